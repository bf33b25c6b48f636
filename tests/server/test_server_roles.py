"""Disaggregated prefill between two HTTP servers (issue 37): ``python -m examples.llama.server
--role prefill`` computes prompts, ``--role decode --prefill-url ...`` pulls their K/V
(examples/llama/_http_roles.py) and generates.

Servers are subprocesses on 127.0.0.1 (free ports) serving the built-in random Llama. Oracles: a
single ``--role both`` server on the same prompts (greedy: token for token), an in-process
:class:`serve.Server` (the scheduler's ``submit_prefilled`` seam), each server's ``/metrics``
(handoff outcomes, referenced pages) and OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_server import ROOT, ServerProcess, _free_port

pytestmark = pytest.mark.slow  # three server processes: seconds

httpx = pytest.importorskip("httpx")

H = 'kvcm_handoffs_total{outcome="%s"}'
REFERENCED = 'kvcm_pages{state="referenced",tier="device"}'
CACHED = 'kvcm_pages{state="cached",tier="device"}'


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(37)
    shared = [1] + rng.integers(3, 512, 15).tolist()           # two full pages of 8
    return [[1, 7, 8], shared + rng.integers(3, 512, 5).tolist(),
            shared + rng.integers(3, 512, 14).tolist(), [1] + rng.integers(3, 512, 8).tolist()]


async def _complete(url: str, bodies: list[dict]) -> list[dict]:
    """The bodies posted at once to ``url`` (completions or chat, streamed or not): per body its
    ``token_ids`` and finish reason."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        return await asyncio.gather(*(_one(c, b) for b in bodies))


async def _one(c, body: dict) -> dict:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body.get("stream"):
        r = await c.post(path, json=body)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        return {"ids": choice["token_ids"], "finish": choice["finish_reason"]}
    ids, finish = [], None
    async with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                (choice,) = json.loads(line[6:])["choices"]
                ids += choice["token_ids"]
                finish = choice["finish_reason"] or finish
    return {"ids": ids, "finish": finish}


def _openai_error(r, status: int, *needles: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    for n in needles:
        assert n in err["message"], (n, err["message"])


def test_decode_server_tokens_equal_the_single_server(tmp_path):
    """Completions (concurrent, one past a page, two sharing a prefix), a streamed chat and a
    one-token request through prefill + decode servers: the single server's greedy tokens and
    finish reasons. Every handoff is imported (none refused or prefilled locally), each offer
    is forgotten, and both servers end with no referenced device page."""
    single = ServerProcess(tmp_path / "single")
    prefill = ServerProcess(tmp_path / "prefill", "--role", "prefill")
    decode = ServerProcess(tmp_path / "decode", "--role", "decode", "--prefill-url", prefill.url)
    try:
        bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in _prompts()]
        bodies += [{"messages": [{"role": "user", "content": "w7 w8 w9 w10"}], "max_tokens": 6,
                    "temperature": 0, "stream": True},
                   {"prompt": "w9 w10 w11", "max_tokens": 1, "temperature": 0}]
        want = asyncio.run(_complete(single.url, bodies))
        got = asyncio.run(_complete(decode.url, bodies))
        assert got == want
        assert all(len(w["ids"]) == b["max_tokens"] or w["finish"] == "stop"
                   for w, b in zip(want, bodies))
        m, pm = decode.wait_idle(), prefill.wait_idle()
        ended_at_prefill = sum(1 for w in want if len(w["ids"]) == 1)
        assert m[H % "finished_at_prefill"] == ended_at_prefill >= 1
        assert m[H % "imported"] == len(bodies) - ended_at_prefill
        assert m[H % "refused"] == m[H % "prefilled_locally"] == 0
        assert pm[H % "offered"] == pm[H % "forgotten"] == m[H % "imported"]
        assert pm[H % "expired"] == 0
        assert m[REFERENCED] == pm[REFERENCED] == 0
    finally:
        for s in (decode, prefill, single):
            assert s.stop() == 0, s.logs()


def test_refused_handoffs_leave_the_decode_server_clean(tmp_path):
    """A prefill server with another page size: its K/V is refused with 502 naming the mismatch
    and nothing is imported (no device page referenced or cached). The prefill server gone: 503
    naming it, with Retry-After. Either way the decode server stays healthy."""
    prefill = ServerProcess(tmp_path / "prefill16", "--role", "prefill", "--page-size", "16")
    decode = ServerProcess(tmp_path / "decode", "--role", "decode", "--prefill-url", prefill.url)
    try:
        body = {"prompt": _prompts()[2], "max_tokens": 4, "temperature": 0}
        r = httpx.post(decode.url + "/v1/completions", json=body, timeout=60)
        _openai_error(r, 502, "refused", "tokens_per_page", "16")
        m = decode.wait_idle()
        assert m[H % "refused"] == 1 and m[H % "imported"] == 0
        assert m[REFERENCED] == m[CACHED] == 0
        assert m['kvcm_requests_rejected_total{reason="handoff"}'] == 1
        assert prefill.metrics()[H % "forgotten"] == 1
        assert prefill.stop() == 0, prefill.logs()
        r = httpx.post(decode.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        _openai_error(r, 503, "prefill server", "unreachable")
        assert r.headers["retry-after"] == "1"
        assert httpx.get(decode.url + "/health", timeout=10).json() == {"status": "ok"}
        m = decode.wait_idle()
        assert m[REFERENCED] == m[CACHED] == 0 and m["kvcm_requests_running"] == 0
    finally:
        prefill.stop()
        assert decode.stop() == 0, decode.logs()


@pytest.mark.parametrize("args, needle", [
    (["--role", "decode"], "argument --role: decode needs --prefill-url"),
    (["--prefill-url", "http://127.0.0.1:1"], "argument --prefill-url: only with --role decode"),
    (["--role", "decode", "--prefill-url", "127.0.0.1:1"], "argument --prefill-url: an http"),
    (["--role", "prefill", "--host-bytes", "0"], "prefill needs a host tier")])
def test_role_flags_are_checked(args, needle):
    r = subprocess.run([sys.executable, "-m", "examples.llama.server", "--port",
                        str(_free_port()), *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_submit_prefilled_in_process(tmp_path):
    """The scheduler seam without HTTP: one-token requests with ``keep_sequence`` hand their
    open sequences over; exported and imported into a second Server (``Prefilled.admit``, the
    engine thread's code), they decode to the plain Server's greedy tokens. The third import
    finds no device room: it is prefilled locally instead, with the same tokens."""
    from prometheus_client import CollectorRegistry, Counter

    from examples.llama import _http_roles, loader, serve
    from examples.llama import run as llama_run

    path = llama_run.write_default_checkpoint(tmp_path)
    config, params, _ = loader.load_checkpoint(path, progress=False)
    cfg = serve.ServeConfig(page_size=8, device_pages=16, host_bytes=4 << 20, max_batch=4,
                            max_seq_len=64)
    prompts = _prompts()[1:4]                                  # 21, 30 and 9 tokens
    want = serve.Server(params, config, cfg).generate([serve.Request(p, 6) for p in prompts])
    prefill = serve.Server(params, config, cfg)
    outs = prefill.generate([serve.Request(p, 1, keep_sequence=True) for p in prompts])
    exports = []
    for o in outs:
        exports.append(prefill.manager.export_sequence(o.sequence, "m"))
        prefill.manager.close(o.sequence)
    assert prefill.manager.stats()["num_active"] == 0
    outcomes = Counter("h", "h", ["outcome"], registry=CollectorRegistry())
    decode = serve.Server(params, config, dataclasses.replace(cfg, device_pages=6))
    rids = [_http_roles.Prefilled(serve.Request(p, 6), e, o.generated_ids[0], "m",
                                  outcomes).admit(decode)
            for p, e, o in zip(prompts, exports, outs)]
    counts = {s.labels["outcome"]: s.value for s in outcomes.collect()[0].samples
              if s.name.endswith("_total")}
    assert counts == {"imported": 2, "prefilled_locally": 1}
    while decode.has_work():
        decode.step()
    got = [decode.pop_output(rid) for rid in rids]
    assert [g.generated_ids for g in got] == [w.generated_ids for w in want]
    assert decode.manager.stats()["num_active"] == 0
    with pytest.raises(ValueError, match="nothing left to decode"):
        decode.submit_prefilled(serve.Request(prompts[0], 1), None, 5)
