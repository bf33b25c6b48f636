"""An OpenAI-compatible HTTP server for the example Llama runner (FastAPI + uvicorn).

    python -m examples.llama.server                         # the built-in random Llama
    python -m examples.llama.server --model DIR --port 8000

Same model, tier, codec and batching flags as ``examples/llama/run.py``, plus ``--host`` (default
127.0.0.1), ``--port``, ``--max-queue``, ``--shutdown-timeout``, ``--served-model-name``. Without
``--model`` the built-in random Llama of the runner is served with a word-level tokenizer
(``<unk> <s> </s> system user assistant : w7 ... w511``) and a chat template, so text prompts and
chat work on it too.

Endpoints:

- ``POST /v1/completions``: ``prompt`` (text, or token ids; one prompt), ``max_tokens`` (16),
  ``temperature`` (1.0; 0 is greedy), ``top_p``, ``seed``, ``stop`` (up to 4 strings), ``n=1``,
  ``stream`` (server-sent events, one chunk per token, ``data: [DONE]`` last),
  ``stream_options.include_usage``. Each choice also carries ``token_ids``: the generated ids.
- ``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template
  (``tokenizer_config.json``); 400 when the model has none.
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

One engine thread owns the serving loop (:mod:`._http_engine`): handlers only queue requests and
read their token streams. A request ends within one step when its client disconnects or a stop
string appears (its sequence is closed: full pages stay cached, the rest are freed). At most
``max_batch + max_queue`` requests are open at once, beyond that ``429`` with ``Retry-After``; a
request that can never fit (``max_seq_len``, device pages) gets ``400`` naming the limit; bad JSON
400, bad fields or values 422 (OpenAI-style ``{"error": {"message": ...}}``). SIGTERM: no new
connections, running requests get ``--shutdown-timeout`` seconds to finish, the rest are
cancelled, the manager is shut down (disk files removed, host memory freed).

Sampling seeds: the engine's key for a request's ``i``-th token is ``fold_in(fold_in(key(seed),
request id), i)`` (``serve.py``), so one seed gives independent draws across requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import jax_kvcm  # noqa: F401  (the installed package before the repo root's source tree)
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from . import run, serve
from ._http_engine import ITL_BUCKETS, TTFT_BUCKETS, Engine, Handle
from ._http_text import ChatTemplate, Detokenizer, StopText, load_chat_template

__all__ = ["create_app", "main", "write_default_model", "DEFAULT_MODEL_NAME"]

log = logging.getLogger("examples.llama.server")

DEFAULT_MODEL_NAME = "kvcm-random-llama"
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
_FINISH = {"eos": "stop", "length": "length", "stop": "stop", "cancelled": "abort"}
# Fields clients send that this server does not implement: accepted only at their no-op values.
_UNSUPPORTED = {"echo": (False,), "logprobs": (None, False), "top_logprobs": (None,),
                "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
                "best_of": (None, 1), "logit_bias": (None, {}), "suffix": (None,)}


# ---------------------------------------------------------------------------------------------
# Request bodies.


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    echo: Any = False
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0
    best_of: Any = None
    logit_bias: Any = None
    suffix: Any = None


class CompletionBody(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


# ---------------------------------------------------------------------------------------------
# Errors.


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 422: "invalid_request_error",
            429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}}, status_code=status, headers=headers)


# ---------------------------------------------------------------------------------------------
# Metrics.


class _Metrics:
    """A Prometheus registry per app: latency histograms (observed by the engine's delivery),
    rejection counters, and the engine's snapshot (refreshed per scrape)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.ttft = Histogram("kvcm_time_to_first_token_seconds",
                              "Time from accepting a request to its first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("kvcm_inter_token_latency_seconds",
                             "Time between two consecutive tokens of one request",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.rejected = Counter("kvcm_requests_rejected",
                                "Requests refused before generation, by reason",
                                ["reason"], registry=self.registry)
        self.snap: dict[str, Any] | None = None
        self.registry.register(self)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.snap
        if s is None:
            return
        r = s["report"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("kvcm_requests_running", "Requests with a sequence on the device",
                    s["running"])
        yield gauge("kvcm_requests_queued", "Requests accepted and waiting for admission",
                    s["queued"])
        yield gauge("kvcm_requests_suspended", "Requests whose pages are parked off the device",
                    s["suspended"])
        yield gauge("kvcm_engine_healthy", "1 while the engine thread serves", float(s["healthy"]))
        fin = CounterMetricFamily("kvcm_requests_finished", "Requests ended, by reason",
                                  labels=["reason"])
        for reason in ("eos", "length", "cancelled", "error"):
            fin.add_metric([reason], s["finished"].get(reason, 0))
        yield fin
        pages = GaugeMetricFamily("kvcm_pages", "KV pages per tier and state",
                                  labels=["tier", "state"])
        for tier, c in r["pages"].items():
            for state in ("capacity", "free", "pending", "referenced", "cached"):
                pages.add_metric([tier, state], c[state])
        yield pages
        yield gauge("kvcm_prefix_hit_rate", "Prompt tokens reused from the prefix cache / prompt "
                    "tokens (first admissions)", r["prefix_hit_rate"])
        yield counter("kvcm_prompt_tokens", "Prompt tokens admitted", r["prompt_tokens"])
        yield counter("kvcm_prefix_hit_tokens", "Prompt tokens reused from the prefix cache",
                      r["prefix_hit_tokens"])
        off = CounterMetricFamily("kvcm_pages_offloaded", "Pages moved off the device, by tier",
                                  labels=["tier"])
        off.add_metric(["host"], r["pages_offloaded_to_host"])
        off.add_metric(["disk"], r["pages_offloaded_to_disk"])
        yield off
        yield counter("kvcm_pages_host_to_disk", "Pages moved from host to disk",
                      r["pages_host_to_disk"])
        yield counter("kvcm_pages_onboarded", "Pages moved onto the device", r["pages_onboarded"])
        yield counter("kvcm_suspends", "Sequences suspended under memory pressure", r["suspends"])
        yield counter("kvcm_resumes", "Suspended sequences resumed", r["resumes"])
        yield counter("kvcm_recomputes", "Sequences dropped and recomputed", r["recomputes"])
        yield counter("kvcm_steps", "Model steps", r["steps"])
        yield counter("kvcm_generated_tokens", "Tokens generated", r["generated_tokens"])
        yield gauge("kvcm_generated_tokens_per_second",
                    "Generated tokens per second of engine busy time",
                    r["generated_tokens_per_s"])


# ---------------------------------------------------------------------------------------------
# The app.


class _State:
    def __init__(self, engine: Engine, metrics: _Metrics, tokenizer: Any,
                 chat: ChatTemplate | None, model_name: str, max_seq_len: int):
        self.engine, self.metrics, self.tokenizer = engine, metrics, tokenizer
        self.chat, self.model_name, self.max_seq_len = chat, model_name, max_seq_len
        self.created = int(time.time())


def create_app(server: serve.Server, *, tokenizer: Any = None, chat_template: ChatTemplate | None
               = None, model_name: str = DEFAULT_MODEL_NAME, max_queue: int = 256,
               shutdown_timeout: float = 0.0) -> FastAPI:
    """The ASGI app over ``server`` (which it then owns: its engine thread starts with the app's
    lifespan and shuts the manager down when the app shuts down). ``max_queue``: accepted
    requests waiting beyond the ``max_batch`` running ones; ``shutdown_timeout``: seconds
    running requests may still finish when the lifespan ends (uvicorn's graceful shutdown has
    already waited for connections by then)."""
    metrics = _Metrics()
    engine = Engine(server, max_open=server.serve.max_batch + max_queue, metrics=metrics)
    # The longest sequence that fits alone (max_seq_len, or fewer when the device pool is small):
    # the default max_tokens of a chat request and the model's max_model_len.
    longest = server.manager.max_seq_len_for(1)
    st = _State(engine, metrics, tokenizer, chat_template, model_name, longest)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop, shutdown_timeout)

    app = FastAPI(title="jax_kvcm Llama server", lifespan=lifespan)
    app.state.kvcm = st

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        bad_json = any(e.get("type") in ("json_invalid", "json_type") for e in errs)
        parts = []
        for e in errs:
            where = ".".join(str(x) for x in e.get("loc", ())[1:]) or "body"
            parts.append(f"{where}: {e.get('msg')}")
        metrics.rejected.labels("invalid").inc()
        return _error(400 if bad_json else 422, "; ".join(parts) or "invalid request")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health() -> Response:
        if engine.healthy and engine.accepting:
            return JSONResponse({"status": "ok"})
        return _error(503, "shutting down" if engine.healthy else
                      f"the engine failed: {engine.last_error}")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": st.created, "owned_by": "jax_kvcm",
            "max_model_len": st.max_seq_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        try:
            metrics.snap = await engine.snapshot()
        except Exception as e:  # noqa: BLE001  (engine stopped or stuck)
            return _error(503, f"no engine snapshot: {type(e).__name__}: {e}")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        prompt = _completion_prompt(st, body.prompt)
        return await _generate(st, request, body, prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        if st.chat is None or st.tokenizer is None:
            raise ApiError(400, "the model has no chat template (tokenizer_config.json "
                                "'chat_template'); use /v1/completions")
        msgs = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                 else "".join(p.text for p in m.content)} for m in body.messages]
        try:
            text = st.chat.render(msgs)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        prompt = st.tokenizer.encode(text, add_special_tokens=False).ids
        limit = body.max_completion_tokens or body.max_tokens
        return await _generate(st, request, body, prompt, limit, chat=True)

    return app


def _completion_prompt(st: _State, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: one prompt per request (got {len(prompt)})")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if st.tokenizer is None:
            raise ApiError(400, "prompt: the model has no tokenizer.json; send token ids")
        ids = st.tokenizer.encode(prompt).ids
    else:
        ids = list(prompt)
    if not ids:
        raise ApiError(400, "prompt: empty")
    return ids


def _check_body(st: _State, body: _Sampling) -> list[str]:
    if body.model is not None and body.model != st.model_name:
        raise ApiError(404, f"model {body.model!r} not found (this server serves "
                            f"{st.model_name!r})")
    for name, allowed in _UNSUPPORTED.items():
        if getattr(body, name) not in allowed:
            raise ApiError(400, f"{name}: not supported (only {allowed[0]!r})")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4:
        raise ApiError(400, f"stop: at most 4 strings (got {len(stops)})")
    if stops and st.tokenizer is None:
        raise ApiError(400, "stop: needs a tokenizer (the model has no tokenizer.json)")
    return stops


async def _generate(st: _State, request: Request, body: _Sampling, prompt: list[int],
                    max_tokens: int | None, *, chat: bool) -> Response:
    stops = _check_body(st, body)
    if max_tokens is None:               # chat default: as long as fits
        max_tokens = max(1, st.max_seq_len - len(prompt))
    engine = st.engine
    if not engine.accepting:
        raise ApiError(503, "the server is shutting down" if engine.healthy
                       else f"the engine failed: {engine.last_error}")
    h = engine.open(serve.Request(prompt, max_tokens, temperature=body.temperature,
                                  top_p=body.top_p, seed=body.seed or 0))
    if h is None:
        st.metrics.rejected.labels("queue_full").inc()
        raise ApiError(429, f"too many requests: {engine.max_open} open (max_batch + "
                            "max_queue); retry later", {"Retry-After": "1"})
    try:
        first = await h.queue.get()
    except BaseException:
        engine.cancel(h)
        raise
    if first[0] == "error":
        st.metrics.rejected.labels("too_long" if first[1] == 400 else "unavailable").inc()
        raise ApiError(first[1], first[2])
    gen = _Generation(st, request, h, prompt, stops, chat, body)
    if body.stream:
        return StreamingResponse(gen.sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await gen.collect()


class _Generation:
    """One accepted request: reads its token stream, builds the OpenAI responses."""

    def __init__(self, st: _State, request: Request, h: Handle, prompt: list[int],
                 stops: list[str], chat: bool, body: _Sampling):
        self.st, self.h, self.prompt, self.chat = st, h, prompt, chat
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.detok = Detokenizer(st.tokenizer, prompt) if st.tokenizer is not None else None
        self.text = StopText(stops)
        self.ids: list[int] = []
        self.finish: str | None = None
        self.error: tuple[int, str] | None = None
        self.disconnected = False
        self.watcher = asyncio.ensure_future(self._watch(request))

    async def _watch(self, request: Request) -> None:
        """Cancels the request when its client disconnects (also while it is queued)."""
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                self.h.queue.put_nowait(("disconnected",))
                self.st.engine.cancel(self.h)
                return

    async def _next(self, coalesce: bool) -> tuple[list[int], str] | None:
        """The next step's tokens (with ``coalesce``, all that queued up) and their text; None
        after the end."""
        if self.finish is not None or self.error is not None:
            return None
        q = self.h.queue
        item = await q.get()
        ids: list[int] = []
        while True:
            kind = item[0]
            if kind == "tokens":
                ids.extend(item[1])
            elif kind == "end":
                self.finish = _FINISH[item[1]]
            elif kind == "error":
                self.error = (item[1], item[2])
            elif kind == "disconnected":
                self.finish, self.disconnected = "abort", True
            if kind != "tokens" or not coalesce or q.empty():
                break
            item = q.get_nowait()
        self.ids.extend(ids)
        piece = self.detok.add(ids) if (self.detok is not None and ids) else ""
        piece, stopped = self.text.add(piece)
        if stopped:
            self.finish = "stop"
            self.st.engine.cancel(self.h)
        elif self.finish is not None:
            piece += self.text.flush()
        return ids, piece

    def _close(self) -> None:
        self.watcher.cancel()
        self.st.engine.cancel(self.h)

    def _usage(self) -> dict[str, int]:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.ids),
                "total_tokens": len(self.prompt) + len(self.ids)}

    def _choice(self, ids: list[int], text: str, finish: str | None, delta: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                    "token_ids": ids}
        msg = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": 0, ("delta" if delta else "message"): msg, "logprobs": None,
                "finish_reason": finish, "token_ids": ids}

    def _response(self, choice: dict, usage: dict | None, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else "")
        out = {"id": self.id, "object": kind, "created": self.created,
               "model": self.st.model_name, "choices": [choice] if choice else []}
        if usage is not None or not chunk:
            out["usage"] = usage
        return out

    async def collect(self) -> Response:
        try:
            while await self._next(coalesce=True) is not None:
                pass
        finally:
            self._close()
        if self.error is not None:
            return _error(*self.error)
        text = self.text.text
        return JSONResponse(self._response(self._choice(self.ids, text, self.finish, False),
                                           self._usage(), chunk=False))

    async def sse(self):
        try:
            if self.chat:   # the role first, as OpenAI does
                first = self._choice([], "", None, True)
                first["delta"]["role"] = "assistant"
                yield _event(self._response(first, None, chunk=True))
            # NOTE: the chunks of one step are the server's hot path (one per running request
            # per step, on the event loop while the engine thread waits for the device): a
            # fixed head and a few formatted fields, no dict and no full json.dumps.
            head = _event(self._response({"index": 0}, None, chunk=True))[:-len("}]}\n\n")]
            field = '"delta":{"content":%s}' if self.chat else '"text":%s'
            while (got := await self._next(coalesce=False)) is not None:
                ids, piece = got
                if self.error is not None:
                    yield _event({"error": {"message": self.error[1], "code": self.error[0]}})
                    break
                if self.disconnected:
                    break
                if ids or piece or self.finish is not None:
                    yield (f'{head},{field % json.dumps(piece)},"logprobs":null,'
                           f'"finish_reason":{json.dumps(self.finish)},'
                           f'"token_ids":[{",".join(map(str, ids))}]}}]}}\n\n')
            if self.include_usage and self.error is None:
                yield _event(self._response({}, self._usage(), chunk=True))
            yield "data: [DONE]\n\n"
        finally:
            self._close()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------------------------------
# The built-in model's tokenizer and the command line.


def write_default_model(directory: Path) -> Path:
    """The runner's built-in random Llama (``run.DEFAULT_CONFIG``, seed 0) plus a word-level
    tokenizer over its vocabulary (``<unk> <s> </s> system user assistant :`` then ``w7`` ...
    ``w511``; text is split on whitespace, ``<s>`` is prepended, decoding joins with spaces) and
    a chat template in ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    path = run.write_default_checkpoint(directory)
    words = ["<unk>", "<s>", "</s>", "system", "user", "assistant", ":"]
    words += [f"w{i}" for i in range(len(words), run.DEFAULT_CONFIG.vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(w, special=True) for w in words[:3]])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": DEFAULT_CHAT_TEMPLATE}, indent=2) + "\n")
    return path


def build_parser() -> argparse.ArgumentParser:
    """The runner's engine flags (``run.add_engine_args``) plus the server's."""
    p = argparse.ArgumentParser(
        prog="server.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_engine_args(p)
    a = p.add_argument
    a("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    a("--port", type=run.count(0), default=8000, metavar="N",
      help="port to bind (default: %(default)s)")
    a("--served-model-name", default=None, metavar="NAME",
      help=f"the model id clients name (default: the directory name, or {DEFAULT_MODEL_NAME})")
    a("--max-queue", type=run.count(0), default=256, metavar="N",
      help="accepted requests waiting beyond the running ones before 429 (default: "
           "%(default)s)")
    a("--shutdown-timeout", type=run.real, default=30.0, metavar="S",
      help="seconds running requests may finish after SIGTERM (default: %(default)s)")
    a("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
      help="uvicorn's and the engine's log level (default: %(default)s)")
    a("--access-log", action="store_true", help="log every HTTP request (default: off)")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check that needs no checkpoint (``server.py: error: ...``, exit status 2), so a bad
    argument fails before the load."""
    if args.shutdown_timeout < 0:
        p.error(f"argument --shutdown-timeout: must be >= 0, got {args.shutdown_timeout}")
    if args.port > 65535:
        p.error(f"argument --port: must be <= 65535, got {args.port}")
    run.check_engine_args(p, args)


class _Uvicorn(uvicorn.Server):
    """``uvicorn.Server`` whose exit signal also starts the engine's shutdown."""

    def __init__(self, config: uvicorn.Config, on_exit: Any):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    cfg = run.serve_config(parser, args)
    path, config, params, tokenizer, tmp = run.load_model(parser, args, progress=False,
                                                          write_default=write_default_model)
    try:
        try:
            server = serve.Server(params, config, cfg)
            chat = load_chat_template(path)
        except ValueError as e:
            parser.error(str(e))
        name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None
                                          else Path(args.model).resolve().name)
        app = create_app(server, tokenizer=tokenizer, chat_template=chat, model_name=name,
                         max_queue=args.max_queue)
        print(f"serving {name} ({config.num_hidden_layers} layers, vocab {config.vocab_size}, "
              f"tokenizer {'yes' if tokenizer else 'no'}, chat {'yes' if chat else 'no'}) on "
              f"http://{args.host}:{args.port}", flush=True)
        # The engine cancels what still runs a little before uvicorn's graceful timeout, so
        # every stream ends with a final chunk instead of a cancelled task.
        margin = min(1.0, args.shutdown_timeout / 4)
        uv = _Uvicorn(uvicorn.Config(app, host=args.host, port=args.port,
                                     log_level=args.log_level, access_log=args.access_log,
                                     timeout_graceful_shutdown=args.shutdown_timeout),
                      lambda: app.state.kvcm.engine.begin_shutdown_from_signal(
                          args.shutdown_timeout - margin))
        # uvicorn raises the signal again after its shutdown: handled here, so the process
        # goes on to remove the built-in model's files and exits 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        uv.run()
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
