"""The CPU arena's pools as jitted steps take them: by address, with an ordering token.

Why not arrays: XLA's CPU client aliases a donated input to an output only when it allocated
that input itself. A buffer imported from outside (``jax.dlpack.from_dlpack``, or
``jax.device_put`` of host memory) is immutable to it, so a step donating the arena gets a fresh
output buffer and the whole input copied into it -- the copy reads the reservation's unmapped
(``PROT_NONE``) super-pages and faults, and even a fully mapped arena would be detached from the
manager (docs/ARCHITECTURE.md §5; ``tests/test_arena_runner.py`` records it). On the GPU the same
import is aliased and the pools stay ``jax.Array``s.

So on CPU ``ArenaKVCacheManager.caches`` holds two :class:`ArenaPool`s: pytrees whose only leaf
is an int32 scalar *token* and whose static part is the pool's address, shape and dtype.
:func:`jax_kvcm.write_kv`, :func:`jax_kvcm.paged_attention` and
:func:`jax_kvcm.ragged_paged_attention` accept them in place of the pool arrays (the same checks
and the same CPU code, run by the ``kvcm_arena_*`` handlers on the reservation itself, no copy).
``write_kv`` returns the pools with their tokens advanced by one; an attention op takes the
tokens as operands, so it runs after every write before it in the step. A jitted step donates
and returns them like pool arrays (the model code is unchanged); the memory never passes
through XLA.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ArenaPool"]


@jax.tree_util.register_pytree_node_class
class ArenaPool:
    """One K or V pool of a CPU arena, ``[num_layers, num_slots, tokens_per_page,
    num_kv_heads, head_dim]`` at ``address`` (see the module docstring).

    ``token``: int32 scalar ``jax.Array`` (a count of ``write_kv`` calls into the pool; the
    only leaf). ``address``, ``shape``, ``dtype``: static. The array-like members a runner uses
    (``shape``, ``dtype``, ``ndim``, ``nbytes``, ``sharding``, ``device``, ``is_deleted``, ``is_ready``,
    ``block_until_ready``, ``unsafe_buffer_pointer``) describe the pool; the readiness ones are
    the token's (the output of the last step that wrote or read the pool).
    """

    __slots__ = ("token", "address", "shape", "dtype")

    def __init__(self, token: Any, address: int, shape: tuple[int, ...], dtype: Any) -> None:
        self.token = token
        self.address = int(address)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = jnp.dtype(dtype)

    def tree_flatten(self) -> tuple[tuple[Any], tuple[int, tuple[int, ...], str]]:
        return (self.token,), (self.address, self.shape, self.dtype.name)

    @classmethod
    def tree_unflatten(cls, aux: tuple[int, tuple[int, ...], str],
                       children: tuple[Any]) -> ArenaPool:
        return cls(children[0], *aux)

    def with_token(self, token: Any) -> ArenaPool:
        return ArenaPool(token, self.address, self.shape, self.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    @property
    def sharding(self) -> Any:
        return self.token.sharding

    @property
    def device(self) -> Any:
        return self.token.device

    def is_deleted(self) -> bool:
        return self.token.is_deleted()

    def is_ready(self) -> bool:
        return self.token.is_ready()

    def block_until_ready(self) -> ArenaPool:
        self.token.block_until_ready()
        return self

    def unsafe_buffer_pointer(self) -> int:
        """The pool's first byte: the memory every op over this pool reads and writes."""
        return self.address

    def __repr__(self) -> str:
        return (f"ArenaPool({self.dtype.name}{list(self.shape)} at {self.address:#x}, "
                f"token={self.token!r})")


def pool_attr(k_cache: Any, v_cache: Any) -> np.ndarray | None:
    """The ``pool`` attribute of the ``kvcm_arena_*`` handlers, or None for two arrays.
    TypeError for an ArenaPool paired with anything but an ArenaPool."""
    k_arena, v_arena = isinstance(k_cache, ArenaPool), isinstance(v_cache, ArenaPool)
    if not (k_arena or v_arena):
        return None
    if not (k_arena and v_arena):
        raise TypeError("k_cache and v_cache must both be ArenaPools or both arrays, got "
                        f"{type(k_cache).__name__} and {type(v_cache).__name__}")
    if len(k_cache.shape) != 5:
        raise ValueError(f"an ArenaPool has a layer axis (rank 5), got shape {k_cache.shape}")
    return np.array([k_cache.address, v_cache.address, *k_cache.shape], np.int64)


def write_kv(k_cache: ArenaPool, v_cache: ArenaPool, operands: tuple[Any, ...],
             pool: np.ndarray) -> tuple[ArenaPool, ArenaPool]:
    """``kvcm_arena_write_kv`` over the checked ``operands`` (k, v, slot_mapping, layer,
    k_scale, v_scale) of :func:`jax_kvcm.write_kv`; the pools with their tokens advanced."""
    tok = jax.ShapeDtypeStruct((), jnp.int32)
    # NOTE: a side effect on memory XLA does not see: kept even when the tokens are dropped.
    call = jax.ffi.ffi_call("kvcm_arena_write_kv", (tok, tok), has_side_effect=True)
    tk, tv = call(*operands, k_cache.token, v_cache.token, pool=pool)
    return k_cache.with_token(tk), v_cache.with_token(tv)


def attention(target: str, q: Any, k_cache: ArenaPool, v_cache: ArenaPool,
              operands: tuple[Any, ...], pool: np.ndarray, attrs: dict[str, Any]) -> jax.Array:
    """``kvcm_arena_<target>`` over the checked ``operands`` (the attention op's, less q and
    the caches), after the pools' last writes."""
    call = jax.ffi.ffi_call(f"kvcm_arena_{target}", jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, *operands, k_cache.token, v_cache.token, pool=pool, **attrs)
