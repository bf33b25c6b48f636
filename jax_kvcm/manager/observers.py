"""The manager's counters, its lock, and the event stream to observers (opt-in).

Events (:class:`~jax_kvcm.manager.api.ManagerEvent`, and the storage's
:class:`~jax_kvcm._storage.StorageEvent`) are recorded only while someone listens: with no
observer and ``record_events`` off (the default) :meth:`Observers.emit` returns at once, so a
serving loop pays nothing for them. Observers are called after the public call that caused the
events left the manager consistent, outside its lock (they may call back into the manager); an
observer that raises changes nothing.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CallLock", "Observers", "Stats"]


@dataclass(slots=True)
class Stats:
    """Counters since construction (``KVCacheManager.stats()`` reports them)."""

    num_steps: int = 0
    num_prefix_queries: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_committed_pages: int = 0
    num_adopted_pages: int = 0
    num_evicted_pages: list[int] = field(default_factory=lambda: [0, 0, 0])
    num_dropped_pages: int = 0
    num_onboarded_pages: int = 0
    num_window_released_pages: int = 0
    num_suspended: int = 0
    num_resumed: int = 0
    num_refused_suspends: int = 0
    num_refused_resumes: int = 0
    num_fence_waits: int = 0        # allocations that waited for a dispatched step
    fence_wait_seconds: float = 0.0  # host time spent in those waits
    num_offloads_ahead: int = 0          # write-back-ahead transactions (offload_ahead_pages)
    num_offloaded_ahead_pages: int = 0   # pages they moved to the host tier
    num_offload_ahead_waits: int = 0     # times the host waited for such a copy to finish
    offload_ahead_wait_seconds: float = 0.0
    num_offload_ahead_failures: int = 0  # copies that failed (their pages rolled back)
    num_offload_ahead_restored_pages: int = 0
    num_aborted_steps: int = 0
    num_failed_steps: int = 0       # steps whose pools were lost (abort/recover_from_failed_step)
    num_lost_sequences: int = 0     # sequences closed by such a loss (to recompute)
    num_observer_errors: int = 0
    num_disk_write_errors: int = 0       # failed writes to the disk tier (e.g. ENOSPC)
    num_disk_read_errors: int = 0        # failed reads of it (EIO, short reads): misses
    num_dropped_on_disk_error: int = 0   # pages dropped because the disk could not take them
    num_truncated_tokens: int = 0        # tokens dropped by truncate (rejected drafts)
    num_unwritten_host_reads: int = 0    # reads of host pages whose device -> host copy had
    #                                      failed (refused: a miss; cached ones are dropped)


class CallLock:
    """The manager's lock; leaving the outermost ``with`` delivers the events the call queued
    to the observers (so they see a consistent manager, and may call back into it)."""

    __slots__ = ("raw", "_after")

    def __init__(self, after: Callable[[], None]) -> None:
        self.raw = threading.Lock()
        self._after = after

    def __enter__(self) -> None:
        self.raw.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.raw.release()
        self._after()


class Observers:
    """Event recording and delivery. ``events``: the latest events (at most 4096) while
    recording is on (:attr:`record_events`, or any observer registered)."""

    def __init__(self, stats: Stats, *, record_events: bool = False) -> None:
        self._stats = stats
        self.record_events = record_events
        self.events: deque[Any] = deque(maxlen=4096)
        self._observers: list[Callable[[Any], None]] = []
        self._queue: list[Any] = []          # events not yet given to the observers
        self._delivering = threading.local()
        #: ``(observer, event, exception)`` of the latest observer calls that raised.
        self.errors: deque[tuple[Callable[[Any], None], Any, Exception]] = deque(maxlen=64)
        self.lock = CallLock(self.deliver)

    @property
    def listening(self) -> bool:
        return self.record_events or bool(self._observers)

    def emit(self, event: Any) -> None:
        """Records an event; observers get it when the public call ends (:meth:`deliver`)."""
        if not (self.record_events or self._observers):
            return
        self.events.append(event)
        if self._observers:
            self._queue.append(event)

    def add(self, fn: Callable[[Any], None]) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._observers.append(fn)

    def deliver(self) -> None:
        """Gives the queued events to the observers, outside the lock, once the call that queued
        them left the manager consistent. An observer that raises changes nothing: the error is
        recorded (:attr:`errors`, ``stats()["num_observer_errors"]``) and warned about, and the
        other observers still get the event. Events queued by a call an observer makes are
        delivered by the same loop, after the current ones."""
        if not self._queue or getattr(self._delivering, "on", False):
            return
        self._delivering.on = True
        try:
            while True:
                with self.lock.raw:
                    batch, self._queue = self._queue, []
                    observers = list(self._observers)
                if not batch:
                    return
                for event in batch:
                    for fn in observers:
                        try:
                            fn(event)
                        except Exception as e:  # noqa: BLE001 - isolated, recorded, warned
                            with self.lock.raw:
                                self._stats.num_observer_errors += 1
                                self.errors.append((fn, event, e))
                            warnings.warn(f"KVCacheManager observer {fn!r} raised {e!r} on "
                                          f"{event}; the manager is unaffected (see "
                                          "observer_errors)", RuntimeWarning, stacklevel=3)
        finally:
            self._delivering.on = False
