"""Shared-prefix (cascade) decode attention, and paged_attention's log-sum-exp output.

- ``return_lse``: against the reference's log-sum-exp (padded rows -inf; long rows take the CUDA
  decode kernel's split + combine path);
- :func:`jax_kvcm.plan_cascade`: its buffers checked against the page table they came from;
- :func:`jax_kvcm.cascade_paged_attention`: equal to the reference's plain decode attention over
  the whole rows, on batches where groups of rows share leading pages (several prefixes, rows in
  no group, padded rows); unreferenced pages are NaN (make_caches), so a read outside the shared
  or own pages shows up; a NaN planted in an attended shared row reaches every member.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import DTYPES, SEEDS, assert_close, cdiv, make_caches, reference, to_f32
import jax_kvcm
from jax_kvcm.ops.cascade import merge_attention_states

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def shared_prefix_batch(rng, *, batch, page_size, max_pages, num_prefixes, num_pages=None):
    """(page_table [B, P], seq_lens [B]): rows draw one of ``num_prefixes`` shared page runs (or
    none), then pages of their own; two rows are padding (0 tokens)."""
    prefix_pages = [int(rng.integers(1, max_pages)) for _ in range(num_prefixes)]
    next_page = 1
    prefixes = []
    for n in prefix_pages:
        prefixes.append(np.arange(next_page, next_page + n, dtype=np.int32))
        next_page += n
    table = np.zeros((batch, max_pages), np.int32)
    lens = np.zeros(batch, np.int32)
    for b in range(batch - 2):
        which = int(rng.integers(-1, num_prefixes))  # -1: no shared prefix
        shared = prefixes[which] if which >= 0 else np.zeros(0, np.int32)
        own_tokens = int(rng.integers(1, (max_pages - len(shared)) * page_size + 1))
        own = np.arange(next_page, next_page + cdiv(own_tokens, page_size), dtype=np.int32)
        next_page += len(own)
        row = np.concatenate([shared, own])
        table[b, :len(row)] = row
        lens[b] = len(shared) * page_size + own_tokens
    perm = rng.permutation(batch)
    return table[perm], lens[perm], next_page + 2  # + 2 NaN spare pages


# ---------------------------------------------------------------------------------------------
# return_lse


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 64, 2, 4, 6, 6), (16, 128, 2, 4, 5, 4),
                                   (16, 128, 1, 16, 3, 4), (16, 128, 2, 4, 1, 2048)],
                         ids=["p8-d64-gqa4", "p16-d128-gqa4", "p16-d128-gqa16", "b1-long-split"])
def test_paged_attention_returns_the_reference_lse(backend, shape, dtype, seed):
    page_size, head_dim, hkv, group, batch, max_pages = shape
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_pages * page_size + 1, size=batch).astype(np.int32)
    if batch > 2:
        lens[0] = 0  # a padded row: zeros and -inf
    need = [cdiv(int(n), page_size) for n in lens]
    table = np.zeros((batch, max_pages), np.int32)
    perm = rng.permutation(np.arange(1, sum(need) + 1, dtype=np.int32))
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n]
        used += n
    k, v = make_caches(rng, None, sum(need) + 3, page_size, hkv, head_dim, table, lens)
    q = rng.standard_normal((batch, hkv * group, head_dim)).astype(np.float32)
    args = backend.put(q.astype(dtype), k.astype(dtype), v.astype(dtype), table, lens)
    out, lse = jax.jit(lambda *a: jax_kvcm.paged_attention(*a, return_lse=True))(*args)
    want_out, want_lse = reference("paged_attention", q.astype(dtype), k.astype(dtype),
                                   v.astype(dtype), table, lens, return_lse=True)
    lse, padded = np.asarray(lse), lens == 0
    assert lse.dtype == np.float32 and lse.shape == (batch, hkv * group)
    assert np.all(lse[padded] == -np.inf), f"padded rows' lse must be -inf (seed={seed})"
    assert_close(out, want_out, dtype, "out", seed)
    np.testing.assert_allclose(lse[~padded], want_lse[~padded], rtol=2e-3, atol=2e-3,
                               err_msg=f"lse (seed={seed})")


def test_return_lse_refuses_a_non_bool(backend):
    q = np.zeros((1, 2, 8), np.float32)
    k = np.zeros((2, 8, 2, 8), np.float32)
    with pytest.raises(TypeError, match="return_lse"):
        jax_kvcm.paged_attention(q, k, k, np.ones((1, 1), np.int32), np.ones(1, np.int32),
                                 return_lse=1)


# ---------------------------------------------------------------------------------------------
# plan_cascade


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("max_members", [2, 3, 4])
def test_plan_cascade_groups_only_shared_whole_pages(seed, max_members):
    rng = np.random.default_rng(seed)
    page_size = 8
    table, lens, _ = shared_prefix_batch(rng, batch=24, page_size=page_size, max_pages=10,
                                         num_prefixes=3)
    c = jax_kvcm.plan_cascade(table, lens, page_size=page_size, max_members=max_members)
    B, P = table.shape
    G, N = c.members.shape
    assert (G, N) == (B // 2, max_members) and c.suffix_table.shape == (B, P)
    for f in (c.prefix_table, c.prefix_lens, c.members, c.member_slot, c.suffix_table,
              c.suffix_lens):
        assert f.dtype == np.int32
    grouped = 0
    for g in range(G):
        n_pages = int(c.prefix_lens[g]) // page_size
        rows = [int(r) for r in np.flatnonzero(c.member_slot >= 0)
                if c.member_slot[r] // N == g]
        if n_pages == 0:
            assert rows == [], f"group {g} has no prefix but members {rows} (seed={seed})"
            continue
        assert c.prefix_lens[g] % page_size == 0
        assert 2 <= len(rows) <= N, f"group {g}: {len(rows)} members (seed={seed})"
        for r in rows:
            assert c.members[g, c.member_slot[r] % N] == r
            # Shared pages are the row's own first pages, wholly before its last position.
            assert np.array_equal(table[r, :n_pages], c.prefix_table[g, :n_pages])
            assert n_pages * page_size <= lens[r] - 1, f"row {r}'s written page is shared"
        assert np.all(c.prefix_table[g, n_pages:] == 0)
        grouped += len(rows)
    assert grouped >= 4, f"the batch's shared prefixes formed no groups (seed={seed})"
    assert c.tokens_saved == int(lens.sum()) - int(c.prefix_lens.sum() + c.suffix_lens.sum()) > 0
    for r in range(B):
        k = int(c.prefix_lens[c.member_slot[r] // N]) // page_size if c.member_slot[r] >= 0 else 0
        assert c.suffix_lens[r] == lens[r] - k * page_size
        assert np.array_equal(c.suffix_table[r, :P - k], table[r, k:])
        assert np.all(c.suffix_table[r, P - k:] == 0)


def loop_plan(table, lens, page_size, N, min_pages=1):
    """An independent, row-by-row plan: (member_slot, prefix_lens, prefix_table) as
    plan_cascade documents them (buckets by first page, even chunks of at most N)."""
    B, P = table.shape
    G = max(1, B // 2)
    limit = [min((int(n) - 1) // page_size, P) if n > 0 else 0 for n in lens]
    slot, plens, ptable = np.full(B, -1), np.zeros(G, int), np.zeros((G, P), int)
    rows = sorted((r for r in range(B) if limit[r] >= min_pages), key=lambda r: table[r, 0])
    buckets: dict[int, list[int]] = {}
    for r in rows:
        buckets.setdefault(int(table[r, 0]), []).append(r)
    g = 0
    for _, bucket in sorted(buckets.items(), key=lambda kv: rows.index(kv[1][0])):
        for chunk in np.array_split(bucket, -(-len(bucket) // N)):
            if len(chunk) < 2 or g == G:
                continue
            k = 0
            while k < min(limit[r] for r in chunk) and all(
                    table[r, k] == table[chunk[0], k] for r in chunk):
                k += 1
            if k < min_pages:
                continue
            for j, r in enumerate(chunk):
                slot[r] = g * N + j
            plens[g], ptable[g, :k] = k * page_size, table[chunk[0], :k]
            g += 1
    return slot, plens, ptable


@pytest.mark.parametrize("seed", range(20))
def test_plan_cascade_equals_a_row_by_row_plan(seed):
    rng = np.random.default_rng(100 + seed)
    batch, N = int(rng.integers(1, 40)), int(rng.integers(2, 6))
    table, lens, _ = shared_prefix_batch(rng, batch=batch + 2, page_size=4, max_pages=7,
                                         num_prefixes=int(rng.integers(1, 5)))
    if seed % 3 == 0:  # forks: rows with identical tables
        table[1::3], lens[1::3] = table[0], lens[0]
    c = jax_kvcm.plan_cascade(table, lens, page_size=4, max_members=N,
                              min_prefix_pages=1 + seed % 2)
    slot, plens, ptable = loop_plan(table, lens, 4, N, 1 + seed % 2)
    np.testing.assert_array_equal(c.member_slot, slot, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(c.prefix_lens, plens, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(c.prefix_table, ptable, err_msg=f"seed={seed}")


def test_plan_cascade_leaves_unshared_rows_whole():
    table = np.array([[1, 2, 0], [3, 4, 0], [5, 0, 0], [0, 0, 0]], np.int32)
    lens = np.array([12, 16, 3, 0], np.int32)
    c = jax_kvcm.plan_cascade(table, lens, page_size=8, max_members=4)
    assert np.all(c.member_slot == -1) and np.all(c.prefix_lens == 0)
    assert np.array_equal(c.suffix_table, table) and np.array_equal(c.suffix_lens, lens)


def test_plan_cascade_never_shares_the_page_a_row_writes():
    # Rows whose tables agree everywhere (forks): the last page holds the token this step writes,
    # so only the pages before it are a prefix.
    table = np.array([[4, 5, 0], [4, 5, 0], [7, 6, 0]], np.int32)
    lens = np.array([16, 16, 9], np.int32)
    c = jax_kvcm.plan_cascade(table, lens, page_size=8, max_members=4)
    assert int(c.prefix_lens[0]) == 8 and c.prefix_table[0].tolist() == [4, 0, 0]
    assert c.suffix_lens.tolist() == [8, 8, 9]
    assert c.suffix_table[:, 0].tolist() == [5, 5, 7]


def test_cascade_group_size():
    assert jax_kvcm.cascade_group_size(32, 8) == 4
    assert jax_kvcm.cascade_group_size(32, 8, kv_dtype=jnp.float8_e4m3fn) == 2
    assert jax_kvcm.cascade_group_size(4, 2, kv_dtype=jnp.bfloat16) == 8
    assert jax_kvcm.cascade_group_size(64, 4) == 2   # 16 heads a kv head: still pairs
    with pytest.raises(ValueError, match="num_kv_heads"):
        jax_kvcm.cascade_group_size(6, 4)


def test_plan_cascade_refuses_bad_arguments():
    t, n = np.zeros((2, 3), np.int32), np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="max_members"):
        jax_kvcm.plan_cascade(t, n, page_size=8, max_members=1)
    with pytest.raises(ValueError, match="page_size"):
        jax_kvcm.plan_cascade(t, n, page_size=0, max_members=2)
    with pytest.raises(ValueError, match="seq_lens"):
        jax_kvcm.plan_cascade(t, n[:1], page_size=8, max_members=2)


# ---------------------------------------------------------------------------------------------
# cascade_paged_attention


CASCADE_SHAPES = [  # page_size, head_dim, num_kv_heads, group, batch, max_pages
    pytest.param((8, 64, 2, 1, 12, 8), id="p8-d64-gqa1"),
    pytest.param((16, 128, 2, 4, 16, 6), id="p16-d128-gqa4"),
    pytest.param((16, 128, 1, 8, 10, 5), id="p16-d128-gqa8"),
]


def cascade_inputs(rng, shape, dtype, *, num_prefixes=2):
    page_size, head_dim, hkv, group, batch, max_pages = shape
    table, lens, num_pages = shared_prefix_batch(rng, batch=batch, page_size=page_size,
                                                 max_pages=max_pages, num_prefixes=num_prefixes)
    k, v = make_caches(rng, 2, num_pages, page_size, hkv, head_dim, table, lens)
    q = rng.standard_normal((batch, hkv * group, head_dim)).astype(np.float32)
    plan = jax_kvcm.plan_cascade(table, lens, page_size=page_size,
                                 max_members=jax_kvcm.cascade_group_size(
                                     hkv * group, hkv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), table, lens, plan


def _cascade(q, k, v, plan, **kw):
    return jax.jit(lambda q, k, v, c: jax_kvcm.cascade_paged_attention(q, k, v, c, **kw))(
        q, k, v, plan)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CASCADE_SHAPES)
def test_cascade_equals_plain_decode_attention(backend, shape, dtype, seed):
    rng = np.random.default_rng(seed)
    q, k, v, table, lens, plan = cascade_inputs(rng, shape, dtype)
    assert (plan.member_slot >= 0).sum() >= 2, f"no group formed (seed={seed})"
    qd, kd, vd = backend.put(q, k, v)
    got = _cascade(qd, kd, vd, jax.device_put(plan, backend.device), layer=1, soft_cap=None)
    want = reference("paged_attention", q, k, v, table, lens, layer=1)
    assert np.all(to_f32(got)[lens == 0] == 0), f"padded rows must be zeros (seed={seed})"
    assert_close(got, want, dtype, "cascade vs plain", seed)


@pytest.mark.parametrize("seed", SEEDS[:1])
def test_cascade_with_soft_cap_scale_and_fp8_caches(backend, seed):
    rng = np.random.default_rng(seed)
    shape = (16, 128, 2, 4, 16, 6)
    q, k, v, table, lens, plan = cascade_inputs(rng, shape, jnp.bfloat16)
    k8, v8 = (to_f32(k) / 0.5).astype(FP8), (to_f32(v) / 2.0).astype(FP8)
    ks = np.full((2, 2), 0.5, np.float32)
    vs = np.full((2, 2), 2.0, np.float32)
    qd, k8d, v8d, ksd, vsd = backend.put(q, k8, v8, ks, vs)
    got = _cascade(qd, k8d, v8d, jax.device_put(plan, backend.device), layer=0, soft_cap=5.0,
                   scale=0.1, k_scale=ksd, v_scale=vsd)
    want = reference("paged_attention", q, k8.astype(np.float32) * 0.5,
                     v8.astype(np.float32) * 2.0, table, lens, layer=0, soft_cap=5.0, scale=0.1)
    assert_close(got, want, jnp.bfloat16, "cascade fp8 vs plain", seed)


@pytest.mark.parametrize("which", ["k", "v"])
def test_a_nan_in_a_shared_prefix_reaches_every_member(backend, which):
    seed = 3
    rng = np.random.default_rng(seed)
    q, k, v, table, lens, plan = cascade_inputs(rng, (8, 64, 2, 2, 12, 8), jnp.float32,
                                                num_prefixes=1)
    g = int(np.argmax(plan.prefix_lens))
    assert plan.prefix_lens[g] > 0, f"no group formed (seed={seed})"
    members = np.flatnonzero((plan.member_slot >= 0) & (plan.member_slot // 4 == g))
    k, v = k.copy(), v.copy()
    (k if which == "k" else v)[1, plan.prefix_table[g, 0], 0] = np.nan  # first shared token
    got = to_f32(_cascade(*backend.put(q, k, v), jax.device_put(plan, backend.device), layer=1))
    want = reference("paged_attention", q, k, v, table, lens, layer=1)
    assert np.all(np.isnan(got[members])), f"members {members} lost the NaN (seed={seed})"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want),
                                  err_msg=f"NaN rows differ from the plain path (seed={seed})")


def test_merge_keeps_the_nan_rule():
    o = jnp.ones((1, 1, 2))
    inf, nan = jnp.array([[-jnp.inf]]), jnp.array([[jnp.nan]])
    out, lse = merge_attention_states(o * 0, inf, o * 0, inf)
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == -np.inf)
    out, _ = merge_attention_states(o * jnp.nan, nan, o, jnp.zeros((1, 1)))
    assert np.all(np.isnan(np.asarray(out)))
    out, lse = merge_attention_states(o * 0, inf, o * 3, jnp.zeros((1, 1)))
    np.testing.assert_array_equal(np.asarray(out), 3.0)
    # Equal lse: the mean; lse grows by log 2.
    out, lse = merge_attention_states(o, jnp.zeros((1, 1)), o * 3, jnp.zeros((1, 1)))
    np.testing.assert_allclose(np.asarray(out), 2.0)
    np.testing.assert_allclose(np.asarray(lse), np.log(2.0), rtol=1e-6)


def test_cascade_compiles_once_per_shape(backend, compile_counter):
    rng = np.random.default_rng(5)
    fn = jax.jit(lambda q, k, v, c: jax_kvcm.cascade_paged_attention(q, k, v, c, layer=0))
    for i in range(4):
        q, k, v, table, lens, plan = cascade_inputs(rng, (8, 64, 2, 2, 12, 8), jnp.float32)
        # Same shapes every call: pad the caches to one page count.
        pad = 200 - k.shape[1]
        k = np.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        v = np.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        args = backend.put(q, k, v) + (jax.device_put(plan, backend.device),)
        if i == 0:
            fn(*args).block_until_ready()
            continue
        with compile_counter.counting():
            fn(*args).block_until_ready()
    assert compile_counter.count == 0, f"{compile_counter.count} recompiles of a fixed shape"


@pytest.mark.parametrize("dtype", DTYPES)
def test_cascade_over_slot_major_arena_pools(backend, dtype):
    """The CUDA arena's pools (``ArenaPool.over_array``, slot-major ``[S, L, P, Hkv, D]``): the
    cascade over them equals plain decode attention over the layer-major caches."""
    seed = 7
    rng = np.random.default_rng(seed)
    q, k, v, table, lens, plan = cascade_inputs(rng, (16, 128, 2, 4, 16, 6), dtype)
    pools = [jax_kvcm.ArenaPool.over_array(jnp.transpose(backend.put(c), (1, 0, 2, 3, 4)))
             for c in (k, v)]
    got = _cascade(backend.put(q), *pools, jax.device_put(plan, backend.device), layer=1)
    want = reference("paged_attention", q, k, v, table, lens, layer=1)
    assert_close(got, want, dtype, "cascade over arena pools vs plain", seed)
