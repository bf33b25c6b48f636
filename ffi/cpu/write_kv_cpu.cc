// CPU twin of write_kv: scatter K/V rows into their flat slots, in place. For an fp8 cache each
// element is stored as saturate(x / scale[layer, kv head]) (round to nearest even, +-448).
#include <cstring>

#include "kvcm/host_dtype.h"
#include "kvcm/shapes.h"

namespace kvcm {
namespace {

// Quantizes one [Hkv, D] row of T into fp8 with per-kv-head scales.
template <typename T>
void QuantizeRow(const T* src, fp8e4m3_t* dst, const float* scales, int64_t num_kv_heads,
                 int64_t head_dim) {
  for (int64_t h = 0; h < num_kv_heads; ++h)
    for (int64_t d = 0; d < head_dim; ++d)
      dst[h * head_dim + d] = SaturateToFp8(ToFloat(src[h * head_dim + d]) / scales[h]);
}

// kc, vc: the layer's first element.
template <typename T>
void WriteFp8(const CacheShape& c, const char* ks, const char* vs, const int32_t* slots,
              int64_t num_tokens, const float* k_scale, const float* v_scale, char* kc, char* vc) {
  const int64_t row = c.token_stride();
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;  // padding
    const int64_t at = c.SlotOffset(slots[t]);
    QuantizeRow(reinterpret_cast<const T*>(ks) + t * row, reinterpret_cast<fp8e4m3_t*>(kc) + at,
                k_scale, c.num_kv_heads, c.head_dim);
    QuantizeRow(reinterpret_cast<const T*>(vs) + t * row, reinterpret_cast<fp8e4m3_t*>(vc) + at,
                v_scale, c.num_kv_heads, c.head_dim);
  }
}

}  // namespace

ffi::Error WriteKvCpuImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::AnyBuffer slot_mapping,
                          ffi::AnyBuffer layer, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                          ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                          bool check_indices, bool slot_major) {
  (void)check_indices;  // the CPU handler always checks
  auto cache = ParseWriteKv(k_cache, v_cache, k, v, slot_mapping, layer, slot_major);
  if (cache.has_error()) return cache.error();
  const CacheShape& c = *cache;
  if (auto err = CheckScales(c, k_scale, v_scale); err.failure()) return err;
  const int64_t num_tokens = k.dimensions()[0];
  const int32_t layer_index = *static_cast<const int32_t*>(layer.untyped_data());
  if (layer_index < 0 || layer_index >= c.num_layers)
    return Invalid("layer " + std::to_string(layer_index) + " is outside [0, " +
                   std::to_string(c.num_layers) + ")");
  const auto* slots = static_cast<const int32_t*>(slot_mapping.untyped_data());
  // Validate everything before writing anything: a bad call leaves the cache untouched.
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] >= c.num_slots())
      return Invalid("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slots[t]) +
                     " is outside the cache (" + std::to_string(c.num_slots()) + " slots)");
  const size_t elem = ffi::ByteWidth(k_cache.element_type());
  const size_t row_bytes = size_t(c.token_stride()) * elem;
  auto* kc = static_cast<char*>(k_out->untyped_data()) + size_t(layer_index * c.layer_stride) * elem;
  auto* vc = static_cast<char*>(v_out->untyped_data()) + size_t(layer_index * c.layer_stride) * elem;
  const auto* ks = static_cast<const char*>(k.untyped_data());
  const auto* vs = static_cast<const char*>(v.untyped_data());
  if (c.dtype == DType::kF8E4M3) {
    const float* ksc = static_cast<const float*>(k_scale.untyped_data()) + layer_index * c.num_kv_heads;
    const float* vsc = static_cast<const float*>(v_scale.untyped_data()) + layer_index * c.num_kv_heads;
    switch (*ToComputeDType(k.element_type())) {
      case DType::kF32: WriteFp8<float>(c, ks, vs, slots, num_tokens, ksc, vsc, kc, vc); break;
      case DType::kBF16: WriteFp8<bf16_t>(c, ks, vs, slots, num_tokens, ksc, vsc, kc, vc); break;
      case DType::kF16: WriteFp8<f16_t>(c, ks, vs, slots, num_tokens, ksc, vsc, kc, vc); break;
      case DType::kF8E4M3: break;  // refused by ParseWriteKv
    }
    return ffi::Error::Success();
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;  // padding
    const size_t at = size_t(c.SlotOffset(slots[t])) * elem;
    std::memcpy(kc + at, ks + size_t(t) * row_bytes, row_bytes);
    std::memcpy(vc + at, vs + size_t(t) * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace kvcm

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmWriteKvCpu, kvcm::WriteKvCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // k_cache (layout: slot_major)
                                  .Arg<xla::ffi::AnyBuffer>()  // v_cache
                                  .Arg<xla::ffi::AnyBuffer>()  // k
                                  .Arg<xla::ffi::AnyBuffer>()  // v
                                  .Arg<xla::ffi::AnyBuffer>()  // slot_mapping [T] int32
                                  .Arg<xla::ffi::AnyBuffer>()  // layer [] int32
                                  .Arg<xla::ffi::AnyBuffer>()  // k_scale [L, Hkv] f32 (fp8) or []
                                  .Arg<xla::ffi::AnyBuffer>()  // v_scale
                                  .Ret<xla::ffi::AnyBuffer>()  // k_cache (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()  // v_cache (aliased)
                                  .Attr<bool>("check_indices")
                                  .Attr<bool>("slot_major"));
