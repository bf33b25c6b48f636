"""The example Llama serving loop (examples/llama/serve.py) and CLI (examples/llama/run.py) on
KVCacheManager, against HF transformers (torch CPU) through real checkpoints.

Small random LlamaForCausalLM / MistralForCausalLM models are saved with ``save_pretrained``
(safetensors) and loaded back through ``examples/llama/loader.py``. Greedy generations must be
HF's token for token: single requests, batches of mixed lengths under a small token budget
(chunked prefill with decodes riding along), shared-prefix requests (the later ones report prefix
hits), a run with so few device pages that pages go to host and disk and sequences are suspended
and resumed, and one with no cold tier where sequences are dropped and recomputed. Then sampling
(seeded, per-request keys), the compiled-shape bound, and the CLI as a subprocess. Where the
server records logits (mixed batches, the host/disk pressure run), every generated token's float32
logits must also be within relative L2 1e-4 of HF's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import hf_checkpoint, hf_logits, random_hf_llama, random_prompt
import jax_kvcm  # noqa: F401  (the installed package first; the repo root goes on sys.path after)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.llama import loader as llama_loader  # noqa: E402
from examples.llama import model as llama  # noqa: E402
from examples.llama import serve  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EOS = 2
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
CONFIGS = {"llama": ("llama", dict(rope_theta=10000.0)),
           "mistral": ("mistral", dict(sliding_window=8))}


def _hf_model(kind: str, extra: dict, seed: int):
    return random_hf_llama(kind, {**BASE, **extra}, seed)


_CASES: dict[str, dict] = {}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    if name not in _CASES:
        kind, extra = CONFIGS[name]
        hf = _hf_model(kind, extra, seed=3 + len(name))
        config, params = hf_checkpoint(hf, tmp_path_factory.mktemp(f"hf_{name}"))
        assert config.model_type == kind
        _CASES[name] = dict(name=name, hf=hf, config=config, params=params)
    return _CASES[name]


_hf_logits = hf_logits


REL_L2 = 1e-4


def _check_greedy(hf, prompt, got, n, what="", logits=None) -> None:
    """``got`` must be HF's greedy continuation of ``prompt`` (``n`` tokens, or fewer ending in
    EOS): one teacher-forced HF forward over ``prompt + got``; each token must be the argmax at
    the position before it (by induction, exactly HF's greedy decoding). With ``logits`` (ours,
    one row per generated token) also each row within relative L2 ``REL_L2`` of HF's."""
    assert len(got) == n or (got and got[-1] == EOS), f"{what}: stopped early: {got}"
    assert EOS not in got[:-1], f"{what}: ran past EOS: {got}"
    ref = _hf_logits(hf, list(prompt) + list(got))[len(prompt) - 1:len(prompt) - 1 + len(got)]
    want = ref.argmax(-1).tolist()
    assert got == want, f"{what}: {got} != HF greedy (first {len(got)} argmaxes) {want}"
    if logits is not None:
        assert logits.shape == (len(got), ref.shape[1])
        err = max(float(np.linalg.norm(logits[j] - ref[j]) / np.linalg.norm(ref[j]))
                  for j in range(len(got)))
        assert err <= REL_L2, f"{what}: logits rel L2 {err:.2e}"


def _server(case, **kw) -> serve.Server:
    cfg = dict(page_size=4, device_pages=64, max_batch=4, max_tokens_per_step=16,
               max_seq_len=128)
    cfg.update(kw)
    return serve.Server(case["params"], case["config"], serve.ServeConfig(**cfg))


# ---------------------------------------------------------------------------------------------


def test_single_request_matches_hf_generate(case):
    hf = case["hf"]
    prompt = random_prompt(np.random.default_rng(1), 13)
    srv = _server(case, max_tokens_per_step=8)           # two prefill chunks
    (out,) = srv.generate([serve.Request(prompt, 20)])
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                           dtype=torch.long), max_new_tokens=20, do_sample=False,
                           pad_token_id=0, eos_token_id=EOS)[0, len(prompt):].tolist()
    assert out.generated_ids == want, (out.generated_ids, want)
    assert len(set(want)) > 3, f"degenerate generation {want}"   # the check must have teeth
    assert out.finish_reason == ("eos" if want[-1] == EOS else "length")
    rep = srv.report()
    assert rep["mixed_steps"] == 2 and rep["decode_steps"] == len(want) - 1, rep
    srv.manager.check_invariants()


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_finish_on_eos(case):
    prompt = random_prompt(np.random.default_rng(8), 7)
    srv = _server(case)
    (ref,) = srv.generate([serve.Request(prompt, 6, eos_token_ids=())])
    assert ref.finish_reason == "length" and len(ref.generated_ids) == 6
    stop = ref.generated_ids[2]
    cut = ref.generated_ids.index(stop) + 1
    (out,) = srv.generate([serve.Request(prompt, 6, eos_token_ids=(stop,))])
    assert out.finish_reason == "eos" and out.generated_ids == ref.generated_ids[:cut]
    assert srv.manager.stats()["num_active"] == 0


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_xla_options_reach_the_step_compiler(case):
    """ServeConfig.xla_options compile the device step with those options: a real option keeps
    HF's greedy tokens; an unknown one fails the request with XLA's error naming it."""
    prompt = random_prompt(np.random.default_rng(4), 9)
    srv = _server(case, xla_options=(("xla_gpu_enable_triton_gemm", False),))
    (out,) = srv.generate([serve.Request(prompt, 8, eos_token_ids=())])
    _check_greedy(case["hf"], prompt, out.generated_ids, 8, "xla_options")
    bad = _server(case, xla_options=(("xla_no_such_option", 1),), max_step_retries=0)
    (out,) = bad.generate([serve.Request(prompt, 4, eos_token_ids=())])
    assert out.finish_reason == "error" and "xla_no_such_option" in out.error, out
    with pytest.raises(ValueError, match="xla_options"):
        serve.ServeConfig(xla_options=("xla_gpu_enable_triton_gemm",))


def test_batch_of_mixed_lengths(case):
    rng = np.random.default_rng(2)
    prompts = [random_prompt(rng, n) for n in (3, 17, 9, 33, 1, 24)]
    srv = _server(case, max_tokens_per_step=8,   # budget 8 with 4 running: decodes ride along
                  record_logits=True)
    outs = srv.generate([serve.Request(p, 16) for p in prompts])
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.request_id == i and o.prompt_ids == p
        _check_greedy(case["hf"], p, o.generated_ids, 16, f"{case['name']} prompt {i}",
                      o.logits)
    rep = srv.report()
    assert rep["mixed_steps"] > 4 and rep["decode_steps"] > 0
    # Steps only take the manager's bucketed shapes.
    kv = srv.kv_config
    for shape in rep["compiled_shapes"]:
        assert shape[1] in kv.batch_buckets and (shape[0] == "decode"
                                                 or shape[2] in kv.token_buckets), shape
    srv.manager.check_invariants()
    assert srv.manager.stats()["pages"]["device"]["referenced"] == 0


def test_shared_prefix_hits_and_matches(case):
    rng = np.random.default_rng(3)
    system = random_prompt(rng, 21)                     # five full pages of 4 plus one token
    prompts = [system + rng.integers(3, 128, n).tolist() for n in (4, 11, 1)]
    srv = _server(case)
    (first,) = srv.generate([serve.Request(system, 10)])
    assert first.prefix_hit_tokens == 0
    later = srv.generate([serve.Request(p, 10) for p in prompts])
    _check_greedy(case["hf"], system, first.generated_ids, 10, "system prompt")
    for i, (p, o) in enumerate(zip(prompts, later)):
        assert o.prefix_hit_tokens == 20, (i, o.prefix_hit_tokens)
        _check_greedy(case["hf"], p, o.generated_ids, 10, f"shared-prefix prompt {i}")
    rep = srv.report()
    assert rep["prefix_hit_tokens"] == 60
    assert rep["prefix_hit_rate"] == pytest.approx(60 / (21 + sum(len(p) for p in prompts)))


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_pressure_offload_suspend_resume(case, tmp_path):
    """12 device pages of 4 tokens for 6 requests of up to 44 tokens, a 3-page host tier and a
    disk tier: cached pages go to host and on to disk, running sequences are suspended and
    resumed, prefix pages come back from host/disk; the generations stay HF's."""
    rng = np.random.default_rng(4)
    system = random_prompt(rng, 12)
    prompts = [system + rng.integers(3, 128, n).tolist() for n in (5, 14, 2, 9)]
    prompts += [random_prompt(rng, n) for n in (7, 20)]
    hot = 2 * 2 * 4 * 2 * 16 * 4                       # bytes of one page (L=2, Hkv=2, Dh=16)
    srv = _server(case, device_pages=12, host_bytes=3 * hot + hot // 2,
                  disk_dir=str(tmp_path / "disk"), disk_bytes=256 * hot, record_logits=True)
    (first,) = srv.generate([serve.Request(system, 8)])
    outs = srv.generate([serve.Request(p, 20) for p in prompts])
    _check_greedy(case["hf"], system, first.generated_ids, 8, "system", first.logits)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        _check_greedy(case["hf"], p, o.generated_ids, 20, f"prompt {i}", o.logits)
    rep = srv.report()
    print({k: v for k, v in rep.items() if k != "compiled_shapes"})
    assert rep["suspends"] > 0 and rep["resumes"] == rep["suspends"], rep
    assert rep["pages_offloaded_to_host"] > 0, rep
    assert rep["pages_offloaded_to_disk"] + rep["pages_host_to_disk"] > 0, rep
    assert rep["pages_onboarded"] > 0 and rep["prefix_hit_tokens"] > 0, rep
    assert sum(o.num_suspends for o in outs) == rep["suspends"]
    srv.manager.check_invariants()


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_corrupt_disk_pages_are_recomputed(case, tmp_path):
    """Disk tier only; once a sequence is suspended to disk, every disk file is overwritten with
    garbage: its resume fails the checksum, it is recomputed, and the tokens stay HF's."""
    rng = np.random.default_rng(9)
    prompts = [random_prompt(rng, n) for n in (10, 6, 13, 3)]
    hot = 2 * 2 * 4 * 2 * 16 * 4
    srv = _server(case, device_pages=14, disk_dir=str(tmp_path), disk_bytes=256 * hot)
    ids = [srv.submit(serve.Request(p, 24)) for p in prompts]
    corrupted = False
    while srv.has_work():
        srv.step()
        if srv.counters["suspends"] and not corrupted:
            # NOTE: the disk files' names are unlinked at creation: reach them by descriptor.
            files = [Path(f"/proc/self/fd/{p.fileno}") for p in srv.manager.storage.disk_pools]
            assert files and not any(f.is_file() for f in tmp_path.rglob("*"))
            for f in files:
                f.write_bytes(b"\xa5" * f.stat().st_size)
            corrupted = True
    outs = [srv._done[i] for i in ids]
    for i, (p, o) in enumerate(zip(prompts, outs)):
        _check_greedy(case["hf"], p, o.generated_ids, 24, f"prompt {i}")
    rep = srv.report()
    assert corrupted and rep["recomputes"] > 0, rep
    srv.manager.check_invariants()


@pytest.mark.parametrize("case", ["mistral"], indirect=True)
def test_pressure_without_cold_tier_recomputes(case):
    """No host or disk tier: a preempted sequence cannot be suspended, so it is dropped and
    recomputed from prompt + generated; still HF's tokens (Mistral: the window bites too)."""
    rng = np.random.default_rng(5)
    prompts = [random_prompt(rng, n) for n in (10, 6, 13, 3)]
    # NOTE: the manager releases pages that left Mistral's window (a sequence holds a few pages
    # however long it gets): 8 device pages, not 14, to feel pressure.
    srv = _server(case, device_pages=8)
    outs = srv.generate([serve.Request(p, 24) for p in prompts])
    for i, (p, o) in enumerate(zip(prompts, outs)):
        _check_greedy(case["hf"], p, o.generated_ids, 24, f"prompt {i}")
    rep = srv.report()
    assert rep["recomputes"] > 0 and rep["suspends"] == 0, rep
    assert sum(o.num_recomputes for o in outs) == rep["recomputes"]
    srv.manager.check_invariants()


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_sampling_seeded_and_batch_independent(case):
    rng = np.random.default_rng(6)
    prompts = [random_prompt(rng, n) for n in (5, 12, 8)]

    def run(reqs, **kw):
        return [o.generated_ids for o in _server(case, **kw).generate(reqs)]

    reqs = [serve.Request(p, 12, temperature=1.0, top_p=0.9, seed=7) for p in prompts]
    a = run(reqs)
    assert a == run(reqs, max_batch=2, max_tokens_per_step=8)   # other batching, same samples
    assert a != run([serve.Request(p, 12, temperature=1.0, top_p=0.9, seed=8) for p in prompts])
    greedy = run([serve.Request(p, 12) for p in prompts])
    assert a != greedy
    # top_p -> 0 keeps only the most likely token: greedy whatever the temperature.
    assert run([serve.Request(p, 12, temperature=5.0, top_p=1e-6, seed=1)
                for p in prompts]) == greedy


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_steady_state_compiles_nothing_new(case):
    """A second run of the same workload (fresh server, same buckets) compiles no new step or
    sampling program: every shape comes from the manager's (batch, token) buckets."""
    rng = np.random.default_rng(7)
    prompts = [random_prompt(rng, n) for n in (9, 30, 4, 17, 11)]
    reqs = [serve.Request(p, 10, temperature=0.5 * (i % 2), seed=i) for i, p in enumerate(prompts)]
    fns = (serve.model_step,)
    first = _server(case, max_tokens_per_step=8).generate(reqs)
    sizes = [f._cache_size() for f in fns]
    again = _server(case, max_tokens_per_step=8).generate(reqs)
    assert [f._cache_size() for f in fns] == sizes
    assert [o.generated_ids for o in again] == [o.generated_ids for o in first]


# ---------------------------------------------------------------------------------------------
# The overlapped loop (tokens read one step late) against the synchronous one; faults.


def _workload(rng, n_sampled=3):
    system = random_prompt(rng, 13)
    prompts = [system + rng.integers(3, 128, n).tolist() for n in (6, 2, 11)]
    prompts += [random_prompt(rng, n) for n in (9, 17, 4)]
    reqs = [serve.Request(p, 14, eos_token_ids=()) for p in prompts]
    for i in range(n_sampled):       # sampled, fixed seeds
        reqs[2 * i] = serve.Request(prompts[2 * i], 14, temperature=0.9, top_p=0.9, seed=i,
                                    eos_token_ids=())
    return system, reqs


def _run(case, system, reqs, **kw):
    srv = _server(case, **kw)
    srv.generate([serve.Request(system, 3, eos_token_ids=())])   # its pages: prefix hits
    outs = srv.generate(reqs)
    srv.manager.check_invariants()
    assert srv.manager.stats()["pages"]["device"]["referenced"] == 0
    return [(o.generated_ids, o.finish_reason) for o in outs], srv.report()


@pytest.mark.parametrize("case", ["llama"], indirect=True)
@pytest.mark.parametrize("pressure", ["none", "suspend", "recompute"])
def test_overlapped_loop_matches_synchronous(case, pressure, tmp_path):
    """Same requests (greedy and sampled with fixed seeds, EOS ids in the middle of some
    generations, shared prefixes) through the synchronous loop and the overlapped one: the same
    tokens and finish reasons; under page pressure sequences are suspended and resumed (host
    tier) or recomputed (none)."""
    seed = {"none": 11, "suspend": 12, "recompute": 13}[pressure]
    print("seed", seed)
    system, reqs = _workload(np.random.default_rng(seed))
    hot = 2 * 2 * 4 * 2 * 16 * 4
    kw = dict(max_tokens_per_step=12, prefill_chunk_tokens=6)
    if pressure == "suspend":
        kw.update(device_pages=14, host_bytes=64 * hot)
    elif pressure == "recompute":
        kw.update(device_pages=14)
    # EOS: the 6th generated token of every other request (taken from a first run).
    first, _ = _run(case, system, reqs, overlap=False, **kw)
    reqs = [dataclasses.replace(r, eos_token_ids=(first[i][0][5],)) if i % 2 else r
            for i, r in enumerate(reqs)]
    sync, rep_sync = _run(case, system, reqs, overlap=False, **kw)
    over, rep = _run(case, system, reqs, overlap=True, **kw)
    print({k: v for k, v in rep.items() if k not in ("compiled_shapes", "pages")})
    assert over == sync
    # Pages of generated text reach the prefix cache in both (the overlapped loop tells the
    # manager the ids one step late).
    assert rep["pages_committed"] == rep_sync["pages_committed"] > rep["prefix_hit_tokens"] // 4
    assert [f for _, f in over].count("eos") >= 3
    assert rep["dropped_tokens"] > 0 and rep_sync["dropped_tokens"] == 0   # past EOS, dropped
    assert rep["prefix_hit_tokens"] >= 3 * 12 and rep["overlap"] and not rep_sync["overlap"]
    if pressure == "suspend":
        assert rep["suspends"] > 0 and rep["resumes"] == rep["suspends"], rep
    if pressure == "recompute":
        assert rep["recomputes"] > 0, rep
    for i, r in enumerate(reqs):       # and the greedy ones are HF's
        if r.temperature == 0 and not r.eos_token_ids:
            _check_greedy(case["hf"], r.prompt, over[i][0], 14, f"request {i}")


@pytest.mark.parametrize("case", ["llama"], indirect=True)
@pytest.mark.parametrize("overlap", [True, False])
def test_step_records_observe_without_changing_tokens(case, overlap):
    """ServeConfig.record_steps (the benchmarks' timing hook) changes no token; it records every
    dispatched step once, in order: its kind from the rows' token counts, its program, and times
    in order (with the overlapped loop a step's tokens are read by a later call, else by the
    call that dispatched it). Page pressure (suspend/resume through a host tier) included."""
    system, reqs = _workload(np.random.default_rng(21))
    hot = 2 * 2 * 4 * 2 * 16 * 4
    kw = dict(max_tokens_per_step=12, prefill_chunk_tokens=6, overlap=overlap, device_pages=14,
              host_bytes=64 * hot)
    want, rep_off = _run(case, system, reqs, **kw)
    srv = _server(case, record_steps=True, **kw)
    srv.generate([serve.Request(system, 3, eos_token_ids=())])
    srv.step_records.clear()
    steps0 = srv.report()["steps"]
    got = [(o.generated_ids, o.finish_reason) for o in srv.generate(reqs)]
    rep = srv.report()
    assert got == want and _server(case).step_records is None
    recs = srv.step_records
    assert len(recs) == rep["steps"] - steps0 and rep["suspends"] > 0
    assert [r.index for r in recs] == list(range(steps0 + 1, rep["steps"] + 1))
    assert sum(r.program == "decode" for r in recs) > 0
    for r in recs:
        assert r.kind == ("decode" if r.decode_rows == r.rows else
                          "mixed" if r.decode_rows else "prefill"), r
        assert r.program == ("decode" if r.tokens == r.rows else "forward"), r
        assert r.tokens >= r.rows >= 1 and r.batch_bucket >= r.rows
        assert r.token_bucket >= r.tokens and r.running >= r.rows and r.min_tokens_left >= 0
        assert r.t_start <= r.t_dispatched <= min(r.t_end, r.t_ready) and r.wait_s >= 0, r
        if not overlap:
            assert r.t_ready <= r.t_end   # read by the call that dispatched it
    assert any(r.kind == "mixed" for r in recs)
    if overlap:
        assert sum(r.t_ready > r.t_end for r in recs) > len(recs) // 2   # read one step late


@pytest.mark.parametrize("case", ["llama"], indirect=True)
@pytest.mark.parametrize("overlap", [True, False])
def test_stream_and_cancel_hooks(case, overlap):
    """The HTTP server's hooks: ``new_tokens`` streams every request's tokens in order (their
    concatenation is the request's output); ``cancel`` of a running request while a step that
    samples for it is in flight, and of a waiting one, ends them at once: no later token is
    streamed, no output is produced, their pages are released once nothing runs (invariants
    hold), and the other requests still generate HF's greedy tokens."""
    seed = 21
    print("seed", seed)
    _, reqs = _workload(np.random.default_rng(seed))
    # NOTE: admission in submission order (no deferral of requests sharing a prompt still being
    # written), so that requests 4 and 5 are the ones that wait.
    srv = _server(case, overlap=overlap, max_tokens_per_step=12, prefill_chunk_tokens=6,
                  defer_shared_prompts=False)
    rids = [srv.submit(r) for r in reqs]       # max_batch 4: rids 4, 5 wait
    streamed = {rid: [] for rid in rids}
    finished, cancelled = {}, {}
    while srv.has_work():
        for out in srv.step():
            finished[out.request_id] = out
        for rid, toks in srv.new_tokens().items():
            streamed[rid] += toks
        if not cancelled and len(streamed[1]) >= 2:     # request 1 decoding
            running = {r.rid for r in srv._running}
            assert 1 in running and 5 not in running, running
            if overlap:
                assert srv._inflight is not None and 1 in {r.rid for r, _ in srv._inflight.rows}
            for rid in (1, 5):
                out = srv.cancel(rid)
                assert out.finish_reason == "cancelled" and out.request_id == rid
                cancelled[rid] = out
            assert srv.cancel(1) is None                       # no longer live
    assert sorted(finished) == [0, 2, 3, 4] and not set(finished) & set(cancelled)
    assert 0 < len(cancelled[1].generated_ids) < 14 and cancelled[5].generated_ids == []
    for rid, out in cancelled.items():
        assert streamed[rid] == out.generated_ids, (rid, streamed[rid], out.generated_ids)
    for rid, out in finished.items():
        assert streamed[rid] == out.generated_ids and len(out.generated_ids) == 14, rid
        if reqs[rid].temperature == 0:
            _check_greedy(case["hf"], reqs[rid].prompt, out.generated_ids, 14, f"request {rid}")
        assert srv.pop_output(rid) is out and srv.pop_output(rid) is None
    assert srv.cancel(0) is None                               # finished: not live
    rep = srv.report()
    if overlap:
        assert rep["dropped_tokens"] >= 1, rep       # the in-flight token of request 1
    srv.manager.check_invariants()
    assert srv.manager.stats()["pages"]["device"]["referenced"] == 0


class _FailingStep:
    """A fault hook around a server's device step (outside the production class): raises
    instead of running the step on the calls numbered in ``fail_on``."""

    def __init__(self, srv, fail_on):
        self.inner, self.fail_on, self.calls = srv._model_step, set(fail_on), 0
        srv._model_step = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError(f"injected failure of step call {self.calls}")
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("case", ["llama"], indirect=True)
@pytest.mark.parametrize("overlap", [True, False])
def test_failed_steps_are_retried_and_the_loop_keeps_serving(case, overlap):
    system, reqs = _workload(np.random.default_rng(14))
    want, _ = _run(case, system, reqs, overlap=overlap)
    srv = _server(case, overlap=overlap)
    srv.generate([serve.Request(system, 3, eos_token_ids=())])
    hook = _FailingStep(srv, fail_on=(3, 4, 9))     # 3 and 4: the same step fails twice
    got = srv.generate(reqs)
    rep = srv.report()
    assert rep["failed_steps"] == 3 and hook.calls > 9
    # max_step_retries=1: requests of the step that failed twice in a row fail; the rest are
    # served exactly as without faults.
    errors = [i for i, o in enumerate(got) if o.finish_reason == "error"]
    assert 0 < len(errors) < len(reqs), errors
    assert all("injected failure" in got[i].error for i in errors)
    for i, o in enumerate(got):
        if i not in errors:
            assert (o.generated_ids, o.finish_reason) == want[i], i
    srv.manager.check_invariants()
    assert srv.manager.stats()["pages"]["device"]["referenced"] == 0
    # With retries enough, every request gets its fault-free tokens.
    srv = _server(case, overlap=overlap, max_step_retries=2)
    srv.generate([serve.Request(system, 3, eos_token_ids=())])
    _FailingStep(srv, fail_on=(3, 4, 9))
    assert [(o.generated_ids, o.finish_reason) for o in srv.generate(reqs)] == want
    srv.manager.check_invariants()


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_storage_error_of_one_request_fails_only_it(case):
    system, reqs = _workload(np.random.default_rng(15))
    want, _ = _run(case, system, reqs)
    srv = _server(case)
    srv.generate([serve.Request(system, 3, eos_token_ids=())])
    add = srv.manager.add_sequence
    calls = []

    def flaky_add(tokens, **kw):       # a fault hook: the third admission's onboarding fails
        calls.append(1)
        if len(calls) == 3:
            raise OSError("injected: cold page unreadable")
        return add(tokens, **kw)

    srv.manager.add_sequence = flaky_add
    got = srv.generate(reqs)
    assert got[2].finish_reason == "error" and "unreadable" in got[2].error
    assert got[2].generated_ids == []
    assert [(o.generated_ids, o.finish_reason) for i, o in enumerate(got) if i != 2] == \
        [w for i, w in enumerate(want) if i != 2]
    srv.manager.check_invariants()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu"], indirect=True)
@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_overlapped_loop_matches_synchronous_gpu(case, backend):
    """On the GPU (float32 model, the CUDA kernels): the overlapped loop against the
    synchronous one with page pressure (suspend/resume to host), greedy and sampled requests.
    Batches differ by a step here and there (an EOS read late), and GEMMs of other shapes may
    round differently: a near-tie can flip a token, so 5/6 of the generations must match."""
    import jax
    case = dict(case, params=jax.device_put(case["params"], backend.device))
    system, reqs = _workload(np.random.default_rng(21))
    hot = 2 * 2 * 4 * 2 * 16 * 4
    kw = dict(max_tokens_per_step=12, prefill_chunk_tokens=6, device_pages=14,
              host_bytes=64 * hot)
    sync, _ = _run(case, system, reqs, overlap=False, **kw)
    over, rep = _run(case, system, reqs, overlap=True, **kw)
    same = sum(a == b for a, b in zip(over, sync))
    print(f"{same}/{len(reqs)} identical; suspends {rep['suspends']}")
    assert same >= len(reqs) * 5 // 6 and rep["suspends"] > 0


def test_submit_refuses_what_cannot_fit(case):
    srv = _server(case, device_pages=4, max_seq_len=64)
    with pytest.raises(ValueError, match="device pages"):
        srv.submit(serve.Request([1] * 10, 8))               # 18 tokens: 5 pages > 4
    with pytest.raises(ValueError, match="max_seq_len"):
        srv.submit(serve.Request([1] * 60, 8))
    with pytest.raises(ValueError, match="out of range"):
        srv.submit(serve.Request([1, 500], 4))
    assert not srv.has_work()


# ---------------------------------------------------------------------------------------------
# The CLI.


def _cli(*args, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.environ.get("PYTHONPATH")] if p)
    return subprocess.run([sys.executable, str(ROOT / "examples/llama/run.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_cli_default_run():
    r = _cli()
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert out.count("[request ") == 5 and "KV report" in out
    assert "prefix hit rate: " in out and "0.0%" not in out.split("prefix hit rate: ")[1][:6]
    for key in ("pages device", "pages   host", "pages offloaded", "onboarded", "suspends",
                "tokens/s"):
        assert key in out, key


def test_cli_json(tmp_path):
    r = _cli("--json", "--prompt-ids", "1,5,9,13,17,21", "--prompt-ids", "1,5,9,13,40",
             "--max-new-tokens", "6", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3",
             "--device-pages", "8", "--host-bytes", "65536", "--disk-dir", str(tmp_path),
             "--disk-bytes", "1048576", "--cold-codec", "int8")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert len(lines) == 3
    assert [d["request"] for d in lines[:2]] == [0, 1]
    assert lines[0]["prompt_ids"] == [1, 5, 9, 13, 17, 21]
    assert all(len(d["generated_ids"]) == 6 or d["generated_ids"][-1] == 2 for d in lines[:2])
    rep = lines[2]["kv_report"]
    assert rep["cold_codec"] == "int8" and set(rep["pages"]) == {"device", "host", "disk"}
    assert rep["generated_tokens"] == sum(len(d["generated_ids"]) for d in lines[:2])
    # Same seed, same samples.
    again = _cli("--json", "--prompt-ids", "1,5,9,13,17,21", "--prompt-ids", "1,5,9,13,40",
                 "--max-new-tokens", "6", "--temperature", "0.7", "--top-p", "0.9",
                 "--seed", "3")
    assert [json.loads(x)["generated_ids"] for x in again.stdout.splitlines()[:2]] == \
        [d["generated_ids"] for d in lines[:2]]


def test_cli_text_prompt_with_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    config = llama.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, eos_token_ids=(2,), bos_token_id=1)
    d = llama_loader.write_random_checkpoint(tmp_path / "m", config, seed=1)
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 32)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    r = _cli("--model", str(d), "--prompt", "w5 w9 w11", "--prompt", "w5 w9 w30",
             "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert [d["prompt_ids"] for d in lines[:2]] == [[5, 9, 11], [5, 9, 30]]
    assert all(isinstance(d["text"], str) for d in lines[:2]) and "kv_report" in lines[2]


def test_cli_text_prompt_needs_tokenizer():
    r = _cli("--prompt", "hello world")
    assert r.returncode != 0 and "tokenizer.json" in r.stderr, r.stderr[-2000:]
