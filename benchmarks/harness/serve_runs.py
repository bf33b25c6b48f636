"""One timed serving run, on either path: :func:`run_paged` (the example runner's
``serve.Server`` on ``KVCacheManager``, paged or arena hot backend) and :func:`run_dense` (the
same model on a dense per-sequence cache, ``dense_llama.DenseServer``). Each returns the run's
row (tokens/s, TTFT, ITL, decode step, pages, loop timings) and the requests' outputs."""

from __future__ import annotations

import gc
import time
from typing import Any, Sequence

import numpy as np

from benchmarks.harness import dense_llama as dense
from benchmarks.harness import loop_profile
from benchmarks.harness.run_log import (COMPILES, COUNTING_COMPILES, Progress, compiled_between,
                                        pct)
from benchmarks.harness.serve_arrivals import Arrivals
from benchmarks.harness.serve_setup import Setup
from examples.llama import serve


def serve_config(setup: Setup, concurrency: int, prefix: bool,
                 hot_backend: str = "paged", cascade: bool | None = None) -> serve.ServeConfig:
    """The runner's configuration of a paged run (``hot_backend``: paged or arena; an arena is
    sized like the paged pool it replaces: examples/llama/hot_backend.py; ``cascade``: None,
    ``setup.cascade``)."""
    return serve.ServeConfig(
        hot_backend=hot_backend,
        page_size=setup.page_size, device_pages=setup.pool_pages(concurrency),
        max_batch=concurrency, max_tokens_per_step=setup.step_tokens,
        prefill_chunk_tokens=setup.prefill_chunk, host_bytes=setup.host_bytes,
        offload_ahead_pages=(setup.offload_ahead_pages if setup.host_bytes
                             and hot_backend == "paged" else 0),
        max_seq_len=setup.pages_per_seq * setup.page_size, enable_prefix_reuse=prefix,
        batch_buckets=setup.batch_buckets_at(concurrency), token_buckets=(setup.step_tokens,),
        record_logits=setup.record_logits, kv_dtype=setup.kv_dtype,
        tensor_parallel=setup.tensor_parallel, record_steps=True,
        cascade=setup.cascade if cascade is None else cascade,
        defer_shared_prompts=setup.defer_shared_prompts, xla_options=setup.xla_options)


def summary(label: str, path: str, workload: str, concurrency: int,
             requests: Sequence[serve.Request], outs: Sequence[serve.RequestOutput],
             seconds: float, compiles: tuple[int, int], warmup_s: float,
             decode_ms: Sequence[float], ttft: Sequence[float] | None = None,
             **extra: Any) -> dict[str, Any]:
    """One run's row; ``compiles``: ``COMPILES["n"]`` when its timed region began and ended;
    ``ttft``: each request's time to first token when not the server's (from submission), as
    from its arrival with ``--request-rate``."""
    gen = sum(len(o.generated_ids) for o in outs)
    if ttft is None:
        ttft = [o.time_to_first_token_s for o in outs]
    itl = np.concatenate([np.diff(o.token_times_s) for o in outs if len(o.token_times_s) > 1]
                         or [np.zeros(0)])
    return dict(
        name=label, path=path, workload=workload, concurrency=concurrency,
        requests=len(requests),
        input_tokens_mean=float(np.mean([len(r.prompt) for r in requests])),
        output_len=int(requests[0].max_new_tokens), generated_tokens=gen, seconds=seconds,
        output_tokens_per_s=gen / seconds if seconds > 0 else 0.0,
        ttft_p50_s=pct(ttft, 50), ttft_p90_s=pct(ttft, 90),
        itl_p50_ms=pct(itl, 50) * 1e3, itl_p90_ms=pct(itl, 90) * 1e3,
        decode_step_ms_p50=pct(decode_ms, 50), decode_steps=len(decode_ms),
        warmup_s=warmup_s,
        compiles_in_timed_region=compiles[1] - compiles[0] if COUNTING_COMPILES else None,
        compiled_in_timed_region=compiled_between(*compiles),
        **extra)


def run_paged(params: Any, setup: Setup, requests: Sequence[serve.Request], *, concurrency: int,
              prefix: bool, workload: str, label: str,
              warm_prompts: Sequence[list[int]] = (),
              hot_backend: str = "paged", cascade: bool | None = None) -> tuple[dict, list]:
    """Warm-up on a throwaway server (same shapes), then the timed run on a fresh one.

    ``warm_prompts``: served (one output token each) on the fresh server before the clock
    starts, so their full pages sit committed in the prefix cache, as hot system prompts do in
    a server that has been running. ``hot_backend="arena"`` adds ``arena``: map/unmap calls in
    the second half of the generated tokens (steady state), alias hits, peak mapped bytes."""
    scfg = serve_config(setup, concurrency, prefix, hot_backend, cascade)
    arena = hot_backend == "arena"
    t = time.perf_counter()
    warm_compiles = {k: COMPILES[k] for k in ("n", "s")}
    warm = serve.Server(params, setup.model, scfg)
    warm.precompile(progress=True)   # every (kind, batch, token) bucket's program (greedy)
    warm.generate([serve.Request(prompt=list(range(1, setup.page_size + 2)), max_new_tokens=2,
                                 eos_token_ids=[])])
    warm.manager.shutdown()   # its pools (or reservation), before the timed run's
    del warm
    gc.collect()   # its pool (a cycle through the manager's observer) before the next one
    warmup_s = time.perf_counter() - t
    warm_compiles = {k: COMPILES[k] - v for k, v in warm_compiles.items()}

    server = serve.Server(params, setup.model, scfg)
    mgr = server.manager
    window = capture = None
    if setup.profile_dir and hot_backend == "paged":
        capture = loop_profile.ProgramCapture(server)
        window = loop_profile.ProfileWindow(
            loop_profile.profile_dir(setup.profile_dir, f"{label} chunk {setup.prefill_chunk}"
                                     + (f" tp {setup.tensor_parallel}"
                                        if setup.tensor_parallel > 1 else "")),
            setup.profile_steps,
            min(concurrency, len(requests)))
    if warm_prompts:
        server.generate([serve.Request(prompt=list(p), max_new_tokens=1, eos_token_ids=[])
                         for p in warm_prompts])
    server.step_records.clear()
    waits0 = fence_waits(mgr)
    total = sum(r.max_new_tokens for r in requests)
    pool = mgr.device_capacity_pages
    progress = Progress(label, total)
    n_compiles = COMPILES["n"]
    arrivals = None   # all at once: submitted before the clock starts
    if setup.request_rate is None:
        for r in requests:
            server.submit(r)
    else:             # --request-rate: each once the clock passes its arrival
        arrivals = Arrivals(requests, setup.request_rate, setup.arrival_seed)
    outs: dict[int, serve.RequestOutput] = {}
    peak_pages = peak_active = steps = 0
    decode_ms: list[float] = []
    step_ms: list[float] = []
    paused = 0.0
    arena_half: dict | None = None
    arena_peak = 0
    step_calls = arena and setup.arena_step_calls
    calls_after: list[tuple[int, int]] = []    # (map, create) calls so far, after each step
    decode_flags: list[bool] = []
    t0 = time.perf_counter()

    def clock() -> float:   # the run's clock: its pauses (outside the clock) excluded
        return time.perf_counter() - t0 - paused

    while server.has_work() or (arrivals is not None and arrivals.pending):
        if arrivals is not None:
            wait = arrivals.submit_due(server, clock)
            if not server.has_work():   # idle: sleep until the next arrival
                time.sleep(wait)
                continue
        n_dec = server.counters["decode_steps"]
        if window is not None:   # starting the trace is outside the clock
            ts = time.perf_counter()
            window.before(server)
            paused += time.perf_counter() - ts
        ts = time.perf_counter()
        for o in server.step():
            outs[o.request_id] = o
        dt = time.perf_counter() - ts
        if window is not None:   # stopping it (and writing the trace) too
            te = time.perf_counter()
            window.after(server)
            paused += time.perf_counter() - te
        step_ms.append(dt * 1e3)
        decode_flags.append(server.counters["decode_steps"] > n_dec)
        if decode_flags[-1]:
            decode_ms.append(dt * 1e3)
        steps += 1
        # NOTE: these reads are inside the clock and the same for both backends. Outside it,
        # the device ran the dispatched step during them for free: with a 12.5 ms stats()
        # (before 0560e35) every 4th arena step hid its device time, which inflated the arena's
        # tokens/s and its ITL p90 in the arena/paged A/Bs from 0630b4d to bb9f639.
        if step_calls:
            a = mgr.stats()["arena"]
            calls_after.append((a["num_map_calls"], a["num_create_calls"]))
        if steps % 4 == 1:
            peak_pages = max(peak_pages, pool - mgr.num_obtainable_pages())   # referenced
            peak_active = max(peak_active, server.num_running)
            progress(server.counters["generated_tokens"])
            st = mgr.stats()
            if arena:
                a = st["arena"]
                arena_peak = max(arena_peak, a["mapped_chunks"] * a["chunk_bytes"])
                if arena_half is None and server.counters["generated_tokens"] * 2 >= total:
                    arena_half = a
    seconds = time.perf_counter() - t0 - paused
    compiles = (n_compiles, COMPILES["n"])
    if window is not None:
        window.stop(server)
    rep = server.report()
    waits = {k: v - waits0[k] for k, v in fence_waits(mgr).items()}
    records = server.step_records
    traced = (set(range(window.indices[0] - 1, window.indices[-1] + 2))
              if window is not None and window.indices else set())
    loop = loop_profile.loop_stats(records, min(concurrency, len(requests)), seconds, traced)
    extra_profile: dict[str, Any] = {}
    if window is not None:
        extra_profile["profile"] = (
            loop_profile.step_breakdown(window, records, capture, params)
            if window.state == "done" else {"error": "the run ended before the window began"})
    page_bytes = (2 * setup.model.num_hidden_layers * setup.page_size
                  * setup.model.num_key_value_heads * setup.model.head_dim
                  * setup.paged_kv_itemsize)
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    device = mgr.storage.stats()["device"]
    # NOTE: equal K/V bytes: the paged pool and the arena's budget are both device_pages
    # pages (the governor's DEVICE limit); the peak is what was in use at once (allocated
    # pages for paged, mapped chunks for the arena).
    extra: dict[str, Any] = {"hot_backend": hot_backend,
                             "kv_bytes_used_peak": peak_pages * page_bytes,
                             "kv_budget_bytes": device["limit"],
                             "kv_bytes_committed_peak": device["peak"]}
    if not arena:   # what one device holds (KVCacheConfig: per device under a mesh)
        extra.update(device_page_bytes=list(mgr.config.device_page_bytes()),
                     device_pool_bytes=mgr.config.device_pool_bytes())
    if arena:
        a = mgr.stats()["arena"]
        half = arena_half or a
        extra.update(
            arena_steady_map_calls=a["num_map_calls"] - half["num_map_calls"],
            arena_steady_unmap_calls=a["num_unmap_calls"] - half["num_unmap_calls"],
            arena_map_calls=a["num_map_calls"], arena_unmap_calls=a["num_unmap_calls"],
            arena_adoptions=a["adoptions"], arena_fresh_ranges=a["fresh_ranges"],
            arena_shared_pages=a["shared_pages"], arena_affine_pages=a["affine_pages"],
            arena_reclaimed_chunks=a["reclaimed_chunks"], arena_quiesces=a["num_quiesces"],
            arena_pages_per_chunk=a["pages_per_chunk"],
            arena_physical_bytes_peak=max(arena_peak, a["peak_physical_bytes"]))
    if step_calls:
        extra["arena_step_calls"] = loop_profile.split_by_calls(step_ms, decode_flags,
                                                                calls_after)
    res = summary(
        label, hot_backend, workload, concurrency, requests, [outs[i] for i in sorted(outs)],
        seconds, compiles, warmup_s, decode_ms, prefix_reuse=prefix,
        prefix_hit_rate=(sum(o.prefix_hit_tokens for o in outs.values())
                         / max(1, sum(len(r.prompt) for r in requests))),
        peak_running=peak_active,
        pages_used_peak=peak_pages, pool_pages=pool, page_size=setup.page_size,
        cache_bytes=pool * page_bytes,
        capacity_seqs=mgr.max_num_sequences(longest), capacity_seq_len=longest,
        steps=rep["steps"], mixed_steps=rep["mixed_steps"], suspends=rep["suspends"],
        recomputes=rep["recomputes"], step_ms_p50=pct(step_ms, 50),
        pages_per_tier=rep["pages"], pages_offloaded=rep["pages_offloaded"],
        pages_onboarded=rep["pages_onboarded"], host_bytes=setup.host_bytes,
        prefill_chunk_tokens=setup.prefill_chunk, step_tokens=setup.step_tokens,
        batch_buckets=list(server.kv_config.batch_buckets),
        overlap=scfg.overlap, kv_dtype=rep["kv_dtype"], tensor_parallel=setup.tensor_parallel,
        weights=(setup.quantize or setup.model.dtype)
        + (" static-scales" if setup.quantize and setup.static_input_scales else ""),
        cascade=scfg.cascade,
        xla_options=dict(server.serve.xla_options),
        decode_kv_tokens=rep["decode_kv_tokens"], cascade_tokens_saved=rep["cascade_tokens_saved"],
        deferred_admissions=rep["deferred_admissions"],
        cascade_grouped_rows=rep["cascade_grouped_rows"],
        cascade_grouped_rows_per_step=rep["cascade_grouped_rows"] / max(1, rep["decode_steps"]),
        compiled_programs=len(rep["compiled_shapes"]), warmup_compiles=warm_compiles["n"],
        warmup_compile_s=warm_compiles["s"], loop=loop, fence_waits=waits,
        ttft=None if arrivals is None else arrivals.ttft_s(outs),
        **({"request_rate": None} if arrivals is None else arrivals.stats()), **extra_profile,
        **extra)
    done = [outs[i] for i in sorted(outs)]
    res["generated_digests"] = loop_profile.digests(done)   # runs of a chunk sweep compare
    if arena:
        mgr.shutdown()
    del server, mgr
    gc.collect()
    return res, done


def fence_waits(mgr: Any) -> dict[str, float]:
    """How often, and how long, the host waited for dispatched device work: allocations waiting
    for the step that last read freed pages, host-tier slots waiting for a migration, and waits
    for write-back-ahead copies (their tickets). In the overlapped loop each such wait is a
    bubble (the host prepares the next step late). Also the write-back-ahead counters
    (``--offload-ahead-pages``): transactions, pages, encode calls on the side stream, and
    failed copies."""
    st = mgr.stats()
    sto = st.get("storage", {})
    return dict(allocation_waits=st.get("num_fence_waits", 0),
                allocation_wait_s=st.get("fence_wait_seconds", 0.0),
                host_slot_waits=sto.get("num_host_fence_waits", 0),
                host_slot_wait_s=sto.get("host_fence_wait_seconds", 0.0),
                offload_ahead_waits=st.get("num_offload_ahead_waits", 0),
                offload_ahead_wait_s=st.get("offload_ahead_wait_seconds", 0.0),
                offload_ahead_moves=st.get("num_offloads_ahead", 0),
                offload_ahead_pages=st.get("num_offloaded_ahead_pages", 0),
                side_stream_calls=sto.get("num_side_stream_calls", 0),
                offload_ahead_failures=st.get("num_offload_ahead_failures", 0))


def run_dense(params: Any, setup: Setup, requests: Sequence[serve.Request], *, batch: int,
              max_len: int, workload: str, label: str) -> tuple[dict, list]:
    srv = dense.DenseServer(params, setup.model, batch=batch, max_len=max_len,
                            prefill_tokens=setup.step_tokens,
                            prefill_bucket=setup.dense_prefill_bucket,
                            record_logits=setup.record_logits)
    t = time.perf_counter()
    srv.warmup([len(r.prompt) for r in requests])
    warmup_s = time.perf_counter() - t
    progress = Progress(label, sum(r.max_new_tokens for r in requests))
    counters = srv.counters   # (not srv: the lambda outlives the `del srv` below)
    srv.on_step = lambda: progress(counters["generated_tokens"])
    n_compiles = COMPILES["n"]
    t0 = time.perf_counter()
    outs = srv.generate(requests)
    seconds = time.perf_counter() - t0
    res = summary(label, "dense", workload, batch, requests, outs, seconds,
                   (n_compiles, COMPILES["n"]), warmup_s, srv.decode_ms, prefix_reuse=False,
                   prefix_hit_rate=0.0, peak_running=min(batch, len(requests)),
                   pages_used_peak=None, pool_pages=None, page_size=None,
                   cache_bytes=srv.cache_bytes, capacity_seqs=batch, capacity_seq_len=max_len,
                   max_len=max_len)
    del srv
    gc.collect()
    return res, outs

