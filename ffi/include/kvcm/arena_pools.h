// The K and V pools of a CPU arena given by address (jax_kvcm/_arena_pool.py, by_address form),
// for the kvcm_arena_* handlers of the ops (ffi/cpu/arena_ops_cpu.cc) and the codecs
// (ffi/cpu/codec_cpu.cc).
//
// The handlers' `pool` attribute:
//   [k_address, v_address, num_layers, num_slots, page_size, num_kv_heads, head_dim, slot_major,
//    dtype]   (logical layer-major dims; dtype: 0 float32, 1 bfloat16, 2 float16, 3 fp8 e4m3fn)
// ArenaPools views the two pools as buffers of their physical shape over the reservation (no
// copy), so the handlers run the ops' and codecs' own code with the layout flag. Every call checks
// that the pools lie in an open reservation (an error, not a fault, after the arena is closed);
// writers and the codecs also check the pages they touch are mapped before touching any.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "kvcm/arena_registry.h"
#include "kvcm/shapes.h"

namespace kvcm {

class ArenaPools {
 public:
  ffi::Error Init(ffi::Span<const int64_t> pool) {
    if (pool.size() != 9)
      return Invalid("pool must be [k_address, v_address, num_layers, num_slots, page_size, "
                     "num_kv_heads, head_dim, slot_major, dtype], got " +
                     std::to_string(pool.size()) + " values");
    slot_major_ = pool[7] != 0;
    int64_t count = 1;
    for (int i = 0; i < 5; ++i) {
      if (pool[2 + i] < 1) return Invalid("pool has an empty dimension");
      count *= pool[2 + i];
    }
    for (int i = 0; i < 5; ++i) dims_[i] = pool[2 + i];
    if (slot_major_) std::swap(dims_[0], dims_[1]);  // physical [S, L, P, Hkv, D]
    static constexpr ffi::DataType kDTypes[] = {ffi::DataType::F32, ffi::DataType::BF16,
                                                ffi::DataType::F16, ffi::DataType::F8E4M3FN};
    if (pool[8] < 0 || pool[8] > 3)
      return Invalid("pool dtype code must be 0 (float32), 1 (bfloat16), 2 (float16) or 3 "
                     "(float8_e4m3fn), got " + std::to_string(pool[8]));
    const ffi::DataType dtype = kDTypes[pool[8]];
    elem_bytes_ = int64_t(ffi::ByteWidth(dtype));
    const size_t bytes = size_t(count * elem_bytes_);
    for (int i = 0; i < 2; ++i) {
      const auto address = static_cast<uintptr_t>(pool[i]);
      if (!ArenaHolds(address, bytes))
        return Invalid(std::string(i ? "v" : "k") +
                       " pool is not inside an open arena reservation (closed arena?)");
      buf_[i] = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr,
                               static_cast<XLA_FFI_DataType>(dtype),
                               reinterpret_cast<void*>(address), 5, dims_};
    }
    auto shape = ParseCaches(k(), v(), slot_major_);
    if (shape.has_error()) return shape.error();
    shape_ = *shape;
    return ffi::Error::Success();
  }

  ffi::AnyBuffer k() const { return ffi::AnyBuffer(&buf_[0]); }
  ffi::AnyBuffer v() const { return ffi::AnyBuffer(&buf_[1]); }
  bool slot_major() const { return slot_major_; }
  const CacheShape& shape() const { return shape_; }

  // Whether `elems` elements at element offset `at` of both pools are on mapped super-pages.
  bool Mapped(int64_t at, int64_t elems) const {
    for (const auto& b : buf_)
      if (!ArenaMapped(reinterpret_cast<uintptr_t>(b.data) + uintptr_t(at * elem_bytes_),
                       size_t(elems * elem_bytes_)))
        return false;
    return true;
  }

  // Refuses a row in an unmapped super-page (the checks ParseWriteKv and WriteKvCpuImpl make
  // on shapes and slot bounds come first).
  ffi::Error CheckRowsMapped(const ffi::AnyBuffer& slot_mapping, int32_t layer) const {
    const auto* slots = static_cast<const int32_t*>(slot_mapping.untyped_data());
    const int64_t n = slot_mapping.dimensions()[0];
    for (int64_t t = 0; t < n; ++t) {
      if (slots[t] < 0 || slots[t] >= shape_.num_slots()) continue;  // padding / refused later
      if (!Mapped(layer * shape_.layer_stride + shape_.SlotOffset(slots[t]),
                  shape_.token_stride()))
        return Invalid("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slots[t]) +
                       " is in an unmapped part of the arena");
    }
    return ffi::Error::Success();
  }

  // Refuses a hot page (all its layers) in an unmapped super-page; `page` is in range.
  ffi::Error CheckPageMapped(int64_t page, const char* what) const {
    const int64_t page_elems = shape_.page_size * shape_.token_stride();
    for (int64_t l = 0; l < shape_.num_layers; ++l)
      if (!Mapped(l * shape_.layer_stride + page * shape_.page_stride, page_elems))
        return Invalid(std::string(what) + ": hot page " + std::to_string(page) +
                       " is in an unmapped part of the arena");
    return ffi::Error::Success();
  }

 private:
  bool slot_major_ = false;
  int64_t elem_bytes_ = 0;
  int64_t dims_[5] = {};
  CacheShape shape_;
  XLA_FFI_Buffer buf_[2] = {};
};

// The int32 scalar ordering tokens of the by-address handlers.
inline ffi::Error CheckToken(const ffi::AnyBuffer& t, const char* name) {
  if (t.element_type() != ffi::DataType::S32 || t.dimensions().size() != 0)
    return Invalid(std::string(name) + " must be an int32 scalar");
  return ffi::Error::Success();
}

// `token` = `after` + 1 (both int32 scalars, checked).
inline void AdvanceToken(const ffi::AnyBuffer& after, ffi::AnyBuffer token) {
  *static_cast<int32_t*>(token.untyped_data()) =
      *static_cast<const int32_t*>(after.untyped_data()) + 1;
}

}  // namespace kvcm
