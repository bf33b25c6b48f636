"""Timing helpers shared by the benchmarks (JAX: wall clock around a dispatch loop; torch: events).

JAX: the callable (already compiled by the caller) is dispatched ``iters`` times back to back and
the loop is closed with ``block_until_ready`` on the last output, so the host only waits once and
per-call dispatch overlaps with device work; a sample is the loop time / ``iters``; the result is
the median of ``repeats`` samples. ``iters`` is chosen so one sample lasts about ``target_s``.

torch: ``triton.testing.do_bench(fn, return_mode="median")`` when triton is importable (it flushes
L2 between calls and times each call with CUDA events), else a CUDA-event loop like the JAX one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def short_error(e: BaseException) -> str:
    """``Type: message`` on one line, without ``|`` (markdown tables), at most 300 characters."""
    msg = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return msg if len(msg) <= 300 else msg[:297] + "..."


_torch_import: list[tuple[Any, str | None]] = []  # [(torch or None, why not)] after the 1st try


def import_torch(*, need_cuda: bool = False) -> tuple[Any, str | None]:
    """``(torch, None)``, or ``(None, why)`` when torch does not import (or, with ``need_cuda``,
    sees no CUDA device). Imported on the first call: after JAX owns the device."""
    if not _torch_import:
        try:
            import torch
            _torch_import.append((torch, None))
        except Exception as e:  # noqa: BLE001
            _torch_import.append((None, f"torch unavailable ({short_error(e)})"))
    torch, why = _torch_import[0]
    if torch is not None and need_cuda and not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    return torch, why


def time_blocking(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn()`` (which must block until its work is done) over ``repeats``
    calls, after two untimed calls (compilation, warm-up): for steps that feed their outputs
    into the next call (donated caches), where :func:`time_jax`'s rotation does not apply."""
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def time_jax(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], *, warmup: int = 3,
             repeats: int = 7, target_s: float = 0.05, min_iters: int = 3,
             max_iters: int = 200) -> dict[str, Any]:
    """Median per-call time of ``fn`` in ms, rotating over ``arg_sets`` (one tuple of args each)."""
    import jax

    n = len(arg_sets)
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % n]))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    est = time.perf_counter() - t0  # an overestimate (includes one host sync); fine for sizing
    iters = int(min(max_iters, max(min_iters, round(target_s / max(est, 1e-7)))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for i in range(iters):
            out = fn(*arg_sets[i % n])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters * 1e3)
        del out
    return {"ms": statistics.median(samples), "samples_ms": samples, "iters": iters,
            "method": "jax wall-clock loop + block_until_ready"}


def time_torch(fn: Callable[[], Any], *, warmup_ms: int = 25, rep_ms: int = 100,
               repeats: int = 7, loop: bool = False) -> dict[str, Any]:
    """Median per-call time of a CUDA torch callable in ms: triton's do_bench (one call between
    L2 flushes) where importable, else (or with ``loop``) calls back to back between two CUDA
    events, as ``time_jax`` times JAX calls."""
    import torch

    try:
        from triton.testing import do_bench
    except Exception:  # noqa: BLE001 - triton missing or broken: fall back to events
        do_bench = None
    if do_bench is not None and not loop:
        ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        return {"ms": float(ms), "method": "triton.testing.do_bench median"}

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    est_ms = max(start.elapsed_time(end), 1e-4)
    iters = int(min(200, max(3, round(rep_ms / repeats / est_ms))))
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return {"ms": statistics.median(samples), "samples_ms": samples, "iters": iters,
            "method": "cuda event loop median"}
