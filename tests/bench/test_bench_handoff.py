"""benchmarks/bench_handoff.py runs (a tiny shape on CPU) and reports every phase."""

import json

from benchmarks import bench_handoff


def test_quick_run_reports_each_phase(tmp_path, capsys):
    out = tmp_path / "h.json"
    assert bench_handoff.main(["--tokens", "64", "--repeats", "1", "--layers", "2",
                               "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["tokens"] == 64 and rows[0]["pages"] == 4
    assert all(rows[0][f"{k}_ms"] > 0 for k in ("export", "transport", "import"))
    assert "| 64 |" in capsys.readouterr().out
