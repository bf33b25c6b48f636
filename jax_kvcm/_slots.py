"""SlotAllocator: the free list of one cold pool (host or disk), kept in numpy arrays.

A cold pool is ``num_slots`` fixed-size slots; the allocator hands out slot ids and takes them back.
It holds no per-slot Python objects: a free stack (``int32``) and an ``allocated`` bitmap (``bool``).

Allocation order. :meth:`SlotAllocator.allocate` returns the *lowest* free slots, in ascending
order, so pages allocated together tend to be adjacent and the disk tier writes them as one I/O
(runs of adjacent slots are coalesced). The free stack is kept sorted *descending* so the lowest
slots are on top: a pop of ``n`` is one slice. :meth:`SlotAllocator.free` appends to the stack and
marks it unsorted; the next allocation re-sorts it (a stable sort, which is linear on a sorted run
plus the appended block, then ``O(k log k)`` for the ``k`` appended slots).

NOTE: allocation failure is a value (``None``, nothing changes); misuse (out-of-range slots, double
free, bad arguments) raises ``ValueError`` / ``TypeError`` and also changes nothing.

Thread-safety: none inside; the owning manager serializes its calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import TypeVar

import numpy as np

from jax_kvcm._types import check_count

__all__ = ["SlotAllocator", "SlotPool", "all_marked", "as_slot_array"]

_Pool = TypeVar("_Pool", bound="SlotPool")


def as_slot_array(slots: object, name: str = "slots") -> np.ndarray:
    """``slots`` (array-like of ints) as a 1-D ``int32`` numpy array; ValueError naming ``name``.

    Integer arrays of any width are accepted when every value fits in int32; bools, floats and
    other dtypes are refused (a float slot id is a bug, not something to round).
    """
    arr = np.asarray(slots)
    if arr.ndim != 1:
        if arr.ndim == 0 or arr.size != 0:
            raise ValueError(f"{name} must be a 1-D array of slot ids, got shape {arr.shape}")
        arr = arr.reshape(0)
    if arr.size == 0:
        return np.zeros(0, np.int32)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype != np.int32:
        info = np.iinfo(np.int32)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            raise ValueError(f"{name} holds values outside int32: [{lo}, {hi}]")
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr)


class SlotAllocator:
    """All-or-nothing allocation of slot ids ``[0, num_slots)``, lowest first."""

    __slots__ = ("_num_slots", "_stack", "_num_free", "_sorted", "_allocated")

    def __init__(self, num_slots: int) -> None:
        self._num_slots = check_count(num_slots, "num_slots", minimum=1)
        if self._num_slots > np.iinfo(np.int32).max:
            raise ValueError(f"num_slots must fit in int32, got {self._num_slots}")
        # NOTE: _stack[:_num_free] holds exactly the free slots; sorted descending when _sorted.
        self._stack = np.arange(self._num_slots - 1, -1, -1, dtype=np.int32)
        self._num_free = self._num_slots
        self._sorted = True
        self._allocated = np.zeros(self._num_slots, np.bool_)

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_allocated(self) -> int:
        return self._num_slots - self._num_free

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot`` is currently allocated; ValueError when it is out of range."""
        s = check_count(slot, "slot", minimum=0)
        if s >= self._num_slots:
            raise ValueError(f"slot {s} is out of range [0, {self._num_slots})")
        return bool(self._allocated[s])

    def all_allocated(self, slots: np.ndarray) -> bool:
        """Whether every slot of an int array is allocated (False when one is out of range)."""
        return all_marked(self._allocated, slots)

    def allocate(self, n: int) -> np.ndarray | None:
        """The ``n`` lowest free slots (int32, ascending), or ``None`` when fewer than ``n`` are free
        (then nothing changes)."""
        n = check_count(n, "n", minimum=0)
        if n > self._num_free:
            return None
        if n == 0:
            return np.zeros(0, np.int32)
        if not self._sorted:
            live = self._stack[: self._num_free]
            live.sort(kind="stable")
            live[:] = live[::-1].copy()
            self._sorted = True
        top = self._num_free
        out = self._stack[top - n : top][::-1].copy()
        self._num_free = top - n
        self._allocated[out] = True
        return out

    def free(self, slots: Iterable[int] | np.ndarray) -> None:
        """Returns ``slots`` to the pool. ValueError (nothing changes) when a slot is out of range,
        not allocated, or listed twice."""
        arr = as_slot_array(slots)
        k = arr.size
        if k == 0:
            return
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self._num_slots:
            bad = int(arr[(arr < 0) | (arr >= self._num_slots)][0])
            raise ValueError(f"slots: slot {bad} is out of range [0, {self._num_slots})")
        if not self._allocated[arr].all():
            bad = int(arr[~self._allocated[arr]][0])
            raise ValueError(f"slots: slot {bad} is not allocated (double free?)")
        if k > 1 and np.unique(arr).size != k:
            values, counts = np.unique(arr, return_counts=True)
            raise ValueError(f"slots: slot {int(values[counts > 1][0])} is listed twice")
        self._allocated[arr] = False
        self._stack[self._num_free : self._num_free + k] = arr
        self._num_free += k
        self._sorted = False

    def __repr__(self) -> str:
        return f"SlotAllocator(num_slots={self._num_slots}, num_free={self._num_free})"


def all_marked(mask: np.ndarray, slots: np.ndarray) -> bool:
    """Whether every index of the int array ``slots`` is in range of the bool array ``mask``
    and set there (the allocators' ``all_allocated``)."""
    return bool(((slots >= 0) & (slots < mask.size)).all() and mask[slots].all())


class SlotPool:
    """Slot bookkeeping shared by the host and disk pools (``HostPool``, ``DiskPool``).

    A subclass sets ``self._allocator`` (a :class:`SlotAllocator`) and defines ``_check_open()``
    (raises once closed), ``free(slots)`` and ``close()``; it is its own context manager.
    """

    __slots__ = ()

    @property
    def num_free(self) -> int:
        return self._allocator.num_free

    def allocate(self, n: int) -> np.ndarray | None:
        """``n`` free slots (int32, lowest first, so they tend to be adjacent) or ``None`` when
        fewer are free (nothing changes)."""
        self._check_open()
        return self._allocator.allocate(n)

    def is_allocated(self, slot: int) -> bool:
        return self._allocator.is_allocated(slot)

    def all_allocated(self, slots: np.ndarray) -> bool:
        return self._allocator.all_allocated(slots)

    def __enter__(self: _Pool) -> _Pool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
