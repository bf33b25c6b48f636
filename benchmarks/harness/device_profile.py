"""Where device time goes: a ``jax.profiler`` trace's device ops attributed to categories through
the compiled HLO (shared by ``benchmarks/decode_step.py`` and ``benchmarks/serve.py --profile``).

Categories (:data:`CATEGORIES`): weight GEMMs (dots, GEMM custom calls, fusions that contain one),
weight copies (instructions that materialize a layer's weight matrix, see :func:`weight_copy_ops`),
paged attention (the ``paged_attention`` custom call: decode), ragged attention
(``ragged_paged_attention``: prefill and mixed steps), K/V writes (``write_kv``), sampling (ops
under ``jax.named_scope("sampling")``), FP8 scales (the activation quantization and the scale
multiplies of FP8 weights' GEMMs: ops under ``jax.named_scope("fp8_scales")``, see
``examples/llama/fp8_weights.py``; a fusion counts by its root's scope, so a scale multiply
fused into a residual add counts there, and a fusion rooted in the quantization that also
computes its input's norm or SiLU (a reduce, rsqrt, logistic, ... outside the scope) counts as
other, since that work is the bf16 step's too), collectives
(tensor parallelism's all-reduce / all-gather / reduce-scatter / collective-permute / all-to-all,
their async ``*-start`` / ``*-done`` halves and fusions or async wrappers around them; on a GPU
also NCCL's kernels, ``ncclDevKernel_AllReduce_Sum_bf16_RING_LL``, ``ncclKernel_...``),
norms/RoPE/other (everything else).

The trace: on a GPU the device's "XLA Ops" line (else its kernels, named by their ``hlo_op``
argument when present; a kernel named after its instruction with ``.`` as ``_``, as jax 0.11's
traces name fusions, is matched to it: :func:`kernel_named`) and its "XLA Modules" line (one
span per program execution; without one, as in jax 0.11's traces, the executions are read from
the kernels' ``hlo_module`` arguments: :func:`_executions_from_kernels`); on the CPU
the thunks XLA runs (named by their HLO instruction), one execution per ``ThunkExecutor::Execute``
span (the thunks on its thread inside it). With several CPU devices
(``--xla_force_host_platform_device_count``, a tensor-parallel step) each device runs its part of
an SPMD program on a thread of XLA's pool, the span ended there by a ``ThunkExecutor::Execute
(wait for completion)`` marker naming its ``device_ordinal``: only device 0's executions are kept
(as on a GPU, shard 0), so each step is counted once.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re

CATEGORIES = ("weight GEMMs", "weight copies", "paged attention", "ragged attention",
              "K/V writes", "sampling", "FP8 scales", "collectives", "norms/RoPE/other")
FP8_SCALES = "FP8 scales"
COLLECTIVES = "collectives"
OTHER = "norms/RoPE/other"
SKIP = "skip"          # container instructions (while, call): their bodies' ops count
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = .*? ([\w-]+)\(")
_HEAD = re.compile(r"^\s*(?:ENTRY )?%?([\w.-]+) .*\{\s*$")
_GEMM_TARGETS = ("cublas", "gemm", "matmul")
_GEMM_KERNELS = _GEMM_TARGETS + ("cutlass", "nvjet", "xmma")
_CONTAINERS = ("while", "conditional", "call")
# ffi/cuda's kernels (names as CUDA reports them, lower-cased): ragged_prefill.cu, paged_decode.cu
_RAGGED_KERNELS = ("raggedprefill", "schedulekernel", "fillpaddingkernel")
_PAGED_KERNELS = ("pageddecode", "combinesplits")
_CPU_THUNK = re.compile(r"[a-z0-9_.-]+")
# XLA's collective HLO ops (an async one as "<op>-start" / "<op>-done")
_COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                   "all-to-all", "ragged-all-to-all", "collective-broadcast")
# GPU kernels of collectives (lower-cased): NCCL's (ncclDevKernel_AllReduce_..., ncclKernel_...)
# and XLA's own one-shot all-reduce kernels
_COLLECTIVE_KERNELS = ("nccl", "allreduce", "all_reduce", "all-reduce", "allgather", "all_gather",
                       "all-gather", "reducescatter", "reduce_scatter", "reduce-scatter",
                       "collectivepermute", "collective_permute", "alltoall", "all_to_all")
_ASYNC_WRAPPERS = ("fusion", "async-start", "async-update", "async-done")
_CPU_EXECUTE = "ThunkExecutor::Execute"


def weight_copy_ops(hlo_text: str, params) -> list[str]:
    """The instructions of an optimized HLO module (``jitted.lower(...).compile().as_text()``)
    that produce a buffer shaped like one layer's weight matrix (``[in, out]``, or ``[1, in,
    out]``): a slice, dynamic-slice, copy, transpose or fusion that materializes weights. A step
    that feeds each GEMM its weight buffer as it is has none; the stacked-layer scan has one
    dynamic-slice (or copy fusion) per weight per layer. ``params``: the per-layer params tree
    (its 2-D layer weights give the shapes to look for)."""
    shapes = {tuple(int(d) for d in w.shape) for lp in params["layers"] for w in lp.values()
              if len(w.shape) == 2}
    found = []
    pattern = (r"^\s*(?:ROOT )?%?[\w.-]+ = \w+\[([\d,]*)\]\S* "
               r"(copy|dynamic-slice|slice|transpose|fusion)\(")
    for line in hlo_text.splitlines():
        m = re.match(pattern, line)
        if m is None:
            continue
        dims = tuple(int(d) for d in m.group(1).split(",") if d)
        while len(dims) > 2 and dims[0] == 1:
            dims = dims[1:]
        if dims in shapes:
            found.append(line.strip())
    return found


def instruction_shapes(hlo_text: str) -> dict[str, str]:
    """Instruction name as GPU kernels are named (:func:`kernel_named`) -> ``"<result> <op>"``
    (e.g. ``"f8e4m3fn[858,4096]{1,0} fusion"``) for every instruction of an HLO module. XLA
    reuses one kernel for identical fusions, so a kernel's time can cover several of them."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"^\s*(?:ROOT )?%?([\w.-]+) = (\S+) ([\w-]+)\(", line)
        if m:
            out[m.group(1)] = f"{m.group(2)} {m.group(3)}"
    return kernel_named(out)


def _instructions(hlo_text: str):
    """(computation or None, instruction name, opcode, line) for each instruction line of an
    HLO module's text, in order."""
    comp = None
    for line in hlo_text.splitlines():
        head = _HEAD.match(line)
        if head and "=" not in line.split("{")[0]:
            comp = head.group(1)
            continue
        m = _INSTR.match(line)
        if m is not None:
            yield comp, m.group(1), m.group(2), line


def instruction_scopes(hlo_text: str) -> dict[str, list[str]]:
    """Instruction name -> the ``op_name`` metadata paths it carries: its own and, for a fusion,
    those of the instructions of the computation it calls (deduplicated, in order). Used to
    explain what the time left in "norms/RoPE/other" was in the JAX program."""
    own, called, inner = {}, {}, collections.defaultdict(list)
    for comp, name, _, line in _instructions(hlo_text):
        op_name = re.search(r'op_name="([^"]*)"', line)
        if op_name:
            own[name] = op_name.group(1)
            if comp is not None and op_name.group(1) not in inner[comp]:
                inner[comp].append(op_name.group(1))
        calls = re.search(r"calls=%?([\w.-]+)", line)
        if calls:
            called[name] = calls.group(1)
    names = set(own) | set(called)
    out = {}
    for name in names:
        paths = [own[name]] if name in own else []
        out[name] = paths + [p for p in inner.get(called.get(name, ""), []) if p not in paths]
    return out


def explain_other(unknown: collections.Counter, hlo_text: str, per: float,
                  top: int = 8) -> list[dict]:
    """The ``top`` largest ops of "norms/RoPE/other" (``unknown`` from :func:`attribute`, in
    microseconds; divided by ``per``, e.g. steps x 1e3 for ms per step) with the named scopes
    behind them: ``{"op", "ms", "in_hlo", "scopes"}``, scopes as the last three components of
    each ``op_name`` path. ``in_hlo`` False: the trace's name matched no instruction."""
    scopes = instruction_scopes(hlo_text)
    as_kernels = kernel_named(scopes)
    rows = []
    for name, us in unknown.most_common(top):
        paths = lookup(scopes, as_kernels, name)
        rows.append({"op": name, "ms": us / per, "in_hlo": paths is not None,
                     "scopes": ["/".join(p.split("/")[-3:]) for p in paths or []][:6]})
    return rows


def kernel_named(by_instruction: dict) -> dict:
    """``by_instruction`` keyed as a GPU trace names the kernels: an HLO instruction's name with
    ``.`` as ``_`` (``fusion.870`` -> ``fusion_870``; jax 0.11's traces on an H100)."""
    return {k.replace(".", "_"): v for k, v in by_instruction.items()}


def lookup(by_instruction: dict, as_kernels: dict, name: str):
    """The entry of a trace op ``name`` (an HLO instruction, ``instruction:suffix``, or a kernel
    named after an instruction, see :func:`kernel_named`), or None."""
    for table in (by_instruction, as_kernels):
        for key in (name, name.split(":")[0]):
            if key in table:
                return table[key]
    return None


def gemm_census(hlo_text: str) -> dict[str, int]:
    """How an optimized HLO module's GEMMs run: ``cublaslt_fp8`` (``__cublas$lt$matmul$f8``,
    FP8 tensor cores), ``cublas`` (any other cuBLAS / cuBLASLt call), ``triton`` (a Triton GEMM
    fusion), ``dot`` (a plain dot left to the backend: the CPU's)."""
    out = {"cublaslt_fp8": 0, "cublas": 0, "triton": 0, "dot": 0}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            continue
        op = m.group(2)
        target = _call_target(line)
        if target == "__cublas$lt$matmul$f8":
            out["cublaslt_fp8"] += 1
        elif "cublas" in target:
            out["cublas"] += 1
        elif op == "fusion" and "__triton_gemm" in line:
            out["triton"] += 1
        elif op == "dot":
            out["dot"] += 1
    return out


def _call_target(line: str) -> str:
    """An HLO instruction line's ``custom_call_target`` ("" for other instructions)."""
    m = re.search(r'custom_call_target="([^"]+)"', line)
    return m.group(1) if m else ""


def _is_gemm_line(line: str, op: str) -> bool:
    target = _call_target(line).lower()
    return (op in ("dot", "convolution") or any(t in target for t in _GEMM_TARGETS)
            or "__triton_gemm" in line or '"kind":"__cublas' in line)


def is_collective_op(op: str) -> bool:
    """Whether an HLO opcode is a collective (:data:`_COLLECTIVE_OPS`, or its async half)."""
    for suffix in ("-start", "-done"):
        if op.endswith(suffix):
            op = op[:-len(suffix)]
    return op in _COLLECTIVE_OPS


def _computations_with(hlo_text: str, pred) -> set[str]:
    """Computations holding an instruction for which ``pred(line, opcode)`` holds, directly or
    through the computations they call (a fusion may wrap a cuBLAS custom call in a nested
    computation; an async wrapper a collective)."""
    direct, calls = set(), collections.defaultdict(set)
    for comp, _, op, line in _instructions(hlo_text):
        if comp is None:
            continue
        if pred(line, op):
            direct.add(comp)
        for callee in re.findall(r"(?:calls|to_apply|body)=%?([\w.-]+)", line):
            calls[comp].add(callee)
    found, changed = set(direct), True
    while changed:
        changed = False
        for comp, callees in calls.items():
            if comp not in found and callees & found:
                found.add(comp)
                changed = True
    return found


def _gemm_computations(hlo_text: str) -> set[str]:
    """Computations that hold a GEMM (a dot, a GEMM custom call), directly or nested."""
    return _computations_with(hlo_text, _is_gemm_line)


# Opcodes of a norm's or an activation's own work: a quantization fusion that holds one of
# these from outside the fp8_scales scope is that producer's kernel with the cast fused in.
_PRODUCER_WORK = ("reduce", "rsqrt", "sqrt", "logistic", "exponential", "tanh", "sine",
                  "cosine")


def _in_scope(line: str, scope: str) -> bool:
    """Whether an HLO line's op_name lies under ``jax.named_scope(scope)``."""
    op_name = re.search(r'op_name="([^"]*)"', line)
    return bool(op_name and re.search(rf"(^|/){scope}(/|$)", op_name.group(1)))


def _is_producer_work(line: str, op: str) -> bool:
    return op in _PRODUCER_WORK and not _in_scope(line, "fp8_scales")


def _first_operand(line: str) -> str | None:
    m = re.search(r" [\w-]+\(%?([\w.-]+)", line.split(" = ", 1)[-1])
    return m.group(1) if m else None


def hlo_categories(hlo_text: str, params=None) -> dict[str, str]:
    """Instruction name -> category (:data:`CATEGORIES`, or :data:`SKIP` for containers) for
    every instruction of an optimized HLO module. ``params``: the per-layer params (for weight
    copies; None: no weight-copy category)."""
    copies = set()
    if params is not None:
        copies = {m.group(1) for line in weight_copy_ops(hlo_text, params)
                  if (m := _INSTR.match(line))}
    gemm_comps = _gemm_computations(hlo_text)
    coll_comps = _computations_with(hlo_text, lambda line, op: is_collective_op(op))
    producer_comps = _computations_with(hlo_text, _is_producer_work)
    cats = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            continue
        name, op = m.groups()
        target = _call_target(line).lower()
        calls = re.search(r"calls=%?([\w.-]+)", line)
        if op in _CONTAINERS:
            cat = SKIP
        elif is_collective_op(op) or (op in _ASYNC_WRAPPERS and calls
                                      and calls.group(1) in coll_comps):
            cat = COLLECTIVES
        elif op in ("async-update", "async-done") and cats.get(_first_operand(line)) \
                == COLLECTIVES:
            cat = COLLECTIVES     # the other half of a collective's async-start
        elif name in copies:
            cat = "weight copies"
        elif "ragged" in target and "attention" in target:
            cat = "ragged attention"
        elif "attention" in target:
            cat = "paged attention"
        elif "write_kv" in target:
            cat = "K/V writes"
        elif _is_gemm_line(line, op) or (op == "fusion" and calls
                                         and calls.group(1) in gemm_comps):
            cat = "weight GEMMs"
        elif _in_scope(line, "sampling"):
            cat = "sampling"
        elif _in_scope(line, "fp8_scales"):
            cat = OTHER if calls and calls.group(1) in producer_comps else FP8_SCALES
        else:
            cat = OTHER
        cats[name] = cat
    return cats


def kernel_category(name: str) -> str:
    """The category of a GPU kernel (or op) name the HLO does not know."""
    n = name.lower()
    if any(k in n for k in _COLLECTIVE_KERNELS):
        return COLLECTIVES
    if "ragged" in n or any(k in n for k in _RAGGED_KERNELS):
        return "ragged attention"
    if "attention" in n or any(k in n for k in _PAGED_KERNELS):
        return "paged attention"
    if "write_kv" in n or "writekv" in n:
        return "K/V writes"
    if any(t in n for t in _GEMM_KERNELS):
        return "weight GEMMs"
    return OTHER


@dataclasses.dataclass(slots=True)
class Op:
    name: str
    ts: float     # microseconds
    dur: float


@dataclasses.dataclass(slots=True)
class Execution:
    """One program execution on the device: its span and its ops (time order)."""

    name: str
    start: float  # microseconds
    end: float
    ops: list[Op]


@dataclasses.dataclass
class Trace:
    """The device side of a perfetto trace (see the module doc)."""

    on_device: bool          # a GPU's device lines (else the CPU's thunks)
    ops: list[Op]
    executions: list[Execution]


def _trace_file(trace_dir: str) -> str:
    files = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise RuntimeError(f"jax.profiler wrote no perfetto trace under {trace_dir}")
    return max(files, key=os.path.getmtime)


def _op_name(e: dict) -> str:
    """A device event's HLO instruction: its ``hlo_op`` argument, except for kernels XLA ran in a
    CUDA graph, whose ``hlo_op`` is the graph's thunk (``command_buffer_N``): their kernel name
    (an XLA fusion's kernel is named after the fusion; library kernels by their own names)."""
    hlo = (e.get("args") or {}).get("hlo_op")
    return hlo if hlo and not hlo.startswith("command_buffer") else e["name"]


def _executions_from_kernels(events: list[dict]) -> list[Execution]:
    """Program executions from the kernels' own arguments, for traces without an "XLA Modules"
    line (jax 0.11 on the H200: kernels on "Stream #N(Compute...)" lines, each with its program
    in ``hlo_module``). A new execution starts where the program changes or where a kernel of the
    current execution recurs (the same CUDA graph node, else the same instruction and kernel):
    a program runs each of its kernels once (the runner's layer loop is unrolled)."""
    execs: list[Execution] = []
    seen: set = set()
    module = None
    for e in events:
        a = e.get("args") or {}
        mod = a.get("hlo_module")
        if mod is None:
            continue
        key = ((a["cuda_graph_id"], a.get("cuda_graph_node_id")) if "cuda_graph_id" in a
               else (a.get("hlo_op"), e["name"]))
        ts, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if mod != module or key in seen:
            execs.append(Execution(mod, ts, end, []))
            module, seen = mod, set()
        seen.add(key)
        execs[-1].end = max(execs[-1].end, end)
    return execs


def _copy_stream(line_name: str) -> bool:
    """A stream line that only copies ("Stream #15(MemcpyH2D)"). The compute stream may copy too:
    jax 0.11.2 on the H100 names it "Stream #14(MemcpyD2D,Compute,Memset)", and its kernels are
    the program's ops."""
    return "Memcpy" in line_name and "Compute" not in line_name


def _device_index(process_name: str) -> int:
    m = re.search(r"/device:[A-Za-z_]+:(\d+)", process_name)
    return int(m.group(1)) if m else 1 << 30


def read_perfetto(path: str) -> tuple[list[dict], dict, dict]:
    """A perfetto trace file's events, ``{pid: process name}`` and ``{(pid, tid): line name}``."""
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    return events, procs, threads


def load_trace(trace_dir: str, kernel_names: bool = False) -> Trace:
    """The device ops and program executions of the perfetto trace ``jax.profiler`` wrote under
    ``trace_dir`` (``jax.profiler.trace(dir, create_perfetto_trace=True)``); ``kernel_names``:
    a GPU op named by its kernel, not its HLO instruction."""
    events, procs, threads = read_perfetto(_trace_file(trace_dir))
    xs = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: float(e["ts"]))
    device = {pid for pid, n in procs.items() if "/device:" in n and "CPU" not in n}
    if device:
        # the first device (one GPU, or shard 0): "/device:GPU:0" before "/device:GPU:1"
        pid = min(device, key=lambda p: (_device_index(procs[p]), p))

        def line(e):
            return threads.get((e["pid"], e.get("tid")))

        dev = [e for e in xs if e["pid"] == pid]
        op_events = [e for e in dev if line(e) == "XLA Ops"] or [
            e for e in dev if line(e) not in ("XLA Modules", "Steps", "Source code")
            and not str(line(e)).startswith("XLA TraceMe") and not _copy_stream(str(line(e)))]
        ops = [Op(e["name"] if kernel_names else _op_name(e), float(e["ts"]),
                  float(e.get("dur", 0))) for e in op_events]
        execs = [Execution(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                           []) for e in dev if line(e) == "XLA Modules"]
        if not execs:
            execs = _executions_from_kernels(op_events)
        i = 0
        for x in execs:             # both lists in time order
            while i < len(ops) and ops[i].ts < x.start:
                i += 1
            while i < len(ops) and ops[i].ts < x.end:
                x.ops.append(ops[i])
                i += 1
        return Trace(True, ops, execs)
    # CPU: thunks, named by their HLO instruction (lower case, no spaces: runtime events are
    # not), on XLA's client threads or the caller's.
    return _cpu_trace(xs, _cpu_spans(xs))


def _cpu_spans(xs: list[dict]) -> list[tuple[dict, int | None]]:
    """The outermost ``ThunkExecutor::Execute`` spans of a CPU trace (time order), each with its
    device: the ``device_ordinal`` of the ``ThunkExecutor::Execute (wait for completion)`` marker
    that ends it on its thread (None where the marker has none)."""
    spans: list[list] = []
    pending: dict = collections.defaultdict(list)    # thread -> its spans awaiting their marker
    open_end: dict = {}
    for e in xs:
        tid = (e["pid"], e.get("tid"))
        if e["name"] == _CPU_EXECUTE:
            ts = float(e["ts"])
            if ts < open_end.get(tid, -1.0):
                continue                    # nested in an execution on this thread
            open_end[tid] = ts + float(e.get("dur", 0))
            spans.append([e, None])
            pending[tid].append(spans[-1])
        elif e["name"].startswith(_CPU_EXECUTE + " (wait"):
            device = (e.get("args") or {}).get("device_ordinal")
            for span in pending.pop(tid, ()):
                span[1] = None if device is None else int(device)
    return [(e, d) for e, d in spans]


def _cpu_trace(xs: list[dict], spans: list[tuple[dict, int | None]]) -> Trace:
    """Executions from ``ThunkExecutor::Execute`` spans (see the module doc): device 0's (and
    single-device programs'), each with the thunks on its thread inside it."""
    devices = [d for _, d in spans if d is not None]
    first = min(devices) if devices else None
    by_thread: dict = collections.defaultdict(list)
    for e, d in spans:
        if d is None or d == first:
            ts = float(e["ts"])
            x = Execution("", ts, ts + float(e.get("dur", 0)), [])
            by_thread[(e["pid"], e.get("tid"))].append(x)
    ops = []
    for e in xs:
        if not _CPU_THUNK.fullmatch(e["name"]):
            continue
        ts = float(e["ts"])
        for x in by_thread.get((e["pid"], e.get("tid")), ()):
            if x.start <= ts < x.end:
                op = Op(e["name"], ts, float(e.get("dur", 0)))
                x.ops.append(op)
                ops.append(op)
                break
    execs = sorted((x for xs_ in by_thread.values() for x in xs_), key=lambda x: x.start)
    return Trace(False, ops, [x for x in execs if x.ops])


def attribute(ops, cats: dict[str, str], on_device: bool,
              unknown: collections.Counter | None = None) -> collections.Counter:
    """Microseconds per category of ``ops`` (:class:`Op` list) given one program's
    :func:`hlo_categories`. An op the HLO does not know is categorized by its name on a GPU
    (kernels), skipped on the CPU (runtime events). ``unknown``: if given, gets microseconds
    per op name of the ops put in "norms/RoPE/other" (to see what hides there)."""
    out: collections.Counter = collections.Counter()
    as_kernels = kernel_named(cats)
    for o in ops:
        cat = lookup(cats, as_kernels, o.name)
        if cat is None:
            if not on_device:
                continue
            cat = kernel_category(o.name)
        elif cat == OTHER and on_device and kernel_category(o.name) != OTHER:
            cat = kernel_category(o.name)    # a GEMM kernel the HLO match missed
        if cat == SKIP:
            continue
        out[cat] += o.dur
        if cat == OTHER and unknown is not None:
            unknown[o.name] += o.dur
    return out


def step_breakdown(step, hlo_text: str, params, repeats: int, wall_s: float,
                   columns: tuple[str, ...]) -> dict:
    """Milliseconds per step by category (``columns``, a subset of :data:`CATEGORIES`, plus
    "host gaps" and "wall") of ``step()`` (which must block until the step is done), traced over
    ``repeats`` calls; ``top_other``: :func:`explain_other` of what landed in norms/RoPE/other.
    ``params``: the per-layer bf16 params (for the weight-copy category), or None. ``hlo_text``:
    the compiled program that ``step`` runs; ``wall_s``: its measured time per call."""
    import tempfile

    import jax

    cats = hlo_categories(hlo_text, params)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(repeats):
                step()
        trace = load_trace(d)
    other: collections.Counter = collections.Counter()
    out = attribute(trace.ops, cats, trace.on_device, other)
    row: dict = {c: out[c] / 1e3 / repeats for c in columns}
    row["host gaps"] = max(0.0, wall_s * 1e3 - sum(row.values()))
    row["wall"] = wall_s * 1e3
    row["top_other"] = explain_other(other, hlo_text, 1e3 * repeats)
    return row
