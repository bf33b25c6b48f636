"""The runner's hot backend: which memory holds its K/V pools, as ``KVCacheConfig`` fields.

``ServeConfig.hot_backend`` is ``"paged"`` (preallocated pools of ``device_pages`` pages) or
``"arena"`` (virtual reservations mapped on demand in chunks; CUDA VMM on a GPU, memfd on CPU).
Both get the same ``device_pages``: an arena maps at most that many pages' bytes (rounded down to
whole chunks), so the two compare in equal K/V memory. :func:`hot_backend_fields` is the one
place that turns the choice into the manager's configuration: ``serve.Server``, the runner's and
the HTTP server's ``--hot-backend`` flag and the serving benchmark's paged-vs-arena rows all go
through it.
"""

from __future__ import annotations

from typing import Any

import jax

from jax_kvcm import ArenaHot, PagedHot

HOT_BACKENDS = ("paged", "arena")
ARENA_SUPER_PAGE = 2 << 20      # CUDA VMM's granularity on the H200
ARENA_CPU_SUPER_PAGE = 4096     # memfd on CPU: the system page (a tiny model's chunk stays small)


def arena_super_page() -> int:
    """The arena's super-page on this backend."""
    return ARENA_SUPER_PAGE if jax.default_backend() == "gpu" else ARENA_CPU_SUPER_PAGE


def hot_backend_fields(serve: Any, model: Any = None) -> dict[str, Any]:
    """``KVCacheConfig`` keyword arguments for ``serve.hot_backend`` (``serve``: a ServeConfig).

    paged: ``PagedHot()``. arena: ``serve.arena`` (an :class:`~jax_kvcm.ArenaHot`) when given,
    else ``ArenaHot`` with twice ``max_batch`` ranges (the running sequences and as many parked
    ones for the next admissions to adopt) and this backend's super-page. ``device_pages`` is
    the budget either way."""
    del model  # NOTE: the arena's chunk follows the page and the super-page, not the model
    if serve.hot_backend == "paged":
        return {"device_pages": serve.device_pages, "hot": PagedHot()}
    if serve.hot_backend != "arena":
        raise ValueError(f"hot_backend must be one of {HOT_BACKENDS}, got "
                         f"{serve.hot_backend!r}")
    arena = serve.arena
    if arena is None:
        arena = ArenaHot(max_sequences=2 * serve.max_batch, super_page_bytes=arena_super_page())
    return {"device_pages": serve.device_pages, "hot": arena}
