"""benchmarks/bench_fp8_gemm.py on CPU (--tiny): every XLA method checked against its float32
oracle before it is timed, the GEMM census read from the compiled program."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import jax_kvcm  # noqa: F401  (the installed package before the repo root goes on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_fp8_gemm as bench  # noqa: E402


def test_tiny_run_checks_and_times_every_xla_method():
    out = bench.main(["--tiny", "--rounds", "1"])
    rows = out["rows"]
    methods = {"xla fp8 (model)", "xla fp8 gemm", "xla bf16", "xla fp8 (scalar scales)"}
    assert {r["method"] for r in rows} == methods
    assert len(rows) == 4 * len(bench.TINY_LINEARS) * 2
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] > 0 and r["tflops"] == pytest.approx(
            2.0 * r["rows"] * r["in"] * r["out"] / r["ms"] / 1e9)
    for r in rows:
        most = (bench.MODEL_CHECK_RTOL if r["method"] in bench.QUANTIZED_X_METHODS
                else bench.CHECK_RTOL)
        assert r["oracle"] == "float32" and 0 <= r["rel_l2"] < most, r
    # On the CPU each FP8 program keeps one plain dot (FP8 operands upcast by the backend).
    assert all(r["census"]["dot"] == 1 for r in rows if r["method"].startswith("xla fp8"))


def test_a_wrong_product_fails_its_check_and_is_not_timed(monkeypatch):
    real = bench.f8.fp8_matmul
    monkeypatch.setattr(bench.f8, "fp8_matmul", lambda x, w: real(x, w) * 1.1)
    rows = bench.case("wqkv", 64, 96, 8, seed=0, rounds=1)
    (model,) = [r for r in rows if r["method"] == "xla fp8 (model)"]
    assert model["error"].startswith("FAIL rel-L2") and "ms" not in model
    assert all(np.isfinite(r["ms"]) for r in rows if r is not model)
