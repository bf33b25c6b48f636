"""Arena pools: one K or V pool of the arena hot tier, in the form the ops and codecs take.

The arena lays each pool out **slot-major**: physical shape ``[num_slots, num_layers, page_size,
num_kv_heads, head_dim]``, so one page of one pool (all its layers) is one contiguous block of
``L * P * Hkv * D`` elements and the arena maps memory page by page whatever the layer count.
Logically the pool is the paged pools' layer-major ``[num_layers, num_slots, page_size,
num_kv_heads, head_dim]``: page ``p``, layer ``l``, offset ``o``, kv head ``h`` is the same
element in both, and every op and codec computes exactly what it computes on a layer-major pool
of the logical shape (the cold page bytes of a page included).

An :class:`ArenaPool` has one of two forms:

- :meth:`ArenaPool.over_array`: the physical ``jax.Array`` itself (the only pytree leaf). On the
  GPU it is the reservation imported with DLPack; a jitted step that donates it aliases it (XLA
  writes in place). The ops call their usual custom calls on it with the FFI attribute
  ``slot_major=True``.
- :meth:`ArenaPool.by_address`: the CPU arena (memfd reservation). Its only leaf is an int32
  scalar ordering *token*; the pool is reached by address. Why: XLA's CPU client aliases a
  donated input to an output only when it allocated that input itself. A buffer imported from
  outside (``jax.dlpack.from_dlpack``, ``jax.device_put`` of host memory) is immutable to it, so
  a step donating the arena would get a fresh output buffer and the whole input copied into it --
  the copy reads the reservation's unmapped (``PROT_NONE``) super-pages and faults, and even a
  fully mapped arena would be detached from the manager (docs/ARCHITECTURE.md §5). So the
  ``kvcm_arena_*`` CPU handlers take the pools' addresses, logical shape, layout and dtype as an
  attribute and run the same CPU code on the reservation itself; ``write_kv`` and the codec's
  ``decode`` return the pools with their tokens advanced by one, the attention ops and
  ``encode`` take the tokens as operands, so XLA orders them after every write before them. A
  jitted step donates and returns them like pool arrays; the memory never passes through XLA.
  (Only the transitional layer-major CPU arena builds a by-address pool with
  ``slot_major=False``.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ArenaPool", "physical_pair", "pool_pair_form"]

# Codes of the cache dtype in the by-address handlers' ``pool`` attribute (kvcm::DType order).
_DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "float8_e4m3fn": 3}


def _logical_to_physical(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[1], shape[0]) + shape[2:]


class _BuilderOrFlag:
    """On the class, a constructor (``ArenaPool.by_address(...)``); on an instance, a bool
    (``pool.by_address``): the two names the pool's users read."""

    def __init__(self, builder: Any, flag: Any) -> None:
        self._builder, self._flag = builder, flag
        self.__doc__ = builder.__doc__

    def __get__(self, obj: Any, owner: type) -> Any:
        return self._builder.__get__(owner, owner) if obj is None else self._flag(obj)


@jax.tree_util.register_pytree_node_class
class ArenaPool:
    """One K or V pool of the arena hot tier (see the module docstring).

    Shapes: ``shape`` is the LOGICAL layer-major ``(L, S, P, Hkv, D)`` every op checks against;
    ``physical_shape`` is ``(S, L, P, Hkv, D)`` when ``slot_major`` (always for
    :meth:`over_array`), else equal to ``shape``.

    Invariants: the pool has rank 5; ``data`` is the only pytree leaf (the physical array, or the
    int32 scalar token of a by-address pool); address, shape, dtype and layout are static (pytree
    aux data), so a jitted step donating the pool sees exactly one buffer per pool. Build with
    :meth:`over_array` or :meth:`by_address`, never directly.

    The array-like members a runner uses (``shape``, ``dtype``, ``ndim``, ``nbytes``,
    ``sharding``, ``device``, ``is_deleted``, ``is_ready``, ``block_until_ready``,
    ``unsafe_buffer_pointer``) describe the pool; the readiness ones are the leaf's (for a
    by-address pool: the output of the last step that wrote or read it).
    """

    __slots__ = ("_address", "_dtype", "_shape", "_slot_major", "data")

    def __init__(self, data: Any, address: int | None, shape: tuple[int, ...], dtype: Any,
                 slot_major: bool) -> None:
        self.data = data
        self._address = None if address is None else int(address)
        self._shape = tuple(int(d) for d in shape)
        self._dtype = jnp.dtype(dtype)
        self._slot_major = bool(slot_major)

    @classmethod
    def over_array(cls, data: Any) -> ArenaPool:
        """A slot-major pool over ``data``, a ``jax.Array`` of physical shape ``[S, L, P, Hkv,
        D]``."""
        shape = getattr(data, "shape", None)
        if shape is None or not hasattr(data, "dtype"):
            raise TypeError(f"data must be a jax.Array, got {type(data).__name__}")
        if len(shape) != 5:
            raise ValueError("data must have the slot-major physical shape [num_slots, "
                             f"num_layers, page_size, num_kv_heads, head_dim], got {tuple(shape)}")
        return cls(data, None, _logical_to_physical(tuple(shape)), data.dtype, True)

    @classmethod
    def _build_by_address(cls, token: Any, address: int, logical_shape: tuple[int, ...],
                          dtype: Any, *, slot_major: bool = True) -> ArenaPool:
        """A CPU arena pool at ``address`` of ``logical_shape`` ``(L, S, P, Hkv, D)``; ``token``:
        an int32 scalar (the ordering token, the only leaf)."""
        logical_shape = tuple(logical_shape)
        if len(logical_shape) != 5:
            raise ValueError("logical_shape must be [num_layers, num_slots, page_size, "
                             f"num_kv_heads, head_dim], got {logical_shape}")
        if int(address) <= 0:
            raise ValueError(f"address must be a positive int, got {address!r}")
        if jnp.dtype(dtype).name not in _DTYPE_CODES:
            raise TypeError(f"dtype must be one of {sorted(_DTYPE_CODES)}, got {dtype}")
        return cls(token, address, logical_shape, dtype, slot_major)

    # -- pytree ---------------------------------------------------------------------------------

    def tree_flatten(self) -> tuple[tuple[Any], tuple[Any, ...]]:
        return (self.data,), (self._address, self._shape, self._dtype.name, self._slot_major)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any]) -> ArenaPool:
        return cls(children[0], *aux)

    def with_data(self, data: Any) -> ArenaPool:
        """The same pool around another leaf (an op's aliased output, an advanced token)."""
        want = () if self.by_address else self.physical_shape
        got = tuple(getattr(data, "shape", ()))
        if got != want:
            raise ValueError(f"data shape {got} must be {want} for {self!r}")
        return ArenaPool(data, self._address, self._shape, self._dtype, self._slot_major)

    # -- description ----------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical, layer-major shape ``(L, S, P, Hkv, D)``."""
        return self._shape

    @property
    def physical_shape(self) -> tuple[int, ...]:
        return _logical_to_physical(self._shape) if self._slot_major else self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return 5

    @property
    def nbytes(self) -> int:
        return int(np.prod(self._shape)) * self._dtype.itemsize

    @property
    def slot_major(self) -> bool:
        return self._slot_major

    def _is_by_address(self) -> bool:
        return self._address is not None

    by_address = _BuilderOrFlag(_build_by_address, _is_by_address)

    @property
    def token(self) -> Any:
        """A by-address pool's ordering token (its leaf)."""
        if not self.by_address:
            raise AttributeError("an over_array ArenaPool has no token (its leaf is the array)")
        return self.data

    @property
    def address(self) -> int:
        """The pool's first byte: the memory every op over this pool reads and writes."""
        return self._address if self.by_address else self.data.unsafe_buffer_pointer()

    def unsafe_buffer_pointer(self) -> int:
        return self.address

    @property
    def sharding(self) -> Any:
        return self.data.sharding

    @property
    def device(self) -> Any:
        return self.data.device

    def is_deleted(self) -> bool:
        return self.data.is_deleted()

    def is_ready(self) -> bool:
        return self.data.is_ready()

    def block_until_ready(self) -> ArenaPool:
        self.data.block_until_ready()
        return self

    def __repr__(self) -> str:
        layout = "slot-major" if self._slot_major else "layer-major"
        where = (f"at {self._address:#x}, token={self.data!r}" if self.by_address
                 else f"over {type(self.data).__name__}{list(self.physical_shape)}")
        return f"ArenaPool({self._dtype.name}{list(self._shape)} {layout}, {where})"

    # -- the by-address handlers' attribute -----------------------------------------------------

    def _pool_attr(self, v_pool: ArenaPool) -> np.ndarray:
        """``pool`` of the ``kvcm_arena_*`` handlers: ``[k_address, v_address, L, S, P, Hkv, D,
        slot_major, dtype code]``."""
        return np.array([self._address, v_pool._address, *self._shape, int(self._slot_major),
                         _DTYPE_CODES[self._dtype.name]], np.int64)


# ---------------------------------------------------------------------------------------------
# What the ops and codecs call with a pair of pools.


def pool_pair_form(k_pool: Any, v_pool: Any, names: tuple[str, str] = ("k_cache", "v_cache")
                   ) -> str | None:
    """How an op takes ``(k_pool, v_pool)``: None for two arrays, ``"array"`` for two
    :meth:`~ArenaPool.over_array` pools, ``"address"`` for two by-address pools of one layout.
    TypeError naming ``names`` for any other pair."""
    k_arena, v_arena = isinstance(k_pool, ArenaPool), isinstance(v_pool, ArenaPool)
    if not (k_arena or v_arena):
        return None
    k_name, v_name = names
    if not (k_arena and v_arena):
        raise TypeError(f"{k_name} and {v_name} must both be ArenaPools or both arrays, got "
                        f"{type(k_pool).__name__} and {type(v_pool).__name__}")
    if k_pool.by_address != v_pool.by_address:
        raise TypeError(f"{k_name} and {v_name} must be ArenaPools of one form (both "
                        f"over_array or both by_address), got {k_pool!r} and {v_pool!r}")
    if k_pool.slot_major != v_pool.slot_major:
        raise ValueError(f"{k_name} and {v_name} must have one layout, got {k_pool!r} and "
                         f"{v_pool!r}")
    return "address" if k_pool.by_address else "array"


def physical_pair(k_pool: Any, v_pool: Any, form: str | None) -> tuple[Any, Any]:
    """What a custom call takes for the pair: the physical arrays of over_array pools, else the
    pair itself."""
    return (k_pool.data, v_pool.data) if form == "array" else (k_pool, v_pool)


def _arena_target(target: str) -> str:
    """The by-address handler of a custom call: kvcm_<op> -> kvcm_arena_<op>."""
    assert target.startswith("kvcm_"), target
    return "kvcm_arena_" + target[len("kvcm_"):]


def write_kv_by_address(k_cache: ArenaPool, v_cache: ArenaPool,
                        operands: tuple[Any, ...]) -> tuple[ArenaPool, ArenaPool]:
    """``kvcm_arena_write_kv`` over the checked ``operands`` (k, v, slot_mapping, layer,
    k_scale, v_scale) of :func:`jax_kvcm.write_kv`; the pools with their tokens advanced."""
    tok = jax.ShapeDtypeStruct((), jnp.int32)
    # NOTE: a side effect on memory XLA does not see: kept even when the tokens are dropped.
    call = jax.ffi.ffi_call(_arena_target("kvcm_write_kv"), (tok, tok), has_side_effect=True)
    tk, tv = call(*operands, k_cache.data, v_cache.data, pool=k_cache._pool_attr(v_cache))
    return k_cache.with_data(tk), v_cache.with_data(tv)


def attention_by_address(target: str, q: Any, k_cache: ArenaPool, v_cache: ArenaPool,
                         operands: tuple[Any, ...], attrs: dict[str, Any]) -> jax.Array:
    """The by-address handler of the attention ``target`` over the checked ``operands`` (the
    op's, less q and the caches), after the pools' last writes."""
    call = jax.ffi.ffi_call(_arena_target(target), jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, *operands, k_cache.data, v_cache.data, pool=k_cache._pool_attr(v_cache),
                **attrs)


def encode_by_address(target: str, k_pool: ArenaPool, v_pool: ArenaPool, index_pairs: Any,
                      attrs: dict[str, Any]) -> jax.Array:
    """The by-address handler of a codec's encode ``target``: reads the pools after their last
    writes; returns the int32 ``[1]`` token of the cold pages."""
    call = jax.ffi.ffi_call(_arena_target(target), jax.ShapeDtypeStruct((1,), jnp.int32),
                            has_side_effect=True)
    return call(index_pairs, k_pool.data, v_pool.data, pool=k_pool._pool_attr(v_pool), **attrs)


def decode_by_address(target: str, k_pool: ArenaPool, v_pool: ArenaPool, index_pairs: Any,
                      attrs: dict[str, Any]) -> tuple[ArenaPool, ArenaPool]:
    """The by-address handler of a codec's decode ``target``: writes the reservation in place;
    the pools with their tokens advanced."""
    tok = jax.ShapeDtypeStruct((), jnp.int32)
    call = jax.ffi.ffi_call(_arena_target(target), (tok, tok), has_side_effect=True)
    tk, tv = call(index_pairs, k_pool.data, v_pool.data, pool=k_pool._pool_attr(v_pool), **attrs)
    return k_pool.with_data(tk), v_pool.with_data(tv)
