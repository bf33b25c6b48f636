"""The arena hot tier on CUDA VMM under the manager (run on the GPU machine: ``pytest -m gpu``).

Checked on the device: the manager's caches are the reservation itself (DLPack, no copy) and
donated jitted steps keep writing it in place (1,000 steps); what a step writes reads back from
the mapped memory and attention over the arena equals the pure-JAX reference; an unmap that
pressure asks for while a long step still reads the range waits for the step (the seed's third
bug: it faulted the GPU); suspend/resume round-trips byte-identical through pinned host memory.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcm
from jax_kvcm import ArenaHot, KVCacheConfig, KVCacheManager, LayerGroupConfig, SuspendResult
from jax_kvcm.ops import reference

pytestmark = pytest.mark.gpu

L, HKV, HQ, DIM, TPP = 2, 8, 16, 128, 16


def gpu_manager(*, device_pages=512, max_seq_len=2048, max_batch=8, host_bytes=0,
                max_sequences=None, adoption=True) -> KVCacheManager:
    lg = LayerGroupConfig(num_layers=L, num_kv_heads=HKV, head_dim=DIM, dtype=jnp.bfloat16)
    cfg = KVCacheConfig(tokens_per_page=TPP, layer_groups=(lg,), device_pages=device_pages,
                        max_seq_len=max_seq_len, max_batch=max_batch, max_tokens_per_step=2048,
                        host_bytes=host_bytes,
                        hot=ArenaHot(max_sequences=max_sequences, adoption=adoption,
                                     backend="cuda"))
    return KVCacheManager(cfg, device=jax.devices("gpu")[0])


@jax.jit
def _kv(seed, positions):
    """Deterministic K/V ``[L, T, Hkv, D]`` for token positions (bf16)."""
    key = jax.random.fold_in(jax.random.PRNGKey(0), seed)
    k = jax.random.normal(key, (L, positions.shape[0], HKV, DIM), jnp.float32)
    return (k + positions[None, :, None, None] * 1e-3).astype(jnp.bfloat16), (-k).astype(
        jnp.bfloat16)


def _step_fn(repeat: int = 1):
    def step(caches, batch, k, v, q):
        (kc, vc), = caches
        out = None
        for layer in range(L):
            kc, vc = jax_kvcm.write_kv(kc, vc, k[layer], v[layer], batch.slot_mapping,
                                       layer=layer)
        for _ in range(repeat):  # a long step, when asked: the same attention many times
            o = jax_kvcm.ragged_paged_attention(q, kc, vc, batch.page_table, batch.seq_lens,
                                                batch.query_start, layer=L - 1)
            out = o if out is None else out + o * 0
        return [(kc, vc)], out
    return jax.jit(step, donate_argnums=(0,))


def dense_copy(mgr, table: np.ndarray):
    """``(k, v, table)``: the pages ``table`` names, read back from the reservation into small
    layer-major arrays, and the table renumbered for them (0 stays the null page)."""
    tier = mgr.storage.hot_tier(0)
    pages = np.unique(table[table > 0])
    remap = np.zeros(int(table.max()) + 1, np.int32)
    remap[pages] = np.arange(1, pages.size + 1)
    shape = (L, TPP, HKV, DIM)
    k = np.zeros((L, pages.size + 1, TPP, HKV, DIM), jnp.bfloat16)
    v = np.zeros_like(k)
    for i, p in enumerate(pages.tolist(), 1):
        kb, vb = tier.memory.read_page(p)
        k[:, i] = kb.view(jnp.bfloat16).reshape(shape)
        v[:, i] = vb.view(jnp.bfloat16).reshape(shape)
    return jnp.asarray(k), jnp.asarray(v), jnp.asarray(remap[table])


def test_steps_write_the_reservation_in_place_and_attention_matches_the_reference():
    mgr = gpu_manager()
    (k0, v0), = mgr.caches
    base = k0.unsafe_buffer_pointer()
    step = _step_fn()
    seqs = [mgr.add_sequence(np.arange(1, 40) + 100 * i) for i in range(4)]
    rng = np.random.default_rng(0)
    written: dict[int, tuple] = {}
    for it in range(1000):
        work = [(s, 39 if s.num_tokens == 0 else 1) for s in seqs]
        batch = mgr.prepare_step(work)
        T = batch.positions.shape[0]
        k, v = _kv(it, jnp.asarray(batch.positions))
        q = jnp.asarray(rng.standard_normal((T, HQ, DIM)), jnp.bfloat16)
        caches, out = step(mgr.caches, batch, k, v, q)
        mgr.complete_step(caches)
        assert caches[0][0].unsafe_buffer_pointer() == base, f"step {it} moved the pool"
        if it in (0, 999):
            written[it] = (batch, k, v, q, out)
    batch, k, v, q, out = written[999]
    # Reference: the same attention over the pages read back from the reservation (a whole-pool
    # op on the arena would touch unmapped memory).
    kc, vc, table = dense_copy(mgr, np.asarray(batch.page_table))
    want = reference.ragged_paged_attention(q, kc, vc, jnp.asarray(table),
                                            jnp.asarray(batch.seq_lens),
                                            jnp.asarray(batch.query_start), layer=L - 1)
    n = batch.num_tokens
    np.testing.assert_allclose(np.asarray(out[:n], np.float32),
                               np.asarray(want[:n], np.float32), rtol=2e-2, atol=2e-2)
    mgr.check_invariants()
    mgr.shutdown()


def test_an_unmap_under_pressure_waits_for_a_step_that_still_reads():
    # 2 MiB chunks of 32 pages; a budget of 5: a's 4 chunks, then b (a fresh range: no
    # adoption) needs 2, which come from a's range while the step still reads it
    mgr = gpu_manager(device_pages=32 * 5, max_seq_len=2048, max_batch=2, max_sequences=3,
                      adoption=False)
    a = mgr.add_sequence(np.arange(1, 2000) % 97 + 1)
    step = _step_fn(repeat=200)                       # hundreds of milliseconds
    batch = mgr.prepare_step([(a, 1999)])
    k, v = _kv(1, jnp.asarray(batch.positions))
    q = jnp.ones((batch.positions.shape[0], HQ, DIM), jnp.bfloat16)
    caches, out = step(mgr.caches, batch, k, v, q)    # dispatched, still running
    mgr.complete_step(caches)
    mgr.close(a)                                      # its pages: cached and pending
    quiesces = mgr.stats()["arena"]["num_quiesces"]
    b = mgr.add_sequence(np.arange(3000, 5040) % 89 + 1)
    t = time.perf_counter()
    mgr.prepare_step([(b, 1024)])                     # needs a's chunks: reclaim -> unmap
    waited = time.perf_counter() - t
    st = mgr.stats()["arena"]
    assert st["num_unmap_calls"] > 0 and st["num_quiesces"] > quiesces, st
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all())  # the step read mapped memory
    print(f"reclaim waited {waited * 1e3:.1f} ms for the running step")
    mgr.abort_step()
    mgr.check_invariants()
    mgr.shutdown()


def test_suspend_and_resume_are_byte_identical_on_the_device():
    mgr = gpu_manager(host_bytes=64 << 20)
    step = _step_fn()
    a = mgr.add_sequence(np.arange(1, 70))
    batch = mgr.prepare_step([(a, 69)])
    k, v = _kv(3, jnp.asarray(batch.positions))
    q = jnp.zeros((batch.positions.shape[0], HQ, DIM), jnp.bfloat16)
    caches, _ = step(mgr.caches, batch, k, v, q)
    mgr.complete_step(caches)
    tier = mgr.storage.hot_tier(0)
    before = [tier.memory.read_page(int(p)) for p in a.page_ids(0)]
    assert mgr.suspend(a) is SuspendResult.SUSPENDED
    assert mgr.resume(a)
    after = [tier.memory.read_page(int(p)) for p in a.page_ids(0)]
    for (kb, vb), (ka, va) in zip(before, after):
        assert np.array_equal(kb, ka) and np.array_equal(vb, va)
    mgr.check_invariants()
    mgr.shutdown()
