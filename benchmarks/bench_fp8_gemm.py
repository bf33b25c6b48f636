#!/usr/bin/env python
"""The 8B model's linear GEMMs in FP8 through XLA against cuBLASLt called directly (issue 38:
"write a custom call only if XLA's path measures worse, and show it").

    python -m benchmarks.bench_fp8_gemm [--rows 256 858 864 2048 2906 2912] [--json PATH]
    JAX_PLATFORMS=cpu python -m benchmarks.bench_fp8_gemm --tiny          # CPU smoke run

For each linear weight of a Llama-3.1-8B layer (``wqkv`` 4,096 -> 6,144, ``wo`` 4,096 -> 4,096,
``w_gate_up`` 4,096 -> 28,672, ``w_down`` 14,336 -> 4,096) and each row count T (tokens in a
step: a decode batch, or a prompt chunk plus the decode rows), random bf16 ``x [T, in]`` and a
random weight quantized per output channel (``examples/llama/fp8_weights.quantize_weight``):

- ``xla fp8 (model)``: ``fp8_matmul(x, w)`` jitted, as the runner calls it: the per-token
  activation quantization, the FP8 GEMM and the scale multiply;
- ``xla fp8 gemm``: ``dot_general`` of the already quantized operands alone, bf16 out;
- ``xla fp8 (scalar scales)``: the product with one static activation scale and one weight
  scale (a calibrated ``input_scale`` and a per-tensor weight, as ModelOpt exports them):
  ``x / s_x`` quantized elementwise, the FP8 dot in float32, times the scalar ``s_x s_w``, bf16
  out. XLA's GEMM rewriter can fold scalar scales into the cuBLASLt call (its
  ``multiply(dot, broadcast(scalar))`` pattern), which it cannot with the runner's per-token /
  per-channel vectors: this row measures whether it does and what that saves;
- ``xla bf16``: the same product with the bf16 weight (``[out, in]``, contracted on ``in``);
- with torch on a GPU: ``torch._scaled_mm`` on the same FP8 bytes with per-tensor scales of 1
  (cuBLASLt's FP8 GEMM, called directly), with row / column scales (torch's rowwise kernel),
  both with fast accumulation as XLA's cuBLASLt call uses it (XLA enables
  ``CUBLASLT_MATMUL_DESC_FAST_ACCUM`` for FP8 operands at the default precision), and
  ``torch.matmul`` in bf16.

The XLA variants compile with the runner's FP8 options (``step.FP8_WEIGHTS_XLA_OPTIONS``) and
report their GEMM census (``__cublas$lt$matmul$f8`` calls). Checks before timing: ``xla fp8
(model)`` against a float32 product of the dequantized operands (rel-L2), the torch FP8
GEMMs against ``xla fp8 gemm`` (the same exact products, only the summation order differs), the
bf16 products against float32. A method that fails its check is not timed.
TFLOP/s = 2 T in out / t. XLA is timed by a wall-clock dispatch loop over one program that
makes ``--reps`` calls on distinct activations (a lone call of a GEMM this small is timed at
JAX's dispatch floor, ~0.04-0.07 ms), torch by CUDA events around back-to-back calls
(benchmarks/harness/timing.py), the methods in turns for ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness.device_profile import gemm_census
from benchmarks.harness.serve_report import rel_l2
from benchmarks.harness.timing import import_torch, short_error, time_jax, time_torch
from examples.llama import fp8_weights as f8
from examples.llama.step import FP8_WEIGHTS_XLA_OPTIONS

# (name, in, out) of one Llama-3.1-8B layer's linear weights.
LLAMA_8B_LINEARS = (("wqkv", 4096, 6144), ("wo", 4096, 4096), ("w_gate_up", 4096, 28672),
                    ("w_down", 14336, 4096))
TINY_LINEARS = (("wqkv", 64, 96), ("w_down", 128, 64))
# Largest rel-L2 a method's check passes at: 1e-2 where the method and its oracle multiply the
# same operands (only the output's bf16 rounding and the summation order differ); 5e-2 for the
# model's path against the float32 product of the unquantized activations (e4m3's 3 mantissa
# bits on the activations give ~2.5e-2).
CHECK_RTOL = 1e-2
MODEL_CHECK_RTOL = 5e-2
QUANTIZED_X_METHODS = ("xla fp8 (model)", "xla fp8 (scalar scales)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_fp8_gemm",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 858, 864, 2048, 2906, 2912],
                    help="tokens per GEMM (decode batch; prompt chunk + decode rows); 858 / 864 "
                         "and 2,906 / 2,912: XLA's FP8 GEMMs off and on multiples of 16")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, methods in turns")
    ap.add_argument("--reps", type=int, default=8,
                    help="XLA calls unrolled in one timed program (amortizes its dispatch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="two small weights, rows 8 and 24 (CPU)")
    ap.add_argument("--json", default=None)
    return ap


def _compiled(fn, *args):
    """``(compiled, census)`` of ``fn`` jitted with the runner's FP8 options (none on CPU)."""
    opts = dict(FP8_WEIGHTS_XLA_OPTIONS) if jax.default_backend() == "gpu" else {}
    compiled = jax.jit(fn).lower(*args).compile(compiler_options=opts or None)
    return compiled, gemm_census(compiled.as_text())


def _torch_methods(torch: Any, xq: jax.Array, w: f8.Fp8Weight, w_bf16: jax.Array,
                   x: jax.Array) -> dict[str, Any]:
    """The torch callables on copies of the same bytes (FP8 moved as uint8 views)."""
    def to_t(a: jax.Array, dtype: Any) -> Any:
        host = np.asarray(jax.device_get(a))
        if host.dtype.itemsize == 1:
            return torch.from_numpy(host.view(np.uint8)).cuda().view(dtype)
        return torch.from_numpy(host.astype(np.float32)).cuda().to(dtype)

    xt = to_t(xq, torch.float8_e4m3fn)                  # [T, in]
    wt = to_t(w.values, torch.float8_e4m3fn)            # [out, in]: .t() is the column-major B
    one = torch.ones((), device="cuda", dtype=torch.float32)
    row_s = torch.ones((xt.shape[0], 1), device="cuda", dtype=torch.float32)
    col_s = torch.ones((1, wt.shape[0]), device="cuda", dtype=torch.float32)
    xb, wb = to_t(x, torch.bfloat16), to_t(w_bf16, torch.bfloat16)
    return {
        "torch scaled_mm (cuBLASLt)": lambda: torch._scaled_mm(
            xt, wt.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True),
        "torch scaled_mm rowwise": lambda: torch._scaled_mm(
            xt, wt.t(), scale_a=row_s, scale_b=col_s, out_dtype=torch.bfloat16,
            use_fast_accum=True),
        "torch bf16": lambda: torch.matmul(xb, wb.t()),
    }


def _xla_timer(fn, x: jax.Array, rest: tuple, reps: int):
    """A timer of ``fn(x, *rest)``: ``reps`` calls on distinct activations unrolled in one
    program (so a call's time is not the host's dispatch time), per call."""
    xs = jax.random.normal(jax.random.key(1), (reps, *x.shape), jnp.float32).astype(x.dtype)
    prog, _ = _compiled(lambda xs, *r: [fn(xs[i], *r) for i in range(reps)], xs, *rest)

    def timer() -> dict[str, Any]:
        t = time_jax(prog, [(xs, *rest)])
        return {**t, "ms": t["ms"] / reps}
    return timer


def case(name: str, k_in: int, n_out: int, t: int, seed: int, rounds: int,
         reps: int = 8) -> list[dict]:
    """Checked and timed rows of one weight at one row count."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (t, k_in), jnp.bfloat16)
    w_in_out = jax.random.normal(kw, (k_in, n_out), jnp.float32) * (k_in ** -0.5)
    w = f8.quantize_weight(w_in_out)
    w_bf16 = w_in_out.T.astype(jnp.bfloat16)                          # [out, in]
    xq, _ = jax.jit(lambda a: f8.quantize_activation(a, None))(x)
    contract = (((1,), (1,)), ((), ()))

    def dot(a, b):
        return jax.lax.dot_general(a, b, contract, preferred_element_type=jnp.bfloat16)

    w_tensor = f8.quantize_weight(w_in_out, "tensor")
    scalars = (jnp.max(jnp.abs(x.astype(jnp.float32))) / f8.FP8_MAX, w_tensor.scale[0])

    def scalar_scaled(a, values, scales):
        s_x, s_w = scales
        aq = jnp.clip(a.astype(jnp.float32) / s_x, -f8.FP8_MAX, f8.FP8_MAX).astype(f8.FP8)
        out = jax.lax.dot_general(aq, values, contract, preferred_element_type=jnp.float32)
        return (out * (s_x * s_w)).astype(a.dtype)

    model, census_model = _compiled(f8.fp8_matmul, x, w)
    gemm, census_gemm = _compiled(dot, xq, w.values)
    scalar, census_scalar = _compiled(scalar_scaled, x, w_tensor.values, scalars)
    bf16, _ = _compiled(dot, x, w_bf16)

    ref = jnp.dot(x.astype(jnp.float32), f8.dequantize(w), precision="highest")
    flop = 2.0 * t * k_in * n_out
    shape = f"{name} T{t} {k_in}->{n_out}"
    rows: list[dict] = [
        {"shape": shape, "weight": name, "rows": t, "in": k_in, "out": n_out, "method": m,
         "census": c, "timer": _xla_timer(f, a, rest, reps)}
        for m, f, a, rest, c in (("xla fp8 (model)", f8.fp8_matmul, x, (w,), census_model),
                                 ("xla fp8 gemm", dot, xq, (w.values,), census_gemm),
                                 ("xla bf16", dot, x, (w_bf16,), None),
                                 ("xla fp8 (scalar scales)", scalar_scaled, x,
                                  (w_tensor.values, scalars), census_scalar))]
    ref_bf16 = jnp.dot(x.astype(jnp.float32), w_bf16.astype(jnp.float32).T, precision="highest")
    ref_fp8 = jnp.dot(xq.astype(jnp.float32), w.values.astype(jnp.float32).T, precision="highest")
    rows[0]["rel_l2"], rows[0]["oracle"] = rel_l2(model(x, w), ref), "float32"
    rows[1]["rel_l2"], rows[1]["oracle"] = rel_l2(gemm(xq, w.values), ref_fp8), "float32"
    rows[2]["rel_l2"], rows[2]["oracle"] = rel_l2(bf16(x, w_bf16), ref_bf16), "float32"
    ref_tensor = jnp.dot(x.astype(jnp.float32), f8.dequantize(w_tensor), precision="highest")
    rows[3]["rel_l2"] = rel_l2(scalar(x, w_tensor.values, scalars), ref_tensor)
    rows[3]["oracle"] = "float32"
    torch, why = import_torch(need_cuda=True)
    if torch is None or jax.default_backend() != "gpu":
        for r in rows:
            r["note"] = f"no torch anchor: {why or 'not a GPU run'}"
    else:
        xla_gemm = np.asarray(jax.device_get(gemm(xq, w.values)), np.float32)
        try:
            fns = _torch_methods(torch, xq, w, w_bf16, x)
        except Exception as e:  # noqa: BLE001 - an anchor that fails is reported, not fatal
            fns, rows[1]["note"] = {}, f"no torch anchor: {short_error(e)}"
        for m, f in fns.items():
            r = {"shape": shape, "weight": name, "rows": t, "in": k_in, "out": n_out, "method": m}
            try:  # scales of 1: the FP8 methods compute XLA's FP8 GEMM, bf16 the bf16 product
                got = f().float().cpu().numpy()
                if m == "torch bf16":
                    r["rel_l2"], r["oracle"] = rel_l2(got, ref_bf16), "float32"
                else:
                    r["rel_l2"], r["oracle"] = rel_l2(got, xla_gemm), "xla fp8 gemm"
                r["timer"] = lambda f=f: time_torch(f, loop=True)
            except Exception as e:  # noqa: BLE001
                r["error"] = short_error(e)
            rows.append(r)
    for r in rows:
        rtol = MODEL_CHECK_RTOL if r["method"] in QUANTIZED_X_METHODS else CHECK_RTOL
        if "rel_l2" in r and not r["rel_l2"] <= rtol:
            r["error"] = f"FAIL rel-L2 {r['rel_l2']:.1e} against {r['oracle']} (> {rtol})"
            r.pop("timer")
    for _ in range(rounds):
        for r in rows:
            if "timer" in r:
                try:
                    r.setdefault("ms_rounds", []).append(r["timer"]()["ms"])
                except Exception as e:  # noqa: BLE001 - one method failing leaves the others
                    r["error"] = short_error(e)
                    r.pop("timer")
    for r in rows:
        r.pop("timer", None)
        if r.get("ms_rounds"):
            r["ms"] = statistics.median(r["ms_rounds"])
            r["tflops"] = flop / (r["ms"] * 1e-3) / 1e12
    base = next((r["ms"] for r in rows if r["method"] == "torch scaled_mm (cuBLASLt)"
                 and "ms" in r), None)
    for r in rows:
        if base is not None and "ms" in r:
            r["time_over_cublaslt"] = r["ms"] / base
    return rows


def print_table(rows: list[dict]) -> None:
    print("| shape | method | ms | TFLOP/s | time / cuBLASLt | GEMM census | check |")
    print("|---|---|---:|---:|---:|---|---|")
    for r in rows:
        check = (f"rel-L2 {r['rel_l2']:.1e} vs {r['oracle']}" if "rel_l2" in r else "")
        check = "; ".join(c for c in (check, r.get("error", r.get("note", ""))) if c)
        census = ", ".join(f"{k} {v}" for k, v in (r.get("census") or {}).items() if v)
        ms, tf, rel = r.get("ms"), r.get("tflops"), r.get("time_over_cublaslt")
        print(f"| {r['shape']} | {r['method']} | {'-' if ms is None else f'{ms:.4f}'} | "
              f"{'-' if tf is None else f'{tf:.0f}'} | {'-' if rel is None else f'{rel:.2f}'} | "
              f"{census} | {check} |")


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    linears, row_counts = LLAMA_8B_LINEARS, args.rows
    if args.tiny:
        linears, row_counts = TINY_LINEARS, [8, 24]
    elif jax.default_backend() == "cpu":
        print("the 8B shapes need a GPU (use --tiny on CPU)", file=sys.stderr)
        raise SystemExit(2)
    print(f"{jax.devices()[0].device_kind}, seed {args.seed}, rounds {args.rounds}")
    rows = [r for i, t in enumerate(row_counts) for j, (name, k, n) in enumerate(linears)
            for r in case(name, k, n, t, args.seed + 100 * i + j, args.rounds, args.reps)]
    print_table(rows)
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "seed": args.seed,
           "xla_options": dict(FP8_WEIGHTS_XLA_OPTIONS), "rows": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
