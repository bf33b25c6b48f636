"""benchmarks/serve.py in ``--tiny`` mode (CPU, float32): the dense baseline is the paged runner.

The tiny run serves the same random requests through the paged server (two concurrencies), the
dense per-sequence cache at equal batch and at equal memory, and a shared-prefix set with prefix
reuse on and off; every pair of runs over the same requests must generate identical greedy tokens,
with float32 logits within relative L2 1e-5 (the benchmark raises otherwise). A deliberately
broken dense decode must be caught.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import jax_kvcm  # noqa: F401  (the installed package before the repo root goes on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("serve_benchmark",
                                                  ROOT / "benchmarks" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod       # dataclasses look their module up while it executes
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def test_tiny_run_paged_equals_dense(tmp_path):
    path = tmp_path / "serve.json"
    out = bench.main(["--tiny", "--json", str(path)])
    assert json.loads(path.read_text())["results"] == json.loads(json.dumps(out["results"]))
    setup = bench.TINY_SETUP
    runs = {r["name"]: r for r in out["results"]}
    for c in setup.concurrencies:
        for path_kind in ("paged", "dense"):
            r = runs[f"{path_kind} random c{c}"]
            n = int(round(c * setup.requests_factor))
            assert r["requests"] == n and r["generated_tokens"] == n * setup.output_len
            assert r["output_tokens_per_s"] > 0 and r["ttft_p90_s"] >= r["ttft_p50_s"] > 0
            assert r["compiles_in_timed_region"] in (0, None), r
        paged = runs[f"paged random c{c}"]
        assert paged["suspends"] == paged["recomputes"] == 0
        assert 0 < paged["pages_used_peak"] <= paged["pool_pages"]
        assert paged["peak_running"] == c
    # Every pair of runs over the same requests agreed token for token.
    assert out["agreement"] and all(a["identical"] == a["requests"] > 0
                                    and a["max_logits_rel_l2"] <= 1e-5 for a in out["agreement"])
    pairs = {(a["a"], a["b"]) for a in out["agreement"]}
    c0, c1 = setup.concurrencies
    assert ("paged random c%d" % c0, "dense random c%d" % c0) in pairs
    assert ("paged random c%d" % c0, "paged random c%d" % c1) in pairs
    assert ("paged shared c4 prefix on", "paged shared c4 prefix off") in pairs
    on, off = runs["paged shared c4 prefix on"], runs["paged shared c4 prefix off"]
    assert on["prefix_hit_rate"] > 0.2 and off["prefix_hit_rate"] == 0
    kinds = {c["kind"]: c for c in out["comparisons"]}
    eq = kinds["equal_memory"]
    assert eq["paged_sequences"] > eq["dense_sequences"] >= 1 and "paged_over_dense" in eq
    assert "paged / dense tok/s" in bench.markdown(out)


def test_a_broken_dense_path_is_caught(monkeypatch):
    """An off-by-one in the dense decode (K/V written one position early) must fail the check."""
    dense = bench.dense
    good = dense.decode

    def broken(params, k, v, tokens, positions, *, config):
        return good(params, k, v, tokens, np.maximum(positions - 1, 0), config=config)

    monkeypatch.setattr(dense, "decode", broken)
    setup = dataclasses.replace(bench.TINY_SETUP, concurrencies=(4,), run_shared=False,
                                equal_memory_run=False)
    params = bench._params(setup)
    with pytest.raises(RuntimeError, match="different greedy tokens"):
        bench.bench(setup, params, min_identical=1.0, log=lambda *a: None)


def test_trtllm_preset_tiny():
    """The seed-workload preset on the tiny model: the shared-prefix run (prefix reuse, a host
    tier) first, then the random row paged and dense (identical tokens); every row reports
    inter-token latencies and a roofline line, the paged rows pages per tier."""
    out = bench.main(["--workload", "trtllm", "--tiny"])
    setup = bench.TINY_TRTLLM
    names = [r["name"] for r in out["results"]]
    assert names == ["paged shared c8 prefix on", "paged random c8", "dense random c8"]
    shared = out["results"][0]
    assert shared["requests"] == setup.shared_requests
    assert shared["input_tokens_mean"] == setup.shared_total_len
    assert shared["generated_tokens"] == setup.shared_requests * setup.shared_output_len
    assert shared["prefix_hit_rate"] > 0.2 and "host" in shared["pages_per_tier"]
    for r in out["results"]:
        assert r["itl_p90_ms"] >= r["itl_p50_ms"] > 0, r["name"]
        f = r["roofline"]
        assert f["step_bytes"] == f["weight_bytes"] + f["kv_bytes"] > 0
        assert f["copy_bytes_per_s"] > 0 and f["fraction_of_roofline"] > 0
    assert all(a["identical"] == a["requests"] > 0 for a in out["agreement"])
    args = bench.parse_args(["--workload", "trtllm", "--quick"])
    quick = bench.setup_from_args(args)
    assert (quick.shared_requests, quick.shared_concurrency, quick.input_len,
            quick.output_len) == (512, 256, 1024, 1024) and quick.host_bytes > 0
    assert bench.setup_from_args(bench.parse_args(["--workload", "trtllm"])).shared_requests \
        == 2500


def test_arena_rows_need_a_gpu_and_cover_the_paged_pool():
    """--hot-backend arena is refused on the CPU (a donated CPU step copies the reservation);
    the arena's budget holds the paged pool's bytes plus a chunk per range and the null one."""
    import jax

    setup = bench.TINY_SETUP
    if jax.default_backend() != "gpu":
        with pytest.raises(SystemExit, match="needs a GPU"):
            bench.setup_from_args(bench.parse_args(["--tiny", "--hot-backend", "arena"]))
    a = bench._arena_config(setup, 4)
    m = setup.model
    slot = setup.page_size * m.num_key_value_heads * m.head_dim * np.dtype(m.jnp_dtype).itemsize
    pool = setup.pool_pages(4) * 2 * m.num_hidden_layers * slot
    chunk = 2 * m.num_hidden_layers * int(np.lcm(slot, bench.ARENA_SUPER_PAGE))
    assert a.budget_bytes == pool + 5 * chunk and a.max_sequences == 4
    assert a.max_pages_per_sequence == setup.pages_per_seq
def test_tiny_mixed_layer_rows():
    """--sliding-window: the paged rows on a model with full and window layers (two KV groups,
    ring tables); the runs over the same requests (prefix reuse on, warm, off) still agree."""
    args = bench.parse_args(["--tiny", "--sliding-window", "8", "--full-every", "2"])
    setup = bench.setup_from_args(args)
    assert setup.model.layer_windows() == (8, None) and not setup.run_dense
    out = bench.main(["--tiny", "--sliding-window", "8", "--full-every", "2"])
    assert out["agreement"] and all(a["identical"] == a["requests"] > 0
                                    for a in out["agreement"])
    assert not any("dense" in r["name"] for r in out["results"])
