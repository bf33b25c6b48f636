"""The attention benchmark's inputs and checks, shared with the kernel lab (tools/): shapes,
the float32 references (gathered decode, dense causal prefill), the fp8 copy of a cache, the
check of an output against its reference, a result row, and timing several methods in turns."""

from __future__ import annotations

import gc
import math
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import timing as _timing
from benchmarks.harness.timing import short_error
from jax_kvcm.ops import reference

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DTYPE = jnp.bfloat16
TOL = 2e-2  # rel-L2 tolerance for bf16 outputs vs the float32 reference

DECODE_SHAPES = [(64, 4096), (256, 1024), (8, 32768), (1, 131072), (256, 256)]
PREFILL_SHAPES = [(8, 2048), (1, 16384)]
QUICK_DECODE_SHAPES = [(2, 256), (3, 512)]
QUICK_PREFILL_SHAPES = [(2, 64), (1, 128)]
MIXED = {"decode_rows": 256, "decode_len": 1024, "chunk": 2048, "chunk_context": 2048}
QUICK_MIXED = {"decode_rows": 4, "decode_len": 40, "chunk": 48, "chunk_context": 16}




def log(*a: Any) -> None:
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
    t = cuda_torch()
    if t is not None:
        t.cuda.empty_cache()


def cuda_torch() -> Any:
    """torch with a CUDA device, or None (``_timing.import_torch`` says why)."""
    return _timing.import_torch(need_cuda=True)[0]


def to_torch(x: jax.Array) -> Any:
    torch = cuda_torch()
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
    torch = cuda_torch()
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
                log(f"  {method}: check {r['check']}")
            else:
                time_in_turns([(r, timers)], 1)
                log(f"  {method}: {r['ms']:.4f} ms, check {r['check']} {r['note']}")
        except Exception as e:  # noqa: BLE001
            msg = short_error(e)
            r["error"] = msg if "not installed" not in msg else msg.split(": ", 1)[-1]
            log(f"  {method}: {r['error']}")
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
                    r["error"] = short_error(e)
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


