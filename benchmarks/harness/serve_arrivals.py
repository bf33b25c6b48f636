"""``--request-rate R``: the serving benchmark's paged requests arriving as a Poisson process
instead of all at once.

The gaps between arrivals are exponential draws of mean ``1 / R`` from
``numpy.random.default_rng(--arrival-seed)`` (the first request arrives at 0, request ``i`` at the
sum of the first ``i`` draws). The run's loop submits a request to the ``Server`` once its clock
passes the request's arrival time, keeps stepping the running requests in between, and sleeps
until the next arrival when the server is idle. The server times a request from its submission
(``RequestOutput.time_to_first_token_s``; the scheduler stamps ``submitted_at`` in ``submit``); a
request waits for the step in flight before it is submitted, so its TTFT from arrival is the
server's plus that wait (:meth:`Arrivals.ttft_s`). The gaps between its tokens (ITL) do not
depend on the origin. Without a rate (or ``inf``) the run submits every request before its clock
starts and reports the server's TTFT as it always did."""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from benchmarks.harness.run_log import pct


def request_rate(text: str) -> float | None:
    """``--request-rate``'s argparse type: requests per second, a number > 0; ``inf``: every
    request at once (None, the default mode)."""
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if math.isnan(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(
            f"must be requests per second > 0 (or inf: all at once), got {text!r}")
    return None if math.isinf(rate) else rate


def arrival_times(n: int, rate: float | None, seed: int) -> np.ndarray:
    """Seconds from the run's start at which ``n`` requests arrive: 0, then the running sum of
    ``n - 1`` exponential gaps of mean ``1 / rate`` drawn from ``default_rng(seed)``; all at 0
    without a rate."""
    if rate is None:
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


class Arrivals:
    """One run's requests against its clock (seconds since the run began, the loop's pauses
    outside the clock excluded): :meth:`submit_due` submits those whose arrival time passed and
    records when each submission returned."""

    def __init__(self, requests: Sequence[Any], rate: float, seed: int):
        self.requests = list(requests)
        self.rate, self.seed = rate, seed
        self.times = arrival_times(len(self.requests), rate, seed)
        self.rids: list[int] = []          # the server's request id of each submitted request
        self.submitted: list[float] = []   # the clock when each submit() returned

    @property
    def pending(self) -> bool:
        """Requests not submitted yet."""
        return len(self.rids) < len(self.requests)

    def submit_due(self, server: Any, clock: Callable[[], float]) -> float:
        """Submits, in order, every request whose arrival time ``clock()`` has passed; returns
        the seconds until the next arrival (0.0 when every request is submitted)."""
        now = clock()
        while self.pending and self.times[len(self.rids)] <= now:
            self.rids.append(server.submit(self.requests[len(self.rids)]))
            now = clock()
            self.submitted.append(now)
        return max(0.0, float(self.times[len(self.rids)]) - now) if self.pending else 0.0

    def ttft_s(self, outs: Mapping[int, Any]) -> list[float]:
        """Each request's time to first token from its arrival (in request order): the server's
        (from submission) plus the submission's delay behind the arrival (``outs``: the server's
        outputs by request id)."""
        return [outs[rid].time_to_first_token_s + (sub - arr)
                for rid, sub, arr in zip(self.rids, self.submitted, self.times)]

    def stats(self) -> dict[str, Any]:
        """The result's arrival keys: the rate asked for and its seed; the achieved arrival rate
        (gaps over the first to the last submission, on the run's clock); how late the loop
        submitted behind the schedule (p50 / p90 / max ms: a request that arrives while a step
        runs waits for it)."""
        sub = np.asarray(self.submitted)
        lag = (sub - self.times[:len(sub)]) * 1e3
        span = float(sub[-1] - sub[0]) if len(sub) > 1 else 0.0
        return dict(request_rate=self.rate, arrival_seed=self.seed,
                    achieved_arrival_rate=(len(sub) - 1) / span if span > 0 else None,
                    scheduled_arrival_span_s=float(self.times[-1]) if len(self.times) else 0.0,
                    arrival_span_s=span, submit_lag_ms_p50=pct(lag, 50),
                    submit_lag_ms_p90=pct(lag, 90),
                    submit_lag_ms_max=float(lag.max()) if len(lag) else 0.0)
