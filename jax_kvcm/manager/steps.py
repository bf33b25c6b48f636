"""Steps: ``prepare_step`` -> the user's jitted step -> ``complete_step``, or ``abort_step``.

``prepare_step`` validates the work (nothing changes on a bad item), allocates the pages the new
tokens need (evicting cached pages when needed; a refusal raises :class:`OutOfPagesError` with
nothing changed), stores the token ids given, and gathers the :class:`StepBatch`.
``complete_step`` takes back the pools the step returned, records its fence, commits pages that
became full and releases the pages sliding windows left. ``abort_step`` undoes a prepared step.
"""

from __future__ import annotations

from collections.abc import Sequence as _Seq
from typing import Any

import jax
import numpy as np

from jax_kvcm._step_batch import StepBatch
from jax_kvcm._types import CacheLevel
from jax_kvcm.manager.api import OutOfPagesError, Sequence, SequenceState, StepInFlightError
from jax_kvcm.manager.committer import Committer
from jax_kvcm.manager.ledger import StepLedger
from jax_kvcm.manager.planner import TierPlanner
from jax_kvcm.manager.rows import MAX_TOKEN_ID, RowTable, check_token_ids

__all__ = ["StepRunner"]

D = CacheLevel.DEVICE


class StepRunner:
    """See the module docstring. ``after_step()``: write-back ahead (or a no-op)."""

    def __init__(self, config: Any, storage: Any, rows: RowTable, ledger: StepLedger,
                 planner: TierPlanner, committer: Committer, after_step: Any,
                 arena_room: Any = None) -> None:
        self._config = config
        self._storage = storage
        self._rows = rows
        self._ledger = ledger
        self._planner = planner
        self._committer = committer
        self._after_step = after_step
        self._arena = arena_room

    # -- prepare ---------------------------------------------------------------------------------

    def parse_work(self, work: _Seq[tuple[Sequence, Any]], check_seq: Any) -> tuple[
            list[Sequence], np.ndarray, np.ndarray, list[int], list[np.ndarray], Any]:
        """``prepare_step``'s ``work`` validated (nothing changes): its sequences, their rows
        and new-token counts, and the items given as token ids (their indices, the arrays and
        all of them concatenated)."""
        cfg = self._config
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
            if type(seq) is not Sequence or seq.state is not active or seq._rows is not self._rows:
                if not isinstance(seq, Sequence):
                    raise TypeError(f"work[{i}][0] must be a Sequence, got "
                                    f"{type(seq).__name__}")
                check_seq(seq, SequenceState.ACTIVE)
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
                    check_token_ids(arr, f"work[{i}][1]")
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

    def prepare(self, work: _Seq[tuple[Sequence, Any]], check_seq: Any) -> StepBatch:
        cfg, tpp, rows = self._config, self._rows.tpp, self._rows
        if self._ledger.in_step is not None:
            raise StepInFlightError("a step is in flight: call complete_step first")
        seqs, row_ids, counts, id_index, id_arrays, every = self.parse_work(work, check_seq)
        if rows.win:
            rows.win.check_chunks(counts)
        cur = rows.length[row_ids]
        new_len = cur + counts
        if new_len.max() > cfg.max_seq_len:
            raise ValueError(f"a sequence would exceed max_seq_len {cfg.max_seq_len}")
        ids = rows.check_ids(row_ids, counts, cur, id_index, id_arrays, every)
        npages = rows.npages[row_ids]
        need = -(-new_len // tpp) - npages
        total = int(need.sum())
        if total:
            rep = np.repeat(row_ids, need)
            off = np.arange(total) - np.repeat(np.cumsum(need) - need - npages, need)
            at = snap = None
            if self._arena is not None:
                grow = [s for s, n in zip(seqs, need.tolist()) if n]
                # NOTE: a refused step changes nothing: the bindings are put back, and the
                # cached pages in the way of new ones are evicted only once the room is planned
                evict: list = []
                if not all(self._arena.bound(s) for s in grow):
                    snap = self._arena.snapshot()
                if snap is not None and not self._arena.bind_all(grow, evict):
                    self._arena.restore(snap)
                    raise OutOfPagesError(f"{len(grow)} sequences need arena ranges: every "
                                          "range is held")
                at = self._arena.place_rows(rep, off)
                if evict:
                    if not self._planner.plan_device(
                            np.full(rows.num_groups, total, np.int64), at,
                            {int(n.slots[int(self._arena.groups[0])]) for n in evict}):
                        self._arena.restore(snap)
                        raise OutOfPagesError(f"{total} device pages needed: evicting every "
                                              "cached page would not do")
                    self._arena.evict_in_the_way(evict)
            slots = self._planner.allocate_device(total, at)
            if slots is None:
                if snap is not None:
                    self._arena.restore(snap)
                raise OutOfPagesError(f"{total} device pages needed, "
                                      f"{self._planner.num_free(D)} free: evicting every cached "
                                      "page would not do")
            rows.set_slots(rep, off, slots)
        rows.store_ids(ids, new_len)
        rows.advance(row_ids, npages + need, new_len)
        batch = rows.gather(row_ids, counts, cur, new_len)
        rows.mark_ran(row_ids)
        self._ledger.begin((seqs, row_ids, npages, cur, ids[0]), list(self._storage.pools))
        return batch

    # -- complete --------------------------------------------------------------------------------

    def complete(self, caches: _Seq[tuple[Any, Any]]) -> None:
        if self._ledger.in_step is None:
            raise RuntimeError("complete_step without a prepared step")
        caches = self._check_caches(caches)
        self._storage.pools = caches
        seqs, row_ids = self._ledger.complete(caches[0][0])[:2]
        if self._config.enable_prefix_reuse:
            self._committer.commit(seqs, row_ids)
        rows = self._rows
        if rows.win:
            live = np.fromiter((s.state is SequenceState.ACTIVE for s in seqs), bool, len(seqs))
            if not live.all():  # NOTE: a row closed in the step may hold a new sequence
                seqs = [s for s, ok in zip(seqs, live) if ok]
                row_ids = row_ids[live]
            rows.win.advance(seqs, row_ids, rows.length, rows.ncommit, self._ledger.defer_free,
                             rows.seq_ids)
        if self._arena is not None:
            self._arena.after_step(seqs)
        if self._config.offload_ahead_pages:
            self._storage.check_pools_in_place()
            self._after_step()

    def _check_caches(self, caches: Any) -> list[tuple[Any, Any]]:
        """``caches`` validated for :meth:`complete` (see ``KVCacheManager.complete_step``)."""
        if isinstance(caches, jax.Array) or not isinstance(caches, (list, tuple)):
            raise TypeError(f"caches must be a list of (k, v) pairs, got {type(caches).__name__}")
        pools = self._storage.pools
        if len(caches) != len(pools):
            raise ValueError(f"caches must hold {len(pools)} (k, v) pairs, got {len(caches)}")
        sharding = self._config.pool_sharding
        out = []
        for h, pair in enumerate(caches):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"caches[{h}] must be a (k, v) pair, got {type(pair).__name__}")
            for i, (a, b, handed) in enumerate(zip(pair, pools[h], self._ledger.handed[h])):
                name = f"caches[{h}][{i}]"
                if isinstance(b, jax.Array) and not isinstance(a, jax.Array):
                    raise TypeError(f"{name} must be a jax.Array (the step's output), got "
                                    f"{type(a).__name__}")
                if not isinstance(b, jax.Array) and type(a) is not type(b):
                    raise TypeError(f"{name} must be a {type(b).__name__} (as manager.caches), "
                                    f"got {type(a).__name__}")
                if a.shape != b.shape or a.dtype != b.dtype:
                    raise ValueError(f"{name} has shape {a.shape} {a.dtype}, expected "
                                     f"{b.shape} {b.dtype}")
                if a.is_deleted():
                    raise ValueError(f"{name} was deleted (a step that consumed the pools "
                                     "failed?): call abort_step()")
                if a is handed:
                    raise ValueError(f"{name} is the pool prepare_step handed out, not the "
                                     "step's output (did the step fail?): call abort_step()")
                if sharding is not None and not a.sharding.is_equivalent_to(sharding, a.ndim):
                    raise ValueError(f"{name} is placed as {a.sharding}, expected the pools' "
                                     f"{sharding} (KV heads split over mesh axis "
                                     f"{self._config.mesh_axis!r})")
            out.append((pair[0], pair[1]))
        if self._arena is not None:
            self._arena.check_returned(out)
        return out

    # -- abort -----------------------------------------------------------------------------------

    def undo(self) -> None:
        """Undoes the prepared step: its sequences go back to their length and known tokens;
        the pages it allocated are freed (no step ever wrote them)."""
        seqs, row_ids, npages, length, known = self._ledger.abort()
        rows = self._rows
        for i, seq in enumerate(seqs):
            if seq.state is not SequenceState.ACTIVE:  # closed during the step: pages pending
                continue
            r = int(row_ids[i])
            first, last = int(npages[i]), rows.num_pages(r)
            new = rows.row_pages(r, first, last)
            for g in range(rows.num_groups):
                self._storage.free(D, g, new[g][new[g] > 0])
            j = np.arange(first, last)
            # NOTE: a ring entry a new page took was empty before
            rows.set_slots(np.full(j.size, r), j, np.zeros((rows.num_groups, j.size), np.int32))
            rows.restore(r, int(npages[i]), int(length[i]), int(known[i]))
