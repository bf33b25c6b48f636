"""Paged-KV custom calls, usable inside ``jax.jit``.

Page-table convention: caches are ``[num_pages, page_size, num_kv_heads, head_dim]`` (optionally
with a leading layer axis); token ``i`` of sequence ``b`` lives in page ``page_table[b, i //
page_size]`` at offset ``i % page_size``; flat slot = ``page * page_size + offset``. Page 0 is the
null page: page-table padding points there.
"""

from __future__ import annotations

from typing import Any

import jax

from jax_kvcm import _ffi  # noqa: F401  (registers the handlers)
from jax_kvcm.ops import _checks

__all__ = ["paged_attention", "ragged_paged_attention", "write_kv"]


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, *, layer: Any = None) -> tuple[jax.Array, jax.Array]:
    """Writes new K/V rows into their cache slots, in place.

    Args:
      k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` or ``[L, num_pages, page_size, Hkv, D]``.
      k, v: ``[T, Hkv, D]``, same dtype as the caches.
      slot_mapping: int32 ``[T]``; flat slot ``page * page_size + offset``; negative = padding,
        skipped.
      layer: int32 scalar (may be traced) selecting the layer when the caches have a layer axis.

    Returns:
      ``(k_cache, v_cache)``, aliased to the inputs: under ``jax.jit(..., donate_argnums=...)``
      the write happens in place and nothing is copied.
    """
    cache_shape = _checks.check_write(k_cache, v_cache, k, v, slot_mapping)
    layer_arr = _checks.layer_operand(layer, cache_shape)
    out_types = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    call = jax.ffi.ffi_call("kvcm_write_kv", out_types, input_output_aliases={0: 0, 1: 1})
    k_out, v_out = call(k_cache, v_cache, k, v, slot_mapping, layer_arr)
    return k_out, v_out


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_table: jax.Array,
                    seq_lens: jax.Array, *, layer: Any = None, scale: float | None = None,
                    sliding_window: int | None = None,
                    soft_cap: float | None = None) -> jax.Array:
    """Decode attention over paged K/V: one query token per sequence.

    Args:
      q: ``[B, H, D]``; row ``b`` is the token at position ``seq_lens[b] - 1`` (already written).
      k_cache, v_cache: as in :func:`write_kv`; ``H % Hkv == 0`` (GQA: head ``h`` reads kv head
        ``h // (H // Hkv)``).
      page_table: int32 ``[B, P]``; padding entries point at the null page 0.
      seq_lens: int32 ``[B]``; 0 marks a padded row (output zeros, nothing read).
      layer: int32 scalar when the caches have a layer axis.
      scale: logit scale, default ``1/sqrt(D)``.
      sliding_window: attend to the last ``W`` positions only.
      soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)``.

    Returns:
      ``[B, H, D]`` in q's dtype (float32 accumulation).
    """
    cache_shape = _checks.check_attention(q, k_cache, v_cache, page_table, seq_lens, None)
    layer_arr = _checks.layer_operand(layer, cache_shape)
    attrs = _checks.attention_attrs(scale, sliding_window, soft_cap, cache_shape[-1])
    call = jax.ffi.ffi_call("kvcm_paged_attention", jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_cache, v_cache, page_table, seq_lens, layer_arr, **attrs)


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           page_table: jax.Array, seq_lens: jax.Array, query_start: jax.Array, *,
                           layer: Any = None, scale: float | None = None,
                           sliding_window: int | None = None,
                           soft_cap: float | None = None) -> jax.Array:
    """Prefill / mixed-batch attention over paged K/V with packed (ragged) queries.

    Args:
      q: ``[T, H, D]``; sequence ``b`` owns rows ``query_start[b]:query_start[b+1]``, which are
        the *last* tokens of its ``seq_lens[b]`` tokens (already written by :func:`write_kv`).
        Causal within each sequence. Rows at or past ``query_start[B]`` are padding (zeros).
      query_start: int32 ``[B + 1]``, non-decreasing.
      Other arguments as in :func:`paged_attention`.

    Returns:
      ``[T, H, D]`` in q's dtype.
    """
    cache_shape = _checks.check_attention(q, k_cache, v_cache, page_table, seq_lens, query_start)
    layer_arr = _checks.layer_operand(layer, cache_shape)
    attrs = _checks.attention_attrs(scale, sliding_window, soft_cap, cache_shape[-1])
    call = jax.ffi.ffi_call("kvcm_ragged_paged_attention", jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_cache, v_cache, page_table, seq_lens, query_start, layer_arr, **attrs)
