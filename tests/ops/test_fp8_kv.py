"""FP8 (float8_e4m3fn) K/V caches: write_kv quantization, attention dequantization, bad scales.

Oracles, independent of the code under test: ml_dtypes' float8_e4m3fn conversion in numpy for
the stored bytes (``saturate(x / scale)``), and the float32 reference run on the *dequantized*
caches (``float32(stored) * scale``) for attention. The reference's own fp8 path is checked
against the same oracles on the CPU. GPU variants are marked ``gpu`` (the ``backend`` fixture).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import (DTYPES, assert_bits_equal, assert_close, assert_zero_rows, reference,
                      to_f32)
from jax_kvcm import ops
from jax_kvcm.ops import reference as ref
from test_attention import (DECODE_CASES, LONG_PREFILL_CASES, RAGGED_CASES, Case,
                            long_ragged_batch, make_batch, numpy_ragged_attention)
from test_nonfinite import base_batch

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def np_quantize(x, scale):
    """numpy oracle: float8_e4m3fn of float32(x) / scale[head], clipped to +-448."""
    y = np.asarray(x, np.float32) / np.asarray(scale, np.float32)[:, None]
    return np.clip(y, -448.0, 448.0).astype(FP8)


def np_dequantize(x8, scale):
    return x8.astype(np.float32) * np.asarray(scale, np.float32)[:, None]


def random_scales(rng, shape):
    return rng.uniform(0.004, 0.05, size=shape).astype(np.float32)


def same_bytes(got, want, what, seed):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype == FP8, (got.dtype, want.dtype)
    # NaN is NaN whatever its sign bit (0x7f / 0xff): compare NaN-ness there, bytes elsewhere.
    g, w = got.view(np.uint8), want.view(np.uint8)
    nan_g, nan_w = (g & 0x7f) == 0x7f, (w & 0x7f) == 0x7f
    assert np.array_equal(nan_g, nan_w), f"{what}: NaN positions differ (seed={seed})"
    diff = (g != w) & ~nan_g
    assert not diff.any(), (f"{what}: {int(diff.sum())} bytes differ, first at "
                            f"{tuple(int(i) for i in np.argwhere(diff)[0])} (seed={seed})")


# ---------------------------------------------------------------------------------------------
# Quantization edge cases: every fp8 value, ties, saturation, inf, NaN, subnormals.


def edge_values() -> np.ndarray:
    """float32 values hitting every rounding case of float8_e4m3fn (scale 1)."""
    finite = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)
    finite = np.unique(finite[np.isfinite(finite)])
    mids = (finite[:-1] + finite[1:]) / 2  # exact ties: round half to even
    nudged = np.concatenate([np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
    big = np.array([448.0, 449.0, 463.9, 464.0, 465.0, 1e6, 3.4e38, np.inf, -np.inf, np.nan,
                    -np.nan, 2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-30, -0.0, 0.0], np.float32)
    return np.concatenate([finite, mids, nudged, big, -big]).astype(np.float32)


@pytest.mark.parametrize("src", ["f32", "bf16", "f16"])
def test_write_kv_fp8_rounding_edges_match_ml_dtypes(backend, src):
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[src]
    with np.errstate(over="ignore"):
        x = edge_values().astype(dtype)  # the source dtype rounds first; the oracle sees the same
    d = 16
    n = -(-x.size // d)
    rows = np.zeros(n * d, dtype)
    rows[:x.size] = x
    k = rows.reshape(n, 1, d)
    v = -k
    scale = np.ones((1,), np.float32)
    kc = np.zeros((n, 1, 1, d), FP8)
    slots = np.arange(n, dtype=np.int32)
    out_k, out_v = ops.write_kv(*backend.put(kc, kc, k, v, slots), k_scale=backend.put(scale),
                                v_scale=backend.put(scale))
    same_bytes(out_k, np_quantize(k.astype(np.float32).reshape(n, 1, d), scale).reshape(kc.shape),
               "k edges", src)
    same_bytes(out_v, np_quantize(v.astype(np.float32).reshape(n, 1, d), scale).reshape(kc.shape),
               "v edges", src)
    # The reference quantizes the same way.
    rk, _ = ref.write_kv(jnp.asarray(kc), jnp.asarray(kc), jnp.asarray(k), jnp.asarray(v),
                         jnp.asarray(slots), k_scale=jnp.asarray(scale), v_scale=jnp.asarray(scale))
    same_bytes(rk, np.asarray(out_k), "reference k edges", src)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_layers", [None, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 16, 24])   # 24: not whole 16-element vectors (element path)
def test_write_kv_fp8_matches_oracle(backend, dtype, num_layers, seed, D):
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    P, Hkv, N, T = 16, 2, 6, 37
    lead = (num_layers,) if num_layers else ()
    kc = (rng.standard_normal(lead + (N, P, Hkv, D)) * 4).astype(FP8)
    vc = (rng.standard_normal(lead + (N, P, Hkv, D)) * 4).astype(FP8)
    k = (rng.standard_normal((T, Hkv, D)) * 3).astype(dtype)
    v = (rng.standard_normal((T, Hkv, D)) * 3).astype(dtype)
    with np.errstate(over="ignore"):
        k[0, 0, :4] = [np.inf, -np.inf, np.nan, 1e6]  # saturate, NaN kept
    slots = rng.choice(np.arange(P, N * P), size=T, replace=False).astype(np.int32)
    slots[rng.random(T) < 0.25] = -1
    ks, vs = random_scales(rng, lead + (Hkv,)), random_scales(rng, lead + (Hkv,))
    layer = int(rng.integers(num_layers)) if num_layers else None
    fn = jax.jit(ops.write_kv, donate_argnums=(0, 1))
    out_k, out_v = fn(*backend.put(kc, vc, k, v, slots),
                      layer=None if layer is None else jnp.int32(layer),
                      k_scale=backend.put(ks), v_scale=backend.put(vs))
    for got, cache, rows, sc, name in ((out_k, kc, k, ks, "k"), (out_v, vc, v, vs, "v")):
        want = cache.copy()
        view = want if layer is None else want[layer]
        flat = view.reshape(-1, Hkv, D)
        keep = slots >= 0
        flat[slots[keep]] = np_quantize(rows[keep].astype(np.float32).transpose(1, 0, 2)
                                        .reshape(Hkv, -1), sc if layer is None else sc[layer]
                                        ).reshape(Hkv, -1, D).transpose(1, 0, 2)
        same_bytes(got, want, f"{name}_cache", seed)


# ---------------------------------------------------------------------------------------------
# Attention over fp8 caches against the reference on the dequantized caches.


def fp8_batch(seed, case, dtype, ragged):
    b = make_batch(seed, case, jnp.float32, ragged)
    rng = np.random.default_rng([seed, 8])
    lead = (case.num_layers,) if case.num_layers else ()
    ks, vs = random_scales(rng, lead + (case.num_kv_heads,)), random_scales(rng, lead + (case.num_kv_heads,))
    flat = lambda c: c.reshape((-1,) + c.shape[-2:]).transpose(1, 0, 2)  # noqa: E731 [Hkv, S, D]

    def quant(cache, scale):
        layers = cache if case.num_layers else cache[None]
        scales = scale if case.num_layers else scale[None]
        q8 = np.stack([np_quantize(flat(c).reshape(case.num_kv_heads, -1), s)
                       .reshape(flat(c).shape).transpose(1, 0, 2).reshape(c.shape)
                       for c, s in zip(layers, scales)])
        deq = np.stack([np_dequantize(flat(c8).reshape(case.num_kv_heads, -1), s)
                        .reshape(flat(c8).shape).transpose(1, 0, 2).reshape(c8.shape)
                        for c8, s in zip(q8, scales)])
        return (q8, deq) if case.num_layers else (q8[0], deq[0])

    k8, kdq = quant(b.k_cache, ks)
    v8, vdq = quant(b.v_cache, vs)
    return b, b.q.astype(dtype), k8, v8, kdq, vdq, ks, vs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.id for c in DECODE_CASES])
def test_paged_attention_fp8(backend, case, dtype):
    seed = 5
    b, q, k8, v8, kdq, vdq, ks, vs = fp8_batch(seed, case, dtype, ragged=False)
    out = ops.paged_attention(*backend.put(q, k8, v8, b.page_table, b.seq_lens), layer=b.layer,
                              k_scale=backend.put(ks), v_scale=backend.put(vs), **case.attrs())
    assert out.dtype == dtype
    want = reference("paged_attention", q, kdq, vdq, b.page_table, b.seq_lens, layer=b.layer,
                     **case.attrs())
    assert_zero_rows(out, b.zero_rows, "fp8 padded rows", seed)
    assert_close(out, want, dtype, f"paged_attention fp8[{case.id}]", seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", RAGGED_CASES, ids=[c.id for c in RAGGED_CASES])
def test_ragged_paged_attention_fp8(backend, case, dtype):
    seed = 6
    b, q, k8, v8, kdq, vdq, ks, vs = fp8_batch(seed, case, dtype, ragged=True)
    args = (b.page_table, b.seq_lens, b.query_start)
    out = ops.ragged_paged_attention(*backend.put(q, k8, v8, *args), layer=b.layer,
                                     k_scale=backend.put(ks), v_scale=backend.put(vs),
                                     **case.attrs())
    want = reference("ragged_paged_attention", q, kdq, vdq, *args, layer=b.layer, **case.attrs())
    assert_zero_rows(out, b.zero_rows, "fp8 ragged padding rows", seed)
    assert_close(out, want, dtype, f"ragged fp8[{case.id}]", seed)


# Long chunks over fp8 caches: on an H100/H200 the sm90 (wgmma) prefill kernel's fp8 path, whose
# producer converts each K/V tile to f16 in the ring: many K/V tiles per work tile, wholly and
# partly read tiles, the ring running on across work tiles, windows and soft caps, page sizes from
# 1 (per-row table lookups) to 256; against the float32 oracle on the dequantized caches.


def fp8_long_batch(seed, seq_lens, num_new, *, page, group, head_dim, dtype, padding):
    rng = np.random.default_rng(seed)
    hkv = 2
    q, k, v, table, query_start, num_rows = long_ragged_batch(
        rng, np.asarray(seq_lens, np.int32), np.asarray(num_new), page=page, hkv=hkv,
        group=group, head_dim=head_dim, padding=padding, spare_pages=2, dtype=np.float32)
    ks, vs = random_scales(rng, (hkv,)), random_scales(rng, (hkv,))
    k8, v8 = fp8_quantize_cache(k, ks), fp8_quantize_cache(v, vs)
    return (q.astype(dtype), k8, v8, ks, vs, table, np.asarray(seq_lens, np.int32), query_start,
            num_rows)


def _check_fp8_long(backend, seed, seq_lens, num_new, *, page, group, head_dim, dtype, window,
                    soft_cap, what):
    q, k8, v8, ks, vs, table, lens, query_start, num_rows = fp8_long_batch(
        seed, seq_lens, num_new, page=page, group=group, head_dim=head_dim, dtype=dtype, padding=5)
    print(f"seed={seed} seq_lens={lens.tolist()} query_start={query_start.tolist()}")
    out = ops.ragged_paged_attention(*backend.put(q, k8, v8, table, lens, query_start),
                                     k_scale=backend.put(ks), v_scale=backend.put(vs),
                                     sliding_window=window, soft_cap=soft_cap)
    assert out.dtype == dtype
    want = numpy_ragged_attention(q, fp8_dequantize_cache(k8, ks), fp8_dequantize_cache(v8, vs),
                                  table, lens, query_start, num_rows, window=window,
                                  soft_cap=soft_cap)
    assert_zero_rows(out, np.arange(query_start[-1], num_rows), "fp8 padding rows", seed)
    assert_close(out, want, dtype, what, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
@pytest.mark.parametrize("head_dim,group,window,soft_cap", LONG_PREFILL_CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_ragged_fp8_long_prefill_matches_reference(backend, head_dim, group, window, soft_cap,
                                                   dtype):
    seed = 800 + head_dim + group + (window or 0)
    _check_fp8_long(backend, seed, [1531, 700, 977, 0], [1000, 700, 1, 0], page=16, group=group,
                    head_dim=head_dim, dtype=dtype, window=window, soft_cap=soft_cap,
                    what=f"fp8 long prefill d{head_dim} g{group} w{window} cap{soft_cap}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
@pytest.mark.parametrize("page", [1, 4, 64, 256])
@pytest.mark.parametrize("head_dim,group,window", [(128, 4, None), (64, 1, 100), (128, 2, 200)])
def test_ragged_fp8_prefill_at_key_tile_edges(backend, page, head_dim, group, window):
    seed = 900 + page + head_dim + group + (window or 0)
    _check_fp8_long(backend, seed, [127, 128, 129, 257, 383, 640, 1],
                    [127, 1, 129, 130, 255, 384, 1], page=page, group=group, head_dim=head_dim, dtype=jnp.bfloat16, window=window,
                    soft_cap=None, what=f"fp8 tile edges p{page} d{head_dim} g{group} w{window}")


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("p", [127, 128, 132, 250])
@pytest.mark.parametrize("D", [64, 128])
def test_ragged_fp8_nan_across_key_tiles(backend, D, where, p):
    """A NaN byte row (0x7f) of kv head 0 at position p inside a 200-token chunk (positions
    100..299) of an fp8 cache: on the GPU the sm90 kernel, whose producer zeroes a NaN V chunk of
    a key that some rows of the work tile do not read and flags the key. Queries before p stay
    finite and match the oracle; those at or after it are non-finite; kv head 1 is untouched.
    Every slot no sequence owns is NaN too (base_batch)."""
    seed = 1000 + 2 * p + D + (where == "v")
    rng, k, v, table, lens = base_batch(seed, [300], head_dim=D)
    page, off = int(table[0, p // 16]), p % 16
    (k if where == "k" else v)[page, off, 0, :] = np.nan
    ks, vs = random_scales(rng, (2,)), random_scales(rng, (2,))
    k8, v8 = fp8_quantize_cache(k, ks), fp8_quantize_cache(v, vs)
    query_start = np.array([0, 200], np.int32)
    q = rng.standard_normal((200, 2 * 4, D)).astype(jnp.bfloat16)
    print(f"seed={seed} p={p} where={where} D={D}")
    out = to_f32(ops.ragged_paged_attention(*backend.put(q, k8, v8, table, lens, query_start),
                                            k_scale=backend.put(ks), v_scale=backend.put(vs)))
    first = p - 100  # the first query that reads position p
    assert not np.isfinite(out[first:, :4]).any(), f"readers must be non-finite (seed={seed})"
    assert np.isfinite(out[:first]).all(), f"earlier queries must stay finite (seed={seed})"
    assert np.isfinite(out[:, 4:]).all(), f"kv head 1 never reads it (seed={seed})"
    want = to_f32(reference("ragged_paged_attention", q, fp8_dequantize_cache(k8, ks),
                            fp8_dequantize_cache(v8, vs), table, lens, query_start))
    assert_close(out[:first], want[:first], jnp.bfloat16, "earlier queries", seed)
    assert_close(out[:, 4:], want[:, 4:], jnp.bfloat16, "kv head 1", seed)


# Shapes the decode kernel's fp8 fragment layouts depend on (head dims 64 / 128 / 256, GQA groups
# up to 16 so that rows 8..15 of the MMA tile carry queries, pages of 8 (tiles over two pages),
# split and unsplit grids, windows, a soft cap). Ragged calls run the same kernel for their decode
# rows.
FP8_DECODE_SHAPE_CASES = [
    Case("p16-d64-gqa16-split", 16, 64, 2, 16, batch=5, max_pages=24, num_tokens=64),
    Case("p8-d256-gqa1-split", 8, 256, 2, 1, batch=5, max_pages=40, num_tokens=64),
    Case("p16-d256-gqa16", 16, 256, 1, 16, batch=5, max_pages=5, num_tokens=64),
    Case("p8-d128-gqa16-window37", 8, 128, 1, 16, batch=6, max_pages=12, num_tokens=64,
         sliding_window=37),
    Case("p32-d128-gqa8-split", 32, 128, 2, 8, batch=5, max_pages=12, num_tokens=64),
    Case("p64-d128-gqa16-softcap-split", 64, 128, 1, 16, batch=5, max_pages=8, num_tokens=64,
         soft_cap=20.0),
    Case("p8-d64-gqa4-window300-split", 8, 64, 2, 4, batch=5, max_pages=60, num_tokens=64,
         sliding_window=300),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("op", ["paged", "ragged"])
@pytest.mark.parametrize("case", FP8_DECODE_SHAPE_CASES, ids=[c.id for c in FP8_DECODE_SHAPE_CASES])
def test_fp8_decode_kernel_shapes(backend, case, op, dtype):
    _check_fp8_decode(backend, case, op, dtype, seed=12)


# 512 rows of up to 2,048 tokens. Written for 3 fp8 CTAs per SM (396 slots on an H200: 396 rows
# whole, 116 split 3 ways); since the kernel fits 4 (528 slots) the 512 rows are one wave of
# whole rows, so this case no longer splits on an H200 (the split cases above and
# MANY_SPLITS below cover fp8 splits). GPU only: the CPU handler takes ~80 s for it.
MANY_ROWS_SPLIT = Case("many-rows-p16-d128-gqa4-split", 16, 128, 8, 4, batch=64, max_pages=128,
                       num_tokens=64)


# Five rows, the longest 9,600 tokens: every row split more than 32 ways (see
# test_attention.MANY_SPLITS_CASES). GPU only.
MANY_SPLITS = Case("many-splits-p16-d128-gqa4", 16, 128, 1, 4, batch=5, max_pages=600,
                   num_tokens=64)
LARGE_GRID_SEEDS = {MANY_ROWS_SPLIT: 13, MANY_SPLITS: 14}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
@pytest.mark.parametrize("op", ["paged", "ragged"])
@pytest.mark.parametrize("case", list(LARGE_GRID_SEEDS), ids=lambda c: c.id)
def test_fp8_decode_large_grids(backend, case, op):
    _check_fp8_decode(backend, case, op, jnp.bfloat16, seed=LARGE_GRID_SEEDS[case])


def _check_fp8_decode(backend, case, op, dtype, *, seed):
    """The fp8 decode kernel (paged, or ragged decode rows) against the reference on the
    dequantized cache; padded rows stay zero."""
    ragged = op == "ragged"
    b, q, k8, v8, kdq, vdq, ks, vs = fp8_batch(seed, case, dtype, ragged=ragged)
    idx = (b.page_table, b.seq_lens) + ((b.query_start,) if ragged else ())
    fn = ops.ragged_paged_attention if ragged else ops.paged_attention
    out = fn(*backend.put(q, k8, v8, *idx), layer=b.layer, k_scale=backend.put(ks),
             v_scale=backend.put(vs), **case.attrs())
    want = reference("ragged_paged_attention" if ragged else "paged_attention", q, kdq, vdq, *idx,
                     layer=b.layer, **case.attrs())
    assert_zero_rows(out, b.zero_rows, f"fp8 {op} padded rows", seed)
    assert_close(out, want, dtype, f"{op} fp8[{case.id}]", seed)


def fp8_poisoned_batch(seed, D, page, lens, window, num_kv_heads, group):
    """fp8 caches whose every slot that is not a token of some sequence is NaN (0x7f: the null
    page, tails, pages before a window, whose table entries point at the null page)."""
    rng, k, v, table, lens = base_batch(seed, lens, window, page=page, head_dim=D,
                                        num_kv_heads=num_kv_heads)
    ks, vs = random_scales(rng, (num_kv_heads,)), random_scales(rng, (num_kv_heads,))
    q = rng.standard_normal((len(lens), num_kv_heads * group, D)).astype(np.float32)
    return q, k, v, table, lens, ks, vs


def fp8_quantize_cache(x, scale):
    """[N, P, Hkv, D] float32 -> float8_e4m3fn with per-kv-head scales (NaN stays NaN)."""
    N, P, H, D = x.shape
    flat = x.transpose(2, 0, 1, 3).reshape(H, -1)
    return np_quantize(flat, scale).reshape(H, N, P, D).transpose(1, 2, 0, 3)


def fp8_dequantize_cache(x8, scale):
    N, P, H, D = x8.shape
    flat = x8.transpose(2, 0, 1, 3).reshape(H, -1)
    return np_dequantize(flat, scale).reshape(H, N, P, D).transpose(1, 2, 0, 3)


@pytest.mark.parametrize("grid", ["window", "split"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_fp8_decode_attended_nan_shows_and_nothing_else_leaks(backend, D, where, grid):
    """The non-finite rule on fp8 caches: a NaN byte in an attended K row makes the reading heads'
    rows NaN; one in V makes exactly that head-dim element of them NaN (the decode kernel's
    permuted output columns must put it back at its d); NaN bytes nobody reads never leak."""
    seed = 13
    G, hkv, page = 4, 2, 16
    if grid == "window":
        lens, window = [37, 50, 16, 0, 70], 40
    else:  # long rows, no window: a split grid on the GPU
        lens, window = [300, 517, 16, 0, 700], None
    q, k, v, table, lens, ks, vs = fp8_poisoned_batch(seed, D, page, lens, window, hkv, G)
    d_bad = D // 2 + 5
    page_bad, off_bad = int(table[1, 30 // page]), 30 % page  # row 1 attends to position 30
    (k if where == "k" else v)[page_bad, off_bad, 0, d_bad] = np.nan
    k8, v8 = fp8_quantize_cache(k, ks), fp8_quantize_cache(v, vs)
    qb = q.astype(jnp.bfloat16)
    out = to_f32(ops.paged_attention(*backend.put(qb, k8, v8, table, lens),
                                     k_scale=backend.put(ks), v_scale=backend.put(vs),
                                     sliding_window=window))
    bad_heads = out[1, :G]  # the query heads reading kv head 0
    if where == "k":
        assert np.isnan(bad_heads).all(), f"row 1 must be NaN (D={D}, seed={seed})"
    else:
        assert np.isnan(bad_heads[:, d_bad]).all(), f"row 1 dim {d_bad} must be NaN (seed={seed})"
        others = np.delete(bad_heads, d_bad, axis=1)
        assert np.isfinite(others).all(), (
            f"row 1: NaN outside dim {d_bad} at "
            f"{np.argwhere(~np.isfinite(others)).tolist()[:4]} (D={D}, seed={seed})")
    clean = (k8 if where == "k" else v8).copy()
    clean[page_bad, off_bad, 0, d_bad] = 0
    k_clean, v_clean = (clean, v8) if where == "k" else (k8, clean)
    want = reference("paged_attention", qb, fp8_dequantize_cache(k_clean, ks),
                     fp8_dequantize_cache(v_clean, vs), table, lens, sliding_window=window)
    keep = np.ones(out.shape[:2], bool)
    keep[1, :G] = False
    assert_close(out[keep], want[keep], jnp.bfloat16, "rows that do not read the poison", seed)
    assert (out[3] == 0).all()


@pytest.mark.parametrize("op", ["paged", "ragged"])
def test_reference_fp8_path_matches_dequantized(op):
    """The reference's own fp8 path (dequantize on load) against itself on dequantized caches."""
    case = DECODE_CASES[-1] if op == "paged" else RAGGED_CASES[-1]  # with a layer axis
    seed = 7
    b, q, k8, v8, kdq, vdq, ks, vs = fp8_batch(seed, case, jnp.float32, ragged=op == "ragged")
    extra = (b.query_start,) if op == "ragged" else ()
    fn = ref.ragged_paged_attention if op == "ragged" else ref.paged_attention
    # jitted (op by op the reference spends seconds dispatching small ops); both sides alike
    fn = jax.jit(fn, static_argnames=("layer", *case.attrs()))
    j = jnp.asarray
    idx = (j(b.page_table), j(b.seq_lens)) + tuple(j(x) for x in extra)
    got = fn(j(q), j(k8), j(v8), *idx, layer=b.layer, k_scale=j(ks), v_scale=j(vs),
             **case.attrs())
    want = fn(j(q), j(kdq), j(vdq), *idx, layer=b.layer, **case.attrs())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_write_then_attend_traced_layer_in_scan(backend, dtype):
    """write_kv quantizes, attention dequantizes, inside lax.scan with a traced layer and traced
    scales; against the reference doing the same on the CPU."""
    seed = 9
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    L, N, P, Hkv, G, D, B = 3, 9, 16, 2, 4, 64, 4
    seq_lens = np.array([5, 16, 33, 0], np.int32)
    page_table = np.array([[1, 0, 0], [2, 0, 0], [3, 4, 5], [0, 0, 0]], np.int32)
    kc = np.zeros((L, N, P, Hkv, D), FP8)
    slots = np.array([1 * P + 4, 2 * P + 15, 5 * P + 0, -1], np.int32)
    # Context already in the cache: random fp8 values.
    kc[:, 1:6] = (rng.standard_normal((L, 5, P, Hkv, D)) * 20).astype(FP8)
    vc = kc[:, :, :, :, ::-1].copy()
    q = rng.standard_normal((L, B, Hkv * G, D)).astype(dtype)
    k = rng.standard_normal((L, B, Hkv, D)).astype(dtype)
    v = rng.standard_normal((L, B, Hkv, D)).astype(dtype)
    ks, vs = random_scales(rng, (L, Hkv)), random_scales(rng, (L, Hkv))

    def model(write_kv, attention):
        def run(kc, vc, q, k, v, ks, vs):
            def body(caches, xs):
                layer, q_l, k_l, v_l = xs
                caches = write_kv(*caches, k_l, v_l, slots, layer=layer, k_scale=ks, v_scale=vs)
                out = attention(q_l, *caches, page_table, seq_lens, layer=layer, k_scale=ks,
                                v_scale=vs)
                return caches, out
            return jax.lax.scan(body, (kc, vc), (jnp.arange(L, dtype=jnp.int32), q, k, v))
        return jax.jit(run)

    (k_out, v_out), outs = model(ops.write_kv, ops.paged_attention)(
        *backend.put(kc, vc, q, k, v, ks, vs))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        (want_k, want_v), want = model(ref.write_kv, ref.paged_attention)(kc, vc, q, k, v, ks, vs)
    same_bytes(k_out, want_k, "k_cache", seed)
    same_bytes(v_out, want_v, "v_cache", seed)
    for l in range(L):
        assert_zero_rows(outs[l], [3], "padded row", seed)
        assert_close(outs[l], to_f32(want[l]), dtype, f"layer {l}", seed)


# ---------------------------------------------------------------------------------------------
# Bad scales.


def _fp8_args(num_layers=None):
    lead = (num_layers,) if num_layers else ()
    kc = jnp.zeros(lead + (4, 8, 2, 64), jnp.float8_e4m3fn)
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    pt = jnp.zeros((2, 3), jnp.int32)
    sl = jnp.array([3, 0], jnp.int32)
    k = jnp.zeros((3, 2, 64), jnp.bfloat16)
    slots = jnp.arange(3, dtype=jnp.int32)
    scale = jnp.ones(lead + (2,), jnp.float32)
    return kc, q, pt, sl, k, slots, scale


@pytest.mark.parametrize("what", ["missing", "wrong_shape", "wrong_dtype", "layerless_for_layers",
                                  "on_bf16_cache", "fp8_q", "fp8_k"])
@pytest.mark.parametrize("op", ["write_kv", "paged", "ragged"])
def test_bad_scales_raise_naming_the_argument(op, what):
    layers = 2 if what == "layerless_for_layers" else None
    kc, q, pt, sl, k, slots, scale = _fp8_args(layers)
    layer = 0 if layers else None
    ks = vs = scale
    exc, name = ValueError, "k_scale"
    if what == "missing":
        ks = None
    elif what == "wrong_shape":
        vs, name = jnp.ones((3,), jnp.float32), "v_scale"
    elif what == "wrong_dtype":
        ks, exc = scale.astype(jnp.bfloat16), TypeError
    elif what == "layerless_for_layers":
        ks = jnp.ones((2,), jnp.float32)
    elif what == "on_bf16_cache":
        kc = kc.astype(jnp.bfloat16)
    elif what == "fp8_q":
        if op == "write_kv":
            pytest.skip("write_kv has no q")
        q, exc, name = q.astype(jnp.float8_e4m3fn), TypeError, "q dtype"
    elif what == "fp8_k":
        if op != "write_kv":
            pytest.skip("only write_kv takes k")
        k, exc, name = k.astype(jnp.float8_e4m3fn), TypeError, "k dtype"
    with pytest.raises(exc, match=name):
        if op == "write_kv":
            ops.write_kv(kc, kc, k, k, slots, layer=layer, k_scale=ks, v_scale=vs)
        elif op == "paged":
            ops.paged_attention(q, kc, kc, pt, sl, layer=layer, k_scale=ks, v_scale=vs)
        else:
            ops.ragged_paged_attention(q, kc, kc, pt, sl, jnp.array([0, 1, 1], jnp.int32),
                                       layer=layer, k_scale=ks, v_scale=vs)


# ---------------------------------------------------------------------------------------------
# Through the manager: fp8 pools, the concat codec and the host tier move them byte-exactly.


def test_manager_fp8_pools_suspend_resume_byte_identical():
    from jax_kvcm import KVCacheConfig, KVCacheManager, LayerGroupConfig, SuspendResult
    seed = 3
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    L, Hkv, D, P = 2, 2, 64, 16
    group = LayerGroupConfig(L, Hkv, D, dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn)
    config = KVCacheConfig(tokens_per_page=P, layer_groups=(group,), device_pages=8,
                           host_bytes=8 * 2 * L * P * Hkv * D, max_batch=4,
                           max_tokens_per_step=64, max_seq_len=128)
    mgr = KVCacheManager(config)
    (k_pool, v_pool), = mgr.caches
    assert k_pool.dtype == v_pool.dtype == FP8
    ks, vs = random_scales(rng, (L, Hkv)), random_scales(rng, (L, Hkv))
    seq = mgr.add_sequence(list(range(40)))
    batch = mgr.prepare_step([(seq, 40)])
    slots = jnp.asarray(batch.slot_mapping)
    new_k = rng.standard_normal((L, slots.shape[0], Hkv, D)).astype(jnp.bfloat16)
    new_v = rng.standard_normal((L, slots.shape[0], Hkv, D)).astype(jnp.bfloat16)

    @jax.jit
    def step(k_pool, v_pool):
        for layer in range(L):
            k_pool, v_pool = ops.write_kv(k_pool, v_pool, new_k[layer], new_v[layer], slots,
                                          layer=layer, k_scale=ks, v_scale=vs)
        return k_pool, v_pool

    k_pool, v_pool = step(k_pool, v_pool)
    mgr.complete_step([(k_pool, v_pool)])
    pages = seq.page_ids().copy()
    before = [np.asarray(x)[:, pages].copy() for x in mgr.caches[0]]
    q = rng.standard_normal((1, Hkv * 2, D)).astype(jnp.bfloat16)

    def attend():
        (kp, vp), = mgr.caches
        table = np.zeros((1, 8), np.int32)
        table[0, :len(seq.page_ids())] = seq.page_ids()
        return np.asarray(ops.paged_attention(q, kp, vp, table, np.array([40], np.int32),
                                              layer=1, k_scale=ks, v_scale=vs), np.float32)

    out_before = attend()
    assert mgr.suspend(seq) is SuspendResult.SUSPENDED
    assert mgr.resume(seq) is True
    after = [np.asarray(x)[:, seq.page_ids()] for x in mgr.caches[0]]
    for a, b_, name in zip(after, before, ("k", "v")):
        assert_bits_equal(a.view(np.uint8), b_.view(np.uint8), f"{name} pages after resume",
                          seed)
    np.testing.assert_array_equal(attend(), out_before)
