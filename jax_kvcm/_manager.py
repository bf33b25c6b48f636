"""KVCacheManager: sequences, fixed-shape step buffers, prefix reuse, eviction, suspend/resume.

One :class:`~jax_kvcm._storage.StorageManager` underneath (one hot pool group per layer group).
Every sequence has one page per layer group per ``tokens_per_page`` tokens, allocated in lockstep
over the layer groups.

Hot-path layout (DESIGN.md §4, seed 001: no per-page Python objects per step): the manager owns a
row table ``_table[G, R, P]`` int32 and per-row ``_len / _npages / _ncommit / _known`` arrays and a
token matrix; a sequence is a row. ``prepare_step`` gathers rows with numpy fancy indexing; the
only per-page Python object is the :class:`BlockNode` created when a page is committed (once per
page, amortized over ``tokens_per_page`` decode steps).

Step protocol: ``prepare_step`` -> the user's jitted step (donating :attr:`caches`) ->
``complete_step(new caches)``. Between the two the pools are owned by the step: calls that move
pages (suspend, resume, onboarding) raise :class:`StepInFlightError`.

Fences. Pages the manager frees (closed sequences, dropped cached pages) go to a pending list tagged
with the step count; they return to the allocator only once the latest completed step's output
arrays are ready (steps complete in order, so that covers every earlier step). ``prepare_step``
reclaims ready ones without blocking and blocks only when nothing else is free.
NOTE: migrations release device source slots immediately (StorageManager's transaction); that is
safe because the encode takes the pools as operands and so is ordered after the step on XLA's
stream, and any later writer of the slot is ordered after the encode.

Page accounting (checked by :meth:`KVCacheManager.check_invariants`): on every tier and layer group
``free + pending + referenced + cached == capacity``.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections import deque
from collections.abc import Callable, Sequence as _Seq
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm._codec import ColdPageCodec
from jax_kvcm._prefix_tree import BlockNode, PrefixTree, salt_bytes
from jax_kvcm._step_batch import StepBatch, default_buckets, pick_bucket
from jax_kvcm._storage import (CorruptPageError, LayerGroupSpec, StorageConfig, StorageEvent,
                               StorageManager)
from jax_kvcm._types import CacheLevel, check_count

__all__ = [
    "KVCacheConfig",
    "KVCacheManager",
    "LayerGroupConfig",
    "ManagerEvent",
    "OutOfPagesError",
    "Sequence",
    "SequenceState",
    "StepInFlightError",
    "SuspendResult",
]

D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
_LITTLE = np.little_endian


def _le_bytes(tokens: np.ndarray) -> bytes:
    """int32 token ids as little-endian bytes (the block-key encoding)."""
    return tokens.tobytes() if _LITTLE else tokens.astype("<i4").tobytes()


class OutOfPagesError(RuntimeError):
    """``prepare_step`` could not get the pages it needs even after evicting every cached page;
    nothing was scheduled (cached pages may have moved down the tiers)."""


class StepInFlightError(RuntimeError):
    """The call needs the pools, which the dispatched step owns until ``complete_step``."""


class SequenceState(enum.Enum):
    ACTIVE = "active"
    SUSPENDED = "suspended"
    CLOSED = "closed"


class SuspendResult(enum.Enum):
    SUSPENDED = "suspended"
    MUST_RECOMPUTE = "must_recompute"  # no tier could take it; the sequence is unchanged


@dataclass(frozen=True, slots=True)
class ManagerEvent:
    """``kind``: "committed", "evicted" (moved down a tier), "dropped", "onboarded",
    "suspended", "resumed"; ``num_pages`` pages; ``level`` the destination tier."""

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
    ``device_bytes``: a total device budget split into whole pages (every group gets the same
    count, since pages are allocated in lockstep). Buckets default to powers of two up to the
    maxima (token buckets start at ``tokens_per_page``).
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
            if g.sliding_window is not None:
                check_count(g.sliding_window, f"layer_groups[{i}].sliding_window", minimum=1)
        s(self, "layer_groups", groups)
        page_bytes = [2 * g.num_layers * self.tokens_per_page * g.num_kv_heads * g.head_dim
                      * jnp.dtype(g.dtype).itemsize for g in groups]
        if (self.device_pages is None) == (self.device_bytes is None):
            raise ValueError("exactly one of device_pages and device_bytes must be given")
        if self.device_bytes is not None:
            nbytes = check_count(self.device_bytes, "device_bytes", minimum=1)
            n = nbytes // sum(page_bytes)
            if n < 1:
                raise ValueError(f"device_bytes {nbytes} holds no page ({sum(page_bytes)} bytes)")
            pages = (n,) * len(groups)
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
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("disk_dir is required when disk_bytes > 0")
        if not isinstance(self.enable_prefix_reuse, bool):
            raise TypeError("enable_prefix_reuse must be a bool")
        check_count(self.max_batch, "max_batch", minimum=1)
        check_count(self.max_tokens_per_step, "max_tokens_per_step", minimum=1)
        check_count(self.max_seq_len, "max_seq_len", minimum=1)
        bb = (default_buckets(self.max_batch) if self.batch_buckets is None
              else _check_buckets(self.batch_buckets, "batch_buckets", self.max_batch))
        tb = (default_buckets(self.max_tokens_per_step, min(self.tokens_per_page,
                                                            self.max_tokens_per_step))
              if self.token_buckets is None
              else _check_buckets(self.token_buckets, "token_buckets", self.max_tokens_per_step))
        s(self, "batch_buckets", bb)
        s(self, "token_buckets", tb)

    @property
    def pages_per_seq(self) -> int:
        """``P``: page-table width."""
        return -(-self.max_seq_len // self.tokens_per_page)


# -- sequences -------------------------------------------------------------------------------


class Sequence:
    """A handle; state lives in the manager's row arrays. ``num_reused_tokens``: tokens matched
    from the prefix cache at :meth:`KVCacheManager.add_sequence` (prefill can skip them)."""

    __slots__ = ("_mgr", "_row", "_nodes", "state", "num_reused_tokens", "seq_id", "_salt",
                 "_parked", "__weakref__")

    def __init__(self, mgr: KVCacheManager, row: int, seq_id: int, salt: bytes) -> None:
        self._mgr = mgr
        self._row = row
        self._nodes: list[BlockNode] = []
        self.state = SequenceState.ACTIVE
        self.num_reused_tokens = 0
        self.seq_id = seq_id
        self._salt = salt
        self._parked: tuple[CacheLevel, np.ndarray] | None = None  # suspended private pages

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V are (or are being) written."""
        return int(self._mgr._len[self._row]) if self.state is not SequenceState.CLOSED else 0

    @property
    def num_pages(self) -> int:
        return int(self._mgr._npages[self._row]) if self.state is not SequenceState.CLOSED else 0

    def page_ids(self, layer_group: int = 0) -> np.ndarray:
        """Device slots of this sequence's pages (a copy; ACTIVE sequences only)."""
        m = self._mgr
        return m._table[layer_group, self._row, :m._npages[self._row]].copy()

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
    num_suspended: int = 0
    num_resumed: int = 0
    num_refused_suspends: int = 0
    num_refused_resumes: int = 0
    num_fence_waits: int = 0


# -- the manager -----------------------------------------------------------------------------


class KVCacheManager:
    """See the module docstring. Public calls are serialized by one lock."""

    def __init__(self, config: KVCacheConfig, cold_page_codec: ColdPageCodec | None = None, *,
                 device: jax.Device | None = None,
                 _hash_fn: Callable[[bytes], bytes] | None = None) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError("config must be a KVCacheConfig")
        self.config = config
        self._lock = threading.Lock()
        self._tpp = config.tokens_per_page
        self._G = len(config.layer_groups)
        self._P = config.pages_per_seq
        specs = tuple(LayerGroupSpec(g.num_layers, config.tokens_per_page, g.num_kv_heads,
                                     g.head_dim, g.dtype) for g in config.layer_groups)
        self.storage = StorageManager(
            StorageConfig(layer_groups=specs, device_slots=tuple(config.device_pages),
                          host_bytes=config.host_bytes, disk_dir=config.disk_dir,
                          disk_bytes=config.disk_bytes), cold_page_codec, device=device)
        self.tree = PrefixTree(_hash_fn)
        self._levels = [lv for lv in CacheLevel if self.storage.has_level(lv)]
        self._disk_chunk = 1 << 30
        if self.storage._ring is not None:
            self._disk_chunk = max(1, self.storage._ring.capacity
                                   // (3 * max(self.storage.cold_page_bytes)))
        self._observers: list[Callable[[Any], None]] = []
        self.events: deque[Any] = deque(maxlen=4096)
        self.storage.add_observer(self._emit)
        self._stats = _Stats()
        # Row arrays (grown by doubling).
        self._table = np.zeros((self._G, 0, self._P), np.int32)
        self._tokens = np.zeros((0, self._P * self._tpp), np.int32)
        self._len = np.zeros(0, np.int64)
        self._npages = np.zeros(0, np.int64)
        self._known = np.zeros(0, np.int64)
        self._ncommit = np.zeros(0, np.int64)    # == len(seq._nodes)
        self._commit_ok = np.zeros(0, np.int64)  # 1 while the sequence may commit pages
        self._free_rows: list[int] = []
        self._grow_rows(16)
        self._seqs: dict[int, Sequence] = {}
        self._next_id = 0
        # Step state.
        self._in_step: tuple[list[Sequence], np.ndarray] | None = None
        self._step_index = 0        # completed steps
        self._fence: Any = None     # an output array of the latest completed step
        self._ready_upto = 0        # every step <= this is known complete
        # NOTE: pending frees: (step index that must complete, slots [G, n]); step index None
        # means "the step in flight" (tagged at complete_step).
        self._pending: list[list[Any]] = []
        self._num_pending = 0

    # -- small helpers -----------------------------------------------------------------------

    def _grow_rows(self, n: int) -> None:
        old = self._len.size
        new = max(n, 2 * old)
        table = np.zeros((self._G, new, self._P), np.int32)
        table[:, :old] = self._table
        tokens = np.zeros((new, self._tokens.shape[1]), np.int32)
        tokens[:old] = self._tokens
        self._table, self._tokens = table, tokens
        for name in ("_len", "_npages", "_known", "_ncommit", "_commit_ok"):
            arr = np.zeros(new, np.int64)
            arr[:old] = getattr(self, name)
            setattr(self, name, arr)
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def _emit(self, event: Any) -> None:
        self.events.append(event)
        for fn in self._observers:
            fn(event)

    def add_observer(self, fn: Callable[[Any], None]) -> None:
        """``fn(event)`` for every :class:`StorageEvent` and :class:`ManagerEvent`."""
        with self._lock:
            self._observers.append(fn)

    def _check_seq(self, seq: Sequence, *states: SequenceState) -> None:
        if not isinstance(seq, Sequence) or seq._mgr is not self:
            raise ValueError(f"{seq!r} is not a sequence of this manager")
        if seq.state not in states:
            raise ValueError(f"{seq!r} is {seq.state.value}, expected one of "
                             f"{[s.value for s in states]}")

    def _need_pools(self, what: str) -> None:
        if self._in_step is not None:
            raise StepInFlightError(f"{what} needs the pools: call complete_step first")

    @property
    def caches(self) -> list[tuple[jax.Array, jax.Array]]:
        """The hot pools, one ``(k, v)`` per layer group, to pass (donated) into the step that
        ``prepare_step`` prepared; the step's outputs go back through ``complete_step``."""
        with self._lock:
            return list(self.storage.pools)

    # -- fences and pending frees ------------------------------------------------------------

    def _poll_fence(self, block: bool) -> None:
        f = self._fence
        if f is None or self._ready_upto >= self._step_index:
            return
        if f.is_deleted():  # donated into a later step: only that step's fence can tell
            return
        if block:
            self._stats.num_fence_waits += 1
            f.block_until_ready()
        if block or f.is_ready():
            self._ready_upto = self._step_index

    def _reclaim(self, block: bool = False) -> int:
        """Returns ready pending frees to the allocator; the number of pages returned."""
        if not self._pending:
            return 0
        self._poll_fence(block)
        keep, n = [], 0
        for step, slots in self._pending:
            if step is not None and step <= self._ready_upto:
                for g in range(self._G):
                    self.storage.free(D, g, slots[g])
                n += slots.shape[1]
            else:
                keep.append([step, slots])
        self._pending = keep
        self._num_pending -= n
        return n

    def _defer_free(self, slots: np.ndarray) -> None:
        """Device slots ``[G, n]`` to free once the last step that may read them completed."""
        if slots.shape[1] == 0:
            return
        step = None if self._in_step is not None else self._step_index
        self._pending.append([step, slots])
        self._num_pending += slots.shape[1]

    # -- eviction ----------------------------------------------------------------------------

    def _num_free(self, level: CacheLevel) -> int:
        return min(self.storage.num_free(level, g) for g in range(self._G))

    def _fits(self, level: CacheLevel, n: int) -> bool:
        if self._num_free(level) < n:
            return False
        nbytes = sum(n * self.storage.page_bytes(level, g) for g in range(self._G))
        return self.storage.governor.available(level) >= nbytes

    def _migrate_nodes(self, nodes: list[BlockNode], dst: CacheLevel) -> bool:
        """Moves nodes (all at one level) to ``dst`` for every layer group; False (nothing moved)
        when the destination refused."""
        if not nodes:
            return True
        src_level = nodes[0].level
        src = np.stack([n.slots for n in nodes], axis=1)  # [G, n]
        try:
            out = self._migrate(src_level, src, dst)
        except BaseException:
            out = None
            raise
        finally:
            if out is None:  # rolled back: the pages are at src_level, maybe in other slots
                for i, n in enumerate(nodes):
                    n.slots = src[:, i].copy()
        if out is None:
            return False
        for i, n in enumerate(nodes):
            self.tree.move(n, dst, out[:, i].copy())
        return True

    def _migrate(self, src_level: CacheLevel, src: np.ndarray,
                 dst_level: CacheLevel) -> np.ndarray | None:
        """``[G, n]`` slots from one level to another, all groups or none (best effort rollback
        of earlier groups when a later one is refused)."""
        n = src.shape[1]
        chunk = max(1, n)
        if K in (src_level, dst_level) and src_level != dst_level:
            # NOTE: disk hops go through the staging ring; a lease larger than the ring fails,
            # so split them (the ring is at least 3 pages; use a third of it per chunk).
            chunk = max(1, self._disk_chunk)
        done: list[tuple[int, int, np.ndarray]] = []  # (group, start, destination slots)
        out = np.zeros((self._G, n), np.int32)

        def rollback() -> None:
            for gg, st, back in reversed(done):
                restored = self.storage.migrate(gg, dst_level, back, src_level)
                if restored is None:  # pragma: no cover - the source slots were just freed
                    raise RuntimeError("could not roll back a partial migration")
                src[gg, st:st + back.size] = restored

        for g in range(self._G):
            for start in range(0, n, chunk):
                try:
                    part = self.storage.migrate(g, src_level, src[g, start:start + chunk],
                                                dst_level)
                except BaseException:  # I/O error, corrupt page: undo the earlier chunks
                    rollback()
                    raise
                if part is None:
                    rollback()
                    return None
                out[g, start:start + part.size] = part
                done.append((g, start, part))
        return out

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
                    self.storage.free(lv, g, s[g])
        self._stats.num_dropped_pages += len(removed)
        self._emit(ManagerEvent("dropped", len(removed)))

    def _make_room_cold(self, level: CacheLevel, n: int) -> bool:
        """Frees room for ``n`` pages at a cold level by moving its cached pages down (or
        dropping them). True when ``n`` pages fit afterwards."""
        while not self._fits(level, n):
            victims = self.tree.lru_nodes(level, max(1, n - self._num_free(level)))
            if not victims:
                return False
            self._evict(victims, level)
        return True

    def _evict(self, victims: list[BlockNode], level: CacheLevel) -> None:
        """Moves cached ``victims`` (at ``level``) one tier down, else drops them."""
        for lower in self._levels:
            if lower <= level:
                continue
            if self._make_room_cold(lower, len(victims)):
                victims = [v for v in victims if v.alive]  # cascades may have dropped some
                if self._migrate_nodes(victims, lower):
                    self._stats.num_evicted_pages[lower] += len(victims)
                    self._emit(ManagerEvent("evicted", len(victims), lower))
                    return
        for v in victims:
            if v.alive:
                self._drop(v)

    def _reserve_device(self, n: int) -> bool:
        """Makes ``n`` device pages allocatable (every layer group); False when impossible."""
        self._reclaim()
        while not self._fits(D, n):
            short = n - self._num_free(D)
            if self._num_pending and self._reclaim() > 0:
                continue
            victims = self.tree.lru_nodes(D, max(1, short))
            if victims:
                self._need_pools("eviction")
                self._evict(victims, D)
                self._reclaim()
                continue
            if self._num_pending and self._in_step is None:
                if self._reclaim(block=True) > 0:
                    continue
            return False
        return True

    def _allocate_device(self, n: int) -> np.ndarray | None:
        """``[G, n]`` device slots, or None (nothing allocated)."""
        if n == 0:
            return np.zeros((self._G, 0), np.int32)
        if not self._reserve_device(n):
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
        toks = np.asarray(tokens)
        if toks.ndim != 1 or (toks.size and not np.issubdtype(toks.dtype, np.integer)):
            raise ValueError("tokens must be a 1-D sequence of ints")
        toks = toks.astype(np.int32)
        if toks.size > self.config.max_seq_len:
            raise ValueError(f"{toks.size} tokens exceed max_seq_len {self.config.max_seq_len}")
        salt_b = salt_bytes(salt)
        with self._lock:
            nodes: list[BlockNode] = []
            if self.config.enable_prefix_reuse and toks.size > 1:
                max_pages = (toks.size - 1) // self._tpp
                self._stats.num_prefix_queries += 1
                self._stats.num_prefix_query_tokens += int(toks.size)
                nodes = self.tree.match(toks, salt_b, self._tpp, max_pages)
                for n in nodes:
                    self.tree.incref(n)
                nodes = self._onboard(nodes)
            if not self._free_rows:
                self._grow_rows(self._len.size * 2)
            row = self._free_rows.pop()
            seq = Sequence(self, row, self._next_id, salt_b)
            self._next_id += 1
            k = len(nodes)
            seq._nodes = nodes
            if k:
                self._table[:, row, :k] = np.stack([n.slots for n in nodes], axis=1)
            self._table[:, row, k:] = 0
            self._tokens[row, :toks.size] = toks
            self._len[row] = k * self._tpp
            self._npages[row] = k
            self._known[row] = toks.size
            self._ncommit[row] = k
            self._commit_ok[row] = int(self.config.enable_prefix_reuse)
            seq.num_reused_tokens = k * self._tpp
            self._stats.num_prefix_hit_tokens += k * self._tpp
            self._seqs[seq.seq_id] = seq
            return seq

    def _onboard(self, nodes: list[BlockNode]) -> list[BlockNode]:
        """Brings matched lower-tier nodes to the device; returns the usable prefix (the rest
        is released)."""
        first_cold = next((i for i, n in enumerate(nodes) if n.level is not D), len(nodes))
        if first_cold == len(nodes):
            return nodes
        keep = first_cold
        cold = nodes[first_cold:]
        corrupt: list[BlockNode] = []
        if self._in_step is None and self._reserve_device(len(cold)):
            ok = True
            for lv in (H, K):
                batch = [n for n in cold if n.level is lv]
                try:
                    moved = self._migrate_nodes(batch, D)
                except CorruptPageError as e:  # a miss; the bad pages are dropped below
                    bad = set(e.slots.tolist())
                    corrupt = [n for n in batch if int(n.slots[e.layer_group]) in bad]
                    moved = False
                if not moved:
                    ok = False
                    break
                if batch:
                    self._stats.num_onboarded_pages += len(batch)
                    self._emit(ManagerEvent("onboarded", len(batch), D))
            if ok:
                keep = len(nodes)
            else:
                keep = next((i for i, n in enumerate(nodes) if n.level is not D), len(nodes))
        for n in nodes[keep:]:
            self.tree.decref(n)
        for n in corrupt:  # never served again (unless still held by a suspended sequence)
            if n.alive and all(d.refcount == 0 for d in self.tree.subtree(n)):
                self._drop(n)
        return nodes[:keep]

    def close(self, seq: Sequence) -> None:
        """Releases the sequence; its committed pages stay cached until evicted."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE, SequenceState.SUSPENDED)
            row = seq._row
            k = len(seq._nodes)
            if seq.state is SequenceState.ACTIVE:
                self._defer_free(self._table[:, row, k:self._npages[row]].copy())
            elif seq._parked is not None:
                lv, slots = seq._parked
                for g in range(self._G):
                    self.storage.free(lv, g, slots[g])
            for n in reversed(seq._nodes):
                self.tree.decref(n)
            seq._nodes = []
            self._ncommit[row] = 0
            seq._parked = None
            seq.state = SequenceState.CLOSED
            self._len[row] = self._npages[row] = self._known[row] = 0
            self._ncommit[row] = self._commit_ok[row] = 0
            self._table[:, row] = 0
            self._free_rows.append(row)
            del self._seqs[seq.seq_id]

    # -- steps -------------------------------------------------------------------------------

    def prepare_step(self, work: _Seq[tuple[Sequence, Any]]) -> StepBatch:
        """``work``: ``[(seq, num_new_tokens or new token ids), ...]`` (distinct ACTIVE
        sequences). Allocates pages (evicting cached pages when needed) and returns the padded
        index buffers. Raises :class:`OutOfPagesError` (nothing scheduled) when pages run out."""
        cfg, tpp = self.config, self._tpp
        with self._lock:
            if self._in_step is not None:
                raise StepInFlightError("a step is in flight: call complete_step first")
            B = len(work)
            if B == 0 or B > cfg.max_batch:
                raise ValueError(f"work must hold 1..{cfg.max_batch} sequences, got {B}")
            seqs: list[Sequence] = []
            row_list: list[int] = []
            count_list: list[int] = []
            id_index: list[int] = []
            id_arrays: list[np.ndarray] = []
            active = SequenceState.ACTIVE
            for i, (seq, x) in enumerate(work):
                if seq.state is not active or seq._mgr is not self:
                    self._check_seq(seq, SequenceState.ACTIVE)
                seqs.append(seq)
                row_list.append(seq._row)
                if type(x) is int or (isinstance(x, (int, np.integer))
                                      and not isinstance(x, (bool, np.bool_))):
                    count_list.append(x)
                    continue
                arr = x if type(x) is np.ndarray else np.asarray(x)
                if arr.ndim != 1 or arr.dtype.kind not in "iu":
                    raise ValueError("work items must be (seq, int) or (seq, 1-D token ids)")
                count_list.append(arr.size)
                id_index.append(i)
                id_arrays.append(arr)
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
            cur = self._len[rows]
            new_len = cur + counts
            if new_len.max() > cfg.max_seq_len:
                raise ValueError(f"a sequence would exceed max_seq_len {cfg.max_seq_len}")
            known = self._known[rows]
            if id_arrays:  # NOTE: validated before anything changes
                idx = np.array(id_index, np.int64)
                sizes = counts[idx]
                id_vals = np.concatenate(id_arrays).astype(np.int32)
                id_rows = np.repeat(rows[idx], sizes)
                id_pos = (np.arange(id_vals.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
                          + np.repeat(cur[idx], sizes))
                id_known = np.repeat(known[idx], sizes)
                overlap = id_pos < id_known
                if overlap.any() and not np.array_equal(
                        self._tokens[id_rows[overlap], id_pos[overlap]], id_vals[overlap]):
                    raise ValueError("token ids contradict the prompt of a sequence in work")
            # Pages.
            npages = self._npages[rows]
            need = -(-new_len // tpp) - npages
            total = int(need.sum())
            if total:
                slots = self._allocate_device(total)
                if slots is None:
                    raise OutOfPagesError(f"{total} device pages needed, "
                                          f"{self._num_free(D)} free and no cached page left")
                rep = np.repeat(rows, need)
                starts = np.cumsum(need) - need
                off = np.arange(total) - np.repeat(starts - npages, need)
                self._table[:, rep, off] = slots
                self._npages[rows] = npages + need
            # Tokens (only when contiguous with the ids already known).
            if id_arrays:
                ok = id_known >= np.repeat(cur[idx], sizes)
                self._tokens[id_rows[ok], id_pos[ok]] = id_vals[ok]
                grow = known[idx] >= cur[idx]
                r = rows[idx][grow]
                self._known[r] = np.maximum(known[idx][grow], new_len[idx][grow])
            self._len[rows] = new_len
            # Buffers.
            Bb = pick_bucket(cfg.batch_buckets, B)
            Tb = pick_bucket(cfg.token_buckets, T)
            qs = np.empty(Bb + 1, np.int32)
            qs[0] = 0
            np.cumsum(counts, out=qs[1:B + 1])
            qs[B + 1:] = T
            tok_row = np.repeat(rows, counts)
            pos = np.arange(T) - np.repeat(qs[:B], counts) + np.repeat(cur, counts)
            positions = np.zeros(Tb, np.int32)
            positions[:T] = pos
            seq_lens = np.zeros(Bb, np.int32)
            seq_lens[:B] = new_len
            pt = np.zeros((self._G, Bb, self._P), np.int32)
            pt[:, :B] = self._table[:, rows]
            sm = np.full((self._G, Tb), -1, np.int32)
            sm[:, :T] = self._table[:, tok_row, pos // tpp] * tpp + pos % tpp
            if self._G == 1:
                pt, sm = pt[0], sm[0]
            self._in_step = (seqs, rows)
            return StepBatch(page_table=pt, seq_lens=seq_lens, query_start=qs, slot_mapping=sm,
                             positions=positions)

    def complete_step(self, caches: _Seq[tuple[jax.Array, jax.Array]]) -> None:
        """Takes back the (donated) pools from the step, records its completion fence and
        commits pages that became full."""
        with self._lock:
            if self._in_step is None:
                raise RuntimeError("complete_step without a prepared step")
            caches = list(caches)
            if len(caches) != len(self.storage.pools):
                raise ValueError(f"caches must hold {len(self.storage.pools)} (k, v) pairs")
            for h, ((k, v), (k0, v0)) in enumerate(zip(caches, self.storage.pools)):
                for a, b in ((k, k0), (v, v0)):
                    if a.shape != b.shape or a.dtype != b.dtype:
                        raise ValueError(f"caches[{h}] has shape {a.shape} {a.dtype}, expected "
                                         f"{b.shape} {b.dtype}")
            self.storage.pools = [(k, v) for k, v in caches]
            seqs, rows = self._in_step
            self._in_step = None
            self._step_index += 1
            self._fence = caches[0][0]
            for p in self._pending:
                if p[0] is None:
                    p[0] = self._step_index
            self._stats.num_steps += 1
            if self.config.enable_prefix_reuse:
                self._commit(seqs, rows)

    def _commit(self, seqs: list[Sequence], rows: np.ndarray) -> None:
        tpp, tree, hash_fn = self._tpp, self.tree, self.tree.hash_fn
        full = np.minimum(self._len[rows], self._known[rows]) // tpp
        ncommit = self._ncommit[rows]
        todo = np.flatnonzero((full > ncommit) & (self._commit_ok[rows] > 0))
        if todo.size == 0:
            return
        n0 = 0
        page_bytes = tpp * 4
        for i in todo.tolist():
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
            cols = self._table[:, r, first:last].T.copy()
            for j in range(last - first):
                toks = blob[j * page_bytes:(j + 1) * page_bytes]
                key = hash_fn(pkey + toks + seq._salt)
                node = tree.insert(key, parent, toks, D, cols[j])
                if node is None:
                    node = tree.nodes[key]
                    if (node.parent is not parent or node.tokens != toks
                            or node.level is not D):
                        # A collision (or a copy off the device): the page stays private and
                        # so does everything after it.
                        self._commit_ok[r] = 0
                        break
                    # NOTE: a duplicate (another sequence computed the same page first): adopt
                    # the committed page, free ours once the step that wrote it completed.
                    tree.incref(node)
                    self._table[:, r, first + j] = node.slots
                    self._defer_free(cols[j][:, None].copy())
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
        r = seq._row
        return self._table[:, r, len(seq._nodes):self._npages[r]].copy()

    def suspend(self, seq: Sequence) -> SuspendResult:
        """Moves the sequence's device pages that only it holds to host (else disk). Reserves
        every destination first; when none can take them the sequence is unchanged and the
        answer is ``MUST_RECOMPUTE``."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE)
            self._need_pools("suspend")
            own = [n for n in seq._nodes if n.level is D and n.refcount == 1]
            private = self._private(seq)
            n = len(own) + private.shape[1]
            for lv in self._levels[1:]:
                if not self._make_room_cold(lv, n):
                    continue
                moved = self._migrate(D, private, lv)
                if moved is None:  # rolled back (maybe into other device slots)
                    r = seq._row
                    self._table[:, r, len(seq._nodes):self._npages[r]] = private
                    continue
                if not self._migrate_nodes(own, lv):  # pragma: no cover - room was made
                    back = self._migrate(lv, moved, D)
                    if back is None:
                        raise RuntimeError("suspend: could not restore after a refusal")
                    r = seq._row
                    self._table[:, r, len(seq._nodes):self._npages[r]] = back
                    continue
                seq._parked = (lv, moved)
                seq.state = SequenceState.SUSPENDED
                self._stats.num_suspended += 1
                self._emit(ManagerEvent("suspended", n, lv))
                return SuspendResult.SUSPENDED
            self._stats.num_refused_suspends += 1
            return SuspendResult.MUST_RECOMPUTE

    def resume(self, seq: Sequence) -> bool:
        """Brings a suspended sequence back to the device byte-identical; False (still
        suspended, nothing changed but cached pages evicted) when the device cannot take it."""
        with self._lock:
            self._check_seq(seq, SequenceState.SUSPENDED)
            self._need_pools("resume")
            lv, parked = seq._parked
            cold_nodes = [n for n in seq._nodes if n.level is not D]
            n = len(cold_nodes) + parked.shape[1]
            if not self._reserve_device(n):
                self._stats.num_refused_resumes += 1
                return False
            # NOTE: shared (node) pages first: a node on the device is valid for a suspended
            # sequence, so a failure (CorruptPageError from disk) below leaves it SUSPENDED and
            # consistent; the caller then closes it and recomputes.
            for level in (H, K):
                if not self._migrate_nodes([c for c in cold_nodes if c.level is level], D):
                    self._stats.num_refused_resumes += 1  # pragma: no cover - reserved above
                    return False
            back = self._migrate(lv, parked, D)
            if back is None:  # pragma: no cover - reserved above
                self._stats.num_refused_resumes += 1
                return False
            seq._parked = None
            r = seq._row
            k = len(seq._nodes)
            if k:
                self._table[:, r, :k] = np.stack([nd.slots for nd in seq._nodes], axis=1)
            self._table[:, r, k:self._npages[r]] = back
            seq.state = SequenceState.ACTIVE
            self._stats.num_resumed += 1
            self._emit(ManagerEvent("resumed", n, D))
            return True

    # -- planning and stats ------------------------------------------------------------------

    @property
    def device_capacity_pages(self) -> int:
        return min(self.config.device_pages)

    def max_num_sequences(self, seq_len: int) -> int:
        """How many sequences of ``seq_len`` tokens fit on the device at once (0 when one does
        not fit; ``seq_len`` is clamped to ``max_seq_len``)."""
        seq_len = check_count(seq_len, "seq_len", minimum=1)
        pages = -(-min(seq_len, self.config.max_seq_len) // self._tpp)
        return self.device_capacity_pages // pages

    def max_seq_len_for(self, num_sequences: int) -> int:
        """The largest length (a whole number of pages, clamped to ``max_seq_len``) such that
        ``num_sequences`` sequences fit on the device at once; 0 when not even one page each."""
        n = check_count(num_sequences, "num_sequences", minimum=1)
        return min(self.config.max_seq_len, (self.device_capacity_pages // n) * self._tpp)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = dataclasses.asdict(self._stats)
            out["num_active"] = sum(s.state is SequenceState.ACTIVE for s in self._seqs.values())
            out["num_suspended_now"] = len(self._seqs) - out["num_active"]
            out["num_committed_now"] = len(self.tree)
            out["pages"] = {lv.name.lower(): self._page_counts(lv) for lv in self._levels}
            out["storage"] = self.storage.stats()
            return out

    def _page_counts(self, level: CacheLevel) -> dict[str, int]:
        cached = len(self.tree.lru[level])
        referenced = sum(1 for n in self.tree.nodes.values()
                         if n.level is level and n.refcount > 0)
        for s in self._seqs.values():
            if level is D and s.state is SequenceState.ACTIVE:
                referenced += int(self._npages[s._row]) - len(s._nodes)
            elif s._parked is not None and s._parked[0] is level:
                referenced += s._parked[1].shape[1]
        pending = self._num_pending if level is D else 0
        cap = min(self.storage.allocator(level, g).num_slots for g in range(self._G))
        if level is D:
            cap -= 1  # the null page
        return dict(capacity=cap, free=self._num_free(level), pending=pending,
                    referenced=referenced, cached=cached)

    # -- invariants (tests) ------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent (tests call this)."""
        with self._lock:
            self._check_invariants()

    def _check_invariants(self) -> None:
        st = self.storage
        holders: dict[int, int] = {}
        for s in self._seqs.values():
            for n in s._nodes:
                holders[id(n)] = holders.get(id(n), 0) + 1
                assert n.alive, f"{s!r} holds a dropped node"
            assert self._ncommit[s._row] == len(s._nodes)
            if s.state is SequenceState.ACTIVE:
                r = s._row
                k = len(s._nodes)
                if k:
                    assert np.array_equal(self._table[:, r, :k],
                                          np.stack([n.slots for n in s._nodes], axis=1))
                    assert all(n.level is D for n in s._nodes)
        for n in self.tree.nodes.values():
            assert n.refcount == holders.get(id(n), 0), f"{n!r} has {holders.get(id(n), 0)}"
            assert (id(n) in self.tree.lru[n.level]) == (n.refcount == 0)
        for lv in CacheLevel:
            for n in self.tree.lru[lv].values():
                assert n.level is lv and n.alive and n.key in self.tree.nodes
        for lv in self._levels:
            for g in range(self._G):
                used: list[np.ndarray] = [n.slots[g:g + 1] for n in self.tree.nodes.values()
                                          if n.level is lv]
                for s in self._seqs.values():
                    if lv is D and s.state is SequenceState.ACTIVE:
                        used.append(self._table[g, s._row, len(s._nodes):self._npages[s._row]])
                    elif s._parked is not None and s._parked[0] is lv:
                        used.append(s._parked[1][g])
                if lv is D:
                    used.extend(p[1][g] for p in self._pending)
                allu = np.concatenate(used) if used else np.zeros(0, np.int32)
                alloc = st.allocator(lv, g)
                assert np.unique(allu).size == allu.size, f"{lv.name} g{g}: a page in two places"
                assert (allu != 0).all() if lv is D else True, "the null page is in use"
                assert all(alloc.is_allocated(int(x)) for x in allu), f"{lv.name}: not allocated"
                extra = 1 if lv is D else 0
                num_allocated = alloc.num_slots - alloc.num_free
                assert num_allocated == allu.size + extra, (
                    f"{lv.name} g{g}: {num_allocated - extra} allocated, {allu.size} known")
            c = self._page_counts(lv)
            assert c["free"] + c["pending"] + c["referenced"] + c["cached"] == c["capacity"] or \
                self._G > 1, c
            # Governor ledger == recomputation from the allocators.
            expect = sum((st.allocator(lv, g).num_slots - st.allocator(lv, g).num_free
                          - (1 if lv is D else 0))
                         * st.page_bytes(lv, g) for g in range(self._G))
            u = st.governor.usage(lv)
            assert u.committed == expect and u.transient == 0 and u.reserved == 0, (lv, u, expect)
