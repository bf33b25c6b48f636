"""Hot tiers: how the device pages of one hot pool group are stored, under one manager.

A hot tier owns, for each hot pool group it serves, the K and V pools a step takes (donated),
which slots are allocated, and the device bytes they charge to the byte governor. The storage
manager (:mod:`jax_kvcm._storage`) runs every migration over it, and the KV-cache manager
(:mod:`jax_kvcm.manager`) plans room, eviction and admission over it, through one protocol
(:class:`HotTier`) with two implementations:

- :class:`~jax_kvcm.hot.paged.PagedTier` (``KVCacheConfig(hot=PagedHot())``, the default): one
  preallocated layer-major pool pair per group; a page is any free slot.
- :class:`~jax_kvcm.hot.arena.tier.ArenaTier` (``KVCacheConfig(hot=ArenaHot(...))``): virtual
  reservations, slot-major, mapped on demand in chunks; each sequence holds a contiguous range
  (page ``j`` at ``base + j``), so an allocation names its slots (``at``).

Allocation is a two-phase :class:`Grant` (the migration transaction's step 1): ``commit()`` once
everything was submitted, or ``undo()``, which returns the tier exactly to where it was (free
counts, mapped chunks, governor ledger). Capacity refusals return None; misuse raises.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

__all__ = ["Grant", "HotTier", "LeaseGrant"]


class Grant(Protocol):
    """Device slots allocated by :meth:`HotTier.allocate`, not yet committed."""

    slots: np.ndarray

    def commit(self) -> None: ...

    def undo(self) -> None: ...


class HotTier(Protocol):
    """The device tier of some hot pool groups (see the module docstring). ``h``: a hot pool
    group index of the storage manager."""

    kind: str  # "paged" | "arena"

    def pools(self, h: int) -> tuple[Any, Any]:
        """The K and V pools of group ``h`` (what a step donates and returns)."""

    def set_pools(self, h: int, pools: tuple[Any, Any]) -> None: ...

    def allocate(self, h: int, n: int, at: np.ndarray | None = None) -> Grant | None:
        """``n`` slots (``at``: exactly these, the arena), or None (nothing changed)."""

    def free(self, h: int, slots: np.ndarray) -> None: ...

    def allocator(self, h: int) -> Any:
        """Slot bookkeeping of group ``h``: ``num_slots``, ``num_free``, ``is_allocated``,
        ``all_allocated`` (range-checked)."""

    def num_free(self, h: int) -> int:
        """Pages group ``h`` can allocate without evicting or waiting (free slots; an arena:
        free slots of mapped chunks plus the pages of the chunks its budget can still map)."""

    def capacity_pages(self, h: int) -> int:
        """Pages group ``h`` can hold at once (paged: its slots; an arena: its budget)."""

    def committed_bytes(self, h: int) -> int:
        """Device bytes group ``h`` charges to the governor now."""

    def note_use(self, h: int, token: Any) -> None:
        """A migration's token (it read or wrote group ``h``'s pools)."""

    def rebuild_pools(self) -> bool:
        """New pool arrays after a failed step consumed them; True when their content survived
        (the arena's memory outlives its arrays), False when it is lost (zeros)."""

    def close(self) -> None: ...


class LeaseGrant:
    """A :class:`Grant` of slots taken from an allocator (``allocate(n)`` / ``free(slots)``)
    under an uncommitted governor lease: paged pools and the cold tiers."""

    __slots__ = ("slots", "_lease", "_allocator")

    def __init__(self, slots: np.ndarray, lease: Any, allocator: Any) -> None:
        self.slots, self._lease, self._allocator = slots, lease, allocator

    def commit(self) -> None:
        self._lease.commit()

    def undo(self) -> None:
        if self.slots.size:
            self._allocator.free(self.slots)
        self._lease.release()
