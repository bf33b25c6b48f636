"""StepBatch: the fixed-shape int32 index buffers of one step, as a registered-dataclass pytree.

Shapes (``B`` the batch bucket, ``T`` the token bucket, ``P = ceil(max_seq_len /
tokens_per_page)``, ``G`` the number of layer groups when > 1):

- ``page_table``   ``[B, P]`` (``[G, B, P]``): padding -> 0 (the null page);
- ``seq_lens``     ``[B]``: tokens of each sequence after this step (padded rows 0);
- ``query_start``  ``[B + 1]``: row ``b``'s new tokens are ``query_start[b]:query_start[b+1]``
  (padded rows repeat the total);
- ``slot_mapping`` ``[T]`` (``[G, T]``): flat slot ``page * tokens_per_page + offset``, padding -1;
- ``positions``    ``[T]``: position of each new token in its sequence (padding 0).

Layer groups own their pages, so with ``G > 1`` the page table and slot mapping have a leading
group axis: group ``g``'s ``write_kv`` takes ``slot_mapping[g]`` and its attention
``page_table[g]`` (with its own pools and ``sliding_window``); token counts, lengths and positions
are the same for every group. In a sliding-window group, entries of pages wholly before the
window of every query of the row are 0 (the manager released them); the attention ops never read
keys outside the window, so those entries are never dereferenced for data.

Widths: ``P`` above is the largest of the groups' widths ``KVCacheConfig.table_widths``. A full
group's width is ``ceil(max_seq_len / tokens_per_page)`` and page ``j`` of a row is entry ``j``.
With ``KVCacheConfig.ring_tables`` a sliding-window group's width ``R`` is a ring: the page of
position ``p`` is entry ``(p // tokens_per_page) % R``; its table is
``page_table[g, :, :table_widths[g]]`` (entries past ``R`` are 0), read by the ops with
``ring_table=True``. A model of window groups only gets ``[B, R]``.

NOTE: every field is a data field (no static metadata), so the pytree structure never changes and
a jitted step compiles once per (B, T) bucket.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import jax
import numpy as np

__all__ = ["StepBatch", "default_buckets", "pick_bucket"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class StepBatch:
    page_table: np.ndarray
    seq_lens: np.ndarray
    query_start: np.ndarray
    slot_mapping: np.ndarray
    positions: np.ndarray

    @classmethod
    def padding(cls, batch_bucket: int, token_bucket: int, width: int,
                num_groups: int = 1) -> StepBatch:
        """All padding: ``[B, P]`` (``[G, B, P]``) page ids 0, lengths and query starts 0,
        ``[T]`` (``[G, T]``) slots -1, positions 0; fresh writable arrays (``prepare_step``
        fills its rows into one; ``KVCacheConfig.padding_batch`` checks the buckets)."""
        lead = (num_groups,) if num_groups > 1 else ()
        return cls(page_table=np.zeros(lead + (batch_bucket, width), np.int32),
                   seq_lens=np.zeros(batch_bucket, np.int32),
                   query_start=np.zeros(batch_bucket + 1, np.int32),
                   slot_mapping=np.full(lead + (token_bucket,), -1, np.int32),
                   positions=np.zeros(token_bucket, np.int32))

    @property
    def num_seqs(self) -> int:
        """Real (unpadded) rows: the rows with ``seq_lens > 0`` come first."""
        return int(np.count_nonzero(np.asarray(self.seq_lens)))

    @property
    def num_tokens(self) -> int:
        return int(np.asarray(self.query_start)[-1])


def default_buckets(maximum: int, minimum: int = 1) -> tuple[int, ...]:
    """Powers of two from ``minimum`` up to and including ``maximum`` (the last entry)."""
    out = []
    b = max(1, minimum)
    while b < maximum:
        out.append(b)
        b *= 2
    out.append(maximum)
    return tuple(out)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket >= ``n`` (``buckets`` ascending; the caller bounds ``n``)."""
    return buckets[bisect.bisect_left(buckets, n)]
