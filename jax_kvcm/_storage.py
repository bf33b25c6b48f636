"""Storage manager: the device / host / disk tiers and every migration between them.

Owns the hot pools (one K and one V ``jax.Array`` per hot pool group, ``[L, num_slots,
page_size, Hkv, D]``, slot 0 the null page), the cold pools (one :class:`HostPool` and one
:class:`DiskPool` per cold pool group, holding codec-encoded pages of a fixed size), the cold-page
codec, the :class:`MemoryGovernor` and, when a disk tier exists, the pinned :class:`StagingRing`.

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

**Tensor parallelism** (``device`` a ``NamedSharding`` splitting the pools over KV heads on mesh
axis ``a`` of size ``n``): the codec is configured with one shard's layout (``Hkv / n`` heads), so
a shard's *piece* of a page is the codec's page of that shard's heads, and a cold page is the
``n`` pieces one after the other (``cold_page_bytes = n * piece``): shard ``s``'s piece of cold
slot ``c`` sits at piece index ``c * n + s`` from the tier's base (its own ``1/n`` of every slot
of the host pool, the disk file and the staging ring). Encode and decode run as one jitted
``shard_map`` per call: each shard's codec call gets the pairs with its piece indices (a pairs
array split over the axis, built on the host, so a HOST-location codec finds each shard's host
copy by its buffer), the same base address and ``n x`` the slot bound; the call's token is split
over the shards, so the one fence is ready when every shard is done. Everything else (slots,
budgets, host <-> disk blob copies, checksums over the whole page) works on whole pages as
before: one slot id names the page on every shard, and a migration is one transaction for all
shards (a failure on any shard, before or at submission, rolls back all of them).

NOTE: device work is ordered by XLA's stream (every encode/decode takes the pools as operands), so
fences only guard host-side accesses: the staging ring, host slots read by disk writes, host slots
written by disk reads. The exception is :meth:`StorageManager.offload_ahead` (write-back ahead):

**Offloads off the compute stream.** ``offload_ahead`` moves device pages to the host tier as one
transaction like :meth:`~StorageManager.migrate_many`, but with the concat codec on CUDA (one
device, no mesh) its encode runs on a side stream with the copy engines (``side_stream`` in
ffi/cuda/codec.cu): the copies finish *after* XLA's stream moved on, and their completion is a
:class:`SideStreamFence` (the codec's tickets). Elsewhere (CPU, other codecs, a mesh) the same call
encodes on XLA's stream as usual and its fence is the token. Either way:

(a) the device source slots are *not* released: the caller (the KV-cache manager) frees them once
    the returned fence is ready, so no later step's ``write_kv`` can overwrite a page the side
    stream still reads;
(b) the fence becomes the destination host slots' fence, and fences of side-stream copies
    (``off_stream``) are waited on before *any* read of those host slots, device-side decodes
    included (a decode on XLA's stream is not ordered after the side stream);
(c) ASSUMPTION: the hot pools stay at their device addresses until the fence is ready. Steps donate
    the pools and XLA aliases them in place (as the manager's own decode and copy functions do);
    the fence also holds the pool arrays it read, so pools that are not donated stay alive.
    :meth:`StorageManager.check_pools_in_place` (called by the manager when a step returns its
    pools) raises when a step moved the pools while such copies were in flight;
    :meth:`~StorageManager.rebuild_pools` and :meth:`~StorageManager.close` wait for them first;
(d) :meth:`~StorageManager.close` waits for every outstanding side-stream copy.

Not thread-safe: the KV-cache manager serializes calls with one lock.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import _ffi
from jax_kvcm._codec import (ColdPageCodec, HotPoolGroupDesc, PageIndexLocation,
                             create_default_cold_page_codec)
from jax_kvcm._disk_tier import DiskIOError, DiskPool
from jax_kvcm._governor import BudgetExceededError, Lease, MemoryGovernor
from jax_kvcm._host_tier import HostPool, allocate_host_buffer
from jax_kvcm._pool_ratios import split_cold_budget, weights_from_ratio
from jax_kvcm._slots import SlotAllocator
from jax_kvcm._staging_ring import ArrayFence, StagingRing, staging_ring_capacity
from jax_kvcm._types import (CacheLevel, LayerGroupLayout, PoolGroupIndex, PoolLayout,
                             check_count, hot_page_bytes)

__all__ = [
    "CorruptPageError",
    "UnreadablePageError",
    "LayerGroupSpec",
    "SideStreamFence",
    "StorageConfig",
    "StorageEvent",
    "StorageManager",
]

MAX_INDEX_BATCH_BYTES = 64 * 1024  # split codec calls above this many bytes of index pairs
_PAIR_BYTES = 8


class CorruptPageError(Exception):
    """Disk pages failed their checksum: they are missing, never served. Nothing was changed;
    ``slots`` are the bad source slots (the caller drops or invalidates them)."""

    def __init__(self, layer_group: int, slots: np.ndarray) -> None:
        super().__init__(f"layer group {layer_group}: disk pages {slots.tolist()} failed their "
                         "checksum")
        self.layer_group = layer_group
        self.slots = slots


class UnreadablePageError(CorruptPageError, DiskIOError):
    """A disk read failed (EIO, a short read): its pages count as corrupt (a miss; ``slots``
    are every source slot of the failed read) and it is also the :class:`DiskIOError` (errno
    preserved). Nothing was changed."""

    def __init__(self, layer_group: int, slots: np.ndarray, cause: OSError) -> None:
        super().__init__(layer_group, slots)
        self.errno = cause.errno
        self.filename = cause.filename
        self.strerror = (f"layer group {layer_group}: disk pages {slots.tolist()} unreadable "
                         f"({cause.strerror or cause})")


@dataclass(frozen=True, slots=True)
class LayerGroupSpec:
    """KV layout of one layer group; its hot page is ``[num_layers] x {K, V} x [page_size,
    num_kv_heads, head_dim]``."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = jnp.bfloat16

    @property
    def hot_page_bytes(self) -> int:
        return hot_page_bytes(self.num_layers, self.page_size, self.num_kv_heads, self.head_dim,
                              self.dtype)

    def same_hot_layout(self, other: LayerGroupSpec) -> bool:
        return (self.num_layers, self.page_size, self.num_kv_heads, self.head_dim,
                jnp.dtype(self.dtype)) == (other.num_layers, other.page_size, other.num_kv_heads,
                                           other.head_dim, jnp.dtype(other.dtype))


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """Tier sizes and groupings. Validated by :class:`StorageManager`.

    - ``device_slots``: usable slots per hot pool group (the null slot 0 comes on top).
    - ``hot_pool_groups``: layer-group ids per hot pool group (identical hot layouts share one
      slot space and one K/V array pair); default one group per layer group.
    - ``cold_pool_groups``: layer-group ids per cold pool group (one slot space and one pool per
      cold tier, HOST and DISK alike), independent of the hot grouping; members must encode to
      the same cold page size. Default: one group per distinct cold page size (ascending), so
      every layer group that can share a cold pool does.
    - ``pool_ratio``: per layer group, its share of hot bytes, projected into the cold tiers
      through slot counts; default: the hot split implied by ``device_slots``.
    - ``host_bytes`` / ``disk_bytes``: cold tier budgets (0 = no such tier); ``disk_dir`` is
      required with ``disk_bytes`` (created when missing; a file there is an error).
    - ``disk_io_threads``: native threads one disk read/write may use (default ``min(8, hardware
      threads)``).
    """

    layer_groups: tuple[LayerGroupSpec, ...]
    device_slots: tuple[int, ...]
    hot_pool_groups: tuple[tuple[int, ...], ...] | None = None
    cold_pool_groups: tuple[tuple[int, ...], ...] | None = None
    pool_ratio: tuple[float, ...] | None = None
    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    pinned_host: bool | None = None
    disk_io_threads: int | None = None


@dataclass(frozen=True, slots=True)
class StorageEvent:
    """``kind`` is "stored", "removed" or "migrated"; ``slots`` at ``level`` (for "migrated":
    the destination, with ``src_level`` / ``src_slots`` the source)."""

    kind: str
    layer_group: int
    level: CacheLevel
    slots: np.ndarray
    src_level: CacheLevel | None = None
    src_slots: np.ndarray | None = None


@dataclass(slots=True)
class _Stats:
    num_migrations: int = 0
    num_pages_migrated: int = 0
    bytes_migrated: int = 0
    num_host_fence_waits: int = 0       # host-slot accesses that waited for device work
    host_fence_wait_seconds: float = 0.0
    num_offloads_ahead: int = 0         # offload_ahead transactions
    num_pages_offloaded_ahead: int = 0
    num_side_stream_calls: int = 0      # of their encode calls, those on the side stream


class SideStreamFence:
    """Completion of encode calls made with ``side_stream=True`` (CUDA): ready when the last
    call's token is (every call was issued) and every ticket's copies are done. The side stream
    runs its copies in order, but every ticket is checked and released.

    ``off_stream`` is True: XLA's stream is not ordered after these copies, so device-side
    readers of the bytes they write wait on the host (see the module docstring, (b)). ``arrays``
    (the pools the calls read) are kept alive until the fence is ready. A failure (the call's
    error, a failed copy) is raised by :meth:`wait`, every time; :meth:`is_ready` is then True.
    """

    __slots__ = ("_token", "_tickets", "_arrays", "_error", "_done")
    off_stream = True

    def __init__(self, token: jax.Array, tickets: Sequence[int], arrays: tuple = ()) -> None:
        self._token, self._tickets, self._arrays = token, list(tickets), arrays
        self._error: BaseException | None = None
        self._done = False

    def _finish(self, error: BaseException | None) -> None:
        for t in self._tickets:
            _ffi._kvcm_cuda.ticket_release(t)
        self._tickets, self._arrays, self._token = [], (), None
        self._error, self._done = error, True

    def is_ready(self) -> bool:
        if self._done:
            return True
        try:
            if not self._token.is_ready():
                return False
            for t in self._tickets:
                state = _ffi._kvcm_cuda.ticket_query(t)
                if state == 1:  # copies in flight
                    return False
                if state != 2:  # never submitted although the call ran: the call failed
                    self.wait()
                    return True
        except Exception as e:  # noqa: BLE001 - reported by wait()
            self._finish(e)
            return True
        self._finish(None)
        return True

    def wait(self) -> None:
        if not self._done:
            try:
                self._token.block_until_ready()
                for t in self._tickets:
                    if not _ffi._kvcm_cuda.ticket_wait(t):
                        raise RuntimeError(f"side-stream offload: ticket {t} was never submitted "
                                           "(its encode call failed)")
            except Exception as e:  # noqa: BLE001 - kept and raised on every wait
                self._finish(e)
            else:
                self._finish(None)
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done else "pending")
        return f"SideStreamFence({state}, {len(self._tickets)} tickets)"


class _AllFences:
    """Ready when every fence is; ``off_stream`` when any is."""

    __slots__ = ("fences", "off_stream")

    def __init__(self, fences: Sequence[Any]) -> None:
        self.fences = list(fences)
        self.off_stream = any(getattr(f, "off_stream", False) for f in fences)

    def is_ready(self) -> bool:
        return all(f.is_ready() for f in self.fences)

    def wait(self) -> None:
        errors = []
        for f in self.fences:
            try:
                f.wait()
            except Exception as e:  # noqa: BLE001 - every fence is waited on
                errors.append(e)
        if errors:
            raise errors[0]


class StorageManager:
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
        self._stats = _Stats()
        self._fault_hook: Callable[[str], None] | None = None
        # NOTE: a test seam (tests/faults.py): wraps the fence of each offload_ahead transaction.
        self._fence_hook: Callable[[Any], Any] | None = None
        self._ahead_fences: list[Any] = []  # off-stream fences not yet seen ready
        self._ahead_pools: list[tuple[int, ...]] | None = None  # pool pointers they read
        self._pending_host_indices: list[tuple[jax.Array, jax.Array]] = []
        self._jit_cache: dict[tuple, Callable] = {}
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
        self.device_allocators = []
        for n in device_slots:
            alloc = SlotAllocator(n + 1)
            taken = alloc.allocate(n + 1)
            alloc.free(taken[taken != 0])  # NOTE: slot 0 stays allocated forever (null page)
            self.device_allocators.append(alloc)
        self.pools: list[tuple[jax.Array, jax.Array]] = []
        for h, g in enumerate(self.hot_groups):
            s = specs[g[0]]
            shape = (s.num_layers, device_slots[h] + 1, s.page_size, s.num_kv_heads, s.head_dim)
            self.pools.append((self._zeros(shape, s.dtype), self._zeros(shape, s.dtype)))

        # 3-5. Configure the codec, query and validate every batching class.
        for g in self.hot_groups:
            if specs[g[0]].num_kv_heads % self.num_shards:
                raise ValueError(f"layer group {g[0]}: num_kv_heads {specs[g[0]].num_kv_heads} "
                                 f"is not divisible by the {self.num_shards} shards")
        descs = [HotPoolGroupDesc(index=h, layer_groups=g, num_layers=specs[g[0]].num_layers,
                                  num_slots=device_slots[h] + 1, page_size=specs[g[0]].page_size,
                                  num_kv_heads=specs[g[0]].num_kv_heads // self.num_shards,
                                  head_dim=specs[g[0]].head_dim, dtype=jnp.dtype(specs[g[0]].dtype))
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
        self._validate_batching()
        self._build_cold_groups(config.cold_pool_groups)
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
        device_limit = sum(n * specs[g[0]].hot_page_bytes
                           for n, g in zip(device_slots, self.hot_groups))
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
        self.layout = PoolLayout(tuple(layouts),
                                 tuple(lv for lv in CacheLevel if self.has_level(lv)),
                                 tuple(self.batching_id))

    def _build_cold_groups(self, groups: Sequence[Sequence[int]] | None) -> None:
        """The cold lifecycle -> pool-group mapping (``cold_group_of``, ``cold_slot_bytes``), then
        the batching representatives restricted to it.

        A codec's batching class lies in one hot pool group and has one cold page size, but the
        cold grouping is the manager's choice: when it splits a class, pairs of members in
        different cold pools cannot share a codec call (one cold base address per call), so each
        member's representative becomes the smallest class member in its own cold pool group.
        With the default grouping (by size) this changes nothing."""
        sizes = self.cold_page_bytes
        if groups is None:
            distinct = sorted(set(sizes))
            groups = [[lg for lg in range(len(sizes)) if sizes[lg] == b] for b in distinct]
        groups = tuple(tuple(g) for g in groups)
        members = sorted(lg for g in groups for lg in g)
        if members != list(range(len(sizes))) or not all(groups):
            raise ValueError("config.cold_pool_groups must assign every layer group id "
                             f"0..{len(sizes) - 1} to exactly one non-empty group, got {groups}")
        for g in groups:
            if len({sizes[lg] for lg in g}) != 1:
                raise ValueError(f"config.cold_pool_groups: layer groups {g} encode to different "
                                 f"cold page sizes {[sizes[lg] for lg in g]}")
        self.cold_groups = groups
        self.cold_group_of = [0] * len(sizes)
        for c, g in enumerate(groups):
            for lg in g:
                self.cold_group_of[lg] = c
        self.cold_slot_bytes = [sizes[g[0]] for g in groups]
        self.batching_id = [min(m for m in range(len(sizes))
                                if self.batching_id[m] == self.batching_id[lg]
                                and self.cold_group_of[m] == self.cold_group_of[lg])
                            for lg in range(len(sizes))]

    def _validate_batching(self) -> None:
        """Each batching representative is configured, <= every member, maps to itself, and
        shares the member's hot pool group, cold page size and index location. (Its cold pool
        group may differ under an explicit cold grouping: :meth:`_build_cold_groups` then
        restricts the class to each cold pool group.)"""
        for lg, rep in enumerate(self.batching_id):
            if rep < 0 or rep >= len(self.specs):
                raise ValueError(f"codec: layer group {lg} has an unknown batching id {rep}")
            if rep > lg or self.batching_id[rep] != rep:
                raise ValueError(f"codec: batching id {rep} of layer group {lg} is not the "
                                 "smallest member of its class or does not map to itself")
            same = (self.hot_group_of[rep] == self.hot_group_of[lg]
                    and self.cold_page_bytes[rep] == self.cold_page_bytes[lg]
                    and self.index_location[rep] == self.index_location[lg])
            if not same:
                raise ValueError(f"codec: layer group {lg} and its batching representative {rep} "
                                 "differ in hot pool group, cold page size or index location")

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
        ``num_free``, ``is_allocated``); cold pools allocate their own slots."""
        level = CacheLevel(level)
        if level is CacheLevel.DEVICE:
            return self.device_allocators[self.hot_group_of[lg]]
        if not self.has_level(level):
            raise ValueError(f"there is no {level.name} tier")
        pools = self.host_pools if level is CacheLevel.HOST else self.disk_pools
        return pools[self.cold_group_of[lg]]

    def num_free(self, level: CacheLevel, lg: int) -> int:
        return self.allocator(level, lg).num_free

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

    def rebuild_pools(self) -> None:
        """Replaces every hot pool by zeros of the same shape and dtype on :attr:`device` (after
        a failed step consumed the pools: their content is gone; the caller forgets it). Waits
        for side-stream copies first (they may still read the old pools)."""
        self._check_open()
        self.wait_side_stream()
        self.pools = [tuple(self._zeros(a.shape, a.dtype) for a in pair) for pair in self.pools]

    def _zeros(self, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        """A zero pool on :attr:`device`; a sharded one is created in place, shard by shard
        (never whole on one device first)."""
        if isinstance(self.device, jax.sharding.NamedSharding):
            return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.device)()
        return jax.device_put(jnp.zeros(shape, dtype), self.device)

    # -- allocation of hot pages -------------------------------------------------------------

    def allocate(self, level: CacheLevel, lg: int, n: int) -> np.ndarray | None:
        """``n`` slots of ``lg`` at ``level`` under a committed governor lease, or ``None``."""
        level = CacheLevel(level)
        lease = self._reserve(level, n * self.page_bytes(level, lg))
        if lease is None:
            return None
        slots = self.allocator(level, lg).allocate(n)
        if slots is None:
            lease.release()
            return None
        lease.commit()
        self._emit(StorageEvent("stored", lg, level, slots))
        return slots

    def free(self, level: CacheLevel, lg: int, slots: np.ndarray) -> None:
        """Returns slots (and their governor bytes); disk pages are invalidated."""
        level = CacheLevel(level)
        slots = np.asarray(slots, np.int32)
        if slots.size == 0:
            return
        self.allocator(level, lg).free(slots)  # NOTE: a freed disk slot also drops its checksum
        self.governor.release_committed(level, slots.size * self.page_bytes(level, lg))
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
        """Several migrations ``(lg, src_level, src_slots [n], dst_level)`` as *one* transaction:
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
                 ahead: bool) -> tuple[list[np.ndarray], Any] | None:
        """migrate_many (ahead=False; the fence is None) or offload_ahead (ahead=True)."""
        self._check_open()
        plan = []
        for lg, src_level, src_slots, dst_level in moves:
            src_level, dst_level = CacheLevel(src_level), CacheLevel(dst_level)
            src = np.ascontiguousarray(src_slots, np.int32).reshape(-1)
            if not self.has_level(dst_level) or not self.has_level(src_level):
                raise ValueError(f"no {src_level.name} -> {dst_level.name} path in this "
                                 "configuration")
            if not 0 <= lg < len(self.specs):
                raise ValueError(f"layer group {lg} does not exist")
            if src.size and (np.unique(src).size != src.size
                             or not _all_allocated(self.allocator(src_level, lg), src)):
                raise ValueError(f"src_slots {src.tolist()} are not distinct allocated "
                                 f"{src_level.name} slots of layer group {lg}")
            plan.append((lg, src_level, src, dst_level))
        by_pool: dict[tuple[int, int], list[np.ndarray]] = {}
        for lg, src_level, src, _ in plan:
            by_pool.setdefault((src_level, id(self.allocator(src_level, lg))), []).append(src)
        for (level, _), arrays in by_pool.items():
            if len(arrays) > 1:
                allsrc = np.concatenate(arrays)
                if np.unique(allsrc).size != allsrc.size:
                    raise ValueError(f"src_slots: a {CacheLevel(level).name} slot is moved twice")
        # 1. Reserve and allocate every destination first.
        taken: list[tuple[Lease | None, np.ndarray | None]] = []

        def unwind() -> None:
            for (lg, _, _, dst_level), (lease, dst) in zip(plan, taken):
                if dst is not None and dst.size:
                    self.allocator(dst_level, lg).free(dst)
                if lease is not None:
                    lease.release()

        for lg, _, src, dst_level in plan:
            if src.size == 0:
                taken.append((None, np.zeros(0, np.int32)))
                continue
            lease = self._reserve(dst_level, src.size * self.page_bytes(dst_level, lg))
            if lease is None:
                unwind()
                return None
            dst = self.allocator(dst_level, lg).allocate(src.size)
            taken.append((lease, dst))
            if dst is None:
                unwind()
                return None
        # 2-3. Submit everything; staging charges are replayed only once all of it succeeded.
        staged: list[int] = []
        fences: list[Any] = []  # ahead: one per move
        try:
            for (lg, src_level, src, dst_level), (_, dst) in zip(plan, taken):
                if src.size:
                    self._hook("offload_ahead" if ahead else "submit")
                    if ahead:
                        fences.append(self._submit_ahead(lg, src, dst))
                    else:
                        self._transfer(lg, src_level, src, dst_level, dst, staged)
        except BaseException:
            for f in fences:  # NOTE: copies already issued write the slots unwind frees
                _wait_quietly(f)
            unwind()
            raise
        fence = None
        if ahead and fences:
            fence = fences[0] if len(fences) == 1 else _AllFences(fences)
            if self._fence_hook is not None:
                fence = self._fence_hook(fence)
            for (lg, _, src, _), (_, dst) in zip(plan, taken):
                self._host_fences[self.cold_group_of[lg]][dst] = fence
            if getattr(fence, "off_stream", False):
                self._ahead_fences = [f for f in self._ahead_fences if not f.is_ready()]
                self._ahead_fences.append(fence)
            self._stats.num_offloads_ahead += 1
            self._stats.num_pages_offloaded_ahead += sum(src.size for _, _, src, _ in plan)
        for nbytes in staged:  # NOTE: the same usage as when each ran: peaks come out equal
            charge = self.governor.reserve(CacheLevel.HOST, nbytes, transient=True)
            charge.commit()
            charge.release()
        # 4-5. Ownership moves; the source slots are released.
        for (lg, src_level, src, dst_level), (lease, dst) in zip(plan, taken):
            if lease is None:
                continue
            lease.commit()
            self._stats.num_migrations += 1
            self._stats.num_pages_migrated += src.size
            self._stats.bytes_migrated += src.size * self.page_bytes(dst_level, lg)
            self._emit(StorageEvent("migrated", lg, dst_level, dst, src_level, src))
            if not ahead:  # NOTE: ahead: the caller frees the sources once the fence is ready
                self.free(src_level, lg, src)
        return [dst for _, dst in taken], fence

    def _submit_ahead(self, lg: int, src: np.ndarray, dst: np.ndarray) -> Any:
        """Encodes device slots ``src`` into host slots ``dst`` (side stream when available);
        the fence of the copies. The host fences of ``dst`` are set by the caller."""
        g = self.cold_group_of[lg]
        self._wait_fences(g, dst, read=False)
        pool = self.host_pools[g]
        encode = self._encode_side if self.side_stream else self._encode
        return encode(lg, src, dst, pool.device_address, pool.num_slots)

    def _encode_side(self, lg: int, src: np.ndarray, dst: np.ndarray, address: int,
                     num_cold_slots: int) -> SideStreamFence:
        """:meth:`_encode` with the side-stream mover: one ticket per codec call."""
        h = self.hot_group_of[lg]
        fn = self._jitted("encode_side", self.batching_id[lg], address, num_cold_slots)
        cuda = _ffi._kvcm_cuda
        tickets: list[int] = []
        token = None
        k, v = self.pools[h]
        try:
            for chunk in self._index_batches(dst, src):
                tickets.append(cuda.ticket_create())
                pairs = self._put_pairs(lg, chunk, cold=0, ticket=tickets[-1])
                token = fn(k, v, pairs)
                self._track_host_indices(lg, pairs, token)
                self._stats.num_side_stream_calls += 1
        except BaseException:
            issued = tickets[:-1]
            if issued and token is not None:  # NOTE: they write the host slots unwind frees
                _wait_quietly(SideStreamFence(token, issued))
            for t in tickets[len(issued):]:
                cuda.ticket_release(t)
            raise
        return SideStreamFence(token, tickets, (k, v))

    def _pool_pointers(self) -> list[tuple[int, ...]]:
        return [tuple(a.unsafe_buffer_pointer() for a in pair) for pair in self.pools]

    def side_stream_busy(self) -> bool:
        """Whether side-stream copies may still be running (an off-stream fence not ready)."""
        self._ahead_fences = [f for f in self._ahead_fences if not f.is_ready()]
        if not self._ahead_fences:
            self._ahead_pools = None
        return bool(self._ahead_fences)

    def check_pools_in_place(self) -> None:
        """Assumption (c) of the module docstring, checked as far as it can be without
        blocking: while side-stream copies are in flight, the device addresses of the pools
        are recorded the first time they are seen ready, and RuntimeError is raised when a
        later step returned pools at other addresses (it did not donate them, or XLA could
        not alias them: the pages those copies move may hold stale bytes). Pools not ready yet
        are not looked at (asking for their address might wait for the step)."""
        if not self.side_stream or not self.side_stream_busy():
            return
        if not all(a.is_ready() for pair in self.pools for a in pair):
            return
        now = self._pool_pointers()
        if self._ahead_pools is None:
            self._ahead_pools = now
        elif now != self._ahead_pools:
            raise RuntimeError("a step moved the hot pools while side-stream offloads read them: "
                               "write-back ahead on CUDA needs steps that donate the pools "
                               "(donate_argnums) so that XLA updates them in place; set "
                               "KVCacheConfig.offload_ahead_pages=0 otherwise")

    def wait_side_stream(self) -> None:
        """Waits for every side-stream copy (errors are the fences' owners' to handle)."""
        for f in self._ahead_fences:
            _wait_quietly(f)
        self._ahead_fences = []
        self._ahead_pools = None

    def _transfer(self, lg: int, src_level: CacheLevel, src: np.ndarray, dst_level: CacheLevel,
                  dst: np.ndarray, staged: list[int]) -> None:
        """Submits one move (steps 2-3); disk hops append their staging bytes to ``staged``."""
        D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
        path = (src_level, dst_level)
        if path == (D, H):
            g = self.cold_group_of[lg]
            self._wait_fences(g, dst, read=False)
            pool = self.host_pools[g]
            self._host_fences[g][dst] = self._encode(lg, src, dst, pool.device_address,
                                                     pool.num_slots)
        elif path == (H, D):
            g = self.cold_group_of[lg]
            self._wait_fences(g, src, off_stream_only=True)  # XLA's stream is not after them
            # A later host-side write into these slots must wait for this read.
            pool = self.host_pools[g]
            self._host_fences[g][src] = self._decode(lg, src, dst, pool.device_address,
                                                     pool.num_slots)
        elif path == (D, K):
            self._device_to_disk(lg, src, dst, staged)
        elif path == (K, D):
            self._disk_to_device(lg, src, dst, staged)
        elif path == (H, K):
            g = self.cold_group_of[lg]
            hpool, dpool = self.host_pools[g], self.disk_pools[g]
            self._wait_fences(g, src)
            self._hook("disk_write")
            dpool.write(dst, hpool.base_address, src)  # one call: its pieces run in parallel
        elif path == (K, H):
            g = self.cold_group_of[lg]
            hpool, dpool = self.host_pools[g], self.disk_pools[g]
            self._wait_fences(g, dst, read=False)
            self._read(lg, dpool, src, hpool.base_address, dst)
        elif path == (D, D):
            self._copy_hot(lg, src, dst)
        elif path == (H, H):
            g = self.cold_group_of[lg]
            self._wait_fences(g, src)
            self._wait_fences(g, dst, read=False)
            view = self.host_pools[g].view()
            view[dst] = view[src]
        else:  # (K, K): through the staging ring
            pool = self.disk_pools[self.cold_group_of[lg]]
            with self._staging(lg, src.size, staged) as (address, _):
                self._read(lg, pool, src, address)
                self._hook("disk_write")
                pool.write(dst, address)

    def _device_to_disk(self, lg: int, src: np.ndarray, dst: np.ndarray,
                        staged: list[int]) -> None:
        pool = self.disk_pools[self.cold_group_of[lg]]
        scope = self._staging(lg, src.size, staged)
        with scope as (address, lease_box):
            window_address, window_slots, num_cold = scope.codec_window()
            fence = self._encode(lg, src, window_slots, window_address, num_cold)
            fence.wait()  # the blob must be in host memory before it is written
            lease_box[0] = None
            self._hook("disk_write")
            pool.write(dst, address)

    def _disk_to_device(self, lg: int, src: np.ndarray, dst: np.ndarray,
                        staged: list[int]) -> None:
        pool = self.disk_pools[self.cold_group_of[lg]]
        scope = self._staging(lg, src.size, staged)
        with scope as (address, lease_box):
            self._read(lg, pool, src, address)
            window_address, window_slots, num_cold = scope.codec_window()
            lease_box[0] = self._decode(lg, window_slots, dst, window_address, num_cold)

    def _read(self, lg: int, pool: DiskPool, src: np.ndarray, address: int,
              pages: np.ndarray | None = None) -> None:
        """Reads disk slots ``src`` into host memory; CorruptPageError for pages that fail their
        checksum, UnreadablePageError (all of ``src``) when the read itself fails."""
        self._hook("disk_read")
        try:
            ok = pool.read(src, address, pages)
        except DiskIOError as e:
            raise UnreadablePageError(lg, src.copy(), e) from e
        if not ok.all():
            raise CorruptPageError(lg, src[~ok])

    # -- submission helpers ------------------------------------------------------------------

    def _index_batches(self, dst: np.ndarray, src: np.ndarray):
        """(dst, src) int32 [n, 2] batches of at most 64 KiB, padded to a power of two (>= 16)
        by repeating the last pair, so a steady workload compiles a handful of shapes."""
        pairs = np.stack([dst, src], axis=1).astype(np.int32)
        per_batch = MAX_INDEX_BATCH_BYTES // _PAIR_BYTES
        for i in range(0, len(pairs), per_batch):
            chunk = pairs[i:i + per_batch]
            size = max(16, 1 << (len(chunk) - 1).bit_length())
            if size > len(chunk):
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], size - len(chunk), axis=0)])
            yield chunk

    def _jitted(self, kind: str, lg: int, address: int, num_cold_slots: int = 0) -> Callable:
        key = (kind, lg, address, num_cold_slots)
        fn = self._jit_cache.get(key)
        if fn is None and self._mesh is not None and kind != "copy":
            fn = self._jit_cache[key] = self._sharded_codec_call(kind, lg, address,
                                                                 num_cold_slots)
        if fn is None:
            codec = self._codec
            if kind in ("encode", "encode_side"):
                side = kind == "encode_side"

                def encode(k, v, pairs):
                    return codec.encode(lg, k, v, pairs, address, num_cold_slots=num_cold_slots,
                                        side_stream=side)
                fn = jax.jit(encode)
            elif kind == "decode":
                def decode(k, v, pairs):
                    k, v = codec.decode(lg, k, v, pairs, address, num_cold_slots=num_cold_slots)
                    return k, v, _token(k, v)
                fn = jax.jit(decode, donate_argnums=(0, 1))
            else:  # hot -> hot copy of whole slots
                def copy(k, v, pairs):
                    d, s = pairs[:, 0], pairs[:, 1]
                    k, v = k.at[:, d].set(k[:, s]), v.at[:, d].set(v[:, s])
                    return k, v, _token(k, v)
                fn = jax.jit(copy, donate_argnums=(0, 1))
            self._jit_cache[key] = fn
        return fn

    def _sharded_codec_call(self, kind: str, lg: int, address: int,
                            num_cold_slots: int) -> Callable:
        """``kind`` ("encode" / "decode") of every shard's piece in one jitted ``shard_map``:
        ``fn(k, v, pairs)`` with ``pairs`` from :meth:`_put_pairs` (split over the axis, piece
        indices); returns the token ``[num_shards]`` (decode: ``(k, v, token)``, pools
        donated)."""
        from jax.sharding import PartitionSpec as P
        codec, axis, n = self._codec, self._axis, self.num_shards
        pool, split = P(None, None, None, axis, None), P(axis)
        bound = num_cold_slots * n

        if kind == "encode":
            def body(k, v, pairs):  # noqa: ANN001, ANN202
                return codec.encode(lg, k, v, pairs, address, num_cold_slots=bound)
            out_specs: Any = split
        else:
            def body(k, v, pairs):  # noqa: ANN001, ANN202
                k, v = codec.decode(lg, k, v, pairs, address, num_cold_slots=bound)
                return k, v, _token(k, v).reshape(1)
            out_specs = (pool, pool, split)
        # NOTE: check_vma=False: the codec calls have no varying-manual-axes rule; the specs
        # are exact (pools split over heads, one token per shard).
        fn = jax.shard_map(body, mesh=self._mesh, in_specs=(pool, pool, P(axis, None)),
                           out_specs=out_specs, check_vma=False)
        return jax.jit(fn, donate_argnums=(0, 1) if kind == "decode" else ())

    def _put_pairs(self, lg: int, chunk: np.ndarray, cold: int = 0,
                   ticket: int = 0) -> jax.Array:
        """The pairs of one codec call on the device(s). With a mesh, ``cold`` is the column of
        cold slots: shard ``s`` gets the chunk with cold slot ``c`` as piece ``c * n + s`` (see
        the module doc), each block its own buffer (a HOST-location codec gets each shard's host
        copy). ``ticket``: the side-stream ticket of the call (no mesh)."""
        if self._mesh is None:
            arr = jax.device_put(chunk, self._index_placement)
            if self.index_location[lg] == PageIndexLocation.HOST:
                self._codec.register_host_index_pairs(arr, chunk, ticket=ticket)
            return arr
        n = self.num_shards
        blocks = []
        for s in range(n):
            b = chunk.copy()
            b[:, cold] = chunk[:, cold] * n + s
            blocks.append(b)
        arr = jax.device_put(np.concatenate(blocks),
                             jax.sharding.NamedSharding(self._mesh,
                                                        jax.sharding.PartitionSpec(self._axis)))
        host = self.index_location[lg] == PageIndexLocation.HOST
        registered = []
        try:
            for shard in arr.addressable_shards:
                s = shard.index[0].start // len(chunk)
                self._hook(f"shard_pairs:{s}")
                if host:
                    self._codec.register_host_index_pairs(shard.data, blocks[s])
                    registered.append(shard.data)
        except BaseException:
            for d in registered:
                self._codec.unregister_host_index_pairs(d)
            raise
        return arr

    def _unregister_pairs(self, pairs: jax.Array) -> None:
        if self._mesh is None:
            self._codec.unregister_host_index_pairs(pairs)
            return
        for shard in pairs.addressable_shards:
            self._codec.unregister_host_index_pairs(shard.data)

    def _encode(self, lg: int, src: np.ndarray, dst: np.ndarray, address: int,
                num_cold_slots: int) -> ArrayFence:
        """Hot slots ``src`` -> cold slots ``dst`` of the region at ``address`` (a host pool or a
        staging lease of ``num_cold_slots`` pages)."""
        h = self.hot_group_of[lg]
        fn = self._jitted("encode", self.batching_id[lg], address, num_cold_slots)
        token = None
        for chunk in self._index_batches(dst, src):
            pairs = self._put_pairs(lg, chunk, cold=0)
            k, v = self.pools[h]
            token = fn(k, v, pairs)
            self._track_host_indices(lg, pairs, token)
        return ArrayFence(token)

    def _decode(self, lg: int, src: np.ndarray, dst: np.ndarray, address: int,
                num_cold_slots: int) -> ArrayFence:
        """Cold slots ``src`` of the region at ``address`` -> hot slots ``dst``."""
        h = self.hot_group_of[lg]
        fn = self._jitted("decode", self.batching_id[lg], address, num_cold_slots)
        token = None
        for chunk in self._index_batches(dst, src):
            pairs = self._put_pairs(lg, chunk, cold=1)
            k, v = self.pools[h]
            k, v, token = fn(k, v, pairs)
            self.pools[h] = (k, v)
            self._track_host_indices(lg, pairs, token)
        return ArrayFence(token)

    def _copy_hot(self, lg: int, src: np.ndarray, dst: np.ndarray) -> None:
        h = self.hot_group_of[lg]
        fn = self._jitted("copy", h, 0)
        for chunk in self._index_batches(dst, src):
            k, v = self.pools[h]
            k, v, _ = fn(k, v, jax.device_put(chunk, self._index_placement))
            self.pools[h] = (k, v)

    def _track_host_indices(self, lg: int, pairs: jax.Array, done: jax.Array) -> None:
        if self.index_location[lg] == PageIndexLocation.HOST:
            self._pending_host_indices.append((pairs, done))
        still = []
        for p, d in self._pending_host_indices:
            if d.is_ready():
                self._unregister_pairs(p)
            else:
                still.append((p, d))
        self._pending_host_indices = still

    # -- staging, fences, governor -----------------------------------------------------------

    class _StagingScope:
        """A staging-ring lease for ``num_pages`` cold pages of ``lg``, charged as transient
        HOST bytes; the body stores the fence of its last use of the bytes in ``box[0]``. On
        success the charged bytes are appended to ``staged`` (the transaction records them)."""

        def __init__(self, manager: StorageManager, lg: int, num_pages: int,
                     staged: list[int]) -> None:
            self.m, self.lg, self.n, self.staged = manager, lg, num_pages, staged
            self.lease = None
            self.charge: Lease | None = None
            self.box: list[Any] = [None]

        def __enter__(self) -> tuple[int, list[Any]]:
            """Returns ``(host address of the lease, box)``; see :meth:`codec_window`."""
            m = self.m
            page = m.cold_page_bytes[self.lg]
            self.charge = m._reserve(CacheLevel.HOST, self.n * page, transient=True)
            if self.charge is None:
                raise RuntimeError("no HOST budget left for staging")
            self.lease = m._ring.allocate(self.n * page, granularity=page,
                                          alignment=min(256, page & -page))
            if self.lease is None:
                self.charge.release()
                raise RuntimeError("staging ring exhausted: split the disk migration")
            self.lease.wait()  # earlier users of these bytes (their fences) are done
            return m._ring_buffer.address + self.lease.offset, self.box

        def codec_window(self) -> tuple[int, np.ndarray, int]:
            """``(address, slots, num_cold_slots)`` naming the lease's pages for a codec call.

            NOTE: the address is a static attribute of the jitted codec call, so it is the ring
            base shifted by ``offset % page`` (a handful of values), and the lease's pages are
            slot indices from there: the calls compile once per residue, not once per lease."""
            m, page = self.m, self.m.cold_page_bytes[self.lg]
            residue = self.lease.offset % page
            first = (self.lease.offset - residue) // page
            return (m._ring_buffer.device_address + residue,
                    np.arange(first, first + self.n, dtype=np.int32),
                    (m._ring.capacity - residue) // page)

        def __exit__(self, exc_type: Any, *exc: Any) -> None:
            self.m._ring.release(self.lease, self.box[0])
            # NOTE: the charge stays PENDING while in use and is always rolled back exactly here
            # (peaks included); a transaction that succeeds as a whole replays it (migrate_many).
            if exc_type is None:
                self.staged.append(self.charge.nbytes)
            self.charge.release()

    def _staging(self, lg: int, num_pages: int,
                 staged: list[int]) -> StorageManager._StagingScope:
        if self._ring is None:
            raise ValueError("no staging ring: there is no disk tier")
        return StorageManager._StagingScope(self, lg, num_pages, staged)

    def _reserve(self, level: CacheLevel, nbytes: int, *, transient: bool = False) -> Lease | None:
        self._hook("reserve")
        try:
            return self.governor.reserve(level, nbytes, transient=transient)
        except BudgetExceededError:
            return None

    def _wait_fences(self, cold_group: int, slots: np.ndarray, *,
                     off_stream_only: bool = False, read: bool = True) -> None:
        """Host-side access to host slots waits for the device work that last touched them;
        ``off_stream_only``: only for side-stream copies (before a device-side read on XLA's
        stream, which is ordered after everything else already). A failed side-stream copy
        raises here when the caller reads the slots (``read``; its pages are not served); a
        writer only needs it finished."""
        fences = self._host_fences[cold_group]
        seen: set[int] = set()
        for f in fences[slots]:  # NOTE: one migration's pages share one fence object
            if f is None or id(f) in seen:
                continue
            if off_stream_only and not getattr(f, "off_stream", False):
                continue
            seen.add(id(f))
            wait = f.wait if read else functools.partial(_wait_quietly, f)
            if not f.is_ready():
                self._stats.num_host_fence_waits += 1
                t = time.perf_counter()
                wait()
                self._stats.host_fence_wait_seconds += time.perf_counter() - t
            elif getattr(f, "off_stream", False):
                wait()  # NOTE: returns at once, or raises the failure of a finished copy
        if off_stream_only:
            sel = np.fromiter((getattr(f, "off_stream", False) for f in fences[slots]), bool,
                              slots.size)
            fences[slots[sel]] = None
        else:
            fences[slots] = None

    def _hook(self, point: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(point)

    def _emit(self, event: StorageEvent) -> None:
        for fn in self._observers:
            fn(event)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the storage manager is closed")

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
        for pool in [*self.disk_pools, *self.host_pools]:
            try:
                pool.close()
            except Exception as e:  # noqa: BLE001 - the others are still released
                errors.append(e)
        if errors:
            raise errors[0]


def _wait_quietly(fence: Any) -> None:
    """Waits for ``fence``; its failure is its owner's to report."""
    try:
        fence.wait()
    except Exception:  # noqa: BLE001, S110 - see the docstring
        pass


def _all_allocated(allocator: Any, slots: np.ndarray) -> bool:
    """Vectorized when the allocator offers it (SlotAllocator), else slot by slot."""
    inner = getattr(allocator, "_allocator", allocator)
    if hasattr(inner, "all_allocated"):
        in_range = bool(((slots >= 0) & (slots < inner.num_slots)).all())
        return in_range and bool(inner.all_allocated(slots))
    return all(allocator.is_allocated(int(s)) for s in slots)


def _token(k: jax.Array, v: jax.Array) -> jax.Array:
    """A tiny output that depends on the new pools: a fence that survives their donation (a
    donated array cannot be waited on)."""
    return k.reshape(-1)[0].astype(jnp.float32) + v.reshape(-1)[0].astype(jnp.float32)

