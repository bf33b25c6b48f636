// CPU twin of paged_attention (decode) and ragged_paged_attention (prefill / mixed).
//
// Both reduce to one routine: query row (token t, head h) of sequence b at position `pos`
// attends to cached positions [max(0, pos + 1 - window), pos] of sequence b, read through its
// page table (absolute or ring). Accumulation is float32 (two passes: logits, then
// softmax-weighted V). fp8 caches are read as float(stored) * scale[layer, kv head].
//
// Non-finite rule (the same as the reference and the CUDA kernels): a non-finite q.k gives a NaN
// logit, so the row's output is NaN (a soft cap would otherwise turn inf into a finite logit);
// a non-finite V at an attended position makes the output non-finite; nothing outside the
// attended positions is read.
//
// The log-sum-exp output (paged_attention's return_lse; decode only): lse[row, h] = the natural
// log of sum_j exp(logit_j) over the attended positions, -inf with none, NaN with a NaN logit.
// Two partial attentions over disjoint positions merge exactly through it (ops/cascade.py).
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
  bool ring;       // ring page table
};

// The page of position `pos` of the sequence whose table row is `row` (max_pages entries).
inline int64_t PageEntry(int64_t pos, int64_t page_size, int64_t max_pages, bool ring) {
  const int64_t i = pos / page_size;
  return ring ? i % max_pages : i;
}

// T: q / out dtype; KV: cache dtype (T, or fp8e4m3_t with per-kv-head scales).
template <typename T, typename KV>
class RowAttender {
 public:
  RowAttender(const AttentionShape& s, const KV* k, const KV* v, const float* k_scale,
              const float* v_scale, const int32_t* page_table, AttentionParams p)
      : s_(s), k_(k), v_(v), k_scale_(k_scale), v_scale_(v_scale), page_table_(page_table),
        p_(p), logits_(), acc_(size_t(s.cache.head_dim)) {}

  // q_row, out_row: [num_heads, head_dim]; lse_row: [num_heads] or nullptr. Attends all heads
  // of one query token.
  void Attend(const T* q_row, int64_t b, int64_t pos, T* out_row, float* lse_row = nullptr) {
    const int64_t D = s_.cache.head_dim, P = s_.cache.page_size;
    const int64_t lo = p_.window > 0 ? std::max<int64_t>(0, pos + 1 - p_.window) : 0;
    const int32_t* pages = page_table_ + b * s_.max_pages;
    logits_.resize(size_t(pos + 1 - lo));
    for (int64_t h = 0; h < s_.num_heads; ++h) {
      const int64_t kvh = h / s_.group();
      const float ks = k_scale_ ? k_scale_[kvh] : 1.f, vs = v_scale_ ? v_scale_[kvh] : 1.f;
      const T* qh = q_row + h * D;
      float max_logit = -std::numeric_limits<float>::infinity();
      bool nan = false;
      for (int64_t j = lo; j <= pos; ++j) {
        const KV* kr = k_ + Offset(pages[PageEntry(j, P, s_.max_pages, p_.ring)], j % P, kvh);
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += ToFloat(qh[d]) * (ToFloat(kr[d]) * ks);
        float logit = dot * p_.scale;
        if (p_.soft_cap > 0.f) logit = p_.soft_cap * std::tanh(logit / p_.soft_cap);
        nan |= !std::isfinite(dot);
        logits_[j - lo] = logit;
        max_logit = std::max(max_logit, logit);
      }
      T* oh = out_row + h * D;
      if (nan) {
        for (int64_t d = 0; d < D; ++d) oh[d] = FromFloat<T>(NAN);
        if (lse_row) lse_row[h] = NAN;
        continue;
      }
      std::fill(acc_.begin(), acc_.end(), 0.f);
      float denom = 0.f;
      for (int64_t j = lo; j <= pos; ++j) {
        const float w = std::exp(logits_[j - lo] - max_logit);
        denom += w;
        const KV* vr = v_ + Offset(pages[PageEntry(j, P, s_.max_pages, p_.ring)], j % P, kvh);
        for (int64_t d = 0; d < D; ++d) acc_[d] += w * (ToFloat(vr[d]) * vs);
      }
      // denom >= 1 here (the largest logit contributes exp(0)); 0 only with no position at all.
      for (int64_t d = 0; d < D; ++d) oh[d] = FromFloat<T>(denom == 0.f ? 0.f : acc_[d] / denom);
      if (lse_row)
        lse_row[h] = denom == 0.f ? -std::numeric_limits<float>::infinity()
                                  : max_logit + std::log(denom);
    }
  }

  void Zero(T* out_row, float* lse_row = nullptr) {
    for (int64_t i = 0; i < s_.num_heads * s_.cache.head_dim; ++i) out_row[i] = FromFloat<T>(0.f);
    if (lse_row)
      std::fill(lse_row, lse_row + s_.num_heads, -std::numeric_limits<float>::infinity());
  }

 private:
  int64_t Offset(int64_t page, int64_t slot, int64_t kvh) const {
    return page * s_.cache.page_stride + slot * s_.cache.token_stride() + kvh * s_.cache.head_dim;
  }
  const AttentionShape& s_;
  const KV* k_;
  const KV* v_;
  const float* k_scale_;  // [Hkv] of this layer, or nullptr (not fp8)
  const float* v_scale_;
  const int32_t* page_table_;
  AttentionParams p_;
  std::vector<float> logits_;
  std::vector<float> acc_;
};

// Checks every index the kernels will read; nothing is read before all of them pass.
ffi::Error CheckIndices(const AttentionShape& s, const int32_t* page_table, const int32_t* seq_lens,
                        const int32_t* query_start, int32_t layer, int32_t window, bool ring) {
  if (layer < 0 || layer >= s.cache.num_layers)
    return Invalid("layer " + std::to_string(layer) + " is outside [0, " +
                   std::to_string(s.cache.num_layers) + ")");
  const int64_t capacity = s.max_pages * s.cache.page_size;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int32_t len = seq_lens[b];
    if (len < 0 || (!ring && len > capacity))
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
    const int64_t first_page = first_pos / s.cache.page_size;
    const int64_t end_page = (int64_t(len) + s.cache.page_size - 1) / s.cache.page_size;
    if (ring && end_page - first_page > s.max_pages)
      return Invalid("seq_lens[" + std::to_string(b) + "] = " + std::to_string(len) +
                     ": with ring_table the positions a sequence reads must span at most "
                     "max_pages = " + std::to_string(s.max_pages) + " pages, these span " +
                     std::to_string(end_page - first_page));
    for (int64_t i = first_page; i < end_page; ++i) {
      const int64_t e = PageEntry(i * s.cache.page_size, s.cache.page_size, s.max_pages, ring);
      const int32_t page = page_table[b * s.max_pages + e];
      if (page < 0 || page >= s.cache.num_pages)
        return Invalid("page_table[" + std::to_string(b) + ", " + std::to_string(e) + "] = " +
                       std::to_string(page) + " is outside the cache (" +
                       std::to_string(s.cache.num_pages) + " pages)");
    }
  }
  return ffi::Error::Success();
}

template <typename T, typename KV>
void RunAttention(const AttentionShape& s, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k_cache,
                  const ffi::AnyBuffer& v_cache, const float* k_scale, const float* v_scale,
                  const int32_t* page_table, const int32_t* seq_lens, const int32_t* query_start,
                  int32_t layer, AttentionParams p, ffi::AnyBuffer out, float* lse) {
  const KV* k = static_cast<const KV*>(k_cache.untyped_data()) + layer * s.cache.layer_stride;
  const KV* v = static_cast<const KV*>(v_cache.untyped_data()) + layer * s.cache.layer_stride;
  const T* qd = static_cast<const T*>(q.untyped_data());
  T* od = static_cast<T*>(out.untyped_data());
  const int64_t row = s.num_heads * s.cache.head_dim;
  const int64_t hkv = s.cache.num_kv_heads;
  RowAttender<T, KV> attender(s, k, v, k_scale ? k_scale + layer * hkv : nullptr,
                              v_scale ? v_scale + layer * hkv : nullptr, page_table, p);
  if (query_start == nullptr) {  // decode: row b is the last token of sequence b
    for (int64_t b = 0; b < s.batch; ++b) {
      float* lse_row = lse ? lse + b * s.num_heads : nullptr;
      if (seq_lens[b] == 0) attender.Zero(od + b * row, lse_row);
      else attender.Attend(qd + b * row, b, seq_lens[b] - 1, od + b * row, lse_row);
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

}  // namespace

// Shared with the by-address arena handlers (arena_ops_cpu.cc).
ffi::Error AttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                        ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens,
                        const ffi::AnyBuffer* query_start, ffi::AnyBuffer layer,
                        ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, ffi::AnyBuffer out,
                        float scale, int32_t window, float soft_cap, bool ring, bool slot_major,
                        ffi::AnyBuffer* lse) {
  auto shape = ParseAttention(q, k_cache, v_cache, page_table, seq_lens, query_start, layer, out,
                              slot_major);
  if (shape.has_error()) return shape.error();
  if (auto err = CheckScales(shape->cache, k_scale, v_scale); err.failure()) return err;
  if (lse != nullptr) {
    if (query_start != nullptr) return Invalid("lse is for decode calls only");
    if (auto err = CheckLse(*shape, *lse); err.failure()) return err;
  }
  float* lse_data = lse ? static_cast<float*>(lse->untyped_data()) : nullptr;
  const auto* pt = static_cast<const int32_t*>(page_table.untyped_data());
  const auto* sl = static_cast<const int32_t*>(seq_lens.untyped_data());
  const auto* qs = query_start ? static_cast<const int32_t*>(query_start->untyped_data()) : nullptr;
  const int32_t li = *static_cast<const int32_t*>(layer.untyped_data());
  if (auto err = CheckIndices(*shape, pt, sl, qs, li, window, ring); err.failure()) return err;
  AttentionParams p{scale, window, soft_cap, ring};
  const float* ks = shape->fp8() ? static_cast<const float*>(k_scale.untyped_data()) : nullptr;
  const float* vs = shape->fp8() ? static_cast<const float*>(v_scale.untyped_data()) : nullptr;
  auto run = [&](auto t) {
    using T = decltype(t);
    if (shape->fp8())
      RunAttention<T, fp8e4m3_t>(*shape, q, k_cache, v_cache, ks, vs, pt, sl, qs, li, p, out, lse_data);
    else
      RunAttention<T, T>(*shape, q, k_cache, v_cache, nullptr, nullptr, pt, sl, qs, li, p, out,
                               lse_data);
  };
  switch (shape->q_dtype) {
    case DType::kF32: run(float{}); break;
    case DType::kBF16: run(bf16_t{}); break;
    case DType::kF16: run(f16_t{}); break;
    case DType::kF8E4M3: return Invalid("q dtype must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

namespace {

ffi::Error PagedAttentionCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                 ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens,
                                 ffi::AnyBuffer layer, ffi::AnyBuffer k_scale,
                                 ffi::AnyBuffer v_scale, ffi::Result<ffi::AnyBuffer> out,
                                 float scale, int32_t sliding_window, float soft_cap,
                                 bool ring_table, bool check_indices, bool slot_major) {
  (void)check_indices;  // the CPU handler always checks
  return AttentionCpu(q, k_cache, v_cache, page_table, seq_lens, nullptr, layer, k_scale, v_scale,
                      *out, scale, sliding_window, soft_cap, ring_table, slot_major, nullptr);
}

ffi::Error PagedAttentionLseCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                    ffi::AnyBuffer v_cache, ffi::AnyBuffer page_table,
                                    ffi::AnyBuffer seq_lens, ffi::AnyBuffer layer,
                                    ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> lse, float scale,
                                    int32_t sliding_window, float soft_cap, bool ring_table,
                                    bool check_indices, bool slot_major) {
  (void)check_indices;  // the CPU handler always checks
  return AttentionCpu(q, k_cache, v_cache, page_table, seq_lens, nullptr, layer, k_scale, v_scale,
                      *out, scale, sliding_window, soft_cap, ring_table, slot_major, &*lse);
}

ffi::Error RaggedPagedAttentionCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                       ffi::AnyBuffer v_cache, ffi::AnyBuffer page_table,
                                       ffi::AnyBuffer seq_lens, ffi::AnyBuffer query_start,
                                       ffi::AnyBuffer layer, ffi::AnyBuffer k_scale,
                                       ffi::AnyBuffer v_scale, ffi::Result<ffi::AnyBuffer> out,
                                       float scale, int32_t sliding_window, float soft_cap,
                                       bool ring_table, bool check_indices, bool slot_major) {
  (void)check_indices;  // the CPU handler always checks
  return AttentionCpu(q, k_cache, v_cache, page_table, seq_lens, &query_start, layer, k_scale,
                      v_scale, *out, scale, sliding_window, soft_cap, ring_table, slot_major,
                      nullptr);
}

}  // namespace
}  // namespace kvcm

namespace xffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmPagedAttentionCpu, kvcm::PagedAttentionCpuImpl,
                              kvcm::BindAttentionAttrs(
                                  kvcm::BindDecodeOperands(xffi::Ffi::Bind())
                                      .Ret<xffi::AnyBuffer>())  // out [B, H, D]
                                  .Attr<bool>("slot_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmRaggedPagedAttentionCpu, kvcm::RaggedPagedAttentionCpuImpl,
                              kvcm::BindAttentionAttrs(xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()  // q [T, H, D]
                                  .Arg<xffi::AnyBuffer>()  // k_cache (layout: slot_major)
                                  .Arg<xffi::AnyBuffer>()  // v_cache
                                  .Arg<xffi::AnyBuffer>()  // page_table [B, P]
                                  .Arg<xffi::AnyBuffer>()  // seq_lens [B]
                                  .Arg<xffi::AnyBuffer>()  // query_start [B + 1]
                                  .Arg<xffi::AnyBuffer>()  // layer []
                                  .Arg<xffi::AnyBuffer>()  // k_scale [L, Hkv] f32 (fp8) or []
                                  .Arg<xffi::AnyBuffer>()  // v_scale
                                  .Ret<xffi::AnyBuffer>())  // out [T, H, D]
                                  .Attr<bool>("slot_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmPagedAttentionLseCpu, kvcm::PagedAttentionLseCpuImpl,
                              kvcm::BindAttentionAttrs(
                                  kvcm::BindDecodeOperands(xffi::Ffi::Bind())
                                      .Ret<xffi::AnyBuffer>()   // out [B, H, D]
                                      .Ret<xffi::AnyBuffer>())  // lse [B, H] f32
                                  .Attr<bool>("slot_major"));
