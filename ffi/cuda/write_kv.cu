// CUDA write_kv: one warp per token copies its K and V rows (16-byte vectors) into the slot; for an
// fp8 cache it quantizes them instead: saturate(x / scale[layer, kv head]), rounded to nearest
// even (cvt.rn.satfinite: +-448, NaN kept), with an IEEE division like the CPU handler.
#include "kvcm/cuda/common.cuh"

namespace kvcm::cuda {
namespace {

// The element offset of token `warp`'s row in the cache, or -1 when it writes nothing (padding,
// or a bad layer / slot: error bits raised by lane 0).
__device__ __forceinline__ int64_t DestRow(const CacheShape& c, const int32_t* slot_mapping,
                                           const int32_t* layer, int64_t warp, int lane,
                                           uint32_t* error_word) {
  const int32_t li = *layer;
  if (li < 0 || li >= c.num_layers) {
    if (lane == 0) RaiseError(error_word, kBadLayer);
    return -1;
  }
  const int32_t slot = slot_mapping[warp];
  if (slot < 0) return -1;  // padding
  if (slot >= c.num_slots()) {
    if (lane == 0) RaiseError(error_word, kBadSlot);
    return -1;
  }
  const int32_t page = slot / int32_t(c.page_size), offset = slot - page * int32_t(c.page_size);
  return li * c.layer_stride + page * c.page_stride + offset * c.token_stride();
}

// validate_only: check the indices and raise error bits, write nothing (checked mode, pass 1).
__global__ void WriteKvKernel(char* __restrict__ k_cache, char* __restrict__ v_cache,
                              const char* __restrict__ k, const char* __restrict__ v,
                              const int32_t* __restrict__ slot_mapping,
                              const int32_t* __restrict__ layer, int64_t num_tokens,
                              CacheShape c, int64_t elem_bytes, uint32_t* error_word,
                              bool validate_only) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= num_tokens) return;
  const int64_t row = DestRow(c, slot_mapping, layer, warp, lane, error_word);
  if (row < 0 || validate_only) return;
  const int64_t row_bytes = c.token_stride() * elem_bytes;
  const int64_t dst = row * elem_bytes;
  const int64_t src = warp * row_bytes;
  if (row_bytes % 16 == 0) {
    for (int64_t i = lane * 16; i < row_bytes; i += 32 * 16) {
      *reinterpret_cast<uint4*>(k_cache + dst + i) = *reinterpret_cast<const uint4*>(k + src + i);
      *reinterpret_cast<uint4*>(v_cache + dst + i) = *reinterpret_cast<const uint4*>(v + src + i);
    }
  } else {
    for (int64_t i = lane * 2; i < row_bytes; i += 32 * 2) {  // 2-byte elements at least
      *reinterpret_cast<uint16_t*>(k_cache + dst + i) = *reinterpret_cast<const uint16_t*>(k + src + i);
      *reinterpret_cast<uint16_t*>(v_cache + dst + i) = *reinterpret_cast<const uint16_t*>(v + src + i);
    }
  }
}

// Same indexing as WriteKvKernel; T is the dtype of k and v, the cache is float8_e4m3fn.
template <typename T>
__global__ void WriteKvFp8Kernel(__nv_fp8_e4m3* __restrict__ k_cache,
                                 __nv_fp8_e4m3* __restrict__ v_cache, const T* __restrict__ k,
                                 const T* __restrict__ v, const int32_t* __restrict__ slot_mapping,
                                 const int32_t* __restrict__ layer,
                                 const float* __restrict__ k_scale,
                                 const float* __restrict__ v_scale, int64_t num_tokens,
                                 CacheShape c, uint32_t* error_word, bool validate_only) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= num_tokens) return;
  const int64_t dst = DestRow(c, slot_mapping, layer, warp, lane, error_word);
  if (dst < 0 || validate_only) return;
  const int64_t row = c.token_stride();
  const int32_t li = *layer;
  const float* ks = k_scale + li * c.num_kv_heads;
  const float* vs = v_scale + li * c.num_kv_heads;
  for (int64_t e = lane; e < row; e += 32) {
    const int64_t h = e / c.head_dim;
    k_cache[dst + e] = DTypeTraits<__nv_fp8_e4m3>::from_float(
        DTypeTraits<T>::to_float(k[warp * row + e]) / ks[h]);
    v_cache[dst + e] = DTypeTraits<__nv_fp8_e4m3>::from_float(
        DTypeTraits<T>::to_float(v[warp * row + e]) / vs[h]);
  }
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
  const int threads = 256;
  const int64_t blocks = (num_tokens * 32 + threads - 1) / threads;
  auto launch_fp8 = [&](auto t, bool validate_only) {
    using T = decltype(t);
    WriteKvFp8Kernel<T><<<blocks, threads, 0, stream>>>(
        static_cast<__nv_fp8_e4m3*>(k_out->untyped_data()),
        static_cast<__nv_fp8_e4m3*>(v_out->untyped_data()), static_cast<const T*>(k.untyped_data()),
        static_cast<const T*>(v.untyped_data()),
        static_cast<const int32_t*>(slot_mapping.untyped_data()),
        static_cast<const int32_t*>(layer.untyped_data()),
        static_cast<const float*>(k_scale.untyped_data()),
        static_cast<const float*>(v_scale.untyped_data()), num_tokens, c, error_word,
        validate_only);
  };
  auto launch = [&](bool validate_only) {
    if (c.dtype == DType::kF8E4M3) {
      switch (*ToComputeDType(k.element_type())) {
        case DType::kF32: return launch_fp8(float{}, validate_only);
        case DType::kBF16: return launch_fp8(__nv_bfloat16{}, validate_only);
        default: return launch_fp8(__half{}, validate_only);
      }
    }
    WriteKvKernel<<<blocks, threads, 0, stream>>>(
        static_cast<char*>(k_out->untyped_data()), static_cast<char*>(v_out->untyped_data()),
        static_cast<const char*>(k.untyped_data()), static_cast<const char*>(v.untyped_data()),
        static_cast<const int32_t*>(slot_mapping.untyped_data()),
        static_cast<const int32_t*>(layer.untyped_data()), num_tokens, c, elem, error_word,
        validate_only);
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
