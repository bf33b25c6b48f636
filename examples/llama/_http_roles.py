"""Disaggregated prefill between two HTTP servers on one machine (``--role prefill`` and
``--role decode``; issue 37): the prefill server computes prompts, the decode server generates.

Clients talk to the decode server (``--prefill-url http://127.0.0.1:PORT``). For each request it
takes a slot (429 as usual), then, in a worker thread:

1. ``POST /internal/prefill`` on the prefill server (token ids, ``max_tokens``, sampling, model
   name). The prefill server runs the prompt through its own serving loop as a one-token request
   whose sequence is kept (``Request.keep_sequence``), exports the sequence
   (``KVCacheManager.export_sequence``), closes it, offers the pages on its
   :class:`~jax_kvcm.handoff.KVSender` and answers ``{"first_token", "ticket",
   "finish_reason"}`` (no ticket when the first token already ends the request: EOS, or
   ``max_tokens`` 1).
2. The decode server checks that the ticket is of its prompt, pulls the pages
   (:class:`~jax_kvcm.handoff.KVReceiver`, JAX's transfer server; ``--handoff-timeout``), then
   ``POST /internal/forget`` (the prefill server drops its staged copy; one never forgotten is
   dropped after ``--handoff-timeout`` all the same).
3. The engine thread imports the sequence (``import_sequence``) and admits it with its first
   token (``Server.submit_prefilled``); the continuous-batching loop decodes the rest.

Failures: the prefill server unreachable (or shutting down) -> 503 with ``Retry-After`` (the
decode server does not prefill locally then: it stays up and answers again once the prefill
server is back); the prefill server busy -> 429; it failed or refused the prompt -> 502; the
pages not pulled in time -> 504; a payload the import refuses (another model, page size, layout,
a checksum) -> 502 naming the mismatch, nothing imported. An import that finds no device room
(a value, not an error) prefills the prompt locally instead: the same tokens. ``/metrics``
counts each outcome in ``kvcm_handoffs_total{outcome}``.

Greedy requests get the single server's tokens. A sampled first token is drawn by the prefill
server's loop (its request id in the key), the rest by the decode server's: the same
distribution, not the same draws as one server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from . import serve
from ._http_engine import Handle
from .server_api import ApiError, Client, Gone, _Strict

__all__ = ["ROLES", "DecodeSide", "HandoffError", "PrefillSide", "Prefilled", "add_role_args",
           "check_role_args"]

log = logging.getLogger("examples.llama.server")

ROLES = ("both", "prefill", "decode")
# kvcm_handoffs_total{outcome}: on the decode server imported, prefilled_locally (no device
# room), finished_at_prefill (the first token ended it), refused (the import refused the K/V);
# on the prefill server offered, forgotten, expired (not forgotten within --handoff-timeout).
DECODE_OUTCOMES = ("imported", "prefilled_locally", "finished_at_prefill", "refused")
PREFILL_OUTCOMES = ("offered", "forgotten", "expired")


class HandoffError(ValueError):
    """A handoff that failed; ``status``: the HTTP status the client gets."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class PrefillBody(_Strict):
    prompt: list[int] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    model: str | None = None


class ForgetBody(_Strict):
    transfer_id: int


# ---------------------------------------------------------------------------------------------
# The prefill server.


class PrefillSide:
    """``--role prefill``: the internal routes and the offers staged on its KVSender."""

    def __init__(self, st: Any, handoff_timeout: float):
        from jax_kvcm.handoff import KVSender
        self.st, self.ttl = st, handoff_timeout
        for outcome in PREFILL_OUTCOMES:
            st.metrics.handoffs.labels(outcome)
        self.sender = KVSender()
        self.outstanding: dict[int, asyncio.TimerHandle] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcm-offer")

    def add_routes(self, app: FastAPI) -> None:
        @app.post("/internal/prefill")
        async def prefill(body: PrefillBody, request: Request) -> Response:
            return await self._prefill(body, request)

        @app.post("/internal/forget")
        async def forget(body: ForgetBody) -> dict[str, bool]:
            return {"forgotten": self._forget(body.transfer_id, "forgotten")}

    async def _prefill(self, body: PrefillBody, request: Request) -> Response:
        st, engine = self.st, self.st.engine
        c = Client(st, request)
        try:
            if body.model is not None and body.model != st.model_name:
                raise ApiError(400, f"model: the decode server serves {body.model!r}, this "
                                    f"prefill server {st.model_name!r}", param="model")
            if not engine.accepting:
                raise ApiError(503, "the prefill server is shutting down", reason="unavailable")
            keep = body.max_tokens > 1             # else the first token is all there is to do
            h = engine.open(serve.Request(body.prompt, 1, temperature=body.temperature,
                                          top_p=body.top_p, seed=body.seed, keep_sequence=keep))
            if h is None:
                raise ApiError(429, f"too many requests: {engine.max_open} open; retry later",
                               {"Retry-After": "1"}, reason="queue_full")
            c.attach(h)
            first, reason, exported = await self._run(c, h)
            ticket = None
            if reason == "length" and keep:
                if isinstance(exported, Exception) or exported is None:
                    raise ApiError(500, f"export_sequence failed: {exported!r}", reason=None)
                ticket = await asyncio.get_running_loop().run_in_executor(
                    self.pool, self.sender.offer, exported)
                self._stage(int(ticket["transfer_id"]))
            return JSONResponse({"first_token": first, "ticket": ticket,
                                 "finish_reason": None if ticket is not None else reason})
        except Gone:
            return Response(status_code=499)
        finally:
            c.close()

    async def _run(self, c: Client, h: Handle) -> tuple[int, str, Any]:
        """The one-token request's first token, finish reason and export (see module doc)."""
        first = exported = None
        while True:
            item = await h.queue.get()
            kind = item[0]
            if kind == "tokens":
                first = int(item[1][0])
            elif kind == "kept":
                exported = item[1]
            elif kind == "end":
                if item[1] not in ("eos", "length") or first is None:
                    raise ApiError(503, f"the prefill request ended: {item[1]}",
                                   reason="unavailable")
                return first, item[1], exported
            elif kind == "error":
                raise ApiError(item[1], item[2], reason="too_long" if item[1] == 400
                               else "unavailable")
            elif kind == "disconnected":
                raise Gone
            elif kind == "timeout":
                raise c.timeout_error()

    def _stage(self, transfer_id: int) -> None:
        self.st.metrics.handoffs.labels("offered").inc()
        self.outstanding[transfer_id] = asyncio.get_running_loop().call_later(
            self.ttl, self._forget, transfer_id, "expired")

    def _forget(self, transfer_id: int, outcome: str) -> bool:
        timer = self.outstanding.pop(transfer_id, None)
        if timer is None:
            return False
        timer.cancel()
        self.sender.forget({"transfer_id": transfer_id})
        self.st.metrics.handoffs.labels(outcome).inc()
        return True

    def close(self) -> None:
        for transfer_id in list(self.outstanding):
            self._forget(transfer_id, "expired")
        self.pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------------------
# The decode server.


@dataclasses.dataclass
class Prefilled:
    """A prompt's K/V pulled from the prefill server, handed to :meth:`Engine.submit`."""

    request: serve.Request
    export: Any                     # jax_kvcm.SequenceExport
    first_token: int
    model_id: str
    outcomes: Any                   # the kvcm_handoffs counter

    def admit(self, server: serve.Server) -> int:
        """Engine thread: imports the sequence and submits the request; without device room,
        submits it for a local prefill instead. HandoffError 502 when the import refuses the
        payload (nothing imported), ValueError for a request the loop refuses."""
        mgr = server.manager
        try:
            seq = mgr.import_sequence(self.export, self.model_id)
        except ValueError as e:
            self.outcomes.labels("refused").inc()
            raise HandoffError(502, f"the prefill server's K/V was refused: {e}") from None
        request = self.request
        if seq is None:                             # no device room now: prefill it here
            self.outcomes.labels("prefilled_locally").inc()
            return server.submit(request)
        try:
            rid = server.submit_prefilled(request, seq, self.first_token)
        except BaseException:
            mgr.close(seq)
            raise
        self.outcomes.labels("imported").inc()
        return rid


class DecodeSide:
    """``--role decode``: prefills each request on the prefill server (see the module doc)."""

    def __init__(self, st: Any, prefill_url: str, handoff_timeout: float, workers: int = 8):
        from jax_kvcm.handoff import KVReceiver
        self.st, self.url, self.timeout = st, prefill_url.rstrip("/"), handoff_timeout
        for outcome in DECODE_OUTCOMES:
            st.metrics.handoffs.labels(outcome)
        self.receiver = KVReceiver()
        self.fetch_lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(workers,
                                                          thread_name_prefix="kvcm-handoff")

    async def hand_in(self, c: Client, h: Handle) -> None:
        """Prefills ``h``'s request on the prefill server and hands it to the engine (or ends
        it when the first token did); ApiError when the handoff failed."""
        st, req = self.st, h.request
        vocab = st.engine.server.config.vocab_size
        bad = [t for t in req.prompt if not 0 <= t < vocab]
        if bad:          # refused here: the prefill server would refuse it as its own fault
            raise ApiError(400, f"token ids out of range [0, {vocab}): {bad[:5]}",
                           param="prompt")
        if len(req.prompt) + req.max_new_tokens > st.max_seq_len:
            raise ApiError(400, f"{len(req.prompt)} prompt + {req.max_new_tokens} new tokens "
                                f"exceed max_seq_len {st.max_seq_len}", reason="too_long")
        loop = asyncio.get_running_loop()
        try:
            exported, first, reason = await c.wait(loop.run_in_executor(self.pool, self._pull,
                                                                        req))
        except HandoffError as e:
            raise ApiError(e.status, str(e), {"Retry-After": "1"} if e.status in (429, 503)
                           else None, reason="unavailable" if e.status == 503 else "handoff")
        if not st.engine.accepting:
            raise ApiError(503, "the server is shutting down" if st.engine.healthy
                           else f"the engine failed: {st.engine.last_error}", reason="unavailable")
        if exported is None:
            st.metrics.handoffs.labels("finished_at_prefill").inc()
            st.engine.end_unsubmitted(h, [first], reason)
            return
        st.engine.submit(h, Prefilled(req, exported, first, st.model_name, st.metrics.handoffs))

    def _pull(self, req: serve.Request) -> tuple[Any, int, str | None]:
        """Worker thread: ``(export or None, first token, finish reason or None)``."""
        answer = self._post("/internal/prefill", {
            "prompt": list(req.prompt), "max_tokens": req.max_new_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
            "model": self.st.model_name})
        ticket, first = answer.get("ticket"), int(answer["first_token"])
        if ticket is None:
            return None, first, str(answer.get("finish_reason") or "length")
        try:
            if list(ticket.get("token_ids", ())) != list(req.prompt):
                raise HandoffError(502, "the prefill server offered the K/V of another prompt "
                                        f"({len(ticket.get('token_ids', ()))} tokens)")
            with self.fetch_lock:
                try:
                    export = self.receiver.fetch(ticket, timeout=self.timeout)
                except TimeoutError as e:
                    raise HandoffError(504, str(e)) from None
                except Exception as e:  # noqa: BLE001  (the transfer failed: answered)
                    raise HandoffError(502, f"pulling the K/V failed: {type(e).__name__}: "
                                            f"{e}") from None
            return export, first, None
        finally:
            try:
                self._post("/internal/forget", {"transfer_id": int(ticket["transfer_id"])})
            except HandoffError as e:   # it drops the offer after --handoff-timeout anyway
                log.warning("could not tell the prefill server to forget: %s", e)

    def _post(self, path: str, body: dict) -> dict:
        """Worker thread: a JSON POST to the prefill server; HandoffError naming what failed."""
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read())["error"]["message"]
            except Exception:  # noqa: BLE001  (not OpenAI's shape)
                msg = e.reason
            status = e.code if e.code in (429, 503) else 502
            raise HandoffError(status, f"the prefill server at {self.url} answered {e.code}: "
                                       f"{msg}") from None
        except (urllib.error.URLError, OSError) as e:
            why = getattr(e, "reason", e)
            status = 504 if isinstance(why, TimeoutError) else 503
            raise HandoffError(status, f"the prefill server at {self.url} is unreachable: "
                                       f"{why}") from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def add_role_args(p: Any) -> None:
    """The ``--role``, ``--prefill-url`` and ``--handoff-timeout`` flags."""
    from . import run
    a = p.add_argument
    a("--role", choices=ROLES, default="both",
      help="both: one server prefills and decodes; prefill: computes prompts for a decode "
           "server (internal routes /internal/prefill and /internal/forget); decode: the server "
           "clients talk to, which has --prefill-url prefill each prompt and pulls its K/V "
           "(default: %(default)s)")
    a("--prefill-url", default=None, metavar="URL",
      help="with --role decode: the prefill server, e.g. http://127.0.0.1:8001")
    a("--handoff-timeout", type=run.real, default=30.0, metavar="S",
      help="seconds a prefill call or a K/V pull may take, and an offer waits to be pulled "
           "(default: %(default)s)")


def check_role_args(p: Any, args: Any) -> None:
    """``p.error`` for role flags that do not go together."""
    if args.role == "decode" and not args.prefill_url:
        p.error("argument --role: decode needs --prefill-url (the prefill server)")
    if args.prefill_url and args.role != "decode":
        p.error("argument --prefill-url: only with --role decode")
    if args.prefill_url and not args.prefill_url.startswith(("http://", "https://")):
        p.error(f"argument --prefill-url: an http:// URL, got {args.prefill_url!r}")
    if args.handoff_timeout <= 0:
        p.error(f"argument --handoff-timeout: must be > 0, got {args.handoff_timeout}")
