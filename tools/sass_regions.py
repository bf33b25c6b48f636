#!/usr/bin/env python
"""Where a warp-specialized kernel's warps wait, from Nsight Compute's per-instruction SASS view.

Reads the CSV of ``ncu -i REPORT --page source --print-source sass --csv`` (what
``tools/gpu_ab.sh --profile`` writes for the sm90 prefill). The kernel's roles are told apart
by address: the consumers' code runs from their ``setmaxnreg`` increase (``USETMAXREG.TRY_ALLOC``)
on, the producer's from its decrease (``USETMAXREG.DEALLOC``) on, whichever comes first in the
binary; code before both is shared. ptxas puts the retry loops of barrier waits out of line, at
the end of the function, after the producer's code: a wait followed by its retry branch and a
branch back counts for the role of the instruction it branches back to, when the CSV prints that
target as an address (``BRA 0x...``). Prints, per role, the stall samples, their share by kind of
instruction (barrier waits, wgmma waits, stores, ...), and the instructions with the most samples;
with ``--units``, each role's samples by the unit of work its instructions run once for (from the
CSV's "Instructions Executed": per key tile, per work tile, ...):

    python -m tools.sass_regions ncu_prefill_b_sass.csv [--top 15] \
        [--units 'work tile=4096' 'key tile=34816' ...]
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# Kinds of instruction, first match wins (SASS mnemonics as nvdisasm prints them).
KINDS = (
    ("mbarrier wait", re.compile(r"SYNCS\.PHASECHK|SYNCS\..*TRYWAIT")),
    ("named barrier", re.compile(r"\bBAR\.(SYNC|ARV|RED)|\bBAR\b")),
    ("wgmma wait", re.compile(r"WARPGROUP\.DEPBAR")),
    ("wgmma", re.compile(r"HGMMA|WARPGROUP\.ARRIVE")),
    ("global store", re.compile(r"\bSTG\b")),
    ("global load", re.compile(r"\bLDG\b")),
    ("shared load/store", re.compile(r"\bLDS\b|\bSTS\b|LDSM|STSM")),
    ("async copy", re.compile(r"LDGSTS|LDGDEPBAR|DEPBAR|ARRIVES")),
    ("exp2", re.compile(r"MUFU\.EX2")),
    ("min/max", re.compile(r"FMNMX|IMNMX|VIMNMX")),
    ("branch", re.compile(r"\bBRA\b|\bBSYNC\b|\bBSSY\b|WARPSYNC")),
)


@dataclass
class Instruction:
    address: int
    source: str
    samples: int
    executed: int = 0  # times a warp ran it ("Instructions Executed"; 0 when the CSV lacks it)


def _column(header: list[str], *needles: str) -> int:
    for i, name in enumerate(header):
        if all(n.lower() in name.lower() for n in needles):
            return i
    raise KeyError(f"no column with {needles} in {header}")


def read_sass_csv(path: Path) -> list[Instruction]:
    """The instructions of an ncu source-page CSV, in address order."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if any("Address" in c for c in r))
    header, body = rows[start], rows[start + 1:]
    a, s = _column(header, "Address"), _column(header, "Source")
    n = _column(header, "Warp Stall Sampling", "All")
    e = header.index("Instructions Executed") if "Instructions Executed" in header else None
    out = []
    for r in body:
        if len(r) <= max(a, s, n) or not r[a].strip():
            continue
        try:
            address = int(r[a], 16) if r[a].lower().startswith("0x") else int(r[a])
        except ValueError:
            continue
        samples = int(float(r[n].replace(",", "") or 0))
        executed = int(float(r[e].replace(",", "") or 0)) if e is not None and len(r) > e else 0
        out.append(Instruction(address, r[s].strip(), samples, executed))
    return sorted(out, key=lambda x: x.address)


BRANCH_BACK = re.compile(r"^\s*BRA\s+`?\(?(0x[0-9a-fA-F]+)")


def role_of(instructions: list[Instruction]) -> list[str]:
    """'shared', 'consumer' or 'producer' per instruction, split at the setmaxnreg instructions
    (out-of-line wait retries: the role they branch back to)."""
    marks = {}
    for x in instructions:
        if "SETMAXREG.TRY_ALLOC" in x.source:  # (also USETMAXREG)
            marks.setdefault("consumer", x.address)
        elif "SETMAXREG.DEALLOC" in x.source:
            marks.setdefault("producer", x.address)
    starts = sorted((addr, role) for role, addr in marks.items())

    def by_address(address: int) -> str:
        role = "shared"
        for addr, r in starts:
            if address >= addr:
                role = r
        return role

    roles = [by_address(x.address) for x in instructions]
    for i in range(len(instructions) - 2):
        wait, retry, back = instructions[i:i + 3]
        target = BRANCH_BACK.match(back.source)
        if kind_of(wait.source) == "mbarrier wait" and "BRA" in retry.source and target:
            roles[i] = roles[i + 1] = roles[i + 2] = by_address(int(target.group(1), 16))
    return roles


def kind_of(source: str) -> str:
    for name, pattern in KINDS:
        if pattern.search(source):
            return name
    return "other"


def summarize(instructions: list[Instruction], top: int = 15) -> str:
    """The per-role table and top instructions, as text."""
    roles = role_of(instructions)
    lines = []
    total = sum(x.samples for x in instructions) or 1
    for role in ("consumer", "producer", "shared"):
        mine = [x for x, r in zip(instructions, roles) if r == role]
        n = sum(x.samples for x in mine)
        if not mine:
            continue
        lines.append(f"## {role}: {n} samples ({100 * n / total:.1f}% of the kernel's)")
        by_kind: dict[str, int] = {}
        for x in mine:
            kind = kind_of(x.source)
            by_kind[kind] = by_kind.get(kind, 0) + x.samples
        lines.append("| kind | samples | share |")
        lines.append("|---|---:|---:|")
        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {k} | {v} | {100 * v / max(n, 1):.1f}% |")
        lines.append("")
        lines.append("| address | samples | share | instruction |")
        lines.append("|---|---:|---:|---|")
        for x in sorted(mine, key=lambda x: -x.samples)[:top]:
            text = x.source.replace("|", "\\|")  # (|R2| in a table cell)
            lines.append(f"| {x.address:#06x} | {x.samples} | {100 * x.samples / max(n, 1):.1f}% "
                         f"| `{text}` |")
        lines.append("")
    return "\n".join(lines)


def by_unit(instructions: list[Instruction], units: dict[str, int], warps: dict[str, int],
            top: int = 8) -> str:
    """Each role's samples by what its instructions run once for: an instruction its warps ran
    ``units[u] * warps * k`` times (k = 1, 2, 4: unrolled; an exact match first) runs once per
    unit u; the rest is "other".
    ``warps[role]`` is the role's warps per unit of work (the consumers' 8 run every work tile;
    the producer's 4 warps). Prints the share per unit and the top instructions of each."""
    roles = role_of(instructions)
    lines = []
    for role, per in warps.items():
        mine = [x for x, r in zip(instructions, roles) if r == role]
        n = sum(x.samples for x in mine) or 1
        classes: dict[str, list[Instruction]] = {}
        for x in mine:
            unit = next((u for k in (1, 2, 4) for u, count in units.items()  # x1 first
                         if x.executed and x.executed == count * per * k), "other")
            classes.setdefault(unit, []).append(x)
        lines.append(f"## {role}: samples by what an instruction runs once for "
                     f"({per} warps per unit)")
        lines.append("| once per | samples | share |")
        lines.append("|---|---:|---:|")
        sums = {unit: sum(x.samples for x in xs) for unit, xs in classes.items()}
        for unit, m in sorted(sums.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {unit} | {m} | {100 * m / n:.1f}% |")
        for unit, xs in classes.items():
            if unit == "other":
                continue
            lines.append(f"\ntop of '{unit}':")
            for x in sorted(xs, key=lambda x: -x.samples)[:top]:
                lines.append(f"  {x.address:#08x} {x.samples:6d} {100 * x.samples / n:4.1f}%  "
                             f"{kind_of(x.source):14s} {x.source[:70]}")
        lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools.sass_regions``."""
    p = argparse.ArgumentParser(
        prog="python -m tools.sass_regions", description=__doc__.splitlines()[0])
    p.add_argument("csv", type=Path, help="ncu --page source --print-source sass --csv output")
    p.add_argument("--top", type=int, default=15, help="instructions listed per role")
    p.add_argument("--units", nargs="*", default=[], metavar="NAME=COUNT",
                   help="units of work and their counts in the profiled launch (the sm90 prefill "
                        "at B8 S2048: tools/gpu_ab.sh --profile names six, e.g. 'work "
                        "tile=4096' 'key tile=34816'): each role's samples by the unit its "
                        "instructions run once for (Instructions Executed)")
    p.add_argument("--warps", nargs="*", default=["consumer=8", "producer=4"],
                   metavar="ROLE=N", help="warps of each role that run every unit")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    instructions = read_sass_csv(a.csv)
    if not instructions:
        print(f"{a.csv}: no instructions found", file=sys.stderr)
        return 1
    print(summarize(instructions, a.top))
    if a.units:
        units = {k: int(v) for k, v in (u.rsplit("=", 1) for u in a.units)}
        warps = {k: int(v) for k, v in (w.rsplit("=", 1) for w in a.warps)}
        print(by_unit(instructions, units, warps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
