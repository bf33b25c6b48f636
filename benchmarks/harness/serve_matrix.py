"""The serving benchmark's matrix of runs for one :class:`Setup`: the random rows (paged, the
other hot backends beside it, dense at equal batch), the shared-prefix runs (prefix reuse on,
warm, off) and the equal-memory comparison; each pair of runs over the same requests is checked
for token agreement."""

from __future__ import annotations

import dataclasses
import gc
import time
import traceback
from typing import Any, Sequence

import jax
import numpy as np

from benchmarks.harness import dense_llama as dense
from benchmarks.harness import loop_profile
from benchmarks.harness import run_log
from benchmarks.harness.run_log import mem_gib
from benchmarks.harness.serve_capacity import resolve_concurrency
from benchmarks.harness.serve_report import (agreement, copy_bandwidth, format_result,
                                             format_roofline, gemm_throughput, roofline)
from benchmarks.harness.serve_runs import run_dense, run_paged
from benchmarks.harness.serve_setup import (TARGET_ARENA_OVER_PAGED, TARGET_PAGED_OVER_DENSE,
                                            Setup, random_requests, shared_requests,
                                            shared_system_prompts)
from benchmarks.harness.tp_scaling import device_weight_bytes
from examples.llama import fp8_weights, serve


def bench(setup: Setup, params: Any, *, min_identical: float | None = None,
          max_logits_rel_l2: float | None = None, log=run_log.log,
          paged_params: Any = None, deadline: float | None = None) -> dict[str, Any]:
    """Runs every configuration of ``setup``; returns results, comparisons and agreement. With
    ``min_identical``, every pair of runs over the same requests must generate identical tokens
    for at least that fraction of the requests, and with ``max_logits_rel_l2`` (and
    ``setup.record_logits``) the logits of identical generations must be that close; else
    RuntimeError. ``paged_params``: the paged runs' params when they differ from the dense
    runs' (``tp.shard_params``' output for ``setup.tensor_parallel`` devices, sharded once for
    every server of the run); default ``params``. ``deadline`` (a ``time.perf_counter()``
    value, ``--time-budget``): a configuration is skipped, not started, when less time is left
    than the longest one so far took (or none is left); the output lists it in ``skipped``."""
    results: list[dict] = []
    skipped: list[str] = []
    longest = {"s": 0.0}   # the longest configuration so far, seconds (warm-up included)
    comparisons: list[dict] = []
    agreements: list[dict] = []
    errors: list[dict] = []
    paged_params = params if paged_params is None else paged_params
    setup, capacity = resolve_concurrency(setup, paged_params, log)
    if capacity is not None:
        comparisons.append(capacity)
    if setup.quantize is not None and (min_identical or max_logits_rel_l2):
        # FP8 activations round at thresholds: a float32 difference between two paths (the
        # attention kernels) can flip an element's FP8 rounding, so paged and dense agree to
        # FP8's precision, not float32's (tests/runner/test_llama_fp8_weights.py bounds it).
        log("FP8 weights: token agreement between runs is reported, not enforced")
        min_identical = max_logits_rel_l2 = None
    if setup.request_rate is not None:
        log(f"arrivals: the paged runs' requests arrive as a Poisson process of "
            f"{setup.request_rate:g} per second (arrival seed {setup.arrival_seed}), TTFT from "
            "each request's arrival" + ("; the dense runs submit every request at once"
                                        if setup.run_dense else ""))
    cmax = max(setup.concurrencies)
    n_random = max(setup.requests_at(c) for c in setup.concurrencies)
    rand = random_requests(setup, n_random)
    first_seen: dict[int, tuple[str, Any]] = {}   # random request -> (run, its output)
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    paged_weight_bytes = device_weight_bytes(paged_params)   # one device's (all without TP)
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw['bytes_per_s'] / 1e12:.3f} TB/s (read + write, "
        f"{bw['bytes'] / 2**30:.2f} GiB copied in {bw['seconds'] * 1e3:.2f} ms)")
    paged_fp8 = fp8_weights.has_fp8_weights(paged_params)
    gemm_rate = {fp8: gemm_throughput(fp8)["flops_per_s"] for fp8 in {False, paged_fp8}}
    log("GEMM throughput " + ", ".join(f"{'fp8' if k else 'bf16'} {v / 1e12:.3g} TFLOP/s"
                                       for k, v in sorted(gemm_rate.items())))

    def record(res: dict, outs: list, requests: Sequence[serve.Request]) -> None:
        fp8 = res["path"] != "dense" and paged_fp8
        res["roofline"] = roofline(setup, weight_bytes if res["path"] == "dense"
                                   else paged_weight_bytes, res, requests, bw["bytes_per_s"],
                                   gemm_rate[fp8])
        results.append(res)
        log(format_result(res))
        log(format_roofline(res["name"], res["roofline"]))
        if "loop" in res:
            log(loop_profile.format_loop(res["name"], res["loop"]))
        if "arena_step_calls" in res:
            log(loop_profile.format_split(res["name"], res["arena_step_calls"]))
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
        a = agreement(outs_a, outs_b)
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
        recorded, and the other configurations still run. Past ``deadline``: skipped."""
        t0 = time.perf_counter()
        if deadline is not None and deadline - t0 <= longest["s"]:
            log(f"  SKIPPED {label}: {max(deadline - t0, 0):.0f} s of the time budget left, "
                f"the longest configuration so far took {longest['s']:.0f} s")
            skipped.append(label)
            return None, []
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
        longest["s"] = max(longest["s"], time.perf_counter() - t0)
        if res is not None:
            record(res, outs, reqs)
            if res["workload"] == "random":
                against_earlier(label, outs)
        return res, outs

    big: dict[str, dict | None] = {"run": None}   # the paged run at the largest concurrency

    def interleaved(pres: dict | None, what: str, other: str, reqs, variant: dict[str, Any],
                    **kwargs: Any) -> list[tuple[dict, dict]]:
        """The paged run ``pres`` and, after it, ``other`` (``variant``: its run_paged
        keywords); with ``setup.ab_rounds`` > 1 both again, interleaved. The (paged, other)
        pairs of the rounds where both ran."""
        pairs = []
        for k in range(setup.ab_rounds):
            tag = "" if k == 0 else f" (round {k + 1})"
            p = pres if k == 0 else attempt(f"paged {what}{tag}", run_paged, reqs, **kwargs)[0]
            res, _ = attempt(f"{other}{tag}", run_paged, reqs, **variant, **kwargs)
            if p is not None and res is not None:
                pairs.append((p, res))
        return pairs

    def beside(pres: dict | None, what: str, reqs, **kwargs: Any) -> None:
        """The other hot backends on the same requests as the paged run ``pres``, interleaved
        ``setup.ab_rounds`` times, and the median ratio with its spread."""
        for hb in setup.hot_backends:
            if hb == "paged":
                continue
            pairs = interleaved(pres, what, f"{hb} {what}", reqs, {"hot_backend": hb}, **kwargs)
            if pairs:
                comparisons.append(compare_backends(hb, pairs, log))

    def cascade_rounds(pres: dict | None, what: str, reqs, **kwargs: Any) -> None:
        """``--cascade-ab``: the run ``pres`` (without cascade) and the same with cascade,
        ``setup.ab_rounds`` times each, interleaved."""
        pairs = interleaved(pres, what, f"paged {what}, cascade", reqs, {"cascade": True},
                            **kwargs)
        if pairs:
            comparisons.append(compare_cascade(pairs, log))

    def random_rows() -> None:
        if not setup.run_random:
            return
        for c in sorted(setup.concurrencies):
            reqs = rand[:setup.requests_at(c)]
            log(f"random {setup.input_len}/{setup.output_len}, concurrency {c}, {len(reqs)} "
                f"requests{mem_gib()}")
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
            f"{mem_gib()}")
        runs: dict[str, tuple[dict | None, list]] = {}
        if "on" in setup.shared_runs:
            runs["on"] = attempt(f"paged shared c{cs} prefix on", run_paged, sreqs,
                                 concurrency=cs, prefix=True, workload="shared")
            beside(runs["on"][0], f"shared c{cs} prefix on", sreqs, concurrency=cs,
                   prefix=True, workload="shared")
            if setup.cascade_ab:
                cascade_rounds(runs["on"][0], f"shared c{cs} prefix on", sreqs,
                               concurrency=cs, prefix=True, workload="shared")
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
            "agreement": agreements, "errors": errors, "skipped": skipped}


def compare_cascade(pairs: list[tuple[dict, dict]], log=run_log.log) -> dict[str, Any]:
    """The ``cascade_vs_plain`` comparison of interleaved ``(plain, cascade)`` runs: tokens/s
    ratio per round, its median and spread, the decode steps' p50 and the K/V token reads the
    cascade saved."""
    ratios = [c["output_tokens_per_s"] / p["output_tokens_per_s"] for p, c in pairs]
    p, c = pairs[0]
    out = dict(kind="cascade_vs_plain", plain=p["name"], cascade=c["name"], rounds=len(pairs),
               tokens_per_s_over_plain=float(np.median(ratios)),
               tokens_per_s_over_plain_rounds=ratios, spread=float(max(ratios) - min(ratios)),
               decode_step_ms_p50=[(a["decode_step_ms_p50"], b["decode_step_ms_p50"])
                                   for a, b in pairs],
               kv_reads_saved=c["cascade_tokens_saved"] / max(c["decode_kv_tokens"], 1),
               prefix_hit_rate=c["prefix_hit_rate"])
    log(f"    cascade / plain over {len(pairs)} interleaved round(s): median "
        f"{out['tokens_per_s_over_plain']:.3f}x tokens/s (rounds "
        f"{', '.join(f'{r:.3f}' for r in ratios)}; spread {out['spread']:.3f}), decode step "
        f"p50 {', '.join(f'{a:.2f} -> {b:.2f}' for a, b in out['decode_step_ms_p50'])} ms, "
        f"K/V token reads saved {out['kv_reads_saved']:.1%}, prefix hits "
        f"{out['prefix_hit_rate']:.1%}")
    return out


def compare_backends(hb: str, pairs: list[tuple[dict, dict]], log=run_log.log) -> dict[str, Any]:
    """The ``{hb}_vs_paged`` comparison of interleaved ``(paged, other)`` runs: tokens/s ratio
    per round, its median and spread; the K/V budgets (equal) and the peak committed K/V bytes;
    the arena's map/unmap calls in the second half of each run and its prefix pages read in
    place."""
    ratios = [o["output_tokens_per_s"] / p["output_tokens_per_s"] for p, o in pairs]
    peaks = [o["kv_bytes_committed_peak"] / max(p["kv_bytes_committed_peak"], 1)
             for p, o in pairs]
    p, o = pairs[0]
    out = dict(kind=f"{hb}_vs_paged", paged=p["name"], other=o["name"], rounds=len(pairs),
               tokens_per_s_over_paged=float(np.median(ratios)),
               tokens_per_s_over_paged_rounds=ratios,
               spread=float(max(ratios) - min(ratios)), target=TARGET_ARENA_OVER_PAGED,
               kv_budget_bytes=(p["kv_budget_bytes"], o["kv_budget_bytes"]),
               kv_bytes_used_peak_over_paged=float(np.median(peaks)),
               steady_map_calls=[r.get("arena_steady_map_calls") for _, r in pairs],
               steady_unmap_calls=[r.get("arena_steady_unmap_calls") for _, r in pairs],
               shared_pages=o.get("arena_shared_pages"), affine_pages=o.get("arena_affine_pages"),
               adoptions=o.get("arena_adoptions"))
    log(f"    {o['name']} / {p['name']} over {len(pairs)} interleaved round(s): median "
        f"{out['tokens_per_s_over_paged']:.3f}x tokens/s (rounds "
        f"{', '.join(f'{r:.3f}' for r in ratios)}; spread {out['spread']:.3f}), K/V budget "
        f"{p['kv_budget_bytes'] / 2**30:.2f} / {o['kv_budget_bytes'] / 2**30:.2f} GiB, peak "
        f"committed {out['kv_bytes_used_peak_over_paged']:.3f}x, steady map/unmap "
        f"{out['steady_map_calls']}/{out['steady_unmap_calls']}, prefix pages read in place "
        f"{out['shared_pages']} shared + {out['affine_pages']} adopted")
    return out
