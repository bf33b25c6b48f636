"""The attention benchmark's other decode methods: JAX's Pallas paged attention (Triton) and
torch SDPA on a dense cache (the cost of no paging), plus the copy kernels that give the DRAM
bandwidth ceiling. Each row is checked against the float32 reference before it is timed."""

from __future__ import annotations

import math
import traceback
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.harness import timing as _timing
from benchmarks.harness.attention_cases import DTYPE, check, free, log, row, to_torch
from benchmarks.harness.timing import short_error

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
        log(f"  pallas: {r['ms']:.4f} ms, check {r['check']}")

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
                    sweep[name] = {"error": short_error(e)}
            r["sweep"] = sweep
            log(f"  pallas sweep: {sweep}")
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
        r["error"] = short_error(e)
        if r not in rows:
            rows.append(r)
        log(f"  pallas: ERROR {short_error(e)}")
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
                    backends[name] = f"refused ({short_error(e)[:80]})"
        except Exception as e:  # noqa: BLE001
            backends["error"] = short_error(e)
        r["backends_ms"] = backends
        timed = {k: v for k, v in backends.items() if isinstance(v, float)}
        if timed:
            r["note"] = "default backend; " + ", ".join(
                f"{k.split('_')[0].lower()} {v:.3f}" if isinstance(v, float) else
                f"{k.split('_')[0].lower()} refused" for k, v in backends.items())
        rows.append(r)
        log(f"  torch-sdpa: {r['ms']:.4f} ms, check {r['check']}, backends {backends}")
        if timed:
            best = min(timed, key=timed.get)
            if timed[best] < 0.95 * r["ms"]:
                rows.append(row("decode", shape, f"torch-sdpa[{best.split('_')[0].lower()}]",
                                kv_bytes=kv_bytes, ms=timed[best], check=r["check"],
                                note="fastest forced backend (same output check as default)"))
        del k_t, v_t, qc_t, qt_t, out
    except Exception as e:  # noqa: BLE001
        r["error"] = short_error(e)
        rows.append(r)
        log(f"  torch-sdpa: ERROR {short_error(e)}")
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
        log(f"  copy (torch): {r['ms']:.4f} ms")
    except Exception as e:  # noqa: BLE001
        r["error"] = short_error(e)
        log(f"  copy (torch): ERROR {short_error(e)}")
    rows.append(r)
    free()
    return rows


