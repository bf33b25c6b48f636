"""The step ledger: the step in flight, completion fences, and pending frees.

Step protocol: ``prepare_step`` -> the user's jitted step (donating the pools) ->
``complete_step(new pools)``. Between the two the pools are owned by the step: calls that move
pages raise :class:`StepInFlightError`.

Fences. Pages the manager frees (closed sequences, dropped cached pages) go to a pending list
tagged with the step count; they return to the allocator once that step is complete. Each
completed step leaves a fence (:func:`jax_kvcm._fence.step_fence`); the ledger keeps the latest
few. Steps complete in order, so a ready fence covers every step before it: in an overlapped loop
(step n handed back while step n - 1 still runs) the pages freed after step n - 1 come back as
soon as it finished, not only once the newest step is ready. (Polling the newest step alone
never succeeded in an overlapped loop: every allocation evicted instead, and write-back ahead
stalled; H200 seed run, session 7 of the results log.)

A pending entry may also wait for a *settle fence* (a write-back-ahead copy that reads its
slots); :meth:`StepLedger.reclaim` skips such entries until the planner clears that fence.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

from jax_kvcm._fence import step_fence
from jax_kvcm._types import CacheLevel
from jax_kvcm.manager.api import Sequence, StepInFlightError
from jax_kvcm.manager.observers import Stats

__all__ = ["PendingFree", "StepLedger"]

_OLDER_FENCES = 4  # an overlapped loop runs one or two steps behind the host
_D = CacheLevel.DEVICE


class PendingFree:
    """Device slots ``[G, n]`` (-1: no page) freed once step ``step`` completed (None: the step
    in flight, tagged at ``complete_step``) and ``fence`` (when set) is settled; ``owners``:
    the seq id (or one per column) that released them."""

    __slots__ = ("step", "slots", "owners", "fence")

    def __init__(self, step: int | None, slots: np.ndarray, owners: Any, fence: Any) -> None:
        self.step, self.slots, self.owners, self.fence = step, slots, owners, fence


class StepLedger:
    """See the module docstring. ``storage`` frees the slots; ``stats`` counts fence waits."""

    def __init__(self, storage: Any, num_groups: int, stats: Stats) -> None:
        self._storage = storage
        self._G = num_groups
        self._stats = stats
        # (seqs, rows, npages, len, known before the step): what abort_step restores.
        self._in_step: tuple[list[Sequence], np.ndarray, np.ndarray, np.ndarray,
                             np.ndarray] | None = None
        self._handed: list[tuple[Any, Any]] = []  # the pools the step was given
        self._step_index = 0        # completed steps
        self._fence: Any = None     # a fence of the latest completed step
        # (step index, fence) of earlier steps not yet known complete, oldest first.
        self._older: deque[tuple[int, Any]] = deque()
        self._ready_upto = 0        # every step <= this is known complete
        self._pending: list[PendingFree] = []
        self._num_pending = np.zeros(num_groups, np.int64)
        self._closed_in_step = False

    # -- the step in flight ----------------------------------------------------------------------

    @property
    def in_step(self) -> tuple | None:
        """``(seqs, rows, npages, length, known)`` of the prepared step, or None."""
        return self._in_step

    @property
    def handed(self) -> list[tuple[Any, Any]]:
        return self._handed

    @property
    def step_index(self) -> int:
        return self._step_index

    @property
    def ready_upto(self) -> int:
        return self._ready_upto

    @property
    def closed_in_step(self) -> bool:
        return self._closed_in_step

    def need_pools(self, what: str) -> None:
        if self._in_step is not None:
            raise StepInFlightError(f"{what} needs the pools: call complete_step first")

    def begin(self, record: tuple, handed: list[tuple[Any, Any]]) -> None:
        self._in_step = record
        self._handed = handed

    def note_close(self) -> None:
        """A sequence of the step in flight closed (its row may hold a new sequence later)."""
        if self._in_step is not None:
            self._closed_in_step = True

    def done_step_of_close(self) -> int:
        """The step that must complete before a sequence closed now is FINISHED."""
        return self._step_index + (self._in_step is not None)

    def complete(self, pool: Any) -> tuple:
        """The step returned its pools (``pool``: one of them, for the fence); returns the
        step's record and clears it."""
        record = self._in_step
        self._in_step = None
        self._handed = []
        if self._fence is not None:
            self._older.append((self._step_index, self._fence))
            if len(self._older) > _OLDER_FENCES:
                # NOTE: dropping the oldest loses nothing: a later step's fence, once ready,
                # covers it (steps complete in order).
                self._older.popleft()
        self._step_index += 1
        self._fence = step_fence(pool)
        for p in self._pending:
            if p.step is None:
                p.step = self._step_index
        self._stats.num_steps += 1
        self._closed_in_step = False
        return record

    def abort(self) -> tuple:
        """Clears the prepared step (it never ran); returns its record."""
        record = self._in_step
        self._in_step = None
        self._handed = []
        for p in self._pending:  # the aborted step reads nothing: the last completed one may
            if p.step is None:
                p.step = self._step_index
        self._closed_in_step = False
        self._stats.num_aborted_steps += 1
        return record

    def forget_steps(self) -> None:
        """Nothing can read the old pools any more (a failed step lost them): every step is
        complete and every pending free is ready."""
        self._fence = None
        self._older.clear()
        self._ready_upto = self._step_index
        for p in self._pending:
            p.step = self._step_index

    # -- fences ----------------------------------------------------------------------------------

    def poll(self, block: bool) -> None:
        """Advances ``ready_upto`` past every step known complete: the latest step's fence
        (``block`` waits for it), else the newest ready one of the older steps'."""
        older = self._older
        f = self._fence
        if f is None or self._ready_upto >= self._step_index:
            older.clear()
            return
        if f.is_deleted():
            # NOTE: step fences are never donated; a deleted fence (a donated pool) is still
            # answered by the pools that later work made from it.
            f = self._storage.pools[0][0]
        if block:
            self._stats.num_fence_waits += 1
            t = time.perf_counter()
            f.block_until_ready()
            self._stats.fence_wait_seconds += time.perf_counter() - t
        if block or f.is_ready():
            self._ready_upto = self._step_index
            older.clear()
            return
        for i in range(len(older) - 1, -1, -1):
            step, fence = older[i]
            if step <= self._ready_upto or fence.is_ready():
                self._ready_upto = max(self._ready_upto, step)
                for _ in range(i + 1):
                    older.popleft()
                return

    def wait_all(self) -> None:
        """Waits for the latest step (shutdown); errors of a failed step are ignored."""
        for arr in ([self._fence] if self._fence is not None else []):
            try:
                if not arr.is_deleted():
                    arr.block_until_ready()
            except Exception:  # noqa: BLE001 - a failed step's output: nothing to wait for
                pass
        self._ready_upto = self._step_index

    def is_finished(self, seq: Sequence) -> bool:
        """Whether every step a closed ``seq`` may have been read by completed (polls)."""
        if seq._done_step > self._ready_upto and self._fence is not None:
            self.poll(block=False)
        return seq._done_step <= self._ready_upto

    # -- pending frees ---------------------------------------------------------------------------

    @property
    def num_pending(self) -> np.ndarray:
        """``[G]`` pages waiting (a view: do not write)."""
        return self._num_pending

    @property
    def pending(self) -> list[PendingFree]:
        return self._pending

    def defer_free(self, slots: np.ndarray, owners: Any = None,
                   fence: Any = None) -> PendingFree | None:
        """Device slots ``[G, n]`` (-1 entries skipped) to free once the last step that may read
        them completed (and ``fence``, when given, is settled). None when there is nothing."""
        if slots.shape[1] == 0:
            return None
        step = None if self._in_step is not None else self._step_index
        entry = PendingFree(step, slots, owners, fence)
        self._pending.append(entry)
        self._num_pending += np.count_nonzero(slots >= 0, axis=1)
        return entry

    def cancel_column(self, entry: PendingFree, i: int) -> None:
        """Column ``i`` of ``entry`` is not to be freed after all (its page came back)."""
        self._num_pending -= entry.slots[:, i] >= 0
        entry.slots[:, i] = -1

    def reclaim(self, block: bool = False) -> int:
        """Returns ready pending frees (settled ones only) to the allocator; the number of pages
        returned. The planner settles write-back-ahead fences first."""
        if not self._pending:
            return 0
        self.poll(block)
        keep, n = [], 0
        for entry in self._pending:
            if entry.step is not None and entry.step <= self._ready_upto and entry.fence is None:
                for g in range(self._G):
                    s = entry.slots[g]
                    s = s[s >= 0]
                    self._storage.free(_D, g, s)
                    self._num_pending[g] -= s.size
                    n += s.size
            else:
                keep.append(entry)
        self._pending = keep
        return n

    def pending_of(self, seq_id: int) -> np.ndarray:
        """``[G]``: pages ``seq_id`` released that still wait."""
        out = np.zeros(self._G, np.int64)
        for entry in self._pending:
            if entry.owners is None:
                continue
            mine = np.broadcast_to(np.asarray(entry.owners) == seq_id, entry.slots.shape[1:])
            out += np.count_nonzero((entry.slots >= 0) & mine[None], axis=1)
        return out
