// CPU twin of write_kv: scatter K/V rows into their flat slots, in place.
#include <cstring>

#include "kvcm/shapes.h"

namespace kvcm {

ffi::Error WriteKvCpuImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::AnyBuffer slot_mapping,
                          ffi::AnyBuffer layer, ffi::Result<ffi::AnyBuffer> k_out,
                          ffi::Result<ffi::AnyBuffer> v_out) {
  auto cache = ParseWriteKv(k_cache, v_cache, k, v, slot_mapping, layer);
  if (cache.has_error()) return cache.error();
  const CacheShape& c = *cache;
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
  auto* kc = static_cast<char*>(k_out->untyped_data()) + size_t(layer_index) * c.layer_stride() * elem;
  auto* vc = static_cast<char*>(v_out->untyped_data()) + size_t(layer_index) * c.layer_stride() * elem;
  const auto* ks = static_cast<const char*>(k.untyped_data());
  const auto* vs = static_cast<const char*>(v.untyped_data());
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;  // padding
    std::memcpy(kc + size_t(slots[t]) * row_bytes, ks + size_t(t) * row_bytes, row_bytes);
    std::memcpy(vc + size_t(slots[t]) * row_bytes, vs + size_t(t) * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace kvcm

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmWriteKvCpu, kvcm::WriteKvCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // k_cache
                                  .Arg<xla::ffi::AnyBuffer>()  // v_cache
                                  .Arg<xla::ffi::AnyBuffer>()  // k
                                  .Arg<xla::ffi::AnyBuffer>()  // v
                                  .Arg<xla::ffi::AnyBuffer>()  // slot_mapping [T] int32
                                  .Arg<xla::ffi::AnyBuffer>()  // layer [] int32
                                  .Ret<xla::ffi::AnyBuffer>()  // k_cache (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()  // v_cache (aliased)
);
