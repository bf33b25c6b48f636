"""The serving loop's data: what a caller submits (:class:`Request`) and gets back
(:class:`RequestOutput`), how the loop is configured (:class:`ServeConfig`), what it records per
step (:class:`StepRecord`, with ``ServeConfig.record_steps``), a request's state inside the loop
(:class:`RequestState`), the manager's configuration for a ServeConfig (:func:`kv_cache_config`)
and the KV report (:func:`kv_report`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from jax_kvcm import ConcatCodec, Int8Codec, KVCacheConfig, LayerGroupConfig

from .hot_backend import hot_backend_fields

__all__ = ["Request", "RequestOutput", "ServeConfig", "StepRecord", "RequestState", "kv_report",
           "kv_cache_config", "checked_prompt", "CODECS", "KV_DTYPES"]

CODECS = {"concat": ConcatCodec, "int8": Int8Codec}
# ServeConfig.kv_dtype -> the pools' dtype (None: the model's compute dtype).
KV_DTYPES = {"auto": None, "fp8": jnp.float8_e4m3fn}

@dataclasses.dataclass
class Request:
    """``temperature == 0``: greedy. ``eos_token_ids`` None: the model config's."""

    prompt: Sequence[int]
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    eos_token_ids: Sequence[int] | None = None
    # The sequence stays open when the request finishes: RequestOutput.sequence holds it and the
    # caller closes it (the prefill side of a K/V handoff exports it first).
    keep_sequence: bool = False


def checked_prompt(request: Request, vocab_size: int, max_seq_len: int, manager: Any) -> list[int]:
    """``request``'s prompt ids; ValueError for a request that is invalid or can never fit
    ``manager``'s device pages (``Server.submit``)."""
    prompt = [int(t) for t in request.prompt]
    if not prompt:
        raise ValueError("empty prompt")
    if request.max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if not 0.0 < request.top_p <= 1.0 or request.temperature < 0:
        raise ValueError("need temperature >= 0 and 0 < top_p <= 1")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    total = len(prompt) + request.max_new_tokens
    if total > max_seq_len:
        raise ValueError(f"{len(prompt)} prompt + {request.max_new_tokens} new tokens exceed "
                         f"max_seq_len {max_seq_len}")
    if manager.max_num_sequences(total) < 1:
        raise ValueError(f"a sequence of {total} tokens needs more than the "
                         f"{manager.device_capacity_pages} device pages")
    return prompt


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
    sequence: Any = None               # the open sequence, with Request.keep_sequence

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable (without the logits, token times and sequence)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("logits", "token_times_s", "sequence")}


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
    # Pure-decode steps read each shared prefix once per group of up to N rows instead of once
    # per row (jax_kvcm.cascade_paged_attention; N: jax_kvcm.cascade_group_size): one device, one
    # KV group of full attention, the paged or the CUDA arena hot tier.
    cascade: bool = False
    enable_prefix_reuse: bool = True
    # A waiting request whose prompt shares at least a page with a running request's prompt
    # that is still being written waits until those pages are (the next steps) and then reuses
    # them, instead of computing the same prefix beside it (requests admitted together cannot
    # reuse each other's pages). Only prefix reuse benefits; off: admit in order regardless.
    defer_shared_prompts: bool = True
    record_logits: bool = False        # keep each sampled token's float32 logits (tests)
    # The manager's shape buckets (None: powers of two up to max_batch / max_tokens_per_step);
    # fewer buckets, fewer compiled programs (the serving benchmark uses one of each). With FP8
    # weights each is rounded up to a multiple of 16 (step.step_kv_config: cuBLASLt's FP8 GEMMs).
    batch_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    # The manager's hot backend (examples/llama/hot_backend.py): "paged", or "arena": CUDA VMM
    # on a GPU, memfd on CPU (where the steps take the pools by address). ``arena``: its
    # ArenaHot options (None: the defaults); device_pages is the budget either way.
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
    # XLA compiler options of the device step, e.g. (("xla_gpu_enable_triton_gemm", False),)
    # (step.model_step_with); (): XLA's defaults; None: the defaults for the weights
    # (step.step_xla_options: FP8 weights compile without Triton GEMMs). Server.serve holds
    # the options it resolved to.
    xla_options: tuple[tuple[str, bool | int | str], ...] | None = None

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
        if self.xla_options is not None and not all(
                isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str)
                for o in self.xla_options):
            raise ValueError(f"xla_options must be (name, value) pairs, got "
                             f"{self.xla_options!r}")
        if self.cascade and (self.tensor_parallel > 1 or not self.paged_decode):
            raise ValueError("cascade needs tensor_parallel 1 and paged_decode (it is a "
                             "decode-step attention on one device)")
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
class RequestState:
    """One request inside the loop: its tokens so far, its sequence while admitted, its counters."""

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


def kv_report(manager: Any, serve: ServeConfig, counters: Any, busy_s: float, steady_s: float,
              shapes: set) -> dict[str, Any]:
    """The KV report of a serving loop (JSON-serializable): pages per tier, prefix hit rate,
    pages offloaded / onboarded, suspends, resumes and recomputes, tokens/s over all steps and in
    steady state (steps that compiled nothing), and the compiled step shapes."""
    st = manager.stats()
    c = counters
    prompt = c["prompt_tokens"]
    busy = max(busy_s, 1e-9)
    return {
        "pages": st["pages"],
        "page_size": serve.page_size,
        "cold_codec": serve.cold_codec,
        "kv_dtype": str(jnp.dtype(manager.config.layer_groups[0].pool_dtype)),
        "overlap": serve.overlap,
        "max_tokens_per_step": serve.max_tokens_per_step,
        "prefill_chunk_tokens": serve.prefill_chunk_tokens,
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
        # Decode steps' K/V reads in tokens (per layer), and what ServeConfig.cascade saved.
        "decode_kv_tokens": c["decode_kv_tokens"],
        "deferred_admissions": c["deferred_admissions"],
        "cascade_grouped_rows": c["cascade_grouped_rows"],
        "cascade_tokens_saved": c["cascade_tokens_saved"],
        "generated_tokens": c["generated_tokens"],
        "step_tokens": c["step_tokens"],
        "seconds": busy_s,
        "generated_tokens_per_s": c["generated_tokens"] / busy,
        "step_tokens_per_s": c["step_tokens"] / busy,
        "steady_seconds": steady_s,
        "steady_generated_tokens_per_s": (c["steady_generated_tokens"] / steady_s
                                          if steady_s else 0.0),
        "compiled_shapes": sorted(shapes, key=str),
    }


def kv_cache_config(serve: ServeConfig, model: Any, num_kv_heads: int,
                    mesh: Any = None) -> KVCacheConfig:
    """The manager's configuration for ``serve`` and ``model`` (a LlamaConfig): one layer group
    per attention kind (full layers; window layers, in the model's ``kv_groups`` order; window
    groups get ring tables, whose width does not grow with ``max_seq_len``), ``num_kv_heads``
    per device (tensor parallelism replicates KV heads below the device count), the hot backend
    (examples/llama/hot_backend.py), the cold tiers and the shape buckets."""
    groups = tuple(LayerGroupConfig(num_layers=len(layers), num_kv_heads=num_kv_heads,
                                    head_dim=model.head_dim, dtype=model.jnp_dtype,
                                    sliding_window=window, kv_dtype=KV_DTYPES[serve.kv_dtype])
                   for window, layers in model.kv_groups())
    return KVCacheConfig(
        tokens_per_page=serve.page_size, layer_groups=groups,
        ring_tables=any(g.sliding_window is not None for g in groups),
        **hot_backend_fields(serve, model),
        host_bytes=serve.host_bytes, disk_dir=serve.disk_dir, disk_bytes=serve.disk_bytes,
        enable_prefix_reuse=serve.enable_prefix_reuse, max_batch=serve.max_batch,
        max_tokens_per_step=serve.max_tokens_per_step, max_seq_len=serve.max_seq_len,
        batch_buckets=serve.batch_buckets, token_buckets=serve.token_buckets,
        mesh=mesh, offload_ahead_pages=serve.offload_ahead_pages)
