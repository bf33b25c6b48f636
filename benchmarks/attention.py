#!/usr/bin/env python
"""Paged attention benchmark: jax_kvcm custom calls vs FlashInfer, SGLang, torch SDPA and cuDNN.

Run on the GPU machine (after `pip install .` of jax_kvcm with its CUDA extension), from anywhere
except a directory that shadows the installed package with an unbuilt `jax_kvcm/`:

    python benchmarks/attention.py [--json results.json] [--anchors /tmp/anchors]
    JAX_PLATFORMS=cpu python benchmarks/attention.py --quick        # CPU smoke test, tiny shapes

Anchors (same process, same inputs, same correctness check; a row says "not installed" when its
package does not import; see benchmarks/_anchors.py for the build settings FlashInfer needs):
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
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

try:
    from benchmarks import _anchors, _timing  # python -m benchmarks.attention
except ImportError:
    import _anchors  # python benchmarks/attention.py (the script's directory is on sys.path)
    import _timing

import jax_kvcm  # noqa: E402
from jax_kvcm.ops import reference  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DTYPE = jnp.bfloat16
TOL = 2e-2  # rel-L2 tolerance for bf16 outputs vs the float32 reference

DECODE_SHAPES = [(64, 4096), (256, 1024), (8, 32768), (1, 131072), (256, 256)]
PREFILL_SHAPES = [(8, 2048), (1, 16384)]
QUICK_DECODE_SHAPES = [(2, 256), (3, 512)]
QUICK_PREFILL_SHAPES = [(2, 64), (1, 128)]
MIXED = {"decode_rows": 256, "decode_len": 1024, "chunk": 2048, "chunk_context": 2048}
QUICK_MIXED = {"decode_rows": 4, "decode_len": 40, "chunk": 48, "chunk_context": 16}


# ----------------------------------------------------------------------------------------------
# small utilities


_err = _timing.short_error


def _log(*a: Any) -> None:
    print(*a, flush=True)


@jax.jit
def _rel_l2_and_finite(out: jax.Array, ref: jax.Array) -> tuple[jax.Array, jax.Array]:
    out32, ref32 = out.astype(jnp.float32), ref.astype(jnp.float32)
    rel = jnp.linalg.norm((out32 - ref32).ravel()) / jnp.maximum(jnp.linalg.norm(ref32.ravel()),
                                                                  1e-30)
    return rel, jnp.isfinite(out32).all()


def check(out: Any, ref: jax.Array) -> dict[str, Any]:
    """rel-L2 of `out` (jax array or numpy) against `ref`; NaN/Inf anywhere fails."""
    rel, finite = _rel_l2_and_finite(jnp.asarray(out), ref)
    rel, finite = float(rel), bool(finite)
    ok = finite and rel < TOL
    return {"rel_l2": rel, "finite": finite, "ok": ok,
            "text": (f"{'ok' if ok else 'FAIL'} {rel:.1e}" + ("" if finite else " NaN/Inf"))}


def poison_allocator(shape: tuple[int, ...], dtype: Any, n: int = 4) -> None:
    """Best effort: leave freed NaN-filled buffers of the output's size in JAX's allocator, so an
    output buffer that a kernel fails to write is likely to read back as NaN, not stale data."""
    bufs = [jnp.full(shape, jnp.nan, dtype) for _ in range(n)]
    jax.block_until_ready(bufs)
    del bufs


def free() -> None:
    gc.collect()
    t = _torch()
    if t is not None:
        t.cuda.empty_cache()


def _torch() -> Any:
    """torch with a CUDA device, or None (``_timing.import_torch`` says why)."""
    return _timing.import_torch(need_cuda=True)[0]


def to_torch(x: jax.Array) -> Any:
    torch = _torch()
    x = jax.block_until_ready(x)
    try:
        return torch.from_dlpack(x)
    except Exception:  # noqa: BLE001 - go through the host
        host = np.asarray(x.astype(jnp.float32))
        return torch.from_numpy(host).to("cuda").to(
            torch.bfloat16 if x.dtype == jnp.bfloat16 else getattr(torch, str(x.dtype)))


def row(section: str, shape: str, method: str, **kw: Any) -> dict[str, Any]:
    r = {"section": section, "shape": shape, "method": method, "ms": None, "check": None,
         "note": "", "error": None}
    r.update(kw)
    return r


# ----------------------------------------------------------------------------------------------
# decode


def gather_attention(q, k_cache, v_cache, page_table, seq_lens):
    """Lean pure-JAX decode: gather pages, bf16 GQA einsums with f32 accumulation and softmax."""
    b, h, d = q.shape
    hkv = k_cache.shape[-2]
    k = k_cache[page_table].reshape(b, -1, hkv, d)  # [B, S, Hkv, D]
    v = v_cache[page_table].reshape(b, -1, hkv, d)
    qg = q.reshape(b, hkv, h // hkv, d)
    s = jnp.einsum("bkgd,bskd->bkgs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    mask = jnp.arange(k.shape[1])[None, :] < seq_lens[:, None]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgs,bskd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, h, d).astype(q.dtype)


def reference_decode(q, k_cache, v_cache, page_table, seq_lens):
    """The package's float32 oracle, run over row chunks to bound its memory (it repeats K/V)."""
    ref = jax.jit(reference.paged_attention)
    s = page_table.shape[1] * PAGE
    chunk = max(1, min(q.shape[0], 32768 // s))
    outs = [ref(q[i:i + chunk], k_cache, v_cache, page_table[i:i + chunk], seq_lens[i:i + chunk])
            for i in range(0, q.shape[0], chunk)]
    return jnp.concatenate(outs, axis=0)


def fp8_caches(k_cache: jax.Array, v_cache: jax.Array) -> tuple[Any, ...]:
    """float8_e4m3fn copies of the caches with one power-of-two scale (so the dequantized cache is
    exact in bf16 and FlashInfer, which takes one scale per tensor, sees the same values):
    (k8, v8, scale, k_dequantized, v_dequantized)."""
    amax = float(jnp.maximum(jnp.abs(k_cache).max(), jnp.abs(v_cache).max()))
    scale = float(2.0 ** math.ceil(math.log2(max(amax, 1e-30) / 448.0)))
    fp8 = jnp.float8_e4m3fn
    quant = jax.jit(lambda c: (c.astype(jnp.float32) / scale).astype(fp8))
    deq = jax.jit(lambda c8: (c8.astype(jnp.float32) * scale).astype(DTYPE))
    k8, v8 = quant(k_cache), quant(v_cache)
    return k8, v8, scale, deq(k8), deq(v8)


def torch_rows(section: str, shape: str, specs: list[tuple[str, Any, Any]], ref: jax.Array,
               amount: dict[str, Any], reshape: Any = None, back_to_back: bool = False,
               turns: list | None = None) -> list[dict[str, Any]]:
    """Rows for torch-side anchors: each spec is (method, make(for_check: bool) -> fn, ref or
    None for the default); fn() returns the output; checked, then timed with CUDA events
    (``time_torch``; with ``back_to_back`` also in a loop of calls, into the note). With
    ``turns`` the timers go there instead, for :func:`time_in_turns`."""
    torch = _torch()
    rows: list[dict[str, Any]] = []
    for method, make, ref_override in specs:
        r = row(section, shape, method, **amount)
        if torch is None:
            r["error"] = f"skipped: {_timing.import_torch(need_cuda=True)[1]}"
            rows.append(r)
            continue
        try:
            out = make(True)()
            torch.cuda.synchronize()
            got = out.float().cpu().numpy()
            if reshape is not None:
                got = reshape(got)
            c = check(got, ref if ref_override is None else ref_override)
            r.update(check=c["text"], rel_l2=c["rel_l2"])
            fn = make(False)
            timers = {"ms": lambda fn=fn: _timing.time_torch(fn)}
            if back_to_back:  # ours is timed so (time_jax): the same for the anchor, in the note
                timers["ms_loop"] = lambda fn=fn: _timing.time_torch(fn, loop=True)
            if turns is not None:
                turns.append((r, timers))
                _log(f"  {method}: check {r['check']}")
            else:
                time_in_turns([(r, timers)], 1)
                _log(f"  {method}: {r['ms']:.4f} ms, check {r['check']} {r['note']}")
        except Exception as e:  # noqa: BLE001
            msg = _err(e)
            r["error"] = msg if "not installed" not in msg else msg.split(": ", 1)[-1]
            _log(f"  {method}: {r['error']}")
        rows.append(r)
        free()
    return rows


def time_in_turns(turns: list[tuple[dict[str, Any], dict[str, Any]]], rounds: int) -> None:
    """Times every (row, {key: timer}) in turns, ``rounds`` times over, so that a drift of the
    GPU's speed during the run falls on every method alike: row[key] is the median of the
    rounds' times (each a ``_timing`` median), the rounds' times in row[key + "_rounds"]; a
    back-to-back time ("ms_loop") also goes into the note."""
    for _ in range(rounds):
        for r, timers in turns:
            if r.get("error"):
                continue
            for key, timer in timers.items():
                try:
                    t = timer()
                except Exception as e:  # noqa: BLE001
                    r["error"] = _err(e)
                    break
                r.setdefault(key + "_rounds", []).append(t["ms"])
                if key == "ms":
                    r["timing"] = t
    for r, timers in turns:
        for key in timers:
            if r.get(key + "_rounds"):
                r[key] = statistics.median(r[key + "_rounds"])
        if r.get("ms_loop") is not None:
            note = f"back to back: {r['ms_loop']:.4f} ms"
            r["note"] = f"{r['note']}; {note}" if r.get("note") else note


def bench_decode(b: int, s: int, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    shape = f"B={b} S={s}"
    h, hkv, d = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    pages_per_seq = s // PAGE
    num_pages = b * pages_per_seq + 1
    kv_bytes = 2 * b * s * hkv * d * jnp.dtype(DTYPE).itemsize  # K + V actually attended
    rows: list[dict[str, Any]] = []
    _log(f"\n[decode {shape}] KV {kv_bytes / 2**30:.2f} GiB, {num_pages} pages")

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
    _log(f"  reference: {time.perf_counter() - t0:.1f}s")

    def add(method: str, fn, arg_sets, out_check: dict | None, note: str = "") -> None:
        r = row("decode", shape, method, kv_bytes=kv_bytes, note=note,
                check=None if out_check is None else out_check["text"],
                rel_l2=None if out_check is None else out_check["rel_l2"])
        try:
            t = _timing.time_jax(fn, arg_sets, repeats=args.repeats)
            r["ms"] = t["ms"]
            r["timing"] = t
        except Exception as e:  # noqa: BLE001
            r["error"] = _err(e)
        rows.append(r)
        _log(f"  {method}: {r['ms'] if r['ms'] is None else round(r['ms'], 4)} ms, "
             f"check {r['check']} {r['error'] or ''}")

    # 1. ours
    ours = jax.jit(jax_kvcm.paged_attention)
    try:
        poison_allocator(q_check.shape, DTYPE)
        c = check(ours(q_check, k_cache, v_cache, page_table, seq_lens), ref)
        add("ours", ours, [(q_time, k_cache, v_cache, page_table, seq_lens),
                           (q_check, k_cache, v_cache, page_table, seq_lens)], c)
    except Exception as e:  # noqa: BLE001
        rows.append(row("decode", shape, "ours", kv_bytes=kv_bytes, error=_err(e)))
        _log(f"  ours: ERROR {_err(e)}")

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
        _log(f"  ours fp8: {r8['ms']:.4f} ms, check {r8['check']}")
    except Exception as e:  # noqa: BLE001
        rows.append(row("decode", shape, "ours fp8", kv_bytes=kv_bytes // 2, error=_err(e)))
        _log(f"  ours fp8: ERROR {_err(e)}")
        k8 = v8 = None

    # 1c. FlashInfer (tensor-core and CUDA-core decode, and tensor-core over fp8) and SGLang's
    # Triton decode kernel, over the same pages through torch views of the same memory
    if _torch() is not None:
        kt, vt, ptt = to_torch(k_cache), to_torch(v_cache), to_torch(page_table)
        qs = {True: to_torch(q_check), False: to_torch(q_time)}
        lens = [s] * b
        sm = 1.0 / math.sqrt(d)
        specs = [
            ("flashinfer-decode[tc]", lambda chk: _anchors.flashinfer_decode(
                _torch(), qs[chk], kt, vt, ptt, lens, tensor_cores=True, sm_scale=sm), None),
            ("flashinfer-decode", lambda chk: _anchors.flashinfer_decode(
                _torch(), qs[chk], kt, vt, ptt, lens, tensor_cores=False, sm_scale=sm), None),
            ("sglang-triton", lambda chk: _anchors.sglang_triton_decode(
                _torch(), qs[chk], kt, vt, ptt, lens, sm_scale=sm, anchor_dir=args.anchors),
             None),
        ]
        rows += torch_rows("decode", shape, specs, ref, {"kv_bytes": kv_bytes})
        if k8 is not None and ref8 is not None:
            k8t, v8t = to_torch(k8), to_torch(v8)
            spec8 = [("flashinfer-decode[tc] fp8", lambda chk: _anchors.flashinfer_decode(
                _torch(), qs[chk], k8t, v8t, ptt, lens, tensor_cores=True, sm_scale=sm,
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
        rows.append(row("decode", shape, "jax-gather", kv_bytes=kv_bytes, error=_err(e)))
        _log(f"  jax-gather: ERROR {_err(e)}")
    free()

    # 3. Pallas (Triton) paged attention: its defaults, then a few other splits if it helps
    if args.pallas and not args.skip_pallas:
        rows.extend(bench_pallas(q_check, q_time, k_cache, v_cache, page_table, seq_lens, ref,
                                 shape, kv_bytes, args))
        free()

    # 4. torch SDPA on a dense cache, 5. device copy (torch; and a JAX copy to cross-check the
    # two timing methods on the same operation)
    torch = _torch()
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
        rows.append(row("decode", shape, "copy (jax)", kv_bytes=kv_bytes, error=_err(e)))
    del k_cache, v_cache, ref
    free()
    return rows


PALLAS_DEFAULT = {"block_h": 16, "pages_per_compute_block": 8, "k_splits": 16}
# A few other (k_splits, pages_per_compute_block) to give the Pallas op a fair shot (GPU only).
PALLAS_SWEEP = [(8, 16), (32, 8), (16, 16), (32, 16)]


def bench_pallas(q_check, q_time, k_cache, v_cache, page_table, seq_lens, ref, shape, kv_bytes,
                 args) -> list[dict[str, Any]]:
    """jax.experimental.pallas.ops.gpu.paged_attention, checked, at its defaults and (on GPU) a
    small sweep of splits; a faster correct config gets its own row."""
    on_gpu = jax.default_backend() == "gpu"
    b, h, d = q_check.shape
    pages_per_seq = page_table.shape[1]
    note = "" if on_gpu else "interpret mode (no GPU); "
    rows: list[dict[str, Any]] = []
    r = row("decode", shape, "pallas", kv_bytes=kv_bytes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # deprecated in jax 0.11
            from jax.experimental.pallas.ops.gpu import paged_attention as pallas_pa
        # Its layout: [Hkv, total_pages, page_size, D]. Our page 0 is the null page and no row
        # uses it, so it is dropped and the block tables shift by one (total pages = B*S/16).
        to_layout = jax.jit(lambda c: jnp.transpose(c[1:], (2, 0, 1, 3)))
        k_pages, v_pages = to_layout(k_cache), to_layout(v_cache)
        block_tables = page_table - 1
        # It applies no logit scale: pass q * 1/sqrt(D) (rounded to bf16, outside the timing).
        scale = 1.0 / math.sqrt(d)
        qs_check = (q_check.astype(jnp.float32) * scale).astype(DTYPE)
        qs_time = (q_time.astype(jnp.float32) * scale).astype(DTYPE)
        arg_sets = [(qs_time, k_pages, v_pages, block_tables, seq_lens),
                    (qs_check, k_pages, v_pages, block_tables, seq_lens)]

        def make(k_splits, ppcb):
            return jax.jit(lambda q, kp, vp, bt, ln: pallas_pa.paged_attention(
                q, kp, vp, bt, ln, k_splits=k_splits, pages_per_compute_block=ppcb,
                interpret=not on_gpu))

        ks0 = PALLAS_DEFAULT["k_splits"] if pages_per_seq % PALLAS_DEFAULT["k_splits"] == 0 else 1
        ppcb0 = PALLAS_DEFAULT["pages_per_compute_block"]
        fn = make(ks0, ppcb0)
        c = check(fn(qs_check, k_pages, v_pages, block_tables, seq_lens), ref)
        r.update(check=c["text"], rel_l2=c["rel_l2"],
                 note=note + f"defaults (block_h=16, k_splits={ks0}, pages_per_compute_block=8)")
        t = _timing.time_jax(fn, arg_sets, repeats=args.repeats)
        r.update(ms=t["ms"], timing=t)
        _log(f"  pallas: {r['ms']:.4f} ms, check {r['check']}")

        sweep = {}
        if on_gpu and not args.no_pallas_sweep:
            for ks, ppcb in PALLAS_SWEEP:
                if pages_per_seq % ks:
                    continue
                name = f"k_splits={ks},pages_per_compute_block={ppcb}"
                try:
                    fn = make(ks, ppcb)
                    cc = check(fn(qs_check, k_pages, v_pages, block_tables, seq_lens), ref)
                    tt = _timing.time_jax(fn, arg_sets, repeats=max(3, args.repeats // 2))
                    sweep[name] = {"ms": tt["ms"], "check": cc["text"], "ok": cc["ok"]}
                except Exception as e:  # noqa: BLE001
                    sweep[name] = {"error": _err(e)}
            r["sweep"] = sweep
            _log(f"  pallas sweep: {sweep}")
        rows.append(r)
        good = {k: v for k, v in sweep.items() if v.get("ok")}
        if good:
            best = min(good, key=lambda k: good[k]["ms"])
            if good[best]["ms"] < 0.95 * r["ms"]:
                rows.append(row("decode", shape, "pallas[tuned]", kv_bytes=kv_bytes,
                                ms=good[best]["ms"], check=good[best]["check"],
                                note=f"best of a small sweep: {best}, block_h=16"))
        del k_pages, v_pages
    except Exception as e:  # noqa: BLE001
        r["error"] = _err(e)
        if r not in rows:
            rows.append(r)
        _log(f"  pallas: ERROR {_err(e)}")
        if args.verbose:
            traceback.print_exc()
    return rows


def bench_torch_decode(torch, q_check, q_time, k_cache, v_cache, page_table, ref, shape,
                       kv_bytes, args) -> list[dict[str, Any]]:
    from torch.nn import functional as F
    rows: list[dict[str, Any]] = []
    b, h, d = q_check.shape
    hkv = k_cache.shape[-2]

    r = row("decode", shape, "torch-sdpa", kv_bytes=kv_bytes)
    try:
        dense = jax.jit(lambda c: jnp.transpose(c[page_table].reshape(b, -1, hkv, d), (0, 2, 1, 3)))
        k_t, v_t = to_torch(dense(k_cache)), to_torch(dense(v_cache))  # [B, Hkv, S, D]
        qc_t = to_torch(q_check.reshape(b, h, 1, d))
        qt_t = to_torch(q_time.reshape(b, h, 1, d))
        out = F.scaled_dot_product_attention(qc_t, k_t, v_t, enable_gqa=True)
        torch.cuda.synchronize()
        c = check(out.reshape(b, h, d).float().cpu().numpy(), ref)
        r.update(check=c["text"], rel_l2=c["rel_l2"])
        t = _timing.time_torch(
            lambda: F.scaled_dot_product_attention(qt_t, k_t, v_t, enable_gqa=True))
        r.update(ms=t["ms"], timing=t, note="default backend")
        # Which fused backends take this GQA decode shape, and how fast each is.
        backends = {}
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
                be = getattr(SDPBackend, name, None)
                if be is None:
                    continue
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        with sdpa_kernel([be]):
                            fn = lambda: F.scaled_dot_product_attention(  # noqa: E731
                                qt_t, k_t, v_t, enable_gqa=True)
                            fn()
                            torch.cuda.synchronize()
                            backends[name] = round(_timing.time_torch(fn, rep_ms=50)["ms"], 4)
                except Exception as e:  # noqa: BLE001
                    backends[name] = f"refused ({_err(e)[:80]})"
        except Exception as e:  # noqa: BLE001
            backends["error"] = _err(e)
        r["backends_ms"] = backends
        timed = {k: v for k, v in backends.items() if isinstance(v, float)}
        if timed:
            r["note"] = "default backend; " + ", ".join(
                f"{k.split('_')[0].lower()} {v:.3f}" if isinstance(v, float) else
                f"{k.split('_')[0].lower()} refused" for k, v in backends.items())
        rows.append(r)
        _log(f"  torch-sdpa: {r['ms']:.4f} ms, check {r['check']}, backends {backends}")
        if timed:
            best = min(timed, key=timed.get)
            if timed[best] < 0.95 * r["ms"]:
                rows.append(row("decode", shape, f"torch-sdpa[{best.split('_')[0].lower()}]",
                                kv_bytes=kv_bytes, ms=timed[best], check=r["check"],
                                note="fastest forced backend (same output check as default)"))
        del k_t, v_t, qc_t, qt_t, out
    except Exception as e:  # noqa: BLE001
        r["error"] = _err(e)
        rows.append(r)
        _log(f"  torch-sdpa: ERROR {_err(e)}")
        if args.verbose:
            traceback.print_exc()
    free()

    r = row("decode", shape, "copy (torch)", kv_bytes=kv_bytes)
    try:
        src = torch.empty(kv_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
        dst = torch.empty_like(src)
        t = _timing.time_torch(lambda: dst.copy_(src))
        r.update(ms=t["ms"], timing=t, copy_rw_tbps=2 * kv_bytes / (t["ms"] * 1e-3) / 1e12,
                 note="dst.copy_(src), K+V bytes")
        del src, dst
        _log(f"  copy (torch): {r['ms']:.4f} ms")
    except Exception as e:  # noqa: BLE001
        r["error"] = _err(e)
        _log(f"  copy (torch): ERROR {_err(e)}")
    rows.append(r)
    free()
    return rows


# ----------------------------------------------------------------------------------------------
# prefill


def dense_causal_reference(q, k, v, pos):
    """float32 causal attention for the query rows at positions `pos` [n] of q [B, S, H, D]
    over k/v [B, S, Hkv, D]; returns [B, n, H, D]."""
    b, _, h, d = q.shape
    hkv = k.shape[2]
    qg = q[:, pos].astype(jnp.float32).reshape(b, pos.shape[0], hkv, h // hkv, d)
    s = jnp.einsum("bnkgd,bskd->bkgns", qg, k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
    mask = jnp.arange(k.shape[1])[None, :] <= pos[:, None]
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgns,bskd->bnkgd", p, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return o.reshape(b, pos.shape[0], h, d)


def prefill_case(b: int, s: int, seed: int) -> dict[str, Any]:
    """The prefill shape's random inputs (bench_prefill's, and benchmarks/prefill_ab.py's): q and a
    second q for timing [B, S, H, D], k, v [B, S, Hkv, D], a page table of a random permutation
    of pages 1.. [B, S / PAGE] with the slots of the B * S tokens, seq_lens = S, query_start,
    and `pos`, the query positions the reference covers (first, last and random, <= 128)."""
    h, hkv, d = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    pages_per_seq = s // PAGE
    keys = jax.random.split(jax.random.key(seed), 4)
    rng = np.random.default_rng(seed)
    pt_np = (rng.permutation(b * pages_per_seq) + 1).reshape(b, pages_per_seq).astype(np.int32)
    tok = np.arange(s)
    n_sub = min(s, 128)
    pos = np.unique(np.concatenate([[0, s - 1], rng.choice(s, n_sub - 2, replace=False)]))
    return {"q": jax.random.normal(keys[0], (b, s, h, d), DTYPE),
            "k": jax.random.normal(keys[1], (b, s, hkv, d), DTYPE),
            "v": jax.random.normal(keys[2], (b, s, hkv, d), DTYPE),
            "q2": jax.random.normal(keys[3], (b, s, h, d), DTYPE),
            "page_table": jnp.asarray(pt_np),
            "slots": jnp.asarray((pt_np[:, tok // PAGE] * PAGE + tok % PAGE).reshape(-1)
                                 .astype(np.int32)),
            "seq_lens": jnp.full((b,), s, jnp.int32),
            "query_start": jnp.asarray(np.arange(b + 1, dtype=np.int32) * s),
            "pos": jnp.asarray(pos.astype(np.int32)),
            "num_pages": b * pages_per_seq + 1}


def bench_prefill(b: int, s: int, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    shape = f"B={b} S={s}"
    h, hkv, d = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    t_tokens = b * s
    flops = 4 * b * s * s / 2 * h * d
    rows: list[dict[str, Any]] = []
    _log(f"\n[prefill {shape}] {t_tokens} tokens, {flops / 1e12:.3f} TFLOP (causal)")

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
        write_note = f"write_kv failed ({_err(e)[:80]}), cache filled by reference; "
    _log(f"  cache filled {write_note}")

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
        _log(f"  {method}: check {r['check']}")

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
        rows.append(row("prefill", shape, "ours", flops=flops, error=_err(e),
                        note=write_note.strip()))
        _log(f"  ours: ERROR {_err(e)}")
    # FlashInfer's paged prefill (FA3, FA2) over the same pages
    if _torch() is not None:
        kt, vt, ptt = to_torch(k_cache), to_torch(v_cache), to_torch(page_table)
        qs = {True: to_torch(qp), False: to_torch(qp2)}
        pos_np = np.asarray(pos)
        specs = [(f"flashinfer-{backend}", (lambda be: lambda chk: _anchors.flashinfer_prefill(
            _torch(), qs[chk], kt, vt, ptt, [s] * b, [s] * b, backend=be,
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
            gqa_err = _err(e)
            rep = h // hkv
            kk, vv = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
            c = check(sub(cudnn(q, kk, vv)), ref)
            note = f"cuDNN refused GQA ({gqa_err[:80]}); kv heads repeated to {h}"
        add("cudnn", cudnn, [(q2, kk, vv), (q, kk, vv)], c, note=note)
    except Exception as e:  # noqa: BLE001
        rows.append(row("prefill", shape, "cudnn", flops=flops, error=_err(e)))
        _log(f"  cudnn: ERROR {_err(e)}")
    time_in_turns(turns, args.rounds)
    for r, _ in turns:
        _log(f"  {r['method']}: {r['ms'] if r['ms'] is None else round(r['ms'], 4)} ms "
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
    _log(f"\n[mixed {shape}] {t_rows} query rows, {flops / 1e12:.3f} TFLOP")
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
    # Reference: the decode rows through the decode oracle; the chunk on sampled positions
    # through the dense causal oracle over its gathered K/V.
    ref_dec = reference_decode(q[:nd], k_cache, v_cache, page_table[:nd, :-(-ld // PAGE)],
                               seq_lens[:nd])
    kc = k_cache[page_table[nd]].reshape(1, -1, hkv, d)[:, :ctx + chunk]
    vc = v_cache[page_table[nd]].reshape(1, -1, hkv, d)[:, :ctx + chunk]
    qc = jnp.zeros((1, ctx + chunk, h, d), DTYPE).at[0, ctx:].set(q[nd:])
    n_sub = min(chunk, 64)
    sub_pos = np.unique(np.concatenate([[0, chunk - 1], rng.choice(chunk, n_sub - 2,
                                                                    replace=False)]))
    ref_chunk = jax.jit(dense_causal_reference)(qc, kc, vc, jnp.asarray(ctx + sub_pos))[0]
    ref = jnp.concatenate([ref_dec.astype(jnp.float32), ref_chunk], axis=0)
    del kc, vc, qc

    def pick(out):  # the rows the reference covers
        out = np.asarray(out)
        return np.concatenate([out[:nd], out[nd + sub_pos]], axis=0)

    rows: list[dict[str, Any]] = []
    amount = {"flops": flops, "kv_bytes": kv_bytes}
    ours = jax.jit(jax_kvcm.ragged_paged_attention)
    r = row("mixed", shape, "ours", **amount)
    try:
        poison_allocator(q.shape, DTYPE)
        c = check(pick(ours(q, k_cache, v_cache, page_table, seq_lens, query_start)
                       .astype(jnp.float32)), ref)
        t = _timing.time_jax(ours, [(q2, k_cache, v_cache, page_table, seq_lens, query_start),
                                    (q, k_cache, v_cache, page_table, seq_lens, query_start)],
                             repeats=args.repeats)
        r.update(ms=t["ms"], timing=t, check=c["text"], rel_l2=c["rel_l2"])
        _log(f"  ours: {r['ms']:.4f} ms, check {r['check']}")
    except Exception as e:  # noqa: BLE001
        r["error"] = _err(e)
        _log(f"  ours: ERROR {_err(e)}")
    rows.append(r)
    if _torch() is not None:
        kt, vt, ptt = to_torch(k_cache), to_torch(v_cache), to_torch(page_table)
        qs = {True: to_torch(q), False: to_torch(q2)}
        specs = [(f"flashinfer-{backend}", (lambda be: lambda chk: _anchors.flashinfer_prefill(
            _torch(), qs[chk], kt, vt, ptt, lens, num_new, backend=be,
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


# ----------------------------------------------------------------------------------------------
# report


def _fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def finish_rows(rows: list[dict[str, Any]]) -> None:
    """Adds derived columns: bandwidth / FLOP rate, t_ours/t_x, fraction of the copy ceiling."""
    by_shape: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault((r["section"], r["shape"]), []).append(r)
    for group in by_shape.values():
        ours = next((r for r in group if r["method"] == "ours" and r["ms"]), None)
        ours8 = next((r for r in group if r["method"] == "ours fp8" and r["ms"]), None)
        copies = [r for r in group if r["method"].startswith("copy") and r["ms"]]
        copy = next((r for r in copies if r["method"] == "copy (torch)"), None) or next(
            iter(copies), None)  # the ceiling: torch's copy (do_bench), else JAX's
        for r in group:
            ms = r["ms"]
            if ms is None:
                continue
            if "kv_bytes" in r:
                r["kv_tbps"] = r["kv_bytes"] / (ms * 1e-3) / 1e12
                if r["method"].startswith("copy"):
                    r.setdefault("copy_rw_tbps", 2 * r["kv_bytes"] / (ms * 1e-3) / 1e12)
                elif copy is not None:
                    r["frac_of_copy_rw"] = r["kv_tbps"] / (2 * copy["kv_bytes"] / (copy["ms"] * 1e-3)
                                                           / 1e12)
            if "flops" in r:
                r["tflops"] = r["flops"] / (ms * 1e-3) / 1e12
            base = ours8 if r.get("fp8") and r["method"] != "ours fp8" else ours
            if base is not None:  # fp8 anchors against ours in fp8, the rest against ours
                r["ours_over_this"] = base["ms"] / ms


def ratio_summary(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """{(section, shape): {method: t_ours / t_method}} for shapes where ours ran."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        if r.get("ours_over_this") is not None and r["method"] != "ours":
            out.setdefault((r["section"], r["shape"]), {})[r["method"]] = r["ours_over_this"]
    return out


def print_tables(rows: list[dict[str, Any]]) -> None:
    dec = [r for r in rows if r["section"] == "decode"]
    pre = [r for r in rows if r["section"] == "prefill"]
    mixed = [r for r in rows if r["section"] == "mixed"]
    if dec:
        print("\n### Decode (H=32, Hkv=8, D=128, page 16, bf16, all rows at length S)\n")
        print("| shape | method | ms | KV TB/s = (K+V bytes read)/t | copy r+w TB/s = 2*bytes/t "
              "| % of copy r+w | t_ours/t_method | check (rel-L2 vs f32 ref) | note |")
        print("|---|---|---:|---:|---:|---:|---:|---|---|")
        for r in dec:
            frac = r.get("frac_of_copy_rw")
            print(f"| {r['shape']} | {r['method']} | {_fmt(r['ms'], 4)} | {_fmt(r.get('kv_tbps'))} "
                  f"| {_fmt(r.get('copy_rw_tbps'))} | {'-' if frac is None else f'{100 * frac:.0f}%'} "
                  f"| {_fmt(r.get('ours_over_this'), 2)} | {r['check'] or '-'} "
                  f"| {r['error'] or r['note']} |")
    if pre:
        print("\n### Ragged prefill (causal, all tokens new; H=32, Hkv=8, D=128, page 16, bf16)\n")
        print("TFLOP/s = 4 * B * S^2/2 * H * D / t  (QK^T and PV, causal half; same for every "
              "method)\n")
        print("| shape | method | ms | TFLOP/s | t_ours/t_method | check (rel-L2 vs f32 ref, "
              "sampled rows) | note |")
        print("|---|---|---:|---:|---:|---|---|")
        for r in pre:
            print(f"| {r['shape']} | {r['method']} | {_fmt(r['ms'], 4)} | {_fmt(r.get('tflops'), 1)} "
                  f"| {_fmt(r.get('ours_over_this'), 2)} | {r['check'] or '-'} "
                  f"| {r['error'] or r['note']} |")
    if mixed:
        print("\n### Mixed batch in one ragged call (decode rows + a prefill chunk; bf16)\n")
        print("| shape | method | ms | TFLOP/s | t_ours/t_method | check | note |")
        print("|---|---|---:|---:|---:|---|---|")
        for r in mixed:
            print(f"| {r['shape']} | {r['method']} | {_fmt(r['ms'], 4)} | "
                  f"{_fmt(r.get('tflops'), 1)} | {_fmt(r.get('ours_over_this'), 2)} | "
                  f"{r['check'] or '-'} | {r['error'] or r['note']} |")
    fp8 = [(r["shape"], r) for r in dec if r["method"] == "ours fp8" and r["ms"]]
    if fp8:
        print("\n### FP8 K/V decode: tokens x context / s, fp8 over bf16 (ours; target >= 1.8)\n")
        print("| shape | bf16 ms | fp8 ms | fp8 / bf16 |")
        print("|---|---:|---:|---:|")
        for shape, r8 in fp8:
            r16 = next((r for r in dec if r["shape"] == shape and r["method"] == "ours"
                        and r["ms"]), None)
            if r16 is not None:
                print(f"| {shape} | {r16['ms']:.4f} | {r8['ms']:.4f} | "
                      f"{r16['ms'] / r8['ms']:.2f} |")
    ratios = ratio_summary(rows)
    if ratios:
        cols = ["flashinfer-decode[tc]", "flashinfer-decode", "sglang-triton",
                "flashinfer-decode[tc] fp8", "flashinfer-fa3", "flashinfer-fa2", "torch-sdpa",
                "jax-gather", "pallas", "pallas[tuned]", "copy (torch)", "cudnn"]
        cols = [c for c in cols if any(c in v for v in ratios.values())]
        print("\n### Time ratios t_ours / t_method (< 1: ours faster)\n")
        print("| section | shape | " + " | ".join(f"ours/{c}" for c in cols) + " |")
        print("|---|---|" + "---:|" * len(cols))
        for (section, shape), v in ratios.items():
            print(f"| {section} | {shape} | " + " | ".join(_fmt(v.get(c), 2) for c in cols) + " |")
    print("\nt_ours/t_method < 1: ours is faster than that method. 'copy' KV TB/s is the bytes "
          "copied / t, i.e. the read-only rate a kernel would show if it took as long as the copy; "
          "'% of copy r+w' = the method's KV TB/s / the copy's read+write rate.", flush=True)


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(), "jax": jax.__version__,
        "backend": jax.default_backend(), "devices": [str(x) for x in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "jax_kvcm_cuda_extension": jax_kvcm.cuda_extension_available(),
    }
    torch = _torch()
    env["torch"] = (torch.__version__ if torch is not None
                    else _timing.import_torch(need_cuda=True)[1])
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"unavailable ({type(e).__name__})"
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write all results (with raw samples) here")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes; runs on CPU (Pallas in interpret mode, torch/cuDNN skipped)")
    p.add_argument("--only", choices=("decode", "prefill", "mixed"), default=None)
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
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 3)
        args.rounds = min(args.rounds, 1)

    t_start = time.perf_counter()
    anchor_env = _anchors.prepare(args.anchors)  # before torch / flashinfer are imported
    env = environment()
    env["anchors"] = anchor_env
    _log("environment:", json.dumps(env))
    if env["backend"] != "gpu" and not args.quick:
        _log("WARNING: no GPU backend; full shapes on CPU will be very slow (use --quick)")
    decode_shapes = QUICK_DECODE_SHAPES if args.quick else DECODE_SHAPES
    prefill_shapes = QUICK_PREFILL_SHAPES if args.quick else PREFILL_SHAPES

    rows: list[dict[str, Any]] = []
    for i, (b, s) in enumerate(decode_shapes if args.only in (None, "decode") else []):
        try:
            rows += bench_decode(b, s, args.seed + i, args)
        except Exception as e:  # noqa: BLE001 - e.g. OOM while building inputs
            rows.append(row("decode", f"B={b} S={s}", "(setup)", error=_err(e)))
            traceback.print_exc()
        free()
    for i, (b, s) in enumerate(prefill_shapes if args.only in (None, "prefill") else []):
        try:
            rows += bench_prefill(b, s, args.seed + 100 + i, args)
        except Exception as e:  # noqa: BLE001
            rows.append(row("prefill", f"B={b} S={s}", "(setup)", error=_err(e)))
            traceback.print_exc()
        free()

    if args.only in (None, "mixed"):
        try:
            rows += bench_mixed(QUICK_MIXED if args.quick else MIXED, args.seed + 200, args)
        except Exception as e:  # noqa: BLE001
            rows.append(row("mixed", "mixed", "(setup)", error=_err(e)))
            traceback.print_exc()
        free()

    finish_rows(rows)
    print_tables(rows)
    wall = time.perf_counter() - t_start
    _log(f"\ntotal wall time {wall:.1f}s")
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
        _log(f"wrote {args.json}")
    bad = [r for r in rows if r["method"] == "ours" and (r["error"] or
                                                         (r["check"] or "").startswith("FAIL"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
