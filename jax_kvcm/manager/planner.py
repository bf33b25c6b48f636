"""The tier planner: room on every tier, eviction down the tiers, and moves as transactions.

Plan, then act. Every allocation first checks that it fits once every cached page at that tier is
evicted and every pending free reclaimed (:meth:`TierPlanner.room`); only then does it evict. So a
refusal (``OutOfPagesError``, ``MUST_RECOMPUTE``, ``resume`` -> False, a prefix hit left on a
lower tier) changes nothing, not even where cached pages are. Moves that belong together (a
suspend, a resume, an onboarding: several tiers, layer groups and disk chunks) are one storage
transaction (``StorageManager.migrate_many``): all of it happens or none of it.

Eviction moves the least recently used cached pages one tier down (device -> host -> disk), else
drops them (and their subtree: nothing below a dropped node is reachable). A disk tier whose
writes keep failing is *degraded* (:meth:`TierPlanner.disk_write_failed`). The device room of an
arena group is planned by :class:`~jax_kvcm.manager.arena_room.ArenaRoom` (its pages live at
fixed slots of ranges); this class plans the paged groups' and every cold tier's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_kvcm._disk_tier import CorruptPageError, DiskIOError, UnreadablePageError
from jax_kvcm._prefix_tree import NO_PAGE, BlockNode, PrefixTree
from jax_kvcm._types import CacheLevel
from jax_kvcm.manager.api import ManagerEvent
from jax_kvcm.manager.ledger import StepLedger
from jax_kvcm.manager.observers import Stats
from jax_kvcm.manager.rows import RowTable

__all__ = ["DISK_DEGRADED_AFTER", "TierPlanner", "node_slots"]

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
DISK_DEGRADED_AFTER = 3  # consecutive failed disk writes after which the disk tier takes no more


def hit_by(error: CorruptPageError, nodes: list[BlockNode]) -> list[BlockNode]:
    """The nodes of ``nodes`` whose page ``error`` names (at its level, in its layer group)."""
    bad, level = set(error.slots.tolist()), H if error.level == "HOST" else K
    return [n for n in nodes if n.alive and n.level is level
            and int(n.slots[error.layer_group]) in bad]


def node_slots(nodes: list[BlockNode]) -> np.ndarray:
    """``[G, n]`` slots of ``nodes`` (their current level)."""
    if not nodes:
        return np.zeros((0, 0), np.int32)
    return np.stack([n.slots for n in nodes], axis=1)


class TierPlanner:
    """See the module docstring. ``arena_room``: the arena groups' device planner (None
    without arena groups); ``settle(block, nodes)``: settles write-back-ahead copies (set by
    the manager; a no-op without write-back ahead)."""

    def __init__(self, storage: Any, tree: PrefixTree, rows: RowTable, ledger: StepLedger,
                 stats: Stats, emit: Callable[[Any], None]) -> None:
        self._storage = storage
        self._tree = tree
        self._rows = rows
        self._ledger = ledger
        self._stats = stats
        self._emit = emit
        self._G = rows.num_groups
        layout = storage.layout
        self.levels = list(layout.levels)
        # Pool of each layer group per level (cold layer groups with equal page sizes share one).
        self._pool_of = {lv: layout.pool_of(lv) for lv in self.levels}
        self._page_bytes = {lv: layout.page_bytes(lv) for lv in self.levels}
        self._disk_failures = 0       # consecutive failed disk writes
        self.disk_degraded = False    # no more writes to the disk tier (disk_write_failed)
        self.disk_chunk = 1 << 30     # pages per disk hop (a third of the staging ring)
        if storage.staging_capacity:
            self.disk_chunk = max(1, storage.staging_capacity // (3 * max(storage.cold_page_bytes)))
        self.settle: Callable[[bool, list[BlockNode] | None], None] = lambda block, nodes: None
        self.settling = lambda: False  # whether write-back-ahead copies are outstanding
        self.arena_room: Any = None

    # -- counts per pool -------------------------------------------------------------------------

    def pool_of(self, level: CacheLevel) -> np.ndarray:
        return self._pool_of[level]

    def page_bytes(self, level: CacheLevel) -> np.ndarray:
        return self._page_bytes[level]

    def num_free(self, level: CacheLevel) -> int:
        return min(self._storage.num_free(level, g) for g in range(self._G))

    def per_pool(self, level: CacheLevel, per_group: np.ndarray) -> np.ndarray:
        return np.bincount(self._pool_of[level], weights=per_group).astype(np.int64)

    def pool_free(self, level: CacheLevel) -> np.ndarray:
        pools = self._pool_of[level]
        free = np.zeros(int(pools.max()) + 1, np.int64)
        for g in range(self._G):
            free[pools[g]] = self._storage.num_free(level, g)
        return free

    def fits(self, level: CacheLevel, need: np.ndarray) -> bool:
        """Whether ``need[g]`` pages of every layer group can be allocated at ``level`` now."""
        if (self.pool_free(level) < self.per_pool(level, need)).any():
            return False
        return self._storage.governor.available(level) >= int(need @ self._page_bytes[level])

    def reclaimable(self, level: CacheLevel) -> np.ndarray:
        """Pages per layer group that eviction (cached pages) and waiting (pending device frees)
        can add to the free ones at ``level``."""
        out = self._tree.cached_pages(level)
        if level is D:
            out += self._ledger.num_pending
            if self._rows.win:
                out += self._rows.win.num_unneeded()
        return out

    def room(self, level: CacheLevel, need: np.ndarray, keep: np.ndarray | None = None) -> bool:
        """Whether ``need`` fits at ``level`` once every cached page there (but ``keep[g]`` of
        them, which the caller is about to take) is evicted and every pending free is
        reclaimed: the plan made before anything is evicted."""
        extra = self.reclaimable(level)
        if keep is not None:
            extra = extra - keep
        if (self.pool_free(level) + self.per_pool(level, extra)
                < self.per_pool(level, need)).any():
            return False
        return (self._storage.governor.available(level) + int(extra @ self._page_bytes[level])
                >= int(need @ self._page_bytes[level]))

    def obtainable(self, level: CacheLevel) -> int:
        """Free + pending + cached pages in the tightest pool of ``level``."""
        extra = self.per_pool(level, self.reclaimable(level))
        return int((self.pool_free(level) + extra).min())

    # -- reclaim and eviction --------------------------------------------------------------------

    def reclaim(self, block: bool = False) -> int:
        """Returns ready pending frees to the allocator (settling write-back-ahead copies
        first); the number of pages returned."""
        if not self._ledger.pending:
            return 0
        if self.settling():
            self.settle(block, None)
        return self._ledger.reclaim(block)

    def evict_some(self, level: CacheLevel, need: np.ndarray, *,
                   count_pending: bool = True) -> bool:
        """Evicts cached pages at ``level`` toward ``need`` (those of layer groups whose pools
        lack pages that pending frees will not bring back, or with ``count_pending=False`` lack
        them now; least recently used first; window pages of referenced nodes before whole
        nodes); False when there is nothing to evict."""
        lack = self.per_pool(level, need) - self.pool_free(level)
        if level is D and count_pending:
            lack -= self.per_pool(D, self._ledger.num_pending)
        pools = self._pool_of[level]
        short = lack[pools] > 0
        if level is D and self._rows.win and self.drop_window_pages(short, lack[pools]):
            return True
        victims = self._tree.lru_nodes(level, max(1, int(lack.max())),
                                       short if short.any() else None)  # else bytes are short
        if not victims:
            return False
        if level is D:
            self._ledger.need_pools("eviction")
        self.evict(victims, level)
        return True

    def drop_window_pages(self, short: np.ndarray | int, lack: np.ndarray | int) -> bool:
        """Frees unneeded window pages (wlru) of the first layer group in ``short`` (a ``[G]``
        mask, or one group id) that has any, up to ``lack`` of them; False when none."""
        if isinstance(short, int):
            short = np.arange(self._G) == short
        lack = np.broadcast_to(np.asarray(lack, np.int64), (self._G,))
        slots = self._rows.win.drop_unneeded(self._tree, short, lack)
        if slots is None:
            return False
        self._ledger.defer_free(slots)
        self._stats.num_dropped_pages += slots.shape[1]
        return True

    def drop(self, node: BlockNode) -> None:
        """Drops a cached node and its subtree from the tree and frees their pages."""
        removed = self._tree.remove_subtree(node)
        dev = [n.slots for n in removed if n.level is D]
        if dev:
            self._ledger.defer_free(np.stack(dev, axis=1))
        for lv in (H, K):
            cold = [n.slots for n in removed if n.level is lv]
            if cold:
                s = np.stack(cold, axis=1)
                for g in range(self._G):
                    self._storage.free(lv, g, s[g][s[g] >= 0])
        self._stats.num_dropped_pages += len(removed)
        self._emit(ManagerEvent("dropped", len(removed)))

    def make_room_cold(self, level: CacheLevel, need: np.ndarray) -> bool:
        """Frees room for ``need[g]`` pages at a cold level by moving its cached pages down (or
        dropping them). True when they fit afterwards; False (nothing evicted) when even
        evicting every cached page there would not make them fit."""
        if self.fits(level, need):
            return True
        if not self.room(level, need):
            return False
        while not self.fits(level, need):
            if not self.evict_some(level, need):  # pragma: no cover - room() counted them
                raise RuntimeError(f"{level.name}: planned room not found")
        return True

    def evict(self, victims: list[BlockNode], level: CacheLevel) -> None:
        """Moves cached ``victims`` (at ``level``) one tier down, else drops them."""
        failures = self._stats.num_disk_write_errors
        for lower in self.levels:
            if lower <= level or not self.writable(lower):
                continue
            if self.make_room_cold(lower, np.count_nonzero(node_slots(victims) >= 0, axis=1)):
                if level is H and self.settling():  # NOTE: a failed copy rolls pages back
                    self.settle(True, victims)
                # cascades may have dropped some
                victims = [v for v in victims if v.alive and v.level is level]
                if self._migrate_readable(victims, lower):
                    self._stats.num_evicted_pages[lower] += len(victims)
                    self._emit(ManagerEvent("evicted", len(victims), lower))
                    return
        victims = [v for v in victims if v.alive and v.level is level]
        if self._stats.num_disk_write_errors > failures:
            self._stats.num_dropped_on_disk_error += len(victims)
        for v in victims:
            if v.alive:  # dropping one drops its subtree
                self.drop(v)

    # -- the device ------------------------------------------------------------------------------

    def plan_device(self, need: np.ndarray, at: dict[int, np.ndarray] | None = None,
                    evicted: set[int] | None = None, keep: np.ndarray | None = None) -> bool:
        """:meth:`reserve_device`'s plan alone (nothing changes); ``evicted``: arena slots
        whose cached pages the caller evicts first; ``keep``: as in :meth:`room`. Arena groups
        are planned by their slots (a free slot in a mapped chunk costs no budget), the others
        by free pages and governor bytes."""
        need = need.copy()
        arena = self.arena_room
        if arena is not None:
            need[arena.groups] = 0
            if not arena.plan(at or {}, evicted):
                return False
        return not need.any() or self.fits(D, need) or self.room(D, need, keep)

    def reserve_device(self, need: np.ndarray, at: dict[int, np.ndarray] | None = None) -> bool:
        """Makes ``need[g]`` device pages of every layer group allocatable (``at[g]``: the
        exact slots of an arena group); False, with nothing evicted or reclaimed, when even
        evicting every cached page would not do."""
        assert self._ledger.in_step is None, "device allocation needs the pools"
        need = need.copy()
        arena = self.arena_room
        if arena is not None:
            need[arena.groups] = 0
            if not arena.plan(at or {}):
                return False
        if need.any() and not self.fits(D, need) and not self.room(D, need):
            return False
        if arena is not None and not arena.make_room(at or {}):
            return False  # pragma: no cover - plan() counted it
        self.reclaim()
        pending = self._ledger.num_pending
        while not self.fits(D, need):
            # NOTE: pending frees that would cover ``need`` but wait for a step still running
            # (an overlapped loop prepares the next step while the device runs this one): waiting
            # would idle the device for the rest of the host's preparation, so cached pages are
            # evicted instead (to a cold tier when there is one); only with nothing cached does
            # the allocation wait. (H200, full seed run: the mixed steps' host time in step()
            # fell from 68 to 19 ms with this; results log, sessions 5 and 6.)
            if pending.any():
                if self.reclaim() > 0:
                    continue
                if (self.pool_free(D) + self.per_pool(D, pending)
                        >= self.per_pool(D, need)).all():
                    if not self.evict_some(D, need, count_pending=False):
                        self.reclaim(block=True)
                    continue
            if self.evict_some(D, need):
                self.reclaim()
            elif pending.any():
                self.reclaim(block=True)
            else:  # pragma: no cover - room() counted every page
                raise RuntimeError("device: planned room not found")
        return True

    def allocate_device(self, n: int, at: dict[int, np.ndarray] | None = None
                        ) -> np.ndarray | None:
        """``[G, n]`` device slots (arena groups: ``at[g]``), or None (nothing changed)."""
        if n == 0:
            return np.zeros((self._G, 0), np.int32)
        if not self.reserve_device(np.full(self._G, n, np.int64), at):
            return None
        out = []
        for g in range(self._G):
            s = self._storage.allocate(D, g, n, None if at is None else at.get(g))
            if s is None:  # pragma: no cover - reserve_device checked slots and bytes
                for gg, back in enumerate(out):
                    self._storage.free(D, gg, back)
                return None
            out.append(s)
        return np.stack(out)

    # -- moves -----------------------------------------------------------------------------------

    def move(self, parts: list[tuple[CacheLevel, np.ndarray, CacheLevel]],
             at: list[np.ndarray | None] | None = None, *,
             keep: bool = False) -> list[np.ndarray] | None:
        """``(src_level, slots [G, n], dst_level)`` moves (-1 entries stay) as one storage
        transaction; the destination ``[G, n]`` of each, or None when refused (no room, or a
        failed disk write: counted, see :meth:`disk_write_failed`). ``at[p]``: the device slots
        ``[G, n]`` part ``p`` must land in (arena groups; -1 elsewhere). ``keep``: copies (the
        sources stay allocated and unchanged). Nothing changed on refusal or failure (an
        exception: CorruptPageError for a source that cannot be read)."""
        moves, where = [], []
        for p, (src_level, src, dst_level) in enumerate(parts):
            chunk = 1 << 30
            if K in (src_level, dst_level) and src_level != dst_level:
                # NOTE: disk hops go through the staging ring; a lease larger than the ring
                # fails, so split them (the ring is at least 3 pages; a third of it per chunk).
                chunk = max(1, self.disk_chunk)
            place = None if at is None else at[p]
            for g in range(self._G):
                cols = np.flatnonzero(src[g] >= 0)
                for start in range(0, cols.size, chunk):
                    c = cols[start:start + chunk]
                    if place is not None and (place[g, c] >= 0).all() and c.size:
                        moves.append((g, src_level, src[g, c], dst_level, place[g, c]))
                    else:
                        moves.append((g, src_level, src[g, c], dst_level))
                    where.append((p, g, c))
        to_disk = any(m[3] is K for m in moves)
        try:
            out = (self._storage.copy_pages if keep else self._storage.migrate_many)(moves)
        except CorruptPageError as e:  # unreadable disk pages, unwritten host pages: a miss
            if isinstance(e, UnreadablePageError):
                self._stats.num_disk_read_errors += 1
            if e.level == "HOST":
                self._stats.num_unwritten_host_reads += 1
            raise
        except DiskIOError as e:  # a write failed (reads raise the above): a refusal
            if not to_disk:
                raise
            self.disk_write_failed(e)
            return None
        if out is None:
            return None
        if to_disk:
            self._disk_failures = 0
        res = [np.full(src.shape, NO_PAGE, np.int32) for _, src, _ in parts]
        for (p, g, c), dst in zip(where, out):
            res[p][g, c] = dst
        return res

    def disk_write_failed(self, error: DiskIOError) -> None:
        """A write to the disk tier failed (nothing changed: the transaction rolled back). The
        disk is a cache: the caller drops what it meant to write (or, suspending, moves on to
        ``MUST_RECOMPUTE``). After ``DISK_DEGRADED_AFTER`` consecutive failures the tier is
        *degraded*: nothing is written to it any more (its pages can still be read), a
        ``"disk_degraded"`` event is emitted and ``stats()["disk_degraded"]`` is True."""
        self._stats.num_disk_write_errors += 1
        self._disk_failures += 1
        if not self.disk_degraded and self._disk_failures >= DISK_DEGRADED_AFTER:
            self.disk_degraded = True
            self._emit(ManagerEvent("disk_degraded", 0, K))
            warnings.warn(f"KVCacheManager: {self._disk_failures} disk writes failed in a row "
                          f"(last: {error}); the disk tier takes no more pages", RuntimeWarning,
                          stacklevel=2)

    def writable(self, level: CacheLevel) -> bool:
        """Whether pages may move to ``level`` (not a degraded disk tier)."""
        return not (level is K and self.disk_degraded)

    def _migrate_readable(self, victims: list[BlockNode], dst: CacheLevel) -> bool:
        """:meth:`migrate_nodes` of cached victims, dropping those with host pages whose
        writing copy failed (CorruptPageError: lost, never served) and moving the rest."""
        while True:
            try:
                return self.migrate_nodes(victims, dst)
            except CorruptPageError as e:
                if e.level != "HOST":
                    raise
                for v in hit_by(e, victims):
                    if v.alive:  # dropping one drops its subtree
                        self.drop(v)
                victims = [v for v in victims if v.alive and v.level is H]

    def migrate_nodes(self, nodes: list[BlockNode], dst: CacheLevel) -> bool:
        """Moves nodes (all at one level) to ``dst``; False (nothing moved) when refused."""
        if not nodes:
            return True
        out = self.move([(nodes[0].level, node_slots(nodes), dst)])
        if out is None:
            return False
        for i, n in enumerate(nodes):
            self._tree.move(n, dst, out[0][:, i].copy())
        return True
