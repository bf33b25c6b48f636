"""An OpenAI-compatible HTTP server for the example Llama runner (FastAPI + uvicorn).

    python -m examples.llama.server                         # the built-in random Llama
    python -m examples.llama.server --model DIR --port 8000

Same model, tier, codec and batching flags as ``examples/llama/run.py``, plus ``--host`` (default
127.0.0.1), ``--port``, ``--max-queue``, ``--shutdown-timeout``, ``--served-model-name`` and the
guards below. Without
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

Disaggregated prefill (:mod:`._http_roles`): ``--role prefill`` adds the internal routes
``POST /internal/prefill`` and ``/internal/forget``; ``--role decode --prefill-url URL`` serves
the endpoints above and has that server prefill each prompt, pulls its K/V
(``--handoff-timeout``), imports it and decodes (503 while the prefill server is down, 502 for
K/V the import refuses). ``--role both`` (the default) prefills and decodes here.

One engine thread owns the serving loop (:mod:`._http_engine`): handlers only queue requests and
read their token streams; tokenizing and chat templating run in a worker pool
(``--tokenizer-workers``), so a long prompt never stalls another request's stream. A request
ends within one step when its client disconnects (streaming or not, also before it reached the
engine), a stop string appears or ``--request-timeout`` passes (408); its sequence is closed:
full pages stay cached, the rest are freed. Refusals, all in OpenAI's error shape
(:mod:`.server_api`) and counted by reason in ``/metrics``: bodies over ``--max-body-bytes``
413; unparseable bodies (bad JSON, invalid UTF-8, nesting too deep) 400; bad fields or values
422; a text prompt far past the context 400 from a prefix, before the tokenizer's full run; a
request that can never fit (``max_seq_len``, device pages) 400 naming the limit; beyond
``max_batch + max_queue`` open requests, or ``--max-requests-per-client`` from one address, 429
with ``Retry-After``. SIGTERM: no new connections, running requests get ``--shutdown-timeout``
seconds to finish, the rest are cancelled, the manager is shut down (disk files removed, host
memory freed).

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax_kvcm  # noqa: F401  (the installed package before the repo root's source tree)
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import _http_roles as roles
from . import run, serve
from ._http_engine import Engine, Handle
from ._http_text import ChatTemplate, Detokenizer, StopText, load_chat_template
from .server_api import (ApiError, BodyLimit, ChatBody, Client, ClientSlots, CompletionBody,
                         Gone, Metrics, Sampling, error_body, error_response,
                         install_error_handlers)

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
DEFAULT_MAX_BODY_BYTES = 8 << 20
# A text prompt longer than this many characters per token of the context is first measured on
# a prefix of that length (see _encode).
PREFIX_CHARS_PER_TOKEN = 16


# ---------------------------------------------------------------------------------------------
# The app.


class _State:
    def __init__(self, engine: Engine, metrics: Metrics, tokenizer: Any,
                 chat: ChatTemplate | None, model_name: str, max_seq_len: int,
                 clients: ClientSlots, request_timeout: float, pool: ThreadPoolExecutor):
        self.engine, self.metrics, self.tokenizer = engine, metrics, tokenizer
        self.chat, self.model_name, self.max_seq_len = chat, model_name, max_seq_len
        self.clients, self.request_timeout, self.pool = clients, request_timeout, pool
        self.created = int(time.time())
        self.decode: roles.DecodeSide | None = None     # --role decode


def create_app(server: serve.Server, *, tokenizer: Any = None, chat_template: ChatTemplate | None
               = None, model_name: str = DEFAULT_MODEL_NAME, max_queue: int = 256,
               shutdown_timeout: float = 0.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_requests_per_client: int = 0, request_timeout: float = 0.0,
               tokenizer_workers: int = 2, role: str = "both", prefill_url: str | None = None,
               handoff_timeout: float = 30.0) -> FastAPI:
    """The ASGI app over ``server`` (which it then owns: its engine thread starts with the app's
    lifespan and shuts the manager down when the app shuts down). ``max_queue``: accepted
    requests waiting beyond the ``max_batch`` running ones; ``shutdown_timeout``: seconds
    running requests may still finish when the lifespan ends (uvicorn's graceful shutdown has
    already waited for connections by then); ``max_body_bytes`` (0: none): larger bodies get
    413; ``max_requests_per_client`` (0: none): open requests per client address before 429;
    ``request_timeout`` (0: none): seconds a request may take in all (408); ``tokenizer_workers``:
    threads that tokenize and render chat templates (off the event loop). ``role``
    (:mod:`._http_roles`): "both", "prefill" (adds the internal routes a decode server calls)
    or "decode" (prefills each prompt on the server at ``prefill_url``); ``handoff_timeout``:
    seconds a prefill call or a K/V pull may take, and an offer waits to be pulled."""
    if role not in roles.ROLES or (role == "decode") != (prefill_url is not None):
        raise ValueError(f"role {role!r} with prefill_url {prefill_url!r}: one of "
                         f"{roles.ROLES}, and a prefill_url exactly with 'decode'")
    metrics = Metrics()
    engine = Engine(server, max_open=server.serve.max_batch + max_queue, metrics=metrics,
                    model_id=model_name)
    # The longest sequence that fits alone (max_seq_len, or fewer when the device pool is small):
    # the default max_tokens of a chat request and the model's max_model_len.
    longest = server.manager.max_seq_len_for(1)
    pool = ThreadPoolExecutor(max(1, tokenizer_workers), thread_name_prefix="kvcm-tokenize")
    st = _State(engine, metrics, tokenizer, chat_template, model_name, longest,
                ClientSlots(max_requests_per_client), request_timeout, pool)
    side = (roles.PrefillSide(st, handoff_timeout) if role == "prefill" else
            roles.DecodeSide(st, prefill_url, handoff_timeout) if role == "decode" else None)
    st.decode = side if role == "decode" else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            if side is not None:
                side.close()
            await asyncio.to_thread(engine.stop, shutdown_timeout)

    app = FastAPI(title="jax_kvcm Llama server", lifespan=lifespan)
    app.state.kvcm = st
    app.add_middleware(BodyLimit, limit=max_body_bytes,
                       on_refuse=lambda: metrics.rejected.labels("body_too_large").inc())
    install_error_handlers(app, metrics)
    if role == "prefill":
        side.add_routes(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.healthy and engine.accepting:
            return JSONResponse({"status": "ok"})
        return error_response(503, "shutting down" if engine.healthy else
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
            return error_response(503, f"no engine snapshot: {type(e).__name__}: {e}")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await _serve_request(st, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        return await _serve_request(st, request, body, chat=True)

    return app


async def _serve_request(st: _State, request: Request, body: Sampling, *, chat: bool) -> Response:
    c = Client(st, request)
    try:
        stops = _check_body(st, body)
        loop = asyncio.get_running_loop()
        if chat:
            if st.chat is None or st.tokenizer is None:
                raise ApiError(400, "the model has no chat template (tokenizer_config.json "
                                    "'chat_template'); use /v1/completions")
            msgs = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content)} for m in body.messages]
            prompt = await c.wait(loop.run_in_executor(st.pool, _chat_prompt, st, msgs))
            max_tokens = body.max_completion_tokens or body.max_tokens
        else:
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                if len(prompt) != 1:
                    raise ApiError(400, f"prompt: one prompt per request (got {len(prompt)})",
                                   param="prompt")
                prompt = prompt[0]
            if isinstance(prompt, str):
                if st.tokenizer is None:
                    raise ApiError(400, "prompt: the model has no tokenizer.json; send token ids",
                                   param="prompt")
                prompt = await c.wait(loop.run_in_executor(st.pool, _encode, st, prompt, True))
            max_tokens = body.max_tokens
        if not prompt:
            raise ApiError(400, "prompt: empty", param="prompt")
        return await _generate(st, c, body, list(prompt), max_tokens, stops, chat)
    except Gone:
        return Response(status_code=499)        # nobody reads it
    finally:
        if not c.handed:
            c.close()


def _encode(st: _State, text: str, special: bool) -> list[int]:
    """Tokenizer worker thread. ``encode_batch`` releases the GIL (``encode`` holds it for the
    whole run), so a long text does not stall the event loop. A text far past the context is
    refused from a bounded prefix before the full run: the tokens of its first
    ``PREFIX_CHARS_PER_TOKEN * longest`` characters (cut at whitespace) alone are more than twice
    the longest sequence that fits."""
    limit = st.max_seq_len
    head_chars = PREFIX_CHARS_PER_TOKEN * limit
    if len(text) > head_chars:
        head = text[:head_chars]
        cut = max(head.rfind(" "), head.rfind("\n"))
        head = head[:cut] if cut > 0 else head
        n = len(st.tokenizer.encode_batch([head], add_special_tokens=False)[0].ids)
        if n > 2 * limit:
            raise ApiError(400, f"prompt: far longer than the context (more than {n} tokens in "
                                f"its first {len(head)} of {len(text)} characters; max_seq_len "
                                f"{limit})", reason="too_long", param="prompt")
    return st.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids


def _chat_prompt(st: _State, msgs: list[dict[str, str]]) -> list[int]:
    """Tokenizer worker thread: the chat template, then the tokenizer."""
    try:
        text = st.chat.render(msgs)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None
    return _encode(st, text, False)


def _check_body(st: _State, body: Sampling) -> list[str]:
    if body.model is not None and body.model != st.model_name:
        raise ApiError(404, f"model {body.model!r} not found (this server serves "
                            f"{st.model_name!r})", reason="not_found", param="model")
    for name, allowed in _UNSUPPORTED.items():
        if getattr(body, name) not in allowed:
            raise ApiError(400, f"{name}: not supported (only {allowed[0]!r})", param=name)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4:
        raise ApiError(400, f"stop: at most 4 strings (got {len(stops)})", param="stop")
    if stops and st.tokenizer is None:
        raise ApiError(400, "stop: needs a tokenizer (the model has no tokenizer.json)",
                       param="stop")
    return stops


async def _generate(st: _State, c: Client, body: Sampling, prompt: list[int],
                    max_tokens: int | None, stops: list[str], chat: bool) -> Response:
    if max_tokens is None:               # chat default: as long as fits
        max_tokens = max(1, st.max_seq_len - len(prompt))
    engine = st.engine
    if not engine.accepting:
        raise ApiError(503, "the server is shutting down" if engine.healthy
                       else f"the engine failed: {engine.last_error}", reason="unavailable")
    h = engine.open(serve.Request(prompt, max_tokens, temperature=body.temperature,
                                  top_p=body.top_p, seed=body.seed or 0),
                    submit=st.decode is None)
    if h is None:
        raise ApiError(429, f"too many requests: {engine.max_open} open (max_batch + "
                            "max_queue); retry later", {"Retry-After": "1"}, reason="queue_full")
    c.attach(h)
    if st.decode is not None:          # --role decode: the prompt is prefilled elsewhere
        await st.decode.hand_in(c, h)
    first = await h.queue.get()
    if first[0] == "disconnected":
        raise Gone
    if first[0] == "timeout":
        raise c.timeout_error()
    if first[0] == "error":
        raise ApiError(first[1], first[2],
                       reason={400: "too_long", 502: "handoff"}.get(first[1], "unavailable"))
    gen = _Generation(st, c, h, prompt, stops, chat, body)
    if body.stream:
        c.handed = True
        return StreamingResponse(gen.sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await gen.collect()


class _Generation:
    """One accepted request: reads its token stream, builds the OpenAI responses."""

    def __init__(self, st: _State, c: Client, h: Handle, prompt: list[int],
                 stops: list[str], chat: bool, body: Sampling):
        self.st, self.c, self.h, self.prompt, self.chat = st, c, h, prompt, chat
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.detok = Detokenizer(st.tokenizer, prompt) if st.tokenizer is not None else None
        self.text = StopText(stops)
        self.ids: list[int] = []
        self.finish: str | None = None
        self.error: tuple[int, str] | None = None
        self.disconnected = False

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
            elif kind == "timeout":
                e = self.c.timeout_error()
                self.st.metrics.rejected.labels("timeout").inc()
                self.error = (e.status, e.message)
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
        self.c.close()

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
            return error_response(*self.error)
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
                    yield _event(error_body(*self.error))
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
    a("--max-body-bytes", type=run.size, default=DEFAULT_MAX_BODY_BYTES, metavar="SIZE",
      help="larger request bodies get 413; 0: no limit (default: 8MiB)")
    a("--max-requests-per-client", type=run.count(0), default=0, metavar="N",
      help="open requests per client address before 429; 0: no limit (default: %(default)s)")
    a("--request-timeout", type=run.real, default=0.0, metavar="S",
      help="seconds a request may take in all (queued, prefill, generation) before it is "
           "cancelled with 408; 0: none (default: %(default)s)")
    a("--tokenizer-workers", type=run.count(1), default=2, metavar="N",
      help="threads that tokenize prompts and render chat templates, off the event loop "
           "(default: %(default)s)")
    a("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
      help="uvicorn's and the engine's log level (default: %(default)s)")
    a("--access-log", action="store_true", help="log every HTTP request (default: off)")
    roles.add_role_args(p)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check that needs no checkpoint (``server.py: error: ...``, exit status 2), so a bad
    argument fails before the load."""
    if args.shutdown_timeout < 0:
        p.error(f"argument --shutdown-timeout: must be >= 0, got {args.shutdown_timeout}")
    if args.request_timeout < 0:
        p.error(f"argument --request-timeout: must be >= 0, got {args.request_timeout}")
    if args.port > 65535:
        p.error(f"argument --port: must be <= 65535, got {args.port}")
    roles.check_role_args(p, args)
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
    if args.role == "prefill" and not cfg.host_bytes:
        parser.error("argument --role: prefill needs a host tier (--host-bytes): "
                     "export_sequence copies the pages through it")
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
                         max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                         max_requests_per_client=args.max_requests_per_client,
                         request_timeout=args.request_timeout,
                         tokenizer_workers=args.tokenizer_workers, role=args.role,
                         prefill_url=args.prefill_url, handoff_timeout=args.handoff_timeout)
        role = "" if args.role == "both" else f" as the {args.role} server"
        print(f"serving {name}{role} ({config.num_hidden_layers} layers, vocab "
              f"{config.vocab_size}, tokenizer {'yes' if tokenizer else 'no'}, chat "
              f"{'yes' if chat else 'no'}) on http://{args.host}:{args.port}", flush=True)
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
