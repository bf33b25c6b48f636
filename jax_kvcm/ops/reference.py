"""Pure-JAX references for the custom calls: the oracles in tests (slow is fine).

Same signatures and conventions as :mod:`jax_kvcm.ops` (fp8 caches, ring tables and the
non-finite rule included); computation in float32. ``check_indices`` is accepted and ignored.
A pair of ``over_array`` ArenaPools (:class:`~jax_kvcm._arena_pool.ArenaPool`) is read as the
layer-major cache it stands for (its physical slot-major array transposed); ``write_kv`` returns
such pools.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jax_kvcm._arena_pool import ArenaPool, pool_pair_form

__all__ = ["dequantize", "paged_attention", "quantize", "ragged_paged_attention", "write_kv"]

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0


_SWAP_SLOTS_AND_LAYERS = (1, 0, 2, 3, 4)


def _layer_major(k_cache: Any, v_cache: Any) -> tuple[Any, Any]:
    """The caches as layer-major arrays (over_array ArenaPools transposed)."""
    form = pool_pair_form(k_cache, v_cache)
    if form == "address":
        raise TypeError("the reference ops take over_array ArenaPools, not by_address ones")
    if form == "array":
        return (jnp.transpose(k_cache.data, _SWAP_SLOTS_AND_LAYERS),
                jnp.transpose(v_cache.data, _SWAP_SLOTS_AND_LAYERS))
    return k_cache, v_cache


def _layer_view(cache: jax.Array, layer: Any) -> jax.Array:
    return cache if cache.ndim == 4 else cache[layer]


def _layer_scale(scale: Any, layer: Any) -> jax.Array:
    """The float32 [Hkv] scales of one layer ([Hkv] or [L, Hkv] given)."""
    scale = jnp.asarray(scale, jnp.float32)
    return scale if scale.ndim == 1 else scale[layer]


def quantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    """float8_e4m3fn of ``x / scale`` (float32 division, saturated to +-448, round to nearest
    even, NaN kept); ``scale`` [Hkv] broadcasts over x [..., Hkv, D]."""
    y = x.astype(jnp.float32) / scale[:, None]
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8)


def dequantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 of an fp8 cache piece [..., Hkv, D] times its per-kv-head scale."""
    return x.astype(jnp.float32) * scale[:, None]


def write_kv(k_cache, v_cache, k, v, slot_mapping, *, layer=None, k_scale=None, v_scale=None,
             check_indices=None):
    """Reference of :func:`jax_kvcm.ops.write_kv` (functional scatter; negative slots dropped)."""
    del check_indices
    if isinstance(k_cache, ArenaPool):
        k_out, v_out = write_kv(*_layer_major(k_cache, v_cache), k, v, slot_mapping, layer=layer,
                                k_scale=k_scale, v_scale=v_scale)
        return (k_cache.with_data(jnp.transpose(k_out, _SWAP_SLOTS_AND_LAYERS)),
                v_cache.with_data(jnp.transpose(v_out, _SWAP_SLOTS_AND_LAYERS)))
    if jnp.dtype(k_cache.dtype) == FP8:
        k = quantize(k, _layer_scale(k_scale, layer))
        v = quantize(v, _layer_scale(v_scale, layer))

    def scatter(cache, rows):
        flat_shape = cache.shape[:-4] + (cache.shape[-4] * cache.shape[-3],) + cache.shape[-2:]
        num_slots = flat_shape[-3]
        slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range -> dropped
        flat = cache.reshape(flat_shape)
        if cache.ndim == 4:
            flat = flat.at[slots].set(rows.astype(cache.dtype), mode="drop")
        else:
            flat = flat.at[layer, slots].set(rows.astype(cache.dtype), mode="drop")
        return flat.reshape(cache.shape)
    return scatter(k_cache, k), scatter(v_cache, v)


def _attend(q, k_seq, v_seq, kv_pos, q_pos, kv_len, scale, sliding_window, soft_cap,
            return_lse=False):
    """One query q [H, D] at position q_pos over k_seq/v_seq [S, Hkv, D] (float32) holding the
    positions kv_pos [S] (only those in [0, kv_len) are valid).

    Non-finite rule: a non-finite q.k at an attended position gives a NaN logit (so the row is
    NaN even under a soft cap); K/V at positions this query does not attend (past q_pos or
    kv_len, before its window) are replaced by zeros before any arithmetic, so garbage there
    (NaN included) cannot reach the output.
    """
    num_heads, num_kv_heads = q.shape[0], k_seq.shape[1]
    group = num_heads // num_kv_heads
    mask = (kv_pos >= 0) & (kv_pos <= q_pos) & (kv_pos < kv_len)
    if sliding_window is not None:
        mask &= kv_pos > q_pos - sliding_window
    live = mask[:, None, None]
    k = jnp.repeat(jnp.where(live, k_seq, 0.0), group, axis=1)
    v = jnp.repeat(jnp.where(live, v_seq, 0.0), group, axis=1)
    dots = jnp.einsum("hd,shd->hs", q.astype(jnp.float32), k,
                      precision=jax.lax.Precision.HIGHEST)
    logits = dots * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(jnp.isfinite(dots), logits, jnp.nan)
    logits = jnp.where(mask[None, :], logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    weights = jnp.where(mask[None, :], weights, 0.0)  # rows with no attended position: zeros
    out = jnp.einsum("hs,shd->hd", weights, v, precision=jax.lax.Precision.HIGHEST)
    if not return_lse:
        return out
    # -inf with nothing attended, NaN with a NaN logit (as the kernels).
    return out, jax.nn.logsumexp(logits, axis=-1)


def _gather(cache, page_table_row, kv_len, scale, ring_table):
    """(K or V of one sequence as float32 [S, Hkv, D], their positions [S]) through its table.

    Absolute table of P entries: positions 0 .. P * page_size - 1. Ring of R entries: the R
    pages ending with the page of position kv_len - 1 (the only positions a valid call reads),
    entry (p // page_size) % R for position p; positions below 0 are masked by the caller.
    """
    page_size, width = cache.shape[-3], page_table_row.shape[0]
    if ring_table:
        first_page = (kv_len + page_size - 1) // page_size - width
        page_ids = first_page + jnp.arange(width)
        pages = cache[page_table_row[page_ids % width]]
        kv_pos = first_page * page_size + jnp.arange(width * page_size)
    else:
        pages = cache[page_table_row]  # [P, page_size, Hkv, D]
        kv_pos = jnp.arange(width * page_size)
    out = pages.reshape((-1,) + cache.shape[-2:])
    out = dequantize(out, scale) if jnp.dtype(cache.dtype) == FP8 else out.astype(jnp.float32)
    return out, kv_pos


def _prepare(q, k_cache, v_cache, layer, scale, k_scale, v_scale, ring_table):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k_cache, v_cache = _layer_major(k_cache, v_cache)
    kc, vc = _layer_view(k_cache, layer), _layer_view(v_cache, layer)
    fp8 = jnp.dtype(k_cache.dtype) == FP8
    ks = _layer_scale(k_scale, layer) if fp8 else None
    vs = _layer_scale(v_scale, layer) if fp8 else None

    def gather(row, kv_len):
        k, kv_pos = _gather(kc, row, kv_len, ks, ring_table)
        v, _ = _gather(vc, row, kv_len, vs, ring_table)
        return k, v, kv_pos
    return scale, gather


def paged_attention(q, k_cache, v_cache, page_table, seq_lens, *, layer=None, scale=None,
                    sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
                    ring_table=False, return_lse=False, check_indices=None):
    """Reference of :func:`jax_kvcm.ops.paged_attention` (gather pages, masked softmax)."""
    del check_indices
    scale, gather = _prepare(q, k_cache, v_cache, layer, scale, k_scale, v_scale, ring_table)

    def one(qb, row, length):
        k, v, kv_pos = gather(row, length)
        return _attend(qb, k, v, kv_pos, length - 1, length, scale, sliding_window, soft_cap,
                       return_lse)

    if not return_lse:
        return jax.vmap(one)(q, page_table, seq_lens).astype(q.dtype)
    out, lse = jax.vmap(one)(q, page_table, seq_lens)
    return out.astype(q.dtype), lse.astype(jnp.float32)


def ragged_paged_attention(q, k_cache, v_cache, page_table, seq_lens, query_start, *, layer=None,
                           scale=None, sliding_window=None, soft_cap=None, k_scale=None,
                           v_scale=None, ring_table=False, check_indices=None):
    """Reference of :func:`jax_kvcm.ops.ragged_paged_attention` (per-token gather, causal mask)."""
    del check_indices
    scale, gather = _prepare(q, k_cache, v_cache, layer, scale, k_scale, v_scale, ring_table)
    num_tokens, batch = q.shape[0], page_table.shape[0]
    t = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(query_start, t, side="right") - 1, 0, batch - 1)
    valid = (t >= query_start[0]) & (t < query_start[batch])
    pos = seq_lens[seq] - (query_start[seq + 1] - t)

    def one(qt, b, p):
        k, v, kv_pos = gather(page_table[b], seq_lens[b])
        return _attend(qt, k, v, kv_pos, p, seq_lens[b], scale, sliding_window, soft_cap)

    out = jax.vmap(one)(q, seq, pos)
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)
