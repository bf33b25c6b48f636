"""Registration of the native FFI handlers with XLA (CPU always, CUDA when built)."""

from __future__ import annotations

import jax

try:
    from jax_kvcm import _kvcm_cpu
except ImportError as e:  # pragma: no cover - only on a source tree without a build
    raise ImportError(
        "jax_kvcm's native extension _kvcm_cpu is neither in this source tree nor in an "
        "installed copy of jax_kvcm on sys.path: install the package (`pip install .`)"
    ) from e

try:
    from jax_kvcm import _kvcm_cuda
except ImportError:
    _kvcm_cuda = None

CUDA_IMPORT_ERROR: str | None = None if _kvcm_cuda is not None else "the CUDA extension was not built"

for _name, _capsule in _kvcm_cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

if _kvcm_cuda is not None:
    try:
        for _name, _capsule in _kvcm_cuda.registrations().items():
            jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
    except Exception as e:  # pragma: no cover - depends on the jaxlib build
        CUDA_IMPORT_ERROR = f"registering the CUDA handlers failed: {e}"


def cuda_extension_available() -> bool:
    """True when the CUDA extension was built and its handlers are registered with XLA."""
    return _kvcm_cuda is not None and CUDA_IMPORT_ERROR is None
