"""The committer: pages that became full enter the prefix tree under their block keys.

A page is committed once it is full and its token ids are known (given to ``prepare_step`` or
recorded late). Its key is :func:`~jax_kvcm._prefix_tree.block_key` of the parent's key, the
page's token ids and the sequence's salt (the one formula). A page another sequence committed
first under the same key (a duplicate) is adopted: the sequence takes the committed page and its
own copy is freed behind the step's fence. A collision (equal key, other tokens or parent) or a
window page released before it was committed ends the sequence's chain: the rest stays private.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jax_kvcm._prefix_tree import PrefixTree, block_key, token_bytes
from jax_kvcm._types import CacheLevel
from jax_kvcm.manager.api import ManagerEvent, Sequence, SequenceState
from jax_kvcm.manager.ledger import StepLedger
from jax_kvcm.manager.observers import Stats
from jax_kvcm.manager.rows import RowTable

__all__ = ["Committer"]

_D = CacheLevel.DEVICE


class Committer:
    """Commits full pages of a step's rows (see the module docstring). ``on_commit(node)``: the
    hot tier's note of where a committed page lives (None: nothing to tell)."""

    def __init__(self, rows: RowTable, tree: PrefixTree, ledger: StepLedger, stats: Stats,
                 emit: Callable[[Any], None],
                 on_commit: Callable[[Any], None] | None = None) -> None:
        self._rows = rows
        self._tree = tree
        self._ledger = ledger
        self._stats = stats
        self._emit = emit
        self._on_commit = on_commit

    def commit(self, seqs: list[Sequence], row_ids: np.ndarray) -> None:
        rows, tree, tpp = self._rows, self._tree, self._rows.tpp
        win = rows.win
        full = np.minimum(rows.length[row_ids], rows.known[row_ids]) // tpp
        ncommit = rows.ncommit[row_ids]
        todo = np.flatnonzero((full > ncommit) & rows.may_commit(row_ids))
        if todo.size == 0:
            return
        n0 = 0
        page_bytes = tpp * 4
        # NOTE: the new pages' slots of every row at once ([n, G], rows in todo order).
        cnt = full[todo] - ncommit[todo]
        starts = np.cumsum(cnt) - cnt
        j = np.arange(int(cnt.sum())) - np.repeat(starts - ncommit[todo], cnt)
        all_cols = rows.view(np.repeat(row_ids[todo], cnt), j).T.copy()
        gone_any = None
        if win:  # NOTE: rows whose window released a page before it was committed
            gone_any = (all_cols == 0).any(axis=1)
            if not gone_any.any():
                gone_any = None
        for i, start in zip(todo.tolist(), starts.tolist()):
            seq = seqs[i]
            if seq.state is not SequenceState.ACTIVE:
                continue
            r = seq._row
            nodes = seq._nodes
            parent = nodes[-1] if nodes else None
            pkey = parent.key if parent is not None else b""
            first, last = int(ncommit[i]), int(full[i])
            # NOTE: one bytes object for all new pages; the table column block for all groups.
            blob = token_bytes(rows.tokens(r, first * tpp, last * tpp))
            cols = all_cols[start:start + last - first]
            if gone_any is not None:  # a page released before it was committed ends the chain
                gone = np.flatnonzero(gone_any[start:start + last - first])
                if gone.size:
                    cols = cols[:gone[0]]
                    rows.stop_commits(r)
            for jj in range(cols.shape[0]):
                toks = blob[jj * page_bytes:(jj + 1) * page_bytes]
                key = block_key(pkey, toks, seq._salt, tree.hash_fn)
                node = tree.insert(key, parent, toks, _D, cols[jj])
                if node is not None:
                    if win:
                        win.new_node(node)  # this holder's windows
                    if self._on_commit is not None:
                        self._on_commit(node)
                    n0 += 1
                else:
                    node = tree.nodes[key]
                    if (node.parent is not parent or node.tokens != toks
                            or node.level is not _D):
                        # A collision (or a copy off the device): the page stays private and
                        # so does everything after it.
                        rows.stop_commits(r)
                        break
                    self._adopt(seq, node, cols[jj], first + jj)
                nodes.append(node)
                parent, pkey = node, key
            rows.set_ncommit(r, len(nodes))
        if n0:
            self._stats.num_committed_pages += n0
            self._emit(ManagerEvent("committed", n0, _D))

    def _adopt(self, seq: Sequence, node: Any, ours: np.ndarray, j: int) -> None:
        """A duplicate (another sequence computed the same page first): the sequence takes the
        committed page and frees its own once the step that wrote it completed; but where the
        node's window page was released, it takes ours instead."""
        rows, tree = self._rows, self._tree
        tree.incref(node)
        ours = ours.copy()
        if rows.win:
            rows.win.adopt(tree, node, ours)
            rows.win.take(node, j, rows.row_wrel(seq._row))
        rows.set_slots(np.array([seq._row]), np.array([j]), node.slots[:, None])
        self._ledger.defer_free(ours[:, None], seq.seq_id)
        self._stats.num_adopted_pages += 1
