"""tools/trace_lines.py on a hand-made perfetto trace: each line with its count, names,
argument keys and programs."""

import gzip
import json

from tools import trace_lines


def test_summarizes_each_line(tmp_path, capsys):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    events = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "thread_name", "pid": 7, "tid": 14,
               "args": {"name": "Stream #14(MemcpyD2D,Compute,Memset)"}}]
    events += [{"ph": "X", "pid": 7, "tid": 14, "name": "gemm", "ts": i, "dur": 1,
                "args": {"hlo_module": "jit_model_step", "hlo_op": "dot.1"}} for i in range(3)]
    events.append({"ph": "X", "pid": 7, "tid": 15, "name": "MemcpyH2D", "ts": 9, "dur": 1})
    with gzip.open(d / "x.perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace_lines.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "'/device:GPU:0' / 'Stream #14(MemcpyD2D,Compute,Memset)': 3" in out
    assert "[('jit_model_step', 3)]" in out and "'hlo_op': 3" in out
    assert "'/device:GPU:0' / 15: 1" in out
