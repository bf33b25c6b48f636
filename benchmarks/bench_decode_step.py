#!/usr/bin/env python
"""Device time of one Llama decode step, paged vs dense, outside any serving loop, and where the
time of the paged step goes (issues 5 and 9).

    python -m benchmarks.bench_decode_step [--batch 64 256] [--context 1152] [--json PATH]
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
benchmark's "decode step ms" separates device time from the serving loop's host time.

**Breakdown** (unless ``--no-profile``): for each batch, the paged step before (the layers' weights
stacked under ``lax.scan``: ``model.stack_layers``) and after (per-layer weight buffers, fused QKV
and gate/up), each traced with ``jax.profiler`` (``--repeats`` steps) and its device ops attributed
to categories through the compiled HLO (``benchmarks/harness/device_profile.py``): weight GEMMs,
weight copies (instructions that materialize a layer's weight matrix), paged attention, K/V writes,
norms/RoPE/other, and host gaps (the step's wall time less the device ops' time). Printed as one
table, before and after side by side; ``weight_copy_ops`` (the HLO probe) is printed for both
layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.harness import dense_llama as dense  # noqa: E402
from benchmarks.harness.device_profile import (attribute, hlo_categories, load_trace,  # noqa: E402
                                               weight_copy_ops)
from benchmarks.harness.serve_setup import LLAMA_31_8B, TINY  # noqa: E402
from examples.llama import model as llama  # noqa: E402

# The decode step's columns (its HLO has no ragged attention and no sampling).
COLUMNS = ("weight GEMMs", "weight copies", "paged attention", "K/V writes", "norms/RoPE/other")


def breakdown(step, hlo_text: str, params, repeats: int, wall_s: float) -> dict[str, float]:
    """Milliseconds per step by category (plus "host gaps" and "wall") of ``step()`` (which
    must block until the step is done), traced over ``repeats`` calls."""
    cats = hlo_categories(hlo_text, params)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(repeats):
                step()
        trace = load_trace(d)
    out = attribute(trace.ops, cats, trace.on_device)
    row = {c: out[c] / 1e3 / repeats for c in COLUMNS}
    busy = sum(row.values())
    row["host gaps"] = max(0.0, wall_s * 1e3 - busy)
    row["wall"] = wall_s * 1e3
    return row


def _time(fn, repeats: int) -> float:
    fn()  # compile + warm-up
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


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
    ap.add_argument("--json", help="write the rows here")
    return ap


def main() -> int:
    args = build_parser().parse_args()
    config = TINY if args.tiny else LLAMA_31_8B
    if jax.default_backend() == "cpu" and not args.tiny:
        print("the 8B-shaped probe needs a GPU (use --tiny on CPU)", file=sys.stderr)
        return 2
    c, P = config, args.page_size
    L, Hkv, Dh = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    itemsize = jnp.dtype(c.jnp_dtype).itemsize
    params = llama.init_params(c, on_device=jax.default_backend() != "cpu")
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    rng = np.random.default_rng(0)
    rows = []
    breakdowns: list[dict] = []
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, weights "
          f"{weight_bytes / 2**30:.2f} GiB, context {args.context}, page {P}")
    print("| path | batch | ms / step | K/V GiB read | min bytes / t (TB/s) |")
    print("|---|---:|---:|---:|---:|")
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
        state = {"k": jnp.zeros(shape, c.jnp_dtype), "v": jnp.zeros(shape, c.jnp_dtype)}
        args_paged = (tokens, positions, jnp.asarray(slots, jnp.int32), jnp.asarray(table),
                      jnp.full((B,), ctx, jnp.int32))

        def paged_step():
            logits, state["k"], state["v"] = llama.decode_step(
                params, state["k"], state["v"], *args_paged, config=c)
            logits.block_until_ready()

        t = _time(paged_step, args.repeats)
        rows.append({"path": "paged", "batch": B, "ms": t * 1e3, "kv_gib": kv_bytes / 2**30,
                     "tbps": (weight_bytes + kv_bytes) / t / 1e12})
        if args.scan or not args.no_profile:   # before: the stacked layers under lax.scan
            stacked = llama.stack_layers(params)

            def scan_step():
                logits, state["k"], state["v"] = llama.decode_step(
                    stacked, state["k"], state["v"], *args_paged, config=c)
                logits.block_until_ready()

            t_scan = _time(scan_step, args.repeats)
            rows.append({"path": "paged, stacked layers (scan)", "batch": B,
                         "ms": t_scan * 1e3, "kv_gib": kv_bytes / 2**30,
                         "tbps": (weight_bytes + kv_bytes) / t_scan / 1e12})
            if not args.no_profile:
                for label, p, fn, wall in (("before: stacked layers, scan", stacked, scan_step,
                                            t_scan),
                                           ("after: per-layer buffers", params, paged_step, t)):
                    hlo = llama.decode_step.lower(p, state["k"], state["v"], *args_paged,
                                                  config=c).compile().as_text()
                    row = breakdown(fn, hlo, params, args.repeats, wall)
                    breakdowns.append({"step": label, "batch": B,
                                       "weight_copy_ops": len(weight_copy_ops(hlo, params)),
                                       **row})
            del stacked
        del state["k"], state["v"]
        dk, dv = dense.make_dense_caches(c, B, ctx + 128)
        dstate = {"k": dk, "v": dv}
        del dk, dv

        def dense_step():
            logits, dstate["k"], dstate["v"] = dense.decode(params, dstate["k"], dstate["v"],
                                                            tokens, positions, config=c)
            logits.block_until_ready()

        try:
            t = _time(dense_step, args.repeats)
            rows.append({"path": "dense", "batch": B, "ms": t * 1e3, "kv_gib": kv_bytes / 2**30,
                         "tbps": (weight_bytes + kv_bytes) / t / 1e12})
        except Exception as e:  # noqa: BLE001  (e.g. out of memory: report, go on)
            rows.append({"path": "dense", "batch": B, "error": f"{type(e).__name__}: {e}"[:300]})
        dstate.clear()
        for r in [r for r in rows if r["batch"] == B]:
            if "error" in r:
                print(f"| {r['path']} | {B} | ERROR {r['error'][:120]} | | |")
            else:
                print(f"| {r['path']} | {B} | {r['ms']:.2f} | {r['kv_gib']:.2f} | "
                      f"{r['tbps']:.2f} |")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "context": args.context, "weight_bytes": weight_bytes, "rows": rows,
                       "breakdown": breakdowns}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
