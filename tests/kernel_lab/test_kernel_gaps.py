"""tools/kernel_gaps.py on a small trace in nsys's cuda_gpu_trace CSV layout."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools/
from tools import kernel_gaps  # noqa: E402

TRACE = '''Generating SQLite file /tmp/t.sqlite from /tmp/t.nsys-rep
"Start (ns)","Duration (ns)","CorrId","GrdX","Strm","Name"
2000,12000,7,264,14,"void (anonymous namespace)::FillPaddingKernel<__nv_bfloat16>(AttentionArgs)"
15000,3000,8,1,14,"(anonymous namespace)::ScheduleKernel(AttentionArgs, int *, int, bool)"
20000,650000,9,132,14,"void (anonymous namespace)::RaggedPrefillSm90Kernel<__nv_bfloat16, 128>(PrefillParams)"
672000,12000,10,264,14,"void (anonymous namespace)::FillPaddingKernel<__nv_bfloat16>(AttentionArgs)"
'''


def test_gaps_are_the_idle_time_before_each_kernel():
    trace = kernel_gaps.read_trace(TRACE)
    assert [round(s) for s, _, _ in trace] == [2, 15, 20, 672]
    text = kernel_gaps.report(trace, last=4)
    assert "| ScheduleKernel | 3.0 | 1.0 |" in text  # 15 - (2 + 12)
    assert "| RaggedPrefillSm90Kernel | 650.0 | 2.0 |" in text
    assert "| FillPaddingKernel | 12.0 | 2.0 |" in text  # the second: 672 - 670
    assert "| FillPaddingKernel | 2 | 12.0 | 1.0 |" in text  # mean of gaps 0 and 2
    assert "span 682.0 us, busy 677.0 us" in text


def test_a_csv_without_the_trace_columns_is_refused():
    with pytest.raises(ValueError, match="cuda_gpu_trace"):
        kernel_gaps.read_trace('"Time (%)","Total Time (ns)","Name"\n1,2,"x"\n')


def test_a_jax_profiler_gpu_trace_by_kernel_name(tmp_path):
    """prefill_profile.py --trace: the device ops of a perfetto trace in jax 0.11's GPU layout
    (kernels on a "Stream #N(Compute...)" line, their HLO instruction in ``hlo_op``), named by
    kernel with ``kernel_names``, then the gaps between them."""
    import gzip
    import json

    from benchmarks.harness import device_profile as _profile

    pid, tid = 7, 14

    def k(name, ts, dur):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur,
                "args": {"hlo_module": "jit_ragged", "hlo_op": "ffi_call.1"}}

    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
               "args": {"name": "Stream #14(Compute,Memset)"}},
              k("FillPaddingKernel", 0, 2), k("ScheduleKernel", 3, 3),
              k("RaggedPrefillSm90Kernel", 7, 650), k("FillPaddingKernel", 700, 2)]
    with gzip.open(tmp_path / "host.perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert {o.name for o in _profile.load_trace(str(tmp_path)).ops} == {"ffi_call.1"}
    ops = [(o.ts, o.dur, o.name)
           for o in _profile.load_trace(str(tmp_path), kernel_names=True).ops]
    assert [n for _, _, n in ops] == ["FillPaddingKernel", "ScheduleKernel",
                                      "RaggedPrefillSm90Kernel", "FillPaddingKernel"]
    text = kernel_gaps.report(ops, last=4)
    assert "| RaggedPrefillSm90Kernel | 650.0 | 1.0 |" in text
    assert "| FillPaddingKernel | 2.0 | 43.0 |" in text  # 700 - 657: idle between calls
