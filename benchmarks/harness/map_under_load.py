"""Does an arena map stall the device? ``python -m benchmarks.bench_arena_map --under-load``.

The arena's decode step p90 on the GPU is about twice paged's in the phase where fresh ranges
grow (fresh chunks created and mapped), while the host time of those maps (tens of
microseconds each) is far too small to explain it. What is left is the device side, and this
measures it directly: a jitted program that keeps the GPU busy for a few milliseconds (a chain
of matmuls, on XLA's stream as a serving step is) is dispatched, and while it runs the host maps
(or unmaps, or creates or releases the physical memory of) ``k`` super-pages of a reservation.
Reported per operation and ``k``:

  idle ms        the ``k`` calls with the device idle
  busy ms        the same calls while the program runs: about the program's remaining time if
                 the driver waits for the device to go idle first
  program ms     the program alone, dispatch to ready
  with calls ms  the program with the calls made while it runs, dispatch to ready: more than
                 ``program`` if the calls slow the device or serialize the next dispatch
  next gap ms    a second program dispatched right after the calls, its extra time over two
                 programs back to back without calls (a stall between steps)

Medians of ``repeats``. On the CPU (``--cpu``, the memfd reservation) it is a smoke test.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

CALLS = (1, 8, 64)
PROGRAM_N = 2048   # the program's [n, n] float32 operand on the GPU: 16 MiB


def busy_program(target_ms: float, x: jax.Array | None = None,
                 ) -> tuple[Callable[[jax.Array], jax.Array], jax.Array, float]:
    """``(fn, x, ms)``: a jitted chain of ``[n, n]`` matmuls by ``x`` (default: a new array)
    that takes about ``target_ms`` on the default device (calibrated here; ``ms`` the measured
    median)."""
    if x is None:
        n = _program_n()
        x = jnp.ones((n, n), jnp.float32) / n

    def make(iters: int):
        @jax.jit
        def fn(a):
            return jax.lax.fori_loop(0, iters, lambda _, b: jnp.tanh(b @ a), a)
        return fn

    iters = 8
    while True:
        fn = make(iters)
        ms = _median_ms(lambda: fn(x).block_until_ready(), 3)
        if ms >= target_ms or iters >= 1 << 16:
            return fn, x, ms
        iters = max(iters * 2, int(iters * target_ms / max(ms, 1e-3)))


def _program_n() -> int:
    return PROGRAM_N if jax.default_backend() != "cpu" else 256


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def under_load_rows(native: Any, super_page_bytes: int, target_ms: float = 20.0,
                    calls: tuple[int, ...] = CALLS, repeats: int = 7,
                    same_reservation: bool = False) -> list[dict]:
    """One row per (operation, k): map or unmap of ``k`` super-pages, idle and under a running
    program (see the module doc). ``same_reservation``: the program's operand is the first
    super-pages of the reservation the calls change (as the arena's step reads its pools while
    other slots are mapped); else memory of its own."""
    n = _program_n()
    resident = -(-n * n * 4 // super_page_bytes) if same_reservation else 0
    res = native.Reservation((resident + max(calls)) * super_page_bytes, super_page_bytes)
    handles = res.create_physical_many(resident + max(calls))
    operand = None
    if same_reservation:
        res.map_many([i * super_page_bytes for i in range(resident)], handles[:resident])
        fill = np.full((n, n), 1.0 / n, np.float32)
        res.write(0, fill.ctypes.data, fill.nbytes)
        operand = jax.dlpack.from_dlpack(res.dlpack(0, [n, n], "float32"))
    fn, x, program_ms = busy_program(target_ms, operand)
    handles = handles[resident:]
    rows = []
    try:
        for k in calls:
            offs = [(resident + i) * super_page_bytes for i in range(k)]
            for op, (prepare, calls_, finish) in _operations(res, offs, handles[:k]).items():
                rows.append(_measure(op, k, fn, x, program_ms, prepare, calls_, finish,
                                     repeats) | {"super_page_bytes": super_page_bytes,
                                                 "same_reservation": same_reservation})
    finally:
        del fn, x, operand
        res.close()
    return rows


def _operations(res: Any, offs: list[int], handles: list[int]) -> dict[str, tuple]:
    """Per operation, ``(prepare, calls, finish)``: the state before the timed calls, the ``k``
    native calls, and back to the start (every offset unmapped, ``handles`` created)."""
    made: list[int] = []

    def nothing():
        pass

    def map_all():
        res.map_many(offs, handles)

    def unmap_all():
        res.unmap_many(offs)

    def map_each():
        for off, h in zip(offs, handles):
            res.map(off, h)

    def unmap_each():
        for off in offs:
            res.unmap(off)

    def create_each():   # cuMemCreate: the physical memory of a fresh chunk
        made.extend(res.create_physical() for _ in handles)

    def release_made():
        res.release_physical_many(made)
        made.clear()

    def create_all():
        made.extend(res.create_physical_many(len(handles)))

    def release_each():
        while made:
            res.release_physical(made.pop())
    return {"map": (nothing, map_each, unmap_all), "unmap": (map_all, unmap_each, nothing),
            "create": (nothing, create_each, release_made),
            "release": (create_all, release_each, nothing)}


def _measure(op: str, k: int, fn, x, program_ms: float, prepare, calls, finish,
             repeats: int) -> dict:
    idle, busy, with_calls, pair, pair_calls = [], [], [], [], []
    for _ in range(repeats):
        prepare()
        t0 = time.perf_counter()
        calls()
        idle.append((time.perf_counter() - t0) * 1e3)
        finish()

        prepare()
        t0 = time.perf_counter()
        y = fn(x)
        t1 = time.perf_counter()
        calls()
        t2 = time.perf_counter()
        y.block_until_ready()
        t3 = time.perf_counter()
        busy.append((t2 - t1) * 1e3)
        with_calls.append((t3 - t0) * 1e3)
        finish()

        t0 = time.perf_counter()
        fn(fn(x)).block_until_ready()
        pair.append((time.perf_counter() - t0) * 1e3)

        prepare()
        t0 = time.perf_counter()
        y = fn(x)
        calls()
        y = fn(y)
        y.block_until_ready()
        pair_calls.append((time.perf_counter() - t0) * 1e3)
        finish()
    med = statistics.median
    return {"op": op, "calls": k, "idle_ms": round(med(idle), 4), "busy_ms": round(med(busy), 4),
            "program_ms": round(program_ms, 3), "with_calls_ms": round(med(with_calls), 3),
            "next_gap_ms": round(med(pair_calls) - med(pair), 3)}


def print_rows(rows: list[dict], backend: str) -> None:
    where = ("reading the same reservation" if rows[0]["same_reservation"] else
             "on memory of its own")
    print(f"\n{backend}: map / unmap / create / release of k super-pages of "
          f"{rows[0]['super_page_bytes'] >> 10} KiB while a {rows[0]['program_ms']:.1f} ms "
          f"program runs, {where} (medians)")
    print("| op | k | idle ms | busy ms | program ms | with calls ms | next gap ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['op']} | {r['calls']} | {r['idle_ms']:.3f} | {r['busy_ms']:.3f} | "
              f"{r['program_ms']:.2f} | {r['with_calls_ms']:.2f} | {r['next_gap_ms']:.2f} |")
