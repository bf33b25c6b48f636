"""The HTTP server's request bodies, its errors (every one in OpenAI's shape) and its guards.

- Request bodies (pydantic, unknown fields refused).
- :class:`ApiError` and :func:`error_response`: ``{"error": {"message", "type", "param",
  "code"}}``; :func:`install_error_handlers` answers in that shape for everything the app
  raises, FastAPI's own parse errors included (invalid JSON, invalid UTF-8, JSON nested too
  deeply, wrong types, unknown routes), and counts each refusal by reason.
- :class:`BodyLimit`: an ASGI middleware that refuses a body over ``--max-body-bytes`` with 413
  (by its Content-Length before reading it, or while reading a chunked one).
- :class:`ClientSlots`: at most ``--max-requests-per-client`` open requests per client address.
- :class:`Client`: one request's connection: its slot, disconnect watcher and deadline
  (``--request-timeout``).
- :class:`Metrics`: the Prometheus registry (latency histograms, refusals, the engine's report).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ._http_engine import ITL_BUCKETS, TTFT_BUCKETS, Handle

log = logging.getLogger("examples.llama.server")

# Why a request was refused (the label of kvcm_requests_rejected_total).
REJECT_REASONS = ("bad_json", "invalid", "not_found", "body_too_large", "too_long",
                  "queue_full", "client_limit", "timeout", "unavailable", "handoff")
_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          408: "timeout_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 502: "bad_gateway", 503: "service_unavailable",
          504: "gateway_timeout"}


# ---------------------------------------------------------------------------------------------
# Request bodies.


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class Sampling(_Strict):
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


class CompletionBody(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class ChatBody(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


# ---------------------------------------------------------------------------------------------
# Errors.


class ApiError(Exception):
    """An error answer; ``reason`` (one of :data:`REJECT_REASONS`, or None for errors that are
    not refusals) labels the refusal counter."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, *,
                 reason: str | None = "invalid", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers
        self.reason, self.param = reason, param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error the app answers, in OpenAI's shape, each refusal counted by reason."""

    def refuse(reason: str | None, status: int, message: str, headers=None, param=None):
        if reason is not None:
            metrics.rejected.labels(reason).inc()
        return error_response(status, message, headers, param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        bad_json = any(e.get("type") in ("json_invalid", "json_type") for e in errs)
        parts, params = [], []
        for e in errs[:8]:
            where = ".".join(str(x) for x in e.get("loc", ())[1:]) or "body"
            msg = e.get("msg", "")
            if e.get("type") == "json_invalid":
                msg = f"the body is not valid JSON ({(e.get('ctx') or {}).get('error', msg)})"
            parts.append(f"{where}: {msg}")
            params.append(where)
        if len(errs) > 8:
            parts.append(f"... {len(errs) - 8} more")
        return refuse("bad_json" if bad_json else "invalid", 400 if bad_json else 422,
                      "; ".join(parts) or "invalid request",
                      param=None if bad_json or not params else params[0])

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        cause, status, msg = exc.__cause__, exc.status_code, str(exc.detail)
        reason: str | None = "invalid"
        if status == 400:            # FastAPI could not parse the body
            reason = "bad_json"
            if isinstance(cause, UnicodeDecodeError):
                msg = f"the body is not valid UTF-8 ({cause.reason} at byte {cause.start})"
            elif isinstance(cause, RecursionError):
                msg = "the body's JSON is nested too deeply"
            elif cause is not None:
                msg = f"the body could not be parsed: {type(cause).__name__}: {cause}"
        elif status in (404, 405):
            reason = "not_found"
            msg = f"{request.method} {request.url.path}: {msg.lower()}"
        elif status == 413:
            reason = "body_too_large"
        return refuse(reason, status, msg, getattr(exc, "headers", None))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return refuse(exc.reason, exc.status, exc.message, exc.headers, exc.param)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------------------
# Guards.


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 (OpenAI's error shape). A
    Content-Length over the limit is refused before the body is read; a chunked body once it
    passes the limit. The rest of an over-long body is read and dropped (bounded), so the client
    gets the answer instead of a reset connection. Below the limit the body is passed on whole,
    then the connection's own messages (``http.disconnect``)."""

    DRAIN_FACTOR = 16

    def __init__(self, app: Any, limit: int | None, on_refuse: Any = None):
        self.app, self.limit, self.on_refuse = app, limit, on_refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.limit:
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        try:
            declared = int(length) if length is not None else None
        except ValueError:
            declared = None
        chunks, total, more = [], 0, True
        if declared is not None and declared > self.limit:
            total = declared
        else:
            while more:
                msg = await receive()
                if msg["type"] != "http.request":          # disconnected while sending
                    return
                body = msg.get("body", b"")
                total += len(body)
                more = msg.get("more_body", False)
                if total > self.limit:
                    break
                chunks.append(body)
        if total > self.limit:
            drained = 0
            while more and drained < self.DRAIN_FACTOR * self.limit:
                msg = await receive()
                if msg["type"] != "http.request":
                    return
                drained += len(msg.get("body", b""))
                more = msg.get("more_body", False)
            if self.on_refuse is not None:
                self.on_refuse()
            body = json.dumps(error_body(413, f"the request body is {total} bytes or more, over "
                                         f"the limit of {self.limit} (--max-body-bytes)"))
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


class ClientSlots:
    """At most ``limit`` open requests per client address (0: no limit)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open: collections.Counter = collections.Counter()

    def enter(self, request: Request) -> Any:
        """A release function (idempotent); ApiError 429 when the client has ``limit`` open."""
        key = request.client.host if request.client is not None else "?"
        if self.limit and self.open[key] >= self.limit:
            raise ApiError(429, f"too many requests from {key}: {self.limit} open "
                                "(--max-requests-per-client); retry later",
                           {"Retry-After": "1"}, reason="client_limit")
        self.open[key] += 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.open[key] -= 1
                if self.open[key] <= 0:
                    del self.open[key]
        return release


class Client:
    """One request's connection from its start: a client slot, a watcher for its disconnect and
    its deadline. Before the engine has the request, :meth:`wait` races an await against both;
    after (:meth:`attach`), either puts an item in the handle's queue and cancels it."""

    def __init__(self, st: Any, request: Request):
        self.st = st
        self.release = st.clients.enter(request)         # ApiError 429 over the client limit
        self.h: Handle | None = None
        self.handed = False                               # a stream owns the cleanup
        self.gone = asyncio.Event()
        self.timed_out = False
        self.watcher = asyncio.ensure_future(self._watch(request))
        t = st.request_timeout
        self.deadline = time.perf_counter() + t if t > 0 else None
        self.timer = (asyncio.get_running_loop().call_later(t, self._timeout) if t > 0
                      else None)

    async def _watch(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.gone.set()
        self.release()
        if self.h is not None:
            self.h.queue.put_nowait(("disconnected",))
            self.st.engine.cancel(self.h)

    def _timeout(self) -> None:
        self.timed_out = True
        if self.h is not None:
            self.h.queue.put_nowait(("timeout",))
            self.st.engine.cancel(self.h)

    def timeout_error(self) -> ApiError:
        return ApiError(408, f"the request ran past --request-timeout ({self.st.request_timeout:g}"
                             " s); it was cancelled", reason="timeout")

    async def wait(self, fut: Any) -> Any:
        """``fut``'s result, unless the client leaves (:class:`Gone`) or the deadline passes
        (ApiError 408) first."""
        fut = asyncio.ensure_future(fut)
        gone = asyncio.ensure_future(self.gone.wait())
        left = None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())
        try:
            await asyncio.wait({fut, gone}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if fut.done():
            return fut.result()
        fut.cancel()
        if self.gone.is_set():
            raise Gone
        raise self.timeout_error()

    def attach(self, h: Handle) -> None:
        self.h = h
        if self.gone.is_set():
            h.queue.put_nowait(("disconnected",))
            self.st.engine.cancel(h)
        elif self.timed_out:
            self._timeout()

    def close(self) -> None:
        """Idempotent: the watcher and the timer stop, the slot is freed, the request ends."""
        self.watcher.cancel()
        if self.timer is not None:
            self.timer.cancel()
        self.release()
        if self.h is not None:
            self.st.engine.cancel(self.h)


class Gone(Exception):
    """The client left before its request reached the engine."""


# ---------------------------------------------------------------------------------------------
# Metrics.


class Metrics:
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
                                "Requests refused (or timed out), by reason",
                                ["reason"], registry=self.registry)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        # Disaggregated prefill (examples/llama/_http_roles.py), by outcome.
        self.handoffs = Counter("kvcm_handoffs", "K/V handoffs between a prefill and a decode "
                                "server, by outcome", ["outcome"], registry=self.registry)
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
