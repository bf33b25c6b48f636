"""A fault in one shard's part of a migration (pools split over KV heads on a mesh) rolls back
every shard, byte-exact, and the migration can be retried: every path of the storage manager
(device <-> host, write-back ahead, device <-> disk, host <-> disk, two-move transactions) and,
through the KV-cache manager, suspend, resume, prefix onboarding and eviction (the manager's
invariants checked after each). The checks run in ``shard_rollback_worker.py`` in a process
with several CPU devices (see its docstring for the oracle and what is compared)."""

from __future__ import annotations

import os

import conftest
import pytest

pytestmark = pytest.mark.slow  # seconds to minutes: `pytest -m "not gpu and not slow"` skips it

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shard_rollback_worker.py")


def run_worker(*args: str, timeout: float = 600) -> str:
    return conftest.run_worker(WORKER, *args, timeout=timeout)


@pytest.mark.parametrize("devices", [2, 4])
def test_storage_rolls_back_every_shard(devices, tmp_path):
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed={seed}")
    print(run_worker("--devices", str(devices), "--seed", str(seed), "--disk", str(tmp_path)))


def test_manager_rolls_back_every_shard(tmp_path):
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed={seed}")
    print(run_worker("--devices", "2", "--seed", str(seed), "--disk", str(tmp_path),
                     "--manager"))


@pytest.mark.gpu
def test_rolls_back_every_shard_two_gpus(tmp_path):
    """The same on two GPUs (HOST-location pairs registered per shard, the pinned host tier and
    staging ring); skipped with fewer than 2 GPUs."""
    from conftest import visible_gpus
    if visible_gpus() < 2:
        pytest.skip("needs 2 GPUs")
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed={seed}")
    print(run_worker("--devices", "2", "--seed", str(seed), "--disk", str(tmp_path / "s"),
                     "--platform", "gpu"))
    print(run_worker("--devices", "2", "--seed", str(seed), "--disk", str(tmp_path / "m"),
                     "--platform", "gpu", "--manager"))
