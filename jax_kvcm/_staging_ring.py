"""The staging ring's allocator: next-fit over live and retired byte ranges that keep their fences.

The storage manager owns one pinned staging ring when a disk tier exists, for the two-hop paths
(hot -> staging -> disk, disk -> staging -> hot), sized by :func:`staging_ring_capacity`. This
module manages *offsets* in ``[0, capacity)`` only; the pinned backing memory (and its base
address, aligned to at least ``base_alignment``) comes from native code.

Layout. The ring is partitioned into a spatially ordered list of ranges, each either

- **live**: the payload of one outstanding :class:`StagingLease`, or
- **retired**: free bytes that keep the *fence* of their previous owner (``None`` = nothing to wait
  for: never used, or released by a synchronous owner, or the fence was seen ready).

A fence is any object with ``is_ready() -> bool`` and ``wait() -> None`` (e.g. :class:`ArrayFence`
over the output ``jax.Array`` of the migration that last used the bytes).

Allocation (next-fit). A *retired run* is a maximal sequence of adjacent retired ranges. Starting at
the byte-accurate ``cursor``, the ring scans retired runs up to the physical end, skipping live
ranges; then it makes at most one more pass from offset 0 over the runs it has not fully seen. The
first run whose aligned start leaves room for the minimum request wins. The payload becomes one live
range; the alignment padding before it and the slack after it stay retired, split only at the
payload's edges, so every padding fragment keeps the fence that protects its bytes. The lease
carries the distinct not-yet-ready fences of the fragments its payload covers: the new owner must
wait on them before touching the bytes, either synchronously (:meth:`StagingLease.wait`, e.g.
before native disk I/O) or, in JAX, by a data dependency (the fences' arrays passed as operands of
the jitted function that uses the bytes). The cursor moves to the payload's end, and only on
success.

NOTE: allocation never waits. If no run fits (only live leases block it) it returns ``None``; a
live lease cannot retire on the thread that is asking.

Sizes. Every request gives a positive ``granularity`` and a power-of-two ``alignment`` with
``granularity % alignment == 0`` (so each granularity-sized slice of a lease is aligned). The lease
size is a multiple of the granularity: ``min_bytes`` is rounded up, ``max_bytes`` and the run's
available bytes are rounded down. Disk staging uses the cold page size as granularity; index staging
uses ``sizeof(PageIndexPair) == 8``.

Release. :meth:`StagingRing.release` with the fence of the work that last uses the lease turns its
range into a retired range with that fence; it merges with retired neighbours holding the same
fence object (``is``).

Thread-safety: none inside. The ring belongs to one manager, whose public calls are serialized by
one lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from jax_kvcm._fence import ArrayFence, Fence
from jax_kvcm._types import check_count

__all__ = [
    "MIN_STAGING_RING_BYTES",
    "ArrayFence",
    "Fence",
    "RangeView",
    "StagingLease",
    "StagingRing",
    "staging_ring_capacity",
]

MIN_STAGING_RING_BYTES = 64 << 20
"""The ring is never smaller than 64 MiB."""

MAX_STAGING_RING_BYTES = (1 << 63) - 1
"""Sizes must fit the native side's signed 64-bit byte counts."""


def staging_ring_capacity(max_cold_page_bytes: int) -> int:
    """``max(64 MiB, 3 * max_cold_page_bytes)``, with checked arithmetic.

    ``max_cold_page_bytes`` is the largest codec ``cold_page_bytes(lg)`` over all layer groups; it
    must be a positive int (0 is the codec's failure value). Raises ``OverflowError`` when
    ``3 * max_cold_page_bytes`` does not fit in a signed 64-bit byte count.

    Example: 2 MiB cold pages -> 64 MiB; 40 MiB cold pages -> 120 MiB.
    """
    page = check_count(max_cold_page_bytes, "max_cold_page_bytes", minimum=1)
    if page > MAX_STAGING_RING_BYTES // 3:
        raise OverflowError(f"staging ring of 3 * {page} bytes does not fit in int64")
    return max(MIN_STAGING_RING_BYTES, 3 * page)


def _align_up(x: int, alignment: int) -> int:
    return (x + alignment - 1) & ~(alignment - 1)


class StagingLease:
    """``nbytes`` at ``[offset, offset + nbytes)`` of the ring, until released.

    ``nbytes`` is a multiple of ``granularity``; ``offset`` is a multiple of ``alignment``.
    ``wait_fences``: distinct fences the previous owners of these bytes left, not ready when the
    lease was made; wait on all of them before writing or reading the bytes.
    """

    __slots__ = ("_ring", "offset", "nbytes", "granularity", "alignment", "wait_fences",
                 "_released")

    def __init__(self, ring: StagingRing, offset: int, nbytes: int, granularity: int,
                 alignment: int, wait_fences: tuple[Fence, ...]) -> None:
        self._ring = ring
        self.offset = offset
        self.nbytes = nbytes
        self.granularity = granularity
        self.alignment = alignment
        self.wait_fences = wait_fences
        self._released = False

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def num_slices(self) -> int:
        """How many granularity-sized slices (e.g. cold pages) the lease holds."""
        return self.nbytes // self.granularity

    def slice_offset(self, i: int) -> int:
        """Ring offset of slice ``i`` (aligned to ``alignment``)."""
        if not 0 <= i < self.num_slices:
            raise IndexError(f"slice {i} outside [0, {self.num_slices})")
        return self.offset + i * self.granularity

    @property
    def released(self) -> bool:
        return self._released

    def wait(self) -> None:
        """Synchronous acquisition: blocks until every fence in ``wait_fences`` is ready."""
        for fence in self.wait_fences:
            fence.wait()

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return (f"StagingLease([{self.offset}, {self.end}), {self.num_slices} x "
                f"{self.granularity} bytes, {len(self.wait_fences)} fences, {state})")


@dataclass(slots=True, eq=False)
class _Range:
    offset: int
    nbytes: int
    lease: StagingLease | None  # live when set
    fence: Fence | None         # retired only: the previous owner's fence, None = reusable now

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class RangeView:
    """A read-only view of one range of the partition (for stats and tests)."""

    offset: int
    nbytes: int
    live: bool
    fence: Fence | None

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class StagingRing:
    """Offsets of a staging ring of ``capacity`` bytes; see the module docstring.

    ``base_alignment``: the guaranteed alignment of the backing memory's base address (a power of
    two); requests may not ask for a larger alignment.
    """

    __slots__ = ("_capacity", "_base_alignment", "_ranges", "_offsets", "_cursor", "_num_live",
                 "_live_bytes", "_closed")

    def __init__(self, capacity: int, *, base_alignment: int = 4096) -> None:
        self._capacity = check_count(capacity, "capacity", minimum=1)
        if capacity > MAX_STAGING_RING_BYTES:
            raise OverflowError(f"capacity {capacity} does not fit in int64")
        self._base_alignment = check_count(base_alignment, "base_alignment", minimum=1)
        if base_alignment & (base_alignment - 1):
            raise ValueError(f"base_alignment must be a power of two, got {base_alignment}")
        # NOTE: _ranges partitions [0, capacity) in offset order; _offsets mirrors their offsets
        # for bisection. No two adjacent retired ranges hold the same fence object.
        self._ranges: list[_Range] = [_Range(0, self._capacity, None, None)]
        self._offsets: list[int] = [0]
        self._cursor = 0  # NOTE: in [0, capacity); changes only on a successful allocation
        self._num_live = 0
        self._live_bytes = 0
        self._closed = False

    # -- queries ------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def base_alignment(self) -> int:
        return self._base_alignment

    @property
    def cursor(self) -> int:
        return self._cursor

    @property
    def num_live(self) -> int:
        return self._num_live

    @property
    def live_bytes(self) -> int:
        return self._live_bytes

    @property
    def num_ranges(self) -> int:
        return len(self._ranges)

    def ranges(self) -> tuple[RangeView, ...]:
        return tuple(RangeView(r.offset, r.nbytes, r.lease is not None, r.fence)
                     for r in self._ranges)

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, min_bytes: int, max_bytes: int | None = None, *, granularity: int,
                 alignment: int) -> StagingLease | None:
        """A lease of ``n`` bytes, ``round_up(min_bytes) <= n <= round_down(max_bytes)`` (multiples
        of ``granularity``; ``max_bytes`` defaults to ``min_bytes``), as large as the chosen run
        allows; or ``None`` when no retired run fits the minimum (never waits).

        Raises ``ValueError`` for misuse: a non-positive size or granularity, an alignment that is
        not a power of two, larger than ``base_alignment`` or not dividing ``granularity``, an
        empty size range after rounding, or a minimum larger than the capacity.
        """
        self._check_open()
        g = check_count(granularity, "granularity", minimum=1)
        a = check_count(alignment, "alignment", minimum=1)
        if a & (a - 1):
            raise ValueError(f"alignment must be a power of two, got {a}")
        if a > self._base_alignment:
            raise ValueError(f"alignment {a} exceeds the ring's base alignment "
                             f"{self._base_alignment}")
        if g % a:
            raise ValueError(f"granularity {g} must be a multiple of alignment {a}")
        lo = -(-check_count(min_bytes, "min_bytes", minimum=1) // g) * g
        hi = lo if max_bytes is None else check_count(max_bytes, "max_bytes", minimum=1) // g * g
        if hi < lo:
            raise ValueError(f"no multiple of granularity {g} in [min_bytes={min_bytes}, "
                             f"max_bytes={max_bytes}]")
        if lo > self._capacity:
            raise ValueError(f"min_bytes {min_bytes} (rounded to {lo}) exceeds the ring's "
                             f"capacity {self._capacity}")
        for run_start, run_end in self._candidate_runs():
            start = _align_up(run_start, a)
            avail = run_end - start
            if avail >= lo:
                return self._carve(start, min(hi, avail // g * g), g, a)
        return None

    def _candidate_runs(self) -> Iterator[tuple[int, int]]:
        """Retired runs ``[start, end)`` in next-fit order: from the cursor to the physical end,
        then from 0 over the runs that start before the cursor (seen whole this time)."""
        cursor = self._cursor
        k = bisect.bisect_right(self._offsets, cursor) - 1  # range containing the cursor
        first = self._ranges[k]
        if first.lease is None:
            yield from self._runs_from(k, cursor, stop_at=None)
        else:
            yield from self._runs_from(k + 1, first.end, stop_at=None)
        if cursor > 0:
            yield from self._runs_from(0, 0, stop_at=cursor)

    def _runs_from(self, i: int, start: int, stop_at: int | None) -> Iterator[tuple[int, int]]:
        """Runs beginning at range ``i`` (the first clipped to begin at ``start``); with
        ``stop_at``, only runs that begin before it."""
        ranges = self._ranges
        run_start: int | None = None
        run_end = start
        for j in range(i, len(ranges)):
            r = ranges[j]
            if r.lease is None:
                if run_start is None:
                    run_start = max(start, r.offset)
                    if stop_at is not None and run_start >= stop_at:
                        return
                run_end = r.end
            elif run_start is not None:
                yield run_start, run_end
                run_start = None
        if run_start is not None:
            yield run_start, run_end

    def _carve(self, start: int, nbytes: int, granularity: int, alignment: int) -> StagingLease:
        """Turns the retired bytes ``[start, start + nbytes)`` into one live range."""
        end = start + nbytes
        ranges = self._ranges
        i = bisect.bisect_right(self._offsets, start) - 1
        j = bisect.bisect_left(self._offsets, end) - 1  # last range overlapping the payload
        covered = ranges[i:j + 1]
        waits: list[Fence] = []
        seen: set[int] = set()
        for r in covered:
            assert r.lease is None, "carving a live range"
            f = r.fence
            if f is not None and id(f) not in seen:
                seen.add(id(f))
                if not f.is_ready():
                    waits.append(f)
        lease = StagingLease(self, start, nbytes, granularity, alignment, tuple(waits))
        # NOTE: padding before and slack after keep their own fences, split only at the payload.
        new: list[_Range] = []
        head, tail = covered[0], covered[-1]
        if head.offset < start:
            new.append(_Range(head.offset, start - head.offset, None, head.fence))
        new.append(_Range(start, nbytes, lease, None))
        if tail.end > end:
            new.append(_Range(end, tail.end - end, None, tail.fence))
        ranges[i:j + 1] = new
        self._offsets[i:j + 1] = [r.offset for r in new]
        self._cursor = end % self._capacity
        self._num_live += 1
        self._live_bytes += nbytes
        return lease

    # -- release and fences -------------------------------------------------------------------

    def release(self, lease: StagingLease, fence: Fence | None = None) -> None:
        """Retires the lease's bytes behind ``fence`` (the completion of the last work that uses
        them; ``None`` when the owner used them synchronously and is done).

        Raises ``ValueError`` for a lease of another ring, ``RuntimeError`` for a double release.
        """
        if lease._ring is not self:
            raise ValueError(f"{lease!r} belongs to another staging ring")
        if lease._released:
            raise RuntimeError(f"double release of {lease!r}")
        if fence is not None and not isinstance(fence, Fence):
            raise TypeError(f"fence must have is_ready() and wait(), got {type(fence).__name__}")
        i = bisect.bisect_left(self._offsets, lease.offset)
        r = self._ranges[i]
        assert r.lease is lease and r.offset == lease.offset and r.nbytes == lease.nbytes
        r.lease = None
        r.fence = fence
        lease._released = True
        self._num_live -= 1
        self._live_bytes -= lease.nbytes
        self._merge_around(i)

    def forget_ready_fences(self) -> int:
        """Drops every retired fence that reports ready (its bytes need no wait any more) and
        merges what becomes adjacent. Returns how many distinct fences were dropped."""
        ready: dict[int, bool] = {}
        for r in self._ranges:
            f = r.fence
            if f is not None:
                if id(f) not in ready:
                    ready[id(f)] = bool(f.is_ready())
                if ready[id(f)]:
                    r.fence = None
        self._merge_all()
        return sum(ready.values())

    def drain(self) -> None:
        """Waits on every retired fence, then forgets them (all retired bytes become reusable)."""
        waited: set[int] = set()
        for r in self._ranges:
            f = r.fence
            if f is not None:
                if id(f) not in waited:
                    waited.add(id(f))
                    f.wait()
                r.fence = None
        self._merge_all()

    def close(self) -> None:
        """Teardown: synchronizes every retired fence before the backing memory may be freed.

        Raises ``RuntimeError`` while a lease is live (a lease must not outlive its ring).
        Idempotent; a closed ring refuses allocations.
        """
        if self._closed:
            return
        if self._num_live:
            raise RuntimeError(f"closing a staging ring with {self._num_live} live leases")
        self.drain()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the staging ring is closed")

    def _merge_around(self, i: int) -> None:
        """Merges retired range ``i`` with retired neighbours holding the same fence object."""
        ranges = self._ranges
        r = ranges[i]
        if i + 1 < len(ranges):
            nxt = ranges[i + 1]
            if nxt.lease is None and nxt.fence is r.fence:
                r.nbytes += nxt.nbytes
                del ranges[i + 1]
                del self._offsets[i + 1]
        if i > 0:
            prev = ranges[i - 1]
            if prev.lease is None and prev.fence is r.fence:
                prev.nbytes += r.nbytes
                del ranges[i]
                del self._offsets[i]

    def _merge_all(self) -> None:
        merged: list[_Range] = []
        for r in self._ranges:
            if (merged and r.lease is None and merged[-1].lease is None
                    and merged[-1].fence is r.fence):
                merged[-1].nbytes += r.nbytes
            else:
                merged.append(r)
        self._ranges = merged
        self._offsets = [r.offset for r in merged]

    # -- checking -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises ``AssertionError`` if the partition is inconsistent (for tests)."""
        ranges = self._ranges
        assert self._offsets == [r.offset for r in ranges], "offset index out of sync"
        assert 0 <= self._cursor < self._capacity, f"cursor {self._cursor}"
        pos = 0
        num_live = live_bytes = 0
        for k, r in enumerate(ranges):
            assert r.offset == pos and r.nbytes > 0, f"range {k} {r} breaks the partition at {pos}"
            pos = r.end
            if r.lease is not None:
                lease = r.lease
                assert r.fence is None, f"live range {k} holds a fence"
                assert not lease._released and lease._ring is self
                assert (lease.offset, lease.nbytes) == (r.offset, r.nbytes)
                assert lease.offset % lease.alignment == 0
                assert lease.nbytes % lease.granularity == 0
                num_live += 1
                live_bytes += r.nbytes
            elif k > 0:
                prev = ranges[k - 1]
                assert not (prev.lease is None and prev.fence is r.fence), (
                    f"adjacent retired ranges {k - 1}, {k} share a fence")
        assert pos == self._capacity, f"partition ends at {pos}, capacity {self._capacity}"
        assert (num_live, live_bytes) == (self._num_live, self._live_bytes)
