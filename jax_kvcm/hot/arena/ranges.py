"""Range allocation and adoption: which holder has which range (pure logic, no memory).

A range is *fresh* (never used, nothing mapped), *bound* to a holder (a sequence with device
pages), or *parked* (its holder left; its chunks stay mapped, its pages may still be cached).
Binding takes, in order of preference (:meth:`RangeBook.choose`):

1. the parked range holding the longest run of the holder's own prefix in place (prefix-affine
   adoption: those pages need neither a copy nor a map call);
2. when the budget could not map a whole fresh range (``tight``), the parked range with the most
   chunks mapped where the holder will write, then the fewest evictions, oldest first
   (adoption: its chunks are mapped, so steady state makes no map/unmap call);
3. a fresh range (its pages are mapped as it grows; the parked ranges keep their cached pages
   for later prefix hits);
4. any fitting parked range.

Whether a parked range *fits* a holder (no page someone else references where the holder will
write) and what must be evicted from it is the caller's answer
(:class:`~jax_kvcm.manager.arena_room.ArenaRoom`); this class keeps the states and the order.
With adoption off, parked ranges are only adopted for a prefix in place (rule 1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

__all__ = ["RangeBook"]


class RangeBook:
    """States of ``num_ranges`` ranges; holders are any hashable ids."""

    def __init__(self, num_ranges: int, adoption: bool = True) -> None:
        self.adoption = adoption
        self._fresh = list(range(num_ranges - 1, -1, -1))  # pop() gives the lowest
        self._parked: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._bound: dict[Hashable, int] = {}
        self.num_adoptions = 0
        self.num_fresh = 0

    # -- reads -----------------------------------------------------------------------------------

    def range_of(self, holder: Hashable) -> int | None:
        return self._bound.get(holder)

    def is_parked(self, r: int) -> bool:
        return r in self._parked

    def parked(self) -> Iterator[int]:
        """Parked ranges, oldest first."""
        return iter(list(self._parked))

    def bound_ranges(self) -> list[int]:
        return sorted(self._bound.values())

    @property
    def num_bound(self) -> int:
        return len(self._bound)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def num_unbound(self) -> int:
        """Ranges a new holder could take (fresh or parked)."""
        return len(self._fresh) + len(self._parked)

    def has_fresh(self) -> bool:
        return bool(self._fresh)

    # -- choice and binding ----------------------------------------------------------------------

    def choose(self, fits: list[tuple[int, int, int, int]], tight: bool) -> int | None:
        """The range to bind given the fitting parked candidates ``(range, pages in place,
        pages to evict, mapped chunks where the holder writes)`` (see the module docstring;
        among adoptions, the most mapped chunks where the holder will write, then the fewest
        evictions); None when there is none."""
        if not self.adoption:
            fits = [f for f in fits if f[1]]
        best = None
        for r, affine, evict, mapped in fits:
            key = (affine, mapped, -evict)
            if best is None or key > best[0]:
                best = (key, r)
        if best is not None and (best[0][0] > 0 or tight or not self._fresh):
            return best[1]
        if self._fresh:
            return self._fresh[-1]
        return None if best is None else best[1]

    def bind(self, holder: Hashable, r: int) -> None:
        """``holder`` takes range ``r`` (fresh or parked)."""
        if holder in self._bound:
            raise ValueError(f"{holder!r} already holds range {self._bound[holder]}")
        if r in self._parked:
            del self._parked[r]
            self.num_adoptions += 1
        elif self._fresh and r in self._fresh:
            self._fresh.remove(r)
            self.num_fresh += 1
        else:
            raise ValueError(f"range {r} is bound")
        self._bound[holder] = r

    def unbind(self, holder: Hashable) -> int | None:
        """``holder`` leaves its range, which is parked (newest); its range, or None."""
        r = self._bound.pop(holder, None)
        if r is not None:
            self._parked[r] = None
        return r

    def snapshot(self) -> tuple:
        """Every state and counter, for :meth:`restore`."""
        return (list(self._fresh), OrderedDict(self._parked), dict(self._bound),
                self.num_adoptions, self.num_fresh)

    def restore(self, snap: tuple) -> None:
        fresh, parked, bound, self.num_adoptions, self.num_fresh = snap
        self._fresh, self._parked, self._bound = list(fresh), OrderedDict(parked), dict(bound)

    def check(self) -> None:
        bound = list(self._bound.values())
        fresh, parked = set(self._fresh), set(self._parked)
        assert len(set(bound)) == len(bound), "a range bound twice"
        assert not (set(bound) & fresh) and not (set(bound) & parked) and not fresh & parked
