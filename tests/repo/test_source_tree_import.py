"""Python started in the repository root imports the source tree (``''`` is first on sys.path):
it must work when the package is installed (the source tree finds the installed extension), and
say "install the package" only when it is not installed anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax_kvcm  # noqa: F401  (the installed package, or the source tree finding its extension)

ROOT = Path(__file__).resolve().parents[2]


def python_in_root(code: str) -> subprocess.CompletedProcess:
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != ROOT]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(keep))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_repo_root_imports_and_runs_an_op():
    r = python_in_root(
        "import jax, jax.numpy as jnp, jax_kvcm, os\n"
        "assert os.path.dirname(jax_kvcm.__file__) == os.path.join(os.getcwd(), 'jax_kvcm')\n"
        "k = jnp.zeros((2, 4, 1, 8)); x = jnp.ones((1, 1, 8))\n"
        "k2, _ = jax_kvcm.write_kv(k, k, x, x, jnp.array([5], jnp.int32))\n"
        "assert float(k2[1, 1].sum()) == 8.0\n"
        "print('ok')\n")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_message_is_true_when_nothing_is_installed():
    r = python_in_root(
        "import os, sys\n"
        "sys.path = [p for p in sys.path if p in ('', os.getcwd()) or not "
        "os.path.isdir(os.path.join(p, 'jax_kvcm'))]\n"
        "try:\n"
        "    import jax_kvcm\n"
        "except ImportError as e:\n"
        "    print(e)\n")
    here = any((ROOT / "jax_kvcm").glob("_kvcm_cpu*"))  # an in-place build: nothing to say
    if not here:
        assert "install the package" in r.stdout and "installed copy" in r.stdout, (
            r.stdout, r.stderr[-2000:])
