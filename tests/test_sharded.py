"""Tensor parallelism over KV heads: :mod:`jax_kvcm.sharded` on 2- and 4-device meshes.

The CPU device count is fixed when jax starts, so each case runs ``sharded_worker.py`` in its own
process with ``--xla_force_host_platform_device_count`` (this process and the other tests keep
one device). The worker's oracles: the pure-JAX reference and the plain unsharded custom call
(bit-equal). The ``gpu`` case runs the same checks on two real GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_worker.py")


def run_worker(*args: str, timeout: float = 600) -> str:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, WORKER, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"worker {' '.join(args)} failed:\n{out[-6000:]}"
    assert "OK " in proc.stdout, out[-6000:]
    return out


@pytest.mark.parametrize("devices,tp", [(2, 2), (4, 4)])
def test_sharded_ops_equal_unsharded(devices, tp):
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed={seed}")
    print(run_worker("--devices", str(devices), "--tp", str(tp), "--seed", str(seed)))


@pytest.mark.gpu
def test_sharded_ops_two_gpus():
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed={seed}")
    print(run_worker("--devices", "2", "--tp", "2", "--seed", str(seed), "--platform", "gpu"))
