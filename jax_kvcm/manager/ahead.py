"""Write-back ahead (``KVCacheConfig.offload_ahead_pages``).

After each step is handed back, when the device pages that are free or pending fall below that
reserve, the least recently used cached device pages move to the host tier with
``StorageManager.offload_ahead`` (on CUDA with the concat codec: copies on a side stream, off
XLA's compute stream), so that a later step's admissions find free pages instead of evicting
(and copying) first. The pages belong to the host tier at once (a prefix hit onboards them,
waiting for the copy first); their device slots go to the pending frees with the copy's fence,
so no slot is handed out before the copy read it. A copy that fails rolls back: its pages that
are still where the offload put them return to their device slots (never freed), their host
slots are freed. That happens when the failure is seen (:meth:`WriteBackAhead.settle`): before
an operation reads the pages, or when the pending frees are reclaimed.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jax_kvcm._prefix_tree import NO_PAGE, BlockNode, PrefixTree
from jax_kvcm._types import CacheLevel
from jax_kvcm.manager.api import ManagerEvent
from jax_kvcm.manager.ledger import PendingFree, StepLedger
from jax_kvcm.manager.observers import Stats
from jax_kvcm.manager.planner import TierPlanner, node_slots

__all__ = ["Offload", "WriteBackAhead"]

D, H = CacheLevel.DEVICE, CacheLevel.HOST


@dataclass(slots=True)
class Offload:
    """A write-back-ahead offload whose copy was not seen finished: ``nodes`` moved from device
    slots ``src [G, n]`` to host slots ``dst [G, n]`` (column i: nodes[i]); ``entry`` is the
    pending free of ``src``, held until ``fence`` is settled."""

    fence: Any
    nodes: list[BlockNode]
    src: np.ndarray
    dst: np.ndarray
    entry: PendingFree


class WriteBackAhead:
    """See the module docstring. ``reserve``: pages per pool to keep free or pending (0: off)."""

    def __init__(self, reserve: int, storage: Any, tree: PrefixTree, planner: TierPlanner,
                 ledger: StepLedger, stats: Stats, emit: Callable[[Any], None]) -> None:
        self._reserve = reserve
        self._storage = storage
        self._tree = tree
        self._planner = planner
        self._ledger = ledger
        self._stats = stats
        self._emit = emit
        self._G = tree.cached_pages(D).size
        self._offloads: list[Offload] = []
        self._offload_of: dict[int, Offload] = {}  # id(node) -> its offload in flight

    @property
    def offloads(self) -> list[Offload]:
        """The offloads whose copies were not seen finished."""
        return self._offloads

    def busy(self) -> bool:
        return bool(self._offloads)

    def after_step(self) -> None:
        """When fewer than ``reserve`` device pages of a pool are free or pending, moves that
        many least recently used cached pages to the host tier (making room there as eviction
        does); their device slots are freed once the copy's fence is settled. Does nothing when
        the host tier cannot take them."""
        want, planner = self._reserve, self._planner
        if not want or H not in planner.levels:
            return
        planner.reclaim()
        lack = want - (planner.pool_free(D) + planner.per_pool(D, self._ledger.num_pending))
        short = lack[planner.pool_of(D)] > 0
        if not short.any():
            return
        victims = self._tree.lru_nodes(D, int(lack.max()), short)
        if not victims:
            return
        if not planner.make_room_cold(H, np.count_nonzero(node_slots(victims) >= 0, axis=1)):
            return
        victims = [v for v in victims if v.alive and v.level is D and v.refcount == 0]
        if not victims:
            return
        src = node_slots(victims)
        try:
            out = self._storage.offload_ahead([(g, src[g][src[g] >= 0])
                                               for g in range(self._G)])
        except Exception as e:  # noqa: BLE001 - nothing changed (the transaction rolled back)
            self._stats.num_offload_ahead_failures += 1
            warnings.warn(f"KVCacheManager: write-back ahead of {len(victims)} pages failed at "
                          f"submission ({e!r}); they stay on the device", RuntimeWarning,
                          stacklevel=3)
            return
        if out is None:
            return
        dsts, fence = out
        dst = np.full(src.shape, NO_PAGE, np.int32)
        for g in range(self._G):
            dst[g, src[g] >= 0] = dsts[g]
        for i, n in enumerate(victims):
            self._tree.move(n, H, dst[:, i].copy())
        entry = self._ledger.defer_free(src.copy(), None, fence)
        rec = Offload(fence, victims, src, dst, entry)
        self._offloads.append(rec)
        for n in victims:
            self._offload_of[id(n)] = rec
        self._stats.num_offloads_ahead += 1
        self._stats.num_offloaded_ahead_pages += len(victims)
        self._stats.num_evicted_pages[H] += len(victims)
        self._emit(ManagerEvent("evicted", len(victims), H))

    def settle(self, block: bool, nodes: list[BlockNode] | None = None) -> None:
        """Settles offloads (all, or those that moved ``nodes``): a finished copy lets its
        device slots be freed; a failed one is rolled back (:meth:`_failed`); with ``block``
        unfinished ones are waited for (counted in ``num_offload_ahead_waits``), else kept."""
        if nodes is None:
            recs = list(self._offloads)
        else:
            recs = list({id(r): r for n in nodes
                         if (r := self._offload_of.get(id(n))) is not None}.values())
        for rec in recs:
            if not rec.fence.is_ready():
                if not block:
                    continue
                self._stats.num_offload_ahead_waits += 1
                t = time.perf_counter()
                try:
                    rec.fence.wait()
                except Exception:  # noqa: BLE001, S110 - seen again just below
                    pass
                self._stats.offload_ahead_wait_seconds += time.perf_counter() - t
            try:
                rec.fence.wait()  # NOTE: ready: returns at once or raises the copy's failure
            except Exception as e:  # noqa: BLE001 - a failed copy is rolled back, not raised
                self._failed(rec, e)
            rec.entry.fence = None
            self._offloads.remove(rec)
            for n in rec.nodes:
                if self._offload_of.get(id(n)) is rec:
                    del self._offload_of[id(n)]

    def _failed(self, rec: Offload, error: Exception) -> None:
        """Rolls back a failed copy: each of its pages still where the offload put it (same
        node, on the host, same slots) returns to its device slots, which were never freed, and
        its host slots are freed; the rest (dropped or moved on since) keep their fate and
        their device slots are freed as pending frees."""
        restored = 0
        for i, n in enumerate(rec.nodes):
            if not (n.alive and n.level is H and np.array_equal(n.slots, rec.dst[:, i])):
                continue
            for g in np.flatnonzero(rec.dst[:, i] >= 0).tolist():
                self._storage.free(H, g, rec.dst[g:g + 1, i])
            self._tree.move(n, D, rec.src[:, i].copy())
            self._ledger.cancel_column(rec.entry, i)
            restored += 1
        self._stats.num_offload_ahead_failures += 1
        self._stats.num_offload_ahead_restored_pages += restored
        self._stats.num_evicted_pages[H] -= restored
        warnings.warn(f"KVCacheManager: a write-back-ahead copy of {len(rec.nodes)} pages to the "
                      f"host tier failed ({error!r}); {restored} pages stay on the device",
                      RuntimeWarning, stacklevel=3)
