"""Serving benchmark (issue 5): the example Llama serving loop on KVCacheManager and the custom
calls, side by side with the same model on a dense per-sequence JAX cache.

Run on the GPU machine from the repo root, after installing jax_kvcm with its CUDA extension (the
source tree's ``jax_kvcm/`` then loads the installed extension):

    python -m benchmarks.serve --json serve.json          # default run (estimated 4-5 min)
    python -m benchmarks.serve --quick                    # concurrency 64 only, fewer requests
    JAX_PLATFORMS=cpu python -m benchmarks.serve --tiny   # tiny float32 model on CPU, seconds
    python -m benchmarks.serve --workload trtllm --quick  # the seed workload, 512 requests
    python -m benchmarks.serve --workload trtllm          # 2,500 requests (estimate printed)
    JAX_PLATFORMS=cpu python -m benchmarks.serve --workload trtllm --tiny
    python -m benchmarks.serve --workload trtllm --kv-dtype fp8   # paged K/V in float8_e4m3fn
    python -m benchmarks.serve --workload trtllm --quick --profile /tmp/prof   # where time goes
    python -m benchmarks.serve --workload trtllm --quick --no-dense --prefill-chunk 512 2048 4096
    python -m benchmarks.serve --workload trtllm --no-shared --no-dense --host-gib 0 \\
        --tensor-parallel 1 2 --profile /tmp/tp_prof --profile-steps 8   # TP 1 vs 2 (2 GPUs)

**Model.** Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336,
vocab 128256, RoPE theta 500000 with Llama-3 scaling, RMSNorm eps 1e-5), bfloat16 weights drawn
with ``jax.random`` directly on the device (``model.init_params(on_device=True)``: no
checkpoint, no download). Both paths run ``examples/llama/model.py``'s layers on the same params.

**Workloads.** Every request is submitted at t=0 (an offline burst: at most ``concurrency``
requests run at once, the rest queue; TTFT counts the queueing), unless ``--request-rate R``:
then the paged runs' requests arrive as a Poisson process of R per second (``--arrival-seed``)
and TTFT counts from each arrival. Greedy, EOS ignored (each generates exactly its output
length); prompts are random token ids (fixed seed).

- ``random``: input 1,024 / output 256 tokens at each ``--concurrency`` (default 64 and 256),
  ``concurrency x --requests-factor`` requests.
- ``shared``: 15 system prompts of 512 +- 32 tokens; request ``i`` = system prompt ``i % 15`` +
  a unique 512-token suffix, output 256; concurrency 64, 128 requests; prefix reuse on and off.
  Requests admitted in the same step cannot reuse each other's pages (nothing is committed yet),
  so a request whose system prompt another running request is still writing waits until it is
  written (``ServeConfig.defer_shared_prompts``; ``--no-defer-shared-prompts``: the first wave
  computes every copy of the system prompts, the second wave finds them). A third run ("warm")
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
- ``dense``: ``benchmarks/harness/dense_llama.DenseServer``: ``[layers, batch, kv_heads,
  max_len, head_dim]`` caches (head-major, so neither attention matmul transposes the cache), one
  slot per running request, whole-prompt prefill (einsum attention) in groups of 4,096 tokens,
  ``dynamic_update_slice`` writes, decode attention over the whole ``max_len`` row masked to the
  sequence's length. Equal batch: ``max_len`` = input + output.
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
fraction of it that the decode steps run at the full batch reach (their p50; every decode step's
where none ran at the full batch).

**Compared**: paged / dense tokens/s at equal batch (target >= 0.95); prefix reuse on / off;
equal memory: the paged pool of the largest concurrency against a dense cache of the same bytes
with a realistic ``max_len`` (4,096): how many sequences each holds (the manager's capacity
planning, ``max_num_sequences``) and, unless ``--no-equal-memory``, the dense run at the batch
it fits. Token agreement between runs of the same requests is reported (bfloat16: kernels round
differently and greedy generations drift apart; a broken path shows as near-zero agreement).

**Where the time goes** (``benchmarks/harness/loop_profile.py``): every paged run prints its loop
timings from the loop's step records (``ServeConfig.record_steps``): per step kind (decode-only,
mixed, prefill-only) the count, step time p50/p90, host time, time blocked on the device and
share of the run, and per phase (ramp-up, steady state, tail). ``--profile DIR`` adds a
``jax.profiler`` trace of ``--profile-steps`` steady-state steps per paged run and the device time
per step kind by category (weight GEMMs, paged / ragged attention, K/V writes, sampling,
FP8 scales, collectives, norms/RoPE/other, idle inside a step, other programs, host gaps).
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
  projections and the logits' all-gather, ``benchmarks/harness/device_profile.py``'s
  "collectives") with their share of the step and of the device's busy time; the requests whose
  tokens equal the first value's (float32: all of them, else the exit status is 1);
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

    XLA_PYTHON_CLIENT_PREALLOCATE=true python3 -m benchmarks.serve --workload trtllm \\
        --no-shared --no-dense --host-gib 0 --tensor-parallel 1 2 \\
        --profile /tmp/tp_prof --profile-steps 8 --json serve_tp.json

**Checks.** Before the 8B runs, the tiny float32 model runs paged, dense, and paged without prefix
reuse on the same device, and paged at every ``--tensor-parallel`` value > 1 (its split of the
tiny model) against one device: at least 3/4 of each pair's greedy generations must be
identical, with logits within relative L2 1e-4 (else the script exits non-zero before the long
part; a broken path changes most generations; ``--no-check`` skips it). ``--tiny`` is that model
alone on its own workloads; on the CPU every generation must be identical with logits within
1e-5 (``tests/bench/test_serve_benchmark.py`` runs it). A configuration that raises is reported in the
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
from pathlib import Path  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402

import jax_kvcm  # noqa: E402
from benchmarks.harness import loop_profile  # noqa: E402
from benchmarks.harness.run_log import log as _log  # noqa: E402
from benchmarks.harness.run_log import mem_gib  # noqa: E402
from benchmarks.harness.serve_cli import build_parser, estimate, setup_from_args  # noqa: E402
from benchmarks.harness.serve_matrix import bench  # noqa: E402
from benchmarks.harness.serve_report import anchor_line, markdown  # noqa: E402
from benchmarks.harness.serve_setup import (ANCHOR, CHECK_SETUP, TARGET_TP2_OVER_TP1,  # noqa: E402
                                            Setup, preflight, random_params)
from benchmarks.harness.tp_scaling import (device_memory_limit, device_weight_bytes,  # noqa: E402
                                           format_capacity, format_tp_scaling, tp_capacity,
                                           tp_params, tp_scaling)
from examples.llama import tp  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``--help`` prints this module's docstring)."""
    return build_parser(__doc__).parse_args(argv)


# The float32 oracle: on the CPU every pair of runs agrees token for token with logits within
# 1e-5 (observed ~2e-7; a 0.1% error in the attention scale gives 4e-5). On a GPU the kernels and
# XLA's einsums round differently: a rare near-tie may flip a greedy token, a broken path changes
# most generations.
_F32_CPU_CHECK = {"min_identical": 1.0, "max_logits_rel_l2": 1e-5}
_F32_GPU_CHECK = {"min_identical": 0.75, "max_logits_rel_l2": 1e-4}


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    setup = setup_from_args(args)
    preflight(args.tiny)
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
    deadline = None if args.time_budget is None else t_start + args.time_budget
    capacity: list[dict[str, Any]] = []
    try:
        # FP8 K/V changes the paged logits against dense (bf16/f32 caches): agreement is
        # reported, not enforced (tests/runner/test_llama_fp8.py bounds the error).
        tol = ({} if setup.model.dtype != "float32" or setup.kv_dtype == "fp8" else
               _F32_CPU_CHECK if jax.default_backend() == "cpu" else _F32_GPU_CHECK)
        chunks = args.prefill_chunk or [setup.prefill_chunk]
        if len(tps) > 1:
            parts, capacity = tp_sweep(args, setup, tol, deadline)
        else:
            params = random_params(setup)
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
                parts.append((chunk, bench(s, params, paged_params=paged, deadline=deadline,
                                           **tol)))
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
    if out.get("skipped"):
        _log("")
        _log(f"skipped (--time-budget {args.time_budget:g} s): " + "; ".join(out["skipped"]))
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
    params = random_params(CHECK_SETUP)
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


def tp_sweep(args: argparse.Namespace, setup: Setup, tol: dict[str, float],
             deadline: float | None = None) -> tuple[list[tuple[int, dict]], list[dict]]:
    """The paged rows once per ``--tensor-parallel`` value (fresh servers; the weights sharded
    once per value, the previous value's shards and pools freed first; dense and equal memory
    with the first value only), and each value's largest concurrency (:func:`tp_capacity`).
    Returns ``[(value, bench output)]`` and the capacity rows. ``deadline``: as ``bench``'s."""
    tps = args.tensor_parallel
    _log(f"{len(tps)} --tensor-parallel values {tps}: the paged rows run once per value (about "
         "that many times the paged estimate above)")
    base = random_params(setup)
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
             f"{time.perf_counter() - t:.1f} s){mem_gib()}")
        res = bench(s, paged if base is None else base, paged_params=paged, deadline=deadline,
                    **tol)
        memory = (int(args.device_memory_gib * 2**30) if args.device_memory_gib is not None
                  else device_memory_limit(n))
        capacity.append(tp_capacity(s, n, weights, res, memory, args.kv_memory_fraction))
        parts.append((n, res))
        del paged, res
        gc.collect()   # this value's shards before the next value's
    return parts, capacity


if __name__ == "__main__":
    main()
