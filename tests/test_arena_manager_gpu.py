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
        return [jitted(k, v, jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(batch.slot_mapping))]

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
        for _ in range(300):  # complete_step checks the pool pointer after every step
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
