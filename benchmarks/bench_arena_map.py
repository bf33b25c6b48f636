#!/usr/bin/env python
"""Arena map/unmap microbenchmark: the cost of one super-page's physical lifecycle.

Run on the GPU machine (after `pip install .` with the CUDA extension), from anywhere except a
directory that shadows the installed package with an unbuilt `jax_kvcm/`:

    python -m benchmarks.bench_arena_map [--json results.json]
    python -m benchmarks.bench_arena_map --cpu --quick     # the memfd path (CPU builds), a smoke test

For each super-page size (2, 4, 8, 16 MiB; --cpu: 4 KiB to 2 MiB) one reservation of
``--pages`` super-pages is made and the native calls are timed in batches over all of them
(median of --repeats batches, microseconds per super-page):

  create     cuMemCreate (CPU: a memfd page handle, ftruncate on growth)
  map        cuMemMap + cuMemSetAccess (CPU: mmap MAP_FIXED | MAP_SHARED)
  unmap      cuMemUnmap (CPU: mmap PROT_NONE over it)
  release    cuMemRelease (CPU: fallocate PUNCH_HOLE)
  remap      unmap + map of an already created handle (what adoption saves per super-page)
  remap_many the same through one map_many + one unmap_many call for all of them

The host-side cost is what is measured: the driver calls are synchronous on the host.

Then (``--churn`` alone, ``--no-churn`` without it; CPU, any build) the shared-prefix churn of
``benchmarks/harness/hot_churn.py`` through the manager on paged and on the arena in the same
device pages: requests of a system prompt drawn from 15 (512 tokens) plus a unique part (64 to
512) and 64 to 256 generated tokens, ``--concurrency`` at a time (admitted while pages are
obtainable, the newest preempted for recompute when a step runs out), the step one ``write_kv``
per pool. Reported: the manager's host time per step (median, p90, p99, mean; split into
admission, prepare_step, complete_step, close), preemptions, and the arena's map / unmap calls,
adoptions and fresh ranges.

    python -m benchmarks.bench_arena_map --churn [--concurrency 256] [--requests 768]

``--under-load`` alone: map / unmap calls while a jitted program keeps the device busy, to see
whether they stall it (``benchmarks/harness/map_under_load.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from benchmarks.harness import map_under_load
from benchmarks.harness.hot_churn import ChurnSpec, churn


def _median_us(fn, n: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6 / n)
    return statistics.median(samples)


def native_rows(native, sizes: list[int], pages: int, repeats: int) -> list[dict]:
    rows = []
    for sp in sizes:
        res = native.Reservation(pages * sp, sp)
        offs = [i * sp for i in range(pages)]
        handles: list[int] = []
        t = {"create": [], "map": [], "unmap": [], "release": [], "remap": [], "remap_many": []}
        for _ in range(repeats):
            t0 = time.perf_counter()
            handles = [res.create_physical() for _ in offs]
            t1 = time.perf_counter()
            for off, h in zip(offs, handles):
                res.map(off, h)
            t2 = time.perf_counter()
            for off in offs:
                res.unmap(off)
            t3 = time.perf_counter()
            for off, h in zip(offs, handles):
                res.map(off, h)
            for off in offs:
                res.unmap(off)
            t4 = time.perf_counter()
            res.map_many(offs, handles)
            res.unmap_many(offs)
            t5 = time.perf_counter()
            for h in handles:
                res.release_physical(h)
            t6 = time.perf_counter()
            for name, dt in (("create", t1 - t0), ("map", t2 - t1), ("unmap", t3 - t2),
                             ("remap", t4 - t3), ("remap_many", t5 - t4),
                             ("release", t6 - t5)):
                t[name].append(dt * 1e6 / pages)
        rows.append({"super_page_bytes": sp, "pages": pages,
                     **{f"{k}_us": round(statistics.median(v), 3) for k, v in t.items()},
                     "num_map_calls": res.num_map_calls, "num_unmap_calls": res.num_unmap_calls})
        res.close()
    return rows


def churn_rows(spec: ChurnSpec) -> list[dict]:
    """The shared-prefix churn (benchmarks/harness/hot_churn.py) on paged and on the arena."""
    return [churn(spec, hot) for hot in ("paged", "arena")]


def print_churn(spec: ChurnSpec, rows: list[dict]) -> None:
    paged = rows[0]
    print(f"\nshared-prefix churn, manager only (CPU): {spec.requests} requests, "
          f"{spec.concurrency} at a time, {rows[0]['device_pages']} pages of "
          f"{spec.tokens_per_page} tokens; host us per step")
    print("| hot | steps | preempted | median | p90 | p99 | mean | vs paged (mean) | admit | "
          "prepare | complete | close | map / unmap calls | by quarter of the steps | "
          "maps per step p50 / p90 / max (steps with any) | quiesces | adoptions / fresh | "
          "peak pages in use / physical |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|---|---|")
    for r in rows:
        calls = (f"{r['arena_num_map_calls']} / {r['arena_num_unmap_calls']}"
                 if "arena_num_map_calls" in r else "-")
        adopt = (f"{r['arena_adoptions']} / {r['arena_fresh_ranges']}"
                 if "arena_adoptions" in r else "-")
        quiesces = r.get("arena_num_quiesces", "-")
        quarters = ("-" if "arena_map_calls_by_quarter" not in r else " ".join(
            f"{m}/{u}" for m, u in zip(r["arena_map_calls_by_quarter"],
                                       r["arena_unmap_calls_by_quarter"])))
        bursts = ("-" if "arena_map_calls_per_step_max" not in r else
                  f"{r['arena_map_calls_per_step_p50']:.0f} / "
                  f"{r['arena_map_calls_per_step_p90']:.0f} / "
                  f"{r['arena_map_calls_per_step_max']} ({r['arena_steps_with_map_calls']})")
        print(f"| {r['hot']} | {r['steps']} | {r['preemptions']} | {r['median_us']:.0f} | "
              f"{r['p90_us']:.0f} | {r['p99_us']:.0f} | {r['mean_us']:.0f} | "
              f"{r['mean_us'] / paged['mean_us']:.2f}x | {r['admit_us_per_step']:.0f} | "
              f"{r['prepare_us_per_step']:.0f} | {r['complete_us_per_step']:.0f} | "
              f"{r['close_us_per_step']:.0f} | {calls} | {quarters} | {bursts} | {quiesces} | "
              f"{adopt} | "
              f"{r['peak_used_pages']} / {r['peak_physical_pages']} |", flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.bench_arena_map``."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_arena_map", description=__doc__.split("\n")[1])
    ap.add_argument("--cpu", action="store_true", help="time the CPU memfd reservation")
    ap.add_argument("--quick", action="store_true", help="few pages, small arena layout")
    ap.add_argument("--pages", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--churn", action="store_true",
                    help="only the shared-prefix churn through the manager (paged vs arena)")
    ap.add_argument("--no-churn", action="store_true", help="only the native timings")
    ap.add_argument("--under-load", action="store_true",
                    help="only map / unmap calls under a running program (device stalls)")
    ap.add_argument("--requests", type=int, default=768)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--unique-tokens", type=int, nargs=2, default=[64, 512], metavar=("LO", "HI"),
                    help="the churn's unique prompt tokens, drawn from [LO, HI)")
    ap.add_argument("--output-tokens", type=int, nargs=2, default=[64, 256], metavar=("LO", "HI"),
                    help="the churn's generated tokens, drawn from [LO, HI)")
    ap.add_argument("--device-pages", type=int, nargs="+", default=[0],
                    help="the churn's device pages, one table each (0: 3/4 of what the running "
                         "sequences need at their longest)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: dict[str, Any] = {}
    if args.under_load:
        rows = under_load_result(args)
        if rows is None:
            return 1
        result["under_load"] = rows
    elif not args.churn:
        timing = timing_result(args)
        if timing is None:
            return 1
        result.update(timing)
    if not (args.no_churn or args.under_load):
        result["churn"] = []
        for pages in args.device_pages:
            spec = ChurnSpec(concurrency=args.concurrency,
                             requests=args.requests // 4 if args.quick else args.requests,
                             device_pages=pages, unique_tokens=tuple(args.unique_tokens),
                             output_tokens=tuple(args.output_tokens))
            rows = churn_rows(spec)
            print_churn(spec, rows)
            result["churn"] += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def native_module(cpu: bool) -> Any:
    """The extension whose ``Reservation`` is timed, or None (printed why) without CUDA."""
    from jax_kvcm import _ffi

    if cpu:
        return _ffi._kvcm_cpu
    if _ffi._kvcm_cuda is None:
        print(f"no CUDA extension: {_ffi.CUDA_IMPORT_ERROR} (use --cpu)", file=sys.stderr)
    return _ffi._kvcm_cuda


def under_load_result(args: argparse.Namespace) -> list[dict] | None:
    """``map_under_load``'s rows (printed) at the 8B arena's super-page (2 MiB; 64 KiB on the
    CPU), or None without the CUDA extension."""
    native = native_module(args.cpu)
    if native is None:
        return None
    rows = []
    for same in (False, True):
        part = map_under_load.under_load_rows(
            native, (64 << 10) if args.cpu else (2 << 20), target_ms=5.0 if args.quick else 20.0,
            repeats=3 if args.quick else 7, same_reservation=same)
        map_under_load.print_rows(part, "cpu (memfd)" if args.cpu else "cuda (VMM)")
        rows += part
    return rows


def timing_result(args: argparse.Namespace) -> dict | None:
    """The native and arena-level timings (printed), or None without the CUDA extension."""
    native = native_module(args.cpu)
    if native is None:
        return None
    if args.cpu:
        sizes = [4 << 10, 64 << 10, 2 << 20]
    else:
        sizes = [2 << 20, 4 << 20, 8 << 20, 16 << 20]
    pages = args.pages or (16 if args.quick else 256)
    result = {"backend": "cpu" if args.cpu else "cuda",
              "native": native_rows(native, sizes, pages, args.repeats)}
    print(f"backend {result['backend']}: microseconds per super-page (median of "
          f"{args.repeats} batches of {pages})")
    print("| super-page | create | map | unmap | release | unmap+map | batched unmap+map |")
    print("|---|---|---|---|---|---|---|")
    for r in result["native"]:
        print(f"| {r['super_page_bytes'] >> 10} KiB | {r['create_us']} | {r['map_us']} | "
              f"{r['unmap_us']} | {r['release_us']} | {r['remap_us']} | "
              f"{r['remap_many_us']} |")
    return result


if __name__ == "__main__":
    sys.exit(main())
