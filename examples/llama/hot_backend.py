"""The runner's hot backend: which memory holds its K/V pools, as ``KVCacheConfig`` fields.

``ServeConfig.hot_backend`` is ``"paged"`` (pools of ``device_pages`` pages) or ``"arena"`` (the
contiguous arena: one virtual reservation, physical memory mapped per chunk against a byte
budget; CUDA VMM on a GPU, memfd on CPU). :func:`hot_backend_fields` is the one place that turns
it into the manager's configuration: ``serve.Server``, the runner's and the HTTP server's
``--hot-backend`` flag and the serving benchmark's paged-vs-arena rows all go through it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcm import ArenaConfig

HOT_BACKENDS = ("paged", "arena")
ARENA_SUPER_PAGE = 2 << 20      # CUDA VMM's granularity on the H200
ARENA_CPU_SUPER_PAGE = 4096     # memfd on CPU: the system page (a tiny model's chunk stays small)


def arena_super_page() -> int:
    """The arena's super-page on this backend."""
    return ARENA_SUPER_PAGE if jax.default_backend() == "gpu" else ARENA_CPU_SUPER_PAGE


def hot_backend_fields(serve: Any, model: Any) -> dict[str, Any]:
    """``KVCacheConfig`` keyword arguments for ``serve.hot_backend`` (``serve``: a ServeConfig,
    ``model``: its LlamaConfig).

    paged: ``device_pages``. arena: ``serve.arena`` when given, else an arena sized like the
    paged pool it replaces: a range per batch row of ``max_seq_len`` tokens, and a budget of the
    pool's bytes (``device_pages`` pages of ``2 L`` slots of ``page_size x Hkv x D`` elements)
    plus one chunk per range and the null chunk (each range rounds its last chunk up).
    """
    if serve.hot_backend == "paged":
        return {"device_pages": serve.device_pages}
    arena = serve.arena
    if arena is None:
        slot = (serve.page_size * model.num_key_value_heads * model.head_dim
                * jnp.dtype(model.jnp_dtype).itemsize)
        pools = 2 * model.num_hidden_layers
        super_page = arena_super_page()
        chunk = pools * int(np.lcm(slot, super_page))
        arena = ArenaConfig(max_sequences=serve.max_batch,
                            max_pages_per_sequence=-(-serve.max_seq_len // serve.page_size),
                            budget_bytes=serve.device_pages * pools * slot
                            + (serve.max_batch + 1) * chunk,
                            super_page_bytes=super_page)
    return {"hot_backend": "arena", "arena": arena, "device_pages": None}
