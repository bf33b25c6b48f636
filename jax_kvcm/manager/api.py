"""The manager's public records: sequence handles and states, results, events and errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jax_kvcm._types import CacheLevel

if TYPE_CHECKING:
    from jax_kvcm.manager.rows import RowTable

__all__ = [
    "ManagerEvent",
    "OutOfPagesError",
    "Sequence",
    "SequencePhase",
    "SequenceState",
    "SequenceView",
    "StepInFlightError",
    "SuspendResult",
]


class OutOfPagesError(RuntimeError):
    """``prepare_step`` cannot get the pages it needs even by evicting every cached page;
    nothing changed (it plans before it evicts)."""


class StepInFlightError(RuntimeError):
    """The call needs the pools, which the dispatched step owns until ``complete_step``."""


class SequenceState(enum.Enum):
    ACTIVE = "active"
    SUSPENDED = "suspended"
    CLOSED = "closed"


class SequencePhase(enum.Enum):
    """Where a sequence is in its life (a request's phases in the bounded-window design):

    - ADMITTED: added (prefix matched), not yet in any prepared step;
    - EXECUTING: has been in a prepared step (ACTIVE or SUSPENDED);
    - FINISHING: closed, but pages it released wait for the fence of a step that may still read
      them (they return to the pool once that step completed);
    - FINISHED: closed and every page it held is free or cached."""

    ADMITTED = "admitted"
    EXECUTING = "executing"
    FINISHING = "finishing"
    FINISHED = "finished"


class SuspendResult(enum.Enum):
    SUSPENDED = "suspended"
    MUST_RECOMPUTE = "must_recompute"  # no tier could take it; the sequence is unchanged


@dataclass(frozen=True, slots=True)
class SequenceView:
    """:meth:`KVCacheManager.state` of one sequence (a snapshot; per layer group ``[G]`` tuples).

    - ``retained``: ``(first, end)`` absolute page indices the sequence holds in each group
      (``first > 0`` only in sliding-window groups: pages before it left every window);
    - ``ring_entries``: entries of its page-table row per group (a window group's ring ``R``;
      ``ceil(max_seq_len / tokens_per_page)`` for full groups); page ``j`` sits at entry
      ``j % ring_entries[g]``;
    - ``pending_retirements``: pages it released (window moves, close) that still wait for the
      fence of the last step that read them, per group."""

    seq_id: int
    state: SequenceState
    phase: SequencePhase
    num_tokens: int
    retained: tuple[tuple[int, int], ...]
    ring_entries: tuple[int, ...]
    pending_retirements: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ManagerEvent:
    """``kind``: "committed", "evicted" (moved down a tier), "dropped", "onboarded",
    "suspended", "resumed"; ``num_pages`` pages; ``level`` the destination tier. "lost":
    ``num_pages`` sequences closed because a failed step lost the device pools;
    "disk_degraded": the disk tier takes no more pages."""

    kind: str
    num_pages: int
    level: CacheLevel | None = None


class Sequence:
    """A handle; its state lives in the manager's row table. ``num_reused_tokens``: tokens
    matched from the prefix cache at :meth:`KVCacheManager.add_sequence` (prefill can skip
    them).

    The underscored slots are the manager's bookkeeping (read and written by its collaborators,
    never by users): ``_row`` the table row, ``_nodes`` the committed prefix chain it holds,
    ``_parked`` ``(level, slots [G, n])`` of its private pages while suspended, ``_done_step``
    the step that must complete before a closed sequence's pages are free."""

    __slots__ = ("_rows", "_row", "_nodes", "state", "num_reused_tokens", "seq_id", "_salt",
                 "_parked", "_done_step", "__weakref__")

    def __init__(self, rows: RowTable, row: int, seq_id: int, salt: bytes) -> None:
        self._rows = rows
        self._row = row
        self._nodes: list[Any] = []
        self.state = SequenceState.ACTIVE
        self.num_reused_tokens = 0
        self.seq_id = seq_id
        self._salt = salt
        self._parked: tuple[CacheLevel, np.ndarray] | None = None
        self._done_step = 0

    def _open(self) -> bool:
        return self.state is not SequenceState.CLOSED

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V are (or are being) written."""
        return self._rows.num_tokens(self._row) if self._open() else 0

    @property
    def num_pages(self) -> int:
        return self._rows.num_pages(self._row) if self._open() else 0

    @property
    def row(self) -> int:
        """The sequence's row in the manager's tables (changes only by
        :meth:`KVCacheManager.compact`)."""
        return self._row

    @property
    def phase(self) -> SequencePhase:
        """See :class:`SequencePhase`."""
        return self._rows.phase_of(self)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the manager knows (the prompt, ids given to ``prepare_step`` or
        :meth:`KVCacheManager.record_token_ids`); may be below ``num_tokens`` when steps were
        given counts, or above it while a prompt is being prefilled."""
        return self._rows.num_known(self._row) if self._open() else 0

    def page_ids(self, layer_group: int = 0) -> np.ndarray:
        """Device slots of this sequence's pages by absolute page index (a copy; ACTIVE
        sequences only). In a sliding-window layer group, pages no future query of the sequence
        can see are released and read 0 (the null page)."""
        rows = self._rows
        return rows.row_pages(self._row, 0, rows.num_pages(self._row))[layer_group].copy()

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, state={self.state.value})"
