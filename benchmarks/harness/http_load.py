"""Load generator of benchmarks/bench_serve_http.py, run as its own process (so that the clients
do not share the server's interpreter): every request opened at once as one streaming
``/v1/completions``; token arrival times recorded per request.

    python -m benchmarks.harness.http_load URL IN.json OUT.json

IN: ``{"prompts": [[ids], ...], "max_tokens": N, "start_at": T}`` (sending starts at
``time.perf_counter() == T``, so that several client processes start together); OUT: ``{"t0":
[...], "times": [[...], ...], "tokens": [[...], ...]}`` (``time.perf_counter`` seconds, which
on Linux is one clock for all processes) or ``{"error": message}``. Imports only httpx (no jax).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx


async def _one(c: httpx.AsyncClient, body: dict, i: int, out: dict) -> None:
    out["t0"][i] = time.perf_counter()
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request {i}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0]["token_ids"]
            now = time.perf_counter()
            out["tokens"][i] += ids
            out["times"][i] += [now] * len(ids)


async def run(url: str, prompts: list[list[int]], max_tokens: int, start_at: float) -> dict:
    n = len(prompts)
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    out = {"t0": [0.0] * n, "times": [[] for _ in range(n)], "tokens": [[] for _ in range(n)]}
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as c:
        await asyncio.gather(*(_one(c, {"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                        "stream": True}, i, out) for i, p in enumerate(prompts)))
    return out


def main() -> int:
    url, src, dst = sys.argv[1:4]
    spec = json.loads(open(src).read())
    try:
        out = asyncio.run(run(url, spec["prompts"], spec["max_tokens"],
                              spec.get("start_at", 0.0)))
    except Exception as e:  # noqa: BLE001  (reported to the benchmark)
        out = {"error": f"{type(e).__name__}: {e}"}
    with open(dst, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
