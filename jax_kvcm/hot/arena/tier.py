"""The arena hot tier of one hot pool group: slots at fixed places, chunks mapped on demand.

:class:`ArenaTier` implements :class:`~jax_kvcm.hot.HotTier` over an :class:`ArenaMemory`. An
allocation names its slots (``at``: a range's ``base + j``, chosen by the manager's
:class:`~jax_kvcm.manager.arena_room.ArenaRoom`); the chunks they fall in are mapped first, each
charged to the governor, all or nothing (:class:`ArenaGrant`). Freed slots stay mapped: their chunk
returns to the budget only when the manager reclaims it (:meth:`ArenaTier.unmap`), under pressure.

Accounting in pages: ``capacity = budget_chunks * pages_per_chunk``; ``free`` = unallocated slots
of mapped chunks + the pages of the chunks the budget can still map, so ``capacity == free +
allocated`` (allocated = referenced + cached + pending pages of the manager's census).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from jax_kvcm._governor import MemoryGovernor
from jax_kvcm._slots import all_marked
from jax_kvcm.hot.arena.geometry import ArenaGeometry
from jax_kvcm.hot.arena.memory import ArenaMemory

__all__ = ["ArenaGrant", "ArenaSpec", "ArenaTier"]


@dataclass(frozen=True, slots=True)
class ArenaSpec:
    """What the storage manager needs to build an arena for a hot pool group."""

    geometry: ArenaGeometry
    backend: str = "auto"


class _Slots:
    """Slot bookkeeping as the storage manager reads it (``num_slots - num_free`` allocated,
    the null page included; the null chunk's other slots are no one's)."""

    __slots__ = ("_tier",)

    def __init__(self, tier: ArenaTier) -> None:
        self._tier = tier

    @property
    def num_slots(self) -> int:
        geo = self._tier.geometry
        return geo.num_slots - geo.pages_per_chunk + 1

    @property
    def num_free(self) -> int:
        return self.num_slots - 1 - self._tier.num_allocated

    def is_allocated(self, slot: int) -> bool:
        if not 0 <= slot < self._tier.used.size:
            return False
        return slot == 0 or bool(self._tier.used[slot])

    def all_allocated(self, slots: np.ndarray) -> bool:
        return all_marked(self._tier.used, slots)

    def free(self, slots: np.ndarray) -> None:
        self._tier.release(slots)


class ArenaGrant:
    """Slots marked allocated, their fresh chunks mapped (see :class:`~jax_kvcm.hot.Grant`)."""

    __slots__ = ("slots", "_tier", "_fresh")

    def __init__(self, slots: np.ndarray, tier: ArenaTier, fresh: list[int]) -> None:
        self.slots, self._tier, self._fresh = slots, tier, fresh

    def commit(self) -> None:
        pass

    def undo(self) -> None:
        self._tier.release(self.slots)
        # NOTE: a failed submission may have issued work into the fresh chunks: quiesce first.
        self._tier.memory.unmap(self._fresh, quiesce=True)


class ArenaTier:
    """One hot pool group's arena (see the module docstring)."""

    kind = "arena"

    def __init__(self, h: int, spec: ArenaSpec, layout: Any, governor: MemoryGovernor,
                 device: Any) -> None:
        self.h = h
        self.geometry = geo = spec.geometry
        self.memory = ArenaMemory(geo, layout, governor, spec.backend, device)
        self.used = np.zeros(geo.num_slots, bool)  # allocated slots (the null page apart)
        self.num_allocated = 0
        self.used_in_chunk = np.zeros(geo.num_chunks, np.int64)
        self._slots = _Slots(self)

    # -- HotTier ---------------------------------------------------------------------------------

    def pools(self, h: int) -> tuple[Any, Any]:
        return self.memory.pools

    def set_pools(self, h: int, pools: tuple[Any, Any]) -> None:
        self.memory.set_pools(pools)

    def allocator(self, h: int) -> _Slots:
        return self._slots

    def capacity_pages(self, h: int) -> int:
        return self.geometry.budget_chunks * self.geometry.pages_per_chunk

    def num_free(self, h: int) -> int:
        return self.capacity_pages(h) - self.num_allocated

    def free_budget_chunks(self) -> int:
        return self.geometry.budget_chunks - self.memory.num_mapped

    def allocate(self, h: int, n: int, at: np.ndarray | None = None) -> ArenaGrant | None:
        if at is None:
            raise ValueError("an arena allocation names its slots (at): the manager places "
                             "page j of a sequence at its range's base + j")
        at = np.asarray(at, np.int32).reshape(-1)
        if at.size != n:
            raise ValueError(f"at: {at.size} slots for {n} pages")
        geo = self.geometry
        if n and (at.min() < geo.pages_per_chunk or at.max() >= geo.num_slots
                  or np.unique(at).size != n or self.used[at].any()):
            raise ValueError(f"at: slots {at.tolist()} must be distinct free slots of ranges")
        chunks = np.unique(at // geo.pages_per_chunk).tolist()
        fresh = [c for c in chunks if not self.memory.is_mapped(c)]
        if len(fresh) > self.free_budget_chunks() or not self.memory.map(fresh):
            return None
        self._mark(at, True)
        return ArenaGrant(at, self, fresh)

    def free(self, h: int, slots: np.ndarray) -> None:
        self.release(np.asarray(slots, np.int32))

    def release(self, slots: np.ndarray) -> None:
        if slots.size == 0:
            return
        if not self.used[slots].all():
            raise ValueError(f"slots {slots.tolist()} are not allocated arena slots")
        self._mark(slots, False)

    def _mark(self, slots: np.ndarray, used: bool) -> None:
        self.used[slots] = used
        np.add.at(self.used_in_chunk, slots // self.geometry.pages_per_chunk,
                  1 if used else -1)
        self.num_allocated += slots.size if used else -slots.size

    def committed_bytes(self, h: int) -> int:
        return self.memory.num_mapped * self.geometry.chunk_bytes

    def note_use(self, h: int, token: Any) -> None:
        """A migration read or wrote the pools: an unmap waits for it."""
        self.memory.note_use(token)

    def rebuild_pools(self) -> bool:
        return self.memory.rebuild_pools()

    def close(self) -> None:
        self.memory.close()

    # -- chunks (the manager's reclaim) ----------------------------------------------------------

    def chunk_used(self, chunk: int) -> int:
        """Allocated slots of ``chunk``."""
        return int(self.used_in_chunk[chunk])

    def empty_mapped_chunks(self, chunks: list[int]) -> list[int]:
        """Those of ``chunks`` that are mapped and hold no allocated slot."""
        return [c for c in chunks if c and self.memory.is_mapped(c)
                and not self.used_in_chunk[c]]

    def unmap(self, chunks: list[int]) -> None:
        """Returns empty mapped ``chunks`` to the budget (after every reader finished)."""
        for c in chunks:
            if self.used_in_chunk[c] or not c:
                raise ValueError(f"chunk {c} holds pages or is the null chunk")
        self.memory.unmap(chunks)

    def stats(self) -> dict[str, int]:
        geo, mem = self.geometry, self.memory
        out = mem.counters()
        out.update(pages_per_chunk=geo.pages_per_chunk, chunk_bytes=geo.chunk_bytes,
                   budget_chunks=geo.budget_chunks, mapped_chunks=mem.num_mapped,
                   peak_mapped_chunks=mem.peak_mapped_chunks,
                   peak_physical_bytes=mem.peak_mapped_chunks * geo.chunk_bytes,
                   allocated_pages=self.num_allocated, num_quiesces=mem.num_quiesces)
        return out
