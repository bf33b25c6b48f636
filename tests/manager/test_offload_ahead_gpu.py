"""The side-stream mover of write-back ahead on CUDA (run on the GPU machine with
``pytest -m gpu tests/manager/test_offload_ahead_gpu.py``).

- Tickets: create / query / wait / release through ``_kvcm_cuda``; bad ids answered, not crashed.
- ``StorageManager.offload_ahead`` on one GPU with the concat codec runs its copies on the side
  stream (``SideStreamFence``, the codec's ticket) and moves pages byte-exactly into the pinned
  host tier while a long kernel keeps XLA's stream busy.
- Event ordering (poison and check): pages written by a step dispatched just before the offload
  (after a long kernel, nothing synchronized in between) arrive as the step wrote them, never
  as the poison they held before; the pools kept their addresses (assumption (c) of
  ``jax_kvcm/_storage.py``).
- The manager end to end: a fake model (``test_manager.Harness``, donated ``write_kv`` steps)
  with ``offload_ahead_pages``: every cached value and every prefix hit on offloaded pages is
  byte-exact, the copies used the side stream, and no ticket is left after shutdown.

A GPU test that cannot run (no GPU, no CUDA extension) fails, it never skips. Inputs are fresh
random values (the seed is printed); the oracle is numpy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcm import _ffi
from jax_kvcm.manager import KVCacheManager
from jax_kvcm._storage import LayerGroupSpec, SideStreamFence, StorageConfig, StorageManager
from jax_kvcm._types import CacheLevel

pytestmark = pytest.mark.gpu

D, H = CacheLevel.DEVICE, CacheLevel.HOST
# Llama-8B-like pages, fewer layers: 4 layers x 16 tokens x 8 kv heads x 128 x bf16 = 256 KiB.
SPEC = LayerGroupSpec(num_layers=4, page_size=16, num_kv_heads=8, head_dim=128,
                      dtype=jnp.bfloat16)


def require_gpu() -> jax.Device:
    if jax.default_backend() != "gpu" or not _ffi.cuda_extension_available():
        pytest.fail(f"needs a GPU and the CUDA extension (backend {jax.default_backend()}, "
                    f"{_ffi.CUDA_IMPORT_ERROR})")
    return jax.devices("gpu")[0]


def storage(num_slots: int = 256, host_pages: int = 512) -> StorageManager:
    dev = require_gpu()
    cfg = StorageConfig(layer_groups=(SPEC,), device_slots=(num_slots,),
                        host_bytes=host_pages * SPEC.hot_page_bytes, pinned_host=True)
    m = StorageManager(cfg, device=dev)
    assert m.side_stream, "the concat codec on one GPU must use the side-stream mover"
    return m


def cold_bytes(k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The concat codec's cold pages of hot ``slots`` (numpy oracle): ``[n, cold_page_bytes]``."""
    pages = np.stack([k[:, slots], v[:, slots]], axis=2)  # [L, n, 2, P, H, D]
    pages = np.moveaxis(pages, 1, 0)                      # [n, L, 2, P, H, D]
    return np.ascontiguousarray(pages).view(np.uint8).reshape(len(slots), -1)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def busy_then_write(k, v, x, slots, vals_k, vals_v):
    """A long matmul chain on XLA's stream, then a write of ``vals`` into hot ``slots`` that
    depends on it (so the write lands only after the long kernel)."""
    def body(_, y):
        return jnp.tanh(y @ x) * 0.5
    y = jax.lax.fori_loop(0, 400, body, x)
    zero = (y.sum() * 0).astype(k.dtype)
    k = k.at[:, slots].set(vals_k + zero)
    v = v.at[:, slots].set(vals_v + zero)
    return k, v


def test_tickets_api():
    require_gpu()
    cuda = _ffi._kvcm_cuda
    n0 = cuda.num_tickets()
    t = cuda.ticket_create()
    assert t > 0 and cuda.num_tickets() == n0 + 1
    assert cuda.ticket_query(t) == 0          # no call submitted it yet
    assert cuda.ticket_wait(t) is False
    assert cuda.ticket_query(10**15) == -1    # unknown
    with pytest.raises(ValueError):
        cuda.ticket_wait(10**15)
    cuda.ticket_release(t)
    cuda.ticket_release(t)                    # no-op
    assert cuda.num_tickets() == n0


@pytest.mark.parametrize("seed", [0, 1])
def test_side_stream_offload_is_byte_exact_and_ordered_after_the_step(seed):
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    m = storage()
    cuda = _ffi._kvcm_cuda
    n0 = cuda.num_tickets()
    try:
        slots = m.allocate(D, 0, 96)
        # Poison every hot page, on the device and synchronized.
        k, v = m.pools[0]
        poison = jnp.full(k.shape, jnp.nan, k.dtype)
        m.pools[0] = (poison, poison + 0)
        jax.block_until_ready(m.pools[0])
        ptrs = [a.unsafe_buffer_pointer() for a in m.pools[0]]
        host = m.host_pools[0].view()
        host[:] = 0xA5  # poison the host tier too
        shape = (SPEC.num_layers, len(slots), SPEC.page_size, SPEC.num_kv_heads, SPEC.head_dim)
        want_k = rng.standard_normal(shape).astype(jnp.bfloat16)
        want_v = rng.standard_normal(shape).astype(jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((2048, 2048)).astype(np.float32) / 64)
        # The step: a long kernel, then the writes. Dispatched, not waited for.
        k, v = busy_then_write(*m.pools[0], x, jnp.asarray(slots), jnp.asarray(want_k),
                               jnp.asarray(want_v))
        m.pools[0] = (k, v)
        (dst,), fence = m.offload_ahead([(0, slots)])  # right behind the step
        assert isinstance(fence, SideStreamFence)
        assert m.stats()["num_side_stream_calls"] >= 1
        fence.wait()
        assert [a.unsafe_buffer_pointer() for a in m.pools[0]] == ptrs  # donated, in place
        assert fence.is_ready() and cuda.num_tickets() == n0  # released once done
        got = m.host_pools[0].view()[dst]
        want = cold_bytes(np.asarray(want_k), np.asarray(want_v), np.arange(len(slots)))
        bad = np.flatnonzero((got != want).any(axis=1))
        assert bad.size == 0, f"{bad.size} pages differ (first {bad[:5].tolist()})"
        # The device sources were not released; they still hold the pages.
        assert all(m.allocator(D, 0).is_allocated(int(s)) for s in slots)
        np.testing.assert_array_equal(np.asarray(m.pools[0][0][:, slots]), want_k)
        m.free(D, 0, slots)
    finally:
        m.close()
    assert cuda.num_tickets() == n0


def test_offload_overlaps_a_long_kernel_and_decodes_back():
    """The copies run while a long kernel runs on XLA's stream; decoding the pages back (H->D,
    on XLA's stream) waits for the ticket on the host and restores them byte-exactly."""
    rng = np.random.default_rng(7)
    print("seed=7")
    m = storage()
    try:
        slots = m.allocate(D, 0, 64)
        shape = (SPEC.num_layers, len(slots), SPEC.page_size, SPEC.num_kv_heads, SPEC.head_dim)
        want_k = jnp.asarray(rng.standard_normal(shape).astype(jnp.bfloat16))
        want_v = jnp.asarray(rng.standard_normal(shape).astype(jnp.bfloat16))
        x = jnp.asarray(rng.standard_normal((2048, 2048)).astype(np.float32) / 64)
        m.pools[0] = busy_then_write(*m.pools[0], x, jnp.asarray(slots), want_k, want_v)
        (dst,), fence = m.offload_ahead([(0, slots)])
        long = jax.jit(lambda a: jax.lax.fori_loop(0, 400, lambda _, y: jnp.tanh(y @ a), a))(x)
        back = m.migrate(0, H, dst, D)  # reads the host pages: waits for the copies first
        m.free(D, 0, slots)
        jax.block_until_ready(long)
        assert fence.is_ready()
        np.testing.assert_array_equal(np.asarray(m.pools[0][0][:, back]), np.asarray(want_k))
        np.testing.assert_array_equal(np.asarray(m.pools[0][1][:, back]), np.asarray(want_v))
    finally:
        m.close()


def test_manager_with_write_back_ahead_on_the_gpu():
    from test_manager import Harness, tiny_config
    dev = require_gpu()
    cuda = _ffi._kvcm_cuda
    n0 = cuda.num_tickets()
    cfg = tiny_config(device_pages=24, host_pages=64, offload_ahead_pages=6, max_batch=4,
                      max_tokens=32, max_seq_len=64)
    h = Harness(KVCacheManager(cfg, device=dev))
    assert h.mgr.storage.side_stream
    prompts = [[p * 20 + i + 1 for i in range(13)] for p in range(12)]
    for p in prompts:
        s = h.add(p)
        h.run([(s, 13)], as_ids=[True])
        h.check()
        h.mgr.close(s)
    st = h.mgr.stats()
    assert st["num_offloads_ahead"] > 0 and st["storage"]["num_side_stream_calls"] > 0
    hits = 0
    for p in reversed(prompts):
        s = h.add(p)
        hits += s.num_reused_tokens
        h.run([(s, 13 - s.num_reused_tokens)], as_ids=[True])
        h.check()  # every value read back through the page table, byte-exact
        h.mgr.close(s)
    assert hits > 0 and h.mgr.stats()["num_onboarded_pages"] > 0
    h.mgr.shutdown()
    assert cuda.num_tickets() == n0
