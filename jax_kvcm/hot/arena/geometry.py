"""Where an arena's pages live: ranges, chunks and slots (pure arithmetic, no memory).

An arena backs one hot pool group with two virtual reservations, K and V, each laid out
**slot-major**: ``[num_slots, num_layers, tokens_per_page, num_kv_heads, head_dim]``, so one page
of one pool is ``pool_page_bytes = L * P * Hkv * D * itemsize`` consecutive bytes, every layer
included. Physical memory is mapped in *chunks*: ``pages_per_chunk`` consecutive slots, the
smallest run whose bytes are whole super-pages (``lcm(pool_page_bytes, super_page_bytes)`` per
pool). A chunk therefore follows the super-page, not the layer count: at the Llama-3.1-8B shape
(1 MiB per page per pool) a 2 MiB super-page holds 2 pages; the layer-major layout the paged
pools use would need ``2 * num_layers`` super-pages per chunk (64 pages, 128 MiB there), and every
sequence would round its memory up to that.

Chunk 0 is the null chunk (slot 0 is the null page; mapped for the arena's life, outside the
budget). Range ``r`` (one per sequence at a time) owns chunks ``[1 + r * C, 1 + (r + 1) * C)``
with ``C = ceil(pages_per_seq / pages_per_chunk)``: page ``j`` of the sequence holding range ``r``
sits at slot ``range_base(r) + j``.

The flat token slot ``slot * tokens_per_page + offset`` the ops take is int32: the geometry
refuses an arena whose slots do not fit (:func:`check_int32`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jax_kvcm._types import check_count

__all__ = ["ArenaGeometry", "INT32_MAX"]

INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class ArenaGeometry:
    """The geometry of one arena (see the module docstring). ``pool_page_bytes``: bytes of one
    page of one pool (K or V); ``pages_per_seq``: a range's pages (``ceil(max_seq_len /
    tokens_per_page)``); ``max_sequences``: ranges; ``budget_pages``: physical pages the arena
    may map (rounded down to whole chunks)."""

    pool_page_bytes: int
    super_page_bytes: int
    pages_per_seq: int
    max_sequences: int
    tokens_per_page: int
    budget_pages: int

    def __post_init__(self) -> None:
        for name in ("pool_page_bytes", "super_page_bytes", "pages_per_seq", "max_sequences",
                     "tokens_per_page", "budget_pages"):
            check_count(getattr(self, name), name, minimum=1)

    @property
    def pages_per_chunk(self) -> int:
        return math.lcm(self.pool_page_bytes, self.super_page_bytes) // self.pool_page_bytes

    @property
    def super_pages_per_chunk(self) -> int:
        """Super-pages of one chunk in one pool."""
        return self.pages_per_chunk * self.pool_page_bytes // self.super_page_bytes

    @property
    def chunk_bytes(self) -> int:
        """Physical bytes one chunk maps, K and V together."""
        return 2 * self.pages_per_chunk * self.pool_page_bytes

    @property
    def chunks_per_range(self) -> int:
        return -(-self.pages_per_seq // self.pages_per_chunk)

    @property
    def num_chunks(self) -> int:
        """Chunks of the reservation, the null chunk included."""
        return 1 + self.max_sequences * self.chunks_per_range

    @property
    def num_slots(self) -> int:
        return self.num_chunks * self.pages_per_chunk

    @property
    def pool_bytes(self) -> int:
        """Virtual bytes of one pool's reservation."""
        return self.num_slots * self.pool_page_bytes

    @property
    def budget_chunks(self) -> int:
        """Chunks the budget maps (the null chunk comes on top)."""
        return self.budget_pages // self.pages_per_chunk

    def range_base(self, r: int) -> int:
        """Slot of page 0 of range ``r``."""
        return (1 + r * self.chunks_per_range) * self.pages_per_chunk

    def chunk_of(self, slot: int) -> int:
        return slot // self.pages_per_chunk

    def range_of_slot(self, slot: int) -> int:
        """The range holding ``slot`` (-1: the null chunk)."""
        return (slot // self.pages_per_chunk - 1) // self.chunks_per_range if slot >= \
            self.pages_per_chunk else -1

    def check_int32(self, what: str) -> None:
        """ValueError naming ``what`` when a flat token slot could exceed int32."""
        top = self.num_slots * self.tokens_per_page - 1
        if top > INT32_MAX:
            raise ValueError(f"{what}: the arena's {self.num_slots} slots x "
                             f"{self.tokens_per_page} tokens per page exceed int32 token slots "
                             f"({top} > {INT32_MAX}); lower max_sequences or max_seq_len")
