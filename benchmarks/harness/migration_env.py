"""The migration benchmark's shape, result rows, machine facts and baselines: the contiguous
pinned copy (the ceiling) and the per-piece copy loop (what a Python mover would do), both with
torch on the GPU."""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcm
from benchmarks.harness import timing as _timing
from benchmarks.harness.timing import short_error
from jax_kvcm import CacheLevel
from jax_kvcm._codec import int8_cold_page_layout
from jax_kvcm._storage import LayerGroupSpec

DEV, HOST, DISK = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.DISK
LG = 0  # the one layer group
GB = 1e9
GiB = 1 << 30
IO_CHUNK = 1 << 30  # plain disk I/O: bytes per pwrite/preadv call (Linux caps one call at 2 GiB)

TARGET_CONCAT_VS_CONTIG = 0.8
TARGET_INT8_VS_CONCAT = 1.5
TARGET_DISK_VS_PLAIN = 0.8


@dataclass(frozen=True)
class Shape:
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    pages: int  # pages moved per migration
    hot_slots: int  # usable hot slots (random sets are drawn from these)
    contig_bytes: int  # the contiguous baseline's copy size

    @property
    def piece_bytes(self) -> int:
        return self.page_size * self.num_kv_heads * self.head_dim * 2  # bf16

    @property
    def hot_page_bytes(self) -> int:
        return 2 * self.num_layers * self.piece_bytes

    @property
    def spec(self) -> LayerGroupSpec:
        return LayerGroupSpec(self.num_layers, self.page_size, self.num_kv_heads, self.head_dim,
                              jnp.bfloat16)

    def int8_page_bytes(self) -> int:
        return int8_cold_page_layout(self.num_layers, self.page_size, self.num_kv_heads,
                                     self.head_dim)[2]

    def describe(self) -> str:
        return (f"{self.num_layers} layers x {{K,V}}, {self.page_size} tokens/page, "
                f"{self.num_kv_heads} kv heads, head dim {self.head_dim}, bf16: "
                f"{2 * self.num_layers} pieces of {self.piece_bytes >> 10} KiB = "
                f"{self.hot_page_bytes / 2**20:.3g} MiB/page; {self.pages} random pages of "
                f"{self.hot_slots} hot slots = {self.pages * self.hot_page_bytes / GiB:.3g} GiB")


FULL = Shape(32, 16, 8, 128, pages=4096, hot_slots=8192, contig_bytes=GiB)
QUICK = Shape(4, 16, 2, 64, pages=64, hot_slots=128, contig_bytes=16 << 20)


# ----------------------------------------------------------------------------------------------
# small utilities





def log(*a: Any) -> None:
    print(*a, flush=True)


def row(section: str, method: str, direction: str, **kw: Any) -> dict[str, Any]:
    r = {"section": section, "method": method, "direction": direction, "bytes": None,
         "cold_bytes": None, "samples_s": [], "median_s": None, "submit_median_s": None,
         "gbps": None, "cold_gbps": None, "note": "", "error": None}
    r.update(kw)
    return r


def finish(r: dict[str, Any]) -> dict[str, Any]:
    """Medians and rates from the samples."""
    if r["samples_s"]:
        r["median_s"] = statistics.median(r["samples_s"])
        if r["bytes"]:
            r["gbps"] = r["bytes"] / r["median_s"] / GB
        if r["cold_bytes"]:
            r["cold_gbps"] = r["cold_bytes"] / r["median_s"] / GB
    if r.get("submit_samples_s"):
        r["submit_median_s"] = statistics.median(r["submit_samples_s"])
    if r.get("fsync_samples_s"):
        # write (or read) time + the fsync that follows it, per repetition
        tot = [a + b for a, b in zip(r["samples_s"], r["fsync_samples_s"])]
        r["with_fsync_gbps"] = r["bytes"] / statistics.median(tot) / GB
    return r


def log_row(r: dict[str, Any]) -> None:
    if r["error"]:
        log(f"  {r['method']} {r['direction']}: ERROR {r['error']}")
        return
    extra = f", cold {r['cold_gbps']:.2f} GB/s" if r.get("cold_gbps") else ""
    sub = (f", submit {r['submit_median_s'] * 1e3:.1f} ms" if r.get("submit_median_s") is not None
           else "")
    fs = f", +fsync {r['with_fsync_gbps']:.2f} GB/s" if r.get("with_fsync_gbps") else ""
    log(f"  {r['method']} {r['direction']}: {r['median_s'] * 1e3:.2f} ms = {r['gbps']:.2f} GB/s"
         f"{extra}{sub}{fs} (samples ms: {[round(s * 1e3, 2) for s in r['samples_s']]})")


def _torch() -> Any:
    """torch, or None (``_timing.import_torch`` says why)."""
    return _timing.import_torch()[0]


def torch_device(torch: Any) -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_unusable(torch: Any) -> str | None:
    """Why the torch baselines cannot run here (None when they can). A CPU stand-in is only used
    when JAX has no GPU either (the --quick smoke test): never as a GPU baseline."""
    if torch is None:
        return f"skipped: {_timing.import_torch()[1]}"
    if jax.default_backend() == "gpu" and not torch.cuda.is_available():
        return f"skipped: torch {torch.__version__} sees no CUDA device"
    return None


def torch_sync(torch: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    torch = sys.modules.get("torch")  # only if a baseline imported it
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)  # cached pinned host blocks
        if host_empty is not None:
            try:
                host_empty()
            except Exception:  # noqa: BLE001
                pass


def meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable", "Dirty"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def fs_type(path: str) -> str:
    """File system type of ``path`` (longest matching mount point in /proc/mounts)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def pick_disk_dir(requested: str | None) -> str:
    """A fresh directory for the disk files: under ``requested``, else the first of the temp dir,
    /var/tmp, the current directory that is not a RAM file system."""
    if requested:
        return tempfile.mkdtemp(prefix="jax_kvcm_migration_", dir=requested)
    for cand in (tempfile.gettempdir(), "/var/tmp", os.getcwd()):
        if os.path.isdir(cand) and os.access(cand, os.W_OK) and fs_type(cand) not in (
                "tmpfs", "ramfs"):
            return tempfile.mkdtemp(prefix="jax_kvcm_migration_", dir=cand)
    return tempfile.mkdtemp(prefix="jax_kvcm_migration_")


def driver_info() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            info["cuda_driver_api_version"] = v.value  # e.g. 13000; cuMemcpyBatchAsync >= 12080
    except OSError as e:
        info["cuda_driver_api_version"] = f"unavailable ({e})"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.current,"
                              "pcie.link.width.current", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        if out.returncode == 0:
            info["nvidia_smi"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def environment(disk_dir: str | None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(), "jax": jax.__version__,
        "backend": jax.default_backend(), "devices": [str(x) for x in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "jax_kvcm_cuda_extension": jax_kvcm.cuda_extension_available(),
        "host": platform.node(), "cpu_count": os.cpu_count(),
    }
    try:
        import jaxlib
        env["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f
                               if ln.startswith("model name")), platform.processor())
    except OSError:
        env["cpu"] = platform.processor()
    mi = meminfo()
    env["mem_total_gib"] = round(mi.get("MemTotal", 0) / GiB, 1)
    env["mem_available_gib"] = round(mi.get("MemAvailable", 0) / GiB, 1)
    torch = _torch()
    if torch is None:
        env["torch"] = _timing.import_torch()[1]
    else:
        env["torch"] = torch.__version__
        env["torch_cuda"] = getattr(torch.version, "cuda", None)
        if torch.cuda.is_available():
            env["torch_device"] = torch.cuda.get_device_name(0)
            get_driver = getattr(torch._C, "_cuda_getDriverVersion", None)
            if get_driver is not None:
                try:
                    env["torch_cuda_driver_version"] = int(get_driver())
                except Exception:  # noqa: BLE001
                    pass
    if env["backend"] == "gpu":
        env.update(driver_info())
    if disk_dir:
        env["disk_dir"] = disk_dir
        env["disk_fs"] = fs_type(disk_dir)
        env["disk_free_gib"] = round(shutil.disk_usage(disk_dir).free / GiB, 1)
    return env


# ----------------------------------------------------------------------------------------------
# contiguous pinned copies and the per-piece torch loop


def bench_contiguous(shape: Shape, repeats: int, tag: str) -> list[dict[str, Any]]:
    torch = _torch()
    name = f"contiguous {shape.contig_bytes / GiB:.3g} GiB pinned (torch copy_) [{tag}]"
    why = torch_unusable(torch)
    if why:
        log(f"  contiguous: {why}")
        return [row("hot<->host", name, d, error=why) for d in ("hot->host", "host->hot")]
    dev = torch_device(torch)
    note = "" if dev == "cuda" else "CPU stand-in (no CUDA): memcpy between two host tensors"
    rows = []
    try:
        n = shape.contig_bytes
        host = torch.empty(n, dtype=torch.uint8, pin_memory=dev == "cuda")
        host.fill_(1)
        gpu = torch.empty(n, dtype=torch.uint8, device=dev)
        gpu.fill_(2)
        torch_sync(torch)
        for direction, dst, src in (("hot->host", host, gpu), ("host->hot", gpu, host)):
            r = row("hot<->host", name, direction, bytes=n, note=note)
            for i in range(2 + repeats):
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch_sync(torch)
                if i >= 2:
                    r["samples_s"].append(time.perf_counter() - t0)
            rows.append(finish(r))
            log_row(r)
        del host, gpu
    except Exception as e:  # noqa: BLE001
        rows.append(row("hot<->host", name, "both", error=short_error(e)))
        log(f"  contiguous: ERROR {short_error(e)}")
    free_memory()
    return rows


def bench_piece_loop(shape: Shape, repeats: int, seed: int) -> tuple[list[dict[str, Any]],
                                                                     dict[str, Any]]:
    """One copy_ (one cudaMemcpyAsync) per 32 KiB piece, for each page and each of the 2L pools."""
    torch = _torch()
    name = "per-piece loop (torch copy_, 1 cudaMemcpyAsync per piece)"
    check: dict[str, Any] = {"ok": None}
    why = torch_unusable(torch)
    if why:
        log(f"  per-piece loop: {why}")
        return [row("hot<->host", name, d, error=why) for d in ("hot->host", "host->hot")], check
    dev = torch_device(torch)
    note = "issued from Python" if dev == "cuda" else "CPU stand-in (no CUDA)"
    L, n = shape.num_layers, shape.pages
    elems = shape.piece_bytes // 2
    rows = []
    try:
        gen = torch.Generator(device=dev).manual_seed(seed)
        k = torch.empty((L, shape.hot_slots + 1, elems), dtype=torch.bfloat16, device=dev)
        v = torch.empty_like(k)
        k.normal_(generator=gen)
        v.normal_(generator=gen)
        host = torch.empty((n, 2 * L, elems), dtype=torch.bfloat16, pin_memory=dev == "cuda")
        host.zero_()
        torch_sync(torch)
        rng = np.random.default_rng(seed)
        d2h = row("hot<->host", name, "hot->host", bytes=n * shape.hot_page_bytes, note=note)
        h2d = row("hot<->host", name, "host->hot", bytes=n * shape.hot_page_bytes, note=note)
        for rep in range(1 + repeats):  # the first repetition warms up (and is checked)
            slots = rng.choice(np.arange(1, shape.hot_slots + 1), n, replace=False).tolist()
            t0 = time.perf_counter()
            for i, s in enumerate(slots):
                kp, vp, hp = k.select(1, s).unbind(0), v.select(1, s).unbind(0), host[i].unbind(0)
                for layer in range(L):
                    hp[2 * layer].copy_(kp[layer], non_blocking=True)
                    hp[2 * layer + 1].copy_(vp[layer], non_blocking=True)
            torch_sync(torch)
            t1 = time.perf_counter()
            if rep == 0:
                sample = rng.choice(n, min(n, 16), replace=False)
                idx = torch.as_tensor(np.asarray(slots)[sample], device=dev)
                want = torch.stack([k[:, idx], v[:, idx]], dim=2).cpu()  # [L, s, 2, E]
                got = host[torch.as_tensor(sample)].cpu().reshape(len(sample), L, 2, elems)
                ok_d2h = torch.equal(want.permute(1, 0, 2, 3).reshape(got.shape).view(
                    torch.int16), got.view(torch.int16))
            # host -> hot: into another random set of hot slots
            slots2 = rng.choice(np.arange(1, shape.hot_slots + 1), n, replace=False).tolist()
            t2 = time.perf_counter()
            for i, s in enumerate(slots2):
                kp, vp, hp = k.select(1, s).unbind(0), v.select(1, s).unbind(0), host[i].unbind(0)
                for layer in range(L):
                    kp[layer].copy_(hp[2 * layer], non_blocking=True)
                    vp[layer].copy_(hp[2 * layer + 1], non_blocking=True)
            torch_sync(torch)
            t3 = time.perf_counter()
            if rep == 0:
                idx = torch.as_tensor(np.asarray(slots2)[sample], device=dev)
                back = torch.stack([k[:, idx], v[:, idx]], dim=2).cpu()
                ok_h2d = torch.equal(back.view(torch.int16), want.view(torch.int16))
                check = {"ok": bool(ok_d2h and ok_h2d), "pages_checked": int(len(sample)),
                         "hot->host": bool(ok_d2h), "host->hot": bool(ok_h2d)}
                log(f"  per-piece loop check: {check}")
            else:
                d2h["samples_s"].append(t1 - t0)
                h2d["samples_s"].append(t3 - t2)
        for r in (d2h, h2d):
            r["note"] = (r["note"] + f"; {n * 2 * L} copies; check "
                         f"{'ok' if check['ok'] else 'FAIL'}").strip("; ")
            rows.append(finish(r))
            log_row(r)
        del k, v, host
    except Exception as e:  # noqa: BLE001
        rows.append(row("hot<->host", name, "both", error=short_error(e)))
        log(f"  per-piece loop: ERROR {short_error(e)}")
        traceback.print_exc()
    free_memory()
    return rows, check


