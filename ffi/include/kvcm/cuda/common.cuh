// Device-side helpers shared by the CUDA handlers: dtype traits, error flags, index guards.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kvcm/shapes.h"

namespace kvcm::cuda {

// Bits OR-ed into the per-device error word by kernels that met a bad index. The kernels never
// access memory out of bounds: they skip the write or poison the output row with NaN instead.
enum ErrorBits : uint32_t {
  kBadPage = 1u << 0,        // page_table entry outside [0, num_pages)
  kBadSlot = 1u << 1,        // slot_mapping entry >= num_pages * page_size
  kBadLayer = 1u << 2,       // layer outside [0, num_layers)
  kBadSeqLen = 1u << 3,      // seq_lens outside [0, max_pages * page_size]
  kBadQueryStart = 1u << 4,  // query_start not non-decreasing within [0, T] or > seq_lens
  kBadIndexPair = 1u << 5,   // codec index_pairs entry outside the hot pool or the cold tier
};

// Per-device error word (cudaMalloc'd once). Handlers pass it to kernels.
uint32_t* DeviceErrorWord();

// Checked mode (the check_indices attribute of every op): handlers synchronize after their
// kernels and turn error bits into an ffi::Error naming the argument (slower; for debugging and
// tests). In checked mode: waits for `stream`, reads and clears the error word, returns the error.
ffi::Error FinishChecked(cudaStream_t stream, const char* op);

// Waits for `stream`, reads the error word and clears it; the bits that were set.
ffi::ErrorOr<uint32_t> TakeErrorBits(cudaStream_t stream, const char* op);

inline ffi::Error LaunchError(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

int NumSMs();

// Device scratch owned by the extension, one buffer per stream, reused in stream order and grown
// on demand (growing synchronizes that stream once). nullptr when cudaMalloc fails.
// NOTE: XLA's FFI ScratchAllocator returned no memory for these handlers on jax 0.11.2 / H200.
void* Workspace(cudaStream_t stream, size_t bytes);

template <typename T> struct DTypeTraits;
template <> struct DTypeTraits<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};
template <> struct DTypeTraits<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};
template <> struct DTypeTraits<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

// float8_e4m3fn storage: read exactly as float (times the caller's scale), written rounded to
// nearest even and saturated to +-448 (NaN kept), the CPU handler's and the reference's rule.
template <> struct DTypeTraits<__nv_fp8_e4m3> {
  static __device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.__x, __NV_E4M3)));
  }
  static __device__ __forceinline__ __nv_fp8_e4m3 from_float(float x) {
    __nv_fp8_e4m3 r;
    r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    return r;
  }
};

__device__ __forceinline__ void RaiseError(uint32_t* word, uint32_t bits) {
  if (word) atomicOr(word, bits);
}

}  // namespace kvcm::cuda
