"""The example Llama server split over devices (``ServeConfig(tensor_parallel=N)``,
``examples/llama/tp.py``): on 2 and 4 CPU devices its greedy tokens equal one device's and HF
transformers', and its compiled steps hold exactly one all-reduce per block (``tp_worker.py``,
each in its own process: the CPU device count is fixed when jax starts). The ``gpu`` case runs the
same worker on two GPUs (skipped when fewer are visible).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "tp_worker.py")


def run_worker(*args: str, timeout: float = 600) -> str:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, WORKER, *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=HERE)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"worker {' '.join(args)} failed:\n{out[-6000:]}"
    assert "OK " in proc.stdout, out[-6000:]
    return proc.stdout


@pytest.mark.parametrize("devices,cases", [(2, "llama,tied,qwen2_mixed,qwen3"),
                                           (4, "llama,tied")])
def test_tensor_parallel_tokens_equal_one_device_and_hf(devices, cases):
    print(run_worker("--devices", str(devices), "--cases", cases))


def test_config_checks_name_the_field():
    import jax

    import jax_kvcm  # noqa: F401  (the installed package first; the repo root after)
    sys.path.insert(0, os.path.dirname(HERE))
    from examples.llama import model as llama
    from examples.llama import serve, tp

    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                            num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=3,
                            head_dim=8)
    with pytest.raises(ValueError, match="num_attention_heads 6 .* tensor_parallel 4"):
        tp.check_config(cfg, 4)
    with pytest.raises(ValueError, match="num_key_value_heads 3 .* tensor_parallel 2"):
        tp.check_config(cfg, 2)
    with pytest.raises(ValueError, match="intermediate_size 48 .* tensor_parallel 5"):
        tp.check_config(llama.LlamaConfig(**{**vars(cfg), "num_attention_heads": 5,
                                             "num_key_value_heads": 5}), 5)
    assert tp.kv_heads(cfg, 3) == 3 and tp.kv_heads(cfg, 6) == 6
    with pytest.raises(ValueError, match="tensor_parallel 2 needs 2 devices"):
        tp.make_mesh(2, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="tensor_parallel must be"):
        serve.ServeConfig(tensor_parallel=0)


@pytest.mark.gpu
def test_tensor_parallel_two_gpus():
    from conftest import visible_gpus
    if visible_gpus() < 2:
        pytest.skip("needs 2 GPUs")
    print(run_worker("--devices", "2", "--platform", "gpu"))


def test_serve_benchmark_tiny_on_two_devices(tmp_path):
    """``benchmarks/serve.py --tiny --tensor-parallel 2``: the paged runs on a 2-device mesh
    generate what the dense single-device runs do (the benchmark raises otherwise)."""
    import json

    root = os.path.dirname(HERE)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "serve.py"),
                           "--tiny", "--tensor-parallel", "2", "--no-shared", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.join(root, "benchmarks"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())
    paged = [r for r in res["results"] if r["path"] == "paged"]
    assert paged and all(r["tensor_parallel"] == 2 for r in paged), paged
    assert res["agreement"] and all(a["identical"] == a["requests"] for a in res["agreement"])
