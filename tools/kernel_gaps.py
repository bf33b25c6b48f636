#!/usr/bin/env python
"""Kernels of a trace in launch order, with each one's time and the idle gap before it: where a
call's time goes outside its main kernel. ``python -m tools.prefill_profile --trace`` feeds
:func:`report` a ``jax.profiler`` trace (the GPU machine has no Nsight Systems); where ``nsys``
exists, its CSV works from the command line:

    nsys profile -t cuda -o /tmp/t python3 -m tools.prefill_profile --calls 9
    nsys stats -q -r cuda_gpu_trace -f csv /tmp/t.nsys-rep > trace.csv
    python3 -m tools.kernel_gaps trace.csv [--last 12]

Prints the last ``--last`` kernels (memcpy / memset rows too) as a markdown table, then, per
name, the kernel count, mean time and mean gap before it, and the busy share of the span.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import defaultdict


def read_trace(text: str) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) rows of an nsys cuda_gpu_trace CSV, by start."""
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if "Start" in line and "Duration" in line),
                None)
    if head is None:
        raise ValueError("no header with 'Start' and 'Duration' columns: not a cuda_gpu_trace CSV")
    rows = list(csv.reader(io.StringIO("\n".join(lines[head:]))))
    cols = rows[0]
    start = next(i for i, c in enumerate(cols) if c.startswith("Start"))
    dur = next(i for i, c in enumerate(cols) if c.startswith("Duration"))
    name = next(i for i, c in enumerate(cols) if c.strip() == "Name")
    out = []
    for r in rows[1:]:
        if len(r) <= max(start, dur, name) or not r[start].strip():
            continue
        out.append((float(r[start]) / 1e3, float(r[dur]) / 1e3, r[name]))
    return sorted(out)


def short(name: str) -> str:
    """A kernel's unqualified name, without template arguments and parameters."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    return name.split("(")[0].split("<")[0].split("::")[-1][:60]


def report(trace: list[tuple[float, float, str]], last: int) -> str:
    lines = ["| kernel | us | gap before, us |", "|---|---:|---:|"]
    gaps = [0.0] + [max(0.0, s - (ps + pd)) for (ps, pd, _), (s, _, _) in zip(trace, trace[1:])]
    for (_, d, n), g in list(zip(trace, gaps))[-last:]:
        lines.append(f"| {short(n)} | {d:.1f} | {g:.1f} |")
    per = defaultdict(list)
    for (_, d, n), g in zip(trace, gaps):
        per[short(n)].append((d, g))
    lines += ["", "| kernel | count | mean us | mean gap before, us |", "|---|---:|---:|---:|"]
    for n, v in per.items():
        lines.append(f"| {n} | {len(v)} | {sum(d for d, _ in v) / len(v):.1f} | "
                     f"{sum(g for _, g in v) / len(v):.1f} |")
    tail = trace[-last:]
    span = tail[-1][0] + tail[-1][1] - tail[0][0]
    busy = sum(d for _, d, _ in tail)
    lines.append(f"\nlast {len(tail)}: span {span:.1f} us, busy {busy:.1f} us "
                 f"({100 * busy / span:.1f}%)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools.kernel_gaps``."""
    p = argparse.ArgumentParser(
        prog="python -m tools.kernel_gaps", description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--last", type=int, default=12, help="kernels in the table (the tail)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    with open(a.csv) as f:
        trace = read_trace(f.read())
    if not trace:
        print("no kernels in the trace", file=sys.stderr)
        return 1
    print(report(trace, a.last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
