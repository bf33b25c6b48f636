"""Paged-KV custom calls, usable inside ``jax.jit``.

Page-table convention: caches are ``[num_pages, page_size, num_kv_heads, head_dim]`` (optionally
with a leading layer axis); token ``i`` of sequence ``b`` lives in page ``page_table[b, i //
page_size]`` at offset ``i % page_size``; flat slot = ``page * page_size + offset``. Page 0 is the
null page: page-table padding points there. With ``ring_table=True`` the table is a ring instead:
token ``i`` lives in page ``page_table[b, (i // page_size) % page_table.shape[1]]``.

FP8 K/V: caches may be ``float8_e4m3fn`` with float32 scales per (layer, kv head): ``write_kv``
stores ``saturate(x / scale)`` (rounded to nearest even, clamped to +-448, NaN kept), the attention
ops read ``float32(stored) * scale``. The scales are operands (they may be traced); they must be
finite and > 0: concrete ones are checked (ValueError naming the argument); traced ones are the
caller's to check where it makes them, or, within :func:`check_traced_scales`, get a
``checkify.debug_check`` (off by default: its effect slows every ``jax.jit`` dispatch of the
step; docs/fp8.md, "Scale values").

Non-finite values (one rule for the CPU handler, the CUDA kernels and the reference): a NaN or inf
in a K or V row that a query attends to makes that query's output non-finite (NaN when a K is
non-finite); values in slots that no query of the call reads (the null page, the tail of a
sequence's last page, positions before a window, unreferenced pages) never reach any output. All
three are exact per query: a position masked for one query (the causal future of a prefill chunk,
positions before its window) never affects that query, even where a kernel shares K/V tiles
between queries (the CUDA prefill kernel zeroes non-finite V rows of such tiles in shared memory
and sets the rows that do read them to NaN).

Arena pools: every op also takes two ArenaPools (:class:`~jax_kvcm._arena_pool.ArenaPool`) in
place of the cache arrays (both or neither), with exactly the semantics of a layer-major cache of
their logical shape ``[L, S, P, Hkv, D]``. ``over_array`` pools (slot-major ``[S, L, P, Hkv,
D]`` arrays) go to the same custom calls with the attribute ``slot_major=True``; ``write_kv``
returns pools around its aliased outputs. ``by_address`` pools (the CPU arena) go to the ``kvcm_arena_*`` handlers:
same checks, same CPU code, on the reservation itself; ``write_kv`` returns them with their
ordering tokens advanced. See ``jax_kvcm/_arena_pool.py`` for why the CPU arena cannot be a
donated array.

Index checking: ``check_indices=True`` (FFI attribute) makes the CUDA handlers synchronize after
their kernels and raise an error naming the bad argument (the CPU handler always checks). Left
None, it follows ``JAX_KVCM_CHECK_INDICES=1`` in the environment when the op is traced (the
environment overrides are listed in ``jax_kvcm._env``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax_kvcm import _arena_pool
from jax_kvcm import _ffi  # noqa: F401  (registers the handlers)
from jax_kvcm.ops import _checks
from jax_kvcm.ops._checks import check_traced_scales

__all__ = ["check_traced_scales", "paged_attention", "ragged_paged_attention", "write_kv"]


def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, *, layer: Any = None, k_scale: jax.Array | None = None,
             v_scale: jax.Array | None = None,
             check_indices: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Writes new K/V rows into their cache slots, in place.

    Args:
      k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` or ``[L, num_pages, page_size, Hkv, D]``,
        float32, bfloat16, float16 or float8_e4m3fn.
      k, v: ``[T, Hkv, D]``, the cache dtype (float32, bfloat16 or float16 for an fp8 cache).
      slot_mapping: int32 ``[T]``; flat slot ``page * page_size + offset``; negative = padding,
        skipped.
      layer: int32 scalar (may be traced) selecting the layer when the caches have a layer axis.
      k_scale, v_scale: fp8 caches only (required there): float32 ``[Hkv]`` (no layer axis) or
        ``[L, Hkv]``, finite and > 0; the cache stores ``saturate(k / k_scale[layer, head])``.
      check_indices: see the module docstring.

    Returns:
      ``(k_cache, v_cache)``, aliased to the inputs: under ``jax.jit(..., donate_argnums=...)``
      the write happens in place and nothing is copied (ArenaPools: over_array pools around the
      aliased outputs; by_address pools with their tokens advanced, always written in place).
    """
    form = _arena_pool.pool_pair_form(k_cache, v_cache)
    cache_shape = _checks.check_write(k_cache, v_cache, k, v, slot_mapping)
    layer_arr = _checks.layer_operand(layer, cache_shape)
    ks, vs = _checks.scale_operands(k_scale, v_scale, cache_shape, k_cache.dtype)
    if form == "address":
        return _arena_pool.write_kv_by_address(k_cache, v_cache,
                                               (k, v, slot_mapping, layer_arr, ks, vs))
    kc, vc = _arena_pool.physical_pair(k_cache, v_cache, form)
    out_types = (jax.ShapeDtypeStruct(kc.shape, kc.dtype), jax.ShapeDtypeStruct(vc.shape, vc.dtype))
    call = jax.ffi.ffi_call("kvcm_write_kv", out_types, input_output_aliases={0: 0, 1: 1})
    k_out, v_out = call(kc, vc, k, v, slot_mapping, layer_arr, ks, vs,
                        check_indices=np.bool_(_checks.resolve_check_indices(check_indices)),
                        slot_major=np.bool_(form == "array"))
    if form == "array":
        return k_cache.with_data(k_out), v_cache.with_data(v_out)
    return k_out, v_out


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_table: jax.Array,
                    seq_lens: jax.Array, *, layer: Any = None, scale: float | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                    ring_table: bool = False, return_lse: bool = False,
                    check_indices: bool | None = None) -> Any:
    """Decode attention over paged K/V: one query token per sequence.

    Args:
      q: ``[B, H, D]`` float32, bfloat16 or float16; row ``b`` is the token at position
        ``seq_lens[b] - 1`` (already written).
      k_cache, v_cache: as in :func:`write_kv`, q's dtype or float8_e4m3fn; ``H % Hkv == 0``
        (GQA: head ``h`` reads kv head ``h // (H // Hkv)``).
      page_table: int32 ``[B, P]``; padding entries point at the null page 0.
      seq_lens: int32 ``[B]``; 0 marks a padded row (output zeros, nothing read). At most
        ``P * page_size`` unless ``ring_table``.
      layer: int32 scalar when the caches have a layer axis.
      scale: logit scale, default ``1/sqrt(D)``.
      sliding_window: attend to the last ``W`` positions only.
      soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)``.
      k_scale, v_scale: fp8 caches only (required there), as in :func:`write_kv`; K/V are read as
        ``float32(cache) * scale``.
      ring_table: the table is a ring of ``P`` entries: position ``p`` lives in page
        ``page_table[b, (p // page_size) % P]``. The positions a row reads (its window) must span
        at most ``P`` pages (the CPU handler refuses more).
      return_lse: also return the log-sum-exp of each row's logits, float32 ``[B, H]`` (natural
        log of ``sum_j exp(logit_j)`` over the attended positions; -inf with none, NaN with a NaN
        logit). Two calls over disjoint positions of the same queries merge exactly with
        :func:`jax_kvcm.ops.cascade.merge_attention_states`. Not on by-address (CPU arena) pools.
      check_indices: see the module docstring.

    Returns:
      ``[B, H, D]`` in q's dtype (float32 accumulation); ``(out, lse)`` with ``return_lse``.
    """
    form = _arena_pool.pool_pair_form(k_cache, v_cache)
    cache_shape = _checks.check_attention(q, k_cache, v_cache, page_table, seq_lens, None)
    layer_arr = _checks.layer_operand(layer, cache_shape)
    ks, vs = _checks.scale_operands(k_scale, v_scale, cache_shape, k_cache.dtype)
    attrs = _attention_attrs(scale, sliding_window, soft_cap, cache_shape, ring_table,
                             check_indices)
    return_lse = _checks.check_flag(return_lse, "return_lse")
    if form == "address":
        if return_lse:
            raise ValueError("return_lse is not supported on by-address (CPU arena) pools")
        return _arena_pool.attention_by_address("kvcm_paged_attention", q, k_cache, v_cache,
                                                (page_table, seq_lens, layer_arr, ks, vs), attrs)
    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if return_lse:
        call = jax.ffi.ffi_call("kvcm_paged_attention_lse",
                                (out_type, jax.ShapeDtypeStruct(q.shape[:2], np.float32)))
    else:
        call = jax.ffi.ffi_call("kvcm_paged_attention", out_type)
    kc, vc = _arena_pool.physical_pair(k_cache, v_cache, form)
    return call(q, kc, vc, page_table, seq_lens, layer_arr, ks, vs,
                slot_major=np.bool_(form == "array"), **attrs)


def ragged_paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           page_table: jax.Array, seq_lens: jax.Array, query_start: jax.Array, *,
                           layer: Any = None, scale: float | None = None,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                           ring_table: bool = False,
                           check_indices: bool | None = None) -> jax.Array:
    """Prefill / mixed-batch attention over paged K/V with packed (ragged) queries.

    Args:
      q: ``[T, H, D]``; sequence ``b`` owns rows ``query_start[b]:query_start[b+1]``, which are
        the *last* tokens of its ``seq_lens[b]`` tokens (already written by :func:`write_kv`).
        Causal within each sequence. Rows at or past ``query_start[B]`` are padding (zeros).
      query_start: int32 ``[B + 1]``, non-decreasing.
      ring_table: as in :func:`paged_attention`; the positions sequence ``b`` reads (from its
        first query's window start to ``seq_lens[b]``) must span at most ``P`` pages.
      Other arguments as in :func:`paged_attention`.

    Returns:
      ``[T, H, D]`` in q's dtype.
    """
    form = _arena_pool.pool_pair_form(k_cache, v_cache)
    cache_shape = _checks.check_attention(q, k_cache, v_cache, page_table, seq_lens, query_start)
    layer_arr = _checks.layer_operand(layer, cache_shape)
    ks, vs = _checks.scale_operands(k_scale, v_scale, cache_shape, k_cache.dtype)
    attrs = _attention_attrs(scale, sliding_window, soft_cap, cache_shape, ring_table,
                             check_indices)
    if form == "address":
        return _arena_pool.attention_by_address(
            "kvcm_ragged_paged_attention", q, k_cache, v_cache,
            (page_table, seq_lens, query_start, layer_arr, ks, vs), attrs)
    call = jax.ffi.ffi_call("kvcm_ragged_paged_attention", jax.ShapeDtypeStruct(q.shape, q.dtype))
    kc, vc = _arena_pool.physical_pair(k_cache, v_cache, form)
    return call(q, kc, vc, page_table, seq_lens, query_start, layer_arr, ks, vs,
                slot_major=np.bool_(form == "array"), **attrs)


def _attention_attrs(scale: Any, sliding_window: Any, soft_cap: Any,
                     cache_shape: tuple[int, ...], ring_table: Any,
                     check_indices: Any) -> dict[str, Any]:
    attrs = _checks.attention_attrs(scale, sliding_window, soft_cap, cache_shape[-1])
    attrs["ring_table"] = np.bool_(_checks.check_flag(ring_table, "ring_table"))
    attrs["check_indices"] = np.bool_(_checks.resolve_check_indices(check_indices))
    return attrs
