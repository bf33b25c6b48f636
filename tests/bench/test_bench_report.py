"""benchmarks/report.py: every result file names its run (command, commit, date, machine), and
benchmarks/RESULTS.md is exactly what the files give (regenerate with ``python -m
benchmarks.report``). The plots need matplotlib (the ``bench`` extra): their test skips without
it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repo root: benchmarks/

from benchmarks import report  # noqa: E402


def test_every_result_file_names_its_run():
    results = report.load_results()
    assert len(results) >= 10
    for name, d in results.items():
        assert name.startswith(d["date"]), name
        assert d["rows"] and d["command"] and d["reproduce"] and d["machine"], name


@pytest.mark.parametrize("bad", [{"notes": ["a", "b"]}, {"title": None, "rows": None}])
def test_a_malformed_result_file_is_refused_by_name(tmp_path, bad):
    """A list of notes would print as a Python list in RESULTS.md; a missing key is named."""
    good = json.loads(next(report.RESULTS_DIR.glob("*.json")).read_text())
    bad_file = {k: v for k, v in {**good, **bad}.items() if v is not None}
    (tmp_path / "2026-01-01_bad.json").write_text(json.dumps(bad_file))
    with pytest.raises(ValueError, match=r"2026-01-01_bad\.json: (notes|missing title, rows)"):
        report.load_results(tmp_path)


def test_results_md_is_generated_from_the_files():
    assert report.main(["--check"]) == 0, "run: python -m benchmarks.report"
    text = report.RESULTS_MD.read_text()
    for name in report.load_results():
        assert f"(results/{name})" in text, name
    for png in ("decode_tbps", "prefill_tflops", "serve_tokens"):
        assert (report.PLOTS_DIR / f"{png}.png").is_file() and f"plots/{png}.png" in text


def test_a_changed_figure_changes_the_summary(tmp_path):
    for p in report.RESULTS_DIR.glob("*.json"):
        shutil.copy(p, tmp_path / p.name)
    before = dict((n, v) for _, v, n in report.summary(report.load_results(tmp_path)))
    path = tmp_path / "2026-12-02_serve_paged_vs_dense_h200.json"
    d = json.loads(path.read_text())
    d["rows"][0]["output_tokens_per_s"] = 5850
    path.write_text(json.dumps(d))
    after = dict((n, v) for _, v, n in report.summary(report.load_results(tmp_path)))
    assert before[path.name].endswith("= 3.31x") and after[path.name].endswith("= 2.00x")
    del d["commit"]
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="missing commit"):
        report.load_results(tmp_path)


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    paths = report.write_plots(report.load_results(), tmp_path)
    assert [Path(p).name for p in paths] == ["decode_tbps.png", "prefill_tflops.png",
                                             "serve_tokens.png"]
    assert all(Path(p).stat().st_size > 10_000 for p in paths)
