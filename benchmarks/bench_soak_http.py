#!/usr/bin/env python
"""HTTP soak (issue 34): the OpenAI-compatible server (``examples/llama/server.py``) on the
built-in tiny random Llama, on the CPU, under bounded mixed load for ``--minutes``.

    python -m benchmarks.bench_soak_http --minutes 30 --json soak.json
    python -m benchmarks.bench_soak_http --minutes 1 --sample-s 15      # a quick check

**Server**: ``python -m examples.llama.server`` as a subprocess on 127.0.0.1 (``JAX_PLATFORMS=cpu``;
its default 20 device pages of 8 tokens and a host tier, so concurrent requests run under page
pressure), with ``--max-body-bytes 256KiB`` and ``--request-timeout 120``.

**Load**: ``--clients`` (8) client loops (``httpx``, one process), each sending one request at a
time until the end: streaming and non-streaming completions (token ids and text) and chat; a share
of the streams is dropped after a few chunks (``--drop-share``, 0.15), a few non-streaming
requests are dropped by a client timeout, and ``--bad-share`` (0.12) are bad requests (invalid
JSON, invalid UTF-8, JSON nested 100,000 deep, wrong types, unknown fields, a body over the limit,
a prompt past the context as ids or as a 200 KB text, an unknown model). Every bad request must
get its 4xx in OpenAI's error shape.

**Samples** (every ``--sample-s`` seconds): the clients pause, the server is waited on until
nothing runs, then ``/metrics`` and the server's RSS (``/proc/PID/status``) are read: device and
host pages still referenced (must be 0: nothing leaks), cached pages, RSS; per interval: requests
by kind, p50 / p99 latency of completed requests (whole request) and p99 time to first token of
streams. **Fails** (exit status 1) on any error that is not the client's fault: a 5xx, a
connection error or a stream that ends without ``[DONE]`` on a request that was not dropped, a bad
request answered with an unexpected status or shape, pages referenced while idle, or RSS growing by
more than ``--rss-growth-mb`` between the first sample past a third of the run and the last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kvcm-random-llama"
BODY_LIMIT = 256 << 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log_path: Path, extra: list[str]) -> subprocess.Popen:
    import httpx

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.llama.server", "--host", "127.0.0.1", "--port",
         str(port), "--max-body-bytes", str(BODY_LIMIT), "--request-timeout", "120", *extra],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"server not up after 300 s; see {log_path}")
        time.sleep(0.3)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


# Bad requests: (name, body bytes or a JSON value, expected status).
def bad_requests(rng: random.Random) -> tuple[str, Any, int]:
    kind = rng.randrange(10)
    if kind == 0:
        return "bad_json", b'{"prompt": [1, 2', 400
    if kind == 1:
        return "bad_utf8", b'{"prompt": "w7 \xff\xfe", "max_tokens": 2}', 400
    if kind == 2:
        return "deep_json", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400
    if kind == 3:
        return "wrong_type", {"prompt": [1, 2], "max_tokens": "many"}, 422
    if kind == 4:
        return "unknown_field", {"prompt": [1, 2], "bogus": True}, 422
    if kind == 5:
        return "body_too_large", {"prompt": "w9 " * (BODY_LIMIT // 3 + 10)}, 413
    if kind == 6:
        return "ids_too_long", {"prompt": [1] * 600, "max_tokens": 4}, 400
    if kind == 7:
        return "text_too_long", {"prompt": "w9 " * 70_000, "max_tokens": 4}, 400
    if kind == 8:
        return "unknown_model", {"model": "gpt-4", "prompt": [1, 2]}, 404
    return "bad_value", {"prompt": [1, 2], "temperature": -1}, 422


class Load:
    def __init__(self, url: str, clients: int, drop_share: float, bad_share: float, seed: int):
        self.url, self.clients = url, clients
        self.drop_share, self.bad_share = drop_share, bad_share
        self.rng = random.Random(seed)
        self.go = asyncio.Event()
        self.go.set()
        self.idle = 0                      # clients waiting at the gate
        self.stop = False
        self.reset()
        self.failures: list[str] = []

    def reset(self) -> None:
        self.lat: list[float] = []
        self.ttft: list[float] = []
        self.counts: dict[str, int] = {}

    def count(self, k: str) -> None:
        self.counts[k] = self.counts.get(k, 0) + 1

    def fail(self, what: str) -> None:
        self.count("errors")
        if len(self.failures) < 50:
            self.failures.append(what)

    async def client(self, i: int, c: Any) -> None:
        rng = random.Random(self.rng.random())
        while not self.stop:
            if not self.go.is_set():
                self.idle += 1
                await self.go.wait()
                self.idle -= 1
                continue
            x = rng.random()
            try:
                if x < self.bad_share:
                    await self.bad(c, rng)
                elif x < self.bad_share + self.drop_share:
                    await self.stream(c, rng, drop=True)
                elif x < self.bad_share + self.drop_share + 0.03:
                    await self.dropped_plain(c, rng)
                elif x < 0.6:
                    await self.stream(c, rng, drop=False)
                else:
                    await self.plain(c, rng)
            except Exception as e:  # noqa: BLE001
                self.fail(f"client {i}: {type(e).__name__}: {e}")

    def _body(self, rng: random.Random, stream: bool) -> tuple[str, dict]:
        n = rng.randint(4, 40)
        common = {"max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.7, 1.0]),
                  "stream": stream}
        if rng.random() < 0.25:
            msgs = [{"role": "user", "content": " ".join(f"w{rng.randint(7, 511)}"
                                                         for _ in range(n))}]
            return "/v1/chat/completions", {"messages": msgs, **common}
        shared = [1] + list(range(100, 115))          # a 16-token shared prefix
        if rng.random() < 0.5:
            return "/v1/completions", {"prompt": shared + [rng.randint(3, 511) for _ in range(n)],
                                       **common}
        return "/v1/completions", {"prompt": " ".join(f"w{rng.randint(7, 511)}"
                                                      for _ in range(n)), **common}

    async def stream(self, c: Any, rng: random.Random, drop: bool) -> None:
        path, body = self._body(rng, True)
        t0 = time.perf_counter()
        first, done, events = None, False, 0
        keep = rng.randint(1, 3)
        async with c.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self.fail(f"stream {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if first is None:
                    first = time.perf_counter() - t0
                if line == "data: [DONE]":
                    done = True
                elif '"error"' in line[:20]:
                    return self.fail(f"stream error event: {line[:200]}")
                if drop and events >= keep:
                    break
        if drop:
            return self.count("dropped_streams")
        if not done:
            return self.fail("stream ended without [DONE]")
        self.count("streams")
        self.ttft.append(first)
        self.lat.append(time.perf_counter() - t0)

    async def plain(self, c: Any, rng: random.Random) -> None:
        path, body = self._body(rng, False)
        t0 = time.perf_counter()
        r = await c.post(path, json=body)
        if r.status_code != 200:
            return self.fail(f"{path} {r.status_code}: {r.text[:200]}")
        ch = r.json()["choices"][0]
        if ch["finish_reason"] not in ("stop", "length"):
            return self.fail(f"finish_reason {ch['finish_reason']}")
        self.count("plain")
        self.lat.append(time.perf_counter() - t0)

    async def dropped_plain(self, c: Any, rng: random.Random) -> None:
        import httpx

        # 104 tokens: 13 of the 20 device pages (a request that can never fit would be refused
        # before it runs, and its drop would test nothing).
        body = {"prompt": [1, 7, 8, 9], "max_tokens": 100, "temperature": 0}
        try:
            r = await c.post("/v1/completions", json=body, timeout=rng.uniform(0.02, 0.2))
        except httpx.TimeoutException:
            return self.count("dropped_plain")
        if r.status_code != 200:
            return self.fail(f"dropped_plain {r.status_code}: {r.text[:200]}")
        self.count("plain")

    async def bad(self, c: Any, rng: random.Random) -> None:
        name, body, want = bad_requests(rng)
        path = "/v1/completions"
        if isinstance(body, bytes):
            r = await c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await c.post(path, json=body)
        try:
            err = r.json()["error"]
            shape = set(err) == {"message", "type", "param", "code"} and err["message"]
        except Exception:  # noqa: BLE001
            shape = False
        if r.status_code != want or not shape:
            return self.fail(f"bad request {name}: {r.status_code} {r.text[:200]}")
        self.count("bad")


async def soak(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    import httpx

    load = Load(url, args.clients, args.drop_share, args.bad_share, args.seed)
    rows: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=180, limits=limits) as c, \
            httpx.AsyncClient(base_url=url, timeout=60) as probe:

        async def idle_metrics() -> dict[str, float]:
            t0 = time.monotonic()
            while True:
                m = parse_metrics((await probe.get("/metrics")).text)
                if (m["kvcm_requests_running"] == 0 and m["kvcm_requests_queued"] == 0
                        and m["kvcm_requests_suspended"] == 0):
                    return m
                if time.monotonic() - t0 > 60:
                    load.fail("not idle 60 s after the load paused")
                    return m
                await asyncio.sleep(0.05)

        tasks = [asyncio.ensure_future(load.client(i, c)) for i in range(args.clients)]
        t_start = time.monotonic()
        end = t_start + args.minutes * 60
        k = 0
        while True:
            k += 1
            await asyncio.sleep(max(0.0, min(t_start + k * args.sample_s, end)
                                    - time.monotonic()))
            load.go.clear()
            while load.idle < args.clients:
                await asyncio.sleep(0.01)
            m = await idle_metrics()
            lat, ttft = np.array(load.lat or [np.nan]), np.array(load.ttft or [np.nan])
            rows.append({
                "elapsed_min": round((time.monotonic() - t_start) / 60, 2),
                "requests": sum(load.counts.get(x, 0) for x in
                                ("streams", "plain", "dropped_streams", "dropped_plain", "bad")),
                "streams_ok": load.counts.get("streams", 0),
                "plain_ok": load.counts.get("plain", 0),
                "dropped_streams": load.counts.get("dropped_streams", 0),
                "dropped_plain": load.counts.get("dropped_plain", 0),
                "bad_requests": load.counts.get("bad", 0),
                "errors": load.counts.get("errors", 0),
                "latency_p50_s": round(float(np.percentile(lat, 50)), 4),
                "latency_p99_s": round(float(np.percentile(lat, 99)), 4),
                "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4),
                "idle_device_pages_referenced":
                    int(m['kvcm_pages{state="referenced",tier="device"}']),
                "idle_host_pages_referenced": int(m.get('kvcm_pages{state="referenced",'
                                                        'tier="host"}', 0)),
                "device_pages_cached": int(m['kvcm_pages{state="cached",tier="device"}']),
                "rss_mb": round(rss_mb(pid), 1),
                "cancelled_total": int(m['kvcm_requests_finished_total{reason="cancelled"}']),
                "rejected_total": int(sum(v for key, v in m.items()
                                          if key.startswith("kvcm_requests_rejected_total"))),
            })
            print(_fmt_row(rows[-1]), flush=True)
            load.reset()
            if time.monotonic() >= end:
                break
            load.go.set()
        load.stop = True
        load.go.set()
        await asyncio.gather(*tasks)
        final = parse_metrics((await probe.get("/metrics")).text)
    return {"rows": rows, "failures": load.failures, "final_metrics": {
        k: v for k, v in final.items() if k.startswith(("kvcm_requests_rejected_total",
                                                         "kvcm_requests_finished_total"))}}


COLS = [("elapsed_min", "min", "{:>5.1f}"), ("requests", "reqs", "{:>6d}"),
        ("dropped_streams", "drop", "{:>5d}"), ("bad_requests", "bad", "{:>5d}"),
        ("errors", "err", "{:>4d}"), ("latency_p50_s", "p50 s", "{:>7.3f}"),
        ("latency_p99_s", "p99 s", "{:>7.3f}"), ("ttft_p99_s", "ttft99", "{:>7.3f}"),
        ("idle_device_pages_referenced", "idle pg", "{:>7d}"), ("rss_mb", "RSS MB", "{:>8.1f}")]


def _fmt_row(r: dict) -> str:
    return "  ".join(f.format(r[k]) for k, _, f in COLS)


def _header() -> str:
    return "  ".join(f"{h:>{len(f.format(0))}}" for _, h, f in COLS)


def verdict(res: dict, rss_growth_mb: float) -> dict[str, Any]:
    rows = res["rows"]
    base = next((r for r in rows if r["elapsed_min"] >= rows[-1]["elapsed_min"] / 3), rows[0])
    growth = rows[-1]["rss_mb"] - base["rss_mb"]
    lat = [r["latency_p99_s"] for r in rows if r["latency_p99_s"] == r["latency_p99_s"]]
    out = {
        "minutes": rows[-1]["elapsed_min"],
        "requests": sum(r["requests"] for r in rows),
        "dropped_streams": sum(r["dropped_streams"] for r in rows),
        "dropped_plain": sum(r["dropped_plain"] for r in rows),
        "bad_requests": sum(r["bad_requests"] for r in rows),
        "errors": sum(r["errors"] for r in rows),
        "max_latency_p99_s": max(lat) if lat else None,
        "max_idle_pages_referenced": max(r["idle_device_pages_referenced"]
                                         + r["idle_host_pages_referenced"] for r in rows),
        "rss_first_mb": rows[0]["rss_mb"], "rss_base_mb": base["rss_mb"],
        "rss_last_mb": rows[-1]["rss_mb"], "rss_growth_after_warmup_mb": round(growth, 1),
    }
    out["ok"] = (out["errors"] == 0 and out["max_idle_pages_referenced"] == 0
                 and growth <= rss_growth_mb)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_soak_http", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="length (default: 30)")
    p.add_argument("--sample-s", type=float, default=60.0,
                   help="seconds between samples (default: 60)")
    p.add_argument("--clients", type=int, default=8, help="client loops (default: 8)")
    p.add_argument("--drop-share", type=float, default=0.15,
                   help="share of requests that are streams dropped mid-way (default: 0.15)")
    p.add_argument("--bad-share", type=float, default=0.12,
                   help="share of requests that are bad requests (default: 0.12)")
    p.add_argument("--rss-growth-mb", type=float, default=64.0,
                   help="allowed RSS growth after the first third (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="the load's random choices")
    p.add_argument("--log", metavar="PATH", default=None,
                   help="the server's log (default: a temporary file)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.minutes <= 0 or args.sample_s <= 0 or args.clients < 1:
        build_parser().error("--minutes, --sample-s must be > 0 and --clients >= 1")
    import tempfile

    log = Path(args.log) if args.log else Path(tempfile.mkdtemp()) / "soak_server.log"
    port = _free_port()
    proc = start_server(port, log, [])
    print(f"server pid {proc.pid} on 127.0.0.1:{port}, log {log}; {args.minutes:g} min, "
          f"{args.clients} clients", flush=True)
    print(_header(), flush=True)
    try:
        res = asyncio.run(soak(args, f"http://127.0.0.1:{port}", proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    res["summary"] = v = verdict(res, args.rss_growth_mb)
    v["server_exit_status"] = rc
    v["ok"] = v["ok"] and rc == 0 and "Traceback" not in log.read_text()
    print(json.dumps(v, indent=1))
    for f in res["failures"][:10]:
        print("FAILURE:", f)
    if args.json:
        out = {"benchmark": "bench_soak_http", "kind": "soak_http",
               "command": "python -m benchmarks.bench_soak_http " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "config": vars(args), **res}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if v["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
