// Launch interface shared by the CUDA attention kernels (decode, ragged prefill, simple fallback).
#pragma once

#include <string>
#include <type_traits>

#include "kvcm/cuda/common.cuh"
#include "kvcm/cuda/mma.cuh"

namespace kvcm::cuda {

struct AttentionArgs {
  const void* q = nullptr;        // [num_queries, num_heads, head_dim]
  const void* k_cache = nullptr;  // [L?, num_pages, ...] or slot-major [num_pages, L, ...]
  const void* v_cache = nullptr;
  void* out = nullptr;            // like q
  float* lse = nullptr;  // [num_queries, num_heads] natural-log sum of exp(logits); null: none
  const int32_t* page_table = nullptr;   // [batch, max_pages]
  const int32_t* seq_lens = nullptr;     // [batch]
  const int32_t* query_start = nullptr;  // [batch + 1]; nullptr for decode
  const int32_t* layer = nullptr;        // scalar
  const float* k_scale = nullptr;        // [num_layers, num_kv_heads] for fp8 caches, else null
  const float* v_scale = nullptr;
  AttentionShape shape;
  float scale = 1.f;
  int32_t window = 0;     // <= 0: none
  float soft_cap = 0.f;   // <= 0: none
  bool ring = false;      // ring page table: entry (position / page_size) % max_pages
  uint32_t* error_word = nullptr;
};

// Page-table entry of page index i (position / page_size) of a row.
__device__ __forceinline__ int TableEntry(int i, int max_pages, bool ring) {
  return ring ? i % max_pages : i;
}

// Whether a row of length len whose reads start at position lo is addressable through its table:
// len <= max_pages * page_size for absolute tables; for rings, [lo, len) spans <= max_pages pages.
__device__ __forceinline__ bool RowFitsTable(int64_t lo, int64_t len, const AttentionArgs& a) {
  const int64_t P = a.shape.cache.page_size, W = a.shape.max_pages;
  if (!a.ring) return len <= W * P;
  return len <= 0 || (len + P - 1) / P - lo / P <= W;
}

// fp8 caches in the tensor-core kernels: the scales of (layer li, kv head kvh) are constant in a
// CTA, so k_scale folds into the logit transform and v_scale multiplies the normalized output.
template <bool kFp8>
__device__ __forceinline__ LogitTransform ScaledLogit(LogitTransform logit, const AttentionArgs& a,
                                                      int li, int kvh, float& v_scale) {
  v_scale = 1.f;
  if constexpr (kFp8) {
    const int64_t i = int64_t(li) * a.shape.cache.num_kv_heads + kvh;
    logit.scale_log2 *= a.k_scale[i];
    logit.scale_over_cap *= a.k_scale[i];
    v_scale = a.v_scale[i];
  }
  return logit;
}

// fp8 caches: the {K, V} tiles of kRows x D raw bytes at src (K then V, unswizzled 16-byte chunks
// in row order) -> f16 tiles at dst (K then V, swizzled for ldmatrix), by threads
// [thread, thread + stride, ...] of the caller's group.
template <int kRows, int D>
__device__ __forceinline__ void ConvertFp8Tiles(const char* src, __half* dst, int thread,
                                                int stride) {
  constexpr int kIn = D / 16;  // 16-byte fp8 chunks per row
#pragma unroll
  for (int i = thread; i < 2 * kRows * kIn; i += stride) {
    const int which = i / (kRows * kIn), j = i % (kRows * kIn);
    const int row = j / kIn, ch = j % kIn;
    uint4 lo4, hi4;
    Fp8ChunkToHalf(*reinterpret_cast<const uint4*>(src + which * kRows * D + j * 16), lo4, hi4);
    __half* out = dst + which * kRows * D;
    *reinterpret_cast<uint4*>(out + SwizzledOffset<D / 8>(row, 2 * ch)) = lo4;
    *reinterpret_cast<uint4*>(out + SwizzledOffset<D / 8>(row, 2 * ch + 1)) = hi4;
  }
}

// CUDA-core kernel: any dtype, any head_dim, decode or ragged. Correct everywhere, not fast.
ffi::Error LaunchSimpleAttention(cudaStream_t stream, const AttentionArgs& a);

// Tensor-core split-KV decode (bf16/f16 queries over caches of the same dtype or fp8, head_dim
// 64/128/256, power-of-two page size, GQA group <= 16). Returns false from *Supports when the
// shape needs the simple kernel instead. With a.query_start set (a ragged call) it computes only
// the single-query sequences (IsRaggedDecodeRow), at their query rows. Its split partials live in
// Workspace(stream) at workspace_offset bytes and beyond.
bool PagedDecodeSupports(const AttentionArgs& a);
ffi::Error LaunchPagedDecode(cudaStream_t stream, const AttentionArgs& a,
                             size_t workspace_offset = 0);

// In a ragged call, whether sequence b is a valid decode row (one query, at position
// seq_lens[b] - 1 >= 0) that the decode kernel computes instead of the prefill kernel. Invalid
// sequences are neither's: the prefill kernel's schedule raises their error bits.
__device__ __forceinline__ bool IsRaggedDecodeRow(const AttentionArgs& a, int64_t b) {
  const int32_t q0 = a.query_start[b], q1 = a.query_start[b + 1];
  return q1 - q0 == 1 && q0 >= 0 && q1 <= a.shape.num_queries && a.seq_lens[b] >= 1;
}

// A ragged prefill launch: the call, its logit transform, log2(page_size), the token rows from
// one page to the next (CacheShape::page_rows), and the schedule kernel's per-sequence tile
// offsets [B + 1] (a tile of rows of one sequence per CTA, or per
// work tile of the persistent sm90 kernel).
struct PrefillParams {
  AttentionArgs a;
  LogitTransform logit;
  int page_shift;
  int page_rows;
  const int32_t* tile_offsets;
  // The sm90 kernel's work counter (zeroed by the schedule kernel, next to tile_offsets).
  int32_t* work_counter;
};

// CTA `cta`'s sequence b (the largest b with tile_offsets[b] <= cta) and its row tile, heaviest
// (last) tiles of a sequence first; false for CTAs past the last tile.
__device__ __forceinline__ bool FindPrefillTile(const PrefillParams& p, int cta, int& b,
                                                int& tile) {
  const int batch = int(p.a.shape.batch);
  if (cta >= p.tile_offsets[batch]) return false;
  int lo = 0, hi = batch;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (p.tile_offsets[mid] <= cta) lo = mid; else hi = mid;
  }
  b = lo;
  const int num_tiles = p.tile_offsets[b + 1] - p.tile_offsets[b];
  tile = num_tiles - 1 - (cta - p.tile_offsets[b]);
  return true;
}

// The Hopper (sm_90a) wgmma prefill kernel: bf16/f16 caches of the query dtype, or fp8 caches
// with bf16/f16 queries, at head_dim 64 or 128, on a device and build that have sm_90a. Rows per
// CTA: kSm90RowsPerCta, so it shares the schedule of the kernel below.
constexpr int kSm90RowsPerCta = 128;
bool RaggedPrefillSm90Supports(const AttentionArgs& a);
ffi::Error LaunchRaggedPrefillSm90(cudaStream_t stream, const PrefillParams& p, int64_t max_tiles);

// Tensor-core ragged prefill (FlashAttention-2 style, GQA heads packed into rows).
bool RaggedPrefillSupports(const AttentionArgs& a);
ffi::Error LaunchRaggedPrefill(cudaStream_t stream, const AttentionArgs& a);

// Calls launch(T{}, std::integral_constant<int, D>{}) for the tensor-core kernels' query dtype (T
// is __nv_bfloat16 or __half) and head_dim D in {64, 128, 256}; other head dims are an error naming
// `op`. Callers check *Supports first.
template <typename LaunchFn>
ffi::Error DispatchHalfDtypeAndHeadDim(const AttentionArgs& a, const char* op, LaunchFn&& launch) {
  auto by_dim = [&](auto t) -> ffi::Error {
    switch (a.shape.cache.head_dim) {
      case 64: return launch(t, std::integral_constant<int, 64>{});
      case 128: return launch(t, std::integral_constant<int, 128>{});
      case 256: return launch(t, std::integral_constant<int, 256>{});
    }
    return ffi::Error::InvalidArgument(std::string(op) + ": unsupported head_dim");
  };
  if (a.shape.q_dtype == DType::kBF16) return by_dim(__nv_bfloat16{});
  return by_dim(__half{});
}

}  // namespace kvcm::cuda
