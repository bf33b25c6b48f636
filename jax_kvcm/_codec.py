"""Cold-page codecs: hot pages (spread over 2 * num_layers pools) <-> one fixed-size cold blob.

A codec is configured once with every hot pool group's layout, then answers, per layer group: the
fixed size of a cold page (:meth:`ColdPageCodec.cold_page_bytes`), the smallest layer group whose
pages it encodes identically (:meth:`~ColdPageCodec.batching_layer_group_id`), and where its index
pairs must be (:meth:`~ColdPageCodec.page_index_location`). :meth:`~ColdPageCodec.encode` and
:meth:`~ColdPageCodec.decode` are traceable: the storage manager calls them inside small jitted
functions, so the work runs as XLA custom calls on XLA's own stream (CPU: C++, GPU: CUDA).

Codecs are native: the two here, :class:`ConcatCodec` (lossless, the default) and
:class:`Int8Codec` (lossy, about half the bytes for 16-bit pools); Python subclasses are refused.

Hot pools of a layer group: ``k_pool``, ``v_pool`` of shape ``[L, S, P, H, D]`` (num_layers,
num_slots, page_size, num_kv_heads, head_dim); hot page ``s`` is slot ``s`` along axis 1 of both.
A slot-major hot pool group (``HotPoolGroupDesc.slot_major``, the arena) passes two ArenaPools
(:class:`~jax_kvcm._arena_pool.ArenaPool`) of that logical shape instead (physically ``[S, L, P,
H, D]``, or by address on CPU); the cold page of a page is byte-identical in both layouts, so a
page encoded from one layout decodes into the other.
Index pairs: int32 ``[n, 2]`` of ``(dst, src)`` (array of structures). Encode: ``dst`` is a cold
slot, ``src`` a hot slot; cold page ``c`` is written at ``dst_address + c * cold_page_bytes(lg)``.
Decode: ``dst`` is a hot slot, ``src`` a cold slot; the pools are written in place (the outputs
alias the inputs, so under donation nothing is copied). Byte layouts: ``ffi/include/kvcm/codec.h``
and the class docstrings.

Index pairs with a hot slot outside ``[0, S)``, a negative cold slot, or a cold slot
``>= num_cold_slots`` (when given) are refused: on CPU the call fails with an error naming
``index_pairs`` and nothing is written; on CUDA nothing outside the pools and the cold tier is
touched, the concat codec (host indices) refuses the call the same way, and the int8 codec (device
indices) skips the bad pairs and reports them when created with ``check_indices=True`` (or
``JAX_KVCM_CHECK_INDICES=1``), like every op.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import _arena_pool, _env
from jax_kvcm._codec_registry import index_registry as _index_registry
from jax_kvcm._codec_registry import on_accelerator as _on_accelerator

__all__ = [
    "ColdPageCodec",
    "ConcatCodec",
    "HotPoolGroupDesc",
    "Int8Codec",
    "PageIndexLocation",
    "create_default_cold_page_codec",
    "make_cold_page_codec",
]

# Cold tier base addresses must be multiples of this (checked here and in the handlers).
COLD_ADDRESS_ALIGNMENT = 16

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                     jnp.dtype(jnp.float8_e4m3fn))
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
# Bits of the handlers' "options" attribute (ffi/include/kvcm/codec.h, CodecOptionBits).
_OPT_CHECK_INDICES, _OPT_CONCAT_MEMCPY, _OPT_NO_MEMCPY_BATCH, _OPT_SIDE_STREAM = 1, 2, 4, 8
# NOTE: the handlers refuse hot pages above 2^40 bytes (every offset product then fits int64).
_MAX_HOT_PAGE_BYTES = 1 << 40


class PageIndexLocation(enum.IntEnum):
    """Where a codec needs its index pairs (for both encode and decode)."""

    BAD = -1  # failure / unknown layer group; never a valid location
    HOST = 0  # consumed on the host when the custom call runs (register_host_index_pairs)
    DEVICE = 1  # read by the device kernels from the operand


@dataclass(frozen=True, slots=True)
class HotPoolGroupDesc:
    """The hot layout of one hot pool group, as :meth:`ColdPageCodec.configure` receives it.

    Every layer group in ``layer_groups`` has one K and one V pool of logical shape
    ``[num_layers, num_slots, page_size, num_kv_heads, head_dim]`` and ``dtype``; with
    ``slot_major`` they are ArenaPools (:class:`~jax_kvcm._arena_pool.ArenaPool`; physically
    ``[num_slots, num_layers, ...]``), else arrays of that shape. Not validated here:
    :meth:`ColdPageCodec.configure` refuses (returns False for) a bad description.
    """

    index: int
    layer_groups: tuple[int, ...]
    num_layers: int
    num_slots: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: Any
    slot_major: bool = False

    @property
    def pool_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_slots, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def hot_page_bytes(self) -> int:
        """Bytes of one hot page: 2 * L * P * H * D * itemsize."""
        return (2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim
                * jnp.dtype(self.dtype).itemsize)


@dataclass(frozen=True, slots=True)
class _Configured:
    """What the codec keeps per configured layer group."""

    desc: HotPoolGroupDesc
    dtype: np.dtype
    cold_page_bytes: int
    batching_id: int


class ColdPageCodec:
    """Base class of the native cold-page codecs (see the module docstring).

    Lifecycle: create, :meth:`configure` exactly once, then query and call. A
    ``KVCacheManager`` given a codec :meth:`consume`\\ s it (whether its construction succeeds or
    fails); a consumed codec cannot be given to another manager.
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = False
    _location: ClassVar[PageIndexLocation] = PageIndexLocation.BAD
    #: Whether ``encode(..., side_stream=True)`` exists (the CUDA side-stream mover).
    supports_side_stream: ClassVar[bool] = False
    _encode_target: ClassVar[str] = ""
    _decode_target: ClassVar[str] = ""

    __slots__ = ("_groups", "_configure_called", "_consumed", "_options", "configure_error")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # NOTE: codecs are native (the custom calls are the implementation); a Python subclass
        # could not supply handlers, so only the classes of this module exist.
        if cls.__module__ != __name__:
            raise TypeError("codecs are native; Python subclasses are not supported")
        super().__init_subclass__(**kwargs)

    def __init__(self, *, check_indices: bool | None = None) -> None:
        """``check_indices``: the CUDA int8 codec (device index pairs) validates every call's
        pairs first and raises on bad ones (synchronizing; for debugging); None = the
        ``JAX_KVCM_CHECK_INDICES`` environment default (``jax_kvcm._env``). The CPU handlers
        and the concat codec (host index pairs) always refuse bad pairs."""
        if type(self) is ColdPageCodec:
            raise TypeError("ColdPageCodec is abstract: use create_default_cold_page_codec() or "
                            "make_cold_page_codec(name)")
        from jax_kvcm.ops._checks import resolve_check_indices
        self._options = _OPT_CHECK_INDICES if resolve_check_indices(check_indices) else 0
        self._groups: dict[int, _Configured] = {}
        self._configure_called = False
        self._consumed = False
        self.configure_error: str | None = None
        """Why the last :meth:`configure` returned False (None otherwise)."""

    def __repr__(self) -> str:
        state = "configured" if self._groups else "unconfigured"
        owner = ", consumed" if self._consumed else ""
        return f"{type(self).__name__}({state}, {len(self._groups)} layer groups{owner})"

    # -- ownership -------------------------------------------------------------------------------

    @property
    def consumed(self) -> bool:
        """True once a KVCacheManager took ownership (:meth:`consume`)."""
        return self._consumed

    def consume(self) -> ColdPageCodec:
        """Marks the codec as owned by a manager; returns it. A second call raises RuntimeError."""
        if self._consumed:
            raise RuntimeError("codec already consumed by a KVCacheManager")
        self._consumed = True
        return self

    # -- configuration and queries ---------------------------------------------------------------

    @property
    def configured(self) -> bool:
        return bool(self._groups)

    def configure(self, descs: Sequence[HotPoolGroupDesc]) -> bool:
        """Takes every hot pool group's layout, once. False (and still unconfigured, with
        :attr:`configure_error` saying why) for an invalid configuration: no descriptions,
        indices not ``0, 1, ...`` in order, a layer group listed twice, an empty group, a
        non-positive size, an unsupported dtype (float32, bfloat16, float16 and, for the lossless
        concat codec only, float8_e4m3fn are supported).

        Raises RuntimeError when called a second time (whatever the first call returned).
        """
        if self._configure_called:
            raise RuntimeError(f"{type(self).__name__}.configure() may be called only once")
        self._configure_called = True
        groups, error = self._build(descs)
        self.configure_error = error
        if error is not None:
            return False
        self._groups = groups
        return True

    def cold_page_bytes(self, lg: int) -> int:
        """Fixed size of one cold page of layer group ``lg``; 0 for unknown / unconfigured."""
        g = self._lookup(lg)
        return 0 if g is None else g.cold_page_bytes

    def batching_layer_group_id(self, lg: int) -> int:
        """Smallest layer group encoded identically to ``lg`` (same hot pool group, same layout,
        same codec); negative for unknown / unconfigured. Pairs of every member of a class may be
        concatenated into one call made with this representative id."""
        g = self._lookup(lg)
        return -1 if g is None else g.batching_id

    def page_index_location(self, lg: int) -> PageIndexLocation:
        """Where encode/decode of ``lg`` need their index pairs; BAD for unknown/unconfigured."""
        return PageIndexLocation.BAD if self._lookup(lg) is None else self._location

    # -- encode / decode (traceable) -------------------------------------------------------------

    def encode(self, lg: int, k_pool: jax.Array, v_pool: jax.Array, index_pairs: jax.Array,
               dst_address: int, *, num_cold_slots: int | None = None,
               side_stream: bool = False) -> jax.Array:
        """Encodes hot pages into cold pages at ``dst_address + dst * cold_page_bytes(lg)``.

        Args:
          lg: a configured layer group (usually a batching representative).
          k_pool, v_pool: the group's hot pools ``[L, S, P, H, D]`` (read only): arrays, or
            ArenaPools for a slot-major group (by-address ones are read after their last
            writes).
          index_pairs: int32 ``[n, 2]`` of ``(dst cold slot, src hot slot)``.
          dst_address: static int, the cold tier's base (device-accessible on GPU), a multiple
            of 16.
          num_cold_slots: optional static bound: cold slots ``>= num_cold_slots`` are refused.
          side_stream: static; concat codec only (:attr:`supports_side_stream`). On CUDA the
            copies run on a side stream with the copy engines (ffi/cuda/codec.cu), ordered after
            everything XLA's stream did before the call; their completion is the *ticket* given
            to :meth:`register_host_index_pairs` with the pairs, not the token. The CPU handler
            ignores it (synchronous: done when the token is ready).

        Returns:
          an int32 ``[1]`` token whose readiness means the pages are written (with
          ``side_stream`` on CUDA: that the copies are issued). The custom call has a side
          effect, so XLA never drops it.
        """
        form = self._check_call(lg, k_pool, v_pool, index_pairs)
        attrs = self._attrs(dst_address, "dst_address", num_cold_slots)
        if side_stream:
            if not self.supports_side_stream:
                raise ValueError(f"side_stream: the {self.name} codec has no side-stream mover "
                                 "(the concat codec has)")
            attrs["options"] = np.int32(self._options | _OPT_SIDE_STREAM)
        if form == "address":
            return _arena_pool.encode_by_address(self._encode_target, k_pool, v_pool, index_pairs,
                                                 attrs)
        call = jax.ffi.ffi_call(self._encode_target, jax.ShapeDtypeStruct((1,), jnp.int32),
                                has_side_effect=True)
        kp, vp = _arena_pool.physical_pair(k_pool, v_pool, form)
        return call(kp, vp, index_pairs, slot_major=np.bool_(form == "array"), **attrs)

    def decode(self, lg: int, k_pool: jax.Array, v_pool: jax.Array, index_pairs: jax.Array,
               src_address: int, *,
               num_cold_slots: int | None = None) -> tuple[jax.Array, jax.Array]:
        """Decodes cold pages from ``src_address + src * cold_page_bytes(lg)`` into hot slots.

        Args as :meth:`encode`, with ``index_pairs`` holding ``(dst hot slot, src cold slot)``.

        Returns:
          ``(k_pool, v_pool)`` aliased to the inputs: under ``jax.jit(..., donate_argnums=(0,
          1))`` the pools are written in place; slots not named in ``index_pairs`` keep their
          contents. ArenaPools come back as ArenaPools (by-address ones written in place, their
          tokens advanced).
        """
        form = self._check_call(lg, k_pool, v_pool, index_pairs)
        attrs = self._attrs(src_address, "src_address", num_cold_slots)
        if form == "address":
            return _arena_pool.decode_by_address(self._decode_target, k_pool, v_pool, index_pairs,
                                                 attrs)
        kp, vp = _arena_pool.physical_pair(k_pool, v_pool, form)
        out = (jax.ShapeDtypeStruct(kp.shape, kp.dtype), jax.ShapeDtypeStruct(vp.shape, vp.dtype))
        call = jax.ffi.ffi_call(self._decode_target, out, input_output_aliases={0: 0, 1: 1},
                                has_side_effect=True)
        k_out, v_out = call(kp, vp, index_pairs, slot_major=np.bool_(form == "array"), **attrs)
        if form == "array":
            return k_pool.with_data(k_out), v_pool.with_data(v_out)
        return k_out, v_out

    # -- host index pairs (HOST location on CUDA) ------------------------------------------------

    def register_host_index_pairs(self, device_array: jax.Array, host_pairs: Any, *,
                                  ticket: int = 0) -> None:
        """Gives the CUDA handler a host copy of the pairs held by ``device_array``.

        A HOST-location codec consumes its pairs on the host while its custom call runs, but XLA
        hands the handler a device buffer: the handler finds the host copy by that buffer's
        device pointer. Register before calling the jitted function with ``device_array`` (passed
        straight through as the ``index_pairs`` operand) and call
        :meth:`unregister_host_index_pairs` only once that call's output is ready. A no-op for
        arrays on the CPU (the handler reads them directly) and for empty arrays. ``ticket``
        (> 0): the side-stream ticket of an ``encode(..., side_stream=True)`` call (see
        :func:`jax_kvcm._storage` ``SideStreamFence``); 0 for none.
        """
        ticket = _as_int(ticket)
        if ticket is None or ticket < 0:
            raise ValueError(f"ticket must be an int >= 0, got {ticket!r}")
        host = np.ascontiguousarray(host_pairs, dtype=np.int32)
        if host.ndim != 2 or host.shape[1] != 2:
            raise ValueError(f"host_pairs must be int32 [n, 2], got shape {host.shape}")
        if tuple(device_array.shape) != host.shape:
            raise ValueError(f"host_pairs shape {host.shape} must equal the device array's "
                             f"shape {tuple(device_array.shape)}")
        if host.shape[0] == 0 or not _on_accelerator(device_array):
            return
        registry = _index_registry()
        if ticket:
            rc = registry.register_ticket(device_array.unsafe_buffer_pointer(), host.ctypes.data,
                                          host.shape[0], ticket)
        else:
            rc = registry.register(device_array.unsafe_buffer_pointer(), host.ctypes.data,
                                   host.shape[0])
        if rc == -2:
            raise MemoryError("out of host memory registering index pairs")
        if rc != 0:
            raise ValueError(f"registering host index pairs failed (code {rc})")

    def unregister_host_index_pairs(self, device_array: jax.Array) -> None:
        """Drops the host copy registered for ``device_array`` (no-op when there is none)."""
        if device_array.size == 0 or not _on_accelerator(device_array):
            return
        _index_registry().unregister(device_array.unsafe_buffer_pointer())

    # -- internals -------------------------------------------------------------------------------

    def _cold_page_bytes_of(self, desc: HotPoolGroupDesc, itemsize: int) -> int:
        raise NotImplementedError

    def _lookup(self, lg: Any) -> _Configured | None:
        if isinstance(lg, (bool, np.bool_)):
            return None
        try:
            return self._groups.get(operator.index(lg))
        except TypeError:
            return None

    def _build(self, descs: Any) -> tuple[dict[int, _Configured], str | None]:
        if isinstance(descs, (str, bytes)) or not isinstance(descs, Sequence):
            return {}, "descs must be a sequence of HotPoolGroupDesc"
        if len(descs) == 0:
            return {}, "no hot pool group descriptions"
        groups: dict[int, _Configured] = {}
        for position, desc in enumerate(descs):
            if not isinstance(desc, HotPoolGroupDesc):
                return {}, f"descs[{position}] is a {type(desc).__name__}, not a HotPoolGroupDesc"
            index = _as_int(desc.index)
            if index != position:
                return {}, (f"descs[{position}].index is {desc.index!r}: indices must be 0, 1, "
                            "... in order")
            for field in ("num_layers", "num_slots", "page_size", "num_kv_heads", "head_dim"):
                value = _as_int(getattr(desc, field))
                if value is None or value < 1:
                    return {}, f"descs[{position}].{field} must be an int >= 1, got " \
                               f"{getattr(desc, field)!r}"
            if _as_int(desc.num_slots) > 2**31 - 1:
                return {}, f"descs[{position}].num_slots must fit int32"
            if not isinstance(desc.slot_major, (bool, np.bool_)):
                return {}, f"descs[{position}].slot_major must be a bool, got {desc.slot_major!r}"
            try:
                dtype = jnp.dtype(desc.dtype)
            except TypeError:
                return {}, f"descs[{position}].dtype {desc.dtype!r} is not a dtype"
            if dtype not in _SUPPORTED_DTYPES:
                return {}, (f"descs[{position}].dtype {dtype} is not supported (float32, "
                            "bfloat16, float16, float8_e4m3fn)")
            if dtype == _FP8 and not self.lossless:
                return {}, (f"descs[{position}].dtype float8_e4m3fn: the {self.name} codec does "
                            "not take fp8 pools (their scales live outside the pages); use the "
                            "concat codec, which moves fp8 pages byte-exactly")
            members = desc.layer_groups
            if isinstance(members, (str, bytes)) or not isinstance(members, Sequence) or \
                    len(members) == 0:
                return {}, f"descs[{position}].layer_groups must be a non-empty tuple of ints"
            ids = [_as_int(m) for m in members]
            if any(i is None or i < 0 for i in ids):
                return {}, (f"descs[{position}].layer_groups must hold ints >= 0, got "
                            f"{tuple(members)!r}")
            if desc.hot_page_bytes > _MAX_HOT_PAGE_BYTES:
                return {}, (f"descs[{position}]: a page of {desc.hot_page_bytes} bytes is too "
                            "large")
            nbytes = self._cold_page_bytes_of(desc, dtype.itemsize)
            representative = min(ids)
            for lg in ids:
                if lg in groups:
                    return {}, f"layer group {lg} appears in more than one place in descs"
                groups[lg] = _Configured(desc, dtype, nbytes, representative)
        return groups, None

    def _check_call(self, lg: Any, k_pool: Any, v_pool: Any, index_pairs: Any) -> str | None:
        """Checks a call's operands; returns how it takes the pools (``pool_pair_form``)."""
        form = _arena_pool.pool_pair_form(k_pool, v_pool, ("k_pool", "v_pool"))
        if not self._groups:
            raise RuntimeError(f"{type(self).__name__} is not configured")
        g = self._lookup(lg)
        if g is None:
            raise ValueError(f"layer group {lg!r} is not configured in this codec")
        slot_major = form is not None and k_pool.slot_major
        if slot_major != g.desc.slot_major:
            want_layout = "slot-major" if g.desc.slot_major else "layer-major"
            raise TypeError(f"k_pool, v_pool: layer group {lg}'s hot pools are {want_layout} "
                            "(HotPoolGroupDesc.slot_major), got "
                            f"{'slot' if slot_major else 'layer'}-major pools")
        want = g.desc.pool_shape
        for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
            if tuple(pool.shape) != want:
                raise ValueError(f"{name} shape {tuple(pool.shape)} must equal layer group {lg}'s "
                                 f"hot pool shape {want}")
            if jnp.dtype(pool.dtype) != g.dtype:
                raise TypeError(f"{name} dtype {jnp.dtype(pool.dtype)} must equal layer group "
                                f"{lg}'s dtype {g.dtype}")
        shape = tuple(getattr(index_pairs, "shape", ()))
        dtype = getattr(index_pairs, "dtype", None)
        if len(shape) != 2 or shape[1] != 2 or dtype is None or jnp.dtype(dtype) != jnp.int32:
            raise ValueError(f"index_pairs must be int32 [n, 2] (dst, src) pairs, got "
                             f"{dtype}{list(shape)}")
        return form

    def _attrs(self, address: Any, name: str, num_cold_slots: Any) -> dict[str, Any]:
        if isinstance(address, jax.core.Tracer):
            raise TypeError(f"{name} must be a static Python int, not a traced value")
        value = _as_int(address)
        if value is None:
            raise TypeError(f"{name} must be an int, got {type(address).__name__}")
        if not 0 < value < 2**64:
            raise ValueError(f"{name} must be in (0, 2^64), got {value}")
        if value % COLD_ADDRESS_ALIGNMENT:
            raise ValueError(f"{name} {value:#x} must be a multiple of {COLD_ADDRESS_ALIGNMENT}")
        if num_cold_slots is None:
            slots = -1
        else:
            slots = _as_int(num_cold_slots)
            if slots is None or slots < 0:
                raise ValueError(f"num_cold_slots must be an int >= 0, got {num_cold_slots!r}")
        return {"address": np.uint64(value), "num_cold_slots": np.int64(slots),
                "options": np.int32(self._options)}


class ConcatCodec(ColdPageCodec):
    """Lossless default: a cold page is the hot page's bytes, layer by layer, K then V.

    Cold page layout (``cold_page_bytes = 2 * L * P * H * D * itemsize``): for ``l`` in
    ``0..L-1``: the bytes of ``k_pool[l, slot]`` (``[P, H, D]``, C order), then those of
    ``v_pool[l, slot]``. That is, piece ``(l, kv)`` starts at byte ``(2 * l + kv) * P * H * D *
    itemsize``; equivalently the cold page is ``np.stack([k_pool[:, s], v_pool[:, s]], axis=1)``
    as raw bytes.

    Index location HOST: every call's pairs are validated on the host, from the host copy given
    to :meth:`register_host_index_pairs` (on CPU, from the operand), before anything moves. On
    CPU the handler memcpy's each piece. On CUDA, when the cold tier is device-accessible (the
    mapped pinned host tier, device memory) one copy kernel moves every piece (one CTA per 32 KiB
    piece at the Llama-8B shape); for pageable host memory, or with ``copy="memcpy"``, one copy
    descriptor per page per pool goes in one ``cuMemcpyBatchAsync`` (one ``cudaMemcpyAsync`` each
    before CUDA 12.8 or with ``memcpy_batch=False``). The kernel is the default because on the H200 the batched
    memcpy reached only 0.39x a contiguous pinned copy (``benchmarks/RESULTS.md``).

    Batching: all layer groups of one hot pool group share a layout, so they share a batching id
    (the smallest of them).
    """

    name = "concat"
    lossless = True
    supports_side_stream = True
    _location = PageIndexLocation.HOST
    _encode_target = "kvcm_concat_encode_pages"
    _decode_target = "kvcm_concat_decode_pages"
    __slots__ = ()

    def __init__(self, *, copy: str | None = None, memcpy_batch: bool | None = None,
                 check_indices: bool | None = None) -> None:
        """``copy``: ``"auto"`` (the copy kernel whenever the cold tier is device-accessible) or
        ``"memcpy"`` (always memcpy descriptors); ``memcpy_batch``: one ``cuMemcpyBatchAsync`` per
        call (True, where the driver has it) or one ``cudaMemcpyAsync`` per piece (False). None
        takes the environment default (``jax_kvcm._env``). CUDA only; the CPU handler ignores
        both."""
        super().__init__(check_indices=check_indices)
        copy = _env.concat_copy_default() if copy is None else copy
        if copy not in ("auto", "memcpy"):
            raise ValueError(f"copy must be 'auto' or 'memcpy', got {copy!r}")
        if memcpy_batch is None:
            memcpy_batch = _env.memcpy_batch_default()
        if not isinstance(memcpy_batch, (bool, np.bool_)):
            raise TypeError(f"memcpy_batch must be a bool or None, got {memcpy_batch!r}")
        self._options |= (_OPT_CONCAT_MEMCPY if copy == "memcpy" else 0) | (
            0 if memcpy_batch else _OPT_NO_MEMCPY_BATCH)

    def _cold_page_bytes_of(self, desc: HotPoolGroupDesc, itemsize: int) -> int:
        return (2 * desc.num_layers * desc.page_size * desc.num_kv_heads * desc.head_dim
                * itemsize)


class Int8Codec(ColdPageCodec):
    """Lossy int8 codec: one float32 scale per (page, layer, K/V, kv head), int8 payloads.

    Cold page layout (all offsets in bytes; ``B = 2 * L * H`` blocks, block
    ``b(l, kv, h) = (2 * l + kv) * H + h``):

    - payload: block ``b`` is int8 ``[P, D]`` (C order) at ``b * P * D``;
    - scales: float32 (little-endian) ``scale[b]`` at ``scales_offset + 4 * b`` with
      ``scales_offset = round_up(B * P * D, 16)``;
    - ``cold_page_bytes = round_up(scales_offset + 4 * B, 16)``; padding bytes are written as 0.

    Quantization of block ``(l, kv, h)`` of hot page ``s``, ``x = pool_kv[l, s, :, h, :]``
    converted to float32 (exact): ``amax = max|x|`` (NaN ignored), ``scale = amax / 127`` in
    float32 (``1`` when that is 0), ``q = rint(clip(x / scale, -127, 127))`` with float32
    division and round-half-to-even. Decode: ``y = T(float32(q) * scale)`` with a float32
    multiply, clipped to the finite float32 range (this only matters when ``amax`` is within
    ``2^-23`` of the float32 maximum) and rounded to nearest even into the pool dtype ``T``. The
    CPU handler computes with IEEE subnormals (XLA's CPU runtime flushes them; the handler restores
    them for the call), so CPU and CUDA produce the same bytes and values.

    Error bound, per element, for finite inputs whose block has a normal float32 scale
    (``amax >= 127 * 2^-126``)::

        |x - y| <= scale / 2 * (1 + 2^-7) + u_T * |y| + t_T

    where ``scale`` is the stored float32 scale of the block, ``u_T`` the unit roundoff of
    ``T`` (``2^-24`` float32, ``2^-8`` bfloat16, ``2^-11`` float16) and ``t_T`` half its
    smallest subnormal (``2^-150``, ``2^-134``, ``2^-25``). (The float32 arithmetic alone stays
    within ``scale / 2 * (1 + 2^-15)``; the rest is the final rounding into ``T``.) Blocks with a
    smaller ``amax`` satisfy ``|x - y| <= 2 * amax``; all-zero blocks decode to exact zeros.
    Non-finite inputs are not preserved.

    Index location DEVICE: the CUDA kernels (one CTA per (pair, layer, K/V)) read each pair with
    one 8-byte load from the ``index_pairs`` operand.
    """

    name = "int8"
    lossless = False
    _location = PageIndexLocation.DEVICE
    _encode_target = "kvcm_int8_encode_pages"
    _decode_target = "kvcm_int8_decode_pages"
    __slots__ = ()

    def _cold_page_bytes_of(self, desc: HotPoolGroupDesc, itemsize: int) -> int:
        del itemsize
        return int8_cold_page_layout(desc.num_layers, desc.page_size, desc.num_kv_heads,
                                     desc.head_dim)[2]


def int8_cold_page_layout(num_layers: int, page_size: int, num_kv_heads: int,
                          head_dim: int) -> tuple[int, int, int]:
    """``(scales_offset, scales_end, cold_page_bytes)`` of an int8 cold page (see Int8Codec)."""
    blocks = 2 * num_layers * num_kv_heads
    scales_offset = _round_up(blocks * page_size * head_dim, 16)
    scales_end = scales_offset + 4 * blocks
    return scales_offset, scales_end, _round_up(scales_end, 16)


_CODECS: dict[str, type[ColdPageCodec]] = {"concat": ConcatCodec, "int8": Int8Codec}


def create_default_cold_page_codec() -> ConcatCodec:
    """A new, unconfigured lossless :class:`ConcatCodec` (a manager creates one when given
    none)."""
    return ConcatCodec()


def make_cold_page_codec(name: str, **options: Any) -> ColdPageCodec:
    """A new, unconfigured codec by name: ``"concat"`` or ``"int8"``; ``options`` go to its
    constructor (``check_indices``; the concat codec's ``copy`` and ``memcpy_batch``)."""
    try:
        cls = _CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown cold-page codec {name!r}; known: {sorted(_CODECS)}") from None
    return cls(**options)


# ---------------------------------------------------------------------------------------------
# Helpers.


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _as_int(value: Any) -> int | None:
    """``value`` as a Python int; None for bools, non-integers and anything else."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
