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
