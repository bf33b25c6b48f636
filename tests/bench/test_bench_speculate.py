"""benchmarks/bench_speculate.py on the tiny model (CPU): every loop generates the same greedy
tokens, drafts are accepted on the repetitive workload, nothing compiles while timed, and the
JSON carries the figures the results table reads."""

from __future__ import annotations

import json

from benchmarks import bench_speculate


def test_tiny_run_agrees_and_accepts_drafts(tmp_path):
    out = tmp_path / "spec.json"
    assert bench_speculate.main(["--tiny", "--batch", "1", "4", "--new-tokens", "48",
                                 "--prompt-len", "96", "--period", "16", "--num-draft-tokens",
                                 "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["token_agreement_with_plain"] == 1.0, r
        assert r["compiles_while_timed"] == 0, r
        assert r["generated_tokens"] == 48 * r["batch"], r
        assert 0 < r["accepted_per_step"] <= 3, r
        assert r["tokens_per_row_step"] > 1.0, r
