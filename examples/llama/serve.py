"""The serving loop of the example Llama runner: continuous batching on :class:`KVCacheManager`.

- **Requests** (prompt ids, ``max_new_tokens``, sampling params) wait in a FIFO queue and are
  admitted while the batch has room and the device has pages for the prompt (free + cached +
  pending pages, less one page of growth headroom per running sequence); a request that could
  never fit alone on the device is refused at submission.
- **Steps** pack every running sequence's pending tokens: one per decoding sequence, then prompt
  chunks up to the token budget (``max_tokens_per_step``: chunked prefill). The manager's
  ``prepare_step`` gives the bucketed index buffers; pure-decode steps go through the model's
  ``decode_step`` (``paged_attention``), others through ``forward_step``
  (``ragged_paged_attention``), both jitted with the caches donated. Shapes only take the
  manager's (batch, token) buckets, so a steady state compiles nothing new.
- **Pressure**: when ``prepare_step`` answers :class:`OutOfPagesError` (the manager has already
  evicted every cached page down the tiers), the most recently admitted running sequence is
  suspended (its pages go to host, else disk); when no tier can take it the sequence is closed and
  its request re-queued at the front to be recomputed from ``prompt + generated`` (prefix reuse
  usually brings most of it back). Suspended sequences are resumed, oldest first and before any
  new admission, when the device has room for them; one whose parked pages fail their checksum
  (:class:`CorruptPageError`) is closed and recomputed the same way.
- **Sampling**: greedy (temperature 0) or temperature + top-p, with a per-request key
  ``fold_in(fold_in(PRNGKey(seed), request_id), i)`` for the ``i``-th generated token (request
  ids count submissions from 0): a request's samples do not depend on what it was batched with or
  whether it was preempted, and two requests with one seed still draw independent noise.
- **Finish** on an EOS id or ``max_new_tokens``; the sequence is closed, its full pages stay in
  the prefix cache.

:meth:`Server.report` is the KV report: pages per tier, prefix hit rate (reused prompt tokens /
prompt tokens, first admissions only), pages offloaded (device -> host/disk) and onboarded
(host/disk -> device), suspends/resumes/recomputes, tokens/s (all steps, and steady state: the
steps that compiled nothing) and the compiled step shapes.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import (CacheLevel, ConcatCodec, Int8Codec, KVCacheConfig, KVCacheManager,
                      LayerGroupConfig, OutOfPagesError, SuspendResult)
from jax_kvcm._storage import CorruptPageError  # NOTE: not exported by jax_kvcm (yet)

try:
    from . import model as llama
except ImportError:  # pragma: no cover  (run from examples/llama)
    import model as llama  # type: ignore[no-redef]

__all__ = ["Request", "RequestOutput", "ServeConfig", "Server", "sample_tokens", "greedy_tokens",
           "CODECS"]

CODECS = {"concat": ConcatCodec, "int8": Int8Codec}
D, H, K = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK


@dataclasses.dataclass
class Request:
    """``temperature == 0``: greedy. ``eos_token_ids`` None: the model config's."""

    prompt: Sequence[int]
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    eos_token_ids: Sequence[int] | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_ids: list[int]
    generated_ids: list[int]
    finish_reason: str                 # "eos" or "length"
    prefix_hit_tokens: int             # prompt tokens reused at the first admission
    num_suspends: int = 0
    num_recomputes: int = 0
    time_to_first_token_s: float = 0.0
    logits: np.ndarray | None = None   # [n_generated, vocab] float32 with record_logits

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable (without the logits)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "logits"}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    page_size: int = 16
    device_pages: int = 256
    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    cold_codec: str = "concat"
    max_batch: int = 8
    max_tokens_per_step: int = 64      # the token budget of one step (chunked prefill)
    max_seq_len: int = 512
    paged_decode: bool = True          # pure-decode steps through paged_attention
    enable_prefix_reuse: bool = True
    record_logits: bool = False        # keep each sampled token's float32 logits (tests)
    # The manager's shape buckets (None: powers of two up to max_batch / max_tokens_per_step);
    # fewer buckets, fewer compiled programs (benchmarks/serve.py uses one of each).
    batch_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.cold_codec not in CODECS:
            raise ValueError(f"cold_codec must be one of {sorted(CODECS)}, got "
                             f"{self.cold_codec!r}")
        if self.max_tokens_per_step < self.max_batch:
            raise ValueError("max_tokens_per_step must be >= max_batch (every running sequence "
                             "decodes in one step)")


@dataclasses.dataclass
class _Req:
    rid: int
    req: Request
    prompt: list[int]
    eos: frozenset[int]
    tokens: list[int]                  # prompt + generated
    seq: Any = None                    # the manager's Sequence while admitted
    order: int = 0                     # admission order (the newest is preempted first)
    first_admit: bool = True
    prefix_hit_tokens: int = 0
    num_suspends: int = 0
    num_recomputes: int = 0
    submitted_at: float = 0.0
    ttft: float = 0.0
    finish_reason: str | None = None
    logits: list = dataclasses.field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]


# ---------------------------------------------------------------------------------------------
# Sampling.


def _sample_row(logits, temperature, top_p, seed, stream, counter):
    greedy = jnp.argmax(logits).astype(jnp.int32)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), stream), counter)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    probs = jax.nn.softmax(sorted_logits)
    before = jnp.cumsum(probs) - probs           # mass strictly before each token
    keep_sorted = before < top_p                 # always keeps the most likely token
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    masked = jnp.where(keep, scaled, -jnp.inf)
    sampled = jax.random.categorical(key, masked).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


@jax.jit
def sample_tokens(logits, temperature, top_p, seed, stream, counter):
    """Next tokens ``[B]`` int32 from ``logits [B, V]``; per row temperature (0: argmax), top-p,
    seed, stream and counter (the key is ``fold_in(fold_in(PRNGKey(seed), stream), counter)``)."""
    return jax.vmap(_sample_row)(logits, temperature, top_p, seed, stream, counter)


@jax.jit
def greedy_tokens(logits):
    """``argmax`` per row: :func:`sample_tokens` when every temperature is 0, without its sort
    over the vocabulary (a full-vocabulary argsort per row costs milliseconds at batch 256)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------


class Server:
    """Continuous-batching generation over one :class:`KVCacheManager` (see the module doc)."""

    def __init__(self, params: Any, config: llama.LlamaConfig, serve: ServeConfig | None = None):
        self.params, self.config = params, config
        self.serve = serve = serve or ServeConfig()
        if serve.disk_dir:
            os.makedirs(serve.disk_dir, exist_ok=True)
        group = LayerGroupConfig(num_layers=config.num_hidden_layers,
                                 num_kv_heads=config.num_key_value_heads,
                                 head_dim=config.head_dim, dtype=config.jnp_dtype,
                                 sliding_window=config.sliding_window)
        self.kv_config = KVCacheConfig(
            tokens_per_page=serve.page_size, layer_groups=(group,),
            device_pages=serve.device_pages, host_bytes=serve.host_bytes,
            disk_dir=serve.disk_dir, disk_bytes=serve.disk_bytes,
            enable_prefix_reuse=serve.enable_prefix_reuse, max_batch=serve.max_batch,
            max_tokens_per_step=serve.max_tokens_per_step, max_seq_len=serve.max_seq_len,
            batch_buckets=serve.batch_buckets, token_buckets=serve.token_buckets)
        self.manager = KVCacheManager(self.kv_config, CODECS[serve.cold_codec]())
        self.manager.add_observer(self._on_event)
        self._forward, self._decode = llama.bind(config)
        self._waiting: collections.deque[_Req] = collections.deque()
        self._running: list[_Req] = []
        self._suspended: collections.deque[_Req] = collections.deque()
        self._done: dict[int, RequestOutput] = {}
        self._next_id = 0
        self._order = 0
        self._shapes: set[tuple] = set()
        self.counters = collections.Counter()
        self._sample_shapes: set[tuple[int, bool]] = set()
        self._busy_s = 0.0
        self._steady_s = 0.0               # time in steps that compiled nothing
        self._token_cursor: dict[int, int] = {}   # new_tokens(): generated tokens handed out
        self._cursor_next_id = 0                  # new_tokens(): ids below this are tracked

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
        prompt = [int(t) for t in request.prompt]
        if not prompt:
            raise ValueError("empty prompt")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not 0.0 < request.top_p <= 1.0 or request.temperature < 0:
            raise ValueError("need temperature >= 0 and 0 < top_p <= 1")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")
        total = len(prompt) + request.max_new_tokens
        if total > self.serve.max_seq_len:
            raise ValueError(f"{len(prompt)} prompt + {request.max_new_tokens} new tokens exceed "
                             f"max_seq_len {self.serve.max_seq_len}")
        if self.manager.max_num_sequences(total) < 1:
            raise ValueError(f"a sequence of {total} tokens needs more than the "
                             f"{self.manager.device_capacity_pages} device pages")
        eos = (self.config.eos_token_ids if request.eos_token_ids is None
               else request.eos_token_ids)
        rid = self._next_id
        self._next_id += 1
        self._waiting.append(_Req(rid, request, prompt, frozenset(int(e) for e in eos),
                                  list(prompt), submitted_at=time.perf_counter()))
        return rid

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._suspended)

    def generate(self, requests: Sequence[Request]) -> list[RequestOutput]:
        """Submits ``requests``, runs until all finish, returns their outputs in order."""
        ids = [self.submit(r) for r in requests]
        while self.has_work():
            self.step()
        return [self._done[i] for i in ids]

    # -- capacity ----------------------------------------------------------------------------

    def _device_room(self) -> int:
        """Device pages obtainable now (free + pending frees + evictable cached), less one page
        of growth headroom per running sequence."""
        c = self.manager.stats()["pages"]["device"]
        return c["free"] + c["pending"] + c["cached"] - len(self._running)

    def _pages(self, n_tokens: int) -> int:
        return -(-n_tokens // self.serve.page_size)

    def _schedule(self) -> None:
        """Resumes suspended sequences (oldest first), then admits waiting requests."""
        mb = self.serve.max_batch
        while self._suspended and len(self._running) < mb:
            r = self._suspended[0]
            if self._pages(len(r.tokens)) + 1 > self._device_room() and self._running:
                return  # no room yet; do not admit newer requests ahead of it either
            try:
                resumed = self.manager.resume(r.seq)
            except CorruptPageError:          # a parked page failed its checksum: recompute
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
        while self._waiting and len(self._running) < mb:
            r = self._waiting[0]
            if self._running and self._pages(len(r.tokens) + 1) > self._device_room():
                return
            self._waiting.popleft()
            r.seq = self.manager.add_sequence(np.asarray(r.tokens, np.int32))
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

    def _drop_for_recompute(self, r: _Req) -> None:
        self.manager.close(r.seq)
        r.seq = None
        r.num_recomputes += 1
        self.counters["recomputes"] += 1
        self._waiting.appendleft(r)

    def _preempt(self, r: _Req) -> None:
        self._running.remove(r)
        res = self.manager.suspend(r.seq)
        if res is SuspendResult.SUSPENDED:
            r.num_suspends += 1
            self.counters["suspends"] += 1
            self._suspended.append(r)
        else:
            self._drop_for_recompute(r)

    # -- one step ----------------------------------------------------------------------------

    def _plan(self) -> list[tuple[_Req, int]]:
        work: list[tuple[_Req, int]] = []
        budget = self.serve.max_tokens_per_step
        lefts = [len(r.tokens) - r.seq.num_tokens for r in self._running]
        for r, left in zip(self._running, lefts):   # decoding sequences first: one token each
            if left == 1:
                work.append((r, 1))
                budget -= 1
        for r, left in zip(self._running, lefts):
            if left > 1 and budget > 0:
                n = min(left, budget)
                work.append((r, n))
                budget -= n
        return work

    def step(self) -> list[RequestOutput]:
        """Schedules, runs one model step, samples; returns the requests that finished."""
        t0 = time.perf_counter()
        self._schedule()
        if not self._running:
            if self._suspended or self._waiting:
                raise RuntimeError("no sequence can run: the device cannot hold any request")
            return []
        while True:
            work = self._plan()
            items = [(r.seq, np.array(r.tokens[nt:nt + n], np.int32))
                     for (r, n), nt in zip(work, [r.seq.num_tokens for r, _ in work])]
            try:
                batch = self.manager.prepare_step(items)
                break
            except OutOfPagesError:
                if len(self._running) > 1:
                    self._preempt(max(self._running, key=lambda r: r.order))
                elif self._suspended:       # their shared pages pin the device: recompute one
                    victim = self._suspended.pop()
                    self._drop_for_recompute(victim)
                else:
                    raise
        n_shapes, n_gen = len(self._shapes) + len(self._sample_shapes), self.counters[
            "generated_tokens"]
        finished = self._run(work, batch)
        dt = time.perf_counter() - t0
        self._busy_s += dt
        if len(self._shapes) + len(self._sample_shapes) == n_shapes:   # compiled nothing
            self._steady_s += dt
            self.counters["steady_generated_tokens"] += self.counters["generated_tokens"] - n_gen
        return finished

    def _run(self, work, batch) -> list[RequestOutput]:
        counts = [n for _, n in work]
        B, T = len(work), sum(counts)
        qs = np.asarray(batch.query_start)
        Bb, Tb = batch.seq_lens.shape[0], batch.positions.shape[0]
        (k, v), = self.manager.caches
        pure_decode = self.serve.paged_decode and T == B
        if pure_decode:
            tokens = np.zeros(Bb, np.int32)
            slots = np.full(Bb, -1, np.int32)
            positions = np.zeros(Bb, np.int32)
            m = min(Bb, Tb)
            slots[:m] = np.asarray(batch.slot_mapping)[:m]
            positions[:m] = np.asarray(batch.positions)[:m]
            slots[B:], positions[B:] = -1, 0
            tokens[:B] = [r.tokens[pos]        # row b's one new token (T == B)
                          for (r, _), pos in zip(work, positions[:B].tolist())]
            self._shapes.add(("decode", Bb))
            logits, k, v = self._decode(self.params, k, v, tokens, positions, slots,
                                        batch.page_table, batch.seq_lens)
            self.counters["decode_steps"] += 1
        else:
            tokens = np.zeros(Tb, np.int32)
            off = 0
            for r, n in work:
                end = r.seq.num_tokens
                tokens[off:off + n] = r.tokens[end - n:end]
                off += n
            logits_index = np.maximum(qs[1:] - 1, 0).astype(np.int32)
            self._shapes.add(("forward", Bb, Tb))
            logits, k, v = self._forward(self.params, k, v, tokens, batch.positions,
                                         batch.slot_mapping, batch.page_table, batch.seq_lens,
                                         batch.query_start, logits_index)
            self.counters["mixed_steps"] += 1
        self.manager.complete_step([(k, v)])
        self.counters["steps"] += 1
        self.counters["step_tokens"] += T
        # Sample for every row whose sequence has consumed all its tokens (seq_lens: the
        # sequences' lengths after this step).
        lens = np.asarray(batch.seq_lens)[:B].tolist()
        due = [b for b, ((r, _), n) in enumerate(zip(work, lens)) if n == len(r.tokens)]
        finished: list[RequestOutput] = []
        if not due:
            return finished
        temp = np.zeros(Bb, np.float32)
        top_p = np.ones(Bb, np.float32)
        seed = np.zeros(Bb, np.int32)
        stream = np.zeros(Bb, np.int32)
        counter = np.zeros(Bb, np.int32)
        rows = [work[b][0] for b in due]
        temp[due] = [r.req.temperature for r in rows]
        top_p[due] = [r.req.top_p for r in rows]
        seed[due] = [r.req.seed for r in rows]
        stream[due] = [r.rid for r in rows]
        counter[due] = [len(r.tokens) - len(r.prompt) for r in rows]
        self._sample_shapes.add((Bb, bool(temp.any())))
        next_tokens = np.asarray(sample_tokens(logits, temp, top_p, seed, stream, counter)
                                 if temp.any() else greedy_tokens(logits)).tolist()
        self.counters["generated_tokens"] += len(due)
        now = time.perf_counter()
        host_logits = np.asarray(logits) if self.serve.record_logits else None
        for b, r in zip(due, rows):
            tok = next_tokens[b]
            if len(r.tokens) == len(r.prompt):
                r.ttft = now - r.submitted_at
            r.tokens.append(tok)
            if host_logits is not None:
                r.logits.append(host_logits[b])
            if tok in r.eos or len(r.tokens) - len(r.prompt) >= r.req.max_new_tokens:
                r.finish_reason = "eos" if tok in r.eos else "length"
                finished.append(self._finish(r))
        return finished

    def _finish(self, r: _Req) -> RequestOutput:
        self.manager.close(r.seq)
        r.seq = None
        self._running.remove(r)
        out = RequestOutput(r.rid, r.prompt, r.generated, r.finish_reason, r.prefix_hit_tokens,
                            r.num_suspends, r.num_recomputes, r.ttft,
                            np.stack(r.logits) if self.serve.record_logits else None)
        self._done[r.rid] = out
        return out

    # -- hooks for a front end (examples/llama/server.py): streaming and cancellation --------

    def new_tokens(self) -> dict[int, list[int]]:
        """The tokens each request generated since the previous call: ``{request id: [token,
        ...]}`` (requests that got none are absent). A request that finished since then is
        included once with its last tokens (EOS included). Call it between steps, e.g. after
        every :meth:`step`; O(live requests)."""
        cursor = self._token_cursor
        for rid in range(self._cursor_next_id, self._next_id):
            cursor[rid] = 0
        self._cursor_next_id = self._next_id
        live = {r.rid: r for q in (self._running, self._suspended, self._waiting) for r in q}
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
        """Ends a waiting, running or suspended request now: its sequence is closed (its full
        pages stay in the prefix cache, the rest are freed) and it is never scheduled again.
        Returns its output so far (``finish_reason`` "cancelled"), or None when the id is not
        live (unknown, finished or already cancelled). Call it between steps."""
        for queue in (self._running, self._suspended, self._waiting):
            r = next((x for x in queue if x.rid == request_id), None)
            if r is None:
                continue
            queue.remove(r)
            if r.seq is not None:
                self.manager.close(r.seq)
                r.seq = None
            self._token_cursor.pop(request_id, None)
            r.finish_reason = "cancelled"
            return RequestOutput(r.rid, r.prompt, r.generated, r.finish_reason,
                                 r.prefix_hit_tokens, r.num_suspends, r.num_recomputes, r.ttft)
        return None

    def pop_output(self, request_id: int) -> RequestOutput | None:
        """Removes and returns a finished request's output (None if it has none): a long-running
        server calls it for every request, since finished outputs are otherwise kept for
        :meth:`generate`."""
        return self._done.pop(request_id, None)

    # -- report ------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The KV report (JSON-serializable)."""
        st = self.manager.stats()
        c = self.counters
        prompt = c["prompt_tokens"]
        busy = max(self._busy_s, 1e-9)
        return {
            "pages": st["pages"],
            "page_size": self.serve.page_size,
            "cold_codec": self.serve.cold_codec,
            "prompt_tokens": prompt,
            "prefix_hit_tokens": c["prefix_hit_tokens"],
            "prefix_hit_rate": c["prefix_hit_tokens"] / prompt if prompt else 0.0,
            "pages_offloaded": c["pages_offloaded"],
            "pages_offloaded_to_host": c["pages_offloaded_to_host"],
            "pages_offloaded_to_disk": c["pages_offloaded_to_disk"],
            "pages_host_to_disk": c["pages_host_to_disk"],
            "pages_onboarded": c["pages_onboarded"],
            "pages_committed": st["num_committed_pages"],
            "pages_dropped": st["num_dropped_pages"],
            "suspends": c["suspends"],
            "resumes": c["resumes"],
            "recomputes": c["recomputes"],
            "recompute_hit_tokens": c["recompute_hit_tokens"],
            "steps": c["steps"],
            "decode_steps": c["decode_steps"],
            "mixed_steps": c["mixed_steps"],
            "generated_tokens": c["generated_tokens"],
            "step_tokens": c["step_tokens"],
            "seconds": self._busy_s,
            "generated_tokens_per_s": c["generated_tokens"] / busy,
            "step_tokens_per_s": c["step_tokens"] / busy,
            "steady_seconds": self._steady_s,
            "steady_generated_tokens_per_s": (c["steady_generated_tokens"] / self._steady_s
                                              if self._steady_s else 0.0),
            "compiled_shapes": sorted(self._shapes, key=str),
        }
