"""Truncation: a sequence drops the K/V of its last tokens (speculative decoding's rejected drafts).

``truncate(seq, n)`` keeps the first ``n`` tokens of a sequence, between steps (a SUSPENDED one:
:meth:`Rewinder._truncate_parked`; an ACTIVE one as follows):

- pages past the new last page: private ones are freed once the last step that may have read
  them completed; committed ones are released (they stay cached: their K/V is right for their
  tokens, and other sequences may hold them);
- the page the cut falls in, when it is committed (full, in the prefix tree): the sequence will
  write its next tokens there, so it must own it. When only this sequence holds it and it lies
  where the hot tier keeps the sequence's own page (always on paged; ``base + j`` on an arena),
  it is un-committed in place: taken out of the prefix tree, with its cached descendants
  (unreachable without it) dropped. Otherwise it is copied to a private page and released: a
  page other sequences share is never written again;
- token ids known past ``n`` are forgotten; the sequence commits its pages again as they fill;
- sliding-window groups: refused (ValueError, nothing changed) when a window already released a
  page the shorter sequence attends to again; ``KVCacheConfig.rollback_tokens`` keeps that many
  tokens beyond each window, so cuts of up to that many are always served (pages released
  before the cut stay released).

Refusals are values (False, nothing changed): the private copy of a shared page finds no device
page (a SUSPENDED sequence's: no page at its parked level, or a disk that is degraded or fails
the write, counted as the planner counts disk write errors); on an arena, another sequence reads a
page at or past the cut where this sequence's range keeps it (page ``j`` at ``base + j``), so it
could not write there again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_kvcm._prefix_tree import BlockNode, PrefixTree
from jax_kvcm._types import CacheLevel
from jax_kvcm.manager.api import Sequence, SequenceState
from jax_kvcm.manager.ledger import StepLedger
from jax_kvcm.manager.observers import Stats
from jax_kvcm.manager.planner import TierPlanner
from jax_kvcm.manager.rows import RowTable

__all__ = ["Rewinder"]

D = CacheLevel.DEVICE


class Rewinder:
    """See the module docstring. ``drop_hold(node, j, wr)``: the lifecycle's release of page
    ``j``'s committed node (window groups keep their own holds); ``arena_room``: the arena
    groups' planner (or None)."""

    def __init__(self, storage: Any, tree: PrefixTree, rows: RowTable, ledger: StepLedger,
                 planner: TierPlanner, stats: Stats, drop_hold: Any,
                 arena_room: Any = None) -> None:
        self._storage = storage
        self._tree = tree
        self._rows = rows
        self._ledger = ledger
        self._planner = planner
        self._stats = stats
        self._drop_hold = drop_hold
        self._arena = arena_room

    def truncate(self, seq: Sequence, num_tokens: int) -> bool:
        rows, tpp = self._rows, self._rows.tpp
        r = seq._row
        old = rows.num_tokens(r)
        if not 0 <= num_tokens <= old:
            raise ValueError(f"num_tokens: {num_tokens} is outside [0, {old}] (the sequence's "
                             "tokens)")
        if num_tokens == old:  # only ids known past the end (a prompt not yet written) go
            rows.restore(r, rows.num_pages(r), old, min(rows.num_known(r), old))
            return True
        wr = rows.row_wrel(r)
        if rows.win is not None and (wr > rows.win.needed_from(num_tokens)).any():
            g = int(np.argmax(wr > rows.win.needed_from(num_tokens)))
            raise ValueError(f"num_tokens: {num_tokens} needs pages the sliding window of layer "
                             f"group {g} already released (it holds pages from "
                             f"{int(wr[g])}, tokens from {int(wr[g]) * tpp})")
        keep, whole = -(-num_tokens // tpp), num_tokens // tpp
        nodes = seq._nodes
        cut = whole if whole < keep and whole < len(nodes) else None
        if seq.state is SequenceState.SUSPENDED:
            return self._truncate_parked(seq, num_tokens, keep, whole, cut, wr, old)
        in_place = cut is not None and self._own_in_place(seq, nodes[cut], cut)
        in_way: list[BlockNode] = []
        if self._arena is not None and cut is not None and not in_place \
                and not self._arena.bound(seq):  # the copy goes into the range it binds now
            if not self._arena.bind(seq, nodes[:whole]):
                return False
        if self._arena is not None and self._arena.bound(seq):
            found = self._arena.rewritable_from(seq, whole)
            if found is None:
                return False
            mine = {id(n) for n in nodes[whole:]}
            if any(n.refcount > (id(n) in mine) for n in found):
                return False  # another sequence reads a page where this one writes again
            in_way = [n for n in found if not (in_place and n is nodes[cut])]
            self._evict([n for n in in_way if n.refcount == 0], nodes)  # plain cache first
        copy_to = None
        if cut is not None and not in_place:
            at = None if self._arena is None else self._arena.place(seq, np.array([cut]))
            copy_to = self._planner.allocate_device(1, at)
            if copy_to is None:
                return False
        old_pages = rows.num_pages(r)
        table = rows.row_pages(r, 0, old_pages)
        private_from = len(nodes)
        self._release(seq, whole, wr)
        if cut is not None:
            table[:, cut] = self._take_cut(nodes[cut], copy_to)
        self._shorten(seq, whole, keep, num_tokens, old)
        self._evict([n for n in in_way if n.refcount == 0], nodes)  # its own, released
        # private pages past the new last one (their content may be read by no later step)
        gone = table[:, max(keep, private_from):old_pages]
        self._ledger.defer_free(np.where(gone > 0, gone, -1).astype(np.int32), seq.seq_id)
        rows.write_row(seq, np.where(table[:, :keep] > 0, table[:, :keep], -1), wr)
        return True

    def _truncate_parked(self, seq: Sequence, num_tokens: int, keep: int, whole: int,
                         cut: int | None, wr: np.ndarray, old: int) -> bool:
        """A SUSPENDED sequence: its parked pages (all at one cold level) past the cut are
        freed there; a committed cut page joins them when only this sequence holds it at that
        level, else a copy of it at that level does (from wherever it is: the device, host or
        disk; False, nothing changed, when that level has no room, is a degraded disk or the
        disk write fails; CorruptPageError, nothing changed, when the page cannot be read). Window groups: the cut was
        checked against their released pages (as for an ACTIVE one); the resume writes their
        rows with those pages still released."""
        nodes = seq._nodes
        level, parked = seq._parked
        copy: np.ndarray | None = None
        if cut is not None and (nodes[cut].refcount != 1 or nodes[cut].level is not level):
            node = nodes[cut]
            if not self._planner.writable(level):   # a degraded disk takes no more pages
                return False
            got = self._planner.move([(node.level, node.slots[:, None], level)], keep=True)
            if got is None:   # no room there, or the disk write failed (counted)
                return False
            copy = got[0][:, 0]
        first = len(nodes)                  # parked column i is page first + i
        self._release(seq, whole, wr)
        if cut is not None and copy is None:
            copy = self._uncommit(nodes[cut])
        columns = [] if copy is None else [copy[:, None]]
        kept = max(0, keep - first)
        gone = parked[:, kept:]
        for g in range(gone.shape[0]):
            self._storage.free(level, g, gone[g][gone[g] >= 0])
        seq._parked = (level, np.concatenate(columns + [parked[:, :kept]], axis=1))
        self._shorten(seq, whole, keep, num_tokens, old)
        return True

    def _evict(self, victims: list[BlockNode], chain: list[BlockNode]) -> None:
        """Arena: cached pages where the truncated sequence writes again, moved out of its way
        (down a tier, else dropped); ``chain``: the pages it keeps (never made room for)."""
        victims = [n for n in victims if n.alive and n.level is D]
        if victims:
            self._arena.evict_in_the_way(victims, chain)

    def _own_in_place(self, seq: Sequence, node: BlockNode, j: int) -> bool:
        """Whether the committed page ``j`` can become the sequence's private page as it is:
        only this sequence holds it, it is on the device, and (arena) it is at ``base + j``."""
        if node.refcount != 1 or node.level is not D:
            return False
        if self._arena is None:
            return True
        if not self._arena.bound(seq):
            return False
        place = self._arena.place(seq, np.array([j]))
        return all(int(node.slots[g]) == int(s[0]) for g, s in place.items())

    def _take_cut(self, node: BlockNode, copy_to: np.ndarray | None) -> np.ndarray:
        """The private page ``[G]`` that replaces committed ``node`` (already released by this
        holder): a copy, or the node's own page taken out of the prefix tree."""
        if copy_to is not None:
            for g in range(copy_to.shape[0]):
                if node.slots[g] >= 0:
                    self._storage.copy_device_pages(g, node.slots[g:g + 1], copy_to[g])
            return copy_to[:, 0]
        return self._uncommit(node)

    def _uncommit(self, node: BlockNode) -> np.ndarray:
        """Takes released ``node`` out of the prefix tree, its cached descendants dropped
        (unreachable without it); its page ``[G]`` (at its level) is the caller's now."""
        for child in list(node.children.values()):
            self._planner.drop(child)
        slots = node.slots.copy()
        self._tree.remove_subtree(node)
        return slots

    def _release(self, seq: Sequence, whole: int, wr: np.ndarray) -> None:
        """Gives back the sequence's holds on its committed pages past the whole ones."""
        for j in range(len(seq._nodes) - 1, whole - 1, -1):
            self._drop_hold(seq._nodes[j], j, wr)

    def _shorten(self, seq: Sequence, whole: int, keep: int, num_tokens: int, old: int) -> None:
        """The row of a sequence cut to ``num_tokens``: ``whole`` committed pages, ``keep`` in
        all, ids known past the cut forgotten."""
        r = seq._row
        del seq._nodes[whole:]
        self._rows.set_ncommit(r, len(seq._nodes))
        self._rows.restore(r, keep, num_tokens, min(self._rows.num_known(r), num_tokens))
        self._stats.num_truncated_tokens += old - num_tokens
