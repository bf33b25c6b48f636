"""The row table: one row per open sequence, its page-table rows, and the step-batch gather.

Hot-path layout (no per-page Python objects per step): the group managers own row tables
``[K, rows, width]`` int32 (:class:`~jax_kvcm._full_group.FullGroups`,
:class:`~jax_kvcm._window_group.WindowGroups`), this table the per-row arrays (``length``,
``num_pages``, ``num_committed``, ``known`` token ids, ...) and a token matrix ``[rows, P * tpp]``;
a sequence is a row. :meth:`RowTable.gather` builds a :class:`StepBatch` with numpy fancy
indexing. Rows grow by doubling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jax_kvcm._full_group import FullGroups, GroupTables
from jax_kvcm._step_batch import StepBatch, pick_bucket
from jax_kvcm._window_group import WindowGroups
from jax_kvcm.manager.api import Sequence, SequencePhase, SequenceState
from jax_kvcm.manager.config import KVCacheConfig

__all__ = ["MAX_TOKEN_ID", "RowTable", "check_token_ids", "prompt_array"]

MAX_TOKEN_ID = (1 << 31) - 1  # token ids are stored and hashed as int32
_ROW_ARRAYS = ("length", "npages", "known", "ncommit", "commit_ok", "ran", "seq_id")


def check_token_ids(arr: np.ndarray, name: str) -> None:
    """ValueError unless ``arr`` (integer dtype) holds ids in ``[0, MAX_TOKEN_ID]``: a wider id
    would wrap when stored as int32 and alias another prompt's pages."""
    if arr.size and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        bad = arr[(arr < 0) | (arr > MAX_TOKEN_ID)][0]
        raise ValueError(f"{name}: token id {int(bad)} is outside [0, {MAX_TOKEN_ID}] (int32)")


def prompt_array(tokens: Any, max_seq_len: int) -> np.ndarray:
    """``add_sequence``'s ``tokens`` as int32 ``[n]``, validated (ValueError naming it)."""
    try:
        toks = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("tokens must be a 1-D sequence of int32 token ids") from None
    if toks.ndim != 1 or (toks.size and toks.dtype.kind not in "iu"):
        raise ValueError("tokens must be a 1-D sequence of int32 token ids")
    check_token_ids(toks, "tokens")
    toks = toks.astype(np.int32)
    if toks.size > max_seq_len:
        raise ValueError(f"{toks.size} tokens exceed max_seq_len {max_seq_len}")
    return toks


class RowTable:
    """Rows, sequences and page tables of one manager (see the module docstring).

    Arrays (int64 ``[rows]``, read through the properties, written through the methods):
    ``length`` tokens written, ``npages`` pages held, ``known`` token ids known, ``ncommit`` ==
    ``len(seq._nodes)``, ``commit_ok`` 1 while the sequence may commit pages, ``ran`` 1 once it
    was in a prepared step, ``seq_id`` its sequence's id (-1: free row)."""

    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.tpp = config.tokens_per_page
        self.num_groups = G = len(config.layer_groups)
        self.pages_per_seq = config.pages_per_seq
        full = [g for g, lg in enumerate(config.layer_groups) if not lg.sliding_window]
        wins = [g for g, lg in enumerate(config.layer_groups) if lg.sliding_window]
        #: the group managers: full attention, sliding windows (None when absent)
        self.full = FullGroups(full, [self.pages_per_seq] * len(full)) if full else None
        self.win = (WindowGroups(wins, [config.kept_window(config.layer_groups[g]) for g in wins],
                                 self.tpp, self.pages_per_seq, config.max_window_chunk,
                                 config.ring_tables, G, config.rollback_tokens)
                    if wins else None)
        self.kinds: list[GroupTables] = [k for k in (self.full, self.win) if k is not None]
        self.widths = np.asarray(config.table_widths, np.int64)
        self.width = int(self.widths.max())  # StepBatch.page_table's last axis
        self.zeros_g = np.zeros(G, np.int64)
        self._tokens = np.zeros((0, self.pages_per_seq * self.tpp), np.int32)
        self._a = {name: np.zeros(0, np.int64) for name in _ROW_ARRAYS}
        self._free_rows: list[int] = []
        self.seqs: dict[int, Sequence] = {}
        self._next_id = 0
        #: ``phase_of(seq)``: set by the manager (the phase needs the step ledger)
        self.phase_of: Callable[[Sequence], SequencePhase] = lambda s: SequencePhase.ADMITTED
        self.grow(16)

    # -- per-row reads ---------------------------------------------------------------------------

    @property
    def length(self) -> np.ndarray:
        return self._a["length"]

    @property
    def npages(self) -> np.ndarray:
        return self._a["npages"]

    @property
    def known(self) -> np.ndarray:
        return self._a["known"]

    @property
    def ncommit(self) -> np.ndarray:
        return self._a["ncommit"]

    @property
    def seq_ids(self) -> np.ndarray:
        return self._a["seq_id"]

    @property
    def num_rows(self) -> int:
        return self._a["length"].size

    def num_tokens(self, row: int) -> int:
        return int(self._a["length"][row])

    def num_pages(self, row: int) -> int:
        return int(self._a["npages"][row])

    def num_known(self, row: int) -> int:
        return int(self._a["known"][row])

    def ran(self, row: int) -> bool:
        return bool(self._a["ran"][row])

    def may_commit(self, rows: np.ndarray) -> np.ndarray:
        return self._a["commit_ok"][rows] > 0

    def tokens(self, row: int, first: int, last: int) -> np.ndarray:
        return self._tokens[row, first:last]

    # -- rows ------------------------------------------------------------------------------------

    def grow(self, n: int) -> None:
        old = self.num_rows
        new = max(n, 2 * old)
        for kind in self.kinds:
            kind.grow(new)
        tokens = np.zeros((new, self._tokens.shape[1]), np.int32)
        tokens[:old] = self._tokens
        self._tokens = tokens
        for name, arr in self._a.items():
            grown = np.zeros(new, np.int64)
            grown[:old] = arr
            self._a[name] = grown
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def open(self, toks: np.ndarray, salt: bytes, nodes: list[Any],
             may_commit: bool) -> Sequence:
        """A new ACTIVE sequence on a free row holding the committed chain ``nodes``."""
        if not self._free_rows:
            self.grow(self.num_rows * 2)
        row = self._free_rows.pop()
        seq = Sequence(self, row, self._next_id, salt)
        self._next_id += 1
        k = len(nodes)
        seq._nodes = nodes
        a = self._a
        self._tokens[row, :toks.size] = toks
        a["length"][row] = k * self.tpp
        a["npages"][row] = k
        a["known"][row] = toks.size
        a["ncommit"][row] = k
        a["commit_ok"][row] = int(may_commit)
        a["ran"][row] = 0
        a["seq_id"][row] = seq.seq_id
        self.seqs[seq.seq_id] = seq
        return seq

    def release(self, seq: Sequence) -> None:
        """Frees the row of a sequence being closed."""
        row = seq._row
        for name in _ROW_ARRAYS:
            self._a[name][row] = 0
        self._a["seq_id"][row] = -1
        for kind in self.kinds:
            kind.clear_row(row)
        self._free_rows.append(row)
        del self.seqs[seq.seq_id]

    def set_ncommit(self, row: int, n: int) -> None:
        self._a["ncommit"][row] = n

    def stop_commits(self, row: int) -> None:
        """Its next pages stay private (a collision, or a window page released uncommitted)."""
        self._a["commit_ok"][row] = 0

    def mark_ran(self, rows: np.ndarray) -> None:
        self._a["ran"][rows] = 1

    def restore(self, row: int, npages: int, length: int, known: int) -> None:
        """Undo of a step for one row (see :meth:`StepRunner.abort`)."""
        a = self._a
        a["npages"][row], a["length"][row], a["known"][row] = npages, length, known

    def advance(self, rows: np.ndarray, npages: np.ndarray, new_len: np.ndarray) -> None:
        self._a["npages"][rows] = npages
        self._a["length"][rows] = new_len

    # -- pages -----------------------------------------------------------------------------------

    def view(self, rows: np.ndarray, j: np.ndarray) -> np.ndarray:
        """``[G, n]`` slots of pages ``j`` of ``rows`` (0: none, e.g. released by a window)."""
        if len(self.kinds) == 1:
            return self.kinds[0].view(rows, j)
        out = np.empty((self.num_groups, j.size), np.int32)
        for kind in self.kinds:
            out[kind.ids] = kind.view(rows, j)
        return out

    def row_pages(self, row: int, first: int, last: int) -> np.ndarray:
        """``[G, last - first]`` slots of pages ``first..last-1`` of ``row`` (0: none)."""
        if len(self.kinds) == 1:
            return self.kinds[0].pages(row, first, last)
        out = np.zeros((self.num_groups, last - first), np.int32)
        for kind in self.kinds:
            out[kind.ids] = kind.pages(row, first, last)
        return out

    def set_slots(self, rows: np.ndarray, j: np.ndarray, slots: np.ndarray) -> None:
        """Writes ``slots [G, n]`` as pages ``j`` of ``rows``."""
        for kind in self.kinds:
            kind.set_slots(rows, j, slots[kind.ids])

    def private(self, seq: Sequence) -> np.ndarray:
        """The device slots ``[G, n]`` of the sequence's uncommitted pages (-1 where the page
        table holds the null page)."""
        r = seq._row
        t = self.row_pages(r, len(seq._nodes), self.num_pages(r))
        return np.where(t > 0, t, -1).astype(np.int32)

    def write_row(self, seq: Sequence, slots: np.ndarray,
                  released: np.ndarray | None = None) -> None:
        """Writes the page-table row of an ACTIVE sequence from ``slots [G, npages]`` (-1 ->
        the null page; window groups enter only the pages their windows still cover, and
        ``released [G]`` pages they already released stay released)."""
        r = seq._row
        slots = np.maximum(slots, 0)
        if self.full:
            self.full.clear_row(r)
            self.full.table[:, r, :slots.shape[1]] = slots[self.full.ids]
        if self.win:
            self.win.write_row(r, slots[self.win.ids], self.num_tokens(r), released)

    def wrel_at(self, num_tokens: int) -> np.ndarray:
        """``[G]``: leading window-released pages of a holder of ``num_tokens`` tokens."""
        return self.win.wrel_at(num_tokens) if self.win else self.zeros_g

    def row_wrel(self, row: int) -> np.ndarray:
        return self.win.row_wrel(row) if self.win else self.zeros_g

    # -- token ids -------------------------------------------------------------------------------

    def check_ids(self, rows: np.ndarray, counts: np.ndarray, cur: np.ndarray,
                  id_index: list[int], id_arrays: list[np.ndarray], every: Any) -> tuple:
        """Refuses token ids that contradict known ones (nothing changes); returns what
        :meth:`store_ids` needs (``[0]``: the rows' known counts before the step)."""
        known = self.known[rows]
        if not id_arrays:
            return (known,)
        idx = np.array(id_index, np.int64)
        sizes = counts[idx]
        id_vals = every.astype(np.int32)
        id_rows = np.repeat(rows[idx], sizes)
        id_pos = (np.arange(id_vals.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
                  + np.repeat(cur[idx], sizes))
        id_known = np.repeat(known[idx], sizes)
        overlap = id_pos < id_known
        if overlap.any() and not np.array_equal(
                self._tokens[id_rows[overlap], id_pos[overlap]], id_vals[overlap]):
            raise ValueError("token ids contradict the prompt of a sequence in work")
        return known, rows, cur, idx, sizes, id_vals, id_rows, id_pos, id_known

    def store_ids(self, ids: tuple, new_len: np.ndarray) -> None:
        """Stores the step's token ids (only when contiguous with the ids already known)."""
        if len(ids) == 1:
            return
        known, rows, cur, idx, sizes, id_vals, id_rows, id_pos, id_known = ids
        ok = id_known >= np.repeat(cur[idx], sizes)
        self._tokens[id_rows[ok], id_pos[ok]] = id_vals[ok]
        grow = known[idx] >= cur[idx]
        r = rows[idx][grow]
        self._a["known"][r] = np.maximum(known[idx][grow], new_len[idx][grow])

    def record_ids(self, seq: Sequence, token_ids: Any) -> int:
        """:meth:`KVCacheManager.record_token_ids`' ids validated (nothing changes on error)
        and stored after the ids already known; returns how many."""
        arr = token_ids if type(token_ids) is np.ndarray else np.asarray(token_ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError("token_ids must be a 1-D array of integer ids")
        check_token_ids(arr, "token_ids")
        r = seq._row
        k, n = self.num_known(r), int(arr.size)
        if k + n > self.config.max_seq_len:
            raise ValueError(f"token_ids: {k} known + {n} ids exceed max_seq_len "
                             f"{self.config.max_seq_len}")
        self._tokens[r, k:k + n] = arr
        self._a["known"][r] = k + n
        return n

    # -- the step batch --------------------------------------------------------------------------

    def gather(self, rows: np.ndarray, counts: np.ndarray, cur: np.ndarray,
               new_len: np.ndarray) -> StepBatch:
        """The padded :class:`StepBatch` of ``rows`` adding ``counts[b]`` tokens after
        ``cur[b]`` (their pages already in the tables)."""
        cfg, tpp = self.config, self.tpp
        B, T = counts.size, int(counts.sum())
        batch = StepBatch.padding(pick_bucket(cfg.batch_buckets, B),
                                  pick_bucket(cfg.token_buckets, T), self.width, self.num_groups)
        qs = batch.query_start
        np.cumsum(counts, out=qs[1:B + 1])
        qs[B + 1:] = T
        pos = np.arange(T) - np.repeat(qs[:B], counts) + np.repeat(cur, counts)
        batch.positions[:T] = pos
        batch.seq_lens[:B] = new_len
        tok_row = np.repeat(rows, counts)
        # [G, B, P] / [G, T] views (one group's arrays have no group axis)
        pt = batch.page_table.reshape((self.num_groups,) + batch.page_table.shape[-2:])
        sm = batch.slot_mapping.reshape(self.num_groups, -1)
        pj, off = pos // tpp, pos % tpp
        for kind in self.kinds:
            sel = slice(None) if len(self.kinds) == 1 else kind.sel
            pt[sel, :B, :kind.width] = kind.table[:, rows]
            sm[sel, :T] = kind.slots(tok_row, pj) * tpp + off
        return batch

    # -- compaction ------------------------------------------------------------------------------

    def compact(self, old_to_new: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """See :meth:`KVCacheManager.compact`; returns ``(new_to_old, src, dst)``."""
        m = np.asarray(old_to_new)
        if m.ndim != 1 or (m.size and m.dtype.kind not in "iu"):
            raise ValueError("old_to_new must be a 1-D array of ints")
        m = m.astype(np.int64)
        src = np.fromiter((s._row for s in self.seqs.values()), np.int64, len(self.seqs))
        if src.size and src.max() >= m.size:
            raise ValueError(f"old_to_new has {m.size} entries; row {int(src.max())} holds "
                             "a sequence")
        dst = m[src]
        if (dst < 0).any():
            raise ValueError("old_to_new maps a row that holds a sequence to -1")
        if np.unique(dst).size != dst.size:
            raise ValueError("old_to_new maps two sequences to one row")
        if dst.size and dst.max() >= self.num_rows:
            self.grow(int(dst.max()) + 1)
        for kind in self.kinds:
            kind.move_rows(src, dst)
        self._tokens[dst] = self._tokens[src]
        for arr in self._a.values():
            arr[dst] = arr[src]
        vacated = np.setdiff1d(src, dst)
        for r in vacated.tolist():
            for kind in self.kinds:
                kind.clear_row(r)
            for arr in self._a.values():
                arr[r] = 0
            self._a["seq_id"][r] = -1
        for seq, r in zip(self.seqs.values(), dst.tolist()):
            seq._row = r
        used = np.zeros(self.num_rows, bool)
        used[dst] = True
        self._free_rows = np.flatnonzero(~used)[::-1].tolist()
        out = np.full(int(dst.max()) + 1 if dst.size else 0, -1, np.int32)
        out[dst] = src
        return out, src, dst

    def active(self) -> list[Sequence]:
        return [s for s in self.seqs.values() if s.state is SequenceState.ACTIVE]
