#!/usr/bin/env python
"""Cold-tier migration benchmark (issue 3): StorageManager.migrate vs plain copies, one run, ratios.

Run on the GPU machine (after `pip install .` of jax_kvcm with its CUDA extension), from anywhere
except a directory that shadows the installed package with an unbuilt `jax_kvcm/`:

    python -m benchmarks.bench_migration [--json results.json]
    JAX_PLATFORMS=cpu python -m benchmarks.bench_migration --quick   # CPU smoke test, tiny shapes
    JAX_PLATFORMS=cpu python -m benchmarks.bench_migration --disk-only --pages 1024   # host<->disk

Workload: one Llama-3-8B-shaped hot pool group (32 layers x {K, V}, 16 tokens per page, 8 kv heads,
head dim 128, bf16): a hot page is 64 pieces of 32 KiB, a concatenated cold page 2 MiB. The hot
pools have 2 * 4096 usable slots, all allocated and filled with N(0, 1) values; every repetition
moves a fresh random (non-contiguous) set of 4096 of them (8 GiB) and back, so page sets rotate.

hot <-> host (GB/s = 1e9 bytes per second of *uncompressed* hot bytes; int8 also in cold bytes):
  contiguous       torch: one 1 GiB copy_ between a CUDA tensor and a pinned CPU tensor (the
                   ceiling; measured at the start and at the end of the run, ratios use the
                   median of both sets of samples)
  concat           StorageManager.migrate with ConcatCodec(copy="auto"): its default CUDA mover
                   for a mapped pinned tier, one copy-kernel launch per codec call (CTA per
                   32 KiB piece)
  concat[memcpy-batch] a manager of its own with ConcatCodec(copy="memcpy", memcpy_batch=True):
                   one cuMemcpyBatchAsync per codec call (4096 pages = one call, 262144
                   descriptors of 32 KiB)
  concat[no-batch] a manager of its own with ConcatCodec(copy="memcpy", memcpy_batch=False):
                   the fallback before CUDA 12.8, one cudaMemcpyAsync per 32 KiB piece issued
                   from C++
                   (every codec is built with explicit options: the JAX_KVCM_CONCAT_COPY /
                   JAX_KVCM_NO_MEMCPY_BATCH environment defaults do not reach any row)
  int8             StorageManager.migrate with Int8Codec (CUDA kernels reading/writing the mapped
                   pinned host tier directly; cold page 1026 KiB)
  per-piece loop   torch: for each page and each of the 64 pools, dst[...].copy_(src[...],
                   non_blocking=True) between a CUDA tensor and a pinned CPU tensor (one
                   cudaMemcpyAsync per piece, issued from Python)
  Each migration is timed end to end: the migrate() call plus waiting for its completion (the
  host-slot fences of an encode, the donated hot pools of a decode); "submit ms" is the migrate()
  call alone (Python bookkeeping + dispatch). Median of --repeats samples after one warm-up.

host <-> disk (concat pages; GB/s of bytes moved):
  manager          StorageManager.migrate HOST->DISK and DISK->HOST: pwrite/pread of the slot runs
                   in pieces of at most 4 MiB plus a CRC32C per page (computed on write, verified
                   on read), spread over the disk tier's native I/O threads (min(8, cores))
  plain            os.pwrite / os.preadv of the same number of bytes, 1 GiB per call, to a
                   preallocated file in the same directory, from / into host memory
  NOTE: neither side calls fsync (the manager never does), so writes measure the copy into the
  page cache; between timed steps both files are fsync'ed outside the timed region (reported as
  "+fsync" GB/s, for information) so each write starts with no dirty pages of its own. Reads are
  served by the page cache for both (the caches are NOT dropped: shared host), unless
  --disk-uncached-reads asks for posix_fadvise(DONTNEED) on our own two files before each read.
  One untimed warm-up repetition of both sides, then --disk-repeats timed ones (medians), the
  order of the two sides alternating; no new repetition starts after --disk-budget-s seconds.
  --disk-only runs this part alone (full-size pages, hot tier of --pages slots, no torch, no
  hot<->host timing): it needs no GPU, so the disk tier can be measured on any machine.
  Both sides move the host tier's bytes: the manager from its slots, the plain write from the
  same pinned memory, the plain read into a separate pre-faulted buffer.

Verified before timing: the concat round trip is byte-exact (cold bytes equal the documented
layout; hot pages equal the originals after host->hot) on a sample of pages; int8 stays within
Int8Codec's stated per-element bound and decodes exactly as its layout says; the disk round trip is
byte-exact; the per-piece loop copies the right bytes.

Targets (issue 3): concat >= 0.8 x contiguous both ways; int8 >= 1.5 x concat in uncompressed
bytes/s; manager host<->disk >= 0.8 x plain, both ways.
"""

from __future__ import annotations

import os

# JAX must not grab 75% of the GPU up front: torch shares the device in this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import jax  # noqa: E402

from benchmarks.harness.migration_env import (  # noqa: E402
    DEV, FULL, HOST, LG, QUICK, TARGET_CONCAT_VS_CONTIG, TARGET_DISK_VS_PLAIN,
    TARGET_INT8_VS_CONCAT, GiB, Shape, bench_contiguous, bench_piece_loop, environment,
    free_memory, fs_type, log, pick_disk_dir, row)
from benchmarks.harness.migration_report import plan_sizes, print_tables, ratios  # noqa: E402
from benchmarks.harness.migration_storage import (bench_disk, build_manager,  # noqa: E402
                                                  time_cycles, verify_concat, verify_int8,
                                                  wait_host)
from benchmarks.harness.timing import short_error  # noqa: E402
from jax_kvcm import ConcatCodec, Int8Codec  # noqa: E402
from jax_kvcm._storage import StorageManager  # noqa: E402

# ----------------------------------------------------------------------------------------------
# phases


def _concat_hot_host(sm: StorageManager, slots_pool: np.ndarray, shape: Shape,
                     args: argparse.Namespace, rng: np.random.Generator, name: str,
                     results: dict[str, Any]) -> list[dict[str, Any]]:
    """The hot <-> host part of the concat phase: verification, then timed cycles of the
    default mover and of the two memcpy movers."""
    rows: list[dict[str, Any]] = []
    batch = ("copy kernel, one launch per call" if jax.default_backend() == "gpu"
             else "CPU memcpy")
    try:
        v = verify_concat(sm, slots_pool, shape.pages, rng, args.sample_pages)
    except Exception as e:  # noqa: BLE001
        v = {"ok": False, "error": short_error(e)}
        traceback.print_exc()
    results["verification"]["concat"] = v
    log(f"  concat check: {v}")
    rows += time_cycles(sm, slots_pool, shape, args.repeats, rng, name, None,
                        note=f"{batch}; check {'ok' if v.get('ok') else 'FAIL'}")
    return rows


def _concat_memcpy_rows(shape: Shape, args: argparse.Namespace,
                        rng: np.random.Generator) -> list[dict[str, Any]]:
    """The memcpy movers, each on a manager built with its codec options (one at a time, after
    the default mover's manager is closed): one cuMemcpyBatchAsync per call (the codec design's
    original path), then one cudaMemcpyAsync per descriptor (the fallback before CUDA 12.8)."""
    rows: list[dict[str, Any]] = []
    for label, batched, note in (
            ("concat[memcpy-batch]", True,
             f'ConcatCodec(copy="memcpy"): one cuMemcpyBatchAsync per call, '
             f"{shape.pages * 2 * shape.num_layers} descriptors"),
            ("concat[no-batch]", False,
             f'ConcatCodec(copy="memcpy", memcpy_batch=False): one cudaMemcpyAsync per '
             f"{shape.piece_bytes >> 10} KiB piece, from C++")):
        if jax.default_backend() != "gpu":
            note = "no effect on CPU (same memcpy path)"
        sm = None
        try:
            sm, slots_pool = build_manager(
                shape, ConcatCodec(copy="memcpy", memcpy_batch=batched),
                shape.pages + args.host_extra_pages, None, 0, args.seed + 1)
            rows += time_cycles(sm, slots_pool, shape, args.piece_repeats, rng, label, None,
                                note=note, warmup=1)
        except Exception as e:  # noqa: BLE001
            rows.append(row("hot<->host", label, "both", error=short_error(e)))
            log(f"  {label}: ERROR {short_error(e)}")
        finally:
            if sm is not None:
                sm.close()
            del sm
            free_memory()
    return rows


def run_concat(shape: Shape, args: argparse.Namespace, disk_dir: str | None, disk_pages: int,
               results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(args.seed + 1)
    name = "concat (StorageManager.migrate, ConcatCodec)"
    t0 = time.perf_counter()
    try:
        sm, slots_pool = build_manager(shape, ConcatCodec(copy="auto", memcpy_batch=True),
                                       shape.pages + args.host_extra_pages,
                                       disk_dir, disk_pages, args.seed + 1)
    except Exception as e:  # noqa: BLE001
        log(f"  concat manager: ERROR {short_error(e)}")
        traceback.print_exc()
        return [row("hot<->host", name, "both", error=short_error(e))]
    try:
        hp = sm.host_pools[0]
        results["concat_manager"] = {
            "host_slots": hp.num_slots, "host_pinned": hp.pinned,
            "cold_page_bytes": hp.slot_bytes, "hot_slots": shape.hot_slots,
            "disk_slots": sm.disk_pools[0].num_slots if sm.disk_pools else 0,
            "setup_s": round(time.perf_counter() - t0, 2)}
        log(f"  manager: {results['concat_manager']}")
        if not args.disk_only:
            rows += _concat_hot_host(sm, slots_pool, shape, args, rng, name, results)
        if disk_pages and not args.skip_disk:
            log(f"\n[host <-> disk] {disk_pages} pages of {hp.slot_bytes / 2**20:.3g} MiB = "
                 f"{disk_pages * hp.slot_bytes / GiB:.3g} GiB in {disk_dir} "
                 f"({fs_type(disk_dir)})")
            try:
                src = rng.choice(slots_pool, disk_pages, replace=False).astype(np.int32)
                host = sm.migrate(LG, DEV, src, HOST)
                wait_host(sm, host)
                drows, dcheck = bench_disk(sm, host, args.disk_repeats, args.disk_budget_s,
                                           args.disk_uncached_reads, disk_dir, args.sample_pages,
                                           rng)
                results["verification"]["disk"] = dcheck
                rows += drows
            except Exception as e:  # noqa: BLE001
                results["verification"]["disk"] = {"ok": False, "error": short_error(e)}
                rows.append(row("host<->disk", "StorageManager.migrate", "both",
                                error=short_error(e)))
                log(f"  disk: ERROR {short_error(e)}")
                traceback.print_exc()
        results["concat_manager"]["stats"] = sm.stats()
    except Exception as e:  # noqa: BLE001
        rows.append(row("hot<->host", name, "both", error=short_error(e)))
        log(f"  concat: ERROR {short_error(e)}")
        traceback.print_exc()
    finally:
        sm.close()
        del sm
        free_memory()
    if not args.disk_only:
        rows += _concat_memcpy_rows(shape, args, rng)
    return rows


def run_int8(shape: Shape, args: argparse.Namespace, results: dict[str, Any]
             ) -> list[dict[str, Any]]:
    rng = np.random.default_rng(args.seed + 2)
    name = "int8 (StorageManager.migrate, Int8Codec)"
    t0 = time.perf_counter()
    try:
        sm, slots_pool = build_manager(shape, Int8Codec(), shape.pages + args.host_extra_pages,
                                       None, 0, args.seed + 2)
    except Exception as e:  # noqa: BLE001
        log(f"  int8 manager: ERROR {short_error(e)}")
        traceback.print_exc()
        return [row("hot<->host", name, "both", error=short_error(e))]
    rows: list[dict[str, Any]] = []
    try:
        hp = sm.host_pools[0]
        results["int8_manager"] = {"host_slots": hp.num_slots, "host_pinned": hp.pinned,
                                   "cold_page_bytes": hp.slot_bytes,
                                   "setup_s": round(time.perf_counter() - t0, 2)}
        log(f"  manager: {results['int8_manager']}")
        try:
            v = verify_int8(sm, shape, slots_pool, shape.pages, rng, args.sample_pages)
        except Exception as e:  # noqa: BLE001
            v = {"ok": False, "error": short_error(e)}
            traceback.print_exc()
        results["verification"]["int8"] = v
        log(f"  int8 check: {v}")
        kern = "CUDA kernels" if jax.default_backend() == "gpu" else "CPU handler"
        rows += time_cycles(sm, slots_pool, shape, args.repeats, rng, name, hp.slot_bytes,
                            note=f"{kern}; check {'ok' if v.get('ok') else 'FAIL'}")
        results["int8_manager"]["stats"] = sm.stats()
    except Exception as e:  # noqa: BLE001
        rows.append(row("hot<->host", name, "both", error=short_error(e)))
        log(f"  int8: ERROR {short_error(e)}")
        traceback.print_exc()
    finally:
        sm.close()
        del sm
        free_memory()
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.bench_migration``."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_migration", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write all results (with raw samples) here")
    p.add_argument("--quick", action="store_true", help="tiny shapes; runs on CPU")
    p.add_argument("--repeats", type=int, default=5, help="timed samples per migration (median)")
    p.add_argument("--contig-repeats", type=int, default=10)
    p.add_argument("--piece-repeats", type=int, default=3,
                   help="timed samples of the per-piece methods (slow: ~262k copies each)")
    p.add_argument("--pages", type=int, default=None, help="pages per migration (default 4096)")
    p.add_argument("--host-extra-pages", type=int, default=64,
                   help="host tier slots beyond --pages")
    p.add_argument("--sample-pages", type=int, default=64, help="pages checked by verification")
    p.add_argument("--disk-dir", default=None,
                   help="parent directory of the disk files (default: the temp dir, if it is "
                        "not tmpfs, else /var/tmp, else the current directory)")
    p.add_argument("--disk-pages", type=int, default=None, help="default: --pages")
    p.add_argument("--disk-repeats", type=int, default=3)
    p.add_argument("--disk-budget-s", type=float, default=90.0,
                   help="start no further timed disk repetition after this many seconds (the "
                        "warm-up and at least one timed repetition always run)")
    p.add_argument("--disk-uncached-reads", action="store_true",
                   help="posix_fadvise(DONTNEED) our own two files before each timed read")
    p.add_argument("--skip-disk", action="store_true")
    p.add_argument("--disk-only", action="store_true",
                   help="only host<->disk (full-size pages, hot tier of --pages slots, no torch, "
                        "no hot<->host timing, no int8): runs without a GPU")
    p.add_argument("--skip-torch", action="store_true",
                   help="skip the torch baselines (contiguous and per-piece loop)")
    p.add_argument("--skip-int8", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    shape = QUICK if args.quick else FULL
    if args.quick:
        args.repeats = min(args.repeats, 2)
        args.contig_repeats = min(args.contig_repeats, 3)
        args.piece_repeats = min(args.piece_repeats, 1)
        args.disk_repeats = min(args.disk_repeats, 2)
        args.host_extra_pages = min(args.host_extra_pages, 8)
        args.sample_pages = min(args.sample_pages, 16)
    if args.pages:
        shape = Shape(**{**shape.__dict__, "pages": args.pages, "hot_slots": 2 * args.pages})
    if args.disk_only:
        if args.skip_disk:
            p.error("--disk-only and --skip-disk exclude each other")
        args.skip_torch = args.skip_int8 = True
        # The hot pages only feed the host tier once: no second set for random draws.
        shape = Shape(**{**shape.__dict__, "hot_slots": shape.pages})

    t_start = time.perf_counter()
    disk_dir = None if args.skip_disk else pick_disk_dir(args.disk_dir)
    try:
        env = environment(disk_dir)
        log("environment:", json.dumps(env))
        if env["backend"] != "gpu" and not (args.quick or args.disk_only):
            log("WARNING: no GPU backend; full shapes on CPU will be very slow (use --quick)")
        shape, disk_pages, notes = plan_sizes(shape, args, disk_dir)
        for n in notes:
            log(n)
        log(f"workload: {shape.describe()}; disk part {disk_pages} pages")
        results: dict[str, Any] = {"verification": {}, "scaling_notes": notes}
        rows: list[dict[str, Any]] = []

        if not args.skip_torch:
            log("\n[contiguous pinned copy, start]")
            rows += bench_contiguous(shape, args.contig_repeats, "start")
            log("\n[per-piece torch loop]")
            prow, pcheck = bench_piece_loop(shape, args.piece_repeats, args.seed)
            rows += prow
            results["verification"]["per_piece_loop"] = pcheck
        log("\n[concat codec]")
        rows += run_concat(shape, args, disk_dir, disk_pages, results)
        if not args.skip_int8:
            log("\n[int8 codec]")
            rows += run_int8(shape, args, results)
        if not args.skip_torch:
            log("\n[contiguous pinned copy, end]")
            rows += bench_contiguous(shape, args.contig_repeats, "end")

        rat = ratios(rows)
        print_tables(rows, rat, shape)
        ver = results["verification"]
        print("\nverification: " + "; ".join(
            f"{k}: {'ok' if v.get('ok') else ('-' if v.get('ok') is None else 'FAIL')}"
            + (f" (max err/bound {v['max_err_over_bound']:.3f})" if "max_err_over_bound" in v
               else "") for k, v in ver.items()))
        for n in notes:
            print(n)
        wall = time.perf_counter() - t_start
        log(f"\ntotal wall time {wall:.1f}s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": env, "wall_s": wall, "quick": args.quick,
                           "config": {**shape.__dict__, "piece_bytes": shape.piece_bytes,
                                      "hot_page_bytes": shape.hot_page_bytes,
                                      "int8_page_bytes": shape.int8_page_bytes(),
                                      "disk_pages": disk_pages, "args": vars(args),
                                      "gb": "1e9 bytes",
                                      "targets": {"concat_vs_contiguous": TARGET_CONCAT_VS_CONTIG,
                                                  "int8_vs_concat": TARGET_INT8_VS_CONCAT,
                                                  "disk_vs_plain": TARGET_DISK_VS_PLAIN}},
                           "ratios": rat, "results": results, "rows": rows}, f, indent=1,
                          default=str)
            log(f"wrote {args.json}")
        ours = [r for r in rows if r["error"] and not r["error"].startswith("skipped")]
        bad = [k for k, v in ver.items() if v.get("ok") is False]
        return 1 if ours or bad else 0
    finally:
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
