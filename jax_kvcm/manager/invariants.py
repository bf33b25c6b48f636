"""Page accounting and the manager's invariants (tests call :meth:`Invariants.check`).

On every tier and pool ``free + pending + referenced + cached == capacity``; every page is in
exactly one place (a sequence's private pages, a committed node, a pending free, a parked
suspended sequence); the allocators and the governor's ledger agree with that census.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_kvcm._prefix_tree import PrefixTree
from jax_kvcm._types import CacheLevel
from jax_kvcm.manager.api import SequenceState
from jax_kvcm.manager.ledger import StepLedger
from jax_kvcm.manager.planner import TierPlanner, node_slots
from jax_kvcm.manager.rows import RowTable

__all__ = ["COUNT_KEYS", "Invariants"]

D = CacheLevel.DEVICE
COUNT_KEYS = ("capacity", "free", "pending", "referenced", "cached")


class Invariants:
    """Reads every collaborator (never writes); ``offloads()``: write-back-ahead records."""

    def __init__(self, storage: Any, tree: PrefixTree, rows: RowTable, ledger: StepLedger,
                 planner: TierPlanner, offloads: Any) -> None:
        self._storage = storage
        self._tree = tree
        self._rows = rows
        self._ledger = ledger
        self._planner = planner
        self._offloads = offloads

    def page_counts(self, level: CacheLevel, *, census: bool = True) -> list[dict[str, Any]]:
        """One dict per pool at ``level``: ``capacity``, ``free``, ``pending``, ``referenced``,
        ``cached`` pages and its ``layer_groups``. ``census``: ``referenced`` counted page by
        page over every node and sequence (O(pages): 12 ms at 26k pages, what :meth:`check`
        verifies the identity with); False: derived from the identity ``capacity - free -
        pending - cached`` (O(pools): what ``stats()`` reports while serving)."""
        rows, G = self._rows, self._rows.num_groups
        referenced = self._referenced(level) if census else None
        cached = self._tree.cached_pages(level)
        if level is D and rows.win:  # window pages of referenced nodes that no window needs
            unneeded = rows.win.num_unneeded()
            cached += unneeded
            if census:
                referenced -= unneeded
        pending = self._ledger.num_pending if level is D else np.zeros(G, np.int64)
        pools = self._planner.pool_of(level)
        out = []
        for p in range(int(pools.max()) + 1):
            groups = np.flatnonzero(pools == p)
            g0 = int(groups[0])
            if level is D:
                tier, h = self._storage.hot_tier(g0), self._storage.hot_group_of[g0]
                capacity, free = tier.capacity_pages(h), tier.num_free(h)
            else:
                alloc = self._storage.allocator(level, g0)
                capacity, free = alloc.num_slots, alloc.num_free
            held, kept = int(pending[groups].sum()), int(cached[groups].sum())
            used = (int(referenced[groups].sum()) if census
                    else capacity - free - held - kept)
            out.append(dict(capacity=capacity, free=free, pending=held, referenced=used,
                            cached=kept, layer_groups=groups.tolist()))
        return out

    def _referenced(self, level: CacheLevel) -> np.ndarray:
        """Pages per layer group at ``level`` that a node with references or a sequence
        (active rows, parked suspended ones) holds, counted one by one."""
        rows = self._rows
        referenced = np.zeros(rows.num_groups, np.int64)
        for n in self._tree.nodes.values():
            if n.level is level and n.refcount > 0:
                referenced += n.slots >= 0
        for s in rows.seqs.values():
            if level is D and s.state is SequenceState.ACTIVE:
                r = s._row
                referenced += np.count_nonzero(
                    rows.row_pages(r, len(s._nodes), rows.num_pages(r)), axis=1)
            elif s._parked is not None and s._parked[0] is level:
                referenced += np.count_nonzero(s._parked[1] >= 0, axis=1)
        return referenced

    def check(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent."""
        rows, tree, G = self._rows, self._tree, self._rows.num_groups
        win, full = rows.win, rows.full
        holders: dict[int, int] = {}
        needs: dict[int, np.ndarray] = {}
        for s in rows.seqs.values():
            r = s._row
            k = len(s._nodes)
            wr = rows.row_wrel(r)
            n_tok = rows.num_tokens(r)
            assert (wr >= rows.wrel_at(n_tok)).all(), (s, wr)  # more only after a truncation
            assert win is None or (wr <= win.needed_from(n_tok)).all(), (s, wr)
            for j, n in enumerate(s._nodes):
                holders[id(n)] = holders.get(id(n), 0) + 1
                needs[id(n)] = needs.get(id(n), 0) + (j >= wr)
                assert n.alive, f"{s!r} holds a dropped node"
            assert rows.ncommit[r] == k
            if s.state is SequenceState.ACTIVE:
                npages = rows.num_pages(r)
                want = np.zeros((G, npages), np.int32)
                if k:
                    want[:, :k] = np.maximum(node_slots(s._nodes), 0)
                    assert all(n.level is D for n in s._nodes)
                want[:, k:] = rows.row_pages(r, k, npages)
                for g in range(G):
                    want[g, :wr[g]] = 0
                assert np.array_equal(rows.row_pages(r, 0, npages), want), s
                if full:
                    full.check_row(r, want[full.ids])
                if win:
                    win.check_row(r, rows.num_tokens(r), npages, want[win.ids])
        for n in tree.nodes.values():
            assert n.refcount == holders.get(id(n), 0), f"{n!r} has {holders.get(id(n), 0)}"
            assert (id(n) in tree.lru[n.level]) == (n.refcount == 0)
            assert (n.need is None) == (win is None), n
        if win:
            win.check_nodes(tree, needs)
        cached = np.zeros((len(CacheLevel), G), np.int64)
        for lv in CacheLevel:
            for n in tree.lru[lv].values():
                assert n.level is lv and n.alive and n.key in tree.nodes
                cached[lv] += n.slots >= 0
        counted = np.stack([tree.cached_pages(lv) for lv in CacheLevel])
        assert np.array_equal(cached, counted), (cached, counted)
        for n in tree.nodes.values():
            assert n.whole == bool((n.slots >= 0).all()), n
        pending = np.zeros(G, np.int64)
        for entry in self._ledger.pending:
            pending += np.count_nonzero(entry.slots >= 0, axis=1)
        assert np.array_equal(pending, self._ledger.num_pending), (pending,
                                                                   self._ledger.num_pending)
        offloads = self._offloads()
        for rec in offloads:  # an offload in flight holds its device slots as pending
            assert any(e is rec.entry for e in self._ledger.pending) and rec.entry.fence is \
                rec.fence
        assert all(e.fence is None or any(r.entry is e for r in offloads)
                   for e in self._ledger.pending)
        for lv in self._planner.levels:
            self._check_level(lv)

    def _check_level(self, lv: CacheLevel) -> None:
        """Every page of ``lv`` is allocated exactly once; counts and ledger agree."""
        rows, st, G = self._rows, self._storage, self._rows.num_groups
        used: list[list[np.ndarray]] = [[] for _ in range(G)]
        for n in self._tree.nodes.values():
            if n.level is lv:
                for g in range(G):
                    used[g].append(n.slots[g:g + 1])
        for s in rows.seqs.values():
            for g in range(G):
                if lv is D and s.state is SequenceState.ACTIVE:
                    t = rows.row_pages(s._row, len(s._nodes), rows.num_pages(s._row))[g]
                    used[g].append(t[t != 0])
                elif s._parked is not None and s._parked[0] is lv:
                    used[g].append(s._parked[1][g])
        if lv is D:
            for entry in self._ledger.pending:
                for g in range(G):
                    used[g].append(entry.slots[g])
        pools = self._planner.pool_of(lv)
        counts = self.page_counts(lv)
        expect_bytes = 0
        for p, c in enumerate(counts):
            groups = np.flatnonzero(pools == p)
            parts = [x for g in groups for x in used[g]]
            allu = np.concatenate(parts) if parts else np.zeros(0, np.int32)
            allu = allu[allu >= 0]
            alloc = st.allocator(lv, int(groups[0]))
            assert np.unique(allu).size == allu.size, f"{lv.name} pool {p}: a page in two places"
            assert (allu != 0).all() if lv is D else True, "the null page is in use"
            assert all(alloc.is_allocated(int(x)) for x in allu), f"{lv.name}: not allocated"
            extra = 1 if lv is D else 0
            num_allocated = alloc.num_slots - alloc.num_free
            assert num_allocated == allu.size + extra, (
                f"{lv.name} pool {p}: {num_allocated - extra} allocated, {allu.size} known")
            assert c["free"] + c["pending"] + c["referenced"] + c["cached"] == c["capacity"], c
            if lv is not D:
                expect_bytes += (num_allocated - extra) * st.page_bytes(lv, int(groups[0]))
        if lv is D:
            expect_bytes = st.device_committed_bytes()
        # Governor ledger == recomputation from the allocators.
        u = st.governor.usage(lv)
        assert u.committed == expect_bytes and u.transient == 0 and u.reserved == 0, (
            lv, u, expect_bytes)
