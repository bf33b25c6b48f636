"""Two processes joined by ``jax.distributed`` on a local coordinator (127.0.0.1, a free port),
one CPU device each, serve the built-in tiny Llama with TP = 2 across the processes
(``examples/llama/multihost.py``: process 0 leads, process 1 follows the published steps; the
all-reduces run between the processes over gloo); the leader's tokens must equal one process's
TP = 1 tokens. Bounded: every process has a timeout (about 15 s on an idle 2-core machine).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

import jax_kvcm  # noqa: F401  (the installed package first; the repo root after)

pytestmark = pytest.mark.slow  # seconds to minutes: `pytest -m "not gpu and not slow"` skips it

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root

TIMEOUT_S = 120


def make_server(tensor_parallel: int):
    """The built-in random Llama (run.py's, float32) in a server with no cold tiers; the same in
    every process (numpy-seeded weights)."""
    from examples.llama import model as llama
    from examples.llama import run, serve
    config = run.DEFAULT_CONFIG
    params = llama.init_params(config, seed=0)
    return serve.Server(params, config, serve.ServeConfig(
        page_size=8, device_pages=64, max_batch=4, max_tokens_per_step=32, max_seq_len=128,
        tensor_parallel=tensor_parallel))


def requests():
    """The built-in prompts (a shared 40-token prefix): the first alone, then the rest."""
    from examples.llama import run, serve
    reqs = [serve.Request(p, 10, eos_token_ids=()) for p in run.default_prompts()]
    return [reqs[:1], reqs[1:]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_tp2_equal_tp1():
    _check_two_processes("cpu")


@pytest.mark.gpu
def test_two_processes_on_two_gpus():
    """The same with one GPU per process (``CUDA_VISIBLE_DEVICES``); the all-reduces go between
    the processes' GPUs. Skipped with fewer than 2 GPUs."""
    from conftest import visible_gpus
    if visible_gpus() < 2:
        pytest.skip("needs 2 GPUs")
    _check_two_processes("gpu")


def _check_two_processes(platform: str) -> None:
    worker = os.path.join(HERE, "multihost_worker.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = []
    for i in range(2):
        penv = dict(env, CUDA_VISIBLE_DEVICES=str(i)) if platform == "gpu" else env
        procs.append(subprocess.Popen(
            [sys.executable, worker, "--coordinator", coordinator, "--process-id", str(i),
             "--platform", platform], env=penv, cwd=HERE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"process {i} exited {rc}:\n{out[-3000:]}\n{err[-6000:]}"
    line = next(x for x in outs[0][1].splitlines() if x.startswith("IDS "))
    got = json.loads(line[4:])
    assert "FOLLOWED" in outs[1][1], outs[1][1]
    steps = int(outs[1][1].split("FOLLOWED ")[1].split()[0])

    server = make_server(tensor_parallel=1)
    want = [o.generated_ids for wave in requests() for o in server.generate(wave)]
    assert got == want, f"TP=2 across processes {got} != TP=1 {want}"
    assert steps == server.counters["steps"], (steps, server.counters["steps"])
    assert len({t for ids in want for t in ids}) > 10, "degenerate generations"
    print(f"2 processes, {steps} steps followed, {len(got)} requests equal TP=1")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))
