"""Storage manager: the device / host / disk tiers and every migration between them.

Owns the hot tiers (one K and one V pool per hot pool group, slot 0 the null page), the cold
pools (one :class:`HostPool` and one :class:`DiskPool` per cold pool group, holding codec-encoded
pages of a fixed size), the cold-page codec, the :class:`MemoryGovernor` and, when a disk tier
exists, the pinned :class:`StagingRing`.

Every migration is one transaction (docs/ARCHITECTURE.md §3):

1. reserve the destination bytes (and transient bytes) on the governor and allocate *all*
   destination slots before submitting anything;
2. order after the sources' and destinations' ready fences;
3. submit (encode / decode custom calls on XLA's stream, raw copies, disk I/O) and obtain one fence;
4. attach the fence to sources and destinations and notify observers;
5. release the source slots only after a successful submission.

A failure in steps 1-3 releases what the call allocated, leaves the source pages intact and
retryable, and returns the governor ledger, free counts and stats to their values before the call.
Allocation failure (budget or slots) is returned as ``None``; I/O failures and corrupt pages raise.
:meth:`StorageManager.migrate_many` runs several moves (layer groups, chunks, paths) as one such
transaction: all destinations first, all submissions, then all ownership transfers.

The device tier is a :mod:`hot tier <jax_kvcm.hot>` per hot pool group (paged pools, or an
arena's reservations): it owns the pools, their slots and their governor charges; a move into the
device takes a :class:`~jax_kvcm.hot.Grant` from it in step 1 (``at``: the exact slots, for an
arena). Tensor parallelism, write-back ahead on the side stream and the submission paths:
:mod:`jax_kvcm._transfers`.

Not thread-safe: the KV-cache manager serializes calls with one lock.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import _ffi
from jax_kvcm._codec import (ColdPageCodec, HotPoolGroupDesc, PageIndexLocation,
                             create_default_cold_page_codec)
from jax_kvcm._disk_tier import CorruptPageError, DiskPool, UnreadablePageError
from jax_kvcm._fence import AllFences, SideStreamFence, wait_quietly
from jax_kvcm._governor import MemoryGovernor
from jax_kvcm._host_tier import HostPool, allocate_host_buffer
from jax_kvcm._pool_ratios import split_cold_budget, weights_from_ratio
from jax_kvcm._slots import SlotAllocator
from jax_kvcm._staging_ring import StagingRing, staging_ring_capacity
from jax_kvcm._storage_config import (LayerGroupSpec, StorageConfig, StorageEvent, StorageStats,
                                      cold_grouping, validate_batching)
from jax_kvcm._page_io import PageIO
from jax_kvcm._transfers import TransferPaths
from jax_kvcm._types import (CacheLevel, LayerGroupLayout, PoolGroupIndex, PoolLayout,
                             check_count)
from jax_kvcm.hot import Grant, HotTier, LeaseGrant
from jax_kvcm.hot.paged import PagedTier, zero_pool

__all__ = [
    "CorruptPageError",
    "UnreadablePageError",
    "LayerGroupSpec",
    "SideStreamFence",
    "StorageConfig",
    "StorageEvent",
    "StorageManager",
]

_D = CacheLevel.DEVICE


class StorageManager(TransferPaths, PageIO):
    """See the module docstring. ``cold_page_codec`` is consumed whether construction succeeds or
    fails; with none, the default :class:`ConcatCodec` is created (and still configured and
    validated when no cold tier exists)."""

    def __init__(self, config: StorageConfig, cold_page_codec: ColdPageCodec | None = None, *,
                 device: jax.Device | jax.sharding.NamedSharding | None = None) -> None:
        # 1. Consume the codec at the call boundary, before anything can fail.
        if cold_page_codec is not None:
            if not isinstance(cold_page_codec, ColdPageCodec):
                raise TypeError("cold_page_codec must be a jax_kvcm ColdPageCodec, got "
                                f"{type(cold_page_codec).__name__}")
            cold_page_codec.consume()
        self._codec = cold_page_codec if cold_page_codec is not None else (
            create_default_cold_page_codec())
        if cold_page_codec is None:
            self._codec.consume()
        self._closed = False
        self._observers: list[Callable[[StorageEvent], None]] = []
        self._stats = StorageStats()
        self._fault_hook: Callable[[str], None] | None = None
        # NOTE: a test seam (tests/manager/faults.py): wraps the fence of each offload_ahead transaction.
        self._fence_hook: Callable[[Any], Any] | None = None
        self._ahead_fences: list[Any] = []  # off-stream fences not yet seen ready
        self._ahead_pools: list[tuple[int, ...]] | None = None  # pool pointers they read
        self._pending_host_indices: list[tuple[jax.Array, jax.Array]] = []
        self._jit_cache: dict[tuple, Callable] = {}
        self._copy_scratch: dict[int, jax.Array] = {}  # arena hot -> hot copies
        self.host_pools: list[HostPool] = []
        self._host_fences: list[np.ndarray] = []
        self.disk_pools: list[DiskPool] = []
        self._ring: StagingRing | None = None
        self._ring_buffer = None
        try:
            self._build(config, device)
        except BaseException:
            self.close()
            raise

    # -- construction ------------------------------------------------------------------------

    def _build(self, config: StorageConfig,
               device: jax.Device | jax.sharding.NamedSharding | None) -> None:
        specs = tuple(config.layer_groups)
        if not specs or not all(isinstance(s, LayerGroupSpec) for s in specs):
            raise ValueError("config.layer_groups must be a non-empty sequence of LayerGroupSpec")
        groups = config.hot_pool_groups
        if groups is None:
            groups = tuple((i,) for i in range(len(specs)))
        members = sorted(lg for g in groups for lg in g)
        if members != list(range(len(specs))):
            raise ValueError("config.hot_pool_groups must assign every layer group id "
                             f"0..{len(specs) - 1} to exactly one group, got {groups}")
        for g in groups:
            if not all(specs[lg].same_hot_layout(specs[g[0]]) for lg in g):
                raise ValueError(f"config.hot_pool_groups: layer groups {g} do not share one "
                                 "hot layout")
        if len(config.device_slots) != len(groups):
            raise ValueError(f"config.device_slots has {len(config.device_slots)} entries for "
                             f"{len(groups)} hot pool groups")
        self.specs = specs
        self.hot_groups = tuple(tuple(g) for g in groups)
        self.hot_group_of = [0] * len(specs)
        for h, g in enumerate(groups):
            for lg in g:
                self.hot_group_of[lg] = h
        device_slots = [check_count(n, f"config.device_slots[{h}]", minimum=1)
                        for h, n in enumerate(config.device_slots)]
        host_bytes = check_count(config.host_bytes, "config.host_bytes", minimum=0)
        disk_bytes = check_count(config.disk_bytes, "config.disk_bytes", minimum=0)
        if disk_bytes and not config.disk_dir:
            raise ValueError("config.disk_dir is required when config.disk_bytes > 0")
        if config.disk_dir and disk_bytes:
            if os.path.exists(config.disk_dir) and not os.path.isdir(config.disk_dir):
                raise ValueError(f"config.disk_dir {config.disk_dir!r} is not a directory")
            try:  # NOTE: created when missing (the disk tier is a cache; its file is unlinked)
                os.makedirs(config.disk_dir, exist_ok=True)
            except OSError as e:
                raise ValueError(f"config.disk_dir {config.disk_dir!r} cannot be created: "
                                 f"{e.strerror or e}") from e

        # 2. Hot storage (slot 0 of every group is the null page).
        self.device = device or jax.devices()[0]
        # NOTE: a NamedSharding (tensor parallelism) places every pool split as it says; index
        # buffers are then replicated over its mesh (a slot is the same slot on every shard).
        self._index_placement = (jax.sharding.NamedSharding(device.mesh,
                                                            jax.sharding.PartitionSpec())
                                 if isinstance(device, jax.sharding.NamedSharding) else self.device)
        # NOTE: with a mesh, the codec sees one shard's heads; a cold page is num_shards pieces.
        self._mesh, self._axis, self.num_shards = None, None, 1
        if isinstance(device, jax.sharding.NamedSharding):
            axis = tuple(device.spec) + (None,) * (5 - len(device.spec))
            if axis[3] is not None:
                self._mesh, self._axis = device.mesh, axis[3]
                self.num_shards = int(device.mesh.shape[self._axis])
        arenas = tuple(config.arenas) if config.arenas is not None else (None,) * len(groups)
        if len(arenas) != len(groups):
            raise ValueError(f"config.arenas has {len(arenas)} entries for {len(groups)} hot "
                             "pool groups")
        if any(a is not None for a in arenas) and self._mesh is not None:
            raise ValueError("config.arenas: an arena is one device's reservation (no mesh)")
        # NOTE: an arena group's slots are its reservation's (chunk 0 holds the null page).
        device_slots = [a.geometry.num_slots - 1 if a is not None else n
                        for a, n in zip(arenas, device_slots)]

        # 3-5. Configure the codec, query and validate every batching class.
        for g in self.hot_groups:
            if specs[g[0]].num_kv_heads % self.num_shards:
                raise ValueError(f"layer group {g[0]}: num_kv_heads {specs[g[0]].num_kv_heads} "
                                 f"is not divisible by the {self.num_shards} shards")
        descs = [HotPoolGroupDesc(index=h, layer_groups=g, num_layers=specs[g[0]].num_layers,
                                  num_slots=device_slots[h] + 1, page_size=specs[g[0]].page_size,
                                  num_kv_heads=specs[g[0]].num_kv_heads // self.num_shards,
                                  head_dim=specs[g[0]].head_dim, dtype=jnp.dtype(specs[g[0]].dtype),
                                  slot_major=arenas[h] is not None)
                 for h, g in enumerate(self.hot_groups)]
        if not self._codec.configure(descs):
            raise ValueError("the cold-page codec rejected the hot pool configuration")
        self.cold_page_bytes = []
        self.index_location = []
        self.batching_id = []
        for lg in range(len(specs)):
            nbytes = self._codec.cold_page_bytes(lg)
            if nbytes <= 0:
                raise ValueError(f"the codec reports no cold page size for layer group {lg}")
            loc = self._codec.page_index_location(lg)
            if loc == PageIndexLocation.BAD:
                raise ValueError(f"the codec reports a bad page-index location for layer group {lg}")
            self.cold_page_bytes.append(int(nbytes) * self.num_shards)
            self.index_location.append(PageIndexLocation(loc))
            self.batching_id.append(int(self._codec.batching_layer_group_id(lg)))
        validate_batching(self.batching_id, self.hot_group_of, self.cold_page_bytes,
                          self.index_location)
        self.cold_groups, self.cold_group_of, self.cold_slot_bytes, self.batching_id = (
            cold_grouping(config.cold_pool_groups, self.cold_page_bytes, self.batching_id))
        # The side-stream mover (offload_ahead): the concat codec's CUDA handler, one device.
        self.side_stream = (self._mesh is None and self._codec.supports_side_stream
                            and not isinstance(self.device, jax.sharding.NamedSharding)
                            and self.device.platform != "cpu" and _ffi._kvcm_cuda is not None
                            and hasattr(_ffi._kvcm_cuda, "ticket_create"))

        # 6. Cold tiers, sized by the pool ratios projected through slot counts.
        layouts = [LayerGroupLayout(lg, PoolGroupIndex(self.hot_group_of[lg]),
                                    specs[lg].hot_page_bytes,
                                    PoolGroupIndex(self.cold_group_of[lg]), self.cold_page_bytes[lg])
                   for lg in range(len(specs))]
        if config.pool_ratio is not None:
            if len(config.pool_ratio) != len(specs):
                raise ValueError(f"config.pool_ratio has {len(config.pool_ratio)} entries for "
                                 f"{len(specs)} layer groups")
            weights = weights_from_ratio(config.pool_ratio)
        else:  # the hot split implied by device_slots, shared evenly inside a hot group
            weights = weights_from_ratio([
                device_slots[self.hot_group_of[lg]] * specs[lg].hot_page_bytes
                / len(self.hot_groups[self.hot_group_of[lg]]) for lg in range(len(specs))])
        self.layouts = layouts
        device_limit = sum(a.geometry.budget_chunks * a.geometry.chunk_bytes if a is not None
                           else n * specs[g[0]].hot_page_bytes
                           for a, n, g in zip(arenas, device_slots, self.hot_groups))
        limits = {CacheLevel.DEVICE: device_limit}
        if host_bytes:
            split = split_cold_budget(CacheLevel.HOST, host_bytes, weights, layouts)
            self.host_pools = [HostPool(s.num_slots, s.slot_bytes, pinned=config.pinned_host)
                               for s in split]
            self._host_fences = [np.full(s.num_slots, None, object) for s in split]
            limits[CacheLevel.HOST] = sum(s.nbytes for s in split)
        if disk_bytes:
            split = split_cold_budget(CacheLevel.DISK, disk_bytes, weights, layouts)
            self.disk_pools = [DiskPool(config.disk_dir, f"jax_kvcm-{os.getpid()}-{id(self)}-{g}",
                                        s.num_slots, s.slot_bytes,
                                        io_threads=config.disk_io_threads)
                               for g, s in enumerate(split)]
            limits[CacheLevel.DISK] = sum(s.nbytes for s in split)
            capacity = staging_ring_capacity(max(self.cold_slot_bytes))
            self._ring_buffer = allocate_host_buffer(capacity, pinned=config.pinned_host)
            self._ring = StagingRing(capacity)
            # NOTE: the staging ring is pinned host memory: its bytes are charged (transient)
            # to the HOST level while a disk migration uses them.
            limits[CacheLevel.HOST] = limits.get(CacheLevel.HOST, 0) + capacity
        self.governor = MemoryGovernor(limits)
        self._build_hot_tiers(arenas, device_slots)
        self.layout = PoolLayout(tuple(layouts),
                                 tuple(lv for lv in CacheLevel if self.has_level(lv)),
                                 tuple(self.batching_id))

    def _build_hot_tiers(self, arenas: tuple[Any, ...], device_slots: list[int]) -> None:
        """One tier per kind: the paged groups' pools, then each arena (see :mod:`jax_kvcm.hot`)."""
        specs = self.specs

        def zero_pair(h: int) -> tuple[jax.Array, jax.Array]:
            s = specs[self.hot_groups[h][0]]
            shape = (s.num_layers, device_slots[h] + 1, s.page_size, s.num_kv_heads, s.head_dim)
            return zero_pool(shape, s.dtype, self.device), zero_pool(shape, s.dtype, self.device)

        self._tier_of: list[HotTier] = []
        self._tiers: list[HotTier] = []
        paged = {h: (device_slots[h], specs[g[0]].hot_page_bytes)
                 for h, g in enumerate(self.hot_groups) if arenas[h] is None}
        paged_tier = PagedTier(paged, self.governor, zero_pair) if paged else None
        if paged_tier is not None:
            self._tiers.append(paged_tier)
        for h, spec in enumerate(arenas):
            if spec is None:
                self._tier_of.append(paged_tier)
                continue
            from jax_kvcm.hot.arena.tier import ArenaTier
            s = specs[self.hot_groups[h][0]]
            tier = ArenaTier(h, spec, s, self.governor, self.device)
            self._tiers.append(tier)
            self._tier_of.append(tier)

    # -- public state ------------------------------------------------------------------------

    @property
    def codec(self) -> ColdPageCodec:
        return self._codec

    def has_level(self, level: CacheLevel) -> bool:
        level = CacheLevel(level)
        return (level is CacheLevel.DEVICE or (level is CacheLevel.HOST and bool(self.host_pools))
                or (level is CacheLevel.DISK and bool(self.disk_pools)))

    def page_bytes(self, level: CacheLevel, lg: int) -> int:
        return self.layouts[lg].page_bytes(level)

    def allocator(self, level: CacheLevel, lg: int) -> SlotAllocator | HostPool | DiskPool:
        """The slot allocator of ``lg``'s pool group at ``level`` (``allocate``, ``free``,
        ``num_free``, ``is_allocated``, ``all_allocated``); cold pools allocate their own slots."""
        level = CacheLevel(level)
        if level is CacheLevel.DEVICE:
            return self.hot_tier(lg).allocator(self.hot_group_of[lg])
        if not self.has_level(level):
            raise ValueError(f"there is no {level.name} tier")
        pools = self.host_pools if level is CacheLevel.HOST else self.disk_pools
        return pools[self.cold_group_of[lg]]

    def num_free(self, level: CacheLevel, lg: int) -> int:
        """Pages of ``lg``'s pool at ``level`` allocatable now (see :meth:`HotTier.num_free`)."""
        if CacheLevel(level) is _D:
            return self.hot_tier(lg).num_free(self.hot_group_of[lg])
        return self.allocator(level, lg).num_free

    @property
    def staging_capacity(self) -> int:
        """Bytes of the pinned staging ring (0 without a disk tier)."""
        return 0 if self._ring is None else self._ring.capacity

    def hot_tier(self, lg: int) -> HotTier:
        """The hot tier holding layer group ``lg``'s device pages."""
        return self._tier_of[self.hot_group_of[lg]]

    @property
    def pools(self) -> list[tuple[Any, Any]]:
        """The hot pools, one ``(k, v)`` per hot pool group (assigning an item, or the whole
        list, replaces them in their tiers)."""
        return _Pools(self, [t.pools(h) for h, t in enumerate(self._tier_of)])

    @pools.setter
    def pools(self, pools: Sequence[tuple[Any, Any]]) -> None:
        for h, pair in enumerate(pools):
            self.set_pools(h, (pair[0], pair[1]))

    def set_pools(self, h: int, pair: tuple[Any, Any]) -> None:
        self._tier_of[h].set_pools(h, pair)

    @property
    def device_allocators(self) -> list[Any]:
        """Slot bookkeeping of each hot pool group (``num_slots``, ``num_free``, ...)."""
        return [t.allocator(h) for h, t in enumerate(self._tier_of)]

    def device_committed_bytes(self) -> int:
        """Device bytes the hot tiers charge to the governor (== its committed DEVICE bytes)."""
        return sum(t.committed_bytes(h) for h, t in enumerate(self._tier_of))

    def add_observer(self, fn: Callable[[StorageEvent], None]) -> None:
        self._observers.append(fn)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self._stats)
        for level in CacheLevel:
            if self.has_level(level):
                u = self.governor.usage(level)
                out[level.name.lower()] = dict(limit=self.governor.limit(level), current=u.current,
                                               peak=u.peak)
        return out

    def rebuild_pools(self) -> bool:
        """New hot pools after a failed step consumed them (waits for side-stream copies first:
        they may still read the old ones). True when their content survived (every tier is an
        arena: its memory outlives its arrays), False when the device content is gone."""
        self._check_open()
        self.wait_side_stream()
        kept = [t.rebuild_pools() for t in self._tiers]
        return all(kept)

    # -- allocation of hot pages -------------------------------------------------------------

    def allocate(self, level: CacheLevel, lg: int, n: int,
                 at: np.ndarray | None = None) -> np.ndarray | None:
        """``n`` slots of ``lg`` at ``level`` under a committed governor charge, or ``None``.
        ``at``: the device slots to take (an arena's; ignored by paged pools)."""
        level = CacheLevel(level)
        grant = self._grant(level, lg, n, at)
        if grant is None:
            return None
        grant.commit()
        if self._observers:
            self._emit(StorageEvent("stored", lg, level, grant.slots))
        return grant.slots

    def _grant(self, level: CacheLevel, lg: int, n: int, at: np.ndarray | None) -> Any:
        """Step 1 of a transaction for one destination: a :class:`Grant` or None."""
        if level is _D:
            self._hook("reserve")
            return self.hot_tier(lg).allocate(self.hot_group_of[lg], n, at)
        lease = self._reserve(level, n * self.page_bytes(level, lg))
        if lease is None:
            return None
        slots = self.allocator(level, lg).allocate(n)
        if slots is None:
            lease.release()
            return None
        return LeaseGrant(slots, lease, self.allocator(level, lg))

    def free(self, level: CacheLevel, lg: int, slots: np.ndarray) -> None:
        """Returns slots (and their governor bytes); disk pages are invalidated."""
        level = CacheLevel(level)
        slots = np.asarray(slots, np.int32)
        if slots.size == 0:
            return
        if level is _D:
            self.hot_tier(lg).free(self.hot_group_of[lg], slots)
        else:
            self.allocator(level, lg).free(slots)  # NOTE: a freed disk slot drops its checksum
            self.governor.release_committed(level, slots.size * self.page_bytes(level, lg))
        if self._observers:
            self._emit(StorageEvent("removed", lg, level, slots))

    # -- migration ---------------------------------------------------------------------------

    def migrate(self, lg: int, src_level: CacheLevel, src_slots: np.ndarray,
                dst_level: CacheLevel) -> np.ndarray | None:
        """Moves pages of layer group ``lg`` from ``src_level`` to ``dst_level``; returns the
        destination slots (``dst[i]`` holds ``src_slots[i]``), or ``None`` when the destination
        cannot take them (nothing changed). The source slots are released on success."""
        out = self.migrate_many([(lg, src_level, src_slots, dst_level)])
        return None if out is None else out[0]

    def migrate_many(self, moves: Sequence[tuple[int, CacheLevel, np.ndarray, CacheLevel]]
                     ) -> list[np.ndarray] | None:
        """Several migrations ``(lg, src_level, src_slots [n], dst_level)`` as *one* transaction
        (a device destination may add a fifth item ``at [n]``: the slots to take, for an arena):
        every destination is reserved and allocated before anything is submitted; any refusal
        returns ``None`` and any failure (I/O error, corrupt page) raises, and then nothing
        changed (ledger, peaks, free counts, stats, events; the sources are intact). On success
        returns the destination slots of each move, in order, and releases every source."""
        out = self._migrate(moves, ahead=False)
        return None if out is None else out[0]

    def offload_ahead(self, moves: Sequence[tuple[int, np.ndarray]]
                      ) -> tuple[list[np.ndarray], Any] | None:
        """Device -> host moves ``(lg, src_slots [n])`` as one transaction, for write-back
        ahead (module docstring, "Offloads off the compute stream"): as :meth:`migrate_many`
        (None when the host tier cannot take them, a failure raises, and then nothing changed),
        but on success it returns ``(dst slots per move, fence)`` and does NOT release the
        device source slots: they stay allocated until the caller frees them (:meth:`free`)
        once ``fence.is_ready()``. The pages belong to the host slots from now on; the fence
        guards every access to them (it is their host fence). With :attr:`side_stream` the
        copies run on the side stream and ``fence`` is a :class:`SideStreamFence` (its
        ``wait`` raises when they failed: the host copy is then lost, the device source still
        holds the page); otherwise it is the encode's token."""
        return self._migrate([(lg, CacheLevel.DEVICE, src, CacheLevel.HOST) for lg, src in moves],
                             ahead=True)

    def _migrate(self, moves: Sequence[tuple[int, CacheLevel, np.ndarray, CacheLevel]], *,
                 ahead: bool, keep: bool = False) -> tuple[list[np.ndarray], Any] | None:
        """migrate_many (ahead=False; the fence is None), offload_ahead (ahead=True) or, with
        ``keep``, copy_pages (the sources stay; the destinations are "stored")."""
        self._check_open()
        plan = []
        for move in moves:
            lg, src_level, src_slots, dst_level = move[:4]
            at = move[4] if len(move) > 4 else None
            src_level, dst_level = CacheLevel(src_level), CacheLevel(dst_level)
            src = np.ascontiguousarray(src_slots, np.int32).reshape(-1)
            if not self.has_level(dst_level) or not self.has_level(src_level):
                raise ValueError(f"no {src_level.name} -> {dst_level.name} path in this "
                                 "configuration")
            if not 0 <= lg < len(self.specs):
                raise ValueError(f"layer group {lg} does not exist")
            if src.size and (np.unique(src).size != src.size
                             or not self.allocator(src_level, lg).all_allocated(src)):
                raise ValueError(f"src_slots {src.tolist()} are not distinct allocated "
                                 f"{src_level.name} slots of layer group {lg}")
            if at is not None and (dst_level is not _D or np.size(at) != src.size):
                raise ValueError(f"at: {np.size(at)} device slots for {src.size} pages moving "
                                 f"to {dst_level.name}")
            plan.append((lg, src_level, src, dst_level, at))
        by_pool: dict[tuple[int, int], list[np.ndarray]] = {}
        for lg, src_level, src, _, _ in plan:
            by_pool.setdefault((src_level, id(self.allocator(src_level, lg))), []).append(src)
        for (level, _), arrays in by_pool.items():
            if len(arrays) > 1:
                allsrc = np.concatenate(arrays)
                if np.unique(allsrc).size != allsrc.size:
                    raise ValueError(f"src_slots: a {CacheLevel(level).name} slot is moved twice")
        # 0. Host sources were written: a failed copy's pages are refused before anything moves.
        for lg, src_level, src, _, _ in plan:
            if src_level is CacheLevel.HOST and src.size:
                self._check_host_written(lg, src)
        # 1. Reserve and allocate every destination first.
        taken: list[Grant | None] = []

        def unwind() -> None:
            for grant in reversed(taken):
                if grant is not None:
                    grant.undo()

        for lg, _, src, dst_level, at in plan:
            if src.size == 0:
                taken.append(None)
                continue
            grant = self._grant(dst_level, lg, src.size,
                                None if at is None else np.asarray(at, np.int32))
            if grant is None:
                unwind()
                return None
            taken.append(grant)
        dsts = [np.zeros(0, np.int32) if g is None else g.slots for g in taken]
        # 2-3. Submit everything; staging charges are replayed only once all of it succeeded.
        staged: list[int] = []
        fences: list[Any] = []  # ahead: one per move
        try:
            for (lg, src_level, src, dst_level, _), dst in zip(plan, dsts):
                if src.size:
                    self._hook("offload_ahead" if ahead else "submit")
                    if ahead:
                        fences.append(self._submit_ahead(lg, src, dst))
                    else:
                        self._transfer(lg, src_level, src, dst_level, dst, staged)
        except BaseException:
            for f in fences:  # NOTE: copies already issued write the slots unwind frees
                wait_quietly(f)
            unwind()
            raise
        fence = None
        if ahead and fences:
            fence = fences[0] if len(fences) == 1 else AllFences(fences)
            if self._fence_hook is not None:
                fence = self._fence_hook(fence)
            for (lg, _, src, _, _), dst in zip(plan, dsts):
                self._host_fences[self.cold_group_of[lg]][dst] = fence
            if getattr(fence, "off_stream", False):
                self._ahead_fences = [f for f in self._ahead_fences if not f.is_ready()]
                self._ahead_fences.append(fence)
            self._stats.num_offloads_ahead += 1
            self._stats.num_pages_offloaded_ahead += sum(p[2].size for p in plan)
        for nbytes in staged:  # NOTE: the same usage as when each ran: peaks come out equal
            charge = self.governor.reserve(CacheLevel.HOST, nbytes, transient=True)
            charge.commit()
            charge.release()
        # 4-5. Ownership moves; the source slots are released.
        for (lg, src_level, src, dst_level, _), grant, dst in zip(plan, taken, dsts):
            if grant is None:
                continue
            grant.commit()
            self._stats.num_migrations += 1
            self._stats.num_pages_migrated += src.size
            self._stats.bytes_migrated += src.size * self.page_bytes(dst_level, lg)
            if self._observers:
                self._emit(StorageEvent("stored", lg, dst_level, dst) if keep else
                           StorageEvent("migrated", lg, dst_level, dst, src_level, src))
            if not (ahead or keep):  # NOTE: ahead: the caller frees them once the fence is ready
                self.free(src_level, lg, src)
        return dsts, fence

    def close(self) -> None:
        """Waits for outstanding work, closes the disk files, frees host memory. Every tier is
        released even when one fails to (e.g. a disk file's name cannot be removed); the first
        such error is raised afterwards."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        self.wait_side_stream()  # NOTE: they write host memory freed below
        for p, d in self._pending_host_indices:
            try:
                d.block_until_ready()
            except Exception as e:  # noqa: BLE001 - a failed step's output: nothing to wait for
                errors.append(e)
            self._unregister_pairs(p)
        self._pending_host_indices = []
        if self._ring is not None:
            try:
                self._ring.drain()
            except Exception as e:  # noqa: BLE001 - as above
                errors.append(e)
        self._ring_buffer = None  # NOTE: the pinned staging memory goes with its last view
        for pool in [*self.disk_pools, *self.host_pools, *getattr(self, "_tiers", [])]:
            try:
                pool.close()
            except Exception as e:  # noqa: BLE001 - the others are still released
                errors.append(e)
        if errors:
            raise errors[0]


class _Pools(list):
    """:attr:`StorageManager.pools`: a list whose item assignment writes through."""

    def __init__(self, storage: StorageManager, pairs: list) -> None:
        super().__init__(pairs)
        self._storage = storage

    def __setitem__(self, h: Any, pair: Any) -> None:
        super().__setitem__(h, pair)
        self._storage.set_pools(h, (pair[0], pair[1]))
