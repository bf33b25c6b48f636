"""tools/sim_sm90_prefill_protocol.py, the model of the sm90 prefill kernel's synchronization
protocol: it holds (no violation over its random interleavings, work lists and ring depths), and it
catches broken variants of its steps (two of its mutations), so that the model can fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "sim_sm90_prefill_protocol.py"


@pytest.mark.parametrize("cache", ["both", "fp8"])
@pytest.mark.parametrize("mutate", [None, "no_stage_bad", "q_freed_early"])
def test_protocol_model(mutate, cache):
    """Exit status 0: no violation without a mutation, violations found with one (fixed seeds);
    by default each trial models the 16-bit or the fp8 producer path, with --cache fp8 all do."""
    argv = [sys.executable, str(SCRIPT), "--trials", "3000", "--cache", cache]
    if mutate:
        argv += ["--mutate", mutate]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
