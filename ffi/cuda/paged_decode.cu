// Split-KV paged decode attention on tensor cores (bf16 / f16 queries; caches of the query dtype
// or float8_e4m3fn): the schedule, the launch and the FFI entry points. The kernels are in
// kvcm/cuda/decode_kernel.cuh, their tile code in kvcm/cuda/decode_tile.cuh.
//
// A CTA owns one row (a sequence and a kv head; row = b * Hkv + kvh) and one range of 16-token
// tiles. The grid is 1-D: CTAs 0 .. full_rows - 1 take rows 0 .. full_rows - 1 whole, the
// remaining rows are split num_splits ways (CTA full_rows + i: row full_rows + i / num_splits,
// split i % num_splits), so the split CTAs, short, run last (see DecodeSchedule).
// Four warps compute the CTA's tiles (warp w: tiles w, w + 4, ...), each with its own
// online-softmax state, and merge through shared memory at the end. The tiles arrive by cp.async
// (zero-filled outside the row): with 16-bit caches one more, producer warp streams them in order
// through a CTA-wide ring (a stage's "full" mbarrier completes when its copies land, its "empty"
// one when its warp has read it); with fp8 caches each warp streams its own through a private
// ring (see kRingBytes). A split CTA writes an unnormalized partial (o, max, sum) and a combine
// kernel reduces the splits of those rows.
//
// The MMAs are transposed ("swap AB"): a tile's 16 tokens (or 16 head dims) are the m16 rows of
// mma.m16n8k16 and the row's G query heads its 8 columns, S^T = K Q^T and O^T += V^T P^T. With
// G <= 8 that is half the MMAs and half the accumulators of Q on the rows (G padded to 16).
//
// Ragged calls (query_start set) run this kernel for their single-query sequences (decode rows of
// a mixed batch): sequence b's query row is query_start[b], and CTAs of other sequences exit at
// once (the ragged prefill kernel owns those; see ragged_prefill.cu).
//
// fp8 caches: tiles arrive as raw bytes (a 16-byte cp.async moves 16 elements, stored with the
// swizzle of Fp8ChunkSwizzle) and each lane converts the bytes it needs straight into its MMA
// fragments (cvt.rn.f16x2.e4m3x2, exact): no converted copy of the tile in shared memory. The MMAs
// run in f16 (bf16 queries are converted to f16 once: exact for |q| in f16's normal range). Two
// free index permutations make each lane's bytes contiguous (see the kernel): the head-dim order
// of the S^T = K Q^T k steps (Q uses the same), and the head-dim order of the O^T rows
// (PermutedVDim, undone when O is written out). tests/test_decode_fragments.py emulates these
// layouts (and the 16-bit ldmatrix ones) on the host.
// The per-(layer, kv head) scales are constant within a CTA: k_scale is folded into the logit
// scale and v_scale multiplies the merged output, so no per-element scaling happens.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "kvcm/cuda/decode_kernel.cuh"

namespace kvcm::cuda {
namespace {

using namespace decode;  // the kernels and their layout constants

// The schedule (the one heuristic; measured rows in benchmarks/RESULTS.md): which rows run whole
// and how many ways the rest are split. Every CTA of a decode grid streams about the same number
// of tiles, so the grid runs in waves of `slots` CTAs (SMs x CTAs per SM), and a partly filled
// last wave costs as much as a full one (B256 S1024 at 3 CTAs/SM: 2,048 rows are 5.2 waves, so
// the sixth runs 17% full). The rows of the full waves run whole (full_rows, a multiple of
// slots); the rows left over, the tail, are split `splits` ways so that they fill their wave(s)
// with shorter CTAs. `splits` minimizes a model: waves x (16-token tiles per warp of a CTA +
// kCtaOverhead) + kCombineCost when split. kCtaOverhead (the ring's fill and the warps' merge, in
// tile iterations) makes an extra wave of short CTAs cost more than one of long ones. Bounds: at
// least 2 tiles per warp of a split (shorter splits are all prologue), at most 64 (the combine
// kernel's reads grow with it); a split is kept only when the model says it saves >= 3%. What it
// picks on an H200 (132 SMs; 3 CTAs/SM for 16-bit caches at head_dim 128, 4 for fp8):
// - few rows (B8 S32768, B1 S131072): all rows are tail, one full wave, slots / rows splits;
// - B64 S4096 (512 rows): 16-bit caches (396 slots) 396 whole rows, 116 rows split 3 ways
//   (348 CTAs); fp8 (528 slots) one wave of whole rows, no split;
// - B256 S1024 (2,048 rows, 396 slots): 1,980 whole rows, 68 rows split 4 ways;
// - B256 S256 (17 tiles a row): no split (at most 2 ways, which the combine eats); 16-bit caches
//   take the short-row ring instead (LaunchBestRing: 528 slots, 3.88 waves, model time 28
//   against 42 in 5.17 waves of 396).
// max_tiles bounds the tiles of the longest row (the table width, or the window).
struct DecodeSchedule {
  int64_t full_rows;  // rows [0, full_rows) run whole
  int64_t splits;     // CTAs per row for the others (1: no split, full_rows = rows)
  int64_t cost;       // the model's time, to compare grids of other CTAs per SM
};

DecodeSchedule PlanDecode(int64_t rows, int64_t slots, int64_t max_tiles) {
  constexpr int64_t kCtaOverhead = 2, kCombineCost = 2;
  const int64_t most = std::clamp<int64_t>(max_tiles / (2 * kWarps), 1, kMaxSplits);
  const int64_t full_rows = rows / slots * slots, tail = rows - full_rows;
  auto cta_cost = [&](int64_t splits) {
    const int64_t tiles = (max_tiles + splits - 1) / splits;
    return (tiles + kWarps - 1) / kWarps + kCtaOverhead;
  };
  auto cost = [&](int64_t splits) {
    const int64_t tail_waves = (tail * splits + slots - 1) / slots;
    return full_rows / slots * cta_cost(1) + tail_waves * cta_cost(splits) +
           (splits > 1 ? kCombineCost : 0);
  };
  int64_t best = 1, best_cost = cost(1);
  for (int64_t splits = 2; splits <= most && tail > 0; ++splits) {
    const int64_t c = cost(splits);
    if (100 * c <= 97 * best_cost) best = splits, best_cost = c;
  }
  return best == 1 ? DecodeSchedule{rows, 1, best_cost}
                   : DecodeSchedule{full_rows, best, best_cost};
}

// Tables of at most this many tiles may take the short-row ring (see kShortRowRingBytes): 512
// tokens (the + 1 of MaxTiles: a row's reads may start inside a tile).
constexpr int64_t kShortRowTiles = 512 / kTile + 1;

// Tiles a row can read: its table's pages (a ring's reads span at most max_pages pages too),
// fewer under a window.
int64_t MaxTiles(const AttentionArgs& a) {
  const AttentionShape& s = a.shape;
  int64_t max_tiles = (s.max_pages * s.cache.page_size + kTile - 1) / kTile + 1;
  if (a.window > 0) max_tiles = std::min<int64_t>(max_tiles, (a.window + kTile - 1) / kTile + 1);
  return max_tiles;
}

// CTAs per SM of one kernel instance (configures its shared memory on the first call); 0 when
// the attribute cannot be set.
template <typename T, int D, bool kFp8, int kNH, int kRing>
int CtasPerSm() {
  static int per_sm = [] {  // NOTE: per-template, on the first launch
    constexpr int smem = DecodeSmemBytes<D, kFp8, kRing>();
    auto kernel = PagedDecodeKernel<T, D, kFp8, kNH, kRing>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess)
      return 0;
    int n = 1;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, CtaThreads<kFp8>(), smem);
    return std::max(n, 1);
  }();
  return per_sm;
}

// The kernel with a ring of kRing bytes on PlanDecode's schedule `plan` (of this ring's slots).
template <typename T, int D, bool kFp8, int kNH, int kRing>
ffi::Error Launch(cudaStream_t stream, const AttentionArgs& a, size_t workspace_offset,
                  const DecodeSchedule& plan) {
  const AttentionShape& s = a.shape;
  constexpr int smem = DecodeSmemBytes<D, kFp8, kRing>();
  auto kernel = PagedDecodeKernel<T, D, kFp8, kNH, kRing>;
  const int64_t rows = s.batch * s.cache.num_kv_heads;
  const int64_t splits = plan.splits;
  const int64_t ctas = plan.full_rows + (rows - plan.full_rows) * splits;
  if (ctas > int64_t(std::numeric_limits<int>::max()))
    return ffi::Error::InvalidArgument("paged_attention: batch * num_kv_heads is too large");

  DecodeParams p;
  p.a = a;
  p.logit = LogitTransform::Make(a.scale, a.soft_cap);
  p.page_shift = __builtin_ctzll(uint64_t(s.cache.page_size));
  p.page_rows = int(s.cache.page_rows());
  p.full_rows = int(plan.full_rows);
  p.num_splits = int(splits);
  p.part_o = nullptr;
  p.part_ml = nullptr;
  const int64_t heads = s.batch * s.num_heads;
  if (splits > 1) {
    const size_t o_bytes = size_t(splits * heads * D) * sizeof(float);
    char* ws = static_cast<char*>(Workspace(
        stream, workspace_offset + o_bytes + size_t(splits * heads * 2) * sizeof(float)));
    if (ws == nullptr) return ffi::Error::Internal("paged_attention: workspace allocation failed");
    ws += workspace_offset;
    p.part_o = reinterpret_cast<float*>(ws);
    p.part_ml = reinterpret_cast<float*>(static_cast<char*>(ws) + o_bytes);
  }
  kernel<<<unsigned(ctas), CtaThreads<kFp8>(), smem, stream>>>(p);
  if (auto err = LaunchError("paged_attention (decode kernel)"); err.failure()) return err;
  if (splits > 1) {  // the split rows' heads: flat head rows full_rows * G on
    const int64_t G = s.group();
    const unsigned heads_split = unsigned((rows - plan.full_rows) * G);
    CombineSplitsKernel<T, D><<<heads_split, kCombineThreads, 0, stream>>>(
        a, p.part_o, p.part_ml, int(splits), plan.full_rows * G);
    return LaunchError("paged_attention (combine kernel)");
  }
  return ffi::Error::Success();
}

// PlanDecode's schedule for the default ring, or for the short-row ring (16-bit caches at head_dim
// <= 128, tables of at most kShortRowTiles tiles) when its extra CTA per SM makes the model's
// time >= 10% shorter.
template <typename T, int D, bool kFp8, int kNH>
ffi::Error LaunchBestRing(cudaStream_t stream, const AttentionArgs& a, size_t workspace_offset) {
  const int per_sm = CtasPerSm<T, D, kFp8, kNH, kRingBytes>();
  if (per_sm == 0) return LaunchError("paged_attention: cudaFuncSetAttribute");
  const int64_t rows = a.shape.batch * a.shape.cache.num_kv_heads, max_tiles = MaxTiles(a);
  const DecodeSchedule plan = PlanDecode(rows, int64_t(NumSMs()) * per_sm, max_tiles);
  if constexpr (!kFp8 && D <= 128) {
    if (max_tiles <= kShortRowTiles) {
      const int short_per_sm = CtasPerSm<T, D, kFp8, kNH, kShortRowRingBytes>();
      if (short_per_sm > per_sm) {
        const DecodeSchedule other = PlanDecode(rows, int64_t(NumSMs()) * short_per_sm, max_tiles);
        if (10 * other.cost <= 9 * plan.cost)
          return Launch<T, D, kFp8, kNH, kShortRowRingBytes>(stream, a, workspace_offset, other);
      }
    }
  }
  return Launch<T, D, kFp8, kNH, kRingBytes>(stream, a, workspace_offset, plan);
}

}  // namespace

bool PagedDecodeSupports(const AttentionArgs& a) {
  const AttentionShape& s = a.shape;
  const int64_t D = s.cache.head_dim, P = s.cache.page_size;
  const bool half_q = s.q_dtype == DType::kBF16 || s.q_dtype == DType::kF16;
  return half_q && (s.cache.dtype == s.q_dtype || s.fp8()) && (D == 64 || D == 128 || D == 256) &&
         P >= 8 && (P & (P - 1)) == 0 && s.group() <= 16 && s.batch <= 65535 &&
         s.cache.num_kv_heads <= 65535 && s.cache.page_rows() < (int64_t(1) << 31);
}

ffi::Error LaunchPagedDecode(cudaStream_t stream, const AttentionArgs& a, size_t workspace_offset) {
  return DispatchHalfDtypeAndHeadDim(a, "paged_attention", [&](auto t, auto d) -> ffi::Error {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
    auto run = [&](auto fp8, auto nh) -> ffi::Error {
      return LaunchBestRing<T, D, decltype(fp8)::value, decltype(nh)::value>(stream, a,
                                                                            workspace_offset);
    };
    // G <= 8 query heads per kv head fill one 8-wide MMA column tile, G <= 16 two.
    auto by_heads = [&](auto fp8) -> ffi::Error {
      if (a.shape.group() <= 8) return run(fp8, std::integral_constant<int, 1>{});
      return run(fp8, std::integral_constant<int, 2>{});
    };
    if (a.shape.fp8()) return by_heads(std::true_type{});
    return by_heads(std::false_type{});
  });
}

}  // namespace kvcm::cuda
