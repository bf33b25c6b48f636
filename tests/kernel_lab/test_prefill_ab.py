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


def test_cases_keep_only_the_named_shapes():
    """--cases times only the cases whose printed name holds one of its texts: here the fp8
    prefill at B=1 S=128 and the bf16 decode rows of one shape, nothing else."""
    from benchmarks.harness import attention_cases as A

    b, s = A.QUICK_DECODE_SHAPES[0]
    site = str(Path(jax_kvcm.__file__).resolve().parents[1])
    r = run(site, "--quick", "--fp8", "--decode", "--rounds", "1", "--repeats", "1",
            "--cases", "fp8 B=1 S=128", f"decode bf16 B={b} S={s}")
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("round 1 ")]
    # "round 1 SITE: NAME MS ms (ok E), NAME MS ms (ok E)"
    timed = [part.rsplit(" ", 4)[0] for part in line.split(": ", 1)[1].split("), ")]
    assert timed == ["fp8 B=1 S=128", f"decode bf16 B={b} S={s}"], line
    assert line.count("(ok ") == 2, line


def test_write_cases_are_timed_after_a_bit_exact_check():
    """--write times write_kv (bf16 and fp8 caches) per layer of one program that writes every
    layer, each first compared byte for byte with the reference's writes."""
    site = str(Path(jax_kvcm.__file__).resolve().parents[1])
    r = run(site, "--quick", "--write", "--rounds", "1", "--repeats", "1", "--cases", "write")
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("round 1 ")]
    timed = [part.rsplit(" ", 4)[0] for part in line.split(": ", 1)[1].split("), ")]
    assert timed == ["write bf16 T=5", "write fp8 T=5", "write bf16 T=40", "write fp8 T=40"], line
    assert line.count("(ok (bit-exact)") == 4, line
