"""Disk tier: DiskFile (native) and DiskPool: round trips, coalescing, checksums, faults, cleanup.

Every randomized test takes a seed from ``SEEDS`` (in the test id) and names it in its messages.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import SEEDS

from jax_kvcm import _kvcm_cpu
from jax_kvcm._disk_tier import DiskFullError, DiskIOError, DiskPool

SLOT = 4096 + 24  # not a multiple of the page size on purpose
FAULT_KINDS = ["enospc", "short_write", "short_read", "eio_read"]
WRITE_FAULTS = {"enospc": errno.ENOSPC, "short_write": errno.EIO}
READ_FAULTS = {"short_read": errno.EIO, "eio_read": errno.EIO}


def i32(*xs) -> np.ndarray:
    return np.array(xs, np.int32)


def num_runs(slots) -> int:
    slots = np.asarray(slots, np.int64)
    return 0 if slots.size == 0 else 1 + int(np.count_nonzero(np.diff(slots) != 1))


class Staging:
    """A contiguous host staging region (HostBuffer) of ``pages`` slots."""

    def __init__(self, pages: int, slot_bytes: int = SLOT) -> None:
        self.slot_bytes = slot_bytes
        self.buf = _kvcm_cpu.HostBuffer(pages * slot_bytes)
        self.pages = self.buf.view().reshape(pages, slot_bytes)
        self.address = self.buf.address

    def fill(self, rng: np.random.Generator, n: int) -> np.ndarray:
        self.pages[:n] = rng.integers(0, 256, (n, self.slot_bytes), dtype=np.uint8)
        return self.pages[:n].copy()


def live(f) -> str:
    """A path to the bytes of an open DiskFile / DiskPool, whose name is already unlinked."""
    assert f.fileno >= 0
    return f"/proc/self/fd/{f.fileno}"


def flip_byte(path: str, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def file_bytes(path: str, slot: int, slot_bytes: int = SLOT) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(slot * slot_bytes)
        return np.frombuffer(f.read(slot_bytes), np.uint8)


@pytest.fixture
def dfile(tmp_path):
    f = _kvcm_cpu.DiskFile(str(tmp_path / "pool.kvcm"), 64, SLOT)
    yield f
    f.close()


@pytest.fixture
def pool(tmp_path):
    with DiskPool(tmp_path, "cold0", 64, SLOT) as p:
        yield p


# ---------------------------------------------------------------------------------------------
# CRC32C.


def test_crc32c_check_values():
    for software in (False, True):
        assert _kvcm_cpu._crc32c(b"123456789", software) == 0xE3069283
        assert _kvcm_cpu._crc32c(b"", software) == 0
        assert _kvcm_cpu._crc32c(bytes(32), software) == 0x8A9136AA  # RFC 3720 B.4
        assert _kvcm_cpu._crc32c(b"\xff" * 32, software) == 0x62A8AB43
        assert _kvcm_cpu._crc32c(bytes(range(32)), software) == 0x46DD794E
    assert _kvcm_cpu._CRC32C_IMPL in ("sse4.2", "armv8-crc", "software")


@pytest.mark.parametrize("seed", SEEDS)
def test_crc32c_paths_agree(seed):
    """The (three-stream) hardware path equals the table path at every length class."""
    rng = np.random.default_rng(seed)
    lengths = [1, 7, 8, 9, 4095, 12287, 12288, 12289, 3 * 4096 + 5, 2 << 20]
    lengths += [int(n) for n in rng.integers(1, 200_000, 20)]
    for n in lengths:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _kvcm_cpu._crc32c(data) == _kvcm_cpu._crc32c(data, True), f"n={n} seed={seed}"


# ---------------------------------------------------------------------------------------------
# DiskFile: creation, round trips, coalescing.


def test_create_preallocates_exclusively(tmp_path):
    path = str(tmp_path / "a.kvcm")
    f = _kvcm_cpu.DiskFile(path, 10, SLOT)
    assert not os.path.exists(path), "the name is unlinked right after the create"
    assert not f.linked
    st = os.fstat(f.fileno)
    assert st.st_size == 10 * SLOT and st.st_nlink == 0
    assert st.st_mode & 0o777 == 0o600
    assert st.st_blocks * 512 >= 10 * SLOT, "posix_fallocate did not reserve the blocks"
    assert (f.path, f.num_slots, f.slot_bytes, f.closed) == (path, 10, SLOT, False)
    with open(path, "wb") as other:  # somebody else's file under that name
        other.write(b"theirs")
    with pytest.raises(FileExistsError) as e:
        _kvcm_cpu.DiskFile(path, 10, SLOT)
    assert e.value.errno == errno.EEXIST and e.value.filename == path
    assert os.path.exists(path), "a refused create must not remove the existing file"
    f.close()
    with open(path, "rb") as other:
        assert other.read() == b"theirs", "close removed a file it did not create"


@pytest.mark.parametrize("args, what", [((0, SLOT), "num_slots"), ((4, 0), "slot_bytes"),
                                        ((1 << 40, 1 << 40), "overflow")])
def test_create_bad_arguments(tmp_path, args, what):
    path = str(tmp_path / "a.kvcm")
    with pytest.raises(ValueError, match=what):
        _kvcm_cpu.DiskFile(path, *args)
    assert not os.path.exists(path)


def test_create_in_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        _kvcm_cpu.DiskFile(str(tmp_path / "nope" / "a.kvcm"), 4, SLOT)


@pytest.mark.parametrize("seed", SEEDS)
def test_round_trip_byte_exact(dfile, seed):
    rng = np.random.default_rng(seed)
    src, dst = Staging(32), Staging(32)
    expected = {}
    for _ in range(6):
        n = int(rng.integers(1, 33))
        # A random slot set with adjacent runs: a few random starts, each extended to a run.
        slots = []
        while len(slots) < n:
            start = int(rng.integers(0, dfile.num_slots))
            length = int(rng.integers(1, 6))
            slots += [s for s in range(start, min(start + length, dfile.num_slots))
                      if s not in slots]
        slots = np.array(slots[:n], np.int32)
        if rng.random() < 0.5:
            slots = np.sort(slots)
        data = src.fill(rng, n)
        dfile.write(slots, src.address)
        for i, s in enumerate(slots):
            expected[int(s)] = data[i]
        # Read back every slot written so far, in a random order.
        order = rng.permutation(np.array(sorted(expected), np.int32))[:32]
        ok = dfile.read(order, dst.address)
        assert ok.dtype == np.bool_ and ok.shape == order.shape
        assert ok.all(), f"seed={seed}: pages {order[~ok]} failed their checksum"
        for i, s in enumerate(order):
            assert np.array_equal(dst.pages[i], expected[int(s)]), f"slot {s} (seed={seed})"
    # The file holds exactly the bytes written.
    for s, want in expected.items():
        assert np.array_equal(file_bytes(live(dfile), s), want), f"file slot {s} (seed={seed})"


@pytest.mark.parametrize("slots", [[5], [3, 4, 5], [3, 4, 5, 9, 10, 0], [7, 6, 5],
                                   [0, 2, 4, 6], [10, 11, 11, 12], list(range(20, 52))])
def test_one_io_per_run(dfile, slots):
    rng = np.random.default_rng(0)
    slots = np.array(slots, np.int32)
    src, dst = Staging(len(slots)), Staging(len(slots))
    src.fill(rng, len(slots))
    before = dfile.num_io_calls
    dfile.write(slots, src.address)
    assert dfile.num_io_calls - before == num_runs(slots), slots
    before = dfile.num_io_calls
    ok = dfile.read(slots, dst.address)
    assert dfile.num_io_calls - before == num_runs(slots), slots
    assert ok.all()
    # Duplicated slots: the last write wins, for the bytes and the checksum.
    last = {int(s): i for i, s in enumerate(slots)}
    for i, s in enumerate(slots):
        assert np.array_equal(dst.pages[i], src.pages[last[int(s)]])


def test_empty_calls_do_no_io(dfile):
    before = dfile.num_io_calls
    dfile.write(np.zeros(0, np.int32), 0)
    assert dfile.read(np.zeros(0, np.int32), 0).shape == (0,)
    dfile.invalidate(np.zeros(0, np.int32))
    assert dfile.num_io_calls == before


def test_strided_slots_are_accepted(dfile):
    rng = np.random.default_rng(1)
    src, dst = Staging(3), Staging(3)
    data = src.fill(rng, 3)
    slots = np.array([1, 99, 2, 99, 8, 99], np.int32)[::2]  # non-contiguous view
    dfile.write(slots, src.address)
    assert dfile.read(slots, dst.address).all()
    assert np.array_equal(dst.pages[:3], data)


# ---------------------------------------------------------------------------------------------
# Validation: ValueError naming the argument, before any I/O.


@pytest.mark.parametrize("bad, match", [
    (np.array([0, 64], np.int32), r"slots\[1\] = 64 is out of range"),
    (np.array([-1], np.int32), r"slots\[0\] = -1 is out of range"),
    (np.array([0, 1], np.int64), "slots"),
    (np.array([0.0, 1.0]), "slots"),
    (np.array([[0, 1]], np.int32), "slots"),
    ([0, 1], "slots"),
])
@pytest.mark.parametrize("op", ["write", "read", "invalidate"])
def test_bad_slots_rejected_before_io(dfile, bad, match, op):
    src = Staging(2)
    dfile.write(i32(0, 1), src.address)
    before = dfile.num_io_calls
    with pytest.raises(ValueError, match=match):
        if op == "invalidate":
            dfile.invalidate(bad)
        else:
            getattr(dfile, op)(bad, src.address)
    assert dfile.num_io_calls == before
    assert dfile.read(i32(0, 1), src.address).all(), "a refused call changed the table"


@pytest.mark.parametrize("op, name", [("write", "src_address"), ("read", "dst_address")])
def test_null_address_rejected(dfile, op, name):
    with pytest.raises(ValueError, match=name):
        getattr(dfile, op)(i32(0), 0)
    with pytest.raises(TypeError):
        getattr(dfile, op)(i32(0), -4096)


# ---------------------------------------------------------------------------------------------
# Checksums: a bad or missing page is a miss (False), never an exception, never served as valid.


@pytest.mark.parametrize("seed", SEEDS)
def test_bit_flip_in_file_fails_exactly_that_page(dfile, seed):
    rng = np.random.default_rng(seed)
    slots = i32(4, 5, 6, 7, 20)
    src, dst = Staging(5), Staging(5)
    src.fill(rng, 5)
    dfile.write(slots, src.address)
    victim = int(rng.integers(0, 5))
    for offset in (0, SLOT // 2, SLOT - 1, int(rng.integers(0, SLOT))):
        pos = int(slots[victim]) * SLOT + offset
        mask = 1 << int(rng.integers(0, 8))
        flip_byte(live(dfile), pos, mask)
        ok = dfile.read(slots, dst.address)
        want = np.ones(5, bool)
        want[victim] = False
        assert np.array_equal(ok, want), f"flip at slot {slots[victim]}+{offset} seed={seed}"
        flip_byte(live(dfile), pos, mask)  # restore
        assert dfile.read(slots, dst.address).all(), f"restored page fails (seed={seed})"


def test_unwritten_and_invalidated_slots_read_false(dfile):
    src, dst = Staging(4), Staging(4)
    src.fill(np.random.default_rng(0), 4)
    dfile.write(i32(1, 2, 3), src.address)
    assert list(dfile.read(i32(0, 1, 2, 3), dst.address)) == [False, True, True, True]
    dfile.invalidate(i32(2))
    assert list(dfile.read(i32(0, 1, 2, 3), dst.address)) == [False, True, False, True]
    dfile.write(i32(2), src.address)  # rewriting restores it
    assert list(dfile.read(i32(0, 1, 2, 3), dst.address)) == [False, True, True, True]


def forge_crc_zero(page: np.ndarray) -> np.ndarray:
    """``page`` with its last 4 bytes replaced so that its CRC32C is 0 (CRC is affine in them)."""
    head = page[:-4].tobytes()

    def crc(x: int) -> int:
        return _kvcm_cpu._crc32c(head + x.to_bytes(4, "little"))

    base = crc(0)
    # Solve sum_i bit_i * (crc(e_i) ^ base) == base over GF(2), tracking which bits make a row.
    rows = [(crc(1 << i) ^ base, 1 << i) for i in range(32)]
    basis: dict[int, tuple[int, int]] = {}
    for vec, combo in rows:
        for bit in reversed(range(32)):
            if not (vec >> bit) & 1:
                continue
            if bit in basis:
                vec, combo = vec ^ basis[bit][0], combo ^ basis[bit][1]
            else:
                basis[bit] = (vec, combo)
                break
    target, x = base, 0
    for bit in reversed(range(32)):
        if (target >> bit) & 1:
            target, x = target ^ basis[bit][0], x ^ basis[bit][1]
    assert target == 0
    out = page.copy()
    out[-4:] = np.frombuffer(x.to_bytes(4, "little"), np.uint8)
    assert _kvcm_cpu._crc32c(out.tobytes()) == 0
    return out


def test_page_with_crc_zero_in_unwritten_slot_reads_false(dfile):
    """Bytes that got into a slot's file region without a write() (no entry) never pass, even when
    their CRC32C happens to be 0 (an empty entry is not the checksum 0)."""
    page = forge_crc_zero(np.random.default_rng(7).integers(0, 256, SLOT, dtype=np.uint8))
    with open(live(dfile), "r+b") as f:
        f.seek(5 * SLOT)
        f.write(page.tobytes())
    dst = Staging(1)
    assert not dfile.read(i32(5), dst.address)[0]
    assert np.array_equal(dst.pages[0], page)
    # Written through the file, the same page is valid.
    src = Staging(1)
    src.pages[0] = page
    dfile.write(i32(5), src.address)
    assert dfile.read(i32(5), dst.address)[0]


def test_zero_page_is_not_valid_by_accident(dfile):
    """An all-zero page that was never written must not pass (no entry), though the file is zero."""
    dst = Staging(1)
    assert not dfile.read(i32(9), dst.address)[0]


# ---------------------------------------------------------------------------------------------
# Fault injection: each injector fires (and the same call without it succeeds).


@pytest.mark.parametrize("kind", list(WRITE_FAULTS))
def test_write_fault_fires_and_negative_control(dfile, kind):
    rng = np.random.default_rng(0)
    src, dst = Staging(3), Staging(3)
    src.fill(rng, 3)
    slots = i32(10, 11, 12)
    dfile.write(slots, src.address)  # negative control: the same call succeeds
    assert dfile.read(slots, dst.address).all()
    data = src.fill(rng, 3)
    dfile._inject_fault(kind)
    with pytest.raises(OSError) as e:
        dfile.write(slots, src.address)
    assert e.value.errno == WRITE_FAULTS[kind], e.value
    assert e.value.filename == dfile.path and "10..12" in str(e.value)
    # The failing run's pages read as missing (their old entries were dropped).
    assert not dfile.read(slots, dst.address).any()
    # One-shot: a retry succeeds and the data is right.
    dfile.write(slots, src.address)
    assert dfile.read(slots, dst.address).all()
    assert np.array_equal(dst.pages, data)


def test_short_write_transfers_half_then_fails(dfile):
    src = Staging(2)
    data = src.fill(np.random.default_rng(3), 2)
    before = dfile.num_io_calls
    dfile._inject_fault("short_write")
    with pytest.raises(OSError) as e:
        dfile.write(i32(0, 1), src.address)
    assert e.value.errno == errno.EIO
    assert dfile.num_io_calls - before == 2, "a half transfer, then one that makes no progress"
    on_disk = np.concatenate([file_bytes(live(dfile), 0), file_bytes(live(dfile), 1)])
    assert np.array_equal(on_disk[:SLOT], data[0]), "the first half was really written"
    assert not on_disk[SLOT:].any(), "nothing beyond the half was written"


@pytest.mark.parametrize("kind", list(READ_FAULTS))
def test_read_fault_fires_and_negative_control(dfile, kind):
    rng = np.random.default_rng(1)
    src, dst = Staging(2), Staging(2)
    data = src.fill(rng, 2)
    slots = i32(30, 31)
    dfile.write(slots, src.address)
    assert dfile.read(slots, dst.address).all()  # negative control
    dfile._inject_fault(kind)
    with pytest.raises(OSError) as e:
        dfile.read(slots, dst.address)
    assert e.value.errno == READ_FAULTS[kind]
    assert e.value.filename == dfile.path and "30..31" in str(e.value)
    # A read fault changes no entry: the retry succeeds.
    dst.pages[:] = 0
    assert dfile.read(slots, dst.address).all()
    assert np.array_equal(dst.pages, data)


def test_fault_direction_and_after_ios(dfile):
    """A write fault ignores reads; after_ios=k skips k I/O syscalls of its direction."""
    src, dst = Staging(6), Staging(6)
    src.fill(np.random.default_rng(2), 6)
    dfile.write(i32(0, 1, 2, 3, 4, 5), src.address)
    dfile._inject_fault("enospc", after_ios=2)
    dfile.read(i32(0, 2, 4), dst.address)  # three reads: no effect on the write fault
    dfile.write(i32(0), src.address)  # write 1
    dfile.write(i32(1), src.address)  # write 2
    with pytest.raises(OSError) as e:
        dfile.write(i32(2), src.address)  # write 3: fires
    assert e.value.errno == errno.ENOSPC
    dfile.write(i32(2), src.address)
    # Read faults likewise.
    dfile._inject_fault("eio_read", after_ios=1)
    dfile.write(i32(3), src.address)
    dfile.read(i32(0), dst.address)
    with pytest.raises(OSError):
        dfile.read(i32(1), dst.address)
    dfile.read(i32(1), dst.address)
    # Cleared faults do not fire.
    dfile._inject_fault("eio_read")
    dfile._inject_fault("enospc")
    dfile._clear_faults()
    dfile.write(i32(4), src.address)
    assert dfile.read(i32(4), dst.address).all()


def test_failed_write_partial_effects_as_documented(dfile):
    """Runs before the failure are written and valid; the failing run reads as missing; runs after
    it are untouched (old bytes, old entries)."""
    rng = np.random.default_rng(4)
    src, dst = Staging(6), Staging(6)
    old = src.fill(rng, 6)
    slots = i32(0, 1, 10, 11, 20, 21)  # three runs
    dfile.write(slots, src.address)
    new = src.fill(rng, 6)
    dfile._inject_fault("enospc", after_ios=1)  # the second run fails
    with pytest.raises(OSError) as e:
        dfile.write(slots, src.address)
    assert e.value.errno == errno.ENOSPC and "10..11" in str(e.value)
    ok = dfile.read(slots, dst.address)
    assert list(ok) == [True, True, False, False, True, True]
    assert np.array_equal(dst.pages[:2], new[:2])
    assert np.array_equal(dst.pages[4:], old[4:])


def test_fault_hook_arguments(dfile):
    with pytest.raises(ValueError, match="unknown fault kind"):
        dfile._inject_fault("disk_on_fire")
    with pytest.raises(ValueError, match="after_ios"):
        dfile._inject_fault("enospc", after_ios=-1)


def test_fault_counts_are_per_syscall_within_a_run(dfile):
    """short_read inside a multi-page run: the half transfer and the zero count as two I/Os."""
    src, dst = Staging(4), Staging(4)
    src.fill(np.random.default_rng(5), 4)
    dfile.write(i32(0, 1, 2, 3), src.address)
    before = dfile.num_io_calls
    dfile._inject_fault("short_read")
    with pytest.raises(OSError):
        dfile.read(i32(0, 1, 2, 3), dst.address)
    assert dfile.num_io_calls - before == 2


# ---------------------------------------------------------------------------------------------
# Lifetime and the GIL.


def test_close_is_idempotent_and_leaves_no_file(tmp_path):
    path = str(tmp_path / "c.kvcm")
    f = _kvcm_cpu.DiskFile(path, 4, SLOT)
    assert not os.path.exists(path) and f.fileno >= 0
    f.close()
    assert not os.path.exists(path) and f.closed and f.fileno == -1
    f.close()
    src = Staging(1)
    for call in (lambda: f.write(i32(0), src.address), lambda: f.read(i32(0), src.address),
                 lambda: f.invalidate(i32(0))):
        with pytest.raises(ValueError, match="closed"):
            call()


def test_destruction_removes_file(tmp_path):
    path = str(tmp_path / "d.kvcm")
    f = _kvcm_cpu.DiskFile(path, 4, SLOT)
    del f
    assert not os.path.exists(path)


def test_killed_process_leaves_no_file(tmp_path):
    """The file's name is gone as soon as it is created: a process killed with its pool open
    leaves nothing (it used to leave the whole preallocation behind)."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        from jax_kvcm._disk_tier import DiskPool
        p = DiskPool({str(tmp_path)!r}, "killed", 256, 4096)
        print(os.listdir({str(tmp_path)!r}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == -9, r.stderr
    assert r.stdout.strip() == "[]"
    assert os.listdir(tmp_path) == []


def test_gil_released_during_io(tmp_path):
    """A Python thread keeps running while a large write and read run in native code.

    The spinning thread timestamps its progress. With the GIL held by the call it could run at most
    one switch interval right after the call starts or right before ``t1`` is taken (a pending
    drop request), so only samples deeper than two intervals inside the call count.
    """
    slot = 1 << 20
    n = 192
    f = _kvcm_cpu.DiskFile(str(tmp_path / "big.kvcm"), n, slot)
    src = _kvcm_cpu.HostBuffer(n * slot)
    src.view()[::4096] = 7
    slots = np.arange(n, dtype=np.int32)[::-1].copy()  # n runs: more syscalls, longer call
    samples: list[float] = []
    stop = threading.Event()

    def spin():
        i = 0
        while not stop.is_set():
            i += 1
            if i % 64 == 0:
                samples.append(time.perf_counter())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    t = threading.Thread(target=spin, daemon=True)
    t.start()
    calls = []
    try:
        time.sleep(0.01)
        for op in ("write", "read"):
            t0 = time.perf_counter()
            if op == "write":
                f.write(slots, src.address)
            else:
                assert f.read(slots, src.address).all()
            calls.append((op, t0, time.perf_counter()))
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
        f.close()
    margin = 2 * 0.005
    ts = np.array(samples)
    for op, t0, t1 in calls:
        if t1 - t0 < 3 * margin:
            pytest.skip(f"{op} took only {(t1 - t0) * 1e3:.1f} ms: too fast to tell")
        inside = int(np.count_nonzero((ts > t0 + margin) & (ts < t1 - margin)))
        assert inside >= 10, (f"{op}: the other thread made {inside} steps in the middle "
                              f"{(t1 - t0 - 2 * margin) * 1e3:.1f} ms of the call")


# ---------------------------------------------------------------------------------------------
# DiskPool.


def test_pool_round_trip_and_errors(tmp_path):
    rng = np.random.default_rng(0)
    with DiskPool(tmp_path, "g0", 16, SLOT) as pool:
        assert pool.path == str(tmp_path / "g0.kvcm") and not os.path.exists(pool.path)
        assert os.fstat(pool.fileno).st_size == 16 * SLOT
        assert (pool.num_slots, pool.slot_bytes, pool.num_free) == (16, SLOT, 16)
        slots = pool.allocate(5)
        assert slots.dtype == np.int32 and list(slots) == [0, 1, 2, 3, 4]
        assert pool.num_free == 11
        src, dst = Staging(5), Staging(5)
        data = src.fill(rng, 5)
        before = pool.num_io_calls
        pool.write(slots, src.address)
        assert pool.num_io_calls - before == 1, "lowest-first slots coalesce into one write"
        assert pool.read(slots, dst.address).all()
        assert np.array_equal(dst.pages, data)
        assert pool.read(slots.tolist(), dst.address).all(), "lists of ints are accepted"
        # Freed slots never read as valid, even when reallocated.
        pool.free(slots[2:3])
        with pytest.raises(ValueError, match="not allocated"):
            pool.read(slots[2:3], dst.address)
        again = pool.allocate(1)
        assert list(again) == [2]
        assert not pool.read(again, dst.address)[0]
        pool.invalidate(slots[:1])
        assert list(pool.read(slots[:2], dst.address)) == [False, True]
        with pytest.raises(ValueError, match="double free|not allocated"):
            pool.free([7])
        assert pool.allocate(100) is None and pool.num_free == 11
        with pytest.raises(ValueError, match="out of range"):
            pool.write([16], src.address)
        with pytest.raises(ValueError, match="integers"):
            pool.write(np.array([0.0]), src.address)
    assert pool.closed and not os.path.exists(str(tmp_path / "g0.kvcm"))
    pool.close()
    with pytest.raises(ValueError, match="closed"):
        pool.allocate(1)


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_pool_typed_errors(pool, kind):
    slots = pool.allocate(2)
    src = Staging(2)
    src.fill(np.random.default_rng(0), 2)
    pool.write(slots, src.address)
    assert pool.read(slots, src.address).all()  # negative control
    pool._inject_fault(kind)
    op = pool.write if kind in WRITE_FAULTS else pool.read
    want = DiskFullError if kind == "enospc" else DiskIOError
    with pytest.raises(want) as e:
        op(slots, src.address)
    assert isinstance(e.value, OSError) and e.value.filename == pool.path
    assert e.value.errno == (errno.ENOSPC if kind == "enospc" else errno.EIO)
    if kind != "enospc":
        assert not isinstance(e.value, DiskFullError)


def test_pool_directory_and_name_validation(tmp_path):
    with pytest.raises(ValueError, match="directory"):
        DiskPool(tmp_path / "missing", "g", 4, SLOT)
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(ValueError, match="directory"):
        DiskPool(tmp_path / "afile", "g", 4, SLOT)
    for bad in ("", "a/b", "..", "."):
        with pytest.raises(ValueError, match="name"):
            DiskPool(tmp_path, bad, 4, SLOT)
    with pytest.raises(ValueError, match="num_slots"):
        DiskPool(tmp_path, "g", 0, SLOT)
    (tmp_path / "g.kvcm").write_bytes(b"")  # not ours: refused, and left alone
    with pytest.raises(DiskIOError) as e:
        DiskPool(tmp_path, "g", 4, SLOT)
    assert e.value.errno == errno.EEXIST
    os.unlink(tmp_path / "g.kvcm")
    with DiskPool(tmp_path, "g", 4, SLOT), DiskPool(tmp_path, "g", 4, SLOT):
        pass  # the first one's name is already gone
    assert os.listdir(tmp_path) == ["afile"]


def _can_mount_tmpfs(tmp_path) -> bool:
    if shutil.which("unshare") is None:
        return False
    mnt = tmp_path / "probe"
    mnt.mkdir()
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                        f"mount -t tmpfs -o size=1m tmpfs {mnt}"], capture_output=True)
    return r.returncode == 0


def test_real_enospc_on_a_tiny_filesystem(tmp_path):
    """posix_fallocate on a 1 MiB tmpfs (mounted in a private user+mount namespace) -> ENOSPC:
    DiskFullError, and the half-created file is gone."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("cannot mount a private tmpfs here (needs unshare and user namespaces)")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    script = textwrap.dedent(f"""
        import errno, os
        from jax_kvcm._disk_tier import DiskFullError, DiskPool
        try:
            DiskPool({str(mnt)!r}, "big", 1000, 4096)
        except DiskFullError as e:
            assert e.errno == errno.ENOSPC, e
            assert os.listdir({str(mnt)!r}) == [], os.listdir({str(mnt)!r})
        else:
            raise SystemExit("no DiskFullError")
        with DiskPool({str(mnt)!r}, "small", 16, 4096) as p:  # negative control: it fits
            assert os.fstat(p.fileno).st_size == 16 * 4096
        print("OK")
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                        f'mount -t tmpfs -o size=1m tmpfs {mnt} && exec "$0" -c "$1"',
                        sys.executable, script], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# Multi-threaded I/O: a call's pieces spread over threads give the same bytes, checksums, syscall
# counts and (injected) failures as one thread.

THREADS = 4


def tuned_file(path, threads: int, piece_pages: int, num_slots: int = 64) -> _kvcm_cpu.DiskFile:
    """A DiskFile cutting runs every ``piece_pages`` pages and using a thread per piece."""
    f = _kvcm_cpu.DiskFile(str(path), num_slots, SLOT, threads)
    f._io_piece_bytes = piece_pages * SLOT
    f._min_thread_bytes = 1
    return f


def pieces_of(slots, pages, piece_pages: int) -> list[list[int]]:
    """The slots of each piece: runs adjacent on disk and in memory, cut every piece_pages."""
    out: list[list[int]] = []
    for i, s in enumerate(slots):
        if (out and len(out[-1]) < piece_pages and s == slots[i - 1] + 1
                and pages[i] == pages[i - 1] + 1):
            out[-1].append(int(s))
        else:
            out.append([int(s)])
    return out


def piece_text(piece: list[int]) -> str:
    return f"slot {piece[0]}" if len(piece) == 1 else f"slots {piece[0]}..{piece[-1]}"


def random_runs(rng: np.random.Generator, n: int, num_slots: int) -> np.ndarray:
    """``n`` distinct slots in runs of 1..6 adjacent slots, runs in random order."""
    slots: list[int] = []
    while len(slots) < n:
        start = int(rng.integers(0, num_slots))
        slots += [s for s in range(start, min(start + int(rng.integers(1, 7)), num_slots))
                  if s not in slots]
    return np.array(slots[:n], np.int32)


def random_pages(rng: np.random.Generator, n: int, capacity: int) -> np.ndarray:
    """Host page numbers: contiguous, sorted-with-gaps or shuffled (distinct, < capacity)."""
    kind = int(rng.integers(0, 3))
    if kind == 0:
        start = int(rng.integers(0, capacity - n + 1))
        return np.arange(start, start + n, dtype=np.int32)
    pages = rng.choice(capacity, n, replace=False).astype(np.int32)
    return np.sort(pages) if kind == 1 else pages


def whole_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("seed", SEEDS)
def test_threads_match_one_thread_byte_for_byte(tmp_path, seed):
    """Random writes and reads (runs, scattered host pages, a duplicated slot now and then) on a
    one-thread file and a THREADS-thread file: identical files, masks, read bytes, syscall counts;
    and the bytes are the ones written (last write wins)."""
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    piece_pages = 2
    files = {t: tuned_file(tmp_path / f"t{t}.kvcm", t, piece_pages) for t in (1, THREADS)}
    src = Staging(48)
    dst = {t: Staging(64) for t in files}  # NOTE: the last read takes every slot of the file
    expected: dict[int, np.ndarray] = {}
    try:
        for step in range(10):
            n = int(rng.integers(2, 41))
            slots = random_runs(rng, n, 64)
            if step % 4 == 3:  # a slot written twice in one call: the later page wins
                slots = np.concatenate([slots, slots[:1]]).astype(np.int32)
            pages = random_pages(rng, len(slots), 48)
            data = src.fill(rng, 48)
            calls = {}
            for t, f in files.items():
                before = f.num_io_calls
                f.write(slots, src.address, pages)
                calls[t] = (f.num_io_calls - before, f._last_workers)
            for i, s in enumerate(slots):
                expected[int(s)] = data[pages[i]]
            num_pieces = len(pieces_of(slots, pages, piece_pages))
            assert calls[1][0] == calls[THREADS][0] == num_pieces, f"seed={seed} step={step}"
            if step % 4 != 3:  # duplicates run in order on one thread
                assert calls[THREADS][1] == min(THREADS, num_pieces), f"seed={seed}: {calls}"
            # Read every slot written so far, in a random order, into scattered host pages.
            order = rng.permutation(np.array(sorted(expected), np.int32))[:48]
            dpages = random_pages(rng, len(order), 48)
            masks = {}
            for t, f in files.items():
                dst[t].pages[:] = 0xA5
                masks[t] = f.read(order, dst[t].address, dpages)
            assert masks[1].all() and masks[THREADS].all(), f"seed={seed} step={step}"
            assert np.array_equal(dst[1].pages, dst[THREADS].pages), f"seed={seed} step={step}"
            for i, s in enumerate(order):
                assert np.array_equal(dst[1].pages[dpages[i]], expected[int(s)]), (
                    f"slot {s} seed={seed} step={step}")
        assert whole_file(live(files[1])) == whole_file(live(files[THREADS])), f"seed={seed}"
        # A flipped bit is a miss on both, for exactly that page.
        victim = int(rng.choice(sorted(expected)))
        offset = victim * SLOT + int(rng.integers(0, SLOT))
        order = np.array(sorted(expected), np.int32)
        for t, f in files.items():
            flip_byte(live(f), offset)
            got = f.read(order, dst[t].address)
            assert np.array_equal(got, order != victim), f"threads={t} seed={seed}"
    finally:
        for f in files.values():
            f.close()


# Three runs, cut every 2 pages: pieces [0, 1] [2, 3] [4] [10, 11] [12, 13] [20, 21] [22].
FAULT_SLOTS = i32(0, 1, 2, 3, 4, 10, 11, 12, 13, 20, 21, 22)
FAULT_PIECES = pieces_of(FAULT_SLOTS, np.arange(12), 2)


@pytest.mark.parametrize("after", [0, 3, 6])
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_threads_injected_fault_matches_one_thread(tmp_path, kind, after):
    """An injected fault in the piece of one thread: the same typed error naming that piece, the
    same syscalls, and the same state as with one thread (pieces before: written and valid; the
    failing piece: missing; pieces after: untouched, never issued); a retry succeeds."""
    assert len(FAULT_PIECES) == 7
    rng = np.random.default_rng(after)
    files = {t: tuned_file(tmp_path / f"t{t}.kvcm", t, 2) for t in (1, THREADS)}
    src, old = Staging(12), None
    dst = {t: Staging(12) for t in files}
    is_write = kind in WRITE_FAULTS
    want_errno = WRITE_FAULTS[kind] if is_write else READ_FAULTS[kind]
    failing = FAULT_PIECES[after]
    try:
        old = src.fill(rng, 12)
        for f in files.values():
            f.write(FAULT_SLOTS, src.address)
        new = src.fill(rng, 12)
        states = {}
        for t, f in files.items():
            dst[t].pages[:] = 0x5A
            f._inject_fault(kind, after_ios=after)
            before = f.num_io_calls
            with pytest.raises(OSError) as e:
                if is_write:
                    f.write(FAULT_SLOTS, src.address)
                else:
                    f.read(FAULT_SLOTS, dst[t].address)
            assert e.value.errno == want_errno, (t, e.value)
            assert piece_text(failing) in str(e.value), (t, str(e.value))
            # Nothing after the failing piece is issued, so `after + 1` pieces ran.
            assert f._last_workers == min(t, after + 1), (t, f._last_workers)
            syscalls = f.num_io_calls - before
            landed = dst[t].pages.copy()  # what the failed read put in host memory
            check = Staging(12)
            mask = f.read(FAULT_SLOTS, check.address)
            states[t] = dict(syscalls=np.array(syscalls), landed=landed, mask=mask,
                             pages=check.pages.copy(),
                             file=np.frombuffer(whole_file(live(f)), np.uint8))
        for name, value in states[1].items():
            assert np.array_equal(states[THREADS][name], value), f"{name} differs"
        # The one-thread state is the documented sequential one.
        landed, mask, pages = (states[1][k] for k in ("landed", "mask", "pages"))
        index = 0
        for p, piece in enumerate(FAULT_PIECES):
            for _ in piece:
                if is_write:
                    assert mask[index] == (p != after), (p, index)
                    if p < after:
                        assert np.array_equal(pages[index], new[index])
                    elif p > after:
                        assert np.array_equal(pages[index], old[index]), "touched after the fault"
                else:
                    assert mask[index], "a failed read changed an entry"
                    if p < after:
                        assert np.array_equal(landed[index], old[index])
                    elif p > after:
                        assert (landed[index] == 0x5A).all(), "read after the fault"
                index += 1
        # One-shot: a retry succeeds on both.
        for t, f in files.items():
            if is_write:
                f.write(FAULT_SLOTS, src.address)
            assert f.read(FAULT_SLOTS, dst[t].address).all()
            assert np.array_equal(dst[t].pages, new if is_write else old)
    finally:
        for f in files.values():
            f.close()


def test_io_threads_setting(tmp_path):
    default = max(1, min(8, os.cpu_count() or 1))
    f = _kvcm_cpu.DiskFile(str(tmp_path / "a.kvcm"), 4, SLOT)
    try:
        assert f.io_threads == default
        f.io_threads = 3
        assert f.io_threads == 3
        f.io_threads = 0
        assert f.io_threads == default
        with pytest.raises(ValueError, match="io_threads"):
            f.io_threads = -1
        for hook in ("_io_piece_bytes", "_min_thread_bytes"):
            with pytest.raises(ValueError, match=hook):
                setattr(f, hook, 0)
    finally:
        f.close()
    with pytest.raises(ValueError, match="io_threads"):
        _kvcm_cpu.DiskFile(str(tmp_path / "b.kvcm"), 4, SLOT, -2)
    assert not os.path.exists(tmp_path / "b.kvcm")
    with DiskPool(tmp_path, "p", 4, SLOT, io_threads=2) as pool:
        assert pool.io_threads == 2
    with DiskPool(tmp_path, "q", 4, SLOT) as pool:
        assert pool.io_threads == default
    with pytest.raises(ValueError, match="io_threads"):
        DiskPool(tmp_path, "r", 4, SLOT, io_threads=0)


@pytest.mark.parametrize("bad, match", [
    (np.array([0, 1], np.int64), "src_pages"),
    (np.array([0], np.int32), "src_pages"),
    (np.array([0, -1], np.int32), r"src_pages\[1\] = -1"),
    ([0, 1], "src_pages"),
])
def test_bad_host_pages_rejected_before_io(dfile, bad, match):
    src = Staging(2)
    before = dfile.num_io_calls
    with pytest.raises(ValueError, match=match):
        dfile.write(i32(0, 1), src.address, bad)
    with pytest.raises(ValueError, match=match.replace("src", "dst")):
        dfile.read(i32(0, 1), src.address, bad)
    assert dfile.num_io_calls == before
    assert not dfile.read(i32(0, 1), src.address).any(), "a refused write recorded entries"


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_pool_threaded_typed_errors(tmp_path, kind):
    """DiskPool with several threads and one page per piece: the fault in the third piece is the
    same typed error as with one thread; the pool's slots stay allocated (the caller frees)."""
    with DiskPool(tmp_path, "t", 16, SLOT, io_threads=THREADS) as pool:
        pool._set_io_tuning(piece_bytes=1, min_thread_bytes=1)
        slots = pool.allocate(6)
        src = Staging(12)
        src.fill(np.random.default_rng(3), 12)
        pages = i32(11, 3, 7, 0, 5, 9)  # scattered host pages: six pieces
        pool.write(slots, src.address, pages)
        assert pool.read(slots, src.address, pages).all()  # negative control
        pool._inject_fault(kind, after_ios=2)
        op = pool.write if kind in WRITE_FAULTS else pool.read
        want = DiskFullError if kind == "enospc" else DiskIOError
        with pytest.raises(want) as e:
            op(slots, src.address, pages)
        assert e.value.errno == (errno.ENOSPC if kind == "enospc" else errno.EIO)
        assert e.value.filename == pool.path and f"slot {slots[2]}" in str(e.value)
        assert pool._file._last_workers == 3
        assert pool.num_free == 10
