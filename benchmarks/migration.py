#!/usr/bin/env python
"""Cold-tier migration benchmark (issue 3): StorageManager.migrate vs plain copies, one run, ratios.

Run on the GPU machine (after `pip install .` of jax_kvcm with its CUDA extension), from anywhere
except a directory that shadows the installed package with an unbuilt `jax_kvcm/`:

    python benchmarks/migration.py [--json results.json]
    JAX_PLATFORMS=cpu python benchmarks/migration.py --quick        # CPU smoke test, tiny shapes
    JAX_PLATFORMS=cpu python benchmarks/migration.py --disk-only --pages 1024   # host<->disk only

Workload: one Llama-3-8B-shaped hot pool group (32 layers x {K, V}, 16 tokens per page, 8 kv heads,
head dim 128, bf16): a hot page is 64 pieces of 32 KiB, a concatenated cold page 2 MiB. The hot
pools have 2 * 4096 usable slots, all allocated and filled with N(0, 1) values; every repetition
moves a fresh random (non-contiguous) set of 4096 of them (8 GiB) and back, so page sets rotate.

hot <-> host (GB/s = 1e9 bytes per second of *uncompressed* hot bytes; int8 also in cold bytes):
  contiguous       torch: one 1 GiB copy_ between a CUDA tensor and a pinned CPU tensor (the
                   ceiling; measured at the start and at the end of the run, ratios use the
                   median of both sets of samples)
  concat           StorageManager.migrate with ConcatCodec(copy="auto"): its default CUDA mover
                   for a mapped pinned tier, one copy-kernel launch per codec call (CTA per
                   32 KiB piece)
  concat[memcpy-batch] a manager of its own with ConcatCodec(copy="memcpy", memcpy_batch=True):
                   one cuMemcpyBatchAsync per codec call (4096 pages = one call, 262144
                   descriptors of 32 KiB)
  concat[no-batch] a manager of its own with ConcatCodec(copy="memcpy", memcpy_batch=False):
                   the fallback before CUDA 12.8, one cudaMemcpyAsync per 32 KiB piece issued
                   from C++
                   (every codec is built with explicit options: the JAX_KVCM_CONCAT_COPY /
                   JAX_KVCM_NO_MEMCPY_BATCH environment defaults do not reach any row)
  int8             StorageManager.migrate with Int8Codec (CUDA kernels reading/writing the mapped
                   pinned host tier directly; cold page 1026 KiB)
  per-piece loop   torch: for each page and each of the 64 pools, dst[...].copy_(src[...],
                   non_blocking=True) between a CUDA tensor and a pinned CPU tensor (one
                   cudaMemcpyAsync per piece, issued from Python)
  Each migration is timed end to end: the migrate() call plus waiting for its completion (the
  host-slot fences of an encode, the donated hot pools of a decode); "submit ms" is the migrate()
  call alone (Python bookkeeping + dispatch). Median of --repeats samples after one warm-up.

host <-> disk (concat pages; GB/s of bytes moved):
  manager          StorageManager.migrate HOST->DISK and DISK->HOST: pwrite/pread of the slot runs
                   in pieces of at most 4 MiB plus a CRC32C per page (computed on write, verified
                   on read), spread over the disk tier's native I/O threads (min(8, cores))
  plain            os.pwrite / os.preadv of the same number of bytes, 1 GiB per call, to a
                   preallocated file in the same directory, from / into host memory
  NOTE: neither side calls fsync (the manager never does), so writes measure the copy into the
  page cache; between timed steps both files are fsync'ed outside the timed region (reported as
  "+fsync" GB/s, for information) so each write starts with no dirty pages of its own. Reads are
  served by the page cache for both (the caches are NOT dropped: shared host), unless
  --disk-uncached-reads asks for posix_fadvise(DONTNEED) on our own two files before each read.
  One untimed warm-up repetition of both sides, then --disk-repeats timed ones (medians), the
  order of the two sides alternating; no new repetition starts after --disk-budget-s seconds.
  --disk-only runs this part alone (full-size pages, hot tier of --pages slots, no torch, no
  hot<->host timing): it needs no GPU, so the disk tier can be measured on any machine.
  Both sides move the host tier's bytes: the manager from its slots, the plain write from the
  same pinned memory, the plain read into a separate pre-faulted buffer.

Verified before timing: the concat round trip is byte-exact (cold bytes equal the documented
layout; hot pages equal the originals after host->hot) on a sample of pages; int8 stays within
Int8Codec's stated per-element bound and decodes exactly as its layout says; the disk round trip is
byte-exact; the per-piece loop copies the right bytes.

Targets (issue 3): concat >= 0.8 x contiguous both ways; int8 >= 1.5 x concat in uncompressed
bytes/s; manager host<->disk >= 0.8 x plain, both ways.
"""

from __future__ import annotations

import os

# JAX must not grab 75% of the GPU up front: torch shares the device in this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

try:
    from benchmarks import _timing  # python -m benchmarks.migration
except ImportError:
    import _timing  # python benchmarks/migration.py (the script's directory is on sys.path)

import jax_kvcm  # noqa: E402
from jax_kvcm._codec import ConcatCodec, Int8Codec, int8_cold_page_layout  # noqa: E402
from jax_kvcm._storage import LayerGroupSpec, StorageConfig, StorageManager  # noqa: E402
from jax_kvcm._types import CacheLevel  # noqa: E402

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


_err = _timing.short_error


def _log(*a: Any) -> None:
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
        _log(f"  {r['method']} {r['direction']}: ERROR {r['error']}")
        return
    extra = f", cold {r['cold_gbps']:.2f} GB/s" if r.get("cold_gbps") else ""
    sub = (f", submit {r['submit_median_s'] * 1e3:.1f} ms" if r.get("submit_median_s") is not None
           else "")
    fs = f", +fsync {r['with_fsync_gbps']:.2f} GB/s" if r.get("with_fsync_gbps") else ""
    _log(f"  {r['method']} {r['direction']}: {r['median_s'] * 1e3:.2f} ms = {r['gbps']:.2f} GB/s"
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
        _log(f"  contiguous: {why}")
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
        rows.append(row("hot<->host", name, "both", error=_err(e)))
        _log(f"  contiguous: ERROR {_err(e)}")
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
        _log(f"  per-piece loop: {why}")
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
                _log(f"  per-piece loop check: {check}")
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
        rows.append(row("hot<->host", name, "both", error=_err(e)))
        _log(f"  per-piece loop: ERROR {_err(e)}")
        traceback.print_exc()
    free_memory()
    return rows, check


# ----------------------------------------------------------------------------------------------
# the storage manager


def build_manager(shape: Shape, codec: Any, host_pages: int, disk_dir: str | None,
                  disk_pages: int, seed: int) -> tuple[StorageManager, np.ndarray]:
    """A manager with one hot pool group of ``shape.hot_slots`` usable slots, all allocated and
    filled with N(0, 1) values; returns it and the allocated hot slots."""
    cold = codec.__class__  # codec is consumed by the manager; remember its page size here
    page = shape.hot_page_bytes if cold is ConcatCodec else shape.int8_page_bytes()
    config = StorageConfig(layer_groups=(shape.spec,), device_slots=(shape.hot_slots,),
                           host_bytes=host_pages * page,
                           disk_dir=disk_dir if disk_pages else None,
                           disk_bytes=disk_pages * page)
    sm = StorageManager(config, codec)
    slots = sm.allocate(DEV, LG, shape.hot_slots)
    if slots is None:
        sm.close()
        raise RuntimeError("could not allocate the hot slots")

    def fill_layer(pool, key, layer):  # one layer at a time: small temporaries, in place
        x = jax.random.normal(key, pool.shape[1:], jnp.float32).astype(pool.dtype)
        return jax.lax.dynamic_update_index_in_dim(pool, x, layer, 0)

    try:
        fill = jax.jit(fill_layer, donate_argnums=0)
        keys = jax.random.split(jax.random.key(seed), 2 * shape.num_layers)
        k, v = sm.pools[0]
        for layer in range(shape.num_layers):
            k = fill(k, keys[2 * layer], jnp.int32(layer))
            v = fill(v, keys[2 * layer + 1], jnp.int32(layer))
        sm.pools[0] = jax.block_until_ready((k, v))
    except BaseException:
        sm.close()
        raise
    return sm, slots


def wait_host(sm: StorageManager, slots: np.ndarray) -> None:
    """Waits for the device work that last wrote these host slots (the encode's fence).

    NOTE: reads the manager's private fence table (the manager waits on it itself before any
    host-side access); each distinct fence is waited on once."""
    fences = sm._host_fences[sm.cold_group_of[LG]][slots]
    distinct = {id(f): f for f in fences if f is not None}
    for f in distinct.values():
        f.wait()


def hot_pages(sm: StorageManager, slots: np.ndarray) -> np.ndarray:
    """``[n, L, 2, P, H, D]`` bf16: pages as the concat codec lays them out."""
    k, v = sm.pools[sm.hot_group_of[LG]]
    idx = jnp.asarray(np.asarray(slots, np.int32))
    kk = np.asarray(jnp.moveaxis(k[:, idx], 1, 0))
    vv = np.asarray(jnp.moveaxis(v[:, idx], 1, 0))
    return np.stack([kk, vv], axis=2)


def cycle(sm: StorageManager, slots_pool: np.ndarray, n: int, rng: np.random.Generator
          ) -> tuple[np.ndarray, dict[str, float], np.ndarray, np.ndarray]:
    """hot -> host -> hot for a fresh random set of ``n`` hot slots; returns (the source hot
    slots, times, the host slots used, the new hot slots)."""
    src = rng.choice(slots_pool, n, replace=False).astype(np.int32)
    t0 = time.perf_counter()
    host = sm.migrate(LG, DEV, src, HOST)
    t1 = time.perf_counter()
    if host is None:
        raise RuntimeError("hot->host migration refused (no host budget / slots)")
    wait_host(sm, host)
    t2 = time.perf_counter()
    hot = sm.migrate(LG, HOST, host, DEV)
    t3 = time.perf_counter()
    if hot is None:
        raise RuntimeError("host->hot migration refused (no device budget / slots)")
    jax.block_until_ready(sm.pools[sm.hot_group_of[LG]])
    t4 = time.perf_counter()
    # NOTE: all hot slots were allocated, so the pages come back into exactly the freed slots
    if sm.num_free(DEV, LG) != 0 or not np.array_equal(np.sort(hot), np.sort(src)):
        raise RuntimeError("hot slot set changed during the cycle")
    return src, {"d2h": t2 - t0, "d2h_submit": t1 - t0, "h2d": t4 - t2,
                 "h2d_submit": t3 - t2}, host, hot


def verify_concat(sm: StorageManager, slots_pool: np.ndarray, n: int, rng: np.random.Generator,
                  num_sample: int) -> dict[str, Any]:
    """One full-size cycle (also the warm-up) with a byte-exact check on sampled pages."""
    src = rng.choice(slots_pool, n, replace=False).astype(np.int32)
    pos = np.sort(rng.choice(n, min(n, num_sample), replace=False))
    want = hot_pages(sm, src[pos])
    host = sm.migrate(LG, DEV, src, HOST)
    wait_host(sm, host)
    cold = sm.host_pools[sm.cold_group_of[LG]].view()[host[pos]]
    ok_cold = bool(np.array_equal(cold, want.view(np.uint8).reshape(len(pos), -1)))
    hot = sm.migrate(LG, HOST, host, DEV)
    jax.block_until_ready(sm.pools[0])
    got = hot_pages(sm, hot[pos])
    ok_hot = bool(np.array_equal(got.view(np.uint16), want.view(np.uint16)))
    return {"ok": ok_cold and ok_hot, "pages_checked": int(len(pos)),
            "cold_bytes_equal_layout": ok_cold, "round_trip_byte_exact": ok_hot}


_ROUNDOFF = {"bfloat16": (2.0**-8, 2.0**-134), "float16": (2.0**-11, 2.0**-25),
             "float32": (2.0**-24, 2.0**-150)}


def verify_int8(sm: StorageManager, shape: Shape, slots_pool: np.ndarray, n: int,
                rng: np.random.Generator, num_sample: int) -> dict[str, Any]:
    """One full-size cycle with Int8Codec's per-element bound checked on sampled pages, and the
    hot pages after host->hot equal to a numpy decode of the cold bytes (its documented layout)."""
    L, P, H, D = shape.num_layers, shape.page_size, shape.num_kv_heads, shape.head_dim
    src = rng.choice(slots_pool, n, replace=False).astype(np.int32)
    pos = np.sort(rng.choice(n, min(n, num_sample), replace=False))
    xs = np.moveaxis(hot_pages(sm, src[pos]), 3, 4)  # [s, L, 2, H, P, D]: block (l, kv, h)
    host = sm.migrate(LG, DEV, src, HOST)
    wait_host(sm, host)
    colds = sm.host_pools[sm.cold_group_of[LG]].view()[host[pos]]  # a copy (fancy indexing)
    hot = sm.migrate(LG, HOST, host, DEV)
    jax.block_until_ready(sm.pools[0])
    gots = np.moveaxis(hot_pages(sm, hot[pos]), 3, 4)
    s_off, s_end, _ = int8_cold_page_layout(L, P, H, D)
    u, t = _ROUNDOFF[str(xs.dtype)]
    worst, worst_rel = 0.0, 0.0
    within = decode_ok = scales_ok = True
    for x, cold, got in zip(xs, colds, gots):  # one page at a time: bounded float64 temporaries
        q = cold[:2 * L * H * P * D].view(np.int8).reshape(L, 2, H, P, D)
        scale = np.ascontiguousarray(cold[s_off:s_end]).view("<f4").reshape(L, 2, H)
        y = (q.astype(np.float32) * scale[..., None, None]).astype(x.dtype)  # f32 mul, RNE to T
        xf, yf = x.astype(np.float64), y.astype(np.float64)
        amax = np.abs(xf).max(axis=(-2, -1))
        want_scale = np.where(amax == 0, np.float32(1),
                              amax.astype(np.float32) / np.float32(127)).astype(np.float32)
        normal = (amax >= 127 * 2.0**-126)[..., None, None]
        bound = np.where(normal, scale.astype(np.float64)[..., None, None] / 2 * (1 + 2.0**-7)
                         + u * np.abs(yf) + t, 2 * amax[..., None, None])
        err = np.abs(xf - yf)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(bound > 0, err / bound, np.where(err > 0, np.inf, 0.0))
        worst = max(worst, float(ratio.max()))
        worst_rel = max(worst_rel, float(np.max(err.max(axis=(-2, -1))
                                                / np.maximum(amax, 1e-30))))
        within &= bool(np.all(ratio <= 1.0))
        decode_ok &= bool(np.array_equal(got.view(np.uint16), y.view(np.uint16)))
        scales_ok &= bool(np.array_equal(scale, want_scale))
    return {"ok": within and decode_ok, "pages_checked": int(len(pos)),
            "within_bound": within, "max_err_over_bound": worst,
            "max_err_over_block_amax": worst_rel, "hot_equals_documented_decode": decode_ok,
            "scales_equal_amax_over_127": scales_ok,
            "bound": "|x-y| <= scale/2*(1+2^-7) + 2^-8*|y| + 2^-134 (bf16), scale=amax/127"}


def time_cycles(sm: StorageManager, slots_pool: np.ndarray, shape: Shape, repeats: int,
                rng: np.random.Generator, name: str, cold_page: int | None,
                note: str = "", warmup: int = 0) -> list[dict[str, Any]]:
    n = shape.pages
    kw = dict(bytes=n * shape.hot_page_bytes, note=note, submit_samples_s=[],
              cold_bytes=None if cold_page is None else n * cold_page)
    d2h = row("hot<->host", name, "hot->host", **kw)
    h2d = row("hot<->host", name, "host->hot", **{**kw, "submit_samples_s": []})
    for i in range(warmup + repeats):
        _, t, _, _ = cycle(sm, slots_pool, n, rng)
        if i >= warmup:
            d2h["samples_s"].append(t["d2h"])
            d2h["submit_samples_s"].append(t["d2h_submit"])
            h2d["samples_s"].append(t["h2d"])
            h2d["submit_samples_s"].append(t["h2d_submit"])
    for r in (d2h, h2d):
        finish(r)
        log_row(r)
    return [d2h, h2d]


# ----------------------------------------------------------------------------------------------
# disk


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.pwrite(fd, buf[done:done + IO_CHUNK], offset + done)
        if n <= 0:
            raise OSError(f"pwrite made no progress at {offset + done}")
        done += n


def _pread_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:done + IO_CHUNK]], offset + done)
        if n <= 0:
            raise OSError(f"preadv made no progress at {offset + done}")
        done += n


def _drop_own_cache(fd: int) -> None:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # our file only, after fsync


def bench_disk(sm: StorageManager, host_slots: np.ndarray, repeats: int, budget_s: float,
               uncached_reads: bool, disk_dir: str, num_sample: int, rng: np.random.Generator
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """HOST->DISK and DISK->HOST through the manager vs plain pwrite/preadv of the same bytes."""
    g = sm.cold_group_of[LG]
    hpool, dpool = sm.host_pools[g], sm.disk_pools[g]
    page = hpool.slot_bytes
    n = len(host_slots)
    nbytes = n * page
    read_note = ("page cache dropped for our two files (posix_fadvise DONTNEED after fsync)"
                 if uncached_reads else "served by the page cache (not dropped)")
    threads = f"{dpool.io_threads} I/O threads"
    m_w = row("host<->disk", f"StorageManager.migrate (pwrite per piece + CRC32C/page, {threads})",
              "host->disk", bytes=nbytes, note="no fsync (the manager never fsyncs)",
              fsync_samples_s=[])
    m_r = row("host<->disk", f"StorageManager.migrate (pread per piece + CRC32C check, {threads})",
              "disk->host", bytes=nbytes, note=read_note)
    p_w = row("host<->disk", f"plain os.pwrite, {IO_CHUNK >> 20} MiB calls", "host->disk",
              bytes=nbytes, note="no fsync; same directory, preallocated file",
              fsync_samples_s=[])
    p_r = row("host<->disk", f"plain os.preadv, {IO_CHUNK >> 20} MiB calls", "disk->host",
              bytes=nbytes, note=read_note)
    check: dict[str, Any] = {"ok": None}
    plain_path = os.path.join(disk_dir, "plain_sequential.bin")
    pfd = os.open(plain_path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    mfd = os.open(dpool.path, os.O_RDONLY | os.O_CLOEXEC)  # to fsync / fadvise the manager's file
    try:
        os.posix_fallocate(pfd, 0, nbytes)  # like the manager's file
        # The plain write's source: the host pool's own (pinned) bytes; its read lands in a
        # separate, pre-faulted buffer (the host pool holds live pages then).
        src = memoryview(hpool.view().reshape(-1)[:nbytes])
        dst_arr = np.ones(nbytes, np.uint8)
        dst = memoryview(dst_arr)
        pos = np.sort(rng.choice(n, min(n, num_sample), replace=False))
        t_start = time.perf_counter()
        # rep 0 is an untimed warm-up of both sides (first writes into freshly preallocated
        # files, first page-cache fills) and the round-trip check; then `repeats` timed ones.
        rep = 0
        while rep < repeats + 1:
            want = hpool.view()[host_slots[pos]].copy() if rep == 0 else None
            timed = rep > 0

            def manager() -> None:
                nonlocal host_slots
                c0 = dpool.num_io_calls
                t0 = time.perf_counter()
                ks = sm.migrate(LG, HOST, host_slots, DISK)
                t1 = time.perf_counter()
                m_w["io_calls_per_write"] = dpool.num_io_calls - c0
                if ks is None:
                    raise RuntimeError("host->disk migration refused (no disk budget / slots)")
                os.fsync(mfd)
                t2 = time.perf_counter()
                if uncached_reads:
                    _drop_own_cache(mfd)
                t3 = time.perf_counter()
                hs = sm.migrate(LG, DISK, ks, HOST)
                t4 = time.perf_counter()
                if hs is None:
                    raise RuntimeError("disk->host migration refused (no host budget / slots)")
                host_slots = hs
                if timed:
                    m_w["samples_s"].append(t1 - t0)
                    m_w["fsync_samples_s"].append(t2 - t1)
                    m_r["samples_s"].append(t4 - t3)

            def plain() -> None:
                t0 = time.perf_counter()
                _pwrite_all(pfd, src, 0)
                t1 = time.perf_counter()
                os.fsync(pfd)
                t2 = time.perf_counter()
                if uncached_reads:
                    _drop_own_cache(pfd)
                t3 = time.perf_counter()
                _pread_all(pfd, dst, 0)
                t4 = time.perf_counter()
                if timed:
                    p_w["samples_s"].append(t1 - t0)
                    p_w["fsync_samples_s"].append(t2 - t1)
                    p_r["samples_s"].append(t4 - t3)

            for step in ((manager, plain) if rep % 2 == 0 else (plain, manager)):
                step()
            if rep == 0:
                got = hpool.view()[host_slots[pos]]
                plain_ok = bool(np.array_equal(dst_arr[:page], np.asarray(src[:page]))
                                and np.array_equal(dst_arr[-page:], np.asarray(src[-page:])))
                check = {"ok": bool(np.array_equal(got, want)), "pages_checked": int(len(pos)),
                         "plain_read_matches_source": plain_ok}
                _log(f"  disk round trip check: {check}")
            rep += 1
            elapsed = time.perf_counter() - t_start
            if 1 < rep < repeats + 1 and elapsed > budget_s:
                _log(f"  disk: stopping after {rep - 1} timed repetitions ({elapsed:.0f}s > "
                     f"budget {budget_s:.0f}s)")
                break
        for r in (m_w, m_r, p_w, p_r):
            r["repetitions"] = rep - 1
            finish(r)
            log_row(r)
        del src, dst, dst_arr
    finally:
        os.close(mfd)
        os.close(pfd)
        try:
            os.unlink(plain_path)
        except OSError:
            pass
    return [m_w, m_r, p_w, p_r], check


# ----------------------------------------------------------------------------------------------
# phases


def _concat_hot_host(sm: StorageManager, slots_pool: np.ndarray, shape: Shape,
                     args: argparse.Namespace, rng: np.random.Generator, name: str,
                     results: dict[str, Any]) -> list[dict[str, Any]]:
    """The hot <-> host part of the concat phase: verification, then timed cycles of the
    default mover and of the two memcpy movers."""
    rows: list[dict[str, Any]] = []
    batch = ("copy kernel, one launch per call" if jax.default_backend() == "gpu"
             else "CPU memcpy")
    try:
        v = verify_concat(sm, slots_pool, shape.pages, rng, args.sample_pages)
    except Exception as e:  # noqa: BLE001
        v = {"ok": False, "error": _err(e)}
        traceback.print_exc()
    results["verification"]["concat"] = v
    _log(f"  concat check: {v}")
    rows += time_cycles(sm, slots_pool, shape, args.repeats, rng, name, None,
                        note=f"{batch}; check {'ok' if v.get('ok') else 'FAIL'}")
    return rows


def _concat_memcpy_rows(shape: Shape, args: argparse.Namespace,
                        rng: np.random.Generator) -> list[dict[str, Any]]:
    """The memcpy movers, each on a manager built with its codec options (one at a time, after
    the default mover's manager is closed): one cuMemcpyBatchAsync per call (the codec design's
    original path), then one cudaMemcpyAsync per descriptor (the fallback before CUDA 12.8)."""
    rows: list[dict[str, Any]] = []
    for label, batched, note in (
            ("concat[memcpy-batch]", True,
             f'ConcatCodec(copy="memcpy"): one cuMemcpyBatchAsync per call, '
             f"{shape.pages * 2 * shape.num_layers} descriptors"),
            ("concat[no-batch]", False,
             f'ConcatCodec(copy="memcpy", memcpy_batch=False): one cudaMemcpyAsync per '
             f"{shape.piece_bytes >> 10} KiB piece, from C++")):
        if jax.default_backend() != "gpu":
            note = "no effect on CPU (same memcpy path)"
        sm = None
        try:
            sm, slots_pool = build_manager(
                shape, ConcatCodec(copy="memcpy", memcpy_batch=batched),
                shape.pages + args.host_extra_pages, None, 0, args.seed + 1)
            rows += time_cycles(sm, slots_pool, shape, args.piece_repeats, rng, label, None,
                                note=note, warmup=1)
        except Exception as e:  # noqa: BLE001
            rows.append(row("hot<->host", label, "both", error=_err(e)))
            _log(f"  {label}: ERROR {_err(e)}")
        finally:
            if sm is not None:
                sm.close()
            del sm
            free_memory()
    return rows


def run_concat(shape: Shape, args: argparse.Namespace, disk_dir: str | None, disk_pages: int,
               results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(args.seed + 1)
    name = "concat (StorageManager.migrate, ConcatCodec)"
    t0 = time.perf_counter()
    try:
        sm, slots_pool = build_manager(shape, ConcatCodec(copy="auto", memcpy_batch=True),
                                       shape.pages + args.host_extra_pages,
                                       disk_dir, disk_pages, args.seed + 1)
    except Exception as e:  # noqa: BLE001
        _log(f"  concat manager: ERROR {_err(e)}")
        traceback.print_exc()
        return [row("hot<->host", name, "both", error=_err(e))]
    try:
        hp = sm.host_pools[0]
        results["concat_manager"] = {
            "host_slots": hp.num_slots, "host_pinned": hp.pinned,
            "cold_page_bytes": hp.slot_bytes, "hot_slots": shape.hot_slots,
            "disk_slots": sm.disk_pools[0].num_slots if sm.disk_pools else 0,
            "setup_s": round(time.perf_counter() - t0, 2)}
        _log(f"  manager: {results['concat_manager']}")
        if not args.disk_only:
            rows += _concat_hot_host(sm, slots_pool, shape, args, rng, name, results)
        if disk_pages and not args.skip_disk:
            _log(f"\n[host <-> disk] {disk_pages} pages of {hp.slot_bytes / 2**20:.3g} MiB = "
                 f"{disk_pages * hp.slot_bytes / GiB:.3g} GiB in {disk_dir} "
                 f"({fs_type(disk_dir)})")
            try:
                src = rng.choice(slots_pool, disk_pages, replace=False).astype(np.int32)
                host = sm.migrate(LG, DEV, src, HOST)
                wait_host(sm, host)
                drows, dcheck = bench_disk(sm, host, args.disk_repeats, args.disk_budget_s,
                                           args.disk_uncached_reads, disk_dir, args.sample_pages,
                                           rng)
                results["verification"]["disk"] = dcheck
                rows += drows
            except Exception as e:  # noqa: BLE001
                results["verification"]["disk"] = {"ok": False, "error": _err(e)}
                rows.append(row("host<->disk", "StorageManager.migrate", "both", error=_err(e)))
                _log(f"  disk: ERROR {_err(e)}")
                traceback.print_exc()
        results["concat_manager"]["stats"] = sm.stats()
    except Exception as e:  # noqa: BLE001
        rows.append(row("hot<->host", name, "both", error=_err(e)))
        _log(f"  concat: ERROR {_err(e)}")
        traceback.print_exc()
    finally:
        sm.close()
        del sm
        free_memory()
    if not args.disk_only:
        rows += _concat_memcpy_rows(shape, args, rng)
    return rows


def run_int8(shape: Shape, args: argparse.Namespace, results: dict[str, Any]
             ) -> list[dict[str, Any]]:
    rng = np.random.default_rng(args.seed + 2)
    name = "int8 (StorageManager.migrate, Int8Codec)"
    t0 = time.perf_counter()
    try:
        sm, slots_pool = build_manager(shape, Int8Codec(), shape.pages + args.host_extra_pages,
                                       None, 0, args.seed + 2)
    except Exception as e:  # noqa: BLE001
        _log(f"  int8 manager: ERROR {_err(e)}")
        traceback.print_exc()
        return [row("hot<->host", name, "both", error=_err(e))]
    rows: list[dict[str, Any]] = []
    try:
        hp = sm.host_pools[0]
        results["int8_manager"] = {"host_slots": hp.num_slots, "host_pinned": hp.pinned,
                                   "cold_page_bytes": hp.slot_bytes,
                                   "setup_s": round(time.perf_counter() - t0, 2)}
        _log(f"  manager: {results['int8_manager']}")
        try:
            v = verify_int8(sm, shape, slots_pool, shape.pages, rng, args.sample_pages)
        except Exception as e:  # noqa: BLE001
            v = {"ok": False, "error": _err(e)}
            traceback.print_exc()
        results["verification"]["int8"] = v
        _log(f"  int8 check: {v}")
        kern = "CUDA kernels" if jax.default_backend() == "gpu" else "CPU handler"
        rows += time_cycles(sm, slots_pool, shape, args.repeats, rng, name, hp.slot_bytes,
                            note=f"{kern}; check {'ok' if v.get('ok') else 'FAIL'}")
        results["int8_manager"]["stats"] = sm.stats()
    except Exception as e:  # noqa: BLE001
        rows.append(row("hot<->host", name, "both", error=_err(e)))
        _log(f"  int8: ERROR {_err(e)}")
        traceback.print_exc()
    finally:
        sm.close()
        del sm
        free_memory()
    return rows


# ----------------------------------------------------------------------------------------------
# report


def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _pooled_gbps(rows: list[dict[str, Any]], prefix: str, direction: str) -> float | None:
    """Rate from the median of all samples of the rows whose method starts with ``prefix``."""
    sel = [r for r in rows if r["method"].startswith(prefix) and r["direction"] == direction
           and r["samples_s"] and not r["error"]]
    if not sel:
        return None
    samples = [s for r in sel for s in r["samples_s"]]
    return sel[0]["bytes"] / statistics.median(samples) / GB


def _gbps(rows: list[dict[str, Any]], prefix: str, direction: str) -> float | None:
    r = next((r for r in rows if r["method"].startswith(prefix) and r["direction"] == direction
              and r["gbps"] and not r["error"]), None)
    return None if r is None else r["gbps"]


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []

    def add(name: str, num: str, den: str, target: float | None, pooled_den: bool = False,
            directions: tuple[str, str] = ("hot->host", "host->hot")) -> None:
        vals = {}
        for d in directions:
            a = _gbps(rows, num, d)
            b = _pooled_gbps(rows, den, d) if pooled_den else _gbps(rows, den, d)
            vals[d] = None if a is None or b is None else a / b
        met = (None if target is None or any(v is None for v in vals.values())
               else all(v >= target for v in vals.values()))
        out.append({"ratio": name, "values": vals, "target": target, "met": met})

    add("concat / contiguous pinned", "concat (", "contiguous", TARGET_CONCAT_VS_CONTIG,
        pooled_den=True)
    add("int8 / concat (uncompressed bytes/s)", "int8", "concat (", TARGET_INT8_VS_CONCAT)
    add("int8 / contiguous pinned (uncompressed bytes/s)", "int8", "contiguous", None,
        pooled_den=True)
    add("concat (kernel) / concat[memcpy-batch]", "concat (", "concat[memcpy-batch]", None)
    add("concat / concat[no-batch] (native cudaMemcpyAsync per piece)", "concat (",
        "concat[no-batch]", None)
    add("concat / per-piece torch loop", "concat (", "per-piece", None)
    add("disk: manager / plain (no fsync)", "StorageManager", "plain", TARGET_DISK_VS_PLAIN,
        directions=("host->disk", "disk->host"))
    return out


def print_tables(rows: list[dict[str, Any]], rat: list[dict[str, Any]], shape: Shape) -> None:
    hh = [r for r in rows if r["section"] == "hot<->host"]
    hd = [r for r in rows if r["section"] == "host<->disk"]
    contig_d2h = _pooled_gbps(rows, "contiguous", "hot->host")
    contig_h2d = _pooled_gbps(rows, "contiguous", "host->hot")
    if hh:
        print(f"\n### hot <-> host: {shape.describe()}\n")
        print("GB/s = 1e9 bytes/s of uncompressed hot bytes (cold GB/s: bytes actually stored); "
              "ms = median end-to-end time per call incl. completion; submit ms = the migrate() "
              "call alone\n")
        print("| method | direction | ms | submit ms | GB/s | cold GB/s | x contiguous | note |")
        print("|---|---|---:|---:|---:|---:|---:|---|")
        for r in hh:
            base = contig_d2h if r["direction"] == "hot->host" else contig_h2d
            x = None if not r["gbps"] or not base else r["gbps"] / base
            ms = None if r["median_s"] is None else r["median_s"] * 1e3
            sub = None if r["submit_median_s"] is None else r["submit_median_s"] * 1e3
            print(f"| {r['method']} | {r['direction']} | {_fmt(ms, 1)} | {_fmt(sub, 1)} "
                  f"| {_fmt(r['gbps'])} | {_fmt(r['cold_gbps'])} | {_fmt(x)} "
                  f"| {r['error'] or r['note']} |")
    if hd:
        print("\n### host <-> disk (concat pages; page cache, no fsync in the timed region)\n")
        print("| method | direction | GiB | ms | GB/s | +fsync GB/s (info) | reps | note |")
        print("|---|---|---:|---:|---:|---:|---:|---|")
        for r in hd:
            ms = None if r["median_s"] is None else r["median_s"] * 1e3
            gib = None if not r["bytes"] else r["bytes"] / GiB
            print(f"| {r['method']} | {r['direction']} | {_fmt(gib)} | {_fmt(ms, 1)} "
                  f"| {_fmt(r['gbps'])} | {_fmt(r.get('with_fsync_gbps'))} "
                  f"| {r.get('repetitions', '-')} | {r['error'] or r['note']} |")
    if rat:
        print("\n### Ratios (same run)\n")
        print("| ratio | write / hot->host | read / host->hot | target | met |")
        print("|---|---:|---:|---:|---|")
        for q in rat:
            v = list(q["values"].values())
            met = "-" if q["met"] is None else ("yes" if q["met"] else "NO")
            tgt = "-" if q["target"] is None else f">= {q['target']}"
            print(f"| {q['ratio']} | {_fmt(v[0])} | {_fmt(v[1])} | {tgt} | {met} |")
    sys.stdout.flush()


def plan_sizes(shape: Shape, args: argparse.Namespace, disk_dir: str | None
               ) -> tuple[Shape, int, list[str]]:
    """Scales pages down when RAM or disk space is short; returns (shape, disk pages, notes)."""
    notes = []
    page = shape.hot_page_bytes
    avail = meminfo().get("MemAvailable")
    # Peak host memory: the concat host tier + a plain-read buffer of the same size (disk part),
    # or the torch per-piece loop's pinned buffer; plus a margin. --disk-only may run on a CPU
    # backend, whose hot pools are host memory too.
    hot_copies = 1 if args.disk_only and jax.default_backend() == "cpu" else 0
    if avail:
        def need(p: int) -> int:
            return (2 + hot_copies) * (p + args.host_extra_pages) * page + 4 * GiB
        pages = shape.pages
        while pages > 16 and need(pages) > avail:
            pages //= 2
        if pages != shape.pages:
            notes.append(f"SCALED DOWN: {shape.pages} -> {pages} pages (MemAvailable "
                         f"{avail / GiB:.1f} GiB)")
            shape = Shape(**{**shape.__dict__, "pages": pages,
                             "hot_slots": pages if args.disk_only else 2 * pages})
    disk_pages = 0
    if disk_dir and not args.skip_disk:
        disk_pages = min(args.disk_pages or shape.pages, shape.pages)
        free = shutil.disk_usage(disk_dir).free
        margin = 2 * GiB if not args.quick else 0
        fit = max(0, (free - margin) // (2 * page))  # the manager's file + the plain file
        if fit < disk_pages:
            notes.append(f"SCALED DOWN: disk part {disk_pages} -> {fit} pages (free space "
                         f"{free / GiB:.1f} GiB in {disk_dir})")
            disk_pages = int(fit)
        if disk_pages < 16:
            notes.append("disk part skipped: not enough free space")
            disk_pages = 0
    return shape, disk_pages, notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write all results (with raw samples) here")
    p.add_argument("--quick", action="store_true", help="tiny shapes; runs on CPU")
    p.add_argument("--repeats", type=int, default=5, help="timed samples per migration (median)")
    p.add_argument("--contig-repeats", type=int, default=10)
    p.add_argument("--piece-repeats", type=int, default=3,
                   help="timed samples of the per-piece methods (slow: ~262k copies each)")
    p.add_argument("--pages", type=int, default=None, help="pages per migration (default 4096)")
    p.add_argument("--host-extra-pages", type=int, default=64,
                   help="host tier slots beyond --pages")
    p.add_argument("--sample-pages", type=int, default=64, help="pages checked by verification")
    p.add_argument("--disk-dir", default=None,
                   help="parent directory of the disk files (default: the temp dir, if it is "
                        "not tmpfs, else /var/tmp, else the current directory)")
    p.add_argument("--disk-pages", type=int, default=None, help="default: --pages")
    p.add_argument("--disk-repeats", type=int, default=3)
    p.add_argument("--disk-budget-s", type=float, default=90.0,
                   help="start no further timed disk repetition after this many seconds (the "
                        "warm-up and at least one timed repetition always run)")
    p.add_argument("--disk-uncached-reads", action="store_true",
                   help="posix_fadvise(DONTNEED) our own two files before each timed read")
    p.add_argument("--skip-disk", action="store_true")
    p.add_argument("--disk-only", action="store_true",
                   help="only host<->disk (full-size pages, hot tier of --pages slots, no torch, "
                        "no hot<->host timing, no int8): runs without a GPU")
    p.add_argument("--skip-torch", action="store_true",
                   help="skip the torch baselines (contiguous and per-piece loop)")
    p.add_argument("--skip-int8", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = QUICK if args.quick else FULL
    if args.quick:
        args.repeats = min(args.repeats, 2)
        args.contig_repeats = min(args.contig_repeats, 3)
        args.piece_repeats = min(args.piece_repeats, 1)
        args.disk_repeats = min(args.disk_repeats, 2)
        args.host_extra_pages = min(args.host_extra_pages, 8)
        args.sample_pages = min(args.sample_pages, 16)
    if args.pages:
        shape = Shape(**{**shape.__dict__, "pages": args.pages, "hot_slots": 2 * args.pages})
    if args.disk_only:
        if args.skip_disk:
            p.error("--disk-only and --skip-disk exclude each other")
        args.skip_torch = args.skip_int8 = True
        # The hot pages only feed the host tier once: no second set for random draws.
        shape = Shape(**{**shape.__dict__, "hot_slots": shape.pages})

    t_start = time.perf_counter()
    disk_dir = None if args.skip_disk else pick_disk_dir(args.disk_dir)
    try:
        env = environment(disk_dir)
        _log("environment:", json.dumps(env))
        if env["backend"] != "gpu" and not (args.quick or args.disk_only):
            _log("WARNING: no GPU backend; full shapes on CPU will be very slow (use --quick)")
        shape, disk_pages, notes = plan_sizes(shape, args, disk_dir)
        for n in notes:
            _log(n)
        _log(f"workload: {shape.describe()}; disk part {disk_pages} pages")
        results: dict[str, Any] = {"verification": {}, "scaling_notes": notes}
        rows: list[dict[str, Any]] = []

        if not args.skip_torch:
            _log("\n[contiguous pinned copy, start]")
            rows += bench_contiguous(shape, args.contig_repeats, "start")
            _log("\n[per-piece torch loop]")
            prow, pcheck = bench_piece_loop(shape, args.piece_repeats, args.seed)
            rows += prow
            results["verification"]["per_piece_loop"] = pcheck
        _log("\n[concat codec]")
        rows += run_concat(shape, args, disk_dir, disk_pages, results)
        if not args.skip_int8:
            _log("\n[int8 codec]")
            rows += run_int8(shape, args, results)
        if not args.skip_torch:
            _log("\n[contiguous pinned copy, end]")
            rows += bench_contiguous(shape, args.contig_repeats, "end")

        rat = ratios(rows)
        print_tables(rows, rat, shape)
        ver = results["verification"]
        print("\nverification: " + "; ".join(
            f"{k}: {'ok' if v.get('ok') else ('-' if v.get('ok') is None else 'FAIL')}"
            + (f" (max err/bound {v['max_err_over_bound']:.3f})" if "max_err_over_bound" in v
               else "") for k, v in ver.items()))
        for n in notes:
            print(n)
        wall = time.perf_counter() - t_start
        _log(f"\ntotal wall time {wall:.1f}s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": env, "wall_s": wall, "quick": args.quick,
                           "config": {**shape.__dict__, "piece_bytes": shape.piece_bytes,
                                      "hot_page_bytes": shape.hot_page_bytes,
                                      "int8_page_bytes": shape.int8_page_bytes(),
                                      "disk_pages": disk_pages, "args": vars(args),
                                      "gb": "1e9 bytes",
                                      "targets": {"concat_vs_contiguous": TARGET_CONCAT_VS_CONTIG,
                                                  "int8_vs_concat": TARGET_INT8_VS_CONCAT,
                                                  "disk_vs_plain": TARGET_DISK_VS_PLAIN}},
                           "ratios": rat, "results": results, "rows": rows}, f, indent=1,
                          default=str)
            _log(f"wrote {args.json}")
        ours = [r for r in rows if r["error"] and not r["error"].startswith("skipped")]
        bad = [k for k, v in ver.items() if v.get("ok") is False]
        return 1 if ours or bad else 0
    finally:
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
