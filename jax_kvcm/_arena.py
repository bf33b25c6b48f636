"""The contiguous arena: one virtual reservation per hot pool group, a contiguous page range per
sequence, physical memory mapped on demand (docs/ARCHITECTURE.md §5).

Geometry (one hot pool group; K and V pools ``[num_layers, num_slots, tokens_per_page,
num_kv_heads, head_dim]`` laid out back to back in one reservation, K first):

- a *slot* is one page across all ``2 * num_layers`` pool-layers (as in the paged backend);
  slot 0 is the null page.
- a *chunk* is ``pages_per_chunk`` consecutive slots; in each pool-layer it covers
  ``lcm(slot_bytes, super_page_bytes)`` bytes, i.e. whole super-pages. Physical memory is mapped
  and charged per chunk (``2 * num_layers * super_pages_per_chunk`` super-pages).
- chunk 0 holds the null page (mapped at construction); sequence range ``r`` owns chunks
  ``[1 + r * C, 1 + (r + 1) * C)``, so a sequence's page ``i`` lives at slot ``base_slot + i``
  and its page table is ``base + arange`` -- except after a *partial alias* (below), where the
  pages from ``skip_from`` on sit ``skip`` slots further (two linear runs).
  ``C = ceil((max_pages_per_sequence + max_skip) / pages_per_chunk)``.

Life of a range: FREE (nothing mapped) -> ACTIVE (a sequence grows it chunk by chunk, against the
byte budget) -> PARKED on close, still mapped, adopted whole by a later admission (no map/unmap in
steady state) -> reclaimed (unmapped) only under pressure or at teardown, and only after the
fence of the last dispatched step that may read it is complete.

Prefix aliasing: a closing sequence's private chunks holding committed pages enter a refcounted
span registry under the caller's prefix keys, one per *alias unit* (``alias_unit_pages`` pages;
the key at a unit's end is the chained block key of the whole prefix through it). A later
admission maps the *same* physical chunks into its own range (zero copy, zero budget): whole
chunks, and then possibly one *partial* chunk whose first ``n`` pages (a multiple of the unit)
match. Physical memory is shared per chunk (a super-page per pool-layer is the driver's unit:
on the GPU 2 MiB, 64 pages of an 8B-shaped model), so the partial chunk's remaining slots are
someone else's: the admission never touches them. Its own pages continue at the next chunk
(``skip = pages_per_chunk - n`` slots later), which is why a range has up to ``max_skip =
pages_per_chunk - alias_unit_pages`` spare slots of address space (free: address space costs no
budget). Invariant: every chunk of a range holds logical pages ``[f, f + used)`` at its offsets
``[0, used)``, so a registered chunk is usable exactly where an admission's next logical page is
its ``f``.
A parked range keeps the registered chunks it maps (its span signature) and is preferably handed
to an admission with that prefix (prefix-affine adoption). Registered chunks up to
``protected_span_fraction`` of the budget are exempt from pressure spills.

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
    - ``alias_unit_pages``: granularity of prefix keys and of aliasing, in pages (1: any page
      boundary); must divide the pages per chunk.
    - ``remap_spans``: an admission adopting a parked range whose first chunk is another
      prefix's span (one some admission aliased) unmaps it, after the range's readers, and maps
      its own (True: every admission aliases what the registry has); or leaves it mapped and
      places the sequence after it, aliasing nothing (False: steady state makes no map/unmap
      call, the prompt is prefilled; a range has one more chunk of address space for it).
    """

    max_sequences: int
    max_pages_per_sequence: int
    budget_bytes: int
    super_page_bytes: int = 2 << 20
    adoption: bool = True
    prefix_aliasing: bool = True
    protected_span_fraction: float = 0.05
    alias_unit_pages: int = 1
    remap_spans: bool = True

    def __post_init__(self) -> None:
        for name, minimum in (("max_sequences", 1), ("max_pages_per_sequence", 1),
                              ("budget_bytes", 1), ("super_page_bytes", 1),
                              ("alias_unit_pages", 1)):
            object.__setattr__(self, name, check_count(getattr(self, name), f"ArenaConfig.{name}",
                                                       minimum=minimum))
        sp = self.super_page_bytes
        if sp & (sp - 1):
            raise ValueError(f"ArenaConfig.super_page_bytes must be a power of two, got {sp}")
        for name in ("adoption", "prefix_aliasing", "remap_spans"):
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
    """One admitted sequence: ``base_slot + i + (skip if i >= skip_from else 0)`` is the slot
    of its page ``i`` (``skip`` is 0 unless a partial alias left the rest of a shared chunk).

    ``num_aliased_pages`` pages at the front were found in the span registry at admission (their
    contents are already in place: skip their prefill; ``num_tokens`` starts after them).
    ``num_pages`` is how many pages are mapped for it (``ensure``). ``suspended`` holds its saved
    bytes while suspended.
    """

    seq_id: int
    base_slot: int
    num_aliased_pages: int
    num_pages: int = 0
    suspended: Any = None
    num_tokens: int = 0  # tokens written by the steps :meth:`Arena.prepare_step` built
    skip_from: int = 0
    skip: int = 0
    _range: _Range | None = dataclasses.field(default=None, repr=False)

    @property
    def active(self) -> bool:
        return self._range is not None

    def slots(self, first: int, last: int) -> np.ndarray:
        """int64 ``[last - first]`` slots of pages ``[first, last)``."""
        j = np.arange(first, last, dtype=np.int64)
        return self.base_slot + j + self.skip * (j >= self.skip_from)

    def runs(self, first: int, last: int) -> list[tuple[int, int, int]]:
        """``(first slot, first page, num pages)`` of the (at most two) runs of consecutive
        slots holding pages ``[first, last)``."""
        out = []
        cut = min(max(self.skip_from if self.skip else last, first), last)
        if cut > first:
            out.append((self.base_slot + first, first, cut - first))
        if last > cut:
            out.append((self.base_slot + cut + self.skip, cut, last - cut))
        return out

    def page_table(self, num_pages: int | None = None) -> np.ndarray:
        """int32 ``[num_pages]`` slots of its first pages (``base_slot + arange`` when
        ``skip`` is 0)."""
        n = self.num_pages if num_pages is None else num_pages
        return self.slots(0, n).astype(np.int32)


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
    num_aliased_pages: int
    num_partial_aliases: int
    aliased_bytes: int
    num_spans: int
    num_spilled_spans: int
    num_consumed_spans: int
    num_front_skips: int
    num_reclaimed_ranges: int
    num_blocking_drains: int


# -- internals -------------------------------------------------------------------------------


class _Chunk:
    """Physical memory of one chunk: its super-page handles, and who maps or holds it."""

    __slots__ = ("handles", "refs", "keys", "hits")

    def __init__(self, handles: list[int]) -> None:
        self.handles = handles
        self.refs = 0  # ranges mapping it + 1 while registered
        self.keys: list[Hashable] = []  # its registry keys (non-empty while registered)
        self.hits = 0  # admissions that aliased it while registered

    def consumable(self) -> bool:
        """A span no admission ever aliased that only the registry and one range hold: an
        admission adopting that range takes it over as private memory (no unmap, no map)."""
        return bool(self.keys) and self.refs == 2 and not self.hits


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
        gran = native.reservation_granularity() if self.backend == "cpu" else \
            native.reservation_granularity(device)
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
        unit = config.alias_unit_pages
        if self.pages_per_chunk % unit:
            raise ValueError(f"ArenaConfig.alias_unit_pages ({unit}) must divide the pages per "
                             f"chunk ({self.pages_per_chunk})")
        self.max_skip = self.pages_per_chunk - unit if config.prefix_aliasing else 0
        self.chunks_per_range = -(-(config.max_pages_per_sequence + self.max_skip)
                                  // self.pages_per_chunk)
        if config.prefix_aliasing and not config.remap_spans:
            self.chunks_per_range += 1  # NOTE: room to place a sequence after a foreign span
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
                self._res = native.Reservation(reservation, sp)
            else:
                self._res = native.Reservation(reservation, sp, device)
        except MemoryError as e:
            raise ValueError(f"ArenaConfig.max_sequences x ArenaConfig.max_pages_per_sequence: "
                             f"cannot reserve {reservation} bytes: {e}") from e
        self._ranges = [_Range(r, 1 + r * self.chunks_per_range, self.chunks_per_range)
                        for r in range(config.max_sequences)]
        self._free: list[_Range] = list(reversed(self._ranges))  # never mapped / reclaimed
        self._parked: OrderedDict[int, _Range] = OrderedDict()  # oldest first
        self._registry: OrderedDict[_Chunk, None] = OrderedDict()  # registered chunks, LRU first
        # key -> (chunk, its first logical page, pages of it through the key's unit)
        self._spans: dict[Hashable, tuple[_Chunk, int, int]] = {}
        self._used_chunks = 0
        self._seq_ids = itertools.count()
        self._counts = dict.fromkeys(
            ("adoptions", "fresh", "alias_hits", "aliased_chunks", "aliased_pages",
             "partial_aliases", "consumed_spans", "front_skips", "spilled_spans",
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

    def _registered_prefix(self, keys: Sequence[Hashable]) -> list[tuple[_Chunk, int]]:
        """The registered chunks an admission with ``keys`` maps, in range order, each with how
        many of its pages match: whole chunks, at most one partial chunk (after it the pages
        continue at the next chunk), whole chunks again; the longest match first."""
        out: list[tuple[_Chunk, int]] = []
        if not self.config.prefix_aliasing:
            return out
        u, ppc = self.config.alias_unit_pages, self.pages_per_chunk
        limit = min(len(keys) * u, self.config.max_pages_per_sequence) // u * u
        p, partial = 0, False
        while p < limit:
            hit = None
            for e in range(min(p + ppc, limit), p, -u):
                ent = self._spans.get(keys[e // u - 1])
                if ent is not None and ent[1] == p:  # the chunk starts where we are
                    hit = (ent[0], e - p)
                    break
            if hit is None or (hit[1] < ppc and partial):
                break
            partial = partial or hit[1] < ppc
            out.append(hit)
            p += hit[1]
        return out

    def _register(self, chunk: _Chunk, first: int, keys: Sequence[Hashable],
                  num_pages: int) -> None:
        """Registers the unit keys of ``chunk``'s committed pages ``[first, num_pages)`` (the
        chunk holds logical pages from ``first`` on) that no chunk holds yet."""
        u = self.config.alias_unit_pages
        last = min(first + self.pages_per_chunk, num_pages)
        for e in range(first + u, last + 1, u):
            key = keys[e // u - 1]
            if key not in self._spans:
                self._spans[key] = (chunk, first, e - first)
                chunk.keys.append(key)
        if chunk.keys:
            chunk.refs += 1  # the registry's hold
            self._registry[chunk] = None

    def _unregister(self, chunk: _Chunk) -> None:
        del self._registry[chunk]
        for key in chunk.keys:
            del self._spans[key]
        chunk.keys = []
        chunk.hits = 0
        self._drop_ref(chunk)

    def _pick_range(self, spans: list[_Chunk]) -> _Range | None:
        """The range for an admission mapping ``spans``. NOTE: prefer the longest prefix
        already in place, then a parked range whose other chunks are private (nothing to unmap
        or unregister), then a fresh range, then a parked one whose other spans are all
        consumable, then one whose spans other parked ranges also map, then one whose last
        reader is done (no wait before its unmap), then the oldest."""
        best, best_score = None, (-1, -1, -1, -1)
        if self.config.adoption:
            parked: dict[_Chunk, int] = {}  # parked ranges mapping each registered chunk
            for rng in self._parked.values():
                for c in rng.chunks:
                    if c is not None and c.keys:
                        parked[c] = parked.get(c, 0) + 1
            for rng in self._parked.values():  # oldest first
                match = 0
                while (match < len(spans) and match < len(rng.chunks)
                       and rng.chunks[match] is spans[match]):
                    match += 1
                rest = [c for c in rng.chunks[match + self._front_skip(rng, spans):]
                        if c is not None and c.keys]
                keep = 2 if not rest else int(all(c.consumable() for c in rest))
                # NOTE: then keep a parked copy of every span (a later admission with its
                # prefix adopts a range where it is mapped: no map call).
                spare = int(all(parked[c] > 1 or c.consumable() for c in rest))
                # NOTE: and one whose readers are done, if a span must be unmapped from it.
                ready = int(keep > 0 or _ready(rng.fence))
                if (match, keep, spare, ready) > best_score:
                    best, best_score = rng, (match, keep, spare, ready)
        if best is not None and (best_score[0] > 0 or best_score[1] == 2 or not self._free):
            del self._parked[best.index]
            self._counts["adoptions"] += 1
            return best
        if self._free:
            self._counts["fresh"] += 1
            return self._free.pop()
        return None

    def _front_skip(self, rng: _Range, spans: list[_Chunk]) -> int:
        """1 when an admission mapping ``spans`` leaves ``rng``'s first chunk (another prefix's
        span) mapped and starts after it (``remap_spans`` off), else 0."""
        c = rng.chunks[0]
        return int(not self.config.remap_spans and c is not None and bool(c.keys)
                   and not c.consumable() and not (spans and spans[0] is c))

    def _first_chunk(self, seq: ArenaSequence, rng: _Range) -> int:
        """Index in ``rng`` of the chunk holding ``seq``'s page 0 (1 after a front skip)."""
        return seq.base_slot // self.pages_per_chunk - rng.first_chunk

    def admit(self, prefix_keys: Sequence[Hashable] = ()) -> ArenaSequence | None:
        """A new sequence with a contiguous range, or None when every range is in use.

        ``prefix_keys[i]`` identifies the sequence's content through the end of alias unit ``i``
        (pages ``[0, (i + 1) * alias_unit_pages)``), e.g. the chained block key of that page.
        Registered chunks matching a prefix of them are mapped into the new range (their matching
        pages count in ``num_aliased_pages`` and ``num_pages``; after a partial chunk the
        sequence's ``skip`` is set); nothing else is mapped yet.
        """
        self._check_open()
        segs = self._registered_prefix(list(prefix_keys))
        spans = [c for c, _ in segs]
        rng = self._pick_range(spans)
        if rng is None:
            return None
        c0 = self._front_skip(rng, spans)
        if c0:  # NOTE: its own prefix is not where the foreign span is: it aliases nothing
            segs, spans = [], []
            self._counts["front_skips"] += 1
        # NOTE: chunks the admission will write must be private to it: a registered span other
        # than the matched one leaves the range (unmapped after the range's last reader), unless
        # it is consumable (never aliased: typically a closed sequence's unique tail), when it
        # leaves the registry instead (steady state stays free of map/unmap calls).
        for i, c in enumerate(rng.chunks[c0:], c0):
            if c is None:
                continue
            if (i < len(spans) and c is spans[i]) or (i >= len(spans) and not c.keys):
                continue
            if i >= len(spans) and c.consumable():
                self._unregister(c)
                self._counts["consumed_spans"] += 1
                continue
            _wait(rng.fence)
            self._unmap_chunk(rng, i)
        for i, c in enumerate(spans):
            if rng.chunks[i] is None:
                self._map_chunk(c, rng.first_chunk + i)
                rng.chunks[i] = c
            self._registry.move_to_end(c)
            c.hits += 1
        aliased, skip_from, skip = 0, 0, 0
        for _, n in segs:
            aliased += n
            if n < self.pages_per_chunk:
                skip_from, skip = aliased, self.pages_per_chunk - n
        if segs:
            self._counts["alias_hits"] += 1
            self._counts["aliased_chunks"] += len(segs)
            self._counts["aliased_pages"] += aliased
            self._counts["partial_aliases"] += skip > 0
        seq = ArenaSequence(seq_id=next(self._seq_ids),
                            base_slot=(rng.first_chunk + c0) * self.pages_per_chunk,
                            num_aliased_pages=aliased, num_pages=aliased,
                            num_tokens=aliased * self.layout.tokens_per_page,
                            skip_from=skip_from, skip=skip, _range=rng)
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
        end = num_pages + (seq.skip if num_pages > seq.skip_from else 0)  # slots
        c0 = self._first_chunk(seq, rng)
        missing = [i for i in range(c0, c0 - (-end // self.pages_per_chunk))
                   if rng.chunks[i] is None]
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
        """Ends ``seq``. ``committed_keys[i]`` (as in :meth:`admit`) for each leading alias unit
        whose pages are all committed: the private chunks holding them enter the span registry
        under the keys no chunk holds yet (when aliasing is on). The range is parked still
        mapped (adoption on) or reclaimed after its fence (off)."""
        rng = self._active_range(seq, "seq")
        seq._range = None
        rng.seq = None
        if self.config.prefix_aliasing:
            keys = list(committed_keys)
            ppc = self.pages_per_chunk
            num = min(len(keys) * self.config.alias_unit_pages, seq.num_pages)
            c0 = self._first_chunk(seq, rng)
            for i, c in enumerate(rng.chunks[c0:]):
                o = i * ppc  # the chunk's first slot offset -> its first logical page
                first = o if not seq.skip or o < seq.skip_from else o - seq.skip
                if c is None or first >= num:
                    break
                if not c.keys and c.refs == 1:  # NOTE: shared chunks are someone's span
                    self._register(c, first, keys, num)
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
        for c in list(self._registry):
            if self.num_free_chunks >= need or spillable <= 0:
                return
            if c.refs == 1:  # only the registry holds it
                self._unregister(c)
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

    def _copy_pages(self, seq: ArenaSequence, num_pages: int, host: np.ndarray,
                    to_host: bool) -> None:
        """Pages ``[0, num_pages)`` of ``seq`` <-> ``host`` (pool-layer major)."""
        sb = self.layout.slot_bytes
        n = num_pages * sb
        addr = host.ctypes.data
        for pl in range(self.num_pool_layers):
            for slot, page, count in seq.runs(0, num_pages):
                off = pl * self._pool_layer_bytes + slot * sb
                if to_host:
                    self._res.read(off, addr + pl * n + page * sb, count * sb)
                else:
                    self._res.write(off, addr + pl * n + page * sb, count * sb)

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
        self._copy_pages(seq, seq.num_pages, buf, to_host=True)
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
        self._copy_pages(fresh, n, seq.suspended, to_host=False)
        host.release(seq.suspended)
        seq.suspended = None
        self.hand_over(fresh, seq)
        return True

    def hand_over(self, fresh: ArenaSequence, seq: ArenaSequence) -> None:
        """Gives ``fresh``'s range (its pages already restored) to the suspended ``seq``, which
        becomes active there (no alias, no skip); ``fresh`` is spent."""
        rng = self._active_range(fresh, "fresh")
        if seq.active:
            raise ValueError("seq is active")
        fresh._range = None
        seq.base_slot, seq.num_aliased_pages, seq._range = fresh.base_slot, 0, rng
        seq.skip_from = seq.skip = 0
        seq.num_pages = max(seq.num_pages, fresh.num_pages)
        rng.seq = seq

    # -- data access -----------------------------------------------------------------------

    def write_pages(self, seq: ArenaSequence, first_page: int, k: np.ndarray,
                    v: np.ndarray) -> None:
        """Host write of whole pages ``[first_page, first_page + n)`` of ``seq``:
        ``k``/``v`` are ``[num_layers, n, tokens_per_page, num_kv_heads, head_dim]``."""
        self._active_range(seq, "seq")
        self._page_io(seq, first_page, k, v, write=True)

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
        self._page_io(seq, first_page, k, v, write=False)
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
            if c < 1 or ch is None or ch.keys or ch.refs != 1:
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

    def _page_io(self, seq: ArenaSequence, first: int, k: np.ndarray, v: np.ndarray, *,
                 write: bool) -> None:
        lay, sb = self.layout, self.layout.slot_bytes
        n = k.shape[1]
        if (k.shape != v.shape or k.shape[0] != lay.num_layers
                or k.nbytes != lay.num_layers * n * sb):
            raise ValueError(f"k and v must be [{lay.num_layers}, n, {lay.tokens_per_page}, "
                             f"{lay.num_kv_heads}, {lay.head_dim}] of {lay.dtype}, got "
                             f"{k.shape} and {v.shape}")
        if first < 0 or first + n > self.config.max_pages_per_sequence:
            raise ValueError(f"pages [{first}, {first + n}) are outside the sequence's range")
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        for pool, arr in enumerate((k, v)):
            for layer in range(lay.num_layers):
                for slot, page, count in seq.runs(first, first + n):
                    off = (pool * lay.num_layers + layer) * self._pool_layer_bytes + slot * sb
                    addr = arr.ctypes.data + (layer * n + page - first) * sb
                    if write:
                        self._res.write(off, addr, count * sb)
                    else:
                        self._res.read(off, addr, count * sb)

    def pool_arrays(self) -> tuple[Any, Any]:
        """(K, V) ``jax.Array``s over the reservation itself, no copy (DLPack).

        On GPU these are the pools a jitted step donates (XLA keeps their pointer). On CPU they
        are not: XLA's CPU client copies a donated buffer it did not allocate, touching unmapped
        super-pages; CPU steps take the pools by address instead (``jax_kvcm/_arena_ops.py``).
        Nothing may run a whole-pool op (copy, print, reduction) on them: only slots of mapped
        chunks are addressable.
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
            table[b, :npg] = seq.page_table(npg)
            seq_lens[b] = end
            query_start[b] = t
            pos = np.arange(seq.num_tokens, end, dtype=np.int32)
            positions[t:t + n] = pos
            slots[t:t + n] = seq.slots(0, npg)[pos // tpp] * tpp + pos % tpp
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
        parked: dict[_Chunk, int] = {}  # NOTE: what reclaiming every parked range would unmap
        for r in self._parked.values():
            for c in r.chunks:
                if c is not None:
                    parked[c] = parked.get(c, 0) + 1
        reclaimable = sum(not c.keys and c.refs == n for c, n in parked.items())
        spill = sum(c.refs - parked.get(c, 0) == 1 for c in self._registry)
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
        for c in list(self._registry):
            self._unregister(c)
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
            num_aliased_pages=c["aliased_pages"], num_partial_aliases=c["partial_aliases"],
            aliased_bytes=c["aliased_pages"] * self.num_pool_layers * self.layout.slot_bytes,
            num_spans=len(self._registry), num_spilled_spans=c["spilled_spans"],
            num_consumed_spans=c["consumed_spans"], num_front_skips=c["front_skips"],
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
            buf[b, :n] = s.page_table(n)
        return buf
