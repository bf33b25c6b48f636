"""The arena hot backend of :class:`~jax_kvcm.KVCacheManager` (``hot_backend="arena"``).

``KVCacheManager(KVCacheConfig(..., hot_backend="arena", arena=ArenaConfig(...)))`` returns an
:class:`ArenaKVCacheManager`: the same calls (``add_sequence``, ``prepare_step``,
``complete_step``, ``abort_step``, ``close``, ``suspend``, ``resume``, ``stats``,
``max_num_sequences``, ``shutdown``) over one :class:`~jax_kvcm._arena.Arena`. Each sequence owns
a contiguous range of slots (page ``j`` at ``base_slot + j``, so every page-table row is
``base + arange``) and physical memory is mapped chunk by chunk against
``ArenaConfig.budget_bytes``.

Where it differs from the paged backend (the seam: the device tier of one full-attention layer
group is the arena; the prefix tree, eviction and the cold tiers are not used):

- **Prefix reuse** is the arena's span registry: a closing sequence's private chunks holding
  committed pages are registered under the chained hash of their token ids (salted), one key per
  alias unit (``ArenaConfig.alias_unit_pages`` pages, default 1); ``add_sequence`` maps
  registered chunks matching the prompt into the new range (same physical pages, zero copy, zero
  budget) and reports the matching pages in ``num_reused_tokens``. Physical memory is shared per
  chunk (2 MiB per pool-layer on the GPU: 64 pages of an 8B-shaped model), so a prefix shorter
  than a chunk (a 512-token system prompt) aliases the first pages of the owner's chunk and the
  sequence's own pages continue at its next chunk (a *partial alias*: two linear runs of slots,
  see :class:`~jax_kvcm._arena.ArenaSequence`).
- **Admission** takes a range: ``add_sequence`` raises :class:`OutOfPagesError` when all
  ``ArenaConfig.max_sequences`` ranges are held by ACTIVE sequences (a suspended one holds none).
- **Suspend/resume** go through the storage manager's migration transaction
  (:class:`~jax_kvcm._arena_storage.ArenaColdStore`): the pages are staged on the device and
  moved to host (``host_bytes``), else disk (``disk_bytes`` / ``disk_dir``), every cold slot
  reserved before anything is submitted (``MUST_RECOMPUTE`` with nothing changed when no tier
  can take them), and back into a fresh range, byte-identical. Cold pages use the manager's
  codec (``cold_page_codec``, consumed as by the paged backend).
- **Steps.** The jitted step donates :attr:`caches` and returns them, on both backends. On the
  GPU they are the reservation imported with DLPack (XLA aliases the donated buffer);
  ``complete_step`` checks the returned K pool still starts at the reservation (a copy would
  silently detach the manager from its memory; checked on the first 16 steps and every 256th,
  as reading the pointer may wait for the step). XLA's CPU client never aliases a donated
  buffer it did not allocate (it copies the whole input, which faults on unmapped super-pages),
  so on CPU :attr:`caches` are two :class:`~jax_kvcm._arena_ops.ArenaPool`s: the pools by
  address plus an ordering token, which the ops take in place of arrays and run on the
  reservation itself (``complete_step`` checks their addresses on every step). A step may also
  write its K/V from the host instead (:meth:`ArenaKVCacheManager.write_step_kv`, at the
  batch's slot mapping) and hand :attr:`caches` back unchanged.
- Observers get :class:`~jax_kvcm.ManagerEvent` "suspended" (with the cold level) / "resumed"
  only (no commits).
- Unsupported here (TypeError naming the call): ``compact``, ``recover_from_failed_step``,
  ``state`` / ``Sequence.phase``, ``private_pages_per_sequence``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import warnings
from collections.abc import Sequence as _Seq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm._arena import Arena, ArenaConfig, ArenaLayout, ArenaSequence
from jax_kvcm._arena_pool import ArenaPool
from jax_kvcm._arena_storage import ArenaColdStore
from jax_kvcm._manager import (KVCacheConfig, KVCacheManager, ManagerEvent, OutOfPagesError,
                               Sequence,
                               SequenceState, StepInFlightError, SuspendResult, _prompt_array,
                               _row_buffers, _Stats)
from jax_kvcm._prefix_tree import salt_bytes
from jax_kvcm._step_batch import StepBatch
from jax_kvcm._storage import LayerGroupSpec, _token
from jax_kvcm._types import CacheLevel

__all__ = ["ArenaKVCacheManager", "check_arena_config"]

_ARENA_DTYPES = ("float32", "float16", "bfloat16")


def check_arena_config(cfg: KVCacheConfig, groups: tuple, page_bytes: list[int]) -> None:
    """Validates the arena fields of ``cfg`` (called by ``KVCacheConfig.__post_init__``) and
    sets ``cfg.device_pages`` to the pages ``arena.budget_bytes`` holds (planning without a
    manager; the manager's own planning counts whole chunks)."""
    a = cfg.arena
    if not isinstance(a, ArenaConfig):
        raise TypeError(f"arena must be an ArenaConfig when hot_backend='arena', got "
                        f"{type(a).__name__}")
    if len(groups) != 1:
        raise ValueError("layer_groups: hot_backend='arena' takes exactly one full-attention "
                         f"layer group, got {len(groups)}")
    if groups[0].sliding_window:
        # NOTE: a window group's ring tables reuse a fixed set of pages, the opposite of a
        # sequence-long contiguous range; such models use the paged backend.
        raise ValueError("layer_groups[0].sliding_window: hot_backend='arena' takes a "
                         "full-attention group only (sliding-window groups: the paged backend)")
    name = jnp.dtype(groups[0].pool_dtype).name
    if name not in _ARENA_DTYPES:
        field = "kv_dtype" if groups[0].kv_dtype is not None else "dtype"
        raise ValueError(f"layer_groups[0].{field}: the arena stores {', '.join(_ARENA_DTYPES)} "
                         f"pools, got {name} (FP8 K/V: the paged backend)")
    for field in ("device_pages", "device_bytes", "pool_ratio", "typical_batch"):
        if getattr(cfg, field) is not None:
            raise ValueError(f"{field}: with hot_backend='arena' the device budget is "
                             "arena.budget_bytes; leave it out")
    pages = -(-cfg.max_seq_len // cfg.tokens_per_page)
    if a.max_pages_per_sequence < pages:
        raise ValueError(f"arena.max_pages_per_sequence ({a.max_pages_per_sequence}) must cover "
                         f"max_seq_len ({cfg.max_seq_len} tokens = {pages} pages)")
    object.__setattr__(cfg, "device_pages", (max(1, a.budget_bytes // page_bytes[0]),))


class _StepFence:
    """A step's K pool output (on CPU: its K pool's token) as the fence of the ranges it read.
    Once a later step consumed that array (donation: it can no longer be waited on), the
    manager's newest pools stand for it: they are the output of a later step on the same
    stream."""

    __slots__ = ("array", "manager")

    def __init__(self, array: jax.Array, manager: ArenaKVCacheManager) -> None:
        self.array, self.manager = array, manager

    def _live(self) -> jax.Array:
        if not self.array.is_deleted():
            return self.array
        m = self.manager
        return m._pools[0][0] if m._step_pools is None else m._step_pools[0][0].token

    def is_ready(self) -> bool:
        return self._live().is_ready()

    def block_until_ready(self) -> Any:
        return self._live().block_until_ready()


def _unsupported(name: str) -> Any:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{name} is not supported by the arena hot backend")

    call.__name__ = name
    call.__doc__ = "Not supported by the arena hot backend (TypeError)."
    return call


class ArenaKVCacheManager(KVCacheManager):
    """:class:`KVCacheManager` over a contiguous arena (see the module docstring).

    Built by ``KVCacheManager(config)`` when ``config.hot_backend == "arena"``. ``backend``
    ("auto", "cpu", "cuda") picks the arena's memory (auto: CUDA VMM when JAX's default backend is
    a GPU, memfd otherwise). ``arena``: the :class:`Arena` (its ``stats()`` are in
    ``stats()["arena"]``).
    """

    def __init__(self, config: KVCacheConfig, cold_page_codec: Any = None, *,
                 device: jax.Device | None = None, _hash_fn: Any = None,
                 backend: str = "auto") -> None:
        self.config = config
        self._lock = threading.RLock()
        self._tpp = config.tokens_per_page
        self._G = 1
        self._P = config.pages_per_seq
        g = config.layer_groups[0]
        self.layout = ArenaLayout(g.num_layers, self._tpp, g.num_kv_heads, g.head_dim,
                                  jnp.dtype(g.pool_dtype).name)
        try:
            self.arena = Arena(config.arena, self.layout, backend=backend,
                               device=-1 if device is None else int(device.id))
        except BaseException:
            if cold_page_codec is not None and hasattr(cold_page_codec, "consume"):
                cold_page_codec.consume()  # NOTE: consumed whether construction succeeds or not
            raise
        try:
            self._cold = ArenaColdStore(
                self.arena, LayerGroupSpec(g.num_layers, self._tpp, g.num_kv_heads, g.head_dim,
                                           g.pool_dtype),
                host_bytes=config.host_bytes, disk_dir=config.disk_dir,
                disk_bytes=config.disk_bytes, codec=cold_page_codec, device=device)
        except BaseException:
            self.arena.close_arena()
            raise
        self._unit_tokens = config.arena.alias_unit_pages * self._tpp
        self._hash = _hash_fn or (lambda b: hashlib.blake2b(b, digest_size=16).digest())
        self._stats = _Stats()
        self._kinds: list[Any] = []
        self._tokens = np.zeros((0, self._P * self._tpp), np.int32)
        for name in self._ROW_ARRAYS:
            setattr(self, name, np.zeros(0, np.int64))
        self._free_rows: list[int] = []
        self._grow_rows(16)
        self._seqs: dict[int, Sequence] = {}
        self._aseq: dict[int, ArenaSequence] = {}
        self._next_id = 0
        self._pools = [self.arena.pool_arrays()]
        # CPU: what steps take and return (jax_kvcm/_arena_ops.py); GPU: None (the _pools).
        self._step_pools = self._fresh_step_pools()
        # (seqs, rows, len before, known before, token slots) of the prepared step.
        self._in_step: tuple[list[Sequence], np.ndarray, np.ndarray, np.ndarray,
                             np.ndarray] | None = None
        self._close_after_step: list[tuple[ArenaSequence, list[bytes]]] = []
        self._fence: Any = None
        self._shut = False
        self._observers: list[Any] = []

    # -- helpers ---------------------------------------------------------------------------

    def _fresh_step_pools(self) -> list[tuple[ArenaPool, ArenaPool]] | None:
        if self.arena.backend != "cpu":
            return None
        k, v = self._pools[0]
        # NOTE: two tokens (a step donates both pools; one array donated twice is an error).
        return [tuple(ArenaPool.by_address(jax.device_put(np.int32(0), a.sharding),
                                           a.unsafe_buffer_pointer(), a.shape, a.dtype,
                                           slot_major=False) for a in (k, v))]

    def _row_pages(self, row: int, first: int, last: int) -> np.ndarray:
        seq = self._aseq[int(self._seq_id[row])]
        return seq.slots(first, last).astype(np.int32)[None]

    def _chunk_keys(self, row: int, salt: bytes, num_tokens: int) -> list[bytes]:
        """Chained keys of the whole alias units (``arena.alias_unit_pages`` pages) among the
        row's first ``num_tokens`` known tokens."""
        ct = self._unit_tokens
        n = min(num_tokens, int(self._known[row])) // ct
        keys, h = [], self._hash(b"arena" + salt)
        for i in range(n):
            h = self._hash(h + self._tokens[row, i * ct:(i + 1) * ct].astype("<i4").tobytes())
            keys.append(h)
        return keys

    def _release_row(self, seq: Sequence) -> None:
        row = seq._row
        self._len[row] = self._npages[row] = self._known[row] = 0
        self._seq_id[row] = -1
        self._free_rows.append(row)
        del self._seqs[seq.seq_id]
        del self._aseq[seq.seq_id]
        seq.state = SequenceState.CLOSED

    def add_observer(self, fn: Any) -> None:
        """``fn(event)`` for each "suspended" / "resumed" :class:`ManagerEvent` (called inside
        the call that caused it; an exception from ``fn`` is warned about, never propagated)."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._observers.append(fn)

    def _notify(self, event: ManagerEvent) -> None:
        for fn in list(self._observers):
            try:
                fn(event)
            except Exception as e:  # noqa: BLE001 - an observer never breaks the manager
                warnings.warn(f"observer {fn!r} raised {e!r}", RuntimeWarning, stacklevel=3)

    def record_token_ids(self, seq: Sequence, token_ids: Any) -> None:
        """As :meth:`KVCacheManager.record_token_ids`: ids of positions ``num_known_tokens``
        onward; full alias units of them are registered as spans when the sequence closes."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE, SequenceState.SUSPENDED)
            self._need_pools("record_token_ids")
            self._store_recorded_ids(seq, token_ids)

    # -- sequences -------------------------------------------------------------------------

    def add_sequence(self, tokens: Any, *, salt: Any = None) -> Sequence:
        """As :meth:`KVCacheManager.add_sequence`; reuse is registered chunks, whole or a
        leading part of one (see the module docstring). Raises :class:`OutOfPagesError` when
        every arena range is held."""
        toks = _prompt_array(tokens, self.config.max_seq_len)
        salt_b = salt_bytes(salt)
        with self._lock:
            self._check_open()
            if not self._free_rows:
                self._grow_rows(self._len.size * 2)
            row = self._free_rows[-1]
            self._tokens[row, :toks.size] = toks
            self._known[row] = toks.size
            keys: list[bytes] = []
            if self.config.enable_prefix_reuse and toks.size > 1:
                keys = self._chunk_keys(row, salt_b, toks.size - 1)
                self._stats.num_prefix_queries += 1
                self._stats.num_prefix_query_tokens += int(toks.size)
            aseq = self.arena.admit(keys)
            if aseq is None:
                self._known[row] = 0
                raise OutOfPagesError(f"every arena range is in use (arena.max_sequences = "
                                      f"{self.config.arena.max_sequences} active sequences)")
            self._free_rows.pop()
            seq = Sequence(self, row, self._next_id, salt_b)
            self._next_id += 1
            reused = aseq.num_aliased_pages * self._tpp
            self._len[row] = reused
            self._npages[row] = aseq.num_aliased_pages
            self._seq_id[row] = seq.seq_id
            seq.num_reused_tokens = reused
            self._stats.num_prefix_hit_tokens += reused
            self._seqs[seq.seq_id] = seq
            self._aseq[seq.seq_id] = aseq
            return seq

    def close(self, seq: Sequence) -> None:
        """Ends the sequence. Its chunks holding committed pages enter the span registry
        (``enable_prefix_reuse``); its range is parked still mapped for the next admission. A
        sequence closed while a step is prepared keeps its range until ``complete_step`` /
        ``abort_step`` (the step may still write it)."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE, SequenceState.SUSPENDED)
            aseq = self._aseq[seq.seq_id]
            if seq.state is SequenceState.SUSPENDED:
                assert aseq.suspended is not None
                self._cold.release(*aseq.suspended)
                aseq.suspended = None
            else:
                done = int(self._len[seq._row])
                if self._in_step is not None:
                    hit = np.flatnonzero(self._in_step[1] == seq._row)
                    if hit.size:
                        done = int(self._in_step[2][hit[0]])
                keys = (self._chunk_keys(seq._row, seq._salt, done)
                        if self.config.enable_prefix_reuse else [])
                if self._in_step is not None:
                    self._close_after_step.append((aseq, keys))
                else:
                    self.arena.close(aseq, keys)
            self._release_row(seq)

    def suspend(self, seq: Sequence) -> SuspendResult:
        """Moves the sequence's pages to host, else disk, as one storage transaction, then parks
        its range; ``MUST_RECOMPUTE`` (nothing changed anywhere) when no tier can take them."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE)
            self._need_pools("suspend")
            aseq = self._aseq[seq.seq_id]
            got = self._cold.suspend(aseq, self._pools[0])
            if got is None:
                self._stats.num_refused_suspends += 1
                return SuspendResult.MUST_RECOMPUTE
            # NOTE: the staging gather reads the range: unmapping it waits for that read.
            self.arena.record_step([aseq], _token(*self._cold.storage.pools[0]))
            self.arena.close(aseq)
            aseq.suspended = got
            seq.state = SequenceState.SUSPENDED
            self._stats.num_suspended += 1
            self._notify(ManagerEvent("suspended", seq.num_pages, got[0]))
            return SuspendResult.SUSPENDED

    def resume(self, seq: Sequence) -> bool:
        """Restores a suspended sequence into a fresh range, byte-identical; False (still
        suspended, nothing changed) when no range or budget is available."""
        with self._lock:
            self._check_seq(seq, SequenceState.SUSPENDED)
            self._need_pools("resume")
            aseq = self._aseq[seq.seq_id]
            level, slots = aseq.suspended
            fresh = self.arena.admit()
            pools = None
            try:
                if fresh is not None and self.arena.ensure(fresh, aseq.num_pages):
                    pools = self._cold.resume(fresh, level, slots, self._pools[0])
            finally:
                if pools is None and fresh is not None:
                    self.arena.close(fresh)
            if pools is None:
                self._stats.num_refused_resumes += 1
                return False
            self.arena.hand_over(fresh, aseq)
            aseq.suspended = None
            if pools is not self._pools[0]:  # the GPU scatter's donated outputs
                if pools[0].unsafe_buffer_pointer() != self.arena.base_address:
                    raise RuntimeError("resume: XLA copied the arena pool instead of writing it "
                                       "in place")
                self._pools = [pools]
                self._fence = self._step_fence(pools[0])
                self.arena.record_step([aseq], self._fence)
            seq.state = SequenceState.ACTIVE
            self._stats.num_resumed += 1
            self._notify(ManagerEvent("resumed", seq.num_pages, CacheLevel.DEVICE))
            return True

    # -- steps -----------------------------------------------------------------------------

    @property
    def caches(self) -> list[tuple[Any, Any]]:
        """``[(k, v)]``: the arena's reservation as ``[num_layers, num_slots, tokens_per_page,
        num_kv_heads, head_dim]`` pools, what a step takes and returns: on the GPU
        ``jax.Array``s (DLPack, no copy; only slots of mapped chunks are addressable, so
        nothing may copy or reduce the whole pool), on CPU
        :class:`~jax_kvcm._arena_ops.ArenaPool`s (the pools by address, for the ops)."""
        self._check_open()
        return list(self._pools if self._step_pools is None else self._step_pools)

    def _step_fence(self, array: jax.Array) -> _StepFence:
        return _StepFence(array, self)

    def _need_pools(self, what: str) -> None:
        if self._in_step is not None:
            raise StepInFlightError(f"{what} while a step is in flight: call complete_step or "
                                    "abort_step first")

    def prepare_step(self, work: _Seq[tuple[Sequence, Any]]) -> StepBatch:
        """As :meth:`KVCacheManager.prepare_step`: maps the chunks the new tokens need and
        returns tables ``base + arange``. Raises :class:`OutOfPagesError` (nothing scheduled;
        chunks mapped for earlier rows stay mapped for them) when the budget cannot cover it."""
        cfg, tpp = self.config, self._tpp
        with self._lock:
            self._check_open()
            self._need_pools("prepare_step")
            seqs, rows, counts, id_index, id_arrays, every = self._parse_work(work)
            B, T = len(seqs), int(counts.sum())
            cur = self._len[rows]
            new_len = cur + counts
            if new_len.max() > cfg.max_seq_len:
                raise ValueError(f"a sequence would exceed max_seq_len {cfg.max_seq_len}")
            ids = self._check_ids(rows, counts, cur, id_index, id_arrays, every)
            npages = -(-new_len // tpp)
            aseqs = [self._aseq[s.seq_id] for s in seqs]
            for a, n in zip(aseqs, npages.tolist()):
                if not self.arena.ensure(a, n):
                    raise OutOfPagesError(f"the arena budget cannot map {n} pages for a "
                                          f"sequence ({self.arena.num_free_chunks} free chunks "
                                          "after reclaiming parked ranges and spans)")
            self._store_ids(ids, new_len)
            self._len[rows] = new_len
            self._npages[rows] = npages
            Bb, Tb, qs, pos, positions, seq_lens = _row_buffers(cfg, counts, cur, new_len)
            base = np.array([a.base_slot for a in aseqs], np.int64)
            # NOTE: page j's slot is base + j, plus skip from skip_from on (a partial alias).
            skip_from = np.array([a.skip_from for a in aseqs], np.int64)
            skip = np.array([a.skip for a in aseqs], np.int64)
            pt = np.zeros((Bb, self._P), np.int32)
            ar = np.arange(self._P)
            slot = base[:, None] + ar[None] + skip[:, None] * (ar[None] >= skip_from[:, None])
            pt[:B] = np.where(ar[None] < npages[:, None], slot, 0)
            sm = np.full(Tb, -1, np.int32)
            page = pos // tpp
            sm[:T] = (np.repeat(base, counts) + page + np.repeat(skip, counts) * (
                page >= np.repeat(skip_from, counts))) * tpp + pos % tpp
            self._in_step = (seqs, rows, cur, ids[0], sm)
            return StepBatch(page_table=pt, seq_lens=seq_lens, query_start=qs, slot_mapping=sm,
                             positions=positions)

    def write_step_kv(self, k: Any, v: Any) -> None:
        """The CPU step path: writes the prepared step's new K/V into the arena at its slot
        mapping. ``k``/``v``: ``[num_layers, T, num_kv_heads, head_dim]`` (``T``: the batch's
        padded token count or the real one; padding tokens are skipped), the pool dtype."""
        with self._lock:
            self._check_open()
            if self._in_step is None:
                raise RuntimeError("write_step_kv without a prepared step")
            sm = self._in_step[4]
            k, v = np.asarray(k), np.asarray(v)
            T = k.shape[1] if k.ndim == 4 else -1
            if T < 0 or T > sm.size or (sm[T:] >= 0).any():
                raise ValueError(f"k must be [num_layers, T, num_kv_heads, head_dim] with T "
                                 f"covering the step's tokens, got {k.shape}")
            dt = self._pools[0][0].dtype
            if k.dtype != dt or v.dtype != dt:
                raise ValueError(f"k and v must be {dt}, got {k.dtype} and {v.dtype}")
            self.arena.write_tokens(sm[:T], k, v)

    def complete_step(self, caches: _Seq[tuple[jax.Array, jax.Array]]) -> None:
        """Takes back the pools (the donated step's outputs on the GPU, or :attr:`caches`
        itself after :meth:`write_step_kv`) and records the step's fence on its ranges. Raises
        ValueError when the returned K pool is not the reservation (a copy; checked on the first
        16 steps and every 256th)."""
        with self._lock:
            self._check_open()
            if self._in_step is None:
                raise RuntimeError("complete_step without a prepared step")
            if isinstance(caches, jax.Array) or not isinstance(caches, (list, tuple)) or len(
                    caches) != 1:
                raise TypeError("caches must be a list of one (k, v) pair")
            pair = tuple(caches[0])
            cpu = self._step_pools is not None
            want = self._step_pools[0] if cpu else self._pools[0]
            kind, what = (ArenaPool, "an ArenaPool") if cpu else (jax.Array, "a jax.Array")
            for name, a, b in zip(("caches[0][0]", "caches[0][1]"), pair, want):
                if not isinstance(a, kind):
                    raise TypeError(f"{name} must be {what} (as manager.caches), got "
                                    f"{type(a).__name__}")
                if a.shape != b.shape or a.dtype != b.dtype:
                    raise ValueError(f"{name} has shape {a.shape} {a.dtype}, expected "
                                     f"{b.shape} {b.dtype}")
                if a.is_deleted():
                    raise ValueError(f"{name} was deleted (the step failed?): call abort_step()")
            # NOTE: the pointer is read on the first steps and every 256th only: reading it may
            # wait for the step, which would serialize an overlapped loop.
            n = self._stats.num_steps
            if cpu:  # NOTE: static addresses: checked on every step, at no cost
                for name, a, b in zip(("caches[0][0]", "caches[0][1]"), pair, want):
                    if a.address != b.address:
                        raise ValueError(f"{name} is not this arena's pool")
            elif (n < 16 or n % 256 == 0) and (
                    pair[0].unsafe_buffer_pointer() != self.arena.base_address):
                raise ValueError("caches[0][0] is not the arena's memory (the step copied the "
                                 "pool: donate the caches)")
            seqs = self._in_step[0]
            self._in_step = None
            if cpu:
                self._step_pools = [(pair[0], pair[1])]
                self._fence = self._step_fence(pair[0].token)
            else:
                self._pools = [(pair[0], pair[1])]
                self._fence = self._step_fence(pair[0])
            live = [self._aseq[s.seq_id] for s in seqs if s.state is SequenceState.ACTIVE]
            self.arena.record_step(live, self._fence)
            self._finish_closes(self._fence)
            self._stats.num_steps += 1

    def _finish_closes(self, fence: Any) -> None:
        for aseq, keys in self._close_after_step:
            if fence is not None:
                self.arena.record_step([aseq], fence)
            self.arena.close(aseq, keys)
        self._close_after_step = []

    def abort_step(self) -> list[Sequence]:
        """Undoes the prepared step: its sequences go back to their lengths and known tokens
        before it (chunks mapped for it stay mapped to them). Returns ``[]``: nothing is lost
        even when a donated step consumed the pool arrays, since the arena's memory outlives
        them (they are imported again; the failed step can only have written slots past the
        restored lengths)."""
        with self._lock:
            self._check_open()
            if self._in_step is None:
                raise RuntimeError("abort_step without a prepared step")
            seqs, rows, cur, known, _ = self._in_step
            self._in_step = None
            for s, r, n, kn in zip(seqs, rows.tolist(), cur.tolist(), known.tolist()):
                if s.state is SequenceState.ACTIVE:
                    self._len[r], self._known[r] = n, kn
                    self._npages[r] = -(-n // self._tpp)
            if any(a.is_deleted() for a in self._pools[0]):
                self._pools = [self.arena.pool_arrays()]
            if self._step_pools is not None and any(a.is_deleted() for a in self._step_pools[0]):
                self._step_pools = self._fresh_step_pools()
            self._finish_closes(None)
            self._stats.num_aborted_steps += 1
            return []

    # -- planning, stats, teardown ---------------------------------------------------------

    @property
    def device_capacity_pages(self) -> int:
        """Pages the budget maps (whole chunks, the null chunk excluded)."""
        return (self.arena.budget_chunks - 1) * self.arena.pages_per_chunk

    def num_obtainable_pages(self, level: CacheLevel = CacheLevel.DEVICE) -> int:
        """Device: pages of chunks the budget can still map without reclaiming anything."""
        with self._lock:
            if CacheLevel(level) is not CacheLevel.DEVICE:
                raise ValueError("the arena backend has only the device level")
            return self.arena.num_free_chunks * self.arena.pages_per_chunk

    def free_page_count(self) -> tuple[int, ...]:
        return (self.num_obtainable_pages(),)

    def max_num_sequences(self, seq_len: int) -> int:
        """How many sequences of ``seq_len`` tokens (clamped to ``max_seq_len``) the arena
        holds at once: its ranges and its budget in whole physical chunks."""
        n = min(int(seq_len), self.config.max_seq_len)
        if n < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        return self.arena.max_num_sequences(-(-n // self._tpp))

    def max_seq_len_for(self, num_sequences: int) -> int:
        """The most tokens each of ``num_sequences`` sequences can hold at once (whole chunks,
        clamped to ``max_seq_len``); 0 when they do not fit."""
        return min(self.config.max_seq_len, self.arena.max_pages_for(num_sequences) * self._tpp)

    def stats(self) -> dict[str, Any]:
        """The manager's counters, ``num_active`` / ``num_suspended_now``, ``host_used_bytes``
        and ``arena`` (the :class:`~jax_kvcm._arena.ArenaStats` as a dict: map/unmap calls,
        mapped and physical bytes, adoptions, alias hits, ...)."""
        with self._lock:
            out = dataclasses.asdict(self._stats)
            out["num_active"] = sum(s.state is SequenceState.ACTIVE for s in self._seqs.values())
            out["num_suspended_now"] = len(self._seqs) - out["num_active"]
            out["host_used_bytes"] = self._cold.used_bytes()
            out["storage"] = self._cold.storage.stats()
            a = self.arena.stats()
            out["arena"] = dataclasses.asdict(a)
            ppc = self.arena.pages_per_chunk
            # NOTE: in pages of whole chunks (the unit mapped): referenced = chunks active
            # ranges map, cached = the rest in use (parked ranges, unmapped spans).
            active = sum(s.num_pages for s in self._aseq.values() if s.active)
            used = (a.used_chunks - 1) * ppc
            cap = self.device_capacity_pages
            out["pages"] = {"device": {"capacity": cap, "free": cap - used, "pending": 0,
                                       "referenced": min(used, active),
                                       "cached": used - min(used, active)}}
            out["num_committed_pages"] = a.num_spans * ppc
            return out

    def check_invariants(self) -> None:
        """Every open sequence's arena handle agrees with its row (tests)."""
        with self._lock:
            for sid, seq in self._seqs.items():
                a = self._aseq[sid]
                assert a.active == (seq.state is SequenceState.ACTIVE), seq
                assert int(self._npages[seq._row]) <= a.num_pages, seq
                assert (a.suspended is not None) == (seq.state is SequenceState.SUSPENDED), seq

    def shutdown(self) -> None:
        """Waits for the last step, unmaps everything and frees the reservation; later calls
        raise RuntimeError. Raises :class:`StepInFlightError` while a step is prepared."""
        with self._lock:
            if self._shut:
                return
            self._need_pools("shutdown")
            try:
                self.arena.close_arena()  # NOTE: waits for the fences (they may need _pools)
            finally:
                self._pools = []
                self._step_pools = None if self._step_pools is None else []
                self._fence = None
                self._cold.close()
            self._shut = True

    compact = _unsupported("compact")
    recover_from_failed_step = _unsupported("recover_from_failed_step")
    state = _unsupported("state")
    _phase = _unsupported("Sequence.phase")
    private_pages_per_sequence = _unsupported("private_pages_per_sequence")
