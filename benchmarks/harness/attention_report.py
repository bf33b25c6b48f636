"""The attention benchmark's report: derived columns (TB/s, TFLOP/s, ratios to ours), the
summary of ratios and the printed tables, and the environment a run records."""

from __future__ import annotations

import platform
from typing import Any

import jax

import jax_kvcm
from benchmarks.harness import timing as _timing
from benchmarks.harness.attention_cases import cuda_torch

def _fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def finish_rows(rows: list[dict[str, Any]]) -> None:
    """Adds derived columns: bandwidth / FLOP rate, t_ours/t_x, fraction of the copy ceiling."""
    by_shape: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault((r["section"], r["shape"]), []).append(r)
    for group in by_shape.values():
        ours = next((r for r in group if r["method"] == "ours" and r["ms"]), None)
        ours8 = next((r for r in group if r["method"] == "ours fp8" and r["ms"]), None)
        copies = [r for r in group if r["method"].startswith("copy") and r["ms"]]
        copy = next((r for r in copies if r["method"] == "copy (torch)"), None) or next(
            iter(copies), None)  # the ceiling: torch's copy (do_bench), else JAX's
        for r in group:
            ms = r["ms"]
            if ms is None:
                continue
            if "kv_bytes" in r:
                r["kv_tbps"] = r["kv_bytes"] / (ms * 1e-3) / 1e12
                if r["method"].startswith("copy"):
                    r.setdefault("copy_rw_tbps", 2 * r["kv_bytes"] / (ms * 1e-3) / 1e12)
                elif copy is not None:
                    r["frac_of_copy_rw"] = r["kv_tbps"] / (2 * copy["kv_bytes"] / (copy["ms"] * 1e-3)
                                                           / 1e12)
            if "flops" in r:
                r["tflops"] = r["flops"] / (ms * 1e-3) / 1e12
            base = ours8 if r.get("fp8") and r["method"] != "ours fp8" else ours
            if base is not None:  # fp8 anchors against ours in fp8, the rest against ours
                r["ours_over_this"] = base["ms"] / ms


def ratio_summary(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """{(section, shape): {method: t_ours / t_method}} for shapes where ours ran."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        if r.get("ours_over_this") is not None and r["method"] != "ours":
            out.setdefault((r["section"], r["shape"]), {})[r["method"]] = r["ours_over_this"]
    return out


def print_tables(rows: list[dict[str, Any]]) -> None:
    dec = [r for r in rows if r["section"] == "decode"]
    pre = [r for r in rows if r["section"] == "prefill"]
    mixed = [r for r in rows if r["section"] == "mixed"]
    if dec:
        print("\n### Decode (H=32, Hkv=8, D=128, page 16, bf16, all rows at length S)\n")
        print("| shape | method | ms | KV TB/s = (K+V bytes read)/t | copy r+w TB/s = 2*bytes/t "
              "| % of copy r+w | t_ours/t_method | check (rel-L2 vs f32 ref) | note |")
        print("|---|---|---:|---:|---:|---:|---:|---|---|")
        for r in dec:
            frac = r.get("frac_of_copy_rw")
            print(f"| {r['shape']} | {r['method']} | {_fmt(r['ms'], 4)} | {_fmt(r.get('kv_tbps'))} "
                  f"| {_fmt(r.get('copy_rw_tbps'))} | {'-' if frac is None else f'{100 * frac:.0f}%'} "
                  f"| {_fmt(r.get('ours_over_this'), 2)} | {r['check'] or '-'} "
                  f"| {r['error'] or r['note']} |")
    if pre:
        print("\n### Ragged prefill (causal, all tokens new; H=32, Hkv=8, D=128, page 16, bf16)\n")
        print("TFLOP/s = 4 * B * S^2/2 * H * D / t  (QK^T and PV, causal half; same for every "
              "method)\n")
        print("| shape | method | ms | TFLOP/s | t_ours/t_method | check (rel-L2 vs f32 ref, "
              "sampled rows) | note |")
        print("|---|---|---:|---:|---:|---|---|")
        for r in pre:
            print(f"| {r['shape']} | {r['method']} | {_fmt(r['ms'], 4)} | {_fmt(r.get('tflops'), 1)} "
                  f"| {_fmt(r.get('ours_over_this'), 2)} | {r['check'] or '-'} "
                  f"| {r['error'] or r['note']} |")
    if mixed:
        print("\n### Mixed batch in one ragged call (decode rows + a prefill chunk), and its "
              "parts alone (bf16 and fp8 K/V)\n")
        print("| shape | method | ms | TFLOP/s | t_ours/t_method | check | note |")
        print("|---|---|---:|---:|---:|---|---|")
        for r in mixed:
            print(f"| {r['shape']} | {r['method']} | {_fmt(r['ms'], 4)} | "
                  f"{_fmt(r.get('tflops'), 1)} | {_fmt(r.get('ours_over_this'), 2)} | "
                  f"{r['check'] or '-'} | {r['error'] or r['note']} |")
    fp8 = [(r["shape"], r) for r in dec if r["method"] == "ours fp8" and r["ms"]]
    if fp8:
        print("\n### FP8 K/V decode: tokens x context / s, fp8 over bf16 (ours; target >= 1.8)\n")
        print("| shape | bf16 ms | fp8 ms | fp8 / bf16 |")
        print("|---|---:|---:|---:|")
        for shape, r8 in fp8:
            r16 = next((r for r in dec if r["shape"] == shape and r["method"] == "ours"
                        and r["ms"]), None)
            if r16 is not None:
                print(f"| {shape} | {r16['ms']:.4f} | {r8['ms']:.4f} | "
                      f"{r16['ms'] / r8['ms']:.2f} |")
    ratios = ratio_summary(rows)
    if ratios:
        cols = ["flashinfer-decode[tc]", "flashinfer-decode", "sglang-triton",
                "flashinfer-decode[tc] fp8", "flashinfer-fa3", "flashinfer-fa2", "torch-sdpa",
                "jax-gather", "pallas", "pallas[tuned]", "copy (torch)", "cudnn"]
        cols = [c for c in cols if any(c in v for v in ratios.values())]
        print("\n### Time ratios t_ours / t_method (< 1: ours faster)\n")
        print("| section | shape | " + " | ".join(f"ours/{c}" for c in cols) + " |")
        print("|---|---|" + "---:|" * len(cols))
        for (section, shape), v in ratios.items():
            print(f"| {section} | {shape} | " + " | ".join(_fmt(v.get(c), 2) for c in cols) + " |")
    print("\nt_ours/t_method < 1: ours is faster than that method. 'copy' KV TB/s is the bytes "
          "copied / t, i.e. the read-only rate a kernel would show if it took as long as the copy; "
          "'% of copy r+w' = the method's KV TB/s / the copy's read+write rate.", flush=True)


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(), "jax": jax.__version__,
        "backend": jax.default_backend(), "devices": [str(x) for x in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "jax_kvcm_cuda_extension": jax_kvcm.cuda_extension_available(),
    }
    torch = cuda_torch()
    env["torch"] = (torch.__version__ if torch is not None
                    else _timing.import_torch(need_cuda=True)[1])
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"unavailable ({type(e).__name__})"
    return env


