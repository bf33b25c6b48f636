"""The serving benchmark's command line: the parser, and the :class:`Setup` a command line
selects (a workload preset, then the flags' overrides, checked)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax

from benchmarks.harness.serve_arrivals import request_rate
from benchmarks.harness.serve_setup import KV_MEMORY_FRACTION, WORKLOADS, Setup
from benchmarks.harness.xla_options import xla_options
from examples.llama import fp8_weights
from examples.llama import serve
from examples.llama import tp


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The serving benchmark's command line (``description``: its help text)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=description,
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
                        "at concurrency 256, paged and dense; trtllm-bench: TensorRT-LLM's "
                        "published protocol, random 1,000/1,000, 3,000 requests (--quick 1,000) "
                        "at once, paged only, concurrency as large as memory allows after the "
                        "weights (--kv-memory-fraction of it for K/V; printed)")
    p.add_argument("--kv-dtype", choices=sorted(serve.KV_DTYPES), default="auto",
                   help="the paged runs' K/V pools: auto (the model dtype) or fp8 "
                        "(float8_e4m3fn, scales 1.0: the random weights have none); dense "
                        "keeps the model dtype, so paged/dense agreement is reported, not "
                        "enforced, with fp8")
    p.add_argument("--no-defer-shared-prompts", action="store_true",
                   help="admit requests in order even when a running request is still writing "
                        "a prompt prefix they share (ServeConfig.defer_shared_prompts off; on, "
                        "they wait a step or two and reuse those pages)")
    p.add_argument("--cascade", action="store_true",
                   help="the paged runs' decode steps read shared prefixes once per group "
                        "(ServeConfig.cascade: jax_kvcm.cascade_paged_attention); one device")
    p.add_argument("--cascade-ab", action="store_true",
                   help="the shared-prefix run without and with --cascade in one process, "
                        "interleaved --ab-rounds times, and the median tokens/s ratio with its "
                        "spread (one device)")
    p.add_argument("--quantize", choices=sorted(fp8_weights.QUANTIZE_CHOICES), default=None,
                   help="every run's linear weights in float8_e4m3fn with FP8 GEMMs "
                        "(examples/llama/fp8_weights.py): fp8 (per-channel scales), fp8-tensor "
                        "(per tensor); activations per token; one device (default: bf16)")
    p.add_argument("--static-input-scales", type=int, default=None, metavar="TOKENS",
                   help="with --quantize: static activation scales, calibrated over TOKENS "
                        "random tokens (fp8_weights.calibrate_input_scales; the random model "
                        "measures their speed, not their accuracy), as in TensorRT-LLM's FP8 "
                        "checkpoints (default: per-token scales at run time)")
    p.add_argument("--xla-option", type=xla_options, default=None, metavar="KEY=VALUE[,...]",
                   help="XLA compiler options of the paged runs' device step "
                        "(ServeConfig.xla_options), e.g. xla_gpu_enable_triton_gemm=false "
                        "(default: XLA's; with --quantize, Triton GEMMs off: "
                        "examples/llama/step.py FP8_WEIGHTS_XLA_OPTIONS)")
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
                        "attention, K/V writes, sampling, FP8 scales, norms/RoPE/other, host "
                        "gaps. The "
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
    p.add_argument("--time-budget", type=float, metavar="S",
                   help="stop starting configurations S seconds after the start: one is "
                        "skipped when less time is left than the longest so far took; the "
                        "ones that ran are reported as usual, the skipped listed (for a run "
                        "under a wall-clock limit, e.g. a 10-minute device call: its summary "
                        "still prints). Default: no limit")
    p.add_argument("--concurrency", type=int, nargs="+", metavar="C",
                   help="concurrencies of the random workload (default 64 256)")
    p.add_argument("--requests-factor", type=float,
                   help="random-workload requests per unit of concurrency (default 1)")
    p.add_argument("--input-len", type=int, help="random-workload prompt length (default 1024)")
    p.add_argument("--output-len", type=int, help="random-workload output length (default 256)")
    p.add_argument("--shared-requests", type=int, help="shared-prefix requests (default 128)")
    p.add_argument("--shared-concurrency", type=int, help="shared-prefix concurrency (default 64)")
    p.add_argument("--batch-buckets", type=int, metavar="N",
                   help="the paged runs' batch buckets: the concurrency and its halves, N of "
                        "them (c, c/2, c/4, ...; rounded up to 16 with --quantize), every step "
                        "program compiled before the clock, so a step of fewer rows (ramp-up, "
                        "tail) computes on its bucket instead of c rows (default 1: c alone)")
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
    p.add_argument("--arena-step-calls", action="store_true",
                   help="with --hot-backend arena: read the arena's map / create calls after "
                        "every step (stats(), in the clock) and split its decode step times by "
                        "them (a diagnostic)")
    p.add_argument("--ab-rounds", type=int, default=1, metavar="N",
                   help="with --hot-backend: run paged and each other backend N times, "
                        "interleaved (paged, arena, paged, arena, ...), and report the median "
                        "ratio and its spread (default: %(default)s)")
    p.add_argument("--request-rate", type=request_rate, metavar="R",
                   help="the paged runs' requests arrive as a Poisson process of R per second "
                        "(exponential gaps of mean 1/R drawn with --arrival-seed), each "
                        "submitted when the clock passes its arrival; TTFT counts from the "
                        "arrival. The table adds the achieved arrival rate. Dense runs still "
                        "submit all at once. Default (or inf): every request at once")
    p.add_argument("--arrival-seed", type=int, default=0, metavar="S",
                   help="the seed of --request-rate's arrival gaps (default 0)")
    p.add_argument("--no-shared", action="store_true", help="skip the shared-prefix workload")
    p.add_argument("--no-random", action="store_true", help="skip the random workload")
    p.add_argument("--pool-pages", type=int, metavar="N",
                   help="device K/V pages of every paged and arena run (default: every running "
                        "request at its longest); e.g. so that a paged pool and an arena of the "
                        "same bytes fit on the device together for --hot-backend paged arena")
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
    return p


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    return build_parser(description).parse_args(argv)


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
    if args.cascade_ab and (args.cascade or args.no_shared or max(tps) > 1):
        raise SystemExit("--cascade-ab runs the shared-prefix workload without and with cascade "
                         "on one device: not with --cascade, --no-shared or --tensor-parallel > 1")
    if args.static_input_scales is not None and (args.quantize is None
                                                 or args.static_input_scales < 1):
        raise SystemExit("--static-input-scales needs --quantize and at least 1 token, got "
                         f"{args.static_input_scales}")
    if args.quantize is not None and max(tps) > 1:
        raise SystemExit(f"--quantize {args.quantize}: FP8 weights are not split for tensor "
                         "parallelism (examples/llama/tp.py); use --tensor-parallel 1")
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
                            "quantize": args.quantize, "cascade": args.cascade,
                            "static_input_scales": args.static_input_scales,
                            "xla_options": args.xla_option,
                            "cascade_ab": args.cascade_ab,
                            "defer_shared_prompts": not args.no_defer_shared_prompts,
                            "kv_memory_fraction": args.kv_memory_fraction,
                            "device_memory_bytes": (None if args.device_memory_gib is None
                                                    else int(args.device_memory_gib * 2**30)),
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
                       ("step_tokens", "step_tokens"), ("batch_buckets", "batch_buckets"),
                       ("equal_memory_max_len", "equal_memory_max_len")):
        v = getattr(args, arg)
        if v is not None:
            over[field] = tuple(v) if isinstance(v, list) else v
    if args.concurrency is not None:   # a fixed concurrency instead of the largest that fits
        over["auto_concurrency"] = False
    if args.no_equal_memory:
        over["equal_memory_run"] = False
    if args.no_dense:
        over["run_dense"] = False
    if args.hot_backend:
        over["hot_backends"] = ("paged",) + tuple(b for b in args.hot_backend if b != "paged")
    if args.no_shared:
        over["run_shared"] = False
    if args.no_random:
        over["run_random"] = False
    if args.pool_pages is not None:
        if args.pool_pages < 1:
            raise SystemExit("--pool-pages must be >= 1")
        over["pool_pages_override"] = args.pool_pages
    over.update(request_rate=args.request_rate, arrival_seed=args.arrival_seed)
    if args.ab_rounds < 1:
        raise SystemExit("--ab-rounds must be >= 1")
    if args.time_budget is not None and not args.time_budget > 0:
        raise SystemExit(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    over["ab_rounds"] = args.ab_rounds
    over["arena_step_calls"] = args.arena_step_calls
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
    if s.batch_buckets < 1:
        raise SystemExit(f"--batch-buckets must be >= 1, got {s.batch_buckets}")
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
    n_rand = sum(setup.requests_at(c) * setup.output_len for c in setup.concurrencies)
    n_shared = (setup.shared_requests * setup.shared_output_len * len(setup.shared_runs)
                if setup.run_shared else 0)
    n_dense = n_rand if setup.run_dense else 0
    secs = (n_rand + n_shared) / 9500 + n_dense / 3300
    rate = ""
    if setup.request_rate is not None:   # a paged run lasts at least until its last arrival
        n = max([setup.requests_at(c) for c in setup.concurrencies if setup.run_random]
                + [setup.shared_requests if setup.run_shared else 0])
        rate = (f"; arrivals at {setup.request_rate:g} requests/s (seed {setup.arrival_seed}): "
                f"a paged run of {n} requests lasts at least ~{n / setup.request_rate:.0f} s")
    return (f"output tokens: shared {n_shared:,}, random paged {n_rand:,}, dense {n_dense:,}; "
            f"~{secs / 60:.1f} min at 9,500 (paged) / 3,300 (dense) tok/s plus warm-ups{rate}")

