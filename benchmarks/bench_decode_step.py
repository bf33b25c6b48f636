#!/usr/bin/env python
"""Device time of one Llama decode step, paged vs dense, outside any serving loop, and where the
time of the paged step goes (issues 5 and 9).

    python -m benchmarks.bench_decode_step [--batch 64 256] [--context 1152] [--json PATH]
    python -m benchmarks.bench_decode_step --batch 459 --context 1500 --quantize fp8 --kv-dtype fp8
    JAX_PLATFORMS=cpu python -m benchmarks.bench_decode_step --tiny        # CPU smoke run

For each batch B: the Llama-3.1-8B-shaped model of the serving benchmark (random bf16 weights
drawn on the device), every sequence at ``--context`` tokens, and
- paged: ``examples/llama/model.decode_step`` (``write_kv`` + ``paged_attention``) over a pool of
  exactly the pages the batch needs, each sequence's pages a random permutation of the pool;
- dense: ``benchmarks/harness/dense_llama.decode`` over ``[L, B, Hkv, max_len, Dh]`` caches with
  ``max_len = context + 128``.
Both run back to back (caches donated, the step's outputs fed into the next call), timed as the
median of ``--repeats`` calls after warm-up. The bytes a step must read at least (weights + the K/V
of every sequence) over the time give an effective bandwidth. Comparing with the serving
benchmark's "decode step ms" separates device time from the serving loop's host time; the
fraction of the roofline divides the same bytes by the measured copy bandwidth
(``serve_report.copy_bandwidth``, the serving benchmark's roofline) by the step time. The
compute-aware roofline (``serve_report.compute_aware_ms``) also counts the weight GEMMs' FLOPs
against a large GEMM in the step's weight format measured in the same process
(``serve_report.gemm_throughput``): the K/V read, then the GEMMs at the longer of their bytes and
their FLOPs. At a large batch with FP8 weights the GEMMs are compute-bound, and that is the
floor a step can reach.

``--quantize fp8`` / ``fp8-tensor`` (FP8 weights, ``fp8_weights.quantize_on_device``) and
``--kv-dtype fp8`` (``float8_e4m3fn`` pools, unit scales) time the serving runs' FP8 step; the
stacked-layer and dense paths (bf16 only) are skipped then, and the breakdown is the per-layer
step's alone, with its GEMM census (cuBLASLt FP8 calls, other cuBLAS calls, Triton fusions).
``--xla-option KEY=VALUE[,KEY=VALUE...]`` (repeatable) times the paged step once more per
occurrence, compiled with that occurrence's XLA options; ``--static-input-scales TOKENS`` (with
``--quantize``) once more with static activation scales calibrated over that many random tokens
(``fp8_weights.calibrate_input_scales``: elementwise quantization XLA can fuse, no per-token max).

**Breakdown** (unless ``--no-profile``): for each batch, the paged step before (the layers' weights
stacked under ``lax.scan``: ``model.stack_layers``) and after (per-layer weight buffers, fused QKV
and gate/up), each traced with ``jax.profiler`` (``--repeats`` steps) and its device ops attributed
to categories through the compiled HLO (``benchmarks/harness/device_profile.py``): weight GEMMs,
weight copies (instructions that materialize a layer's weight matrix), paged attention, K/V writes,
FP8 scales (with ``--quantize``: kernels of the activation quantization and scale multiplies
alone; one that also computes a norm or the SiLU counts as other), norms/RoPE/other, and host gaps (the step's wall time less the device ops' time). Printed as one
table, before and after side by side; ``weight_copy_ops`` (the HLO probe) is printed for both
layouts. Below it, the largest ops left in norms/RoPE/other with the named scopes of what each
(or, for a fusion, what it fused) was in the JAX program (``top_other`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.harness import dense_llama as dense  # noqa: E402
from benchmarks.harness.device_profile import (gemm_census, step_breakdown,  # noqa: E402
                                               weight_copy_ops)
from benchmarks.harness.serve_report import (compute_aware_ms, copy_bandwidth,  # noqa: E402
                                             gemm_flops_per_token, gemm_throughput)
from benchmarks.harness.serve_setup import LLAMA_31_8B, TINY  # noqa: E402
from benchmarks.harness.timing import time_blocking  # noqa: E402
from benchmarks.harness.xla_options import xla_options  # noqa: E402
from examples.llama import fp8_weights  # noqa: E402
from examples.llama import model as llama  # noqa: E402

# The decode step's columns (its HLO has no ragged attention and no sampling).
COLUMNS = ("weight GEMMs", "weight copies", "paged attention", "K/V writes", "FP8 scales",
           "norms/RoPE/other")


def _print_rows(rows: list[dict]) -> None:
    for r in rows:
        if "error" in r:
            print(f"| {r['path']} | {r['batch']} | ERROR {r['error'][:120]} | | | | | | |")
        else:
            print(f"| {r['path']} | {r['batch']} | {r['ms']:.2f} | {r['kv_gib']:.2f} | "
                  f"{r['tbps']:.2f} | {r['roofline_ms']:.2f} | {r['fraction_of_roofline']:.2f} | "
                  f"{r['compute_roofline_ms']:.2f} | {r['fraction_of_compute_roofline']:.2f} |")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.bench_decode_step``."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_decode_step", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, default=1152, help="tokens per sequence (1,024 in + "
                    "half of 256 out: the serving benchmark's average)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny float32 model (CPU smoke run)")
    ap.add_argument("--scan", action="store_true", help="also time the paged step over stacked "
                    "weights under lax.scan (model.stack_layers: the layout before per-layer "
                    "buffers, which copies every layer's weights each step)")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-category breakdown "
                    "of the paged step (before/after) from a jax.profiler trace")
    ap.add_argument("--quantize", choices=sorted(fp8_weights.QUANTIZE_CHOICES),
                    help="the layers' linear weights in FP8 (fp8: per-channel scales, "
                    "fp8-tensor: per tensor), as serve.py --quantize")
    ap.add_argument("--static-input-scales", type=int, metavar="TOKENS",
                    help="with --quantize: also time the paged step with static activation "
                    "scales (fp8_weights.calibrate_input_scales over TOKENS random tokens), "
                    "side by side in the same process")
    ap.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                    help="the K/V pools' dtype (auto: the model's; fp8: float8_e4m3fn, unit "
                    "scales)")
    ap.add_argument("--xla-option", action="append", metavar="KEY=VALUE",
                    help="also time the paged step compiled with these XLA options "
                    "(KEY=VALUE[,KEY=VALUE...]; repeatable: one more variant each; e.g. "
                    "xla_gpu_enable_triton_gemm=false: every GEMM to cuBLAS), side by side in "
                    "the same process")
    ap.add_argument("--json", help="write the rows here")
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    if args.static_input_scales is not None and (args.quantize is None
                                                 or args.static_input_scales < 1):
        ap.error("argument --static-input-scales: needs --quantize and at least 1 token")
    config = TINY if args.tiny else LLAMA_31_8B
    if jax.default_backend() == "cpu" and not args.tiny:
        print("the 8B-shaped probe needs a GPU (use --tiny on CPU)", file=sys.stderr)
        return 2
    c, P = config, args.page_size
    L, Hkv, Dh = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    kv_dtype = jnp.float8_e4m3fn if args.kv_dtype == "fp8" else c.jnp_dtype
    itemsize = jnp.dtype(kv_dtype).itemsize
    fp8 = args.quantize is not None or args.kv_dtype == "fp8"
    params = llama.init_params(c, on_device=jax.default_backend() != "cpu")
    if args.quantize:
        params = fp8_weights.quantize_on_device(params, fp8_weights.QUANTIZE_CHOICES[args.quantize])
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    copy_bps = copy_bandwidth()["bytes_per_s"]
    gemm_rate = gemm_throughput(args.quantize is not None)["flops_per_s"]
    rng = np.random.default_rng(0)
    rows = []
    breakdowns: list[dict] = []
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, weights "
          f"{weight_bytes / 2**30:.2f} GiB ({args.quantize or c.dtype}), K/V "
          f"{jnp.dtype(kv_dtype).name}, context {args.context}, page {P}, copy bandwidth "
          f"{copy_bps / 1e12:.2f} TB/s, GEMM {gemm_rate / 1e12:.0f} TFLOP/s")
    print("| path | batch | ms / step | K/V GiB read | min bytes / t (TB/s) | roofline ms "
          "| fraction of roofline | compute-aware roofline ms | fraction |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def timed(path: str, B: int, t: float, kv_bytes: int) -> dict:
        ideal = (weight_bytes + kv_bytes) / copy_bps
        floor_ms = compute_aware_ms(weight_bytes, kv_bytes, B * gemm_flops_per_token(c),
                                    copy_bps, gemm_rate)
        return {"path": path, "batch": B, "ms": t * 1e3, "kv_gib": kv_bytes / 2**30,
                "tbps": (weight_bytes + kv_bytes) / t / 1e12, "roofline_ms": ideal * 1e3,
                "fraction_of_roofline": ideal / t, "compute_roofline_ms": floor_ms,
                "fraction_of_compute_roofline": floor_ms / 1e3 / t}

    # --xla-option: the step compiled once more per occurrence, with its XLA options;
    # --static-input-scales: once more with calibrated static activation scales
    variants = [("paged", llama.decode_step, params)]
    for text in args.xla_option or ():
        variants.append((f"paged, {text}",
                         llama.with_xla_options(llama.decode_step, xla_options(text)), params))
    if args.static_input_scales:
        calibration = rng.integers(0, c.vocab_size, args.static_input_scales).tolist()
        variants.append(("paged, static input scales", llama.decode_step,
                         fp8_weights.calibrate_input_scales(params, c, calibration)))
    for B in args.batch:
        ctx = args.context
        kv_bytes = 2 * L * B * ctx * Hkv * Dh * itemsize
        tokens = jnp.asarray(rng.integers(0, c.vocab_size, B), jnp.int32)
        positions = jnp.full((B,), ctx - 1, jnp.int32)
        # paged: pages 1.. (0 is the null page), a random permutation over the batch
        per_seq = -(-ctx // P)
        num_pages = 1 + B * per_seq
        table = (1 + rng.permutation(B * per_seq)).reshape(B, per_seq).astype(np.int32)
        slots = table[:, (ctx - 1) // P] * P + (ctx - 1) % P
        shape = (L, num_pages, P, Hkv, Dh)
        state = {"k": jnp.zeros(shape, kv_dtype), "v": jnp.zeros(shape, kv_dtype)}
        args_paged = (tokens, positions, jnp.asarray(slots, jnp.int32), jnp.asarray(table),
                      jnp.full((B,), ctx, jnp.int32))

        for label, step_fn, step_params in variants:
            def paged_step(step_fn=step_fn, step_params=step_params):
                logits, state["k"], state["v"] = step_fn(
                    step_params, state["k"], state["v"], *args_paged, config=c)
                logits.block_until_ready()

            t = time_blocking(paged_step, args.repeats)
            rows.append(timed(label, B, t, kv_bytes))
            if fp8 and not args.no_profile:
                hlo = step_fn.lower(step_params, state["k"], state["v"], *args_paged,
                                    config=c).compile().as_text()
                breakdowns.append({"step": f"{label}: {args.quantize or c.dtype} weights, "
                                   f"{jnp.dtype(kv_dtype).name} K/V", "batch": B,
                                   "weight_copy_ops": 0, "gemms": gemm_census(hlo),
                                   **step_breakdown(paged_step, hlo, None, args.repeats, t, COLUMNS)})
                print(f"GEMMs of {label} at batch {B} ({4 * L} linear + the LM head): "
                      + ", ".join(f"{k} {v}" for k, v in breakdowns[-1]["gemms"].items()))
        if not fp8 and (args.scan or not args.no_profile):   # before: stacked layers, scan
            stacked = llama.stack_layers(params)

            def scan_step():
                logits, state["k"], state["v"] = llama.decode_step(
                    stacked, state["k"], state["v"], *args_paged, config=c)
                logits.block_until_ready()

            t_scan = time_blocking(scan_step, args.repeats)
            rows.append(timed("paged, stacked layers (scan)", B, t_scan, kv_bytes))
            if not args.no_profile:
                for label, p, fn, wall in (("before: stacked layers, scan", stacked, scan_step,
                                            t_scan),
                                           ("after: per-layer buffers", params, paged_step, t)):
                    hlo = llama.decode_step.lower(p, state["k"], state["v"], *args_paged,
                                                  config=c).compile().as_text()
                    row = step_breakdown(fn, hlo, params, args.repeats, wall, COLUMNS)
                    breakdowns.append({"step": label, "batch": B,
                                       "weight_copy_ops": len(weight_copy_ops(hlo, params)),
                                       **row})
            del stacked
        del state["k"], state["v"]
        if fp8:   # the dense harness is bf16 only
            _print_rows([r for r in rows if r["batch"] == B])
            continue
        dk, dv = dense.make_dense_caches(c, B, ctx + 128)
        dstate = {"k": dk, "v": dv}
        del dk, dv

        def dense_step():
            logits, dstate["k"], dstate["v"] = dense.decode(params, dstate["k"], dstate["v"],
                                                            tokens, positions, config=c)
            logits.block_until_ready()

        try:
            rows.append(timed("dense", B, time_blocking(dense_step, args.repeats), kv_bytes))
        except Exception as e:  # noqa: BLE001  (e.g. out of memory: report, go on)
            rows.append({"path": "dense", "batch": B, "error": f"{type(e).__name__}: {e}"[:300]})
        dstate.clear()
        _print_rows([r for r in rows if r["batch"] == B])
    if breakdowns:
        print()
        print("Where the paged step's time goes (ms per step; jax.profiler trace, "
              f"{args.repeats} steps; host gaps = wall - device ops):")
        cols = COLUMNS + ("host gaps", "wall")
        print("| step | batch | " + " | ".join(cols) + " | weight-copy ops in HLO |")
        print("|---|---:|" + "---:|" * (len(cols) + 1))
        for b in breakdowns:
            print(f"| {b['step']} | {b['batch']} | "
                  + " | ".join(f"{b[k]:.3f}" for k in cols) + f" | {b['weight_copy_ops']} |")
        for b in breakdowns:
            print(f"\nLargest ops in norms/RoPE/other, {b['step']}, batch {b['batch']} "
                  "(ms per step; the named scopes behind each):")
            for o in b["top_other"]:
                where = "; ".join(o["scopes"]) if o["in_hlo"] else "(not in the HLO)"
                print(f"  {o['ms']:7.3f}  {o['op']}: {where}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "context": args.context, "weight_bytes": weight_bytes,
                       "quantize": args.quantize, "kv_dtype": jnp.dtype(kv_dtype).name,
                       "copy_bytes_per_s": copy_bps, "gemm_flops_per_s": gemm_rate,
                       "rows": rows,
                       "breakdown": breakdowns}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
