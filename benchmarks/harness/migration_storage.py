"""The migration benchmark's StorageManager side: a manager over one hot pool group and its
cold tiers, migration cycles hot -> host -> hot over random page sets, their checks (the concat
codec byte-exact, the int8 codec within its quantization bound) and timing, and the disk tier
against plain ``pwrite`` / ``preadv`` of the same bytes."""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness.migration_env import (DEV, DISK, HOST, IO_CHUNK, LG, Shape, finish, log,
                                              log_row, row)
from jax_kvcm import ConcatCodec
from jax_kvcm._codec import int8_cold_page_layout
from jax_kvcm._storage import StorageConfig, StorageManager

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
    mfd = os.dup(dpool.fileno)  # to fsync / fadvise the manager's file (unlinked at creation)
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
                log(f"  disk round trip check: {check}")
            rep += 1
            elapsed = time.perf_counter() - t_start
            if 1 < rep < repeats + 1 and elapsed > budget_s:
                log(f"  disk: stopping after {rep - 1} timed repetitions ({elapsed:.0f}s > "
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


