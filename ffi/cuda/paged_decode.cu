// Split-KV paged decode attention on tensor cores (bf16 / f16).
//
// Grid (num_splits, num_kv_heads, batch). A CTA owns one sequence, one kv head and one range of
// 16-token tiles; its G = H / Hkv query heads form the rows of one m16 tile (rows >= G are zero).
// Each warp streams its own tiles (w, w + kWarps, ...) through a private kStages-deep cp.async
// ring, keeps its own online-softmax state, and the warps merge through shared memory at the end.
// With num_splits > 1 the CTA writes an unnormalized partial (o, max, sum) and a combine kernel
// reduces the splits.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "kvcm/cuda/attention.cuh"
#include "kvcm/cuda/mma.cuh"

namespace kvcm::cuda {
namespace {

constexpr int kTile = 16;  // tokens per tile
constexpr int kWarps = 4;

template <int D>
constexpr int DefaultStages() { return D <= 128 ? 3 : 2; }

template <int D, int kStages>
constexpr int DecodeSmemBytes() {
  return kWarps * kStages * 2 * kTile * D * 2;
}

// Online-softmax update of a decode tile (2 n-tiles of 8 tokens, log2 domain, already masked).
// Rows 8..15 (h == 1) are skipped unless two_halves. The accumulator is rescaled only when some
// lane's running max grew (warp vote): after the first tiles that is rare, and it saves
// D / 4 multiplies per tile.
template <int NO>
__device__ __forceinline__ void DecodeSoftmax(float (&s)[2][4], float (&o)[NO][4], float (&m)[2],
                                              float (&l)[2], bool two_halves) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (h == 1 && !two_halves) break;
    float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[h], mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      s[nt][2 * h] = FastExp2(s[nt][2 * h] - base);
      s[nt][2 * h + 1] = FastExp2(s[nt][2 * h + 1] - base);
      sum += s[nt][2 * h] + s[nt][2 * h + 1];
    }
    if (__any_sync(0xffffffffu, m_new > m[h])) {
      const float alpha = FastExp2(m[h] - base);  // 1 where this lane's max did not grow
      l[h] *= alpha;
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        o[n][2 * h] *= alpha;
        o[n][2 * h + 1] *= alpha;
      }
    }
    l[h] += sum;
    m[h] = m_new;
  }
}

struct DecodeParams {
  AttentionArgs a;
  LogitTransform logit;
  int page_shift;
  int num_splits;
  float* part_o;   // [num_splits, B, H, D] (num_splits > 1)
  float* part_ml;  // [num_splits, B, H, 2]
};

template <typename T, int D, int kStages, bool kL2Hint>
__global__ void __launch_bounds__(kWarps * 32) PagedDecodeKernel(const DecodeParams p) {
  constexpr int kChunks = D / 8;
  constexpr int kTileElems = kTile * D;
  const AttentionArgs& a = p.a;
  const AttentionShape& s = a.shape;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int G = int(s.group());
  const bool two_halves = G > 8;  // query heads fill rows 8..15 of the m16 tile too
  const int P = int(s.cache.page_size);

  extern __shared__ uint4 smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  __shared__ int cta_bad;
  if (threadIdx.x == 0) cta_bad = 0;
  __syncthreads();

  int len = a.seq_lens[b];
  int li = *a.layer;
  uint32_t bits = 0;
  if (len < 0 || len > s.max_pages * P) { bits |= kBadSeqLen; len = 0; }
  if (li < 0 || li >= s.cache.num_layers) { bits |= kBadLayer; li = 0; len = 0; }
  const int lo = a.window > 0 ? max(0, len - a.window) : 0;
  const int tile_lo = lo / kTile, tile_hi = (len + kTile - 1) / kTile;
  const int per_split = (max(tile_hi - tile_lo, 0) + p.num_splits - 1) / p.num_splits;
  const int my_lo = tile_lo + split * per_split;
  const int my_hi = min(tile_hi, my_lo + per_split);
  const int my_count = my_hi - my_lo > warp ? (my_hi - my_lo - warp + kWarps - 1) / kWarps : 0;

  // Q rows kvh*G + r for r < G as A fragments, one per 16-wide k step.
  const int r0 = lane / 4, c0 = (lane % 4) * 2;
  const T* qb = static_cast<const T*>(a.q) + (int64_t(b) * s.num_heads + int64_t(kvh) * G) * D;
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int col = kk * 16 + c0;
    qf[kk][0] = r0 < G ? *reinterpret_cast<const uint32_t*>(qb + r0 * D + col) : 0u;
    qf[kk][1] = r0 + 8 < G ? *reinterpret_cast<const uint32_t*>(qb + (r0 + 8) * D + col) : 0u;
    qf[kk][2] = r0 < G ? *reinterpret_cast<const uint32_t*>(qb + r0 * D + col + 8) : 0u;
    qf[kk][3] = r0 + 8 < G ? *reinterpret_cast<const uint32_t*>(qb + (r0 + 8) * D + col + 8) : 0u;
  }

  const int64_t layer_off = int64_t(li) * s.cache.layer_stride() + int64_t(kvh) * D;
  const T* kbase = static_cast<const T*>(a.k_cache) + layer_off;
  const T* vbase = static_cast<const T*>(a.v_cache) + layer_off;
  const int32_t* pages = a.page_table + int64_t(b) * s.max_pages;
  const int64_t token_stride = s.cache.token_stride();
  T* wsmem = smem + warp * kStages * 2 * kTileElems;

  // Page indices of a tile, lane-uniform: a 16-token tile spans one page (P >= 16) or two
  // (P == 8). Fetched one iteration ahead so their latency hides behind the compute (fetching
  // a 32-iteration chunk ahead measured the same on the H200).
  auto fetch_pages = [&](int it, int& page_lo, int& page_hi) {
    page_lo = page_hi = 0;
    if (it < my_count) {
      const int first = (my_lo + warp + it * kWarps) * kTile;  // < len
      page_lo = pages[first >> p.page_shift];
      page_hi = (P >= 16 || first + 8 >= len) ? page_lo : pages[(first + 8) >> p.page_shift];
    }
  };

  // Each lane copies the 16-byte chunks (row, ch) with ch = lane % kChunks and rows
  // lane / kChunks + j * kRowsPerLoad: the row-dependent part of every address is a compile-time
  // multiple of the token stride, so a tile costs one page check and two adds per chunk.
  constexpr int kRowsPerLoad = 32 / kChunks;
  constexpr int kLoads = kTile / kRowsPerLoad;
  const int lane_row = lane / kChunks, lane_ch = lane % kChunks;
  const int64_t lane_off = int64_t(lane_row) * token_stride + lane_ch * 8;
  auto load_tile = [&](int it, int stage, int page_lo, int page_hi) {
    const int first = (my_lo + warp + it * kWarps) * kTile;
    T* ks = wsmem + stage * 2 * kTileElems;
    T* vs = ks + kTileElems;
    // Rows 0..7 read page_lo, rows 8..15 page_hi (the same page unless P == 8, and then always
    // read). With P == 8 a page is checked only when one of its rows is in [lo, len).
    const bool lo_used = P > 8 || first + 8 > lo;
    const bool hi_used = P > 8 || first + 8 < len;
    const bool bad = (lo_used && uint32_t(page_lo) >= uint32_t(s.cache.num_pages)) ||
                     (hi_used && uint32_t(page_hi) >= uint32_t(s.cache.num_pages));
    if (bad) bits |= kBadPage;
    const int in_page = first & (P - 1);  // 0 when P == 8 (tiles are 16-aligned)
    // Unread or bad pages become page 0, so that no address is out of bounds.
    const int64_t off_lo =
        (int64_t(bad || !lo_used ? 0 : page_lo) * P + in_page) * token_stride + lane_off;
    const int64_t off_hi =
        P == 8 ? (int64_t(bad || !hi_used ? 0 : page_hi) * P - 8) * token_stride + lane_off : off_lo;
    const bool full = !bad && first >= lo && first + kTile <= len;
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int row = lane_row + j * kRowsPerLoad;
      // j * kRowsPerLoad >= 8 is a compile-time choice of page (rows differ by < kRowsPerLoad
      // across lanes, and kRowsPerLoad divides 8).
      const int64_t off = (j * kRowsPerLoad >= 8 ? off_hi : off_lo) +
                          int64_t(j * kRowsPerLoad) * token_stride;
      const int pos = first + row;
      const bool valid = full || (!bad && pos >= lo && pos < len);
      const int so = SwizzledOffset<kChunks>(row, lane_ch);
      if constexpr (kL2Hint) {
        CpAsync16L2(SmemAddr(ks + so), kbase + off, valid);
        CpAsync16L2(SmemAddr(vs + so), vbase + off, valid);
      } else {
        CpAsync16(SmemAddr(ks + so), kbase + off, valid);
        CpAsync16(SmemAddr(vs + so), vbase + off, valid);
      }
    }
  };

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  int page_lo, page_hi;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    fetch_pages(st, page_lo, page_hi);
    if (st < my_count) load_tile(st, st, page_lo, page_hi);
    CpAsyncCommit();
  }
  fetch_pages(kStages - 1, page_lo, page_hi);
  for (int it = 0; it < my_count; ++it) {
    CpAsyncWait<kStages - 2>();
    __syncwarp();
    if (it + kStages - 1 < my_count) {
      load_tile(it + kStages - 1, (it + kStages - 1) % kStages, page_lo, page_hi);
      fetch_pages(it + kStages, page_lo, page_hi);
    }
    CpAsyncCommit();

    const T* ks = wsmem + (it % kStages) * 2 * kTileElems;
    const T* vs = ks + kTileElems;
    // Two independent accumulator chains (even / odd k steps) halve the dependent-mma latency.
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float sd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t r[4];
      const int row = (lane & 7) + ((lane >> 4) << 3);
      LdMatrixX4(r, SmemAddr(ks + SwizzledOffset<kChunks>(row, 2 * kk + ((lane >> 3) & 1))));
      if (kk % 2 == 0) {
        Mma<T>::mma(sc[0], qf[kk], r[0], r[1]);
        Mma<T>::mma(sc[1], qf[kk], r[2], r[3]);
      } else {
        Mma<T>::mma(sd[0], qf[kk], r[0], r[1]);
        Mma<T>::mma(sd[1], qf[kk], r[2], r[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) sc[nt][j] += sd[nt][j];
    // Rows 8..15 of the m16 tile hold query heads only when G > 8; otherwise their logits are
    // neither transformed nor used (their P fragments below are zero).
    const int tile_pos = (my_lo + warp + it * kWarps) * kTile;
    const int num_j = two_halves ? 4 : 2;
    if (p.logit.soft_cap > 0.f) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (j < num_j) sc[nt][j] = p.logit.capped(sc[nt][j]);
    } else {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) sc[nt][j] *= p.logit.scale_log2;
    }
    if (tile_pos < lo || tile_pos + kTile > len) {  // a partial tile: mask (warp-uniform)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int pos = tile_pos + nt * 8 + c0 + (j & 1);
          if (pos < lo || pos >= len) sc[nt][j] = -INFINITY;
        }
    }
    DecodeSoftmax<D / 8>(sc, o, m, l, two_halves);
    const uint32_t pa[4] = {
        Mma<T>::pack(sc[0][0], sc[0][1]), two_halves ? Mma<T>::pack(sc[0][2], sc[0][3]) : 0u,
        Mma<T>::pack(sc[1][0], sc[1][1]), two_halves ? Mma<T>::pack(sc[1][2], sc[1][3]) : 0u};
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      uint32_t r[4];
      const int row = (lane & 7) + (((lane >> 3) & 1) << 3);
      LdMatrixX4Trans(r, SmemAddr(vs + SwizzledOffset<kChunks>(row, n + (lane >> 4))));
      Mma<T>::mma(o[n], pa, r[0], r[1]);
      Mma<T>::mma(o[n + 1], pa, r[2], r[3]);
    }
  }
  CpAsyncWait<0>();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  if (bits) {
    atomicOr(&cta_bad, 1);
    RaiseError(a.error_word, bits);
  }
  __syncthreads();  // all warps are done with the ring: reuse it for the merge

  float* mo = reinterpret_cast<float*>(smem);  // [kWarps][G][D]
  float* mm = mo + kWarps * G * D;             // [kWarps][G]
  float* ml = mm + kWarps * G;                 // [kWarps][G]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + 8 * h;
    if (row < G) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        mo[(warp * G + row) * D + n * 8 + c0] = o[n][2 * h];
        mo[(warp * G + row) * D + n * 8 + c0 + 1] = o[n][2 * h + 1];
      }
      if (lane % 4 == 0) {
        mm[warp * G + row] = m[h];
        ml[warp * G + row] = l[h];
      }
    }
  }
  __syncthreads();
  const bool bad = cta_bad != 0;
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int row = idx / D, d = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, mm[w * G + row]);
    float num = 0.f, den = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = FastExp2(mm[w * G + row] - mx);
        num += f * mo[(w * G + row) * D + d];
        den += f * ml[w * G + row];
      }
    }
    if (bad) num = NAN;
    const int64_t head = int64_t(b) * s.num_heads + int64_t(kvh) * G + row;
    if (p.num_splits == 1) {
      static_cast<T*>(a.out)[head * D + d] = DTypeTraits<T>::from_float(den > 0.f ? num / den : (bad ? NAN : 0.f));
    } else {
      const int64_t ph = int64_t(split) * s.batch * s.num_heads + head;
      p.part_o[ph * D + d] = num;
      if (d == 0) {
        p.part_ml[ph * 2] = mx;
        p.part_ml[ph * 2 + 1] = den;
      }
    }
  }
}

// Merges the splits of each (b, h): out = sum_i 2^(m_i - M) o_i / sum_i 2^(m_i - M) l_i.
template <typename T>
__global__ void CombineSplitsKernel(const float* __restrict__ part_o,
                                    const float* __restrict__ part_ml, T* __restrict__ out,
                                    int num_splits, int64_t num_rows, int D) {
  const int64_t row = blockIdx.x;
  float mx = -INFINITY;
  for (int i = 0; i < num_splits; ++i) mx = fmaxf(mx, part_ml[(i * num_rows + row) * 2]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float num = 0.f, den = 0.f;
    if (mx != -INFINITY) {
      for (int i = 0; i < num_splits; ++i) {
        const int64_t pr = i * num_rows + row;
        const float f = FastExp2(part_ml[pr * 2] - mx);
        num += f * part_o[pr * D + d];
        den += f * part_ml[pr * 2 + 1];
      }
    }
    const bool nan = num != num;
    out[row * D + d] = DTypeTraits<T>::from_float(nan ? NAN : (den > 0.f ? num / den : 0.f));
  }
}

// Wave-aware split count (experimental, variants 4/5): every CTA of a decode grid does about the
// same work, so a grid of 1.3 waves costs 2. Picks the smallest split count in [1, 8] whose grid
// fills its last wave best (within 2%), keeping >= 2 tiles per warp.
int64_t WaveAwareSplits(int64_t base, int64_t slots, int64_t max_splits) {
  int64_t best = 1;
  double best_eff = 0.0;
  for (int64_t s = 1; s <= std::min<int64_t>(8, std::max<int64_t>(1, max_splits)); ++s) {
    const double waves = double(base * s) / double(slots);
    const double eff = waves / std::ceil(waves);
    if (eff > best_eff + 0.02) {
      best_eff = eff;
      best = s;
    }
  }
  return best;
}

template <typename T, int D, int kStages = DefaultStages<D>(), bool kL2Hint = false,
          bool kWaveAware = false>
ffi::Error Launch(cudaStream_t stream, const AttentionArgs& a) {
  const AttentionShape& s = a.shape;
  constexpr int smem = DecodeSmemBytes<D, kStages>();
  auto kernel = PagedDecodeKernel<T, D, kStages, kL2Hint>;
  static bool configured = false;  // NOTE: per-template, set on the first launch
  if (!configured) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess)
      return LaunchError("paged_attention: cudaFuncSetAttribute");
    configured = true;
  }
  int per_sm = 1;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * 32, smem);
  const int64_t base = s.batch * s.cache.num_kv_heads;
  const int64_t slots = int64_t(NumSMs()) * std::max(per_sm, 1);
  int64_t max_tiles = (s.max_pages * s.cache.page_size + kTile - 1) / kTile + 1;
  if (a.window > 0) max_tiles = std::min<int64_t>(max_tiles, (a.window + kTile - 1) / kTile + 1);
  // One wave of CTAs when the batch alone cannot fill the GPU; at least 2 tiles per warp.
  int64_t splits = base < slots ? slots / base : 1;
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, max_tiles / (2 * kWarps)));
  if constexpr (kWaveAware) splits = WaveAwareSplits(base, slots, max_tiles / (2 * kWarps));

  DecodeParams p;
  p.a = a;
  p.logit = LogitTransform::Make(a.scale, a.soft_cap);
  p.page_shift = __builtin_ctzll(uint64_t(s.cache.page_size));
  p.num_splits = int(splits);
  p.part_o = nullptr;
  p.part_ml = nullptr;
  const int64_t rows = s.batch * s.num_heads;
  if (splits > 1) {
    const size_t o_bytes = size_t(splits * rows * D) * sizeof(float);
    void* ws = Workspace(stream, o_bytes + size_t(splits * rows * 2) * sizeof(float));
    if (ws == nullptr) return ffi::Error::Internal("paged_attention: workspace allocation failed");
    p.part_o = static_cast<float*>(ws);
    p.part_ml = reinterpret_cast<float*>(static_cast<char*>(ws) + o_bytes);
  }
  dim3 grid(unsigned(splits), unsigned(s.cache.num_kv_heads), unsigned(s.batch));
  kernel<<<grid, kWarps * 32, smem, stream>>>(p);
  if (auto err = LaunchError("paged_attention (decode kernel)"); err.failure()) return err;
  if (splits > 1) {
    CombineSplitsKernel<T><<<unsigned(rows), 128, 0, stream>>>(
        p.part_o, p.part_ml, static_cast<T*>(a.out), int(splits), rows, D);
    return LaunchError("paged_attention (combine kernel)");
  }
  return ffi::Error::Success();
}

}  // namespace

bool PagedDecodeSupports(const AttentionArgs& a) {
  const AttentionShape& s = a.shape;
  const int64_t D = s.cache.head_dim, P = s.cache.page_size;
  return (s.cache.dtype == DType::kBF16 || s.cache.dtype == DType::kF16) &&
         (D == 64 || D == 128 || D == 256) && P >= 8 && (P & (P - 1)) == 0 && s.group() <= 16 &&
         s.batch <= 65535 && s.cache.num_kv_heads <= 65535;
}

ffi::Error LaunchPagedDecode(cudaStream_t stream, const AttentionArgs& a) {
  return DispatchHalfDtypeAndHeadDim(a, "paged_attention", [&](auto t, auto d) -> ffi::Error {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
    if constexpr (D == 128) {
      // Experimental variants for tuning (JAX_KVCM_DECODE_VARIANT), head_dim 128 only.
      if (const char* variant = std::getenv("JAX_KVCM_DECODE_VARIANT")) {
        if (variant[0] == '1') return Launch<T, 128, 2, false>(stream, a);
        if (variant[0] == '2') return Launch<T, 128, 3, true>(stream, a);
        if (variant[0] == '3') return Launch<T, 128, 4, false>(stream, a);
        if (variant[0] == '4') return Launch<T, 128, 2, false, true>(stream, a);
        if (variant[0] == '5') return Launch<T, 128, 3, false, true>(stream, a);
      }
    }
    return Launch<T, D>(stream, a);
  });
}

}  // namespace kvcm::cuda
