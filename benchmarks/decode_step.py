#!/usr/bin/env python
"""Device time of one Llama decode step, paged vs dense, outside any serving loop, and where the
time of the paged step goes (issues 5 and 9).

    python benchmarks/decode_step.py [--batch 64 256] [--context 1152] [--json PATH]
    JAX_PLATFORMS=cpu python benchmarks/decode_step.py --tiny        # CPU smoke run

For each batch B: the Llama-3.1-8B-shaped model of ``benchmarks/serve.py`` (random bf16 weights
drawn on the device), every sequence at ``--context`` tokens, and
- paged: ``examples/llama/model.decode_step`` (``write_kv`` + ``paged_attention``) over a pool of
  exactly the pages the batch needs, each sequence's pages a random permutation of the pool;
- dense: ``benchmarks/_dense_llama.decode`` over ``[L, B, Hkv, max_len, Dh]`` caches with
  ``max_len = context + 128``.
Both run back to back (caches donated, the step's outputs fed into the next call), timed as the
median of ``--repeats`` calls after warm-up. The bytes a step must read at least (weights + the K/V
of every sequence) over the time give an effective bandwidth. Comparing with the serving
benchmark's "decode step ms" separates device time from the serving loop's host time.

**Breakdown** (unless ``--no-profile``): for each batch, the paged step before (the layers'
weights stacked under ``lax.scan``: ``model.stack_layers``) and after (per-layer weight buffers,
fused QKV and gate/up), each traced with ``jax.profiler`` (``--repeats`` steps) and its device
ops attributed to categories through the compiled HLO: weight GEMMs (dots, GEMM custom calls
and fusions containing a dot), weight copies (instructions that materialize a layer's weight
matrix, see :func:`weight_copy_ops`), attention (the paged attention custom calls), K/V writes
(``write_kv``), norms/RoPE/other (everything else), and host gaps (the step's wall time less the
device ops' time). Printed as one table, before and after side by side; on a GPU the ops are
the device's kernels (the trace's "XLA Ops" line, or its kernels by their ``hlo_op``), on the
CPU the thunks XLA runs. ``weight_copy_ops`` (the HLO probe) is printed for both layouts.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_kvcm  # noqa: E402,F401  (first: the repo root below must not shadow the built package)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _dense_llama as dense  # noqa: E402
from examples.llama import model as llama  # noqa: E402
from serve import LLAMA_31_8B, TINY  # noqa: E402


def weight_copy_ops(hlo_text: str, params) -> list[str]:
    """The instructions of an optimized HLO module (``jitted.lower(...).compile().as_text()``)
    that produce a buffer shaped like one layer's weight matrix (``[in, out]``, or ``[1, in,
    out]``): a slice, dynamic-slice, copy, transpose or fusion that materializes weights. A step
    that feeds each GEMM its weight buffer as it is has none; the stacked-layer scan has one
    dynamic-slice (or copy fusion) per weight per layer. ``params``: the per-layer params tree
    (its 2-D layer weights give the shapes to look for)."""
    shapes = {tuple(int(d) for d in w.shape) for lp in params["layers"] for w in lp.values()
              if len(w.shape) == 2}
    found = []
    pattern = (r"^\s*(?:ROOT )?%?[\w.-]+ = \w+\[([\d,]*)\]\S* "
               r"(copy|dynamic-slice|slice|transpose|fusion)\(")
    for line in hlo_text.splitlines():
        m = re.match(pattern, line)
        if m is None:
            continue
        dims = tuple(int(d) for d in m.group(1).split(",") if d)
        while len(dims) > 2 and dims[0] == 1:
            dims = dims[1:]
        if dims in shapes:
            found.append(line.strip())
    return found


CATEGORIES = ("weight GEMMs", "weight copies", "attention", "K/V writes", "norms/RoPE/other")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = .*? ([\w-]+)\(")
_GEMM_TARGETS = ("cublas", "gemm", "matmul")
_CONTAINERS = ("while", "conditional", "call")
_SKIP = "skip"


def hlo_categories(hlo_text: str, params) -> dict[str, str]:
    """Instruction name -> category (see the module doc) for every instruction of an optimized
    HLO module's non-fused computations. ``params``: the per-layer params (for weight copies)."""
    copies = {m.group(1) for line in weight_copy_ops(hlo_text, params)
              if (m := _INSTR.match(line))}
    # Fused computations holding a dot: a fusion calling one is a GEMM.
    dot_comps, comp = set(), None
    for line in hlo_text.splitlines():
        head = re.match(r"^\s*(?:ENTRY )?%?([\w.-]+) .*\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            comp = head.group(1)
        elif comp and (" dot(" in line or " convolution(" in line):
            dot_comps.add(comp)
    cats = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            continue
        name, op = m.groups()
        target = re.search(r'custom_call_target="([^"]+)"', line)
        target = target.group(1).lower() if target else ""
        calls = re.search(r"calls=%?([\w.-]+)", line)
        if op in _CONTAINERS:
            cat = _SKIP                 # its body's ops are counted themselves
        elif name in copies:
            cat = "weight copies"
        elif "attention" in target:
            cat = "attention"
        elif "write_kv" in target:
            cat = "K/V writes"
        elif (op in ("dot", "convolution") or any(t in target for t in _GEMM_TARGETS)
              or "__triton_gemm" in line
              or (op == "fusion" and calls and calls.group(1) in dot_comps)):
            cat = "weight GEMMs"
        else:
            cat = "norms/RoPE/other"
        cats[name] = cat
    return cats


def _kernel_category(name: str) -> str:
    n = name.lower()
    if "attention" in n:
        return "attention"
    if "write_kv" in n:
        return "K/V writes"
    if any(t in n for t in ("gemm", "cublas", "cutlass", "nvjet", "xmma", "matmul")):
        return "weight GEMMs"
    return "norms/RoPE/other"


def trace_ops(trace_dir: str) -> list[tuple[str, float]]:
    """``(op name, microseconds)`` of every device op in the perfetto trace ``jax.profiler``
    wrote under ``trace_dir``: on a GPU the "XLA Ops" line of the device (else its kernels,
    named by their ``hlo_op`` argument when present); on the CPU every complete event (thunks
    carry their HLO instruction's name; the caller keeps the names it knows)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise RuntimeError(f"jax.profiler wrote no perfetto trace under {trace_dir}")
    data = json.load(gzip.open(files[0]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    device = {pid for pid, n in procs.items() if "/device:" in n and "CPU" not in n}
    ops = [e for e in events if e.get("ph") == "X"]
    if device:
        ops = [e for e in ops if e["pid"] in device]
        xla_ops = [e for e in ops if threads.get((e["pid"], e.get("tid"))) == "XLA Ops"]
        if xla_ops:
            ops = xla_ops
        return [((e.get("args") or {}).get("hlo_op") or e["name"], float(e.get("dur", 0)))
                for e in ops]
    return [(e["name"], float(e.get("dur", 0))) for e in ops]


def breakdown(step, hlo_text: str, params, repeats: int, wall_s: float) -> dict[str, float]:
    """Milliseconds per step by category (plus "host gaps" and "wall") of ``step()`` (which
    must block until the step is done), traced over ``repeats`` calls."""
    cats = hlo_categories(hlo_text, params)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(repeats):
                step()
        ops = trace_ops(d)
    on_gpu = jax.default_backend() != "cpu"
    out = collections.Counter()
    for name, us in ops:
        cat = cats.get(name) or cats.get(name.split(":")[0])
        if cat is None:
            if not on_gpu:
                continue          # host events of the runtime, not an op
            cat = _kernel_category(name)
        if cat != _SKIP:
            out[cat] += us / 1e3 / repeats
    row = {c: out[c] for c in CATEGORIES}
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    args = ap.parse_args()
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
        cols = CATEGORIES + ("host gaps", "wall")
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
