"""Cold-page codecs: byte layouts, round trips, the int8 error bound, configuration and ownership.

The cold tier in these tests is host memory ("host": an aligned numpy buffer on CPU, as the host
tier of CPU builds; mapped pinned memory from the CUDA extension's PinnedHostBuffer on GPU, as the
host tier of CUDA builds), device memory ("device": a uint8 jax array on the backend's device), or
pageable numpy memory ("pageable", concat only: the GPU reaches it only by DMA). Cold bytes are
read back and compared with the documented layouts computed here with numpy.

Round trips run on the ``backend`` fixture (cpu, and gpu marked ``gpu``: it fails without a GPU).
For the concat codec (HOST index location) every call registers the host copy of its pairs first,
as the storage manager does; on CPU that is a no-op.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (BF16, DTYPES, F16, F32, assert_bits_equal, forget_failed_runtime_tokens,
                      runtime_error_types)
from jax_kvcm import _codec, _ffi
from jax_kvcm._codec import (ColdPageCodec, ConcatCodec, HotPoolGroupDesc, Int8Codec,
                             PageIndexLocation, create_default_cold_page_codec,
                             make_cold_page_codec)

# (id, num_layers, num_slots, page_size, num_kv_heads, head_dim)
LAYOUTS = [
    ("L1-P16-H2-D64", 1, 9, 16, 2, 64),
    ("L3-P8-H1-D128", 3, 7, 8, 1, 128),
    ("L2-P4-H4-D16", 2, 12, 4, 4, 16),
    ("L4-P2-H3-D24", 4, 6, 2, 3, 24),  # D % 16 != 0: the CUDA int8 kernels' scalar path
    ("L1-P3-H1-D5", 1, 5, 3, 1, 5),  # odd sizes: int8 padding bytes on both sides of the scales
]
LAYOUT_IDS = [c[0] for c in LAYOUTS]
SEEDS = [0, 1]

FP8 = jnp.dtype(jnp.float8_e4m3fn)
# The concat codec moves fp8 pages as they are (their scales live outside the pages).
CONCAT_DTYPES = DTYPES + [pytest.param(FP8, id="fp8")]

UNIT_ROUNDOFF = {F32: 2.0**-24, BF16: 2.0**-8, F16: 2.0**-11}
HALF_MIN_SUBNORMAL = {F32: 2.0**-150, BF16: 2.0**-134, F16: 2.0**-25}


# ---------------------------------------------------------------------------------------------
# Helpers.


def _desc(layout, dtype, index=0, layer_groups=(0,)) -> HotPoolGroupDesc:
    _, num_layers, num_slots, page_size, num_kv_heads, head_dim = layout
    return HotPoolGroupDesc(index=index, layer_groups=tuple(layer_groups), num_layers=num_layers,
                            num_slots=num_slots, page_size=page_size, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, dtype=dtype)


def _configured(name: str, *descs: HotPoolGroupDesc) -> ColdPageCodec:
    codec = make_cold_page_codec(name)
    assert codec.configure(list(descs)), codec.configure_error
    return codec


def _random_pools(rng, desc: HotPoolGroupDesc) -> tuple[np.ndarray, np.ndarray]:
    """Normal values with a per-(layer, slot, head) magnitude spread of 10^-3..10^3."""
    shape = desc.pool_shape
    spread = 10.0 ** rng.uniform(-3, 3, size=(shape[0], shape[1], 1, shape[3], 1))
    k = (rng.standard_normal(shape) * spread).astype(desc.dtype)
    v = (rng.standard_normal(shape) * spread).astype(desc.dtype)
    return k, v


class ColdTier:
    """A cold tier of ``num_slots`` pages of ``page_bytes``, filled with random garbage.

    kind "host": on CPU a 64-byte aligned numpy buffer; on GPU a PinnedHostBuffer (mapped pinned
    memory; the codec gets its device address). "pageable": an aligned numpy buffer on every
    backend. "device": a uint8 jax array on the backend's device (its buffer is written behind
    XLA's back by the codec and read by copying it).
    """

    def __init__(self, backend, kind: str, num_slots: int, page_bytes: int, rng) -> None:
        self.kind, self.num_slots, self.page_bytes = kind, num_slots, page_bytes
        nbytes = num_slots * page_bytes
        garbage = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        if kind == "host" and backend.name == "gpu":
            backend.device  # noqa: B018  (fails the test when the GPU backend cannot run)
            pinned_cls = getattr(_ffi._kvcm_cuda, "PinnedHostBuffer", None)
            if pinned_cls is None:
                pytest.fail("the CUDA extension has no PinnedHostBuffer (host tier) to test with")
            self._pinned = pinned_cls(nbytes)
            self._buf = self._pinned.view()
            self._buf[:] = garbage
            self.address = self._pinned.device_address
        elif kind in ("host", "pageable"):
            raw = np.empty(nbytes + 64, np.uint8)
            offset = (-raw.ctypes.data) % 64
            self._buf = raw[offset:offset + nbytes]
            self._buf[:] = garbage
            self.address = self._buf.ctypes.data
        else:
            self._arr = backend.put(garbage)
            self._arr.block_until_ready()  # the codec is not ordered after this transfer
            self.address = self._arr.unsafe_buffer_pointer()
        assert self.address % 16 == 0

    def read(self) -> np.ndarray:
        """A copy of the tier's bytes, ``[num_slots, page_bytes]``."""
        if self.kind != "device":
            data = self._buf.copy()
        else:
            # NOTE: a fresh computed copy each time: np.asarray(self._arr) would cache its value.
            data = np.asarray(jax.jit(lambda x: x + jnp.uint8(0))(self._arr))
        return data.reshape(self.num_slots, self.page_bytes)


def _with_pairs(codec: ColdPageCodec, backend, pairs_np: np.ndarray, fn):
    """Runs ``fn(pairs_device)`` with the host copy registered (HOST location on CUDA)."""
    pairs = backend.put(np.ascontiguousarray(pairs_np, np.int32).reshape(-1, 2))
    codec.register_host_index_pairs(pairs, pairs_np)
    try:
        out = fn(pairs)
        jax.block_until_ready(out)
        return out
    finally:
        codec.unregister_host_index_pairs(pairs)


def _encode(codec, backend, lg, k, v, pairs_np, address, **kw) -> jax.Array:
    fn = jax.jit(lambda k, v, p: codec.encode(lg, k, v, p, address, **kw))
    return _with_pairs(codec, backend, pairs_np, lambda p: fn(k, v, p))


def _decode(codec, backend, lg, k, v, pairs_np, address, *, donate=True, **kw):
    fn = jax.jit(lambda k, v, p: codec.decode(lg, k, v, p, address, **kw),
                 donate_argnums=(0, 1) if donate else ())
    return _with_pairs(codec, backend, pairs_np, lambda p: fn(k, v, p))


def _distinct(rng, n: int, low: int, high: int) -> np.ndarray:
    return rng.choice(np.arange(low, high), size=n, replace=False).astype(np.int32)


def _with_repeat(pairs: np.ndarray) -> np.ndarray:
    """The storage manager pads a batch by repeating its last pair: the codecs must accept it."""
    return np.concatenate([pairs, pairs[-1:], pairs[-1:]])


# --- documented layouts, in numpy ----------------------------------------------------------------


def concat_page(k: np.ndarray, v: np.ndarray, slot: int) -> np.ndarray:
    """ConcatCodec cold page: for each layer, K piece bytes then V piece bytes."""
    return np.ascontiguousarray(np.stack([k[:, slot], v[:, slot]], axis=1)).view(np.uint8).ravel()


def int8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """One block [P, D] -> (int8 payload, float32 scale), float32 arithmetic as documented."""
    x = x.astype(np.float32)
    amax = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
    scale = np.float32(amax / np.float32(127))
    if not scale > 0:
        scale = np.float32(1)
    q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    return q, scale


def int8_page(k: np.ndarray, v: np.ndarray, slot: int) -> np.ndarray:
    """Int8Codec cold page: payload blocks (l, kv, h) of int8 [P, D], then float32 scales."""
    L, _, P, H, D = k.shape
    scales_offset, scales_end, page_bytes = _codec.int8_cold_page_layout(L, P, H, D)
    page = np.zeros(page_bytes, np.uint8)
    scales = np.zeros(2 * L * H, np.float32)
    for l in range(L):
        for kv, pool in enumerate((k, v)):
            for h in range(H):
                b = (2 * l + kv) * H + h
                q, s = int8_quantize(pool[l, slot, :, h, :])
                page[b * P * D:(b + 1) * P * D] = q.view(np.uint8).ravel()
                scales[b] = s
    page[scales_offset:scales_end] = scales.astype("<f4").view(np.uint8)
    return page


def int8_dequantize(page: np.ndarray, shape, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decodes one int8 cold page as documented: (k [L, P, H, D], v, scales [L, 2, H])."""
    L, P, H, D = shape
    scales_offset, scales_end, _ = _codec.int8_cold_page_layout(L, P, H, D)
    q = page[:2 * L * H * P * D].view(np.int8).reshape(L, 2, H, P, D)
    s = page[scales_offset:scales_end].view("<f4").reshape(L, 2, H)
    big = np.finfo(np.float32).max
    with np.errstate(over="ignore"):
        y32 = np.clip(q.astype(np.float32) * s[..., None, None], -big, big)
    y = y32.astype(dtype)  # [L, 2, H, P, D]
    y = y.transpose(0, 1, 3, 2, 4)  # [L, 2, P, H, D]
    return y[:, 0], y[:, 1], s


# ---------------------------------------------------------------------------------------------
# ConcatCodec: byte-exact round trips.


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tier_kind", ["host", "device"])
@pytest.mark.parametrize("dtype", CONCAT_DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_concat_round_trip_is_byte_exact(backend, layout, dtype, tier_kind, seed):
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    desc = _desc(layout, dtype, layer_groups=(0, 1))
    codec = _configured("concat", desc)
    num_slots, page_bytes = desc.num_slots, codec.cold_page_bytes(1)
    assert page_bytes == desc.hot_page_bytes
    k, v = _random_pools(rng, desc)
    num_cold = num_slots + 3
    tier = ColdTier(backend, tier_kind, num_cold, page_bytes, rng)
    before = tier.read()

    # hot -> cold: a random page set (slot 0 included sometimes) into random cold slots.
    n = int(rng.integers(1, num_slots))
    src = _distinct(rng, n, 0, num_slots)
    dst = _distinct(rng, n, 0, num_cold)
    k_dev, v_dev = backend.put(k, v)
    token = _encode(codec, backend, 1, k_dev, v_dev, _with_repeat(np.stack([dst, src], 1)),
                    tier.address, num_cold_slots=num_cold)
    assert token.shape == (1,) and token.dtype == jnp.int32
    cold = tier.read()
    want = before.copy()
    for d, s in zip(dst, src):
        want[d] = concat_page(k, v, s)
    assert_bits_equal(cold, want, "cold tier after concat encode", seed)

    # cold -> hot: into different slots of other pools, in place; other slots untouched.
    k2, v2 = _random_pools(rng, desc)
    hot_dst = _distinct(rng, n, 0, num_slots)
    k2_dev, v2_dev = backend.put(k2, v2)
    k_ptr, v_ptr = k2_dev.unsafe_buffer_pointer(), v2_dev.unsafe_buffer_pointer()
    k_out, v_out = _decode(codec, backend, 0, k2_dev, v2_dev,
                           _with_repeat(np.stack([hot_dst, dst], 1)), tier.address)
    assert k_out.unsafe_buffer_pointer() == k_ptr, "k_pool was copied, not decoded in place"
    assert v_out.unsafe_buffer_pointer() == v_ptr, "v_pool was copied, not decoded in place"
    want_k, want_v = k2.copy(), v2.copy()
    want_k[:, hot_dst], want_v[:, hot_dst] = k[:, src], v[:, src]
    assert_bits_equal(np.asarray(k_out), want_k, "k_pool after concat decode", seed)
    assert_bits_equal(np.asarray(v_out), want_v, "v_pool after concat decode", seed)
    assert_bits_equal(tier.read(), cold, "cold tier after decode (read only)", seed)


@pytest.mark.parametrize("tier_kind", ["host", "pageable", "device"])
@pytest.mark.parametrize("mover", ["auto", "memcpy-batch", "memcpy-each"])
def test_concat_round_trip_copy_paths(backend, mover, tier_kind):
    """Every CUDA data mover: the copy kernel (auto, whenever the cold tier is device-accessible:
    mapped pinned host or device memory), one cuMemcpyBatchAsync (``copy="memcpy"``, and auto for
    pageable host memory, which the GPU reaches only by DMA), and one cudaMemcpyAsync per piece
    (also ``memcpy_batch=False``, the path for drivers before 12.8). The CPU handler ignores both
    options."""
    options = dict(copy="auto" if mover == "auto" else "memcpy",
                   memcpy_batch=mover != "memcpy-each")
    calls_before = _codec._index_registry().concat_mover_calls() if backend.name == "gpu" else None
    rng = np.random.default_rng(5)
    desc = _desc(LAYOUTS[1], BF16)
    codec = make_cold_page_codec("concat", **options)
    assert codec.configure([desc]), codec.configure_error
    k, v = _random_pools(rng, desc)
    tier = ColdTier(backend, tier_kind, 8, codec.cold_page_bytes(0), rng)
    src, dst = np.array([3, 1, 6], np.int32), np.array([7, 0, 2], np.int32)
    _encode(codec, backend, 0, *backend.put(k, v), np.stack([dst, src], 1), tier.address)
    cold = tier.read()
    for d, s in zip(dst, src):
        assert_bits_equal(cold[d], concat_page(k, v, s), f"cold page {d}", 5)
    k_out, v_out = _decode(codec, backend, 0, *backend.put(np.zeros_like(k), np.zeros_like(v)),
                           np.stack([src, dst], 1), tier.address)
    want_k, want_v = np.zeros_like(k), np.zeros_like(v)
    want_k[:, src], want_v[:, src] = k[:, src], v[:, src]
    assert_bits_equal(np.asarray(k_out), want_k, "k_pool", 5)
    assert_bits_equal(np.asarray(v_out), want_v, "v_pool", 5)
    if calls_before is not None:  # the mover this configuration must take, twice (enc + dec)
        kernel, memcpy = np.subtract(_codec._index_registry().concat_mover_calls(), calls_before)
        want_kernel = mover == "auto" and tier_kind != "pageable"
        assert (kernel, memcpy) == ((2, 0) if want_kernel else (0, 2)), (mover, tier_kind)


# ---------------------------------------------------------------------------------------------
# Int8Codec: exact bytes vs the documented float32 arithmetic, and the stated error bound.


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tier_kind", ["host", "device"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_int8_round_trip_within_stated_bound(backend, layout, dtype, tier_kind, seed):
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    desc = _desc(layout, dtype, layer_groups=(2,))
    codec = _configured("int8", desc)
    L, S, P, H, D = desc.pool_shape
    page_bytes = codec.cold_page_bytes(2)
    assert page_bytes % 16 == 0 and page_bytes == _codec.int8_cold_page_layout(L, P, H, D)[2]
    k, v = _random_pools(rng, desc)
    k[0, 1, :, 0, :] = 0  # an all-zero block: scale 1, exact zeros
    tier = ColdTier(backend, tier_kind, S + 2, page_bytes, rng)
    before = tier.read()

    src = np.arange(S, dtype=np.int32)
    dst = _distinct(rng, S, 0, S + 2)
    _encode(codec, backend, 2, *backend.put(k, v), _with_repeat(np.stack([dst, src], 1)),
            tier.address, num_cold_slots=S + 2)
    cold = tier.read()
    want = before.copy()
    for d, s in zip(dst, src):
        want[d] = int8_page(k, v, s)
    assert_bits_equal(cold, want, "cold tier after int8 encode", seed)

    # Decode every page back into a permuted slot of fresh pools, in place.
    hot_dst = rng.permutation(S).astype(np.int32)
    k_dev, v_dev = backend.put(np.full_like(k, 7), np.full_like(v, 7))
    k_ptr = k_dev.unsafe_buffer_pointer()
    k_out, v_out = _decode(codec, backend, 2, k_dev, v_dev, np.stack([hot_dst, dst], 1),
                           tier.address)
    assert k_out.unsafe_buffer_pointer() == k_ptr, "k_pool was copied, not decoded in place"
    k_out, v_out = np.asarray(k_out), np.asarray(v_out)

    u, t = UNIT_ROUNDOFF[jnp.dtype(dtype)], HALF_MIN_SUBNORMAL[jnp.dtype(dtype)]
    worst = 0.0
    for hd, d, s in zip(hot_dst, dst, src):
        yk, yv, scales = int8_dequantize(cold[d], (L, P, H, D), dtype)
        # Bit-exact against the documented arithmetic ...
        assert_bits_equal(k_out[:, hd], yk, f"k page {s} decoded", seed)
        assert_bits_equal(v_out[:, hd], yv, f"v page {s} decoded", seed)
        # ... and within the stated bound of the float64 original.
        for kv, (x, y) in enumerate(((k[:, s], k_out[:, hd]), (v[:, s], v_out[:, hd]))):
            x64 = x.astype(np.float64)
            y64 = y.astype(np.float64)
            scale = scales[:, kv].astype(np.float64)[:, None, :, None]  # [L, 1, H, 1]
            err = np.abs(x64 - y64)
            bound = scale / 2 * (1 + 2.0**-7) + u * np.abs(y64) + t
            bad = err > bound
            assert not bad.any(), (
                f"int8 error above the stated bound at {np.argwhere(bad)[0].tolist()}: "
                f"err={err[bad][0]:.6g} bound={np.broadcast_to(bound, err.shape)[bad][0]:.6g} "
                f"(page {s}, seed={seed})")
            worst = max(worst, float((err / np.broadcast_to(scale, err.shape)).max()))
            if s == 1 and kv == 0:
                assert not y64[0, :, 0, :].any() and scales[0, 0, 0] == 1.0, "zero block"
    # The bound is tight enough to matter: errors of about scale / 2 do occur.
    assert worst > 0.3, f"largest error / scale = {worst} (seed={seed})"
    # Slots nobody decoded into keep their contents (here: none left; every slot was decoded).
    assert_bits_equal(tier.read(), cold, "cold tier after decode (read only)", seed)


@pytest.mark.parametrize("tier_kind", ["host", "device"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_extreme_blocks(backend, dtype, tier_kind):
    """Largest finite values do not overflow; tiny blocks stay within 2 * amax; zeros stay 0."""
    finfo = jnp.finfo(dtype)
    desc = HotPoolGroupDesc(0, (0,), 1, 4, 2, 2, 16, dtype)
    codec = _configured("int8", desc)
    k = np.zeros(desc.pool_shape, np.float32)
    k[0, 0, :, 0] = float(finfo.max)
    k[0, 0, 1, 0, 3] = -float(finfo.max)
    k[0, 1, :, 0] = float(finfo.tiny) * np.linspace(-1, 1, 16)  # tiny: subnormal or zero scale
    k[0, 2, 0, 1, 0] = float(finfo.smallest_subnormal)
    k = k.astype(dtype)
    v = -k
    rng = np.random.default_rng(0)
    tier = ColdTier(backend, tier_kind, 4, codec.cold_page_bytes(0),
                    rng)
    pairs = np.array([[0, 0], [1, 1], [2, 2], [3, 3]], np.int32)
    _encode(codec, backend, 0, *backend.put(k, v), pairs, tier.address)
    cold = tier.read()
    for s in range(4):
        assert_bits_equal(cold[s], int8_page(k, v, s), f"cold page {s}", 0)
    k_out, v_out = _decode(codec, backend, 0, *backend.put(np.ones_like(k), np.ones_like(v)),
                           pairs, tier.address)
    for x, y in ((k, np.asarray(k_out)), (v, np.asarray(v_out))):
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        assert np.isfinite(y64).all()
        assert y64[0, 0, 0, 0, 0] == x64[0, 0, 0, 0, 0]  # amax itself is exact
        amax = np.abs(x64).max(axis=(2, 4), keepdims=True)
        assert (np.abs(x64 - y64)[:, 1:] <= 2 * amax[:, 1:]).all()
        assert not y64[:, 3].any()


# ---------------------------------------------------------------------------------------------
# Both codecs: in-place decode, untouched slots, empty batches.


@pytest.mark.parametrize("name", ["concat", "int8"])
def test_decode_is_in_place_and_keeps_other_slots(backend, name):
    rng = np.random.default_rng(3)
    desc = _desc(LAYOUTS[2], F32)
    codec = _configured(name, desc)
    k, v = _random_pools(rng, desc)
    tier = ColdTier(backend, "host", 4, codec.cold_page_bytes(0), rng)
    _encode(codec, backend, 0, *backend.put(k, v), np.array([[0, 5], [3, 9]], np.int32),
            tier.address)

    k2, v2 = _random_pools(rng, desc)
    k_dev, v_dev = backend.put(k2, v2)
    k_ptr, v_ptr = k_dev.unsafe_buffer_pointer(), v_dev.unsafe_buffer_pointer()
    k_out, v_out = _decode(codec, backend, 0, k_dev, v_dev, np.array([[1, 3]], np.int32),
                           tier.address)
    assert k_dev.is_deleted() and v_dev.is_deleted(), "donated pools should be consumed"
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == (k_ptr, v_ptr)
    # A second in-place decode on the returned buffers: still the same memory.
    k_out, v_out = _decode(codec, backend, 0, k_out, v_out, np.array([[7, 0]], np.int32),
                           tier.address)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == (k_ptr, v_ptr)
    k_out, v_out = np.asarray(k_out), np.asarray(v_out)
    others = np.setdiff1d(np.arange(desc.num_slots), [1, 7])
    assert_bits_equal(k_out[:, others], k2[:, others], "k_pool slots not decoded into", 3)
    assert_bits_equal(v_out[:, others], v2[:, others], "v_pool slots not decoded into", 3)
    cold = tier.read()
    for hot, c, s in ((1, 3, 9), (7, 0, 5)):
        if name == "concat":
            assert_bits_equal(cold[c], concat_page(k, v, s), f"cold page {c}", 3)
            want_k, want_v = k[:, s], v[:, s]
        else:
            want_k, want_v, _ = int8_dequantize(cold[c], (2, 4, 4, 16), F32)
        assert_bits_equal(k_out[:, hot], want_k, f"k_pool slot {hot}", 3)
        assert_bits_equal(v_out[:, hot], want_v, f"v_pool slot {hot}", 3)


@pytest.mark.parametrize("name", ["concat", "int8"])
def test_decode_without_donation_leaves_inputs(backend, name):
    rng = np.random.default_rng(4)
    desc = _desc(LAYOUTS[0], BF16)
    codec = _configured(name, desc)
    k, v = _random_pools(rng, desc)
    tier = ColdTier(backend, "host", 2, codec.cold_page_bytes(0), rng)
    _encode(codec, backend, 0, *backend.put(k, v), np.array([[1, 2]], np.int32), tier.address)
    k_dev, v_dev = backend.put(np.zeros_like(k), np.zeros_like(v))
    k_out, _ = _decode(codec, backend, 0, k_dev, v_dev, np.array([[4, 1]], np.int32),
                       tier.address, donate=False)
    assert not np.asarray(k_dev).any(), "a non-donated input must not change"
    assert np.asarray(k_out)[:, 4].astype(np.float32).any()


@pytest.mark.parametrize("name", ["concat", "int8"])
def test_empty_index_pairs_do_nothing(backend, name):
    rng = np.random.default_rng(6)
    desc = _desc(LAYOUTS[2], F16)
    codec = _configured(name, desc)
    k, v = _random_pools(rng, desc)
    tier = ColdTier(backend, "host", 2, codec.cold_page_bytes(0), rng)
    before = tier.read()
    empty = np.zeros((0, 2), np.int32)
    token = _encode(codec, backend, 0, *backend.put(k, v), empty, tier.address)
    assert token.shape == (1,)
    assert_bits_equal(tier.read(), before, "cold tier", 6)
    k_out, v_out = _decode(codec, backend, 0, *backend.put(k, v), empty, tier.address)
    assert_bits_equal(np.asarray(k_out), k, "k_pool", 6)
    assert_bits_equal(np.asarray(v_out), v, "v_pool", 6)


# ---------------------------------------------------------------------------------------------
# Bad indices: refused by the handler, naming index_pairs; a refused encode writes nothing.

NUM_SLOTS = 6
BAD_PAIRS = [  # (id, kind, bad pair); encode pairs are (cold, hot), decode pairs (hot, cold)
    ("encode-hot-too-large", "encode", (1, NUM_SLOTS)),
    ("encode-hot-negative", "encode", (1, -1)),
    ("encode-cold-negative", "encode", (-2, 1)),
    ("encode-cold-past-num-cold-slots", "encode", (3, 1)),
    ("decode-hot-too-large", "decode", (NUM_SLOTS + 5, 0)),
    ("decode-hot-negative", "decode", (-(2**31), 0)),
    ("decode-cold-negative", "decode", (2, -1)),
    ("decode-cold-past-num-cold-slots", "decode", (2, 3)),
]


@pytest.mark.parametrize("name", ["concat", "int8"])
@pytest.mark.parametrize("case", BAD_PAIRS, ids=[c[0] for c in BAD_PAIRS])
def test_bad_index_pairs_are_refused(index_checks, case, name):
    backend = index_checks
    _, kind, bad = case
    rng = np.random.default_rng(7)
    desc = HotPoolGroupDesc(0, (0,), 2, NUM_SLOTS, 4, 2, 16, F32)
    codec = _configured(name, desc)
    k, v = _random_pools(rng, desc)
    tier = ColdTier(backend, "host", 4, codec.cold_page_bytes(0), rng)
    before = tier.read()
    pairs = np.array([(0, 2), bad], np.int32)  # a good pair first: it must not be written either
    with pytest.raises(runtime_error_types(), match="index_pairs"):
        if kind == "encode":
            _encode(codec, backend, 0, *backend.put(k, v), pairs, tier.address, num_cold_slots=3)
        else:
            _decode(codec, backend, 0, *backend.put(k, v), pairs, tier.address, num_cold_slots=3)
    assert_bits_equal(tier.read(), before, "cold tier after a refused call", 7)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
def test_concat_cuda_needs_registered_host_pairs(backend):
    """On CUDA the concat handler reads its pairs from the host registry; without an entry it
    refuses the call with an error naming index_pairs (the CPU handler reads the operand)."""
    desc = _desc(LAYOUTS[0], F32)
    codec = _configured("concat", desc)
    k, v = backend.put(*_random_pools(np.random.default_rng(0), desc))
    tier = ColdTier(backend, "device", 2, codec.cold_page_bytes(0), np.random.default_rng(0))
    pairs = backend.put(np.array([[0, 1]], np.int32))
    fn = jax.jit(lambda k, v, p: codec.encode(0, k, v, p, tier.address))
    try:
        with pytest.raises(runtime_error_types(), match="index_pairs"):
            fn(k, v, pairs).block_until_ready()
    finally:
        forget_failed_runtime_tokens()
    # A registered copy with another length is refused too.
    codec.register_host_index_pairs(pairs, np.array([[0, 1]], np.int32))
    registry = _codec._index_registry()
    assert registry.lookup(pairs.unsafe_buffer_pointer()).tolist() == [[0, 1]]
    codec.unregister_host_index_pairs(pairs)
    assert registry.lookup(pairs.unsafe_buffer_pointer()) is None


# ---------------------------------------------------------------------------------------------
# Python-side argument checks (before tracing).


@pytest.fixture
def concat_f32():
    desc = _desc(LAYOUTS[0], F32)
    return _configured("concat", desc), desc


def _specs(desc, dtype=None, shape=None):
    s = jax.ShapeDtypeStruct(shape or desc.pool_shape, dtype or desc.dtype)
    return s, s


PAIRS_SPEC = jax.ShapeDtypeStruct((4, 2), jnp.int32)


@pytest.mark.parametrize("method", ["encode", "decode"])
def test_encode_decode_argument_errors(concat_f32, method):
    codec, desc = concat_f32
    call = getattr(codec, method)

    def check(exc, match, lg=0, pools=None, pairs=PAIRS_SPEC, address=1 << 20, **kw):
        k, v = pools or _specs(desc)
        with pytest.raises(exc, match=match):
            jax.eval_shape(lambda k, v, p: call(lg, k, v, p, address, **kw), k, v, pairs)

    check(ValueError, "layer group 5", lg=5)
    check(ValueError, "k_pool shape", pools=_specs(desc, shape=(1, 9, 16, 2, 32)))
    check(TypeError, "k_pool dtype", pools=_specs(desc, dtype=jnp.bfloat16))
    k, _ = _specs(desc)
    check(ValueError, "v_pool shape",
          pools=(k, jax.ShapeDtypeStruct((1, 8, 16, 2, 64), jnp.float32)))
    check(ValueError, "index_pairs", pairs=jax.ShapeDtypeStruct((4, 2), jnp.int16))
    check(ValueError, "index_pairs", pairs=jax.ShapeDtypeStruct((4, 2), jnp.float32))
    check(ValueError, "index_pairs", pairs=jax.ShapeDtypeStruct((8,), jnp.int32))
    check(ValueError, "index_pairs", pairs=jax.ShapeDtypeStruct((4, 3), jnp.int32))
    check(ValueError, "multiple of 16", address=(1 << 20) + 8)
    check(ValueError, r"\(0, 2\^64\)", address=0)
    check(ValueError, r"\(0, 2\^64\)", address=2**64)
    check(TypeError, "must be an int", address=1.5)
    check(TypeError, "must be an int", address=True)
    check(ValueError, "num_cold_slots", num_cold_slots=-1)
    k, v = _specs(desc)
    with pytest.raises(TypeError, match="static"):
        jax.eval_shape(lambda k, v, p, a: call(0, k, v, p, a), k, v, PAIRS_SPEC,
                       jax.ShapeDtypeStruct((), jnp.uint64))
    fresh = ConcatCodec()
    with pytest.raises(RuntimeError, match="not configured"):
        jax.eval_shape(lambda k, v, p: getattr(fresh, method)(0, k, v, p, 1 << 20), k, v,
                       PAIRS_SPEC)


def test_encode_output_and_decode_aliasing_shapes(concat_f32):
    codec, desc = concat_f32
    k, v = _specs(desc)
    tok = jax.eval_shape(lambda k, v, p: codec.encode(0, k, v, p, 1 << 20), k, v, PAIRS_SPEC)
    assert (tok.shape, tok.dtype) == ((1,), jnp.int32)
    outs = jax.eval_shape(lambda k, v, p: codec.decode(0, k, v, p, 1 << 20), k, v, PAIRS_SPEC)
    assert [(o.shape, o.dtype) for o in outs] == [(desc.pool_shape, jnp.float32)] * 2
    # Encode is a side effect: it survives in a jitted function whose result is dropped.
    text = jax.jit(lambda k, v, p: (codec.encode(0, k, v, p, 1 << 20), k)[1]).lower(
        k, v, PAIRS_SPEC).as_text()
    assert "kvcm_concat_encode_pages" in text
    assert re.search(r"has_side_effect\s*=\s*true", text)


# ---------------------------------------------------------------------------------------------
# configure(): validation, once only.

_GOOD = dict(num_layers=2, num_slots=8, page_size=16, num_kv_heads=2, head_dim=64,
             dtype=jnp.bfloat16)


def _d(index=0, layer_groups=(0,), **kw) -> HotPoolGroupDesc:
    fields = dict(_GOOD, **kw)
    return HotPoolGroupDesc(index=index, layer_groups=layer_groups, **fields)


BAD_CONFIGS = [
    ("empty", [], "no hot pool group"),
    ("not-a-sequence", 7, "sequence"),
    ("a-string", "descs", "sequence"),
    ("not-a-desc", [dict(index=0)], "not a HotPoolGroupDesc"),
    ("index-not-zero", [_d(index=1)], "indices must be"),
    ("indices-out-of-order", [_d(index=1, layer_groups=(0,)), _d(index=0, layer_groups=(1,))],
     "indices must be"),
    ("index-gap", [_d(index=0), _d(index=2, layer_groups=(1,))], "indices must be"),
    ("lg-in-two-descs", [_d(index=0, layer_groups=(0, 1)), _d(index=1, layer_groups=(1, 2))],
     "layer group 1"),
    ("lg-twice-in-one-desc", [_d(layer_groups=(3, 3))], "layer group 3"),
    ("empty-layer-groups", [_d(layer_groups=())], "non-empty"),
    ("negative-lg", [_d(layer_groups=(-1,))], ">= 0"),
    ("bool-lg", [_d(layer_groups=(True,))], ">= 0"),
    ("zero-layers", [_d(num_layers=0)], "num_layers"),
    ("negative-head-dim", [_d(head_dim=-64)], "head_dim"),
    ("float-page-size", [_d(page_size=16.0)], "page_size"),
    ("bool-slots", [_d(num_slots=True)], "num_slots"),
    ("int8-dtype", [_d(dtype=jnp.int8)], "not supported"),
    ("float64-dtype", [_d(dtype=np.float64)], "not supported"),
    ("not-a-dtype", [_d(dtype="not a dtype")], "dtype"),
    ("huge-page", [_d(num_layers=2**20, page_size=2**12, head_dim=2**12)], "too large"),
]


@pytest.mark.parametrize("name", ["concat", "int8"])
@pytest.mark.parametrize("case", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_configure_refuses_invalid_configurations(case, name):
    _, descs, why = case
    codec = make_cold_page_codec(name)
    assert codec.configure(descs) is False
    assert why in codec.configure_error
    assert not codec.configured
    assert codec.cold_page_bytes(0) == 0
    assert codec.batching_layer_group_id(0) < 0
    assert codec.page_index_location(0) is PageIndexLocation.BAD
    with pytest.raises(RuntimeError, match="only once"):
        codec.configure([_d()])


@pytest.mark.parametrize("env,kwargs,bits", [
    ({}, {}, 0),
    ({"JAX_KVCM_CONCAT_COPY": "memcpy"}, {}, 2),
    ({"JAX_KVCM_NO_MEMCPY_BATCH": "1"}, {}, 4),
    ({"JAX_KVCM_CHECK_INDICES": "1"}, {}, 1),
    ({"JAX_KVCM_CONCAT_COPY": "memcpy"}, {"copy": "auto"}, 0),  # an explicit option wins
    ({}, {"copy": "memcpy", "memcpy_batch": False, "check_indices": True}, 7),
])
def test_codec_options_and_environment_overrides(monkeypatch, env, kwargs, bits):
    """Options are codec configuration (the handlers' "options" attribute); the environment
    supplies only the options left None, read once when the codec is created."""
    for name in ("JAX_KVCM_CONCAT_COPY", "JAX_KVCM_NO_MEMCPY_BATCH", "JAX_KVCM_CHECK_INDICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    codec = make_cold_page_codec("concat", **kwargs)
    for name in env:
        monkeypatch.delenv(name)  # later changes do not affect a created codec
    assert int(codec._attrs(16, "dst_address", None)["options"]) == bits


@pytest.mark.parametrize("kwargs,exc", [({"copy": "fast"}, ValueError),
                                        ({"memcpy_batch": 1}, TypeError),
                                        ({"check_indices": "yes"}, TypeError)])
def test_codec_options_validated(kwargs, exc):
    with pytest.raises(exc, match=next(iter(kwargs))):
        make_cold_page_codec("concat", **kwargs)
    with pytest.raises(TypeError):
        make_cold_page_codec("int8", copy="memcpy")  # the int8 codec has no copy option


def test_int8_codec_refuses_fp8_pools():
    """fp8 pools: the int8 codec refuses the configuration with a clear reason (configure) and
    its handlers refuse fp8 pools too; the concat codec takes them (round trips above)."""
    codec = make_cold_page_codec("int8")
    assert codec.configure([_d(dtype=jnp.float8_e4m3fn)]) is False
    assert "float8_e4m3fn" in codec.configure_error and "concat" in codec.configure_error
    concat = make_cold_page_codec("concat")
    assert concat.configure([_d(dtype=jnp.float8_e4m3fn)]) is True
    assert concat.cold_page_bytes(0) == 2 * 2 * 16 * 2 * 64  # one byte per element
    # The native handler refuses fp8 pools even when reached directly.
    k = jnp.zeros((2, 8, 16, 2, 64), jnp.float8_e4m3fn)
    call = jax.ffi.ffi_call(Int8Codec._encode_target, jax.ShapeDtypeStruct((1,), jnp.int32),
                            has_side_effect=True)
    buf = np.zeros(1 << 16, np.uint8)
    with pytest.raises(Exception, match="float8_e4m3fn"):
        jax.block_until_ready(call(k, k, jnp.zeros((1, 2), jnp.int32),
                                   address=np.uint64(buf.ctypes.data + (-buf.ctypes.data) % 16),
                                   num_cold_slots=np.int64(1), options=np.int32(0),
                                   slot_major=np.bool_(False)))


@pytest.mark.parametrize("name", ["concat", "int8"])
def test_configure_only_once(name):
    codec = make_cold_page_codec(name)
    assert codec.configure((_d(),)) is True and codec.configure_error is None
    with pytest.raises(RuntimeError, match="only once"):
        codec.configure([_d()])
    assert codec.cold_page_bytes(0) > 0  # still configured as the first call said


def test_configure_accepts_numpy_ints_and_dtype_spellings():
    desc = HotPoolGroupDesc(index=np.int64(0), layer_groups=(np.int32(4), 2),
                            num_layers=np.int16(2), num_slots=np.uint32(5), page_size=8,
                            num_kv_heads=1, head_dim=32, dtype="float16")
    codec = make_cold_page_codec("concat")
    assert codec.configure([desc]), codec.configure_error
    assert codec.cold_page_bytes(4) == 2 * 2 * 8 * 1 * 32 * 2
    assert codec.batching_layer_group_id(np.int64(4)) == 2


# ---------------------------------------------------------------------------------------------
# Queries: cold page sizes, batching ids, page index locations.

MULTI = [
    _d(index=0, layer_groups=(3, 1)),
    _d(index=1, layer_groups=(0, 2), num_layers=3, page_size=4, num_kv_heads=1, head_dim=24,
       dtype=jnp.float32),
    _d(index=2, layer_groups=(5,), dtype=jnp.float16, head_dim=5, page_size=3, num_kv_heads=1,
       num_layers=1),
]


def test_concat_queries():
    codec = _configured("concat", *MULTI)
    assert [codec.cold_page_bytes(lg) for lg in (0, 1, 2, 3, 4, 5)] == [
        2 * 3 * 4 * 1 * 24 * 4, 2 * 2 * 16 * 2 * 64 * 2, 2 * 3 * 4 * 1 * 24 * 4,
        2 * 2 * 16 * 2 * 64 * 2, 0, 2 * 1 * 3 * 1 * 5 * 2]
    assert [codec.batching_layer_group_id(lg) for lg in (0, 1, 2, 3, 5)] == [0, 1, 0, 1, 5]
    assert all(codec.page_index_location(lg) is PageIndexLocation.HOST for lg in (0, 1, 2, 3, 5))
    assert codec.lossless and codec.name == "concat"


def test_int8_queries():
    codec = _configured("int8", *MULTI)
    # group 0: payload 2*2*2*16*64 = 8192, scales 8 * 4 = 32 -> 8224
    # group 1: payload 2*3*1*4*24 = 576, scales 6 * 4 = 24 -> 600 -> 608
    # group 2: payload 2*1*1*3*5 = 30 -> scales at 32, + 8 = 40 -> 48
    assert [codec.cold_page_bytes(lg) for lg in (0, 1, 2, 3, 5)] == [608, 8224, 608, 8224, 48]
    assert [codec.batching_layer_group_id(lg) for lg in (0, 1, 2, 3, 5)] == [0, 1, 0, 1, 5]
    assert all(codec.page_index_location(lg) is PageIndexLocation.DEVICE
               for lg in (0, 1, 2, 3, 5))
    assert not codec.lossless and codec.name == "int8"
    # Compression: a bfloat16 page shrinks to about half.
    assert codec.cold_page_bytes(1) < 0.51 * MULTI[0].hot_page_bytes


@pytest.mark.parametrize("name", ["concat", "int8"])
@pytest.mark.parametrize("lg", [4, 6, -1, 2**40, True, "1", None, 1.0])
def test_unknown_layer_groups(name, lg):
    codec = _configured(name, *MULTI)
    assert codec.cold_page_bytes(lg) == 0
    assert codec.batching_layer_group_id(lg) < 0
    assert codec.page_index_location(lg) is PageIndexLocation.BAD


@pytest.mark.parametrize("name", ["concat", "int8"])
def test_unconfigured_queries(name):
    codec = make_cold_page_codec(name)
    assert not codec.configured
    assert codec.cold_page_bytes(0) == 0
    assert codec.batching_layer_group_id(0) < 0
    assert codec.page_index_location(0) is PageIndexLocation.BAD


def test_page_index_location_values():
    assert [int(x) for x in PageIndexLocation] == [-1, 0, 1]
    assert [x.name for x in PageIndexLocation] == ["BAD", "HOST", "DEVICE"]


# ---------------------------------------------------------------------------------------------
# Factories, ownership, no Python subclasses.


def test_factories():
    a, b = create_default_cold_page_codec(), create_default_cold_page_codec()
    assert type(a) is ConcatCodec and a is not b
    assert not a.configured and not a.consumed
    assert type(make_cold_page_codec("concat")) is ConcatCodec
    assert type(make_cold_page_codec("int8")) is Int8Codec
    for bad in ("fp8", "", None, 3):
        with pytest.raises(ValueError, match="unknown cold-page codec"):
            make_cold_page_codec(bad)


@pytest.mark.parametrize("name", ["concat", "int8"])
def test_consume_once(name):
    codec = make_cold_page_codec(name)
    assert not codec.consumed
    assert codec.consume() is codec
    assert codec.consumed
    with pytest.raises(RuntimeError, match="^codec already consumed by a KVCacheManager$"):
        codec.consume()
    assert codec.consumed
    # Consumption and configuration are independent: the manager configures after consuming.
    assert codec.configure([_d()])
    assert "consumed" in repr(codec)


def test_python_subclasses_are_refused():
    for base in (ColdPageCodec, ConcatCodec, Int8Codec):
        with pytest.raises(TypeError, match="codecs are native; Python subclasses are not "
                                            "supported"):
            type("MyCodec", (base,), {})
    with pytest.raises(TypeError, match="abstract"):
        ColdPageCodec()


def test_hot_pool_group_desc_is_frozen_and_slotted():
    d = _d()
    with pytest.raises(AttributeError):
        d.num_slots = 3
    assert not hasattr(d, "__dict__")
    assert d.pool_shape == (2, 8, 16, 2, 64)
    assert d.hot_page_bytes == 2 * 2 * 16 * 2 * 64 * 2


# ---------------------------------------------------------------------------------------------
# Host index registry (CUDA extension; the functions need no GPU).


def test_register_host_index_pairs_is_a_noop_on_cpu_arrays():
    codec = create_default_cold_page_codec()
    cpu = jax.devices("cpu")[0]
    pairs = jax.device_put(np.array([[1, 2]], np.int32), cpu)
    codec.register_host_index_pairs(pairs, np.array([[1, 2]], np.int32))
    codec.unregister_host_index_pairs(pairs)
    with pytest.raises(ValueError, match="host_pairs"):
        codec.register_host_index_pairs(pairs, np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="host_pairs"):
        codec.register_host_index_pairs(pairs, np.zeros((2,), np.int32))


@pytest.mark.skipif(_ffi._kvcm_cuda is None, reason="the CUDA extension is not built here")
def test_native_host_index_registry():
    registry = _codec._index_registry()
    start = registry.count()
    pairs = np.array([[5, 1], [6, 2], [7, 3]], np.int32)
    fake_ptr = 0x7F0000001000
    assert registry.register(fake_ptr, pairs.ctypes.data, 3) == 0
    pairs[:] = -1  # the registry holds a copy
    assert registry.lookup(fake_ptr).tolist() == [[5, 1], [6, 2], [7, 3]]
    assert registry.count() == start + 1
    assert registry.register(fake_ptr, np.array([[9, 9]], np.int32).ctypes.data, 1) == 0
    assert registry.lookup(fake_ptr).tolist() == [[9, 9]]  # replaced
    assert registry.register(fake_ptr, None, -1) == -1
    assert registry.unregister(fake_ptr) == 1
    assert registry.unregister(fake_ptr) == 0
    assert registry.lookup(fake_ptr) is None
    assert registry.count() == start
