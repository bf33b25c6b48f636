"""Where the serving loop's time goes (issue 9, items 3 and 5), for ``benchmarks/bench_serve.py``.

- :func:`loop_stats`: from the loop's own timings (``ServeConfig.record_steps``: one
  ``StepRecord`` per dispatched step), per step kind (decode-only, mixed, prefill-only) the
  count, the step time p50/p90 (the interval between its tokens and the previous step's tokens
  reaching the host: with the overlapped loop, the pace of the device, or of the host when the
  host is slower), the host time of the ``step()`` call that dispatched it (its wall time less
  the time it blocked reading the previous step's tokens), how long reading its own tokens
  blocked (> 0: the device was the bottleneck and the host work was hidden), and its share of
  the total; and per phase (ramp-up, steady state, tail) the steps, seconds and share.
- :class:`ProfileWindow`: a ``jax.profiler`` trace of ``N`` consecutive steps of a paged run,
  started in steady state, where the next request is about to finish (so the window holds
  decode-only steps and the mixed steps that prefill the requests admitted in its place).
- :func:`step_breakdown`: the trace's device time per step kind by category
  (``benchmarks/harness/device_profile.py``: weight GEMMs, paged / ragged attention, K/V writes,
  sampling, FP8 scales, collectives, norms/RoPE/other), the device idle inside a step, other
  programs (migrations) between steps, and the device idle before a step (host gaps: what the
  overlapped loop should hide).

Phases: ramp-up runs until the first decode-only step at the run's full batch (``min(concurrency,
requests)`` rows: every admitted prompt prefilled); the tail starts at the first step planned
with no request waiting and fewer than the full batch running (the batch drains); steady state
is in between (a run whose batch never fills with decodes has no steady state).
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
from typing import Any, Sequence

import jax
import numpy as np

from benchmarks.harness import device_profile

KINDS = ("decode", "mixed", "prefill")
PHASES = ("ramp-up", "steady", "tail")


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else 0.0


def phases(records: Sequence[Any], full_batch: int) -> list[str]:
    """The phase of each record (see the module doc)."""
    out, phase = [], "ramp-up"
    for r in records:
        if phase == "ramp-up" and r.kind == "decode" and r.decode_rows >= full_batch:
            phase = "steady"
        if phase != "tail" and r.waiting == 0 and r.running < full_batch:
            phase = "tail"
        out.append(phase)
    return out


def step_times(records: Sequence[Any]) -> list[dict[str, float]]:
    """Per record (read ones), in seconds: ``step`` (its tokens' arrival - the previous
    record's), ``wall`` (its ``step()`` call), ``host`` (that call less the time it blocked on
    reads), ``blocked`` (how long reading its own tokens blocked)."""
    read = [r for r in records if r.t_ready > 0]
    out = []
    for i, r in enumerate(read):
        prev = read[i - 1].t_ready if i else r.t_start
        waits = sum(x.wait_s for x in read[max(0, i - 2):i + 1]
                    if r.t_start <= x.t_ready <= r.t_end)
        wall = r.t_end - r.t_start
        out.append({"index": r.index, "step": r.t_ready - prev, "wall": wall,
                    "host": max(0.0, wall - waits), "blocked": r.wait_s})
    return out


def loop_stats(records: Sequence[Any], full_batch: int, run_s: float,
               exclude: set[int] = frozenset()) -> dict[str, Any]:
    """Per step kind and per phase, from ``StepRecord``s (see the module doc). ``run_s``: the
    run's wall time (the steps' total is compared with it); ``exclude``: record indices left
    out (the profiled window, slowed by the tracer, and the steps around it, whose intervals
    hold the tracer's start and stop)."""
    phase = dict(zip((r.index for r in records), phases(records, full_batch)))
    times = {t["index"]: t for t in step_times(records) if t["index"] not in exclude}
    total = sum(t["step"] for t in times.values())
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        rs = [r for r in records if r.kind == kind and r.index in times]
        ts = [times[r.index] for r in rs]
        if not rs:
            continue
        ms = lambda key, q: _pct([t[key] * 1e3 for t in ts], q)  # noqa: E731
        kinds[kind] = {
            "steps": len(rs), "rows_mean": float(np.mean([r.rows for r in rs])),
            "tokens_mean": float(np.mean([r.tokens for r in rs])),
            "step_ms_p50": ms("step", 50), "step_ms_p90": ms("step", 90),
            "host_ms_p50": ms("host", 50), "host_ms_p90": ms("host", 90),
            "blocked_ms_p50": ms("blocked", 50),
            "seconds": sum(times[r.index]["step"] for r in rs),
            "share": sum(times[r.index]["step"] for r in rs) / total if total else 0.0}
    by_phase: dict[str, Any] = {}
    for p in PHASES:
        rs = [r for r in records if phase[r.index] == p and r.index in times]
        if not rs:
            continue
        secs = sum(times[r.index]["step"] for r in rs)
        by_phase[p] = {"steps": len(rs), **{k: sum(r.kind == k for r in rs) for k in KINDS},
                       "seconds": secs, "share": secs / total if total else 0.0,
                       "step_ms_mean": secs / len(rs) * 1e3,
                       "rows_mean": float(np.mean([r.rows for r in rs]))}
    # Decode steps at the full batch: what a roofline at the full batch compares with (the
    # decode p50 over all of them mixes in the ramp-up's and the tail's smaller batches).
    full = [times[r.index] for r in records
            if r.kind == "decode" and r.decode_rows >= full_batch and r.index in times]
    full_decode = ({} if not full else
                   {"steps": len(full), "step_ms_p50": _pct([t["step"] * 1e3 for t in full], 50),
                    "host_ms_p50": _pct([t["host"] * 1e3 for t in full], 50),
                    "blocked_ms_p50": _pct([t["blocked"] * 1e3 for t in full], 50)})
    return {"full_batch": full_batch, "steps": len(records), "steps_seconds": total,
            "run_seconds": run_s, "excluded_steps": len(exclude),
            "new_programs": sum(r.new_program for r in records), "kinds": kinds,
            "phases": by_phase, "full_decode": full_decode}


def format_loop(name: str, s: dict[str, Any]) -> str:
    """Markdown tables of :func:`loop_stats`."""
    lines = [f"Loop timings, {name} ({s['steps']} steps, {s['steps_seconds']:.2f} s of steps in a "
             f"{s['run_seconds']:.2f} s run; step = interval between consecutive steps' tokens "
             "reaching the host; host = the step() call less its blocking read; blocked = "
             "the read of its tokens waiting on the device"
             + (f"; {s['excluded_steps']} steps in and around the profiled window (the "
                f"tracer's start and stop are outside the run's clock) left out"
                if s["excluded_steps"] else "") + "):",
             "| kind | steps | rows | tokens | step ms p50 | p90 | host ms p50 | p90 | "
             "blocked ms p50 | seconds | share |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, k in s["kinds"].items():
        lines.append(f"| {kind} | {k['steps']} | {k['rows_mean']:.0f} | {k['tokens_mean']:.0f} | "
                     f"{k['step_ms_p50']:.2f} | {k['step_ms_p90']:.2f} | {k['host_ms_p50']:.2f} | "
                     f"{k['host_ms_p90']:.2f} | {k['blocked_ms_p50']:.2f} | {k['seconds']:.2f} | "
                     f"{k['share']:.1%} |")
    lines += ["", f"| phase (full batch {s['full_batch']}) | steps | decode | mixed | prefill | "
              "rows | step ms mean | seconds | share |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p, k in s["phases"].items():
        lines.append(f"| {p} | {k['steps']} | {k['decode']} | {k['mixed']} | {k['prefill']} | "
                     f"{k['rows_mean']:.0f} | {k['step_ms_mean']:.2f} | {k['seconds']:.2f} | "
                     f"{k['share']:.1%} |")
    if s["steps_seconds"] > 1.05 * s["run_seconds"] + 0.5:
        lines.append(f"WARNING: the steps span {s['steps_seconds'] - s['run_seconds']:.2f} s more "
                     "than the run's clock: the device ran steps in time left out of it, so this "
                     "run's tokens/s is overstated")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The profiled window.


def split_by_calls(step_ms: Sequence[float], decode: Sequence[bool],
                   calls_after: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """The arena's decode steps split by its native calls (``--arena-step-calls``).

    ``step_ms[i]``: the ``Server.step()`` call of step ``i`` (its host work, its map / create
    calls included, and, overlapped, the read of step ``i - 1``'s tokens); ``calls_after[i]``:
    the (map, create) calls made so far after it. A host cost of the calls shows in the step
    that made them; a device stall they cause delays that step's execution, which the next
    step's read waits for. So each decode step is put in one group by the calls of its own
    step and in another by those of the step before. Per group: steps, p50 and p90 ms."""
    made = np.diff(np.asarray([(0, 0)] + list(calls_after)), axis=0).sum(axis=1) > 0
    ms, dec = np.asarray(step_ms), np.asarray(decode, bool)
    before = np.concatenate([[False], made[:-1]])

    def group(mask: np.ndarray) -> dict[str, float]:
        x = ms[mask & dec]
        return {"steps": int(x.size), "p50_ms": _pct(x, 50) if x.size else 0.0,
                "p90_ms": _pct(x, 90) if x.size else 0.0}
    p90 = _pct(ms[dec], 90) if dec.any() else 0.0
    slow = dec & (ms > p90)
    return {"with_calls": group(made), "without_calls": group(~made),
            "after_calls": group(before), "after_none": group(~before),
            "decode_p90_ms": p90, "slow_steps": int(slow.sum()),
            "slow_with_or_after_calls": int((slow & (made | before)).sum())}


def format_split(name: str, s: dict[str, Any]) -> str:
    """:func:`split_by_calls` as a table."""
    lines = [f"{name}: decode steps by the arena's map / create calls (--arena-step-calls; "
             f"{s['slow_with_or_after_calls']} of the {s['slow_steps']} steps over the p90 "
             f"{s['decode_p90_ms']:.2f} ms made calls or followed a step that did)",
             "| group | steps | p50 ms | p90 ms |", "|---|---:|---:|---:|"]
    for k, label in (("with_calls", "made calls"), ("without_calls", "made none"),
                     ("after_calls", "after a step that made calls"),
                     ("after_none", "after one that made none")):
        g = s[k]
        lines.append(f"| {label} | {g['steps']} | {g['p50_ms']:.2f} | {g['p90_ms']:.2f} |")
    return "\n".join(lines)


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, np.ndarray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


class ProgramCapture:
    """Wraps a server's device step (``Server._model_step``, the loop's seam for hooks) and
    keeps the abstract arguments of each program it runs, to get the program's optimized HLO
    afterwards (:meth:`hlo`). Adds a dict lookup per step."""

    def __init__(self, server: Any):
        self.fn = server._model_step
        self.args: dict[tuple, tuple] = {}
        server._model_step = self

    def __call__(self, *args: Any, decode: bool, greedy: bool, with_logits: bool) -> Any:
        batch = args[6]
        key = ("decode" if decode else "forward", batch.seq_lens.shape[0],
               batch.positions.shape[0])
        if key not in self.args:
            self.args[key] = (jax.tree_util.tree_map(_abstract, args),
                              dict(decode=decode, greedy=greedy, with_logits=with_logits))
        return self.fn(*args, decode=decode, greedy=greedy, with_logits=with_logits)

    def hlo(self, key: tuple) -> str:
        """The optimized HLO text of the program ``(program, batch bucket, token bucket)``
        (compiled once more, outside the run: XLA does not hand out the text of what it ran;
        the same program of a later run comes from a cache)."""
        args, static = self.args[key]
        leaves, tree = jax.tree_util.tree_flatten(args)
        sig = (tree, tuple((getattr(x, "shape", x), str(getattr(x, "dtype", ""))) for x in leaves),
               tuple(sorted(self.fn.keywords.items())), tuple(sorted(static.items())))
        if sig not in _HLO_CACHE:
            _HLO_CACHE[sig] = self.fn.func.lower(*args, **self.fn.keywords,
                                                 **static).compile().as_text()
        return _HLO_CACHE[sig]


_HLO_CACHE: dict[tuple, str] = {}


class ProfileWindow:
    """Traces ``steps`` consecutive steps of one run into ``out_dir`` (see the module doc).
    Call :meth:`before` before and :meth:`after` after every ``Server.step()``."""

    def __init__(self, out_dir: str, steps: int, full_batch: int):
        self.out_dir, self.steps, self.full_batch = out_dir, steps, full_batch
        self.indices: list[int] = []      # the records dispatched inside the trace
        self.state = "waiting"            # -> "tracing" -> "done"
        self.ramp_done = False
        self.reason = ""
        self._first = 0                   # the last record before the trace started

    def before(self, server: Any) -> None:
        if self.state != "waiting":
            return
        recs = server.step_records
        if recs:
            last = recs[-1]
            if last.kind == "decode" and last.decode_rows >= self.full_batch:
                self.ramp_done = True
            if self.ramp_done and last.min_tokens_left <= self.steps // 2:
                self._start(server, "steady state, a request finishing mid-window")
            elif last.waiting == 0 and last.min_tokens_left <= self.steps // 2:
                self._start(server, "a request finishing mid-window, the batch never full of "
                            "decodes" if not self.ramp_done else "the tail")

    def after(self, server: Any) -> None:
        if self.state == "tracing":
            rec = server.step_records[-1] if server.step_records else None
            if rec is not None and (not self.indices or rec.index > self.indices[-1]) \
                    and rec.index > self._first:
                self.indices.append(rec.index)
            if len(self.indices) >= self.steps or not server.has_work():
                self.stop(server)

    def _start(self, server: Any, reason: str) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        self._first = server.step_records[-1].index if server.step_records else 0
        self.reason = reason
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0      # no event per Python call: the host loop runs as usual
        jax.profiler.start_trace(self.out_dir, create_perfetto_trace=True,
                                 profiler_options=opts)
        self.state = "tracing"

    def stop(self, server: Any) -> None:
        """Waits for the last traced step to complete, then stops the trace."""
        if self.state != "tracing":
            return
        jax.block_until_ready(server.manager.caches)  # the last dispatched step's outputs
        jax.profiler.stop_trace()
        self.state = "done"


def _slug(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name).strip("_")


def profile_dir(root: str, run_name: str) -> str:
    return os.path.join(root, _slug(run_name))


def step_breakdown(window: ProfileWindow, records: Sequence[Any], capture: ProgramCapture,
                   params: Any) -> dict[str, Any]:
    """Device milliseconds per step kind and category over the traced window (see the module
    doc), plus ``other_top``: the largest ops in "norms/RoPE/other" (name, ms per step, the
    HLO instruction's result and op where the name matches one)."""
    trace = device_profile.load_trace(window.out_dir)
    by_index = {r.index: r for r in records}
    recs = [by_index[i] for i in window.indices if i in by_index]
    cats = {key: device_profile.hlo_categories(capture.hlo(key), params) for key in capture.args}
    known = set().union(*cats.values()) if cats else set()

    named = any("model_step" in x.name for x in trace.executions)

    def is_step(x: device_profile.Execution) -> bool:
        if named:                        # GPU: the "XLA Modules" line names the program
            return "model_step" in x.name
        names = [o.name for o in x.ops]  # CPU (or unnamed modules): the step's instructions
        return len(names) >= 8 and sum(n in known for n in names) >= 0.8 * len(names)

    steps = [x for x in trace.executions if is_step(x)]
    # NOTE: the trace stops after the window's last step completed; a step dispatched before
    # it started may show first (partly): align from the end. The first step's gap is not
    # measured (the host started the tracer before dispatching it).
    n = min(len(steps), len(recs))
    pairs = list(zip(recs[len(recs) - n:], steps[len(steps) - n:]))
    first_start = pairs[0][1].start if pairs else 0.0
    others = [x for x in trace.executions if not is_step(x)]
    rows: dict[str, collections.Counter] = {}
    counts: collections.Counter = collections.Counter()
    unknown: collections.Counter = collections.Counter()
    prev_end = None
    for rec, x in pairs:
        key = (rec.program, rec.batch_bucket, rec.token_bucket)
        c = device_profile.attribute(x.ops, cats.get(key, {}), trace.on_device, unknown)
        busy = sum(o.dur for o in x.ops if o.ts < x.end)
        c["idle inside the step"] += max(0.0, (x.end - x.start) - busy)
        if prev_end is not None:
            between = sum(min(o.end, x.start) - max(o.start, prev_end) for o in others
                          if o.end > prev_end and o.start < x.start)
            c["other programs"] += between
            c["idle before the step (host gap)"] += max(0.0, x.start - prev_end - between)
            c["_gaps"] += 1
        prev_end = x.end
        rows.setdefault(rec.kind, collections.Counter()).update(c)
        rows.setdefault("all", collections.Counter()).update(c)
        counts[rec.kind] += 1
        counts["all"] += 1
    out: dict[str, Any] = {"dir": window.out_dir, "reason": window.reason,
                           "window_steps": len(window.indices), "traced_step_programs": len(steps),
                           "matched": n, "on_device": trace.on_device,
                           "span_ms": ((pairs[-1][1].end - first_start) / 1e3 if pairs else 0.0),
                           "kinds": {}}
    for kind in KINDS + ("all",):
        if kind not in rows:
            continue
        c, k = rows[kind], counts[kind]
        gaps = max(1, c.pop("_gaps", 0))
        row = {cat: c[cat] / 1e3 / k for cat in device_profile.CATEGORIES}
        row["idle inside the step"] = c["idle inside the step"] / 1e3 / k
        row["other programs"] = c["other programs"] / 1e3 / gaps
        row["idle before the step (host gap)"] = c["idle before the step (host gap)"] / 1e3 / gaps
        row["total"] = sum(row.values())
        out["kinds"][kind] = {"steps": k, "ms_per_step": row}
    total_steps = max(1, counts["all"])
    shapes = {}
    for key in capture.args:
        shapes.update(device_profile.instruction_shapes(capture.hlo(key)))
    out["other_top"] = [(name, us / 1e3 / total_steps, shapes.get(name.replace(".", "_"), ""))
                        for name, us in unknown.most_common(5)]
    return out


BREAKDOWN_COLUMNS = device_profile.CATEGORIES + ("idle inside the step", "other programs",
                                           "idle before the step (host gap)", "total")


def format_breakdown(name: str, b: dict[str, Any]) -> str:
    """A markdown table of :func:`step_breakdown`."""
    where = "device ops" if b["on_device"] else "CPU thunks (a smoke run: no device timeline)"
    lines = [f"Device time per step, {name} (jax.profiler, {b['window_steps']} steps from "
             f"{b['reason']}; {b['matched']} matched to traced step programs, {where}; ms per "
             f"step; trace in {b['dir']}):",
             "| kind | steps | " + " | ".join(BREAKDOWN_COLUMNS) + " |",
             "|---|---:|" + "---:|" * len(BREAKDOWN_COLUMNS)]
    for kind, k in b["kinds"].items():
        lines.append(f"| {kind} | {k['steps']} | "
                     + " | ".join(f"{k['ms_per_step'][c]:.3f}" for c in BREAKDOWN_COLUMNS) + " |")
    if b["other_top"]:
        lines.append("largest ops in norms/RoPE/other (ms per step; the HLO instruction's "
                     "result where the name matches one): "
                     + ", ".join(f"{n} {ms:.3f}" + (f" ({shape})" if shape else "")
                                 for n, ms, shape in b["other_top"]))
        if any("command" in n.lower() for n, _, _ in b["other_top"]):
            lines.append("(XLA ran ops as CUDA graphs, whose kernels the trace does not name: "
                         "XLA_FLAGS=--xla_gpu_enable_command_buffer= shows them op by op)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# --prefill-chunk with several values.


def _tag(res: dict[str, Any], tag: str) -> dict[str, Any]:
    """``res`` (one ``bench`` output) with `` [tag]`` after every run name, wherever it
    appears (results, errors, comparisons, agreement)."""
    names = {r["name"] for r in res["results"]} | {e["name"] for e in res["errors"]}
    rename = {n: f"{n} [{tag}]" for n in names}

    def fix(d: dict) -> dict:
        return {k: rename.get(v, v) if isinstance(v, str) else v for k, v in d.items()}

    return {"setup": res["setup"], "results": [fix(r) for r in res["results"]],
            "errors": [fix(e) for e in res["errors"]],
            "comparisons": [fix(c) for c in res["comparisons"]],
            "agreement": [fix(a) for a in res["agreement"]]}


def digests(outputs: Sequence[Any]) -> list[str]:
    """A short digest of each request's generated ids (``RequestOutput`` list): runs of a
    sweep compare their tokens through these."""
    return [hashlib.sha1(np.asarray(o.generated_ids, np.int64).tobytes()).hexdigest()[:16]
            for o in outputs]


_SWEEP_TAG = re.compile(r" \[(?:chunk|tp) \d+\]$")
# The sweeps: --prefill-chunk values ("chunk") and --tensor-parallel values ("tp"), and the key of
# each value in merge_sweep's "sweep" list.
SWEEP_KEYS = {"chunk": "prefill_chunk", "tp": "tensor_parallel"}


def sweep_base(name: str) -> str:
    """A sweep run's name without its `` [chunk N]`` / `` [tp N]`` tag."""
    return _SWEEP_TAG.sub("", name)


def sweep_agreement(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each run of a sweep, every later value (prefill chunk, tensor parallelism) against
    the first: requests whose generated tokens are identical (neither the chunk size nor the
    device split may change a float32 greedy run; bfloat16 kernels may round a near-tie
    differently)."""
    first: dict[str, dict] = {}
    out = []
    for r in results:
        if "generated_digests" not in r:
            continue
        run = sweep_base(r["name"])
        if run not in first:
            first[run] = r
            continue
        a, b = first[run]["generated_digests"], r["generated_digests"]
        out.append({"a": first[run]["name"], "b": r["name"], "requests": len(a),
                    "identical": sum(x == y for x, y in zip(a, b)),
                    "identical_first_token": None, "max_logits_rel_l2": None})
    return out


def merge_sweep(parts: Sequence[tuple[int, dict[str, Any]]], tag: str = "chunk") -> dict[str, Any]:
    """One ``bench`` output per value of a sweep (``tag``: "chunk", ``--prefill-chunk``
    values; "tp", ``--tensor-parallel`` values) -> one output, run names tagged `` [chunk N]``
    / `` [tp N]`` (plus :func:`sweep_agreement` in ``agreement``); ``setup`` is the first
    value's, ``sweep`` lists each value's setup."""
    key = SWEEP_KEYS[tag]
    out: dict[str, Any] = {"setup": parts[0][1]["setup"], "results": [], "errors": [],
                           "comparisons": [], "agreement": [], "skipped": [],
                           "sweep": [{key: c, "setup": r["setup"]} for c, r in parts]}
    for i, (value, res) in enumerate(parts):
        tagged = _tag(res, f"{tag} {value}")
        if i:     # the equal-memory comparison runs with the first value only: once
            tagged["comparisons"] = [c for c in tagged["comparisons"]
                                     if c["kind"] != "equal_memory"]
        for key in ("results", "errors", "comparisons", "agreement"):
            out[key] += tagged[key]
        out["skipped"] += [f"{label} [{tag} {value}]" for label in res.get("skipped", [])]
    out["agreement"] += sweep_agreement(out["results"])
    return out


def format_sweep(results: Sequence[dict[str, Any]]) -> str:
    """The paged rows of a ``--prefill-chunk`` sweep side by side (one line per run and
    value; ``programs``: step programs the run used, each (batch bucket, token bucket) pair
    compiles a decode and a forward program; ``warm-up compiles``: XLA compiles before the
    clock, and their seconds)."""
    rows = [r for r in results if r["path"] in ("paged", "arena") and "loop" in r]
    base = lambda r: sweep_base(r["name"])  # noqa: E731
    order = {n: i for i, n in enumerate(dict.fromkeys(base(r) for r in rows))}
    rows.sort(key=lambda r: (order[base(r)], r["prefill_chunk_tokens"]))
    lines = ["Prefill chunk sweep (ServeConfig.prefill_chunk_tokens; step budget = concurrency "
             "+ chunk):",
             "| run | chunk | step budget | output tok/s | TTFT p50 s | TTFT p90 s | ITL p50 ms | "
             "ITL p90 ms | decode step ms | mixed step ms p50 | mixed p90 | mixed steps | "
             "programs | warm-up compiles (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        mixed = r["loop"]["kinds"].get("mixed", {})
        lines.append(
            f"| {base(r)} | {r['prefill_chunk_tokens']} | {r['step_tokens']} | "
            f"{r['output_tokens_per_s']:,.0f} | {r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | "
            f"{r['itl_p50_ms']:.1f} | {r['itl_p90_ms']:.1f} | {r['decode_step_ms_p50']:.2f} | "
            f"{mixed.get('step_ms_p50', 0.0):.2f} | {mixed.get('step_ms_p90', 0.0):.2f} | "
            f"{mixed.get('steps', 0)} | {r['compiled_programs']} | {r['warmup_compiles']} "
            f"({r['warmup_compile_s']:.1f}) |")
    return "\n".join(lines)
