"""Manager configuration: layer groups, budgets, buckets, and the hot tier (paged or arena).

Every config validates itself on construction; a bad value raises naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm._pool_ratios import (split_device_budget, weights_from_ratio,
                                   weights_from_typical_batch)
from jax_kvcm._step_batch import StepBatch, default_buckets
from jax_kvcm._types import LayerGroupLayout, PoolGroupIndex, check_count, hot_page_bytes
from jax_kvcm._window_group import ring_width, window_peak_pages
from jax_kvcm.hot.arena.geometry import ArenaGeometry

__all__ = ["ArenaHot", "KVCacheConfig", "LayerGroupConfig", "PagedHot"]

_ARENA_BACKENDS = ("auto", "cpu", "cuda")


@dataclass(frozen=True, slots=True)
class PagedHot:
    """The paged hot tier (the default): each hot pool group is one preallocated K and V array
    ``[num_layers, device_pages + 1, tokens_per_page, Hkv, D]`` (layer-major; slot 0 the null
    page); a page is any free slot."""

    kind = "paged"


@dataclass(frozen=True, slots=True)
class ArenaHot:
    """The arena hot tier: each full-attention pool group is two virtual reservations (K, V),
    slot-major, with physical memory mapped on demand in chunks (:mod:`jax_kvcm.hot.arena`).
    Each sequence holds a *range*: page ``j`` at slot ``base + j``. Sliding-window groups stay
    paged (their pages cycle through a bounded ring: a sequence-long range gains nothing there).

    - ``max_sequences``: ranges (default ``2 * max_batch``: the running sequences plus as many
      parked ranges, closed and still mapped, for the next admissions to adopt);
    - ``super_page_bytes``: the mapping unit of one pool (2 MiB, the CUDA VMM granularity; a
      multiple of the driver's);
    - ``adoption``: closed ranges stay mapped and are handed to the next admission (no
      map/unmap in steady state); off, a range is unmapped when its sequence ends;
    - ``backend``: "auto" (CUDA VMM when JAX's default backend is a GPU, else memfd), "cpu",
      "cuda".

    The device budget is ``device_pages`` / ``device_bytes`` as for paged (whole chunks of it
    are mapped at most); it counts under the byte governor like paged pages."""

    max_sequences: int | None = None
    super_page_bytes: int = 2 << 20
    adoption: bool = True
    backend: str = "auto"

    kind = "arena"

    def __post_init__(self) -> None:
        if self.max_sequences is not None:
            check_count(self.max_sequences, "ArenaHot.max_sequences", minimum=1)
        sp = check_count(self.super_page_bytes, "ArenaHot.super_page_bytes", minimum=1)
        if sp & (sp - 1):
            raise ValueError(f"ArenaHot.super_page_bytes must be a power of two, got {sp}")
        if not isinstance(self.adoption, bool):
            raise TypeError(f"ArenaHot.adoption must be a bool, got {self.adoption!r}")
        if self.backend not in _ARENA_BACKENDS:
            raise ValueError(f"ArenaHot.backend must be one of {_ARENA_BACKENDS}, got "
                             f"{self.backend!r}")


def _kv_dtype_name(dtype: Any) -> str | None:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        return None
    return name if name in ("float32", "bfloat16", "float16", "float8_e4m3fn") else None


def _check_buckets(value: Any, name: str, maximum: int) -> tuple[int, ...]:
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints") from None
    if not items:
        raise ValueError(f"{name} must not be empty")
    out = tuple(check_count(b, f"{name}[{i}]", minimum=1) for i, b in enumerate(items))
    if any(b >= c for b, c in zip(out, out[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {out}")
    if out[-1] < maximum:
        raise ValueError(f"{name} must reach {maximum} (its maximum), got {out}")
    return out


@dataclass(frozen=True, slots=True)
class LayerGroupConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = jnp.bfloat16
    sliding_window: int | None = None
    # Dtype of the K/V pools: None = dtype; float8_e4m3fn stores K/V in fp8 (scales per layer
    # and kv head are the user's, passed to the ops); dtype stays the compute dtype.
    kv_dtype: Any = None

    @property
    def pool_dtype(self) -> Any:
        return self.dtype if self.kv_dtype is None else self.kv_dtype


@dataclass(frozen=True)
class KVCacheConfig:
    """Validated on construction; a bad value raises naming the field.

    ``device_pages``: usable device pages per layer group (an int for all, or one per group); or
    ``device_bytes``: a total device budget split into whole pages (the null page of each pool
    comes on top). How it is split between layer groups:

    - default: every group gets the same count (pages are allocated in lockstep);
    - ``pool_ratio``: one positive byte weight per layer group;
    - ``typical_batch``: the context lengths (tokens) of a typical batch; each group's byte weight
      is the pages the batch's sequences hold there at their peak (a sliding-window group holds
      at most ``ceil((W + C - 2) / P) + 1``, see :mod:`jax_kvcm._window_group`) times its page
      bytes, so window groups stop holding pages they can never use.

    Both go through :func:`jax_kvcm._pool_ratios.split_device_budget`; the resulting
    ``device_pages`` tuple is what the manager and :meth:`KVCacheManager.max_num_sequences` use.

    Sliding-window groups: ``ring_tables`` makes their page-table rows rings of
    ``table_widths[g]`` entries (independent of ``max_seq_len``; the attention ops must then be
    called with ``ring_table=True``); off (the default, for callers whose ops read absolute
    tables) their rows are ``pages_per_seq`` wide. ``max_window_chunk``: the most new tokens one
    sequence may add in one step when a window group exists (default ``max_tokens_per_step``;
    ``prepare_step`` raises beyond it); the rings are sized for it, so a runner that splits
    prefill into smaller chunks gets smaller rings (and a smaller peak per sequence).
    ``rollback_tokens``: window groups keep this many tokens beyond their window, so
    :meth:`KVCacheManager.truncate` can take back that many (speculative decoding's drafts);
    the rings and peaks grow to match.

    Buckets default to powers of two up to the maxima (token buckets start at
    ``tokens_per_page``).

    ``hot``: :class:`PagedHot` (default) or :class:`ArenaHot`: how device pages are stored
    (the same manager, budgets and tiers over either; see :mod:`jax_kvcm.hot`). With the arena,
    ``device_pages`` of a full-attention group is the physical page budget its arena may map.
    Tensor parallelism: ``mesh`` (a ``jax.sharding.Mesh``) splits every hot pool over its KV-head
    axis on mesh axis ``mesh_axis`` (:attr:`pool_sharding`); each group's ``num_kv_heads`` must be
    divisible by that axis's size. The manager is unchanged (a page id is the same page on every
    device); the step calls :mod:`jax_kvcm.sharded`'s ops with the same mesh. Then
    ``device_bytes`` is the budget of *one* device (pages are sized by their per-device bytes,
    :meth:`device_page_bytes`). Cold tiers (``host_bytes``, ``disk_bytes``) hold every shard's
    piece of a page in one cold slot (piece ``s`` at ``1/n`` of the slot, see
    :mod:`jax_kvcm._storage`); their budgets count all pieces (the host tier is one process's
    memory).

    ``offload_ahead_pages`` (write-back ahead; 0 = off, the default): after each
    ``complete_step``, when fewer device pages than this (per pool) are free or pending, the
    least recently used cached pages move to the host tier ahead of need (needs ``host_bytes``).
    On CUDA with the concat codec and no mesh the copies run on a side stream with the copy
    engines, overlapping the next steps; the steps must then donate the pools (XLA updates them in
    place; ``complete_step`` raises otherwise). Elsewhere they run on XLA's stream right after the
    step. A good value: the pages one step can take, i.e. about ``max_tokens_per_step /
    tokens_per_page`` plus a decode step's growth (``max_batch / tokens_per_page``, more for
    short pages), up to twice that for back-to-back prompt chunks (in an overlapped loop the
    pages moved after step n come free once step n ran and the copy is done; a step that finds
    the reserve still in flight evicts on XLA's stream as without it). See
    :mod:`jax_kvcm.manager.ahead`.
    """

    tokens_per_page: int
    layer_groups: tuple[LayerGroupConfig, ...]
    device_pages: int | tuple[int, ...] | None = None
    device_bytes: int | None = None
    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    enable_prefix_reuse: bool = True
    max_batch: int = 256
    max_tokens_per_step: int = 2048
    max_seq_len: int = 4096
    batch_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    pool_ratio: tuple[float, ...] | None = None
    typical_batch: tuple[int, ...] | None = None
    ring_tables: bool = False
    max_window_chunk: int | None = None
    hot: PagedHot | ArenaHot = PagedHot()
    mesh: jax.sharding.Mesh | None = None
    mesh_axis: str = "tp"
    offload_ahead_pages: int = 0
    rollback_tokens: int = 0

    def __post_init__(self) -> None:
        s = object.__setattr__
        check_count(self.tokens_per_page, "tokens_per_page", minimum=1)
        groups = self.layer_groups
        if isinstance(groups, LayerGroupConfig):
            groups = (groups,)
        try:
            groups = tuple(groups)
        except TypeError:
            raise TypeError("layer_groups must be a sequence of LayerGroupConfig") from None
        if not groups:
            raise ValueError("layer_groups must not be empty")
        for i, g in enumerate(groups):
            if not isinstance(g, LayerGroupConfig):
                raise TypeError(f"layer_groups[{i}] must be a LayerGroupConfig")
            check_count(g.num_layers, f"layer_groups[{i}].num_layers", minimum=1)
            check_count(g.num_kv_heads, f"layer_groups[{i}].num_kv_heads", minimum=1)
            check_count(g.head_dim, f"layer_groups[{i}].head_dim", minimum=1)
            try:
                jnp.dtype(g.dtype)
            except TypeError:
                raise TypeError(f"layer_groups[{i}].dtype {g.dtype!r} is not a dtype") from None
            if g.kv_dtype is not None and _kv_dtype_name(g.kv_dtype) is None:
                raise TypeError(f"layer_groups[{i}].kv_dtype must be None, float32, bfloat16, "
                                f"float16 or float8_e4m3fn, got {g.kv_dtype!r}")
            if g.sliding_window is not None:
                check_count(g.sliding_window, f"layer_groups[{i}].sliding_window", minimum=1)
        s(self, "layer_groups", groups)
        check_count(self.max_tokens_per_step, "max_tokens_per_step", minimum=1)
        check_count(self.max_seq_len, "max_seq_len", minimum=1)
        if not isinstance(self.ring_tables, bool):
            raise TypeError("ring_tables must be a bool")
        s(self, "max_window_chunk", self.max_tokens_per_step if self.max_window_chunk is None
          else check_count(self.max_window_chunk, "max_window_chunk", minimum=1))
        check_count(self.rollback_tokens, "rollback_tokens", minimum=0)
        self._check_mesh()
        page_bytes = list(self.device_page_bytes())
        if not isinstance(self.hot, (PagedHot, ArenaHot)):
            raise TypeError(f"hot must be PagedHot() or ArenaHot(...), got "
                            f"{type(self.hot).__name__}")
        if (self.device_pages is None) == (self.device_bytes is None):
            raise ValueError("exactly one of device_pages and device_bytes must be given")
        if (self.pool_ratio is not None or self.typical_batch is not None) and (
                self.device_bytes is None):
            raise ValueError("pool_ratio and typical_batch split device_bytes: give device_bytes")
        if self.pool_ratio is not None and self.typical_batch is not None:
            raise ValueError("give at most one of pool_ratio and typical_batch")
        if self.device_bytes is not None:
            nbytes = check_count(self.device_bytes, "device_bytes", minimum=1)
            if self.pool_ratio is None and self.typical_batch is None:
                n = nbytes // sum(page_bytes)
                if n < 1:
                    raise ValueError(f"device_bytes {nbytes} holds no page ({sum(page_bytes)} "
                                     "bytes)")
                pages = (n,) * len(groups)
            else:
                pages = self._split_device_bytes(nbytes, page_bytes)
        elif isinstance(self.device_pages, (tuple, list)):
            if len(self.device_pages) != len(groups):
                raise ValueError(f"device_pages has {len(self.device_pages)} entries for "
                                 f"{len(groups)} layer groups")
            pages = tuple(check_count(n, f"device_pages[{i}]", minimum=1)
                          for i, n in enumerate(self.device_pages))
        else:
            pages = (check_count(self.device_pages, "device_pages", minimum=1),) * len(groups)
        s(self, "device_pages", pages)
        check_count(self.host_bytes, "host_bytes", minimum=0)
        check_count(self.disk_bytes, "disk_bytes", minimum=0)
        check_count(self.offload_ahead_pages, "offload_ahead_pages", minimum=0)
        if self.offload_ahead_pages and not self.host_bytes:
            raise ValueError("offload_ahead_pages needs a host tier (host_bytes > 0)")
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("disk_dir is required when disk_bytes > 0")
        if not isinstance(self.enable_prefix_reuse, bool):
            raise TypeError("enable_prefix_reuse must be a bool")
        check_count(self.max_batch, "max_batch", minimum=1)
        bb = (default_buckets(self.max_batch) if self.batch_buckets is None
              else _check_buckets(self.batch_buckets, "batch_buckets", self.max_batch))
        tb = (default_buckets(self.max_tokens_per_step, min(self.tokens_per_page,
                                                            self.max_tokens_per_step))
              if self.token_buckets is None
              else _check_buckets(self.token_buckets, "token_buckets", self.max_tokens_per_step))
        s(self, "batch_buckets", bb)
        s(self, "token_buckets", tb)
        if self.hot.kind == "arena":
            self._check_arena()

    def _check_arena(self) -> None:
        """The combinations the arena refuses, with the reason, and its int32 slot bound."""
        if self.mesh is not None:
            # NOTE: a sharded arena needs one reservation per device assembled into one global
            # array; not built (the paged pools shard over KV heads).
            raise ValueError("mesh: the arena hot tier is one device's reservation; use "
                             "PagedHot() with tensor parallelism")
        if self.offload_ahead_pages:
            # NOTE: a page freed in a range serves only that range's next occupant, so copying
            # cached pages ahead frees no room another sequence could take.
            raise ValueError("offload_ahead_pages: write-back ahead is for PagedHot() (an "
                             "arena range's freed pages serve only its own next occupant)")
        geos = self.arena_geometries()
        for g, geo in geos.items():
            geo.check_int32(f"hot.max_sequences / max_seq_len (layer_groups[{g}])")
        if len(set(geos.values())) > 1:
            # NOTE: a sequence's page j sits at base + j of every arena group, so their ranges
            # and chunks must coincide.
            raise ValueError(f"layer_groups {sorted(geos)}: the arena's full-attention groups "
                             "must share one page layout and device_pages (their ranges move "
                             "in lockstep); use PagedHot() for such a model")

    @property
    def max_sequences_of_arena(self) -> int:
        """Ranges of each arena (``ArenaHot.max_sequences``, default ``2 * max_batch``)."""
        n = getattr(self.hot, "max_sequences", None)
        return 2 * self.max_batch if n is None else n

    def arena_geometries(self) -> dict[int, ArenaGeometry]:
        """``{layer group: geometry}`` of the groups an :class:`ArenaHot` stores in an arena
        (the full-attention ones; empty with :class:`PagedHot`)."""
        if self.hot.kind != "arena":
            return {}
        out = {}
        for g, lg in enumerate(self.layer_groups):
            if lg.sliding_window:
                continue
            pool_page = hot_page_bytes(lg.num_layers, self.tokens_per_page, lg.num_kv_heads,
                                       lg.head_dim, lg.pool_dtype) // 2
            out[g] = ArenaGeometry(pool_page, self.hot.super_page_bytes, self.pages_per_seq,
                                   self.max_sequences_of_arena, self.tokens_per_page,
                                   max(1, self.device_pages[g]))
        return out

    def _check_mesh(self) -> None:
        if self.mesh is None:
            return
        if not isinstance(self.mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got "
                            f"{type(self.mesh).__name__}")
        if self.mesh_axis not in self.mesh.axis_names:
            raise ValueError(f"mesh_axis {self.mesh_axis!r} is not an axis of the mesh (axes "
                             f"{self.mesh.axis_names})")
        n = self.num_shards
        for i, g in enumerate(self.layer_groups):
            if g.num_kv_heads % n:
                hint = (" (fewer KV heads than shards: replicate each KV head up to the axis "
                        "size)" if g.num_kv_heads < n else "")
                raise ValueError(f"layer_groups[{i}].num_kv_heads {g.num_kv_heads} must be "
                                 f"divisible by the size {n} of mesh axis {self.mesh_axis!r}"
                                 f"{hint}")

    @property
    def num_shards(self) -> int:
        """Devices one pool is split over: the size of ``mesh_axis`` (1 without a mesh)."""
        return 1 if self.mesh is None else int(self.mesh.shape[self.mesh_axis])

    @property
    def pool_sharding(self) -> jax.sharding.NamedSharding | None:
        """Placement of every hot pool ``[L, pages, page_size, Hkv, D]``: KV heads split over
        ``mesh_axis`` (None without a mesh)."""
        if self.mesh is None:
            return None
        spec = jax.sharding.PartitionSpec(None, None, None, self.mesh_axis, None)
        return jax.sharding.NamedSharding(self.mesh, spec)

    def device_page_bytes(self) -> tuple[int, ...]:
        """Bytes one page of each layer group (K and V, every layer) occupies on *one* device:
        its KV heads divided by :attr:`num_shards`."""
        return tuple(hot_page_bytes(g.num_layers, self.tokens_per_page,
                                    g.num_kv_heads // self.num_shards, g.head_dim, g.pool_dtype)
                     for g in self.layer_groups)

    def device_pool_bytes(self) -> int:
        """Bytes of every hot pool (null pages included) on one device."""
        return sum((n + 1) * b for n, b in zip(self.device_pages, self.device_page_bytes()))

    def _split_device_bytes(self, nbytes: int, page_bytes: list[int]) -> tuple[int, ...]:
        """Usable pages per layer group from ``pool_ratio`` or ``typical_batch``."""
        groups = self.layer_groups
        if self.pool_ratio is not None:
            try:
                ratio = tuple(self.pool_ratio)
            except TypeError:
                raise TypeError("pool_ratio must be a sequence of numbers") from None
            if len(ratio) != len(groups):
                raise ValueError(f"pool_ratio has {len(ratio)} entries for {len(groups)} layer "
                                 "groups")
            try:
                weights = weights_from_ratio(ratio)
            except (TypeError, ValueError) as e:
                raise type(e)(f"pool_ratio: {e}") from None
            object.__setattr__(self, "pool_ratio", ratio)
        else:
            try:
                batch = tuple(self.typical_batch)
            except TypeError:
                raise TypeError("typical_batch must be a sequence of context lengths") from None
            if not batch:
                raise ValueError("typical_batch must not be empty")
            lens = [min(check_count(n, f"typical_batch[{i}]", minimum=1), self.max_seq_len)
                    for i, n in enumerate(batch)]
            object.__setattr__(self, "typical_batch", batch)
            tokens = sum(self.peak_pages(n) for n in lens) * self.tokens_per_page
            per_token = [b // self.tokens_per_page for b in page_bytes]
            weights = weights_from_typical_batch(tokens.tolist(), per_token)
        # NOTE: the device split's one-group-per-layer-group layout (the cold fields are unused
        # at the DEVICE level).
        layouts = [LayerGroupLayout(i, PoolGroupIndex(i), b, PoolGroupIndex(i), b)
                   for i, b in enumerate(page_bytes)]
        try:
            split = split_device_budget(nbytes, weights, layouts, num_reserved_slots=0)
        except ValueError as e:
            raise ValueError(f"device_bytes {nbytes}: {e}") from None
        return tuple(p.num_slots for p in split)

    @property
    def pages_per_seq(self) -> int:
        """``P``: page-table width of full-attention groups."""
        return -(-self.max_seq_len // self.tokens_per_page)

    @property
    def table_widths(self) -> tuple[int, ...]:
        """Page-table entries per row of each layer group: ``pages_per_seq`` for full attention
        (and for windows without ``ring_tables``), the ring ``R = ceil((W + C - 2) / P) + 1``
        (``C = max_window_chunk``, at most ``pages_per_seq``) for a window ``W`` with them."""
        P = self.pages_per_seq
        return tuple(ring_width(self.kept_window(g), self.tokens_per_page, self.max_window_chunk,
                                P) if g.sliding_window and self.ring_tables else P
                     for g in self.layer_groups)

    def padding_batch(self, batch_bucket: int, token_bucket: int) -> StepBatch:
        """An all-padding :class:`StepBatch` of ``batch_bucket`` rows and ``token_bucket``
        tokens (both among this config's buckets): no sequence (page ids 0, lengths 0, query
        starts 0, slots -1, positions 0), in the shapes and dtypes ``prepare_step`` gives in
        those buckets, so a jitted step can be compiled ahead of serving:
        ``step.lower(..., config.padding_batch(b, t), ...).compile()``. Fresh writable arrays."""
        for name, value, buckets in (("batch_bucket", batch_bucket, self.batch_buckets),
                                     ("token_bucket", token_bucket, self.token_buckets)):
            if value not in buckets:
                raise ValueError(f"{name} {value!r} is not one of {name}s {buckets}")
        return StepBatch.padding(batch_bucket, token_bucket, max(self.table_widths),
                                 len(self.layer_groups))

    def kept_window(self, group: LayerGroupConfig) -> int | None:
        """The tokens a window group keeps behind a sequence's end: its window plus
        ``rollback_tokens`` (None for full attention)."""
        return group.sliding_window + self.rollback_tokens if group.sliding_window else None

    def max_num_sequences(self, seq_len: int) -> int:
        """How many sequences of ``seq_len`` tokens (clamped to ``max_seq_len``) fit in
        ``device_pages`` at once, each holding :meth:`peak_pages` (0 when one does not fit).
        :meth:`KVCacheManager.max_num_sequences` is this; planning needs no manager."""
        seq_len = min(check_count(seq_len, "seq_len", minimum=1), self.max_seq_len)
        return int((np.asarray(self.device_pages) // self.peak_pages(seq_len)).min())

    def peak_pages(self, seq_len: int) -> np.ndarray:
        """``[G]``: device pages per layer group one sequence of ``seq_len`` tokens may hold at
        once. Full attention: all of them; window W: ``ceil((W + n - 2) / P) + 1`` during a
        step of ``n = min(seq_len, max_tokens_per_step, max_window_chunk)`` new tokens."""
        pages = -(-seq_len // self.tokens_per_page)
        n = min(seq_len, self.max_tokens_per_step, self.max_window_chunk)
        return np.asarray([min(pages, window_peak_pages(self.kept_window(g),
                                                         self.tokens_per_page, n))
                           if g.sliding_window else pages for g in self.layer_groups], np.int64)
