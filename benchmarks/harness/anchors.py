"""The kernels to beat, driven from the attention benchmark in the same process: FlashInfer's paged
decode (tensor-core and CUDA-core) and paged prefill (FA2, FA3 backends), and SGLang's Triton
decode kernel. Each is optional: when its package is not importable the caller's rows say so.

Where they come from on a machine without network: install the wheels into a folder and name it
with ``--anchors DIR`` (it goes on ``sys.path``; SGLang's single ``decode_attention.py`` is looked
up in an installed ``sglang``, then as ``DIR/sglang*/decode_attention.py`` and
``.anchors/sglang*/decode_attention.py`` under the working directory). FlashInfer JIT-compiles
its kernels with nvcc on first use (about 1.5 minutes on 16 cores for all four); the settings the
H200 needs are applied by :func:`prepare` unless already set: ``FLASHINFER_CUDA_ARCH_LIST=9.0a``
(plain 9.0 builds FA3 without the Hopper instructions), ``CUDA_HOME`` from the nvcc found (or
``/usr/local/cuda``), workspace and cache folders under ``/tmp``, and the curand headers FA3
includes taken from torch's nvidia-curand wheel when the toolkit lacks them.

All wrappers take torch tensors that share memory with our JAX arrays (DLPack) and return a
zero-argument callable producing the output, for ``benchmarks.harness.timing.time_torch``.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import sys
import types
from typing import Any

from benchmarks.harness.timing import short_error


def prepare(anchor_dir: str | None) -> dict[str, Any]:
    """Puts ``anchor_dir`` on sys.path and sets FlashInfer's build environment (before import)."""
    info: dict[str, Any] = {"anchor_dir": anchor_dir}
    if anchor_dir and os.path.isdir(anchor_dir) and anchor_dir not in sys.path:
        sys.path.insert(0, anchor_dir)
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/kvcm_anchors_fi")
    os.environ.setdefault("TVM_FFI_CACHE_DIR", "/tmp/kvcm_anchors_tvmffi")
    os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/kvcm_anchors_triton")
    os.environ.setdefault("FLASHINFER_LOGGING_LEVEL", "warning")
    if "CUDA_HOME" not in os.environ:
        nvcc = shutil.which("nvcc")
        home = os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda"
        if os.path.isdir(home):
            os.environ["CUDA_HOME"] = home
    info["CUDA_HOME"] = os.environ.get("CUDA_HOME")
    home = os.environ.get("CUDA_HOME") or ""
    if home and not os.path.isfile(os.path.join(home, "include", "curand_kernel.h")):
        spec = importlib.util.find_spec("nvidia")
        for loc in (spec.submodule_search_locations or []) if spec else []:
            hits = sorted(glob.glob(os.path.join(loc, "*", "include", "curand_kernel.h")))
            if hits:
                inc = os.path.dirname(hits[-1])
                flags = os.environ.get("FLASHINFER_EXTRA_CUDAFLAGS", "")
                os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] = f"{flags} -I{inc}".strip()
                info["curand_headers"] = inc
                break
    return info


_cache: dict[str, Any] = {}


def flashinfer() -> tuple[Any, str | None]:
    """(module, None) or (None, why not)."""
    if "flashinfer" not in _cache:
        try:
            import flashinfer as fi
            _cache["flashinfer"] = (fi, None)
        except Exception as e:  # noqa: BLE001
            _cache["flashinfer"] = (None, f"not installed ({short_error(e)[:120]})")
    return _cache["flashinfer"]


def sglang_decode(anchor_dir: str | None) -> tuple[Any, str | None]:
    """SGLang's Triton decode module (``decode_attention_fwd``), or (None, why not).

    The file imports only triton, logging and ``sglang.srt.utils.is_hip``: it is loaded by path
    with that one function stubbed when sglang itself is not installed."""
    if "sglang" in _cache:
        return _cache["sglang"]
    try:
        from sglang.srt.layers.attention.triton_ops import decode_attention as mod  # type: ignore
        _cache["sglang"] = (mod, None)
        return _cache["sglang"]
    except Exception:  # noqa: BLE001 - try the single file
        pass
    folders = [d for d in (anchor_dir, ".anchors") if d]
    cands = [c for d in folders
             for c in sorted(glob.glob(os.path.join(d, "sglang*", "decode_attention.py")))]
    if not cands:
        where = " or ".join(f"{d}/sglang*/decode_attention.py" for d in folders)
        _cache["sglang"] = (None, f"not installed (no sglang, no {where})")
        return _cache["sglang"]
    try:
        for name in ("sglang", "sglang.srt"):
            if name not in sys.modules:
                m = types.ModuleType(name)
                m.__path__ = []
                sys.modules[name] = m
        if "sglang.srt.utils" not in sys.modules:
            u = types.ModuleType("sglang.srt.utils")
            u.is_hip = lambda: False
            sys.modules["sglang.srt.utils"] = u
        spec = importlib.util.spec_from_file_location("kvcm_anchor_sglang_decode", cands[0])
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # triton.jit needs a real file (inspect.getsource)
        _cache["sglang"] = (mod, None)
    except Exception as e:  # noqa: BLE001
        _cache["sglang"] = (None, f"failed to load {cands[0]}: {short_error(e)[:150]}")
    return _cache["sglang"]


def _workspace(torch: Any) -> Any:
    if "ws" not in _cache:
        _cache["ws"] = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    return _cache["ws"]


def paged_indices(torch: Any, page_table: Any, seq_lens: list[int], page: int) -> dict[str, Any]:
    """FlashInfer's CSR page lists from a dense page table (torch int32 [B, P])."""
    counts = [-(-n // page) for n in seq_lens]
    indptr = torch.tensor([0] + list(_cumsum(counts)), dtype=torch.int32, device="cuda")
    rows = [page_table[b, :c] for b, c in enumerate(counts)]
    indices = torch.cat(rows).contiguous().to(torch.int32)
    last = torch.tensor([n - (c - 1) * page if c else 0 for n, c in zip(seq_lens, counts)],
                        dtype=torch.int32, device="cuda")
    return {"indptr": indptr, "indices": indices, "last_page_len": last}


def _cumsum(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out


def flashinfer_decode(torch: Any, q: Any, k_cache: Any, v_cache: Any, page_table: Any,
                      seq_lens: list[int], *, tensor_cores: bool, sm_scale: float,
                      kv_scale: float | None = None) -> Any:
    """BatchDecodeWithPagedKVCacheWrapper over our caches ([pages, page, Hkv, D] = its NHD).
    ``kv_scale``: fp8 caches with one scale for K and V (FlashInfer takes per-tensor scales)."""
    fi, why = flashinfer()
    if fi is None:
        raise RuntimeError(why)
    _, page, hkv, d = k_cache.shape
    idx = paged_indices(torch, page_table, seq_lens, page)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(torch), "NHD",
                                              use_tensor_cores=tensor_cores)
    w.plan(idx["indptr"], idx["indices"], idx["last_page_len"], q.shape[1], hkv, d, page,
           q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=sm_scale)
    out = torch.empty_like(q)
    kw = {} if kv_scale is None else {"k_scale": kv_scale, "v_scale": kv_scale}
    return lambda: w.run(q, (k_cache, v_cache), out=out, **kw)


def flashinfer_prefill(torch: Any, q: Any, k_cache: Any, v_cache: Any, page_table: Any,
                       seq_lens: list[int], num_new: list[int], *, backend: str,
                       sm_scale: float) -> Any:
    """BatchPrefillWithPagedKVCacheWrapper(backend="fa2" | "fa3"), causal: each sequence's queries
    are its last ``num_new`` tokens (FlashInfer aligns the causal mask to the end, as ours)."""
    fi, why = flashinfer()
    if fi is None:
        raise RuntimeError(why)
    _, page, hkv, d = k_cache.shape
    idx = paged_indices(torch, page_table, seq_lens, page)
    qo_indptr = torch.tensor([0] + _cumsum(num_new), dtype=torch.int32, device="cuda")
    w = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(torch), "NHD", backend=backend)
    w.plan(qo_indptr, idx["indptr"], idx["indices"], idx["last_page_len"], q.shape[1], hkv, d,
           page, causal=True, q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=sm_scale)
    out = torch.empty_like(q)
    return lambda: w.run(q, (k_cache, v_cache), out=out)


SGL_MAX_KV_SPLITS = 8  # SGLang's default triton_attention_num_kv_splits on CUDA


def _sglang_num_kv_splits(seq_lens: list[int], num_sms: int, num_heads: int,
                          group: int) -> list[int]:
    """SGLang's host rule for the per-row split count (its triton backend), for GQA."""
    mx, mn = max(seq_lens), min(seq_lens)
    if mx * 8 < mn * 10:
        mn = mx
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    s1 = min(cdiv(mx, mn), SGL_MAX_KV_SPLITS)
    chunk1 = cdiv(mx, s1)
    import math
    ext_core = int(num_sms * max(math.log2(mx / 64.0), 1.0))
    token_grid = len(seq_lens) * cdiv(num_heads, min(16, group))
    s2 = min(cdiv(ext_core, token_grid), SGL_MAX_KV_SPLITS)
    chunk2 = cdiv(mx, s2)
    return [max(cdiv(n, chunk1), cdiv(n, chunk2)) for n in seq_lens]


def sglang_triton_decode(torch: Any, q: Any, k_cache: Any, v_cache: Any, page_table: Any,
                         seq_lens: list[int], *, sm_scale: float, anchor_dir: str | None) -> Any:
    """SGLang's decode_attention_fwd: it takes per-token slot ids (int64), so pages are expanded
    to token ids first (outside the timed call)."""
    mod, why = sglang_decode(anchor_dir)
    if mod is None:
        raise RuntimeError(why)
    b, h, d = q.shape
    _, page, hkv, _ = k_cache.shape
    tok = [(page_table[i, :-(-n // page)].long()[:, None] * page
            + torch.arange(page, device="cuda")[None, :]).reshape(-1)[:n]
           for i, n in enumerate(seq_lens)]
    kv_indices = torch.cat(tok).contiguous()
    kv_indptr = torch.tensor([0] + _cumsum(seq_lens), dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = torch.tensor(_sglang_num_kv_splits(seq_lens, sms, h, h // hkv), dtype=torch.int32,
                          device="cuda")
    logits = torch.empty(b, h, SGL_MAX_KV_SPLITS, d, dtype=torch.float32, device="cuda")
    lse = torch.empty(b, h, SGL_MAX_KV_SPLITS, dtype=torch.float32, device="cuda")
    out = torch.empty_like(q)
    kbuf, vbuf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)

    def fn():
        mod.decode_attention_fwd(q, kbuf, vbuf, out, kv_indptr, kv_indices, logits, lse, splits,
                                 SGL_MAX_KV_SPLITS, sm_scale, 1.0, 1.0)
        return out
    return fn


def warm(anchor_dir: str | None, what: tuple[str, ...] = ("decode", "prefill")) -> None:
    """Builds FlashInfer's JIT modules that benchmarks/attention.py uses (bf16, head dim 128: the
    tensor-core and CUDA-core decode, the tc decode over fp8, the FA3 and FA2 paged prefill) by
    running each once on a tiny cache, printing what it built and how long it took. Their cache
    (FLASHINFER_WORKSPACE_BASE) is what the benchmark finds later, so a GPU job can run this in
    the background while it builds and tests its own code (~80 s of nvcc for decode, ~110 s
    for prefill on 16 cores)."""
    import time

    t0 = time.time()
    prepare(anchor_dir)
    import torch

    page, hkv, d, h, lens = 16, 8, 128, 32, [200, 100]
    kc = torch.randn(64, page, hkv, d, device="cuda").to(torch.bfloat16)
    vc = torch.randn(64, page, hkv, d, device="cuda").to(torch.bfloat16)
    pt = torch.arange(1, 33, dtype=torch.int32, device="cuda").reshape(2, 16)
    runs = []
    if "prefill" in what:
        q = torch.randn(sum(lens), h, d, device="cuda").to(torch.bfloat16)
        runs += [(f"prefill {be}", lambda be=be: flashinfer_prefill(
            torch, q, kc, vc, pt, lens, lens, backend=be, sm_scale=d ** -0.5))
            for be in ("fa3", "fa2")]
    if "decode" in what:
        q1 = torch.randn(len(lens), h, d, device="cuda").to(torch.bfloat16)
        k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        runs += [(f"decode{' tc' if tc else ''}", lambda tc=tc: flashinfer_decode(
            torch, q1, kc, vc, pt, lens, tensor_cores=tc, sm_scale=d ** -0.5))
            for tc in (True, False)]
        runs.append(("decode tc fp8", lambda: flashinfer_decode(
            torch, q1, k8, v8, pt, lens, tensor_cores=True, sm_scale=d ** -0.5, kv_scale=1.0)))
    for name, make in runs:
        t = time.time()
        try:
            make()()
            torch.cuda.synchronize()
            print(f"{name}: built in {time.time() - t:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - the benchmark reports the same failure
            print(f"{name}: failed ({short_error(e)[:150]})", flush=True)
    print(f"warm total {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Warm FlashInfer's JIT cache for attention.py")
    parser.add_argument("--anchors", default=None, help="the anchors' install folder")
    # Checked by hand: argparse refuses an empty nargs="*" list against choices (3.11) and a
    # list default (3.12), so neither form of "no argument" works with choices=.
    parser.add_argument("what", nargs="*", help="decode, prefill or both (default: both)")
    args = parser.parse_args()
    unknown = set(args.what) - {"decode", "prefill"}
    if unknown:
        parser.error(f"what: unknown {sorted(unknown)} (choose from decode, prefill)")
    warm(args.anchors, tuple(args.what or ("decode", "prefill")))
