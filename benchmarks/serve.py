#!/usr/bin/env python
"""Serving benchmark (issue 5): the example Llama serving loop on KVCacheManager and the custom
calls, side by side with the same model on a dense per-sequence JAX cache.

Run on the GPU machine from the repo root, after installing jax_kvcm with its CUDA extension (the
repo's unbuilt ``jax_kvcm/`` must not shadow the installed package: ``python benchmarks/serve.py``
keeps the script's directory, not the repo root, first on ``sys.path``):

    python benchmarks/serve.py --json serve.json          # default run (estimated 4-5 min)
    python benchmarks/serve.py --quick                    # concurrency 64 only, fewer requests
    JAX_PLATFORMS=cpu python benchmarks/serve.py --tiny   # tiny float32 model on CPU, seconds
    python benchmarks/serve.py --workload trtllm --quick  # the seed workload, 512 requests
    python benchmarks/serve.py --workload trtllm          # 2,500 requests (estimate printed)
    JAX_PLATFORMS=cpu python benchmarks/serve.py --workload trtllm --tiny
    python benchmarks/serve.py --workload trtllm --kv-dtype fp8   # paged K/V in float8_e4m3fn
    python benchmarks/serve.py --workload trtllm --quick --profile /tmp/prof   # where time goes
    python benchmarks/serve.py --workload trtllm --quick --no-dense --prefill-chunk 512 2048 4096
    python benchmarks/serve.py --workload trtllm --no-shared --no-dense --host-gib 0 \\
        --tensor-parallel 1 2 --profile /tmp/tp_prof --profile-steps 8   # TP 1 vs 2 (2 GPUs)

**Model.** Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336,
vocab 128256, RoPE theta 500000 with Llama-3 scaling, RMSNorm eps 1e-5), bfloat16 weights drawn
with ``jax.random`` directly on the device (``model.init_params(on_device=True)``: no checkpoint,
no download). Both paths run ``examples/llama/model.py``'s layers on the same params.

**Workloads.** Every request is submitted at t=0 (an offline burst: at most ``concurrency``
requests run at once, the rest queue), greedy, EOS ignored (each generates exactly its output
length); prompts are random token ids (fixed seed).

- ``random``: input 1,024 / output 256 tokens at each ``--concurrency`` (default 64 and 256),
  ``concurrency x --requests-factor`` requests.
- ``shared``: 15 system prompts of 512 +- 32 tokens; request ``i`` = system prompt ``i % 15`` +
  a unique 512-token suffix, output 256; concurrency 64, 128 requests; prefix reuse on and off.
  Requests admitted in the same step cannot reuse each other's pages (nothing is committed yet):
  the first wave computes the system prompts, the second wave finds them. A third run ("warm")
  serves the 15 system prompts once before the clock starts, as a running server has them
  cached, so every timed request can hit. Hit rates count the timed requests only.

- ``--workload trtllm`` (the anchor's trtllm-bench run): input/output 1,024/1,024 at
  concurrency 256; 15 system prompts of 512 +- 32 tokens, request ``i`` = system prompt
  ``i % 15`` + a unique suffix to 1,024 tokens; prefix reuse on and a pinned host tier
  (``--host-gib``, default 32) on; 2,500 requests (``--quick``: 512), no pre-warmed cache. It
  runs first; then the random 1,024/1,024 row at concurrency 256 (256 requests), paged and
  dense. Token budget: 256 decodes + ``--prefill-chunk`` (2,048) prompt tokens per step. The run
  prints its output-token counts and a time estimate first, and progress lines with the pace
  and the time left.

``--kv-dtype fp8``: the paged runs' K/V pools in ``float8_e4m3fn`` (scales 1.0: the random
weights carry none; same page count, half the K/V bytes), with ``--workload trtllm`` the seed
workload and the random 1,024/1,024 row; dense keeps bfloat16 caches, and token agreement
between fp8 paged and dense runs is reported, not enforced (the pre-run float32 check still
runs with the model dtype's K/V).

**Paths.**

- ``paged``: ``examples/llama/serve.Server`` (``KVCacheManager``, 16-token pages, a pool of
  ``concurrency x (pages(longest request) + 1)`` pages, no host tier, continuous batching with
  chunked prefill in 4,096-token steps; pure-decode steps through ``paged_attention``, others
  through ``ragged_paged_attention``). One batch bucket (the concurrency) and one token bucket
  (4,096), so each concurrency compiles two step programs.
- ``dense``: ``benchmarks/_dense_llama.DenseServer``: ``[layers, batch, kv_heads, max_len,
  head_dim]`` caches (head-major, so neither attention matmul transposes the cache), one slot per running request, whole-prompt prefill (einsum attention) in
  groups of 4,096 tokens, ``dynamic_update_slice`` writes, decode attention over the whole
  ``max_len`` row masked to the sequence's length. Equal batch: ``max_len`` = input + output.
- paged runs the overlapped loop (``ServeConfig.overlap``: sampling on the device, tokens read
  one step late, no per-step synchronization); dense samples with ``greedy_tokens`` and
  synchronizes once per step.

**Measured** per configuration on a fresh server, after a warm-up that compiles every program the
run uses (a compile inside the timed region is counted and flagged):
output tokens/s = generated tokens / wall time from submission to the last token; time to first
token (TTFT, from submission, so it includes queueing) median and p90; prefix hit rate = reused
prompt tokens / prompt tokens; pages used = peak device pages referenced by running sequences
(shared pages once; sampled every 4 steps) out of the pool; decode ms = median wall time of a
pure-decode step (model + sampling + host bookkeeping; with the overlapped loop, the pace of the
device in steady state); inter-token latency (ITL) = gaps between a request's tokens reaching
the host, median and p90 over all gaps; pages per tier at the end of the run (device, host);
**roofline**: the bytes one decode step must move (every weight once + the batch's K/V at the
workload's mean decode context, prompt + half the output), the copy bandwidth measured in the
same run (a large device-to-device elementwise copy, read + write), the ideal step time and the
measured decode step's fraction of it.

**Compared**: paged / dense tokens/s at equal batch (target >= 0.95); prefix reuse on / off;
equal memory: the paged pool of the largest concurrency against a dense cache of the same bytes
with a realistic ``max_len`` (4,096): how many sequences each holds (the manager's capacity
planning, ``max_num_sequences``) and, unless ``--no-equal-memory``, the dense run at the batch
it fits. Token agreement between runs of the same requests is reported (bfloat16: kernels round
differently and greedy generations drift apart; a broken path shows as near-zero agreement).

**Where the time goes** (``benchmarks/_loop_profile.py``): every paged run prints its loop
timings from the loop's step records (``ServeConfig.record_steps``): per step kind (decode-only,
mixed, prefill-only) the count, step time p50/p90, host time, time blocked on the device and
share of the run, and per phase (ramp-up, steady state, tail). ``--profile DIR`` adds a
``jax.profiler`` trace of ``--profile-steps`` steady-state steps per paged run and the device time
per step kind by category (weight GEMMs, paged / ragged attention, K/V writes, sampling,
collectives, norms/RoPE/other, idle inside a step, other programs, host gaps).
``--prefill-chunk`` with several values runs the paged rows once per value (the step budget =
the largest concurrency + the chunk, unless ``--step-tokens``; dense and equal memory with the
first value) and prints a table of them side by side.

**Tensor parallelism** (``--tensor-parallel N [N ...]``, ``examples/llama/tp.py``). One value:
the paged runs split over the first N devices (the weights sharded once, Megatron-style; the
pools over KV heads), dense on one device. Several values (``--tensor-parallel 1 2``): the paged
rows run once per value, in the order given, on fresh servers, the weights sharded once per
value; the previous value's servers, pools and shards are freed first, and before the last value
(when no dense run needs them) the unsharded weights leave device 0. Dense and equal memory run
with the first value only; run names carry `` [tp N]``. Printed after the runs:

- the scaling table: per run and value, output tok/s and its ratio to the first value's (target
  >= 1.6x at TP 2 over TP 1), decode step ms p50, TTFT and ITL p50, and with ``--profile`` the
  collectives' device ms per decode step (shard 0: its all-reduces after the O and down
  projections and the logits' all-gather, ``benchmarks/_profile.py``'s "collectives") with
  their share of the step and of the device's busy time; the requests whose tokens equal the
  first value's (float32: all of them, else the exit status is 1);
- the largest concurrency each value fits, arithmetic (no trial run), per device:
  memory ``M`` = the allocator limit the device reports (``memory_stats()["bytes_limit"]``:
  ``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.90 here, of the device's memory; the smallest over the
  value's devices; ``--device-memory-gib`` gives it where none is reported, as on the CPU);
  weights ``W`` = the value's params on device 0 (its shards; embeddings replicated); page bytes
  ``B`` = one page's bytes on one device as the run's ``KVCacheConfig`` reports them
  (``device_page_bytes()``: K and V of every layer, the device's KV heads, summed over layer
  groups); K/V budget = ``f x (M - W)`` with ``f`` = ``--kv-memory-fraction`` (0.9: the rest
  for the step's temporaries and XLA's workspace); a sequence at its longest (input + output)
  holds ``P`` pages and the pool of ``c`` sequences is sized as the run sizes it, ``c x (P + 1)``
  pages plus the null page; so ``c_max = floor((floor(budget / B) - 1) / (P + 1))``. For the
  8B shape at 1,024/1,024 (page 16, ``P`` = 128) on an H200 (``M`` ~ 126.4 GiB): TP 1 ``W``
  ~ 15.0 GiB, ``B`` = 2 MiB -> 397 sequences; TP 2 ``W`` ~ 8.0 GiB, ``B`` = 1 MiB -> 845.

The issue's row (two H200s, ~5 minutes, at most ~7 with slow compiles: the check ~40 s, then
per value the weights ~10 s, two step programs to compile ~1-1.5 min, 262,144 output tokens at
~9,000 (TP 1) / ~14,000 (TP 2) tok/s, an 8-step trace; the runs print progress lines)::

    XLA_PYTHON_CLIENT_PREALLOCATE=true python3 benchmarks/serve.py --workload trtllm \\
        --no-shared --no-dense --host-gib 0 --tensor-parallel 1 2 \\
        --profile /tmp/tp_prof --profile-steps 8 --json serve_tp.json

**Checks.** Before the 8B runs, the tiny float32 model runs paged, dense, and paged without prefix
reuse on the same device, and paged at every ``--tensor-parallel`` value > 1 (its split of the
tiny model) against one device: at least 3/4 of each pair's greedy generations must be
identical, with logits within relative L2 1e-4 (else the script exits non-zero before the long
part; a broken path changes most generations; ``--no-check`` skips it). ``--tiny`` is that model
alone on its own workloads; on the CPU every generation must be identical with logits within
1e-5 (``tests/test_serve_benchmark.py`` runs it). A configuration that raises is reported in the
table and the JSON, the others still run, and the exit status is 1.

Anchor (printed alongside, not measured here): TensorRT-LLM paged KV, Llama-3.1-8B on one H100,
1,024/1,024 at concurrency 256: 8,563 output tokens/s (the paged KVCacheManagerV2 baseline of a
TensorRT-LLM pull request's trtllm-bench run, "Contiguous primary KV cache (P0)"); the H200
has ~1.4x the H100's memory bandwidth. Its output length is 4x ours, so decode (bandwidth-bound)
dominates there; here prefill is a larger share.
"""

from __future__ import annotations

import os

# The 8B run holds ~16 GiB of weights plus one ~40 GiB cache at a time; leave XLA room for both.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
# NOTE: XLA_PYTHON_CLIENT_PREALLOCATE=false (growing the allocator region by region) left no room
# for the second 32 GiB pool of a 256-sequence 8B run on the H200 (RESOURCE_EXHAUSTED at 48 GiB in
# use); the default, one preallocated region, serves it.
if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
    import sys
    print("warning: XLA_PYTHON_CLIENT_PREALLOCATE=false may fail the 8B runs' pool allocation "
          "(fragmented allocator regions); unset it", file=sys.stderr)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_kvcm  # noqa: E402  (the installed package first; then the repo root for examples/)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # after jax_kvcm: its unbuilt source tree must not shadow it

from benchmarks import _dense_llama as dense  # noqa: E402
from benchmarks import _loop_profile as loop_profile  # noqa: E402
from benchmarks import _profile  # noqa: E402
from examples.llama import model as llama  # noqa: E402
from examples.llama import serve  # noqa: E402
from examples.llama import tp  # noqa: E402

ANCHOR = {"system": "TensorRT-LLM paged KV", "model": "Llama-3.1-8B", "gpu": "one H100",
          "input_len": 1024, "output_len": 1024, "concurrency": 256,
          "output_tokens_per_s": 8563.0, "source": "TensorRT-LLM PR 'Contiguous primary KV cache (P0)', trtllm-bench, paged v2 baseline",
          "h200_over_h100_bandwidth": 1.4}
TARGET_PAGED_OVER_DENSE = 0.95
TARGET_ARENA_OVER_PAGED = 0.98  # issue 13: the arena within 2% of paged tokens/s
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
    seed: int = 0
    # Hot backends run side by side on the random rows and the shared "on" run ("arena": the
    # contiguous arena, CUDA VMM on a GPU, memfd on CPU; its budget is the paged pool's bytes
    # plus a chunk per range).
    hot_backends: tuple[str, ...] = ("paged",)
    # --profile: a jax.profiler trace of profile_steps steady-state steps of every paged run
    # under this directory (benchmarks/_loop_profile.py), and the device time per step kind.
    profile_dir: str | None = None
    profile_steps: int = 64

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

    def pool_pages(self, concurrency: int) -> int:
        """Every running request at its longest, plus a page each of slack (a preempted request
        would be recomputed: there is no host tier)."""
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
# a mixed step taking ~62-64 ms instead of ~25-29 ms (RESULTS.md, 2026-12-01); the runner's own
# default (ServeConfig.prefill_chunk_tokens = 512) keeps the latency-bounded choice. Write-back
# ahead keeps 384 device pages free or pending (its ~207,000 offloads copied on a side stream
# instead of in the steps): 9,434 against 9,175 output tok/s in the full run (RESULTS.md,
# 2026-12-01, session 7); --offload-ahead-pages 0 turns it off.
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
WORKLOADS = {"default": (FULL, QUICK, TINY_SETUP), "trtllm": (TRTLLM, TRTLLM_QUICK, TINY_TRTLLM)}
# The device check before an 8B run: the tiny model, one concurrency, no equal-memory run.
CHECK_SETUP = dataclasses.replace(TINY_SETUP, name="tiny-check", concurrencies=(8,),
                                  equal_memory_run=False)


# ---------------------------------------------------------------------------------------------
# Small helpers.


def _log(*a: Any) -> None:
    print(*a, flush=True)


_COMPILES: dict[str, Any] = {"n": 0, "s": 0.0, "names": []}  # names: (function, seconds)


def _on_duration(event: str, duration: float, *args: Any, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["n"] += 1
        _COMPILES["s"] += float(duration)
        _COMPILES["names"].append((str(kwargs.get("fun_name", "?")), float(duration)))


def _compiled_between(n0: int, n1: int) -> list[str]:
    """``"function (seconds)"`` of the XLA compiles counted while ``_COMPILES["n"]`` went from
    ``n0`` to ``n1``."""
    return [f"{name} ({sec:.1f} s)" for name, sec in _COMPILES["names"][n0:n1]]


try:  # counts XLA compiles (a compile in a timed region is flagged); absent: no flag
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    _COUNTING_COMPILES = True
except Exception:  # noqa: BLE001
    _COUNTING_COMPILES = False


def _mem_gib() -> str:
    try:
        st = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        st = {}
    if "bytes_in_use" not in st:
        return ""
    return (f" [device memory {st['bytes_in_use'] / 2**30:.1f} GiB in use, peak "
            f"{st.get('peak_bytes_in_use', 0) / 2**30:.1f} GiB]")


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else 0.0


class _Progress:
    """A line every ``every_s`` seconds on long runs."""

    def __init__(self, label: str, total_tokens: int, every_s: float = 5.0):
        self.label, self.total, self.every = label, total_tokens, every_s
        self.t0 = self.last = time.perf_counter()

    def __call__(self, tokens: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            el = now - self.t0
            rate = tokens / el if el > 0 else 0.0
            eta = f", ~{(self.total - tokens) / rate:.0f} s left" if rate > 0 else ""
            _log(f"    {self.label}: {tokens}/{self.total} tokens generated, {el:.1f} s "
                 f"({rate:,.0f} tok/s{eta})")


# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# The two paths.


ARENA_SUPER_PAGE = 2 << 20      # CUDA VMM's granularity on the H200
ARENA_CPU_SUPER_PAGE = 4096     # memfd on CPU: the system page (a tiny model's chunk stays small)


def arena_super_page() -> int:
    """The arena's super-page on this backend."""
    return ARENA_SUPER_PAGE if jax.default_backend() == "gpu" else ARENA_CPU_SUPER_PAGE


def _arena_config(setup: Setup, concurrency: int) -> jax_kvcm.ArenaConfig:
    """The arena of a run: a range per running request, the paged pool's bytes plus one chunk
    per range and the null chunk (each range rounds its last chunk up)."""
    m = setup.model
    slot = setup.page_size * m.num_key_value_heads * m.head_dim * jnp.dtype(m.jnp_dtype).itemsize
    sp = arena_super_page()
    chunk = 2 * m.num_hidden_layers * int(np.lcm(slot, sp))
    pool = setup.pool_pages(concurrency) * 2 * m.num_hidden_layers * slot
    return jax_kvcm.ArenaConfig(max_sequences=concurrency,
                                max_pages_per_sequence=setup.pages_per_seq,
                                budget_bytes=pool + (concurrency + 1) * chunk,
                                super_page_bytes=sp)


def _serve_config(setup: Setup, concurrency: int, prefix: bool,
                  hot_backend: str = "paged") -> serve.ServeConfig:
    arena = _arena_config(setup, concurrency) if hot_backend == "arena" else None
    return serve.ServeConfig(
        hot_backend=hot_backend, arena=arena,
        page_size=setup.page_size, device_pages=setup.pool_pages(concurrency),
        max_batch=concurrency, max_tokens_per_step=setup.step_tokens,
        prefill_chunk_tokens=setup.prefill_chunk, host_bytes=setup.host_bytes,
        offload_ahead_pages=setup.offload_ahead_pages if setup.host_bytes else 0,
        max_seq_len=setup.pages_per_seq * setup.page_size, enable_prefix_reuse=prefix,
        batch_buckets=(concurrency,), token_buckets=(setup.step_tokens,),
        record_logits=setup.record_logits, kv_dtype=setup.kv_dtype,
        tensor_parallel=setup.tensor_parallel, record_steps=True)


def _summary(label: str, path: str, workload: str, concurrency: int,
             requests: Sequence[serve.Request], outs: Sequence[serve.RequestOutput],
             seconds: float, compiles: tuple[int, int], warmup_s: float,
             decode_ms: Sequence[float], **extra: Any) -> dict[str, Any]:
    """One run's row; ``compiles``: ``_COMPILES["n"]`` when its timed region began and ended."""
    gen = sum(len(o.generated_ids) for o in outs)
    ttft = [o.time_to_first_token_s for o in outs]
    itl = np.concatenate([np.diff(o.token_times_s) for o in outs if len(o.token_times_s) > 1]
                         or [np.zeros(0)])
    return dict(
        name=label, path=path, workload=workload, concurrency=concurrency,
        requests=len(requests),
        input_tokens_mean=float(np.mean([len(r.prompt) for r in requests])),
        output_len=int(requests[0].max_new_tokens), generated_tokens=gen, seconds=seconds,
        output_tokens_per_s=gen / seconds if seconds > 0 else 0.0,
        ttft_p50_s=_pct(ttft, 50), ttft_p90_s=_pct(ttft, 90),
        itl_p50_ms=_pct(itl, 50) * 1e3, itl_p90_ms=_pct(itl, 90) * 1e3,
        decode_step_ms_p50=_pct(decode_ms, 50), decode_steps=len(decode_ms),
        warmup_s=warmup_s,
        compiles_in_timed_region=compiles[1] - compiles[0] if _COUNTING_COMPILES else None,
        compiled_in_timed_region=_compiled_between(*compiles),
        **extra)


def run_paged(params: Any, setup: Setup, requests: Sequence[serve.Request], *, concurrency: int,
              prefix: bool, workload: str, label: str,
              warm_prompts: Sequence[list[int]] = (),
              hot_backend: str = "paged") -> tuple[dict, list]:
    """Warm-up on a throwaway server (same shapes), then the timed run on a fresh one.

    ``warm_prompts``: served (one output token each) on the fresh server before the clock
    starts, so their full pages sit committed in the prefix cache, as hot system prompts do in
    a server that has been running. ``hot_backend="arena"`` adds ``arena``: map/unmap calls in
    the second half of the generated tokens (steady state), alias hits, peak mapped bytes."""
    scfg = _serve_config(setup, concurrency, prefix, hot_backend)
    arena = hot_backend == "arena"
    t = time.perf_counter()
    warm_compiles = {k: _COMPILES[k] for k in ("n", "s")}
    warm = serve.Server(params, setup.model, scfg)
    warm.generate([serve.Request(prompt=list(range(1, setup.page_size + 2)), max_new_tokens=2,
                                 eos_token_ids=[])])
    if arena:
        warm.manager.shutdown()   # its reservation, before the timed run's
    del warm
    gc.collect()   # its pool (a cycle through the manager's observer) before the next one
    warmup_s = time.perf_counter() - t
    warm_compiles = {k: _COMPILES[k] - v for k, v in warm_compiles.items()}

    server = serve.Server(params, setup.model, scfg)
    mgr = server.manager
    window = capture = None
    if setup.profile_dir and hot_backend == "paged":
        capture = loop_profile.ProgramCapture(server)
        window = loop_profile.ProfileWindow(
            loop_profile.profile_dir(setup.profile_dir, f"{label} chunk {setup.prefill_chunk}"
                                     + (f" tp {setup.tensor_parallel}"
                                        if setup.tensor_parallel > 1 else "")),
            setup.profile_steps,
            min(concurrency, len(requests)))
    if warm_prompts:
        server.generate([serve.Request(prompt=list(p), max_new_tokens=1, eos_token_ids=[])
                         for p in warm_prompts])
    server.step_records.clear()
    waits0 = _fence_waits(mgr)
    total = sum(r.max_new_tokens for r in requests)
    pool = mgr.device_capacity_pages
    progress = _Progress(label, total)
    n_compiles = _COMPILES["n"]
    for r in requests:
        server.submit(r)
    outs: dict[int, serve.RequestOutput] = {}
    peak_pages = peak_active = steps = 0
    decode_ms: list[float] = []
    step_ms: list[float] = []
    paused = 0.0
    arena_half: dict | None = None
    arena_peak = 0
    t0 = time.perf_counter()
    while server.has_work():
        n_dec = server.counters["decode_steps"]
        if window is not None:   # starting the trace is outside the clock
            ts = time.perf_counter()
            window.before(server)
            paused += time.perf_counter() - ts
        ts = time.perf_counter()
        for o in server.step():
            outs[o.request_id] = o
        dt = time.perf_counter() - ts
        if window is not None:   # stopping it (and writing the trace) too
            te = time.perf_counter()
            window.after(server)
            paused += time.perf_counter() - te
        step_ms.append(dt * 1e3)
        if server.counters["decode_steps"] > n_dec:
            decode_ms.append(dt * 1e3)
        steps += 1
        if steps % 4 == 1:   # outside the clock
            ts = time.perf_counter()
            peak_pages = max(peak_pages, pool - mgr.num_obtainable_pages())   # referenced
            peak_active = max(peak_active, server.num_running)
            progress(server.counters["generated_tokens"])
            if arena:
                a = mgr.arena.stats()
                arena_peak = max(arena_peak, a.mapped_bytes)
                if arena_half is None and server.counters["generated_tokens"] * 2 >= total:
                    arena_half = dataclasses.asdict(a)
            paused += time.perf_counter() - ts
    seconds = time.perf_counter() - t0 - paused
    compiles = (n_compiles, _COMPILES["n"])
    if window is not None:
        window.stop(server)
    rep = server.report()
    waits = {k: v - waits0[k] for k, v in _fence_waits(mgr).items()}
    records = server.step_records
    traced = (set(range(window.indices[0] - 1, window.indices[-1] + 2))
              if window is not None and window.indices else set())
    loop = loop_profile.loop_stats(records, min(concurrency, len(requests)), seconds, traced)
    extra_profile: dict[str, Any] = {}
    if window is not None:
        extra_profile["profile"] = (
            loop_profile.step_breakdown(window, records, capture, params)
            if window.state == "done" else {"error": "the run ended before the window began"})
    page_bytes = (2 * setup.model.num_hidden_layers * setup.page_size
                  * setup.model.num_key_value_heads * setup.model.head_dim
                  * setup.paged_kv_itemsize)
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    extra: dict[str, Any] = {"hot_backend": hot_backend,
                             "kv_bytes_used_peak": peak_pages * page_bytes}
    if not arena:   # what one device holds (KVCacheConfig: per device under a mesh)
        extra.update(device_page_bytes=list(mgr.config.device_page_bytes()),
                     device_pool_bytes=mgr.config.device_pool_bytes())
    if arena:
        a = dataclasses.asdict(mgr.arena.stats())
        half = arena_half or a
        extra.update(
            arena_steady_map_calls=a["num_map_calls"] - half["num_map_calls"],
            arena_steady_unmap_calls=a["num_unmap_calls"] - half["num_unmap_calls"],
            arena_map_calls=a["num_map_calls"], arena_unmap_calls=a["num_unmap_calls"],
            arena_alias_hits=a["num_alias_hits"], arena_adoptions=a["num_adoptions"],
            arena_partial_aliases=a["num_partial_aliases"], arena_aliased_bytes=a["aliased_bytes"],
            arena_mapped_bytes_peak=max(arena_peak, a["mapped_bytes"]),
            arena_budget_bytes=scfg.arena.budget_bytes,
            kv_bytes_used_peak=max(arena_peak, a["mapped_bytes"]))
    res = _summary(
        label, hot_backend, workload, concurrency, requests, [outs[i] for i in sorted(outs)],
        seconds, compiles, warmup_s, decode_ms, prefix_reuse=prefix,
        prefix_hit_rate=(sum(o.prefix_hit_tokens for o in outs.values())
                         / max(1, sum(len(r.prompt) for r in requests))),
        peak_running=peak_active,
        pages_used_peak=peak_pages, pool_pages=pool, page_size=setup.page_size,
        cache_bytes=pool * page_bytes,
        capacity_seqs=mgr.max_num_sequences(longest), capacity_seq_len=longest,
        steps=rep["steps"], mixed_steps=rep["mixed_steps"], suspends=rep["suspends"],
        recomputes=rep["recomputes"], step_ms_p50=_pct(step_ms, 50),
        pages_per_tier=rep["pages"], pages_offloaded=rep["pages_offloaded"],
        pages_onboarded=rep["pages_onboarded"], host_bytes=setup.host_bytes,
        prefill_chunk_tokens=setup.prefill_chunk, step_tokens=setup.step_tokens,
        overlap=scfg.overlap, kv_dtype=rep["kv_dtype"], tensor_parallel=setup.tensor_parallel,
        compiled_programs=len(rep["compiled_shapes"]), warmup_compiles=warm_compiles["n"],
        warmup_compile_s=warm_compiles["s"], loop=loop, fence_waits=waits, **extra_profile,
        **extra)
    done = [outs[i] for i in sorted(outs)]
    res["generated_digests"] = loop_profile.digests(done)   # runs of a chunk sweep compare
    if arena:
        mgr.shutdown()
    del server, mgr
    gc.collect()
    return res, done


def _fence_waits(mgr: Any) -> dict[str, float]:
    """How often, and how long, the host waited for dispatched device work: allocations waiting
    for the step that last read freed pages, host-tier slots waiting for a migration, and waits
    for write-back-ahead copies (their tickets). In the overlapped loop each such wait is a
    bubble (the host prepares the next step late). Also the write-back-ahead counters
    (``--offload-ahead-pages``): transactions, pages, encode calls on the side stream, and
    failed copies."""
    st = mgr.stats()
    sto = st.get("storage", {})
    return dict(allocation_waits=st.get("num_fence_waits", 0),
                allocation_wait_s=st.get("fence_wait_seconds", 0.0),
                host_slot_waits=sto.get("num_host_fence_waits", 0),
                host_slot_wait_s=sto.get("host_fence_wait_seconds", 0.0),
                offload_ahead_waits=st.get("num_offload_ahead_waits", 0),
                offload_ahead_wait_s=st.get("offload_ahead_wait_seconds", 0.0),
                offload_ahead_moves=st.get("num_offloads_ahead", 0),
                offload_ahead_pages=st.get("num_offloaded_ahead_pages", 0),
                side_stream_calls=sto.get("num_side_stream_calls", 0),
                offload_ahead_failures=st.get("num_offload_ahead_failures", 0))


def run_dense(params: Any, setup: Setup, requests: Sequence[serve.Request], *, batch: int,
              max_len: int, workload: str, label: str) -> tuple[dict, list]:
    srv = dense.DenseServer(params, setup.model, batch=batch, max_len=max_len,
                            prefill_tokens=setup.step_tokens,
                            prefill_bucket=setup.dense_prefill_bucket,
                            record_logits=setup.record_logits)
    t = time.perf_counter()
    srv.warmup([len(r.prompt) for r in requests])
    warmup_s = time.perf_counter() - t
    progress = _Progress(label, sum(r.max_new_tokens for r in requests))
    srv.on_step = lambda: progress(srv.counters["generated_tokens"])
    n_compiles = _COMPILES["n"]
    t0 = time.perf_counter()
    outs = srv.generate(requests)
    seconds = time.perf_counter() - t0
    res = _summary(label, "dense", workload, batch, requests, outs, seconds,
                   (n_compiles, _COMPILES["n"]), warmup_s, srv.decode_ms, prefix_reuse=False,
                   prefix_hit_rate=0.0, peak_running=min(batch, len(requests)),
                   pages_used_peak=None, pool_pages=None, page_size=None,
                   cache_bytes=srv.cache_bytes, capacity_seqs=batch, capacity_seq_len=max_len,
                   max_len=max_len)
    del srv
    gc.collect()
    return res, outs


# ---------------------------------------------------------------------------------------------
# The benchmark.


def _rel_l2(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.linalg.norm(x - y) / max(float(np.linalg.norm(y)), 1e-30))


def _agreement(a: Sequence[serve.RequestOutput],
               b: Sequence[serve.RequestOutput]) -> dict[str, Any]:
    """Requests with identical generations, identical first tokens, and (recorded logits) the
    largest relative L2 distance between the logits of requests with identical generations."""
    pairs = list(zip(a, b))
    same = [x.generated_ids == y.generated_ids for x, y in pairs]
    first = sum(bool(x.generated_ids) and x.generated_ids[:1] == y.generated_ids[:1]
                for x, y in pairs)
    rel = [_rel_l2(x.logits, y.logits) for (x, y), s in zip(pairs, same)
           if s and x.logits is not None and y.logits is not None]
    return {"requests": len(pairs), "identical": sum(same), "identical_first_token": first,
            "max_logits_rel_l2": max(rel) if rel else None}


def _fmt_result(r: dict) -> str:
    extra = ""
    if r["path"] == "paged":
        extra = (f", prefix hit {r['prefix_hit_rate']:.1%}, pages used {r['pages_used_peak']}"
                 f"/{r['pool_pages']}")
        if r["recomputes"] or r["suspends"]:
            extra += f", SUSPENDS {r['suspends']} RECOMPUTES {r['recomputes']}"
    flag = ""
    if r["compiles_in_timed_region"]:
        flag = (f"  WARNING: {r['compiles_in_timed_region']} compile(s) inside the timed region: "
                + ", ".join(r.get("compiled_in_timed_region", [])))
    return (f"  {r['name']}: {r['output_tokens_per_s']:,.0f} output tok/s, {r['requests']} "
            f"requests in {r['seconds']:.2f} s, TTFT p50 {r['ttft_p50_s']:.3f} s p90 "
            f"{r['ttft_p90_s']:.3f} s, ITL p50 {r['itl_p50_ms']:.1f} ms p90 "
            f"{r['itl_p90_ms']:.1f} ms, decode step {r['decode_step_ms_p50']:.2f} ms{extra} "
            f"(warm-up {r['warmup_s']:.1f} s){flag}")


def copy_bandwidth(nbytes: int | None = None, repeats: int = 10) -> dict[str, float]:
    """Device copy bandwidth (bytes read + written per second) of a large elementwise copy
    (``x ^ 1`` over uint32, which XLA cannot elide), median of ``repeats`` after warm-up: the
    practical ceiling of a memory-bound step on this device. ``nbytes``: 4 GiB on a GPU, 64 MiB
    on a CPU."""
    if nbytes is None:
        nbytes = (64 << 20) if jax.default_backend() == "cpu" else (4 << 30)
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    flip = jax.jit(lambda a: a ^ jnp.uint32(1))
    for _ in range(2):
        x = flip(x).block_until_ready()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        x = flip(x).block_until_ready()
        samples.append(time.perf_counter() - t)
    t = float(np.median(samples))
    del x
    return {"bytes": float(nbytes), "seconds": t, "bytes_per_s": 2 * nbytes / t}


def roofline(setup: Setup, weight_bytes: int, res: dict, requests: Sequence[serve.Request],
             copy_bytes_per_s: float) -> dict[str, float]:
    """What one decode step of ``res`` must move at least: every weight once, plus the K/V of
    the batch (``min(concurrency, requests)`` sequences at the workload's mean context during
    decode, prompt + half the output), against the measured copy bandwidth. With tensor
    parallelism (``res["tensor_parallel"]`` = n), one device's share against one device's
    bandwidth: ``weight_bytes`` is then the weights on one device, the K/V its KV heads
    (``tp.kv_heads / n``)."""
    c = setup.model
    itemsize = (setup.paged_kv_itemsize if res["path"] == "paged"
                else jnp.dtype(c.jnp_dtype).itemsize)
    n = res.get("tensor_parallel") or 1
    heads = tp.kv_heads(c, n) // n if n > 1 else c.num_key_value_heads
    per_token = 2 * c.num_hidden_layers * heads * c.head_dim * itemsize
    batch = min(res["concurrency"], len(requests))
    context = float(np.mean([len(r.prompt) + r.max_new_tokens / 2 for r in requests]))
    kv = batch * context * per_token
    step_bytes = weight_bytes + kv
    ideal_ms = step_bytes / copy_bytes_per_s * 1e3
    step_ms = res["decode_step_ms_p50"] or res.get("step_ms_p50") or 0.0
    return {"weight_bytes": float(weight_bytes), "kv_bytes": kv, "batch": batch,
            "mean_context": context, "step_bytes": step_bytes,
            "copy_bytes_per_s": copy_bytes_per_s, "roofline_step_ms": ideal_ms,
            "measured_step_ms": step_ms,
            "fraction_of_roofline": ideal_ms / step_ms if step_ms else 0.0}


def _fmt_roofline(name: str, r: dict) -> str:
    return (f"  roofline {name}: a decode step must move {r['step_bytes'] / 1e9:.1f} GB "
            f"(weights {r['weight_bytes'] / 1e9:.1f} + K/V {r['kv_bytes'] / 1e9:.1f}: batch "
            f"{r['batch']} x {r['mean_context']:.0f} tokens); copy bandwidth "
            f"{r['copy_bytes_per_s'] / 1e12:.2f} TB/s (r+w) -> {r['roofline_step_ms']:.2f} ms; "
            f"measured {r['measured_step_ms']:.2f} ms = {r['fraction_of_roofline']:.2f}x of "
            "the roofline")


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: one sweep value's params, the largest concurrency each fits, the scaling.


def tp_params(params: Any, model: llama.LlamaConfig, n: int) -> Any:
    """The paged runs' params at ``--tensor-parallel n``: ``params`` (n = 1), or their shards on
    the first ``n`` devices (``tp.shard_params``, done once per value: the servers of the runs
    get them as they are)."""
    return params if n == 1 else tp.shard_params(params, model, tp.make_mesh(n))


def device_weight_bytes(params: Any, device: Any = None) -> int:
    """Bytes of ``params`` held on ``device`` (default the first device): each leaf's shard
    there (the whole leaf when it lives on that device alone; 0 for a leaf elsewhere)."""
    device = jax.devices()[0] if device is None else device
    total = 0
    for x in jax.tree_util.tree_leaves(params):
        sharding = getattr(x, "sharding", None)
        if sharding is None or device not in sharding.device_set:
            continue
        total += int(np.prod(sharding.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize
    return total


def device_memory_limit(n: int) -> int | None:
    """The smallest allocator limit (``memory_stats()["bytes_limit"]``: the memory XLA may use,
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the device's) over the first ``n`` devices; None where
    a device reports none (the CPU)."""
    limits = []
    for d in jax.devices()[:n]:
        try:
            st = d.memory_stats() or {}
        except Exception:  # noqa: BLE001
            st = {}
        if "bytes_limit" not in st:
            return None
        limits.append(int(st["bytes_limit"]))
    return min(limits) if limits else None


def max_concurrency(memory_bytes: int, weight_bytes: int, page_bytes: int, pages_per_seq: int,
                    kv_fraction: float = KV_MEMORY_FRACTION) -> dict[str, Any]:
    """The largest concurrency ``c`` whose pool fits one device (see the module doc): the K/V
    budget is ``kv_fraction x (memory_bytes - weight_bytes)``; the pool of ``c`` sequences is
    sized as the run sizes it, ``c x (pages_per_seq + 1)`` pages (every sequence at its longest,
    plus a page of slack) plus the null page, each of ``page_bytes`` (one device's bytes of a
    page, K and V of every layer, summed over layer groups). All arguments per device, bytes."""
    budget = int(kv_fraction * (memory_bytes - weight_bytes))
    pages = max(0, budget // page_bytes - 1)
    return {"memory_bytes": memory_bytes, "weight_bytes_per_device": weight_bytes,
            "page_bytes_per_device": page_bytes, "kv_fraction": kv_fraction,
            "kv_budget_bytes": budget, "pool_pages_fit": pages,
            "pages_per_seq": pages_per_seq,
            "max_concurrency": pages // (pages_per_seq + 1)}


def tp_capacity(setup: Setup, n: int, weight_bytes: int, res: dict[str, Any],
                memory_bytes: int | None, kv_fraction: float) -> dict[str, Any]:
    """:func:`max_concurrency` at ``--tensor-parallel n`` from the numbers of that value's part
    (``res``: its ``bench`` output; the page bytes its paged runs' ``KVCacheConfig`` reported per
    device) and ``weight_bytes`` (its params on one device)."""
    row: dict[str, Any] = {"tensor_parallel": n, "max_len": setup.max_total_len,
                           "page_size": setup.page_size}
    pages = [r["device_page_bytes"] for r in res["results"] if r.get("device_page_bytes")]
    if memory_bytes is None:
        row["error"] = ("the device reports no allocator limit (the CPU): --device-memory-gib "
                        "gives one")
    elif not pages:
        row["error"] = "no paged run completed at this value"
    else:
        row.update(max_concurrency(memory_bytes, weight_bytes, int(sum(pages[0])),
                                   setup.pages_per_seq, kv_fraction))
    return row


def format_capacity(rows: Sequence[dict[str, Any]], source: str) -> str:
    """A markdown table of :func:`tp_capacity` rows."""
    ok = [r for r in rows if "error" not in r]
    head = ("Largest concurrency per --tensor-parallel value (per device: K/V budget = "
            f"{ok[0]['kv_fraction']:g} x (memory - weights); pool = concurrency x (pages per "
            "sequence + 1) + the null page; a sequence at its longest, input + output = "
            f"{ok[0]['max_len']} tokens = {ok[0]['pages_per_seq']} pages of "
            f"{ok[0]['page_size']}; memory: {source}):" if ok else
            "Largest concurrency per --tensor-parallel value:")
    lines = [head, "| TP | memory GiB | weights GiB / device | K/V bytes / page / device | "
             "K/V budget GiB | pages | largest concurrency |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tensor_parallel']} | | | | | | n/a: {r['error']} |")
            continue
        lines.append(f"| {r['tensor_parallel']} | {r['memory_bytes'] / 2**30:.2f} | "
                     f"{r['weight_bytes_per_device'] / 2**30:.2f} | "
                     f"{r['page_bytes_per_device']:,} | {r['kv_budget_bytes'] / 2**30:.2f} | "
                     f"{r['pool_pages_fit']:,} | {r['max_concurrency']:,} |")
    return "\n".join(lines)


def collectives_share(res: dict[str, Any], kind: str = "decode") -> dict[str, float] | None:
    """From a profiled run (``--profile``): the collectives' device ms per ``kind`` step, their
    share of the step (device ops, idle and host gap: the breakdown's total) and of the device's
    busy time (its ops); None without a profile of such steps."""
    k = res.get("profile", {}).get("kinds", {}).get(kind)
    if k is None:
        return None
    ms = k["ms_per_step"]
    busy = sum(ms[c] for c in _profile.CATEGORIES)
    coll = ms[_profile.COLLECTIVES]
    return {"ms_per_step": coll, "steps": k["steps"], "share_of_step": coll / ms["total"]
            if ms["total"] else 0.0, "share_of_busy": coll / busy if busy else 0.0}


def tp_scaling(results: Sequence[dict[str, Any]],
               agreement: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per paged run of a ``--tensor-parallel`` sweep and value: output tok/s and its ratio to
    the first value's (TP 1 when given first), decode step ms, TTFT/ITL p50, the collectives'
    share of the decode step (with ``--profile``) and the requests whose tokens equal the first
    value's."""
    same = {(a["a"], a["b"]): a for a in agreement}
    first: dict[str, dict] = {}
    rows = []
    for r in results:
        if r["path"] != "paged":
            continue
        run = loop_profile.sweep_base(r["name"])
        ref = first.setdefault(run, r)
        a = same.get((ref["name"], r["name"]))
        rows.append({"run": run, "name": r["name"], "tensor_parallel": r["tensor_parallel"],
                     "reference": ref["name"], "output_tokens_per_s": r["output_tokens_per_s"],
                     "over_reference": (r["output_tokens_per_s"]
                                        / max(ref["output_tokens_per_s"], 1e-9)),
                     "decode_step_ms_p50": r["decode_step_ms_p50"],
                     "ttft_p50_s": r["ttft_p50_s"], "itl_p50_ms": r["itl_p50_ms"],
                     "collectives": collectives_share(r),
                     "identical": None if a is None else a["identical"],
                     "requests": r["requests"]})
    return rows


def format_tp_scaling(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of :func:`tp_scaling` (the target: ``TARGET_TP2_OVER_TP1`` at TP 2
    against TP 1)."""
    lines = [f"Tensor parallelism (output tok/s against the first --tensor-parallel value on the "
             f"same requests; target >= {TARGET_TP2_OVER_TP1}x at TP 2 over TP 1; collectives: "
             "all-reduce / all-gather device ms per decode step from --profile, shard 0, and "
             "their share of the step / of the device's busy time):",
             "| run | TP | output tok/s | / first | target | decode step ms | TTFT p50 s | "
             "ITL p50 ms | collectives ms / decode step | share of step / busy | tokens = first |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        c = r["collectives"]
        ref_tp = next((x["tensor_parallel"] for x in rows if x["name"] == r["reference"]), 0)
        target = ""
        if r["tensor_parallel"] == 2 and ref_tp == 1:
            target = ("met" if r["over_reference"] >= TARGET_TP2_OVER_TP1 else "NOT met")
        same = "" if r["identical"] is None else f"{r['identical']}/{r['requests']}"
        lines.append(
            f"| {r['run']} | {r['tensor_parallel']} | {r['output_tokens_per_s']:,.0f} | "
            f"{r['over_reference']:.2f}x | {target} | {r['decode_step_ms_p50']:.2f} | "
            f"{r['ttft_p50_s']:.3f} | {r['itl_p50_ms']:.1f} | "
            + (f"{c['ms_per_step']:.3f} | {c['share_of_step']:.1%} / {c['share_of_busy']:.1%}"
               if c else "- | -") + f" | {same} |")
    return "\n".join(lines)


def bench(setup: Setup, params: Any, *, min_identical: float | None = None,
          max_logits_rel_l2: float | None = None, log=_log,
          paged_params: Any = None) -> dict[str, Any]:
    """Runs every configuration of ``setup``; returns results, comparisons and agreement. With
    ``min_identical``, every pair of runs over the same requests must generate identical tokens
    for at least that fraction of the requests, and with ``max_logits_rel_l2`` (and
    ``setup.record_logits``) the logits of identical generations must be that close; else
    RuntimeError. ``paged_params``: the paged runs' params when they differ from the dense
    runs' (``tp.shard_params``' output for ``setup.tensor_parallel`` devices, sharded once for
    every server of the run); default ``params``."""
    results: list[dict] = []
    comparisons: list[dict] = []
    agreements: list[dict] = []
    errors: list[dict] = []
    cmax = max(setup.concurrencies)
    n_random = max(int(round(c * setup.requests_factor)) for c in setup.concurrencies)
    rand = random_requests(setup, n_random)
    first_seen: dict[int, tuple[str, Any]] = {}   # random request -> (run, its output)
    paged_params = params if paged_params is None else paged_params
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    paged_weight_bytes = device_weight_bytes(paged_params)   # one device's (all without TP)
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw['bytes_per_s'] / 1e12:.3f} TB/s (read + write, "
        f"{bw['bytes'] / 2**30:.2f} GiB copied in {bw['seconds'] * 1e3:.2f} ms)")

    def record(res: dict, outs: list, requests: Sequence[serve.Request]) -> None:
        res["roofline"] = roofline(setup, weight_bytes if res["path"] == "dense"
                                   else paged_weight_bytes, res, requests, bw["bytes_per_s"])
        results.append(res)
        log(_fmt_result(res))
        log(_fmt_roofline(res["name"], res["roofline"]))
        if "loop" in res:
            log(loop_profile.format_loop(res["name"], res["loop"]))
        if "fence_waits" in res:
            w = res["fence_waits"]
            log(f"  host waits for the device inside step(): {w['allocation_waits']} allocations "
                f"({w['allocation_wait_s']:.2f} s), {w['host_slot_waits']} host-tier slots "
                f"({w['host_slot_wait_s']:.2f} s), {w['offload_ahead_waits']} write-back-ahead "
                f"copies ({w['offload_ahead_wait_s']:.2f} s)")
            if w["offload_ahead_moves"]:
                log(f"  write-back ahead: {w['offload_ahead_moves']} moves, "
                    f"{w['offload_ahead_pages']} pages, {w['side_stream_calls']} encode calls on "
                    f"the side stream, {w['offload_ahead_failures']} failed")
        if "error" in res.get("profile", {}):
            log(f"  profile {res['name']}: {res['profile']['error']}")
        elif "profile" in res:
            log(loop_profile.format_breakdown(res["name"], res["profile"]))
        distinct = {t for o in outs for t in o.generated_ids}
        if len(distinct) < 2 and res["generated_tokens"] > 1:
            log(f"  WARNING: {res['name']} generated only token {sorted(distinct)} "
                "(non-finite logits?)")

    def agree(label_a: str, outs_a: list, label_b: str, outs_b: list) -> None:
        a = _agreement(outs_a, outs_b)
        a.update(a=label_a, b=label_b)
        agreements.append(a)
        rel = a["max_logits_rel_l2"]
        log(f"    tokens {label_a} vs {label_b}: {a['identical']}/{a['requests']} requests "
            f"identical, {a['identical_first_token']}/{a['requests']} first tokens"
            + ("" if rel is None else f"; logits rel-L2 <= {rel:.1e}"))
        if min_identical is not None and a["identical"] < min_identical * a["requests"]:
            bad = next(i for i, (x, y) in enumerate(zip(outs_a, outs_b))
                       if x.generated_ids != y.generated_ids)
            raise RuntimeError(
                f"{label_a} and {label_b} generated different greedy tokens for "
                f"{a['requests'] - a['identical']} of {a['requests']} requests; request {bad}: "
                f"{outs_a[bad].generated_ids} vs {outs_b[bad].generated_ids}")
        if max_logits_rel_l2 is not None and rel is not None and rel > max_logits_rel_l2:
            raise RuntimeError(f"{label_a} and {label_b} generated the same tokens but their "
                               f"logits differ by rel-L2 {rel:.2e} > {max_logits_rel_l2:.0e}")

    def against_earlier(label: str, generated: list) -> None:
        """Compares with the first run that generated each of these random requests."""
        by_run: dict[str, tuple[list, list]] = {}
        for i, g in enumerate(generated):
            if i in first_seen:
                run, ref = first_seen[i]
                by_run.setdefault(run, ([], []))
                by_run[run][0].append(ref)
                by_run[run][1].append(g)
            else:
                first_seen[i] = (label, g)
        for run, (ref, got) in by_run.items():
            agree(run, ref, label, got)

    def attempt(label: str, fn, reqs, **kwargs: Any) -> tuple[dict | None, list]:
        """Runs one configuration; a failure (out of memory, a kernel error) is logged and
        recorded, and the other configurations still run."""
        try:
            res, outs = fn(paged_params if fn is run_paged else params, setup, reqs,
                           label=label, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported in the output, exit status 1 at the end
            tb = traceback.format_exc().strip().splitlines()
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")[:600]
            log(f"  ERROR {label}: {msg}\n    " + "\n    ".join(tb[-6:]))
            errors.append({"name": label, "error": msg})
            res, outs = None, []
        gc.collect()
        if res is not None:
            record(res, outs, reqs)
            if res["workload"] == "random":
                against_earlier(label, outs)
        return res, outs

    big: dict[str, dict | None] = {"run": None}   # the paged run at the largest concurrency

    def beside(pres: dict | None, what: str, reqs, **kwargs: Any) -> None:
        """The other hot backends on the same requests as the paged run ``pres``."""
        for hb in setup.hot_backends:
            if hb == "paged":
                continue
            res, _ = attempt(f"{hb} {what}", run_paged, reqs, hot_backend=hb, **kwargs)
            if pres is not None and res is not None:
                comparisons.append(dict(
                    kind=f"{hb}_vs_paged", paged=pres["name"], other=res["name"],
                    tokens_per_s_over_paged=(res["output_tokens_per_s"]
                                             / pres["output_tokens_per_s"]),
                    target=TARGET_ARENA_OVER_PAGED,
                    kv_bytes_used_peak_over_paged=(res["kv_bytes_used_peak"]
                                                   / max(pres["kv_bytes_used_peak"], 1)),
                    steady_map_calls=res.get("arena_steady_map_calls"),
                    steady_unmap_calls=res.get("arena_steady_unmap_calls"),
                    alias_hits=res.get("arena_alias_hits")))
                log(f"    {res['name']} / {pres['name']}: "
                    f"{comparisons[-1]['tokens_per_s_over_paged']:.3f}x tokens/s, "
                    f"{comparisons[-1]['kv_bytes_used_peak_over_paged']:.2f}x K/V bytes, "
                    f"steady map/unmap {res.get('arena_steady_map_calls')}/"
                    f"{res.get('arena_steady_unmap_calls')}, alias hits "
                    f"{res.get('arena_alias_hits')}")

    def random_rows() -> None:
        for c in sorted(setup.concurrencies):
            reqs = rand[:int(round(c * setup.requests_factor))]
            log(f"random {setup.input_len}/{setup.output_len}, concurrency {c}, {len(reqs)} "
                f"requests{_mem_gib()}")
            pres, _ = attempt(f"paged random c{c}", run_paged, reqs, concurrency=c,
                              prefix=True, workload="random")
            if c == cmax:
                big["run"] = pres
            beside(pres, f"random c{c}", reqs, concurrency=c, prefix=True, workload="random")
            if setup.run_dense:
                dres, _ = attempt(f"dense random c{c}", run_dense, reqs, batch=c,
                                  max_len=setup.input_len + setup.output_len,
                                  workload="random")
                if pres is not None and dres is not None:
                    ratio = pres["output_tokens_per_s"] / dres["output_tokens_per_s"]
                    comparisons.append(dict(
                        kind="equal_batch", concurrency=c, paged=pres["name"],
                        dense=dres["name"], paged_over_dense=ratio,
                        decode_step_time_dense_over_paged=(
                            dres["decode_step_ms_p50"] / max(pres["decode_step_ms_p50"], 1e-9)),
                        target=TARGET_PAGED_OVER_DENSE))

    def shared() -> None:
        sreqs = shared_requests(setup)
        cs = setup.shared_concurrency
        what = (f"~{setup.shared_prompt_len} + suffixes to {setup.shared_total_len}"
                if setup.shared_total_len is not None
                else f"~{setup.shared_prompt_len} + {setup.shared_suffix_len}-token suffixes")
        host = f", host tier {setup.host_bytes / 2**30:.2f} GiB" if setup.host_bytes else ""
        log(f"shared prefix: {setup.shared_prompts} system prompts of {what} tokens, output "
            f"{setup.shared_output_len}, concurrency {cs}, {len(sreqs)} requests{host}"
            f"{_mem_gib()}")
        runs: dict[str, tuple[dict | None, list]] = {}
        if "on" in setup.shared_runs:
            runs["on"] = attempt(f"paged shared c{cs} prefix on", run_paged, sreqs,
                                 concurrency=cs, prefix=True, workload="shared")
            beside(runs["on"][0], f"shared c{cs} prefix on", sreqs, concurrency=cs,
                   prefix=True, workload="shared")
        if "warm" in setup.shared_runs:
            runs["warm"] = attempt(f"paged shared c{cs} prefix on, warm", run_paged, sreqs,
                                   concurrency=cs, prefix=True, workload="shared",
                                   warm_prompts=shared_system_prompts(setup))
        if "off" not in setup.shared_runs:
            return
        off, goff = attempt(f"paged shared c{cs} prefix off", run_paged, sreqs, concurrency=cs,
                            prefix=False, workload="shared")
        for run, gen in runs.values():
            if run is None or off is None:
                continue
            agree(run["name"], gen, off["name"], goff)
            comparisons.append(dict(
                kind="prefix_reuse", concurrency=cs, on=run["name"], off=off["name"],
                tokens_per_s_on_over_off=run["output_tokens_per_s"] / off["output_tokens_per_s"],
                ttft_p50_off_over_on=off["ttft_p50_s"] / max(run["ttft_p50_s"], 1e-9),
                prefix_hit_rate=run["prefix_hit_rate"],
                pages_used_on_over_off=run["pages_used_peak"] / max(off["pages_used_peak"], 1)))

    if setup.run_shared and setup.shared_first:
        shared()
    random_rows()
    if setup.run_shared and not setup.shared_first:
        shared()
    big = big["run"]

    # Equal memory: the largest concurrency's paged pool against a dense cache of the same bytes.
    if big is not None:
        M = setup.equal_memory_max_len
        dense_fit = int(big["cache_bytes"] // dense.dense_cache_bytes(setup.model, 1, M))
        eq = dict(kind="equal_memory", cache_bytes=big["cache_bytes"], dense_max_len=M,
                  dense_sequences=dense_fit, paged_seq_len=big["capacity_seq_len"],
                  paged_sequences=big["capacity_seqs"], paged_run=big["name"],
                  paged_sequences_over_dense=big["capacity_seqs"] / max(dense_fit, 1))
        log(f"equal memory ({big['cache_bytes'] / 2**30:.2f} GiB of K/V): dense max_len {M} "
            f"holds {dense_fit} sequences; the paged pool holds {big['capacity_seqs']} sequences "
            f"of {big['capacity_seq_len']} tokens (KVCacheManager.max_num_sequences)")
        if setup.equal_memory_run and setup.run_dense and dense_fit >= 1:
            reqs = rand[:dense_fit] if dense_fit <= len(rand) else random_requests(setup,
                                                                                   dense_fit)
            dres, _ = attempt(f"dense random c{dense_fit} max_len {M}", run_dense, reqs,
                              batch=dense_fit, max_len=M, workload="random")
            if dres is not None:
                eq.update(dense_run=dres["name"], paged_over_dense=(
                    big["output_tokens_per_s"] / dres["output_tokens_per_s"]))
        comparisons.append(eq)
    return {"setup": dataclasses.asdict(setup), "results": results, "comparisons": comparisons,
            "agreement": agreements, "errors": errors}


# ---------------------------------------------------------------------------------------------
# Output.


def markdown(out: dict[str, Any]) -> str:
    lines = ["| run | path | workload | batch | requests | output tok/s | TTFT p50 s | "
             "TTFT p90 s | ITL p50 ms | ITL p90 ms | decode step ms | step / roofline | "
             "prefix hit | pages used / pool | K/V GiB |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in out["results"]:
        managed = r["path"] in ("paged", "arena")
        pages = (f"{r['pages_used_peak']} / {r['pool_pages']}" if managed
                 else f"dense max_len {r['max_len']}")
        hit = f"{r['prefix_hit_rate']:.1%}" if managed else "-"
        path = r["path"] + (" (fp8 K/V)" if r.get("kv_dtype") == "float8_e4m3fn" else "")
        lines.append(
            f"| {r['name']} | {path} | {r['workload']} | {r['concurrency']} | "
            f"{r['requests']} | {r['output_tokens_per_s']:,.0f} | {r['ttft_p50_s']:.3f} | "
            f"{r['ttft_p90_s']:.3f} | {r['itl_p50_ms']:.1f} | {r['itl_p90_ms']:.1f} | "
            f"{r['decode_step_ms_p50']:.2f} | {r['roofline']['fraction_of_roofline']:.2f}x | "
            f"{hit} | {pages} | {r['cache_bytes'] / 2**30:.2f} |")
    for e in out.get("errors", []):
        lines.append(f"| {e['name']} | FAILED | | | | | | | | | | | | {e['error'][:120]} | |")
    lines += ["", "| run | step bytes (weights + K/V) | copy TB/s (r+w) | roofline ms | "
              "measured ms | fraction |", "|---|---:|---:|---:|---:|---:|"]
    for r in out["results"]:
        f = r["roofline"]
        lines.append(f"| {r['name']} | {f['step_bytes'] / 1e9:.1f} GB "
                     f"({f['weight_bytes'] / 1e9:.1f} + {f['kv_bytes'] / 1e9:.1f}) | {f['copy_bytes_per_s'] / 1e12:.2f} | "
                     f"{f['roofline_step_ms']:.2f} | {f['measured_step_ms']:.2f} | "
                     f"{f['fraction_of_roofline']:.2f}x |")
    tiers = [r for r in out["results"] if r.get("pages_per_tier")]
    if tiers:
        lines += ["", "| run | tier | capacity | referenced | cached | free | offloaded / "
                  "onboarded | offloaded ahead: moves / pages (side-stream calls) |",
                  "|---|---|---:|---:|---:|---:|---|---|"]
        for r in tiers:
            w = r.get("fence_waits", {})
            for tier, c in r["pages_per_tier"].items():
                moved = ahead = ""
                if tier == "device":
                    moved = f"{r['pages_offloaded']} / {r['pages_onboarded']}"
                    ahead = (f"{w.get('offload_ahead_moves', 0)} / "
                             f"{w.get('offload_ahead_pages', 0)} "
                             f"({w.get('side_stream_calls', 0)})")
                lines.append(f"| {r['name']} | {tier} | {c['capacity']} | {c['referenced']} | "
                             f"{c['cached']} | {c['free']} | {moved} | {ahead} |")
    lines += ["", "| comparison | value | note |", "|---|---:|---|"]
    for c in out["comparisons"]:
        if c["kind"] == "equal_batch":
            ok = "met" if c["paged_over_dense"] >= c["target"] else "NOT met"
            lines.append(f"| paged / dense tok/s, equal batch {c['concurrency']} | "
                         f"{c['paged_over_dense']:.2f}x | target >= {c['target']}: {ok}; "
                         f"decode step time dense/paged "
                         f"{c['decode_step_time_dense_over_paged']:.2f}x |")
        elif c["kind"] == "prefix_reuse":
            warm = ", warm cache" if c["on"].endswith("warm") else ""
            lines.append(f"| prefix reuse on{warm} / off tok/s, concurrency {c['concurrency']} | "
                         f"{c['tokens_per_s_on_over_off']:.2f}x | hit rate "
                         f"{c['prefix_hit_rate']:.1%}; TTFT p50 off/on "
                         f"{c['ttft_p50_off_over_on']:.2f}x; pages used on/off "
                         f"{c['pages_used_on_over_off']:.2f} |")
        elif c["kind"] == "arena_vs_paged":
            ok = "met" if c["tokens_per_s_over_paged"] >= c["target"] else "NOT met"
            lines.append(f"| {c['other']} / {c['paged']} tok/s | "
                         f"{c['tokens_per_s_over_paged']:.3f}x | target >= {c['target']}: {ok}; "
                         f"steady-state map/unmap calls {c['steady_map_calls']}/"
                         f"{c['steady_unmap_calls']}; alias hits {c['alias_hits']}; peak K/V "
                         f"bytes arena/paged {c['kv_bytes_used_peak_over_paged']:.2f}x |")
        elif c["kind"] == "equal_memory":
            run = ""
            if "paged_over_dense" in c:
                run = (f"; tok/s {c['paged_run']} / {c['dense_run']}: "
                       f"{c['paged_over_dense']:.2f}x")
            lines.append(f"| sequences in {c['cache_bytes'] / 2**30:.2f} GiB: paged "
                         f"({c['paged_seq_len']} tokens) / dense (max_len {c['dense_max_len']}) | "
                         f"{c['paged_sequences']} / {c['dense_sequences']} = "
                         f"{c['paged_sequences_over_dense']:.2f}x | capacity planning{run} |")
    return "\n".join(lines)


def anchor_line(setup: Setup | None = None) -> str:
    a = ANCHOR
    ratio = a["output_len"] / setup.output_len if setup is not None else 4
    note = (f"; {ratio:g}x our random workload's output length" if ratio != 1
            else "; the trtllm preset is its workload")
    return (f"Anchor: {a['system']}, {a['model']} on {a['gpu']}, {a['input_len']:,}/"
            f"{a['output_len']:,} at concurrency {a['concurrency']}: "
            f"{a['output_tokens_per_s']:,.0f} output tok/s ({a['source']}); H200 ~"
            f"{a['h200_over_h100_bandwidth']}x its memory bandwidth (~"
            f"{a['output_tokens_per_s'] * a['h200_over_h100_bandwidth']:,.0f} tok/s scaled, "
            f"not measured{note})")


# ---------------------------------------------------------------------------------------------
# CLI.


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="concurrency 64 only, 96 shared-prefix requests, no equal-memory run")
    size.add_argument("--tiny", action="store_true",
                      help="a tiny float32 model (CPU, seconds); paged and dense must generate "
                           "identical tokens")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="default",
                   help="default: random 1,024/256 at concurrency 64 and 256 plus the shared-"
                        "prefix set; trtllm: the seed workload (1,024/1,024, concurrency 256, 15 "
                        "system prompts of ~512 + unique suffixes, prefix reuse and a pinned "
                        "host tier on, 2,500 requests, --quick 512), then random 1,024/1,024 "
                        "at concurrency 256, paged and dense")
    p.add_argument("--kv-dtype", choices=sorted(serve.KV_DTYPES), default="auto",
                   help="the paged runs' K/V pools: auto (the model dtype) or fp8 "
                        "(float8_e4m3fn, scales 1.0: the random weights have none); dense "
                        "keeps the model dtype, so paged/dense agreement is reported, not "
                        "enforced, with fp8")
    p.add_argument("--prefill-chunk", type=int, nargs="+", metavar="N",
                   help="paged prompt tokens per step (ServeConfig.prefill_chunk_tokens); the "
                        "step's token budget becomes the largest concurrency + N unless "
                        "--step-tokens is given. Several values: the paged rows run once per "
                        "value (dense and equal memory with the first only) and a table "
                        "compares them (tok/s, TTFT, ITL, mixed-step ms, compiled programs)")
    p.add_argument("--profile", metavar="DIR",
                   help="trace --profile-steps steady-state steps of every paged run with "
                        "jax.profiler (under DIR, one folder per run) and print the device "
                        "time per step kind (decode-only, mixed): weight GEMMs, paged / ragged "
                        "attention, K/V writes, sampling, norms/RoPE/other, host gaps. The "
                        "trace export pauses the loop (outside the clock; TTFT and ITL see it)")
    p.add_argument("--profile-steps", type=int, default=64, metavar="N",
                   help="steps in the --profile window (default 64)")
    p.add_argument("--host-gib", type=float, help="the paged runs' pinned host tier in GiB")
    p.add_argument("--offload-ahead-pages", type=int, metavar="N",
                   help="write-back ahead (KVCacheConfig.offload_ahead_pages) of the paged runs "
                        "with a host tier: keep N device pages free or pending by moving LRU "
                        "cached pages to the host after each step (side stream on CUDA); "
                        "default: the workload's (trtllm: 384, its tiny run 8; else 0 = off)")
    p.add_argument("--tensor-parallel", type=int, nargs="+", default=[1], metavar="N",
                   help="the paged runs split over the first N devices (examples/llama/tp.py; "
                        "dense stays on one device); default 1. Several values (e.g. 1 2): the "
                        "paged rows run once per value on fresh servers, the weights sharded "
                        "once per value (dense and equal memory with the first value), and "
                        "tables compare them (tok/s against the first value, decode step, "
                        "TTFT/ITL, the collectives' share of a decode step with --profile) and "
                        "give the largest concurrency each value fits")
    p.add_argument("--device-memory-gib", type=float, metavar="G",
                   help="the per-device memory the largest-concurrency table assumes (default: "
                        "the allocator limit each device reports; the CPU reports none)")
    p.add_argument("--kv-memory-fraction", type=float, default=KV_MEMORY_FRACTION, metavar="F",
                   help="the share of the memory left after the weights that the largest-"
                        f"concurrency table gives the K/V pool (default {KV_MEMORY_FRACTION})")
    p.add_argument("--json", metavar="PATH", help="write every result as JSON")
    p.add_argument("--concurrency", type=int, nargs="+", metavar="C",
                   help="concurrencies of the random workload (default 64 256)")
    p.add_argument("--requests-factor", type=float,
                   help="random-workload requests per unit of concurrency (default 1)")
    p.add_argument("--input-len", type=int, help="random-workload prompt length (default 1024)")
    p.add_argument("--output-len", type=int, help="random-workload output length (default 256)")
    p.add_argument("--shared-requests", type=int, help="shared-prefix requests (default 128)")
    p.add_argument("--shared-concurrency", type=int, help="shared-prefix concurrency (default 64)")
    p.add_argument("--step-tokens", type=int,
                   help="paged tokens per step = dense prefill tokens per call (default 4096)")
    p.add_argument("--equal-memory-max-len", type=int,
                   help="the dense cache's max_len for the equal-memory comparison (default 4096)")
    p.add_argument("--no-equal-memory", action="store_true",
                   help="report the equal-memory capacities without running the dense batch")
    p.add_argument("--no-dense", action="store_true", help="paged runs only")
    p.add_argument("--hot-backend", nargs="+", choices=("paged", "arena"), default=None,
                   help="hot backends side by side (paged always runs as the reference; "
                        "arena: CUDA VMM on a GPU, memfd on CPU)")
    p.add_argument("--no-shared", action="store_true", help="skip the shared-prefix workload")
    p.add_argument("--no-check", action="store_true",
                   help="skip the tiny float32 paged-vs-dense check before an 8B run")
    p.add_argument("--sliding-window", type=int, metavar="W",
                   help="a mixed-layer model: every layer but each --full-every-th slides over "
                        "the last W positions (HF layer_types; the window group gets ring "
                        "tables); paged runs only (the dense baseline has no window)")
    p.add_argument("--full-every", type=int, default=4, metavar="K",
                   help="with --sliding-window: layers K-1, 2K-1, ... attend fully (default 4: "
                        "3 of 4 layers slide)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--compile-cache", metavar="DIR",
                   help="JAX persistent compilation cache directory (repeated runs compile less)")
    return p.parse_args(argv)


def setup_from_args(args: argparse.Namespace, chunk: int | None = None,
                    tensor_parallel: int | None = None) -> Setup:
    """The run's Setup; ``chunk``: one of several ``--prefill-chunk`` values (default: the
    first given); ``tensor_parallel``: one of several ``--tensor-parallel`` values (default:
    the first)."""
    full, quick, tiny = WORKLOADS[args.workload]
    s = tiny if args.tiny else quick if args.quick else full
    tps = args.tensor_parallel
    if len(set(tps)) != len(tps):
        raise SystemExit("--tensor-parallel values must be distinct")
    if len(tps) > 1 and args.prefill_chunk is not None and len(args.prefill_chunk) > 1:
        raise SystemExit("several --tensor-parallel values and several --prefill-chunk values: "
                         "sweep one of them at a time")
    for n in tps:
        if not 1 <= n <= jax.device_count():
            raise SystemExit(f"--tensor-parallel must be in [1, {jax.device_count()}] (the "
                             f"visible devices), got {n}")
        try:
            tp.check_config(s.model, n)
        except ValueError as e:
            raise SystemExit(f"--tensor-parallel {n}: {e}") from None
    if not 0 < args.kv_memory_fraction <= 1:
        raise SystemExit(f"--kv-memory-fraction must be in (0, 1], got {args.kv_memory_fraction}")
    if args.device_memory_gib is not None and args.device_memory_gib <= 0:
        raise SystemExit(f"--device-memory-gib must be > 0, got {args.device_memory_gib}")
    over: dict[str, Any] = {"seed": args.seed, "kv_dtype": args.kv_dtype,
                            "tensor_parallel": tps[0] if tensor_parallel is None
                            else tensor_parallel}
    if args.prefill_chunk is not None:
        over["prefill_chunk"] = args.prefill_chunk[0] if chunk is None else chunk
    if args.profile is not None:
        if args.profile_steps < 2:
            raise SystemExit("--profile-steps must be >= 2")
        over.update(profile_dir=args.profile, profile_steps=args.profile_steps)
    if args.host_gib is not None:
        over["host_bytes"] = int(args.host_gib * 2**30)
    if args.offload_ahead_pages is not None:
        if args.offload_ahead_pages < 0:
            raise SystemExit("--offload-ahead-pages must be >= 0")
        over["offload_ahead_pages"] = args.offload_ahead_pages
    for arg, field in (("concurrency", "concurrencies"), ("requests_factor", "requests_factor"),
                       ("input_len", "input_len"), ("output_len", "output_len"),
                       ("shared_requests", "shared_requests"),
                       ("shared_concurrency", "shared_concurrency"),
                       ("step_tokens", "step_tokens"),
                       ("equal_memory_max_len", "equal_memory_max_len")):
        v = getattr(args, arg)
        if v is not None:
            over[field] = tuple(v) if isinstance(v, list) else v
    if args.no_equal_memory:
        over["equal_memory_run"] = False
    if args.no_dense:
        over["run_dense"] = False
    if args.hot_backend:
        over["hot_backends"] = ("paged",) + tuple(b for b in args.hot_backend if b != "paged")
    if args.no_shared:
        over["run_shared"] = False
    if args.sliding_window is not None:
        if args.sliding_window < 1 or args.full_every < 1:
            raise SystemExit("--sliding-window and --full-every must be >= 1")
        m = s.model
        types = tuple("full_attention" if i % args.full_every == args.full_every - 1
                      else "sliding_attention" for i in range(m.num_hidden_layers))
        over.update(name=f"{s.name}-window{args.sliding_window}", run_dense=False,
                    equal_memory_run=False, model=dataclasses.replace(
                        m, sliding_window=args.sliding_window, layer_types=types))
    s = dataclasses.replace(s, **over)
    if args.prefill_chunk is not None and args.step_tokens is None:
        # the budget follows the chunk: every running sequence decodes, plus one chunk
        s = dataclasses.replace(s, step_tokens=max(s.concurrencies + (s.shared_concurrency,))
                                + s.prefill_chunk)
    if args.prefill_chunk is not None and len(set(args.prefill_chunk)) != len(args.prefill_chunk):
        raise SystemExit("--prefill-chunk values must be distinct")
    if min(s.concurrencies) < 1 or s.input_len < 1 or s.output_len < 1:
        raise SystemExit("concurrency, --input-len and --output-len must be >= 1")
    if s.step_tokens < max(s.concurrencies + (s.shared_concurrency,)):
        raise SystemExit(f"--step-tokens {s.step_tokens} must be >= every concurrency (each "
                         "running sequence decodes in one step)")
    if s.input_len + s.output_len > s.equal_memory_max_len:
        raise SystemExit("--equal-memory-max-len must hold input + output")
    if s.prefill_chunk < 1 or min(args.prefill_chunk or [1]) < 1:
        raise SystemExit("--prefill-chunk must be >= 1")
    return s


def estimate(setup: Setup) -> str:
    """The run's output tokens per part and a time estimate at the issue's target rates (paged
    9,500 tok/s, dense 3,300 tok/s on the H200; progress lines give the measured pace)."""
    n_rand = sum(int(round(c * setup.requests_factor)) * setup.output_len
                 for c in setup.concurrencies)
    n_shared = (setup.shared_requests * setup.shared_output_len * len(setup.shared_runs)
                if setup.run_shared else 0)
    n_dense = n_rand if setup.run_dense else 0
    secs = (n_rand + n_shared) / 9500 + n_dense / 3300
    return (f"output tokens: shared {n_shared:,}, random paged {n_rand:,}, dense {n_dense:,}; "
            f"~{secs / 60:.1f} min at 9,500 (paged) / 3,300 (dense) tok/s plus warm-ups")


# The float32 oracle: on the CPU every pair of runs agrees token for token with logits within
# 1e-5 (observed ~2e-7; a 0.1% error in the attention scale gives 4e-5). On a GPU the kernels and
# XLA's einsums round differently: a rare near-tie may flip a greedy token, a broken path changes
# most generations.
_F32_CPU_CHECK = {"min_identical": 1.0, "max_logits_rel_l2": 1e-5}
_F32_GPU_CHECK = {"min_identical": 0.75, "max_logits_rel_l2": 1e-4}


def _preflight(tiny: bool) -> None:
    backend = jax.default_backend()
    if backend != "cpu" and not jax_kvcm.cuda_extension_available():
        raise SystemExit("jax runs on the GPU but jax_kvcm has no CUDA extension: reinstall "
                         "jax_kvcm where nvcc is found (pip install --no-build-isolation "
                         "--no-deps .)")
    if not tiny and backend == "cpu":
        raise SystemExit("the 8B-shaped benchmark needs a GPU (jax backend is cpu); "
                         "use --tiny on a CPU")


def _params(setup: Setup) -> Any:
    t = time.perf_counter()
    params = llama.init_params(setup.model, seed=setup.seed, on_device=True)
    params = jax.block_until_ready(params)
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    _log(f"params: {n / 1e9:.2f} B parameters, {nbytes / 2**30:.1f} GiB {setup.model.dtype} "
         f"(jax.random on {jax.devices()[0].platform}) in {time.perf_counter() - t:.1f} s"
         f"{_mem_gib()}")
    return params


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    setup = setup_from_args(args)
    _preflight(args.tiny)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    dev = jax.devices()[0]
    t_start = time.perf_counter()
    _log(f"jax {jax.__version__} on {dev.device_kind} ({jax.default_backend()}), jax_kvcm "
         f"{jax_kvcm.__version__}, python {platform.python_version()}; setup {setup.name}")
    _log(anchor_line(setup))
    _log(estimate(setup))
    out: dict[str, Any] = {"meta": {"jax": jax.__version__, "device": dev.device_kind,
                                    "backend": jax.default_backend(),
                                    "argv": list(sys.argv if argv is None else argv),
                                    "time": time.strftime("%Y-%m-%d %H:%M:%S")},
                           "anchor": ANCHOR}
    if not args.tiny and not args.no_check:
        out["check"] = _check(args.tensor_parallel)
    tps = args.tensor_parallel
    capacity: list[dict[str, Any]] = []
    try:
        # FP8 K/V changes the paged logits against dense (bf16/f32 caches): agreement is
        # reported, not enforced (tests/test_llama_fp8.py bounds the error).
        tol = ({} if setup.model.dtype != "float32" or setup.kv_dtype == "fp8" else
               _F32_CPU_CHECK if jax.default_backend() == "cpu" else _F32_GPU_CHECK)
        chunks = args.prefill_chunk or [setup.prefill_chunk]
        if len(tps) > 1:
            parts, capacity = tp_sweep(args, setup, tol)
        else:
            params = _params(setup)
            paged = tp_params(params, setup.model, tps[0])
            if len(chunks) > 1:
                _log(f"{len(chunks)} --prefill-chunk values {chunks}: the paged rows run once "
                     "per value (about that many times the paged estimate above)")
            parts = []
            for i, chunk in enumerate(chunks):
                s = setup_from_args(args, chunk) if args.prefill_chunk else setup
                if i:     # the paged rows once per value; dense and equal memory with the first
                    s = dataclasses.replace(s, run_dense=False, equal_memory_run=False)
                if len(chunks) > 1:
                    _log(f"--prefill-chunk {chunk} (step budget {s.step_tokens} tokens)")
                parts.append((chunk, bench(s, params, paged_params=paged, **tol)))
    except RuntimeError as e:
        raise SystemExit(f"FAILED: {e}") from None
    if len(parts) == 1:
        out.update(parts[0][1])
    else:
        out.update(loop_profile.merge_sweep(parts, "tp" if len(tps) > 1 else "chunk"))
    if len(tps) > 1:
        scaling = tp_scaling(out["results"], out["agreement"])
        memory = ("--device-memory-gib" if args.device_memory_gib is not None else
                  "the allocator limit the devices report (bytes_limit)")
        out["tensor_parallel"] = {"values": list(tps), "target_tp2_over_tp1": TARGET_TP2_OVER_TP1,
                                  "scaling": scaling, "capacity": capacity,
                                  "memory_source": memory}
        # float32: the device split must not change a greedy generation (as the chunk size)
        for a in out["agreement"]:
            if tol and " [tp " in a["b"] and a["identical"] < tol["min_identical"] * a["requests"]:
                out["errors"].append({"name": a["b"], "error": (
                    f"generated other tokens than {a['a']} for "
                    f"{a['requests'] - a['identical']} of {a['requests']} requests")})
    out["meta"]["total_s"] = time.perf_counter() - t_start
    md = markdown(out)
    _log("")
    _log(md)
    if len(chunks) > 1:
        _log("")
        _log(loop_profile.format_sweep(out["results"]))
    if len(parts) > 1:
        for a in loop_profile.sweep_agreement(out["results"]):
            _log(f"tokens {a['a']} vs {a['b']}: {a['identical']}/{a['requests']} requests "
                 "identical")
    if len(tps) > 1:
        _log("")
        _log(format_tp_scaling(out["tensor_parallel"]["scaling"]))
        _log("")
        _log(format_capacity(capacity, out["tensor_parallel"]["memory_source"]))
    _log("")
    _log(anchor_line(setup))
    _log(f"total {out['meta']['total_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
        _log(f"wrote {args.json}")
    if out["errors"]:
        raise SystemExit(f"FAILED: {len(out['errors'])} configuration(s) raised: "
                         + "; ".join(e["name"] for e in out["errors"]))
    return out


def _check(tps: Sequence[int]) -> dict[str, Any]:
    """The tiny float32 model on this device before an 8B run: paged vs dense vs no prefix
    reuse, and the paged random row at every ``--tensor-parallel`` value > 1 against one
    device's (the tiny model splits over 2 and 4 devices); SystemExit when a pair disagrees."""
    _log("check: tiny float32 model, paged vs dense vs no prefix reuse on this device"
         + "".join(f", tensor parallel {n} vs 1" for n in tps if n > 1))
    t = time.perf_counter()
    params = _params(CHECK_SETUP)
    try:
        chk = bench(CHECK_SETUP, params, **_F32_GPU_CHECK, log=lambda *a: None)
        errors = chk["errors"]
        ref = next((r for r in chk["results"] if r["name"] == "paged random c8"), None)
        for n in tps:
            if n == 1 or ref is None:
                continue
            try:
                tp.check_config(CHECK_SETUP.model, n)
            except ValueError as e:
                _log(f"check: tensor parallel {n} skipped (the tiny model: {e})")
                continue
            s = dataclasses.replace(CHECK_SETUP, tensor_parallel=n, run_dense=False,
                                    run_shared=False, equal_memory_run=False)
            res = bench(s, params, paged_params=tp_params(params, s.model, n),
                        log=lambda *a: None)
            errors = errors + res["errors"]
            got = next((r for r in res["results"] if r["name"] == "paged random c8"), None)
            if got is None:
                continue
            same = sum(a == b for a, b in zip(ref["generated_digests"], got["generated_digests"]))
            chk["agreement"].append({"a": ref["name"], "b": f"{got['name']} [tp {n}]",
                                     "requests": got["requests"], "identical": same})
            if same < _F32_GPU_CHECK["min_identical"] * got["requests"]:
                raise RuntimeError(f"tensor parallel {n} generated other tokens than one device "
                                   f"for {got['requests'] - same} of {got['requests']} requests")
        if errors:
            raise RuntimeError("; ".join(f"{e['name']}: {e['error']}" for e in errors))
    except RuntimeError as e:
        raise SystemExit(f"CHECK FAILED: {e}\n(--no-check skips this check)") from None
    same = sum(a["identical"] for a in chk["agreement"])
    total = sum(a["requests"] for a in chk["agreement"])
    _log(f"check passed: {same}/{total} request pairs over {len(chk['agreement'])} pairs of "
         f"runs generated identical tokens ({time.perf_counter() - t:.1f} s)")
    return {"agreement": chk["agreement"]}


def tp_sweep(args: argparse.Namespace, setup: Setup,
             tol: dict[str, float]) -> tuple[list[tuple[int, dict]], list[dict]]:
    """The paged rows once per ``--tensor-parallel`` value (fresh servers; the weights sharded
    once per value, the previous value's shards and pools freed first; dense and equal memory
    with the first value only), and each value's largest concurrency (:func:`tp_capacity`).
    Returns ``[(value, bench output)]`` and the capacity rows."""
    tps = args.tensor_parallel
    _log(f"{len(tps)} --tensor-parallel values {tps}: the paged rows run once per value (about "
         "that many times the paged estimate above)")
    base = _params(setup)
    parts, capacity = [], []
    for i, n in enumerate(tps):
        s = setup_from_args(args, tensor_parallel=n)
        if i:     # dense (one device) and equal memory with the first value
            s = dataclasses.replace(s, run_dense=False, equal_memory_run=False)
        t = time.perf_counter()
        paged = tp_params(base, s.model, n)
        weights = device_weight_bytes(paged)
        if i == len(tps) - 1 and n > 1 and not s.run_dense:
            base = None      # the last value: the unsharded weights leave device 0 first
            gc.collect()
        _log(f"--tensor-parallel {n}: weights {weights / 2**30:.2f} GiB per device (sharded in "
             f"{time.perf_counter() - t:.1f} s){_mem_gib()}")
        res = bench(s, paged if base is None else base, paged_params=paged, **tol)
        memory = (int(args.device_memory_gib * 2**30) if args.device_memory_gib is not None
                  else device_memory_limit(n))
        capacity.append(tp_capacity(s, n, weights, res, memory, args.kv_memory_fraction))
        parts.append((n, res))
        del paged, res
        gc.collect()   # this value's shards before the next value's
    return parts, capacity


if __name__ == "__main__":
    main()
