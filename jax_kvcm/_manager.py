"""KVCacheManager: sequences, fixed-shape step buffers, prefix reuse, eviction, suspend/resume.

One :class:`~jax_kvcm._storage.StorageManager` underneath (one hot pool group per layer group);
its :class:`~jax_kvcm._types.PoolLayout` (pool groups and page bytes per level) is computed once
there. Every sequence has one page per layer group per ``tokens_per_page`` tokens, allocated in
lockstep over the layer groups.

The manager is a facade over one group manager per layer-group kind, each owning the page tables
of its groups: :class:`~jax_kvcm._full_group.FullGroups` (full attention: a row of
``ceil(max_seq_len / tokens_per_page)`` entries, page ``j`` at entry ``j``) and
:class:`~jax_kvcm._window_group.WindowGroups` (sliding windows: pages that left the window of
every future query are released as the sequence grows, and the row is a bounded ring; all window
logic lives there). The facade owns the sequences, the prefix tree, eviction, the tiers and the
step protocol.

Hot-path layout (docs/ARCHITECTURE.md §4: no per-page Python objects per step): the group managers
own row tables ``[K, rows, width]`` int32, the facade per-row ``_len / _npages / _ncommit /
_known`` arrays and a token matrix; a sequence is a row. ``prepare_step`` gathers rows with numpy
fancy indexing; the only per-page Python object is the :class:`BlockNode` created when a page is
committed (once per page, amortized over ``tokens_per_page`` decode steps).

Step protocol: ``prepare_step`` -> the user's jitted step (donating :attr:`caches`) ->
``complete_step(new caches)``. Between the two the pools are owned by the step: calls that move
pages (suspend, resume, onboarding) raise :class:`StepInFlightError`.

Fences. Pages the manager frees (closed sequences, dropped cached pages) go to a pending list tagged
with the step count; they return to the allocator once that step is complete. Each completed step
leaves a fence: a few bytes sliced from its output pool (``_step_fence``), which the next step does
not donate; the manager keeps the latest few. Steps complete in order, so a ready fence covers
every step before it: in an overlapped loop (step n handed back while step n - 1 still runs) the
pages freed after step n - 1 come back as soon as it finished, not only once the newest step is
ready. (Polling the newest step alone never succeeded in an overlapped loop: every allocation
evicted instead, and write-back ahead stalled; H200 seed run, benchmarks/RESULTS.md, session 7.)
``prepare_step`` reclaims ready ones without blocking and blocks only when nothing else is free.
NOTE: migrations release device source slots immediately (StorageManager's transaction); that is
safe because the encode takes the pools as operands and so is ordered after the step on XLA's
stream, and any later writer of the slot is ordered after the encode.

Write-back ahead (``KVCacheConfig.offload_ahead_pages``): after each step is handed back
(:meth:`KVCacheManager.complete_step`), when the device pages that are free or pending fall below
that reserve, the least recently used cached device pages move to the host tier with
``StorageManager.offload_ahead`` (on CUDA with the concat codec: copies on a side stream, off XLA's
compute stream), so that a later step's admissions find free pages instead of evicting (and
copying) first. The pages belong to the host tier at once (a prefix hit onboards them, waiting for
the copy first); their device slots go to the pending frees with the copy's fence, so no slot is
handed out before the copy read it. A copy that fails rolls back: its pages that are still where
the offload put them return to their device slots (never freed), their host slots are freed. That
happens when the failure is seen (``_settle_offloads``): before an operation reads the pages, or
when the pending frees are reclaimed.

Plan, then act. Every allocation first checks that it fits once every cached page at that tier is
evicted and every pending free reclaimed (:meth:`KVCacheManager._room`); only then does it evict.
So a refusal (``OutOfPagesError``, ``MUST_RECOMPUTE``, ``resume`` -> False, a prefix hit left on a
lower tier) changes nothing, not even where cached pages are. Moves that belong together (a
suspend, a resume, an onboarding: several tiers, layer groups and disk chunks) are one storage
transaction (``StorageManager.migrate_many``): all of it happens or none of it.

Page accounting (checked by :meth:`KVCacheManager.check_invariants`): on every tier and pool
``free + pending + referenced + cached == capacity``.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence as _Seq
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm._codec import ColdPageCodec
from jax_kvcm._full_group import FullGroups, GroupTables
from jax_kvcm._pool_ratios import (split_device_budget, weights_from_ratio,
                                   weights_from_typical_batch)
from jax_kvcm._prefix_tree import NO_PAGE, BlockNode, PrefixTree, salt_bytes
from jax_kvcm._step_batch import StepBatch, default_buckets, pick_bucket
from jax_kvcm._disk_tier import DiskIOError
from jax_kvcm._storage import (CorruptPageError, LayerGroupSpec, StorageConfig, StorageEvent,
                               StorageManager, UnreadablePageError)
from jax_kvcm._types import (CacheLevel, LayerGroupLayout, PoolGroupIndex, check_count,
                             hot_page_bytes)
from jax_kvcm._window_group import WindowGroups, ring_width, window_peak_pages

__all__ = [
    "KVCacheConfig",
    "KVCacheManager",
    "LayerGroupConfig",
    "ManagerEvent",
    "OutOfPagesError",
    "Sequence",
    "SequencePhase",
    "SequenceState",
    "SequenceView",
    "StepInFlightError",
    "SuspendResult",
]

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
_LITTLE = np.little_endian


@jax.jit
def _step_fence(pool: jax.Array) -> jax.Array:
    """A few bytes computed from a step's output pool ``[..., Hkv, D]`` (the leading axes cut to
    1, the KV-head axis kept, so a pool sharded over KV heads stays sharded: no collective):
    ready once the step is complete, and never donated, unlike the pool that the next step
    takes. One small dispatch per step."""
    return pool[(slice(0, 1),) * (pool.ndim - 2)] if pool.ndim > 2 else pool.reshape(-1)[:1]


_OLDER_FENCES = 4  # an overlapped loop runs one or two steps behind the host


_COUNT_KEYS = ("capacity", "free", "pending", "referenced", "cached")
DISK_DEGRADED_AFTER = 3  # consecutive failed disk writes after which the disk tier takes no more


MAX_TOKEN_ID = (1 << 31) - 1  # token ids are stored and hashed as int32


def _check_token_ids(arr: np.ndarray, name: str) -> None:
    """ValueError unless ``arr`` (integer dtype) holds ids in ``[0, MAX_TOKEN_ID]``: a wider id
    would wrap when stored as int32 and alias another prompt's pages."""
    if arr.size and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        bad = arr[(arr < 0) | (arr > MAX_TOKEN_ID)][0]
        raise ValueError(f"{name}: token id {int(bad)} is outside [0, {MAX_TOKEN_ID}] (int32)")


def _row_buffers(cfg: KVCacheConfig, counts: np.ndarray, cur: np.ndarray,
                 new_len: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray,
                                               np.ndarray]:
    """The table-independent part of a :class:`StepBatch` for ``B`` rows adding ``counts[b]``
    tokens after ``cur[b]``: ``(Bb, Tb, query_start [Bb+1], pos [T], positions [Tb],
    seq_lens [Bb])``, padded to the configured (batch, token) buckets."""
    B, T = counts.size, int(counts.sum())
    Bb = pick_bucket(cfg.batch_buckets, B)
    Tb = pick_bucket(cfg.token_buckets, T)
    qs = np.empty(Bb + 1, np.int32)
    qs[0] = 0
    np.cumsum(counts, out=qs[1:B + 1])
    qs[B + 1:] = T
    pos = np.arange(T) - np.repeat(qs[:B], counts) + np.repeat(cur, counts)
    positions = np.zeros(Tb, np.int32)
    positions[:T] = pos
    seq_lens = np.zeros(Bb, np.int32)
    seq_lens[:B] = new_len
    return Bb, Tb, qs, pos, positions, seq_lens


class _CallLock:
    """The manager's lock; leaving the outermost ``with`` delivers the events the call queued
    to the observers (so they see a consistent manager, and may call back into it)."""

    __slots__ = ("raw", "_after")

    def __init__(self, after: Callable[[], None]) -> None:
        self.raw = threading.Lock()
        self._after = after

    def __enter__(self) -> None:
        self.raw.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.raw.release()
        self._after()


def _prompt_array(tokens: Any, max_seq_len: int) -> np.ndarray:
    """``add_sequence``'s ``tokens`` as int32 ``[n]``, validated (ValueError naming it)."""
    try:
        toks = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("tokens must be a 1-D sequence of int32 token ids") from None
    if toks.ndim != 1 or (toks.size and toks.dtype.kind not in "iu"):
        raise ValueError("tokens must be a 1-D sequence of int32 token ids")
    _check_token_ids(toks, "tokens")
    toks = toks.astype(np.int32)
    if toks.size > max_seq_len:
        raise ValueError(f"{toks.size} tokens exceed max_seq_len {max_seq_len}")
    return toks


def _le_bytes(tokens: np.ndarray) -> bytes:
    """int32 token ids as little-endian bytes (the block-key encoding)."""
    return tokens.tobytes() if _LITTLE else tokens.astype("<i4").tobytes()


class OutOfPagesError(RuntimeError):
    """``prepare_step`` cannot get the pages it needs even by evicting every cached page;
    nothing changed (it plans before it evicts)."""


class StepInFlightError(RuntimeError):
    """The call needs the pools, which the dispatched step owns until ``complete_step``."""


class SequenceState(enum.Enum):
    ACTIVE = "active"
    SUSPENDED = "suspended"
    CLOSED = "closed"


class SequencePhase(enum.Enum):
    """Where a sequence is in its life (a request's phases in the bounded-window design):

    - ADMITTED: added (prefix matched), not yet in any prepared step;
    - EXECUTING: has been in a prepared step (ACTIVE or SUSPENDED);
    - FINISHING: closed, but pages it released wait for the fence of a step that may still read
      them (they return to the pool once that step completed);
    - FINISHED: closed and every page it held is free or cached."""

    ADMITTED = "admitted"
    EXECUTING = "executing"
    FINISHING = "finishing"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SequenceView:
    """:meth:`KVCacheManager.state` of one sequence (a snapshot; per layer group ``[G]`` tuples).

    - ``retained``: ``(first, end)`` absolute page indices the sequence holds in each group
      (``first > 0`` only in sliding-window groups: pages before it left every window);
    - ``ring_entries``: entries of its page-table row per group (a window group's ring ``R``;
      ``ceil(max_seq_len / tokens_per_page)`` for full groups); page ``j`` sits at entry
      ``j % ring_entries[g]``;
    - ``pending_retirements``: pages it released (window moves, close) that still wait for the
      fence of the last step that read them, per group."""

    seq_id: int
    state: SequenceState
    phase: SequencePhase
    num_tokens: int
    retained: tuple[tuple[int, int], ...]
    ring_entries: tuple[int, ...]
    pending_retirements: tuple[int, ...]


class SuspendResult(enum.Enum):
    SUSPENDED = "suspended"
    MUST_RECOMPUTE = "must_recompute"  # no tier could take it; the sequence is unchanged


@dataclass(frozen=True, slots=True)
class ManagerEvent:
    """``kind``: "committed", "evicted" (moved down a tier), "dropped", "onboarded",
    "suspended", "resumed"; ``num_pages`` pages; ``level`` the destination tier. "lost":
    ``num_pages`` sequences closed because a failed step lost the device pools."""

    kind: str
    num_pages: int
    level: CacheLevel | None = None


# -- configuration ---------------------------------------------------------------------------


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

    Buckets default to powers of two up to the maxima (token buckets start at
    ``tokens_per_page``).

    ``hot_backend``: "paged" (default) or "arena": the device pages of each sequence are then
    consecutive in one virtual reservation with physical memory mapped on demand
    (``arena``: an :class:`~jax_kvcm._arena.ArenaConfig`; one full-attention layer group;
    ``device_pages``/``device_bytes`` are left out: the budget is ``arena.budget_bytes``). See
    :mod:`jax_kvcm._arena_manager`.
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
    :mod:`jax_kvcm._manager` ("Write-back ahead").
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
    hot_backend: str = "paged"
    arena: Any = None
    mesh: jax.sharding.Mesh | None = None
    mesh_axis: str = "tp"
    offload_ahead_pages: int = 0

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
        self._check_mesh()
        page_bytes = list(self.device_page_bytes())
        if self.hot_backend not in ("paged", "arena"):
            raise ValueError(f"hot_backend must be 'paged' or 'arena', got {self.hot_backend!r}")
        if self.hot_backend == "arena":
            if self.mesh is not None:
                raise ValueError("hot_backend='arena' does not take a mesh (one device)")
            from jax_kvcm._arena_manager import check_arena_config
            check_arena_config(self, groups, page_bytes)
        elif self.arena is not None:
            raise ValueError("arena is only for hot_backend='arena'")
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
        if self.offload_ahead_pages and self.hot_backend != "paged":
            raise ValueError("offload_ahead_pages is for hot_backend='paged'")
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
        return tuple(ring_width(g.sliding_window, self.tokens_per_page, self.max_window_chunk, P)
                     if g.sliding_window and self.ring_tables else P for g in self.layer_groups)

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
        return np.asarray([min(pages, window_peak_pages(g.sliding_window, self.tokens_per_page, n))
                           if g.sliding_window else pages for g in self.layer_groups], np.int64)


# -- sequences -------------------------------------------------------------------------------


class Sequence:
    """A handle; state lives in the manager's row arrays. ``num_reused_tokens``: tokens matched
    from the prefix cache at :meth:`KVCacheManager.add_sequence` (prefill can skip them)."""

    __slots__ = ("_mgr", "_row", "_nodes", "state", "num_reused_tokens", "seq_id", "_salt",
                 "_parked", "_done_step", "__weakref__")

    def __init__(self, mgr: KVCacheManager, row: int, seq_id: int, salt: bytes) -> None:
        self._mgr = mgr
        self._row = row
        self._nodes: list[BlockNode] = []
        self.state = SequenceState.ACTIVE
        self.num_reused_tokens = 0
        self.seq_id = seq_id
        self._salt = salt
        self._parked: tuple[CacheLevel, np.ndarray] | None = None  # suspended private pages
        self._done_step = 0  # closed: the step that must complete before its pages are free

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V are (or are being) written."""
        return int(self._mgr._len[self._row]) if self.state is not SequenceState.CLOSED else 0

    @property
    def num_pages(self) -> int:
        return int(self._mgr._npages[self._row]) if self.state is not SequenceState.CLOSED else 0

    @property
    def row(self) -> int:
        """The sequence's row in the manager's tables (changes only by
        :meth:`KVCacheManager.compact`)."""
        return self._row

    @property
    def phase(self) -> SequencePhase:
        """See :class:`SequencePhase`."""
        return self._mgr._phase(self)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the manager knows (the prompt, ids given to ``prepare_step`` or
        :meth:`KVCacheManager.record_token_ids`); may be below ``num_tokens`` when steps were
        given counts, or above it while a prompt is being prefilled."""
        return int(self._mgr._known[self._row]) if self.state is not SequenceState.CLOSED else 0

    def page_ids(self, layer_group: int = 0) -> np.ndarray:
        """Device slots of this sequence's pages by absolute page index (a copy; ACTIVE
        sequences only). In a sliding-window layer group, pages no future query of the sequence
        can see are released and read 0 (the null page)."""
        m = self._mgr
        return m._row_pages(self._row, 0, int(m._npages[self._row]))[layer_group].copy()

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, state={self.state.value})"


@dataclass(slots=True)
class _Stats:
    num_steps: int = 0
    num_prefix_queries: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_committed_pages: int = 0
    num_adopted_pages: int = 0
    num_evicted_pages: list[int] = field(default_factory=lambda: [0, 0, 0])
    num_dropped_pages: int = 0
    num_onboarded_pages: int = 0
    num_window_released_pages: int = 0
    num_suspended: int = 0
    num_resumed: int = 0
    num_refused_suspends: int = 0
    num_refused_resumes: int = 0
    num_fence_waits: int = 0        # allocations that waited for a dispatched step
    fence_wait_seconds: float = 0.0  # host time spent in those waits
    num_offloads_ahead: int = 0          # write-back-ahead transactions (offload_ahead_pages)
    num_offloaded_ahead_pages: int = 0   # pages they moved to the host tier
    num_offload_ahead_waits: int = 0     # times the host waited for such a copy to finish
    offload_ahead_wait_seconds: float = 0.0
    num_offload_ahead_failures: int = 0  # copies that failed (their pages rolled back)
    num_offload_ahead_restored_pages: int = 0
    num_aborted_steps: int = 0
    num_failed_steps: int = 0       # steps whose pools were lost (abort/recover_from_failed_step)
    num_lost_sequences: int = 0     # sequences closed by such a loss (to recompute)
    num_observer_errors: int = 0
    num_disk_write_errors: int = 0       # failed writes to the disk tier (e.g. ENOSPC)
    num_disk_read_errors: int = 0        # failed reads of it (EIO, short reads): misses
    num_dropped_on_disk_error: int = 0   # pages dropped because the disk could not take them


@dataclass(slots=True)
class _Offload:
    """A write-back-ahead offload whose copy was not seen finished: ``nodes`` moved from device
    slots ``src [G, n]`` to host slots ``dst [G, n]`` (column i: nodes[i]); ``entry`` is the
    pending free of ``src``, held until ``fence`` is settled."""

    fence: Any
    nodes: list[BlockNode]
    src: np.ndarray
    dst: np.ndarray
    entry: list[Any]


# -- the manager -----------------------------------------------------------------------------


class KVCacheManager:
    """See the module docstring. Public calls are serialized by one lock.

    With ``config.hot_backend == "arena"`` the constructor returns an
    :class:`~jax_kvcm._arena_manager.ArenaKVCacheManager` (the same calls over a contiguous
    arena; see there)."""

    def __new__(cls, config: KVCacheConfig, *args: Any, **kwargs: Any) -> KVCacheManager:
        if (cls is KVCacheManager and isinstance(config, KVCacheConfig)
                and config.hot_backend == "arena"):
            from jax_kvcm._arena_manager import ArenaKVCacheManager
            return super().__new__(ArenaKVCacheManager)
        return super().__new__(cls)

    def __init__(self, config: KVCacheConfig, cold_page_codec: ColdPageCodec | None = None, *,
                 device: jax.Device | None = None,
                 _hash_fn: Callable[[bytes], bytes] | None = None) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError("config must be a KVCacheConfig")
        self.config = config
        self._lock = _CallLock(self._deliver)
        self._tpp = config.tokens_per_page
        self._G = len(config.layer_groups)
        self._P = config.pages_per_seq
        specs = tuple(LayerGroupSpec(g.num_layers, config.tokens_per_page, g.num_kv_heads,
                                     g.head_dim, g.pool_dtype) for g in config.layer_groups)
        self.storage = StorageManager(
            StorageConfig(layer_groups=specs, device_slots=tuple(config.device_pages),
                          host_bytes=config.host_bytes, disk_dir=config.disk_dir,
                          disk_bytes=config.disk_bytes), cold_page_codec,
            device=self._placement(config, device))
        self.tree = PrefixTree(_hash_fn, self._G)
        # One group manager per layer-group kind (each owns its groups' page tables).
        full = [g for g, lg in enumerate(config.layer_groups) if not lg.sliding_window]
        wins = [g for g, lg in enumerate(config.layer_groups) if lg.sliding_window]
        self._full = FullGroups(full, [self._P] * len(full)) if full else None
        self._win = (WindowGroups(wins, [config.layer_groups[g].sliding_window for g in wins],
                                  self._tpp, self._P, config.max_window_chunk,
                                  config.ring_tables, self._G) if wins else None)
        self._kinds: list[GroupTables] = [k for k in (self._full, self._win) if k is not None]
        self._widths = np.asarray(config.table_widths, np.int64)
        self._width = int(self._widths.max())  # StepBatch.page_table's last axis
        self._zeros_g = np.zeros(self._G, np.int64)
        layout = self.storage.layout
        self._levels = list(layout.levels)
        # Pool of each layer group per level (cold layer groups with equal page sizes share one).
        self._pool_of = {lv: layout.pool_of(lv) for lv in self._levels}
        self._page_bytes = {lv: layout.page_bytes(lv) for lv in self._levels}
        self._disk_failures = 0       # consecutive failed disk writes
        self._disk_degraded = False   # no more writes to the disk tier (see _disk_write_failed)
        self._disk_chunk = 1 << 30
        if self.storage._ring is not None:
            self._disk_chunk = max(1, self.storage._ring.capacity
                                   // (3 * max(self.storage.cold_page_bytes)))
        self._observers: list[Callable[[Any], None]] = []
        self.events: deque[Any] = deque(maxlen=4096)
        self._queue: list[Any] = []          # events not yet given to the observers
        self._delivering = threading.local()
        #: ``(observer, event, exception)`` of the latest observer calls that raised.
        self.observer_errors: deque[tuple[Callable[[Any], None], Any, Exception]] = deque(
            maxlen=64)
        self.storage.add_observer(self._emit)
        self._stats = _Stats()
        # Row arrays (grown by doubling).
        self._tokens = np.zeros((0, self._P * self._tpp), np.int32)
        self._len = np.zeros(0, np.int64)
        self._npages = np.zeros(0, np.int64)
        self._known = np.zeros(0, np.int64)
        self._ncommit = np.zeros(0, np.int64)    # == len(seq._nodes)
        self._commit_ok = np.zeros(0, np.int64)  # 1 while the sequence may commit pages
        self._ran = np.zeros(0, np.int64)        # 1 once the sequence was in a prepared step
        self._seq_id = np.zeros(0, np.int64)     # the seq_id of the row's sequence
        self._free_rows: list[int] = []
        self._grow_rows(16)
        self._seqs: dict[int, Sequence] = {}
        self._next_id = 0
        # Step state.
        # (seqs, rows, npages, len, known before the step): what abort_step restores.
        self._in_step: tuple[list[Sequence], np.ndarray, np.ndarray, np.ndarray,
                             np.ndarray] | None = None
        self._handed: list[tuple[jax.Array, jax.Array]] = []  # the pools the step was given
        self._step_index = 0        # completed steps
        self._fence: Any = None     # a fence of the latest completed step (_step_fence)
        # (step index, fence) of earlier steps not yet known complete, oldest first, at most
        # _OLDER_FENCES: an overlapped loop completes step n before step n - 1 has run, and the
        # pages step n - 1 freed must come back once it has, not once the newest step has.
        self._older_fences: deque[tuple[int, Any]] = deque()
        self._ready_upto = 0        # every step <= this is known complete
        # NOTE: pending frees: [step index that must complete, slots [G, n], owner seq ids [n]
        # or None]; step index None means "the step in flight" (tagged at complete_step).
        # Entries NO_PAGE are no page (a layer group with nothing to free there).
        self._pending: list[list[Any]] = []
        self._num_pending = np.zeros(self._G, np.int64)
        # Write-back-ahead offloads whose copies were not seen finished (see _settle_offloads).
        self._offloads: list[_Offload] = []
        self._offload_of: dict[int, _Offload] = {}  # id(node) -> its offload in flight
        self._closed_in_step = False
        self._shut = False

    # -- small helpers -----------------------------------------------------------------------

    _ROW_ARRAYS = ("_len", "_npages", "_known", "_ncommit", "_commit_ok", "_ran", "_seq_id")

    def _grow_rows(self, n: int) -> None:
        old = self._len.size
        new = max(n, 2 * old)
        for kind in self._kinds:
            kind.grow(new)
        tokens = np.zeros((new, self._tokens.shape[1]), np.int32)
        tokens[:old] = self._tokens
        self._tokens = tokens
        for name in self._ROW_ARRAYS:
            arr = np.zeros(new, np.int64)
            arr[:old] = getattr(self, name)
            setattr(self, name, arr)
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def _view(self, rows: np.ndarray, j: np.ndarray) -> np.ndarray:
        """``[G, n]`` slots of pages ``j`` of ``rows`` (0: none, e.g. released by a window)."""
        if len(self._kinds) == 1:
            return self._kinds[0].view(rows, j)
        out = np.empty((self._G, j.size), np.int32)
        for kind in self._kinds:
            out[kind.ids] = kind.view(rows, j)
        return out

    def _row_pages(self, row: int, first: int, last: int) -> np.ndarray:
        """``[G, last - first]`` slots of pages ``first..last-1`` of ``row`` (0: none, e.g.
        released by a window)."""
        if len(self._kinds) == 1:
            return self._kinds[0].pages(row, first, last)
        out = np.zeros((self._G, last - first), np.int32)
        for kind in self._kinds:
            out[kind.ids] = kind.pages(row, first, last)
        return out

    def _wrel_at(self, num_tokens: int) -> np.ndarray:
        """``[G]``: leading window-released pages of a holder of ``num_tokens`` tokens."""
        return self._win.wrel_at(num_tokens) if self._win else self._zeros_g

    def _emit(self, event: Any) -> None:
        """Records an event; observers get it when the public call ends (:meth:`_deliver`)."""
        self.events.append(event)
        if self._observers:
            self._queue.append(event)

    def _deliver(self) -> None:
        """Gives the queued events to the observers, outside the lock, once the call that queued
        them left the manager consistent. An observer that raises changes nothing: the error is
        recorded (:attr:`observer_errors`, ``stats()["num_observer_errors"]``) and warned about,
        and the other observers still get the event. Events queued by a call an observer makes
        are delivered by the same loop, after the current ones."""
        if not self._queue or getattr(self._delivering, "on", False):
            return
        self._delivering.on = True
        try:
            while True:
                with self._lock.raw:
                    batch, self._queue = self._queue, []
                    observers = list(self._observers)
                if not batch:
                    return
                for event in batch:
                    for fn in observers:
                        try:
                            fn(event)
                        except Exception as e:  # noqa: BLE001 - isolated, recorded, warned
                            with self._lock.raw:
                                self._stats.num_observer_errors += 1
                                self.observer_errors.append((fn, event, e))
                            warnings.warn(f"KVCacheManager observer {fn!r} raised {e!r} on "
                                          f"{event}; the manager is unaffected (see "
                                          "observer_errors)", RuntimeWarning, stacklevel=3)
        finally:
            self._delivering.on = False

    def add_observer(self, fn: Callable[[Any], None]) -> None:
        """``fn(event)`` for every :class:`StorageEvent` and :class:`ManagerEvent`, in order,
        called after the manager call that caused them returned its state to consistency
        (outside the manager's lock: ``fn`` may call the manager). An exception from ``fn`` is
        recorded in :attr:`observer_errors` and warned about, never propagated."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        with self._lock:
            self._observers.append(fn)

    def _check_open(self) -> None:
        if self._shut:
            raise RuntimeError("the KV-cache manager is shut down")

    def _check_seq(self, seq: Sequence, *states: SequenceState) -> None:
        self._check_open()
        if not isinstance(seq, Sequence) or seq._mgr is not self:
            raise ValueError(f"{seq!r} is not a sequence of this manager")
        if seq.state not in states:
            raise ValueError(f"{seq!r} is {seq.state.value}, expected one of "
                             f"{[s.value for s in states]}")

    def _need_pools(self, what: str) -> None:
        if self._in_step is not None:
            raise StepInFlightError(f"{what} needs the pools: call complete_step first")

    @staticmethod
    def _placement(config: KVCacheConfig, device: jax.Device | None) -> Any:
        """Where the hot pools live: ``config.pool_sharding`` with a mesh, else ``device``."""
        if config.mesh is None:
            return device
        if device is not None:
            raise ValueError("give either device or KVCacheConfig.mesh, not both")
        return config.pool_sharding

    @property
    def caches(self) -> list[tuple[jax.Array, jax.Array]]:
        """The hot pools, one ``(k, v)`` per layer group, to pass (donated) into the step that
        ``prepare_step`` prepared; the step's outputs go back through ``complete_step``."""
        with self._lock:
            return list(self.storage.pools)

    # -- fences and pending frees ------------------------------------------------------------

    def _poll_fence(self, block: bool) -> None:
        """Advances ``_ready_upto`` past every step known complete: the latest step's fence
        (``block`` waits for it), else the newest ready one of the older steps' (steps complete
        in order, so it covers every step before it)."""
        older = self._older_fences
        f = self._fence
        if f is None or self._ready_upto >= self._step_index:
            older.clear()
            return
        if f.is_deleted():
            # NOTE: _step_fence's arrays are never donated; a deleted fence (a donated pool)
            # is still answered by the pools that later work made from it.
            f = self.storage.pools[0][0]
        if block:
            self._stats.num_fence_waits += 1
            t = time.perf_counter()
            f.block_until_ready()
            self._stats.fence_wait_seconds += time.perf_counter() - t
        if block or f.is_ready():
            self._ready_upto = self._step_index
            older.clear()
            return
        for i in range(len(older) - 1, -1, -1):
            step, fence = older[i]
            if step <= self._ready_upto or fence.is_ready():
                self._ready_upto = max(self._ready_upto, step)
                for _ in range(i + 1):
                    older.popleft()
                return

    def _reclaim(self, block: bool = False) -> int:
        """Returns ready pending frees to the allocator; the number of pages returned."""
        if not self._pending:
            return 0
        if self._offloads:
            self._settle_offloads(block)
        self._poll_fence(block)
        keep, n = [], 0
        for entry in self._pending:
            step, slots = entry[0], entry[1]
            if step is not None and step <= self._ready_upto and entry[3] is None:
                for g in range(self._G):
                    s = slots[g]
                    s = s[s >= 0]
                    self.storage.free(D, g, s)
                    self._num_pending[g] -= s.size
                    n += s.size
            else:
                keep.append(entry)
        self._pending = keep
        return n

    def _defer_free(self, slots: np.ndarray, owners: np.ndarray | int | None = None,
                    fence: Any = None) -> list[Any] | None:
        """Device slots ``[G, n]`` (``NO_PAGE`` entries skipped) to free once the last step that
        may read them completed (and ``fence``, when given, is settled: an offload's copy that
        reads them); ``owners``: the seq id (or one per column) that released them (for
        :meth:`state`). Returns the pending entry (None when there is nothing to free)."""
        if slots.shape[1] == 0:
            return None
        step = None if self._in_step is not None else self._step_index
        entry = [step, slots, owners, fence]
        self._pending.append(entry)
        self._num_pending += np.count_nonzero(slots >= 0, axis=1)
        return entry

    # -- write-back ahead --------------------------------------------------------------------

    def _offload_ahead(self) -> None:
        """Write-back ahead (module docstring): when fewer than ``offload_ahead_pages`` device
        pages of a pool are free or pending, moves that many least recently used cached pages
        to the host tier (making room there as eviction does); their device slots are freed
        once the copy's fence is settled. Does nothing when the host tier cannot take them."""
        want = self.config.offload_ahead_pages
        if not want or H not in self._levels:
            return
        self._reclaim()
        lack = want - (self._pool_free(D) + self._per_pool(D, self._num_pending))
        short = lack[self._pool_of[D]] > 0
        if not short.any():
            return
        victims = self.tree.lru_nodes(D, int(lack.max()), short)
        if not victims:
            return
        if not self._make_room_cold(H, np.count_nonzero(self._node_slots(victims) >= 0, axis=1)):
            return
        victims = [v for v in victims if v.alive and v.level is D and v.refcount == 0]
        if not victims:
            return
        src = self._node_slots(victims)
        try:
            out = self.storage.offload_ahead([(g, src[g][src[g] >= 0])
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
            self.tree.move(n, H, dst[:, i].copy())
        entry = self._defer_free(src.copy(), None, fence)
        rec = _Offload(fence, victims, src, dst, entry)
        self._offloads.append(rec)
        for n in victims:
            self._offload_of[id(n)] = rec
        self._stats.num_offloads_ahead += 1
        self._stats.num_offloaded_ahead_pages += len(victims)
        self._stats.num_evicted_pages[H] += len(victims)
        self._emit(ManagerEvent("evicted", len(victims), H))

    def _settle_offloads(self, block: bool, nodes: list[BlockNode] | None = None) -> None:
        """Settles write-back-ahead offloads (all, or those that moved ``nodes``): a finished
        copy lets its device slots be freed; a failed one is rolled back
        (:meth:`_offload_failed`); with ``block`` unfinished ones are waited for (counted in
        ``num_offload_ahead_waits``), else kept."""
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
                self._offload_failed(rec, e)
            rec.entry[3] = None
            self._offloads.remove(rec)
            for n in rec.nodes:
                if self._offload_of.get(id(n)) is rec:
                    del self._offload_of[id(n)]

    def _offload_failed(self, rec: _Offload, error: Exception) -> None:
        """Rolls back a failed write-back-ahead copy: each of its pages still where the offload
        put it (same node, on the host, same slots) returns to its device slots, which were
        never freed, and its host slots are freed; the rest (dropped or moved on since) keep
        their fate and their device slots are freed as pending frees."""
        entry, restored = rec.entry, 0
        for i, n in enumerate(rec.nodes):
            if not (n.alive and n.level is H and np.array_equal(n.slots, rec.dst[:, i])):
                continue
            for g in np.flatnonzero(rec.dst[:, i] >= 0).tolist():
                self.storage.free(H, g, rec.dst[g:g + 1, i])
            self.tree.move(n, D, rec.src[:, i].copy())
            self._num_pending -= entry[1][:, i] >= 0
            entry[1][:, i] = NO_PAGE
            restored += 1
        self._stats.num_offload_ahead_failures += 1
        self._stats.num_offload_ahead_restored_pages += restored
        self._stats.num_evicted_pages[H] -= restored
        warnings.warn(f"KVCacheManager: a write-back-ahead copy of {len(rec.nodes)} pages to the "
                      f"host tier failed ({error!r}); {restored} pages stay on the device",
                      RuntimeWarning, stacklevel=3)

    # -- room: free, pending, cached pages per pool ------------------------------------------

    def _num_free(self, level: CacheLevel) -> int:
        return min(self.storage.num_free(level, g) for g in range(self._G))

    def _per_pool(self, level: CacheLevel, per_group: np.ndarray) -> np.ndarray:
        return np.bincount(self._pool_of[level], weights=per_group).astype(np.int64)

    def _pool_free(self, level: CacheLevel) -> np.ndarray:
        pools = self._pool_of[level]
        free = np.zeros(int(pools.max()) + 1, np.int64)
        for g in range(self._G):
            free[pools[g]] = self.storage.num_free(level, g)
        return free

    def _fits(self, level: CacheLevel, need: np.ndarray) -> bool:
        """Whether ``need[g]`` pages of every layer group can be allocated at ``level`` now."""
        if (self._pool_free(level) < self._per_pool(level, need)).any():
            return False
        return self.storage.governor.available(level) >= int(need @ self._page_bytes[level])

    def _reclaimable(self, level: CacheLevel) -> np.ndarray:
        """Pages per layer group that eviction (cached pages) and waiting (pending device frees)
        can add to the free ones at ``level``."""
        out = self.tree.cached_pages(level)
        if level is D:
            out += self._num_pending
            if self._win:
                out += self._win.num_unneeded()
        return out

    def _room(self, level: CacheLevel, need: np.ndarray, keep: np.ndarray | None = None) -> bool:
        """Whether ``need`` fits at ``level`` once every cached page there (but ``keep[g]`` of
        them, which the caller is about to take) is evicted and every pending free is
        reclaimed: the plan made before anything is evicted."""
        extra = self._reclaimable(level)
        if keep is not None:
            extra = extra - keep
        if (self._pool_free(level) + self._per_pool(level, extra)
                < self._per_pool(level, need)).any():
            return False
        return (self.storage.governor.available(level) + int(extra @ self._page_bytes[level])
                >= int(need @ self._page_bytes[level]))

    def _evict_some(self, level: CacheLevel, need: np.ndarray, *,
                    count_pending: bool = True) -> bool:
        """Evicts cached pages at ``level`` toward ``need`` (those of layer groups whose pools
        lack pages that pending frees will not bring back, or with ``count_pending=False`` lack
        them now; least recently used first; window pages of referenced nodes before whole
        nodes); False when there is nothing to evict."""
        lack = self._per_pool(level, need) - self._pool_free(level)
        if level is D and count_pending:
            lack -= self._per_pool(D, self._num_pending)
        pools = self._pool_of[level]
        short = lack[pools] > 0
        if level is D and self._win and self._drop_window_pages(short, lack[pools]):
            return True
        victims = self.tree.lru_nodes(level, max(1, int(lack.max())),
                                      short if short.any() else None)  # else bytes are short
        if not victims:
            return False
        if level is D:
            self._need_pools("eviction")
        self._evict(victims, level)
        return True

    # -- moves -------------------------------------------------------------------------------

    def _move(self, parts: list[tuple[CacheLevel, np.ndarray, CacheLevel]]
              ) -> list[np.ndarray] | None:
        """``(src_level, slots [G, n], dst_level)`` moves (``NO_PAGE`` entries stay) as one
        storage transaction; the destination ``[G, n]`` of each, or None when refused. Nothing
        changed on refusal or failure (an exception)."""
        moves, where = [], []
        for p, (src_level, src, dst_level) in enumerate(parts):
            chunk = 1 << 30
            if K in (src_level, dst_level) and src_level != dst_level:
                # NOTE: disk hops go through the staging ring; a lease larger than the ring
                # fails, so split them (the ring is at least 3 pages; a third of it per chunk).
                chunk = max(1, self._disk_chunk)
            for g in range(self._G):
                cols = np.flatnonzero(src[g] >= 0)
                for start in range(0, cols.size, chunk):
                    c = cols[start:start + chunk]
                    moves.append((g, src_level, src[g, c], dst_level))
                    where.append((p, g, c))
        to_disk = any(dst_level is K for _, _, _, dst_level in moves)
        try:
            out = self.storage.migrate_many(moves)
        except CorruptPageError as e:  # unreadable disk pages too (a miss for the caller)
            if isinstance(e, UnreadablePageError):
                self._stats.num_disk_read_errors += 1
            raise
        except DiskIOError as e:  # a write failed (reads raise the above): a refusal
            if not to_disk:
                raise
            self._disk_write_failed(e)
            return None
        if out is None:
            return None
        if to_disk:
            self._disk_failures = 0
        res = [np.full(src.shape, NO_PAGE, np.int32) for _, src, _ in parts]
        for (p, g, c), dst in zip(where, out):
            res[p][g, c] = dst
        return res

    def _disk_write_failed(self, error: DiskIOError) -> None:
        """A write to the disk tier failed (nothing changed: the transaction rolled back). The
        disk is a cache: the caller drops what it meant to write (or, suspending, moves on to
        ``MUST_RECOMPUTE``). After ``DISK_DEGRADED_AFTER`` consecutive failures the tier is
        *degraded*: nothing is written to it any more (its pages can still be read), a
        ``"disk_degraded"`` event is emitted and ``stats()["disk_degraded"]`` is True."""
        self._stats.num_disk_write_errors += 1
        self._disk_failures += 1
        if not self._disk_degraded and self._disk_failures >= DISK_DEGRADED_AFTER:
            self._disk_degraded = True
            self._emit(ManagerEvent("disk_degraded", 0, K))
            warnings.warn(f"KVCacheManager: {self._disk_failures} disk writes failed in a row "
                          f"(last: {error}); the disk tier takes no more pages", RuntimeWarning,
                          stacklevel=2)

    def _writable(self, level: CacheLevel) -> bool:
        """Whether pages may move to ``level`` (not a degraded disk tier)."""
        return not (level is K and self._disk_degraded)

    def _migrate_nodes(self, nodes: list[BlockNode], dst: CacheLevel) -> bool:
        """Moves nodes (all at one level) to ``dst``; False (nothing moved) when refused."""
        if not nodes:
            return True
        out = self._move([(nodes[0].level, self._node_slots(nodes), dst)])
        if out is None:
            return False
        for i, n in enumerate(nodes):
            self.tree.move(n, dst, out[0][:, i].copy())
        return True

    @staticmethod
    def _node_slots(nodes: list[BlockNode]) -> np.ndarray:
        if not nodes:
            return np.zeros((0, 0), np.int32)
        return np.stack([n.slots for n in nodes], axis=1)

    def _drop_window_pages(self, short: np.ndarray | int, lack: np.ndarray | int) -> bool:
        """Frees unneeded window pages (wlru) of the first layer group in ``short`` (a ``[G]``
        mask, or one group id) that has any, up to ``lack`` of them; False when none."""
        if isinstance(short, int):
            short = np.arange(self._G) == short
        lack = np.broadcast_to(np.asarray(lack, np.int64), (self._G,))
        slots = self._win.drop_unneeded(self.tree, short, lack)
        if slots is None:
            return False
        self._defer_free(slots)
        self._stats.num_dropped_pages += slots.shape[1]
        return True

    def _usable_prefix(self, nodes: list[BlockNode]) -> list[BlockNode]:
        return self._win.usable_prefix(nodes) if self._win else nodes

    def _take(self, node: BlockNode, j: int, wr: np.ndarray) -> None:
        if self._win:
            self._win.take(node, j, wr)

    def _drop_hold(self, node: BlockNode, j: int, wr: np.ndarray) -> None:
        if self._win:
            self._win.drop_hold(self.tree, node, j, wr)
        else:
            self.tree.decref(node)

    # -- eviction ----------------------------------------------------------------------------

    def _drop(self, node: BlockNode) -> None:
        """Drops a cached node and its subtree from the tree and frees their pages."""
        removed = self.tree.remove_subtree(node)
        dev = [n.slots for n in removed if n.level is D]
        if dev:
            self._defer_free(np.stack(dev, axis=1))
        for lv in (H, K):
            cold = [n.slots for n in removed if n.level is lv]
            if cold:
                s = np.stack(cold, axis=1)
                for g in range(self._G):
                    self.storage.free(lv, g, s[g][s[g] >= 0])
        self._stats.num_dropped_pages += len(removed)
        self._emit(ManagerEvent("dropped", len(removed)))

    def _make_room_cold(self, level: CacheLevel, need: np.ndarray) -> bool:
        """Frees room for ``need[g]`` pages at a cold level by moving its cached pages down (or
        dropping them). True when they fit afterwards; False (nothing evicted) when even
        evicting every cached page there would not make them fit."""
        if self._fits(level, need):
            return True
        if not self._room(level, need):
            return False
        while not self._fits(level, need):
            if not self._evict_some(level, need):  # pragma: no cover - _room counted them
                raise RuntimeError(f"{level.name}: planned room not found")
        return True

    def _evict(self, victims: list[BlockNode], level: CacheLevel) -> None:
        """Moves cached ``victims`` (at ``level``) one tier down, else drops them."""
        failures = self._stats.num_disk_write_errors
        for lower in self._levels:
            if lower <= level or not self._writable(lower):
                continue
            if self._make_room_cold(lower, np.count_nonzero(self._node_slots(victims) >= 0,
                                                            axis=1)):
                if self._offloads and level is H:  # NOTE: a failed copy rolls pages back
                    self._settle_offloads(True, victims)
                # cascades may have dropped some
                victims = [v for v in victims if v.alive and v.level is level]
                if self._migrate_nodes(victims, lower):
                    self._stats.num_evicted_pages[lower] += len(victims)
                    self._emit(ManagerEvent("evicted", len(victims), lower))
                    return
        victims = [v for v in victims if v.alive and v.level is level]
        if self._stats.num_disk_write_errors > failures:
            self._stats.num_dropped_on_disk_error += len(victims)
        for v in victims:
            if v.alive:  # dropping one drops its subtree
                self._drop(v)

    def _reserve_device(self, need: np.ndarray) -> bool:
        """Makes ``need[g]`` device pages of every layer group allocatable; False, with nothing
        evicted or reclaimed, when even evicting every cached page would not do."""
        assert self._in_step is None, "device allocation needs the pools"
        if not self._fits(D, need) and not self._room(D, need):
            return False
        self._reclaim()
        while not self._fits(D, need):
            # NOTE: pending frees that would cover ``need`` but wait for a step still running
            # (an overlapped loop prepares the next step while the device runs this one): waiting
            # would idle the device for the rest of the host's preparation, so cached pages are
            # evicted instead (to a cold tier when there is one); only with nothing cached does
            # the allocation wait. (H200, full seed run: the mixed steps' host time in step()
            # fell from 68 to 19 ms with this; benchmarks/RESULTS.md, sessions 5 and 6.)
            if self._num_pending.any():
                if self._reclaim() > 0:
                    continue
                if (self._pool_free(D) + self._per_pool(D, self._num_pending)
                        >= self._per_pool(D, need)).all():
                    if not self._evict_some(D, need, count_pending=False):
                        self._reclaim(block=True)
                    continue
            if self._evict_some(D, need):
                self._reclaim()
            elif self._num_pending.any():
                self._reclaim(block=True)
            else:  # pragma: no cover - _room counted every page
                raise RuntimeError("device: planned room not found")
        return True

    def _allocate_device(self, n: int) -> np.ndarray | None:
        """``[G, n]`` device slots, or None (nothing changed)."""
        if n == 0:
            return np.zeros((self._G, 0), np.int32)
        if not self._reserve_device(np.full(self._G, n, np.int64)):
            return None
        out = []
        for g in range(self._G):
            s = self.storage.allocate(D, g, n)
            if s is None:  # pragma: no cover - _reserve_device checked slots and bytes
                for gg, back in enumerate(out):
                    self.storage.free(D, gg, back)
                return None
            out.append(s)
        return np.stack(out)

    # -- sequences ---------------------------------------------------------------------------

    def add_sequence(self, tokens: Any, *, salt: Any = None) -> Sequence:
        """Registers a prompt; reuses the longest committed prefix (at most all but the last
        token, so the step still produces logits). Lower-tier hits are onboarded to the device
        when the pools are free (not between prepare_step and complete_step) and room exists;
        otherwise the match stops before them."""
        toks = _prompt_array(tokens, self.config.max_seq_len)
        salt_b = salt_bytes(salt)
        with self._lock:
            self._check_open()
            nodes: list[BlockNode] = []
            if self.config.enable_prefix_reuse and toks.size > 1:
                max_pages = (toks.size - 1) // self._tpp
                self._stats.num_prefix_queries += 1
                self._stats.num_prefix_query_tokens += int(toks.size)
                nodes = self._onboard(self._usable_prefix(
                    self.tree.match(toks, salt_b, self._tpp, max_pages)))
            if not self._free_rows:
                self._grow_rows(self._len.size * 2)
            row = self._free_rows.pop()
            seq = Sequence(self, row, self._next_id, salt_b)
            self._next_id += 1
            k = len(nodes)
            seq._nodes = nodes
            self._tokens[row, :toks.size] = toks
            self._len[row] = k * self._tpp
            self._npages[row] = k
            self._set_table(seq, np.zeros((self._G, 0), np.int32))
            self._known[row] = toks.size
            self._ncommit[row] = k
            self._commit_ok[row] = int(self.config.enable_prefix_reuse)
            self._ran[row] = 0
            self._seq_id[row] = seq.seq_id
            seq.num_reused_tokens = k * self._tpp
            self._stats.num_prefix_hit_tokens += k * self._tpp
            self._seqs[seq.seq_id] = seq
            return seq

    def _onboard(self, nodes: list[BlockNode]) -> list[BlockNode]:
        """Takes the matched nodes that are usable for a new holder: those on the device up to
        the first lower-tier one, and all of them if the lower-tier pages needed can be brought
        to the device (one transaction; window pages no one needs are freed instead). Lower-tier
        hits that cannot are left untouched (not even their LRU position changes); an I/O error
        releases every reference taken and propagates."""
        if self._offloads and self._in_step is None:  # NOTE: a failed copy rolls pages back
            self._settle_offloads(True, [n for n in nodes if n.level is H])
        lower = [j for j, n in enumerate(nodes) if n.level is not D]
        wr = self._wrel_at(len(nodes) * self._tpp)
        if lower and self._in_step is None:
            # NOTE: pages this holder's windows need, or another holder's (a suspended one).
            slots = self._node_slots([nodes[j] for j in lower])
            wanted = slots >= 0
            if self._win:
                self._win.wanted(nodes, lower, slots, wr, wanted)
            need = np.count_nonzero(wanted, axis=1)
            if self._fits(D, need) or self._room(D, need, self._kept(nodes, wr)):
                if self._onboard_lower(nodes, lower, wr, np.where(wanted, slots, NO_PAGE)):
                    return nodes
        nodes = self._usable_prefix(nodes[:lower[0]] if lower else nodes)
        wr = self._wrel_at(len(nodes) * self._tpp)
        for j, n in enumerate(nodes):
            self.tree.incref(n)
            self._take(n, j, wr)
        return nodes

    def _kept(self, nodes: list[BlockNode], wr: np.ndarray) -> np.ndarray:
        """Per layer group, the cached device pages among ``nodes`` that a new holder with
        windows from ``wr`` would take (and so no eviction could free)."""
        out = np.zeros(self._G, np.int64)
        full = self._full.ids if self._full else []
        for n in nodes:
            if n.level is D and n.refcount == 0:
                out[full] += n.slots[full] >= 0
        if self._win:
            self._win.kept(nodes, wr, out)
        return out

    def _onboard_lower(self, nodes: list[BlockNode], lower: list[int], wr: np.ndarray,
                       src: np.ndarray) -> bool:
        """Takes every node and brings pages ``src[:, i]`` of ``nodes[lower[i]]`` to the
        device (room was planned), freeing their other pages; False (every reference given
        back, nothing moved) when it failed."""
        for j, n in enumerate(nodes):  # NOTE: held while room is made: eviction cannot take them
            self.tree.incref(n)
            self._take(n, j, wr)
        cols = [[i for i, j in enumerate(lower) if nodes[j].level is lv] for lv in (K, H)]
        parts = [(lv, src[:, c], D) for lv, c in zip((K, H), cols) if c]  # disk first: it can fail
        corrupt: list[BlockNode] = []
        out = None
        try:
            if self._reserve_device(np.count_nonzero(src >= 0, axis=1)):
                try:
                    out = self._move(parts)
                except CorruptPageError as e:  # a miss; nothing moved; bad pages dropped below
                    bad = set(e.slots.tolist())
                    corrupt = [nodes[lower[i]] for i in cols[0]
                               if int(nodes[lower[i]].slots[e.layer_group]) in bad]
        except BaseException:
            for j, n in enumerate(nodes):
                self._drop_hold(n, j, wr)
            raise
        if out is None:
            for j, n in enumerate(nodes):
                self._drop_hold(n, j, wr)
            for n in corrupt:  # never served again (unless still held by a suspended sequence)
                if n.alive and all(d.refcount == 0 for d in self.tree.subtree(n)):
                    self._drop(n)
            return False
        for c, dst in zip([c for c in cols if c], out):
            for k, i in enumerate(c):
                n = nodes[lower[i]]
                for g in np.flatnonzero((n.slots >= 0) & (src[:, i] < 0)).tolist():
                    self.storage.free(n.level, g, n.slots[g:g + 1])  # pages no window needs
                self.tree.move(n, D, dst[:, k].copy())
        self._stats.num_onboarded_pages += len(lower)
        self._emit(ManagerEvent("onboarded", len(lower), D))
        return True

    def close(self, seq: Sequence) -> None:
        """Releases the sequence; its committed pages stay cached until evicted."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE, SequenceState.SUSPENDED)
            self._close(seq)

    def _close(self, seq: Sequence) -> None:
        row = seq._row
        k = len(seq._nodes)
        if seq.state is SequenceState.ACTIVE:
            self._defer_free(self._private(seq), seq.seq_id)
            if self._in_step is not None:
                self._closed_in_step = True
        elif seq._parked is not None:
            lv, slots = seq._parked
            for g in range(self._G):
                self.storage.free(lv, g, slots[g][slots[g] >= 0])
        wr = self._win.row_wrel(row) if self._win else self._zeros_g
        for j in range(k - 1, -1, -1):
            self._drop_hold(seq._nodes[j], j, wr)
        seq._nodes = []
        self._ncommit[row] = 0
        seq._parked = None
        seq.state = SequenceState.CLOSED
        seq._done_step = self._step_index + (self._in_step is not None)
        self._len[row] = self._npages[row] = self._known[row] = 0
        self._ncommit[row] = self._commit_ok[row] = self._ran[row] = 0
        self._seq_id[row] = -1
        for kind in self._kinds:
            kind.clear_row(row)
        self._free_rows.append(row)
        del self._seqs[seq.seq_id]

    # -- steps -------------------------------------------------------------------------------

    def _parse_work(self, work: _Seq[tuple[Sequence, Any]]) -> tuple[
            list[Sequence], np.ndarray, np.ndarray, list[int], list[np.ndarray], Any]:
        """``prepare_step``'s ``work`` validated (nothing changes): its sequences, their rows
        and new-token counts, and the items given as token ids (their indices, the arrays and
        all of them concatenated)."""
        cfg = self.config
        B = len(work)
        if B == 0 or B > cfg.max_batch:
            raise ValueError(f"work must hold 1..{cfg.max_batch} sequences, got {B}")
        seqs: list[Sequence] = []
        row_list: list[int] = []
        count_list: list[int] = []
        id_index: list[int] = []
        id_arrays: list[np.ndarray] = []
        active = SequenceState.ACTIVE
        for i, item in enumerate(work):
            try:
                seq, x = item
            except (TypeError, ValueError):
                raise TypeError(f"work[{i}] must be a (Sequence, tokens) pair") from None
            if type(seq) is not Sequence or seq.state is not active or seq._mgr is not self:
                if not isinstance(seq, Sequence):
                    raise TypeError(f"work[{i}][0] must be a Sequence, got "
                                    f"{type(seq).__name__}")
                self._check_seq(seq, SequenceState.ACTIVE)
            seqs.append(seq)
            row_list.append(seq._row)
            if type(x) is int or (isinstance(x, (int, np.integer))
                                  and not isinstance(x, (bool, np.bool_))):
                count_list.append(x)
                continue
            if type(x) is np.ndarray:
                arr = x
            else:
                if x is None or isinstance(x, (bool, np.bool_, float, str, bytes)):
                    raise TypeError(f"work[{i}][1] must be a token count or 1-D token ids, "
                                    f"got {type(x).__name__}")
                arr = np.asarray(x)
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError(f"work[{i}][1]: work items must be (seq, int) or "
                                 "(seq, 1-D token ids)")
            count_list.append(arr.size)
            id_index.append(i)
            id_arrays.append(arr)
        if id_arrays:  # NOTE: one range check for all ids (per item only to name a bad one)
            every = np.concatenate(id_arrays)
            if every.dtype.kind == "f" or (every.size and (  # (float: uint64 met int64)
                    every.min() < 0 or every.max() > MAX_TOKEN_ID)):
                for i, arr in zip(id_index, id_arrays):
                    _check_token_ids(arr, f"work[{i}][1]")
        rows = np.array(row_list, np.int64)
        counts = np.array(count_list, np.int64)
        if np.unique(rows).size != B:
            raise ValueError("a sequence appears twice in work")
        if counts.min() < 1:
            raise ValueError("every work item must add at least one token")
        T = int(counts.sum())
        if T > cfg.max_tokens_per_step:
            raise ValueError(f"{T} tokens exceed max_tokens_per_step "
                             f"{cfg.max_tokens_per_step}")
        return seqs, rows, counts, id_index, id_arrays, every if id_arrays else None

    def _check_ids(self, rows: np.ndarray, counts: np.ndarray, cur: np.ndarray,
                   id_index: list[int], id_arrays: list[np.ndarray], every: Any) -> tuple:
        """Refuses token ids that contradict known ones (nothing changes); returns what
        :meth:`_store_ids` needs (``[0]``: the rows' known counts before the step)."""
        known = self._known[rows]
        if not id_arrays:
            return (known,)
        idx = np.array(id_index, np.int64)
        sizes = counts[idx]
        id_vals = every.astype(np.int32)
        id_rows = np.repeat(rows[idx], sizes)
        id_pos = (np.arange(id_vals.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
                  + np.repeat(cur[idx], sizes))
        id_known = np.repeat(known[idx], sizes)
        overlap = id_pos < id_known
        if overlap.any() and not np.array_equal(
                self._tokens[id_rows[overlap], id_pos[overlap]], id_vals[overlap]):
            raise ValueError("token ids contradict the prompt of a sequence in work")
        return known, rows, cur, idx, sizes, id_vals, id_rows, id_pos, id_known

    def _store_ids(self, ids: tuple, new_len: np.ndarray) -> None:
        """Stores the step's token ids (only when contiguous with the ids already known)."""
        if len(ids) == 1:
            return
        known, rows, cur, idx, sizes, id_vals, id_rows, id_pos, id_known = ids
        ok = id_known >= np.repeat(cur[idx], sizes)
        self._tokens[id_rows[ok], id_pos[ok]] = id_vals[ok]
        grow = known[idx] >= cur[idx]
        r = rows[idx][grow]
        self._known[r] = np.maximum(known[idx][grow], new_len[idx][grow])

    def prepare_step(self, work: _Seq[tuple[Sequence, Any]]) -> StepBatch:
        """``work``: ``[(seq, num_new_tokens or new token ids), ...]`` (distinct ACTIVE
        sequences). Allocates pages (evicting cached pages when needed) and returns the padded
        index buffers. Raises :class:`OutOfPagesError` (nothing scheduled) when pages run out."""
        cfg, tpp = self.config, self._tpp
        with self._lock:
            self._check_open()
            if self._in_step is not None:
                raise StepInFlightError("a step is in flight: call complete_step first")
            seqs, rows, counts, id_index, id_arrays, every = self._parse_work(work)
            B, T = len(seqs), int(counts.sum())
            if self._win:
                self._win.check_chunks(counts)
            cur = self._len[rows]
            new_len = cur + counts
            if new_len.max() > cfg.max_seq_len:
                raise ValueError(f"a sequence would exceed max_seq_len {cfg.max_seq_len}")
            ids = self._check_ids(rows, counts, cur, id_index, id_arrays, every)
            # Pages.
            npages = self._npages[rows]
            need = -(-new_len // tpp) - npages
            total = int(need.sum())
            if total:
                slots = self._allocate_device(total)
                if slots is None:
                    raise OutOfPagesError(f"{total} device pages needed, {self._num_free(D)} "
                                          "free: evicting every cached page would not do")
                rep = np.repeat(rows, need)
                starts = np.cumsum(need) - need
                off = np.arange(total) - np.repeat(starts - npages, need)
                for kind in self._kinds:
                    kind.set_slots(rep, off, slots[kind.ids])
                self._npages[rows] = npages + need
            self._store_ids(ids, new_len)
            self._len[rows] = new_len
            # Buffers.
            Bb, Tb, qs, pos, positions, seq_lens = _row_buffers(cfg, counts, cur, new_len)
            tok_row = np.repeat(rows, counts)
            pt = np.zeros((self._G, Bb, self._width), np.int32)
            sm = np.full((self._G, Tb), -1, np.int32)
            pj, off = pos // tpp, pos % tpp
            for kind in self._kinds:
                if len(self._kinds) == 1:
                    pt[:, :B, :kind.width] = kind.table[:, rows]
                    sm[:, :T] = kind.slots(tok_row, pj) * tpp + off
                else:
                    pt[kind.sel, :B, :kind.width] = kind.table[:, rows]
                    sm[kind.sel, :T] = kind.slots(tok_row, pj) * tpp + off
            if self._G == 1:
                pt, sm = pt[0], sm[0]
            self._ran[rows] = 1
            self._in_step = (seqs, rows, npages, cur, ids[0])
            self._handed = list(self.storage.pools)
            return StepBatch(page_table=pt, seq_lens=seq_lens, query_start=qs, slot_mapping=sm,
                             positions=positions)

    def complete_step(self, caches: _Seq[tuple[jax.Array, jax.Array]]) -> None:
        """Takes back the pools the step returned (one ``(k, v)`` per layer group, each the shape
        and dtype of :attr:`caches`), records its completion fence and commits pages that became
        full. Refused, with the step still in flight, when an array is not a ``jax.Array``
        (TypeError), was deleted (the step consumed it and failed), or is one of the pools
        ``prepare_step`` handed out rather than the step's output (the step did not run): undo
        such a step with :meth:`abort_step`."""
        with self._lock:
            self._check_open()
            if self._in_step is None:
                raise RuntimeError("complete_step without a prepared step")
            caches = self._check_caches(caches)
            self.storage.pools = caches
            seqs, rows = self._in_step[:2]
            self._in_step = None
            self._handed = []
            if self._fence is not None:
                self._older_fences.append((self._step_index, self._fence))
                if len(self._older_fences) > _OLDER_FENCES:
                    # NOTE: dropping the oldest loses nothing: a later step's fence, once
                    # ready, covers it (steps complete in order).
                    self._older_fences.popleft()
            self._step_index += 1
            self._fence = _step_fence(caches[0][0])
            for p in self._pending:
                if p[0] is None:
                    p[0] = self._step_index
            self._stats.num_steps += 1
            if self.config.enable_prefix_reuse:
                self._commit(seqs, rows)
            if self._win:
                if self._closed_in_step:  # NOTE: a row closed in the step may hold a new sequence
                    live = np.fromiter((s.state is SequenceState.ACTIVE for s in seqs), bool,
                                       len(seqs))
                    seqs = [s for s, ok in zip(seqs, live) if ok]
                    rows = rows[live]
                self._win.advance(seqs, rows, self._len, self._ncommit, self._defer_free,
                                  self._seq_id)
            self._closed_in_step = False
            if self.config.offload_ahead_pages:
                self.storage.check_pools_in_place()
                self._offload_ahead()

    def _check_caches(self, caches: Any) -> list[tuple[jax.Array, jax.Array]]:
        """``caches`` validated for :meth:`complete_step` (see there)."""
        if isinstance(caches, jax.Array) or not isinstance(caches, (list, tuple)):
            raise TypeError(f"caches must be a list of (k, v) pairs, got {type(caches).__name__}")
        pools = self.storage.pools
        if len(caches) != len(pools):
            raise ValueError(f"caches must hold {len(pools)} (k, v) pairs, got {len(caches)}")
        out = []
        for h, pair in enumerate(caches):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"caches[{h}] must be a (k, v) pair, got {type(pair).__name__}")
            for i, (a, b, handed) in enumerate(zip(pair, pools[h], self._handed[h])):
                name = f"caches[{h}][{i}]"
                if not isinstance(a, jax.Array):
                    raise TypeError(f"{name} must be a jax.Array (the step's output), got "
                                    f"{type(a).__name__}")
                if a.shape != b.shape or a.dtype != b.dtype:
                    raise ValueError(f"{name} has shape {a.shape} {a.dtype}, expected "
                                     f"{b.shape} {b.dtype}")
                if a.is_deleted():
                    raise ValueError(f"{name} was deleted (a step that consumed the pools "
                                     "failed?): call abort_step()")
                if a is handed:
                    raise ValueError(f"{name} is the pool prepare_step handed out, not the "
                                     "step's output (did the step fail?): call abort_step()")
                sharding = self.config.pool_sharding
                if sharding is not None and not a.sharding.is_equivalent_to(sharding, a.ndim):
                    raise ValueError(f"{name} is placed as {a.sharding}, expected the pools' "
                                     f"{sharding} (KV heads split over mesh axis "
                                     f"{self.config.mesh_axis!r})")
            out.append((pair[0], pair[1]))
        return out

    def abort_step(self) -> list[Sequence]:
        """Undoes the prepared step, e.g. after the user's step raised. Every sequence of the
        step goes back to its length and known tokens before ``prepare_step``; the pages it
        allocated are freed and nothing is committed (cached pages evicted to make room stay
        evicted). Sequences closed meanwhile stay closed.

        When the step had consumed the pools (donated, then failed at run time: the arrays
        handed out are deleted), the device tier's content is lost as well: see
        :meth:`recover_from_failed_step`, whose list of closed sequences is returned. Otherwise
        the result is ``[]``."""
        with self._lock:
            if self._in_step is None:
                raise RuntimeError("abort_step without a prepared step")
            self._undo_step()
            if any(a.is_deleted() for pair in self.storage.pools for a in pair):
                return self._lose_device()
            return []

    def recover_from_failed_step(self) -> list[Sequence]:
        """Discards the device tier after a step failed in a way that lost its pools (their
        arrays deleted, or a step's output that turned out to hold an error after
        ``complete_step`` took it): undoes the step in flight if any, builds fresh (zero)
        pools, drops every committed page on the device (and what hangs below it in the prefix
        tree), and closes every sequence that held a device page. Returns those sequences,
        CLOSED: the caller recomputes them (``add_sequence`` with all their tokens reuses what
        the host and disk tiers still hold). Suspended sequences whose pages are all on the host
        or disk are kept."""
        with self._lock:
            if self._in_step is not None:
                self._undo_step()
            return self._lose_device()

    def _undo_step(self) -> None:
        seqs, rows, npages, length, known = self._in_step
        self._in_step = None
        self._handed = []
        for i, seq in enumerate(seqs):
            if seq.state is not SequenceState.ACTIVE:  # closed during the step: pages pending
                continue
            r = int(rows[i])
            first, last = int(npages[i]), int(self._npages[r])
            new = self._row_pages(r, first, last)
            for g in range(self._G):
                self.storage.free(D, g, new[g][new[g] > 0])  # no step ever wrote them
            j = np.arange(first, last)
            for kind in self._kinds:  # NOTE: a ring entry a new page took was empty before
                kind.set_slots(np.full(j.size, r), j, 0)
            self._npages[r], self._len[r], self._known[r] = npages[i], length[i], known[i]
        for p in self._pending:  # the aborted step reads nothing: the last completed one may
            if p[0] is None:
                p[0] = self._step_index
        self._closed_in_step = False
        self._stats.num_aborted_steps += 1

    def _lose_device(self) -> list[Sequence]:
        """See :meth:`recover_from_failed_step` (lock held, no step in flight)."""
        if self._offloads:  # NOTE: rolled-back pages are on the device: lost with it below
            self._settle_offloads(True)
        lost = [s for s in self._seqs.values()
                if (s.state is SequenceState.ACTIVE and self._npages[s._row] > 0)
                or any(n.level is D for n in s._nodes)]
        for seq in lost:
            self._close(seq)
        for n in list(self.tree.nodes.values()):
            if n.alive and n.level is D:
                self._drop(n)
        # Nothing can read the old pools' pages any more: every pending free is ready.
        self._fence = None
        self._older_fences.clear()
        self._ready_upto = self._step_index
        for p in self._pending:
            p[0] = self._step_index
        self._reclaim()
        self.storage.rebuild_pools()
        self._stats.num_failed_steps += 1
        self._stats.num_lost_sequences += len(lost)
        self._emit(ManagerEvent("lost", len(lost), D))
        return lost

    def record_token_ids(self, seq: Sequence, token_ids: Any) -> None:
        """Appends ids the caller learned late: ``token_ids`` (1-D ints) are the ids of positions
        ``seq.num_known_tokens`` onward (at most ``max_seq_len`` in all).

        For a loop that feeds sampled tokens to the next step on the device and passes
        ``prepare_step`` a count for them, then reads them one step later: recording them lets
        full pages of generated text be committed to the prefix tree (now, for pages already
        written or being written by a dispatched step) exactly as if the ids had been given to
        ``prepare_step``. Ids beyond ``num_tokens`` are checked against the ids ``prepare_step``
        gets for those positions later. Raises :class:`StepInFlightError` between
        ``prepare_step`` and ``complete_step``; ``ValueError`` for bad ids (nothing changes)."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE, SequenceState.SUSPENDED)
            if self._in_step is not None:
                raise StepInFlightError("record_token_ids: a step is in flight: call "
                                        "complete_step first")
            if self._store_recorded_ids(seq, token_ids) and self.config.enable_prefix_reuse \
                    and seq.state is SequenceState.ACTIVE:
                self._commit([seq], np.array([seq._row], np.int64))

    def _store_recorded_ids(self, seq: Sequence, token_ids: Any) -> int:
        """:meth:`record_token_ids`' ids validated (nothing changes on error) and stored after
        the ids already known; returns how many (lock held)."""
        arr = token_ids if type(token_ids) is np.ndarray else np.asarray(token_ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError("token_ids must be a 1-D array of integer ids")
        _check_token_ids(arr, "token_ids")
        r = seq._row
        k, n = int(self._known[r]), int(arr.size)
        if k + n > self.config.max_seq_len:
            raise ValueError(f"token_ids: {k} known + {n} ids exceed max_seq_len "
                             f"{self.config.max_seq_len}")
        self._tokens[r, k:k + n] = arr
        self._known[r] = k + n
        return n

    def _commit(self, seqs: list[Sequence], rows: np.ndarray) -> None:
        tpp, tree, hash_fn = self._tpp, self.tree, self.tree.hash_fn
        full = np.minimum(self._len[rows], self._known[rows]) // tpp
        ncommit = self._ncommit[rows]
        todo = np.flatnonzero((full > ncommit) & (self._commit_ok[rows] > 0))
        if todo.size == 0:
            return
        n0 = 0
        page_bytes = tpp * 4
        # NOTE: the new pages' slots of every row at once ([n, G], rows in todo order).
        cnt = full[todo] - ncommit[todo]
        starts = np.cumsum(cnt) - cnt
        j = np.arange(int(cnt.sum())) - np.repeat(starts - ncommit[todo], cnt)
        all_cols = self._view(np.repeat(rows[todo], cnt), j).T.copy()
        gone_any = None
        if self._win:  # NOTE: rows whose window released a page before it was committed
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
            blob = _le_bytes(self._tokens[r, first * tpp:last * tpp])
            cols = all_cols[start:start + last - first]
            if gone_any is not None:  # a page released before it was committed ends the chain
                gone = np.flatnonzero(gone_any[start:start + last - first])
                if gone.size:
                    cols = cols[:gone[0]]
                    self._commit_ok[r] = 0
            for j in range(cols.shape[0]):
                toks = blob[j * page_bytes:(j + 1) * page_bytes]
                key = hash_fn(pkey + toks + seq._salt)
                node = tree.insert(key, parent, toks, D, cols[j])
                if node is not None and self._win:
                    self._win.new_node(node)  # this holder's windows
                if node is None:
                    node = tree.nodes[key]
                    if (node.parent is not parent or node.tokens != toks
                            or node.level is not D):
                        # A collision (or a copy off the device): the page stays private and
                        # so does everything after it.
                        self._commit_ok[r] = 0
                        break
                    # NOTE: a duplicate (another sequence computed the same page first): adopt
                    # the committed page, free ours once the step that wrote it completed; but
                    # where its window page was released, it takes ours instead.
                    tree.incref(node)
                    ours = cols[j].copy()
                    if self._win:
                        self._win.adopt(tree, node, ours)
                        self._win.take(node, first + j, self._win.row_wrel(r))
                    at = np.array([first + j])
                    for kind in self._kinds:
                        kind.set_slots(np.array([r]), at, node.slots[kind.ids][:, None])
                    self._defer_free(ours[:, None], seq.seq_id)
                    self._stats.num_adopted_pages += 1
                else:
                    n0 += 1
                nodes.append(node)
                parent, pkey = node, key
            self._ncommit[r] = len(nodes)
        if n0:
            self._stats.num_committed_pages += n0
            self._emit(ManagerEvent("committed", n0, D))

    # -- suspend / resume --------------------------------------------------------------------

    def _private(self, seq: Sequence) -> np.ndarray:
        """The device slots ``[G, n]`` of the sequence's uncommitted pages (``NO_PAGE`` where
        the page table holds the null page)."""
        r = seq._row
        t = self._row_pages(r, len(seq._nodes), int(self._npages[r]))
        return np.where(t > 0, t, NO_PAGE).astype(np.int32)

    def _set_table(self, seq: Sequence, private: np.ndarray) -> None:
        """Writes the page-table row of an ACTIVE sequence: its nodes' slots, then ``private``
        (``NO_PAGE`` -> the null page), and the null page where its windows released pages."""
        r, k = seq._row, len(seq._nodes)
        slots = np.zeros((self._G, int(self._npages[r])), np.int32)
        if k:
            slots[:, :k] = self._node_slots(seq._nodes)
        slots[:, k:] = private
        slots = np.maximum(slots, 0)
        if self._full:
            self._full.clear_row(r)
            self._full.table[:, r, :slots.shape[1]] = slots[self._full.ids]
        if self._win:
            self._win.write_row(r, slots[self._win.ids], int(self._len[r]))

    def suspend(self, seq: Sequence) -> SuspendResult:
        """Moves the sequence's device pages that only it holds to host (else disk), as one
        transaction. When no tier can take them (even by evicting cached pages there) nothing
        changes and the answer is ``MUST_RECOMPUTE``."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE)
            self._need_pools("suspend")
            own = [n for n in seq._nodes if n.level is D and n.refcount == 1]
            private = self._private(seq)
            own_slots = self._node_slots(own)
            if own and self._win:  # window pages it does not need (wlru) are dropped, not moved
                own_slots = self._win.unneeded(own, own_slots)
            need = np.count_nonzero(private >= 0, axis=1)
            if own:
                need += np.count_nonzero(own_slots >= 0, axis=1)
            for lv in self._levels[1:]:
                if not self._writable(lv) or not self._make_room_cold(lv, need):
                    continue
                out = self._move([(D, private, lv)] + ([(D, own_slots, lv)] if own else []))
                if out is None:  # a failed disk write (room was made)
                    continue
                for i, n in enumerate(own):
                    if self._win:
                        dropped = self._win.forget(n)
                        if dropped is not None:
                            self._defer_free(dropped, seq.seq_id)
                    self.tree.move(n, lv, out[1][:, i].copy())
                seq._parked = (lv, out[0])
                seq.state = SequenceState.SUSPENDED
                self._stats.num_suspended += 1
                self._emit(ManagerEvent("suspended", len(own) + private.shape[1], lv))
                return SuspendResult.SUSPENDED
            self._stats.num_refused_suspends += 1
            return SuspendResult.MUST_RECOMPUTE

    def resume(self, seq: Sequence) -> bool:
        """Brings a suspended sequence back to the device byte-identical, as one transaction
        (every device page reserved before anything moves). False when the device cannot take
        it even by evicting every cached page: then nothing changed at all. A failure (e.g.
        :class:`CorruptPageError` from disk) also leaves the sequence suspended exactly as it
        was (cached pages evicted to make room stay evicted); the caller then closes it and
        recomputes."""
        with self._lock:
            self._check_seq(seq, SequenceState.SUSPENDED)
            self._need_pools("resume")
            lv, parked = seq._parked
            if self._offloads:  # NOTE: before the parts are built (a failed copy rolls back)
                self._settle_offloads(True, [n for n in seq._nodes if n.level is H])
            cold = [[n for n in seq._nodes if n.level is level] for level in (K, H)]
            parts = [(level, self._node_slots(b), D) for level, b in zip((K, H), cold) if b]
            parts.append((lv, parked, D))
            parts.sort(key=lambda p: p[0] is not K)  # disk first: only disk reads can fail
            need = sum(np.count_nonzero(p[1] >= 0, axis=1) for p in parts)
            if not self._reserve_device(need):
                self._stats.num_refused_resumes += 1
                return False
            out = self._move(parts)
            if out is None:  # pragma: no cover - reserved above
                self._stats.num_refused_resumes += 1
                return False
            back = None
            for (level, src, _), dst in zip(parts, out):
                if src is parked:
                    back = dst
                    continue
                for i, n in enumerate(cold[level is H]):
                    self.tree.move(n, D, dst[:, i].copy())
            seq._parked = None
            seq.state = SequenceState.ACTIVE
            self._set_table(seq, back)
            self._stats.num_resumed += 1
            self._emit(ManagerEvent("resumed", sum(map(len, cold)) + parked.shape[1], D))
            return True

    # -- lifecycle and views (the bounded-window design) -------------------------------------

    def _phase(self, seq: Sequence) -> SequencePhase:
        with self._lock:
            if seq.state is not SequenceState.CLOSED:
                return (SequencePhase.EXECUTING if self._ran[seq._row]
                        else SequencePhase.ADMITTED)
            if seq._done_step > self._ready_upto and self._fence is not None:
                self._poll_fence(block=False)
            return (SequencePhase.FINISHING if seq._done_step > self._ready_upto
                    else SequencePhase.FINISHED)

    def state(self, seq: Sequence) -> SequenceView:
        """A snapshot of ``seq`` (any state) as the group managers see it: see
        :class:`SequenceView`. Polls the latest step's fence without blocking."""
        with self._lock:
            if not isinstance(seq, Sequence) or seq._mgr is not self:
                raise ValueError(f"{seq!r} is not a sequence of this manager")
            self._reclaim()
            pending = np.zeros(self._G, np.int64)
            for entry in self._pending:
                owners = entry[2]
                if owners is None:
                    continue
                mine = np.broadcast_to(np.asarray(owners) == seq.seq_id, entry[1].shape[1:])
                pending += np.count_nonzero((entry[1] >= 0) & mine[None], axis=1)
            if seq.state is SequenceState.CLOSED:
                retained = ((0, 0),) * self._G
                num_tokens = 0
            else:
                r = seq._row
                wr = self._win.row_wrel(r) if self._win else self._zeros_g
                retained = tuple((int(w), int(self._npages[r])) for w in wr)
                num_tokens = int(self._len[r])
        return SequenceView(seq.seq_id, seq.state, self._phase(seq), num_tokens, retained,
                            tuple(int(w) for w in self._widths), tuple(int(p) for p in pending))

    def private_pages_per_sequence(self) -> tuple[int, ...]:
        """Per layer group, the most device pages one sequence holds at once (``[G]``): the
        page-table width ``ceil(max_seq_len / tokens_per_page)`` of a full group; for a window
        group, its peak ``ceil((W + C - 2) / P) + 1`` (``C = max_window_chunk``; its ring width
        with ``ring_tables``), at most the full width."""
        return tuple(int(p) for p in self.config.peak_pages(self.config.max_seq_len))

    def free_page_count(self) -> tuple[int, ...]:
        """Per layer group, device pages allocatable right now without evicting or waiting
        (free slots of its pool, after returning the pending pages whose fence has passed)."""
        with self._lock:
            self._reclaim()
            return tuple(int(self.storage.num_free(D, g)) for g in range(self._G))

    def compact(self, old_to_new: Any) -> np.ndarray:
        """Moves sequences between table rows, e.g. to keep a runner's batch dense after some
        finished: ``old_to_new[r]`` is the new row of the sequence at row ``r`` (see
        :attr:`Sequence.row`); rows beyond ``len(old_to_new)`` or marked ``-1`` must hold no
        sequence. Targets must be distinct and >= 0. Every group manager moves its rows (ring
        entries, released counts), so no table is rebuilt; returns ``new_to_old`` (int32, one
        entry per row up to the largest target, -1 for empty rows) for the runner to gather its
        own per-row device state the same way. Not while a step is in flight."""
        with self._lock:
            self._check_open()
            self._need_pools("compact")
            m = np.asarray(old_to_new)
            if m.ndim != 1 or (m.size and m.dtype.kind not in "iu"):
                raise ValueError("old_to_new must be a 1-D array of ints")
            m = m.astype(np.int64)
            src = np.fromiter((s._row for s in self._seqs.values()), np.int64, len(self._seqs))
            if src.size and src.max() >= m.size:
                raise ValueError(f"old_to_new has {m.size} entries; row {int(src.max())} holds "
                                 "a sequence")
            dst = m[src]
            if (dst < 0).any():
                raise ValueError("old_to_new maps a row that holds a sequence to -1")
            if np.unique(dst).size != dst.size:
                raise ValueError("old_to_new maps two sequences to one row")
            if dst.size and dst.max() >= self._len.size:
                self._grow_rows(int(dst.max()) + 1)
            for kind in self._kinds:
                kind.move_rows(src, dst)
            self._tokens[dst] = self._tokens[src]
            for name in self._ROW_ARRAYS:
                arr = getattr(self, name)
                arr[dst] = arr[src]
            vacated = np.setdiff1d(src, dst)
            for r in vacated.tolist():
                for kind in self._kinds:
                    kind.clear_row(r)
                for name in self._ROW_ARRAYS:
                    getattr(self, name)[r] = 0
                self._seq_id[r] = -1
            for seq, r in zip(self._seqs.values(), dst.tolist()):
                seq._row = r
            used = np.zeros(self._len.size, bool)
            used[dst] = True
            self._free_rows = np.flatnonzero(~used)[::-1].tolist()
            out = np.full(int(dst.max()) + 1 if dst.size else 0, -1, np.int32)
            out[dst] = src
            return out

    def shutdown(self) -> None:
        """Ends the manager: waits for every dispatched step and migration (their fences),
        returns every pending page, then closes the storage (waits for its outstanding work,
        closes the disk files, freeing their space, frees host and pinned memory). Every later
        call raises RuntimeError; a second ``shutdown`` does nothing. Raises :class:`StepInFlightError` while
        a step is prepared and not completed (complete or abort it first)."""
        with self._lock:
            if self._shut:
                return
            self._need_pools("shutdown")
            waits = [self._fence] if self._fence is not None else []
            for arr in waits + [a for pair in self.storage.pools for a in pair]:
                try:
                    if not arr.is_deleted():
                        arr.block_until_ready()
                except Exception:  # noqa: BLE001 - a failed step's output: nothing to wait for
                    pass
            self._ready_upto = self._step_index
            if self._offloads:
                self._settle_offloads(True)
            self._reclaim()
            self._shut = True
            self.storage.close()

    # -- planning and stats ------------------------------------------------------------------

    @property
    def device_capacity_pages(self) -> int:
        """The smallest layer group's device page budget."""
        return min(self.config.device_pages)

    def _peak_pages(self, seq_len: int) -> np.ndarray:
        """See :meth:`KVCacheConfig.peak_pages`."""
        return self.config.peak_pages(seq_len)

    def num_obtainable_pages(self, level: CacheLevel = CacheLevel.DEVICE) -> int:
        """Pages an allocation at ``level`` could get now without touching referenced ones:
        free + pending frees (device: back once the step that may read them completed) +
        cached (evictable) pages, in the tightest pool of the level. Equals ``free + pending +
        cached`` of ``stats()["pages"][level]`` with one pool, in constant time (``stats``
        walks the prefix tree: a scheduler polling it every step pays for the tree's size)."""
        with self._lock:
            level = CacheLevel(level)
            if level not in self._levels:
                raise ValueError(f"level {level.name} is not configured")
            extra = self._per_pool(level, self._reclaimable(level))
            return int((self._pool_free(level) + extra).min())

    def max_num_sequences(self, seq_len: int) -> int:
        """How many sequences of ``seq_len`` tokens fit on the device at once (0 when one does
        not fit; ``seq_len`` is clamped to ``max_seq_len``). Sliding-window groups count the
        pages a sequence holds at its peak (see :meth:`_peak_pages`), not all of them."""
        return self.config.max_num_sequences(seq_len)

    def max_seq_len_for(self, num_sequences: int) -> int:
        """The largest length (a whole number of pages, clamped to ``max_seq_len``) such that
        ``num_sequences`` sequences fit on the device at once; 0 when not even one page each."""
        n = check_count(num_sequences, "num_sequences", minimum=1)
        cap = self.config.max_seq_len
        out = cap
        for g, pages in enumerate(self.config.device_pages):
            each = pages // n
            if self._peak_pages(cap)[g] > each:  # NOTE: a window's bound only grows with n
                out = min(out, each * self._tpp)
        return out

    def stats(self) -> dict[str, Any]:
        """Counters, and ``pages[level]``: ``capacity == free + pending + referenced + cached``
        summed over the level's pools (``pages_per_pool[level]``: one such dict per pool, with
        its ``layer_groups``). ``pending``: freed device pages waiting for a step's fence;
        ``cached``: unreferenced committed pages (evictable)."""
        with self._lock:
            out = dataclasses.asdict(self._stats)
            if self._win:
                out["num_window_released_pages"] = self._win.num_released
            out["num_active"] = sum(s.state is SequenceState.ACTIVE for s in self._seqs.values())
            out["num_suspended_now"] = len(self._seqs) - out["num_active"]
            out["num_committed_now"] = len(self.tree)
            out["disk_degraded"] = self._disk_degraded
            per_pool = {lv.name.lower(): self._page_counts(lv) for lv in self._levels}
            out["pages"] = {lv: {k: sum(c[k] for c in pools) for k in _COUNT_KEYS}
                            for lv, pools in per_pool.items()}
            out["pages_per_pool"] = per_pool
            out["storage"] = self.storage.stats()
            cfg = self.config
            out["per_device"] = dict(num_shards=cfg.num_shards,
                                     page_bytes=list(cfg.device_page_bytes()),
                                     pool_bytes=cfg.device_pool_bytes())
            return out

    def _page_counts(self, level: CacheLevel) -> list[dict[str, Any]]:
        """One dict per pool at ``level`` (see :meth:`stats`)."""
        G = self._G
        referenced = np.zeros(G, np.int64)
        for n in self.tree.nodes.values():
            if n.level is level and n.refcount > 0:
                referenced += n.slots >= 0
        for s in self._seqs.values():
            if level is D and s.state is SequenceState.ACTIVE:
                r = s._row
                referenced += np.count_nonzero(
                    self._row_pages(r, len(s._nodes), int(self._npages[r])), axis=1)
            elif s._parked is not None and s._parked[0] is level:
                referenced += np.count_nonzero(s._parked[1] >= 0, axis=1)
        cached = self.tree.cached_pages(level)
        if level is D:
            if self._win:  # window pages of referenced nodes that no window needs
                unneeded = self._win.num_unneeded()
                cached += unneeded
                referenced -= unneeded
        pending = self._num_pending if level is D else np.zeros(G, np.int64)
        pools = self._pool_of[level]
        out = []
        for p in range(int(pools.max()) + 1):
            groups = np.flatnonzero(pools == p)
            alloc = self.storage.allocator(level, int(groups[0]))
            out.append(dict(capacity=alloc.num_slots - (1 if level is D else 0),  # null page
                            free=alloc.num_free, pending=int(pending[groups].sum()),
                            referenced=int(referenced[groups].sum()),
                            cached=int(cached[groups].sum()), layer_groups=groups.tolist()))
        return out

    # -- invariants (tests) ------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent (tests call this)."""
        with self._lock:
            self._check_invariants()

    def _check_invariants(self) -> None:
        st, G, tpp = self.storage, self._G, self._tpp
        holders: dict[int, int] = {}
        needs: dict[int, np.ndarray] = {}
        for s in self._seqs.values():
            r = s._row
            k = len(s._nodes)
            wr = self._win.row_wrel(r) if self._win else self._zeros_g
            assert np.array_equal(wr, self._wrel_at(int(self._len[r]))), (s, wr)
            for j, n in enumerate(s._nodes):
                holders[id(n)] = holders.get(id(n), 0) + 1
                needs[id(n)] = needs.get(id(n), 0) + (j >= wr)
                assert n.alive, f"{s!r} holds a dropped node"
            assert self._ncommit[r] == k
            if s.state is SequenceState.ACTIVE:
                want = np.zeros((G, int(self._npages[r])), np.int32)
                if k:
                    want[:, :k] = np.maximum(self._node_slots(s._nodes), 0)
                    assert all(n.level is D for n in s._nodes)
                want[:, k:] = self._row_pages(r, k, int(self._npages[r]))
                for g in range(G):
                    want[g, :wr[g]] = 0
                assert np.array_equal(self._row_pages(r, 0, int(self._npages[r])), want), s
                if self._full:
                    self._full.check_row(r, want[self._full.ids])
                if self._win:
                    self._win.check_row(r, int(self._len[r]), int(self._npages[r]),
                                        want[self._win.ids])
        for n in self.tree.nodes.values():
            assert n.refcount == holders.get(id(n), 0), f"{n!r} has {holders.get(id(n), 0)}"
            assert (id(n) in self.tree.lru[n.level]) == (n.refcount == 0)
            assert (n.need is None) == (self._win is None), n
        if self._win:
            self._win.check_nodes(self.tree, needs)
        cached = np.zeros((len(CacheLevel), G), np.int64)
        for lv in CacheLevel:
            for n in self.tree.lru[lv].values():
                assert n.level is lv and n.alive and n.key in self.tree.nodes
                cached[lv] += n.slots >= 0
        counted = np.stack([self.tree.cached_pages(lv) for lv in CacheLevel])
        assert np.array_equal(cached, counted), (cached, counted)
        for n in self.tree.nodes.values():
            assert n.whole == bool((n.slots >= 0).all()), n
        pending = np.zeros(G, np.int64)
        for entry in self._pending:
            pending += np.count_nonzero(entry[1] >= 0, axis=1)
        assert np.array_equal(pending, self._num_pending), (pending, self._num_pending)
        for rec in self._offloads:  # an offload in flight holds its device slots as pending
            assert any(e is rec.entry for e in self._pending) and rec.entry[3] is rec.fence
        assert all(e[3] is None or any(r.entry is e for r in self._offloads)
                   for e in self._pending)
        for lv in self._levels:
            used: list[list[np.ndarray]] = [[] for _ in range(G)]
            for n in self.tree.nodes.values():
                if n.level is lv:
                    for g in range(G):
                        used[g].append(n.slots[g:g + 1])
            for s in self._seqs.values():
                for g in range(G):
                    if lv is D and s.state is SequenceState.ACTIVE:
                        t = self._row_pages(s._row, len(s._nodes), int(self._npages[s._row]))[g]
                        used[g].append(t[t != 0])
                    elif s._parked is not None and s._parked[0] is lv:
                        used[g].append(s._parked[1][g])
            if lv is D:
                for entry in self._pending:
                    for g in range(G):
                        used[g].append(entry[1][g])
            pools = self._pool_of[lv]
            counts = self._page_counts(lv)
            expect_bytes = 0
            for p, c in enumerate(counts):
                groups = np.flatnonzero(pools == p)
                parts = [x for g in groups for x in used[g]]
                allu = np.concatenate(parts) if parts else np.zeros(0, np.int32)
                allu = allu[allu >= 0]
                alloc = st.allocator(lv, int(groups[0]))
                assert np.unique(allu).size == allu.size, f"{lv.name} pool {p}: a page in two places"
                assert (allu != 0).all() if lv is D else True, "the null page is in use"
                assert all(alloc.is_allocated(int(x)) for x in allu), f"{lv.name}: not allocated"
                extra = 1 if lv is D else 0
                num_allocated = alloc.num_slots - alloc.num_free
                assert num_allocated == allu.size + extra, (
                    f"{lv.name} pool {p}: {num_allocated - extra} allocated, {allu.size} known")
                assert c["free"] + c["pending"] + c["referenced"] + c["cached"] == c["capacity"], c
                expect_bytes += (num_allocated - extra) * st.page_bytes(lv, int(groups[0]))
            # Governor ledger == recomputation from the allocators.
            u = st.governor.usage(lv)
            assert u.committed == expect_bytes and u.transient == 0 and u.reserved == 0, (
                lv, u, expect_bytes)
