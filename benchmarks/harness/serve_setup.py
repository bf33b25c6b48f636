"""What the serving benchmark runs: the model shapes, :class:`Setup` (one run's sizes), the
workload presets (default, trtllm; full, ``--quick``, ``--tiny``) and the requests they make.
The workloads are described in ``benchmarks/bench_serve.py``'s docstring; :func:`preflight` and
:func:`random_params` start a run."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcm
from benchmarks.harness.run_log import log, mem_gib
from examples.llama import fp8_weights
from examples.llama import model as llama
from examples.llama import serve

ANCHOR = {"system": "TensorRT-LLM paged KV", "model": "Llama-3.1-8B", "gpu": "one H100",
          "input_len": 1024, "output_len": 1024, "concurrency": 256,
          "output_tokens_per_s": 8563.0, "source": "TensorRT-LLM PR 'Contiguous primary KV cache (P0)', trtllm-bench, paged v2 baseline",
          "h200_over_h100_bandwidth": 1.4}
# --workload trtllm-bench's anchor: TensorRT-LLM's published throughput table (trtllm-bench
# throughput, FP8 weights and activations, 3,000 requests at an unbounded rate, 0.95 of free
# memory for K/V; docs/source/performance/perf-overview.md, v1.0 edition).
ANCHOR_TRTLLM_BENCH = {"system": "TensorRT-LLM", "model": "Llama-3.1-8B FP8", "gpu": "one H200",
                       "input_len": 1000, "output_len": 1000, "requests": 3000,
                       "output_tokens_per_s": 17744.0,
                       "source": "perf-overview.md (v1.0), trtllm-bench throughput"}
TARGET_TRTLLM_BENCH_H200 = 18000.0   # issue 38: FP8 weights and K/V, one H200
TARGET_PAGED_OVER_DENSE = 0.95
TARGET_ARENA_OVER_PAGED = 1.0   # the arena at least as fast as paged, in equal memory
TARGET_TP2_OVER_TP1 = 1.6       # issue 15: output tokens/s at --tensor-parallel 2 over 1
# The share of the device memory XLA leaves after the weights that the largest-concurrency
# arithmetic gives the K/V pool (the rest: the step's temporaries, XLA's workspace).
KV_MEMORY_FRACTION = 0.9

LLAMA_31_8B = llama.LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope_theta=500000.0, rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192,
    max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(), dtype="bfloat16")

TINY = llama.LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    rope_theta=500000.0, rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0, rope_original_max_position_embeddings=64,
    max_position_embeddings=1024, eos_token_ids=(), dtype="float32")


@dataclasses.dataclass(frozen=True)
class Setup:
    """One benchmark's sizes (see the module doc)."""

    name: str
    model: llama.LlamaConfig
    page_size: int = 16
    input_len: int = 1024
    output_len: int = 256
    concurrencies: tuple[int, ...] = (64, 256)
    requests_factor: float = 1.0
    shared_prompts: int = 15
    shared_prompt_len: int = 512
    shared_prompt_jitter: int = 32
    shared_suffix_len: int = 512
    shared_output_len: int = 256
    shared_concurrency: int = 64
    shared_requests: int = 128
    # Prompt length of a shared-prefix request (system prompt + a suffix to this length); None:
    # the system prompt + shared_suffix_len tokens.
    shared_total_len: int | None = None
    # The shared-prefix runs: "on" (prefix reuse), "warm" (system prompts served before the
    # clock), "off" (no reuse).
    shared_runs: tuple[str, ...] = ("on", "warm", "off")
    shared_first: bool = False          # the shared-prefix workload before the random one
    step_tokens: int = 4096             # paged token budget per step = dense prefill group budget
    # --batch-buckets: the paged runs' batch buckets, the concurrency and its halves (N of them:
    # c, c/2, c/4, ...), every step program compiled before the clock (Server.precompile), so a
    # step of fewer rows (the ramp-up, the tail) runs its GEMMs on its bucket, not on c rows
    batch_buckets: int = 1
    prefill_chunk: int = 4096           # paged prompt tokens per step (ServeConfig field)
    host_bytes: int = 0                 # the paged runs' pinned host tier
    offload_ahead_pages: int = 0        # the paged runs' write-back ahead (0 = off)
    dense_prefill_bucket: int = 128
    equal_memory_max_len: int = 4096
    equal_memory_run: bool = True
    run_dense: bool = True
    run_shared: bool = True
    record_logits: bool = False          # float32 oracle: compare logits too (tiny)
    kv_dtype: str = "auto"               # the paged runs' K/V pools (ServeConfig.kv_dtype)
    tensor_parallel: int = 1             # the paged runs' devices (ServeConfig.tensor_parallel)
    cascade: bool = False                # --cascade: ServeConfig.cascade for the paged runs
    xla_options: tuple | None = None     # --xla-option: ServeConfig.xla_options (paged runs)
    # --cascade-ab: the shared "on" run without and with cascade, ab_rounds times each,
    # interleaved in one process, and the median ratio with its spread
    cascade_ab: bool = False
    defer_shared_prompts: bool = True    # ServeConfig.defer_shared_prompts (--no-defer-...)
    seed: int = 0
    # Hot backends run side by side on the random rows and the shared "on" run ("arena": CUDA
    # VMM on a GPU, memfd on CPU; its budget is the paged pool's pages: equal K/V bytes; it
    # runs without write-back ahead, which the arena refuses).
    hot_backends: tuple[str, ...] = ("paged",)
    ab_rounds: int = 1                   # paged / other backend runs, interleaved, per row
    # --arena-step-calls: the arena's native calls read after every step (stats(), inside the
    # clock), its decode step times split by them; a diagnostic.
    arena_step_calls: bool = False
    pool_pages_override: int | None = None  # --pool-pages
    # --request-rate: the paged runs' requests arrive as a Poisson process of this many per
    # second (exponential gaps from default_rng(arrival_seed); serve_arrivals.py), TTFT from each
    # request's arrival, not behind every request submitted at once; None: all at once
    request_rate: float | None = None
    arrival_seed: int = 0                # --arrival-seed
    run_random: bool = True
    # --profile: a jax.profiler trace of profile_steps steady-state steps of every paged run
    # under this directory (benchmarks/_loop_profile.py), and the device time per step kind.
    profile_dir: str | None = None
    profile_steps: int = 64
    # --quantize: the layers' linear weights in FP8 ("fp8": per-channel scales, "fp8-tensor":
    # per tensor; examples/llama/fp8_weights.py), for every run of the setup; None: as drawn.
    quantize: str | None = None
    # --static-input-scales: with quantize, static activation scales calibrated over this many
    # random tokens (fp8_weights.calibrate_input_scales); None: per-token scales at run time.
    static_input_scales: int | None = None
    # Random-workload requests (None: concurrency x requests_factor).
    num_requests: int | None = None
    # The random rows' concurrency is the largest the device memory left after the weights holds
    # (serve_capacity.py; computed when the run starts, printed); concurrencies is then only
    # the fallback where the device reports no memory and --device-memory-gib gives none.
    auto_concurrency: bool = False
    kv_memory_fraction: float = KV_MEMORY_FRACTION   # of the memory left after the weights
    device_memory_bytes: int | None = None           # --device-memory-gib (CPU: none reported)

    @property
    def max_total_len(self) -> int:
        """The longest request (prompt + output) of any workload."""
        prompt = (self.shared_total_len if self.shared_total_len is not None else
                  self.shared_prompt_len + self.shared_prompt_jitter + self.shared_suffix_len)
        shared = prompt + self.shared_output_len if self.run_shared else 0
        return max(self.input_len + self.output_len, shared)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_total_len // self.page_size)

    @property
    def paged_kv_itemsize(self) -> int:
        """Bytes per K/V element of the paged runs' pools (1 with FP8 K/V)."""
        return 1 if self.kv_dtype == "fp8" else jnp.dtype(self.model.jnp_dtype).itemsize

    def requests_at(self, concurrency: int) -> int:
        """Random-workload requests at ``concurrency``."""
        if self.num_requests is not None:
            return self.num_requests
        return int(round(concurrency * self.requests_factor))

    def batch_buckets_at(self, concurrency: int) -> tuple[int, ...]:
        """The paged runs' batch buckets at ``concurrency``: ``ceil(c / 2**k)`` for ``k <
        batch_buckets``, ascending, distinct."""
        return tuple(sorted({-(-concurrency // 2**k) for k in range(self.batch_buckets)}))

    def pool_pages(self, concurrency: int) -> int:
        """Every running request at its longest, plus a page each of slack (a preempted request
        would be recomputed: there is no host tier); ``--pool-pages`` when given."""
        if self.pool_pages_override is not None:
            return self.pool_pages_override
        return concurrency * (self.pages_per_seq + 1)


FULL = Setup("llama-3.1-8b-shape", LLAMA_31_8B)
QUICK = dataclasses.replace(FULL, concurrencies=(64,), shared_requests=96, equal_memory_run=False)
TINY_SETUP = Setup(
    "tiny", TINY, page_size=8, input_len=40, output_len=12, concurrencies=(4, 8),
    requests_factor=2.0, shared_prompts=5, shared_prompt_len=24, shared_prompt_jitter=4,
    shared_suffix_len=12, shared_output_len=8, shared_concurrency=4, shared_requests=12,
    step_tokens=64, dense_prefill_bucket=16, equal_memory_max_len=128, record_logits=True)
# The seed workload (TensorRT-LLM's trtllm-bench run of the anchor): input/output 1,024/1,024 at
# concurrency 256, 15 system prompts of ~512 tokens plus a unique suffix to 1,024, prefix reuse
# and a pinned host tier on, 2,500 requests (--quick: 512). Then the random 1,024/1,024 row at
# concurrency 256 and its dense comparison. Prompt chunks of 2,048 tokens: on the H200 they gave
# 9,258 / 8,938 output tok/s (seed / random, --quick) against 8,895 / 8,080 with 512-token chunks,
# a mixed step taking ~62-64 ms instead of ~25-29 ms (benchmarks/results/, 2026-12-01); the
# runner's own default (ServeConfig.prefill_chunk_tokens = 512) keeps the latency-bounded choice.
# Write-back ahead keeps 384 device pages free or pending (its ~207,000 offloads copied on a side
# stream instead of in the steps): 9,434 against 9,175 output tok/s in the full run
# (benchmarks/results/, 2026-12-01, session 7); --offload-ahead-pages 0 turns it off.
TRTLLM = dataclasses.replace(
    FULL, name="trtllm", input_len=1024, output_len=1024, concurrencies=(256,),
    shared_prompts=15, shared_prompt_len=512, shared_prompt_jitter=32, shared_total_len=1024,
    shared_output_len=1024, shared_concurrency=256, shared_requests=2500, shared_runs=("on",),
    shared_first=True, step_tokens=256 + 2048, prefill_chunk=2048, host_bytes=32 << 30,
    offload_ahead_pages=384, equal_memory_run=False)
TRTLLM_QUICK = dataclasses.replace(TRTLLM, shared_requests=512)
TINY_TRTLLM = dataclasses.replace(
    TINY_SETUP, name="tiny-trtllm", input_len=40, output_len=16, concurrencies=(8,),
    requests_factor=1.0, shared_prompts=5, shared_prompt_len=20, shared_prompt_jitter=3,
    shared_total_len=40, shared_output_len=16, shared_concurrency=8, shared_requests=24,
    shared_runs=("on",), shared_first=True, step_tokens=8 + 16, prefill_chunk=16,
    host_bytes=1 << 20, offload_ahead_pages=8, equal_memory_run=False)
# TensorRT-LLM's published protocol (ANCHOR_TRTLLM_BENCH): random 1,000/1,000, 3,000 requests
# submitted at once, concurrency as large as memory allows; paged only, no host tier, no prefix
# sharing to find. --quick: 1,000 requests (a short GPU run); --tiny: the tiny model.
TRTLLM_BENCH = dataclasses.replace(
    FULL, name="trtllm-bench", input_len=1000, output_len=1000, concurrencies=(256,),
    num_requests=3000, auto_concurrency=True, run_shared=False, run_dense=False,
    equal_memory_run=False, step_tokens=256 + 2048, prefill_chunk=2048)
TRTLLM_BENCH_QUICK = dataclasses.replace(TRTLLM_BENCH, num_requests=1000)
TINY_TRTLLM_BENCH = dataclasses.replace(
    TINY_SETUP, name="tiny-trtllm-bench", input_len=20, output_len=20, concurrencies=(8,),
    num_requests=30, auto_concurrency=True, run_shared=False, run_dense=False,
    equal_memory_run=False, step_tokens=8 + 16, prefill_chunk=16)
WORKLOADS = {"default": (FULL, QUICK, TINY_SETUP), "trtllm": (TRTLLM, TRTLLM_QUICK, TINY_TRTLLM),
             "trtllm-bench": (TRTLLM_BENCH, TRTLLM_BENCH_QUICK, TINY_TRTLLM_BENCH)}
# The device check before an 8B run: the tiny model, one concurrency, no equal-memory run.
CHECK_SETUP = dataclasses.replace(TINY_SETUP, name="tiny-check", concurrencies=(8,),
                                  equal_memory_run=False)

# Requests.


def random_requests(setup: Setup, n: int) -> list[serve.Request]:
    """``n`` random prompts of ``input_len`` (the first ``k`` are the same for every ``n``)."""
    rng = np.random.default_rng(setup.seed)
    V = setup.model.vocab_size
    return [serve.Request(prompt=rng.integers(0, V, setup.input_len).tolist(),
                          max_new_tokens=setup.output_len, eos_token_ids=[]) for _ in range(n)]


def shared_system_prompts(setup: Setup) -> list[list[int]]:
    """The shared set's system prompts (``shared_prompt_len`` +- ``shared_prompt_jitter``)."""
    rng = np.random.default_rng(setup.seed + 1)
    j = setup.shared_prompt_jitter
    return [rng.integers(0, setup.model.vocab_size,
                         setup.shared_prompt_len + int(rng.integers(-j, j + 1))).tolist()
            for _ in range(setup.shared_prompts)]


def shared_requests(setup: Setup) -> list[serve.Request]:
    """Request ``i``: system prompt ``i % shared_prompts`` + a unique suffix."""
    systems = shared_system_prompts(setup)
    rng = np.random.default_rng(setup.seed + 2)

    def suffix(system: list[int]) -> int:
        if setup.shared_total_len is None:
            return setup.shared_suffix_len
        return setup.shared_total_len - len(system)

    return [serve.Request(prompt=systems[i % len(systems)]
                          + rng.integers(0, setup.model.vocab_size,
                                         suffix(systems[i % len(systems)])).tolist(),
                          max_new_tokens=setup.shared_output_len, eos_token_ids=[])
            for i in range(setup.shared_requests)]


# Before a run.


def preflight(tiny: bool) -> None:
    """SystemExit when this machine cannot run the benchmark (an 8B run on a CPU, a GPU without
    the CUDA extension)."""
    backend = jax.default_backend()
    if backend != "cpu" and not jax_kvcm.cuda_extension_available():
        raise SystemExit("jax runs on the GPU but jax_kvcm has no CUDA extension: reinstall "
                         "jax_kvcm where nvcc is found (pip install --no-build-isolation "
                         "--no-deps .)")
    if not tiny and backend == "cpu":
        raise SystemExit("the 8B-shaped benchmark needs a GPU (jax backend is cpu); "
                         "use --tiny on a CPU")


def random_params(setup: Any) -> Any:
    """``setup.model``'s params drawn with ``jax.random`` on the device (``setup.seed``), the
    layers' linear weights quantized to FP8 with ``setup.quantize``."""
    t = time.perf_counter()
    params = llama.init_params(setup.model, seed=setup.seed, on_device=True)
    params = jax.block_until_ready(params)
    quantize = getattr(setup, "quantize", None)
    if quantize is not None:
        params = fp8_weights.quantize_on_device(params, fp8_weights.QUANTIZE_CHOICES[quantize])
        calibration = getattr(setup, "static_input_scales", None)
        if calibration:
            tokens = np.random.default_rng(setup.seed).integers(
                0, setup.model.vocab_size, calibration).tolist()
            params = fp8_weights.calibrate_input_scales(params, setup.model, tokens)
            quantize += f", static input scales over {calibration} tokens"
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    kind = f"{setup.model.dtype}{f', layers {quantize}' if quantize else ''}"
    log(f"params: {n / 1e9:.2f} B parameters, {nbytes / 2**30:.1f} GiB {kind} "
        f"(jax.random on {jax.devices()[0].platform}) in {time.perf_counter() - t:.1f} s"
        f"{mem_gib()}")
    return params
