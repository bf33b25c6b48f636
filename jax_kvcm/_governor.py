"""Byte budgets per cache level: reserve first, then allocate; roll back exactly on failure.

Every tier (DEVICE, HOST, DISK) has a byte limit. Storage is allocated only under a ``Lease``
reserved from the :class:`MemoryGovernor` first; a reservation that does not fit raises
:class:`BudgetExceededError` and changes nothing. A lease is used as a context manager::

    with governor.reserve(CacheLevel.HOST, nbytes) as lease:
        slots = allocate(...)          # may raise: the lease is released on the way out
        submit(...)                    # may raise: same
        lease.commit()                 # success: the bytes stay charged

Lease kinds and states. A lease is one kind for life; its bytes sit in exactly one bucket::

    state:        PENDING  --commit()-->  COMMITTED  --release()-->  RELEASED
    persistent:   reserved                committed
    transient:    transient_reserved      transient_in_flight
                  PENDING  --release() (exact rollback)------------>  RELEASED

- *Persistent* leases back long-lived allocations (a pool, a tier's slots). ``commit()`` moves
  their bytes into ``committed``; ``release()`` on a committed lease frees them later.
- *Transient* leases back bytes that exist only while a migration is in flight (staging, replacement
  copies). ``commit()`` means "submitted": the bytes move to ``transient_in_flight`` and stay there
  until ``release()``, which the owner calls once the migration's finish fence is ready. Exiting the
  ``with`` block does not release a committed lease.
- ``release()`` of a PENDING lease is the exact rollback of its reservation. Exiting the ``with``
  block with the lease still PENDING (an exception, or no ``commit()``) does that.

Limits: ``reserved + committed + transient_reserved + transient_in_flight <= limit`` at all times.

Statistics. ``current = committed + transient_in_flight`` (bytes in use by successful operations).
Peaks (``peak``, and the iteration peaks returned and reset by
:meth:`MemoryGovernor.get_and_reset_iteration_peak_stats`) are maxima of ``current``, updated on
``commit()``. NOTE: a reservation that is rolled back never reaches ``current``, so it leaves every
counter and peak exactly as before; :meth:`MemoryGovernor.ledger` snapshots compare equal before and
after a failed operation.

Thread-safety: none inside. The governor belongs to one manager, whose public calls are serialized
by one lock; synchronization belongs at that boundary, not here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from jax_kvcm._types import CacheLevel, check_count

__all__ = [
    "BudgetExceededError",
    "GovernorLedger",
    "Lease",
    "LeaseState",
    "LevelLedger",
    "MemoryGovernor",
    "PeakStats",
]


class BudgetExceededError(Exception):
    """A reservation did not fit in its level's limit; nothing was reserved."""

    def __init__(self, level: CacheLevel, requested: int, available: int) -> None:
        self.level = CacheLevel(level)
        self.requested = requested
        self.available = available
        super().__init__(f"{self.level.name}: requested {requested} bytes, "
                         f"{available} bytes available")

    def __reduce__(self):  # keeps the three fields through pickling (e.g. across processes)
        return (type(self), (self.level, self.requested, self.available))


class LeaseState(enum.Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    RELEASED = "released"


@dataclass(frozen=True, slots=True)
class LevelLedger:
    """One level's counters at one instant (bytes unless named ``num_*``).

    Invariants: every field >= 0; ``held <= limit``; ``current <= peak``;
    ``current <= iteration_peak <= peak``.
    """

    limit: int
    reserved: int             # persistent leases, PENDING
    committed: int            # persistent leases, COMMITTED
    transient_reserved: int   # transient leases, PENDING
    transient_in_flight: int  # transient leases, COMMITTED (submitted, not yet released)
    num_leases: int           # leases not yet RELEASED
    peak: int                 # max of `current` since construction
    iteration_peak: int       # max of `current` since the last iteration reset
    iteration_peak_transient: int  # max of `transient_in_flight` since the last iteration reset

    @property
    def transient(self) -> int:
        """All transient bytes, pending or in flight."""
        return self.transient_reserved + self.transient_in_flight

    @property
    def current(self) -> int:
        """Bytes in use by successful operations (what peaks track)."""
        return self.committed + self.transient_in_flight

    @property
    def held(self) -> int:
        """Everything charged against the limit, pending reservations included."""
        return self.reserved + self.committed + self.transient

    @property
    def available(self) -> int:
        return self.limit - self.held


@dataclass(frozen=True, slots=True)
class GovernorLedger:
    """Every level's :class:`LevelLedger`, indexed by ``CacheLevel``; compare with ``==``."""

    levels: tuple[LevelLedger, ...]

    def __getitem__(self, level: CacheLevel) -> LevelLedger:
        return self.levels[CacheLevel(level)]


@dataclass(frozen=True, slots=True)
class PeakStats:
    """Peaks of one level since the previous ``get_and_reset_iteration_peak_stats`` call."""

    level: CacheLevel
    peak_bytes: int            # max of committed + transient_in_flight
    peak_transient_bytes: int  # max of transient_in_flight
    current_bytes: int         # committed + transient_in_flight now (the new iteration's start)


class _LevelCounters:
    """Mutable counters of one level (see :class:`LevelLedger` for the meaning of each)."""

    __slots__ = ("limit", "reserved", "committed", "transient_reserved", "transient_in_flight",
                 "num_leases", "peak", "iteration_peak", "iteration_peak_transient")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reserved = 0
        self.committed = 0
        self.transient_reserved = 0
        self.transient_in_flight = 0
        self.num_leases = 0
        self.peak = 0
        self.iteration_peak = 0
        self.iteration_peak_transient = 0

    @property
    def held(self) -> int:
        return self.reserved + self.committed + self.transient_reserved + self.transient_in_flight

    @property
    def current(self) -> int:
        return self.committed + self.transient_in_flight

    def snapshot(self) -> LevelLedger:
        return LevelLedger(self.limit, self.reserved, self.committed, self.transient_reserved,
                           self.transient_in_flight, self.num_leases, self.peak,
                           self.iteration_peak, self.iteration_peak_transient)

    def note_peaks(self) -> None:
        current = self.current
        self.peak = max(self.peak, current)
        self.iteration_peak = max(self.iteration_peak, current)
        self.iteration_peak_transient = max(self.iteration_peak_transient,
                                            self.transient_in_flight)


class Lease:
    """Bytes reserved at one level; see the module docstring for states and kinds.

    Misuse (commit of a non-PENDING lease, release of a RELEASED one) raises ``RuntimeError``.
    """

    __slots__ = ("_counters", "_level", "_nbytes", "_transient", "_state")

    def __init__(self, counters: _LevelCounters, level: CacheLevel, nbytes: int,
                 transient: bool) -> None:
        self._counters = counters
        self._level = level
        self._nbytes = nbytes
        self._transient = transient
        self._state = LeaseState.PENDING

    @property
    def level(self) -> CacheLevel:
        return self._level

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def transient(self) -> bool:
        return self._transient

    @property
    def state(self) -> LeaseState:
        return self._state

    def commit(self) -> None:
        """The operation succeeded: keep the bytes charged (persistent: ``committed``;
        transient: ``transient_in_flight`` until :meth:`release`)."""
        if self._state is not LeaseState.PENDING:
            raise RuntimeError(f"commit of a {self._state.value} lease ({self!r})")
        c = self._counters
        if self._transient:
            c.transient_reserved -= self._nbytes
            c.transient_in_flight += self._nbytes
        else:
            c.reserved -= self._nbytes
            c.committed += self._nbytes
        self._state = LeaseState.COMMITTED
        c.note_peaks()

    def release(self) -> None:
        """Returns the bytes: the exact rollback of a PENDING lease, or the end of a COMMITTED
        one."""
        c = self._counters
        n = self._nbytes
        if self._state is LeaseState.PENDING:
            if self._transient:
                c.transient_reserved -= n
            else:
                c.reserved -= n
        elif self._state is LeaseState.COMMITTED:
            if self._transient:
                c.transient_in_flight -= n
            else:
                c.committed -= n
        else:
            raise RuntimeError(f"release of a released lease ({self!r})")
        c.num_leases -= 1
        self._state = LeaseState.RELEASED

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # NOTE: only a PENDING lease is rolled back; a committed one outlives the block.
        if self._state is LeaseState.PENDING:
            self.release()

    def __repr__(self) -> str:
        kind = "transient" if self._transient else "persistent"
        return f"Lease({self._level.name}, {self._nbytes} bytes, {kind}, {self._state.value})"


class MemoryGovernor:
    """Byte limits per :class:`CacheLevel` and the leases charged against them.

    ``limits`` maps levels to byte limits (ints >= 0); a level left out has limit 0 (any non-empty
    reservation there is refused). Not thread-safe: see the module docstring.
    """

    __slots__ = ("_levels",)

    def __init__(self, limits: Mapping[CacheLevel, int]) -> None:
        given = {}
        for level, limit in limits.items():
            level = CacheLevel(level)
            given[level] = check_count(limit, f"limit of {level.name}", minimum=0)
        # NOTE: indexed by CacheLevel value; one counter object per level for the lifetime.
        self._levels = tuple(_LevelCounters(given.get(level, 0)) for level in CacheLevel)

    def reserve(self, level: CacheLevel, nbytes: int, *, transient: bool = False) -> Lease:
        """Reserves ``nbytes`` at ``level``; raises :class:`BudgetExceededError` (changing
        nothing) when ``nbytes`` exceeds the level's available bytes. Zero bytes always fit."""
        level = CacheLevel(level)
        check_count(nbytes, "nbytes", minimum=0)
        c = self._levels[level]
        available = c.limit - c.held
        if nbytes > available:
            raise BudgetExceededError(level, nbytes, available)
        if transient:
            c.transient_reserved += nbytes
        else:
            c.reserved += nbytes
        c.num_leases += 1
        return Lease(c, level, nbytes, bool(transient))

    def release_committed(self, level: CacheLevel, nbytes: int) -> None:
        """Returns ``nbytes`` of committed persistent bytes freed piecemeal (slots of a tier
        freed batch by batch long after the lease that charged them was committed).

        NOTE: slot allocations are charged per batch but freed per page set; keeping a lease per
        page would put Python objects on the hot path, so frees uncharge by count instead."""
        level = CacheLevel(level)
        check_count(nbytes, "nbytes", minimum=0)
        c = self._levels[level]
        if nbytes > c.committed:
            raise RuntimeError(f"release_committed({level.name}, {nbytes}) exceeds the "
                               f"{c.committed} committed bytes")
        c.committed -= nbytes

    def limit(self, level: CacheLevel) -> int:
        return self._levels[CacheLevel(level)].limit

    def available(self, level: CacheLevel) -> int:
        """Bytes a reservation at ``level`` could take now."""
        c = self._levels[CacheLevel(level)]
        return c.limit - c.held

    def usage(self, level: CacheLevel) -> LevelLedger:
        """Snapshot of one level (``.current``, ``.peak``, ``.transient``, ...)."""
        return self._levels[CacheLevel(level)].snapshot()

    def ledger(self) -> GovernorLedger:
        """Snapshot of every level; equal before and after an operation that rolled back."""
        return GovernorLedger(tuple(c.snapshot() for c in self._levels))

    def get_and_reset_iteration_peak_stats(self, level: CacheLevel) -> PeakStats:
        """The level's peaks since the previous call; then restarts them from current usage."""
        level = CacheLevel(level)
        c = self._levels[level]
        stats = PeakStats(level, c.iteration_peak, c.iteration_peak_transient, c.current)
        c.iteration_peak = c.current
        c.iteration_peak_transient = c.transient_in_flight
        return stats
