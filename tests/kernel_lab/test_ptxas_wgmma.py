"""The sm_90a prefill kernel keeps its wgmma pipeline through ptxas.

ptxas may serialize every wgmma of a kernel (each one then waits for the previous) when it meets,
for example, a divergent branch while a wgmma is in flight. It says so only as an "info" line
("Potential Performance Loss: wgmma.mma_async instructions are serialized", C7515 / C7518 ...),
and the build passes. Session 15 measured one such branch cost 11-15% of the prefill. This test
compiles ``ffi/cuda/ragged_prefill_sm90.cu`` for sm_90a with ``ptxas -v`` and fails on any such
line. It needs nvcc (CI has it; skipped without), not a GPU. The same report shows that no
instantiation spills (the producer's setmaxnreg budget is 56 registers, which the fp8 path's
in-place conversion also has to fit).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "ffi" / "cuda" / "ragged_prefill_sm90.cu"


def ptxas_report(source: Path, out_dir: Path) -> str:
    """nvcc's output for ``source`` compiled to an sm_90a cubin with ptxas -v (stdout + stderr)."""
    import jax.ffi

    argv = ["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-arch=sm_90a",
            f"-I{ROOT / 'ffi' / 'include'}", f"-I{jax.ffi.include_dir()}", "-Xptxas=-v",
            "-cubin", "-o", str(out_dir / "kernel.cubin"), str(source)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout + r.stderr


def serialized_wgmma_lines(report: str) -> list[str]:
    """The report's lines that say ptxas serialized wgmma instructions."""
    return [line for line in report.splitlines()
            if "wgmma" in line.lower() and "serializ" in line.lower()]


def kernel_spills(report: str) -> dict[str, tuple[int, int]]:
    """(spill store bytes, spill load bytes) per RaggedPrefillSm90Kernel instantiation, by its
    mangled template arguments (dtype, head_dim, fp8)."""
    found = re.findall(r"Function properties for \S*RaggedPrefillSm90KernelI(\w+?)EEvNS0_\w*\n"
                       r"\s*\d+ bytes stack frame, (\d+) bytes spill stores, "
                       r"(\d+) bytes spill loads", report)
    return {args: (int(st), int(ld)) for args, st, ld in found}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    text = ptxas_report(SOURCE, tmp_path_factory.mktemp("ptxas"))
    assert "Compiling entry function" in text, text[-2000:]  # ptxas -v did report
    return text


def test_sm90_prefill_wgmma_not_serialized(report):
    assert serialized_wgmma_lines(report) == [], "\n".join(serialized_wgmma_lines(report))


def test_sm90_prefill_instantiations_do_not_spill(report):
    spills = kernel_spills(report)
    # bf16 / f16 queries x head_dim 64 / 128 x 16-bit / fp8 caches
    assert len(spills) == 8, sorted(spills)
    assert all(v == (0, 0) for v in spills.values()), spills
