"""write_kv against the reference: exact scatter, padding skipped, other slots kept, in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DTYPES, SEEDS, assert_bits_equal, reference
from jax_kvcm import ops

# (id, num_layers or None, num_pages, page_size, num_kv_heads, head_dim, num_tokens)
WRITE_CASES = [
    ("p8-d64-h2", None, 12, 8, 2, 64, 40),
    ("p16-d128-h1", None, 6, 16, 1, 128, 33),
    ("p32-d256-h2", None, 5, 32, 2, 256, 64),
    ("p128-d64-h4", None, 3, 128, 4, 64, 130),
    ("layers3-p16-d64-h2", 3, 6, 16, 2, 64, 37),
    ("layers2-p64-d128-h1", 2, 3, 64, 1, 128, 70),
    ("p8-d4-h1", None, 4, 8, 1, 4, 20),     # 8- or 16-byte rows: the CUDA kernel's 2-byte copies
    ("p8-d12-h3", None, 4, 8, 3, 12, 21),
]


def _random_caches(rng, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype):
    shape = ((num_layers,) if num_layers else ()) + (num_pages, page_size, num_kv_heads, head_dim)
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))


def _random_slots(rng, num_tokens, num_pages, page_size):
    """Distinct slots on pages >= 1, about a quarter of them padding (various negatives)."""
    num_slots = num_pages * page_size
    slots = rng.choice(np.arange(page_size, num_slots), size=num_tokens, replace=False)
    pad = rng.random(num_tokens) < 0.25
    negatives = rng.choice(np.array([-1, -2, -page_size, -(2**31)], np.int64), size=num_tokens)
    return np.where(pad, negatives, slots).astype(np.int32)


def _expected(cache, rows, slots, layer):
    """numpy scatter: what the cache must hold after the write (negative slots skipped)."""
    want = cache.copy()
    view = want if layer is None else want[layer]
    flat = view.reshape((-1,) + view.shape[-2:])
    keep = slots >= 0
    flat[slots[keep]] = rows[keep]
    return want


def _check_write(backend, dtype, seed, num_layers, num_pages, page_size, num_kv_heads, head_dim,
                 num_tokens, *, slots=None, layer=None, jit=False):
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    kc, vc = _random_caches(rng, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(dtype)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(dtype)
    if slots is None:
        slots = _random_slots(rng, num_tokens, num_pages, page_size)
    if num_layers and layer is None:
        layer = int(rng.integers(num_layers))

    args = backend.put(kc, vc, k, v, slots)
    if jit:
        layer_arg = None if layer is None else jnp.int32(layer)
        k_out, v_out = jax.jit(ops.write_kv)(*args, layer=layer_arg)
    else:
        k_out, v_out = ops.write_kv(*args, layer=layer)
    assert k_out.devices() == {backend.device}
    k_out, v_out = np.asarray(k_out), np.asarray(v_out)

    # Exact: written slots hold the new rows bit for bit, every other slot (and every other layer)
    # keeps its old value (the old random contents are the poison).
    assert_bits_equal(k_out, _expected(kc, k, slots, layer), "k_cache after write_kv", seed)
    assert_bits_equal(v_out, _expected(vc, v, slots, layer), "v_cache after write_kv", seed)
    # Without donation the inputs are not modified.
    assert_bits_equal(np.asarray(args[0]), kc, "k_cache input (not donated)", seed)
    assert_bits_equal(np.asarray(args[1]), vc, "v_cache input (not donated)", seed)
    # And the oracle agrees.
    ref_k, ref_v = reference("write_kv", kc, vc, k, v, slots, layer=layer)
    np.testing.assert_array_equal(k_out.astype(np.float32), ref_k, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(v_out.astype(np.float32), ref_v, err_msg=f"seed={seed}")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", WRITE_CASES, ids=[c[0] for c in WRITE_CASES])
def test_write_kv_matches_reference(backend, case, dtype, seed):
    _check_write(backend, dtype, seed, *case[1:])


@pytest.mark.parametrize("seed", SEEDS)
def test_write_kv_traced_layer_under_jit(backend, seed):
    _check_write(backend, jnp.bfloat16, seed, 4, 5, 16, 2, 64, 21, jit=True)


@pytest.mark.parametrize("num_layers", [None, 2])
def test_write_kv_zero_tokens(backend, num_layers):
    _check_write(backend, jnp.float32, 0, num_layers, 4, 8, 2, 64, 0,
                 slots=np.zeros((0,), np.int32), layer=1 if num_layers else None)


@pytest.mark.parametrize("num_layers", [None, 2])
def test_write_kv_all_padding_changes_nothing(backend, num_layers):
    slots = np.array([-1, -5, -(2**31), -8, -1], np.int32)
    _check_write(backend, jnp.float16, 0, num_layers, 4, 8, 2, 64, 5, slots=slots,
                 layer=0 if num_layers else None)


@pytest.mark.parametrize("seed", SEEDS)
def test_write_kv_fills_every_slot(backend, seed):
    """A permutation of all slots (page 0 included): nothing of the old cache survives."""
    rng = np.random.default_rng(seed)
    slots = rng.permutation(4 * 8).astype(np.int32)
    _check_write(backend, jnp.float32, seed, None, 4, 8, 2, 64, 32, slots=slots)


@pytest.mark.parametrize("num_layers", [None, 3])
def test_write_kv_donated_is_in_place(backend, num_layers):
    """Under jit with donation the outputs are the donated buffers: no copy of the cache."""
    seed = 7
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    num_pages, page_size, hkv, d, t = 6, 16, 2, 128, 24
    kc, vc = _random_caches(rng, num_layers, num_pages, page_size, hkv, d, np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    slots = _random_slots(rng, t, num_pages, page_size)
    layer = 2 if num_layers else None

    step = jax.jit(ops.write_kv, donate_argnums=(0, 1))
    kc_dev, vc_dev, k_dev, v_dev, slots_dev = backend.put(kc, vc, k, v, slots)
    k_ptr, v_ptr = kc_dev.unsafe_buffer_pointer(), vc_dev.unsafe_buffer_pointer()
    layer_arg = None if layer is None else jnp.int32(layer)
    k_out, v_out = step(kc_dev, vc_dev, k_dev, v_dev, slots_dev, layer=layer_arg)
    jax.block_until_ready((k_out, v_out))
    assert k_out.unsafe_buffer_pointer() == k_ptr, "k_cache was copied, not written in place"
    assert v_out.unsafe_buffer_pointer() == v_ptr, "v_cache was copied, not written in place"
    assert kc_dev.is_deleted() and vc_dev.is_deleted(), "donated inputs should be consumed"
    assert_bits_equal(np.asarray(k_out), _expected(kc, k, slots, layer), "k_cache", seed)
    assert_bits_equal(np.asarray(v_out), _expected(vc, v, slots, layer), "v_cache", seed)

    # A second in-place step on the returned buffers: still the same memory.
    k2 = rng.standard_normal((t, hkv, d)).astype(np.float32)
    slots2 = _random_slots(rng, t, num_pages, page_size)
    k2_dev, slots2_dev = backend.put(k2, slots2)
    k_out2, v_out2 = step(k_out, v_out, k2_dev, k2_dev, slots2_dev, layer=layer_arg)
    jax.block_until_ready((k_out2, v_out2))
    assert k_out2.unsafe_buffer_pointer() == k_ptr
    assert v_out2.unsafe_buffer_pointer() == v_ptr
    want_k = _expected(_expected(kc, k, slots, layer), k2, slots2, layer)
    want_v = _expected(_expected(vc, v, slots, layer), k2, slots2, layer)
    assert_bits_equal(np.asarray(k_out2), want_k, "k_cache after 2 steps", seed)
    assert_bits_equal(np.asarray(v_out2), want_v, "v_cache after 2 steps", seed)
