"""Shared-prefix (cascade) decode attention: each shared prefix is read once per group.

When several decoding sequences share their first pages (a system prompt the prefix cache
deduplicated), :func:`paged_attention` reads those pages once per sequence. Here the step's rows
are split into groups that share whole pages (:func:`jax_kvcm.plan_cascade` builds the
:class:`~jax_kvcm.CascadeBatch` from the step's page table), and each row's attention is two
partial attentions merged by their log-sum-exp:

- **prefix**: one :func:`paged_attention` call per group. The ``N`` members' queries are packed as
  the query heads of one row (GQA: ``N * H / Hkv`` heads per kv head), so the decode kernel reads
  the group's prefix pages once for all members;
- **suffix**: one :func:`paged_attention` call per row over its own pages (its table shifted past
  the prefix pages, its length minus the prefix);
- **merge**: ``out = (w_p * o_p + w_s * o_s) / (w_p + w_s)`` with ``w = exp(lse - max)``.

The result equals :func:`paged_attention` over the whole rows up to the rounding of the two
partial outputs to q's dtype. The non-finite rule is the same: a NaN in an attended prefix or
suffix row reaches the output (a NaN output or log-sum-exp is never weighted away); positions no
query attends are never read. Not for sliding windows or ring tables (positions are shifted).

Cost: the prefix pass runs ``G = max(1, B // 2)`` rows of ``N * H`` heads, the suffix pass ``B``
rows. The CUDA decode kernel covers up to 16 query heads per kv head, so ``N <= 16 / (H / Hkv)``
(4 at Llama-3.1-8B's 32 / 8), and with fp8 caches 8 / (H / Hkv) is what costs it no compute:
:func:`jax_kvcm.cascade_group_size`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_kvcm._cascade_plan import CascadeBatch
from jax_kvcm.ops import paged_attention

__all__ = ["cascade_paged_attention", "merge_attention_states"]


def merge_attention_states(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array,
                           lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merges two attentions of the same queries over disjoint key sets.

    Args:
      out_a, out_b: ``[..., H, D]`` normalized outputs (any float dtype).
      lse_a, lse_b: float32 ``[..., H]``, their log-sum-exp (-inf: nothing attended).

    Returns:
      ``(out, lse)``: float32 ``[..., H, D]`` and ``[..., H]``, the attention over the union.
      Nothing attended on either side: zeros and -inf. A NaN output or log-sum-exp on a side
      that attended anything gives NaN.
    """
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # both -inf (nothing attended): weights exp(-inf) = 0
    w_a = jnp.exp(lse_a - m)[..., None]
    w_b = jnp.exp(lse_b - m)[..., None]
    # A side with weight 0 attended nothing (its output is 0). A NaN weight (NaN lse) stays in den.
    num = (jnp.where(w_a == 0, 0.0, w_a * out_a.astype(jnp.float32))
           + jnp.where(w_b == 0, 0.0, w_b * out_b.astype(jnp.float32)))
    den = w_a + w_b
    out = jnp.where(den == 0, 0.0, num / jnp.where(den == 0, 1.0, den))
    return out, m + jnp.log(den[..., 0])


def cascade_paged_attention(q: jax.Array, k_cache: Any, v_cache: Any, cascade: CascadeBatch, *,
                            layer: Any = None, scale: float | None = None,
                            soft_cap: float | None = None, k_scale: jax.Array | None = None,
                            v_scale: jax.Array | None = None,
                            check_indices: bool | None = None) -> jax.Array:
    """:func:`paged_attention` of the rows of ``cascade`` with shared prefixes read once a group.

    Args:
      q: ``[B, H, D]``, as in :func:`paged_attention`.
      k_cache, v_cache: as in :func:`paged_attention` (arrays or over_array arena pools).
      cascade: the step's :class:`~jax_kvcm.CascadeBatch` (``B`` rows, ``G`` groups of ``N``).
      layer, scale, soft_cap, k_scale, v_scale, check_indices: as in :func:`paged_attention`.

    Returns:
      ``[B, H, D]`` in q's dtype: :func:`paged_attention` over the rows' full tables (page
      table ``cascade`` was planned from), within q's dtype's rounding.
    """
    B, H, D = q.shape
    if cascade.suffix_table.shape[0] != B:
        raise ValueError(f"cascade has {cascade.suffix_table.shape[0]} rows, q has {B}")
    G, N = cascade.members.shape
    hkv = k_cache.shape[-2]
    group = H // hkv if hkv and H % hkv == 0 else 0
    if not group:
        raise ValueError(f"q's {H} heads are not a multiple of the caches' {hkv} kv heads")
    kw = dict(layer=layer, scale=scale, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
              check_indices=check_indices, return_lse=True)
    # Member n of group g, query head j of kv head k -> packed head k * (N * group) + n * group
    # + j: GQA maps it to kv head k, so the row reads its kv heads' prefix pages once.
    packed = (q[cascade.members].reshape(G, N, hkv, group, D).transpose(0, 2, 1, 3, 4)
              .reshape(G, hkv * N * group, D))
    out_p, lse_p = paged_attention(packed, k_cache, v_cache, cascade.prefix_table,
                                   cascade.prefix_lens, **kw)
    out_p = out_p.reshape(G, hkv, N, group, D).transpose(0, 2, 1, 3, 4).reshape(G * N, H, D)
    lse_p = lse_p.reshape(G, hkv, N, group).transpose(0, 2, 1, 3).reshape(G * N, H)
    slot = cascade.member_slot
    grouped = (slot >= 0)[:, None]
    slot = jnp.maximum(slot, 0)
    out_p = out_p[slot]
    lse_p = jnp.where(grouped, lse_p[slot], -jnp.inf)
    out_s, lse_s = paged_attention(q, k_cache, v_cache, cascade.suffix_table, cascade.suffix_lens,
                                   **kw)
    out, _ = merge_attention_states(out_p, lse_p, out_s, lse_s)
    return out.astype(q.dtype)
