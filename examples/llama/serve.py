"""The serving loop of the example Llama runner: continuous batching on :class:`KVCacheManager`.

- **Requests** (prompt ids, ``max_new_tokens``, sampling params) wait in a FIFO queue and are
  admitted while the batch has room and the device has pages for the prompt (free + cached +
  pending pages, less one page of growth headroom per running sequence); a request that could
  never fit alone on the device is refused at submission.
- **Steps** pack every running sequence's pending tokens: one per decoding sequence, then prompt
  chunks (chunked prefill: prompts stream in while the others decode) up to
  ``prefill_chunk_tokens`` prompt tokens and ``max_tokens_per_step`` tokens in all. The manager's
  ``prepare_step`` gives the bucketed index buffers; pure-decode steps go through the model's
  ``decode_step`` (``paged_attention``), others through ``forward_step``
  (``ragged_paged_attention``); one jitted program per (kind, batch bucket, token bucket) does
  the model step and the sampling, caches donated. A steady state compiles nothing new.
- **Overlap** (``ServeConfig.overlap``, on by default): the host prepares step n+1 (admission,
  ``prepare_step``, page allocation) while the device runs step n. Sampled tokens stay on the
  device: step n+1 gathers its input tokens from step n's output array (the manager gets a
  count for them), and the host reads step n's tokens (``copy_to_host_async`` at dispatch, read
  after step n+1 is dispatched) one step late: EOS and length checks then, and the read ids go
  to the manager (``record_token_ids``) so full pages of generated text still enter the prefix
  cache. A sequence that produced EOS has already been fed to step n+1: the token it generates
  there is dropped. A sequence that reached ``max_new_tokens`` is known to be done without
  reading anything and is closed at once (its pages stay fenced by the manager until the steps
  that read them complete). The only blocking reads are that one-step-late read, and a drain
  (read everything outstanding) before a preemption or after a failed step. With
  ``overlap=False`` each step's tokens are read right after it (the synchronous loop): both
  produce exactly the same tokens.
- **Pressure**: when ``prepare_step`` answers :class:`OutOfPagesError` (the manager has already
  evicted every cached page down the tiers), the most recently admitted running sequence is
  suspended (its pages go to host, else disk); when no tier can take it the sequence is closed and
  its request re-queued at the front to be recomputed from ``prompt + generated`` (prefix reuse
  usually brings most of it back). Suspended sequences are resumed, oldest first and before any
  new admission, when the device has room for them; one whose parked pages fail their checksum
  (:class:`CorruptPageError`) is closed and recomputed the same way.
- **Sampling** (on the device): greedy (temperature 0) or temperature + top-p, with a
  per-request key ``fold_in(fold_in(PRNGKey(seed), request_id), i)`` for the ``i``-th generated
  token (request ids count submissions from 0): a request's samples do not depend on what it was
  batched with or whether it was preempted, and two requests with one seed still draw
  independent noise.
- **Tensor parallelism** (``ServeConfig.tensor_parallel = N``): the params are split over the
  first N devices (``tp.shard_params``), the manager's pools over KV heads
  (``KVCacheConfig(mesh=...)``), and the steps run ``tp.forward_step`` / ``tp.decode_step``; the
  host side (scheduling, the manager, tiers) is the same. ``multihost.py`` runs it across
  processes.
- **Finish** on an EOS id or ``max_new_tokens``; the sequence is closed, its full pages stay in
  the prefix cache.
- **Faults**: a step that raises (out of memory, a kernel error) is undone in the manager
  (``KVCacheManager.abort_step`` where the manager has it; otherwise its sequences are closed and
  recomputed), its requests are retried (recomputed when the manager lost their pages) and fail
  with ``finish_reason == "error"`` after more than ``max_step_retries`` failed steps in a row;
  a storage error of one request (a corrupt or unreadable cold page while admitting,
  suspending or resuming it) recomputes or fails that request only. The loop keeps serving
  the others.

:meth:`Server.report` is the KV report: pages per tier, prefix hit rate (reused prompt tokens /
prompt tokens, first admissions only), pages offloaded (device -> host/disk) and onboarded
(host/disk -> device), suspends/resumes/recomputes, tokens/s (all steps, and steady state: the
steps that compiled nothing) and the compiled step shapes. With ``ServeConfig.record_steps``,
:attr:`Server.step_records` keeps a :class:`StepRecord` per dispatched step (its kind, rows,
buckets, queue lengths, when it was dispatched and when its tokens reached the host, and how long
that read blocked): ``benchmarks/serve.py`` derives where the loop's time goes from them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import (ArenaHot, CacheLevel, ConcatCodec, Int8Codec, KVCacheConfig, KVCacheManager,
                      LayerGroupConfig, OutOfPagesError, PagedHot, SuspendResult)
from jax_kvcm.manager import SequenceState  # NOTE: not exported by jax_kvcm (yet)
from jax_kvcm._storage import CorruptPageError  # NOTE: not exported by jax_kvcm (yet)

try:
    from . import model as llama
    from . import tp as tensor_parallel
except ImportError:  # pragma: no cover  (run from examples/llama)
    import model as llama  # type: ignore[no-redef]
    import tp as tensor_parallel  # type: ignore[no-redef]

__all__ = ["Request", "RequestOutput", "ServeConfig", "Server", "StepRecord", "sample_tokens",
           "greedy_tokens", "CODECS"]

CODECS = {"concat": ConcatCodec, "int8": Int8Codec}
# ServeConfig.kv_dtype -> the pools' dtype (None: the model's compute dtype).
KV_DTYPES = {"auto": None, "fp8": jnp.float8_e4m3fn}
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
    finish_reason: str                 # "eos", "length", "error" (see ServeConfig), "cancelled"
    prefix_hit_tokens: int             # prompt tokens reused at the first admission
    num_suspends: int = 0
    num_recomputes: int = 0
    time_to_first_token_s: float = 0.0
    logits: np.ndarray | None = None   # [n_generated, vocab] float32 with record_logits
    # When each generated token reached the host, in seconds from submission (the differences
    # are the inter-token latencies).
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None           # what failed, when finish_reason == "error"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable (without the logits and token times)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("logits", "token_times_s")}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    page_size: int = 16
    device_pages: int = 256
    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    cold_codec: str = "concat"
    offload_ahead_pages: int = 0       # KVCacheConfig.offload_ahead_pages (write-back ahead)
    max_batch: int = 8
    max_tokens_per_step: int = 64      # the token budget of one step (decodes + prompt chunks)
    # Prompt tokens one step may carry besides its decodes (chunked prefill). It bounds the
    # inter-token latency of the running sequences while prompts stream in: a mixed step costs
    # about a decode step plus this many tokens through every GEMM. 512: on an H200 with an
    # 8B model a decode step at batch 256 moves ~65 GB (~16 ms at the copy roofline) and 512
    # more tokens add ~8 TFLOP of GEMMs (~10 ms), so a step with a chunk stays within ~1.6x
    # of a pure decode step while a 1,024-token prompt takes two steps.
    prefill_chunk_tokens: int = 512
    overlap: bool = True               # host prepares step n+1 while the device runs step n
    max_step_retries: int = 1          # failed steps in a row a request survives (then "error")
    max_seq_len: int = 512
    paged_decode: bool = True          # pure-decode steps through paged_attention
    enable_prefix_reuse: bool = True
    record_logits: bool = False        # keep each sampled token's float32 logits (tests)
    # The manager's shape buckets (None: powers of two up to max_batch / max_tokens_per_step);
    # fewer buckets, fewer compiled programs (benchmarks/serve.py uses one of each).
    batch_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    # The manager's hot tier: "paged", or "arena" (``arena``: its ArenaHot options, default
    # ArenaHot()); device_pages is the page budget either way.
    hot_backend: str = "paged"
    arena: Any = None
    # K/V pools: "auto" in the model's dtype; "fp8" in float8_e4m3fn with the params'
    # "kv_scales" (the checkpoint's, else 1.0; see model.kv_scales). Half the bytes of bf16 per
    # page: twice the pages in the same memory. The int8 cold codec refuses fp8 pools.
    kv_dtype: str = "auto"
    # Devices the model and the K/V pools are split over (examples/llama/tp.py: Megatron-style
    # weights, pools split over KV heads); 1: one device, no mesh. The first N of
    # jax.devices() (every process's devices under jax.distributed).
    tensor_parallel: int = 1
    # Timing hook: keep a StepRecord per dispatched step in Server.step_records (benchmarks'
    # loop profile). Off: nothing is recorded and the loop does no extra work.
    record_steps: bool = False

    def __post_init__(self) -> None:
        if self.cold_codec not in CODECS:
            raise ValueError(f"cold_codec must be one of {sorted(CODECS)}, got "
                             f"{self.cold_codec!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got "
                             f"{self.kv_dtype!r}")
        if self.kv_dtype == "fp8" and self.cold_codec == "int8":
            raise ValueError("kv_dtype 'fp8' needs cold_codec 'concat' (the int8 codec "
                             "quantizes float pools, not fp8 ones)")
        if self.max_tokens_per_step < self.max_batch:
            raise ValueError("max_tokens_per_step must be >= max_batch (every running sequence "
                             "decodes in one step)")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.max_step_retries < 0:
            raise ValueError(f"max_step_retries must be >= 0, got {self.max_step_retries}")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be an integer >= 1, got "
                             f"{self.tensor_parallel!r}")
        if self.tensor_parallel > 1 and self.hot_backend != "paged":
            raise ValueError("tensor_parallel > 1 needs hot_backend 'paged' (the arena is one "
                             "device)")


@dataclasses.dataclass(slots=True)
class StepRecord:
    """One dispatched step (``ServeConfig.record_steps``); times are ``time.perf_counter()``
    seconds.

    ``kind``: "decode" (every row one new token), "mixed" (decode rows and prompt chunks) or
    "prefill" (prompt chunks only); ``program``: "decode" (``decode_step``) or "forward"
    (``forward_step``). ``waiting``/``running``: queued and admitted requests when the step was
    planned; ``min_tokens_left``: the fewest tokens any running request still has to generate
    (how close the next finish is). ``t_start``/``t_dispatched``/``t_end``: the :meth:`Server.step`
    call that dispatched it (entry, the device step dispatched, return). ``t_ready``: when its
    sampled tokens reached the host; ``wait_s``: how long that read blocked on the device (0.0
    until read)."""

    index: int
    kind: str
    program: str
    rows: int
    decode_rows: int
    tokens: int
    batch_bucket: int
    token_bucket: int
    waiting: int
    running: int
    min_tokens_left: int
    new_program: bool                  # its (program, buckets) shape was not seen before
    t_start: float
    t_dispatched: float
    t_end: float = 0.0
    t_ready: float = 0.0
    wait_s: float = 0.0


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
    error: str | None = None
    logits: list = dataclasses.field(default_factory=list)
    token_times: list = dataclasses.field(default_factory=list)
    # NOTE: tokens sampled by dispatched steps and not read yet (0..2 with overlap); the newest
    # is row `last_row` of the output of step `last_step`.
    unread: int = 0
    last_row: int = -1
    last_step: int = -1
    step_failures: int = 0

    @property
    def num_generated(self) -> int:
        """Generated tokens, read or not."""
        return len(self.tokens) + self.unread - len(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]


# Sampling on the device (examples/llama/model.py), re-exported here.
sample_tokens = llama.sample_tokens
greedy_tokens = llama.greedy_tokens


def _fit(x, n: int, fill: int):
    """``x[:n]``, padded with ``fill`` to ``n`` entries (static shapes)."""
    if x.shape[0] >= n:
        return x[:n]
    return jnp.concatenate([x, jnp.full((n - x.shape[0],), fill, x.dtype)])


@functools.partial(jax.jit, static_argnames=("config", "rings", "decode", "greedy",
                                             "with_logits", "mesh"),
                   donate_argnames=("k_cache", "v_cache"))
def model_step(params, k_cache, v_cache, prev_tokens, gather, host_tokens, batch, sampling, *,
               config: llama.LlamaConfig, rings: tuple[int, ...] | None = None, decode: bool,
               greedy: bool, with_logits: bool, mesh: jax.sharding.Mesh | None = None):
    """One serving step on the device: input tokens, the model, sampling.

    Args:
      prev_tokens: int32 ``[M]``: the previous step's sampled tokens (its output).
      gather, host_tokens: int32 ``[T]`` (``T`` the token bucket): token ``t`` is
        ``prev_tokens[gather[t]]`` where ``gather[t] >= 0`` (a token sampled by the previous step
        and not read by the host yet), else ``host_tokens[t]``.
      batch: the manager's :class:`StepBatch` (``[B]`` rows, ``[T]`` tokens).
      sampling: ``(temperature, top_p, seed, stream, counter)`` ``[B]`` each (see
        :func:`model.sample_tokens`); ignored when ``greedy``.
      decode: one token per row (``T`` new tokens = the ``B`` rows): ``decode_step``
        (``paged_attention``); else ``forward_step`` (``ragged_paged_attention``).
      k_cache, v_cache, rings: the model's pools (tuples with several KV groups) and ring widths
        (see examples/llama/model.py).
      mesh: None, or the tensor-parallel mesh (``tp.forward_step`` / ``tp.decode_step``; params
        from ``tp.shard_params``, pools split over KV heads).

    Returns:
      ``(tokens [M] int32, logits [B, V] float32 or None, k_cache, v_cache)``: row ``b``'s next
      token (from the logits of its last new token) at ``tokens[b]``, zeros past ``B``; the
      caches donated.
    """
    tokens = jnp.where(gather >= 0, prev_tokens[jnp.maximum(gather, 0)], host_tokens)
    B = batch.seq_lens.shape[0]
    step_fns = llama if mesh is None else tensor_parallel
    on_mesh = {} if mesh is None else {"mesh": mesh}
    if decode:
        slots = batch.slot_mapping  # [T], or [G, T] with several KV groups
        slots = (_fit(slots, B, -1) if slots.ndim == 1
                 else jax.vmap(lambda s: _fit(s, B, -1))(slots))
        logits, k_cache, v_cache = step_fns.decode_step(
            params, k_cache, v_cache, _fit(tokens, B, 0), _fit(batch.positions, B, 0),
            slots, batch.page_table, batch.seq_lens, config=config, rings=rings, **on_mesh)
    else:
        logits, k_cache, v_cache = step_fns.forward_step(
            params, k_cache, v_cache, tokens, batch.positions, batch.slot_mapping,
            batch.page_table, batch.seq_lens, batch.query_start, config=config, rings=rings,
            **on_mesh)
    with jax.named_scope("sampling"):    # a name for profiles (benchmarks/_profile.py)
        nxt = (llama.greedy_tokens(logits) if greedy
               else llama.sample_tokens(logits, *sampling))
        out = jax.lax.dynamic_update_slice(jnp.zeros_like(prev_tokens), nxt, (0,))
    return out, (logits if with_logits else None), k_cache, v_cache


def _model_caches(caches):
    """The manager's pools (one ``(k, v)`` per layer group) as the model takes them: one
    ``(k, v)`` pair for one group, else a tuple of ``k`` pools and one of ``v`` pools."""
    if len(caches) == 1:
        return caches[0]
    k, v = zip(*caches)
    return tuple(k), tuple(v)


@dataclasses.dataclass
class _Dispatched:
    """A dispatched step whose sampled tokens the host has not read yet."""

    index: int
    tokens: jax.Array                  # [max_batch] on the device
    logits: jax.Array | None
    rows: list[tuple[_Req, int]]       # (request, row) of every token due
    record: StepRecord | None = None   # ServeConfig.record_steps


# ---------------------------------------------------------------------------------------------



def hot_tier(backend: str, arena: Any = None) -> PagedHot | ArenaHot:
    """The manager's hot tier for ``--hot-backend`` (``arena``: ArenaHot options, or None)."""
    if backend == "paged":
        return PagedHot()
    if backend == "arena":
        return arena if arena is not None else ArenaHot()
    raise ValueError(f"hot_backend must be 'paged' or 'arena', got {backend!r}")

class Server:
    """Continuous-batching generation over one :class:`KVCacheManager` (see the module doc)."""

    def __init__(self, params: Any, config: llama.LlamaConfig, serve: ServeConfig | None = None):
        self.params, self.config = params, config
        self.serve = serve = serve or ServeConfig()
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
        # One layer group per attention kind (full layers; window layers), in the model's
        # kv_groups order; window groups get ring tables (width independent of max_seq_len).
        groups = tuple(LayerGroupConfig(num_layers=len(layers),
                                        num_kv_heads=num_kv_heads,
                                        head_dim=config.head_dim, dtype=config.jnp_dtype,
                                        sliding_window=window,
                                        kv_dtype=KV_DTYPES[serve.kv_dtype])
                       for window, layers in config.kv_groups())
        self.kv_config = KVCacheConfig(
            tokens_per_page=serve.page_size, layer_groups=groups,
            ring_tables=any(g.sliding_window is not None for g in groups),
            device_pages=serve.device_pages,
            host_bytes=serve.host_bytes, disk_dir=serve.disk_dir, disk_bytes=serve.disk_bytes,
            hot=hot_tier(serve.hot_backend, serve.arena),
            enable_prefix_reuse=serve.enable_prefix_reuse, max_batch=serve.max_batch,
            max_tokens_per_step=serve.max_tokens_per_step, max_seq_len=serve.max_seq_len,
            batch_buckets=serve.batch_buckets, token_buckets=serve.token_buckets,
            mesh=self.mesh, offload_ahead_pages=serve.offload_ahead_pages)
        self.manager = KVCacheManager(self.kv_config, CODECS[serve.cold_codec]())
        self.manager.add_observer(self._on_event)
        rings = tuple(w if g.sliding_window else 0
                      for g, w in zip(groups, self.kv_config.table_widths))
        # NOTE: the device step; a test seam (a fault hook wraps it from outside the class).
        self._model_step = functools.partial(model_step, config=config, rings=rings,
                                             mesh=self.mesh)
        self._waiting: collections.deque[_Req] = collections.deque()
        self._running: list[_Req] = []
        self._suspended: collections.deque[_Req] = collections.deque()
        self._closing: list[_Req] = []     # reached max_new_tokens, last token not read yet
        self._done: dict[int, RequestOutput] = {}
        self._next_id = 0
        self._order = 0
        self._shapes: set[tuple] = set()
        self.counters = collections.Counter()
        self._busy_s = 0.0
        self._steady_s = 0.0               # time in steps that compiled nothing
        # NOTE: committed to the pools' device like every later step output (else the first
        # step compiles once more for an uncommitted argument).
        self._prev_tokens = jax.device_put(
            np.zeros((serve.max_batch,), np.int32),
            self.manager.caches[0][0].sharding if self.mesh is None
            else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        self._inflight: _Dispatched | None = None
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
        while self._waiting and len(self._running) < mb:
            r = self._waiting[0]
            if self._running and self._pages(len(r.tokens) + 1) > self._device_room():
                return
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

    def _drop_for_recompute(self, r: _Req) -> None:
        self._close_seq(r)
        r.num_recomputes += 1
        self.counters["recomputes"] += 1
        self._waiting.appendleft(r)

    def _preempt(self, r: _Req) -> None:
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

    def _plan(self) -> list[tuple[_Req, int]]:
        work: list[tuple[_Req, int]] = []
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

    def _dispatch(self, work, batch, t_start: float = 0.0) -> _Dispatched:
        """Builds the host inputs, dispatches the device step (nothing waits for it) and hands
        the pools back to the manager. ``t_start``: when the step began (StepRecord)."""
        counts = [n for _, n in work]
        B, T = len(work), sum(counts)
        Bb, Tb = batch.seq_lens.shape[0], batch.positions.shape[0]
        decode = self.serve.paged_decode and T == B
        host_tokens = np.zeros(Tb, np.int32)
        gather = np.full(Tb, -1, np.int32)
        off = 0
        for r, n in work:
            if r.unread:
                gather[off] = r.last_row
            else:
                end = r.seq.num_tokens
                host_tokens[off:off + n] = r.tokens[end - n:end]
            off += n
        lens = np.asarray(batch.seq_lens)[:B].tolist()
        due = [b for b, ((r, _), n) in enumerate(zip(work, lens))
               if n == len(r.tokens) + r.unread]
        rows = [work[b][0] for b in due]
        temp = np.zeros(Bb, np.float32)
        temp[due] = [r.req.temperature for r in rows]
        greedy = not temp.any()
        sampling = None
        if not greedy:
            top_p = np.ones(Bb, np.float32)
            seed = np.zeros(Bb, np.int32)
            stream = np.zeros(Bb, np.int32)
            counter = np.zeros(Bb, np.int32)
            top_p[due] = [r.req.top_p for r in rows]
            seed[due] = [r.req.seed for r in rows]
            stream[due] = [r.rid for r in rows]
            counter[due] = [r.num_generated for r in rows]
            sampling = (temp, top_p, seed, stream, counter)
        with_logits = self.serve.record_logits
        shape = ("decode" if decode else "forward", Bb, Tb, greedy)
        new_program = shape not in self._shapes
        self._shapes.add(shape)
        k, v = _model_caches(self.manager.caches)
        tokens, logits, k, v = self._model_step(
            self.params, k, v, self._prev_tokens, gather, host_tokens, batch, sampling,
            decode=decode, greedy=greedy, with_logits=with_logits)
        self.manager.complete_step(list(zip(k, v)) if isinstance(k, tuple) else [(k, v)])
        tokens.copy_to_host_async()
        if logits is not None:
            logits.copy_to_host_async()
        self._prev_tokens = tokens
        self._num_dispatched += 1
        self.counters["decode_steps" if decode else "mixed_steps"] += 1
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
        return _Dispatched(self._num_dispatched, tokens, logits, list(zip(rows, due)), record)

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

    def _record_ids(self, r: _Req) -> None:
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

    def _read(self, d: _Dispatched) -> list[RequestOutput]:
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

    def _close_seq(self, r: _Req) -> None:
        if r.seq is not None and r.seq.state is not SequenceState.CLOSED:
            self.manager.close(r.seq)
        r.seq = None

    def _finish(self, r: _Req) -> RequestOutput:
        self._close_seq(r)
        for queue in (self._running, self._closing, self._waiting, self._suspended):
            if r in queue:
                queue.remove(r)
        out = self._output(r)
        self._done[r.rid] = out
        return out

    def _output(self, r: _Req) -> RequestOutput:
        return RequestOutput(r.rid, r.prompt, r.generated, r.finish_reason, r.prefix_hit_tokens,
                             r.num_suspends, r.num_recomputes, r.ttft,
                             np.stack(r.logits) if self.serve.record_logits and r.logits
                             else None, list(r.token_times), r.error)

    def _fail(self, r: _Req, e: BaseException) -> RequestOutput:
        self.counters["failed_requests"] += 1
        r.finish_reason, r.error = "error", f"{type(e).__name__}: {e}"[:500]
        return self._finish(r)

    def _step_failed(self, work, e: BaseException) -> list[RequestOutput]:
        """The step raised before it was handed back: undo it in the manager, read what the
        previous step produced, then retry, recompute or fail the step's requests."""
        self.counters["failed_steps"] += 1
        mgr = self.manager
        if hasattr(mgr, "abort_step"):
            lost = mgr.abort_step()         # the step undone; lost: pools gone, seqs closed
        else:
            # NOTE: without abort_step the step's sequences are closed (nothing of this step is
            # committed: complete_step skips closed sequences) and recomputed; the pools must
            # be intact (the step failed before consuming them).
            caches = mgr.caches
            if any(a.is_deleted() for kv in caches for a in kv):
                raise RuntimeError("the failed step consumed the KV pools and this manager has "
                                   "no abort_step to recover them") from e
            lost = [r.seq for r, _ in work]
            for seq in lost:
                mgr.close(seq)
            mgr.complete_step(caches)
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
        """The KV report (JSON-serializable)."""
        st = self.manager.stats()
        c = self.counters
        prompt = c["prompt_tokens"]
        busy = max(self._busy_s, 1e-9)
        return {
            "pages": st["pages"],
            "page_size": self.serve.page_size,
            "cold_codec": self.serve.cold_codec,
            "kv_dtype": str(self.manager.caches[0][0].dtype),
            "overlap": self.serve.overlap,
            "max_tokens_per_step": self.serve.max_tokens_per_step,
            "prefill_chunk_tokens": self.serve.prefill_chunk_tokens,
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
            "failed_steps": c["failed_steps"],
            "failed_requests": c["failed_requests"],
            "dropped_tokens": c["dropped_tokens"],
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
