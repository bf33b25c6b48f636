"""The OpenAI-compatible HTTP server (examples/llama/server.py) as a subprocess on 127.0.0.1,
driven by the official ``openai`` client and by ``httpx``.

One server per module on the built-in random Llama (20 device pages of 8 tokens, a host tier:
concurrent requests run under pressure), plus one for the SIGTERM test (with a disk tier). Oracles:
HF transformers (greedy, token for token, on the same checkpoint the server writes) and the CLI
runner (``examples/llama/run.py``) on the same prompts.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jax_kvcm  # noqa: F401  (the installed package first; the repo root goes on sys.path after)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.llama import run as llama_run  # noqa: E402

pytestmark = pytest.mark.slow  # seconds to minutes: `pytest -m "not gpu and not slow"` skips it

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EOS = 2
STARTUP_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m examples.llama.server`` on a free port of 127.0.0.1, logs in ``log``.

    The port is free when chosen but may be taken before the server binds it (another test's
    server, or the local end of a client connection: ephemeral ports share the range); then
    the server exits with "address already in use" and is started again on another port."""

    BIND_ATTEMPTS = 3

    def __init__(self, tmp: Path, *args: str):
        self.tmpdir = tmp / "tmpdir"
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        self.log = tmp / "server.log"
        for attempt in range(self.BIND_ATTEMPTS):
            if self._start(args, last=attempt == self.BIND_ATTEMPTS - 1):
                return

    def _start(self, args: tuple[str, ...], last: bool) -> bool:
        """Starts the server and waits for /health; False when its port was taken."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(self.tmpdir))
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "examples.llama.server", "--host", "127.0.0.1", "--port",
             str(self.port), *args], cwd=ROOT, env=env, stdout=self._log_file,
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_S
        while True:
            if self.proc.poll() is not None:
                logs = self.logs()
                if "address already in use" in logs and not last:
                    self._log_file.close()
                    return False
                pytest.fail(f"server exited with {self.proc.returncode}:\n{logs}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"server not up after {STARTUP_S}s:\n{self.logs()}")
            time.sleep(0.3)
        return True

    def logs(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text()[-4000:]

    def metrics(self) -> dict[str, float]:
        """``{'name{labels}': value}`` from /metrics (labels sorted as the server prints)."""
        r = httpx.get(self.url + "/metrics", timeout=30)
        assert r.status_code == 200, r.text
        out = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds a device page."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["kvcm_requests_running"] == 0 and m["kvcm_requests_queued"] == 0
                    and m["kvcm_requests_suspended"] == 0
                    and m['kvcm_pages{state="referenced",tier="device"}'] == 0):
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"server not idle after {timeout}s: "
                            f"{ {k: v for k, v in m.items() if 'requests' in k or 'pages' in k} }")
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("server"), "--max-queue", "56")
    yield s
    rc = s.stop()
    assert rc == 0, s.logs()


@pytest.fixture(scope="module")
def srv_long(tmp_path_factory):
    """Long requests (4,096 tokens) and a disk tier; the last test SIGTERMs it."""
    tmp = tmp_path_factory.mktemp("server_long")
    s = ServerProcess(tmp, "--max-seq-len", "4096", "--device-pages", "600", "--disk-dir",
                      str(tmp / "disk"), "--disk-bytes", str(1 << 20), "--shutdown-timeout", "2")
    s.disk = tmp / "disk"
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """HF LlamaForCausalLM on the checkpoint the server serves (the runner's built-in one)."""
    path = llama_run.write_default_checkpoint(tmp_path_factory.mktemp("ckpt"))
    model = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                                          attn_implementation="eager")
    return model.eval()


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=EOS)
    return out[0, len(prompt):].tolist()


def _check_greedy(hf, prompt: list[int], got: list[int], n: int, what: str) -> None:
    """``got`` is HF's greedy continuation (one teacher-forced forward: each token must be the
    argmax at the position before it; ``n`` tokens or fewer ending in EOS)."""
    assert len(got) == n or (got and got[-1] == EOS), f"{what}: stopped early: {got}"
    assert EOS not in got[:-1], f"{what}: ran past EOS: {got}"
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + got]), use_cache=False).logits[0].numpy()
    want = logits[len(prompt) - 1:len(prompt) - 1 + len(got)].argmax(-1).tolist()
    assert got == want, f"{what}: {got} != HF greedy {want}"


def _ids(choice) -> list[int]:
    return list((choice.model_extra or {})["token_ids"])


# ---------------------------------------------------------------------------------------------



def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch):
    """The harness itself: the port it chose is taken before the server binds it (here held by
    the test); the server exits with "address already in use" and starts on another port."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    ports = iter([taken, _free_port()])
    monkeypatch.setattr(sys.modules[__name__], "_free_port", lambda: next(ports))
    try:
        s = ServerProcess(tmp_path)
        assert s.port != taken
        assert s.stop() == 0, s.logs()
    finally:
        held.close()

def test_models_and_health(srv, client):
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    (m,) = client.models.list().data
    assert m.id == "kvcm-random-llama"


def test_greedy_completion_matches_cli_and_transformers(srv, client, hf):
    rng = np.random.default_rng(11)
    prompts = [[1] + rng.integers(3, 512, n).tolist() for n in (5, 17)]
    n = 12
    got = []
    for p in prompts:
        r = client.completions.create(model="kvcm-random-llama", prompt=p, max_tokens=n,
                                      temperature=0)
        (c,) = r.choices
        got.append(_ids(c))
        assert c.finish_reason == ("stop" if got[-1][-1] == EOS else "length")
        assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == len(got[-1])
    for p, g in zip(prompts, got):
        assert g == _hf_greedy(hf, p, n), (p, g)
    assert len({t for g in got for t in g}) > 4, f"degenerate generations {got}"
    cli = subprocess.run([sys.executable, str(ROOT / "examples/llama/run.py"), "--json",
                          "--max-new-tokens", str(n)]
                         + [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr[-3000:]
    lines = [json.loads(x) for x in cli.stdout.splitlines()[:len(prompts)]]
    assert [d["generated_ids"] for d in lines] == got


@pytest.mark.parametrize("args, needle", [
    (["--max-batch", "9", "--max-tokens-per-step", "4"], "argument --max-tokens-per-step"),
    (["--port", "70000"], "argument --port"),
    (["--host-bytes", "4 lots"], "argument --host-bytes"),
    (["--model", "/nonexistent/ckpt"], "argument --model")])
def test_bad_flags_fail_before_loading(args, needle):
    """The runner's flags and checks (shared through run.add_engine_args/check_engine_args), in
    the runner's error style: ``server.py: error: argument ...``, exit status 2, no traceback."""
    r = subprocess.run([sys.executable, "-m", "examples.llama.server", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"server.py: error: {needle}" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_readme_client_block(srv, client, capsys):
    """The README's openai-client block runs as written against a server (its port changed):
    tests/repo/test_readme.py leaves the server's client blocks to this test."""
    readme = (ROOT / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                if "http://127.0.0.1:8000" in b]
    exec(compile(block.replace("127.0.0.1:8000", f"127.0.0.1:{srv.port}"), "README.md", "exec"),
         {"__name__": "readme_client_block"})  # noqa: S102 - the README's own code
    first = capsys.readouterr().out.splitlines()[0]
    r = client.completions.create(model="kvcm-random-llama", prompt="w12 w99 w7", max_tokens=8,
                                  temperature=0)
    assert first == f"{r.choices[0].text} {_ids(r.choices[0])}", first


def test_text_prompt_stream_and_stop(srv, client, hf):
    # The built-in tokenizer: words w<id>, <s> first.
    r = client.completions.create(model="kvcm-random-llama", prompt="w15 w9 w11 w300",
                                  max_tokens=8, temperature=0)
    (c,) = r.choices
    ids = _ids(c)
    assert r.usage.prompt_tokens == 5
    assert ids == _hf_greedy(hf, [1, 15, 9, 11, 300], 8)
    words = [f"w{t}" for t in ids if t > 6]
    assert c.text.split() == words
    # Streaming: one token per chunk, the same tokens and text.
    chunks = list(client.completions.create(model="kvcm-random-llama", prompt="w15 w9 w11 w300",
                                            max_tokens=8, temperature=0, stream=True))
    tok_chunks = [_ids(ch.choices[0]) for ch in chunks if _ids(ch.choices[0])]
    assert all(len(t) == 1 for t in tok_chunks), tok_chunks
    assert sum(tok_chunks, []) == ids
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert chunks[-1].choices[0].finish_reason == c.finish_reason
    # A stop string: the text ends before it, finish_reason "stop", the request is cancelled.
    stop_word = words[3]
    # Long enough (no EOS in HF's greedy tokens) that the request cannot end by itself before
    # the cancel reaches the engine.
    long = _hf_greedy(hf, [1, 15, 9, 11, 300], 120)
    n_long = long.index(EOS) if EOS in long else len(long)
    assert n_long > 40, long
    before = srv.metrics()['kvcm_requests_finished_total{reason="cancelled"}']
    r = client.completions.create(model="kvcm-random-llama", prompt="w15 w9 w11 w300",
                                  max_tokens=n_long, temperature=0, stop=[stop_word, "never"])
    (c2,) = r.choices
    assert c2.finish_reason == "stop" and stop_word not in c2.text
    assert c2.text.split() == words[:3]
    m = srv.wait_idle()
    assert m['kvcm_requests_finished_total{reason="cancelled"}'] == before + 1


def test_chat_completion(srv, client, hf):
    msgs = [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "w8 w9"}]
    r = client.chat.completions.create(model="kvcm-random-llama", messages=msgs, max_tokens=6,
                                       temperature=0)
    (c,) = r.choices
    # "<s>system : w40 w41 </s> user : w8 w9 </s> assistant :"
    prompt = [1, 3, 6, 40, 41, 2, 4, 6, 8, 9, 2, 5, 6]
    assert r.usage.prompt_tokens == len(prompt)
    ids = _ids(c)
    assert ids == _hf_greedy(hf, prompt, 6)
    assert c.message.role == "assistant"
    assert c.message.content.split() == [f"w{t}" for t in ids if t > 6]
    chunks = list(client.chat.completions.create(model="kvcm-random-llama", messages=msgs,
                                                 max_tokens=6, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content


def test_64_concurrent_streaming_clients(srv, hf):
    rng = np.random.default_rng(5)
    system = [1] + rng.integers(3, 512, 15).tolist()      # a shared 16-token prefix (2 pages)
    prompts = [system + rng.integers(3, 512, int(rng.integers(1, 12))).tolist()
               for _ in range(64)]
    n = 8

    async def one(c, p):
        ids, finish = [], None
        stream = await c.completions.create(model="kvcm-random-llama", prompt=p, max_tokens=n,
                                            temperature=0, stream=True)
        async for ch in stream:
            t = _ids(ch.choices[0])
            assert len(t) <= 1, f"a chunk with {len(t)} tokens"
            ids += t
            finish = ch.choices[0].finish_reason or finish
        return ids, finish

    async def main():
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=300, http_client=httpx.AsyncClient(
                                   limits=httpx.Limits(max_connections=100), timeout=300))
        try:
            return await asyncio.gather(*(one(c, p) for p in prompts))
        finally:
            await c.close()

    before = srv.metrics()
    results = asyncio.run(main())
    for i, (p, (ids, finish)) in enumerate(zip(prompts, results)):
        _check_greedy(hf, p, ids, n, f"client {i}")
        assert finish == ("stop" if ids[-1] == EOS else "length")
    m = srv.wait_idle()
    assert m['kvcm_requests_finished_total{reason="length"}'] + m[
        'kvcm_requests_finished_total{reason="eos"}'] - before[
        'kvcm_requests_finished_total{reason="length"}'] - before[
        'kvcm_requests_finished_total{reason="eos"}'] == 64
    assert m["kvcm_prefix_hit_tokens_total"] > before["kvcm_prefix_hit_tokens_total"]
    # Under pressure: 64 prompts of 3-4 pages through a 20-page device push cached pages to host
    # (running sequences may also be suspended, depending on timing).
    off = 'kvcm_pages_offloaded_total{tier="host"}'
    assert m[off] > before[off]
    print("suspends", m["kvcm_suspends_total"] - before["kvcm_suspends_total"], "offloaded",
          m[off] - before[off])


def test_disconnect_mid_stream_frees_pages(srv_long):
    srv = srv_long
    before = srv.metrics()['kvcm_requests_finished_total{reason="cancelled"}']
    body = {"prompt": [1, 7, 8, 9, 10], "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()     # NOTE: kept alive (closing it closes the response)
            events = 0
            while events < 3:
                events += next(lines).startswith("data: ")
            m = srv.metrics()
            assert m["kvcm_requests_running"] == 1
            assert m['kvcm_pages{state="referenced",tier="device"}'] >= 1
    # The client is gone: the sequence is closed within a step, its pages freed or cached.
    m = srv.wait_idle(timeout=30)
    assert m['kvcm_requests_finished_total{reason="cancelled"}'] == before + 1
    steps = m["kvcm_steps_total"]
    time.sleep(0.5)
    assert srv.metrics()["kvcm_steps_total"] == steps       # nothing runs on for the lost client


def test_bad_requests(srv, client):
    url = srv.url + "/v1/completions"

    def post(body, **kw):
        return httpx.post(url, json=body, timeout=60, **kw)

    def err(r, status, *needles):
        assert r.status_code == status, (r.status_code, r.text)
        msg = r.json()["error"]["message"]
        for n in needles:
            assert n in msg, (n, msg)

    err(httpx.post(url, content=b'{"prompt": [1, 2', timeout=60,
                   headers={"content-type": "application/json"}), 400, "JSON")
    err(post({"prompt": [1, 2], "bogus": 1}), 422, "bogus")
    err(post({"prompt": [1, 2], "temperature": -1}), 422, "temperature")
    err(post({"prompt": [1, 2], "top_p": 0}), 422, "top_p")
    err(post({"prompt": [1, 2], "n": 2}), 422, "n")
    err(post({"prompt": [1, 2], "max_tokens": 0}), 422, "max_tokens")
    err(post({"max_tokens": 3}), 422, "prompt")
    err(post([1, 2, 3]), 422)
    err(post({"prompt": [1, 2], "logprobs": 2}), 400, "logprobs")
    err(post({"prompt": [[1, 2], [3, 4]]}), 400, "one prompt")
    err(post({"prompt": []}), 400, "empty")
    err(post({"prompt": [1, 600]}), 400, "out of range")
    err(post({"prompt": [1, 2], "model": "gpt-4"}), 404, "gpt-4")
    err(post({"prompt": [1] * 500, "max_tokens": 20}), 400, "max_seq_len 512")
    err(post({"prompt": [1] * 100, "max_tokens": 100}), 400, "20 device pages")
    err(post({"prompt": [1, 2], "stop": ["a", "b", "c", "d", "e"]}), 400, "stop")
    err(httpx.post(srv.url + "/v1/chat/completions", json={"messages": []}, timeout=60), 422,
        "messages")
    err(httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "robot", "content": "hi"}]}), 422, "role")
    with pytest.raises(openai.BadRequestError, match="max_seq_len"):
        client.completions.create(model="kvcm-random-llama", prompt=[1] * 510, max_tokens=5)
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="kvcm-random-llama", prompt=[1, 2], temperature=3)
    # Still serving.
    r = client.completions.create(model="kvcm-random-llama", prompt=[1, 2, 3], max_tokens=2,
                                  temperature=0)
    assert len(_ids(r.choices[0])) == 2
    assert httpx.get(srv.url + "/health").status_code == 200


def test_overload_gets_429(srv):
    """64 may be open (8 running + 56 queued): with 64 long streams open, more get 429 with
    Retry-After (as many as there are extra requests, less any stream that finished meanwhile:
    the 154-token requests fill the 20-page device alone, so one runs at a time)."""
    # Greedy, this prompt runs the full 150 tokens (no EOS) on the built-in model.
    body = {"prompt": [1, 7, 8, 9], "max_tokens": 150, "temperature": 0, "stream": True}
    extra = 12
    fin = 'kvcm_requests_finished_total{reason="length"}'

    async def main():
        statuses: dict[int, int] = {}
        retry_after: dict[int, str | None] = {}
        opened, done = asyncio.Event(), asyncio.Event()

        async def one(c, i):
            async with c.stream("POST", "/v1/completions", json=body) as r:
                statuses[i] = r.status_code
                retry_after[i] = r.headers.get("retry-after")
                if len(statuses) == 64:
                    opened.set()
                await asyncio.wait_for(done.wait(), 120)
            # leaving the block closes the connection: accepted requests are cancelled

        limits = httpx.Limits(max_connections=64 + extra + 4)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as c:
            first = [asyncio.ensure_future(one(c, i)) for i in range(64)]
            await asyncio.wait_for(opened.wait(), 120)
            finished_before = await asyncio.to_thread(lambda: srv.metrics()[fin])
            more = [asyncio.ensure_future(one(c, 64 + i)) for i in range(extra)]
            while len(statuses) < 64 + extra:
                await asyncio.sleep(0.02)
            finished = await asyncio.to_thread(lambda: srv.metrics()[fin]) - finished_before
            done.set()
            await asyncio.gather(*first, *more)
        return statuses, retry_after, finished

    before = srv.metrics()
    statuses, retry_after, finished = asyncio.run(main())
    assert all(statuses[i] == 200 for i in range(64)), statuses
    late = [statuses[64 + i] for i in range(extra)]
    assert set(late) <= {200, 429}, late
    n429 = late.count(429)
    assert n429 >= 1 and n429 + finished >= extra, (late, finished)
    assert all(retry_after[i] == "1" for i, s in statuses.items() if s == 429)
    m = srv.wait_idle()
    assert m['kvcm_requests_rejected_total{reason="queue_full"}'] - before.get(
        'kvcm_requests_rejected_total{reason="queue_full"}', 0) == n429
    assert m['kvcm_requests_finished_total{reason="cancelled"}'] > before[
        'kvcm_requests_finished_total{reason="cancelled"}']


def _open_files_under(pid: int, directory: Path) -> list[str]:
    """The files under ``directory`` (unlinked ones too) that process ``pid`` has open."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:          # closed meanwhile
            continue
        if target.startswith(str(directory.resolve()) + "/"):
            out.append(target)
    return out


def test_sigterm_shuts_down_cleanly(srv_long):
    s, disk = srv_long, srv_long.disk
    try:
        # The disk tier's file is unlinked at creation: it lives as the server's descriptor.
        assert _open_files_under(s.proc.pid, disk), "the disk tier has no file while serving"
        assert any(s.tmpdir.iterdir()), "the built-in checkpoint is not in TMPDIR"
        body = {"prompt": [1, 7, 8, 9], "max_tokens": 4000, "temperature": 0, "stream": True}
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                while not next(lines).startswith("data: "):
                    pass
                s.proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                rest = [ln for ln in lines if ln.startswith("data: ")]   # the stream ends
        # Cancelled by the engine before uvicorn's own timeout: a last chunk, then [DONE].
        assert time.monotonic() - t0 < 30, "the stream outlived the shutdown timeout"
        assert rest[-1] == "data: [DONE]", rest[-3:]
        last = json.loads(rest[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "abort", last
        rc = s.proc.wait(60)
    finally:
        s.stop()
    assert rc == 0, s.logs()
    assert not list(disk.iterdir()), f"left behind: {list(disk.iterdir())}"
    assert not list(s.tmpdir.iterdir()), f"left behind: {list(s.tmpdir.iterdir())}"
    assert "Traceback" not in s.logs(), s.logs()


def test_http_benchmark_tiny(tmp_path):
    """python -m benchmarks.bench_serve_http --tiny: the same greedy tokens through HTTP as in
    process."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_serve_http", "--tiny",
                        "--requests", "16", "--json", str(out)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["identical_generations"] == 1.0 and res["http_all_complete"]
    assert [x["path"] for x in res["results"]] == ["in-process", "http"]
    assert all(x["generated_tokens"] == 16 * 16 for x in res["results"])
    assert res["http_over_in_process"] > 0


def test_in_process_app_without_tokenizer_and_engine_failure(tmp_path):
    """``create_app`` under uvicorn in a thread, on a checkpoint without a tokenizer: text, chat
    and stop strings are refused with 400 and token ids work; then a step that raises (a fault
    injected into this server instance) fails the running request with 500 and the server
    reports itself unhealthy instead of dying."""
    import threading

    import uvicorn

    from examples.llama import loader, serve
    from examples.llama.server import create_app

    path = llama_run.write_default_checkpoint(tmp_path)
    config, params, tok = loader.load_checkpoint(path, progress=False)
    assert tok is None
    server = serve.Server(params, config, serve.ServeConfig(page_size=8, device_pages=32,
                                                            max_batch=4, max_seq_len=128))
    app = create_app(server, model_name="m")
    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not uv.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"

        def post(path, body):
            return httpx.post(url + path, json=body, timeout=60)

        r = post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        r = post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stop": "x"})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        r = post("/v1/completions", {"prompt": [1, 7, 8], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        (c,) = r.json()["choices"]
        assert c["text"] == "" and len(c["token_ids"]) == 3

        def broken_step():
            raise RuntimeError("injected step failure")

        server.step = broken_step          # NOTE: this instance only (a test seam)
        r = post("/v1/completions", {"prompt": [1, 7, 8], "max_tokens": 3})
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"], r.text
        h = httpx.get(url + "/health", timeout=10)
        assert h.status_code == 503 and "injected" in h.json()["error"]["message"]
        r = post("/v1/completions", {"prompt": [1, 7, 8], "max_tokens": 3})
        assert r.status_code == 503, r.text
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
    finally:
        uv.should_exit = True
        thread.join(60)
    assert not thread.is_alive()
