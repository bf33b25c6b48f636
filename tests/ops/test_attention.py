"""paged_attention (decode) and ragged_paged_attention (prefill / mixed) against the reference.

Caches come from :func:`conftest.make_caches`: unreferenced pages are NaN, the null page and unused
tail slots hold finite poison, so reading a wrong page, position or layer shows up as a mismatch.
Also: write_kv + attention inside ``lax.scan`` over layers with a traced layer index, and
fixed-shape jitted steps that must compile once over 50 calls.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (DTYPES, SEEDS, assert_close, assert_zero_rows, cdiv, flat_slots,
                      make_caches, random_page_table, reference, to_f32)
from jax_kvcm import ops


@dataclass(frozen=True)
class Case:
    id: str
    page_size: int
    head_dim: int
    num_kv_heads: int
    group: int  # GQA ratio H / Hkv
    batch: int
    max_pages: int
    num_tokens: int = 0  # ragged only: rows of q (fixed per case, so seeds share one compile)
    num_layers: int | None = None
    sliding_window: int | None = None
    soft_cap: float | None = None
    scale: float | None = None
    # Point page-table entries of pages wholly before the window at the null page (what a bounded
    # sliding-window page manager does once pages leave the window).
    null_out_of_window: bool = False

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def capacity(self) -> int:
        return self.max_pages * self.page_size

    @property
    def num_pages(self) -> int:
        return self.batch * self.max_pages + 3  # null page + every row full + 2 NaN spares

    def attrs(self) -> dict:
        return dict(scale=self.scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap)


DECODE_CASES = [
    Case("p8-d64-gqa1", 8, 64, 2, 1, batch=7, max_pages=6),
    Case("p16-d128-gqa4", 16, 128, 2, 4, batch=6, max_pages=5),
    Case("p32-d256-gqa8", 32, 256, 1, 8, batch=6, max_pages=4),
    Case("p128-d64-gqa4", 128, 64, 2, 4, batch=6, max_pages=3),
    Case("p64-d128-gqa1-window70", 64, 128, 4, 1, batch=6, max_pages=3, sliding_window=70),
    Case("p8-d64-gqa8-window1", 8, 64, 1, 8, batch=6, max_pages=4, sliding_window=1),
    Case("p16-d64-gqa4-softcap-scale", 16, 64, 2, 4, batch=6, max_pages=4, soft_cap=8.0,
         scale=0.5),
    Case("p32-d128-gqa4-window40-nulled", 32, 128, 2, 2, batch=6, max_pages=5, sliding_window=40,
         null_out_of_window=True),
    Case("layers3-p16-d64-gqa4", 16, 64, 2, 4, batch=6, max_pages=4, num_layers=3),
    # G > 8: the decode kernel's two 8-head column tiles (a full and a partial second one).
    Case("p16-d128-gqa16", 16, 128, 1, 16, batch=5, max_pages=4),
    Case("p32-d64-gqa12", 32, 64, 2, 12, batch=5, max_pages=3),
    # batch * Hkv >= 4 waves of the decode kernel's CTAs on an H200 (PlanDecode: whole rows and
    # a split tail).
    Case("many-rows-p16-d128-gqa4", 16, 128, 2, 4, batch=1000, max_pages=3),
]

RAGGED_CASES = [
    Case("p8-d64-gqa1", 8, 64, 2, 1, batch=7, max_pages=6, num_tokens=96),
    Case("p16-d128-gqa4", 16, 128, 2, 4, batch=7, max_pages=4, num_tokens=128),
    Case("p32-d256-gqa8", 32, 256, 1, 8, batch=6, max_pages=3, num_tokens=160),
    Case("p64-d64-gqa2-window50", 64, 64, 2, 2, batch=6, max_pages=3, num_tokens=200,
         sliding_window=50),
    Case("p128-d128-gqa1-softcap-scale", 128, 128, 2, 1, batch=6, max_pages=2, num_tokens=200,
         soft_cap=6.0, scale=0.3),
    Case("p8-d128-gqa4-window1", 8, 128, 1, 4, batch=6, max_pages=6, num_tokens=80,
         sliding_window=1),
    Case("layers3-p16-d64-gqa4-window20-nulled", 16, 64, 2, 4, batch=7, max_pages=4,
         num_tokens=100, num_layers=3, sliding_window=20, null_out_of_window=True),
]


# ---------------------------------------------------------------------------------------------
# Batch generators.


def decode_seq_lens(rng, case: Case) -> np.ndarray:
    """0 (padded row), 1, exact page multiples (one page, full capacity) and random lengths."""
    special = [0, 1, case.page_size, case.capacity]
    rest = rng.integers(1, case.capacity + 1, size=case.batch - len(special))
    lens = np.concatenate([special, rest]).astype(np.int32)
    rng.shuffle(lens)
    return lens


def ragged_layout(rng, case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(seq_lens [B], num_new [B]) mixing decode rows, whole prefills, chunked prefills, sequences
    with no new tokens and padded sequences; at least one trailing padding row in q."""
    cap, page = case.capacity, case.page_size
    kinds = ["decode", "prefill_pages", "chunk", "empty", "pad"]
    kinds += list(rng.choice(["decode", "prefill", "chunk", "empty"], size=case.batch - len(kinds)))
    rng.shuffle(kinds)
    seq_lens, num_new = [], []
    for kind in kinds:
        if kind == "decode":
            total, n = rng.integers(1, cap + 1), 1
        elif kind == "prefill_pages":  # exact page multiple
            total = page * rng.integers(1, case.max_pages + 1)
            n = total
        elif kind == "prefill":
            total = rng.choice([1, rng.integers(1, cap + 1)])
            n = total
        elif kind == "chunk":
            ctx = rng.integers(1, cap - 1)
            n = rng.integers(2, cap - ctx + 1)
            total = ctx + n
        elif kind == "empty":  # cached sequence with no new token this step
            total, n = rng.integers(1, cap + 1), 0
        else:  # padded sequence
            total, n = 0, 0
        seq_lens.append(int(total))
        num_new.append(int(n))
    num_new = np.array(num_new)
    budget = case.num_tokens - 1 - int(rng.integers(0, 4))  # keep >= 1 trailing padding row
    while num_new.sum() > budget:
        i = int(num_new.argmax())
        num_new[i] = max(1, num_new[i] - (num_new.sum() - budget))
    return np.array(seq_lens, np.int32), num_new.astype(np.int32)


def null_out_of_window_pages(page_table, seq_lens, num_new, case: Case) -> np.ndarray:
    """Entries of pages wholly before the first position any query of the row can see -> 0."""
    table = page_table.copy()
    for b, (total, n) in enumerate(zip(seq_lens, num_new)):
        first_visible = max(0, int(total) - max(int(n), 1) + 1 - case.sliding_window)
        table[b, :first_visible // case.page_size] = 0
    return table


@dataclass
class Batch:
    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    page_table: np.ndarray
    seq_lens: np.ndarray
    query_start: np.ndarray | None
    layer: int | None
    zero_rows: np.ndarray  # rows of the output that must be exactly zero


def make_batch(seed: int, case: Case, dtype, ragged: bool) -> Batch:
    rng = np.random.default_rng(seed)
    if ragged:
        seq_lens, num_new = ragged_layout(rng, case)
        query_start = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
        num_rows = case.num_tokens
        zero_rows = np.arange(query_start[-1], num_rows)
    else:
        seq_lens = decode_seq_lens(rng, case)
        num_new = np.ones_like(seq_lens)
        query_start = None
        num_rows = case.batch
        zero_rows = np.flatnonzero(seq_lens == 0)
    page_table = random_page_table(rng, seq_lens, case.page_size, case.max_pages, case.num_pages)
    k_cache, v_cache = make_caches(rng, case.num_layers, case.num_pages, case.page_size,
                                   case.num_kv_heads, case.head_dim, page_table, seq_lens)
    if case.null_out_of_window:
        page_table = null_out_of_window_pages(page_table, seq_lens, num_new, case)
    q = rng.standard_normal((num_rows, case.num_heads, case.head_dim)).astype(np.float32)
    layer = int(rng.integers(case.num_layers)) if case.num_layers else None
    print(f"seed={seed} seq_lens={seq_lens.tolist()} "
          f"query_start={None if query_start is None else query_start.tolist()} layer={layer}")
    cast = lambda x: x.astype(dtype)  # noqa: E731
    return Batch(cast(q), cast(k_cache), cast(v_cache), page_table, seq_lens, query_start, layer,
                 zero_rows)


# ---------------------------------------------------------------------------------------------
# Op vs reference.


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.id for c in DECODE_CASES])
def test_paged_attention_matches_reference(backend, case, dtype, seed):
    _check_paged_attention(backend, case, dtype, seed)


def _check_paged_attention(backend, case, dtype, seed):
    b = make_batch(seed, case, dtype, ragged=False)
    args = (b.q, b.k_cache, b.v_cache, b.page_table, b.seq_lens)
    out = ops.paged_attention(*backend.put(*args), layer=b.layer, **case.attrs())
    assert out.dtype == dtype and out.shape == b.q.shape
    assert out.devices() == {backend.device}
    want = reference("paged_attention", *args, layer=b.layer, **case.attrs())
    assert_zero_rows(out, b.zero_rows, "paged_attention seq_lens==0 rows", seed)
    assert_close(out, want, dtype, f"paged_attention[{case.id}]", seed)


# 416 rows, just over one wave of the 16-bit decode kernel's CTAs on an H100 / H200 (head dim
# 128: 3 CTAs per SM x 132 SMs = 396): PlanDecode (ffi/cuda/paged_decode.cu) runs 396 rows whole
# and splits the other 20 four ways. (At 284 rows, the case's size until 2026-12-07, written for
# 2 CTAs per SM, all rows fit one wave and nothing was split.) 640-token tables: past the
# short-row ring's 512 (kShortRowTiles), which would fit all 416 rows in one wave. GPU only: the
# CPU handler is slow at this size and does not split.
WAVE_TAIL_CASE = Case("wave-tail-p16-d128-gqa4", 16, 128, 4, 4, batch=104, max_pages=40)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_paged_attention_whole_rows_and_split_tail(backend, dtype):
    _check_paged_attention(backend, WAVE_TAIL_CASE, dtype, seed=21)


# B256 S256 with 8 kv heads (2,048 rows of at most 17 tiles), head dims 128 and 64: 16-bit caches
# take the short-row ring (48 KiB, 4 CTAs per SM: 3.88 waves instead of 5.17), as do the 2,000
# 3-tile rows of many-rows-p16-d128-gqa4 above. GPU only (the CPU handler has one path).
SHORT_ROW_CASES = [Case(f"short-rows-p16-d{d}-gqa4", 16, d, 8, 4, batch=256, max_pages=16)
                   for d in (64, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", SHORT_ROW_CASES, ids=[c.id for c in SHORT_ROW_CASES])
def test_paged_attention_short_row_ring(backend, case, dtype):
    _check_paged_attention(backend, case, dtype, seed=23)


# Four rows, one of 9,600 tokens beside rows of 0, 1 and 16: PlanDecode splits every row ~50 ways
# on an H200 (4 rows fill under one wave), so the combine kernel merges more than 32 partials per
# head (both of warp 0's (max, sum) loads, several o loads per thread), most of the short rows'
# empty (max -inf, sum 0). GPU only (the CPU handler does not split).
MANY_SPLITS_CASES = [Case(f"many-splits-p16-d{d}-gqa4", 16, d, 1, 4, batch=4, max_pages=600)
                     for d in (64, 128, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", MANY_SPLITS_CASES, ids=[c.id for c in MANY_SPLITS_CASES])
def test_paged_attention_many_splits(backend, case, dtype):
    _check_paged_attention(backend, case, dtype, seed=22)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", RAGGED_CASES, ids=[c.id for c in RAGGED_CASES])
def test_ragged_paged_attention_matches_reference(backend, case, dtype, seed):
    b = make_batch(seed, case, dtype, ragged=True)
    args = (b.q, b.k_cache, b.v_cache, b.page_table, b.seq_lens, b.query_start)
    out = ops.ragged_paged_attention(*backend.put(*args), layer=b.layer, **case.attrs())
    assert out.dtype == dtype and out.shape == b.q.shape
    assert out.devices() == {backend.device}
    want = reference("ragged_paged_attention", *args, layer=b.layer, **case.attrs())
    assert_zero_rows(out, b.zero_rows, "ragged rows past query_start[B]", seed)
    assert_close(out, want, dtype, f"ragged_paged_attention[{case.id}]", seed)


RANDOM_SHAPE_SEEDS = list(range(100, 116))


def random_case(seed: int, ragged: bool) -> tuple[Case, jnp.dtype]:
    """A seeded random configuration: page size, head dim, GQA ratio, batch, window, soft cap,
    scale, layer axis and dtype all drawn from the seed."""
    rng = np.random.default_rng([seed, 1 + ragged])
    page_size = int(rng.choice([8, 16, 32, 64, 128]))
    head_dim = int(rng.choice([64, 128, 256]))
    group = int(rng.choice([1, 4, 8]))
    num_kv_heads = int(rng.choice([1, 2])) if group < 8 else 1
    max_pages = int(rng.integers(1, min(6, 256 // page_size) + 1))
    capacity = max_pages * page_size
    batch = int(rng.integers(5, 8))
    window = int(rng.integers(1, capacity + 8)) if rng.random() < 0.5 else None
    soft_cap = float(rng.uniform(2.0, 30.0)) if rng.random() < 0.4 else None
    scale = float(rng.uniform(0.05, 1.0)) if rng.random() < 0.4 else None
    case = Case(f"random-{seed}", page_size, head_dim, num_kv_heads, group, batch, max_pages,
                num_tokens=int(rng.integers(batch + 4, min(200, 2 * capacity + batch + 4) + 1)),
                num_layers=2 if rng.random() < 0.3 else None, sliding_window=window,
                soft_cap=soft_cap, scale=scale,
                null_out_of_window=window is not None and rng.random() < 0.5)
    dtype = jnp.dtype([jnp.float32, jnp.bfloat16, jnp.float16][int(rng.integers(3))])
    return case, dtype


@pytest.mark.parametrize("seed", RANDOM_SHAPE_SEEDS)
@pytest.mark.parametrize("op", ["paged", "ragged"])
def test_random_shapes_match_reference(backend, op, seed):
    ragged = op == "ragged"
    case, dtype = random_case(seed, ragged)
    print(f"seed={seed} dtype={dtype.name} {case}")
    b = make_batch(seed, case, dtype, ragged=ragged)
    args = (b.q, b.k_cache, b.v_cache, b.page_table, b.seq_lens)
    args += (b.query_start,) if ragged else ()
    fn = ops.ragged_paged_attention if ragged else ops.paged_attention
    out = fn(*backend.put(*args), layer=b.layer, **case.attrs())
    assert out.dtype == dtype and out.shape == b.q.shape
    want = reference("ragged_paged_attention" if ragged else "paged_attention", *args,
                     layer=b.layer, **case.attrs())
    assert_zero_rows(out, b.zero_rows, f"{op} padded rows", seed)
    assert_close(out, want, dtype, f"{op}[{case}]", seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_ragged_decode_rows_equal_paged_attention(backend, seed):
    """A ragged batch of one token per sequence is the decode op (same kernels' contract)."""
    case = DECODE_CASES[1]
    b = make_batch(seed, case, jnp.float32, ragged=False)
    # Pack the non-empty rows first; padded sequences own no rows; trailing rows are padding.
    order = np.argsort(b.seq_lens == 0, kind="stable")
    seq_lens, page_table, q = b.seq_lens[order], b.page_table[order], b.q[order]
    query_start = np.concatenate([[0], np.cumsum(seq_lens > 0)]).astype(np.int32)
    dev = backend.put(q, b.k_cache, b.v_cache, page_table, seq_lens, query_start)
    ragged = np.asarray(ops.ragged_paged_attention(*dev))
    decode = np.asarray(ops.paged_attention(*dev[:5]))
    n = int(query_start[-1])
    assert_close(ragged[:n], decode[:n], jnp.float32, "ragged vs decode rows", seed)
    assert_zero_rows(ragged, np.arange(n, len(q)), "ragged padding rows", seed)
    assert_zero_rows(decode, np.arange(n, len(q)), "decode padded rows", seed)


def long_ragged_batch(rng, seq_lens, num_new, *, page, hkv, group, head_dim, padding,
                      spare_pages, dtype):
    """(q, k, v, table, query_start, num_rows) of a ragged call: sequence b owns num_new[b]
    queries (its last tokens of seq_lens[b]), then `padding` rows; random pages, caches holding
    every token, `spare_pages` unreferenced pages."""
    query_start = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
    num_rows = int(query_start[-1]) + padding
    max_pages = cdiv(int(seq_lens.max()), page)
    num_pages = 1 + sum(cdiv(int(n), page) for n in seq_lens) + spare_pages
    table = random_page_table(rng, seq_lens, page, max_pages, num_pages)
    k, v = make_caches(rng, None, num_pages, page, hkv, head_dim, table, seq_lens)
    q = rng.standard_normal((num_rows, hkv * group, head_dim)).astype(np.float32)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return q, k, v, table, query_start, num_rows


def numpy_ragged_attention(q, k, v, table, seq_lens, query_start, num_rows, *, window=None,
                           soft_cap=None):
    """float32 numpy oracle of ragged_paged_attention, one sequence at a time: q [T, H, D],
    caches [pages, P, Hkv, D], table [B, max_pages]; rows past query_start[B] stay zero."""
    page, hkv, head_dim = k.shape[1], k.shape[2], k.shape[3]
    group = q.shape[1] // hkv
    want = np.zeros((num_rows, q.shape[1], head_dim), np.float32)
    qf, kf, vf = (to_f32(x) for x in (q, k, v))
    for b, total in enumerate(seq_lens):
        n = int(query_start[b + 1] - query_start[b])
        if n == 0:
            continue
        pos = np.arange(total)
        ks = np.repeat(kf[table[b, pos // page], pos % page], group, axis=1)  # [S, H, D]
        vs = np.repeat(vf[table[b, pos // page], pos % page], group, axis=1)
        qs = qf[query_start[b]:query_start[b + 1]]  # [n, H, D]
        logits = np.einsum("nhd,shd->hns", qs, ks) / np.sqrt(head_dim)
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        qpos = np.arange(total - n, total)[:, None]
        live = pos[None, :] <= qpos
        if window is not None:
            live &= pos[None, :] > qpos - window
        logits = np.where(live[None], logits, -np.inf)
        w = np.exp(logits - logits.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        want[query_start[b]:query_start[b + 1]] = np.einsum("hns,shd->nhd", w, vs)
    return want


@pytest.mark.parametrize("decode_rows", [3, 40])
def test_ragged_mixed_decode_rows_and_chunk(backend, decode_rows):
    """A mixed step in one ragged call: long single-query (decode) rows beside a prefill chunk,
    with padding rows. On CUDA the decode rows run the split-KV decode kernel inside the ragged
    call (3 long rows: several splits and the combine kernel; 40: one split), the chunk the
    prefill kernel; the output must match the reference row for row."""
    seed = 300 + decode_rows
    rng = np.random.default_rng(seed)
    page, hkv, group, head_dim, dtype = 16, 2, 4, 128, jnp.bfloat16
    chunk_ctx, chunk = 200, 150
    dec_lens = rng.integers(1500, 2049, size=decode_rows)
    seq_lens = np.concatenate([dec_lens[:decode_rows // 2], [chunk_ctx + chunk],
                               dec_lens[decode_rows // 2:]]).astype(np.int32)
    num_new = np.where(np.arange(len(seq_lens)) == decode_rows // 2, chunk, 1)
    q, k, v, table, query_start, num_rows = long_ragged_batch(  # 5 padding rows must be zero
        rng, seq_lens, num_new, page=page, hkv=hkv, group=group, head_dim=head_dim, padding=5,
        spare_pages=3, dtype=dtype)
    print(f"seed={seed} seq_lens={seq_lens.tolist()} query_start={query_start.tolist()}")
    args = (q, k, v, table, seq_lens, query_start)
    out = ops.ragged_paged_attention(*backend.put(*args))
    want = reference("ragged_paged_attention", *args)
    assert_zero_rows(out, np.arange(query_start[-1], num_rows), "mixed padding rows", seed)
    assert_close(out, want, dtype, f"mixed {decode_rows} decode rows + chunk", seed)


# (head_dim, group, window, soft_cap) of the long-prefill tests (here and over fp8 caches).
LONG_PREFILL_CASES = [(128, 4, None, None), (128, 1, 300, None), (64, 8, None, 8.0),
                      (64, 2, 700, None), (128, 8, 64, 20.0)]


@pytest.mark.parametrize("head_dim,group,window,soft_cap", LONG_PREFILL_CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_ragged_long_prefill_matches_reference(backend, head_dim, group, window, soft_cap,
                                               dtype):
    """Long chunks (many row tiles and K/V tiles per CTA, causal diagonals inside tiles, windows
    crossing tiles) beside a whole prompt and a decode row: the shapes the CUDA prefill kernels
    (wgmma on sm_90a) spend their time on, against the reference."""
    if backend.name == "cpu" and (dtype == jnp.float16 or window is None and group != 4):
        pytest.skip("CPU handler: two shapes suffice (the CUDA kernels are the subject)")
    seed = 400 + head_dim + group + (window or 0)
    rng = np.random.default_rng(seed)
    page, hkv = 16, 2
    seq_lens = np.array([1531, 700, 977, 0], np.int32)
    num_new = np.array([1000, 700, 1, 0])
    q, k, v, table, query_start, num_rows = long_ragged_batch(
        rng, seq_lens, num_new, page=page, hkv=hkv, group=group, head_dim=head_dim, padding=7,
        spare_pages=2, dtype=dtype)
    print(f"seed={seed} seq_lens={seq_lens.tolist()} query_start={query_start.tolist()}")
    attrs = {"sliding_window": window, "soft_cap": soft_cap}
    out = ops.ragged_paged_attention(*backend.put(q, k, v, table, seq_lens, query_start), **attrs)
    # numpy oracle, one sequence at a time (the reference's per-query gather would need ~20 GB)
    want = numpy_ragged_attention(q, k, v, table, seq_lens, query_start, num_rows,
                                  window=window, soft_cap=soft_cap)
    assert_zero_rows(out, np.arange(query_start[-1], num_rows), "padding rows", seed)
    assert_close(out, want, dtype, f"long prefill d{head_dim} g{group} w{window}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
@pytest.mark.parametrize("page", [1, 4, 16, 64, 256])
@pytest.mark.parametrize("head_dim,group,window", [(128, 4, None), (64, 1, 100), (128, 2, 200)])
def test_ragged_prefill_at_key_tile_edges(backend, page, head_dim, group, window):
    """Lengths and chunk starts on and around 64- and 128-key tile edges (the sm90 kernel's
    tiles), with page sizes from 1 (more pages than lanes per tile: per-row table lookups) and 4
    (one lookup per page of a tile, by shuffle) to 256 (a page holds several tiles); windows
    whose band starts inside a tile."""
    seed = 500 + page + head_dim + group + (window or 0)
    rng = np.random.default_rng(seed)
    seq_lens = np.array([127, 128, 129, 257, 383, 640, 1], np.int32)
    num_new = np.array([127, 1, 129, 130, 255, 384, 1])
    q, k, v, table, query_start, num_rows = long_ragged_batch(
        rng, seq_lens, num_new, page=page, hkv=2, group=group, head_dim=head_dim, padding=3,
        spare_pages=2, dtype=jnp.bfloat16)
    print(f"seed={seed} seq_lens={seq_lens.tolist()} query_start={query_start.tolist()}")
    out = ops.ragged_paged_attention(*backend.put(q, k, v, table, seq_lens, query_start),
                                     sliding_window=window)
    want = numpy_ragged_attention(q, k, v, table, seq_lens, query_start, num_rows, window=window)
    assert_zero_rows(out, np.arange(query_start[-1], num_rows), "padding rows", seed)
    assert_close(out, want, jnp.bfloat16, f"tile edges p{page} d{head_dim} g{group} w{window}",
                 seed)


@pytest.mark.parametrize("lead,trail", [(0, 700), (333, 0), (301, 455)])
def test_ragged_padding_rows_before_and_after_the_queries_are_zero(backend, lead, trail):
    """Rows before query_start[0] and from query_start[B] on are padding: exactly zero, however
    many (more than the CUDA fill kernel has CTAs: 2 per SM), with the real rows in between
    matching the oracle. The output buffer is poisoned (NaN) by an earlier call first."""
    seed = 600 + lead + trail
    rng = np.random.default_rng(seed)
    seq_lens = np.array([130, 1, 77], np.int32)
    num_new = np.array([130, 1, 20])
    q, k, v, table, query_start, num_rows = long_ragged_batch(
        rng, seq_lens, num_new, page=16, hkv=2, group=4, head_dim=128, padding=0,
        spare_pages=1, dtype=jnp.bfloat16)
    want = numpy_ragged_attention(q, k, v, table, seq_lens, query_start, num_rows)
    h, d = q.shape[1:]
    q = np.concatenate([rng.standard_normal((lead, h, d)).astype(q.dtype), q,
                        rng.standard_normal((trail, h, d)).astype(q.dtype)])
    query_start = query_start + lead
    print(f"seed={seed} lead={lead} trail={trail} query_start={query_start.tolist()}")
    dev = backend.put(q, k, v, table, seq_lens, query_start)
    attend = jax.jit(ops.ragged_paged_attention)
    for _ in range(2):  # NaN in the buffers the allocator hands out next
        jax.block_until_ready(jnp.full(q.shape, jnp.nan, q.dtype, device=backend.device))
    out = np.asarray(attend(*dev))
    pad = np.r_[np.arange(lead), np.arange(lead + num_rows, len(q))]
    assert_zero_rows(out, pad, "padding rows", seed)
    assert_close(out[lead:lead + num_rows], want, jnp.bfloat16, "rows between the padding", seed)


# ---------------------------------------------------------------------------------------------
# lax.scan over layers: write_kv then attention in the body, traced layer index.


def _scan_model(write_kv, attention, num_layers, ragged, attrs):
    def model(k_cache, v_cache, q, k, v, slot_mapping, page_table, seq_lens, query_start):
        def body(caches, xs):
            layer, q_l, k_l, v_l = xs
            k_cache, v_cache = write_kv(*caches, k_l, v_l, slot_mapping, layer=layer)
            extra = (query_start,) if ragged else ()
            out = attention(q_l, k_cache, v_cache, page_table, seq_lens, *extra, layer=layer,
                            **attrs)
            return (k_cache, v_cache), out

        layers = jnp.arange(num_layers, dtype=jnp.int32)
        (k_cache, v_cache), outs = jax.lax.scan(body, (k_cache, v_cache), (layers, q, k, v))
        return k_cache, v_cache, outs
    return model


SCAN_CASES = {
    "paged": Case("scan-p16-d64-gqa4-softcap", 16, 64, 2, 4, batch=6, max_pages=4, num_layers=3,
                  soft_cap=20.0),
    "ragged": Case("scan-p8-d128-gqa2-window12", 8, 128, 2, 2, batch=6, max_pages=6,
                   num_tokens=72, num_layers=3, sliding_window=12),
}


@functools.lru_cache(maxsize=None)
def _jitted_scan_model(op: str, oracle: bool):
    """SCAN_CASES[op]'s scan model over the ops (caches donated) or, ``oracle``, over the
    reference; one jitted function per pair, so the seeds (same shapes) compile it once."""
    from jax_kvcm.ops import reference as ref
    case, ragged = SCAN_CASES[op], op == "ragged"
    mod = ref if oracle else ops
    attention = mod.ragged_paged_attention if ragged else mod.paged_attention
    model = _scan_model(mod.write_kv, attention, case.num_layers, ragged, case.attrs())
    return jax.jit(model) if oracle else jax.jit(model, donate_argnums=(0, 1))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["paged", "ragged"])
def test_write_then_attend_in_scan_over_layers(backend, op, dtype, seed):
    case, ragged = SCAN_CASES[op], op == "ragged"
    rng = np.random.default_rng(seed)
    if ragged:
        seq_lens, num_new = ragged_layout(rng, case)
        num_rows = case.num_tokens
    else:
        seq_lens = decode_seq_lens(rng, case)
        num_new = (seq_lens > 0).astype(np.int32)  # padded rows write nothing
        num_rows = case.batch
    query_start = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
    print(f"seed={seed} seq_lens={seq_lens.tolist()} query_start={query_start.tolist()}")
    page_table = random_page_table(rng, seq_lens, case.page_size, case.max_pages, case.num_pages)
    # The cache holds the context; the new tokens are written by write_kv inside the scan.
    k_cache, v_cache = make_caches(rng, case.num_layers, case.num_pages, case.page_size,
                                   case.num_kv_heads, case.head_dim, page_table, seq_lens,
                                   num_written=seq_lens - num_new)
    slot_mapping = np.full((num_rows,), -1, np.int32)
    for b in range(case.batch):
        if ragged:
            rows = np.arange(query_start[b], query_start[b + 1])
        else:
            rows = np.arange(b, b + num_new[b])
        slot_mapping[rows] = flat_slots(page_table[b], case.page_size,
                                        np.arange(seq_lens[b] - num_new[b], seq_lens[b]))
    L, H, Hkv, D = case.num_layers, case.num_heads, case.num_kv_heads, case.head_dim
    q = rng.standard_normal((L, num_rows, H, D)).astype(np.float32)
    k = rng.standard_normal((L, num_rows, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((L, num_rows, Hkv, D)).astype(np.float32)
    inputs = [x.astype(dtype) for x in (k_cache, v_cache, q, k, v)]
    inputs += [slot_mapping, page_table, seq_lens, query_start]

    k_out, v_out, outs = _jitted_scan_model(op, oracle=False)(*backend.put(*inputs))

    ref_model = _jitted_scan_model(op, oracle=True)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        want_k, want_v, want = ref_model(*(jax.device_put(to_f32(x), cpu) for x in inputs))

    # The cache writes are exact (NaN pages must stay NaN: compare NaN == NaN).
    np.testing.assert_array_equal(to_f32(k_out), np.asarray(want_k), err_msg=f"k_cache seed={seed}")
    np.testing.assert_array_equal(to_f32(v_out), np.asarray(want_v), err_msg=f"v_cache seed={seed}")
    zero_rows = (np.arange(query_start[-1], num_rows) if ragged
                 else np.flatnonzero(seq_lens == 0))
    for l in range(L):
        assert_zero_rows(outs[l], zero_rows, f"layer {l} padded rows", seed)
        assert_close(outs[l], want[l], dtype, f"scan[{op}] layer {l}", seed)


# ---------------------------------------------------------------------------------------------
# No recompilation at fixed shapes.


NUM_STEPS = 50


def _count_compiles(fn, make_args, compile_counter, num_steps=NUM_STEPS):
    """Calls fn(*make_args(i)) num_steps times; returns (traces, backend compiles after call 0)."""
    traces = [0]

    def counted(*args):
        traces[0] += 1
        return fn(*args)

    jitted = jax.jit(counted, donate_argnums=(0, 1))
    state = None
    for i in range(num_steps):
        args = make_args(i, state)
        if i == 0:
            out = jitted(*args)
        else:
            with compile_counter.counting():
                out = jitted(*args)
        jax.block_until_ready(out)
        state = out
    cache_size = jitted._cache_size() if hasattr(jitted, "_cache_size") else 1
    return traces[0], compile_counter.count, cache_size, state, args


@pytest.mark.parametrize("op", ["paged", "ragged"])
def test_fixed_shape_steps_compile_once(backend, op, compile_counter):
    ragged = op == "ragged"
    case = Case("recompile", 16, 64, 2, 2, batch=5, max_pages=4, num_tokens=48, sliding_window=24)
    seed = 11
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    H, Hkv, D, T = case.num_heads, case.num_kv_heads, case.head_dim, case.num_tokens
    num_rows = T if ragged else case.batch
    cache_shape = (case.num_pages, case.page_size, Hkv, D)
    k_cache = rng.standard_normal(cache_shape).astype(np.float32)
    v_cache = rng.standard_normal(cache_shape).astype(np.float32)
    host = {}

    def make_args(i, state):
        if ragged:
            seq_lens, num_new = ragged_layout(rng, case)
        else:
            seq_lens = rng.integers(0, case.capacity + 1, size=case.batch).astype(np.int32)
            num_new = (seq_lens > 0).astype(np.int32)
        query_start = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
        page_table = random_page_table(rng, seq_lens, case.page_size, case.max_pages,
                                       case.num_pages)
        slot_mapping = np.full((num_rows,), -1, np.int32)
        for b in range(case.batch):
            start = query_start[b] if ragged else b
            slot_mapping[start:start + num_new[b]] = flat_slots(
                page_table[b], case.page_size, np.arange(seq_lens[b] - num_new[b], seq_lens[b]))
        q = rng.standard_normal((num_rows, H, D)).astype(np.float32)
        k = rng.standard_normal((num_rows, Hkv, D)).astype(np.float32)
        v = rng.standard_normal((num_rows, Hkv, D)).astype(np.float32)
        caches = backend.put(k_cache, v_cache) if state is None else state[:2]
        # Host copy of the caches before this step (read before they are donated).
        host["caches"] = tuple(np.asarray(c) for c in caches)
        host["args"] = (q, k, v, slot_mapping, page_table, seq_lens, query_start)
        rest = (q, k, v, slot_mapping, page_table, seq_lens) + ((query_start,) if ragged else ())
        return (*caches, *backend.put(*rest))

    def step(kc, vc, q, k, v, slot_mapping, page_table, seq_lens, *query_start):
        kc, vc = ops.write_kv(kc, vc, k, v, slot_mapping)
        attention = ops.ragged_paged_attention if ragged else ops.paged_attention
        out = attention(q, kc, vc, page_table, seq_lens, *query_start,
                        sliding_window=case.sliding_window)
        return kc, vc, out

    traces, compiles, cache_size, state, _ = _count_compiles(step, make_args, compile_counter)
    assert traces == 1, f"the step was traced {traces} times over {NUM_STEPS} calls"
    assert compiles == 0, f"{compiles} backend compilations after the first of {NUM_STEPS} calls"
    assert cache_size == 1, f"jit cache holds {cache_size} entries"

    # The last step still computes the right thing.
    q, k, v, slot_mapping, page_table, seq_lens, query_start = host["args"]
    kc, vc = reference("write_kv", *host["caches"], k, v, slot_mapping)
    attn_args = (q, kc, vc, page_table, seq_lens) + ((query_start,) if ragged else ())
    want = reference("ragged_paged_attention" if ragged else "paged_attention", *attn_args,
                     sliding_window=case.sliding_window)
    assert_close(state[2], want, jnp.float32, f"step {NUM_STEPS} output", seed)
