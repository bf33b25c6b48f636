"""examples/llama/disagg.py (issue 37): a prefill process hands each prompt's K/V to a decode
process (export_sequence, JAX's transfer server, import_sequence); the generated tokens equal
the single-process runner's, token for token (greedy), with and without speculation on the
decode side."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import jax_kvcm  # noqa: F401  (the installed package first; the repo root goes on sys.path after)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.llama import disagg, run  # noqa: E402

pytestmark = pytest.mark.slow  # two processes, a checkpoint each: seconds


def _lines(out: str) -> list[dict]:
    return sorted((json.loads(x) for x in out.splitlines() if x.startswith('{"request"')),
                  key=lambda d: d["request"])


@pytest.mark.parametrize("k", [0, 3])
def test_disaggregated_tokens_equal_the_single_process_runner(capsys, k):
    assert run.main(["--json", "--max-new-tokens", "10"]) == 0
    plain = _lines(capsys.readouterr().out)
    assert disagg.main(["--json", "--max-new-tokens", "10", "--num-draft-tokens", str(k)]) == 0
    handed = _lines(capsys.readouterr().out)
    assert len(handed) == len(plain) > 1
    assert [d["generated_ids"] for d in handed] == [d["generated_ids"] for d in plain]
