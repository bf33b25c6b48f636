"""``python -m benchmarks.bench_arena_map --under-load --cpu --quick`` (the memfd reservation):
every (operation, k) row is measured, the busy program took at least its target, and the
reservation ends as it began (each repeat undoes its calls)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax_kvcm  # noqa: F401  (the installed package before the repo root goes on sys.path)
from jax_kvcm import _ffi

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

from benchmarks import bench_arena_map  # noqa: E402
from benchmarks.harness import map_under_load  # noqa: E402


class _Counting:
    """The CPU extension, its reservations kept, to check what they hold at the end."""

    def __init__(self):
        self.made = []

    def Reservation(self, *args):  # noqa: N802  (the extension's name)
        r = _ffi._kvcm_cpu.Reservation(*args)
        self.made.append(r)
        return r


def test_under_load_rows_cover_every_call_count_and_leave_nothing_mapped(monkeypatch):
    native = _Counting()
    rows = map_under_load.under_load_rows(native, 64 << 10, target_ms=2.0, calls=(1, 4),
                                          repeats=2)
    ops = ["map", "unmap", "create", "release"]
    assert [(r["op"], r["calls"]) for r in rows] == [(op, k) for k in (1, 4) for op in ops]
    for r in rows:
        assert r["program_ms"] >= 2.0 and r["with_calls_ms"] > 0 and r["idle_ms"] >= 0
    (res,) = native.made
    # 2 repeats x (idle + busy + pair) calls, each k: every map was undone by an unmap, every
    # handle created released (the 4 made up front by the close).
    assert res.num_map_calls >= 2 * 3 * (1 + 4)
    assert res.num_map_calls == res.num_unmap_calls
    assert res.num_create_calls >= 4 + 2 * 3 * (1 + 4) * 2
    assert res.num_create_calls == res.num_release_calls and res.closed


def test_under_load_flag_runs_only_that(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench_arena_map.main(["--cpu", "--quick", "--under-load", "--json", str(out)]) == 0
    import json
    got = json.loads(out.read_text())
    assert set(got) == {"under_load"} and len(got["under_load"]) == 2 * 4 * len(map_under_load.CALLS)
    assert "program runs" in capsys.readouterr().out
