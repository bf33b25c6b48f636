"""The serving benchmark (``python -m benchmarks.serve``) in ``--tiny`` mode (CPU, float32): the dense baseline is the paged runner.

The tiny run serves the same random requests through the paged server (two concurrencies), the
dense per-sequence cache at equal batch and at equal memory, and a shared-prefix set with prefix
reuse on and off; every pair of runs over the same requests must generate identical greedy tokens,
with float32 logits within relative L2 1e-5 (the benchmark raises otherwise). A deliberately
broken dense decode must be caught.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest

import jax_kvcm  # (the installed package before the repo root goes on sys.path)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repo root: benchmarks/ and examples/

from benchmarks import bench_serve as bench  # noqa: E402
from benchmarks.harness import dense_llama, serve_matrix, serve_runs, serve_setup  # noqa: E402
from benchmarks.harness import tp_scaling  # noqa: E402
from examples.llama import hot_backend  # noqa: E402
from examples.llama import serve  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """``--tiny`` with the arena rows beside the paged ones, run once for the tests of both
    (the paged and dense rows are those of a plain ``--tiny`` run); (output, its JSON file)."""
    path = tmp_path_factory.mktemp("tiny") / "serve.json"
    return bench.main(["--tiny", "--hot-backend", "paged", "arena", "--json", str(path)]), path


def test_tiny_run_paged_equals_dense(tiny_run):
    out, path = tiny_run
    assert json.loads(path.read_text())["results"] == json.loads(json.dumps(out["results"]))
    assert bench.setup_from_args(bench.parse_args(["--tiny"])).hot_backends == ("paged",)
    setup = serve_setup.TINY_SETUP
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
    dense = dense_llama
    good = dense.decode

    def broken(params, k, v, tokens, positions, *, config):
        return good(params, k, v, tokens, np.maximum(positions - 1, 0), config=config)

    monkeypatch.setattr(dense, "decode", broken)
    setup = dataclasses.replace(serve_setup.TINY_SETUP, concurrencies=(4,), run_shared=False,
                                equal_memory_run=False)
    params = serve_setup.random_params(setup)
    with pytest.raises(RuntimeError, match="different greedy tokens"):
        serve_matrix.bench(setup, params, min_identical=1.0, log=lambda *a: None)


@pytest.fixture(scope="module")
def trtllm_tiny():
    """``--workload trtllm --tiny``, run once for the preset test and as the write-back-ahead
    test's run with write-back ahead (the preset's default)."""
    return bench.main(["--workload", "trtllm", "--tiny"])


def test_trtllm_preset_tiny(trtllm_tiny):
    """The seed-workload preset on the tiny model: the shared-prefix run (prefix reuse, a host
    tier) first, then the random row paged and dense (identical tokens); every row reports
    inter-token latencies and a roofline line, the paged rows pages per tier."""
    out = trtllm_tiny
    setup = serve_setup.TINY_TRTLLM
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
    # all at once (no --request-rate): TTFT from submission, no arrivals table
    assert all(r["request_rate"] is None for r in out["results"] if r["path"] == "paged")
    assert "Poisson arrivals" not in bench.markdown(out)
    args = bench.parse_args(["--workload", "trtllm", "--quick"])
    quick = bench.setup_from_args(args)
    assert (quick.shared_requests, quick.shared_concurrency, quick.input_len,
            quick.output_len) == (512, 256, 1024, 1024) and quick.host_bytes > 0
    assert bench.setup_from_args(bench.parse_args(["--workload", "trtllm"])).shared_requests \
        == 2500


def test_arena_and_paged_get_equal_kv_bytes():
    """The serving benchmark's arena rows get the paged pool's pages as their budget (equal
    K/V bytes), twice max_batch ranges and this backend's super-page (2 MiB VMM on a GPU, 4 KiB
    memfd pages on CPU)."""
    setup = serve_setup.TINY_SETUP
    paged = hot_backend.hot_backend_fields(serve_runs.serve_config(setup, 4, True, "paged"))
    arena = hot_backend.hot_backend_fields(serve_runs.serve_config(setup, 4, True, "arena"))
    assert arena["device_pages"] == paged["device_pages"] == setup.pool_pages(4)
    a = arena["hot"]
    assert a.kind == "arena" and paged["hot"].kind == "paged"
    assert a.max_sequences == 8 and a.super_page_bytes == hot_backend.arena_super_page()


def test_tiny_arena_rows_beside_paged(tiny_run):
    """--hot-backend paged arena on the tiny model (on CPU: the arena's donated steps over
    ArenaPools): an arena row beside each paged row, the same tokens, no map/unmap in the
    second half, and the arena-vs-paged comparisons."""
    out, _ = tiny_run
    runs = {r["name"]: r for r in out["results"]}
    names = [n for n in runs if n.startswith("arena ")]
    assert sorted(names) == sorted(["arena random c4", "arena random c8",
                                    "arena shared c4 prefix on"]), list(runs)
    for name in names:
        arena, paged = runs[name], runs["paged" + name[len("arena"):]]
        assert arena["generated_digests"] == paged["generated_digests"], name
        assert arena["generated_tokens"] == paged["generated_tokens"] > 0
        # NOTE: no unmap anywhere; no map once every range was used (from the second wave of
        # requests on, admissions adopt parked ranges mapped to full length; a single wave
        # still maps its sequences' last chunks as they grow).
        assert arena["arena_steady_unmap_calls"] == 0, name
        if arena["requests"] >= 2 * arena["concurrency"]:
            assert arena["arena_steady_map_calls"] == 0, name
        assert arena["kv_budget_bytes"] == paged["kv_budget_bytes"], name    # equal K/V bytes
        assert 0 < arena["arena_physical_bytes_peak"] <= arena["kv_budget_bytes"]
    kinds = [c for c in out["comparisons"] if c["kind"] == "arena_vs_paged"]
    assert len(kinds) == 3 and all(c["tokens_per_s_over_paged"] > 0 for c in kinds)


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


# ---------------------------------------------------------------------------------------------
# Where the loop's time goes (--profile, several --prefill-chunk values).

from benchmarks.harness import loop_profile  # noqa: E402

pytestmark = pytest.mark.slow  # seconds to minutes: `pytest -m "not gpu and not slow"` skips it
def _rec(index, kind, rows, decode_rows, waiting, running, t_start, t_end, t_ready, wait_s):
    return types.SimpleNamespace(index=index, kind=kind, rows=rows, decode_rows=decode_rows,
                                 tokens=rows, waiting=waiting, running=running, t_start=t_start,
                                 t_end=t_end, t_ready=t_ready, wait_s=wait_s, new_program=False)


def test_phases_and_loop_stats_of_made_up_records():
    """Ramp-up until the first decode-only step at the full batch, the tail from the first
    step with nothing waiting and the batch below full; step time = interval between tokens
    reaching the host; host = the call less the reads it blocked on."""
    recs = [_rec(1, "prefill", 1, 0, 3, 4, 0.0, 1.0, 2.5, 0.0),
            _rec(2, "mixed", 4, 3, 3, 4, 1.0, 3.0, 4.0, 0.5),     # read of 1 blocked 1.0 in it
            _rec(3, "decode", 4, 4, 3, 4, 3.0, 4.5, 6.0, 0.2),
            _rec(4, "mixed", 4, 3, 0, 4, 4.5, 6.5, 7.0, 0.0),
            _rec(5, "decode", 3, 3, 0, 3, 6.5, 7.5, 9.0, 0.0),
            _rec(6, "decode", 2, 2, 0, 2, 7.5, 9.5, 10.0, 0.0)]
    recs[0].wait_s = 1.0
    assert loop_profile.phases(recs, 4) == ["ramp-up", "ramp-up", "steady", "steady", "tail",
                                            "tail"]
    times = {t["index"]: t for t in loop_profile.step_times(recs)}
    assert times[1]["step"] == 2.5 and times[2]["step"] == 1.5 and times[6]["step"] == 1.0
    assert times[2]["host"] == 2.0 - 1.0 and times[2]["wall"] == 2.0
    s = loop_profile.loop_stats(recs, 4, 10.0)
    assert s["kinds"]["decode"]["steps"] == 3 and s["kinds"]["mixed"]["steps"] == 2
    assert abs(sum(k["share"] for k in s["kinds"].values()) - 1) < 1e-12
    assert s["phases"]["tail"]["seconds"] == 3.0 and s["phases"]["steady"]["steps"] == 2
    assert s["steps_seconds"] == 10.0
    # the decode steps at the full batch (4 rows): record 3 alone, 2.0 s from 4.0 to 6.0
    assert s["full_decode"]["steps"] == 1 and s["full_decode"]["step_ms_p50"] == 2000.0
    s = loop_profile.loop_stats(recs, 4, 10.0, exclude={3, 4})
    assert s["kinds"]["mixed"]["steps"] == 1 and "steady" not in s["phases"]
    assert "| decode | 2 |" in loop_profile.format_loop("x", s)
    assert s["full_decode"] == {}
    # steps spanning more than the run's clock: time left out of it ran steps
    assert "WARNING" not in loop_profile.format_loop("x", loop_profile.loop_stats(recs, 4, 10.0))
    assert "overstated" in loop_profile.format_loop("x", loop_profile.loop_stats(recs, 4, 4.0))


def test_roofline_compares_with_the_full_batch_decode_steps():
    """The roofline assumes the full batch, so it is measured against the full-batch decode
    steps' p50 where the loop has them, else against every decode step's."""
    from benchmarks.harness.serve_report import format_roofline, roofline
    setup = serve_setup.TINY_TRTLLM
    reqs = [serve.Request(prompt=[1] * 8, max_new_tokens=4) for _ in range(4)]
    res = {"path": "paged", "concurrency": 4, "decode_step_ms_p50": 2.0,
           "loop": {"full_decode": {"steps": 7, "step_ms_p50": 4.0}}}
    r = roofline(setup, 1000, res, reqs, 1e9)
    assert r["measured_step_ms"] == 4.0 and r["measured_over"] == "7 full-batch decode steps"
    assert r["fraction_of_roofline"] == r["roofline_step_ms"] / 4.0
    assert "p50 of 7 full-batch decode steps" in format_roofline("x", r)
    res["loop"]["full_decode"] = {}
    r = roofline(setup, 1000, res, reqs, 1e9)
    assert r["measured_step_ms"] == 2.0 and r["measured_over"] == "every decode step"


def test_compute_aware_roofline_counts_the_gemm_flops():
    """The GEMM FLOPs per token are 2 x the model's linear weights (counted here from the
    initialized parameters: every 2-D array but the embedding table), and the compute-aware
    floor is the K/V read plus the GEMMs at the longer of their bytes and their FLOPs."""
    from benchmarks.harness.serve_report import (compute_aware_ms, format_roofline,
                                                 gemm_flops_per_token, gemm_throughput,
                                                 roofline)
    from examples.llama import model as llama
    setup = serve_setup.TINY_TRTLLM
    c = setup.model
    params = llama.init_params(c)
    linear = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                 if x.ndim == 2 and "embed" not in jax.tree_util.keystr(path))
    assert gemm_flops_per_token(c) == 2 * linear
    # bytes-bound GEMMs (2 ms of weights vs 1 ms of FLOPs) and compute-bound ones (4 ms)
    assert compute_aware_ms(2e9, 3e9, 1e12, 1e12, 1e15) == pytest.approx(5.0)
    assert compute_aware_ms(2e9, 3e9, 4e12, 1e12, 1e15) == pytest.approx(7.0)
    reqs = [serve.Request(prompt=[1] * 8, max_new_tokens=4) for _ in range(4)]
    res = {"path": "paged", "concurrency": 4, "decode_step_ms_p50": 2.0}
    r = roofline(setup, 1000, res, reqs, 1e9, gemm_flops_per_s=1e9)
    assert r["gemm_flops"] == 4 * gemm_flops_per_token(c)
    assert r["compute_roofline_step_ms"] == pytest.approx(
        (r["kv_bytes"] / 1e9 + max(1000 / 1e9, r["gemm_flops"] / 1e9)) * 1e3)
    assert r["compute_roofline_step_ms"] > r["roofline_step_ms"]
    assert r["fraction_of_compute_roofline"] == r["compute_roofline_step_ms"] / 2.0
    assert "TFLOP/s measured" in format_roofline("x", r)
    assert "gemm_flops" not in roofline(setup, 1000, res, reqs, 1e9)
    rate = gemm_throughput(True, shapes=((64, 32, 16), (32, 32, 32)), repeats=2, calls=2)
    assert rate["flops_per_s"] > 0 and (rate["m"], rate["k"], rate["n"]) in {(64, 32, 16),
                                                                              (32, 32, 32)}


def _check_profiled_runs(out, prof, *, on_device: bool) -> None:
    """Every paged run of ``out`` has loop timings and a profiled window whose steps all
    matched a traced step program: decode steps spend time in the paged kernel, mixed and
    prefill steps in the ragged one (the program each step matched must agree), every step
    in GEMMs and K/V writes."""
    seen = collections.Counter()
    for r in out["results"]:
        if r["path"] != "paged":
            continue
        chunk = r["prefill_chunk_tokens"]
        assert r["step_tokens"] == 8 + chunk and r["compiled_programs"] == 2, r["name"]
        loop = r["loop"]
        mixed, decode = loop["kinds"]["mixed"], loop["kinds"]["decode"]
        assert decode["tokens_mean"] == decode["rows_mean"] < mixed["tokens_mean"]
        assert mixed["tokens_mean"] <= 8 + chunk and mixed["step_ms_p50"] > 0
        p = r["profile"]
        assert p["window_steps"] == p["matched"] == 8 and p["on_device"] == on_device, p
        run = r["name"].split(" [chunk")[0]
        assert p["dir"] == loop_profile.profile_dir(str(prof), f"{run} chunk {chunk}")
        assert os.listdir(p["dir"])
        for kind, k in p["kinds"].items():
            ms = k["ms_per_step"]
            seen[kind] += k["steps"] if kind != "all" else 0
            assert ms["weight GEMMs"] > 0 and ms["K/V writes"] > 0, (kind, ms)
            assert ms["total"] >= ms["weight GEMMs"] + ms["ragged attention"]
            if kind == "decode":
                assert ms["paged attention"] > 0 == ms["ragged attention"], ms
            elif kind in ("mixed", "prefill"):
                assert ms["ragged attention"] > 0 == ms["paged attention"], ms
    assert seen["decode"] > 0 and seen["mixed"] > 0, seen


def test_profile_window_and_chunk_sweep_tiny(tmp_path):
    """--profile traces a window of steps of every paged run and breaks its device time down
    per step kind (decode steps run the paged kernel, mixed ones the ragged one: the program
    each traced step matched must agree); --prefill-chunk with two values runs the paged rows
    once per value, with the token budget concurrency + chunk, and compares them."""
    prof = tmp_path / "prof"
    out = bench.main(["--workload", "trtllm", "--tiny", "--profile", str(prof),
                      "--profile-steps", "8", "--prefill-chunk", "16", "32"])
    names = [r["name"] for r in out["results"]]
    assert names == ["paged shared c8 prefix on [chunk 16]", "paged random c8 [chunk 16]",
                     "dense random c8 [chunk 16]", "paged shared c8 prefix on [chunk 32]",
                     "paged random c8 [chunk 32]"]
    assert [s["prefill_chunk"] for s in out["sweep"]] == [16, 32]
    assert all(a["identical"] == a["requests"] > 0 for a in out["agreement"])
    # the chunk size changes no token (float32, CPU): each run against its first value
    assert {(a["a"], a["b"]) for a in out["agreement"]} >= {
        (f"{run} [chunk 16]", f"{run} [chunk 32]")
        for run in ("paged shared c8 prefix on", "paged random c8")}
    assert sum(c["kind"] == "equal_memory" for c in out["comparisons"]) == 1
    _check_profiled_runs(out, prof, on_device=False)
    table = loop_profile.format_sweep(out["results"])
    assert table.count("| paged random c8 |") == 2 and "| 32 | 40 |" in table
    with pytest.raises(SystemExit, match="distinct"):
        bench.setup_from_args(bench.parse_args(["--tiny", "--prefill-chunk", "16", "16"]))
    args = bench.parse_args(["--workload", "trtllm", "--quick", "--prefill-chunk", "512", "2048"])
    assert [bench.setup_from_args(args, c).step_tokens for c in (512, 2048)] == [768, 2304]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
def test_profile_window_gpu(backend, tmp_path):
    """On a GPU: the trace's "XLA Modules" line names the step programs and its ops are the
    programs' HLO instructions (or kernels named after them), so every traced step matches a
    dispatched one and its device time lands in the right categories."""
    backend.device                        # fails here when there is no GPU
    prof = tmp_path / "prof"
    out = bench.main(["--workload", "trtllm", "--tiny", "--no-dense", "--profile", str(prof),
                      "--profile-steps", "8", "--prefill-chunk", "16"])
    _check_profiled_runs(out, prof, on_device=True)
    for r in out["results"]:
        host_gap = r["profile"]["kinds"]["all"]["ms_per_step"]["idle before the step (host gap)"]
        print(r["name"], "host gap ms per step", host_gap, r["profile"]["other_top"])


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: collectives in the profile, the largest concurrency per TP value.

def test_max_concurrency_against_the_managers_pool_bytes():
    """The largest concurrency arithmetic against KVCacheConfig's own per-device pool bytes: the
    pool of c_max sequences (sized as the run sizes it) fits the K/V budget, c_max + 1 does not;
    for the 8B shape on an H200-sized budget at TP 1 and (page bytes halved, weights per device
    as tp.param_specs splits them) TP 2."""
    from examples.llama import tp

    setup = dataclasses.replace(serve_setup.TRTLLM, run_shared=False)
    m = setup.model
    assert setup.max_total_len == 2048 and setup.pages_per_seq == 128

    def pool_bytes(c: int, n: int) -> int:
        group = jax_kvcm.LayerGroupConfig(num_layers=m.num_hidden_layers,
                                          num_kv_heads=tp.kv_heads(m, n) // n,
                                          head_dim=m.head_dim, dtype=m.jnp_dtype)
        cfg = jax_kvcm.KVCacheConfig(tokens_per_page=setup.page_size, layer_groups=(group,),
                                     device_pages=setup.pool_pages(c), max_batch=max(c, 1),
                                     max_seq_len=setup.max_total_len)
        return cfg.device_pool_bytes()

    shapes = {"embed": (m.vocab_size, m.hidden_size), "lm_head": (m.hidden_size, m.vocab_size)}
    layer = {"wqkv": (m.hidden_size, (m.num_attention_heads + 2 * m.num_key_value_heads)
                      * m.head_dim),
             "wo": (m.num_attention_heads * m.head_dim, m.hidden_size),
             "w_gate_up": (m.hidden_size, 2 * m.intermediate_size),
             "w_down": (m.intermediate_size, m.hidden_size)}
    full = 2 * (sum(a * b for a, b in shapes.values())
                + m.num_hidden_layers * sum(a * b for a, b in layer.values()))
    # TP 2: embed replicated, lm_head and every layer matrix split in two (norms left out)
    half = 2 * (m.vocab_size * m.hidden_size) + (full - 2 * m.vocab_size * m.hidden_size) // 2
    memory = int(0.9 * 141e9)
    for n, weights in ((1, full), (2, half)):
        page = 2 * m.num_hidden_layers * setup.page_size * (m.num_key_value_heads // n) \
            * m.head_dim * 2
        row = tp_scaling.max_concurrency(memory, weights, page, setup.pages_per_seq)
        c = row["max_concurrency"]
        budget = int(serve_setup.KV_MEMORY_FRACTION * (memory - weights))
        assert row["kv_budget_bytes"] == budget and row["page_bytes_per_device"] == page
        assert pool_bytes(c, n) <= budget < pool_bytes(c + 1, n), (n, c)
        print(f"TP {n}: {weights / 2**30:.2f} GiB weights per device, {page:,} B per page, "
              f"largest concurrency {c}")
        if n == 1:
            c1 = c
    assert 256 <= c1 and c > 2 * c1     # TP 2 holds more than twice: the weights split too
    assert tp_scaling.max_concurrency(weights, weights, page, 128)["max_concurrency"] == 0


def test_tp_cli_checks():
    """--tensor-parallel values: distinct, one sweep at a time, within the visible devices."""
    for argv, msg in ((["--tensor-parallel", "1", "1"], "distinct"),
                      (["--tensor-parallel", "1", "2", "--prefill-chunk", "16", "32"],
                       "one of them at a time"),
                      (["--tensor-parallel", "1", "64"], "visible devices"),
                      (["--kv-memory-fraction", "1.5"], "kv-memory-fraction"),
                      (["--device-memory-gib", "0"], "device-memory-gib")):
        with pytest.raises(SystemExit, match=msg):
            bench.setup_from_args(bench.parse_args(["--tiny", *argv]))
    assert bench.setup_from_args(bench.parse_args(["--tiny"])).tensor_parallel == 1


def test_trtllm_tiny_with_write_back_ahead(trtllm_tiny):
    """Write-back ahead, on by default in the trtllm preset: its shared-prefix run (the paged rows
    of the preset run) moves cached pages to the host tier ahead of need, reports it (log
    counters, the tiers table), and generates exactly the tokens of the run with
    ``--offload-ahead-pages 0`` (off)."""
    out = dict(trtllm_tiny, results=[r for r in trtllm_tiny["results"] if r["path"] == "paged"])
    base = bench.main(["--workload", "trtllm", "--tiny", "--no-dense", "--offload-ahead-pages", "0"])
    w = out["results"][0]["fence_waits"]
    assert w["offload_ahead_moves"] > 0 and w["offload_ahead_pages"] > 0
    assert w["offload_ahead_failures"] == 0 and w["side_stream_calls"] == 0  # CPU: no side stream
    assert [r["name"] for r in base["results"]] == [r["name"] for r in out["results"]]
    for a, b in zip(base["results"], out["results"]):
        assert a["generated_digests"] == b["generated_digests"], a["name"]
    assert "offloaded ahead" in bench.markdown(out)
    assert base["results"][0]["fence_waits"]["offload_ahead_moves"] == 0


ARRIVAL_SEED = 3   # the arrival tests' seed (printed)


def _seeded_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """The schedule --request-rate must follow, drawn here independently of the harness: 0,
    then the running sum of n - 1 exponential gaps of mean 1 / rate from default_rng(seed)."""
    return np.concatenate([[0.0], np.cumsum(np.random.default_rng(seed).exponential(1 / rate,
                                                                                    n - 1))])


def test_arrival_times_are_the_seeded_exponential_draws():
    """--request-rate's schedule: the gaps are exactly the seeded generator's exponential draws
    (another seed, other gaps); no rate: every request at 0."""
    from benchmarks.harness import serve_arrivals
    print(f"arrival seed {ARRIVAL_SEED}")
    times = serve_arrivals.arrival_times(2000, 100.0, ARRIVAL_SEED)
    np.testing.assert_array_equal(times, _seeded_arrivals(2000, 100.0, ARRIVAL_SEED))
    gaps = np.diff(times)
    assert abs(gaps.mean() - 0.01) < 0.001 and abs(gaps.std() - 0.01) < 0.0015  # exponential
    assert not np.array_equal(times, serve_arrivals.arrival_times(2000, 100.0, ARRIVAL_SEED + 1))
    np.testing.assert_array_equal(serve_arrivals.arrival_times(3, None, 0), [0.0, 0.0, 0.0])
    assert len(serve_arrivals.arrival_times(1, 5.0, 0)) == 1


def test_request_rate_flag(capsys):
    """--request-rate takes a rate > 0 or inf (all at once, the default mode); 0, a negative
    rate, NaN and words are refused by argparse, naming the flag; --arrival-seed defaults to 0."""
    for bad in ("0", "-2", "nan", "fast"):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--tiny", "--request-rate", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --request-rate" in err and repr(bad) in err, err
    s = bench.setup_from_args(bench.parse_args(["--tiny", "--request-rate", "2.5"]))
    assert (s.request_rate, s.arrival_seed) == (2.5, 0)
    for argv in ([], ["--request-rate", "inf"]):
        s = bench.setup_from_args(bench.parse_args(["--tiny", "--arrival-seed", "7", *argv]))
        assert (s.request_rate, s.arrival_seed) == (None, 7)


def test_arrivals_time_ttft_from_arrival():
    """A request that arrives while a step runs is submitted after it: its TTFT is the server's
    (from submission) plus that wait, on a made-up server and clock (steps of 50 ms; idle, the
    clock jumps to the next arrival as the loop's sleep would)."""
    from benchmarks.harness import serve_arrivals
    clock = [0.0]
    submitted: dict[int, float] = {}

    class Server:
        def submit(self, request):
            submitted[100 + len(submitted)] = clock[0]
            return 100 + len(submitted) - 1

    arr = serve_arrivals.Arrivals(list(range(12)), 10.0, ARRIVAL_SEED)
    server, steps_left = Server(), 0          # each request: 3 steps of work
    while steps_left or arr.pending:          # run_paged's loop
        before = len(arr.rids)
        wait = arr.submit_due(server, lambda: clock[0])
        steps_left += 3 * (len(arr.rids) - before)
        if not steps_left:
            clock[0] += wait                  # idle: sleep until the next arrival
            continue
        clock[0] += 0.05                      # a step
        steps_left -= 1
    outs = {rid: types.SimpleNamespace(time_to_first_token_s=0.01) for rid in submitted}
    times = _seeded_arrivals(12, 10.0, ARRIVAL_SEED)
    sub = np.array([submitted[rid] for rid in arr.rids])
    assert arr.rids == sorted(submitted) and (sub >= times).all(), (sub, times)
    np.testing.assert_allclose(arr.ttft_s(outs), 0.01 + sub - times)
    assert (sub - times).max() > 0.01       # some waited: TTFT from submission would differ
    st = arr.stats()
    assert st["request_rate"] == 10.0 and st["arrival_seed"] == ARRIVAL_SEED
    assert st["achieved_arrival_rate"] == pytest.approx(11 / (sub[-1] - sub[0]))


def test_request_rate_run_tiny(monkeypatch, tmp_path, capsys):
    """--request-rate 20 on the tiny seed workload (24 requests): each request is submitted to
    the Server once the run's clock passes its seeded arrival time, never before; the loop
    sleeps while idle (at most once per arrival) rather than spinning; TTFT is reported from
    each request's arrival, far below the run's length (from the run's start it would be about
    half of it); the table and the JSON carry the rate, the achieved rate and the seed."""
    rate = 20.0
    print(f"arrival seed {ARRIVAL_SEED}")
    calls: list[tuple[int, float]] = []
    submit = serve.Server.submit

    def recorded(self, request):
        calls.append((id(self), time.perf_counter()))
        return submit(self, request)

    monkeypatch.setattr(serve.Server, "submit", recorded)
    sleeps: list[float] = []
    sleep = time.sleep

    def counted(s):
        if sys._getframe(1).f_globals["__name__"] == serve_runs.__name__:
            sleeps.append(s)
        sleep(s)

    monkeypatch.setattr(time, "sleep", counted)
    path = tmp_path / "r.json"
    out = bench.main(["--workload", "trtllm", "--tiny", "--no-dense", "--no-random",
                      "--request-rate", "20", "--arrival-seed", str(ARRIVAL_SEED),
                      "--json", str(path)])
    (r,) = out["results"]
    n = r["requests"]
    timed = np.array([t for s, t in calls if s == calls[-1][0]])   # the timed server's
    assert len(timed) == n == serve_setup.TINY_TRTLLM.shared_requests
    arrivals = _seeded_arrivals(n, rate, ARRIVAL_SEED)
    since = timed - timed[0]          # the first arrives at 0, submitted as the clock starts
    assert (since >= arrivals - 1e-3).all(), np.c_[since, arrivals]
    assert (since <= arrivals + 0.5).all(), np.c_[since, arrivals]   # and the loop kept up
    assert 1 <= len(sleeps) <= n and sum(sleeps) > 0, sleeps   # slept, not spun
    assert r["seconds"] >= arrivals[-1] and r["ttft_p90_s"] < r["seconds"] / 4, r
    assert r["request_rate"] == rate and r["arrival_seed"] == ARRIVAL_SEED
    assert r["achieved_arrival_rate"] == pytest.approx((n - 1) / (since[-1] - since[0]),
                                                       rel=0.05)
    assert 0 <= r["submit_lag_ms_p50"] <= r["submit_lag_ms_max"]
    saved = json.loads(path.read_text())
    assert saved["results"][0]["arrival_seed"] == ARRIVAL_SEED
    assert saved["setup"]["request_rate"] == rate
    md = bench.markdown(out)
    assert "| run (Poisson arrivals) |" in md and f"| {r['name']} | 20 |" in md
    assert f"arrival seed {ARRIVAL_SEED}" in capsys.readouterr().out


def test_cascade_run_tiny(trtllm_tiny):
    """``--cascade``: the shared-prefix run reads shared prefixes once per group: the report
    counts the decode steps' K/V token reads and the share the cascade saved, and the greedy
    tokens equal the run without it (the float32 tiny model)."""
    out = bench.main(["--workload", "trtllm", "--tiny", "--no-dense", "--no-random",
                      "--no-check", "--cascade"])
    (r,) = out["results"]
    assert r["cascade"] and r["decode_kv_tokens"] > r["cascade_tokens_saved"] > 0
    assert r["cascade_grouped_rows"] > 0
    assert "| run (cascade) |" in bench.markdown(out)
    plain = trtllm_tiny["results"][0]
    assert not plain["cascade"] and plain["cascade_tokens_saved"] == 0
    assert r["generated_digests"] == plain["generated_digests"]


def test_xla_option_parsing():
    from benchmarks.harness.xla_options import xla_options
    assert xla_options("xla_gpu_enable_triton_gemm=false") == (
        ("xla_gpu_enable_triton_gemm", False),)
    assert xla_options("xla_gpu_autotune_level=0") == (("xla_gpu_autotune_level", 0),)
    assert xla_options("k=abc") == (("k", "abc"),)
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        xla_options("no_value")
    # one --xla-option is one variant: commas join its options
    assert xla_options("xla_gpu_enable_triton_gemm=false,xla_gpu_autotune_level=0") == (
        ("xla_gpu_enable_triton_gemm", False), ("xla_gpu_autotune_level", 0))
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        xla_options("a=1,")
