"""KVCacheManager with ``hot_backend="arena"`` on CUDA VMM (run on the GPU machine with
``pytest -m gpu tests/test_arena_manager_gpu.py``).

The steps are jitted, donate ``manager.caches`` and write with :func:`jax_kvcm.write_kv` at the
batch's slot mapping; the runner checks after every step that the returned K and V pools still
start at the reservation (XLA kept the arena's pointer: no copy). Content is checked through the
CUDA attention op over the arena against the pure-JAX reference (on the CPU) over the K/V the
test wrote (fresh random values per seed), after poisoning what no table may read: finite poison
in the null page and in the unwritten tail slots of each sequence's last page, NaN in every other
page of the null chunk and of the sequences' private chunks (the conftest convention).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcm
from jax_kvcm import _ffi
from jax_kvcm._arena import ArenaConfig
from jax_kvcm.ops import reference
from test_arena_manager import Oracle, prompt

pytestmark = pytest.mark.gpu

L, H, D, TPP = 2, 8, 128, 16
SP = 2 << 20
PPC = SP // (TPP * H * D * 4)   # 32 pages (512 tokens) per chunk in float32
CT = PPC * TPP
MAX_LEN = 4 * CT
K_POISON, V_POISON = 30.0, -30.0


def make(*, budget_chunks=24, max_sequences=6, host_bytes=1 << 30, **disk):
    if jax.default_backend() != "gpu" or not _ffi.cuda_extension_available():
        pytest.fail(f"needs a GPU and the CUDA extension (backend {jax.default_backend()}, "
                    f"{_ffi.CUDA_IMPORT_ERROR})")
    cfg = jax_kvcm.KVCacheConfig(
        tokens_per_page=TPP,
        layer_groups=(jax_kvcm.LayerGroupConfig(L, H, D, dtype=jnp.float32),),
        host_bytes=host_bytes, **disk, max_batch=8, max_tokens_per_step=2 * CT, max_seq_len=MAX_LEN,
        hot_backend="arena",
        arena=ArenaConfig(max_sequences=max_sequences, max_pages_per_sequence=MAX_LEN // TPP,
                          budget_bytes=budget_chunks * 2 * L * SP, super_page_bytes=SP))
    mgr = jax_kvcm.KVCacheManager(cfg)
    assert mgr.arena.backend == "cuda"
    return mgr


def poison(mgr, seqs) -> None:
    """Poisons every slot the checks must not read (module docstring); waits for the last step
    first (the host writes are synchronous copies)."""
    a = mgr.arena
    jax.block_until_ready(mgr.caches[0])
    sb, ppc = a.layout.slot_bytes, a.pages_per_chunk
    tok = sb // TPP

    def fill(slot: int, first_token: int, num_slots: int, finite: bool) -> None:
        for pl in range(a.num_pool_layers):
            value = (K_POISON if pl < L else V_POISON) if finite else np.nan
            buf = np.full((num_slots * sb - first_token * tok) // 4, value, np.float32)
            a._res.write(pl * a._pool_layer_bytes + slot * sb + first_token * tok,
                         buf.ctypes.data, buf.nbytes)

    fill(0, 0, 1, True)            # the null page: padded table entries read it
    fill(1, 0, ppc - 1, False)     # the rest of the null chunk: nobody's
    for s in seqs:
        aseq = mgr._aseq[s.seq_id]
        n = s.num_tokens
        used = aseq.slots(0, -(-n // TPP)).tolist()
        if n % TPP:
            fill(used[-1], n % TPP, 1, True)
        for i, c in enumerate(aseq._range.chunks):
            if c is None or c.keys or c.refs != 1:
                continue  # unmapped, or shared (a span other sequences read)
            first = (aseq._range.first_chunk + i) * ppc
            for slot in range(first, first + ppc):
                if slot not in used:
                    fill(slot, 0, 1, False)


def check(o, mgr, seqs) -> None:
    poison(mgr, seqs)
    o.check_attention(mgr, seqs)


def _runner(mgr, extra=None):
    """``run(batch, kn, vn)`` for :meth:`Oracle.step`: a jitted step donating the arena pools
    (``extra(k, v, batch)``, when given, also runs inside it; its output is kept in
    ``run.out``)."""
    def step(k, v, kn, vn, batch):
        for layer in range(L):
            k, v = jax_kvcm.write_kv(k, v, kn[layer], vn[layer], batch.slot_mapping,
                                     layer=layer)
        return k, v, (None if extra is None else extra(k, v, batch))

    jitted = jax.jit(step, donate_argnums=(0, 1))

    def run(batch, kn, vn):
        T = kn.shape[1]
        Tb = batch.slot_mapping.shape[-1]
        pad = np.zeros((L, Tb, H, D), np.float32)
        kp, vp = pad.copy(), pad.copy()
        kp[:, :T], vp[:, :T] = kn, vn
        k, v = mgr.caches[0]
        k, v, run.out = jitted(k, v, jnp.asarray(kp), jnp.asarray(vp), batch)
        assert k.unsafe_buffer_pointer() == mgr.arena.base_address, "the step copied the pool"
        assert v.unsafe_buffer_pointer() == mgr.arena.base_address + v.nbytes, "V was copied"
        return [(k, v)]

    run.out = None
    return run


def test_donated_steps_through_the_manager_keep_the_arena_and_read_back():
    o = Oracle(21, tol=1e-4)
    mgr = make()
    try:
        run = _runner(mgr)
        seqs = [mgr.add_sequence(prompt(o.rng, n)) for n in (40, CT + 17, 2 * CT)]
        for s in seqs:
            o.step(mgr, [(s, s.num_known_tokens)], run)
        check(o, mgr, seqs)
        before = mgr.stats()["arena"]
        for i in range(1000):  # run() checks both pool pointers after every step
            o.step(mgr, [(s, 1) for s in seqs], run)
            if i % 250 == 0:
                check(o, mgr, seqs)
        check(o, mgr, seqs)
        assert mgr.stats()["num_steps"] >= 1003
        after = mgr.stats()["arena"]
        assert after["num_unmap_calls"] == before["num_unmap_calls"] == 0
        # Suspend / resume byte-identical on the device.
        other = o.suspend_resume_round_trip(mgr, seqs, run, CT)
        check(o, mgr, seqs + [other])
    finally:
        mgr.shutdown()


def test_suspend_to_host_then_disk_and_back_through_the_ops(tmp_path):
    """The host holds one sequence: the second suspend goes to disk (the storage transaction,
    through the pinned staging ring); both resume byte-identical into fresh ranges and read
    back through the CUDA op after more donated steps."""
    o = Oracle(27, tol=1e-4)
    page = 2 * L * TPP * H * D * 4
    mgr = make(host_bytes=PPC * page, disk_dir=str(tmp_path), disk_bytes=8 * PPC * page)
    try:
        run = _runner(mgr)
        seqs = [mgr.add_sequence(prompt(o.rng, n)) for n in (CT - 5, CT - 9, 40)]
        for s in seqs:  # one prompt a step: together they exceed max_tokens_per_step (2 * CT)
            o.step(mgr, [(s, s.num_known_tokens)], run)
        saved = [mgr.arena.read_pages(mgr._aseq[s.seq_id], 0, s.num_pages) for s in seqs[:2]]
        levels = []
        mgr.add_observer(lambda e: levels.append(e.level) if e.kind == "suspended" else None)
        for s in seqs[:2]:
            assert mgr.suspend(s) is jax_kvcm.SuspendResult.SUSPENDED
        assert levels == [jax_kvcm.CacheLevel.HOST, jax_kvcm.CacheLevel.DISK]
        o.step(mgr, [(seqs[2], 1)], run)
        for s, (k0, v0) in zip(seqs[:2], saved):
            assert mgr.resume(s)
            k1, v1 = mgr.arena.read_pages(mgr._aseq[s.seq_id], 0, s.num_pages)
            np.testing.assert_array_equal(k0, k1)
            np.testing.assert_array_equal(v0, v1)
        for _ in range(3):
            o.step(mgr, [(s, 1) for s in seqs], run)
        check(o, mgr, seqs)
    finally:
        mgr.shutdown()


@pytest.mark.parametrize("sys_len", [CT, CT // 2 + 3 * TPP], ids=["chunk", "partial"])
def test_shared_prefix_cycles_alias_and_map_nothing_in_steady_state(sys_len):
    """A system prompt of a whole chunk, or of part of one (a partial alias: the sequences'
    own pages continue at their next chunk), shared by 60 sequences, 3 at a time."""
    o = Oracle(22, tol=1e-4)
    mgr = make()
    try:
        run = _runner(mgr)
        system = o.rng.integers(0, 1000, sys_len).astype(np.int32)
        owner = mgr.add_sequence(prompt(o.rng, CT + 30, system))
        o.step(mgr, [(owner, CT + 30)], run)
        mgr.close(owner)
        counts = []
        for i in range(20):
            batch = [mgr.add_sequence(prompt(o.rng, CT + 10 + i, system)) for _ in range(3)]
            for s in batch:
                assert s.num_reused_tokens == sys_len  # page aligned
                o.adopt_prefix(s, owner.seq_id)
            o.step(mgr, [(s, s.num_known_tokens - sys_len) for s in batch], run)
            for _ in range(5):
                o.step(mgr, [(s, 1) for s in batch], run)
            check(o, mgr, batch)
            for s in batch:
                mgr.close(s)
            a = mgr.stats()["arena"]
            counts.append((a["num_map_calls"], a["num_unmap_calls"], a["mapped_bytes"]))
        assert counts[-1] == counts[2], counts
        a = mgr.stats()["arena"]
        assert a["num_alias_hits"] == 60
        assert a["num_partial_aliases"] == (60 if sys_len % CT else 0)
    finally:
        mgr.shutdown()


def test_unmap_under_pressure_waits_for_a_step_still_reading():
    """A step that writes a sequence and then reads it for a long time (a loop of attention
    kernels inside the same jitted step) is dispatched; the sequence is closed and another one
    needs its chunk under a full budget: the range is unmapped only after the step completes
    (a blocking drain), and the step's reads equal the reference."""
    o = Oracle(24, tol=1e-4)
    mgr = make(budget_chunks=2, max_sequences=2)  # the null chunk + one sequence chunk
    try:
        B, Hq = 4, 2 * H

        def long_read(k, v, batch):
            table = jnp.tile(batch.page_table[:1], (B, 1))
            lens = jnp.tile(batch.seq_lens[:1], (B,))
            q = jnp.ones((B, Hq, D), jnp.float32) * 0.01

            def body(i, acc):
                return jnp.maximum(acc, jax_kvcm.paged_attention(q + i * 0.0, k, v, table, lens,
                                                                 layer=1))
            return jax.lax.fori_loop(0, 20000, body, jnp.full(q.shape, -jnp.inf, jnp.float32))

        run = _runner(mgr, long_read)  # NOTE: compiled at its first call, before dispatch
        s = mgr.add_sequence(prompt(o.rng, CT))
        u = mgr.add_sequence(prompt(o.rng, 10))  # its own (fresh) range
        o.step(mgr, [(s, CT)], run)  # s maps the one chunk the budget has
        fence = mgr.caches[0][0]
        mgr.close(s)  # parked; the step may still be reading it
        still_running = not fence.is_ready()
        drains = mgr.stats()["arena"]["num_blocking_drains"]
        mgr.prepare_step([(u, 10)])  # needs a chunk: unmaps s's range, after the step
        assert still_running, "the step finished before the unmap was requested: lengthen it"
        assert mgr.stats()["arena"]["num_blocking_drains"] == drains + 1
        assert run.out.is_ready()
        mgr.abort_step()
        kv = np.stack(o.kv[s.seq_id], axis=2)  # [2, L, CT, H, D]
        dense = np.zeros((2, L, 1 + PPC, TPP, H, D), np.float32)
        dense[:, :, 1:] = kv.reshape(2, L, PPC, TPP, H, D)
        with jax.default_device(jax.devices("cpu")[0]):
            want = reference.paged_attention(
                jnp.ones((B, 2 * H, D), jnp.float32) * 0.01, jnp.asarray(dense[0]),
                jnp.asarray(dense[1]), jnp.tile(jnp.arange(1, PPC + 1, dtype=jnp.int32), (B, 1)),
                jnp.full((B,), CT, jnp.int32), layer=1)
        np.testing.assert_allclose(np.asarray(run.out), np.asarray(want), rtol=1e-4, atol=1e-4)
    finally:
        mgr.shutdown()


def test_llama_server_on_the_arena_generates_what_the_paged_server_does(tmp_path):
    """examples/llama/serve.Server end to end on the arena (donated jitted steps, CUDA
    kernels): greedy tokens of a float32 model equal the paged server's, prompts sharing a
    whole chunk alias it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: examples/
    from conftest import random_hf_llama
    from examples.llama import loader as llama_loader
    from examples.llama import serve

    if jax.default_backend() != "gpu" or not _ffi.cuda_extension_available():
        pytest.fail("needs a GPU and the CUDA extension")
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_theta=10000.0)
    random_hf_llama("llama", base, 5).save_pretrained(tmp_path, safe_serialization=True)
    config, params, _ = llama_loader.load_checkpoint(tmp_path, dtype="float32", progress=False)
    page = 16
    slot = page * 2 * 32 * 4                     # 2 KV heads of 32 dims, float32
    ppc = SP // slot                             # 512 pages = 8,192 tokens per chunk
    max_len = ppc * page + 256
    rng = np.random.default_rng(23)
    system = [1] + rng.integers(3, 128, ppc * page).tolist()
    reqs = [serve.Request(prompt=system + rng.integers(3, 128, 20 + i).tolist(),
                          max_new_tokens=12, eos_token_ids=[]) for i in range(4)]
    reqs += [serve.Request(prompt=[1] + rng.integers(3, 128, 30).tolist(), max_new_tokens=12,
                           eos_token_ids=[])]
    common = dict(page_size=page, max_batch=4, max_tokens_per_step=1024,
                  prefill_chunk_tokens=1024, max_seq_len=max_len)
    outs = {}
    for hb in ("paged", "arena"):
        arena = (ArenaConfig(max_sequences=4, max_pages_per_sequence=-(-max_len // page),
                             budget_bytes=12 * 2 * 2 * SP, super_page_bytes=SP)
                 if hb == "arena" else None)
        srv = serve.Server(params, config, serve.ServeConfig(
            device_pages=4 * (-(-max_len // page)), hot_backend=hb, arena=arena, **common))
        srv.generate(reqs[:1])   # the system prompt's chunk committed
        outs[hb] = [o.generated_ids for o in srv.generate(reqs)]
        if hb == "arena":
            st = srv.manager.stats()["arena"]
            assert st["num_alias_hits"] >= 4, st
            srv.manager.shutdown()
    same = sum(a == b for a, b in zip(outs["paged"], outs["arena"]))
    assert same >= len(reqs) - 1, (outs["paged"], outs["arena"])
