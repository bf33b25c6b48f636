// CUDA-core attention over paged K/V: one warp per (query row, head), online softmax.
// Used for float32, for fp8 caches under float32 queries and for shapes the tensor-core kernels do
// not cover. T: q / out dtype; KV: cache dtype (T, or __nv_fp8_e4m3 read times its scale).
#include <cmath>

#include "kvcm/cuda/attention.cuh"

namespace kvcm::cuda {
namespace {

template <typename T, typename KV>
__global__ void SimpleAttentionKernel(AttentionArgs a) {
  using Tr = DTypeTraits<T>;
  using Kr = DTypeTraits<KV>;
  const AttentionShape& s = a.shape;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= s.num_queries * s.num_heads) return;
  const int64_t row = warp / s.num_heads, h = warp % s.num_heads;
  const int64_t D = s.cache.head_dim, P = s.cache.page_size;
  T* out = static_cast<T*>(a.out) + (row * s.num_heads + h) * D;
  // lse (decode calls only): NaN with the NaN output, -inf with nothing attended.
  float* lse = a.lse != nullptr ? a.lse + row * s.num_heads + h : nullptr;
  auto write_fill = [&](float value) {
    for (int64_t d = lane; d < D; d += 32) out[d] = Tr::from_float(value);
    if (lse != nullptr && lane == 0) *lse = value == 0.f ? -INFINITY : NAN;
  };

  int64_t b = row, pos = 0;
  int32_t len = 0;
  if (a.query_start != nullptr) {
    const int32_t first = a.query_start[0], last = a.query_start[s.batch];
    if (last > s.num_queries || first < 0 || first > last) {
      if (lane == 0) RaiseError(a.error_word, kBadQueryStart);
      return write_fill(NAN);
    }
    if (row < first || row >= last) return write_fill(0.f);  // padding rows
    int64_t lo = 0, hi = s.batch;  // largest b with query_start[b] <= row
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (a.query_start[mid] <= row) lo = mid; else hi = mid;
    }
    b = lo;
    const int32_t end = a.query_start[b + 1];
    len = a.seq_lens[b];
    if (end < a.query_start[b] || end - a.query_start[b] > len) {
      if (lane == 0) RaiseError(a.error_word, kBadQueryStart);
      return write_fill(NAN);
    }
    pos = len - (end - row);
  } else {
    len = a.seq_lens[b];
    if (len == 0) return write_fill(0.f);
    pos = len - 1;
  }
  const int64_t start = a.window > 0 ? max(int64_t(0), pos + 1 - a.window) : 0;
  if (len < 0 || !RowFitsTable(start, len, a)) {
    if (lane == 0) RaiseError(a.error_word, kBadSeqLen);
    return write_fill(NAN);
  }
  const int32_t li = *a.layer;
  if (li < 0 || li >= s.cache.num_layers) {
    if (lane == 0) RaiseError(a.error_word, kBadLayer);
    return write_fill(NAN);
  }
  const int64_t kvh = h / s.group();
  const T* q = static_cast<const T*>(a.q) + (row * s.num_heads + h) * D;
  const KV* kc = static_cast<const KV*>(a.k_cache) + li * s.cache.layer_stride + kvh * D;
  const KV* vc = static_cast<const KV*>(a.v_cache) + li * s.cache.layer_stride + kvh * D;
  const float ksc = a.k_scale ? a.k_scale[li * s.cache.num_kv_heads + kvh] : 1.f;
  const float vsc = a.v_scale ? a.v_scale[li * s.cache.num_kv_heads + kvh] : 1.f;
  const int32_t* pages = a.page_table + b * s.max_pages;
  constexpr int kMaxPerLane = 8;  // head_dim <= 256
  float qr[kMaxPerLane], acc[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int64_t d = lane + 32 * i;
    qr[i] = d < D ? Tr::to_float(q[d]) : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int64_t j = start; j <= pos; ++j) {
    const int32_t page = pages[TableEntry(int(j / P), int(s.max_pages), a.ring)];
    if (page < 0 || page >= s.cache.num_pages) {
      if (lane == 0) RaiseError(a.error_word, kBadPage);
      return write_fill(NAN);
    }
    const int64_t off = page * s.cache.page_stride + (j % P) * s.cache.token_stride();
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < D) dot += qr[i] * (Kr::to_float(kc[off + d]) * ksc);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    float logit = dot * a.scale;
    if (a.soft_cap > 0.f) logit = a.soft_cap * tanhf(logit / a.soft_cap);
    if (!(fabsf(dot) < INFINITY)) logit = NAN;  // the non-finite rule (see ops docs)
    const float m_new = fmaxf(m, logit);
    const float alpha = __expf(m - m_new), p = __expf(logit - m_new);
    l = l * alpha + p;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int64_t d = lane + 32 * i;
      acc[i] = acc[i] * alpha + (d < D ? p * (Kr::to_float(vc[off + d]) * vsc) : 0.f);
    }
    m = m_new;
  }
  const float inv = l == 0.f ? 0.f : 1.f / l;  // l is NaN after a NaN logit: keep it
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int64_t d = lane + 32 * i;
    if (d < D) out[d] = Tr::from_float(acc[i] * inv);
  }
  if (lse != nullptr && lane == 0) *lse = l == 0.f ? -INFINITY : m + logf(l);
}

}  // namespace

ffi::Error LaunchSimpleAttention(cudaStream_t stream, const AttentionArgs& a) {
  if (a.shape.cache.head_dim > 256)
    return ffi::Error::InvalidArgument("head_dim > 256 is not supported on CUDA");
  const int64_t warps = a.shape.num_queries * a.shape.num_heads;
  if (warps == 0) return ffi::Error::Success();
  const int threads = 128;
  const int64_t blocks = (warps * 32 + threads - 1) / threads;
  auto launch = [&](auto t) {
    using T = decltype(t);
    if (a.shape.fp8())
      SimpleAttentionKernel<T, __nv_fp8_e4m3><<<blocks, threads, 0, stream>>>(a);
    else
      SimpleAttentionKernel<T, T><<<blocks, threads, 0, stream>>>(a);
  };
  switch (a.shape.q_dtype) {
    case DType::kF32: launch(float{}); break;
    case DType::kBF16: launch(__nv_bfloat16{}); break;
    case DType::kF16: launch(__half{}); break;
    case DType::kF8E4M3: return ffi::Error::InvalidArgument("q must not be float8_e4m3fn");
  }
  return LaunchError("attention (simple kernel)");
}

}  // namespace kvcm::cuda
