"""KVCacheManager with ``hot_backend="arena"`` on CUDA VMM (run on the GPU machine with
``pytest -m gpu tests/test_arena_manager_gpu.py``).

The steps are jitted, donate ``manager.caches`` and write with :func:`jax_kvcm.write_kv` at the
batch's slot mapping; ``complete_step`` refuses pools that are not the reservation, so every step
proves XLA kept the arena's pointer. Content is checked through the attention op against the
pure-JAX reference (on the CPU) over the K/V the test wrote.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcm
from jax_kvcm import _ffi
from jax_kvcm._arena import ArenaConfig
from test_arena_manager import Oracle, prompt

pytestmark = pytest.mark.gpu

L, H, D, TPP = 2, 8, 128, 16
SP = 2 << 20
PPC = SP // (TPP * H * D * 4)   # 32 pages (512 tokens) per chunk in float32
CT = PPC * TPP
MAX_LEN = 4 * CT


def make(*, budget_chunks=24, max_sequences=6):
    if jax.default_backend() != "gpu" or not _ffi.cuda_extension_available():
        pytest.fail(f"needs a GPU and the CUDA extension (backend {jax.default_backend()}, "
                    f"{_ffi.CUDA_IMPORT_ERROR})")
    cfg = jax_kvcm.KVCacheConfig(
        tokens_per_page=TPP,
        layer_groups=(jax_kvcm.LayerGroupConfig(L, H, D, dtype=jnp.float32),),
        host_bytes=1 << 30, max_batch=8, max_tokens_per_step=2 * CT, max_seq_len=MAX_LEN,
        hot_backend="arena",
        arena=ArenaConfig(max_sequences=max_sequences, max_pages_per_sequence=MAX_LEN // TPP,
                          budget_bytes=budget_chunks * 2 * L * SP, super_page_bytes=SP))
    mgr = jax_kvcm.KVCacheManager(cfg)
    assert mgr.arena.backend == "cuda"
    return mgr


def _runner(mgr):
    def step(k, v, kn, vn, slots):
        for layer in range(L):
            k, v = jax_kvcm.write_kv(k, v, kn[layer], vn[layer], slots, layer=layer)
        return k, v

    jitted = jax.jit(step, donate_argnums=(0, 1))

    def run(batch, kn, vn):
        T = kn.shape[1]
        Tb = batch.slot_mapping.shape[-1]
        pad = np.zeros((L, Tb, H, D), np.float32)
        kp, vp = pad.copy(), pad.copy()
        kp[:, :T], vp[:, :T] = kn, vn
        k, v = mgr.caches[0]
        k, v = jitted(k, v, jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(batch.slot_mapping))
        assert k.unsafe_buffer_pointer() == mgr.arena.base_address, "the step copied the pool"
        return [(k, v)]

    return run


def test_donated_steps_through_the_manager_keep_the_arena_and_read_back():
    o = Oracle(21, tol=1e-4)
    mgr = make()
    try:
        run = _runner(mgr)
        seqs = [mgr.add_sequence(prompt(o.rng, n)) for n in (40, CT + 17, 2 * CT)]
        for s in seqs:
            o.step(mgr, [(s, s.num_known_tokens)], run)
        o.check_attention(mgr, seqs)
        before = mgr.stats()["arena"]
        for _ in range(300):  # run() checks the pool pointer after every step
            o.step(mgr, [(s, 1) for s in seqs], run)
        o.check_attention(mgr, seqs)
        after = mgr.stats()["arena"]
        assert after["num_unmap_calls"] == before["num_unmap_calls"] == 0
        # Suspend / resume byte-identical on the device.
        a = seqs[1]
        k0, v0 = mgr.arena.read_pages(mgr._aseq[a.seq_id], 0, a.num_pages)
        assert mgr.suspend(a) is jax_kvcm.SuspendResult.SUSPENDED
        other = mgr.add_sequence(prompt(o.rng, CT))
        o.step(mgr, [(other, CT)], run)
        assert mgr.resume(a)
        k1, v1 = mgr.arena.read_pages(mgr._aseq[a.seq_id], 0, a.num_pages)
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
        o.step(mgr, [(s, 1) for s in seqs + [other]], run)
        o.check_attention(mgr, seqs + [other])
    finally:
        mgr.shutdown()


def test_shared_prefix_cycles_alias_and_map_nothing_in_steady_state():
    o = Oracle(22, tol=1e-4)
    mgr = make()
    try:
        run = _runner(mgr)
        system = o.rng.integers(0, 1000, CT).astype(np.int32)
        owner = mgr.add_sequence(prompt(o.rng, CT + 30, system))
        o.step(mgr, [(owner, CT + 30)], run)
        mgr.close(owner)
        counts = []
        for i in range(20):
            batch = [mgr.add_sequence(prompt(o.rng, CT + 10 + i, system)) for _ in range(3)]
            for s in batch:
                assert s.num_reused_tokens == CT
                o.adopt_prefix(s, owner.seq_id)
            o.step(mgr, [(s, s.num_known_tokens - CT) for s in batch], run)
            for _ in range(5):
                o.step(mgr, [(s, 1) for s in batch], run)
            o.check_attention(mgr, batch)
            for s in batch:
                mgr.close(s)
            a = mgr.stats()["arena"]
            counts.append((a["num_map_calls"], a["num_unmap_calls"], a["mapped_bytes"]))
        assert counts[-1] == counts[2], counts
        assert mgr.stats()["arena"]["num_alias_hits"] == 60
    finally:
        mgr.shutdown()


def test_llama_server_on_the_arena_generates_what_the_paged_server_does(tmp_path):
    """examples/llama/serve.Server end to end on the arena (donated jitted steps, CUDA
    kernels): greedy tokens of a float32 model equal the paged server's, prompts sharing a
    whole chunk alias it."""
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
