"""Cold-page codecs over slot-major ("arena") pools, and the by-address (CPU arena) form of every
op and codec.

Codecs: one codec configured with two hot pool groups of one logical shape, layer group 0
layer-major and layer group 1 slot-major (``HotPoolGroupDesc.slot_major``). Pages encoded from
either layout must be the same cold bytes (the documented layouts of tests/tiers/test_codec.py), and a
cold page decodes bit-exactly into either layout: encode from slot-major, decode into layer-major
and the reverse. Both codecs (concat: HOST index pairs; int8: DEVICE index pairs), every concat
data mover (the CUDA copy kernel, one cuMemcpyBatchAsync, one cudaMemcpyAsync per piece, the
side-stream mover), host and device cold tiers; the hot pools of a decode are poisoned (NaN) and
only the decoded slots may change. ``gpu`` variants through the ``backend`` fixture.

By address: a real memfd reservation holds the two slot-major pools; ``ArenaPool.by_address``
pools over it go to the ``kvcm_arena_*`` handlers, which must compute what the layer-major
arrays compute, refuse pages on unmapped super-pages, and refuse a closed reservation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BF16, F16, F32, assert_bits_equal, runtime_error_types
from jax_kvcm import _ffi, ops
from jax_kvcm._arena_pool import ArenaPool
from jax_kvcm._codec import HotPoolGroupDesc, make_cold_page_codec
from test_codec import ColdTier, concat_page, int8_page
from test_fp8_kv import FP8, random_scales, same_bytes

SWAP = (1, 0, 2, 3, 4)
LAYER_MAJOR, SLOT_MAJOR = 0, 1  # the layer groups of the two hot pool groups

# (id, num_layers, num_slots, page_size, num_kv_heads, head_dim)
LAYOUTS = [
    ("L3-S9-P4-H2-D16", 3, 9, 4, 2, 16),
    ("L2-S7-P3-H1-D24", 2, 7, 3, 1, 24),  # D % 16 != 0: the int8 kernels' scalar path; fp8
                                          # pieces of 72 bytes: the copy kernel's byte path
]
# (codec, data mover): every concat mover (the CPU handler has one: same code each time).
MOVERS = [("concat", "auto"), ("concat", "memcpy-batch"), ("concat", "memcpy-each"),
          ("concat", "side-stream"), ("int8", "device-pairs")]


def reservation(nbytes: int, super_page_bytes: int):
    """A CPU memfd reservation (create_physical, map, unmap, write, read, base, close)."""
    return _ffi._kvcm_cpu.Reservation(nbytes, super_page_bytes)


def desc(layout, dtype, index, slot_major) -> HotPoolGroupDesc:
    _, L, S, P, H, D = layout
    return HotPoolGroupDesc(index=index, layer_groups=(index,), num_layers=L, num_slots=S,
                            page_size=P, num_kv_heads=H, head_dim=D, dtype=dtype,
                            slot_major=slot_major)


def both_layout_codec(name, layout, dtype, **options):
    codec = make_cold_page_codec(name, **options)
    assert codec.configure([desc(layout, dtype, LAYER_MAJOR, False),
                            desc(layout, dtype, SLOT_MAJOR, True)]), codec.configure_error
    assert codec.cold_page_bytes(LAYER_MAJOR) == codec.cold_page_bytes(SLOT_MAJOR) > 0
    assert codec.batching_layer_group_id(SLOT_MAJOR) == SLOT_MAJOR
    return codec


def mover_options(name, mover):
    if name != "concat":
        return {}
    return dict(copy="auto" if mover in ("auto", "side-stream") else "memcpy",
                memcpy_batch=mover != "memcpy-each")


def random_pools(rng, shape, dtype):
    spread = 10.0 ** rng.uniform(-2, 2, size=(shape[0], shape[1], 1, shape[3], 1))
    return tuple((rng.standard_normal(shape) * spread).astype(dtype) for _ in range(2))


def encode(codec, backend, lg, k, v, pairs_np, address, *, side_stream=False):
    """Encodes with the host copy of the pairs registered (HOST location on CUDA); the
    side-stream mover's ticket is waited for and released."""
    pairs = backend.put(np.ascontiguousarray(pairs_np, np.int32))
    ticket = 0
    cuda = _ffi._kvcm_cuda if backend.name == "gpu" else None
    if side_stream and cuda is not None:
        ticket = cuda.ticket_create()
    codec.register_host_index_pairs(pairs, pairs_np, ticket=ticket)
    try:
        fn = jax.jit(lambda k, v, p: codec.encode(lg, k, v, p, address, side_stream=side_stream))
        jax.block_until_ready(fn(k, v, pairs))
        if ticket:
            assert cuda.ticket_wait(ticket), "the side-stream encode never submitted its ticket"
    finally:
        codec.unregister_host_index_pairs(pairs)
        if ticket:
            cuda.ticket_release(ticket)


def decode(codec, backend, lg, k, v, pairs_np, address):
    pairs = backend.put(np.ascontiguousarray(pairs_np, np.int32))
    codec.register_host_index_pairs(pairs, pairs_np)
    try:
        fn = jax.jit(lambda k, v, p: codec.decode(lg, k, v, p, address), donate_argnums=(0, 1))
        return jax.block_until_ready(fn(k, v, pairs))
    finally:
        codec.unregister_host_index_pairs(pairs)


def twin(backend, pool: np.ndarray) -> ArenaPool:
    return ArenaPool.over_array(jnp.transpose(backend.put(pool), SWAP))


def layer_major(pool: ArenaPool) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(pool.data).transpose(SWAP))


# ---------------------------------------------------------------------------------------------
# Codecs over over_array pools.


def codec_dtypes(name):
    return [F32, BF16, FP8] if name == "concat" else [F32, BF16, F16]


CODEC_CASES = [(name, mover, dtype) for name, mover in MOVERS for dtype in codec_dtypes(name)]


@pytest.mark.parametrize("tier_kind", ["host", "device"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
@pytest.mark.parametrize("name,mover,dtype", CODEC_CASES,
                         ids=[f"{n}-{m}-{jnp.dtype(d).name}" for n, m, d in CODEC_CASES])
def test_cold_pages_do_not_depend_on_the_hot_layout(backend, name, mover, dtype, layout,
                                                    tier_kind):
    seed = 40 + LAYOUTS.index(layout)
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    codec = both_layout_codec(name, layout, dtype, **mover_options(name, mover))
    side = mover == "side-stream"
    _, L, S, P, H, D = layout
    shape = (L, S, P, H, D)
    k, v = random_pools(rng, shape, dtype)
    page_bytes = codec.cold_page_bytes(LAYER_MAJOR)
    n = S - 2
    src = rng.choice(S, n, replace=False).astype(np.int32)
    dst = rng.choice(n + 3, n, replace=False).astype(np.int32)
    pairs = np.stack([dst, src], 1)
    tiers = [ColdTier(backend, tier_kind, n + 3, page_bytes, rng) for _ in range(2)]
    encode(codec, backend, LAYER_MAJOR, *backend.put(k, v), pairs, tiers[0].address,
           side_stream=side)
    encode(codec, backend, SLOT_MAJOR, twin(backend, k), twin(backend, v), pairs,
           tiers[1].address, side_stream=side)
    from_layer_major, from_slot_major = tiers[0].read(), tiers[1].read()
    documented = concat_page if name == "concat" else int8_page
    for d, s in zip(dst, src):
        assert_bits_equal(from_layer_major[d], documented(k, v, s), f"cold page {d}", seed)
        assert_bits_equal(from_slot_major[d], from_layer_major[d], f"cold page {d} from the "
                          "slot-major pools", seed)

    # Decode each tier into both layouts: encoded from one layout, decoded into the other too.
    hot_dst = rng.permutation(S)[:n].astype(np.int32)
    back = np.stack([hot_dst, dst], 1)
    poison = np.full(shape, np.nan, np.float32).astype(dtype)
    outs = []
    for tier in tiers:
        lm = decode(codec, backend, LAYER_MAJOR, *backend.put(poison, poison), back, tier.address)
        pools = (twin(backend, poison), twin(backend, poison))
        pointers = [p.unsafe_buffer_pointer() for p in pools]
        sm = decode(codec, backend, SLOT_MAJOR, *pools, back, tier.address)
        assert all(isinstance(p, ArenaPool) for p in sm)
        assert [p.unsafe_buffer_pointer() for p in sm] == pointers, \
            "a donated slot-major pool was copied, not decoded in place"
        for what, got_lm, got_sm in zip("kv", lm, sm):
            assert_bits_equal(layer_major(got_sm), np.asarray(got_lm),
                              f"{what} pool decoded slot-major vs layer-major", seed)
        outs.append([np.asarray(a) for a in lm])
    for what, a, b in zip("kv", *outs):
        assert_bits_equal(a, b, f"{what} pool decoded from either tier", seed)
    untouched = np.setdiff1d(np.arange(S), hot_dst)
    for what, got, orig in zip("kv", outs[0], (k, v)):
        assert_bits_equal(got[:, untouched], poison[:, untouched], f"{what} other slots", seed)
        if name == "concat":
            assert_bits_equal(got[:, hot_dst], orig[:, src], f"{what} decoded pages", seed)


def test_codec_refuses_pools_of_the_other_layout():
    layout = LAYOUTS[0]
    codec = both_layout_codec("concat", layout, F32)
    k = jnp.zeros(desc(layout, F32, 0, False).pool_shape, jnp.float32)
    pairs = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(TypeError, match="layer group 1's hot pools are slot-major"):
        codec.encode(SLOT_MAJOR, k, k, pairs, 4096)
    kp = ArenaPool.over_array(jnp.transpose(k, SWAP))
    with pytest.raises(TypeError, match="layer group 0's hot pools are layer-major"):
        codec.decode(LAYER_MAJOR, kp, kp, pairs, 4096)
    with pytest.raises(TypeError, match="k_pool and v_pool must both be ArenaPools"):
        codec.encode(SLOT_MAJOR, kp, k, pairs, 4096)
    bad = make_cold_page_codec("int8")
    assert not bad.configure([HotPoolGroupDesc(0, (0,), 1, 2, 3, 1, 8, F32, slot_major=1)])
    assert "slot_major must be a bool" in bad.configure_error


# ---------------------------------------------------------------------------------------------
# By address: a CPU memfd reservation holding the two slot-major pools.


class ArenaPair:
    """K and V slot-major pools in one reservation, every super-page mapped; the pools'
    contents are ``k``, ``v`` (layer-major numpy) at the start."""

    def __init__(self, k: np.ndarray, v: np.ndarray) -> None:
        self.gran = _ffi._kvcm_cpu.reservation_granularity()
        self.shape, self.dtype = k.shape, k.dtype
        self.span = -(-k.nbytes // self.gran) * self.gran
        self.res = reservation(2 * self.span, self.gran)
        for offset in range(0, 2 * self.span, self.gran):
            self.res.map(offset, self.res.create_physical())
        for i, pool in enumerate((k, v)):
            data = np.ascontiguousarray(pool.transpose(SWAP))
            self.res.write(i * self.span, data.ctypes.data, data.nbytes)

    def pools(self) -> tuple[ArenaPool, ArenaPool]:
        return tuple(ArenaPool.by_address(jnp.int32(0), self.res.base + i * self.span,
                                          self.shape, self.dtype) for i in range(2))

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """The pools' logical (layer-major) contents."""
        out = []
        for i in range(2):
            data = np.empty((self.shape[1], self.shape[0]) + self.shape[2:], self.dtype)
            self.res.read(i * self.span, data.ctypes.data, data.nbytes)
            out.append(np.ascontiguousarray(data.transpose(SWAP)))
        return out[0], out[1]

    def unmap_page_of(self, slot: int) -> None:
        """Unmaps every super-page holding a K byte of hot page ``slot``."""
        page_bytes = int(np.prod(self.shape)) // self.shape[1] * self.dtype.itemsize
        first = slot * page_bytes // self.gran * self.gran
        for offset in range(first, (slot + 1) * page_bytes, self.gran):
            self.res.unmap(offset)


def by_address_case(seed, dtype):
    rng = np.random.default_rng(seed)
    L, S, P, H, G, D = 3, 24, 16, 2, 2, 64
    cache_dtype = FP8 if dtype == "fp8" else dtype
    q_dtype = BF16 if dtype == "fp8" else dtype
    k, v = (rng.standard_normal((L, S, P, H, D)).astype(cache_dtype) for _ in range(2))
    scales = {}
    if dtype == "fp8":
        scales = dict(k_scale=random_scales(rng, (L, H)), v_scale=random_scales(rng, (L, H)))
    print(f"seed={seed}")
    return rng, (L, S, P, H, G, D), q_dtype, k, v, scales


@pytest.mark.parametrize("dtype", [F32, BF16, "fp8"], ids=["f32", "bf16", "fp8"])
def test_by_address_ops_compute_what_the_layer_major_arrays_compute(dtype):
    rng, (_, S, P, H, G, D), q_dtype, k, v, scales = by_address_case(50, dtype)
    arena = ArenaPair(k, v)
    B, T = 4, 11
    table = rng.permutation(np.arange(1, S, dtype=np.int32))[:B * 5].reshape(B, 5)
    lens = np.array([70, 1, 33, 80], np.int32)
    slots = (table[np.arange(B), (lens - 1) // P] * P + (lens - 1) % P).astype(np.int32)
    new_k, new_v = (rng.standard_normal((B, H, D)).astype(q_dtype) for _ in range(2))
    q = rng.standard_normal((B, H * G, D)).astype(q_dtype)
    qs = np.array([0, 4, 5, 9, T - 1], np.int32)
    q_ragged = rng.standard_normal((T, H * G, D)).astype(q_dtype)
    layer = jnp.int32(1)
    jscales = {n: jnp.asarray(s) for n, s in scales.items()}

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(kc, vc):
        kc, vc = ops.write_kv(kc, vc, new_k, new_v, slots, layer=layer, **jscales)
        decode = ops.paged_attention(q, kc, vc, table, lens, layer=layer, **jscales)
        ragged = ops.ragged_paged_attention(q_ragged, kc, vc, table, lens, qs, layer=layer,
                                            sliding_window=40, **jscales)
        return kc, vc, decode, ragged

    k_lm, v_lm, decode_lm, ragged_lm = step(jnp.asarray(k), jnp.asarray(v))
    k_pool, v_pool, decode_ba, ragged_ba = step(*arena.pools())
    assert k_pool.by_address and int(k_pool.token) == int(v_pool.token) == 1
    assert k_pool.address == arena.res.base
    compare = same_bytes if dtype == "fp8" else assert_bits_equal
    got_k, got_v = arena.read()
    compare(got_k, np.asarray(k_lm), "k pool in the reservation", 50)
    compare(got_v, np.asarray(v_lm), "v pool in the reservation", 50)
    assert_bits_equal(np.asarray(decode_ba), np.asarray(decode_lm), "decode by address", 50)
    assert_bits_equal(np.asarray(ragged_ba), np.asarray(ragged_lm), "ragged by address", 50)


@pytest.mark.parametrize("name", ["concat", "int8"])
def test_by_address_codecs_compute_what_the_layer_major_arrays_compute(name):
    _, (L, S, P, H, _, D), _, k, v, _ = by_address_case(51, F32)
    arena = ArenaPair(k, v)
    layout = ("by-address", L, S, P, H, D)
    codec = both_layout_codec(name, layout, F32)
    page_bytes = codec.cold_page_bytes(SLOT_MAJOR)
    src = np.array([3, 17, 0, 23], np.int32)
    dst = np.array([1, 0, 3, 2], np.int32)
    tiers = [np.zeros((4, page_bytes), np.uint8) for _ in range(2)]
    encode_fn = jax.jit(lambda k, v, p, lg, at: codec.encode(lg, k, v, p, at),
                        static_argnums=(3, 4))
    pairs = jnp.asarray(np.stack([dst, src], 1))
    encode_fn(jnp.asarray(k), jnp.asarray(v), pairs, LAYER_MAJOR,
              tiers[0].ctypes.data).block_until_ready()
    encode_fn(*arena.pools(), pairs, SLOT_MAJOR, tiers[1].ctypes.data).block_until_ready()
    assert_bits_equal(tiers[1], tiers[0], f"{name} cold pages from the reservation", 51)

    # Decode them back into other slots of the reservation, in place, tokens advanced.
    hot_dst = np.array([5, 9, 20, 2], np.int32)
    back = jnp.asarray(np.stack([hot_dst, dst], 1))
    decode_fn = jax.jit(lambda k, v, p, lg: codec.decode(lg, k, v, p, tiers[1].ctypes.data),
                        static_argnums=3, donate_argnums=(0, 1))
    k_lm, v_lm = decode_fn(jnp.asarray(k), jnp.asarray(v), back, LAYER_MAJOR)
    k_pool, v_pool = decode_fn(*arena.pools(), back, SLOT_MAJOR)
    assert int(k_pool.token) == int(v_pool.token) == 1
    got_k, got_v = arena.read()
    assert_bits_equal(got_k, np.asarray(k_lm), "k pool decoded in the reservation", 51)
    assert_bits_equal(got_v, np.asarray(v_lm), "v pool decoded in the reservation", 51)


def test_by_address_refuses_unmapped_pages_and_closed_reservations():
    _, (L, S, P, H, G, D), _, k, v, _ = by_address_case(52, F32)
    arena = ArenaPair(k, v)
    errors = runtime_error_types()
    slot = 10
    arena.unmap_page_of(slot)
    k_pool, v_pool = arena.pools()
    rows = jnp.ones((1, H, D), jnp.float32)
    with pytest.raises(errors, match="unmapped part of the arena"):
        jax.block_until_ready(ops.write_kv(k_pool, v_pool, rows, rows,
                                           jnp.array([slot * P + 3], jnp.int32), layer=2))
    codec = both_layout_codec("concat", ("by-address", L, S, P, H, D), F32)
    tier = np.zeros((2, codec.cold_page_bytes(SLOT_MAJOR)), np.uint8)
    for call, pairs in ((codec.encode, [[0, 2], [1, slot]]), (codec.decode, [[slot, 0]])):
        with pytest.raises(errors, match="hot page 10 is in an unmapped part of the arena"):
            jax.block_until_ready(call(SLOT_MAJOR, k_pool, v_pool,
                                       jnp.asarray(np.array(pairs, np.int32)),
                                       tier.ctypes.data))
    assert not tier.any(), "a refused encode wrote a cold page"
    arena.res.close()
    q = jnp.zeros((1, H * G, D), jnp.float32)
    with pytest.raises(errors, match="not inside an open arena reservation"):
        jax.block_until_ready(ops.paged_attention(q, k_pool, v_pool, jnp.ones((1, 1), jnp.int32),
                                                  jnp.ones((1,), jnp.int32), layer=0))
