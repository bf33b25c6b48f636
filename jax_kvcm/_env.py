"""The environment overrides of jax_kvcm, all in one place.

Every option below is configuration first (an op keyword or a codec constructor argument); the
environment only supplies the value when that argument is left ``None``. It is read in Python when
the op is traced or the codec is created, never by the native handlers (so a jitted function keeps
what it was traced with).

=============================  ===========================================================
``JAX_KVCM_CHECK_INDICES=1``   ops' and codecs' ``check_indices=None`` -> True: the CUDA handlers
                               synchronize after their kernels and raise an error naming the bad
                               index argument (the CPU handlers always check).
``JAX_KVCM_CONCAT_COPY=memcpy``  ``ConcatCodec(copy=None)`` -> ``"memcpy"``: the CUDA concat
                               codec moves pages with memcpy descriptors, never its copy kernel.
``JAX_KVCM_NO_MEMCPY_BATCH=1``  ``ConcatCodec(memcpy_batch=None)`` -> False: one
                               ``cudaMemcpyAsync`` per piece instead of one ``cuMemcpyBatchAsync``.
=============================  ===========================================================
"""

from __future__ import annotations

import os

CHECK_INDICES = "JAX_KVCM_CHECK_INDICES"
CONCAT_COPY = "JAX_KVCM_CONCAT_COPY"
NO_MEMCPY_BATCH = "JAX_KVCM_NO_MEMCPY_BATCH"


def check_indices_default() -> bool:
    return os.environ.get(CHECK_INDICES, "") == "1"


def concat_copy_default() -> str:
    return "memcpy" if os.environ.get(CONCAT_COPY, "") == "memcpy" else "auto"


def memcpy_batch_default() -> bool:
    return os.environ.get(NO_MEMCPY_BATCH, "") != "1"
