"""``--arena-step-calls``: the arena's decode steps split by its native calls. The split is
checked on a hand-made run (the groups counted by hand), and the flag end to end on the tiny
shared-prefix run on the CPU arena."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax_kvcm  # noqa: F401  (the installed package before the repo root goes on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_serve as bench  # noqa: E402
from benchmarks.harness import loop_profile  # noqa: E402


def test_split_by_calls_groups_each_decode_step_by_its_calls_and_the_previous_steps():
    # steps:     0 (mixed)  1       2      3      4      5
    step_ms = [50.0, 10.0, 30.0, 11.0, 12.0, 10.0]
    decode = [False, True, True, True, True, True]
    # calls so far after each step: step 1 maps twice, step 4 creates once
    calls = [(0, 0), (2, 0), (2, 0), (2, 0), (2, 1), (2, 1)]
    s = loop_profile.split_by_calls(step_ms, decode, calls)
    assert s["with_calls"]["steps"] == 2          # steps 1 and 4
    assert s["with_calls"]["p50_ms"] == 11.0
    assert s["without_calls"]["steps"] == 3       # 2, 3, 5 (0 is not a decode step)
    assert s["after_calls"]["steps"] == 2         # 2 (after 1) and 5 (after 4)
    assert s["after_calls"]["p90_ms"] > 20.0      # step 2's 30 ms is in it
    assert s["after_none"]["steps"] == 3          # 1, 3, 4
    assert s["slow_steps"] == 1 and s["slow_with_or_after_calls"] == 1   # step 2
    assert "after a step that made calls | 2 |" in loop_profile.format_split("r", s)


def test_arena_step_calls_flag_on_the_tiny_run():
    out = bench.main(["--workload", "trtllm", "--tiny", "--no-check", "--no-dense",
                      "--no-random", "--hot-backend", "paged", "arena", "--arena-step-calls"])
    arena = [r for r in out["results"] if r.get("hot_backend") == "arena"]
    paged = [r for r in out["results"] if r.get("hot_backend") == "paged"]
    assert arena and paged and all("arena_step_calls" not in r for r in paged)
    for r in arena:
        s = r["arena_step_calls"]
        assert s["with_calls"]["steps"] + s["without_calls"]["steps"] == r["decode_steps"]
        assert s["with_calls"]["steps"] >= 1 or r["arena_map_calls"] == 0


def test_reads_between_steps_count_in_the_runs_clock(monkeypatch):
    """The loop's stats() reads between steps are inside the run's clock, for both backends:
    outside it, the device ran the dispatched step during a read for free (a 12.5 ms stats()
    every 4th step inflated the arena's tokens/s). A slowed stats() must show in ``seconds``."""
    from jax_kvcm import KVCacheManager

    real, delay, calls = KVCacheManager.stats, 0.02, {"n": 0}

    def slow_stats(self):
        calls["n"] += 1
        time.sleep(delay)
        return real(self)

    monkeypatch.setattr(KVCacheManager, "stats", slow_stats)
    out = bench.main(["--workload", "trtllm", "--tiny", "--no-check", "--no-dense",
                      "--no-random", "--hot-backend", "paged", "arena"])
    runs = [r for r in out["results"] if r.get("hot_backend") in ("paged", "arena")]
    assert {r["hot_backend"] for r in runs} == {"paged", "arena"} and calls["n"] > 0
    for r in runs:
        reads = (r["steps"] + 3) // 4     # one read every 4th step
        assert r["seconds"] >= reads * delay, (r["hot_backend"], r["seconds"], reads)
