"""The non-finite rule, the same on the CPU handler, the CUDA kernels and the reference:

- a NaN or inf in a K or V row that a query attends to makes that query's output non-finite
  (never a silent finite row; a non-finite q.k gives NaN even under a soft cap);
- garbage (NaN, inf) in slots no query reads -- the null page, the tail of a sequence's last page,
  positions before a window, pages no table references -- never reaches any output.

Per query all three are exact (a position masked for a query never affects it), including the
CUDA tensor-core prefill kernel (bf16 here), whose CTAs share K/V tiles between queries.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, cdiv, reference, to_f32
from jax_kvcm import ops

P, D, HKV, G = 16, 64, 2, 4
BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def base_batch(seed, seq_lens, window=None, *, page=P, head_dim=D, num_kv_heads=HKV):
    """float32 caches: every slot that is not a token of some sequence holds NaN (null page,
    tails, unreferenced pages); pages wholly before each row's window are NaN too and their
    table entries point at the null page (as a window manager releases them). Returns the
    generator (for further draws), k, v, the page table and the lengths."""
    rng = np.random.default_rng(seed)
    P, D, HKV = page, head_dim, num_kv_heads
    B = len(seq_lens)
    width = max(cdiv(n, P) for n in seq_lens)
    num_pages = 1 + B * width + 1
    k = np.full((num_pages, P, HKV, D), np.nan, np.float32)
    v = np.full((num_pages, P, HKV, D), np.nan, np.float32)
    table = np.zeros((B, width), np.int32)
    nxt = 1
    for b, n in enumerate(seq_lens):
        for i in range(cdiv(n, P)):
            table[b, i] = nxt
            rows = min(P, n - i * P)
            k[nxt, :rows] = rng.standard_normal((rows, HKV, D))
            v[nxt, :rows] = rng.standard_normal((rows, HKV, D))
            nxt += 1
        if window is not None:
            table[b, :max(0, n - window) // P] = 0
    return rng, k, v, table, np.asarray(seq_lens, np.int32)


def slot(table, b, pos):
    return int(table[b, pos // P]), pos % P


@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("bad", list(BAD))
def test_decode_attended_nonfinite_shows_and_nothing_else_leaks(backend, dtype_f32_bf16, bad,
                                                                where, soft_cap):
    dtype = dtype_f32_bf16
    seed = 3
    lens = [37, 50, 16, 0, 70]
    window = 40
    rng, k, v, table, lens = base_batch(seed, lens, window)
    # Row 1 attends to position 30 (in its window [10, 50)): poison one element there.
    page, off = slot(table, 1, 30)
    (k if where == "k" else v)[page, off, 0, 5] = BAD[bad]
    q = rng.standard_normal((len(lens), HKV * G, D)).astype(np.float32)
    args = (q.astype(dtype), k.astype(dtype), v.astype(dtype), table, lens)
    out = to_f32(ops.paged_attention(*backend.put(*args), sliding_window=window,
                                     soft_cap=soft_cap))
    bad_heads = out[1, :G]  # the query heads reading kv head 0
    if where == "k":  # a non-finite q.k: the whole row is NaN
        assert np.isnan(bad_heads).all(), f"row 1 must be NaN (seed={seed})"
    else:  # a non-finite V element: that output element of every reading head
        assert not np.isfinite(bad_heads[:, 5]).any(), f"row 1 dim 5 must be non-finite (seed={seed})"
    # Everything else is finite and right (the garbage in tails, the null page, released pages
    # and unreferenced pages never leaks).
    clean_k, clean_v = k.copy(), v.copy()
    (clean_k if where == "k" else clean_v)[page, off, 0, 5] = 0.0
    want = reference("paged_attention", args[0], clean_k.astype(dtype), clean_v.astype(dtype),
                     table, lens, sliding_window=window, soft_cap=soft_cap)
    keep = np.ones(out.shape[:2], bool)
    keep[1, :G] = False
    assert_close(out[keep], want[keep], dtype, "rows that do not read the poison", seed)
    assert (out[3] == 0).all()
    # The reference follows the same rule.
    got_ref = reference("paged_attention", *args, sliding_window=window, soft_cap=soft_cap)
    assert np.array_equal(np.isfinite(got_ref), np.isfinite(out)), "reference disagrees"


@pytest.fixture(params=[jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def dtype_f32_bf16(request):
    return jnp.dtype(request.param)


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("where", ["k", "v"])
def test_ragged_masked_future_nonfinite_stays_masked(backend, where, dtype, bad):
    """A NaN at position p of a prefill chunk: queries at positions < p never read it (bf16 runs
    the CUDA tensor-core prefill kernel, float32 the CUDA-core one)."""
    seed = 5
    lens = [40, 23]
    rng, k, v, table, lens = base_batch(seed, lens)
    p = 35  # sequence 0's queries are positions 20..39; 20..34 must stay finite
    page, off = slot(table, 0, p)
    (k if where == "k" else v)[page, off, 1, :] = BAD[bad]
    query_start = np.array([0, 20, 43], np.int32)
    q = rng.standard_normal((45, HKV * G, D)).astype(np.float32)
    args = (q.astype(dtype), k.astype(dtype), v.astype(dtype), table, lens, query_start)
    out = to_f32(ops.ragged_paged_attention(*backend.put(*args)))
    want = to_f32(reference("ragged_paged_attention", *args))
    readers = slice(15, 20)  # positions 35..39, kv head 1 -> heads 4..7
    for got, name in ((out, backend.name), (want, "reference")):
        assert not np.isfinite(got[readers, G:]).any(), f"{name}: readers must be non-finite"
        assert np.isfinite(got[:, :G]).all(), f"{name}: kv head 0 never reads it"
        assert np.isfinite(got[20:]).all(), f"{name}: sequence 1 never reads it"
    for got, name in ((out, backend.name), (want, "reference")):
        assert np.isfinite(got[:15]).all(), f"{name}: earlier queries must stay finite"
    assert_close(out[:15], want[:15], dtype, "earlier queries", seed)


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("p", [127, 128, 132, 250])
def test_ragged_nonfinite_across_key_tiles(backend, where, p):
    """A NaN row of kv head 0 at position p inside a 200-token chunk (positions 100..299, head_dim
    128, bf16: on the GPU the sm90 kernel, whose CTAs hold 32 tokens of G = 4 heads and read
    128-key tiles). p is the last / first key of a tile or inside one; CTAs whose tile holding p
    is read only in part by their rows (the producer's scan) must keep the rows before p finite
    and make those at or after it non-finite; every other CTA reads p whole or not at all.
    p = 132 is the key right after the first work tile's last row (131), in that row's 16-key
    step, which the work tile's last P V GEMM multiplies by P = 0: the kernel's copy of it must
    be the zero fill, not the NaN."""
    seed = 7 + p
    rng, k, v, table, lens = base_batch(seed, [300], head_dim=128)
    page, off = slot(table, 0, p)
    (k if where == "k" else v)[page, off, 0, :] = np.nan
    query_start = np.array([0, 200], np.int32)
    q = rng.standard_normal((200, HKV * G, 128)).astype(np.float32)
    args = (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), table, lens,
            query_start)
    out = to_f32(ops.ragged_paged_attention(*backend.put(*args)))
    want = to_f32(reference("ragged_paged_attention", *args))
    first = p - 100  # the first query (row of the chunk) that reads position p
    for got, name in ((out, backend.name), (want, "reference")):
        assert not np.isfinite(got[first:, :G]).any(), f"{name}: readers must be non-finite"
        assert np.isfinite(got[:first]).all(), f"{name}: earlier queries must stay finite"
        assert np.isfinite(got[:, G:]).all(), f"{name}: kv head 1 never reads it"
    assert_close(out[:first], want[:first], jnp.bfloat16, "earlier queries", seed)
    assert_close(out[:, G:], want[:, G:], jnp.bfloat16, "kv head 1", seed)


def test_reference_masked_nan_does_not_poison():
    """The issue's case on the reference alone: NaN V at a masked future position, decode row
    reading only the past (a window) and ragged rows before it."""
    seed = 6
    rng, k, v, table, lens = base_batch(seed, [30])
    page, off = slot(table, 0, 29)
    v[page, off] = np.nan
    q = rng.standard_normal((30, HKV * G, D)).astype(np.float32)
    out = reference("ragged_paged_attention", q, k, v, table, lens,
                    np.array([0, 30], np.int32))
    assert np.isfinite(out[:29]).all() and np.isnan(out[29]).all()


@pytest.mark.parametrize("p", [50, 140])
@pytest.mark.parametrize("kind", ["k-inf", "k-overflow", "q-overflow"])
def test_ragged_minus_inf_logits_in_wholly_read_key_tiles(backend, kind, p):
    """A q.k of -inf at one key of a row whose other logits are finite (exp2 alone would weigh it
    0 and leave the row finite), in key tiles that later CTAs of a 200-token chunk read whole
    (on the GPU the sm90 kernel's unmasked path, which no other test reaches with a -inf q.k):
    - k-inf: one +inf element of K at position p (kv head 0), read with random-sign q;
    - k-overflow: a finite 1e30 there and kv head 0's q scaled by 1e12 (q.k overflows float32);
    - q-overflow: 1e30 in one q element of query p + 60's first head, K's element there -1e9 at
      position p (not large) and negative elsewhere: only key p's q.k overflows, to -inf.
    The reference's NaN rows are exactly the NaN rows and include such rows; every other row is
    finite and right. At p = 140, k-overflow's rows before p read only finite logits of ~1e13:
    the sm90 soft-max once made about half of them NaN (its exp2 argument, s * scale minus a
    rounded m * scale, came out up to half an ulp, ~6e4, above 0)."""
    seed = 11 + p
    rng, k, v, table, lens = base_batch(seed, [300], head_dim=128)
    q = rng.standard_normal((200, HKV * G, 128)).astype(np.float32)
    page, off = slot(table, 0, p)
    readers = np.zeros(q.shape[:2], bool)  # rows reading the poisoned q.k
    if kind == "q-overflow":
        k[..., 0, 5] = -np.abs(k[..., 0, 5])  # (NaN slots stay NaN)
        k[page, off, 0, 5] = -1e9
        q[p + 60 - 100, 0, 5] = 1e30
        readers[p + 60 - 100, 0] = True
        minus_inf = readers
    else:
        k[page, off, 0, 5] = np.inf if kind == "k-inf" else 1e30
        if kind == "k-overflow":
            q[:, :G] *= 1e12
        readers[max(0, p - 100):, :G] = True  # queries at positions >= p, kv head 0
        minus_inf = readers & (q[:, :, 5] < 0)
    query_start = np.array([0, 200], np.int32)
    args = (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), table, lens,
            query_start)
    out = to_f32(ops.ragged_paged_attention(*backend.put(*args)))
    want = to_f32(reference("ragged_paged_attention", *args))
    nan_rows = np.isnan(want).all(axis=-1)
    assert not (nan_rows & ~readers).any(), f"reference: NaN outside the readers (seed={seed})"
    assert (nan_rows & minus_inf).sum() >= min(8, minus_inf.sum()), (
        f"reference: too few rows with a -inf q.k, the case is not exercised (seed={seed})")
    missed = int((~np.isnan(out[nan_rows]).all(axis=-1)).sum())
    assert missed == 0, f"{backend.name}: {missed} rows with an inf q.k are not NaN (seed={seed})"
    assert np.isfinite(out[~nan_rows]).all(), f"{backend.name}: other rows not finite (seed={seed})"
    if kind == "k-overflow":  # kv head 0's logits are ~1e13 there: only kv head 1 compares well
        assert_close(out[:, G:], want[:, G:], jnp.bfloat16, "kv head 1", seed)
    else:
        assert_close(out[~nan_rows], want[~nan_rows], jnp.bfloat16, "rows without an inf q.k",
                     seed)
