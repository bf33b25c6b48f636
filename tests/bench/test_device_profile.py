"""benchmarks/harness/device_profile.py, where a step's device time goes: HLO instructions to
categories (hand-written optimized modules), the explanation of "norms/RoPE/other", and the trace
parsers on hand-made perfetto traces (GPU, CPU, one and two devices). Pure parsing: no model runs.
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
import types
from pathlib import Path

import pytest

import jax_kvcm  # noqa: F401  (the installed package before the repo root goes on sys.path)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import device_profile as _profile  # noqa: E402
from benchmarks.harness import loop_profile  # noqa: E402


# A hand-written optimized module: a GEMM as a dot fusion, a cuBLAS call wrapped in a nested
# fusion computation, both attention custom calls, write_kv, a sampling op, a norm, a loop.
_HLO = """HloModule jit_model_step, is_scheduled=true

%fused_dot (p0: bf16[8,64], p1: bf16[64,64]) -> bf16[8,64] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%inner (q0: bf16[8,64], q1: bf16[64,64]) -> bf16[8,64] {
  %q0 = bf16[8,64]{1,0} parameter(0)
  %q1 = bf16[64,64]{1,0} parameter(1)
  ROOT %cc = bf16[8,64]{1,0} custom-call(%q0, %q1), custom_call_target="__cublas$gemm"
}

%outer (r0: bf16[8,64], r1: bf16[64,64]) -> bf16[8,64] {
  %r0 = bf16[8,64]{1,0} parameter(0)
  %r1 = bf16[64,64]{1,0} parameter(1)
  ROOT %call.2 = bf16[8,64]{1,0} fusion(%r0, %r1), kind=kCustom, calls=%inner
}

ENTRY %main (x: bf16[8,64], w: bf16[64,64]) -> s32[8] {
  %x = bf16[8,64]{1,0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  %gemm_a = bf16[8,64]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %gemm_b = bf16[8,64]{1,0} fusion(%x, %w), kind=kCustom, calls=%outer
  %attn_d = bf16[8,64]{1,0} custom-call(%x), custom_call_target="kvcm_paged_attention"
  %attn_r = bf16[8,64]{1,0} custom-call(%x), custom_call_target="kvcm_ragged_paged_attention"
  %kv = bf16[8,64]{1,0} custom-call(%x), custom_call_target="kvcm_write_kv"
  %norm = bf16[8,64]{1,0} multiply(%x, %x), metadata={op_name="jit(model_step)/rms_norm/mul"}
  %quant = f8e4m3fn[8,64]{1,0} convert(%x), metadata={op_name="jit(model_step)/fp8_scales/convert_element_type"}
  %amax = s32[8]{0} fusion(%x), kind=kLoop, calls=%fused_dot, metadata={op_name="jit(model_step)/sampling/jit(greedy_tokens)/reduce"}
  %loop = bf16[8,64]{1,0} while(%x), condition=%c, body=%b
  ROOT %out = s32[8]{0} copy(%amax), metadata={op_name="jit(model_step)/sampling/dynamic_update_slice"}
}
"""


def test_hlo_categories_of_a_hand_written_module():
    cats = _profile.hlo_categories(_HLO)
    assert cats["gemm_a"] == cats["gemm_b"] == cats["cc"] == "weight GEMMs"
    assert cats["attn_d"] == "paged attention" and cats["attn_r"] == "ragged attention"
    assert cats["kv"] == "K/V writes" and cats["norm"] == "norms/RoPE/other"
    assert cats["out"] == "sampling" and cats["loop"] == _profile.SKIP
    assert cats["quant"] == _profile.FP8_SCALES
    # a fusion calling a dot computation is a GEMM even under the sampling scope
    assert cats["amax"] == "weight GEMMs"
    ops = [_profile.Op(n, 0.0, us) for n, us in (("gemm_a", 5.0), ("attn_r", 7.0),
                                                  ("norm", 1.0), ("loop", 100.0),
                                                  ("nvjet_gemm_kernel", 2.0), ("mystery", 3.0))]
    unknown = collections.Counter()
    gpu = _profile.attribute(ops, cats, True, unknown)
    assert gpu == {"weight GEMMs": 7.0, "ragged attention": 7.0, "norms/RoPE/other": 4.0}
    assert unknown == {"norm": 1.0, "mystery": 3.0}
    cpu = _profile.attribute(ops, cats, False)      # runtime events the HLO lacks are skipped
    assert cpu == {"weight GEMMs": 5.0, "ragged attention": 7.0, "norms/RoPE/other": 1.0}


_HLO_FUSED_SCALE = """HloModule jit_model_step, is_scheduled=true

%fused_add (p0: bf16[8,64], p1: f32[8]) -> bf16[8,64] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  %b = bf16[8,64]{1,0} broadcast(%p1), metadata={op_name="jit(step)/layer/fp8_scales/broadcast_in_dim"}
  %s = bf16[8,64]{1,0} multiply(%p0, %b), metadata={op_name="jit(step)/layer/fp8_scales/mul"}
  ROOT %r = bf16[8,64]{1,0} add(%s, %p0), metadata={op_name="jit(step)/layer/add"}
}

ENTRY %main (x: bf16[8,64], s: f32[8]) -> f8e4m3fn[8,64] {
  %x = bf16[8,64]{1,0} parameter(0)
  %s = f32[8]{0} parameter(1)
  %rope = bf16[8,64]{1,0} sine(%x), metadata={op_name="jit(step)/layer/rope/sin"}
  %residual.2 = bf16[8,64]{1,0} fusion(%x, %s), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/layer/add"}
  ROOT %quant.7 = f8e4m3fn[8,64]{1,0} convert(%residual.2), metadata={op_name="jit(step)/fp8_scales/convert_element_type"}
}
"""


def test_explain_other_names_the_scopes_a_fusion_holds():
    """A scale multiply fused into a residual add counts as "other" (the fusion's root scope),
    and explain_other shows the fp8_scales ops inside it; a trace name the HLO lacks says so."""
    cats = _profile.hlo_categories(_HLO_FUSED_SCALE)
    assert cats["residual.2"] == cats["rope"] == _profile.OTHER
    assert cats["quant.7"] == _profile.FP8_SCALES
    unknown = collections.Counter()
    # as a GPU trace names them: kernels named after instructions, "." as "_"
    ops = [_profile.Op(n, 0.0, us) for n, us in (("residual_2", 4000.0), ("rope", 1000.0),
                                                  ("cutlass_mystery", 2000.0),
                                                  ("quant_7", 500.0))]
    by_cat = _profile.attribute(ops, cats, True, unknown)
    assert by_cat[_profile.FP8_SCALES] == 500.0
    rows = _profile.explain_other(unknown, _HLO_FUSED_SCALE, per=1e3 * 2)
    assert [r["op"] for r in rows] == ["residual_2", "rope"]     # a cutlass kernel is a GEMM
    top = rows[0]
    assert top["ms"] == 2.0 and top["in_hlo"]
    assert top["scopes"] == ["jit(step)/layer/add", "layer/fp8_scales/broadcast_in_dim",
                             "layer/fp8_scales/mul"]
    assert _profile.explain_other(collections.Counter({"nowhere": 10.0}), _HLO_FUSED_SCALE,
                                  per=1.0) == [{"op": "nowhere", "ms": 10.0, "in_hlo": False,
                                                "scopes": []}]


_HLO_QUANT_FUSIONS = """HloModule jit_forward_step, is_scheduled=true

%region_0 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_norm_quant (p0: bf16[8,64]) -> f8e4m3fn[8,64] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %x = f32[8,64]{1,0} convert(%p0), metadata={op_name="jit(forward_step)/convert_element_type"}
  %sq = f32[8,64]{1,0} multiply(%x, %x), metadata={op_name="jit(forward_step)/mul"}
  %zero = f32[] constant(0)
  %ss = f32[8]{0} reduce(%sq, %zero), dimensions={1}, to_apply=%region_0, metadata={op_name="jit(forward_step)/reduce_sum"}
  %r = f32[8]{0} rsqrt(%ss), metadata={op_name="jit(forward_step)/rsqrt"}
  %rb = f32[8,64]{1,0} broadcast(%r), dimensions={0}
  %n = f32[8,64]{1,0} multiply(%x, %rb), metadata={op_name="jit(forward_step)/fp8_scales/div"}
  ROOT %q = f8e4m3fn[8,64]{1,0} convert(%n), metadata={op_name="jit(forward_step)/fp8_scales/convert_element_type"}
}

%fused_amax_quant (p0: bf16[8,64]) -> f8e4m3fn[8,64] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %x = f32[8,64]{1,0} convert(%p0), metadata={op_name="jit(forward_step)/fp8_scales/convert_element_type"}
  %zero = f32[] constant(0)
  %amax = f32[8]{0} reduce(%x, %zero), dimensions={1}, to_apply=%region_0, metadata={op_name="jit(forward_step)/fp8_scales/reduce_max"}
  %ab = f32[8,64]{1,0} broadcast(%amax), dimensions={0}
  %d = f32[8,64]{1,0} divide(%x, %ab), metadata={op_name="jit(forward_step)/fp8_scales/div"}
  ROOT %q = f8e4m3fn[8,64]{1,0} convert(%d), metadata={op_name="jit(forward_step)/fp8_scales/convert_element_type"}
}

ENTRY %main (h: bf16[8,64]) -> f8e4m3fn[8,64] {
  %h = bf16[8,64]{1,0} parameter(0)
  %norm_quant = f8e4m3fn[8,64]{1,0} fusion(%h), kind=kLoop, calls=%fused_norm_quant, metadata={op_name="jit(forward_step)/fp8_scales/convert_element_type"}
  ROOT %amax_quant = f8e4m3fn[8,64]{1,0} fusion(%h), kind=kInput, calls=%fused_amax_quant, metadata={op_name="jit(forward_step)/fp8_scales/convert_element_type"}
}
"""


def test_a_quantization_fused_into_its_norm_counts_as_the_norm():
    """XLA roots the RMSNorm (and SiLU) that makes an FP8 GEMM's input in the quantization's
    convert (H100, 8B chunk step: every such fusion); its norm work is the bf16 step's too, so
    it counts as other. A fusion whose reduce is the quantization's own (a per-token amax)
    stays FP8 scales."""
    cats = _profile.hlo_categories(_HLO_QUANT_FUSIONS)
    assert cats["norm_quant"] == _profile.OTHER
    assert cats["amax_quant"] == _profile.FP8_SCALES


def test_step_breakdown_of_a_made_up_gpu_trace(tmp_path):
    """The GPU branch of the trace parser on a hand-made perfetto trace: a step program before
    the window (dropped: the window is aligned from the end), a decode and a mixed step, and a
    migration program between them; ops land in their step and category through that step's
    program, the device idle before a step excludes the other program's time."""
    pid, mods, ops = 7, 1, 2

    def x(tid, name, ts, dur, hlo=None):
        e = {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
        if hlo:
            e["args"] = {"hlo_op": hlo}
        return e

    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
              {"ph": "M", "name": "thread_name", "pid": pid, "tid": mods,
               "args": {"name": "XLA Modules"}},
              {"ph": "M", "name": "thread_name", "pid": pid, "tid": ops,
               "args": {"name": "XLA Ops"}},
              x(mods, "jit_model_step(11)", 0, 50), x(ops, "k", 0, 50, "gemm_a"),
              # decode step: 100..200, busy 10 + 30 + 20 = 60
              x(mods, "jit_model_step(11)", 100, 100), x(ops, "k", 100, 10, "gemm_a"),
              x(ops, "k", 120, 30, "attn_d"), x(ops, "k", 160, 20, "out"),
              # a migration 210..230, then the mixed step 250..400
              x(mods, "jit_encode(12)", 210, 20), x(ops, "k", 210, 20, "fusion.9"),
              x(mods, "jit_model_step(13)", 250, 150), x(ops, "k", 250, 100, "attn_r"),
              x(ops, "k", 360, 40, "nvjet_gemm"),
              {"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction(model_step)", "ts": 90,
               "dur": 5}]
    b = _breakdown_of_made_up_trace(tmp_path, events)
    dec, mix = b["kinds"]["decode"]["ms_per_step"], b["kinds"]["mixed"]["ms_per_step"]
    assert dec["idle inside the step"] == 0.04
    assert mix["other programs"] == 0.02 and mix["idle before the step (host gap)"] == 0.03
    assert mix["idle inside the step"] == 0.01


def _breakdown_of_made_up_trace(tmp_path, events) -> dict:
    """Writes ``events`` as a profile and checks what both made-up traces share: four program
    executions (a step before the window, a decode step, a migration, a mixed step) with 1, 3, 1
    and 2 ops, and the two steps' ops in their categories. Returns the breakdown."""
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace = _profile.load_trace(str(tmp_path))
    assert trace.on_device and [len(e.ops) for e in trace.executions] == [1, 3, 1, 2]
    recs = [types.SimpleNamespace(index=i, kind=k, program=p, batch_bucket=4, token_bucket=8)
            for i, k, p in ((5, "decode", "decode"), (6, "mixed", "forward"))]
    capture = types.SimpleNamespace(args={("decode", 4, 8): None, ("forward", 4, 8): None},
                                    hlo=lambda key: _HLO)
    window = types.SimpleNamespace(out_dir=str(tmp_path), indices=[5, 6], reason="test")
    b = loop_profile.step_breakdown(window, recs, capture, None)
    assert b["matched"] == 2 and b["traced_step_programs"] == 3 and b["on_device"]
    dec, mix = b["kinds"]["decode"]["ms_per_step"], b["kinds"]["mixed"]["ms_per_step"]
    assert (dec["weight GEMMs"], dec["paged attention"], dec["sampling"]) == (0.01, 0.03, 0.02)
    # the window's first step: no gap (the host started the tracer before dispatching it)
    assert dec["idle before the step (host gap)"] == 0.0
    assert (mix["ragged attention"], mix["weight GEMMs"]) == (0.1, 0.04)
    assert "| mixed | 1 |" in loop_profile.format_breakdown("x", b)
    return b


@pytest.mark.parametrize("compute_line", ["Stream #14(Compute,Memset)",
                                          "Stream #14(MemcpyD2D,Compute,Memset)"])
def test_step_breakdown_of_a_made_up_trace_without_module_line(tmp_path, compute_line):
    """jax 0.11's GPU traces (H200, 2026-12-01) have no "XLA Modules" line: kernels sit on
    "Stream #N(Compute...)" lines with their program in ``hlo_module``, and kernels of a CUDA
    graph carry the graph's thunk as ``hlo_op`` (``command_buffer_N``) and their own kernel name.
    The same four executions as above are read from those arguments: a new one where the program
    changes or a kernel (graph node, else instruction) recurs; copies on memcpy lines are no ops.
    On the H100 (jax 0.11.2, 2026-12-06) the compute line also names MemcpyD2D: still the ops."""
    pid, compute, copies = 7, 14, 15

    def k(name, ts, dur, module="jit_model_step", hlo="command_buffer_0", graph=None):
        args = {"hlo_module": module, "hlo_op": hlo, "correlation_id": str(ts)}
        if graph is not None:
            args.update(cuda_graph_id=str(graph[0]), cuda_graph_node_id=str(graph[1]))
        return {"ph": "X", "pid": pid, "tid": compute, "name": name, "ts": ts, "dur": dur,
                "args": args}

    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "thread_name", "pid": pid, "tid": compute,
               "args": {"name": compute_line}},
              {"ph": "M", "name": "thread_name", "pid": pid, "tid": copies,
               "args": {"name": "Stream #15(MemcpyH2D)"}},
              k("gemm_a", 0, 50, graph=(20, 0)),
              # decode step 100..180: graph node (20, 0) recurs; a custom call's kernel outside
              # the graph; busy 10 + 30 + 20 = 60 of 80
              k("gemm_a", 100, 10, graph=(20, 0)),
              k("PagedDecodeKernel<bf16>", 120, 30, hlo="attn_d"),
              k("out", 160, 20, hlo="command_buffer_1", graph=(21, 0)),
              {"ph": "X", "pid": pid, "tid": copies, "name": "MemcpyH2D", "ts": 165, "dur": 5,
               "args": {"memcpy_details": "size:96"}},
              k("fusion.9", 210, 20, module="jit_encode", hlo="fusion.9"),
              # mixed step 250..400
              k("RaggedPrefillSm90Kernel", 250, 100, hlo="attn_r"),
              k("nvjet_gemm", 360, 40, graph=(22, 0))]
    b = _breakdown_of_made_up_trace(tmp_path, events)
    dec, mix = b["kinds"]["decode"]["ms_per_step"], b["kinds"]["mixed"]["ms_per_step"]
    assert dec["idle inside the step"] == 0.02
    assert mix["other programs"] == 0.02 and mix["idle before the step (host gap)"] == 0.05
    assert mix["idle inside the step"] == 0.01


# A hand-written tensor-parallel module: a plain all-reduce (a psum: CPU thunks are named after
# the instruction), an async all-reduce pair, an all-gather, a reduce-scatter inside an async
# wrapper, a collective-permute, next to a GEMM fusion and a norm.
_HLO_TP = """HloModule jit_model_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_dot (p0: bf16[8,64], p1: bf16[64,64]) -> bf16[8,64] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%wrapped_rs (p: bf16[8,64]) -> bf16[4,64] {
  %p = bf16[8,64]{1,0} parameter(0)
  ROOT %rs = bf16[4,64]{1,0} reduce-scatter(%p), channel_id=5, replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

ENTRY %main (x: bf16[8,64], w: bf16[64,64]) -> f32[8,128] {
  %x = bf16[8,64]{1,0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  %gemm = bf16[8,64]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %psum.28 = bf16[8,64]{1,0} all-reduce(%gemm), channel_id=1, replica_groups=[1,2]<=[2], use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(model_step)/shard_map/psum"}
  %all-reduce-start.1 = bf16[8,64]{1,0} all-reduce-start(%gemm), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %all-reduce-done.1 = bf16[8,64]{1,0} all-reduce-done(%all-reduce-start.1)
  %rs-start = ((bf16[8,64]{1,0}), bf16[4,64]{1,0}) async-start(%x), calls=%wrapped_rs
  %rs-done = bf16[4,64]{1,0} async-done(%rs-start)
  %cp = bf16[8,64]{1,0} collective-permute(%x), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %norm = bf16[8,64]{1,0} multiply(%psum.28, %psum.28), metadata={op_name="jit(model_step)/shard_map/rms_norm/mul"}
  ROOT %all_gather.3 = f32[8,128]{1,0} all-gather(%norm), channel_id=3, replica_groups={{0,1}}, dimensions={1}, use_global_device_ids=true
}
"""


def test_collectives_of_a_hand_written_tp_module():
    """Every collective form (plain, async pair, async wrapper) lands in "collectives", a GEMM
    fusion and a norm where they were; on a GPU, NCCL's kernels (named by the kernel when XLA
    ran them in a CUDA graph, or absent from the HLO) too."""
    cats = _profile.hlo_categories(_HLO_TP)
    coll = {"psum.28", "all-reduce-start.1", "all-reduce-done.1", "rs-start", "rs-done", "cp",
            "all_gather.3"}
    assert {n for n, c in cats.items() if c == _profile.COLLECTIVES} == coll | {"rs"}, cats
    assert cats["gemm"] == "weight GEMMs" and cats["norm"] == _profile.OTHER
    assert _profile.COLLECTIVES in _profile.CATEGORIES
    ops = [_profile.Op(n, 0.0, us) for n, us in (
        ("gemm", 5.0), ("psum.28", 7.0), ("all_gather.3", 2.0), ("norm", 1.0),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 11.0),
        ("ncclKernel_AllGather_RING_LL_Sum_int8", 3.0), ("mystery", 4.0))]
    gpu = _profile.attribute(ops, cats, True)
    assert gpu == {"weight GEMMs": 5.0, "collectives": 23.0, "norms/RoPE/other": 5.0}
    cpu = _profile.attribute(ops, cats, False)   # the NCCL names are no CPU thunks
    assert cpu == {"weight GEMMs": 5.0, "collectives": 9.0, "norms/RoPE/other": 1.0}
    for kernel in ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "ncclDevKernel_SendRecv",
                   "cross_device_all_reduce_k"):
        assert _profile.kernel_category(kernel) == _profile.COLLECTIVES, kernel
    assert _profile.kernel_category("nvjet_tst_gemm") == "weight GEMMs"


def test_cpu_trace_of_two_devices_keeps_device_0(tmp_path):
    """A CPU trace of a tensor-parallel step: each device runs its part on a thread of XLA's
    pool (any thread, whichever device), the threads' thunks interleaved in time, each span ended
    on its thread by a "wait for completion" marker naming its device. Only device 0's
    executions and single-device programs (a marker without a device) are kept, each with the
    thunks inside its span on its thread."""
    pid = 5

    def x(tid, name, ts, dur, **args):
        e = {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
        if args:
            e["args"] = args
        return e

    def step(t0, dev_a, dev_b, psum_a, psum_b):
        a, b = 11, 12
        wait = "ThunkExecutor::Execute (wait for completion)"
        return [x(a, f"[{dev_a}] CommonPjRtLoadedExecutable::Execute (jit_model_step)", t0, 3),
                x(a, "ThunkExecutor::Execute", t0 + 5, 100),
                x(b, "ThunkExecutor::Execute", t0 + 6, 100),
                x(a, "gemm", t0 + 6, 10), x(b, "gemm", t0 + 7, 12),
                x(a, "psum.28", t0 + 20, psum_a), x(b, "psum.28", t0 + 21, psum_b),
                x(a, "Rendezvous", t0 + 21, 5), x(a, "end: psum.28", t0 + 20 + psum_a, 0.1),
                x(a, "norm", t0 + 90, 4), x(b, "norm", t0 + 91, 6),
                x(a, wait, t0 + 105.5, 0, device_ordinal=str(dev_a), run_id="7"),
                x(b, wait, t0 + 106.5, 0, device_ordinal=str(dev_b), run_id="7")]

    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "/host:CPU"}}]
    events += step(0, 0, 1, 50, 9) + step(200, 1, 0, 8, 60)    # the threads swap devices
    # a single-device program on the caller's thread
    events += [x(13, "ThunkExecutor::Execute", 150, 20), x(13, "fusion.9", 152, 7),
               x(13, "ThunkExecutor::Execute (wait for completion)", 170.5, 0)]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace = _profile.load_trace(str(tmp_path))
    assert not trace.on_device
    assert [(x.start, x.end, [o.name for o in x.ops]) for x in trace.executions] == [
        (5, 105, ["gemm", "psum.28", "norm"]), (150, 170, ["fusion.9"]),
        (206, 306, ["gemm", "psum.28", "norm"])]
    cats = _profile.hlo_categories(_HLO_TP)
    c = _profile.attribute(trace.executions[0].ops + trace.executions[2].ops, cats, False)
    # device 0's thunks: thread a's in the first step, thread b's in the second
    assert c == {"weight GEMMs": 10 + 12, "collectives": 50 + 60, "norms/RoPE/other": 4 + 6}


def test_gpu_trace_of_two_devices_reads_gpu_0(tmp_path):
    """A two-GPU trace (TP 2): the ops of "/device:GPU:0" are read whatever the process ids; its
    NCCL kernel (on its own stream, absent from the HLO) lands in "collectives"."""
    events = []
    for pid, gpu, nccl_us in ((3, 1, 40.0), (9, 0, 25.0)):
        events += [{"ph": "M", "name": "process_name", "pid": pid,
                    "args": {"name": f"/device:GPU:{gpu}"}},
                   {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1,
                    "args": {"name": "XLA Modules"}},
                   {"ph": "M", "name": "thread_name", "pid": pid, "tid": 2,
                    "args": {"name": "XLA Ops"}},
                   {"ph": "X", "pid": pid, "tid": 1, "name": "jit_model_step(1)", "ts": 0,
                    "dur": 100},
                   {"ph": "X", "pid": pid, "tid": 2, "name": "k", "ts": 0, "dur": 10,
                    "args": {"hlo_op": "gemm"}},
                   {"ph": "X", "pid": pid, "tid": 2,
                    "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts": 20,
                    "dur": nccl_us}]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace = _profile.load_trace(str(tmp_path))
    assert trace.on_device and len(trace.executions) == 1
    c = _profile.attribute(trace.executions[0].ops, _profile.hlo_categories(_HLO_TP), True)
    assert c == {"weight GEMMs": 10.0, "collectives": 25.0}


def test_gemm_census_tells_fp8_cublaslt_from_other_gemms():
    """bench_decode_step's GEMM census of a compiled step: cuBLASLt FP8 calls, other cuBLAS
    calls, Triton GEMM fusions, plain dots (hand-written instruction lines)."""
    hlo = "\n".join([
        '  %a = (bf16[8,64]{1,0}, s8[0]{0}) custom-call(%x, %w), '
        'custom_call_target="__cublas$lt$matmul$f8"',
        '  %b = (bf16[8,64]{1,0}, s8[0]{0}) custom-call(%x, %w), '
        'custom_call_target="__cublas$lt$matmul$f8"',
        '  %c = (f32[8,64]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm"',
        '  %d = bf16[8,64]{1,0} fusion(%x, %w), kind=kCustom, calls=%f, '
        'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
        '  %e = f32[8,64]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}',
        '  %g = bf16[8,64]{1,0} fusion(%x), kind=kLoop, calls=%h'])
    assert _profile.gemm_census(hlo) == {"cublaslt_fp8": 2, "cublas": 1, "triton": 1, "dot": 1}


def test_instruction_shapes_name_kernels_as_the_gpu_does():
    hlo = ('  %loop_convert_fusion.31 = f8e4m3fn[858,4096]{1,0} fusion(%x), kind=kLoop\n'
           '  ROOT %tuple = (f32[2]{0}) tuple(%y)')
    assert _profile.instruction_shapes(hlo) == {
        "loop_convert_fusion_31": "f8e4m3fn[858,4096]{1,0} fusion", "tuple": "(f32[2]{0}) tuple"}
