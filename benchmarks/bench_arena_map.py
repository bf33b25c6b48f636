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

plus, at the arena level (jax_kvcm._arena.Arena, 8B-shaped layout: 32 layers x {K, V}, 16
tokens x 8 kv heads x 128 dims bf16 per slot, i.e. 64 super-pages per chunk):

  grow chunk   Arena.ensure mapping one fresh chunk (64 x create + map)
  adopt        close + admit + ensure of a parked range (steady state: no map call)
  reclaim      a parked range unmapped under pressure (64 x unmap + release per chunk)

The host-side cost is what is measured: the driver calls are synchronous on the host.

``--prefix-workload`` instead replays the seed's shared-prefix workload through the arena's
allocator alone (no model, nothing written: on CPU the memfd pages are never touched), 8B-shaped
(64 pages = 1,024 tokens per chunk): requests of a system prompt drawn from 15 (lengths around 512
tokens) plus a unique prompt part, to ISL + OSL tokens, ``--concurrency`` at a time (the oldest
closes, the next is admitted), once per alias unit (whole chunks, as before page granularity,
and one page) and once more with pages but ``remap_spans=False``. Reported: alias hits,
partial aliases, prompt tokens aliased, steady-state map / unmap calls (second half), and the
peak physical bytes the active sequences map beside what the paged backend would hold for the
same pages (shared prompt pages once, the rest per sequence).
On CPU every mapped super-page is one kernel mapping: at concurrency 256 the 8B shape passes
the default limit of 65,530 per process (``vm.max_map_count``); use ``--concurrency 128``.
``--spare-ranges``: ranges beyond the concurrency (parked ones keep their spans mapped, so more
admissions find their prompt's span already in place).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any


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


def arena_rows(cpu: bool, repeats: int, quick: bool) -> list[dict]:
    from jax_kvcm._arena import Arena, ArenaConfig, ArenaLayout

    layers = 2 if quick else 32
    lay = ArenaLayout(num_layers=layers, tokens_per_page=16, num_kv_heads=8, head_dim=128,
                      dtype="bfloat16")
    sp = 2 << 20
    per_chunk = 2 * layers * sp
    cfg = ArenaConfig(max_sequences=8, max_pages_per_sequence=64, budget_bytes=5 * per_chunk,
                      super_page_bytes=sp)
    rows = []
    with Arena(cfg, lay, backend="cpu" if cpu else "cuda") as a:
        seqs = [a.admit() for _ in range(4)]
        grow = []
        for s in seqs:
            t0 = time.perf_counter()
            assert a.ensure(s, 1)
            grow.append((time.perf_counter() - t0) * 1e6)
        before = a.stats()

        def adopt():
            for i, s in enumerate(seqs):
                a.close(s)
                seqs[i] = a.admit()
                assert a.ensure(seqs[i], 1)

        adopt_us = _median_us(adopt, len(seqs), repeats)
        after = a.stats()
        reclaim = []
        for _ in range(repeats):
            fresh = a.admit()  # nothing parked: a fresh range
            a.close(seqs[0])  # parked, still mapped; the budget is full
            t0 = time.perf_counter()
            ok = a.ensure(fresh, 1)  # reclaims the parked range, then maps a new chunk
            reclaim.append((time.perf_counter() - t0) * 1e6)
            assert ok
            seqs[0] = fresh
        rows.append({"layout": f"{layers} layers x KV, 32 KiB slots", "super_pages_per_chunk":
                     2 * layers, "grow_chunk_us": round(statistics.median(grow), 1),
                     "adopt_us": round(adopt_us, 1),
                     "adopt_map_calls": after.num_map_calls - before.num_map_calls,
                     "adopt_unmap_calls": after.num_unmap_calls - before.num_unmap_calls,
                     "reclaim_and_grow_us": round(statistics.median(reclaim), 1)})
    return rows


def prefix_workload_rows(cpu: bool, requests: int, concurrency: int, isl: int, osl: int,
                         seed: int, spare: int = 1) -> list[dict]:
    import numpy as np

    from jax_kvcm._arena import Arena, ArenaConfig, ArenaLayout

    tpp, sp = 16, 2 << 20
    lay = ArenaLayout(num_layers=32, tokens_per_page=tpp, num_kv_heads=8, head_dim=128,
                      dtype="bfloat16")
    max_pages = -(-(isl + osl) // tpp)
    rng = np.random.default_rng(seed)
    systems = rng.integers(384, 641, 15).tolist()  # system prompt lengths, mean ~512 tokens
    picks = rng.integers(0, 15, requests).tolist()
    rows = []
    for unit_name, remap in (("chunk", True), ("page", True), ("page, no remap", False)):
        probe = Arena(ArenaConfig(1, max_pages, 4 * 2 * 32 * sp, sp), lay,
                      backend="cpu" if cpu else "cuda")
        ppc = probe.pages_per_chunk
        per_range = probe.chunks_per_range + 1  # NOTE: room for the skip of a partial alias
        probe.close_arena()
        unit = ppc if unit_name == "chunk" else 1
        per_range += int(not remap)
        budget = (1 + (concurrency + spare) * per_range + 64) * 2 * 32 * sp
        cfg = ArenaConfig(max_sequences=concurrency + spare, max_pages_per_sequence=max_pages,
                          budget_bytes=budget, super_page_bytes=sp, alias_unit_pages=unit,
                          remap_spans=remap)
        with Arena(cfg, lay, backend="cpu" if cpu else "cuda") as a:
            live: list = []
            half = None
            peak_arena = peak_paged = aliased_tokens = 0
            for r, sysid in enumerate(picks):
                sys_pages = systems[sysid] // tpp  # pages holding only the system prompt

                def keys(n_pages: int) -> list:
                    out = [("sys", sysid, e) if e <= sys_pages else ("req", r, e)
                           for e in range(1, n_pages + 1)]
                    return out[unit - 1::unit]

                if len(live) == concurrency:
                    seq, n, ks = live.pop(0)
                    a.close(seq, ks)
                seq = a.admit(keys((isl - 1) // tpp))
                assert seq is not None and a.ensure(seq, max_pages)
                aliased_tokens += seq.num_aliased_pages * tpp
                live.append((seq, max_pages, keys(max_pages)))
                if r == requests // 2:
                    half = a.stats()
                chunks = {id(c) for s, _, _ in live for c in s._range.chunks if c is not None}
                peak_arena = max(peak_arena, len(chunks) * a.chunk_bytes)
                shared = {picks[r - len(live) + 1 + i] for i in range(len(live))}
                pages = sum(max_pages - systems[picks[r - len(live) + 1 + i]] // tpp
                            for i in range(len(live))) + sum(systems[i] // tpp for i in shared)
                peak_paged = max(peak_paged, pages * 2 * 32 * lay.slot_bytes)
            st = a.stats()
            rows.append({"alias_unit": unit_name, "requests": requests,
                         "concurrency": concurrency, "alias_hits": st.num_alias_hits,
                         "partial_aliases": st.num_partial_aliases,
                         "aliased_prompt_tokens": aliased_tokens,
                         "aliased_bytes": st.aliased_bytes,
                         "steady_map_calls": st.num_map_calls - half.num_map_calls,
                         "steady_unmap_calls": st.num_unmap_calls - half.num_unmap_calls,
                         "peak_active_bytes": peak_arena, "paged_bytes": peak_paged})
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.bench_arena_map``."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_arena_map", description=__doc__.split("\n")[1])
    ap.add_argument("--cpu", action="store_true", help="time the CPU memfd reservation")
    ap.add_argument("--quick", action="store_true", help="few pages, small arena layout")
    ap.add_argument("--pages", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prefix-workload", action="store_true",
                    help="replay the shared-prefix workload through the allocator instead")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--spare-ranges", type=int, default=1,
                    help="ranges beyond --concurrency (parked ones keep spans mapped)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prefix_workload:
        result: Any = prefix_workload_rows(args.cpu, args.requests, args.concurrency, 1024, 1024,
                                           0, spare=args.spare_ranges)
        print("| alias unit | hits | partial | prompt tokens aliased | aliased GiB | steady "
              "map / unmap | peak active GiB | paged GiB |")
        print("|---|---|---|---|---|---|---|---|")
        for r in result:
            print(f"| {r['alias_unit']} | {r['alias_hits']} | {r['partial_aliases']} | "
                  f"{r['aliased_prompt_tokens']} | {r['aliased_bytes'] / 2**30:.1f} | "
                  f"{r['steady_map_calls']} / {r['steady_unmap_calls']} | "
                  f"{r['peak_active_bytes'] / 2**30:.1f} | {r['paged_bytes'] / 2**30:.1f} |")
    else:
        result = timing_result(args)
        if result is None:
            return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def timing_result(args: argparse.Namespace) -> dict | None:
    """The native and arena-level timings (printed), or None without the CUDA extension."""
    from jax_kvcm import _ffi

    if args.cpu:
        native = _ffi._kvcm_cpu
        sizes = [4 << 10, 64 << 10, 2 << 20]
    else:
        native = _ffi._kvcm_cuda
        if native is None:
            print(f"no CUDA extension: {_ffi.CUDA_IMPORT_ERROR} (use --cpu)", file=sys.stderr)
            return None
        sizes = [2 << 20, 4 << 20, 8 << 20, 16 << 20]
    pages = args.pages or (16 if args.quick else 256)
    result = {"backend": "cpu" if args.cpu else "cuda",
              "native": native_rows(native, sizes, pages, args.repeats),
              "arena": arena_rows(args.cpu, args.repeats, args.quick)}
    print(f"backend {result['backend']}: microseconds per super-page (median of "
          f"{args.repeats} batches of {pages})")
    print("| super-page | create | map | unmap | release | unmap+map | batched unmap+map |")
    print("|---|---|---|---|---|---|---|")
    for r in result["native"]:
        print(f"| {r['super_page_bytes'] >> 10} KiB | {r['create_us']} | {r['map_us']} | "
              f"{r['unmap_us']} | {r['release_us']} | {r['remap_us']} | "
              f"{r['remap_many_us']} |")
    for r in result["arena"]:
        print(f"arena ({r['layout']}, {r['super_pages_per_chunk']} super-pages per chunk): "
              f"grow one chunk {r['grow_chunk_us']} us; adoption cycle {r['adopt_us']} us per "
              f"sequence with {r['adopt_map_calls']} map / {r['adopt_unmap_calls']} unmap calls; "
              f"reclaim + grow {r['reclaim_and_grow_us']} us")
    return result


if __name__ == "__main__":
    sys.exit(main())
