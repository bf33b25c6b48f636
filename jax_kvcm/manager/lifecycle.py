"""Sequences' lives: admission with prefix reuse, close, suspend and resume, loss of the device.

A new sequence reuses the longest committed prefix of its prompt (device, host or disk; lower-tier
hits are onboarded to the device in one transaction when room exists). ``suspend`` moves the
device pages only it holds down a tier as one transaction, or changes nothing (``MUST_RECOMPUTE``);
``resume`` brings them back byte-identical, or changes nothing. With an arena, a sequence also
holds a range (bound at admission or resume, parked at close or suspend) and its pages move in at
``base + j``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_kvcm._disk_tier import CorruptPageError
from jax_kvcm._prefix_tree import NO_PAGE, BlockNode, PrefixTree, salt_bytes
from jax_kvcm._types import CacheLevel
from jax_kvcm.manager.api import ManagerEvent, Sequence, SequenceState, SuspendResult
from jax_kvcm.manager.ledger import StepLedger
from jax_kvcm.manager.observers import Stats
from jax_kvcm.manager.planner import TierPlanner, hit_by, node_slots
from jax_kvcm.manager.rows import RowTable, prompt_array

__all__ = ["Lifecycle"]

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK


class Lifecycle:
    """See the module docstring; ``arena_room``: the arena groups' planner (or None)."""

    def __init__(self, config: Any, storage: Any, tree: PrefixTree, rows: RowTable,
                 ledger: StepLedger, planner: TierPlanner, stats: Stats, emit: Any,
                 settle: Any, arena_room: Any = None) -> None:
        self._config = config
        self._storage = storage
        self._tree = tree
        self._rows = rows
        self._ledger = ledger
        self._planner = planner
        self._stats = stats
        self._emit = emit
        self._settle = settle  # (block, nodes) -> None: write-back-ahead copies of ``nodes``
        self._arena = arena_room

    # -- holders of committed pages --------------------------------------------------------------

    def _usable_prefix(self, nodes: list[BlockNode]) -> list[BlockNode]:
        return self._rows.win.usable_prefix(nodes) if self._rows.win else nodes

    def _take(self, node: BlockNode, j: int, wr: np.ndarray) -> None:
        if self._rows.win:
            self._rows.win.take(node, j, wr)

    def drop_hold(self, node: BlockNode, j: int, wr: np.ndarray) -> None:
        if self._rows.win:
            self._rows.win.drop_hold(self._tree, node, j, wr)
        else:
            self._tree.decref(node)

    # -- admission -------------------------------------------------------------------------------

    def add(self, tokens: Any, salt: Any) -> Sequence:
        cfg, tpp = self._config, self._rows.tpp
        toks = prompt_array(tokens, cfg.max_seq_len)
        salt_b = salt_bytes(salt)
        matched: list[BlockNode] = []
        if cfg.enable_prefix_reuse and toks.size > 1:
            max_pages = (toks.size - 1) // tpp
            self._stats.num_prefix_queries += 1
            self._stats.num_prefix_query_tokens += int(toks.size)
            matched = self._usable_prefix(self._tree.match(toks, salt_b, tpp, max_pages))
        seq = self._rows.open(toks, salt_b, [], cfg.enable_prefix_reuse)
        try:
            snap = None
            if self._arena is not None and self._ledger.in_step is None:
                # NOTE: only lower-tier hits can be cut short by onboarding (below)
                if any(n.level is not D for n in matched):
                    snap = self._arena.snapshot()
                self._arena.bind(seq, matched)
            nodes = self._onboard(seq, matched)
            if snap is not None and len(nodes) < len(matched) and self._arena.bound(seq):
                # NOTE: the range was chosen for the whole chain, whose device pages past the
                # kept prefix it may hold in place, where the sequence now writes its own (the
                # random run's seed 3402, operation 83845): choose again for what it holds
                self._arena.restore(snap, counts=False)
                self._arena.bind(seq, nodes)
        except BaseException:
            if self._arena is not None:
                self._arena.unbind(seq)
            self._rows.release(seq)
            raise
        k = len(nodes)
        seq._nodes = nodes
        self._rows.restore(seq._row, k, k * tpp, toks.size)
        self._rows.set_ncommit(seq._row, k)
        self._rows.write_row(seq, node_slots(nodes) if k
                             else np.zeros((self._rows.num_groups, 0), np.int32))
        seq.num_reused_tokens = k * tpp
        self._stats.num_prefix_hit_tokens += k * tpp
        return seq

    def _onboard(self, seq: Sequence, nodes: list[BlockNode]) -> list[BlockNode]:
        """Takes the matched nodes that are usable for a new holder: those on the device up to
        the first lower-tier one, and all of them if the lower-tier pages needed can be brought
        to the device (one transaction; window pages no one needs are freed instead). Lower-tier
        hits that cannot are left untouched (not even their LRU position changes); an I/O error
        releases every reference taken and propagates."""
        planner, rows = self._planner, self._rows
        in_step = self._ledger.in_step is not None
        if not in_step:  # NOTE: a failed write-back-ahead copy rolls pages back
            self._settle(True, [n for n in nodes if n.level is H])
        lower = [j for j, n in enumerate(nodes) if n.level is not D]
        wr = rows.wrel_at(len(nodes) * rows.tpp)
        if lower and not in_step and (self._arena is None or self._arena.bound(seq)):
            # NOTE: pages this holder's windows need, or another holder's (a suspended one).
            slots = node_slots([nodes[j] for j in lower])
            wanted = slots >= 0
            if rows.win:
                rows.win.wanted(nodes, lower, slots, wr, wanted)
            need = np.count_nonzero(wanted, axis=1)
            at = None if self._arena is None else self._arena.place(seq, np.asarray(lower))
            if planner.plan_device(need, at, keep=self._kept(nodes, wr)):
                if self._onboard_lower(nodes, lower, wr, np.where(wanted, slots, NO_PAGE), at):
                    return nodes
        nodes = self._usable_prefix(nodes[:lower[0]] if lower else nodes)
        wr = rows.wrel_at(len(nodes) * rows.tpp)
        for j, n in enumerate(nodes):
            self._tree.incref(n)
            self._take(n, j, wr)
        return nodes

    def _kept(self, nodes: list[BlockNode], wr: np.ndarray) -> np.ndarray:
        """Per layer group, the cached device pages among ``nodes`` that a new holder with
        windows from ``wr`` would take (and so no eviction could free)."""
        out = np.zeros(self._rows.num_groups, np.int64)
        full = self._rows.full.ids if self._rows.full else []
        for n in nodes:
            if n.level is D and n.refcount == 0:
                out[full] += n.slots[full] >= 0
        if self._rows.win:
            self._rows.win.kept(nodes, wr, out)
        return out

    def _onboard_lower(self, nodes: list[BlockNode], lower: list[int], wr: np.ndarray,
                       src: np.ndarray, at: dict[int, np.ndarray] | None) -> bool:
        """Takes every node and brings pages ``src[:, i]`` of ``nodes[lower[i]]`` to the device
        (room was planned; ``at[g][i]``: its slot in an arena group), freeing their other
        pages; False (every reference given back, nothing moved) when it failed."""
        planner = self._planner
        for j, n in enumerate(nodes):  # NOTE: held while room is made: eviction cannot take them
            self._tree.incref(n)
            self._take(n, j, wr)
        cols = [[i for i, j in enumerate(lower) if nodes[j].level is lv] for lv in (K, H)]
        used = [(lv, c) for lv, c in zip((K, H), cols) if c]  # disk first: it can fail
        parts = [(lv, src[:, c], D) for lv, c in used]
        places = None if at is None else [_columns(at, c, src.shape[0]) for _, c in used]
        corrupt: list[BlockNode] = []
        out = None
        try:
            if planner.reserve_device(np.count_nonzero(src >= 0, axis=1), _subset(at, src)):
                try:
                    out = planner.move(parts, places)
                except CorruptPageError as e:  # a miss; nothing moved; bad pages dropped below
                    corrupt = hit_by(e, [nodes[j] for j in lower])
        except BaseException:
            for j, n in enumerate(nodes):
                self.drop_hold(n, j, wr)
            raise
        if out is None:
            for j, n in enumerate(nodes):
                self.drop_hold(n, j, wr)
            for n in corrupt:  # never served again (unless still held by a suspended sequence)
                if n.alive and all(d.refcount == 0 for d in self._tree.subtree(n)):
                    planner.drop(n)
            return False
        for (_, c), dst in zip(used, out):
            for k, i in enumerate(c):
                n = nodes[lower[i]]
                for g in np.flatnonzero((n.slots >= 0) & (src[:, i] < 0)).tolist():
                    self._storage.free(n.level, g, n.slots[g:g + 1])  # pages no window needs
                self._tree.move(n, D, dst[:, k].copy())
        self._stats.num_onboarded_pages += len(lower)
        self._emit(ManagerEvent("onboarded", len(lower), D))
        return True

    # -- close -----------------------------------------------------------------------------------

    def close(self, seq: Sequence) -> None:
        rows = self._rows
        row = seq._row
        if seq.state is SequenceState.ACTIVE:
            self._ledger.defer_free(rows.private(seq), seq.seq_id)
            self._ledger.note_close()
        elif seq._parked is not None:
            lv, slots = seq._parked
            for g in range(rows.num_groups):
                self._storage.free(lv, g, slots[g][slots[g] >= 0])
        wr = rows.row_wrel(row)
        for j in range(len(seq._nodes) - 1, -1, -1):
            self.drop_hold(seq._nodes[j], j, wr)
        if self._arena is not None:
            self._arena.unbind(seq)
        seq._nodes = []
        seq._parked = None
        seq.state = SequenceState.CLOSED
        seq._done_step = self._ledger.done_step_of_close()
        rows.release(seq)

    # -- suspend / resume ------------------------------------------------------------------------

    def suspend(self, seq: Sequence) -> SuspendResult:
        planner, rows = self._planner, self._rows
        own = [n for n in seq._nodes if n.level is D and n.refcount == 1]
        private = rows.private(seq)
        own_slots = node_slots(own)
        if own and rows.win:  # window pages it does not need (wlru) are dropped, not moved
            own_slots = rows.win.unneeded(own, own_slots)
        need = np.count_nonzero(private >= 0, axis=1)
        if own:
            need += np.count_nonzero(own_slots >= 0, axis=1)
        for lv in planner.levels[1:]:
            if not planner.writable(lv) or not planner.make_room_cold(lv, need):
                continue
            out = planner.move([(D, private, lv)] + ([(D, own_slots, lv)] if own else []))
            if out is None:  # a failed disk write (room was made)
                continue
            for i, n in enumerate(own):
                if rows.win:
                    dropped = rows.win.forget(n)
                    if dropped is not None:
                        self._ledger.defer_free(dropped, seq.seq_id)
                self._tree.move(n, lv, out[1][:, i].copy())
            seq._parked = (lv, out[0])
            seq.state = SequenceState.SUSPENDED
            if self._arena is not None:
                self._arena.unbind(seq)
            self._stats.num_suspended += 1
            self._emit(ManagerEvent("suspended", len(own) + private.shape[1], lv))
            return SuspendResult.SUSPENDED
        self._stats.num_refused_suspends += 1
        return SuspendResult.MUST_RECOMPUTE

    def resume(self, seq: Sequence) -> bool:
        planner = self._planner
        lv, parked = seq._parked
        self._settle(True, [n for n in seq._nodes if n.level is H])
        cold = [[n for n in seq._nodes if n.level is level] for level in (K, H)]
        parts = [(level, node_slots(b), D) for level, b in zip((K, H), cold) if b]
        parts.append((lv, parked, D))
        parts.sort(key=lambda p: p[0] is not K)  # disk first: disk reads fail mid-submission
        need = sum(np.count_nonzero(p[1] >= 0, axis=1) for p in parts)
        places = at = None
        if self._arena is not None:
            if not self._resume_fits(seq, parts, cold, parked, need):
                self._stats.num_refused_resumes += 1
                return False  # NOTE: before binding, whose evictions a refusal must not make
            if not self._arena.bind(seq, [n for n in seq._nodes if n.level is D]):
                self._stats.num_refused_resumes += 1
                return False
            places, at = self._arena_places(seq, parts, cold, parked)
        out = None
        try:
            if planner.reserve_device(need, at):
                out = planner.move(parts, places)
        finally:
            if out is None and self._arena is not None:
                self._arena.unbind(seq)
        if out is None:
            self._stats.num_refused_resumes += 1
            return False
        back = None
        for (level, src, _), dst in zip(parts, out):
            if src is parked:
                back = dst
                continue
            for i, n in enumerate(cold[level is H]):
                self._tree.move(n, D, dst[:, i].copy())
        seq._parked = None
        seq.state = SequenceState.ACTIVE
        k = len(seq._nodes)
        slots = np.concatenate([node_slots(seq._nodes) if k else
                                np.zeros((self._rows.num_groups, 0), np.int32), back], axis=1)
        self._rows.write_row(seq, slots, self._rows.row_wrel(seq._row))  # (after a truncation
        #                                          pages before its window may stay released)
        self._stats.num_resumed += 1
        self._emit(ManagerEvent("resumed", sum(map(len, cold)) + parked.shape[1], D))
        return True

    def _resume_fits(self, seq: Sequence, parts: list, cold: list, parked: np.ndarray,
                     need: np.ndarray) -> bool:
        """Whether a resume on the arena could reserve its device pages (the dry run of
        binding and ``reserve_device``: nothing changes)."""
        index = {id(n): j for j, n in enumerate(seq._nodes)}
        g0 = int(self._arena.groups[0])
        pages = []
        for level, src, _ in parts:
            if src is parked:
                j = len(seq._nodes) + np.arange(src.shape[1])
            else:
                j = np.asarray([index[id(n)] for n in cold[level is H]], np.int64)
            pages.append(j[src[g0] >= 0])
        pages = np.concatenate(pages) if pages else np.zeros(0, np.int64)
        if not self._arena.plan_bind(seq, [n for n in seq._nodes if n.level is D], pages):
            return False
        rest = need.copy()
        rest[self._arena.groups] = 0
        planner = self._planner
        return not rest.any() or planner.fits(D, rest) or planner.room(D, rest)

    def _arena_places(self, seq: Sequence, parts: list, cold: list, parked: np.ndarray
                      ) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
        """Where each part of a resume lands in the sequence's range: nodes at their page
        index, private pages after its committed ones."""
        index = {id(n): j for j, n in enumerate(seq._nodes)}
        places, allat = [], {}
        for level, src, _ in parts:
            if src is parked:
                j = len(seq._nodes) + np.arange(src.shape[1])
            else:
                j = np.asarray([index[id(n)] for n in cold[level is H]], np.int64)
            at = self._arena.place(seq, j)
            place = np.full(src.shape, -1, np.int32)
            for g, s in at.items():
                place[g] = np.where(src[g] >= 0, s, -1)
            places.append(place)
        for g in self._arena.groups:
            cols = [p[g][p[g] >= 0] for p in places]
            allat[g] = np.concatenate(cols) if cols else np.zeros(0, np.int32)
        return places, allat

    # -- loss of the device ----------------------------------------------------------------------

    def lose_device(self) -> list[Sequence]:
        """See :meth:`KVCacheManager.recover_from_failed_step` (no step in flight)."""
        self._settle(True, None)  # NOTE: rolled-back pages are on the device: lost below
        lost = [s for s in self._rows.seqs.values()
                if (s.state is SequenceState.ACTIVE and self._rows.num_pages(s._row) > 0)
                or any(n.level is D for n in s._nodes)]
        for seq in lost:
            self.close(seq)
        for n in list(self._tree.nodes.values()):
            if n.alive and n.level is D:
                self._planner.drop(n)
        self._ledger.forget_steps()
        self._planner.reclaim()
        self._storage.rebuild_pools()
        self._stats.num_failed_steps += 1
        self._stats.num_lost_sequences += len(lost)
        self._emit(ManagerEvent("lost", len(lost), D))
        return lost


def _columns(at: dict[int, np.ndarray], cols: list[int], num_groups: int) -> np.ndarray:
    """``[G, len(cols)]`` slots of ``at`` (arena groups; -1 elsewhere) at ``cols``."""
    out = np.full((num_groups, len(cols)), -1, np.int32)
    for g, s in at.items():
        out[g] = s[cols]
    return out


def _subset(at: dict[int, np.ndarray] | None, src: np.ndarray) -> dict[int, np.ndarray] | None:
    """The arena slots ``at`` of the pages that move (``src >= 0``)."""
    if at is None:
        return None
    return {g: s[src[g] >= 0] for g, s in at.items()}
