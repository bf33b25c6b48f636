"""KVCacheManager: the facade. It builds the collaborators, holds the lock, and delegates."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence as _Seq
from typing import Any

import jax
import numpy as np

from jax_kvcm._codec import ColdPageCodec
from jax_kvcm._prefix_tree import PrefixTree
from jax_kvcm._step_batch import StepBatch
from jax_kvcm._storage import LayerGroupSpec, StorageConfig, StorageManager
from jax_kvcm._types import CacheLevel, check_count
from jax_kvcm.manager.ahead import WriteBackAhead
from jax_kvcm.manager.api import (Sequence, SequencePhase, SequenceState, SequenceView,
                                  StepInFlightError, SuspendResult)
from jax_kvcm.manager.arena_room import ArenaRoom, arena_specs
from jax_kvcm.manager.committer import Committer
from jax_kvcm.manager.config import KVCacheConfig
from jax_kvcm.manager.handoff import Handoff, SequenceExport
from jax_kvcm.manager.invariants import COUNT_KEYS, Invariants
from jax_kvcm.manager.ledger import StepLedger
from jax_kvcm.manager.lifecycle import Lifecycle
from jax_kvcm.manager.observers import Observers, Stats
from jax_kvcm.manager.planner import TierPlanner
from jax_kvcm.manager.rewind import Rewinder
from jax_kvcm.manager.rows import RowTable
from jax_kvcm.manager.steps import StepRunner

__all__ = ["KVCacheManager"]

D = CacheLevel.DEVICE


class KVCacheManager:
    """A KV-cache manager (see :mod:`jax_kvcm.manager`): one instance per model; its public
    calls are serialized by one lock.

    ``cold_page_codec`` is consumed whether construction succeeds or fails (default: the
    lossless concat codec). ``device``: where the pools live (default: JAX's first device; give
    ``KVCacheConfig.mesh`` instead to shard them). ``record_events``: keep the latest events in
    :attr:`events` even with no observer (off by default: a serving loop pays nothing for
    them)."""

    def __init__(self, config: KVCacheConfig, cold_page_codec: ColdPageCodec | None = None, *,
                 device: jax.Device | None = None, record_events: bool = False,
                 _hash_fn: Callable[[bytes], bytes] | None = None) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError("config must be a KVCacheConfig")
        self.config = config
        specs = tuple(LayerGroupSpec(g.num_layers, config.tokens_per_page, g.num_kv_heads,
                                     g.head_dim, g.pool_dtype) for g in config.layer_groups)
        #: the tiers (hot pools, host, disk) and every migration between them
        self.storage = StorageManager(
            StorageConfig(layer_groups=specs, device_slots=tuple(config.device_pages),
                          host_bytes=config.host_bytes, disk_dir=config.disk_dir,
                          disk_bytes=config.disk_bytes, arenas=arena_specs(config)),
            cold_page_codec, device=self._placement(config, device))
        #: committed pages by block key
        self.tree = PrefixTree(_hash_fn, len(config.layer_groups))
        self._stats = Stats()
        self._obs = Observers(self._stats, record_events=record_events)
        self._lock = self._obs.lock
        if record_events:
            self.storage.add_observer(self._obs.emit)
        emit = self._obs.emit
        self._rows = RowTable(config)
        self._ledger = StepLedger(self.storage, len(config.layer_groups), self._stats)
        self._rows.phase_of = self._phase
        self._planner = TierPlanner(self.storage, self.tree, self._rows, self._ledger,
                                    self._stats, emit)
        self._ahead = WriteBackAhead(config.offload_ahead_pages, self.storage, self.tree,
                                     self._planner, self._ledger, self._stats, emit)
        self._planner.settle = self._ahead.settle
        self._planner.settling = self._ahead.busy
        arena = (ArenaRoom(config, self.storage, self.tree, self._rows, self._ledger,
                           self._planner) if config.arena_geometries() else None)
        self._planner.arena_room = arena
        self._arena = arena
        self._committer = Committer(self._rows, self.tree, self._ledger, self._stats, emit,
                                    None if arena is None else arena.on_commit)
        self._life = Lifecycle(config, self.storage, self.tree, self._rows, self._ledger,
                               self._planner, self._stats, emit, self._settle, arena)
        self._handoff = Handoff(config, self.storage, self.tree, self._rows, self._planner,
                                self._committer, arena)
        self._rewind = Rewinder(self.storage, self.tree, self._rows, self._ledger,
                                self._planner, self._stats, self._life.drop_hold, arena)
        self._steps = StepRunner(config, self.storage, self._rows, self._ledger, self._planner,
                                 self._committer, self._ahead.after_step, arena)
        self._check = Invariants(self.storage, self.tree, self._rows, self._ledger,
                                 self._planner, lambda: self._ahead.offloads)
        self._shut = False

    # -- small helpers ---------------------------------------------------------------------------

    def _settle(self, block: bool, nodes: list | None) -> None:
        if self._ahead.busy() and self._ledger.in_step is None:
            self._ahead.settle(block, nodes)

    @staticmethod
    def _placement(config: KVCacheConfig, device: jax.Device | None) -> Any:
        """Where the hot pools live: ``config.pool_sharding`` with a mesh, else ``device``."""
        if config.mesh is None:
            return device
        if device is not None:
            raise ValueError("give either device or KVCacheConfig.mesh, not both")
        return config.pool_sharding

    def _check_open(self) -> None:
        if self._shut:
            raise RuntimeError("the KV-cache manager is shut down")

    def _check_seq(self, seq: Sequence, *states: SequenceState) -> None:
        self._check_open()
        if not isinstance(seq, Sequence) or seq._rows is not self._rows:
            raise ValueError(f"{seq!r} is not a sequence of this manager")
        if seq.state not in states:
            raise ValueError(f"{seq!r} is {seq.state.value}, expected one of "
                             f"{[s.value for s in states]}")

    # -- observers -------------------------------------------------------------------------------

    @property
    def events(self) -> Any:
        """The latest events (at most 4096), kept while an observer is registered or
        ``record_events`` is on."""
        return self._obs.events

    @property
    def observer_errors(self) -> Any:
        """``(observer, event, exception)`` of the latest observer calls that raised."""
        return self._obs.errors

    def add_observer(self, fn: Callable[[Any], None]) -> None:
        """``fn(event)`` for every :class:`StorageEvent` and :class:`ManagerEvent`, in order,
        called after the manager call that caused them returned its state to consistency
        (outside the manager's lock: ``fn`` may call the manager). An exception from ``fn`` is
        recorded in :attr:`observer_errors` and warned about, never propagated."""
        with self._lock:
            listening = self._obs.listening
            self._obs.add(fn)
            if not listening:
                self.storage.add_observer(self._obs.emit)

    # -- sequences -------------------------------------------------------------------------------

    @property
    def caches(self) -> list[tuple[Any, Any]]:
        """The hot pools, one ``(k, v)`` per layer group, to pass (donated) into the step that
        ``prepare_step`` prepared; the step's outputs go back through ``complete_step``. Paged
        pools are ``jax.Array``s ``[L, pages + 1, P, Hkv, D]``; an arena's are
        :class:`~jax_kvcm.ArenaPool`s, which the ops take in their place."""
        with self._lock:
            self._check_open()
            return list(self.storage.pools)

    def add_sequence(self, tokens: Any, *, salt: Any = None) -> Sequence:
        """Registers a prompt (``tokens``: 1-D int32 ids); reuses the longest committed prefix
        (at most all but the last token, so the step still produces logits). Lower-tier hits
        are onboarded to the device when the pools are free (not between prepare_step and
        complete_step) and room exists; otherwise the match stops before them."""
        with self._lock:
            self._check_open()
            return self._life.add(tokens, salt)

    def close(self, seq: Sequence) -> None:
        """Releases the sequence; its committed pages stay cached until evicted."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE, SequenceState.SUSPENDED)
            self._life.close(seq)

    def suspend(self, seq: Sequence) -> SuspendResult:
        """Moves the sequence's device pages that only it holds to host (else disk), as one
        transaction. When no tier can take them (even by evicting cached pages there) nothing
        changes and the answer is ``MUST_RECOMPUTE``."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE)
            self._ledger.need_pools("suspend")
            return self._life.suspend(seq)

    def resume(self, seq: Sequence) -> bool:
        """Brings a suspended sequence back to the device byte-identical, as one transaction
        (every device page reserved before anything moves). False when the device cannot take
        it even by evicting every cached page: then nothing changed at all. A failure (e.g.
        :class:`CorruptPageError`: a disk page failed its checksum, or a host page's device ->
        host copy failed) also leaves the sequence suspended exactly as it was (cached pages
        evicted to make room stay evicted); its K/V is lost, so close it and recompute."""
        with self._lock:
            self._check_seq(seq, SequenceState.SUSPENDED)
            self._ledger.need_pools("resume")
            return self._life.resume(seq)

    def record_token_ids(self, seq: Sequence, token_ids: Any) -> None:
        """Appends ids the caller learned late: ``token_ids`` (1-D ints) are the ids of positions
        ``seq.num_known_tokens`` onward (at most ``max_seq_len`` in all). Full pages of them are
        committed now, as if the ids had been given to ``prepare_step``. Raises
        :class:`StepInFlightError` between ``prepare_step`` and ``complete_step``."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE, SequenceState.SUSPENDED)
            if self._ledger.in_step is not None:
                raise StepInFlightError("record_token_ids: a step is in flight: call "
                                        "complete_step first")
            if self._rows.record_ids(seq, token_ids) and self.config.enable_prefix_reuse \
                    and seq.state is SequenceState.ACTIVE:
                self._committer.commit([seq], np.array([seq._row], np.int64))

    def truncate(self, seq: Sequence, num_tokens: int) -> bool:
        """Keeps the first ``num_tokens`` tokens of a sequence and drops the K/V of the rest
        (e.g. rejected draft tokens): pages past the cut are freed (committed ones stay cached
        for other sequences), and a committed page the cut falls in becomes the sequence's own
        (a copy when other sequences share it: a shared page is never written again; for a
        SUSPENDED sequence, at its parked level). False, with nothing changed, when that copy
        finds no page (or its disk write fails). Raises
        :class:`CorruptPageError` (nothing changed) when a suspended sequence's cut page cannot
        be read from the disk, as :meth:`resume` does;
        :class:`StepInFlightError` between ``prepare_step`` and ``complete_step``, ValueError
        for ``num_tokens`` outside ``[0, seq.num_tokens]`` or before a sliding window's
        retained pages. Example: ``mgr.truncate(seq, seq.num_tokens - num_rejected)``."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE, SequenceState.SUSPENDED)
            if self._ledger.in_step is not None:
                raise StepInFlightError("truncate: a step is in flight: call complete_step "
                                        "first")
            return self._rewind.truncate(seq, check_count(num_tokens, "num_tokens", minimum=0))

    def export_sequence(self, seq: Sequence, model_id: str = "") -> SequenceExport:
        """An ACTIVE sequence's K/V as bytes for another manager (disaggregated prefill): its
        token ids, layout and, per layer group, its pages ``uint8 [n, bytes]`` with a CRC-32
        each (see :mod:`jax_kvcm.manager.handoff`). Copies through the host tier (needs
        ``host_bytes``); the sequence is unchanged. Example:
        ``exp = mgr.export_sequence(seq, "llama-8b")``."""
        with self._lock:
            self._check_seq(seq, SequenceState.ACTIVE)
            self._ledger.need_pools("export_sequence")
            return self._handoff.export(seq, model_id)

    def import_sequence(self, export: SequenceExport, model_id: str = "") -> Sequence | None:
        """A new ACTIVE sequence holding ``export``'s K/V, ready to decode (its full pages
        committed, so later prompts reuse them); None when the device has no room. A mismatch
        (model id, page size, layout, codec, a checksum) raises ValueError naming it, and
        nothing changes. Example: ``seq = mgr.import_sequence(exp, "llama-8b")``."""
        with self._lock:
            self._check_open()
            self._ledger.need_pools("import_sequence")
            return self._handoff.import_(export, model_id)

    # -- steps -----------------------------------------------------------------------------------

    def prepare_step(self, work: _Seq[tuple[Sequence, Any]]) -> StepBatch:
        """``work``: ``[(seq, num_new_tokens or new token ids), ...]`` (distinct ACTIVE
        sequences). Allocates pages (evicting cached pages when needed) and returns the padded
        index buffers. Raises :class:`OutOfPagesError` (nothing scheduled) when pages run out."""
        with self._lock:
            self._check_open()
            return self._steps.prepare(work, self._check_seq)

    def complete_step(self, caches: _Seq[tuple[Any, Any]]) -> None:
        """Takes back the pools the step returned (one ``(k, v)`` per layer group, each the shape
        and dtype of :attr:`caches`), records its completion fence and commits pages that became
        full. Refused, with the step still in flight, when an array is not the step's output
        (TypeError), was deleted (the step consumed it and failed), or is one of the pools
        ``prepare_step`` handed out (the step did not run): undo it with :meth:`abort_step`."""
        with self._lock:
            self._check_open()
            self._steps.complete(caches)

    def abort_step(self) -> list[Sequence]:
        """Undoes the prepared step, e.g. after the user's step raised: its sequences go back to
        their lengths and known tokens; the pages it allocated are freed, nothing is committed.
        When the step had consumed the pools (donated, then failed), the device tier's content
        is lost as well (see :meth:`recover_from_failed_step`, whose list of closed sequences is
        returned); an arena's memory outlives its arrays, so then nothing is lost. Otherwise
        ``[]``."""
        with self._lock:
            if self._ledger.in_step is None:
                raise RuntimeError("abort_step without a prepared step")
            self._steps.undo()
            if any(a.is_deleted() for pair in self.storage.pools for a in pair):
                return self._lose_device()
            return []

    def recover_from_failed_step(self) -> list[Sequence]:
        """Discards the device tier after a step failed in a way that lost its pools: undoes the
        step in flight if any, builds fresh pools, drops every committed page on the device and
        closes every sequence that held a device page. Returns those sequences, CLOSED: the
        caller recomputes them. Suspended sequences whose pages are all on the host or disk are
        kept. (An arena's pools are imported again with their content: nothing is lost.)"""
        with self._lock:
            if self._ledger.in_step is not None:
                self._steps.undo()
            return self._lose_device()

    def _lose_device(self) -> list[Sequence]:
        if self._arena is not None and self._arena.recover_pools():
            return []
        return self._life.lose_device()

    # -- views -----------------------------------------------------------------------------------

    def _phase(self, seq: Sequence) -> SequencePhase:
        with self._lock:
            if seq.state is not SequenceState.CLOSED:
                return (SequencePhase.EXECUTING if self._rows.ran(seq._row)
                        else SequencePhase.ADMITTED)
            return (SequencePhase.FINISHED if self._ledger.is_finished(seq)
                    else SequencePhase.FINISHING)

    def state(self, seq: Sequence) -> SequenceView:
        """A snapshot of ``seq`` (any state): see :class:`SequenceView`. Polls the latest step's
        fence without blocking."""
        with self._lock:
            if not isinstance(seq, Sequence) or seq._rows is not self._rows:
                raise ValueError(f"{seq!r} is not a sequence of this manager")
            self._planner.reclaim()
            pending = self._ledger.pending_of(seq.seq_id)
            G = len(self.config.layer_groups)
            if seq.state is SequenceState.CLOSED:
                retained, num_tokens = ((0, 0),) * G, 0
            else:
                r = seq._row
                retained = tuple((int(w), self._rows.num_pages(r))
                                 for w in self._rows.row_wrel(r))
                num_tokens = self._rows.num_tokens(r)
        return SequenceView(seq.seq_id, seq.state, self._phase(seq), num_tokens, retained,
                            tuple(int(w) for w in self._rows.widths),
                            tuple(int(p) for p in pending))

    def compact(self, old_to_new: Any) -> np.ndarray:
        """Moves sequences between table rows, e.g. to keep a runner's batch dense:
        ``old_to_new[r]`` is the new row of the sequence at row ``r`` (:attr:`Sequence.row`);
        rows beyond ``len(old_to_new)`` or marked ``-1`` must hold no sequence; targets are
        distinct and >= 0. Returns ``new_to_old`` (int32, -1 for empty rows) for the runner to
        gather its own per-row state the same way. Not while a step is in flight."""
        with self._lock:
            self._check_open()
            self._ledger.need_pools("compact")
            out, src, dst = self._rows.compact(old_to_new)
            if self._arena is not None:
                self._arena.move_rows(src, dst)
            return out

    def private_pages_per_sequence(self) -> tuple[int, ...]:
        """Per layer group, the most device pages one sequence holds at once: the table width
        of a full group; a window group's peak ``ceil((W + C - 2) / P) + 1``."""
        return tuple(int(p) for p in self.config.peak_pages(self.config.max_seq_len))

    def free_page_count(self) -> tuple[int, ...]:
        """Per layer group, device pages allocatable right now without evicting or waiting."""
        with self._lock:
            self._planner.reclaim()
            return tuple(int(self.storage.num_free(D, g))
                         for g in range(len(self.config.layer_groups)))

    def shutdown(self) -> None:
        """Ends the manager: waits for every dispatched step and migration, returns every
        pending page, then closes the storage (disk files removed, host and pinned memory and
        arena reservations freed). Later calls raise RuntimeError; a second ``shutdown`` does
        nothing. Raises :class:`StepInFlightError` while a step is prepared."""
        with self._lock:
            if self._shut:
                return
            self._ledger.need_pools("shutdown")
            self._ledger.wait_all()
            for arr in [a for pair in self.storage.pools for a in pair]:
                try:
                    if not arr.is_deleted():
                        arr.block_until_ready()
                except Exception:  # noqa: BLE001 - a failed step's output: nothing to wait for
                    pass
            self._ahead.settle(True, None)
            self._planner.reclaim()
            self._shut = True
            self.storage.close()

    # -- planning and stats ----------------------------------------------------------------------

    @property
    def device_capacity_pages(self) -> int:
        """The smallest layer group's device page budget."""
        return min(self.config.device_pages)

    def num_obtainable_pages(self, level: CacheLevel = CacheLevel.DEVICE) -> int:
        """Pages an allocation at ``level`` could get now without touching referenced ones:
        free + pending frees + cached (evictable) pages in the tightest pool of the level (an
        arena's free pages include its unmapped budget and its parked ranges' free slots), in
        constant time (``stats`` walks the prefix tree)."""
        with self._lock:
            level = CacheLevel(level)
            if level not in self._planner.levels:
                raise ValueError(f"level {level.name} is not configured")
            return self._planner.obtainable(level)

    def max_num_sequences(self, seq_len: int) -> int:
        """How many sequences of ``seq_len`` tokens fit on the device at once (0 when one does
        not fit; clamped to ``max_seq_len``; an arena also counts its ranges and chunks)."""
        n = self.config.max_num_sequences(seq_len)
        return n if self._arena is None else min(n, self._arena.max_num_sequences(seq_len))

    def max_seq_len_for(self, num_sequences: int) -> int:
        """The largest length (whole pages, at most ``max_seq_len``) such that
        ``num_sequences`` sequences fit on the device at once; 0 when not even one page each."""
        n = check_count(num_sequences, "num_sequences", minimum=1)
        cfg, out = self.config, self.config.max_seq_len
        for g, pages in enumerate(cfg.device_pages):
            each = pages // n
            if cfg.peak_pages(out)[g] > each:  # NOTE: a window's bound only grows with n
                out = min(out, each * cfg.tokens_per_page)
        return out if self._arena is None else min(out, self._arena.max_seq_len_for(n))

    def stats(self) -> dict[str, Any]:
        """Counters, and ``pages[level]``: ``capacity == free + pending + referenced + cached``
        summed over the level's pools (``pages_per_pool[level]``: one dict per pool, with its
        ``layer_groups``; ``referenced`` is what the identity leaves, so a call costs O(pools),
        not O(pages): ``check_invariants`` counts it page by page); ``arena``: the arena's
        counters (map/unmap calls, physical bytes, adoptions, ...) when there is one."""
        with self._lock:
            out = dataclasses.asdict(self._stats)
            if self._rows.win:
                out["num_window_released_pages"] = self._rows.win.num_released
            out["num_active"] = len(self._rows.active())
            out["num_suspended_now"] = len(self._rows.seqs) - out["num_active"]
            out["num_committed_now"] = len(self.tree)
            out["disk_degraded"] = self._planner.disk_degraded
            per_pool = {lv.name.lower(): self._check.page_counts(lv, census=False)
                        for lv in self._planner.levels}
            out["pages"] = {lv: {k: sum(c[k] for c in pools) for k in COUNT_KEYS}
                            for lv, pools in per_pool.items()}
            out["pages_per_pool"] = per_pool
            out["storage"] = self.storage.stats()
            cfg = self.config
            out["per_device"] = dict(num_shards=cfg.num_shards,
                                     page_bytes=list(cfg.device_page_bytes()),
                                     pool_bytes=cfg.device_pool_bytes())
            if self._arena is not None:
                out["arena"] = self._arena.stats()
            return out

    def check_invariants(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent (tests call this)."""
        with self._lock:
            self._check.check()
            if self._arena is not None:
                self._arena.check()
