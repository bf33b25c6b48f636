"""Tensor parallelism over KV heads: :mod:`jax_kvcm.sharded` on 2- and 4-device meshes.

The CPU device count is fixed when jax starts, so each case runs ``sharded_worker.py`` in its own
process with ``--xla_force_host_platform_device_count`` (this process and the other tests keep
one device). The worker's oracles: the pure-JAX reference and the plain unsharded custom call
(bit-equal). The ``gpu`` case runs the same checks on two real GPUs.
"""

from __future__ import annotations

import os

import conftest
import pytest

pytestmark = pytest.mark.slow  # seconds to minutes: `pytest -m "not gpu and not slow"` skips it

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_worker.py")


def run_worker(*args: str, timeout: float = 600) -> str:
    return conftest.run_worker(WORKER, *args, timeout=timeout)


@pytest.mark.parametrize("devices,tp", [(2, 2), (4, 4)])
def test_sharded_ops_equal_unsharded(devices, tp):
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed={seed}")
    print(run_worker("--devices", str(devices), "--tp", str(tp), "--seed", str(seed)))


@pytest.mark.parametrize("devices,tp", [(2, 2), (4, 4)])
def test_manager_on_a_mesh(devices, tp):
    """Pools split over KV heads; prepare_step / complete_step with sharded steps; attention
    outputs and pool contents against a closed-form oracle (sharded_manager_check.py)."""
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed={seed}")
    print(run_worker("--devices", str(devices), "--tp", str(tp), "--seed", str(seed),
                     "--manager"))


def test_config_mesh_errors_name_the_field():
    import jax
    import jax.numpy as jnp

    from jax_kvcm import KVCacheConfig, LayerGroupConfig
    mesh = jax.make_mesh((1,), ("tp",))
    group = LayerGroupConfig(2, 3, 8, jnp.float32)
    cfg = KVCacheConfig(tokens_per_page=4, layer_groups=(group,), device_pages=8, mesh=mesh)
    assert cfg.num_shards == 1 and cfg.device_pool_bytes() == 9 * 2 * 2 * 4 * 3 * 8 * 4
    with pytest.raises(ValueError, match="mesh_axis 'dp'"):
        KVCacheConfig(tokens_per_page=4, layer_groups=(group,), device_pages=8, mesh=mesh,
                      mesh_axis="dp")
    with pytest.raises(TypeError, match="mesh must be"):
        KVCacheConfig(tokens_per_page=4, layer_groups=(group,), device_pages=8, mesh="tp")


@pytest.mark.parametrize("devices,tp", [(2, 2), (4, 4)])
def test_cold_tiers_per_shard(devices, tp, tmp_path):
    """Storage round trips byte-exact per shard, a fault on one shard rolling back all, and the
    manager's suspend / resume / prefix onboarding on a mesh (sharded_tiers_check.py)."""
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed={seed}")
    print(run_worker("--devices", str(devices), "--tp", str(tp), "--seed", str(seed),
                     "--tiers", str(tmp_path)))


@pytest.mark.gpu
def test_sharded_ops_two_gpus():
    """The sharded ops and the manager on two GPUs (skipped with < 2 GPUs)."""
    from conftest import visible_gpus
    if visible_gpus() < 2:
        pytest.skip("needs 2 GPUs")
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed={seed}")
    print(run_worker("--devices", "2", "--tp", "2", "--seed", str(seed), "--platform", "gpu"))
    print(run_worker("--devices", "2", "--tp", "2", "--seed", str(seed), "--platform", "gpu",
                     "--manager"))


@pytest.mark.gpu
def test_cold_tiers_per_shard_two_gpus(tmp_path):
    """The tier checks on two GPUs: the pinned host tier, the concat codec's HOST-location pairs
    registered per shard, the disk tier through the staging ring (skipped with < 2 GPUs)."""
    from conftest import visible_gpus
    if visible_gpus() < 2:
        pytest.skip("needs 2 GPUs")
    seed = int.from_bytes(os.urandom(2), "little")
    print(f"seed={seed}")
    print(run_worker("--devices", "2", "--tp", "2", "--seed", str(seed), "--platform", "gpu",
                     "--tiers", str(tmp_path)))
