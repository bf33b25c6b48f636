// Shape and argument checks shared by the CPU and CUDA handlers.
//
// Page-table convention (spelled out once, used by every op):
//   cache     [num_pages, page_size, num_kv_heads, head_dim]            (or [num_layers, ...] first)
//             or, with the slot_major attribute (the arena), [num_pages, num_layers, page_size,
//             num_kv_heads, head_dim]: the same logical cache, one page of all layers contiguous.
//   flat slot = page * page_size + offset;  token i of sequence b lives in page
//               page_table[b, i / page_size] at offset i % page_size.
//   page 0 is the null page: page-table padding points there and is never read for valid tokens.
//   ring tables (ring_table attribute): token i of sequence b lives in page
//               page_table[b, (i / page_size) % max_pages] instead.
//   fp8 caches (float8_e4m3fn): float32 scales [num_layers, num_kv_heads] per K and V; stored =
//               saturate(x / scale), read = float(stored) * scale.
#pragma once

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define KVCM_HD __host__ __device__
#else
#define KVCM_HD
#endif

namespace kvcm {

namespace ffi = xla::ffi;

enum class DType { kF32, kBF16, kF16, kF8E4M3 };

// The attributes every attention handler binds, in this order (after its operands and result):
// scale, sliding_window, soft_cap, ring_table, check_indices. Usage:
// BindAttentionAttrs(ffi::Ffi::Bind().Arg<...>()...Ret<...>()).
// The operands of a decode attention handler (paged_attention, with or without lse), in order:
// q [B, H, D], k_cache, v_cache (layout: slot_major), page_table [B, P], seq_lens [B], layer [],
// k_scale, v_scale ([L, Hkv] f32 for fp8 caches, else []).
template <typename Binding>
auto BindDecodeOperands(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>();
}

template <typename Binding>
auto BindAttentionAttrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<float>("scale")
      .template Attr<int32_t>("sliding_window")
      .template Attr<float>("soft_cap")
      .template Attr<bool>("ring_table")
      .template Attr<bool>("check_indices");
}

inline std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << "]";
  return s.str();
}

inline std::optional<DType> ToDType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    case ffi::DataType::F8E4M3FN: return DType::kF8E4M3;
    default: return std::nullopt;
  }
}

// The float dtypes of queries and of K/V written into an fp8 cache.
inline std::optional<DType> ToComputeDType(ffi::DataType t) {
  auto d = ToDType(t);
  if (d && *d == DType::kF8E4M3) return std::nullopt;
  return d;
}

inline ffi::Error Invalid(const std::string& msg) { return ffi::Error::InvalidArgument(msg); }
// The same, for functions returning ffi::ErrorOr<T>.
inline ffi::Unexpected<ffi::Error> Fail(const std::string& msg) {
  return ffi::Unexpected<ffi::Error>(Invalid(msg));
}

// The element strides of a pool of num_pages pages of page_elems elements per layer:
//   layer-major [L, S, ...]: page = page_elems,     layer = S * page_elems
//   slot-major  [S, L, ...]: page = L * page_elems, layer = page_elems
struct PoolStrides {
  int64_t page = 0;
  int64_t layer = 0;
  KVCM_HD static PoolStrides Of(bool slot_major, int64_t num_layers, int64_t num_pages,
                                int64_t page_elems) {
    return slot_major ? PoolStrides{num_layers * page_elems, page_elems}
                      : PoolStrides{page_elems, num_pages * page_elems};
  }
};

// Geometry of a K/V cache pair. Strides are in elements; page_stride and layer_stride follow the
// layout (PoolStrides), so element (layer l, page p, offset o, kv head h, d) is at
//   l * layer_stride + p * page_stride + o * token_stride() + h * head_dim + d
// in either layout (int64 arithmetic).
struct CacheShape {
  int64_t num_layers = 1;  // 1 when the cache has no layer axis
  int64_t num_pages = 0;
  int64_t page_size = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  DType dtype = DType::kF32;
  int64_t page_stride = 0;
  int64_t layer_stride = 0;

  KVCM_HD int64_t token_stride() const { return num_kv_heads * head_dim; }
  KVCM_HD int64_t num_slots() const { return num_pages * page_size; }
  // Token rows from one page to the next: page_size (layer-major), num_layers * page_size
  // (slot-major). The kernels address row `page * page_rows() + offset` of a layer.
  KVCM_HD int64_t page_rows() const { return page_stride / token_stride(); }
  // Element offset of flat slot page * page_size + offset within its layer.
  KVCM_HD int64_t SlotOffset(int64_t slot) const {
    return (slot / page_size) * page_stride + (slot % page_size) * token_stride();
  }
};

// slot_major: the caches are [num_pages, num_layers, page_size, num_kv_heads, head_dim] (rank 5).
inline ffi::ErrorOr<CacheShape> ParseCaches(const ffi::AnyBuffer& k_cache,
                                            const ffi::AnyBuffer& v_cache, bool slot_major) {
  auto kd = k_cache.dimensions();
  auto vd = v_cache.dimensions();
  if (slot_major && kd.size() != 5)
    return Fail("k_cache must have rank 5 [num_pages, num_layers, page_size, num_kv_heads, "
                "head_dim] (slot_major), got shape " + DimsToString(kd));
  if (kd.size() != 4 && kd.size() != 5)
    return Fail("k_cache must have rank 4 [num_pages, page_size, num_kv_heads, head_dim] or 5 "
                   "[num_layers, ...], got shape " + DimsToString(kd));
  if (vd.size() != kd.size())
    return Fail("v_cache shape " + DimsToString(vd) + " must equal k_cache shape " +
                   DimsToString(kd));
  for (size_t i = 0; i < kd.size(); ++i)
    if (kd[i] != vd[i])
      return Fail("v_cache shape " + DimsToString(vd) + " must equal k_cache shape " +
                     DimsToString(kd));
  auto dt = ToDType(k_cache.element_type());
  if (!dt) return Fail("k_cache dtype must be float32, bfloat16, float16 or float8_e4m3fn");
  if (v_cache.element_type() != k_cache.element_type())
    return Fail("v_cache dtype must equal k_cache dtype");
  CacheShape c;
  size_t o = kd.size() == 5 ? 1 : 0;
  c.num_layers = o ? kd[slot_major ? 1 : 0] : 1;
  c.num_pages = kd[slot_major ? 0 : o];
  c.page_size = kd[o + 1];
  c.num_kv_heads = kd[o + 2];
  c.head_dim = kd[o + 3];
  c.dtype = *dt;
  if (c.num_layers < 1 || c.num_pages < 1 || c.page_size < 1 || c.num_kv_heads < 1 ||
      c.head_dim < 1)
    return Fail("k_cache has an empty dimension: " + DimsToString(kd));
  const PoolStrides strides =
      PoolStrides::Of(slot_major, c.num_layers, c.num_pages, c.page_size * c.token_stride());
  c.page_stride = strides.page;
  c.layer_stride = strides.layer;
  return c;
}

// Shared shape checks for paged_attention (query_start == nullptr) and ragged_paged_attention.
struct AttentionShape {
  CacheShape cache;
  int64_t num_queries = 0;  // B for decode, T for ragged
  int64_t num_heads = 0;
  int64_t batch = 0;        // number of sequences
  int64_t max_pages = 0;    // page_table width
  DType q_dtype = DType::kF32;  // q and out; the cache dtype or (fp8 caches) any float dtype
  KVCM_HD int64_t group() const { return num_heads / cache.num_kv_heads; }
  KVCM_HD bool fp8() const { return cache.dtype == DType::kF8E4M3; }
};

// The k_scale / v_scale operands: float32 [num_layers, num_kv_heads] for an fp8 cache (the
// Python wrapper reshapes [num_kv_heads]), empty otherwise.
inline ffi::Error CheckScales(const CacheShape& c, const ffi::AnyBuffer& k_scale,
                              const ffi::AnyBuffer& v_scale) {
  const bool fp8 = c.dtype == DType::kF8E4M3;
  for (const auto* s : {&k_scale, &v_scale}) {
    const char* name = s == &k_scale ? "k_scale" : "v_scale";
    auto d = s->dimensions();
    if (!fp8) {
      if (s->element_count() != 0)
        return Invalid(std::string(name) + " is only for float8_e4m3fn caches (pass none)");
      continue;
    }
    if (s->element_type() != ffi::DataType::F32 || d.size() != 2 || d[0] != c.num_layers ||
        d[1] != c.num_kv_heads)
      return Invalid(std::string(name) + " must be float32 [num_layers, num_kv_heads] = [" +
                     std::to_string(c.num_layers) + ", " + std::to_string(c.num_kv_heads) +
                     "] for a float8_e4m3fn cache, got shape " + DimsToString(d));
  }
  return ffi::Error::Success();
}

inline ffi::ErrorOr<AttentionShape> ParseAttention(const ffi::AnyBuffer& q,
                                                   const ffi::AnyBuffer& k_cache,
                                                   const ffi::AnyBuffer& v_cache,
                                                   const ffi::AnyBuffer& page_table,
                                                   const ffi::AnyBuffer& seq_lens,
                                                   const ffi::AnyBuffer* query_start,
                                                   const ffi::AnyBuffer& layer,
                                                   const ffi::AnyBuffer& out, bool slot_major) {
  auto cache = ParseCaches(k_cache, v_cache, slot_major);
  if (cache.has_error()) return ffi::Unexpected<ffi::Error>(cache.error());
  AttentionShape s;
  s.cache = *cache;
  auto qd = q.dimensions();
  if (qd.size() != 3) return Fail("q must have rank 3, got shape " + DimsToString(qd));
  auto qdt = ToComputeDType(q.element_type());
  if (!qdt) return Fail("q dtype must be float32, bfloat16 or float16");
  if (!s.fp8() && q.element_type() != k_cache.element_type())
    return Fail("q dtype must equal the cache dtype");
  s.q_dtype = *qdt;
  s.num_queries = qd[0];
  s.num_heads = qd[1];
  if (qd[2] != s.cache.head_dim)
    return Fail("q head_dim " + std::to_string(qd[2]) + " must equal the cache head_dim " +
                   std::to_string(s.cache.head_dim));
  if (s.num_heads < 1 || s.num_heads % s.cache.num_kv_heads != 0)
    return Fail("q num_heads " + std::to_string(s.num_heads) +
                   " must be a positive multiple of num_kv_heads " +
                   std::to_string(s.cache.num_kv_heads));
  auto pt = page_table.dimensions();
  if (pt.size() != 2 || page_table.element_type() != ffi::DataType::S32)
    return Fail("page_table must be int32 [batch, max_pages], got shape " + DimsToString(pt));
  s.batch = pt[0];
  s.max_pages = pt[1];
  auto sl = seq_lens.dimensions();
  if (sl.size() != 1 || sl[0] != s.batch || seq_lens.element_type() != ffi::DataType::S32)
    return Fail("seq_lens must be int32 [batch] with batch=" + std::to_string(s.batch) +
                   ", got shape " + DimsToString(sl));
  if (query_start == nullptr) {
    if (s.num_queries != s.batch)
      return Fail("q batch " + std::to_string(s.num_queries) + " must equal page_table batch " +
                     std::to_string(s.batch));
  } else {
    auto qs = query_start->dimensions();
    if (qs.size() != 1 || qs[0] != s.batch + 1 ||
        query_start->element_type() != ffi::DataType::S32)
      return Fail("query_start must be int32 [batch + 1] with batch=" +
                     std::to_string(s.batch) + ", got shape " + DimsToString(qs));
  }
  if (layer.dimensions().size() != 0 || layer.element_type() != ffi::DataType::S32)
    return Fail("layer must be an int32 scalar");
  auto od = out.dimensions();
  if (od.size() != 3 || od[0] != qd[0] || od[1] != qd[1] || od[2] != qd[2] ||
      out.element_type() != q.element_type())
    return Fail("out must have the shape and dtype of q");
  return s;
}

// The optional log-sum-exp output of paged_attention: float32 [num_queries, num_heads].
inline ffi::Error CheckLse(const AttentionShape& s, const ffi::AnyBuffer& lse) {
  auto d = lse.dimensions();
  if (d.size() != 2 || d[0] != s.num_queries || d[1] != s.num_heads ||
      lse.element_type() != ffi::DataType::F32)
    return Invalid("lse must be float32 [num_queries, num_heads] = [" +
                   std::to_string(s.num_queries) + ", " + std::to_string(s.num_heads) +
                   "], got shape " + DimsToString(d));
  return ffi::Error::Success();
}

// Shape checks for write_kv; returns the cache geometry.
inline ffi::ErrorOr<CacheShape> ParseWriteKv(const ffi::AnyBuffer& k_cache,
                                             const ffi::AnyBuffer& v_cache, const ffi::AnyBuffer& k,
                                             const ffi::AnyBuffer& v,
                                             const ffi::AnyBuffer& slot_mapping,
                                             const ffi::AnyBuffer& layer, bool slot_major) {
  auto cache = ParseCaches(k_cache, v_cache, slot_major);
  if (cache.has_error()) return ffi::Unexpected<ffi::Error>(cache.error());
  const CacheShape& c = *cache;
  auto kd = k.dimensions();
  if (kd.size() != 3 || kd[1] != c.num_kv_heads || kd[2] != c.head_dim)
    return Fail("k must have shape [T, num_kv_heads, head_dim] = [T, " +
                std::to_string(c.num_kv_heads) + ", " + std::to_string(c.head_dim) + "], got " +
                DimsToString(kd));
  auto vd = v.dimensions();
  if (vd.size() != 3 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2])
    return Fail("v shape " + DimsToString(vd) + " must equal k shape " + DimsToString(kd));
  if (c.dtype == DType::kF8E4M3) {
    if (!ToComputeDType(k.element_type()) || v.element_type() != k.element_type())
      return Fail("k and v must have one dtype, float32, bfloat16 or float16, for a "
                  "float8_e4m3fn cache");
  } else if (k.element_type() != k_cache.element_type() ||
             v.element_type() != k_cache.element_type()) {
    return Fail("k and v dtype must equal the cache dtype");
  }
  if (slot_mapping.element_type() != ffi::DataType::S32 || slot_mapping.dimensions().size() != 1 ||
      slot_mapping.dimensions()[0] != kd[0])
    return Fail("slot_mapping must be int32 [T] with T=" + std::to_string(kd[0]));
  if (layer.element_type() != ffi::DataType::S32 || layer.dimensions().size() != 0)
    return Fail("layer must be an int32 scalar");
  return c;
}

}  // namespace kvcm
