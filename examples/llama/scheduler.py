"""The serving loop's scheduler: :class:`Server` admits requests, plans and dispatches each step,
preempts under page pressure, reads sampled tokens one step late and recovers from failed steps
(the loop is described in ``examples/llama/serve.py``)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from typing import Any, Sequence

import jax
import numpy as np

from jax_kvcm import CacheLevel, KVCacheManager, OutOfPagesError, SuspendResult
from jax_kvcm import CorruptPageError, SequenceState, cascade_group_size

from . import model as llama
from . import tp as tensor_parallel
from .admission import PromptsInFlight
from .serve_types import (CODECS, Request, RequestOutput, RequestState, ServeConfig, StepRecord,
                          checked_prompt, kv_cache_config, kv_report)
from .step import (Dispatched, compile_steps, model_caches, model_step_with, program_key,
                   step_inputs, step_kv_config, step_shapes, step_xla_options)

__all__ = ["Server"]

D = CacheLevel.DEVICE


class Server:
    """Continuous-batching generation over one :class:`KVCacheManager` (see the module doc)."""

    def __init__(self, params: Any, config: llama.LlamaConfig, serve: ServeConfig | None = None):
        self.params, self.config = params, config
        serve = serve or ServeConfig()
        self.serve = serve = dataclasses.replace(  # xla_options None: the weights' defaults
            serve, xla_options=step_xla_options(serve.xla_options, params))
        if serve.disk_dir:
            os.makedirs(serve.disk_dir, exist_ok=True)
        # Tensor parallelism: weights split Megatron-style, pools split over KV heads (with
        # Hkv < N each KV head replicated up to N); see examples/llama/tp.py.
        self.mesh = None
        num_kv_heads = config.num_key_value_heads
        if serve.tensor_parallel > 1:
            self.mesh = tensor_parallel.make_mesh(serve.tensor_parallel)
            num_kv_heads = tensor_parallel.kv_heads(config, serve.tensor_parallel)
            self.params = params = tensor_parallel.shard_params(params, config, self.mesh)
        self.kv_config = step_kv_config(kv_cache_config(serve, config, num_kv_heads, self.mesh),
                                        params)
        self.manager = KVCacheManager(self.kv_config, CODECS[serve.cold_codec]())
        self.manager.add_observer(self._on_event)
        rings = tuple(w if g.sliding_window else 0 for g, w in
                      zip(self.kv_config.layer_groups, self.kv_config.table_widths))
        # ServeConfig.cascade: (page size, members a group) for step_inputs' plan_cascade.
        self._cascade = None
        if serve.cascade:
            if len(self.kv_config.layer_groups) != 1 or any(rings):
                raise ValueError("cascade needs one KV group of full attention (this model has "
                                 "sliding-window layers)")
            if serve.hot_backend != "paged" and jax.default_backend() != "gpu":
                raise ValueError("cascade on the arena needs the CUDA arena (the CPU arena's "
                                 "pools are read by address, without a log-sum-exp output)")
            self._cascade = (serve.page_size, cascade_group_size(
                config.num_attention_heads, config.num_key_value_heads,
                kv_dtype=self.manager.caches[0][0].dtype))
        # NOTE: the device step; a test seam (a fault hook wraps it from outside the class).
        self._step_statics = dict(config=config, rings=rings, mesh=self.mesh)
        self._model_step = functools.partial(model_step_with(serve.xla_options),
                                             **self._step_statics)
        self._waiting: collections.deque[RequestState] = collections.deque()
        self._running: list[RequestState] = []
        self._suspended: collections.deque[RequestState] = collections.deque()
        # reached max_new_tokens, last token unread (sequence closed unless Request.keep_sequence)
        self._closing: list[RequestState] = []
        self._done: dict[int, RequestOutput] = {}
        self._next_id = 0
        self._order = 0
        self._shapes: set[tuple] = set()
        self.counters = collections.Counter()
        self._busy_s = 0.0
        self._steady_s = 0.0               # time in steps that compiled nothing
        # NOTE: committed to the pools' device like every later step output (else the first
        # step compiles once more for an uncommitted argument); rows: the largest batch bucket.
        self._prev_tokens = jax.device_put(
            np.zeros((self.kv_config.batch_buckets[-1],), np.int32),
            self.manager.caches[0][0].sharding if self.mesh is None
            else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        self._inflight: Dispatched | None = None
        self._num_dispatched = 0
        self._token_cursor: dict[int, int] = {}   # new_tokens(): generated tokens handed out
        self._cursor_next_id = 0                  # new_tokens(): ids below this are tracked
        # ServeConfig.record_steps: one StepRecord per dispatched step (the caller may clear it).
        self.step_records: list[StepRecord] | None = [] if serve.record_steps else None

    # -- events ------------------------------------------------------------------------------

    def _on_event(self, ev: Any) -> None:
        if getattr(ev, "kind", None) != "migrated" or ev.layer_group != 0:
            return
        n = int(np.asarray(ev.slots).size)
        if ev.level is D:
            self.counters["pages_onboarded"] += n
        elif ev.src_level is D:
            self.counters["pages_offloaded"] += n
            self.counters[f"pages_offloaded_to_{ev.level.name.lower()}"] += n
        else:
            self.counters["pages_host_to_disk"] += n

    # -- requests ----------------------------------------------------------------------------

    def submit(self, request: Request) -> int:
        prompt = checked_prompt(request, self.config.vocab_size,
                                self.serve.max_seq_len, self.manager)
        rid = self._next_id
        self._next_id += 1
        self._waiting.append(RequestState(rid, request, prompt, self._eos(request),
                                  list(prompt), submitted_at=time.perf_counter()))
        return rid

    def submit_prefilled(self, request: Request, sequence: Any, first_token: int) -> int:
        """Admits a request another engine prefilled: ``sequence`` (this manager's, e.g. from
        ``import_sequence``) holds the prompt's K/V, ``first_token`` is the token sampled after
        it; the loop decodes the rest and closes the sequence when the request ends. It goes
        ahead of the waiting requests (its pages are here already) as soon as the batch has
        room. ValueError, the sequence untouched, for a bad request, a sequence that is not the
        prompt's, or a first token that ends the request (nothing left to decode)."""
        prompt = checked_prompt(request, self.config.vocab_size,
                                self.serve.max_seq_len, self.manager)
        eos, first = self._eos(request), int(first_token)
        if first in eos or request.max_new_tokens < 2:
            raise ValueError("the first token ends the request: nothing left to decode")
        if not 0 <= first < self.config.vocab_size:
            raise ValueError(f"first token {first} out of range [0, {self.config.vocab_size})")
        if sequence.num_tokens != len(prompt):
            raise ValueError(f"the prefilled sequence holds {sequence.num_tokens} tokens, the "
                             f"prompt has {len(prompt)}")
        rid = self._next_id
        self._next_id += 1
        r = RequestState(rid, request, prompt, eos, prompt + [first], seq=sequence,
                         first_admit=False, submitted_at=time.perf_counter())
        r.token_times.append(0.0)           # the first token came with the submission
        self._waiting.appendleft(r)
        self.counters["prefilled_requests"] += 1
        return rid

    def _eos(self, request: Request) -> frozenset[int]:
        eos = (self.config.eos_token_ids if request.eos_token_ids is None
               else request.eos_token_ids)
        return frozenset(int(e) for e in eos)

    @property
    def num_running(self) -> int:
        """Requests admitted and not finished (their sequences on the device)."""
        return len(self._running) + len(self._closing)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._suspended or self._closing
                    or self._inflight is not None)

    def generate(self, requests: Sequence[Request]) -> list[RequestOutput]:
        """Submits ``requests``, runs until all finish, returns their outputs in order."""
        ids = [self.submit(r) for r in requests]
        while self.has_work():
            self.step()
        return [self._done[i] for i in ids]

    def precompile(self, sampling: bool = False, progress: bool = False) -> int:
        """Compiles the device step for every (kind, batch bucket, token bucket) a step can take
        (:func:`step.step_shapes`): the greedy programs (every step whose rows sample nothing)
        and, with ``sampling``, those with sampling inputs too, so that serving compiles nothing
        more. Nothing runs on the device. Returns the number of programs."""
        shapes = step_shapes(self.kv_config, self.serve.paged_decode)
        for greedy in (True, False)[:1 + sampling]:
            compile_steps(model_step_with(self.serve.xla_options), self._step_statics,
                          self.params, model_caches(self.manager.caches), self._prev_tokens,
                          self.kv_config, shapes, greedy=greedy,
                          with_logits=self.serve.record_logits, cascade=self._cascade,
                          progress=progress)
            self._shapes |= {program_key(d, b, t, greedy) for d, b, t in shapes}
        return len(shapes) * (1 + sampling)

    # -- capacity ----------------------------------------------------------------------------

    def _device_room(self) -> int:
        """Device pages obtainable now (free + pending frees + evictable cached), less one page
        of growth headroom per running sequence."""
        return self.manager.num_obtainable_pages(D) - len(self._running)

    def _pages(self, n_tokens: int) -> int:
        return -(-n_tokens // self.serve.page_size)

    def _schedule(self, finished: list[RequestOutput]) -> None:
        """Resumes suspended sequences (oldest first), then admits waiting requests."""
        mb = self.serve.max_batch
        while self._suspended and len(self._running) < mb:
            r = self._suspended[0]
            if self._pages(len(r.tokens)) + 1 > self._device_room() and self._running:
                return  # no room yet; do not admit newer requests ahead of it either
            try:
                resumed = self.manager.resume(r.seq)
            except (CorruptPageError, OSError):   # a parked page is lost: recompute
                self._suspended.popleft()
                self._drop_for_recompute(r)
                continue
            if not resumed:
                if self._running:
                    return
                self._drop_for_recompute(r)   # nothing runs and it still cannot come back
                self._suspended.popleft()
                continue
            self._suspended.popleft()
            self.counters["resumes"] += 1
            self._running.append(r)
        deferred: list[RequestState] = []
        try:
            self._admit(finished, deferred)
        finally:   # deferred requests keep their place at the head of the queue
            self._waiting.extendleft(reversed(deferred))

    def _admit(self, finished: list[RequestOutput], deferred: list[RequestState]) -> None:
        """Admits waiting requests, in order, while the batch and the device have room; a
        request whose prompt prefix another running request is still writing waits in
        ``deferred`` (``ServeConfig.defer_shared_prompts``; at most ``max_batch`` a round, so
        a long queue is not scanned to its end)."""
        mb = self.serve.max_batch
        if not self._waiting or len(self._running) >= mb:
            return   # nothing to admit: no per-step scan of the running requests
        # ServeConfig.defer_shared_prompts: prompts being written that a waiting one may share
        in_flight = (PromptsInFlight(self.serve.page_size, self._running)
                     if self.serve.defer_shared_prompts and self.serve.enable_prefix_reuse
                     else None)
        while self._waiting and len(self._running) < mb and len(deferred) < mb:
            r = self._waiting[0]
            if r.seq is not None:       # prefilled elsewhere (submit_prefilled): pages here
                self._waiting.popleft()
                self._order += 1
                r.order = self._order
                self._running.append(r)
                continue
            if self._running and self._pages(len(r.tokens) + 1) > self._device_room():
                return
            if in_flight is not None and in_flight.shares_uncomputed_prefix(r):
                deferred.append(self._waiting.popleft())
                self.counters["deferred_admissions"] += 1
                continue
            self._waiting.popleft()
            try:
                r.seq = self.manager.add_sequence(np.asarray(r.tokens, np.int32))
            except (CorruptPageError, OSError) as e:   # its prefix hit could not be onboarded
                finished.append(self._fail(r, e))
                continue
            hit = r.seq.num_reused_tokens
            if r.first_admit:
                r.first_admit = False
                r.prefix_hit_tokens = hit
                self.counters["prompt_tokens"] += len(r.prompt)
                self.counters["prefix_hit_tokens"] += hit
            else:
                self.counters["recompute_hit_tokens"] += hit
            self._order += 1
            r.order = self._order
            self._running.append(r)
            if in_flight is not None:
                in_flight.note(r)

    def _drop_for_recompute(self, r: RequestState) -> None:
        self._close_seq(r)
        r.num_recomputes += 1
        self.counters["recomputes"] += 1
        self._waiting.appendleft(r)

    def _preempt(self, r: RequestState) -> None:
        self._running.remove(r)
        try:
            res = self.manager.suspend(r.seq)
        except (CorruptPageError, OSError):
            res = SuspendResult.MUST_RECOMPUTE
        if res is SuspendResult.SUSPENDED:
            r.num_suspends += 1
            self.counters["suspends"] += 1
            self._suspended.append(r)
        else:
            self._drop_for_recompute(r)

    # -- one step ----------------------------------------------------------------------------

    def _plan(self) -> list[tuple[RequestState, int]]:
        work: list[tuple[RequestState, int]] = []
        budget = self.serve.max_tokens_per_step
        lefts = [len(r.tokens) + r.unread - r.seq.num_tokens for r in self._running]
        for r, left in zip(self._running, lefts):   # decoding sequences first: one token each
            if left == 1:
                work.append((r, 1))
                budget -= 1
        chunk = min(budget, self.serve.prefill_chunk_tokens)
        for r, left in zip(self._running, lefts):
            if left > 1 and chunk > 0:
                n = min(left, chunk)
                work.append((r, n))
                chunk -= n
        return work

    def _prepare(self, finished: list[RequestOutput]):
        """Plans the step and has the manager prepare it; under page pressure reads what is
        outstanding (finished sequences free pages), then preempts. ``(work, batch)``, or
        ``None`` when nothing can run now."""
        while True:
            if any(r.unread and r.last_step != self._num_dispatched for r in self._running):
                finished += self._drain()  # pragma: no cover  (a token to feed is not at hand)
            work = self._plan()
            if not work:
                return None
            items = []
            for r, n in work:
                nt = r.seq.num_tokens
                # NOTE: an unread token is fed from the device; prepare_step gets a count.
                if r.unread:
                    items.append((r.seq, 1))
                    continue
                if r.seq.num_known_tokens < nt:
                    self._record_ids(r)    # ids given now must follow the known ones
                items.append((r.seq, np.array(r.tokens[nt:nt + n], np.int32)))
            try:
                return work, self.manager.prepare_step(items)
            except OutOfPagesError:
                if self._inflight is not None:
                    finished += self._drain()
                elif len(self._running) > 1:
                    self._preempt(max(self._running, key=lambda r: r.order))
                elif self._suspended:       # their shared pages pin the device: recompute one
                    victim = self._suspended.pop()
                    self._drop_for_recompute(victim)
                else:
                    raise

    def step(self) -> list[RequestOutput]:
        """Schedules and dispatches one model step; returns the requests that finished (with
        ``overlap``, those whose last token the previous step produced)."""
        t0 = time.perf_counter()
        finished: list[RequestOutput] = []
        self._schedule(finished)
        n_shapes, n_gen = len(self._shapes), self.counters["generated_tokens"]
        prepared = self._prepare(finished) if self._running else None
        if prepared is None:
            if self._inflight is not None:
                finished += self._drain()
            elif (self._suspended or self._waiting) and not finished:
                raise RuntimeError("no sequence can run: the device cannot hold any request")
            return finished
        work, batch = prepared
        try:
            new = self._dispatch(work, batch, t0)
        except Exception as e:  # noqa: BLE001  (a failed step: its requests retry or fail)
            finished += self._step_failed(work, e)
            return finished
        prev, self._inflight = self._inflight, new
        if prev is not None:
            finished += self._read(prev)
        if not self.serve.overlap:
            finished += self._drain()
        for r, _ in new.rows:      # done by length: nothing to read first (EOS may come late)
            if r.finish_reason is None and r.seq is not None and (
                    r.num_generated >= r.req.max_new_tokens):
                if not r.req.keep_sequence:
                    self._close_seq(r)
                self._running.remove(r)
                self._closing.append(r)
        dt = time.perf_counter() - t0
        if new.record is not None:
            new.record.t_end = t0 + dt
        self._busy_s += dt
        if len(self._shapes) == n_shapes:   # compiled nothing
            self._steady_s += dt
            self.counters["steady_generated_tokens"] += self.counters["generated_tokens"] - n_gen
        return finished

    def _dispatch(self, work, batch, t_start: float = 0.0) -> Dispatched:
        """Builds the host inputs, dispatches the device step (nothing waits for it) and hands
        the pools back to the manager. ``t_start``: when the step began (StepRecord)."""
        inputs = step_inputs(work, batch, self.serve.paged_decode, self._cascade)
        decode, greedy, due, rows = inputs.decode, inputs.greedy, inputs.due, inputs.rows
        Bb, Tb = batch.seq_lens.shape[0], batch.positions.shape[0]
        T = sum(n for _, n in work)
        with_logits = self.serve.record_logits
        shape = program_key(decode, Bb, Tb, greedy)
        new_program = shape not in self._shapes
        self._shapes.add(shape)
        k, v = model_caches(self.manager.caches)
        tokens, logits, k, v = self._model_step(
            self.params, k, v, self._prev_tokens, inputs.gather, inputs.host_tokens, batch,
            inputs.sampling, decode=decode, greedy=greedy, with_logits=with_logits,
            # NOTE: only when planned: the seam's wrappers (multihost.publish) take the rest.
            **({} if inputs.cascade is None else {"cascade": inputs.cascade}))
        self.manager.complete_step(list(zip(k, v)) if isinstance(k, tuple) else [(k, v)])
        tokens.copy_to_host_async()
        if logits is not None:
            logits.copy_to_host_async()
        self._prev_tokens = tokens
        self._num_dispatched += 1
        self.counters["decode_steps" if decode else "mixed_steps"] += 1
        if decode:
            self.counters["decode_kv_tokens"] += int(np.asarray(batch.seq_lens).sum())
        if inputs.cascade is not None:
            self.counters["cascade_grouped_rows"] += int((inputs.cascade.member_slot >= 0).sum())
            self.counters["cascade_tokens_saved"] += inputs.cascade.tokens_saved
        self.counters["steps"] += 1
        self.counters["step_tokens"] += T
        for r, _ in work:
            r.step_failures = 0
        for b, r in zip(due, rows):
            r.unread += 1
            r.last_row, r.last_step = b, self._num_dispatched
        record = None
        if self.step_records is not None:
            record = self._step_record(work, shape, new_program, t_start)
        return Dispatched(self._num_dispatched, tokens, logits, list(zip(rows, due)), record)

    def _step_record(self, work, shape, new_program: bool, t_start: float) -> StepRecord:
        """The StepRecord of the step just dispatched (``ServeConfig.record_steps``)."""
        n_dec = sum(1 for _, n in work if n == 1)
        kind = "decode" if n_dec == len(work) else "mixed" if n_dec else "prefill"
        left = [r.req.max_new_tokens - r.num_generated for r in self._running]
        rec = StepRecord(self._num_dispatched, kind, shape[0], len(work), n_dec,
                         sum(n for _, n in work), shape[1], shape[2], len(self._waiting),
                         len(self._running) + len(self._closing), min(left, default=0),
                         new_program, t_start, time.perf_counter())
        self.step_records.append(rec)
        return rec

    def _record_ids(self, r: RequestState) -> None:
        """Tells the manager the read ids it has not got yet (tokens fed to steps as counts),
        so the pages they fill can be committed to the prefix tree."""
        seq = r.seq
        if seq is None or seq.state is not SequenceState.ACTIVE:
            return
        known = seq.num_known_tokens
        if known < len(r.tokens):
            self.manager.record_token_ids(seq, np.asarray(r.tokens[known:], np.int32))

    def _drain(self) -> list[RequestOutput]:
        """Reads the outstanding step's tokens (blocks until it completed)."""
        prev, self._inflight = self._inflight, None
        return self._read(prev) if prev is not None else []

    def _read(self, d: Dispatched) -> list[RequestOutput]:
        """The host side of a dispatched step's tokens: append, record, EOS/length checks."""
        t_read = time.perf_counter()
        toks = np.asarray(d.tokens).tolist()
        host_logits = np.asarray(d.logits) if d.logits is not None else None
        now = time.perf_counter()
        if d.record is not None:
            d.record.t_ready, d.record.wait_s = now, now - t_read
        finished: list[RequestOutput] = []
        for r, b in d.rows:
            if r.finish_reason is not None:     # EOS came first: a token past the end
                self.counters["dropped_tokens"] += 1
                continue
            if r.unread == 0:                   # pragma: no cover  (requeued after a failure)
                continue
            tok = toks[b]
            r.unread -= 1
            if len(r.tokens) == len(r.prompt):
                r.ttft = now - r.submitted_at
            r.tokens.append(tok)
            if len(r.tokens) % self.serve.page_size == 0:
                self._record_ids(r)     # a page of ids complete: it can be committed now
            r.token_times.append(now - r.submitted_at)
            self.counters["generated_tokens"] += 1
            if host_logits is not None:
                r.logits.append(host_logits[b])
            if tok in r.eos or len(r.tokens) - len(r.prompt) >= r.req.max_new_tokens:
                r.finish_reason = "eos" if tok in r.eos else "length"
                finished.append(self._finish(r))
        return finished

    def _close_seq(self, r: RequestState) -> None:
        if r.seq is not None and r.seq.state is not SequenceState.CLOSED:
            self.manager.close(r.seq)
        r.seq = None

    def _finish(self, r: RequestState) -> RequestOutput:
        kept = None
        if r.req.keep_sequence and r.seq is not None and r.seq.state is SequenceState.ACTIVE:
            kept, r.seq = r.seq, None          # handed to the caller, who closes it
        self._close_seq(r)
        for queue in (self._running, self._closing, self._waiting, self._suspended):
            if r in queue:
                queue.remove(r)
        out = self._output(r)
        out.sequence = kept
        self._done[r.rid] = out
        return out

    def _output(self, r: RequestState) -> RequestOutput:
        return RequestOutput(r.rid, r.prompt, r.generated, r.finish_reason, r.prefix_hit_tokens,
                             r.num_suspends, r.num_recomputes, r.ttft,
                             np.stack(r.logits) if self.serve.record_logits and r.logits
                             else None, list(r.token_times), r.error)

    def _fail(self, r: RequestState, e: BaseException) -> RequestOutput:
        self.counters["failed_requests"] += 1
        r.finish_reason, r.error = "error", f"{type(e).__name__}: {e}"[:500]
        return self._finish(r)

    def _step_failed(self, work, e: BaseException) -> list[RequestOutput]:
        """The step raised before it was handed back: undo it in the manager, read what the
        previous step produced, then retry, recompute or fail the step's requests."""
        self.counters["failed_steps"] += 1
        lost = self.manager.abort_step()   # the step undone; lost: pools gone, seqs closed
        lost_ids = {id(s) for s in lost}
        finished = self._drain()
        for r, _ in work:
            if r.finish_reason is not None:
                continue
            r.step_failures += 1
            if r.seq is not None and id(r.seq) in lost_ids:
                if r in self._running:
                    self._running.remove(r)
                if r.step_failures > self.serve.max_step_retries:
                    finished.append(self._fail(r, e))
                else:
                    self._drop_for_recompute(r)
            elif r.step_failures > self.serve.max_step_retries:
                finished.append(self._fail(r, e))
        for seq in lost:   # other sequences the manager closed (their pools were lost)
            for r in list(self._running) + list(self._suspended):
                if r.seq is seq:
                    if r in self._running:
                        self._running.remove(r)
                    else:
                        self._suspended.remove(r)
                    self._drop_for_recompute(r)
        return finished

    # -- hooks for a front end (examples/llama/server.py): streaming and cancellation --------

    def new_tokens(self) -> dict[int, list[int]]:
        """The tokens each request got since the previous call: ``{request id: [token, ...]}``
        (requests that got none are absent). Tokens appear as the loop reads them (with
        ``overlap``, one step after the step that sampled them). A request that finished since
        then is included once with its last tokens (EOS included); a cancelled one never again.
        Call it between steps, e.g. after every :meth:`step`; O(live requests)."""
        cursor = self._token_cursor
        for rid in range(self._cursor_next_id, self._next_id):
            cursor[rid] = 0
        self._cursor_next_id = self._next_id
        live = {r.rid: r for q in (self._running, self._closing, self._suspended, self._waiting)
                for r in q}
        out: dict[int, list[int]] = {}
        for rid, sent in list(cursor.items()):
            r = live.get(rid)
            if r is None:                      # finished (or cancelled) since the last call
                del cursor[rid]
                done = self._done.get(rid)
                if done is not None and len(done.generated_ids) > sent:
                    out[rid] = done.generated_ids[sent:]
                continue
            n = len(r.tokens) - len(r.prompt)
            if n > sent:
                out[rid] = r.tokens[len(r.prompt) + sent:]
                cursor[rid] = n
        return out

    def cancel(self, request_id: int) -> RequestOutput | None:
        """Ends a waiting, running, suspended or closing request now: its sequence is closed
        (full pages stay in the prefix cache, the rest are freed once the step in flight that
        reads them completed: the manager fences them) and it is never scheduled again; tokens
        the step in flight samples for it are dropped when read. Returns its output so far
        (``finish_reason`` "cancelled"; not kept for :meth:`pop_output`), or None when the id is
        not live (unknown, finished or already cancelled). Call it between steps."""
        for queue in (self._running, self._closing, self._suspended, self._waiting):
            r = next((x for x in queue if x.rid == request_id), None)
            if r is None:
                continue
            queue.remove(r)
            self._close_seq(r)
            self._token_cursor.pop(request_id, None)
            r.finish_reason = "cancelled"     # _read drops its unread tokens
            self.counters["cancelled_requests"] += 1
            return self._output(r)
        return None

    def pop_output(self, request_id: int) -> RequestOutput | None:
        """Removes and returns a finished request's output (None if it has none): a long-running
        server calls it for every request, since finished outputs are otherwise kept for
        :meth:`generate`."""
        return self._done.pop(request_id, None)

    # -- report ------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The KV report (JSON-serializable; :func:`serve_types.kv_report`)."""
        return kv_report(self.manager, self.serve, self.counters, self._busy_s, self._steady_s,
                         self._shapes)
