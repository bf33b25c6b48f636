"""What the serving benchmark prints: token agreement between runs, one line per run, the
decode step's roofline (the bytes a step must move against the copy bandwidth measured in the
same run, and with the weight GEMMs' compute against a GEMM measured in the same run), the
markdown tables and the anchor line."""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness.serve_setup import (ANCHOR, ANCHOR_TRTLLM_BENCH, TARGET_TRTLLM_BENCH_H200,
                                            Setup)
from benchmarks.harness.timing import time_jax
from examples.llama import serve
from examples.llama import tp


def rel_l2(x: Any, y: Any) -> float:
    """``|x - y| / |y|`` (L2, in float64; y of norm 0 counts as 1e-30): the benchmarks' check of
    an output against its oracle."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(float(np.linalg.norm(y)), 1e-30))


def agreement(a: Sequence[serve.RequestOutput],
               b: Sequence[serve.RequestOutput]) -> dict[str, Any]:
    """Requests with identical generations, identical first tokens, and (recorded logits) the
    largest relative L2 distance between the logits of requests with identical generations."""
    pairs = list(zip(a, b))
    same = [x.generated_ids == y.generated_ids for x, y in pairs]
    first = sum(bool(x.generated_ids) and x.generated_ids[:1] == y.generated_ids[:1]
                for x, y in pairs)
    rel = [rel_l2(x.logits, y.logits) for (x, y), s in zip(pairs, same)
           if s and x.logits is not None and y.logits is not None]
    return {"requests": len(pairs), "identical": sum(same), "identical_first_token": first,
            "max_logits_rel_l2": max(rel) if rel else None}


def format_result(r: dict) -> str:
    extra = ""
    if r["path"] == "paged":
        extra = (f", prefix hit {r['prefix_hit_rate']:.1%}, pages used {r['pages_used_peak']}"
                 f"/{r['pool_pages']}")
        if r["recomputes"] or r["suspends"]:
            extra += f", SUSPENDS {r['suspends']} RECOMPUTES {r['recomputes']}"
    if r.get("xla_options"):
        extra += ", XLA " + ",".join(f"{k}={v}" for k, v in r["xla_options"].items())
    if r.get("request_rate") is not None:
        extra += (f", arrivals {r['request_rate']:g}/s seed {r['arrival_seed']} (achieved "
                  f"{_rate(r['achieved_arrival_rate'])}/s, TTFT from arrival; submitted behind "
                  f"arrival p50 {r['submit_lag_ms_p50']:.1f} ms max "
                  f"{r['submit_lag_ms_max']:.1f} ms)")
    flag = ""
    if r["compiles_in_timed_region"]:
        flag = (f"  WARNING: {r['compiles_in_timed_region']} compile(s) inside the timed region: "
                + ", ".join(r.get("compiled_in_timed_region", [])))
    return (f"  {r['name']}: {r['output_tokens_per_s']:,.0f} output tok/s, {r['requests']} "
            f"requests in {r['seconds']:.2f} s, TTFT p50 {r['ttft_p50_s']:.3f} s p90 "
            f"{r['ttft_p90_s']:.3f} s, ITL p50 {r['itl_p50_ms']:.1f} ms p90 "
            f"{r['itl_p90_ms']:.1f} ms, decode step {r['decode_step_ms_p50']:.2f} ms{extra} "
            f"(warm-up {r['warmup_s']:.1f} s){flag}")


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def arrivals_table(results: Sequence[dict]) -> list[str]:
    """The ``--request-rate`` runs' table (none without a rate): the arrival rate asked for, the
    achieved one, output tok/s, TTFT (from each request's arrival) and ITL."""
    rows = [r for r in results if r.get("request_rate") is not None]
    if not rows:
        return []
    lines = ["", "| run (Poisson arrivals) | request rate /s | achieved /s | arrival seed | "
             "output tok/s | TTFT p50 s | TTFT p90 s | ITL p50 ms | ITL p90 ms | submitted "
             "behind arrival p50 / max ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['request_rate']:g} | "
                     f"{_rate(r['achieved_arrival_rate'])} | {r['arrival_seed']} | "
                     f"{r['output_tokens_per_s']:,.0f} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p90_s']:.3f} | {r['itl_p50_ms']:.1f} | {r['itl_p90_ms']:.1f} | "
                     f"{r['submit_lag_ms_p50']:.1f} / {r['submit_lag_ms_max']:.1f} |")
    return lines


def cascade_table(results: Sequence[dict]) -> list[str]:
    """The ``--cascade`` runs' share of decode K/V reads saved (none without cascade)."""
    rows = [r for r in results if r.get("cascade")]
    if not rows:
        return []
    lines = ["", "| run (cascade) | decode K/V token reads | saved by the cascade | grouped "
             "rows per decode step |", "|---|---:|---:|---:|"]
    for r in rows:
        total, saved = r.get("decode_kv_tokens", 0), r.get("cascade_tokens_saved", 0)
        lines.append(f"| {r['name']} | {total:,} | {saved / max(total, 1):.1%} | "
                     f"{r.get('cascade_grouped_rows_per_step', 0.0):.1f} |")
    return lines


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


def gemm_flops_per_token(c: Any) -> float:
    """FLOPs of the weight GEMMs one token costs in a Llama step: 2 x every linear weight (the
    layers' q, k, v, o, gate, up, down and the LM head)."""
    H, D = c.hidden_size, c.head_dim
    attention = H * D * 2 * (c.num_attention_heads + c.num_key_value_heads)
    mlp = 3 * H * c.intermediate_size
    return 2.0 * (c.num_hidden_layers * (attention + mlp) + H * c.vocab_size)


def gemm_throughput(fp8: bool, shapes: Sequence[tuple[int, int, int]] | None = None,
                    repeats: int = 10, calls: int = 4) -> dict[str, float]:
    """FLOP/s of large GEMMs in the step's weight format, the best of ``shapes`` (``(m, k, n)``;
    default: 8192 cubed and the 8B layer's gate/up and down GEMMs at 4,096 rows), each timed by
    :func:`benchmarks.harness.timing.time_jax` as a program of ``calls`` GEMMs (so JAX's dispatch
    does not count), the median of ``repeats`` samples:
    the practical compute ceiling of the step's weight GEMMs on this device, as
    :func:`copy_bandwidth` is that of its bytes. ``fp8``: ``float8_e4m3fn`` operands, bf16 out,
    the runner's FP8 XLA options (cuBLASLt's FP8 GEMM on Hopper); else bf16. On a CPU: one
    256-cubed GEMM."""
    from examples.llama.step import FP8_WEIGHTS_XLA_OPTIONS

    if shapes is None:
        shapes = (((256, 256, 256),) if jax.default_backend() == "cpu" else
                  ((8192, 8192, 8192), (4096, 4096, 28672), (4096, 14336, 4096)))
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    opts = dict(FP8_WEIGHTS_XLA_OPTIONS) if fp8 and jax.default_backend() == "gpu" else {}

    def gemms(xs, w):    # calls GEMMs on distinct activations, weight [n, k] (K-major)
        return [jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.bfloat16) for x in xs]

    program = jax.jit(gemms, compiler_options=opts)
    best = {"flops_per_s": 0.0}
    for m, k, n in shapes:
        keys = jax.random.split(jax.random.key(0), calls + 1)
        xs = [jax.random.normal(key, (m, k), jnp.bfloat16).astype(dtype) for key in keys[1:]]
        w = jax.random.normal(keys[0], (n, k), jnp.bfloat16).astype(dtype)
        t = time_jax(program, [(xs, w)], warmup=2, repeats=repeats)
        rate = 2.0 * m * k * n * calls / (t["ms"] / 1e3)
        if rate > best["flops_per_s"]:
            best = {"m": float(m), "k": float(k), "n": float(n), "flops_per_s": rate}
        del xs, w
    return best


def roofline(setup: Setup, weight_bytes: int, res: dict, requests: Sequence[serve.Request],
             copy_bytes_per_s: float, gemm_flops_per_s: float | None = None
             ) -> dict[str, float]:
    """What one decode step of ``res`` must move at least: every weight once, plus the K/V of
    the batch (``min(concurrency, requests)`` sequences at the workload's mean context during
    decode, prompt + half the output), against the measured copy bandwidth. With tensor
    parallelism (``res["tensor_parallel"]`` = n), one device's share against one device's
    bandwidth: ``weight_bytes`` is then the weights on one device, the K/V its KV heads
    (``tp.kv_heads / n``).

    With ``gemm_flops_per_s`` (:func:`gemm_throughput`), also the compute-aware roofline: the
    weight GEMMs take at least the longer of reading the weights and their FLOPs
    (:func:`gemm_flops_per_token` x batch / n) at that rate, attention at least the K/V read, one
    after the other: ``kv / bw + max(weights / bw, flops / gemm_rate)``. At a large batch with
    FP8 weights the GEMMs are compute-bound and this is the step's real floor."""
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
    full = (res.get("loop") or {}).get("full_decode") or {}
    if full.get("steps"):   # the decode steps at the batch this roofline assumes
        step_ms, measured = full["step_ms_p50"], f"{full['steps']} full-batch decode steps"
    else:
        step_ms = res["decode_step_ms_p50"] or res.get("step_ms_p50") or 0.0
        measured = "every decode step"
    out = {"weight_bytes": float(weight_bytes), "kv_bytes": kv, "batch": batch,
           "mean_context": context, "step_bytes": step_bytes,
           "copy_bytes_per_s": copy_bytes_per_s, "roofline_step_ms": ideal_ms,
           "measured_step_ms": step_ms, "measured_over": measured,
           "fraction_of_roofline": ideal_ms / step_ms if step_ms else 0.0}
    if gemm_flops_per_s:
        flops = batch * gemm_flops_per_token(c) / n
        floor_ms = compute_aware_ms(weight_bytes, kv, flops, copy_bytes_per_s, gemm_flops_per_s)
        out.update(gemm_flops=flops, gemm_flops_per_s=gemm_flops_per_s,
                   compute_roofline_step_ms=floor_ms,
                   fraction_of_compute_roofline=floor_ms / step_ms if step_ms else 0.0)
    return out


def compute_aware_ms(weight_bytes: float, kv_bytes: float, gemm_flops: float,
                     copy_bytes_per_s: float, gemm_flops_per_s: float) -> float:
    """A decode step's floor in ms: its K/V read, then its weight GEMMs at the longer of
    their bytes and their FLOPs (see :func:`roofline`)."""
    gemms = max(weight_bytes / copy_bytes_per_s, gemm_flops / gemm_flops_per_s)
    return (kv_bytes / copy_bytes_per_s + gemms) * 1e3


def format_roofline(name: str, r: dict) -> str:
    return (f"  roofline {name}: a decode step must move {r['step_bytes'] / 1e9:.1f} GB "
            f"(weights {r['weight_bytes'] / 1e9:.1f} + K/V {r['kv_bytes'] / 1e9:.1f}: batch "
            f"{r['batch']} x {r['mean_context']:.0f} tokens); copy bandwidth "
            f"{r['copy_bytes_per_s'] / 1e12:.2f} TB/s (r+w) -> {r['roofline_step_ms']:.2f} ms; "
            f"measured {r['measured_step_ms']:.2f} ms (p50 of "
            f"{r.get('measured_over', 'every decode step')}) = "
            f"{r['fraction_of_roofline']:.2f}x of the roofline"
            + (f"; with the GEMMs' {r['gemm_flops'] / 1e12:.1f} TFLOP at the "
               f"{r['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s measured: "
               f"{r['compute_roofline_step_ms']:.2f} ms, "
               f"{r['fraction_of_compute_roofline']:.2f}x" if "gemm_flops" in r else ""))

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
        path += f" ({r['weights']} weights)" if r.get("weights", "").startswith("fp8") else ""
        path += " (cascade)" if r.get("cascade") else ""
        lines.append(
            f"| {r['name']} | {path} | {r['workload']} | {r['concurrency']} | "
            f"{r['requests']} | {r['output_tokens_per_s']:,.0f} | {r['ttft_p50_s']:.3f} | "
            f"{r['ttft_p90_s']:.3f} | {r['itl_p50_ms']:.1f} | {r['itl_p90_ms']:.1f} | "
            f"{r['decode_step_ms_p50']:.2f} | {r['roofline']['fraction_of_roofline']:.2f}x | "
            f"{hit} | {pages} | {r['cache_bytes'] / 2**30:.2f} |")
    for e in out.get("errors", []):
        lines.append(f"| {e['name']} | FAILED | | | | | | | | | | | | {e['error'][:120]} | |")
    lines += arrivals_table(out["results"])
    lines += cascade_table(out["results"])
    lines += ["", "| run | step bytes (weights + K/V) | copy TB/s (r+w) | roofline ms | "
              "measured ms | fraction | GEMM TFLOP at TFLOP/s | compute-aware roofline ms | "
              "fraction |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out["results"]:
        f = r["roofline"]
        compute = (f"{f['gemm_flops'] / 1e12:.1f} at {f['gemm_flops_per_s'] / 1e12:.0f} | "
                   f"{f['compute_roofline_step_ms']:.2f} | "
                   f"{f['fraction_of_compute_roofline']:.2f}x" if "gemm_flops" in f
                   else "- | - | -")
        lines.append(f"| {r['name']} | {f['step_bytes'] / 1e9:.1f} GB "
                     f"({f['weight_bytes'] / 1e9:.1f} + {f['kv_bytes'] / 1e9:.1f}) | {f['copy_bytes_per_s'] / 1e12:.2f} | "
                     f"{f['roofline_step_ms']:.2f} | {f['measured_step_ms']:.2f} | "
                     f"{f['fraction_of_roofline']:.2f}x | {compute} |")
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
            rounds = ", ".join(f"{r:.3f}" for r in c["tokens_per_s_over_paged_rounds"])
            budgets = " / ".join(f"{b / 2**30:.2f}" for b in c["kv_budget_bytes"])
            lines.append(f"| {c['other']} / {c['paged']} tok/s, {c['rounds']} round(s) | "
                         f"{c['tokens_per_s_over_paged']:.3f}x | target >= {c['target']}: {ok}; "
                         f"rounds {rounds} (spread {c['spread']:.3f}); K/V budget paged / "
                         f"arena {budgets} GiB; peak committed K/V arena/paged "
                         f"{c['kv_bytes_used_peak_over_paged']:.3f}x; steady-state map/unmap "
                         f"calls {c['steady_map_calls']}/{c['steady_unmap_calls']}; prefix "
                         f"pages read in place {c['shared_pages']} shared + "
                         f"{c['affine_pages']} adopted |")
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
    if setup is not None and setup.name.endswith("trtllm-bench"):
        b = ANCHOR_TRTLLM_BENCH
        return (f"Anchor: {b['system']}, {b['model']} on {b['gpu']}, {b['input_len']:,}/"
                f"{b['output_len']:,}, {b['requests']:,} requests: {b['output_tokens_per_s']:,.0f} "
                f"output tok/s ({b['source']}; FP8 weights and K/V, not measured here); target "
                f"{TARGET_TRTLLM_BENCH_H200:,.0f} on an H200 with --quantize fp8 --kv-dtype fp8")
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

