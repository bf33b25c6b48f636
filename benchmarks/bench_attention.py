#!/usr/bin/env python
"""Paged attention benchmark: jax_kvcm custom calls vs FlashInfer, SGLang, torch SDPA and cuDNN.

Run on the GPU machine (after `pip install .` of jax_kvcm with its CUDA extension), from anywhere
except a directory that shadows the installed package with an unbuilt `jax_kvcm/`:

    python -m benchmarks.bench_attention [--json results.json] [--anchors /tmp/anchors]
    JAX_PLATFORMS=cpu python -m benchmarks.bench_attention --quick   # CPU smoke test, tiny shapes

Anchors (same process, same inputs, same correctness check; a row says "not installed" when its
package does not import; see benchmarks/harness/anchors.py for the build settings FlashInfer needs):
  flashinfer-decode[tc]  FlashInfer BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)
  flashinfer-decode      the same with its CUDA-core kernel
  flashinfer-decode[tc] fp8  over the fp8 copy of the cache (one scale for K and V)
  sglang-triton          SGLang's Triton decode kernel (decode_attention_fwd)
  flashinfer-fa3 / -fa2  FlashInfer BatchPrefillWithPagedKVCacheWrapper(backend=...), causal
  ours fp8               jax_kvcm over a float8_e4m3fn copy of the cache (per-kv-head scales),
                         checked against the reference on the dequantized cache; the summary
                         gives its tokens x context / s over ours in bf16

Decode (one query token per sequence; all sequences at length S; H=32, Hkv=8, D=128, page 16,
bf16; random page table = random permutation of pages 1..B*S/16, page 0 is the null page):
  ours        jax_kvcm.paged_attention under jax.jit
  jax-gather  pure JAX: gather the pages to [B, S, Hkv, D], bf16 GQA einsums with f32 softmax
  pallas      (with --pallas) jax.experimental.pallas.ops.gpu.paged_attention (Triton; deprecated
              in jax 0.11).
              Its caches are [Hkv, pages, page, D] and it applies NO logit scale, so it gets
              q * 1/sqrt(D) (bf16) and a copy of our cache in its layout (pages 1.. only, block
              tables = ours - 1), both made once outside the timed region. Timed at its defaults;
              "pallas[tuned]" appears when one of a few other splits is >5% faster and correct
  torch-sdpa  torch scaled_dot_product_attention(q [B,H,1,D], k/v [B,Hkv,S,D], enable_gqa=True)
              on a dense contiguous cache holding the same values: the cost of no paging. The
              default dispatch is timed; each forced backend's time is in the note/JSON, and
              "torch-sdpa[x]" appears when a forced backend is >5% faster than the default
  copy (torch) dst.copy_(src) of K+V bytes (do_bench): the DRAM bandwidth ceiling
  copy (jax)  jit(jnp.copy) of the same bytes with the JAX timing loop: if it matches the torch
              copy, the two timing methods agree

Decode columns: ms = median time per call; KV TB/s = (K bytes + V bytes attended) / t, for the
copies the bytes copied / t (the read-only rate of a kernel as slow as the copy); copy r+w TB/s =
2 * bytes copied / t (read + write); % of copy r+w = KV TB/s / the torch copy's r+w rate;
t_ours/t_method < 1 means ours is faster.

Prefill (ragged, causal, all tokens new: query_start = [0, S, 2S, ...], seq_lens = S):
  ours        jax_kvcm.ragged_paged_attention over a cache filled by write_kv (write not timed)
  cudnn       jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
              on dense [B, S, H|Hkv, D]
  Every method is checked first, then all are timed in turns, --rounds times (default 3; the
  median), so that the GPU's drift during a run (FA3 moved 9% from one run to the next) falls on
  all alike. FlashInfer is timed by do_bench (one call between L2 flushes) and, in the note, back
  to back in a loop of calls, the way ours and cuDNN are timed (time_jax).

Mixed (one ragged call): 256 decode rows at context 1024 and one 2048-token chunk after 2048
cached tokens; ours vs FlashInfer's paged prefill (FA3, FA2) on the same batch.

Every method is checked against a float32 reference on the same inputs before it is timed; a
failed check or an exception is reported in the table instead of aborting the run.
"""

from __future__ import annotations

import os

# JAX must not grab 75% of the GPU up front: torch shares the device in this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.harness import anchors as _anchors  # noqa: E402
from benchmarks.harness import timing as _timing  # noqa: E402
from benchmarks.harness.attention_baselines import bench_pallas, bench_torch_decode  # noqa: E402
from benchmarks.harness.attention_cases import (  # noqa: E402
    DECODE_SHAPES, DTYPE, HEAD_DIM, MIXED, NUM_HEADS, NUM_KV_HEADS, PAGE, PREFILL_SHAPES, TOL,
    QUICK_DECODE_SHAPES, QUICK_MIXED, QUICK_PREFILL_SHAPES, check, cuda_torch,
    dense_causal_reference, fp8_caches, free, gather_attention, log, poison_allocator,
    prefill_case, reference_decode, row, time_in_turns, to_torch, torch_rows)
from benchmarks.harness.attention_report import (environment, finish_rows,  # noqa: E402
                                                 print_tables, ratio_summary)
from benchmarks.harness.timing import short_error  # noqa: E402

import jax_kvcm  # noqa: E402
from jax_kvcm.ops import reference  # noqa: E402



def bench_decode(b: int, s: int, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    shape = f"B={b} S={s}"
    h, hkv, d = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    pages_per_seq = s // PAGE
    num_pages = b * pages_per_seq + 1
    kv_bytes = 2 * b * s * hkv * d * jnp.dtype(DTYPE).itemsize  # K + V actually attended
    rows: list[dict[str, Any]] = []
    log(f"\n[decode {shape}] KV {kv_bytes / 2**30:.2f} GiB, {num_pages} pages")

    keys = jax.random.split(jax.random.key(seed), 4)
    k_cache = jax.random.normal(keys[0], (num_pages, PAGE, hkv, d), DTYPE)
    v_cache = jax.random.normal(keys[1], (num_pages, PAGE, hkv, d), DTYPE)
    rng = np.random.default_rng(seed)
    page_table = jnp.asarray((rng.permutation(b * pages_per_seq) + 1)
                             .reshape(b, pages_per_seq).astype(np.int32))
    seq_lens = jnp.full((b,), s, jnp.int32)
    q_check = jax.random.normal(keys[2], (b, h, d), DTYPE)  # fresh inputs for the checks
    q_time = jax.random.normal(keys[3], (b, h, d), DTYPE)
    t0 = time.perf_counter()
    ref = jax.block_until_ready(reference_decode(q_check, k_cache, v_cache, page_table, seq_lens))
    log(f"  reference: {time.perf_counter() - t0:.1f}s")

    def add(method: str, fn, arg_sets, out_check: dict | None, note: str = "") -> None:
        r = row("decode", shape, method, kv_bytes=kv_bytes, note=note,
                check=None if out_check is None else out_check["text"],
                rel_l2=None if out_check is None else out_check["rel_l2"])
        try:
            t = _timing.time_jax(fn, arg_sets, repeats=args.repeats)
            r["ms"] = t["ms"]
            r["timing"] = t
        except Exception as e:  # noqa: BLE001
            r["error"] = short_error(e)
        rows.append(r)
        log(f"  {method}: {r['ms'] if r['ms'] is None else round(r['ms'], 4)} ms, "
             f"check {r['check']} {r['error'] or ''}")

    # 1. ours
    ours = jax.jit(jax_kvcm.paged_attention)
    try:
        poison_allocator(q_check.shape, DTYPE)
        c = check(ours(q_check, k_cache, v_cache, page_table, seq_lens), ref)
        add("ours", ours, [(q_time, k_cache, v_cache, page_table, seq_lens),
                           (q_check, k_cache, v_cache, page_table, seq_lens)], c)
    except Exception as e:  # noqa: BLE001
        rows.append(row("decode", shape, "ours", kv_bytes=kv_bytes, error=short_error(e)))
        log(f"  ours: ERROR {short_error(e)}")

    # 1b. ours over an fp8 copy of the cache (half the bytes), against the reference on the
    # dequantized cache; and the anchors over the same fp8 values
    ref8 = None
    try:
        k8, v8, scale8, kdq, vdq = fp8_caches(k_cache, v_cache)
        ref8 = jax.block_until_ready(reference_decode(q_check, kdq, vdq, page_table, seq_lens))
        del kdq, vdq
        scales = jnp.full((hkv,), scale8, jnp.float32)
        ours8 = jax.jit(lambda q, k, v, pt, sl, sc: jax_kvcm.paged_attention(
            q, k, v, pt, sl, k_scale=sc, v_scale=sc))
        poison_allocator(q_check.shape, DTYPE)
        c8 = check(ours8(q_check, k8, v8, page_table, seq_lens, scales), ref8)
        r8 = row("decode", shape, "ours fp8", kv_bytes=kv_bytes // 2, check=c8["text"],
                 rel_l2=c8["rel_l2"], note=f"float8_e4m3fn K/V, scale {scale8:g}")
        t = _timing.time_jax(ours8, [(q_time, k8, v8, page_table, seq_lens, scales),
                                     (q_check, k8, v8, page_table, seq_lens, scales)],
                             repeats=args.repeats)
        r8.update(ms=t["ms"], timing=t, fp8=True)
        rows.append(r8)
        log(f"  ours fp8: {r8['ms']:.4f} ms, check {r8['check']}")
    except Exception as e:  # noqa: BLE001
        rows.append(row("decode", shape, "ours fp8", kv_bytes=kv_bytes // 2, error=short_error(e)))
        log(f"  ours fp8: ERROR {short_error(e)}")
        k8 = v8 = None

    # 1c. FlashInfer (tensor-core and CUDA-core decode, and tensor-core over fp8) and SGLang's
    # Triton decode kernel, over the same pages through torch views of the same memory
    if cuda_torch() is not None:
        kt, vt, ptt = to_torch(k_cache), to_torch(v_cache), to_torch(page_table)
        qs = {True: to_torch(q_check), False: to_torch(q_time)}
        lens = [s] * b
        sm = 1.0 / math.sqrt(d)
        specs = [
            ("flashinfer-decode[tc]", lambda chk: _anchors.flashinfer_decode(
                cuda_torch(), qs[chk], kt, vt, ptt, lens, tensor_cores=True, sm_scale=sm), None),
            ("flashinfer-decode", lambda chk: _anchors.flashinfer_decode(
                cuda_torch(), qs[chk], kt, vt, ptt, lens, tensor_cores=False, sm_scale=sm), None),
            ("sglang-triton", lambda chk: _anchors.sglang_triton_decode(
                cuda_torch(), qs[chk], kt, vt, ptt, lens, sm_scale=sm, anchor_dir=args.anchors),
             None),
        ]
        rows += torch_rows("decode", shape, specs, ref, {"kv_bytes": kv_bytes})
        if k8 is not None and ref8 is not None:
            k8t, v8t = to_torch(k8), to_torch(v8)
            spec8 = [("flashinfer-decode[tc] fp8", lambda chk: _anchors.flashinfer_decode(
                cuda_torch(), qs[chk], k8t, v8t, ptt, lens, tensor_cores=True, sm_scale=sm,
                kv_scale=scale8), ref8)]
            rows += [dict(r, fp8=True) for r in
                     torch_rows("decode", shape, spec8, ref, {"kv_bytes": kv_bytes // 2})]
            del k8t, v8t
        del kt, vt, ptt, qs
    else:
        for m in ("flashinfer-decode[tc]", "flashinfer-decode", "sglang-triton"):
            rows.append(row("decode", shape, m, kv_bytes=kv_bytes,
                            error=f"skipped: {_timing.import_torch(need_cuda=True)[1]}"))
    del k8, v8, ref8
    free()

    # 2. pure-JAX gather
    gather = jax.jit(gather_attention)
    try:
        c = check(gather(q_check, k_cache, v_cache, page_table, seq_lens), ref)
        add("jax-gather", gather, [(q_time, k_cache, v_cache, page_table, seq_lens),
                                   (q_check, k_cache, v_cache, page_table, seq_lens)], c)
    except Exception as e:  # noqa: BLE001
        rows.append(row("decode", shape, "jax-gather", kv_bytes=kv_bytes, error=short_error(e)))
        log(f"  jax-gather: ERROR {short_error(e)}")
    free()

    # 3. Pallas (Triton) paged attention: its defaults, then a few other splits if it helps
    if args.pallas and not args.skip_pallas:
        rows.extend(bench_pallas(q_check, q_time, k_cache, v_cache, page_table, seq_lens, ref,
                                 shape, kv_bytes, args))
        free()

    # 4. torch SDPA on a dense cache, 5. device copy (torch; and a JAX copy to cross-check the
    # two timing methods on the same operation)
    torch = cuda_torch()
    if torch is None:
        for m in ("torch-sdpa", "copy (torch)"):
            rows.append(row("decode", shape, m, kv_bytes=kv_bytes, error=f"skipped: {_timing.import_torch(need_cuda=True)[1]}"))
    else:
        rows.extend(bench_torch_decode(torch, q_check, q_time, k_cache, v_cache, page_table, ref,
                                       shape, kv_bytes, args))
    try:
        src = jax.random.normal(keys[3], (kv_bytes // 2,), DTYPE)
        add("copy (jax)", jax.jit(jnp.copy), [(src,)], None,
            note="jit(jnp.copy), K+V bytes; cross-checks the JAX timing loop against do_bench")
        del src
    except Exception as e:  # noqa: BLE001
        rows.append(row("decode", shape, "copy (jax)", kv_bytes=kv_bytes, error=short_error(e)))
    del k_cache, v_cache, ref
    free()
    return rows


def bench_prefill(b: int, s: int, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    shape = f"B={b} S={s}"
    h, hkv, d = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    t_tokens = b * s
    flops = 4 * b * s * s / 2 * h * d
    rows: list[dict[str, Any]] = []
    log(f"\n[prefill {shape}] {t_tokens} tokens, {flops / 1e12:.3f} TFLOP (causal)")

    case = prefill_case(b, s, seed)
    q, k, v, q2 = case["q"], case["k"], case["v"], case["q2"]  # q2: a second input for timing
    page_table, slots, pos = case["page_table"], case["slots"], case["pos"]
    seq_lens, query_start, num_pages = case["seq_lens"], case["query_start"], case["num_pages"]

    # Fill the cache with write_kv (not timed); cross-check it against the reference write.
    zeros = lambda: jnp.zeros((num_pages, PAGE, hkv, d), DTYPE)  # noqa: E731
    kf, vf = k.reshape(t_tokens, hkv, d), v.reshape(t_tokens, hkv, d)
    ref_kc, ref_vc = jax.jit(reference.write_kv)(zeros(), zeros(), kf, vf, slots)
    write_note = ""
    try:
        write = jax.jit(jax_kvcm.write_kv, donate_argnums=(0, 1))
        k_cache, v_cache = write(zeros(), zeros(), kf, vf, slots)
        same = bool(jnp.array_equal(k_cache, ref_kc) & jnp.array_equal(v_cache, ref_vc))
        write_note = "" if same else "write_kv != reference write_kv! "
        del ref_kc, ref_vc
    except Exception as e:  # noqa: BLE001
        k_cache, v_cache = ref_kc, ref_vc
        write_note = f"write_kv failed ({short_error(e)[:80]}), cache filled by reference; "
    log(f"  cache filled {write_note}")

    # Reference on a sub-sample of query positions (first, last, random) of every sequence.
    ref = jax.block_until_ready(jax.jit(dense_causal_reference)(q, k, v, pos))

    def sub(out_bshd):
        return out_bshd[:, pos]

    turns: list = []  # every method checked first, then all timed in turns (time_in_turns)

    def add(method, fn, arg_sets, c, note=""):
        r = row("prefill", shape, method, flops=flops, note=note,
                check=None if c is None else c["text"], rel_l2=None if c is None else c["rel_l2"])
        rows.append(r)
        turns.append((r, {"ms": lambda: _timing.time_jax(fn, arg_sets, repeats=args.repeats)}))
        log(f"  {method}: check {r['check']}")

    # ours
    ours = jax.jit(jax_kvcm.ragged_paged_attention)
    qp, qp2 = q.reshape(t_tokens, h, d), q2.reshape(t_tokens, h, d)
    try:
        poison_allocator(qp.shape, DTYPE)
        out = ours(qp, k_cache, v_cache, page_table, seq_lens, query_start)
        c = check(sub(out.reshape(b, s, h, d)), ref)
        del out
        add("ours", ours, [(qp2, k_cache, v_cache, page_table, seq_lens, query_start),
                           (qp, k_cache, v_cache, page_table, seq_lens, query_start)], c,
            note=write_note.strip())
    except Exception as e:  # noqa: BLE001
        rows.append(row("prefill", shape, "ours", flops=flops, error=short_error(e),
                        note=write_note.strip()))
        log(f"  ours: ERROR {short_error(e)}")
    # FlashInfer's paged prefill (FA3, FA2) over the same pages
    if cuda_torch() is not None:
        kt, vt, ptt = to_torch(k_cache), to_torch(v_cache), to_torch(page_table)
        qs = {True: to_torch(qp), False: to_torch(qp2)}
        pos_np = np.asarray(pos)
        specs = [(f"flashinfer-{backend}", (lambda be: lambda chk: _anchors.flashinfer_prefill(
            cuda_torch(), qs[chk], kt, vt, ptt, [s] * b, [s] * b, backend=be,
            sm_scale=1.0 / math.sqrt(d)))(backend), None) for backend in ("fa3", "fa2")]
        rows += torch_rows("prefill", shape, specs, ref, {"flops": flops},
                           reshape=lambda x: x.reshape(b, s, h, d)[:, pos_np], back_to_back=True,
                           turns=turns)
    else:
        for m in ("flashinfer-fa3", "flashinfer-fa2"):
            rows.append(row("prefill", shape, m, flops=flops,
                            error=f"skipped: {_timing.import_torch(need_cuda=True)[1]}"))
    # cuDNN flash attention on dense [B, S, H, D]; GQA first, repeated kv heads if refused.
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"))
    note, c = "GQA (k/v with 8 heads)", None
    kk, vv = k, v
    try:
        try:
            c = check(sub(cudnn(q, kk, vv)), ref)
        except Exception as e:  # noqa: BLE001
            gqa_err = short_error(e)
            rep = h // hkv
            kk, vv = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
            c = check(sub(cudnn(q, kk, vv)), ref)
            note = f"cuDNN refused GQA ({gqa_err[:80]}); kv heads repeated to {h}"
        add("cudnn", cudnn, [(q2, kk, vv), (q, kk, vv)], c, note=note)
    except Exception as e:  # noqa: BLE001
        rows.append(row("prefill", shape, "cudnn", flops=flops, error=short_error(e)))
        log(f"  cudnn: ERROR {short_error(e)}")
    time_in_turns(turns, args.rounds)
    for r, _ in turns:
        log(f"  {r['method']}: {r['ms'] if r['ms'] is None else round(r['ms'], 4)} ms "
             f"(rounds {[round(x, 4) for x in r.get('ms_rounds', [])]}) {r['note']} "
             f"{r['error'] or ''}")
    del turns, k_cache, v_cache, q, q2, k, v, kk, vv, ref
    free()
    return rows


# ----------------------------------------------------------------------------------------------
# mixed: decode rows and one prefill chunk in one ragged call


def bench_mixed(cfg: dict[str, int], seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    nd, ld, chunk, ctx = cfg["decode_rows"], cfg["decode_len"], cfg["chunk"], cfg["chunk_context"]
    shape = f"{nd} decode x {ld} + chunk {chunk} after {ctx}"
    h, hkv, d = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    lens = [ld] * nd + [ctx + chunk]
    num_new = [1] * nd + [chunk]
    b, t_rows = nd + 1, nd + chunk
    width = -(-max(lens) // PAGE)
    pages_needed = [-(-n // PAGE) for n in lens]
    num_pages = sum(pages_needed) + 1
    # FLOPs: decode rows 4*L*H*D each; the chunk 4*H*D*sum_i (ctx + i + 1)
    flops = 4 * h * d * (nd * ld + sum(ctx + i + 1 for i in range(chunk)))
    kv_bytes = 2 * sum(lens) * hkv * d * jnp.dtype(DTYPE).itemsize
    log(f"\n[mixed {shape}] {t_rows} query rows, {flops / 1e12:.3f} TFLOP")
    keys = jax.random.split(jax.random.key(seed), 4)
    k_cache = jax.random.normal(keys[0], (num_pages, PAGE, hkv, d), DTYPE)
    v_cache = jax.random.normal(keys[1], (num_pages, PAGE, hkv, d), DTYPE)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_pages - 1) + 1
    pt_np = np.zeros((b, width), np.int32)
    used = 0
    for i, n in enumerate(pages_needed):
        pt_np[i, :n] = perm[used:used + n]
        used += n
    page_table = jnp.asarray(pt_np)
    seq_lens = jnp.asarray(np.array(lens, np.int32))
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32))
    q = jax.random.normal(keys[2], (t_rows, h, d), DTYPE)
    q2 = jax.random.normal(keys[3], (t_rows, h, d), DTYPE)
    n_sub = min(chunk, 64)
    sub_pos = np.unique(np.concatenate([[0, chunk - 1], rng.choice(chunk, n_sub - 2,
                                                                    replace=False)]))

    def reference(kc_all, vc_all):
        """The decode rows through the decode oracle; the chunk on sampled positions through
        the dense causal oracle over its gathered K/V."""
        ref_dec = reference_decode(q[:nd], kc_all, vc_all, page_table[:nd, :-(-ld // PAGE)],
                                   seq_lens[:nd])
        kc = kc_all[page_table[nd]].reshape(1, -1, hkv, d)[:, :ctx + chunk]
        vc = vc_all[page_table[nd]].reshape(1, -1, hkv, d)[:, :ctx + chunk]
        qc = jnp.zeros((1, ctx + chunk, h, d), DTYPE).at[0, ctx:].set(q[nd:])
        ref_chunk = jax.jit(dense_causal_reference)(qc, kc, vc, jnp.asarray(ctx + sub_pos))[0]
        return jnp.concatenate([ref_dec.astype(jnp.float32), ref_chunk], axis=0)

    def pick(out):  # the rows the reference covers
        out = np.asarray(out)
        return np.concatenate([out[:nd], out[nd + sub_pos]], axis=0)

    amount = {"flops": flops, "kv_bytes": kv_bytes}
    inputs = (q, q2, page_table, seq_lens, query_start)
    ref = reference(k_cache, v_cache)
    rows = _ours_mixed_and_parts("ours", shape, k_cache, v_cache, {}, ref, pick, sub_pos,
                                 inputs, amount, args)
    try:
        k8, v8, scale8, kdq, vdq = fp8_caches(k_cache, v_cache)
        ref8 = reference(kdq, vdq)
        del kdq, vdq
        sc = jnp.full((hkv,), scale8, jnp.float32)
        rows += _ours_mixed_and_parts("ours fp8", shape, k8, v8, {"k_scale": sc, "v_scale": sc},
                                      ref8, pick, sub_pos, inputs,
                                      dict(amount, kv_bytes=kv_bytes // 2), args)
        del k8, v8, ref8
    except Exception as e:  # noqa: BLE001
        rows.append(row("mixed", shape, "ours fp8", error=short_error(e)))
        log(f"  ours fp8: ERROR {short_error(e)}")
    if cuda_torch() is not None:
        kt, vt, ptt = to_torch(k_cache), to_torch(v_cache), to_torch(page_table)
        qs = {True: to_torch(q), False: to_torch(q2)}
        specs = [(f"flashinfer-{backend}", (lambda be: lambda chk: _anchors.flashinfer_prefill(
            cuda_torch(), qs[chk], kt, vt, ptt, lens, num_new, backend=be,
            sm_scale=1.0 / math.sqrt(d)))(backend), None) for backend in ("fa3", "fa2")]
        rows += torch_rows("mixed", shape, specs, ref, amount, reshape=pick)
        del kt, vt, ptt, qs
    else:
        for m in ("flashinfer-fa3", "flashinfer-fa2"):
            rows.append(row("mixed", shape, m, **amount,
                            error=f"skipped: {_timing.import_torch(need_cuda=True)[1]}"))
    del k_cache, v_cache, ref
    free()
    return rows


def _ours_mixed_and_parts(label: str, shape: str, k_cache, v_cache, scales: dict[str, Any], ref,
                          pick, sub_pos, inputs, amount: dict[str, Any],
                          args: argparse.Namespace) -> list[dict[str, Any]]:
    """The mixed call (``label``), then its two parts alone: the decode rows through
    ``paged_attention`` and the chunk (the last sequence) through ``ragged_paged_attention``,
    each checked and timed. The mixed row's note gives ``mixed / (decode + chunk)``: what
    sharing one call costs (1.0: nothing)."""
    q, q2, page_table, seq_lens, query_start = inputs
    nd = seq_lens.shape[0] - 1
    chunk = q.shape[0] - nd
    mixed = jax.jit(lambda q, kc, vc, pt, sl, qs: jax_kvcm.ragged_paged_attention(
        q, kc, vc, pt, sl, qs, **scales))
    decode = jax.jit(lambda q, kc, vc, pt, sl: jax_kvcm.paged_attention(
        q, kc, vc, pt, sl, **scales))
    chunk_qs = jnp.asarray([0, chunk], jnp.int32)
    parts = [
        (label, mixed, lambda x: (x, k_cache, v_cache, page_table, seq_lens, query_start),
         pick, ref),
        (f"{label}: decode rows alone", decode,
         lambda x: (x[:nd], k_cache, v_cache, page_table[:nd], seq_lens[:nd]),
         np.asarray, ref[:nd]),
        (f"{label}: chunk alone", mixed,
         lambda x: (x[nd:], k_cache, v_cache, page_table[nd:], seq_lens[nd:], chunk_qs),
         lambda out: np.asarray(out)[sub_pos], ref[nd:]),
    ]
    rows: list[dict[str, Any]] = []
    for method, fn, args_of, select, want in parts:
        r = row("mixed", shape, method, **(amount if method == label else {}))
        try:
            poison_allocator(args_of(q)[0].shape, DTYPE)
            c = check(select(fn(*args_of(q)).astype(jnp.float32)), want)
            t = _timing.time_jax(fn, [args_of(q2), args_of(q)], repeats=args.repeats)
            r.update(ms=t["ms"], timing=t, check=c["text"], rel_l2=c["rel_l2"])
            log(f"  {method}: {r['ms']:.4f} ms, check {r['check']}")
        except Exception as e:  # noqa: BLE001
            r["error"] = short_error(e)
            log(f"  {method}: ERROR {short_error(e)}")
        rows.append(r)
    if all(r["ms"] for r in rows):
        whole = rows[1]["ms"] + rows[2]["ms"]
        rows[0].update(parts_ms=whole, over_parts=rows[0]["ms"] / whole)
        rows[0]["note"] = (f"decode rows alone + chunk alone = {whole:.4f} ms; "
                           f"mixed / parts = {rows[0]['ms'] / whole:.3f}")
        log(f"  {label}: {rows[0]['note']}")
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.bench_attention``."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_attention", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write all results (with raw samples) here")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes; runs on CPU (Pallas in interpret mode, torch/cuDNN skipped)")
    p.add_argument("--only", choices=("decode", "prefill", "mixed"), default=None)
    p.add_argument("--mixed", type=int, nargs=4, default=None,
                   metavar=("DECODE_ROWS", "DECODE_LEN", "CHUNK", "CHUNK_CONTEXT"),
                   help="the mixed case's shape (default: %s)" % " ".join(map(str, MIXED.values())))
    p.add_argument("--anchors", default=None,
                   help="folder with FlashInfer (and its deps) installed, put on sys.path; SGLang's "
                        "decode_attention.py is looked up as DIR/sglang*/decode_attention.py "
                        "(default: plain imports; SGLang also from .anchors/sglang*/)")
    p.add_argument("--pallas", action="store_true",
                   help="also time jax's Pallas paged attention (slow to compile)")
    p.add_argument("--repeats", type=int, default=7, help="timing samples per method (median)")
    p.add_argument("--rounds", type=int, default=3,
                   help="prefill: time every method this many times, in turns (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-pallas", action="store_true", help="(the default; kept for scripts)")
    p.add_argument("--no-pallas-sweep", action="store_true",
                   help="time the Pallas op at its defaults only")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failures")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 3)
        args.rounds = min(args.rounds, 1)

    t_start = time.perf_counter()
    anchor_env = _anchors.prepare(args.anchors)  # before torch / flashinfer are imported
    env = environment()
    env["anchors"] = anchor_env
    log("environment:", json.dumps(env))
    if env["backend"] != "gpu" and not args.quick:
        log("WARNING: no GPU backend; full shapes on CPU will be very slow (use --quick)")
    decode_shapes = QUICK_DECODE_SHAPES if args.quick else DECODE_SHAPES
    prefill_shapes = QUICK_PREFILL_SHAPES if args.quick else PREFILL_SHAPES

    rows: list[dict[str, Any]] = []
    for i, (b, s) in enumerate(decode_shapes if args.only in (None, "decode") else []):
        try:
            rows += bench_decode(b, s, args.seed + i, args)
        except Exception as e:  # noqa: BLE001 - e.g. OOM while building inputs
            rows.append(row("decode", f"B={b} S={s}", "(setup)", error=short_error(e)))
            traceback.print_exc()
        free()
    for i, (b, s) in enumerate(prefill_shapes if args.only in (None, "prefill") else []):
        try:
            rows += bench_prefill(b, s, args.seed + 100 + i, args)
        except Exception as e:  # noqa: BLE001
            rows.append(row("prefill", f"B={b} S={s}", "(setup)", error=short_error(e)))
            traceback.print_exc()
        free()

    if args.only in (None, "mixed"):
        try:
            shape = (dict(zip(MIXED, args.mixed)) if args.mixed
                     else QUICK_MIXED if args.quick else MIXED)
            rows += bench_mixed(shape, args.seed + 200, args)
        except Exception as e:  # noqa: BLE001
            rows.append(row("mixed", "mixed", "(setup)", error=short_error(e)))
            traceback.print_exc()
        free()

    finish_rows(rows)
    print_tables(rows)
    wall = time.perf_counter() - t_start
    log(f"\ntotal wall time {wall:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "wall_s": wall, "quick": args.quick,
                       "config": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
                                  "head_dim": HEAD_DIM, "page_size": PAGE, "dtype": "bfloat16",
                                  "tolerance_rel_l2": TOL,
                                  "prefill_flops": "4 * B * S^2/2 * H * D",
                                  "kv_bytes": "2 * B * S * Hkv * D * 2 (K + V, bf16)"},
                       "ratios_ours_over_method": {f"{k[0]} {k[1]}": v
                                                   for k, v in ratio_summary(rows).items()},
                       "rows": rows}, f, indent=1, default=str)
        log(f"wrote {args.json}")
    # any of ours (bf16, fp8, a mixed call's parts) that failed or was wrong fails the run
    bad = [r for r in rows if r["method"].startswith("ours") and (
        r["error"] or (r["check"] or "").startswith("FAIL"))]
    for r in bad:
        log(f"FAILED: {r['section']} {r['shape']} {r['method']}: {r['error'] or r['check']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
