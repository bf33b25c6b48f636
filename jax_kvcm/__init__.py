"""jax_kvcm: a KV-cache manager for LLM inference in JAX on NVIDIA GPUs.

The ops below are XLA custom calls (C++ on CPU, CUDA on GPU) usable inside ``jax.jit``;
``jax_kvcm.ops.reference`` holds their pure-JAX oracles.
"""

from jax_kvcm._ffi import cuda_extension_available
from jax_kvcm.ops import paged_attention, ragged_paged_attention, write_kv

__all__ = [
    "cuda_extension_available",
    "paged_attention",
    "ragged_paged_attention",
    "write_kv",
]

__version__ = "0.1.0"
