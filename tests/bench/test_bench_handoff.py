"""benchmarks/bench_handoff.py runs (a tiny shape on CPU) and reports every phase, and the
device-buffer probe moves its bytes exactly (it checks them itself)."""

import json
import sys
from pathlib import Path

import jax_kvcm  # noqa: F401  (the installed package before the repo root goes on sys.path)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repo root: benchmarks/

from benchmarks import bench_handoff  # noqa: E402


def test_quick_run_reports_each_phase(tmp_path, capsys):
    out = tmp_path / "h.json"
    assert bench_handoff.main(["--tokens", "64", "--repeats", "1", "--layers", "2",
                               "--device-probe", "4", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    rows = got["rows"]
    probe = got["device_probe"]
    assert probe["bytes"] == 4 << 20 and probe["transfer_gb_per_s"] > 0, probe
    assert rows[0]["tokens"] == 64 and rows[0]["pages"] == 4
    assert all(rows[0][f"{k}_ms"] > 0 for k in ("export", "transport", "import"))
    assert "| 64 |" in capsys.readouterr().out
