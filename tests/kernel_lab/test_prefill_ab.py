"""tools/prefill_ab.py on the CPU at tiny shapes: each build's child process times the prefill
after checking it against the float32 reference (with ``--fp8`` also over fp8 caches, against
the reference on the dequantized K/V), and the table compares the builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax_kvcm

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "tools.prefill_ab", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_two_builds_alternate_and_are_checked():
    site = str(Path(jax_kvcm.__file__).resolve().parents[1])  # the installed build, twice
    r = run(site, site + os.sep, "--quick", "--fp8", "--rounds", "1", "--repeats", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    rounds = [x for x in r.stdout.splitlines() if x.startswith("round 1 ")]
    assert len(rounds) == 2 and all(x.count("(ok ") == 4 for x in rounds), r.stdout
    assert ("| build | B=2 S=64 ms | / first | fp8 B=2 S=64 ms | / first | B=1 S=128 ms | / first "
            "| fp8 B=1 S=128 ms | / first |") in r.stdout
    assert r.stdout.count("| 1.000 |") >= 1


def test_a_folder_without_a_build_is_refused(tmp_path):
    r = run(str(tmp_path), "--quick")
    assert r.returncode == 2 and "holds no jax_kvcm/" in r.stderr
