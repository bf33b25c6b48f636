"""Summarize a ``jax.profiler`` perfetto trace: per process and thread ("line"), the number of
complete events, the most common event names and the argument keys they carry, and the distinct
``hlo_module`` values. For finding how a jax/XLA version lays out its device trace when
``benchmarks/harness/device_profile.py`` finds no programs in it.

    python tools/trace_lines.py TRACE_DIR [--top 8]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os

from benchmarks.harness import device_profile


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args(argv)
    files = glob.glob(os.path.join(a.trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    for path in files:
        events, procs, threads = device_profile.read_perfetto(path)
        lines = collections.defaultdict(list)
        for e in events:
            if e.get("ph") == "X":
                lines[(e["pid"], e.get("tid"))].append(e)
        print(f"== {path}: {len(events)} events")
        for key, evs in sorted(lines.items(), key=lambda kv: -len(kv[1])):
            names = collections.Counter(e["name"] for e in evs).most_common(a.top)
            argkeys = collections.Counter(k for e in evs for k in (e.get("args") or {}))
            mods = collections.Counter((e.get("args") or {}).get("hlo_module") for e in evs)
            print(f"-- {procs.get(key[0], key[0])!r} / {threads.get(key, key[1])!r}: {len(evs)}")
            print("   names:", [(n[:60], c) for n, c in names])
            print("   args:", dict(argkeys.most_common(12)))
            if len(mods) > 1 or None not in mods:
                print("   hlo_module:", [(str(m)[:60], c) for m, c in mods.most_common(a.top)])


if __name__ == "__main__":
    main()
