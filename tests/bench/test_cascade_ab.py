"""``--cascade-ab``: the tiny shared-prefix run without and with cascade, interleaved in one
process: every round runs both, the cascade runs carry cascade and its counters, the plain runs
do not, and the comparison's ratios are the runs' own tokens/s ratios (recomputed here)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import jax_kvcm  # noqa: F401  (the installed package before the repo root goes on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_serve as bench  # noqa: E402


def test_cascade_ab_runs_both_in_turns_and_compares_them():
    out = bench.main(["--workload", "trtllm", "--tiny", "--no-check", "--no-dense",
                      "--no-random", "--cascade-ab", "--ab-rounds", "2"])
    names = [r["name"] for r in out["results"]]
    assert names == ["paged shared c8 prefix on", "paged shared c8 prefix on, cascade",
                     "paged shared c8 prefix on (round 2)",
                     "paged shared c8 prefix on, cascade (round 2)"], names
    plain, casc = out["results"][0::2], out["results"][1::2]
    assert not any(r["cascade"] for r in plain) and all(r["cascade"] for r in casc)
    assert all(r["cascade_grouped_rows"] > 0 for r in casc)
    assert all(r["cascade_tokens_saved"] == 0 for r in plain)
    (cmp,) = [c for c in out["comparisons"] if c["kind"] == "cascade_vs_plain"]
    want = [c["output_tokens_per_s"] / p["output_tokens_per_s"] for p, c in zip(plain, casc)]
    assert cmp["rounds"] == 2 and np.allclose(cmp["tokens_per_s_over_plain_rounds"], want)
    assert cmp["tokens_per_s_over_plain"] == pytest.approx(float(np.median(want)))
    assert 0 < cmp["kv_reads_saved"] < 1 and not out["errors"]


@pytest.mark.parametrize("extra", [["--cascade"], ["--no-shared"]])
def test_cascade_ab_refuses_what_contradicts_it(extra):
    with pytest.raises(SystemExit, match="--cascade-ab"):
        bench.setup_from_args(bench.parse_args(["--workload", "trtllm", "--tiny",
                                                "--cascade-ab", *extra]))


def test_time_budget_skips_what_would_end_past_it(monkeypatch, capsys):
    """``--time-budget``: a configuration starts only while more time is left than the longest
    one so far took. The benchmark's clock is made to advance 100 s per reading (each run reads
    it when it starts and ends), so with 550 s: runs 1 and 2 take 100 s each, run 3 would start
    with ~50 s left (< 100: skipped) and run 4 with none; the A/B compares the one full pair."""
    from benchmarks.harness import serve_matrix

    real, clock = serve_matrix.time.perf_counter, {"start": None, "n": 0}

    def perf_counter():
        clock["start"] = clock["start"] or real()
        clock["n"] += 1
        return clock["start"] + 100.0 * clock["n"]

    monkeypatch.setattr(serve_matrix, "time", type("Clock", (), {"perf_counter": perf_counter}))
    out = bench.main(["--workload", "trtllm", "--tiny", "--no-check", "--no-dense",
                      "--no-random", "--cascade-ab", "--ab-rounds", "2", "--time-budget", "550"])
    assert [r["name"] for r in out["results"]] == ["paged shared c8 prefix on",
                                                   "paged shared c8 prefix on, cascade"]
    assert out["skipped"] == ["paged shared c8 prefix on (round 2)",
                              "paged shared c8 prefix on, cascade (round 2)"]
    (cmp,) = [c for c in out["comparisons"] if c["kind"] == "cascade_vs_plain"]
    assert cmp["rounds"] == 1 and not out["errors"]
    log = capsys.readouterr()
    text = log.out + log.err
    assert "SKIPPED paged shared c8 prefix on (round 2)" in text
    assert "skipped (--time-budget 550 s)" in text


def test_time_budget_must_be_positive():
    with pytest.raises(SystemExit, match="--time-budget must be > 0"):
        bench.main(["--workload", "trtllm", "--tiny", "--no-check", "--time-budget", "0"])
