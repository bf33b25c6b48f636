// CPU twin of paged_attention (decode) and ragged_paged_attention (prefill / mixed).
//
// Both reduce to one routine: query row (token t, head h) of sequence b at position `pos`
// attends to cached positions [max(0, pos + 1 - window), pos] of sequence b, read through its
// page table. Accumulation is float32 (two passes: logits, then softmax-weighted V).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvcm/host_dtype.h"
#include "kvcm/shapes.h"

namespace kvcm {
namespace {

struct AttentionParams {
  float scale;
  int32_t window;  // <= 0: no window
  float soft_cap;  // <= 0: no cap
};

template <typename T>
class RowAttender {
 public:
  RowAttender(const AttentionShape& s, const T* k, const T* v, const int32_t* page_table,
              AttentionParams p)
      : s_(s), k_(k), v_(v), page_table_(page_table), p_(p),
        logits_(size_t(s.max_pages * s.cache.page_size)), acc_(size_t(s.cache.head_dim)) {}

  // q_row, out_row: [num_heads, head_dim]. Attends all heads of one query token.
  void Attend(const T* q_row, int64_t b, int64_t pos, T* out_row) {
    const int64_t D = s_.cache.head_dim, P = s_.cache.page_size;
    const int64_t lo = p_.window > 0 ? std::max<int64_t>(0, pos + 1 - p_.window) : 0;
    const int32_t* pages = page_table_ + b * s_.max_pages;
    for (int64_t h = 0; h < s_.num_heads; ++h) {
      const int64_t kvh = h / s_.group();
      const T* qh = q_row + h * D;
      float max_logit = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j <= pos; ++j) {
        const T* kr = k_ + Offset(pages[j / P], j % P, kvh);
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += ToFloat(qh[d]) * ToFloat(kr[d]);
        float logit = dot * p_.scale;
        if (p_.soft_cap > 0.f) logit = p_.soft_cap * std::tanh(logit / p_.soft_cap);
        logits_[j - lo] = logit;
        max_logit = std::max(max_logit, logit);
      }
      std::fill(acc_.begin(), acc_.end(), 0.f);
      float denom = 0.f;
      for (int64_t j = lo; j <= pos; ++j) {
        const float w = std::exp(logits_[j - lo] - max_logit);
        denom += w;
        const T* vr = v_ + Offset(pages[j / P], j % P, kvh);
        for (int64_t d = 0; d < D; ++d) acc_[d] += w * ToFloat(vr[d]);
      }
      T* oh = out_row + h * D;
      for (int64_t d = 0; d < D; ++d) oh[d] = FromFloat<T>(denom > 0.f ? acc_[d] / denom : 0.f);
    }
  }

  void Zero(T* out_row) {
    for (int64_t i = 0; i < s_.num_heads * s_.cache.head_dim; ++i) out_row[i] = FromFloat<T>(0.f);
  }

 private:
  int64_t Offset(int64_t page, int64_t slot, int64_t kvh) const {
    return page * s_.cache.page_stride() + slot * s_.cache.token_stride() + kvh * s_.cache.head_dim;
  }
  const AttentionShape& s_;
  const T* k_;
  const T* v_;
  const int32_t* page_table_;
  AttentionParams p_;
  std::vector<float> logits_;
  std::vector<float> acc_;
};

// Checks every index the kernels will read; nothing is read before all of them pass.
ffi::Error CheckIndices(const AttentionShape& s, const int32_t* page_table, const int32_t* seq_lens,
                        const int32_t* query_start, int32_t layer, int32_t window) {
  if (layer < 0 || layer >= s.cache.num_layers)
    return Invalid("layer " + std::to_string(layer) + " is outside [0, " +
                   std::to_string(s.cache.num_layers) + ")");
  const int64_t capacity = s.max_pages * s.cache.page_size;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int32_t len = seq_lens[b];
    if (len < 0 || len > capacity)
      return Invalid("seq_lens[" + std::to_string(b) + "] = " + std::to_string(len) +
                     " is outside [0, max_pages * page_size = " + std::to_string(capacity) + "]");
    if (query_start != nullptr) {
      const int32_t n = query_start[b + 1] - query_start[b];
      if (query_start[b] < 0 || n < 0 || query_start[b + 1] > s.num_queries)
        return Invalid("query_start must be non-decreasing within [0, " +
                       std::to_string(s.num_queries) + "], broken at index " + std::to_string(b));
      if (n > len)
        return Invalid("sequence " + std::to_string(b) + " has " + std::to_string(n) +
                       " queries (query_start) but seq_lens = " + std::to_string(len));
    }
    // Only pages holding positions some query can see are read.
    const int64_t first_pos =
        window > 0 ? std::max<int64_t>(0, len - (query_start ? query_start[b + 1] - query_start[b] : 1) + 1 - window)
                   : 0;
    for (int64_t i = first_pos / s.cache.page_size; i * s.cache.page_size < len; ++i) {
      const int32_t page = page_table[b * s.max_pages + i];
      if (page < 0 || page >= s.cache.num_pages)
        return Invalid("page_table[" + std::to_string(b) + ", " + std::to_string(i) + "] = " +
                       std::to_string(page) + " is outside the cache (" +
                       std::to_string(s.cache.num_pages) + " pages)");
    }
  }
  return ffi::Error::Success();
}

template <typename T>
void RunAttention(const AttentionShape& s, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k_cache,
                  const ffi::AnyBuffer& v_cache, const int32_t* page_table, const int32_t* seq_lens,
                  const int32_t* query_start, int32_t layer, AttentionParams p, ffi::AnyBuffer out) {
  const T* k = static_cast<const T*>(k_cache.untyped_data()) + layer * s.cache.layer_stride();
  const T* v = static_cast<const T*>(v_cache.untyped_data()) + layer * s.cache.layer_stride();
  const T* qd = static_cast<const T*>(q.untyped_data());
  T* od = static_cast<T*>(out.untyped_data());
  const int64_t row = s.num_heads * s.cache.head_dim;
  RowAttender<T> attender(s, k, v, page_table, p);
  if (query_start == nullptr) {  // decode: row b is the last token of sequence b
    for (int64_t b = 0; b < s.batch; ++b) {
      if (seq_lens[b] == 0) attender.Zero(od + b * row);
      else attender.Attend(qd + b * row, b, seq_lens[b] - 1, od + b * row);
    }
    return;
  }
  for (int64_t t = 0; t < query_start[0]; ++t) attender.Zero(od + t * row);
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t end = query_start[b + 1];
    for (int64_t t = query_start[b]; t < end; ++t)
      attender.Attend(qd + t * row, b, seq_lens[b] - (end - t), od + t * row);
  }
  for (int64_t t = query_start[s.batch]; t < s.num_queries; ++t) attender.Zero(od + t * row);
}

ffi::Error AttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                        ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens,
                        const ffi::AnyBuffer* query_start, ffi::AnyBuffer layer,
                        ffi::AnyBuffer out, float scale, int32_t window, float soft_cap) {
  auto shape = ParseAttention(q, k_cache, v_cache, page_table, seq_lens, query_start, layer, out);
  if (shape.has_error()) return shape.error();
  const auto* pt = static_cast<const int32_t*>(page_table.untyped_data());
  const auto* sl = static_cast<const int32_t*>(seq_lens.untyped_data());
  const auto* qs = query_start ? static_cast<const int32_t*>(query_start->untyped_data()) : nullptr;
  const int32_t li = *static_cast<const int32_t*>(layer.untyped_data());
  if (auto err = CheckIndices(*shape, pt, sl, qs, li, window); err.failure()) return err;
  AttentionParams p{scale, window, soft_cap};
  switch (shape->cache.dtype) {
    case DType::kF32: RunAttention<float>(*shape, q, k_cache, v_cache, pt, sl, qs, li, p, out); break;
    case DType::kBF16: RunAttention<bf16_t>(*shape, q, k_cache, v_cache, pt, sl, qs, li, p, out); break;
    case DType::kF16: RunAttention<f16_t>(*shape, q, k_cache, v_cache, pt, sl, qs, li, p, out); break;
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttentionCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                 ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens,
                                 ffi::AnyBuffer layer, ffi::Result<ffi::AnyBuffer> out, float scale,
                                 int32_t sliding_window, float soft_cap) {
  return AttentionCpu(q, k_cache, v_cache, page_table, seq_lens, nullptr, layer, *out, scale,
                      sliding_window, soft_cap);
}

ffi::Error RaggedPagedAttentionCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                       ffi::AnyBuffer v_cache, ffi::AnyBuffer page_table,
                                       ffi::AnyBuffer seq_lens, ffi::AnyBuffer query_start,
                                       ffi::AnyBuffer layer, ffi::Result<ffi::AnyBuffer> out,
                                       float scale, int32_t sliding_window, float soft_cap) {
  return AttentionCpu(q, k_cache, v_cache, page_table, seq_lens, &query_start, layer, *out, scale,
                      sliding_window, soft_cap);
}

}  // namespace
}  // namespace kvcm

namespace xffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmPagedAttentionCpu, kvcm::PagedAttentionCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()  // q [B, H, D]
                                  .Arg<xffi::AnyBuffer>()  // k_cache
                                  .Arg<xffi::AnyBuffer>()  // v_cache
                                  .Arg<xffi::AnyBuffer>()  // page_table [B, P]
                                  .Arg<xffi::AnyBuffer>()  // seq_lens [B]
                                  .Arg<xffi::AnyBuffer>()  // layer []
                                  .Ret<xffi::AnyBuffer>()  // out [B, H, D]
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmRaggedPagedAttentionCpu, kvcm::RaggedPagedAttentionCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()  // q [T, H, D]
                                  .Arg<xffi::AnyBuffer>()  // k_cache
                                  .Arg<xffi::AnyBuffer>()  // v_cache
                                  .Arg<xffi::AnyBuffer>()  // page_table [B, P]
                                  .Arg<xffi::AnyBuffer>()  // seq_lens [B]
                                  .Arg<xffi::AnyBuffer>()  // query_start [B + 1]
                                  .Arg<xffi::AnyBuffer>()  // layer []
                                  .Ret<xffi::AnyBuffer>()  // out [T, H, D]
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
