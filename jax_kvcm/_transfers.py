"""The submission half of the storage manager: every migration path, codec call and fence.

:class:`TransferPaths` is a mixin of :class:`~jax_kvcm._storage.StorageManager` (the same object:
it reads the tiers, the codec and the governor the storage manager built). The transaction
around these calls (reserve, submit, transfer ownership, roll back) lives in
:mod:`jax_kvcm._storage`; this module submits one move of one layer group: device <-> host
(codec encode / decode on XLA's stream, or write-back ahead on the CUDA side stream), disk hops
through the pinned staging ring, raw blob copies between cold tiers.

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
written by disk reads. They also carry failure: a transaction that reads host slots first checks
that the copies which wrote them succeeded (:meth:`TransferPaths._check_host_written`), since a
device -> host encode is not waited for and its device source is already free. The exception is :meth:`StorageManager.offload_ahead` (write-back ahead):

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
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import _ffi
from jax_kvcm._codec import PageIndexLocation
from jax_kvcm._disk_tier import CorruptPageError, DiskIOError, DiskPool, UnreadablePageError
from jax_kvcm._fence import ArrayFence, SideStreamFence, wait_quietly
from jax_kvcm._governor import BudgetExceededError, Lease
from jax_kvcm._types import CacheLevel

__all__ = ["MAX_INDEX_BATCH_BYTES", "TransferPaths"]

MAX_INDEX_BATCH_BYTES = 64 * 1024  # split codec calls above this many bytes of index pairs
_PAIR_BYTES = 8


class TransferPaths:
    """Submission of single moves (see the module docstring); mixed into StorageManager."""

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
        k, v = self._tier_of[h].pools(h)
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
                wait_quietly(SideStreamFence(token, issued))
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
            wait_quietly(f)
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
            k, v = self._tier_of[h].pools(h)
            token = fn(k, v, pairs)
            self._tier_of[h].note_use(h, token)
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
            k, v = self._tier_of[h].pools(h)
            k, v, token = fn(k, v, pairs)
            self.set_pools(h, (k, v))
            self._tier_of[h].note_use(h, token)
            self._track_host_indices(lg, pairs, token)
        return ArrayFence(token)

    def _copy_hot(self, lg: int, src: np.ndarray, dst: np.ndarray) -> None:
        h = self.hot_group_of[lg]
        if self._tier_of[h].kind != "paged":
            raise ValueError("device -> device moves copy whole paged pools; an arena's pages "
                             "stay where their range puts them")
        fn = self._jitted("copy", h, 0)
        for chunk in self._index_batches(dst, src):
            k, v = self._tier_of[h].pools(h)
            k, v, _ = fn(k, v, jax.device_put(chunk, self._index_placement))
            self.set_pools(h, (k, v))

    def copy_device_pages(self, lg: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Copies device pages ``src`` -> ``dst`` ``[n]`` of layer group ``lg`` (both allocated
        by the caller; the sources stay). Paged pools: one jitted gather / scatter. An arena:
        the codec encodes the pages into a device scratch region and decodes them into ``dst``
        (its pools are reached by address), both on XLA's stream, so in order."""
        self._check_open()
        src, dst = (np.asarray(a, np.int32).reshape(-1) for a in (src, dst))
        h = self.hot_group_of[lg]
        if self._tier_of[h].kind == "paged":
            self._copy_hot(lg, src, dst)
            return
        page = self.cold_page_bytes[lg]
        scratch = self._copy_scratch.get(lg)
        if scratch is None or scratch.size < src.size * page:
            # NOTE: the region's address is a static attribute of the codec call: one scratch
            # per group, kept (and grown only when a larger copy comes), so it compiles once.
            scratch = jnp.zeros(max(1, src.size) * page, jnp.uint8, device=self.device)
            self._copy_scratch[lg] = scratch
        address, num = scratch.unsafe_buffer_pointer(), scratch.size // page
        slots = np.arange(src.size, dtype=np.int32)
        self._encode(lg, src, slots, address, num)
        self._decode(lg, slots, dst, address, num)

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

    def _check_host_written(self, lg: int, slots: np.ndarray) -> None:
        """Host ``slots`` about to be read: the copies that wrote them must have succeeded.
        Waits for those still running (a page read back before its encode finished). An encode
        on XLA's stream that failed at run time (on any shard of a mesh) already had its device
        source freed, so its pages are lost: CorruptPageError (``level`` HOST) names them before
        anything is submitted, and they stay unserved (each later read raises again)."""
        fences = self._host_fences[self.cold_group_of[lg]]
        written: dict[int, bool] = {}
        bad = []
        for s in slots.tolist():
            f = fences[s]
            if f is None:
                continue
            if id(f) not in written:
                if not f.is_ready():
                    self._stats.num_host_fence_waits += 1
                try:
                    f.wait()
                    written[id(f)] = True
                except Exception:  # noqa: BLE001  (the copy's run-time error, whatever its type)
                    written[id(f)] = False
            if not written[id(f)]:
                bad.append(s)
        if bad:
            raise CorruptPageError(lg, np.asarray(bad, np.int32), level="HOST")

    # -- staging, fences, governor -----------------------------------------------------------

    class _StagingScope:
        """A staging-ring lease for ``num_pages`` cold pages of ``lg``, charged as transient
        HOST bytes; the body stores the fence of its last use of the bytes in ``box[0]``. On
        success the charged bytes are appended to ``staged`` (the transaction records them)."""

        def __init__(self, manager: Any, lg: int, num_pages: int,
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
                 staged: list[int]) -> TransferPaths._StagingScope:
        if self._ring is None:
            raise ValueError("no staging ring: there is no disk tier")
        return TransferPaths._StagingScope(self, lg, num_pages, staged)

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
            wait = f.wait if read else functools.partial(wait_quietly, f)
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

    def _emit(self, event: Any) -> None:
        for fn in self._observers:
            fn(event)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the storage manager is closed")


def _token(k: Any, v: Any) -> jax.Array:
    """A tiny output that depends on the new pools: a fence that survives their donation (a
    donated array cannot be waited on). An arena pool's leaf stands for it (its first bytes are
    the null chunk, always mapped)."""
    k, v = getattr(k, "data", k), getattr(v, "data", v)
    return k.reshape(-1)[0].astype(jnp.float32) + v.reshape(-1)[0].astype(jnp.float32)
