"""The sliding-window group manager: bounded rings of pages per sequence (all window logic).

In a layer group with window ``W`` (tokens) and ``P`` tokens per page, the next query of a
sequence of ``L`` tokens sits at position ``L`` and sees positions ``[L + 1 - W, L]``: its first
``wrel = (L + 1 - W) // P`` pages are dead to it (:meth:`WindowGroups.wrel_at`). After every step
the manager releases them (:meth:`WindowGroups.advance`): a private page is freed behind the
fence of the step that last read it (never before that step completed); a committed page (a
prefix-tree node, maybe shared) loses this holder's *need*; at need 0 its page of that group
becomes cached in ``wlru`` (dropped under pressure, oldest first; the node's other groups stay
referenced).

**The ring.** A sequence therefore holds at most ``ceil((W + n - 2) / P) + 1`` pages of the group
during a step of ``n`` new tokens (the pages from the first one the step's first query sees to
the one its last token lands in). Its page-table row is a ring of ``R`` entries
(:func:`ring_width`): the page holding position ``p`` sits at entry ``(p // P) % R``, so the
row's width does not depend on ``max_seq_len``. ``R`` covers ``W`` plus the largest chunk a
sequence may add in one step (``KVCacheConfig.max_window_chunk``, default
``max_tokens_per_step``): ``R = ceil((W + C - 2) / P) + 1`` (``ceil((W - 1) / P) + 1`` for pure
decode, the design's ``ceil(W / P) + 1`` at most), capped at ``ceil(max_seq_len / P)``. The
attention ops read such a table with ``ring_table=True`` ("the page of position ``p`` of row
``b`` is ``page_table[b, (p // P) % page_table.shape[-1]]``"). With ``KVCacheConfig.ring_tables``
off the width is ``ceil(max_seq_len / P)`` and entry ``j`` is page ``j`` (an absolute table, the
same arithmetic with ``R = P``). Released entries read 0 (the null page); the ops never read
keys outside the window, so they are never dereferenced for data.

Why the ring never overwrites a live entry: the pages retained by a row during a step are
consecutive and at most ``R`` many, so they occupy distinct entries; a page is allocated at entry
``j % R`` only after page ``j - R`` left the window (released at the previous ``complete_step``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_kvcm._full_group import GroupTables
from jax_kvcm._prefix_tree import NO_PAGE, BlockNode, PrefixTree
from jax_kvcm._types import CacheLevel

__all__ = ["WindowGroups", "ring_width", "window_peak_pages"]

D = CacheLevel.DEVICE


def window_peak_pages(window: int, page_size: int, num_new_tokens: int) -> int:
    """Pages of a window group a sequence holds during a step of ``num_new_tokens`` new tokens
    (at most): ``ceil((W + n - 2) / P) + 1``."""
    return -(-(window + num_new_tokens - 2) // page_size) + 1


def ring_width(window: int, page_size: int, max_chunk: int, max_pages: int) -> int:
    """``R``: ring entries per sequence for window ``W`` when one step adds at most
    ``max_chunk`` tokens to a sequence (:func:`window_peak_pages`), at most ``max_pages``."""
    return min(max_pages, window_peak_pages(window, page_size, max_chunk))


class WindowGroups(GroupTables):
    """The sliding-window layer groups ``ids`` of a manager with ``num_groups`` layer groups.

    ``windows[k]``: the window of group ``ids[k]``; ``wrel[k, row]``: leading pages of the row
    released in that group; ``wlru[g]``: referenced device nodes whose page of group ``g`` no
    holder's window covers (need 0), oldest first."""

    kind = "window"

    def __init__(self, ids: list[int], windows: list[int], page_size: int, max_pages: int,
                 max_chunk: int, ring: bool, num_groups: int, slack: int = 0) -> None:
        widths = [ring_width(w, page_size, max_chunk, max_pages) if ring else max_pages
                  for w in windows]
        super().__init__(ids, widths)
        self.tpp = page_size
        self.max_chunk = max_chunk
        self.windows = np.asarray(windows, np.int64)
        self.window_of = np.zeros(num_groups, np.int64)  # [G]: 0 for other kinds
        self.window_of[self.ids] = self.windows
        self.num_groups = num_groups
        self.slack = slack  # tokens kept beyond each window (KVCacheConfig.rollback_tokens)
        self._one_holder = [int(w > 0) for w in self.window_of]
        self.wrel = np.zeros((len(ids), 0), np.int64)
        # NOTE: wlru[g]: referenced device nodes whose page of group g no holder's window covers
        # (need[g] == 0): cached like an unreferenced node's pages, but only that one page.
        self.wlru: dict[int, OrderedDict[int, BlockNode]] = {int(g): OrderedDict()
                                                             for g in self.ids}
        self.num_released = 0

    # -- rows ------------------------------------------------------------------------------------

    def grow(self, num_rows: int) -> None:
        super().grow(num_rows)
        wrel = np.zeros((len(self), num_rows), np.int64)
        wrel[:, :self.wrel.shape[1]] = self.wrel
        self.wrel = wrel

    def clear_row(self, row: int) -> None:
        super().clear_row(row)
        self.wrel[:, row] = 0

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        super().move_rows(src, dst)
        self.wrel[:, dst] = self.wrel[:, src]

    def wrel_at(self, num_tokens: int | np.ndarray) -> np.ndarray:
        """``[G]``: leading dead pages of a sequence of ``num_tokens`` tokens (0 outside
        window groups)."""
        return np.where(self.window_of > 0,
                        np.maximum(0, (num_tokens + 1 - self.window_of) // self.tpp), 0)

    def needed_from(self, num_tokens: int) -> np.ndarray:
        """``[G]``: the first page a sequence of ``num_tokens`` tokens attends to (its window
        without the rollback slack; 0 outside window groups)."""
        return np.where(self.window_of > 0, np.maximum(
            0, (num_tokens + 1 - self.window_of + self.slack) // self.tpp), 0)

    def row_wrel(self, row: int) -> np.ndarray:
        """``[G]``: the pages released so far by ``row`` (0 outside window groups)."""
        out = np.zeros(self.num_groups, np.int64)
        out[self.ids] = self.wrel[:, row]
        return out

    def view(self, rows: np.ndarray, j: np.ndarray) -> np.ndarray:
        return np.where(j[None] >= self.wrel[:, rows], self.slots(rows, j), 0)

    def write_row(self, row: int, slots: np.ndarray, num_tokens: int,
                  released: np.ndarray | None = None) -> None:
        """The row of a sequence of ``num_tokens`` tokens whose pages are ``slots [K, n]``
        (``NO_PAGE`` / 0: none): only the pages its windows still cover are entered.
        ``released`` (``[G]``): pages the row already released stay released (a truncation)."""
        super().clear_row(row)
        wr = self.wrel_at(num_tokens)[self.ids]
        if released is not None:
            wr = np.maximum(wr, released[self.ids])
        self.wrel[:, row] = wr
        n = slots.shape[1]
        for k in range(len(self)):
            j = np.arange(int(wr[k]), n)
            self.table[k, row, j % self.widths[k]] = np.maximum(slots[k, j], 0)

    def check_chunks(self, counts: np.ndarray) -> None:
        """Misuse: a sequence adds more tokens in one step than its ring was sized for."""
        if counts.max() > self.max_chunk:
            raise ValueError(f"a work item adds {int(counts.max())} tokens, more than "
                             f"max_window_chunk {self.max_chunk} (the window groups' rings hold "
                             "that many new tokens per sequence per step): split the chunk")

    def peak_pages(self, seq_len: int, max_tokens: int) -> np.ndarray:
        """``[K]``: pages one sequence of ``seq_len`` tokens may hold at once in each group."""
        n = min(seq_len, max_tokens, self.max_chunk)
        pages = -(-seq_len // self.tpp)
        return np.minimum(pages, -(-(self.windows + n - 2) // self.tpp) + 1)

    # -- holders of committed pages ------------------------------------------------------------

    def new_node(self, node: BlockNode) -> None:
        """A node just committed by one holder, whose windows cover it."""
        node.need = self._one_holder.copy()

    def take(self, node: BlockNode, j: int, wr: np.ndarray) -> None:
        """Window bookkeeping of a new holder of ``node`` (already incref'd) at depth ``j`` whose
        windows start at pages ``wr [G]``."""
        need = node.need
        if need is None:
            return
        fresh = node.refcount == 1  # was cached: its pages no one needs become wlru entries
        for g in self.ids.tolist():
            if j >= wr[g]:
                if need[g] == 0 and not fresh:
                    self.wlru[g].pop(id(node), None)
                need[g] += 1
            elif fresh and node.level is D and node.slots[g] >= 0:
                self.wlru[g][id(node)] = node

    def drop_hold(self, tree: PrefixTree, node: BlockNode, j: int, wr: np.ndarray) -> None:
        """A holder at depth ``j`` (windows from pages ``wr``) lets go of ``node`` (decref'd
        here)."""
        need = node.need
        if need is not None:
            for g in self.ids.tolist():
                if j >= wr[g]:
                    need[g] -= 1
        tree.decref(node)
        if need is None:
            return
        for g in self.ids.tolist():
            if node.refcount == 0:  # cached as a whole now
                self.wlru[g].pop(id(node), None)
            elif need[g] == 0 and node.slots[g] >= 0 and node.level is D:
                self.wlru[g][id(node)] = node

    def adopt(self, tree: PrefixTree, node: BlockNode, ours: np.ndarray) -> None:
        """A holder adopts a duplicate ``node``: where the node lost its window page, it takes
        ours (``ours[g]`` becomes ``NO_PAGE``, not to be freed)."""
        for g in self.ids.tolist():
            if node.slots[g] < 0:
                tree.set_page(node, g, ours[g])
                ours[g] = NO_PAGE

    def usable_prefix(self, nodes: list[BlockNode]) -> list[BlockNode]:
        """The longest prefix of matched nodes whose pages a new holder's windows need are all
        there (a node may have lost a window page no earlier holder needed)."""
        k = len(nodes)
        ids = self.ids.tolist()
        while k:
            wr = self.wrel_at(k * self.tpp)
            if all(nodes[j].slots[g] >= 0 for g in ids for j in range(wr[g], k)):
                break
            k -= 1
        return nodes[:k]

    def kept(self, nodes: list[BlockNode], wr: np.ndarray, out: np.ndarray) -> None:
        """Adds to ``out [G]`` the cached device pages of window groups among ``nodes`` that a new
        holder with windows from ``wr`` would take (and so no eviction could free)."""
        for j, n in enumerate(nodes):
            if n.level is not D:
                continue
            for g in self.ids.tolist():
                if n.refcount == 0:
                    out[g] += j >= wr[g] and n.slots[g] >= 0
                else:
                    out[g] += j >= wr[g] and id(n) in self.wlru[g]

    def wanted(self, nodes: list[BlockNode], lower: list[int], slots: np.ndarray,
               wr: np.ndarray, wanted: np.ndarray) -> None:
        """Narrows ``wanted [G, len(lower)]`` (pages of lower-tier nodes to onboard) to the window
        pages this holder's windows need, or another holder's (a suspended one)."""
        cover = np.asarray(lower)[None, :] >= wr[self.ids][:, None]
        for i, j in enumerate(lower):
            need = nodes[j].need
            if need is not None:
                cover[:, i] |= np.asarray(need)[self.ids] > 0
        wanted[self.ids] &= cover

    def unneeded(self, own: list[BlockNode], own_slots: np.ndarray) -> np.ndarray:
        """``own_slots [G, n]`` without the window pages no holder needs (suspend drops them)."""
        unneeded = np.stack([np.asarray(n.need) == 0 for n in own], axis=1)
        unneeded[self.window_of == 0] = False
        return np.where(unneeded, NO_PAGE, own_slots)

    def forget(self, node: BlockNode) -> np.ndarray | None:
        """The node leaves the device: its wlru pages (``[G, n]`` slots to free) or None."""
        out = None
        for g in self.ids.tolist():
            if self.wlru[g].pop(id(node), None) is not None:
                slots = np.full((self.num_groups, 1), NO_PAGE, np.int32)
                slots[g, 0] = node.slots[g]
                out = slots if out is None else np.concatenate([out, slots], axis=1)
        return out

    # -- room and release ----------------------------------------------------------------------

    def num_unneeded(self) -> np.ndarray:
        """``[G]``: referenced nodes' device pages no window needs (evictable)."""
        out = np.zeros(self.num_groups, np.int64)
        for g, lru in self.wlru.items():
            out[g] = len(lru)
        return out

    def drop_unneeded(self, tree: PrefixTree, short: np.ndarray,
                      lack: np.ndarray) -> np.ndarray | None:
        """Frees up to ``lack[g]`` of the oldest wlru pages of the first group ``g`` with
        ``short[g]`` that has any (their nodes keep the others): the slots ``[G, n]`` to free,
        or None when there is none."""
        for g in self.ids.tolist():
            wlru = self.wlru[g]
            if not (short[g] and wlru):
                continue
            out = []
            while wlru and len(out) < lack[g]:
                _, node = wlru.popitem(last=False)
                out.append(node.slots[g])
                tree.set_page(node, g, NO_PAGE)
            slots = np.full((self.num_groups, len(out)), NO_PAGE, np.int32)
            slots[g] = out
            return slots
        return None

    def advance(self, seqs: list[Any], rows: np.ndarray, length: np.ndarray,
                ncommit: np.ndarray, defer_free: Callable[[np.ndarray, np.ndarray], None],
                owners: np.ndarray) -> None:
        """Releases the pages the step's sequences' windows left (after the commit, so a
        committed page is released as a node page). ``length``, ``ncommit``, ``owners``: per
        manager row; ``defer_free(slots [G, n], owner ids [n])`` frees behind the step's
        fence."""
        tpp = self.tpp
        length = length[rows]
        for k, g in enumerate(self.ids.tolist()):
            new = np.maximum(0, (length + 1 - self.windows[k]) // tpp)
            old = self.wrel[k, rows]
            idx = np.flatnonzero(new > old)
            if idx.size == 0:
                continue
            cnt = new[idx] - old[idx]
            which = np.repeat(idx, cnt)
            rep = rows[which]
            j = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt) + old[which]
            e = j % self.widths[k]
            private = j >= ncommit[rep]
            slots = np.full((self.num_groups, int(private.sum())), NO_PAGE, np.int32)
            slots[g] = self.table[k, rep[private], e[private]]
            defer_free(slots, owners[rep[private]])
            wlru = self.wlru[g]
            shared = ~private
            for i, jj in zip(which[shared].tolist(), j[shared].tolist()):  # once per node page
                node = seqs[i]._nodes[jj]
                need = node.need
                need[g] -= 1
                if need[g] == 0:
                    wlru[id(node)] = node
            self.table[k, rep, e] = 0
            self.wrel[k, rows[idx]] = new[idx]
            self.num_released += j.size

    # -- invariants (tests) ----------------------------------------------------------------------

    def check_row(self, row: int, num_tokens: int, num_pages: int, want: np.ndarray) -> None:
        """Invariants of an ACTIVE row: ``want [K, num_pages]`` its pages (0 where released)."""
        wr = self.wrel[:, row]
        # NOTE: more than wrel_at only after a truncation, never into the window itself
        assert (wr >= self.wrel_at(num_tokens)[self.ids]).all(), (row, wr)
        assert (wr <= self.needed_from(num_tokens)[self.ids]).all(), (row, wr)
        for k in range(len(self)):
            # NOTE: the bound on what a windowed sequence holds, and the ring.
            held = num_pages - wr[k]
            assert held <= -(-(self.windows[k] - 1) // self.tpp) + 1, (row, k, held)
            assert held <= self.widths[k], (row, k, held, self.widths[k])
            assert (want[k, wr[k]:] > 0).all(), (row, k, want[k])
            assert not want[k, :wr[k]].any(), (row, k, want[k])
            ring = np.zeros(self.width, np.int32)
            j = np.arange(wr[k], num_pages)
            ring[j % self.widths[k]] = want[k, j]
            assert np.array_equal(self.table[k, row], ring), (row, k, self.table[k, row], ring)

    def check_nodes(self, tree: PrefixTree, needs: dict[int, np.ndarray]) -> None:
        """``needs[id(node)]``: holders per group whose windows cover the node."""
        for n in tree.nodes.values():
            need = needs.get(id(n), np.zeros(self.num_groups, np.int64))
            for g in self.ids.tolist():
                assert n.need[g] == need[g], (n, g, n.need, need)
                assert n.need[g] == 0 or n.slots[g] >= 0, (n, "a needed window page is gone")
                unneeded = n.refcount > 0 and n.need[g] == 0 and n.slots[g] >= 0
                assert (id(n) in self.wlru[g]) == (unneeded and n.level is D), (n, g)
                assert not unneeded or n.level is D, (n, "an unneeded page moved off the device")
        for lru in self.wlru.values():
            for n in lru.values():
                assert n.alive and n.key in tree.nodes
