#!/usr/bin/env python
"""Device time of one serving step that mixes decode rows with a prompt chunk, against its parts
alone: does a mixed step cost a decode step plus its chunk's GEMMs, and no more? (issue 36)

    python -m benchmarks.bench_mixed_step [--decode-rows 256] [--context 1152] [--chunk 2048]
    python -m benchmarks.bench_mixed_step --decode-rows 459 --context 1500 --chunk 2048 \\
        --quantize fp8 --static-input-scales 256 --kv-dtype fp8     # trtllm-bench's mixed step
    JAX_PLATFORMS=cpu python -m benchmarks.bench_mixed_step --tiny   # CPU smoke run

Three programs over one pool of random K/V, as the serving loop runs them
(``examples/llama/model.py``; the Llama-3.1-8B-shaped model of the serving benchmark, random
weights drawn on the device):

- decode: ``decode_step`` over B rows at ``--context`` tokens each (``paged_attention``);
- chunk: ``forward_step`` over one sequence's C new tokens after ``--chunk-context`` tokens
  (``ragged_paged_attention``);
- mixed: ``forward_step`` over both in one ragged batch (B single-token rows, then the chunk).

Compiled with the serving runner's XLA options (``examples/llama/step.step_xla_options``: with
FP8 weights, XLA's Triton GEMM fusions off), so each step is the one the runner executes.

Each is checked first: the mixed step's logits of the decode rows against the decode step's, and
of the chunk against the chunk step's (the same pool, tokens and positions: only the batching
differs), relative L2 at most ``TOLERANCE``. Then each is timed (median of ``--repeats`` calls,
caches donated) and, unless ``--no-profile``, its device time split by category from a
``jax.profiler`` trace (``device_profile.step_breakdown``). Printed last:

- ``mixed / (decode + chunk)``: below 1 when one weight read serves both (the decode step's
  GEMMs read every weight for B rows; the mixed step's read them once for B + C);
- ``mixed / bound``, bound = the decode step + the chunk step's weight GEMMs and ragged
  attention (from its profile): the cost the issue allows a mixed step.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

# One preallocated region for one big pool (XLA's default), 0.90 of the device's memory: with
# XLA_PYTHON_CLIENT_PREALLOCATE=false, trtllm-bench's mixed step (two 21 GiB FP8 caches beside
# 8.6 GB of weights) ran out of memory on an H100 (2026-12-07), as bench_serve's second pool did
# when the allocator grew region by region.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.harness.device_profile import step_breakdown  # noqa: E402
from benchmarks.harness.serve_report import rel_l2  # noqa: E402
from benchmarks.harness.serve_setup import LLAMA_31_8B, TINY  # noqa: E402
from benchmarks.harness.timing import time_blocking  # noqa: E402
from examples.llama import fp8_weights  # noqa: E402
from examples.llama import model as llama  # noqa: E402
from examples.llama.step import step_xla_options  # noqa: E402

COLUMNS = ("weight GEMMs", "paged attention", "ragged attention", "K/V writes", "FP8 scales",
           "norms/RoPE/other")
TOLERANCE = 0.05   # relative L2 of logits between batchings (bf16 GEMMs of other row counts)


@functools.partial(jax.jit, donate_argnums=0)
def _fill(pool, key):
    """``pool`` ``[L, pages, P, Hkv, Dh]`` filled with N(0, 1) in its dtype, one layer at a time
    (a float32 temporary of one layer, not of the pool)."""
    def layer(i, pool):
        x = jax.random.normal(jax.random.fold_in(key, i), pool.shape[1:], jnp.float32)
        return pool.at[i].set(x.astype(pool.dtype))
    return jax.lax.fori_loop(0, pool.shape[0], layer, pool)


def step_inputs(B: int, ctx: int, C: int, chunk_ctx: int, P: int, vocab: int,
                rng: np.random.Generator) -> tuple[dict, int]:
    """The three steps' host inputs (int32 numpy) and the pool's page count. Pages: 0 is the
    null page; each decode row owns ``ceil(ctx / P)`` pages and the chunk's sequence
    ``ceil((chunk_ctx + C) / P)``, all a random permutation of pages 1..."""
    per_row, per_chunk = -(-ctx // P), -(-(chunk_ctx + C) // P)
    pages = 1 + rng.permutation(B * per_row + per_chunk).astype(np.int32)
    rows_table, chunk_table = pages[:B * per_row].reshape(B, per_row), pages[B * per_row:]
    width = max(per_row, per_chunk)
    tokens = rng.integers(0, vocab, B + C).astype(np.int32)
    d_pos = np.full(B, ctx - 1, np.int32)
    d_slots = (rows_table[:, (ctx - 1) // P] * P + (ctx - 1) % P).astype(np.int32)
    c_pos = np.arange(chunk_ctx, chunk_ctx + C, dtype=np.int32)
    c_slots = (chunk_table[c_pos // P] * P + c_pos % P).astype(np.int32)
    table = np.zeros((B + 1, width), np.int32)
    table[:B, :per_row], table[B, :per_chunk] = rows_table, chunk_table
    lens = np.append(np.full(B, ctx, np.int32), np.int32(chunk_ctx + C))
    return {
        "decode": (tokens[:B], d_pos, d_slots, rows_table, lens[:B]),
        "chunk": (tokens[B:], c_pos, c_slots, chunk_table[None], lens[B:],
                  np.array([0, C], np.int32)),
        "mixed": (tokens, np.concatenate([d_pos, c_pos]), np.concatenate([d_slots, c_slots]),
                  table, lens, np.append(np.arange(B + 1, dtype=np.int32), np.int32(B + C))),
    }, 1 + len(pages)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.bench_mixed_step``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_mixed_step",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--decode-rows", type=int, default=256, help="B: the step's decode rows")
    ap.add_argument("--context", type=int, default=1152,
                    help="tokens of each decode row (with its new one)")
    ap.add_argument("--chunk", type=int, nargs="+", default=[2048],
                    help="C: the prompt chunk's new tokens (several: one measurement each)")
    ap.add_argument("--chunk-context", type=int, default=0,
                    help="tokens of the chunk's sequence before the chunk (0: a prompt's first)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="tiny float32 model (CPU smoke run)")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the per-category breakdown (and the bound, which needs it)")
    ap.add_argument("--quantize", choices=sorted(fp8_weights.QUANTIZE_CHOICES),
                    help="the layers' linear weights in FP8, as serve.py --quantize")
    ap.add_argument("--static-input-scales", type=int, metavar="TOKENS",
                    help="with --quantize: static activation scales calibrated over TOKENS "
                    "random tokens (fp8_weights.calibrate_input_scales), as serve.py's")
    ap.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                    help="the K/V pool's dtype (auto: the model's; fp8: float8_e4m3fn, unit "
                    "scales)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--hlo-dir", metavar="DIR",
                    help="write each step's optimized HLO here (STEP_CHUNK.hlo.txt), to read "
                         "which ops XLA fused into which kernels")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name, value, low in (("--decode-rows", args.decode_rows, 1), ("--context", args.context, 1),
                             ("--chunk", min(args.chunk), 1),
                             ("--chunk-context", args.chunk_context, 0),
                             ("--repeats", args.repeats, 1)):
        if value < low:
            ap.error(f"argument {name}: at least {low}, got {value}")
    if args.page_size < 8 or args.page_size & (args.page_size - 1):
        ap.error(f"argument --page-size: a power of two >= 8, got {args.page_size}")
    if args.static_input_scales is not None and (args.quantize is None
                                                 or args.static_input_scales < 1):
        ap.error("argument --static-input-scales: needs --quantize and at least 1 token")
    if jax.default_backend() == "cpu" and not args.tiny:
        print("the 8B-shaped probe needs a GPU (use --tiny on CPU)", file=sys.stderr)
        return 2
    c = TINY if args.tiny else LLAMA_31_8B
    B, ctx, P = args.decode_rows, args.context, args.page_size
    kv_dtype = jnp.float8_e4m3fn if args.kv_dtype == "fp8" else c.jnp_dtype
    params = llama.init_params(c, on_device=jax.default_backend() != "cpu")
    if args.quantize:
        params = fp8_weights.quantize_on_device(params, fp8_weights.QUANTIZE_CHOICES[args.quantize])
    rng = np.random.default_rng(0)
    if args.static_input_scales:
        calibration = rng.integers(0, c.vocab_size, args.static_input_scales).tolist()
        params = fp8_weights.calibrate_input_scales(params, c, calibration)
    weights = f"{args.quantize or c.dtype}" + (", static input scales"
                                               if args.static_input_scales else "")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; weights {weights}; K/V "
          f"{jnp.dtype(kv_dtype).name}; {B} decode rows at {ctx} tokens; chunk(s) "
          f"{args.chunk} after {args.chunk_context}; page {P}")
    steps = {"decode": llama.decode_step, "chunk": llama.forward_step,
             "mixed": llama.forward_step}
    options = step_xla_options(None, params)   # the runner's (FP8 weights: Triton GEMMs off)
    steps = {name: llama.with_xla_options(fn, options) for name, fn in steps.items()}
    results, failed = [], False
    for C in args.chunk:
        inputs, num_pages = step_inputs(B, ctx, C, args.chunk_context, P, c.vocab_size, rng)
        k, v = llama.make_caches(c, num_pages, P, kv_dtype=kv_dtype)
        state = {"k": _fill(k, jax.random.key(1)), "v": _fill(v, jax.random.key(2))}
        del k, v
        logits, row = {}, {"decode_rows": B, "context": ctx, "chunk": C,
                           "chunk_context": args.chunk_context, "steps": {}}
        for name, fn in steps.items():
            a = tuple(jnp.asarray(x) for x in inputs[name])

            def run(fn=fn, a=a):
                out, state["k"], state["v"] = fn(params, state["k"], state["v"], *a, config=c)
                out.block_until_ready()
                return out

            logits[name] = np.asarray(run(), np.float32)
            t = time_blocking(run, args.repeats)
            entry = {"ms": t * 1e3, "rows": int(a[4].shape[0]), "tokens": int(a[0].shape[0])}
            if not args.no_profile or args.hlo_dir:
                hlo = fn.lower(params, state["k"], state["v"], *a, config=c).compile().as_text()
            if args.hlo_dir:
                os.makedirs(args.hlo_dir, exist_ok=True)
                with open(os.path.join(args.hlo_dir, f"{name}_{C}.hlo.txt"), "w") as f:
                    f.write(hlo)
            if not args.no_profile:
                entry["breakdown"] = step_breakdown(run, hlo, None, args.repeats, t, COLUMNS)
            row["steps"][name] = entry
        row["check"] = {"decode rows": rel_l2(logits["mixed"][:B], logits["decode"]),
                        "chunk": rel_l2(logits["mixed"][B:], logits["chunk"])}
        bad = [k for k, e in row["check"].items() if not e <= TOLERANCE]
        failed |= bool(bad)
        ms = {k: e["ms"] for k, e in row["steps"].items()}
        row["mixed_over_parts"] = ms["mixed"] / (ms["decode"] + ms["chunk"])
        if not args.no_profile:
            b = row["steps"]["chunk"]["breakdown"]
            row["bound_ms"] = ms["decode"] + b["weight GEMMs"] + b["ragged attention"]
            row["mixed_over_bound"] = ms["mixed"] / row["bound_ms"]
        results.append(row)
        print(f"\nchunk {C}: checked (mixed against its parts, relative L2 of logits): "
              + ", ".join(f"{k} {e:.1e}" for k, e in row["check"].items())
              + (f"; FAILED ({', '.join(bad)} > {TOLERANCE})" if bad else ""))
        print_row(row, args.no_profile)
        del state["k"], state["v"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "weights": weights, "kv_dtype": jnp.dtype(kv_dtype).name,
                       "page_size": P, "rows": results}, f, indent=1)
    return 1 if failed else 0


def print_row(row: dict, no_profile: bool) -> None:
    """One chunk size's table: the three steps (and their breakdowns), then the ratios."""
    cols = () if no_profile else COLUMNS + ("host gaps",)
    print("| step | rows | tokens | ms | " + " | ".join(cols) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(cols))
    for name, e in row["steps"].items():
        cells = [f"{e['breakdown'][k]:.3f}" for k in cols] if cols else []
        print(f"| {name} | {e['rows']} | {e['tokens']} | {e['ms']:.3f} | " + " | ".join(cells)
              + " |")
    line = f"mixed / (decode + chunk) = {row['mixed_over_parts']:.3f}"
    if "bound_ms" in row:
        line += (f"; mixed / (decode + the chunk's GEMMs and attention = {row['bound_ms']:.3f} ms)"
                 f" = {row['mixed_over_bound']:.3f}")
    print(line)


if __name__ == "__main__":
    sys.exit(main())
