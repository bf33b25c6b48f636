"""The native reservation (ffi/runtime) through its Python API, on both physical backends:
memfd (``_kvcm_cpu.Reservation``, here) and CUDA VMM (``_kvcm_cuda.Reservation``, marked ``gpu``:
``pytest -m gpu tests/tiers/test_reservation.py`` on the GPU machine, where it fails rather than skips
when it cannot run).

Oracles: numpy bytes written through ``write`` and read back through ``read``, through another
offset mapping the same handle, or through a DLPack view; the counters; and, after a refused or
failed call, the table and the counters exactly as before it.
"""

from __future__ import annotations

import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvcm import _ffi

DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "int32", "int8", "uint8"]
PAGES = 8


@pytest.fixture(params=["memfd", pytest.param("vmm", marks=pytest.mark.gpu)])
def native(request):
    if request.param == "memfd":
        return _ffi._kvcm_cpu
    if jax.default_backend() != "gpu" or not _ffi.cuda_extension_available():
        pytest.fail(f"needs a GPU and the CUDA extension (backend {jax.default_backend()}, "
                    f"{_ffi.CUDA_IMPORT_ERROR})")
    return _ffi._kvcm_cuda


@pytest.fixture
def res(native):
    sp = native.reservation_granularity()
    r = native.Reservation(PAGES * sp, sp)
    yield r
    r.close()


def write(r, offset: int, data: np.ndarray) -> None:
    data = np.ascontiguousarray(data)
    r.write(offset, data.ctypes.data, data.nbytes)


def read(r, offset: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    r.read(offset, out.ctypes.data, nbytes)
    return out


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def state(r) -> tuple:
    """Everything a refused or rolled-back call must leave as it was."""
    sp = r.super_page_bytes
    return (tuple(r.handle_at(i * sp) for i in range(PAGES)), r.num_map_calls,
            r.num_unmap_calls, r.num_create_calls, r.num_release_calls, r.num_physical,
            r.mapped_bytes, r.physical_bytes)


# -- geometry -----------------------------------------------------------------------------------


def test_backend_geometry_and_dtypes(native, res):
    sp = res.super_page_bytes
    assert res.nbytes == PAGES * sp and res.base != 0 and not res.closed
    if native is _ffi._kvcm_cpu:
        assert res.backend == "memfd" and res.device == -1
        assert sp == os.sysconf("SC_PAGE_SIZE")
    else:
        assert res.backend == "vmm" and res.device >= 0 and sp % (2 << 20) == 0
    assert list(res.dtypes) == DTYPES and list(type(res).dtypes) == DTYPES


# -- round trips and counters -------------------------------------------------------------------


def test_round_trip_aliasing_and_counters(res):
    sp = res.super_page_bytes
    h0, h1 = res.create_physical(), res.create_physical()
    res.map(0, h0)
    res.map(sp, h1)
    res.map(5 * sp, h0)  # the same physical super-page at a second offset
    assert [res.is_mapped(i * sp) for i in range(PAGES)] == [i in (0, 1, 5) for i in range(PAGES)]
    assert (res.handle_at(0), res.handle_at(sp), res.handle_at(5 * sp), res.handle_at(2 * sp)) == \
        (h0, h1, h0, -1)
    data = random_bytes(2 * sp)
    write(res, 0, data)  # one copy across two super-pages
    np.testing.assert_array_equal(read(res, 0, 2 * sp), data)
    np.testing.assert_array_equal(read(res, 5 * sp, sp), data[:sp])  # seen through the alias
    write(res, 5 * sp + 8, data[:16])  # written through the alias, seen at offset 0
    np.testing.assert_array_equal(read(res, 8, 16), data[:16])
    assert (res.num_map_calls, res.num_unmap_calls, res.num_create_calls,
            res.num_release_calls) == (3, 0, 2, 0)
    assert res.mapped_bytes == 3 * sp and res.physical_bytes == 2 * sp and res.num_physical == 2
    for off in (0, sp, 5 * sp):
        res.unmap(off)
    res.release_physical(h0)
    res.release_physical(h1)
    assert (res.num_map_calls, res.num_unmap_calls, res.num_create_calls,
            res.num_release_calls) == (3, 3, 2, 2)
    assert res.mapped_bytes == 0 and res.physical_bytes == 0 and res.num_physical == 0
    h = res.create_physical()
    assert h in (h0, h1)  # a freed handle comes back
    res.map(3 * sp, h)
    if res.backend == "memfd":  # memfd holes are punched: reused memory reads zero
        assert not read(res, 3 * sp, sp).any()


def test_batch_calls_round_trip_and_count_super_pages(res):
    sp = res.super_page_bytes
    handles = res.create_physical_many(4)
    assert len(set(handles)) == 4 and res.num_create_calls == 4 and res.num_physical == 4
    offsets = [2 * sp, 3 * sp, 4 * sp, 5 * sp]
    res.map_many(np.asarray(offsets), np.asarray(handles))  # any int sequence
    assert [res.handle_at(o) for o in offsets] == handles and res.num_map_calls == 4
    data = random_bytes(4 * sp, seed=1)
    write(res, 2 * sp, data)
    np.testing.assert_array_equal(read(res, 2 * sp, 4 * sp), data)
    res.unmap_many(offsets[1:3])
    assert [res.is_mapped(o) for o in offsets] == [True, False, False, True]
    assert res.num_unmap_calls == 2 and res.mapped_bytes == 2 * sp
    res.map_many([6 * sp, 7 * sp], [handles[0], handles[0]])  # one handle, two more offsets
    np.testing.assert_array_equal(read(res, 7 * sp, sp), data[:sp])
    res.unmap_many([2 * sp, 5 * sp, 6 * sp, 7 * sp])
    res.release_physical_many(handles)
    assert (res.num_map_calls, res.num_unmap_calls, res.num_create_calls,
            res.num_release_calls) == (6, 6, 4, 4)
    assert res.num_physical == 0 and res.mapped_bytes == 0
    assert sorted(res.create_physical_many(4)) == sorted(handles)  # freed handles come back
    assert res.create_physical_many(0) == [] and res.num_create_calls == 8
    res.map_many([], [])
    res.unmap_many([])
    res.release_physical_many([])


# -- all or nothing -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mapped", "outside", "misaligned", "negative", "repeated",
                                  "dead handle", "lengths"])
def test_map_many_refuses_a_bad_pair_and_maps_nothing(res, case):
    sp = res.super_page_bytes
    h = res.create_physical()
    res.map(2 * sp, h)
    offsets, handles = [0, sp, 3 * sp], [h, h, h]
    match = {"mapped": r"offsets\[2\] = \d+ is already mapped",
             "outside": r"offsets\[2\] must be a multiple of super_page_bytes",
             "misaligned": r"offsets\[1\] must be a multiple of super_page_bytes",
             "negative": r"offsets\[2\] must be a multiple of super_page_bytes",
             "repeated": r"offsets\[2\] = 0 repeats offsets\[0\]",
             "dead handle": r"handles\[2\] = 99 is not a live physical handle",
             "lengths": r"offsets and handles must have the same length, got 3 and 2"}[case]
    if case == "mapped":
        offsets[2] = 2 * sp
    elif case == "outside":
        offsets[2] = PAGES * sp
    elif case == "misaligned":
        offsets[1] = sp + 8
    elif case == "negative":
        offsets[2] = -sp
    elif case == "repeated":
        offsets[2] = 0
    elif case == "dead handle":
        handles[2] = 99
    else:
        handles = handles[:2]
    before = state(res)
    with pytest.raises(ValueError, match=match):
        res.map_many(offsets, handles)
    assert state(res) == before


def test_map_many_rolls_back_a_failure_part_way(res):
    sp = res.super_page_bytes
    handles = res.create_physical_many(4)
    res.map(0, handles[0])
    before = state(res)
    res._inject_fault("map", 2)  # the third map of the batch fails as a driver would
    with pytest.raises(MemoryError, match="injected fault: map"):
        res.map_many([sp, 2 * sp, 3 * sp, 4 * sp], handles)
    assert state(res) == before  # the two mapped first were unmapped, the counters restored
    res.map_many([sp, 2 * sp, 3 * sp, 4 * sp], handles)  # the fault fired once
    assert res.num_map_calls == 5


def test_create_physical_many_is_all_or_nothing(res):
    sp = res.super_page_bytes
    first = res.create_physical()
    freed = res.create_physical_many(2)
    res.release_physical_many(freed)
    before = state(res)
    res._inject_fault("create", 3)
    with pytest.raises(MemoryError, match="injected fault: create"):
        res.create_physical_many(5)
    assert state(res) == before
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        res.create_physical_many(-1)
    again = res.create_physical_many(3)
    assert first not in again and set(freed) <= set(again)
    res.map_many([0, sp, 2 * sp], again)  # all live


def test_release_and_unmap_many_check_every_argument_first(res):
    sp = res.super_page_bytes
    a, b, c = res.create_physical_many(3)
    res.map(0, b)
    res.map(sp, c)
    before = state(res)
    for handles, match in (([a, b], r"handles\[1\] = \d+ is still mapped at 1 offset\(s\)"),
                           ([a, a], r"handles\[1\] = \d+ repeats handles\[0\]"),
                           ([a, 12345], r"handles\[1\] = 12345 is not a live physical handle"),
                           ([a, -1], r"handles\[1\] = -1 is not a live physical handle")):
        with pytest.raises(ValueError, match=match):
            res.release_physical_many(handles)
        assert state(res) == before
    for offsets, match in (([0, 2 * sp], r"offsets\[1\] = \d+ is not mapped"),
                           ([sp, sp], r"offsets\[1\] = \d+ repeats offsets\[0\]"),
                           ([0, sp + 1], r"offsets\[1\] must be a multiple")):
        with pytest.raises(ValueError, match=match):
            res.unmap_many(offsets)
        assert state(res) == before


# -- errors -------------------------------------------------------------------------------------


def test_errors_name_the_argument(native, res):
    sp = res.super_page_bytes
    for args, match in (((PAGES * sp, sp // 2), "super_page_bytes must be a positive multiple"),
                        ((PAGES * sp, 0), "super_page_bytes must be a positive multiple"),
                        ((sp + 1, sp), "nbytes must be a positive multiple"),
                        ((0, sp), "nbytes must be a positive multiple")):
        with pytest.raises(ValueError, match=match):
            native.Reservation(*args)
    h = res.create_physical()
    res.map(0, h)
    buf = np.zeros(2 * sp, np.uint8)
    calls = [
        (lambda: res.map(sp + 8, h), "offset must be a multiple of super_page_bytes"),
        (lambda: res.map(PAGES * sp, h), "offset must be a multiple of super_page_bytes"),
        (lambda: res.map(-sp, h), "offset must be a multiple of super_page_bytes"),
        (lambda: res.map(sp, 99), "handle 99 is not a live physical handle"),
        (lambda: res.map(0, h), "offset 0 is already mapped"),
        (lambda: res.unmap(sp), f"offset {sp} is not mapped"),
        (lambda: res.release_physical(99), "handle 99 is not a live physical handle"),
        (lambda: res.release_physical(h), f"handle {h} is still mapped at 1 offset"),
        (lambda: res.handle_at(sp + 1), "offset must be a multiple"),
        (lambda: res.is_mapped(-1), "offset must be a multiple"),
        (lambda: res.read(-1, buf.ctypes.data, 1), "offset must be inside the reservation"),
        (lambda: res.read(0, buf.ctypes.data, PAGES * sp + 1), "nbytes must be >= 0 and end"),
        (lambda: res.read(sp, buf.ctypes.data, PAGES * sp), "nbytes must be >= 0 and end"),
        (lambda: res.write(0, buf.ctypes.data, -1), "nbytes must be >= 0 and end"),
        (lambda: res.read(0, 0, 8), "dst_address is null"),
        (lambda: res.write(0, 0, 8), "src_address is null"),
        (lambda: res.read(0, buf.ctypes.data, 2 * sp), f"unmapped super-page at offset {sp}"),
        (lambda: res.dlpack(0, [8], "float64"), "dtype must be one of float32, .*float8_e4m3fn"),
        (lambda: res.dlpack(PAGES * sp - 4, [8], "uint8"), "outside the reservation"),
        (lambda: res.dlpack(-4, [8], "uint8"), "outside the reservation"),
        (lambda: res.dlpack(0, [1 << 40, 1 << 40], "float32"), "more bytes than 64 bits"),
        (lambda: res._inject_fault("unmap"), 'kind must be "create" or "map"'),
    ]
    before = state(res)
    for call, match in calls:
        with pytest.raises(ValueError, match=match):
            call()
    assert state(res) == before
    res.read(sp, buf.ctypes.data, 0)  # an empty copy touches nothing


def test_address_space_exhaustion_is_a_memory_error(native):
    sp = native.reservation_granularity()
    with pytest.raises(MemoryError, match="address space"):
        native.Reservation((1 << 62) // sp * sp, sp)


# -- close --------------------------------------------------------------------------------------


def test_close_unmaps_releases_and_refuses_further_use(res):
    sp = res.super_page_bytes
    handles = res.create_physical_many(3)
    res.map_many([0, sp, 4 * sp], [handles[0], handles[1], handles[0]])
    res.close()
    assert res.closed and res.mapped_bytes == 0 and res.physical_bytes == 0
    assert (res.num_map_calls, res.num_unmap_calls, res.num_create_calls,
            res.num_release_calls) == (3, 3, 3, 3)
    assert not res.is_mapped(0) and not res.is_mapped(sp + 1)  # closed: nothing is mapped
    res.close()  # idempotent
    assert res.num_unmap_calls == 3 and res.num_release_calls == 3
    buf = np.zeros(8, np.uint8)
    for call in (res.create_physical, lambda: res.create_physical_many(1),
                 lambda: res.release_physical(handles[2]),
                 lambda: res.release_physical_many(handles), lambda: res.map(0, handles[0]),
                 lambda: res.map_many([0], [handles[0]]), lambda: res.unmap(0),
                 lambda: res.unmap_many([0]), lambda: res.handle_at(0),
                 lambda: res.read(0, buf.ctypes.data, 8), lambda: res.write(0, buf.ctypes.data, 8),
                 lambda: res.dlpack(0, [8], "uint8"), res.view):
        with pytest.raises(ValueError, match="the arena reservation is closed"):
            call()


# -- zero-copy views ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_dlpack_view_is_zero_copy_with_the_written_contents(res, dtype):
    sp = res.super_page_bytes
    res.map_many([sp, 2 * sp], res.create_physical_many(2))
    np_dtype = np.dtype(jnp.dtype(dtype))
    values = random_bytes(sp, seed=2).view(np_dtype)  # every bit pattern, NaNs included
    offset = sp + sp // 2  # across the super-page boundary at 2 * sp
    write(res, offset, values.view(np.uint8))
    x = jax.dlpack.from_dlpack(res.dlpack(offset, [values.size], dtype))
    assert x.dtype == np_dtype and x.shape == values.shape
    assert x.unsafe_buffer_pointer() == res.base + offset  # no copy
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), values.view(np.uint8))
    grid = jax.dlpack.from_dlpack(res.dlpack(sp, [2, sp // np_dtype.itemsize], dtype))
    half = values.size // 2
    np.testing.assert_array_equal(
        np.asarray(grid).reshape(-1)[half:half + values.size].view(np.uint8),
        values.view(np.uint8))


def test_host_views_keep_the_reservation_alive(native):
    sp = native.reservation_granularity()
    r = native.Reservation(PAGES * sp, sp)
    r.map(0, r.create_physical())
    if r.backend != "memfd":
        with pytest.raises(ValueError, match="use dlpack"):
            r.view()
        r.close()
        return
    whole = r.view()
    assert whole.shape == (PAGES * sp,) and whole.ctypes.data == r.base
    part = np.from_dlpack(r.dlpack(0, [sp // 4], "float32"))
    part[:] = 1.5  # writable, and the same bytes as the whole view and read()
    assert np.frombuffer(whole[:sp].tobytes(), np.float32).tolist() == [1.5] * (sp // 4)
    np.testing.assert_array_equal(read(r, 0, sp), whole[:sp])
    del r
    gc.collect()
    assert float(part.sum()) == 1.5 * (sp // 4)  # the views hold the memory
    whole[:8] = 3
    assert part.view(np.uint8)[:8].tolist() == [3] * 8
