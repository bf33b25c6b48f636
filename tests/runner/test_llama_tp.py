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

import conftest
import pytest

pytestmark = pytest.mark.slow  # seconds to minutes: `pytest -m "not gpu and not slow"` skips it

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "tp_worker.py")


def run_worker(*args: str, timeout: float = 600) -> str:
    return conftest.run_worker(WORKER, *args, timeout=timeout)


TP_CASES = {2: "llama,tied,qwen2_mixed,qwen3", 4: "llama,tied"}


@pytest.fixture(scope="module")
def tp_worker_cpu() -> str:
    """One worker on 4 CPU devices for every degree of TP_CASES (TP 2 on the first two): each
    case's checkpoint and TP-1 runs are made once, not once per degree."""
    return run_worker("--devices", "4", *(f"--tp={n}:{c}" for n, c in TP_CASES.items()))


@pytest.mark.parametrize("tp", sorted(TP_CASES))
def test_tensor_parallel_tokens_equal_one_device_and_hf(tp_worker_cpu, tp):
    print(tp_worker_cpu)
    assert f"OK devices=4 tp={tp} cases={TP_CASES[tp]}\n" in tp_worker_cpu


def test_config_checks_name_the_field():
    import jax

    import jax_kvcm  # noqa: F401  (the installed package first; the repo root after)
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root
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


@pytest.fixture(scope="module")
def serve_on_two_devices(tmp_path_factory) -> tuple[dict, str]:
    """One process on 2 CPU devices runs ``python -m benchmarks.serve --tiny --tensor-parallel 2
    --no-shared --json FILE`` (its ``main``) and then the pre-run check ``serve._check([1, 2])``
    (as an 8B run does before its runs); (the JSON, the process's stdout)."""
    import json

    root = os.path.dirname(os.path.dirname(HERE))  # the repo root
    out = tmp_path_factory.mktemp("serve_tp2") / "serve.json"
    code = ("import json; from benchmarks import bench_serve as serve; serve.main(['--tiny', "
            "'--tensor-parallel', '2', '--no-shared', "
            f"'--json', {str(out)!r}]); print('CHECK ' + json.dumps(serve._check([1, 2])))")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_serve_benchmark_tiny_on_two_devices(serve_on_two_devices):
    """``python -m benchmarks.serve --tiny --tensor-parallel 2``: the paged runs on a 2-device mesh
    generate what the dense single-device runs do (the benchmark raises otherwise)."""
    res, _ = serve_on_two_devices
    paged = [r for r in res["results"] if r["path"] == "paged"]
    assert paged and all(r["tensor_parallel"] == 2 for r in paged), paged
    assert res["agreement"] and all(a["identical"] == a["requests"] for a in res["agreement"])


def _serve_tp_sweep(tmp_path, tps: str, env: dict) -> dict:
    """``python -m benchmarks.serve --tiny --workload trtllm --no-shared --tensor-parallel <tps>
    --profile`` in a fresh process (``env``: its platform and devices); its JSON."""
    import json

    root = os.path.dirname(os.path.dirname(HERE))  # the repo root
    out, prof = tmp_path / "serve.json", tmp_path / "prof"
    argv = [sys.executable, "-m", "benchmarks.serve", "--tiny", "--workload",
            "trtllm", "--no-shared", "--tensor-parallel", *tps.split(), "--profile", str(prof),
            "--profile-steps", "8", "--json", str(out)]
    if env.get("JAX_PLATFORMS") == "cpu":
        argv += ["--device-memory-gib", "0.01"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=root)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(out.read_text())


def _check_tp_sweep(res: dict, tps: list[int]) -> None:
    """What a ``--tensor-parallel`` sweep of the tiny float32 model must show (see the
    callers): the paged row once per value, tokens equal to the first value's, the collectives
    of every step at TP > 1 in their category (none at TP 1), and the capacity rows."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root
    from benchmarks.harness import device_profile as _profile

    names = [r["name"] for r in res["results"]]
    assert names == (["paged random c8 [tp 1]", "dense random c8 [tp 1]"]
                     + [f"paged random c8 [tp {n}]" for n in tps[1:]]), names
    assert res["agreement"] and all(a["identical"] == a["requests"] > 0
                                    for a in res["agreement"]), res["agreement"]
    scaling = res["tensor_parallel"]["scaling"]
    assert [r["tensor_parallel"] for r in scaling] == tps
    assert all(r["identical"] == r["requests"] for r in scaling[1:]), scaling
    runs = {r["tensor_parallel"]: r for r in res["results"] if r["path"] == "paged"}
    for n, r in runs.items():
        p = r["profile"]
        assert p["window_steps"] == p["matched"] == 8, (n, p)
        # each traced step once (shard 0's), at most one more dispatched before the trace began
        assert 8 <= p["traced_step_programs"] <= 9, (n, p)
        for kind in ("decode", "mixed"):
            coll = p["kinds"][kind]["ms_per_step"]["collectives"]
            assert (coll > 0) == (n > 1), (n, kind, p["kinds"][kind])
        left = " ".join(name for name, _, _ in p["other_top"]).lower()
        assert not any(k in left for k in ("psum", "all_gather", "all-reduce", "nccl")), left
        if n > 1 and not p["on_device"]:
            # CPU: shard 0's steps alone, each with the step's 2 L psums and one all-gather
            trace = _profile.load_trace(p["dir"])
            per_step = [sum(o.name.startswith(("psum", "all_gather")) for o in x.ops)
                        for x in trace.executions if len(x.ops) >= 8]
            assert per_step and set(per_step) == {2 * 2 + 1}, per_step
    cap = {c["tensor_parallel"]: c for c in res["tensor_parallel"]["capacity"]}
    assert sorted(cap) == tps and not any("error" in c for c in cap.values()), cap
    page1 = 2 * 2 * 8 * 2 * 16 * 4          # K and V, 2 layers, page 8, 2 KV heads of 16, f32
    for n, c in cap.items():
        heads = 2 // n if n <= 2 else 1     # TP 4: each KV head replicated, one per device
        assert c["page_bytes_per_device"] == page1 // 2 * heads == sum(
            runs[n]["device_page_bytes"]), (n, c)
        assert c["weight_bytes_per_device"] == runs[n]["roofline"]["weight_bytes"]
        pages = int(c["kv_fraction"] * (c["memory_bytes"] - c["weight_bytes_per_device"])) \
            // c["page_bytes_per_device"] - 1
        assert c["max_concurrency"] == pages // (c["pages_per_seq"] + 1) > 0, c
        assert (runs[n]["device_pool_bytes"]
                == (runs[n]["pool_pages"] + 1) * c["page_bytes_per_device"])
    assert cap[2]["weight_bytes_per_device"] < cap[1]["weight_bytes_per_device"]
    assert cap[2]["max_concurrency"] > cap[1]["max_concurrency"]


def test_serve_benchmark_tp_sweep_on_four_devices(tmp_path):
    """``serve.py --tensor-parallel 1 2 4 --profile`` on 4 CPU devices: one run, the paged row
    per value on fresh servers (TP 4 replicates the tiny model's 2 KV heads), every value's
    tokens equal to TP 1's, the psum / all-gather thunks of a real TP step in "collectives"
    (shard 0's alone), and the largest concurrency per value from the per-device bytes."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    _check_tp_sweep(_serve_tp_sweep(tmp_path, "1 2 4", env), [1, 2, 4])


@pytest.mark.gpu
def test_serve_benchmark_tp_sweep_two_gpus(tmp_path):
    """``serve.py --tiny --tensor-parallel 1 2 --profile`` on two GPUs: the float32 TP 2 tokens
    equal TP 1's for every request, the NCCL kernels of the TP 2 steps land in "collectives",
    and the capacity rows use the devices' allocator limit."""
    from conftest import visible_gpus
    n = visible_gpus()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, {n} visible")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    res = _serve_tp_sweep(tmp_path, "1 2", env)
    _check_tp_sweep(res, [1, 2])
    assert res["meta"]["backend"] == "gpu"


def test_pre_run_check_covers_tensor_parallel(serve_on_two_devices):
    """The check before an 8B run (``serve._check``) adds the tiny model's paged random row at
    every ``--tensor-parallel`` value > 1 against one device's: on 2 CPU devices its tokens
    agree for every request."""
    import json

    _, stdout = serve_on_two_devices
    line = next(x for x in stdout.splitlines() if x.startswith("CHECK "))
    agreement = json.loads(line[len("CHECK "):])["agreement"]
    tp2 = [a for a in agreement if a["b"].endswith("[tp 2]")]
    assert len(tp2) == 1 and tp2[0]["identical"] == tp2[0]["requests"] == 16, agreement
    assert len(agreement) > 1 and all(a["identical"] == a["requests"] for a in agreement)
