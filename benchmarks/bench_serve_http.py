#!/usr/bin/env python
"""HTTP serving benchmark (issue 14): the runner's serving loop through the OpenAI-compatible
server (``examples/llama/server.py``) with streaming clients, against the same loop in process.

Run on the GPU machine from the repo root, after installing jax_kvcm with its CUDA extension:

    python -m benchmarks.bench_serve_http --quick --json serve_http.json  # 320 requests (~3 min)
    python -m benchmarks.bench_serve_http                                  # 640 requests
    JAX_PLATFORMS=cpu python -m benchmarks.bench_serve_http --tiny         # tiny model, CPU

**Model**: Llama-3.1-8B's shape with random bf16 weights (the serving benchmark's, drawn on the
device: no download); ``--tiny``: that script's tiny float32 model.

**Workload** (the shared-prefix set of the seed benchmark, smaller): requests of 1,024 prompt
tokens (one of 15 system prompts of 512 +- 32 tokens, then a unique suffix) and 1,024 output
tokens, greedy, EOS ignored; all submitted at t=0, at most ``--concurrency`` (256) running, the
rest queued. Both runs go through one server (16-token pages, a pool of ``concurrency x
(pages(2,048) + 1)`` pages, 4,096-token steps, one batch and one token bucket) after a warm-up
that compiles every step program and serves the 15 system prompts (a running server has them
cached). The two runs share the system prompts but not the suffixes (in-process first): with the
same requests, pages the first run leaves cached served 95% of the second run's prompt tokens
(H200, 2026-12-01), so each run draws its own suffixes and both hit only the system prompts; each
run's prefix hit rate is printed.

- ``in-process``: ``Server.submit`` for every request, then ``step()`` until done; a request's
  token times are taken from :meth:`Server.new_tokens` after each step.
- ``http``: the same ``Server`` behind ``create_app`` (uvicorn on 127.0.0.1 in this process; one
  engine thread), driven by ``--client-procs`` client processes
  (``benchmarks/harness/http_load.py``: ``httpx``, one streaming ``/v1/completions`` per
  request, all opened at once); token times are chunk arrival times at the clients.

**Measured**: output tokens/s (generated tokens / wall time from the first submission to the last
token), time to first token (from submission, so queueing included) and inter-token latency
(between consecutive tokens of a request), p50 and p99; the ratio http / in-process tokens/s
(target >= 0.95).

``--tiny`` is also a correctness check: it serves the HTTP run's prompts in process too (before
the HTTP run) and exits with status 1 unless every HTTP generation is complete and equals the in-process one
(exact on the CPU; bfloat16 on a GPU drifts where batch composition differs, so the GPU runs
skip the check); its ratio means little: a tiny step takes about a millisecond on the
CPU, so per-token HTTP work dominates there, while an 8B decode step on the GPU leaves the event
loop tens of milliseconds of device time to stream the previous step's tokens in.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.harness import http_load  # noqa: E402
from benchmarks.harness import run_log  # noqa: E402
from benchmarks.harness import serve_setup  # noqa: E402
from examples.llama import serve  # noqa: E402

TARGET_HTTP_OVER_IN_PROCESS = 0.95


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    model: Any
    requests: int = 640
    concurrency: int = 256
    input_len: int = 1024
    output_len: int = 1024
    system_prompts: int = 15
    system_len: int = 512
    system_jitter: int = 32
    page_size: int = 16
    step_tokens: int = 4096
    seed: int = 0

    @property
    def pages_per_seq(self) -> int:
        return -(-(self.input_len + self.output_len) // self.page_size)


FULL = Workload("llama-3.1-8b-shape", serve_setup.LLAMA_31_8B)
QUICK = dataclasses.replace(FULL, requests=320)
TINY = Workload("tiny", serve_setup.TINY, requests=48, concurrency=8, input_len=40, output_len=16,
                system_prompts=5, system_len=24, system_jitter=4, page_size=8, step_tokens=64)


def make_prompts(w: Workload) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(system prompts, the in-process run's prompts, the HTTP run's prompts): request ``i`` of a
    run = system ``i % n`` + a unique suffix up to ``input_len`` tokens. The two runs share the
    system prompts, not the suffixes: pages the first run leaves cached must not serve the second
    (with the same prompts the HTTP run hit 95% of its prompt tokens, the in-process run 49%)."""
    rng = np.random.default_rng(w.seed + 1)
    V = w.model.vocab_size
    j = w.system_jitter
    systems = [rng.integers(0, V, w.system_len + int(rng.integers(-j, j + 1))).tolist()
               for _ in range(w.system_prompts)]

    def run_prompts() -> list[list[int]]:
        return [systems[i % len(systems)]
                + rng.integers(0, V, w.input_len - len(systems[i % len(systems)])).tolist()
                for i in range(w.requests)]

    return systems, run_prompts(), run_prompts()


def _latencies(t0: Sequence[float], times: Sequence[Sequence[float]]) -> dict[str, float]:
    ttft = [ts[0] - s for s, ts in zip(t0, times) if ts]
    itl = np.concatenate([np.diff(ts) for ts in times if len(ts) > 1] or [np.zeros(0)])
    return dict(ttft_p50_s=run_log.pct(ttft, 50), ttft_p99_s=run_log.pct(ttft, 99),
                itl_p50_s=run_log.pct(itl, 50), itl_p99_s=run_log.pct(itl, 99))


def _hits(server: serve.Server, before: dict) -> float:
    rep = server.report()
    prompt = rep["prompt_tokens"] - before["prompt_tokens"]
    return (rep["prefix_hit_tokens"] - before["prefix_hit_tokens"]) / max(1, prompt)


# ---------------------------------------------------------------------------------------------
# In process.


def run_in_process(server: serve.Server, w: Workload, prompts: list[list[int]]) -> tuple[dict,
                                                                                           list]:
    before = server.report()
    rids = [server.submit(serve.Request(p, w.output_len, eos_token_ids=[])) for p in prompts]
    index = {rid: i for i, rid in enumerate(rids)}
    t0 = time.perf_counter()
    times: list[list[float]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    while server.has_work():
        finished = server.step()
        now = time.perf_counter()
        for rid, ids in server.new_tokens().items():   # before pop_output: the last tokens
            i = index.get(rid)
            if i is None:         # the warm-up's requests
                continue
            tokens[i] += ids
            times[i] += [now] * len(ids)
        for out in finished:
            server.pop_output(out.request_id)
    seconds = max(ts[-1] for ts in times) - t0
    gen = sum(map(len, tokens))
    res = dict(path="in-process", requests=len(prompts), generated_tokens=gen, seconds=seconds,
               output_tokens_per_s=gen / seconds, prefix_hit_rate=_hits(server, before),
               **_latencies([t0] * len(prompts), times))
    return res, tokens


# ---------------------------------------------------------------------------------------------
# Through HTTP.


def run_http(server: serve.Server, w: Workload, prompts: list[list[int]],
             client_procs: int = 8) -> tuple[dict, list]:
    import uvicorn

    from examples.llama.server import create_app

    before = server.report()
    app = create_app(server, model_name="bench", max_queue=len(prompts))
    with _socket() as sock:
        port = sock.getsockname()[1]
        uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not uv.started:
            if not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        with tempfile.TemporaryDirectory(prefix="kvcm-http-bench-") as tmp:
            # NOTE: several client processes: one asyncio client parsing every chunk of 256
            # streams falls behind the server (httpx parses HTTP in Python), which would
            # measure the client.
            n = max(1, min(client_procs, len(prompts)))
            start_at = time.perf_counter() + 3.0    # every client starts sending then
            procs = []
            for k in range(n):
                src, dst = Path(tmp) / f"in{k}.json", Path(tmp) / f"out{k}.json"
                src.write_text(json.dumps({"prompts": prompts[k::n], "max_tokens": w.output_len,
                                           "start_at": start_at}))
                procs.append((dst, subprocess.Popen(
                    [sys.executable, http_load.__file__,
                     f"http://127.0.0.1:{port}", str(src), str(dst)],
                    stderr=subprocess.PIPE, text=True)))
            parts = []
            for dst, proc in procs:
                _, err = proc.communicate()
                parts.append(json.loads(dst.read_text()) if dst.is_file() else {
                    "error": f"client exited with {proc.returncode}: {err[-2000:]}"})
        uv.should_exit = True       # the app's lifespan stops the engine (storage closed)
        thread.join()
    errors = [p["error"] for p in parts if "error" in p]
    if errors:
        raise RuntimeError(f"client failed: {errors[0]}")
    t0s, times, tokens = ([0.0] * len(prompts), [[] for _ in prompts], [[] for _ in prompts])
    for k, part in enumerate(parts):       # client k had requests k, k + n, k + 2n, ...
        t0s[k::n], times[k::n], tokens[k::n] = part["t0"], part["times"], part["tokens"]
    t0 = min(t0s)
    seconds = max(ts[-1] for ts in times if ts) - t0
    gen = sum(map(len, tokens))
    res = dict(path="http", requests=len(prompts), generated_tokens=gen, seconds=seconds,
               output_tokens_per_s=gen / seconds, prefix_hit_rate=_hits(server, before),
               **_latencies(t0s, times))
    return res, tokens


def _socket():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(2048)
    return s


# ---------------------------------------------------------------------------------------------


def bench_http(w: Workload, params: Any, client_procs: int = 8, *,
               check_tokens: bool = False) -> dict[str, Any]:
    """Both runs through one server; ``check_tokens``: serve the HTTP run's prompts in process
    too (before the HTTP run, whose prefix hits they then raise) and report the fraction of identical generations (exact on the CPU; bfloat16 on a GPU
    drifts where batch composition differs, so the GPU runs skip it)."""
    systems, prompts_in, prompts_http = make_prompts(w)
    pool = w.concurrency * (w.pages_per_seq + 1)
    cfg = serve.ServeConfig(page_size=w.page_size, device_pages=pool, max_batch=w.concurrency,
                            max_tokens_per_step=w.step_tokens,
                            max_seq_len=w.pages_per_seq * w.page_size,
                            batch_buckets=(w.concurrency,), token_buckets=(w.step_tokens,))
    server = serve.Server(params, w.model, cfg)
    t = time.perf_counter()
    server.generate([serve.Request(list(range(1, w.page_size + 2)), 2, eos_token_ids=[])])
    server.generate([serve.Request(list(s), 1, eos_token_ids=[]) for s in systems])
    run_log.log(f"warm-up (compiles, {len(systems)} system prompts cached): "
                f"{time.perf_counter() - t:.1f} s")
    results = []
    res_in, _ = run_in_process(server, w, prompts_in)
    results.append(res_in)
    run_log.log(_fmt(res_in))
    tok_ref = None
    if check_tokens:     # the HTTP run's prompts in process too (the HTTP run shuts the server)
        _, tok_ref = run_in_process(server, w, prompts_http)
    res_http, tok_http = run_http(server, w, prompts_http, client_procs)
    results.append(res_http)
    run_log.log(_fmt(res_http))
    same = (None if tok_ref is None else
            sum(a == b for a, b in zip(tok_ref, tok_http)) / len(prompts_http))
    ratio = res_http["output_tokens_per_s"] / res_in["output_tokens_per_s"]
    complete = all(len(t) == w.output_len for t in tok_http)
    return dict(workload=dataclasses.asdict(dataclasses.replace(w, model=None)),
                model=w.name, device=jax.devices()[0].device_kind, results=results,
                http_over_in_process=ratio, target=TARGET_HTTP_OVER_IN_PROCESS,
                identical_generations=same, http_all_complete=complete, pool_pages=pool)


def _fmt(r: dict) -> str:
    return (f"  {r['path']:>10}: {r['output_tokens_per_s']:9.1f} tok/s ({r['generated_tokens']} "
            f"tokens in {r['seconds']:.2f} s), TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms p99 "
            f"{r['ttft_p99_s'] * 1e3:.1f} ms, ITL p50 {r['itl_p50_s'] * 1e3:.2f} ms p99 "
            f"{r['itl_p99_s'] * 1e3:.2f} ms, prefix hit rate {r['prefix_hit_rate']:.1%}")


def markdown(out: dict) -> str:
    lines = ["| path | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | prefix hits |",
             "|---|---|---|---|---|"]
    for r in out["results"]:
        lines.append(f"| {r['path']} | {r['output_tokens_per_s']:.0f} | "
                     f"{r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p99_s'] * 1e3:.0f} | "
                     f"{r['itl_p50_s'] * 1e3:.1f} / {r['itl_p99_s'] * 1e3:.1f} | "
                     f"{r['prefix_hit_rate']:.1%} |")
    same = out["identical_generations"]
    lines.append(f"\nhttp / in-process tokens/s: {out['http_over_in_process']:.3f} (target >= "
                 f"{out['target']})" + ("" if same is None else
                                        f"; identical generations {same:.0%}"))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.bench_serve_http``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve_http", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="320 requests")
    size.add_argument("--tiny", action="store_true", help="tiny float32 model (CPU, seconds)")
    p.add_argument("--requests", type=int, help="number of requests")
    p.add_argument("--concurrency", type=int, help="requests running at once (max_batch)")
    p.add_argument("--client-procs", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                   help="load-generating client processes (default: half the CPUs, at most 8)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    w = TINY if args.tiny else QUICK if args.quick else FULL
    w = dataclasses.replace(w, seed=args.seed, requests=args.requests or w.requests,
                            concurrency=args.concurrency or w.concurrency)
    serve_setup.preflight(args.tiny)
    dev = jax.devices()[0]
    run_log.log(f"jax {jax.__version__} on {dev.device_kind} ({jax.default_backend()}); "
                f"{w.name}: {w.requests} requests of {w.input_len}/{w.output_len} tokens, "
                f"concurrency {w.concurrency}, {w.system_prompts} system prompts of "
                f"~{w.system_len} tokens")
    params = serve_setup.random_params(types.SimpleNamespace(model=w.model, seed=w.seed))
    out = bench_http(w, params, args.client_procs, check_tokens=args.tiny)
    out["client_procs"] = args.client_procs
    print(markdown(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if args.tiny and (out["identical_generations"] != 1.0 or not out["http_all_complete"]):
        raise SystemExit("tiny check failed: HTTP and in-process generations differ")
    return out


if __name__ == "__main__":
    main()
