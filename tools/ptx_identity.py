"""Does a CUDA source change leave the generated code as it was? For refactors of ``ffi/cuda``
(moving a kernel into a header, renaming, splitting a file): compiles each named ``.cu`` file
to PTX for sm_90a twice, as it is in ``--base`` (a git ref, with that ref's ``ffi/include``) and
as it is in the working tree, and compares the two with every mangled symbol name replaced by
one placeholder (a kernel that moves between namespaces changes its name, not its code) and the
comment / debug-line directives dropped. Needs ``nvcc``, not a GPU.

    python -m tools.ptx_identity --base main ffi/cuda/paged_decode.cu      # main -> working tree
    python -m tools.ptx_identity --base main --head BRANCH ffi/cuda/codec.cu

Prints ``identical`` or the first differing lines per file; exits 1 when any file differs.
Identical PTX is identical machine code (ptxas is deterministic), so such a change needs no new
GPU run; anything else is a kernel change and runs the whole gpu suite first.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MANGLED = re.compile(r"_Z[A-Za-z0-9_]+")
_DROPPED = ("//", ".loc", ".file")


def normalized_ptx(text: str) -> list[str]:
    """PTX lines with mangled names replaced by ``SYM``, ``.visible`` dropped (a kernel leaving
    an anonymous namespace becomes visible) and comment / debug lines removed."""
    text = _MANGLED.sub("SYM", text).replace(".visible .entry", ".entry")
    text = text.replace(".visible .func", ".func").replace(".visible .shared", ".shared")
    return [ln for ln in text.split("\n") if not ln.strip().startswith(_DROPPED)]


def compile_ptx(source: Path, include: Path, out: Path, nvcc: str) -> None:
    """``source`` -> PTX at ``out`` for sm_90a, with the extension's language flags."""
    import jax  # the XLA FFI headers
    import nanobind  # codec.cu binds module functions

    cmd = [nvcc, "-ptx", "-arch=sm_90a", "-std=c++17", "-O3", "-DNDEBUG",
           "--expt-relaxed-constexpr", f"-I{include}", "-isystem", jax.ffi.include_dir(),
           "-isystem", nanobind.include_dir(), "-isystem", sysconfig.get_paths()["include"],
           str(source), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"nvcc failed on {source}:\n{done.stderr[-3000:]}")


def _checkout(ref: str, dest: Path) -> Path:
    """``ffi/`` as it is at git ref ``ref``, under ``dest``; returns ``dest``."""
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "ffi"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)
    return dest


def compare(base: str, files: list[str], nvcc: str, head: str | None = None,
            context: int = 20) -> dict[str, list[str]]:
    """``{file: differing lines}`` (empty: identical) of each file at ``base`` and at ``head``
    (a git ref; None: the working tree)."""
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = _checkout(base, Path(tmp) / "base")
        new_tree = ROOT if head is None else _checkout(head, Path(tmp) / "head")

        def one(i_f):
            i, f = i_f
            ptx = [Path(tmp) / f"{i}_base.ptx", Path(tmp) / f"{i}_tree.ptx"]
            compile_ptx(old_tree / f, old_tree / "ffi" / "include", ptx[0], nvcc)
            compile_ptx(new_tree / f, new_tree / "ffi" / "include", ptx[1], nvcc)
            a, b = (normalized_ptx(p.read_text()) for p in ptx)
            diff = list(difflib.unified_diff(a, b, "base", "tree", lineterm="", n=0))
            return f, diff[:context]

        with ThreadPoolExecutor(max_workers=max(1, len(files))) as pool:
            return dict(pool.map(one, enumerate(files)))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.ptx_identity", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--base", required=True, help="git ref to compare the working tree against")
    ap.add_argument("--head", default=None, help="git ref to compare (default: the working tree)")
    ap.add_argument("files", nargs="+", help=".cu files, relative to the repository root")
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    differs = 0
    for f, diff in compare(args.base, args.files, args.nvcc, args.head).items():
        if diff:
            differs += 1
            print(f"{f}: DIFFERS\n" + "\n".join(diff))
        else:
            print(f"{f}: identical")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
