"""``python -m benchmarks.serve --workload trtllm-bench`` (TensorRT-LLM's published protocol:
random 1,000/1,000, 3,000 requests at once, concurrency as large as memory allows) in ``--tiny``
mode on the CPU, with FP8 weights and FP8 K/V: the concurrency follows the memory arithmetic,
every request runs to its length, and the row reports tok/s, TTFT and ITL."""

from __future__ import annotations

import dataclasses

import sys
from pathlib import Path

import numpy as np
import pytest

import jax_kvcm  # noqa: F401  (the installed package before the repo root goes on sys.path)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repo root: benchmarks/ and examples/

from benchmarks import bench_serve as bench  # noqa: E402
from benchmarks.harness import serve_setup  # noqa: E402
from examples.llama import fp8_weights as f8  # noqa: E402
from examples.llama import model as llama  # noqa: E402

# A memory for which the tiny model's weights leave room for a few sequences only, so the
# concurrency is set by the arithmetic, not by the number of requests.
MEMORY_GIB = 0.0005


def _expected_concurrency(kv_itemsize: int, weight_bytes: int) -> int:
    """The largest concurrency, from the model's dimensions (independent of the harness)."""
    s = serve_setup.TINY_TRTLLM_BENCH
    m = s.model
    page = 2 * m.num_hidden_layers * s.page_size * m.num_key_value_heads * m.head_dim * kv_itemsize
    pages_per_seq = -(-(s.input_len + s.output_len) // s.page_size)
    budget = int(0.9 * (int(MEMORY_GIB * 2**30) - weight_bytes))
    return (budget // page - 1) // (pages_per_seq + 1)


def _fp8_weight_bytes(model: llama.LlamaConfig) -> int:
    """The float32 tiny model's bytes with FP8 linear weights: 1 byte per weight plus a float32
    scale per output channel; everything else float32."""
    total = 0
    shapes = llama.param_shapes(model)
    for lp in shapes.pop("layers"):
        for name, shape in lp.items():
            total += (shape[0] * shape[1] + 4 * shape[1] if name in f8.QUANTIZED_WEIGHTS
                      else 4 * int(np.prod(shape)))
    return total + sum(4 * int(np.prod(shape)) for shape in shapes.values())


@pytest.fixture(scope="module")
def fp8_run():
    return bench.main(["--workload", "trtllm-bench", "--tiny", "--quantize", "fp8",
                       "--kv-dtype", "fp8", "--device-memory-gib", str(MEMORY_GIB)])


def test_tiny_trtllm_bench_fp8(fp8_run):
    out = fp8_run
    s = serve_setup.TINY_TRTLLM_BENCH
    want = _expected_concurrency(1, _fp8_weight_bytes(s.model))
    assert 1 <= want < s.num_requests
    (cap,) = [c for c in out["comparisons"] if c["kind"] == "max_concurrency"]
    assert cap["max_concurrency"] == cap["concurrency"] == want, cap
    (row,) = out["results"]
    assert row["concurrency"] == want == out["setup"]["concurrencies"][0]
    assert out["setup"]["step_tokens"] == want + s.prefill_chunk
    assert row["requests"] == s.num_requests == 30
    assert row["generated_tokens"] == s.num_requests * s.output_len
    assert row["weights"] == "fp8" and row["kv_dtype"] == "float8_e4m3fn"
    assert row["output_tokens_per_s"] > 0 and row["ttft_p90_s"] >= row["ttft_p50_s"] > 0
    assert row["itl_p90_ms"] >= row["itl_p50_ms"] > 0
    assert row["peak_running"] == want and row["suspends"] == row["recomputes"] == 0
    assert "(fp8 weights)" in bench.markdown(out) and not out["errors"]


def test_trtllm_bench_presets_and_flags():
    def setup(*argv):
        return bench.setup_from_args(bench.parse_args(["--workload", "trtllm-bench", *argv]))
    full, quick = setup(), setup("--quick")
    for s in (full, quick):
        assert (s.input_len, s.output_len, s.auto_concurrency) == (1000, 1000, True)
        assert not (s.run_shared or s.run_dense or s.equal_memory_run) and s.host_bytes == 0
        assert s.quantize is None and s.kv_dtype == "auto"
    assert (full.num_requests, quick.num_requests) == (3000, 1000)
    s = setup("--quantize", "fp8", "--kv-dtype", "fp8", "--kv-memory-fraction", "0.95")
    assert (s.quantize, s.kv_dtype, s.kv_memory_fraction) == ("fp8", "fp8", 0.95)
    fixed = setup("--concurrency", "256")
    assert fixed.concurrencies == (256,) and not fixed.auto_concurrency
    assert fixed.requests_at(256) == 3000
    with pytest.raises(SystemExit, match="--quantize fp8: FP8 weights are not split"):
        setup("--quantize", "fp8", "--tensor-parallel", "2")
    assert setup("--quantize", "fp8", "--static-input-scales", "64").static_input_scales == 64
    for bad in (("--static-input-scales", "64"), ("--quantize", "fp8", "--static-input-scales",
                                                  "0")):
        with pytest.raises(SystemExit, match="--static-input-scales needs --quantize"):
            setup(*bad)
    with pytest.raises(SystemExit):
        bench.parse_args(["--quantize", "int4"])
    # The 8B shape at 1,000/1,000: 125 pages of 16 tokens per sequence; a page is 2 MiB in
    # bf16, 1 MiB in fp8 (32 layers x 8 KV heads x 128 x K and V).
    from benchmarks.harness.serve_capacity import page_bytes_per_device
    assert full.pages_per_seq == 125
    assert page_bytes_per_device(full) == 2 * page_bytes_per_device(s) == 2 << 20


def test_batch_buckets_run_compiles_nothing_in_the_clock():
    """``--batch-buckets 3``: the concurrency and its halves as batch buckets, each bucket's
    decode and forward program compiled in the warm-up (one token bucket: 6 programs), none in
    the timed run, and every request served to its length."""
    out = bench.main(["--workload", "trtllm-bench", "--tiny", "--batch-buckets", "3"])
    (row,) = out["results"]
    c = row["concurrency"]
    assert row["batch_buckets"] == [-(-c // 4), -(-c // 2), c] and c >= 4
    assert row["compiled_programs"] == 6 and row["compiles_in_timed_region"] == 0
    assert row["generated_tokens"] == row["requests"] * row["output_len"] and not out["errors"]
    def setup(*argv):
        return bench.setup_from_args(bench.parse_args(["--workload", "trtllm-bench", *argv]))
    assert setup("--batch-buckets", "4").batch_buckets_at(858) == (108, 215, 429, 858)
    assert setup().batch_buckets_at(858) == (858,)
    with pytest.raises(SystemExit, match="--batch-buckets must be >= 1"):
        setup("--batch-buckets", "0")


def test_concurrency_counts_at_most_the_largest_free_block(monkeypatch):
    """Each K/V pool is one allocation, so free bytes in pieces do not all hold pools: with the
    allocator reporting a largest free block smaller than the free bytes, the budget is
    ``kv_memory_fraction`` of the block (both pools fit in it, one after the other); with a block
    as large as the free bytes, nothing changes."""
    from benchmarks.harness import serve_capacity
    s = serve_setup.TINY_TRTLLM_BENCH
    page = serve_capacity.page_bytes_per_device(s)
    limit, in_use = 4000 * page, 1000 * page
    monkeypatch.setattr(serve_capacity, "device_memory", lambda params: (limit, in_use, "test"))

    def concurrency(block):
        monkeypatch.setattr(serve_capacity, "largest_free_block", lambda: block)
        lines = []
        got, row = serve_capacity.resolve_concurrency(s, None, lines.append)
        assert got.concurrencies == (row["concurrency"],)
        return row["max_concurrency"], lines[0]

    def expected(usable):   # pages = 0.9 x usable bytes, less the null page
        return (int(0.9 * usable) // page - 1) // (s.pages_per_seq + 1)

    whole, line = concurrency(None)
    assert whole == expected(3000 * page) and "largest free block" not in line
    assert concurrency(3000 * page)[0] == whole
    capped, line = concurrency(1200 * page)
    assert capped == expected(1200 * page) < whole
    assert "of which the largest free block" in line, line


def test_static_input_scales_reach_the_served_params():
    """--static-input-scales: random_params calibrates every FP8 linear (a static scalar
    input_scale on each) and the rows say so."""
    s = dataclasses.replace(serve_setup.TINY_TRTLLM_BENCH, quantize="fp8", static_input_scales=16)
    params = serve_setup.random_params(s)
    scales = [lp[name].input_scale for lp in params["layers"] for name in f8.QUANTIZED_WEIGHTS]
    assert all(x is not None and x.shape == () and float(x) > 0 for x in scales), scales
    dynamic = serve_setup.random_params(dataclasses.replace(s, static_input_scales=None))
    assert all(lp[name].input_scale is None for lp in dynamic["layers"]
               for name in f8.QUANTIZED_WEIGHTS)
