"""The engine thread behind the HTTP server: one thread owns :class:`serve.Server` (its manager
and the device); the asyncio side only opens, cancels and reads requests through it.

- :meth:`Engine.open` (event loop) queues a submission and returns a :class:`Handle` whose
  ``queue`` (an ``asyncio.Queue`` of that loop) receives, in order: ``("ok",)`` or ``("error",
  status, message)``, then ``("tokens", [ids])`` per step that produced tokens, then ``("end",
  reason)`` with reason ``eos``, ``length`` or ``cancelled``. A bounded number of requests may be
  open at once (running + queued); :meth:`open` returns None beyond it (the caller answers 429).
- :meth:`Engine.cancel` (event loop, any time, idempotent) ends a request before the next step.
- Disaggregated prefill (:mod:`._http_roles`): :meth:`Engine.open` with ``submit=False`` holds a
  slot while the prompt is prefilled elsewhere; :meth:`Engine.submit` then hands the request in
  with its ``prefilled`` K/V (admitted in the engine thread by ``prefilled.admit(server)``), or
  :meth:`Engine.end_unsubmitted` answers it with the tokens it already has. On the prefill side
  a request with ``keep_sequence`` gets ``("kept", export)`` before its end: its sequence
  exported (``export_sequence(seq, model_id)``, or the exception) and closed.
- The thread loops: take commands (submit, cancel, snapshot), run one ``Server.step``, hand every
  request's new tokens to its loop in one ``call_soon_threadsafe`` per step.
- :meth:`Engine.begin_shutdown` / :meth:`Engine.stop` (blocking): stop admission, let running
  requests finish until a deadline, cancel the rest, shut the manager down (``shutdown()``:
  waits for the steps in flight, disk files removed, host memory freed); ``stop`` also joins
  the thread.

Latency metrics are observed where tokens are delivered (the event loop): time to first token
from :meth:`open`, inter-token latency between consecutive deliveries of one request.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import sys
import threading
import time
from typing import Any

from . import serve

__all__ = ["Engine", "Handle"]

log = logging.getLogger("examples.llama.server")

SWITCH_INTERVAL_S = 5e-4
# Histogram buckets (seconds).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


@dataclasses.dataclass(eq=False)
class Handle:
    """One open request, as the event loop sees it (``rid``: the engine's request id)."""

    request: serve.Request
    queue: asyncio.Queue
    opened_at: float
    rid: int | None = None
    last_token_at: float | None = None
    submitted: bool = False            # handed to the engine thread (see Engine.open)
    prefilled: Any = None              # K/V prefilled elsewhere: .admit(server) -> request id
    done: bool = False                 # a terminal item was delivered (event loop side)
    ended: bool = False                # the engine is done with it (engine side)


class Engine:
    """See the module doc. ``max_open``: requests open at once (running + queued) before
    :meth:`open` refuses; ``metrics``: an object with ``ttft`` and ``itl`` histograms
    (``observe(seconds)``) or None; ``model_id``: what exported sequences are labelled with."""

    def __init__(self, server: serve.Server, *, max_open: int, metrics: Any = None,
                 model_id: str = ""):
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        self.server = server
        self.max_open = max_open
        self.metrics = metrics
        self.model_id = model_id
        self.num_open = 0                  # event-loop side count of open handles
        self.healthy = True
        self.last_error: str | None = None
        self._cmds: collections.deque = collections.deque()   # thread-safe append/popleft
        self._wake = threading.Event()
        self._by_rid: dict[int, Handle] = {}
        self._live: set[Handle] = set()
        self._stopping = threading.Event()
        self._deadline = float("inf")
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.finished = collections.Counter()   # engine side: eos / length / cancelled / error
        self._thread = threading.Thread(target=self._run, name="kvcm-engine", daemon=True)

    # -- event loop side ------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts the engine thread; tokens go to ``loop``. Also shortens the interpreter's GIL
        switch interval (process-wide, 5 ms -> 0.5 ms): when a step's device wait ends, the
        engine thread gets the GIL back from the event loop within 0.5 ms instead of 5."""
        self._loop = loop
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return not self._stopping.is_set() and self.healthy

    def open(self, request: serve.Request, *, submit: bool = True) -> Handle | None:
        """Queues ``request``; None when ``max_open`` requests are open already. With
        ``submit=False`` it only takes a slot: :meth:`submit` or :meth:`end_unsubmitted` follow
        (or :meth:`cancel`, which frees the slot)."""
        if self.num_open >= self.max_open:
            return None
        self.num_open += 1
        h = Handle(request, asyncio.Queue(), time.perf_counter())
        if submit:
            self.submit(h)
        return h

    def submit(self, h: Handle, prefilled: Any = None) -> None:
        """Hands an open handle to the engine thread (no-op once it ended), with the K/V
        another engine ``prefilled`` (an object whose ``admit(server)`` returns the request id
        it submitted, or raises ValueError; a ``status`` attribute gives the HTTP status)."""
        if h.done or h.submitted:
            return
        h.submitted, h.prefilled = True, prefilled
        self._command("submit", h)

    def end_unsubmitted(self, h: Handle, tokens: list[int], reason: str) -> None:
        """Answers an unsubmitted handle with ``tokens`` and ends it (``reason``: ``eos`` or
        ``length``), e.g. a request the prefill engine's first token already finished."""
        if h.done or h.submitted:
            return
        h.submitted = True
        self._command("answer", (h, tokens, reason))

    def cancel(self, h: Handle) -> None:
        """Ends ``h`` within one step (no-op once it ended); an unsubmitted one at once."""
        if h.done:
            return
        if not h.submitted:
            h.submitted = h.ended = h.done = True
            self.num_open -= 1
            return
        self._command("cancel", h)

    async def snapshot(self, timeout: float = 30.0) -> dict[str, Any]:
        """The engine's report and request counts, taken between two steps."""
        fut = asyncio.get_running_loop().create_future()
        self._command("snapshot", fut)
        return await asyncio.wait_for(fut, timeout)

    def _command(self, kind: str, arg: Any) -> None:
        self._cmds.append((kind, arg))
        self._wake.set()

    def _deliver(self, items: list, now: float) -> None:
        """Event loop: hands one step's items to their handles."""
        m = self.metrics
        for h, kind, payload in items:
            if h.done:
                continue
            if kind == "tokens":
                if m is not None:
                    if h.last_token_at is None:
                        m.ttft.observe(now - h.opened_at)
                    else:
                        m.itl.observe(now - h.last_token_at)
                h.last_token_at = now
                h.queue.put_nowait(("tokens", payload))
                continue
            if kind in ("end", "error"):
                h.done = True
                self.num_open -= 1
            h.queue.put_nowait((kind, *payload) if kind == "error" else (kind, payload))

    # -- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                items: list = []
                self._take_commands(items)
                stopping = self._stopping.is_set()
                if stopping and (not self._live or time.perf_counter() >= self._deadline):
                    for h in list(self._live):
                        self._cancel(h, items)
                    self._flush(items)
                    break
                if self.server.has_work() and self.healthy:
                    self._step(items)
                self._flush(items)
                if not items and not (self.server.has_work() and self.healthy):
                    self._wake.wait(0.1 if stopping else 1.0)
        except BaseException as e:  # noqa: BLE001  (the thread must not die silently)
            self.healthy = False
            self.last_error = f"{type(e).__name__}: {e}"
            log.exception("engine thread failed")
        finally:
            self._close()

    def _take_commands(self, items: list) -> None:
        while self._cmds:
            kind, arg = self._cmds.popleft()
            if kind == "submit":
                self._submit(arg, items)
            elif kind == "cancel":
                self._cancel(arg, items)
            elif kind == "answer":
                self._answer(*arg, items)
            else:
                self._snapshot(arg)

    def _answer(self, h: Handle, tokens: list[int], reason: str, items: list) -> None:
        """:meth:`end_unsubmitted` in the engine thread (the finish counters live here)."""
        h.ended = True
        self.finished[reason] += 1
        items += [(h, "ok", None), (h, "tokens", tokens), (h, "end", reason)]

    def _submit(self, h: Handle, items: list) -> None:
        if self._stopping.is_set() or not self.healthy:
            items.append((h, "error", (503, "the server is shutting down" if self.healthy
                                       else f"the engine failed: {self.last_error}")))
            h.ended = True
            return
        try:
            h.rid = (self.server.submit(h.request) if h.prefilled is None
                     else h.prefilled.admit(self.server))
        except ValueError as e:         # can never fit, bad values, or a refused handoff
            items.append((h, "error", (getattr(e, "status", 400), str(e))))
            h.ended = True
            return
        self._by_rid[h.rid] = h
        self._live.add(h)
        items.append((h, "ok", None))

    def _cancel(self, h: Handle, items: list) -> None:
        if h.ended or h.rid is None:
            return
        if self.server.cancel(h.rid) is not None:
            self.finished["cancelled"] += 1
        self._end(h, "cancelled", items)

    def _end(self, h: Handle, reason: str, items: list, error: str | None = None) -> None:
        h.ended = True
        self._live.discard(h)
        self._by_rid.pop(h.rid, None)
        items.append((h, "error", (500, f"the request failed: {error}")) if reason == "error"
                     else (h, "end", reason))

    def _step(self, items: list) -> None:
        try:
            finished = self.server.step()
        except Exception as e:  # noqa: BLE001  (fail the requests, keep serving /health)
            log.exception("engine step failed")
            self.healthy = False
            self.last_error = f"{type(e).__name__}: {e}"
            for h in list(self._live):
                h.ended = True
                self._live.discard(h)
                self.finished["error"] += 1
                items.append((h, "error", (500, f"the engine failed: {self.last_error}")))
            return
        for rid, tokens in self.server.new_tokens().items():
            h = self._by_rid.get(rid)
            if h is not None:
                items.append((h, "tokens", tokens))
        for out in finished:
            self.server.pop_output(out.request_id)
            h = self._by_rid.get(out.request_id)
            if out.sequence is not None:
                exported = self._export_and_close(out.sequence, h is not None)
                if h is not None:
                    items.append((h, "kept", exported))
            if h is not None:
                self.finished[out.finish_reason] += 1
                self._end(h, out.finish_reason, items, out.error)

    def _export_and_close(self, seq: Any, wanted: bool) -> Any:
        """A kept sequence (``Request.keep_sequence``) exported (if ``wanted``; the exception if
        that failed), then closed."""
        mgr = self.server.manager
        try:
            return mgr.export_sequence(seq, self.model_id) if wanted else None
        except Exception as e:  # noqa: BLE001  (answered to its request)
            log.exception("export_sequence failed")
            return e
        finally:
            mgr.close(seq)

    def _flush(self, items: list) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, items, time.perf_counter())
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _snapshot(self, fut: asyncio.Future) -> None:
        try:
            rep = self.server.report()
            st = self.server.manager.stats()
            snap = dict(report=rep, running=st["num_active"], suspended=st["num_suspended_now"],
                        open=len(self._live), finished=dict(self.finished),
                        healthy=self.healthy)
            snap["queued"] = max(0, snap["open"] - snap["running"] - snap["suspended"])
            res: Any = snap
        except Exception as e:  # noqa: BLE001
            res = e
        self._loop.call_soon_threadsafe(_resolve, fut, res)

    def _close(self) -> None:
        """Engine thread, last: answers what is left, shuts the manager down (files, memory)."""
        items: list = []
        for h in list(self._live):
            try:
                self._cancel(h, items)
            except Exception:  # noqa: BLE001  (a failed engine: end the stream regardless)
                log.exception("cancel at shutdown failed")
                self._end(h, "cancelled", items)
        while self._cmds:
            kind, arg = self._cmds.popleft()
            if kind == "submit":
                items.append((arg, "error", (503, "the server is shutting down")))
            elif kind == "answer":
                self._answer(*arg, items)
            elif kind == "snapshot":
                self._loop.call_soon_threadsafe(_resolve, arg, RuntimeError("engine stopped"))
        self._flush(items)
        self._shutdown_manager()

    def _shutdown_manager(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # Waits for the fences of dispatched steps and migrations, then closes the storage
            # (disk files removed, host memory freed).
            self.server.manager.shutdown()
        except Exception:  # noqa: BLE001
            log.exception("shutting the manager down failed")

    # -- shutdown ---------------------------------------------------------------------------

    def begin_shutdown(self, timeout: float) -> None:
        """Stops admission now; running requests may finish for ``timeout`` seconds, then the
        rest are cancelled (their streams end) and the engine shuts the manager down. Returns at
        once; a second call changes nothing."""
        if not self._stopping.is_set():
            self._deadline = time.perf_counter() + max(0.0, timeout)
            self._stopping.set()
        self._wake.set()

    def begin_shutdown_from_signal(self, timeout: float) -> None:
        """:meth:`begin_shutdown` from a signal handler (run on the event loop: a handler must
        not take the locks the interrupted code may hold)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.begin_shutdown, timeout)

    def stop(self, timeout: float = 0.0) -> None:
        """:meth:`begin_shutdown`, then waits for the engine thread to finish. Blocking;
        idempotent."""
        self.begin_shutdown(timeout)
        if self._thread.is_alive():
            self._thread.join()
        else:                      # never started
            self._shutdown_manager()


def _resolve(fut: asyncio.Future, res: Any) -> None:
    if fut.done():
        return
    if isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)
