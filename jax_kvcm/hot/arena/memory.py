"""An arena's memory: one native reservation (K then V), chunks mapped behind fences.

The reservation holds the K pool at bytes ``[0, pool_bytes)`` and the V pool at ``[pool_bytes,
2 * pool_bytes)``, both slot-major (:mod:`jax_kvcm.hot.arena.geometry`). Mapping chunk ``c``
creates ``2 * super_pages_per_chunk`` physical super-pages and maps them at the chunk's bytes in
both pools, charging :attr:`ArenaGeometry.chunk_bytes` to the governor's DEVICE level;
unmapping releases them and the charge. The native side is
``_kvcm_cuda.Reservation`` (CUDA VMM) on a GPU and ``_kvcm_cpu.Reservation`` (memfd super-pages
over a ``PROT_NONE`` reservation: the same semantics, so CPU tests exercise the real paths).

Pools. On the GPU the pools are the reservation imported with DLPack (no copy), wrapped in
:class:`~jax_kvcm.ArenaPool`s; a step donates them and XLA aliases them in place. XLA's CPU client
copies a donated buffer it did not allocate (which would read unmapped super-pages), so on CPU the
pools are ArenaPools by address, with an ordering token as their only leaf; the ops take them in
place of arrays (see :mod:`jax_kvcm._arena_pool`). Nothing may run a whole-pool XLA op on an
arena pool: only slots of mapped chunks are addressable.

Unmap safety (the seed's third bug: unmapping under a kernel that still reads the range faults
the GPU). :meth:`ArenaMemory.unmap` first *quiesces*: it waits for the pools (the outputs of the
latest step or decode that wrote them) and for every migration that read them since the last
quiesce (:meth:`note_use`). Unmaps happen only under pressure and at teardown, never in steady
state, so the wait is rare.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax_kvcm import _ffi
from jax_kvcm._governor import BudgetExceededError, MemoryGovernor
from jax_kvcm._types import CacheLevel
from jax_kvcm.hot.arena.geometry import ArenaGeometry

__all__ = ["ArenaMemory", "native_reservation"]

_D = CacheLevel.DEVICE


def native_reservation(backend: str, device: Any) -> tuple[Any, str, int, int]:
    """``(Reservation class, backend name, granularity, device ordinal)`` for ``backend``
    ("auto", "cpu", "cuda"; auto: cuda when ``device`` is a GPU)."""
    platform = getattr(device, "platform", None) or jax.default_backend()
    if backend == "auto":
        backend = "cpu" if platform == "cpu" else "cuda"
    if backend == "cpu":
        mod = _ffi._kvcm_cpu
        return mod.Reservation, "cpu", int(mod.reservation_granularity()), -1
    if backend == "cuda":
        if _ffi._kvcm_cuda is None:
            raise RuntimeError("ArenaHot.backend 'cuda' needs the CUDA extension: "
                               f"{_ffi.CUDA_IMPORT_ERROR}")
        ordinal = int(getattr(device, "id", 0)) if device is not None else 0
        mod = _ffi._kvcm_cuda
        return mod.Reservation, "cuda", int(mod.reservation_granularity(ordinal)), ordinal
    raise ValueError(f"ArenaHot.backend must be 'auto', 'cpu' or 'cuda', got {backend!r}")


class ArenaMemory:
    """The reservation of one arena (see the module docstring). ``spec``: the layer group's
    layout (num_layers, page_size, num_kv_heads, head_dim, dtype)."""

    def __init__(self, geometry: ArenaGeometry, spec: Any, governor: MemoryGovernor,
                 backend: str, device: Any) -> None:
        self.geometry = geo = geometry
        self._governor = governor
        self._device = device if device is not None else jax.devices()[0]
        reservation, self.backend, gran, ordinal = native_reservation(backend, self._device)
        if geo.super_page_bytes % gran:
            raise ValueError(f"ArenaHot.super_page_bytes ({geo.super_page_bytes}) must be a "
                             f"multiple of the {self.backend} driver's granularity {gran}")
        self._dtype = np.dtype(spec.dtype)
        self._physical = (geo.num_slots, spec.num_layers, spec.page_size, spec.num_kv_heads,
                          spec.head_dim)
        self._logical = (spec.num_layers, geo.num_slots, spec.page_size, spec.num_kv_heads,
                         spec.head_dim)
        try:
            if self.backend == "cpu":
                self._res = reservation(2 * geo.pool_bytes, geo.super_page_bytes)
            else:
                self._res = reservation(2 * geo.pool_bytes, geo.super_page_bytes, ordinal)
        except MemoryError as e:
            raise ValueError(f"ArenaHot.max_sequences x max_seq_len: cannot reserve "
                             f"{2 * geo.pool_bytes} bytes of address space: {e}") from e
        self._handles: dict[int, list[int]] = {}  # mapped chunk -> its physical handles
        self.mapped = np.zeros(geo.num_chunks, bool)                    # by chunk
        self.mapped_per_range = np.zeros(geo.max_sequences, np.int64)  # mapped chunks per range
        self._uses: list[Any] = []                # migration tokens since the last quiesce
        self.num_quiesces = 0
        self.peak_mapped_chunks = 0
        self._map(0)  # the null chunk (never charged, never unmapped before close)
        self._pools = self._make_pools()

    # -- chunks ----------------------------------------------------------------------------------

    def _offsets(self, chunk: int) -> list[int]:
        geo = self.geometry
        start = chunk * geo.pages_per_chunk * geo.pool_page_bytes
        one = [start + i * geo.super_page_bytes for i in range(geo.super_pages_per_chunk)]
        return one + [geo.pool_bytes + o for o in one]

    def _map(self, chunk: int) -> None:
        offsets = self._offsets(chunk)
        handles = self._res.create_physical_many(len(offsets))
        try:
            self._res.map_many(offsets, handles)
        except BaseException:
            self._res.release_physical_many(handles)
            raise
        self._handles[chunk] = handles
        self.mapped[chunk] = True
        if chunk:
            self.mapped_per_range[(chunk - 1) // self.geometry.chunks_per_range] += 1
        self.peak_mapped_chunks = max(self.peak_mapped_chunks, len(self._handles) - 1)

    def is_mapped(self, chunk: int) -> bool:
        return chunk in self._handles

    @property
    def num_mapped(self) -> int:
        """Mapped chunks, the null chunk excluded."""
        return len(self._handles) - 1

    def mapped_chunks(self) -> list[int]:
        return [c for c in self._handles if c]

    def map(self, chunks: list[int]) -> bool:
        """Maps ``chunks`` (unmapped, not the null chunk) under governor charges, all or
        nothing; False when the budget (or the driver) cannot take them."""
        geo, done = self.geometry, []
        for c in chunks:
            try:
                lease = self._governor.reserve(_D, geo.chunk_bytes)
            except BudgetExceededError:
                break
            try:
                self._map(c)
            except MemoryError:  # the driver is out of memory: a capacity refusal
                lease.release()
                break
            lease.commit()
            done.append(c)
        if len(done) == len(chunks):
            return True
        self.unmap(done, quiesce=False)  # NOTE: never read: mapped by this call
        return False

    def unmap(self, chunks: list[int], *, quiesce: bool = True) -> None:
        """Unmaps ``chunks`` (mapped; nothing of them allocated), after every reader finished
        (``quiesce``), releasing their physical memory and governor charges."""
        if not chunks:
            return
        if quiesce:
            self.quiesce()
        for c in chunks:
            handles = self._handles.pop(c)
            self.mapped[c] = False
            self.mapped_per_range[(c - 1) // self.geometry.chunks_per_range] -= 1
            self._res.unmap_many(self._offsets(c))
            self._res.release_physical_many(handles)
            self._governor.release_committed(_D, self.geometry.chunk_bytes)

    def note_use(self, token: Any) -> None:
        """A migration that reads or writes the pools; :meth:`quiesce` waits for it."""
        self._uses.append(token)
        if len(self._uses) > 64:  # keep the list short: drop the finished ones
            self._uses = [t for t in self._uses if not _ready(t)]

    def quiesce(self) -> None:
        """Waits for every device access to the pools that may still run."""
        self.num_quiesces += 1
        self._wait_for_device()

    def _wait_for_device(self) -> None:
        for t in [*self._uses, *(p.data for p in self._pools)]:
            try:
                t.block_until_ready()
            except Exception:  # noqa: BLE001, S110 - a failed step: it reads nothing any more
                pass
        self._uses = []

    # -- pools -----------------------------------------------------------------------------------

    def _make_pools(self) -> tuple[Any, Any]:
        from jax_kvcm._arena_pool import ArenaPool
        base, pool_bytes = self._res.base, self.geometry.pool_bytes
        if self.backend == "cpu":
            return tuple(ArenaPool.by_address(jax.device_put(np.int32(0), self._device),
                                              base + i * pool_bytes, self._logical, self._dtype)
                         for i in range(2))
        return tuple(ArenaPool.over_array(jax.dlpack.from_dlpack(
            self._res.dlpack(i * pool_bytes, list(self._physical), self._dtype.name)))
            for i in range(2))

    @property
    def pools(self) -> tuple[Any, Any]:
        return self._pools

    def set_pools(self, pools: tuple[Any, Any]) -> None:
        self._pools = pools

    def check_pools(self, pools: tuple[Any, Any], name: str) -> None:
        """ValueError unless ``pools`` are this arena's memory (XLA did not copy them)."""
        base = self._res.base
        for i, p in enumerate(pools):
            if p.unsafe_buffer_pointer() != base + i * self.geometry.pool_bytes:
                raise ValueError(f"{name}[{i}] is not the arena's memory (the step copied the "
                                 "pool: donate the caches)")

    def rebuild_pools(self) -> bool:
        """New pool objects over the same memory (the old ones were consumed by a failed
        step): the content is intact."""
        self._pools = self._make_pools()
        return True

    # -- host access (tests, checks) -------------------------------------------------------------

    def read_page(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of K and V page ``slot`` (``[L, P, Hkv, D]`` each, raw bytes as uint8),
        after every dispatched device access is done (the copy does not order itself after
        XLA's stream)."""
        self._wait_for_device()
        geo = self.geometry
        out = []
        for i in range(2):
            buf = np.empty(geo.pool_page_bytes, np.uint8)
            self._res.read(i * geo.pool_bytes + slot * geo.pool_page_bytes, buf.ctypes.data,
                           buf.nbytes)
            out.append(buf)
        return out[0], out[1]

    def counters(self) -> dict[str, int]:
        r = self._res
        return {"num_map_calls": r.num_map_calls, "num_unmap_calls": r.num_unmap_calls,
                "num_create_calls": r.num_create_calls,
                "num_release_calls": r.num_release_calls,
                "mapped_bytes": r.mapped_bytes, "physical_bytes": r.physical_bytes}

    def close(self) -> None:
        """Waits for every reader, unmaps everything, frees the reservation."""
        if self._res.closed:
            return
        self.quiesce()
        self._pools = ()
        self._handles = {}
        self._res.close()


def _ready(token: Any) -> bool:
    try:
        return bool(token.is_ready())
    except Exception:  # noqa: BLE001 - a failed computation is done
        return True
