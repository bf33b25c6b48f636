"""Host tier: HostBuffer / PinnedHostBuffer (native), allocate_host_buffer, HostPool, SlotAllocator."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_kvcm import _ffi, _kvcm_cpu
from jax_kvcm._host_tier import HostOOMError, HostPool, allocate_host_buffer
from jax_kvcm._slots import SlotAllocator, as_slot_array

HUGE = 1 << 60  # more than any machine can map


# ---------------------------------------------------------------------------------------------
# HostBuffer.


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 3 * 4096 + 1, 1 << 20])
@pytest.mark.parametrize("alignment", [1, 64, 4096, 1 << 21])
def test_host_buffer_zeroed_and_aligned(nbytes, alignment):
    b = _kvcm_cpu.HostBuffer(nbytes, alignment)
    assert b.nbytes == nbytes and b.address % alignment == 0 and b.address % 4096 == 0
    assert b.device_address == b.address and b.pinned is False
    v = b.view()
    assert v.dtype == np.uint8 and v.shape == (nbytes,) and v.flags.writeable
    assert v.ctypes.data == b.address, "view() must not copy"
    assert not v.any()


def test_host_buffer_view_keeps_memory_alive():
    b = _kvcm_cpu.HostBuffer(1 << 16)
    v = b.view()
    v[:] = 0xAB
    del b
    gc.collect()
    junk = [_kvcm_cpu.HostBuffer(1 << 16) for _ in range(8)]  # would reuse a freed mapping
    for j in junk:
        j.view()[:] = 0
    assert (v == 0xAB).all()
    v[-1] = 1  # still writable memory


def test_host_buffer_views_share_memory():
    b = _kvcm_cpu.HostBuffer(100)
    b.view()[7] = 42
    assert b.view()[7] == 42


@pytest.mark.parametrize("args, match", [((0,), "nbytes"), ((-5,), "nbytes"),
                                         ((64, 3), "alignment"), ((64, 0), "alignment")])
def test_host_buffer_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        _kvcm_cpu.HostBuffer(*args)


def test_host_buffer_failure_is_memory_error():
    with pytest.raises(MemoryError):
        _kvcm_cpu.HostBuffer(HUGE)


# ---------------------------------------------------------------------------------------------
# PinnedHostBuffer (CUDA builds).


def _cuda():
    if _ffi._kvcm_cuda is None:
        pytest.skip("the CUDA extension is not built")
    return _ffi._kvcm_cuda


def test_pinned_buffer_fails_cleanly_or_works():
    """Without a driver/GPU: MemoryError naming the CUDA calls. With one: pinned, zeroed, mapped."""
    cuda = _cuda()
    try:
        b = cuda.PinnedHostBuffer(3 * 4096 + 5)
    except MemoryError as e:
        assert "cudaHostAlloc" in str(e) and "cudaHostRegister" in str(e), str(e)
        return
    assert b.pinned is True and b.nbytes == 3 * 4096 + 5 and b.device_address != 0
    v = b.view()
    assert v.ctypes.data == b.address and not v.any()


def test_pinned_buffer_bad_arguments():
    cuda = _cuda()
    with pytest.raises(ValueError, match="nbytes"):
        cuda.PinnedHostBuffer(0)


@pytest.mark.gpu
def test_pinned_buffer_on_gpu():
    """On the GPU machine pinned allocation must work (UVA: device address == host address)."""
    cuda = _ffi._kvcm_cuda
    assert cuda is not None, _ffi.CUDA_IMPORT_ERROR
    b = cuda.PinnedHostBuffer((5 << 20) + 3)
    assert b.pinned and b.device_address == b.address and not b.view().any()
    b.view()[:] = 3
    assert (b.view() == 3).all()
    with pytest.raises(MemoryError, match="pinned"):
        cuda.PinnedHostBuffer(HUGE)
    pool = HostPool(4, 4096)
    assert pool.pinned and pool.device_address == pool.base_address


# ---------------------------------------------------------------------------------------------
# allocate_host_buffer.


def test_allocate_plain_and_default_on_cpu():
    b = allocate_host_buffer(1000, pinned=False)
    assert isinstance(b, _kvcm_cpu.HostBuffer) and b.nbytes == 1000
    # JAX_PLATFORMS=cpu (how the CPU suite runs): the default is plain memory.
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        assert allocate_host_buffer(10).pinned is False


def test_default_does_not_initialize_a_backend():
    script = textwrap.dedent("""
        from jax._src import xla_bridge
        from jax_kvcm._host_tier import allocate_host_buffer
        b = allocate_host_buffer(4096)
        assert b.pinned is False
        assert not xla_bridge.backends_are_initialized(), "a backend was initialized"
        print("OK")
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       cwd="/", timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr


def test_allocate_oom_is_typed():
    with pytest.raises(HostOOMError, match="plain host memory") as e:
        allocate_host_buffer(HUGE, pinned=False)
    assert isinstance(e.value, MemoryError)


def test_pinned_without_cuda_extension(monkeypatch):
    monkeypatch.setattr(_ffi, "_kvcm_cuda", None)
    with pytest.raises(RuntimeError, match="CUDA extension"):
        allocate_host_buffer(4096, pinned=True)
    assert allocate_host_buffer(4096).pinned is False  # the default falls back to plain


def test_pinned_without_gpu_is_host_oom():
    cuda = _cuda()
    try:
        cuda.PinnedHostBuffer(4096)
    except MemoryError:
        pass
    else:
        pytest.skip("pinned memory works here (GPU present)")
    with pytest.raises(HostOOMError, match="pinned host memory"):
        allocate_host_buffer(4096, pinned=True)


@pytest.mark.parametrize("bad", [0, -1])
def test_allocate_bad_size(bad):
    with pytest.raises(ValueError, match="nbytes"):
        allocate_host_buffer(bad, pinned=False)


# ---------------------------------------------------------------------------------------------
# HostPool.


def test_host_pool_slots_and_views():
    pool = HostPool(8, 1000, pinned=False)
    assert (pool.num_slots, pool.slot_bytes, pool.num_free, pool.pinned) == (8, 1000, 8, False)
    assert pool.device_address == pool.base_address and pool.base_address % 4096 == 0
    v = pool.view()
    assert v.shape == (8, 1000) and v.dtype == np.uint8 and not v.any()
    assert v.ctypes.data == pool.base_address
    slots = pool.allocate(3)
    assert list(slots) == [0, 1, 2] and pool.num_free == 5
    pool.slot_view(2)[:] = 9
    assert (v[2] == 9).all() and not v[[0, 1, 3]].any()
    assert pool.slot_address(2) == pool.base_address + 2000
    assert pool.slot_view(2).ctypes.data == pool.slot_address(2)
    assert pool.allocate(6) is None and pool.num_free == 5
    pool.free(slots[1:2])
    assert not pool.is_allocated(1) and pool.is_allocated(2)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([1])
    with pytest.raises(ValueError, match="out of range"):
        pool.slot_view(8)
    assert list(pool.allocate(2)) == [1, 3], "lowest free slots first"
    pool.close()
    assert pool.closed
    assert (v[2] == 9).all(), "views outlive close()"
    for call in (lambda: pool.allocate(1), pool.view, lambda: pool.base_address):
        with pytest.raises(ValueError, match="closed"):
            call()
    pool.close()


def test_host_pool_oom_and_arguments():
    with pytest.raises(HostOOMError):
        HostPool(4, 1 << 58, pinned=False)
    with pytest.raises(ValueError, match="num_slots"):
        HostPool(0, 10, pinned=False)
    with pytest.raises(ValueError, match="slot_bytes"):
        HostPool(10, 0, pinned=False)
    with HostPool(2, 10, pinned=False) as pool:
        assert not pool.closed
    assert pool.closed


# ---------------------------------------------------------------------------------------------
# SlotAllocator.


def test_slot_allocator_basics():
    a = SlotAllocator(5)
    assert (a.num_slots, a.num_free) == (5, 5)
    assert a.allocate(0).shape == (0,)
    x = a.allocate(2)
    assert x.dtype == np.int32 and list(x) == [0, 1]
    assert a.allocate(4) is None and a.num_free == 3
    a.free(np.array([1], np.int64))
    assert list(a.allocate(2)) == [1, 2]
    with pytest.raises(ValueError, match="out of range"):
        a.free([5])
    with pytest.raises(ValueError, match="listed twice"):
        a.free([0, 0])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([3])
    with pytest.raises(ValueError, match="integers"):
        a.free([0.0])
    with pytest.raises(ValueError, match="n must be"):
        a.allocate(-1)
    with pytest.raises(ValueError, match="out of range"):
        a.is_allocated(5)
    assert a.num_free == 2 and a.is_allocated(0) and a.is_allocated(2) and not a.is_allocated(3)


def test_as_slot_array():
    assert as_slot_array([]).dtype == np.int32
    assert list(as_slot_array(np.array([3, 4], np.uint64))) == [3, 4]
    with pytest.raises(ValueError, match="int32"):
        as_slot_array([1 << 40])
    with pytest.raises(ValueError, match="1-D"):
        as_slot_array([[1, 2]])
    with pytest.raises(ValueError, match="integers"):
        as_slot_array([True])


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 12)),
        st.tuples(st.just("free"), st.lists(st.integers(0, 1 << 16), max_size=6)),
        st.tuples(st.just("bad_free"), st.integers(-3, 40)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None, print_blob=True)
@given(num_slots=st.integers(1, 32), ops=_OPS)
def test_slot_allocator_model(num_slots, ops):
    """Against a set model: lowest-first ascending allocation, all-or-nothing, exact free counts,
    and refused frees (out of range, double, duplicate) change nothing."""
    a = SlotAllocator(num_slots)
    allocated: set[int] = set()
    for op, arg in ops:
        free = sorted(set(range(num_slots)) - allocated)
        if op == "alloc":
            got = a.allocate(arg)
            if arg > len(free):
                assert got is None
            else:
                assert got.dtype == np.int32 and list(got) == free[:arg]
                allocated |= set(got.tolist())
        elif op == "free":
            # Pick a subset of the allocated slots by index (in a random order).
            owned = sorted(allocated)
            chosen = list(dict.fromkeys(owned[i % len(owned)] for i in arg)) if owned else []
            a.free(np.array(chosen, np.int32))
            allocated -= set(chosen)
        else:  # a free that must be refused: out of range, not allocated, or listed twice
            if 0 <= arg < num_slots and arg in allocated:
                bad = [arg, arg]
            else:
                bad = [arg]
            with pytest.raises(ValueError):
                a.free(bad)
        assert a.num_free == num_slots - len(allocated)
        assert all(a.is_allocated(s) == (s in allocated) for s in range(num_slots))
