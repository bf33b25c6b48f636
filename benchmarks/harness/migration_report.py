"""The migration benchmark's report: the ratios against the targets, the printed tables, and
the sizes a run plans (pages, host and disk bytes) from the machine's free memory."""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from typing import Any

import jax

from benchmarks.harness.migration_env import (GB, TARGET_CONCAT_VS_CONTIG, TARGET_DISK_VS_PLAIN,
                                              TARGET_INT8_VS_CONCAT, GiB, Shape, meminfo)

# ----------------------------------------------------------------------------------------------
# report


def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _pooled_gbps(rows: list[dict[str, Any]], prefix: str, direction: str) -> float | None:
    """Rate from the median of all samples of the rows whose method starts with ``prefix``."""
    sel = [r for r in rows if r["method"].startswith(prefix) and r["direction"] == direction
           and r["samples_s"] and not r["error"]]
    if not sel:
        return None
    samples = [s for r in sel for s in r["samples_s"]]
    return sel[0]["bytes"] / statistics.median(samples) / GB


def _gbps(rows: list[dict[str, Any]], prefix: str, direction: str) -> float | None:
    r = next((r for r in rows if r["method"].startswith(prefix) and r["direction"] == direction
              and r["gbps"] and not r["error"]), None)
    return None if r is None else r["gbps"]


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []

    def add(name: str, num: str, den: str, target: float | None, pooled_den: bool = False,
            directions: tuple[str, str] = ("hot->host", "host->hot")) -> None:
        vals = {}
        for d in directions:
            a = _gbps(rows, num, d)
            b = _pooled_gbps(rows, den, d) if pooled_den else _gbps(rows, den, d)
            vals[d] = None if a is None or b is None else a / b
        met = (None if target is None or any(v is None for v in vals.values())
               else all(v >= target for v in vals.values()))
        out.append({"ratio": name, "values": vals, "target": target, "met": met})

    add("concat / contiguous pinned", "concat (", "contiguous", TARGET_CONCAT_VS_CONTIG,
        pooled_den=True)
    add("int8 / concat (uncompressed bytes/s)", "int8", "concat (", TARGET_INT8_VS_CONCAT)
    add("int8 / contiguous pinned (uncompressed bytes/s)", "int8", "contiguous", None,
        pooled_den=True)
    add("concat (kernel) / concat[memcpy-batch]", "concat (", "concat[memcpy-batch]", None)
    add("concat / concat[no-batch] (native cudaMemcpyAsync per piece)", "concat (",
        "concat[no-batch]", None)
    add("concat / per-piece torch loop", "concat (", "per-piece", None)
    add("disk: manager / plain (no fsync)", "StorageManager", "plain", TARGET_DISK_VS_PLAIN,
        directions=("host->disk", "disk->host"))
    return out


def print_tables(rows: list[dict[str, Any]], rat: list[dict[str, Any]], shape: Shape) -> None:
    hh = [r for r in rows if r["section"] == "hot<->host"]
    hd = [r for r in rows if r["section"] == "host<->disk"]
    contig_d2h = _pooled_gbps(rows, "contiguous", "hot->host")
    contig_h2d = _pooled_gbps(rows, "contiguous", "host->hot")
    if hh:
        print(f"\n### hot <-> host: {shape.describe()}\n")
        print("GB/s = 1e9 bytes/s of uncompressed hot bytes (cold GB/s: bytes actually stored); "
              "ms = median end-to-end time per call incl. completion; submit ms = the migrate() "
              "call alone\n")
        print("| method | direction | ms | submit ms | GB/s | cold GB/s | x contiguous | note |")
        print("|---|---|---:|---:|---:|---:|---:|---|")
        for r in hh:
            base = contig_d2h if r["direction"] == "hot->host" else contig_h2d
            x = None if not r["gbps"] or not base else r["gbps"] / base
            ms = None if r["median_s"] is None else r["median_s"] * 1e3
            sub = None if r["submit_median_s"] is None else r["submit_median_s"] * 1e3
            print(f"| {r['method']} | {r['direction']} | {_fmt(ms, 1)} | {_fmt(sub, 1)} "
                  f"| {_fmt(r['gbps'])} | {_fmt(r['cold_gbps'])} | {_fmt(x)} "
                  f"| {r['error'] or r['note']} |")
    if hd:
        print("\n### host <-> disk (concat pages; page cache, no fsync in the timed region)\n")
        print("| method | direction | GiB | ms | GB/s | +fsync GB/s (info) | reps | note |")
        print("|---|---|---:|---:|---:|---:|---:|---|")
        for r in hd:
            ms = None if r["median_s"] is None else r["median_s"] * 1e3
            gib = None if not r["bytes"] else r["bytes"] / GiB
            print(f"| {r['method']} | {r['direction']} | {_fmt(gib)} | {_fmt(ms, 1)} "
                  f"| {_fmt(r['gbps'])} | {_fmt(r.get('with_fsync_gbps'))} "
                  f"| {r.get('repetitions', '-')} | {r['error'] or r['note']} |")
    if rat:
        print("\n### Ratios (same run)\n")
        print("| ratio | write / hot->host | read / host->hot | target | met |")
        print("|---|---:|---:|---:|---|")
        for q in rat:
            v = list(q["values"].values())
            met = "-" if q["met"] is None else ("yes" if q["met"] else "NO")
            tgt = "-" if q["target"] is None else f">= {q['target']}"
            print(f"| {q['ratio']} | {_fmt(v[0])} | {_fmt(v[1])} | {tgt} | {met} |")
    sys.stdout.flush()


def plan_sizes(shape: Shape, args: argparse.Namespace, disk_dir: str | None
               ) -> tuple[Shape, int, list[str]]:
    """Scales pages down when RAM or disk space is short; returns (shape, disk pages, notes)."""
    notes = []
    page = shape.hot_page_bytes
    avail = meminfo().get("MemAvailable")
    # Peak host memory: the concat host tier + a plain-read buffer of the same size (disk part),
    # or the torch per-piece loop's pinned buffer; plus a margin. --disk-only may run on a CPU
    # backend, whose hot pools are host memory too.
    hot_copies = 1 if args.disk_only and jax.default_backend() == "cpu" else 0
    if avail:
        def need(p: int) -> int:
            return (2 + hot_copies) * (p + args.host_extra_pages) * page + 4 * GiB
        pages = shape.pages
        while pages > 16 and need(pages) > avail:
            pages //= 2
        if pages != shape.pages:
            notes.append(f"SCALED DOWN: {shape.pages} -> {pages} pages (MemAvailable "
                         f"{avail / GiB:.1f} GiB)")
            shape = Shape(**{**shape.__dict__, "pages": pages,
                             "hot_slots": pages if args.disk_only else 2 * pages})
    disk_pages = 0
    if disk_dir and not args.skip_disk:
        disk_pages = min(args.disk_pages or shape.pages, shape.pages)
        free = shutil.disk_usage(disk_dir).free
        margin = 2 * GiB if not args.quick else 0
        fit = max(0, (free - margin) // (2 * page))  # the manager's file + the plain file
        if fit < disk_pages:
            notes.append(f"SCALED DOWN: disk part {disk_pages} -> {fit} pages (free space "
                         f"{free / GiB:.1f} GiB in {disk_dir})")
            disk_pages = int(fit)
        if disk_pages < 16:
            notes.append("disk part skipped: not enough free space")
            disk_pages = 0
    return shape, disk_pages, notes


