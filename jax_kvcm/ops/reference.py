"""Pure-JAX references for the custom calls: the oracles in tests (slow is fine).

Same signatures and conventions as :mod:`jax_kvcm.ops`; computation in float32.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["paged_attention", "ragged_paged_attention", "write_kv"]


def _layer_view(cache: jax.Array, layer: Any) -> jax.Array:
    return cache if cache.ndim == 4 else cache[layer]


def write_kv(k_cache, v_cache, k, v, slot_mapping, *, layer=None):
    """Reference of :func:`jax_kvcm.ops.write_kv` (functional scatter; negative slots dropped)."""
    def scatter(cache, rows):
        flat_shape = cache.shape[:-4] + (cache.shape[-4] * cache.shape[-3],) + cache.shape[-2:]
        num_slots = flat_shape[-3]
        slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range -> dropped
        flat = cache.reshape(flat_shape)
        if cache.ndim == 4:
            flat = flat.at[slots].set(rows, mode="drop")
        else:
            flat = flat.at[layer, slots].set(rows, mode="drop")
        return flat.reshape(cache.shape)
    return scatter(k_cache, k), scatter(v_cache, v)


def _attend(q, k_seq, v_seq, q_pos, kv_len, scale, sliding_window, soft_cap):
    """q [N, H, D] at positions q_pos [N] over k_seq/v_seq [S, Hkv, D] (first kv_len valid)."""
    num_heads, num_kv_heads = q.shape[1], k_seq.shape[1]
    group = num_heads // num_kv_heads
    kv_pos = jnp.arange(k_seq.shape[0])
    # Slots past kv_len (tail of the last page, null-page padding) and before every query's
    # window (pages a sliding-window manager released to the null page) may hold anything, NaN
    # included: zero them so that a masked weight times garbage cannot poison the output.
    live = kv_pos < kv_len
    if sliding_window is not None:
        live &= kv_pos > jnp.min(q_pos) - sliding_window
    live = live[:, None, None]
    k = jnp.repeat(jnp.where(live, k_seq.astype(jnp.float32), 0.0), group, axis=1)
    v = jnp.repeat(jnp.where(live, v_seq.astype(jnp.float32), 0.0), group, axis=1)
    logits = jnp.einsum("nhd,shd->nhs", q.astype(jnp.float32), k,
                        precision=jax.lax.Precision.HIGHEST) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    mask = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < kv_len)
    if sliding_window is not None:
        mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
    logits = jnp.where(mask[:, None, :], logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    weights = jnp.where(mask[:, None, :], weights, 0.0)
    return jnp.einsum("nhs,shd->nhd", weights, v, precision=jax.lax.Precision.HIGHEST)


def _gather(cache, page_table_row):
    pages = cache[page_table_row]  # [P, page_size, Hkv, D]
    return pages.reshape((-1,) + cache.shape[-2:])


def paged_attention(q, k_cache, v_cache, page_table, seq_lens, *, layer=None, scale=None,
                    sliding_window=None, soft_cap=None):
    """Reference of :func:`jax_kvcm.ops.paged_attention` (gather pages, masked softmax)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kc, vc = _layer_view(k_cache, layer), _layer_view(v_cache, layer)

    def one(qb, pages, length):
        out = _attend(qb[None], _gather(kc, pages), _gather(vc, pages), (length - 1)[None],
                      length, scale, sliding_window, soft_cap)[0]
        return jnp.where(length > 0, out, 0.0)

    return jax.vmap(one)(q, page_table, seq_lens).astype(q.dtype)


def ragged_paged_attention(q, k_cache, v_cache, page_table, seq_lens, query_start, *, layer=None,
                           scale=None, sliding_window=None, soft_cap=None):
    """Reference of :func:`jax_kvcm.ops.ragged_paged_attention` (per-token gather, causal mask)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kc, vc = _layer_view(k_cache, layer), _layer_view(v_cache, layer)
    num_tokens, batch = q.shape[0], page_table.shape[0]
    t = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(query_start, t, side="right") - 1, 0, batch - 1)
    valid = (t >= query_start[0]) & (t < query_start[batch])
    pos = seq_lens[seq] - (query_start[seq + 1] - t)

    def one(qt, b, p):
        pages = page_table[b]
        return _attend(qt[None], _gather(kc, pages), _gather(vc, pages), p[None], seq_lens[b],
                       scale, sliding_window, soft_cap)[0]

    out = jax.vmap(one)(q, seq, pos)
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)
