"""plan_cascade: the fixed-shape index buffers of a shared-prefix (cascade) decode step.

Sequences that reuse a cached prefix hold the *same* page ids for it (the prefix tree hands every
holder the canonical pages), so the step's page table says which rows share what: rows whose
tables agree on their first ``k`` entries read the same ``k`` pages. :func:`plan_cascade` groups
the rows of a decode step by their first page, splits each set into groups of at most ``N``
members, and gives each group the longest run of whole pages all its members share (only pages
wholly before each member's last position: the page a row writes this step is its own).

Shapes (``B`` rows, ``P`` table width, ``G = max(1, B // 2)`` groups, ``N`` members a group):

- ``prefix_table`` ``[G, P]``: the group's shared pages, then 0 (the null page);
- ``prefix_lens``  ``[G]``: shared tokens (a multiple of the page size; 0: unused group);
- ``members``      ``[G, N]``: the member rows (padding: row 0, its result unused);
- ``member_slot``  ``[B]``: ``g * N + n`` for member ``n`` of group ``g``, -1 for a row in no
  group;
- ``suffix_table`` ``[B, P]``: the row's table without its group's prefix pages, then 0;
- ``suffix_lens``  ``[B]``: the row's tokens after the prefix (its whole length outside groups).

Every field is int32 and every shape depends on ``(B, P, N)`` only, so a jitted step compiles
once per bucket (:class:`jax_kvcm.StepBatch`'s rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CascadeBatch", "plan_cascade", "cascade_group_size"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class CascadeBatch:
    prefix_table: np.ndarray
    prefix_lens: np.ndarray
    members: np.ndarray
    member_slot: np.ndarray
    suffix_table: np.ndarray
    suffix_lens: np.ndarray

    @property
    def shared_tokens_read(self) -> int:
        """Prefix tokens the step reads once per group instead of once per member."""
        return int(np.asarray(self.prefix_lens).sum())

    @property
    def tokens_saved(self) -> int:
        """Token reads the cascade saves against reading every row whole."""
        lens = np.asarray(self.prefix_lens)
        counts = np.bincount(np.asarray(self.member_slot)[np.asarray(self.member_slot) >= 0]
                             // self.members.shape[1], minlength=lens.shape[0])
        return int(((counts - 1).clip(min=0) * lens).sum())


def cascade_group_size(num_heads: int, num_kv_heads: int, kv_dtype: Any = None) -> int:
    """Members a group (at least 2) for ``num_heads / num_kv_heads`` query heads per kv head:
    the most whose packed heads fit one pass of the CUDA decode kernel without costing it
    compute, 16 for 16-bit caches and 8 for float8_e4m3fn caches (whose kernel converts every
    element it reads and, at 16 heads, ran at a third of the copy bandwidth: see
    benchmarks/bench_cascade.py)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    fp8 = kv_dtype is not None and np.dtype(kv_dtype) == np.dtype(jnp.float8_e4m3fn)
    return max(2, (8 if fp8 else 16) // (num_heads // num_kv_heads))


def plan_cascade(page_table: np.ndarray, seq_lens: np.ndarray, *, page_size: int,
                 max_members: int, min_prefix_pages: int = 1) -> CascadeBatch:
    """Groups the rows of a decode step that share leading pages (see the module docstring).

    Args:
      page_table: int32 ``[B, P]``, the step's table (absolute, one layer group; no ring).
      seq_lens: int32 ``[B]``, tokens of each row after the step (0: padded row).
      page_size: tokens per page.
      max_members: ``N``, members a group at most (>= 2): :func:`cascade_group_size`.
      min_prefix_pages: a group needs at least this many shared pages (>= 1).

    Returns:
      The :class:`CascadeBatch`. Host work: one sort of ``B`` and a compare per group.
    """
    table = np.asarray(page_table)
    lens = np.asarray(seq_lens)
    if table.ndim != 2 or lens.shape != table.shape[:1]:
        raise ValueError(f"page_table must be [B, P] and seq_lens [B], got {table.shape} and "
                         f"{lens.shape}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if max_members < 2:
        raise ValueError(f"max_members must be >= 2, got {max_members}")
    if min_prefix_pages < 1:
        raise ValueError(f"min_prefix_pages must be >= 1, got {min_prefix_pages}")
    B, P = table.shape
    G, N = max(1, B // 2), max_members
    # Shareable pages of a row: those wholly before the page of its last position.
    limit = np.where(lens > 0, (lens.astype(np.int64) - 1) // page_size, 0).clip(max=P)
    rows = np.flatnonzero(limit >= min_prefix_pages)
    rows = rows[np.argsort(table[rows, 0], kind="stable")]
    # Buckets: runs of one first page. A bucket of n rows splits into k = ceil(n / N) chunks
    # as even as possible (np.array_split's sizes: the first n % k of n // k + 1 rows).
    first = table[rows, 0]
    new_bucket = np.r_[True, first[1:] != first[:-1]] if len(rows) else np.zeros(0, bool)
    bucket = np.cumsum(new_bucket) - 1
    start = np.flatnonzero(new_bucket)
    n = np.bincount(bucket, minlength=len(start))[bucket]
    i = np.arange(len(rows)) - start[bucket]
    k = -(-n // N)
    small, extra = n // k, n % k
    cut = extra * (small + 1)
    chunk_in_bucket = np.where(i < cut, i // (small + 1), extra + (i - cut) // np.maximum(small, 1))
    chunk_size = np.where(chunk_in_bucket < extra, small + 1, small)
    new_chunk = np.r_[True, (bucket[1:] != bucket[:-1])
                      | (chunk_in_bucket[1:] != chunk_in_bucket[:-1])] if len(rows) else new_bucket
    chunk = np.cumsum(new_chunk) - 1
    chunk_start = np.flatnonzero(new_chunk)
    # Shared pages of a chunk: the first column where a member differs from the chunk's first
    # row, at most every member's limit.
    same = table[rows] == table[rows[chunk_start[chunk]]]
    agree = np.where(same.all(axis=1), P, np.argmin(same, axis=1))
    shared = np.minimum(agree, limit[rows])
    lcp = np.minimum.reduceat(shared, chunk_start) if len(rows) else shared
    keep = (chunk_size[chunk_start] >= 2) & (lcp >= min_prefix_pages)
    group_of_chunk = np.where(keep, np.cumsum(keep) - 1, -1)
    group_of_chunk[group_of_chunk >= G] = -1   # more groups than G: the rest read whole
    g = group_of_chunk[chunk]
    member = np.flatnonzero(g >= 0)
    rows_in, g_in, n_in = rows[member], g[member], (i - (chunk_start[chunk] - start[bucket]))[member]
    kept = np.flatnonzero(group_of_chunk >= 0)
    num_groups = len(kept)
    prefix_lens = np.zeros(G, np.int32)
    prefix_lens[:num_groups] = lcp[kept] * page_size
    prefix_table = np.zeros((G, P), np.int32)
    lead = table[rows[chunk_start[kept]]]
    prefix_table[:num_groups] = np.where(np.arange(P)[None, :] < lcp[kept][:, None], lead, 0)
    members = np.zeros((G, N), np.int32)
    members[g_in, n_in] = rows_in
    member_slot = np.full(B, -1, np.int32)
    member_slot[rows_in] = g_in * N + n_in
    prefix_pages = np.zeros(B, np.int64)
    prefix_pages[rows_in] = lcp[kept][g_in]
    suffix_table = np.zeros_like(table, dtype=np.int32)
    cols = np.arange(P)[None, :] + prefix_pages[:, None]
    inside = cols < P
    suffix_table[inside] = table[np.nonzero(inside)[0], cols[inside]]
    suffix_lens = (lens - prefix_pages * page_size).astype(np.int32)
    return CascadeBatch(prefix_table, prefix_lens, members, member_slot, suffix_table,
                        suffix_lens)
