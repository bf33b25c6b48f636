"""Ring page tables (``ring_table=True``): position p of row b lives in page
``page_table[b, (p // page_size) % R]``, R = the table width, for sliding-window layer groups
whose table holds only the pages a window can see.

Oracle: the reference run with the equivalent *absolute* table (pages that left the ring point at
the null page there and are NaN in the cache, as if reused), independent of the ring indexing.
The reference's own ring path is checked against the same oracle. CPU and ``gpu`` backends.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import (DTYPES, K_POISON, NULL_PAGE, V_POISON, assert_close, assert_zero_rows,
                      cdiv, reference)
from jax_kvcm import ops

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

# (id, page_size, head_dim, num_kv_heads, group, window, max_new, num_layers)
RING_CASES = [
    ("p16-d128-gqa4-w40", 16, 128, 2, 4, 40, 1, None),
    ("p8-d64-gqa1-w8", 8, 64, 2, 1, 8, 1, None),
    ("p32-d256-gqa8-w100", 32, 256, 1, 8, 100, 1, None),
    ("p64-d64-gqa4-w64", 64, 64, 2, 4, 64, 1, 2),
    ("p16-d64-gqa2-w1", 16, 64, 2, 2, 1, 1, None),
    ("p16-d128-gqa4-w33-chunks", 16, 128, 2, 4, 33, 20, None),
    ("p32-d64-gqa1-w50-chunks-layers", 32, 64, 2, 1, 50, 40, 3),
]


def ring_batch(seed, case, dtype, ragged):
    """(q, k_cache, v_cache, ring_table, abs_table, seq_lens, query_start, layer, zero_rows)."""
    _, P, D, Hkv, G, W, max_new, L = case
    rng = np.random.default_rng(seed)
    R = cdiv(W + max_new - 1, P) + 1
    B = 7
    lens = rng.integers(1, 7 * R * P, size=B)
    lens[0], lens[1] = R * P * 3, 1  # an exact multiple of the ring, one token
    new = np.ones(B, np.int64)
    if ragged:
        new = np.minimum(rng.integers(0, max_new + 1, size=B), lens)
        new[2] = 0  # a cached sequence with no query this step
    else:
        lens[2] = 0  # a padded decode row
        new[2] = 0
    layers = L or 1
    abs_pages = [cdiv(int(n), P) for n in lens]
    num_pages = 1 + sum(abs_pages) + 2
    shape = (layers, num_pages, P, Hkv, D)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    k[:, NULL_PAGE], v[:, NULL_PAGE] = K_POISON, V_POISON
    ring = np.full((B, R), NULL_PAGE, np.int32)
    width = max(abs_pages)
    absolute = np.full((B, width), NULL_PAGE, np.int32)
    perm = rng.permutation(np.arange(1, num_pages, dtype=np.int32))
    used = 0
    for b in range(B):
        n, q_new = int(lens[b]), int(new[b])
        phys = perm[used:used + abs_pages[b]]
        used += abs_pages[b]
        first_pos = max(0, n - max(q_new, 1) + 1 - W)
        first_page, end_page = first_pos // P, cdiv(n, P)
        for i in range(first_page, end_page):  # pages still in the ring; older ones were reused
            ring[b, i % R] = phys[i]
            absolute[b, i] = phys[i]
            k[:, phys[i]], v[:, phys[i]] = K_POISON, V_POISON
            for pos in range(i * P, min(n, (i + 1) * P)):
                k[:, phys[i], pos % P] = rng.standard_normal((layers, Hkv, D))
                v[:, phys[i], pos % P] = rng.standard_normal((layers, Hkv, D))
    if L is None:
        k, v = k[0], v[0]
    query_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    rows = int(query_start[-1]) + 2 if ragged else B
    q = rng.standard_normal((rows, Hkv * G, D)).astype(np.float32)
    layer = int(rng.integers(L)) if L else None
    zero_rows = np.arange(query_start[-1], rows) if ragged else np.flatnonzero(lens == 0)
    print(f"seed={seed} R={R} seq_lens={lens.tolist()} new={new.tolist()} layer={layer}")
    cast = lambda x: x.astype(dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), ring, absolute, lens.astype(np.int32),
            query_start if ragged else None, layer, zero_rows)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["paged", "ragged"])
@pytest.mark.parametrize("case", RING_CASES, ids=[c[0] for c in RING_CASES])
def test_ring_table_matches_absolute_reference(backend, case, op, dtype, seed):
    ragged = op == "ragged"
    if not ragged and case[6] > 1:
        pytest.skip("chunked cases are for the ragged op")
    q, k, v, ring, absolute, lens, qs, layer, zero_rows = ring_batch(seed, case, dtype, ragged)
    W = case[5]
    extra = (qs,) if ragged else ()
    name = "ragged_paged_attention" if ragged else "paged_attention"
    fn = getattr(ops, name)
    out = fn(*backend.put(q, k, v, ring, lens, *extra), layer=layer, sliding_window=W,
             ring_table=True)
    want = reference(name, q, k, v, absolute, lens, *extra, layer=layer, sliding_window=W)
    assert_zero_rows(out, zero_rows, "padded rows", seed)
    assert_close(out, want, dtype, f"{name} ring[{case[0]}]", seed)
    if backend.name == "cpu" and dtype == jnp.float32:  # the reference's ring path, too
        got = reference(name, q, k, v, ring, lens, *extra, layer=layer, sliding_window=W,
                        ring_table=True)
        assert_close(got, want, dtype, f"reference ring[{case[0]}]", seed)


@pytest.mark.parametrize("op", ["paged", "ragged"])
def test_ring_table_fp8(backend, op):
    """Ring tables over an fp8 cache (the decode kernel's fp8 tile path on the GPU)."""
    seed, case, ragged = 4, RING_CASES[0 if op == "paged" else 5], op == "ragged"
    q, k, v, ring, absolute, lens, qs, layer, zero_rows = ring_batch(seed, case, jnp.float32,
                                                                     ragged)
    q = q.astype(jnp.bfloat16)
    Hkv = case[3]
    ks = np.linspace(0.01, 0.03, Hkv).astype(np.float32)
    vs = np.linspace(0.02, 0.01, Hkv).astype(np.float32)
    k8 = np.clip(k / ks[:, None], -448, 448).astype(FP8)
    v8 = np.clip(v / vs[:, None], -448, 448).astype(FP8)
    kdq, vdq = k8.astype(np.float32) * ks[:, None], v8.astype(np.float32) * vs[:, None]
    extra = (qs,) if ragged else ()
    name = "ragged_paged_attention" if ragged else "paged_attention"
    out = getattr(ops, name)(*backend.put(q, k8, v8, ring, lens, *extra), sliding_window=case[5],
                             ring_table=True, k_scale=backend.put(ks), v_scale=backend.put(vs))
    want = reference(name, q, kdq, vdq, absolute, lens, *extra, sliding_window=case[5])
    assert_zero_rows(out, zero_rows, "padded rows", seed)
    assert_close(out, want, jnp.bfloat16, f"{name} fp8 ring", seed)


@pytest.mark.parametrize("op", ["paged", "ragged"])
def test_ring_too_small_for_the_window_is_refused_on_cpu(op):
    """The positions a row reads must span at most R pages; the CPU handler refuses more."""
    P, R, D = 16, 3, 64
    kc = jnp.zeros((8, P, 1, D), jnp.float32)
    q = jnp.zeros((2 if op == "paged" else 4, 1, D), jnp.float32)
    table = jnp.ones((2, R), jnp.int32)
    lens = jnp.array([200, 5], jnp.int32)
    kw = dict(sliding_window=3 * P, ring_table=True)  # needs 4 pages of ring
    with pytest.raises(Exception, match="ring_table"):
        if op == "paged":
            jnp.asarray(ops.paged_attention(q, kc, kc, table, lens, **kw)).block_until_ready()
        else:
            jnp.asarray(ops.ragged_paged_attention(q, kc, kc, table, lens,
                                                   jnp.array([0, 2, 4], jnp.int32), **kw))
    # The same with a window that fits: accepted, and seq_lens past R * P is fine for a ring.
    ok = ops.paged_attention(q[:2], kc, kc, table, lens, sliding_window=2 * P, ring_table=True)
    assert np.isfinite(np.asarray(ok)).all()


def test_ring_table_must_be_a_bool():
    kc = jnp.zeros((4, 16, 1, 64), jnp.float32)
    with pytest.raises(TypeError, match="ring_table"):
        ops.paged_attention(jnp.zeros((1, 1, 64)), kc, kc, jnp.zeros((1, 2), jnp.int32),
                            jnp.ones((1,), jnp.int32), ring_table=1)


def test_reference_ring_without_window_equals_absolute():
    """A ring as wide as the absolute table, no window: the same attention (no wrap-around)."""
    seed = 2
    rng = np.random.default_rng(seed)
    P, D, pages = 8, 64, 5
    kc = rng.standard_normal((12, P, 2, D)).astype(np.float32)
    vc = rng.standard_normal((12, P, 2, D)).astype(np.float32)
    table = np.array([[3, 4, 5, 6, 7], [8, 9, 1, 0, 0]], np.int32)
    lens = np.array([37, 20], np.int32)
    q = rng.standard_normal((2, 4, D)).astype(np.float32)
    a = reference("paged_attention", q, kc, vc, table, lens, ring_table=True)   # jitted
    b = reference("paged_attention", q, kc, vc, table, lens)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert pages == table.shape[1]
