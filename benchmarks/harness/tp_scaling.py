"""Tensor parallelism in the serving benchmark: one ``--tensor-parallel`` value's params, the
largest concurrency each value fits (arithmetic, per device: see ``benchmarks/bench_serve.py``),
the collectives' share of a decode step, and the scaling table."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from benchmarks.harness import device_profile, loop_profile
from benchmarks.harness.serve_setup import KV_MEMORY_FRACTION, TARGET_TP2_OVER_TP1, Setup
from examples.llama import model as llama
from examples.llama import tp


def tp_params(params: Any, model: llama.LlamaConfig, n: int) -> Any:
    """The paged runs' params at ``--tensor-parallel n``: ``params`` (n = 1), or their shards on
    the first ``n`` devices (``tp.shard_params``, done once per value: the servers of the runs
    get them as they are)."""
    return params if n == 1 else tp.shard_params(params, model, tp.make_mesh(n))


def device_weight_bytes(params: Any, device: Any = None) -> int:
    """Bytes of ``params`` held on ``device`` (default the first device): each leaf's shard
    there (the whole leaf when it lives on that device alone; 0 for a leaf elsewhere)."""
    device = jax.devices()[0] if device is None else device
    total = 0
    for x in jax.tree_util.tree_leaves(params):
        sharding = getattr(x, "sharding", None)
        if sharding is None or device not in sharding.device_set:
            continue
        total += int(np.prod(sharding.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize
    return total


def device_memory_limit(n: int) -> int | None:
    """The smallest allocator limit (``memory_stats()["bytes_limit"]``: the memory XLA may use,
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the device's) over the first ``n`` devices; None where
    a device reports none (the CPU)."""
    limits = []
    for d in jax.devices()[:n]:
        try:
            st = d.memory_stats() or {}
        except Exception:  # noqa: BLE001
            st = {}
        if "bytes_limit" not in st:
            return None
        limits.append(int(st["bytes_limit"]))
    return min(limits) if limits else None


def max_concurrency(memory_bytes: int, weight_bytes: int, page_bytes: int, pages_per_seq: int,
                    kv_fraction: float = KV_MEMORY_FRACTION) -> dict[str, Any]:
    """The largest concurrency ``c`` whose pool fits one device (see the module doc): the K/V
    budget is ``kv_fraction x (memory_bytes - weight_bytes)``; the pool of ``c`` sequences is
    sized as the run sizes it, ``c x (pages_per_seq + 1)`` pages (every sequence at its longest,
    plus a page of slack) plus the null page, each of ``page_bytes`` (one device's bytes of a
    page, K and V of every layer, summed over layer groups). All arguments per device, bytes."""
    budget = int(kv_fraction * (memory_bytes - weight_bytes))
    pages = max(0, budget // page_bytes - 1)
    return {"memory_bytes": memory_bytes, "weight_bytes_per_device": weight_bytes,
            "page_bytes_per_device": page_bytes, "kv_fraction": kv_fraction,
            "kv_budget_bytes": budget, "pool_pages_fit": pages,
            "pages_per_seq": pages_per_seq,
            "max_concurrency": pages // (pages_per_seq + 1)}


def tp_capacity(setup: Setup, n: int, weight_bytes: int, res: dict[str, Any],
                memory_bytes: int | None, kv_fraction: float) -> dict[str, Any]:
    """:func:`max_concurrency` at ``--tensor-parallel n`` from the numbers of that value's part
    (``res``: its ``bench`` output; the page bytes its paged runs' ``KVCacheConfig`` reported per
    device) and ``weight_bytes`` (its params on one device)."""
    row: dict[str, Any] = {"tensor_parallel": n, "max_len": setup.max_total_len,
                           "page_size": setup.page_size}
    pages = [r["device_page_bytes"] for r in res["results"] if r.get("device_page_bytes")]
    if memory_bytes is None:
        row["error"] = ("the device reports no allocator limit (the CPU): --device-memory-gib "
                        "gives one")
    elif not pages:
        row["error"] = "no paged run completed at this value"
    else:
        row.update(max_concurrency(memory_bytes, weight_bytes, int(sum(pages[0])),
                                   setup.pages_per_seq, kv_fraction))
    return row


def format_capacity(rows: Sequence[dict[str, Any]], source: str) -> str:
    """A markdown table of :func:`tp_capacity` rows."""
    ok = [r for r in rows if "error" not in r]
    head = ("Largest concurrency per --tensor-parallel value (per device: K/V budget = "
            f"{ok[0]['kv_fraction']:g} x (memory - weights); pool = concurrency x (pages per "
            "sequence + 1) + the null page; a sequence at its longest, input + output = "
            f"{ok[0]['max_len']} tokens = {ok[0]['pages_per_seq']} pages of "
            f"{ok[0]['page_size']}; memory: {source}):" if ok else
            "Largest concurrency per --tensor-parallel value:")
    lines = [head, "| TP | memory GiB | weights GiB / device | K/V bytes / page / device | "
             "K/V budget GiB | pages | largest concurrency |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tensor_parallel']} | | | | | | n/a: {r['error']} |")
            continue
        lines.append(f"| {r['tensor_parallel']} | {r['memory_bytes'] / 2**30:.2f} | "
                     f"{r['weight_bytes_per_device'] / 2**30:.2f} | "
                     f"{r['page_bytes_per_device']:,} | {r['kv_budget_bytes'] / 2**30:.2f} | "
                     f"{r['pool_pages_fit']:,} | {r['max_concurrency']:,} |")
    return "\n".join(lines)


def collectives_share(res: dict[str, Any], kind: str = "decode") -> dict[str, float] | None:
    """From a profiled run (``--profile``): the collectives' device ms per ``kind`` step, their
    share of the step (device ops, idle and host gap: the breakdown's total) and of the device's
    busy time (its ops); None without a profile of such steps."""
    k = res.get("profile", {}).get("kinds", {}).get(kind)
    if k is None:
        return None
    ms = k["ms_per_step"]
    busy = sum(ms[c] for c in device_profile.CATEGORIES)
    coll = ms[device_profile.COLLECTIVES]
    return {"ms_per_step": coll, "steps": k["steps"], "share_of_step": coll / ms["total"]
            if ms["total"] else 0.0, "share_of_busy": coll / busy if busy else 0.0}


def tp_scaling(results: Sequence[dict[str, Any]],
               agreement: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per paged run of a ``--tensor-parallel`` sweep and value: output tok/s and its ratio to
    the first value's (TP 1 when given first), decode step ms, TTFT/ITL p50, the collectives'
    share of the decode step (with ``--profile``) and the requests whose tokens equal the first
    value's."""
    same = {(a["a"], a["b"]): a for a in agreement}
    first: dict[str, dict] = {}
    rows = []
    for r in results:
        if r["path"] != "paged":
            continue
        run = loop_profile.sweep_base(r["name"])
        ref = first.setdefault(run, r)
        a = same.get((ref["name"], r["name"]))
        rows.append({"run": run, "name": r["name"], "tensor_parallel": r["tensor_parallel"],
                     "reference": ref["name"], "output_tokens_per_s": r["output_tokens_per_s"],
                     "over_reference": (r["output_tokens_per_s"]
                                        / max(ref["output_tokens_per_s"], 1e-9)),
                     "decode_step_ms_p50": r["decode_step_ms_p50"],
                     "ttft_p50_s": r["ttft_p50_s"], "itl_p50_ms": r["itl_p50_ms"],
                     "collectives": collectives_share(r),
                     "identical": None if a is None else a["identical"],
                     "requests": r["requests"]})
    return rows


def format_tp_scaling(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of :func:`tp_scaling` (the target: ``TARGET_TP2_OVER_TP1`` at TP 2
    against TP 1)."""
    lines = [f"Tensor parallelism (output tok/s against the first --tensor-parallel value on the "
             f"same requests; target >= {TARGET_TP2_OVER_TP1}x at TP 2 over TP 1; collectives: "
             "all-reduce / all-gather device ms per decode step from --profile, shard 0, and "
             "their share of the step / of the device's busy time):",
             "| run | TP | output tok/s | / first | target | decode step ms | TTFT p50 s | "
             "ITL p50 ms | collectives ms / decode step | share of step / busy | tokens = first |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        c = r["collectives"]
        ref_tp = next((x["tensor_parallel"] for x in rows if x["name"] == r["reference"]), 0)
        target = ""
        if r["tensor_parallel"] == 2 and ref_tp == 1:
            target = ("met" if r["over_reference"] >= TARGET_TP2_OVER_TP1 else "NOT met")
        same = "" if r["identical"] is None else f"{r['identical']}/{r['requests']}"
        lines.append(
            f"| {r['run']} | {r['tensor_parallel']} | {r['output_tokens_per_s']:,.0f} | "
            f"{r['over_reference']:.2f}x | {target} | {r['decode_step_ms_p50']:.2f} | "
            f"{r['ttft_p50_s']:.3f} | {r['itl_p50_ms']:.1f} | "
            + (f"{c['ms_per_step']:.3f} | {c['share_of_step']:.1%} / {c['share_of_busy']:.1%}"
               if c else "- | -") + f" | {same} |")
    return "\n".join(lines)

