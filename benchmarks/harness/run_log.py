"""Logging for the long benchmark runs: lines flushed at once, XLA compiles counted (a compile
inside a timed region is flagged), device memory in use, progress lines with the pace."""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import numpy as np


def log(*a: Any) -> None:
    print(*a, flush=True)


COMPILES: dict[str, Any] = {"n": 0, "s": 0.0, "names": []}  # names: (function, seconds)


def _on_duration(event: str, duration: float, *args: Any, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES["n"] += 1
        COMPILES["s"] += float(duration)
        COMPILES["names"].append((str(kwargs.get("fun_name", "?")), float(duration)))


def compiled_between(n0: int, n1: int) -> list[str]:
    """``"function (seconds)"`` of the XLA compiles counted while ``COMPILES["n"]`` went from
    ``n0`` to ``n1``."""
    return [f"{name} ({sec:.1f} s)" for name, sec in COMPILES["names"][n0:n1]]


try:  # counts XLA compiles (a compile in a timed region is flagged); absent: no flag
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    COUNTING_COMPILES = True
except Exception:  # noqa: BLE001
    COUNTING_COMPILES = False


def device_memory_stats() -> dict[str, Any]:
    """The first device's allocator statistics (``{}`` where the backend keeps none)."""
    try:
        return jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001  (backends without memory stats raise)
        return {}


def mem_gib() -> str:
    st = device_memory_stats()
    if "bytes_in_use" not in st:
        return ""
    return (f" [device memory {st['bytes_in_use'] / 2**30:.1f} GiB in use, peak "
            f"{st.get('peak_bytes_in_use', 0) / 2**30:.1f} GiB]")


def pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else 0.0


class Progress:
    """A line every ``every_s`` seconds on long runs."""

    def __init__(self, label: str, total_tokens: int, every_s: float = 5.0):
        self.label, self.total, self.every = label, total_tokens, every_s
        self.t0 = self.last = time.perf_counter()

    def __call__(self, tokens: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            el = now - self.t0
            rate = tokens / el if el > 0 else 0.0
            eta = f", ~{(self.total - tokens) / rate:.0f} s left" if rate > 0 else ""
            log(f"    {self.label}: {tokens}/{self.total} tokens generated, {el:.1f} s "
                 f"({rate:,.0f} tok/s{eta})")

