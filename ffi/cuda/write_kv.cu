// CUDA write_kv. Caches of the inputs' dtype: one warp per token copies its K and V rows in
// 16-byte vectors (2-byte pieces where a row is not a multiple of 16 bytes or a buffer is not
// 16-byte aligned). An fp8 cache: one thread per 16 elements of a token's K or V row (K's then
// V's), quantized into one 16-byte store (one element a thread where the head dim is not a
// multiple of 16 or an address not aligned): saturate(x / scale[layer, kv head]), rounded to
// nearest even (cvt.rn.satfinite: +-448, NaN kept), with an IEEE division like the CPU handler.
// Measured on H100s (tools/prefill_ab.py --write, 8B-shaped caches): the fp8 kernel takes 0.16-0.56x
// the time of one warp per token with byte stores; a copy kernel of one thread per vector measured
// no faster than the warp (within the +-20% the bf16 write varies between runs), so the copy
// keeps the warp.
#include <cstdint>

#include "kvcm/cuda/common.cuh"

namespace kvcm::cuda {
namespace {

constexpr int kVecBytes = 16;

// The element offset of `token`'s row in the cache, or -1 when it writes nothing (padding, or a
// bad layer / slot: error bits raised by the token's `report`ing thread).
__device__ __forceinline__ int64_t DestRow(const CacheShape& c, const int32_t* slot_mapping,
                                           const int32_t* layer, int64_t token, bool report,
                                           uint32_t* error_word) {
  const int32_t li = *layer;
  if (li < 0 || li >= c.num_layers) {
    if (report) RaiseError(error_word, kBadLayer);
    return -1;
  }
  const int32_t slot = slot_mapping[token];
  if (slot < 0) return -1;  // padding
  if (slot >= c.num_slots()) {
    if (report) RaiseError(error_word, kBadSlot);
    return -1;
  }
  const int32_t page = slot / int32_t(c.page_size), offset = slot - page * int32_t(c.page_size);
  return li * c.layer_stride + page * c.page_stride + offset * c.token_stride();
}

// Caches of the inputs' dtype: one warp per token, lanes striding its row in vectors of V (uint4,
// or uint16_t).
// validate_only: check the indices and raise error bits, write nothing (checked mode, pass 1).
template <typename V>
__global__ void WriteKvKernel(char* __restrict__ k_cache, char* __restrict__ v_cache,
                              const char* __restrict__ k, const char* __restrict__ v,
                              const int32_t* __restrict__ slot_mapping,
                              const int32_t* __restrict__ layer, int64_t num_tokens,
                              CacheShape c, int64_t elem_bytes, uint32_t* error_word,
                              bool validate_only) {
  const int64_t token = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (token >= num_tokens) return;
  const int64_t row = DestRow(c, slot_mapping, layer, token, lane == 0, error_word);
  if (row < 0 || validate_only) return;
  const int64_t row_bytes = c.token_stride() * elem_bytes;
  const int64_t dst = row * elem_bytes, src = token * row_bytes;
  constexpr int64_t kStep = 32 * int64_t(sizeof(V));
  for (int64_t i = lane * int64_t(sizeof(V)); i < row_bytes; i += kStep) {
    *reinterpret_cast<V*>(k_cache + dst + i) = *reinterpret_cast<const V*>(k + src + i);
    *reinterpret_cast<V*>(v_cache + dst + i) = *reinterpret_cast<const V*>(v + src + i);
  }
}

// The fp8 kernel's thread t: its token, whether it writes V (else K), and the index of its vector
// within the row; false past the last token.
struct VecTask {
  int64_t token, vec;
  bool is_v;
};
__device__ __forceinline__ bool TaskOf(int64_t vecs_per_row, int64_t num_tokens, VecTask& task) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  task.token = t / (2 * vecs_per_row);
  if (task.token >= num_tokens) return false;
  const int64_t i = t - task.token * 2 * vecs_per_row;
  task.is_v = i >= vecs_per_row;
  task.vec = task.is_v ? i - vecs_per_row : i;
  return true;
}

// x / scale in float8_e4m3fn's bits.
template <typename T>
__device__ __forceinline__ uint8_t Quantize(T x, float scale) {
  return DTypeTraits<__nv_fp8_e4m3>::from_float(DTypeTraits<T>::to_float(x) / scale).__x;
}

// A float8_e4m3fn cache: TaskOf's tasks, kElems elements of source dtype T a thread (16: one
// 16-byte store; the host picks 1 where the head dim or an address does not allow 16).
template <typename T, int kElems>
__global__ void WriteKvFp8Kernel(uint8_t* __restrict__ k_cache, uint8_t* __restrict__ v_cache,
                                 const T* __restrict__ k, const T* __restrict__ v,
                                 const int32_t* __restrict__ slot_mapping,
                                 const int32_t* __restrict__ layer,
                                 const float* __restrict__ k_scale,
                                 const float* __restrict__ v_scale, int64_t num_tokens,
                                 CacheShape c, uint32_t* error_word, bool validate_only) {
  static_assert(kElems == 1 || (kElems * sizeof(T)) % kVecBytes == 0);
  const int64_t row_elems = c.token_stride();
  VecTask task;
  if (!TaskOf(row_elems / kElems, num_tokens, task)) return;
  const int64_t dst = DestRow(c, slot_mapping, layer, task.token, task.vec == 0 && !task.is_v,
                              error_word);
  if (dst < 0 || validate_only) return;
  const int64_t e = task.vec * kElems;  // within one head: head_dim % kElems == 0
  const float scale = (task.is_v ? v_scale : k_scale)[*layer * c.num_kv_heads + e / c.head_dim];
  const T* src = (task.is_v ? v : k) + task.token * row_elems + e;
  uint8_t* out = (task.is_v ? v_cache : k_cache) + dst + e;
  if constexpr (kElems == 1) {
    *out = Quantize(*src, scale);
  } else {
    alignas(kVecBytes) T x[kElems];
#pragma unroll
    for (int j = 0; j < int(kElems * sizeof(T)) / kVecBytes; ++j)
      reinterpret_cast<uint4*>(x)[j] = reinterpret_cast<const uint4*>(src)[j];
    alignas(kVecBytes) uint8_t q[kElems];
#pragma unroll
    for (int j = 0; j < kElems; ++j)
      q[j] = Quantize(x[j], scale);
    *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(q);
  }
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVecBytes == 0; }

// Blocks of kThreads: the fp8 kernel's one thread per vector of every token's K and V rows.
constexpr int kThreads = 256;
int64_t BlocksFor(int64_t num_tokens, int64_t vecs_per_row) {
  return (num_tokens * 2 * vecs_per_row + kThreads - 1) / kThreads;
}

ffi::Error WriteKvCudaImpl(cudaStream_t stream, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                           ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer slot_mapping,
                           ffi::AnyBuffer layer, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                           ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                           bool check_indices, bool slot_major) {
  auto cache = ParseWriteKv(k_cache, v_cache, k, v, slot_mapping, layer, slot_major);
  if (cache.has_error()) return cache.error();
  const CacheShape& c = *cache;
  if (auto err = CheckScales(c, k_scale, v_scale); err.failure()) return err;
  const int64_t num_tokens = k.dimensions()[0];
  if (num_tokens == 0) return ffi::Error::Success();
  const int64_t elem = ffi::ByteWidth(k_cache.element_type());
  const bool checked = check_indices;
  uint32_t* error_word = DeviceErrorWord();
  const int64_t row_elems = c.token_stride();
  const bool aligned = Aligned(k_out->untyped_data()) && Aligned(v_out->untyped_data()) &&
                       Aligned(k.untyped_data()) && Aligned(v.untyped_data());
  auto launch_fp8 = [&](auto t, bool validate_only) {
    using T = decltype(t);
    auto run = [&](auto kernel, int64_t elems) {
      kernel<<<BlocksFor(num_tokens, row_elems / elems), kThreads, 0, stream>>>(
          static_cast<uint8_t*>(k_out->untyped_data()),
          static_cast<uint8_t*>(v_out->untyped_data()), static_cast<const T*>(k.untyped_data()),
          static_cast<const T*>(v.untyped_data()),
          static_cast<const int32_t*>(slot_mapping.untyped_data()),
          static_cast<const int32_t*>(layer.untyped_data()),
          static_cast<const float*>(k_scale.untyped_data()),
          static_cast<const float*>(v_scale.untyped_data()), num_tokens, c, error_word,
          validate_only);
    };
    if (aligned && c.head_dim % 16 == 0)
      run(WriteKvFp8Kernel<T, 16>, 16);
    else
      run(WriteKvFp8Kernel<T, 1>, 1);
  };
  auto launch = [&](bool validate_only) {
    if (c.dtype == DType::kF8E4M3) {
      switch (*ToComputeDType(k.element_type())) {
        case DType::kF32: return launch_fp8(float{}, validate_only);
        case DType::kBF16: return launch_fp8(__nv_bfloat16{}, validate_only);
        default: return launch_fp8(__half{}, validate_only);
      }
    }
    auto run = [&](auto kernel) {
      kernel<<<(num_tokens * 32 + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
          static_cast<char*>(k_out->untyped_data()), static_cast<char*>(v_out->untyped_data()),
          static_cast<const char*>(k.untyped_data()), static_cast<const char*>(v.untyped_data()),
          static_cast<const int32_t*>(slot_mapping.untyped_data()),
          static_cast<const int32_t*>(layer.untyped_data()), num_tokens, c, elem, error_word,
          validate_only);
    };
    if (aligned && (row_elems * elem) % kVecBytes == 0)
      run(WriteKvKernel<uint4>);
    else
      run(WriteKvKernel<uint16_t>);  // 2-byte elements at least
  };
  if (checked) {  // validate first so that a refused call writes nothing
    launch(true);
    if (auto err = LaunchError("write_kv"); err.failure()) return err;
    if (auto err = FinishChecked(stream, "write_kv"); err.failure()) return err;
  }
  launch(false);
  return LaunchError("write_kv");
}

}  // namespace
}  // namespace kvcm::cuda

namespace xffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmWriteKvCuda, kvcm::cuda::WriteKvCudaImpl,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // k_cache (layout: slot_major)
                                  .Arg<xffi::AnyBuffer>()  // v_cache
                                  .Arg<xffi::AnyBuffer>()  // k
                                  .Arg<xffi::AnyBuffer>()  // v
                                  .Arg<xffi::AnyBuffer>()  // slot_mapping
                                  .Arg<xffi::AnyBuffer>()  // layer
                                  .Arg<xffi::AnyBuffer>()  // k_scale [L, Hkv] f32 (fp8) or []
                                  .Arg<xffi::AnyBuffer>()  // v_scale
                                  .Ret<xffi::AnyBuffer>()  // k_cache (aliased)
                                  .Ret<xffi::AnyBuffer>()  // v_cache (aliased)
                                  .Attr<bool>("check_indices")
                                  .Attr<bool>("slot_major"));
