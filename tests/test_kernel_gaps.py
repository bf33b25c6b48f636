"""benchmarks/kernel_gaps.py on a small trace in nsys's cuda_gpu_trace CSV layout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_gaps  # noqa: E402

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
    try:
        kernel_gaps.read_trace('"Time (%)","Total Time (ns)","Name"\n1,2,"x"\n')
    except ValueError as e:
        assert "cuda_gpu_trace" in str(e)
    else:
        raise AssertionError("accepted a CSV without Start / Duration columns")
