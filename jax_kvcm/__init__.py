"""jax_kvcm: a KV-cache manager for LLM inference in JAX on NVIDIA GPUs.

- Ops (XLA custom calls, C++ on CPU, CUDA on GPU, usable inside ``jax.jit``): :func:`write_kv`,
  :func:`paged_attention`, :func:`ragged_paged_attention`, and
  :func:`cascade_paged_attention` (shared prefixes read once per group, planned by
  :func:`plan_cascade`); ``jax_kvcm.ops.reference`` holds their pure-JAX oracles.
- Host side: :class:`KVCacheManager` (sequences, fixed-shape :class:`StepBatch` buffers, prefix
  reuse, eviction down the device / host / disk tiers, suspend/resume, capacity planning),
  configured by :class:`KVCacheConfig`; cold pages are encoded by a codec
  (:func:`create_default_cold_page_codec`, or ``make_cold_page_codec("int8")``).
"""

# ruff: noqa: E402  (the package's imports follow _find_installed_extension)
import importlib.machinery as _machinery
import os as _os
import sys as _sys


def _find_installed_extension() -> None:
    """Python started in a source checkout imports this directory, which has no built extension
    (``pip install .`` builds it into site-packages): then load ``_kvcm_cpu`` (and
    ``_kvcm_cuda``) from the first installed copy of the package further down ``sys.path``."""
    def has_extension(d: str) -> bool:
        return any(_os.path.exists(_os.path.join(d, "_kvcm_cpu" + s))
                   for s in _machinery.EXTENSION_SUFFIXES)

    here = _os.path.dirname(_os.path.abspath(__file__))
    if has_extension(here):
        return
    for entry in _sys.path:
        d = _os.path.join(_os.path.abspath(entry or _os.curdir), "jax_kvcm")
        if d != here and has_extension(d):
            __path__.append(d)
            return


_find_installed_extension()

from jax_kvcm._arena_pool import ArenaPool
from jax_kvcm._cascade_plan import CascadeBatch, cascade_group_size, plan_cascade
from jax_kvcm._codec import (ColdPageCodec, ConcatCodec, Int8Codec,
                             create_default_cold_page_codec, make_cold_page_codec)
from jax_kvcm._ffi import cuda_extension_available
from jax_kvcm._disk_tier import CorruptPageError, UnreadablePageError
from jax_kvcm._step_batch import StepBatch
from jax_kvcm._types import CacheLevel
from jax_kvcm.manager import (ArenaHot, KVCacheConfig, KVCacheManager, LayerGroupConfig,
                              OutOfPagesError, PagedHot, Sequence, SequenceExport, SequencePhase,
                              SequenceState, SequenceView, StepInFlightError, SuspendResult)
from jax_kvcm.ops import paged_attention, ragged_paged_attention, write_kv
from jax_kvcm.ops.cascade import cascade_paged_attention

__all__ = [
    "ArenaHot",
    "ArenaPool",
    "CacheLevel",
    "CascadeBatch",
    "ColdPageCodec",
    "ConcatCodec",
    "CorruptPageError",
    "Int8Codec",
    "KVCacheConfig",
    "KVCacheManager",
    "LayerGroupConfig",
    "OutOfPagesError",
    "PagedHot",
    "Sequence",
    "SequenceExport",
    "SequencePhase",
    "SequenceState",
    "SequenceView",
    "StepBatch",
    "StepInFlightError",
    "SuspendResult",
    "UnreadablePageError",
    "cascade_group_size",
    "cascade_paged_attention",
    "create_default_cold_page_codec",
    "cuda_extension_available",
    "make_cold_page_codec",
    "paged_attention",
    "plan_cascade",
    "ragged_paged_attention",
    "write_kv",
]

__version__ = "0.1.0"
