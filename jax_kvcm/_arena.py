"""The contiguous arena: one virtual reservation per hot pool group, a contiguous page range per
sequence, physical memory mapped on demand (DESIGN.md §5).

Geometry (one hot pool group; K and V pools ``[num_layers, num_slots, tokens_per_page,
num_kv_heads, head_dim]`` laid out back to back in one reservation, K first):

- a *slot* is one page across all ``2 * num_layers`` pool-layers (as in the paged backend);
  slot 0 is the null page.
- a *chunk* is ``pages_per_chunk`` consecutive slots; in each pool-layer it covers
  ``lcm(slot_bytes, super_page_bytes)`` bytes, i.e. whole super-pages. Physical memory is mapped
  and charged per chunk (``2 * num_layers * super_pages_per_chunk`` super-pages).
- chunk 0 holds the null page (mapped at construction); sequence range ``r`` owns chunks
  ``[1 + r * C, 1 + (r + 1) * C)``, ``C = ceil(max_pages_per_sequence / pages_per_chunk)``, so a
  sequence's page ``i`` lives at slot ``base_slot + i`` and its page table is ``base + arange``.

Life of a range: FREE (nothing mapped) -> ACTIVE (a sequence grows it chunk by chunk, against the
byte budget) -> PARKED on close, still mapped, adopted whole by a later admission (no map/unmap in
steady state) -> reclaimed (unmapped) only under pressure or at teardown, and only after the
fence of the last dispatched step that may read it is complete.

Prefix aliasing: a closing sequence's fully committed chunks enter a refcounted span registry
keyed by the caller's chunk keys (the chained block key at each chunk's end); a later admission
with the same keys maps the *same* physical chunks into its own range (zero copy, zero budget).
A parked range keeps the registered chunks it maps (its span signature) and is preferably handed
to an admission with that prefix (prefix-affine adoption). Registered chunks up to ``protected_span_fraction`` of the
budget are exempt from pressure spills.

Fences: any object with ``is_ready() -> bool`` and ``block_until_ready()`` (a ``jax.Array`` output
of the step is one). Capacity failure is returned as a value (``None`` / ``False``); misuse raises.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from jax_kvcm._types import check_count

if TYPE_CHECKING:
    from jax_kvcm._step_batch import StepBatch

__all__ = [
    "Arena",
    "ArenaConfig",
    "ArenaHostStore",
    "ArenaIndexRing",
    "ArenaLayout",
    "ArenaSequence",
    "ArenaStats",
    "ArenaSuspend",
]

_ADDRESS_SPACE_BYTES = 1 << 47  # user virtual address space on x86-64 / the GPU's VA limit


class Fence(Protocol):
    def is_ready(self) -> bool: ...
    def block_until_ready(self) -> Any: ...


# -- configuration ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ArenaConfig:
    """Options of the arena hot backend (validated at construction; errors name the field).

    - ``max_sequences``: ranges in the reservation (the most sequences alive at once).
    - ``max_pages_per_sequence``: per-request maximum, in pages; sizes every range.
    - ``budget_bytes``: physical device bytes the arena may map (null chunk included).
    - ``super_page_bytes``: mapping granularity (2 MiB default); a multiple of the driver's.
    - ``adoption``: park closed ranges still mapped and hand them whole to the next admission.
    - ``prefix_aliasing``: keep closing sequences' committed chunks in the span registry.
    - ``protected_span_fraction``: fraction of the budget whose registered spans pressure never
      spills (in [0, 1)).
    """

    max_sequences: int
    max_pages_per_sequence: int
    budget_bytes: int
    super_page_bytes: int = 2 << 20
    adoption: bool = True
    prefix_aliasing: bool = True
    protected_span_fraction: float = 0.05

    def __post_init__(self) -> None:
        for name, minimum in (("max_sequences", 1), ("max_pages_per_sequence", 1),
                              ("budget_bytes", 1), ("super_page_bytes", 1)):
            object.__setattr__(self, name, check_count(getattr(self, name), f"ArenaConfig.{name}",
                                                       minimum=minimum))
        sp = self.super_page_bytes
        if sp & (sp - 1):
            raise ValueError(f"ArenaConfig.super_page_bytes must be a power of two, got {sp}")
        for name in ("adoption", "prefix_aliasing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ArenaConfig.{name} must be a bool, got {getattr(self, name)!r}")
        f = self.protected_span_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
            raise ValueError(f"ArenaConfig.protected_span_fraction must be in [0, 1), got {f!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class ArenaLayout:
    """The hot layout of the pool group the arena backs (as the paged pools')."""

    num_layers: int
    tokens_per_page: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "tokens_per_page", "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, check_count(getattr(self, name), f"ArenaLayout.{name}",
                                                       minimum=1))
        if self.dtype not in ("float32", "float16", "bfloat16", "int8", "uint8"):
            raise ValueError(f"ArenaLayout.dtype must be float32, float16, bfloat16, int8 or "
                             f"uint8, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}[self.dtype]

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot in one pool-layer."""
        return self.tokens_per_page * self.num_kv_heads * self.head_dim * self.itemsize


# -- results ---------------------------------------------------------------------------------


class ArenaSuspend(enum.Enum):
    SUSPENDED = "suspended"
    MUST_RECOMPUTE = "must_recompute"  # the host could not take it; the sequence is unchanged


@dataclasses.dataclass(slots=True)
class ArenaSequence:
    """One admitted sequence: ``base_slot + i`` is the slot of its page ``i``.

    ``num_aliased_pages`` pages at the front were found in the span registry at admission (their
    contents are already in place: skip their prefill; ``num_tokens`` starts after them). ``num_pages`` is how many pages are
    mapped for it (``ensure``). ``suspended`` holds its saved bytes while suspended.
    """

    seq_id: int
    base_slot: int
    num_aliased_pages: int
    num_pages: int = 0
    suspended: np.ndarray | None = None
    num_tokens: int = 0  # tokens written by the steps :meth:`Arena.prepare_step` built
    _range: _Range | None = dataclasses.field(default=None, repr=False)

    @property
    def active(self) -> bool:
        return self._range is not None

    def page_table(self, num_pages: int | None = None) -> np.ndarray:
        """int32 ``[num_pages]`` slots of its first pages: ``base_slot + arange``."""
        n = self.num_pages if num_pages is None else num_pages
        return np.arange(self.base_slot, self.base_slot + n, dtype=np.int32)


@dataclasses.dataclass(frozen=True, slots=True)
class ArenaStats:
    """Counters since construction (calls into the native reservation are counted there)."""

    num_map_calls: int
    num_unmap_calls: int
    num_create_calls: int
    num_release_calls: int
    mapped_bytes: int
    physical_bytes: int
    budget_chunks: int
    used_chunks: int
    num_active: int
    num_parked: int
    num_free_ranges: int
    num_adoptions: int
    num_fresh_ranges: int
    num_alias_hits: int
    num_aliased_chunks: int
    num_spans: int
    num_spilled_spans: int
    num_reclaimed_ranges: int
    num_blocking_drains: int


# -- internals -------------------------------------------------------------------------------


class _Chunk:
    """Physical memory of one chunk: its super-page handles, and who maps or holds it."""

    __slots__ = ("handles", "refs", "key")

    def __init__(self, handles: list[int]) -> None:
        self.handles = handles
        self.refs = 0  # ranges mapping it + 1 while registered
        self.key: Hashable | None = None  # registry key while registered


class _Range:
    __slots__ = ("index", "first_chunk", "chunks", "fence", "seq")

    def __init__(self, index: int, first_chunk: int, num_chunks: int) -> None:
        self.index = index
        self.first_chunk = first_chunk
        self.chunks: list[_Chunk | None] = [None] * num_chunks
        self.fence: Fence | None = None  # last dispatched step that may read the range
        self.seq: ArenaSequence | None = None

    def num_mapped(self) -> int:
        return sum(c is not None for c in self.chunks)


def _native_backend(kind: str) -> tuple[Any, str]:
    from jax_kvcm import _ffi

    if kind == "auto":
        import jax

        kind = "cuda" if jax.default_backend() == "gpu" else "cpu"
    if kind == "cpu":
        return _ffi._kvcm_cpu, "cpu"
    if kind == "cuda":
        if _ffi._kvcm_cuda is None:
            raise RuntimeError("the arena's CUDA backend needs the CUDA extension: "
                               f"{_ffi.CUDA_IMPORT_ERROR}")
        return _ffi._kvcm_cuda, "cuda"
    raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', got {kind!r}")


def _wait(fence: Fence | None) -> None:
    if fence is not None:
        fence.block_until_ready()


def _ready(fence: Fence | None) -> bool:
    return fence is None or fence.is_ready()


# -- the arena -------------------------------------------------------------------------------


class Arena:
    """One pool group's contiguous arena (see the module docstring for the geometry).

    ``backend``: "cpu" (memfd super-pages), "cuda" (VMM), or "auto" (cuda when JAX's default
    backend is a GPU). Raises ValueError naming the ArenaConfig field for a super-page that is not
    a multiple of the driver's granularity, a reservation beyond the address space or a budget
    below two chunks; RuntimeError (from the CUDA backend) when the driver has no VMM support.
    """

    def __init__(self, config: ArenaConfig, layout: ArenaLayout, *, backend: str = "auto",
                 device: int = -1) -> None:
        if not isinstance(config, ArenaConfig):
            raise TypeError(f"config must be an ArenaConfig, got {type(config).__name__}")
        if not isinstance(layout, ArenaLayout):
            raise TypeError(f"layout must be an ArenaLayout, got {type(layout).__name__}")
        native, self.backend = _native_backend(backend)
        gran = native.arena_granularity() if self.backend == "cpu" else \
            native.vmm_granularity(device)
        sp = config.super_page_bytes
        if sp % gran:
            raise ValueError(f"ArenaConfig.super_page_bytes ({sp}) must be a multiple of the "
                             f"{self.backend} driver's granularity {gran}")
        self.config, self.layout = config, layout
        sb = layout.slot_bytes
        chunk_pl = math.lcm(sb, sp)
        self.pages_per_chunk = chunk_pl // sb
        self.super_pages_per_chunk = chunk_pl // sp  # per pool-layer
        self.num_pool_layers = 2 * layout.num_layers
        self.chunks_per_range = -(-config.max_pages_per_sequence // self.pages_per_chunk)
        # NOTE: only chunks that can be full (all pages within the per-request maximum) alias.
        self.max_span_chunks = config.max_pages_per_sequence // self.pages_per_chunk
        self.num_chunks = 1 + config.max_sequences * self.chunks_per_range
        self.num_slots = self.num_chunks * self.pages_per_chunk
        self._pool_layer_bytes = self.num_slots * sb
        self._chunk_pl_bytes = chunk_pl
        self.chunk_bytes = self.num_pool_layers * chunk_pl  # physical bytes per chunk
        reservation = self.num_pool_layers * self._pool_layer_bytes
        if reservation > _ADDRESS_SPACE_BYTES:
            raise ValueError(
                f"the arena reservation ({reservation} bytes = ArenaConfig.max_sequences x "
                f"ArenaConfig.max_pages_per_sequence rounded to chunks) exceeds the address "
                f"space ({_ADDRESS_SPACE_BYTES} bytes)")
        self.budget_chunks = config.budget_bytes // self.chunk_bytes
        if self.budget_chunks < 2:
            raise ValueError(f"ArenaConfig.budget_bytes ({config.budget_bytes}) must cover at "
                             f"least two chunks of {self.chunk_bytes} bytes (the null chunk "
                             f"and one sequence chunk)")
        self._protected_chunks = int(config.protected_span_fraction * self.budget_chunks)
        try:
            if self.backend == "cpu":
                self._res = native.ArenaReservation(reservation, sp)
            else:
                self._res = native.VmmReservation(reservation, sp, device)
        except MemoryError as e:
            raise ValueError(f"ArenaConfig.max_sequences x ArenaConfig.max_pages_per_sequence: "
                             f"cannot reserve {reservation} bytes: {e}") from e
        self._ranges = [_Range(r, 1 + r * self.chunks_per_range, self.chunks_per_range)
                        for r in range(config.max_sequences)]
        self._free: list[_Range] = list(reversed(self._ranges))  # never mapped / reclaimed
        self._parked: OrderedDict[int, _Range] = OrderedDict()  # oldest first
        self._registry: OrderedDict[Hashable, _Chunk] = OrderedDict()  # LRU first
        self._used_chunks = 0
        self._seq_ids = itertools.count()
        self._counts = dict.fromkeys(
            ("adoptions", "fresh", "alias_hits", "aliased_chunks", "spilled_spans",
             "reclaimed_ranges", "blocking_drains"), 0)
        self._closed = False
        self._null = self._new_chunk()
        self._map_chunk(self._null, 0)

    # -- geometry --------------------------------------------------------------------------

    @property
    def base_address(self) -> int:
        """Address of the reservation's first byte (the K pool's slot 0 of layer 0)."""
        return int(self._res.base)

    @property
    def pool_shape(self) -> tuple[int, int, int, int, int]:
        """``[num_layers, num_slots, tokens_per_page, num_kv_heads, head_dim]`` of K and V."""
        lay = self.layout
        return (lay.num_layers, self.num_slots, lay.tokens_per_page, lay.num_kv_heads,
                lay.head_dim)

    def _offsets(self, chunk: int) -> list[int]:
        """Byte offsets of every super-page of ``chunk`` (pool-layer major)."""
        sp = self.config.super_page_bytes
        out = []
        for pl in range(self.num_pool_layers):
            start = pl * self._pool_layer_bytes + chunk * self._chunk_pl_bytes
            out.extend(start + j * sp for j in range(self.super_pages_per_chunk))
        return out

    # -- physical chunks -------------------------------------------------------------------

    def _new_chunk(self) -> _Chunk:
        n = self.num_pool_layers * self.super_pages_per_chunk
        handles: list[int] = []
        try:
            for _ in range(n):
                handles.append(self._res.create_physical())
        except BaseException:
            for h in handles:
                self._res.release_physical(h)
            raise
        self._used_chunks += 1
        return _Chunk(handles)

    def _drop_ref(self, chunk: _Chunk) -> None:
        chunk.refs -= 1
        if chunk.refs == 0:
            for h in chunk.handles:
                self._res.release_physical(h)
            self._used_chunks -= 1

    def _map_chunk(self, chunk: _Chunk, index: int) -> None:
        for off, h in zip(self._offsets(index), chunk.handles):
            self._res.map(off, h)
        chunk.refs += 1

    def _unmap_chunk(self, rng: _Range, i: int) -> None:
        """Unmaps chunk ``i`` of ``rng``; the caller has waited for ``rng.fence``."""
        chunk = rng.chunks[i]
        assert chunk is not None
        for off in self._offsets(rng.first_chunk + i):
            self._res.unmap(off)
        rng.chunks[i] = None
        self._drop_ref(chunk)

    @property
    def num_free_chunks(self) -> int:
        """Chunks the budget can still map without reclaiming anything."""
        return self.budget_chunks - self._used_chunks

    # -- admission -------------------------------------------------------------------------

    def _registered_prefix(self, keys: Sequence[Hashable]) -> list[_Chunk]:
        out = []
        if self.config.prefix_aliasing:
            for k in keys[:self.max_span_chunks]:
                c = self._registry.get(k)
                if c is None:
                    break
                out.append(c)
        return out

    def _pick_range(self, spans: list[_Chunk]) -> _Range | None:
        if self.config.adoption and self._parked:
            best, best_match = None, -1
            for rng in self._parked.values():  # oldest first
                match = 0
                while (match < len(spans) and match < len(rng.chunks)
                       and rng.chunks[match] is spans[match]):
                    match += 1
                shared = sum(c is not None and c.key is not None for c in rng.chunks[match:])
                # NOTE: prefer the longest prefix already in place, then ranges whose other
                # chunks are private (no unmap needed before writing them).
                score = match * 2 + (shared == 0)
                if match > 0 or shared == 0:
                    if score > best_match:
                        best, best_match = rng, score
            if best is not None:
                del self._parked[best.index]
                self._counts["adoptions"] += 1
                return best
        if self._free:
            self._counts["fresh"] += 1
            return self._free.pop()
        if self._parked:  # only ranges mapping other spans are left: take the oldest
            _, rng = self._parked.popitem(last=False)
            self._counts["adoptions"] += 1
            return rng
        return None

    def admit(self, prefix_keys: Sequence[Hashable] = ()) -> ArenaSequence | None:
        """A new sequence with a contiguous range, or None when every range is in use.

        ``prefix_keys[i]`` identifies the sequence's content through the end of chunk ``i``
        (pages ``[0, (i + 1) * pages_per_chunk)``), e.g. the chained block key of that page.
        Registered chunks matching a prefix of them are mapped into the new range (their pages
        count in ``num_aliased_pages`` and ``num_pages``); nothing else is mapped yet.
        """
        self._check_open()
        spans = self._registered_prefix(list(prefix_keys))
        rng = self._pick_range(spans)
        if rng is None:
            return None
        # NOTE: chunks the admission will write must be private to it: unmap every chunk that
        # maps a registered span other than the matched one (after the range's last reader).
        for i, c in enumerate(rng.chunks):
            if c is None:
                continue
            if (i < len(spans) and c is spans[i]) or (i >= len(spans) and c.key is None):
                continue
            _wait(rng.fence)
            self._unmap_chunk(rng, i)
        for i, c in enumerate(spans):
            if rng.chunks[i] is None:
                self._map_chunk(c, rng.first_chunk + i)
                rng.chunks[i] = c
            self._registry.move_to_end(c.key)
        if spans:
            self._counts["alias_hits"] += 1
            self._counts["aliased_chunks"] += len(spans)
        aliased = len(spans) * self.pages_per_chunk
        seq = ArenaSequence(seq_id=next(self._seq_ids),
                            base_slot=rng.first_chunk * self.pages_per_chunk,
                            num_aliased_pages=aliased, num_pages=aliased,
                            num_tokens=aliased * self.layout.tokens_per_page, _range=rng)
        rng.seq = seq
        return seq

    def ensure(self, seq: ArenaSequence, num_pages: int) -> bool:
        """Maps physical memory for ``seq``'s first ``num_pages`` pages; False (nothing changed)
        when the budget cannot cover them even after reclaiming parked ranges and unprotected
        spans. Raises ValueError beyond ``max_pages_per_sequence``."""
        rng = self._active_range(seq, "seq")
        num_pages = check_count(num_pages, "num_pages", minimum=0)
        if num_pages > self.config.max_pages_per_sequence:
            raise ValueError(f"num_pages ({num_pages}) exceeds ArenaConfig.max_pages_per_sequence "
                             f"({self.config.max_pages_per_sequence})")
        want = -(-num_pages // self.pages_per_chunk)
        missing = [i for i in range(want) if rng.chunks[i] is None]
        if missing and not self._reclaim(len(missing)):
            return False
        for i in missing:
            c = self._new_chunk()
            self._map_chunk(c, rng.first_chunk + i)
            rng.chunks[i] = c
        seq.num_pages = max(seq.num_pages, num_pages)
        return True

    def record_step(self, seqs: Iterable[ArenaSequence], fence: Fence) -> None:
        """Notes that a dispatched step, complete when ``fence`` is, may read ``seqs``' ranges
        (their unmap waits for it)."""
        for s in seqs:
            self._active_range(s, "seqs").fence = fence

    def close(self, seq: ArenaSequence, committed_keys: Sequence[Hashable] = ()) -> None:
        """Ends ``seq``. ``committed_keys[i]`` (as in :meth:`admit`) for each leading chunk whose
        pages are all committed: those chunks enter the span registry (when aliasing is on). The
        range is parked still mapped (adoption on) or reclaimed after its fence (off)."""
        rng = self._active_range(seq, "seq")
        seq._range = None
        rng.seq = None
        if self.config.prefix_aliasing:
            for i, key in enumerate(list(committed_keys)[:self.max_span_chunks]):
                c = rng.chunks[i]
                if c is None:
                    break
                reg = self._registry.get(key)
                if reg is None and c.key is None:
                    c.key = key
                    c.refs += 1  # the registry's hold
                    self._registry[key] = c
                    reg = c
                if reg is not c:  # NOTE: a duplicate of a registered span: keep ours private
                    break
        if self.config.adoption:
            self._parked[rng.index] = rng
        else:
            self._reclaim_range(rng, blocking=True)

    # -- reclaim ---------------------------------------------------------------------------

    def _reclaim_range(self, rng: _Range, *, blocking: bool) -> bool:
        if not _ready(rng.fence):
            if not blocking:
                return False
            self._counts["blocking_drains"] += 1
        _wait(rng.fence)  # NOTE: never unmap under a step that may still read the range
        for i, c in enumerate(rng.chunks):
            if c is not None:
                self._unmap_chunk(rng, i)
        rng.fence = None
        self._parked.pop(rng.index, None)
        self._free.append(rng)
        self._counts["reclaimed_ranges"] += 1
        return True

    def _spill_spans(self, need: int, *, protect: int) -> None:
        """Drops registered chunks no range maps (LRU first) until ``need`` chunks are free,
        keeping the newest ``protect`` chunks of registry."""
        spillable = len(self._registry) - protect
        for key in list(self._registry):
            if self.num_free_chunks >= need or spillable <= 0:
                return
            c = self._registry[key]
            if c.refs == 1:  # only the registry holds it
                del self._registry[key]
                c.key = None
                self._drop_ref(c)
                self._counts["spilled_spans"] += 1
                spillable -= 1

    def _reclaim(self, need: int) -> bool:
        """Frees budget for ``need`` chunks. The ladder: parked ranges whose readers are done
        (oldest first), unprotected spans, then a blocking drain of the remaining parked ranges
        (the seed's bug (b): frees whose fence is pending must not deadlock an allocation that
        needs them), each rung retried before the next."""
        if self.num_free_chunks >= need:
            return True
        for blocking in (False, True):
            for rng in list(self._parked.values()):
                if self.num_free_chunks >= need:
                    return True
                if rng.num_mapped():
                    self._reclaim_range(rng, blocking=blocking)
            self._spill_spans(need, protect=min(self._protected_chunks, len(self._registry)))
            if self.num_free_chunks >= need:
                return True
        return False

    def trim(self) -> int:
        """Reclaims every parked range (waiting for their fences) and every span no range maps;
        returns the number of chunks freed."""
        self._check_open()
        before = self._used_chunks
        for rng in list(self._parked.values()):
            self._reclaim_range(rng, blocking=True)
        self._spill_spans(self.budget_chunks + 1, protect=0)
        return before - self._used_chunks

    # -- suspend / resume ------------------------------------------------------------------

    def _copy_pages(self, rng: _Range, num_pages: int, host: np.ndarray, to_host: bool) -> None:
        sb = self.layout.slot_bytes
        n = num_pages * sb
        base = rng.first_chunk * self.pages_per_chunk * sb
        addr = host.ctypes.data
        for pl in range(self.num_pool_layers):
            off = pl * self._pool_layer_bytes + base
            if to_host:
                self._res.read(off, addr + pl * n, n)
            else:
                self._res.write(off, addr + pl * n, n)

    def suspend(self, seq: ArenaSequence, host: ArenaHostStore) -> ArenaSuspend:
        """Saves ``seq``'s pages to ``host`` and releases its range (parked, adoptable).

        NOTE: the host bytes are reserved before anything changes (the seed's fourth bug): when
        ``host`` cannot take them, MUST_RECOMPUTE is returned and ``seq`` is untouched (still
        active, still mapped); the caller drops it and recomputes.
        """
        rng = self._active_range(seq, "seq")
        nbytes = seq.num_pages * self.num_pool_layers * self.layout.slot_bytes
        buf = host.reserve(nbytes)
        if buf is None:
            return ArenaSuspend.MUST_RECOMPUTE
        _wait(rng.fence)  # the last step's writes are in the pages
        self._copy_pages(rng, seq.num_pages, buf, to_host=True)
        seq.suspended = buf
        self.close(seq)
        return ArenaSuspend.SUSPENDED

    def resume(self, seq: ArenaSequence, host: ArenaHostStore) -> bool:
        """Gives a suspended ``seq`` a range again and restores its pages byte-identical; False
        (still suspended, nothing changed) when no range or budget is available."""
        self._check_open()
        if seq.active or seq.suspended is None:
            raise ValueError("seq is not suspended")
        n = seq.num_pages
        fresh = self.admit()
        if fresh is None:
            return False
        if not self.ensure(fresh, n):
            self.close(fresh)
            return False
        rng = fresh._range
        assert rng is not None
        self._copy_pages(rng, n, seq.suspended, to_host=False)
        host.release(seq.suspended)
        seq.suspended = None
        seq.base_slot, seq.num_aliased_pages, seq._range = fresh.base_slot, 0, rng
        rng.seq = seq
        return True

    # -- data access -----------------------------------------------------------------------

    def write_pages(self, seq: ArenaSequence, first_page: int, k: np.ndarray,
                    v: np.ndarray) -> None:
        """Host write of whole pages ``[first_page, first_page + n)`` of ``seq``:
        ``k``/``v`` are ``[num_layers, n, tokens_per_page, num_kv_heads, head_dim]``."""
        rng = self._active_range(seq, "seq")
        self._page_io(rng, first_page, k, v, write=True)

    def read_pages(self, seq: ArenaSequence, first_page: int,
                   num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of ``seq``'s pages ``[first_page, first_page + num_pages)`` (K, V), each
        ``[num_layers, num_pages, tokens_per_page, num_kv_heads, head_dim]``; waits for the
        range's fence first."""
        rng = self._active_range(seq, "seq")
        lay = self.layout
        shape = (lay.num_layers, num_pages, lay.tokens_per_page, lay.num_kv_heads, lay.head_dim)
        k = np.empty(shape, np.dtype(lay.dtype) if lay.dtype != "bfloat16" else np.uint16)
        v = np.empty_like(k)
        _wait(rng.fence)
        self._page_io(rng, first_page, k, v, write=False)
        return k, v

    def write_tokens(self, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Host write of single tokens: token ``t`` goes to flat token slot ``slot_mapping[t]``
        (``page_slot * tokens_per_page + offset``; -1: padding, skipped). ``k``/``v`` are
        ``[num_layers, T, num_kv_heads, head_dim]``. Every slot must lie in a mapped chunk of
        an active sequence that no other range shares (never a registered span: writing one
        would change every alias); ValueError otherwise, nothing written. Waits for the fence
        of the ranges written first (the CPU step path: the arena is written through here)."""
        self._check_open()
        lay = self.layout
        sm = np.asarray(slot_mapping)
        T = sm.shape[0] if sm.ndim == 1 else -1
        tok = lay.num_kv_heads * lay.head_dim * lay.itemsize
        if (T < 0 or k.shape != v.shape or k.ndim != 4 or k.shape[0] != lay.num_layers
                or k.shape[1] != T or k.nbytes != lay.num_layers * T * tok):
            raise ValueError(f"k and v must be [{lay.num_layers}, {T}, {lay.num_kv_heads}, "
                             f"{lay.head_dim}] of {lay.dtype} for slot_mapping of shape "
                             f"{sm.shape}, got {k.shape} and {v.shape}")
        keep = np.flatnonzero(sm >= 0)
        sm = sm[keep].astype(np.int64)
        chunk = sm // (lay.tokens_per_page * self.pages_per_chunk)
        C = self.chunks_per_range
        ranges = set()
        for c in np.unique(chunk).tolist():
            r, i = divmod(c - 1, C)
            rng = self._ranges[r] if 0 <= r < len(self._ranges) else None
            ch = rng.chunks[i] if rng is not None and rng.seq is not None else None
            if c < 1 or ch is None or ch.key is not None or ch.refs != 1:
                raise ValueError(f"slot_mapping writes chunk {c}, which is not a private mapped "
                                 "chunk of an active sequence")
            ranges.add(r)
        for r in ranges:
            _wait(self._ranges[r].fence)
        k = np.ascontiguousarray(k[:, keep])
        v = np.ascontiguousarray(v[:, keep])
        # NOTE: consecutive token slots are consecutive bytes: one write per run per pool-layer.
        cut = np.flatnonzero(np.diff(sm) != 1) + 1
        starts, ends = np.r_[0, cut], np.r_[cut, sm.size]
        for pool, arr in enumerate((k, v)):
            for layer in range(lay.num_layers):
                base = (pool * lay.num_layers + layer) * self._pool_layer_bytes
                addr = arr.ctypes.data + layer * sm.size * tok
                for a, b in zip(starts.tolist(), ends.tolist()):
                    self._res.write(base + int(sm[a]) * tok, addr + a * tok, (b - a) * tok)

    def _page_io(self, rng: _Range, first: int, k: np.ndarray, v: np.ndarray, *,
                 write: bool) -> None:
        lay, sb = self.layout, self.layout.slot_bytes
        n = k.shape[1]
        if (k.shape != v.shape or k.shape[0] != lay.num_layers
                or k.nbytes != lay.num_layers * n * sb):
            raise ValueError(f"k and v must be [{lay.num_layers}, n, {lay.tokens_per_page}, "
                             f"{lay.num_kv_heads}, {lay.head_dim}] of {lay.dtype}, got "
                             f"{k.shape} and {v.shape}")
        if first < 0 or first + n > self.chunks_per_range * self.pages_per_chunk:
            raise ValueError(f"pages [{first}, {first + n}) are outside the sequence's range")
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        slot = rng.first_chunk * self.pages_per_chunk + first
        for pool, arr in enumerate((k, v)):
            for layer in range(lay.num_layers):
                off = (pool * lay.num_layers + layer) * self._pool_layer_bytes + slot * sb
                addr = arr.ctypes.data + layer * n * sb
                if write:
                    self._res.write(off, addr, n * sb)
                else:
                    self._res.read(off, addr, n * sb)

    def pool_arrays(self) -> tuple[Any, Any]:
        """(K, V) ``jax.Array``s over the reservation itself, no copy (DLPack).

        On GPU these are the pools a jitted step donates (XLA keeps their pointer). On CPU they
        are for reading ops only: a donated step copies the whole input, touching unmapped
        super-pages (DESIGN.md §5). Nothing may run a whole-pool op (copy, print, reduction) on
        them: only slots of mapped chunks are addressable.
        """
        import jax

        self._check_open()
        shape = list(self.pool_shape)
        k = jax.dlpack.from_dlpack(self._res.dlpack(0, shape, self.layout.dtype))
        v = jax.dlpack.from_dlpack(self._res.dlpack(
            self.num_pool_layers // 2 * self._pool_layer_bytes, shape, self.layout.dtype))
        return k, v

    # -- steps -----------------------------------------------------------------------------

    def prepare_step(self, work: Sequence[tuple[ArenaSequence, int]], *, batch: int,
                     tokens: int) -> StepBatch | None:
        """The :class:`StepBatch` of one step appending ``n`` tokens to each ``(seq, n)``, padded
        to ``batch`` rows and ``tokens`` tokens, page tables ``[batch, max_pages_per_sequence]``
        (``base_slot + arange``, padding the null page 0); maps the pages the new tokens need.

        Returns None (no sequence advanced) when the budget cannot cover them; pages mapped for
        earlier rows of the call stay mapped (they are the sequences' next pages anyway). The
        arrays are fresh each call, so a dispatched step never sees them rewritten.
        """
        from jax_kvcm._step_batch import StepBatch

        self._check_open()
        total = sum(check_count(n, "num_new_tokens", minimum=0) for _, n in work)
        if len(work) > batch or total > tokens:
            raise ValueError(f"work ({len(work)} rows, {total} tokens) exceeds batch={batch} / "
                             f"tokens={tokens}")
        tpp = self.layout.tokens_per_page
        for seq, n in work:
            if not self.ensure(seq, -(-(seq.num_tokens + n) // tpp)):
                return None
        width = self.config.max_pages_per_sequence
        table = np.zeros((batch, width), np.int32)
        seq_lens = np.zeros(batch, np.int32)
        query_start = np.full(batch + 1, total, np.int32)
        slots = np.full(tokens, -1, np.int32)
        positions = np.zeros(tokens, np.int32)
        t = 0
        for b, (seq, n) in enumerate(work):
            end = seq.num_tokens + n
            npg = -(-end // tpp)
            table[b, :npg] = np.arange(seq.base_slot, seq.base_slot + npg, dtype=np.int32)
            seq_lens[b] = end
            query_start[b] = t
            pos = np.arange(seq.num_tokens, end, dtype=np.int32)
            positions[t:t + n] = pos
            slots[t:t + n] = (seq.base_slot + pos // tpp) * tpp + pos % tpp
            t += n
            seq.num_tokens = end
        return StepBatch(page_table=table, seq_lens=seq_lens, query_start=query_start,
                         slot_mapping=slots, positions=positions)

    # -- capacity planning -----------------------------------------------------------------

    def chunks_for(self, num_pages: int) -> int:
        """Physical chunks a sequence of ``num_pages`` pages maps (its own, no aliasing)."""
        return -(-check_count(num_pages, "num_pages", minimum=0) // self.pages_per_chunk)

    def max_num_sequences(self, num_pages: int) -> int:
        """How many sequences of ``num_pages`` pages the budget and the ranges hold at once
        (every chunk private; aliased prefixes only make room)."""
        per = max(1, self.chunks_for(num_pages))
        return min(self.config.max_sequences, (self.budget_chunks - 1) // per)

    def max_pages_for(self, num_sequences: int) -> int:
        """The most pages each of ``num_sequences`` sequences can have at once (whole chunks,
        capped by ``max_pages_per_sequence``); 0 when they do not fit at all."""
        n = check_count(num_sequences, "num_sequences", minimum=1)
        if n > self.config.max_sequences:
            return 0
        chunks = (self.budget_chunks - 1) // n
        return min(self.config.max_pages_per_sequence, chunks * self.pages_per_chunk)

    def can_grow(self, num_chunks: int) -> bool:
        """True when ``num_chunks`` more chunks fit without spilling protected spans (free
        budget plus what parked ranges and unprotected unreferenced spans hold)."""
        reclaimable = sum(r.num_mapped() for r in self._parked.values()
                          if all(c is None or c.key is None for c in r.chunks))
        spill = sum(c.refs == 1 for c in self._registry.values())
        spill = max(0, spill - self._protected_chunks)
        return self.num_free_chunks + reclaimable + spill >= num_chunks

    # -- teardown and stats ----------------------------------------------------------------

    def close_arena(self) -> None:
        """Waits for every recorded fence, unmaps every range, releases every physical handle
        and frees the reservation. Active sequences become unusable."""
        if self._closed:
            return
        for rng in self._ranges:
            _wait(rng.fence)
            if rng.seq is not None:
                rng.seq._range = None
                rng.seq = None
            self._parked.pop(rng.index, None)
            for i, c in enumerate(rng.chunks):
                if c is not None:
                    self._unmap_chunk(rng, i)
        for key in list(self._registry):
            c = self._registry.pop(key)
            c.key = None
            self._drop_ref(c)
        for off in self._offsets(0):
            self._res.unmap(off)
        self._drop_ref(self._null)
        self._res.close()
        self._closed = True

    def native_counters(self) -> dict[str, int]:
        """Live counters of the native reservation (they stay readable after close_arena)."""
        r = self._res
        return {"num_map_calls": r.num_map_calls, "num_unmap_calls": r.num_unmap_calls,
                "num_create_calls": r.num_create_calls,
                "num_release_calls": r.num_release_calls, "mapped_bytes": r.mapped_bytes,
                "physical_bytes": r.physical_bytes, "num_physical": r.num_physical}

    def stats(self) -> ArenaStats:
        n = self.native_counters()
        c = self._counts
        return ArenaStats(
            num_map_calls=n["num_map_calls"], num_unmap_calls=n["num_unmap_calls"],
            num_create_calls=n["num_create_calls"], num_release_calls=n["num_release_calls"],
            mapped_bytes=n["mapped_bytes"], physical_bytes=n["physical_bytes"],
            budget_chunks=self.budget_chunks, used_chunks=self._used_chunks,
            num_active=sum(r.seq is not None for r in self._ranges),
            num_parked=len(self._parked), num_free_ranges=len(self._free),
            num_adoptions=c["adoptions"], num_fresh_ranges=c["fresh"],
            num_alias_hits=c["alias_hits"], num_aliased_chunks=c["aliased_chunks"],
            num_spans=len(self._registry), num_spilled_spans=c["spilled_spans"],
            num_reclaimed_ranges=c["reclaimed_ranges"],
            num_blocking_drains=c["blocking_drains"])

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_arena()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the arena is closed")

    def _active_range(self, seq: ArenaSequence, name: str) -> _Range:
        self._check_open()
        if not isinstance(seq, ArenaSequence):
            raise TypeError(f"{name} must be an ArenaSequence, got {type(seq).__name__}")
        rng = seq._range
        if rng is None or rng.seq is not seq or self._ranges[rng.index] is not rng:
            raise ValueError(f"{name} is not an active sequence of this arena")
        return rng


# -- host side helpers -----------------------------------------------------------------------


class ArenaHostStore:
    """Host memory for suspended sequences under a byte limit: ``reserve`` returns a uint8 buffer
    or None (nothing reserved) when the limit would be exceeded."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = check_count(capacity_bytes, "capacity_bytes", minimum=0)
        self.used_bytes = 0

    def reserve(self, nbytes: int) -> np.ndarray | None:
        nbytes = check_count(nbytes, "nbytes", minimum=0)
        if self.used_bytes + nbytes > self.capacity_bytes:
            return None
        self.used_bytes += nbytes
        return np.empty(max(nbytes, 1), np.uint8)[:nbytes]

    def release(self, buf: np.ndarray) -> None:
        self.used_bytes -= buf.nbytes


def _aligned_zeros(shape: tuple[int, int], align: int = 64) -> np.ndarray:
    n = shape[0] * shape[1]
    raw = np.zeros(n * 4 + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip:skip + n * 4].view(np.int32).reshape(shape)


class ArenaIndexRing:
    """Host index buffers for the steps' page tables, reused only after the step that read them.

    The seed's first bug: a staging buffer rewritten for step n+1 while step n had not yet read it
    gives step n stale page indices. ``acquire()`` hands out the next of ``num_buffers`` int32
    ``[rows, width]`` buffers, first waiting for the fence published with its previous use;
    ``publish(fence)`` attaches the consuming step's fence to the last acquired buffer.

    NOTE: the buffers are 64-byte aligned, so JAX on CPU passes them to a step without a copy
    (measured: it then reads them when the step runs, not at dispatch); the fences make it safe.
    """

    def __init__(self, num_buffers: int, rows: int, width: int) -> None:
        n = check_count(num_buffers, "num_buffers", minimum=1)
        shape = (check_count(rows, "rows", minimum=1), check_count(width, "width", minimum=1))
        self._bufs = [_aligned_zeros(shape) for _ in range(n)]
        self._fences: list[Fence | None] = [None] * n
        self._next = 0
        self._last: int | None = None
        self.num_waits = 0

    def acquire(self) -> np.ndarray:
        i = self._next
        if not _ready(self._fences[i]):
            self.num_waits += 1
        _wait(self._fences[i])
        self._fences[i] = None
        self._next = (i + 1) % len(self._bufs)
        self._last = i
        return self._bufs[i]

    def publish(self, fence: Fence) -> None:
        if self._last is None:
            raise ValueError("publish() without a preceding acquire()")
        self._fences[self._last] = fence
        self._last = None

    def fill(self, seqs: Sequence[ArenaSequence], num_pages: Sequence[int]) -> np.ndarray:
        """Acquires a buffer and writes each row ``b`` as ``base_slot + arange(num_pages[b])``,
        padded with the null page 0; rows past ``len(seqs)`` are all 0."""
        buf = self.acquire()
        buf[:] = 0
        width = buf.shape[1]
        for b, (s, n) in enumerate(zip(seqs, num_pages)):
            if n > width:
                raise ValueError(f"num_pages[{b}] ({n}) exceeds the ring's width {width}")
            buf[b, :n] = np.arange(s.base_slot, s.base_slot + n, dtype=np.int32)
        return buf
