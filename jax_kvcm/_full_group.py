"""Page tables of one kind of layer group, and the full-attention group manager.

:class:`GroupTables` is what every group manager shares: the row tables of the layer groups of
one kind. ``table[k, row, e]`` (int32; 0 is the null page) is entry ``e`` of the row of the
manager's ``k``-th layer group (``ids[k]``); a row has ``widths[k]`` entries, and the page of
absolute page index ``j`` (tokens ``[j * P, (j + 1) * P)``) of the row sits at entry
``j % widths[k]``. For a full-attention group the width is ``ceil(max_seq_len / P)``, so entry
``j`` is page ``j`` (an absolute table); a sliding-window group's width may be a ring
(:mod:`jax_kvcm._window_group`).

:class:`FullGroups` keeps every page of a sequence until it is closed (or suspended): no release
logic, no per-step work beyond the table writes and gathers.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FullGroups", "GroupTables"]


class GroupTables:
    """Row tables of the layer groups ``ids`` (ascending) with ``widths`` entries per row."""

    kind = "?"

    def __init__(self, ids: list[int], widths: list[int]) -> None:
        self.ids = np.asarray(ids, np.int64)
        self.widths = np.asarray(widths, np.int64)
        self.width = int(self.widths.max())
        self._k = np.arange(len(ids))[:, None]
        # NOTE: one width for all (the common case): entries by one scalar modulus, and the
        # gathers index [K, rows, entries] with plain broadcasting.
        self._uniform = bool((self.widths == self.width).all())
        # The groups' rows of a [G, ...] array: a slice when the ids are contiguous (the common
        # case; cheaper than fancy indexing on the hot path).
        contiguous = bool((np.diff(self.ids) == 1).all())
        self.sel = slice(int(self.ids[0]), int(self.ids[-1]) + 1) if contiguous else self.ids
        self.table = np.zeros((len(ids), 0, self.width), np.int32)

    def __len__(self) -> int:
        return int(self.ids.size)

    def grow(self, num_rows: int) -> None:
        """Resizes the row axis to ``num_rows`` (>= the current size), new rows empty."""
        table = np.zeros((len(self), num_rows, self.width), np.int32)
        table[:, :self.table.shape[1]] = self.table
        self.table = table

    def entries(self, j: np.ndarray) -> np.ndarray:
        """``[K, ...]``: the entry of absolute page ``j`` in each of the manager's groups."""
        return np.asarray(j)[None] % self.widths.reshape((-1,) + (1,) * np.ndim(j))

    def slots(self, rows: np.ndarray, j: np.ndarray) -> np.ndarray:
        """``[K, n]``: the entries holding pages ``j`` of ``rows`` (both ``[n]``)."""
        if self._uniform:
            return self.table[:, rows, j % self.width]
        return self.table[self._k, rows[None], self.entries(j)]

    def set_slots(self, rows: np.ndarray, j: np.ndarray, slots: np.ndarray) -> None:
        """Writes ``slots [K, n]`` as pages ``j`` of ``rows``."""
        if self._uniform:
            self.table[:, rows, j % self.width] = slots
        else:
            self.table[self._k, rows[None], self.entries(j)] = slots

    def view(self, rows: np.ndarray, j: np.ndarray) -> np.ndarray:
        """``[K, n]``: the slots of pages ``j`` of ``rows`` (0 where the group holds no page
        for it, e.g. released by a window)."""
        return self.slots(rows, j)

    def pages(self, row: int, first: int, last: int) -> np.ndarray:
        """``[K, last - first]``: pages ``first..last-1`` of ``row`` (see :meth:`view`)."""
        return self.view(np.full(last - first, row), np.arange(first, last))

    def clear_row(self, row: int) -> None:
        self.table[:, row] = 0

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Row ``src[i]`` becomes row ``dst[i]`` (a permutation of live rows; see compact)."""
        self.table[:, dst] = self.table[:, src]


class FullGroups(GroupTables):
    """Full-attention layer groups: table width ``P``, page ``j`` at entry ``j``."""

    kind = "full"

    def entries(self, j: np.ndarray) -> np.ndarray:
        return np.broadcast_to(np.asarray(j)[None], (len(self),) + np.shape(j))

    def slots(self, rows: np.ndarray, j: np.ndarray) -> np.ndarray:
        return self.table[:, rows, j]

    def set_slots(self, rows: np.ndarray, j: np.ndarray, slots: np.ndarray) -> None:
        self.table[:, rows, j] = slots

    def pages(self, row: int, first: int, last: int) -> np.ndarray:
        return self.table[:, row, first:last]

    def check_row(self, row: int, want: np.ndarray) -> None:
        """Invariants of one ACTIVE row whose pages are ``want [K, n]`` (tests)."""
        assert (want > 0).all(), (row, want)
        assert not self.table[:, row, want.shape[1]:].any(), row
