// The decode kernels: PagedDecodeKernel (a CTA per row, or per split of a row: the producer /
// consumer warps around the tile functions of decode_tile.cuh, the end-of-CTA merge, the output
// or a split's partial) and CombineSplitsKernel (merges a split row's partials). Framework-free;
// launched by ffi/cuda/paged_decode.cu.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvcm/cuda/decode_tile.cuh"

namespace kvcm::cuda::decode {

// T: query / output dtype; kFp8: float8_e4m3fn caches (MMAs in f16), else caches of T; kNH:
// column tiles of 8 query heads (G <= 8 * kNH). 16-bit caches: kWarps computing warps and a
// producer warp around one CTA-wide ring of kRing bytes; fp8 caches: kWarps warps with a ring
// each (see kRingBytes).
template <typename T, int D, bool kFp8, int kNH, int kRing = kRingBytes>
__global__ void __launch_bounds__(CtaThreads<kFp8>(), MinCtasPerSm<D, kFp8>())
    PagedDecodeKernel(const DecodeParams p) {
  using M = std::conditional_t<kFp8, __half, T>;  // MMA operand type
  constexpr int kStages = RingStages<D, kFp8, kRing>();
  constexpr int kTileBytes = TileBytes<D, kFp8>();  // bytes of one arriving K (or V) tile
  const AttentionArgs& a = p.a;
  const AttentionShape& s = a.shape;
  // 32-bit: the launch checks that the grid's CTA count fits an int.
  const int cta = int(blockIdx.x), full_rows = p.full_rows, hkv = int(s.cache.num_kv_heads);
  const bool whole = cta < full_rows;
  const int row_id = whole ? cta : full_rows + (cta - full_rows) / p.num_splits;
  const int split = whole ? 0 : (cta - full_rows) % p.num_splits;
  const int splits = whole ? 1 : p.num_splits;
  const int kvh = row_id % hkv, b = row_id / hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool computes = warp < kWarps;  // else the producer warp (16-bit caches)
  const int G = int(s.group());

  // The dynamic base follows the static variables, 16-byte aligned unless declared otherwise
  // (the fp8 kernel's landed at 16 mod 32). Tiles need 128-byte alignment: a cp.async whose
  // destination straddles 32-byte units makes the two 16-byte halves of a global sector separate
  // L2 requests (Nsight Compute, H200, fp8 B64 S4096: twice the sectors of the data, half of them
  // L2 hits, 3x the shared-store wavefronts), and the swizzles assume 128-byte rows.
  extern __shared__ __align__(kSmemAlign) uint4 smem_raw[];
  char* smem = reinterpret_cast<char*>(smem_raw);
  // 16-bit caches: full[i]: stage i's copies landed (one arrival per producer lane, on its
  // copies); empty[i]: its warp has read it (one arrival per lane).
  __shared__ uint64_t full_bar[kFp8 ? 1 : kStages], empty_bar[kFp8 ? 1 : kStages];
  __shared__ int cta_bad;
  if (threadIdx.x == 0) {
    cta_bad = 0;
    if constexpr (!kFp8) {
      for (int i = 0; i < kStages; ++i) {
        MbarInit(&full_bar[i], 32);
        MbarInit(&empty_bar[i], 32);
      }
    }
  }
  __syncthreads();

  // The q / out row of this sequence: b for decode calls, query_start[b] for ragged ones.
  int64_t qrow = b;
  if (a.query_start != nullptr) {
    if (!IsRaggedDecodeRow(a, b)) return;  // CTA-uniform (b is the CTA's)
    qrow = a.query_start[b];
  }

  int len = a.seq_lens[b];
  int li = *a.layer;
  uint32_t bits = 0;
  if (len < 0 || !RowFitsTable(a.window > 0 ? max(0, len - a.window) : 0, len, a)) {
    bits |= kBadSeqLen;
    len = 0;
  }
  if (li < 0 || li >= s.cache.num_layers) { bits |= kBadLayer; li = 0; len = 0; }
  const int lo = a.window > 0 ? max(0, len - a.window) : 0;
  float v_scale;
  const LogitTransform logit = ScaledLogit<kFp8>(p.logit, a, li, kvh, v_scale);
  const int tile_lo = lo / kTile, tile_hi = (len + kTile - 1) / kTile;
  const int per_split = (max(tile_hi - tile_lo, 0) + splits - 1) / splits;
  const int my_lo = tile_lo + split * per_split;
  const int my_hi = min(tile_hi, my_lo + per_split);
  const int num_tiles = max(my_hi - my_lo, 0);  // the CTA's tiles: my_lo + i, i < num_tiles
  // This warp's tiles: my_lo + warp + j * kWarps, j < my_count.
  const int my_count = num_tiles > warp ? (num_tiles - warp + kWarps - 1) / kWarps : 0;

  constexpr int kElemBytes = kFp8 ? 1 : 2;
  const int64_t layer_off = (int64_t(li) * s.cache.layer_stride + int64_t(kvh) * D) * kElemBytes;
  const RowSource src{static_cast<const char*>(a.k_cache) + layer_off,
                      static_cast<const char*>(a.v_cache) + layer_off,
                      s.cache.token_stride() * kElemBytes, s.cache.num_pages,
                      int(s.cache.page_size), p.page_shift, p.page_rows};
  const int32_t* pages = a.page_table + int64_t(b) * s.max_pages;
  const int max_pages = int(s.max_pages);

  // The kernel computes the transposed products (tokens and head dims on the MMA's 16 rows, the
  // G query heads of the kv head on its 8 columns, kNH column tiles for G > 8):
  //   S^T = K Q^T   (A = a K tile [16 tokens][16 d], B = Q^T [16 d][8 heads], k = d)
  //   O^T += V^T P^T (A = V^T [16 d][16 tokens], B = P^T [16 tokens][8 heads], k = tokens)
  // which takes half the MMAs (and half the accumulator registers) of S = Q K^T with G <= 8 query
  // heads padded to 16 rows. P^T's B fragments come from the S^T accumulators by one in-register
  // 8x8 transpose each (movmatrix).
  // O^T accumulators: m-tile mt, column tile nh; C element j of lane (g, q) is row
  // g + 8 (j / 2) of the m-tile and head nh * 8 + 2q + j % 2. Row r of m-tile mt is
  // d = 16 mt + r (16-bit caches) or PermutedVDim(mt, r) (fp8, see AttendTile's P V step).
  // Online-softmax state of this lane's heads nh * 8 + 2q + {0, 1}; l is this lane's partial
  // sum over its tokens (rows g, g + 8), summed over the lanes of a column at the end.
  const int r0 = lane / 4, c0 = (lane % 4) * 2;
  uint32_t qf[D / 16][kNH][2];
  float o[D / 16][kNH][4];
  float m[kNH][2], l[kNH][2];
  if (computes) {
    LoadQueryFragments<T, M, D, kFp8, kNH>(
        qf, static_cast<const T*>(a.q) + (qrow * s.num_heads + int64_t(kvh) * G) * D, G, lane);
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
      for (int nh = 0; nh < kNH; ++nh)
        o[mt][nh][0] = o[mt][nh][1] = o[mt][nh][2] = o[mt][nh][3] = 0.f;
#pragma unroll
    for (int nh = 0; nh < kNH; ++nh) m[nh][0] = m[nh][1] = -INFINITY, l[nh][0] = l[nh][1] = 0.f;
  }

  if constexpr (!kFp8) {
    if (!computes) {
      // ---- producer warp: tile i into stage i % kStages, once its previous tile was read ----
      // Page ids, 32 at a time: lane j holds the entry of page index base + j of the row (-1
      // past its last page), so a tile's page ids come by shuffle and the table's latency is
      // paid once per 32 pages (>= 16 tiles).
      int base = -64, lane_page = -1;
      const int last_page = len > 0 ? (len - 1) >> p.page_shift : -1;
      for (int it = 0; it < num_tiles; ++it) {
        const int stage = it % kStages;
        const int first = (my_lo + it) * kTile;  // < len
        const int p_lo = first >> p.page_shift;
        const int p_hi = min(first + kTile - 1, len - 1) >> p.page_shift;  // p_lo + {0, 1}
        if (p_hi >= base + 32) {
          base = p_lo;
          lane_page = base + lane <= last_page ? pages[TableEntry(base + lane, max_pages, a.ring)]
                                               : -1;
        }
        const int page_lo = __shfl_sync(0xffffffffu, lane_page, p_lo - base);
        const int page_hi = __shfl_sync(0xffffffffu, lane_page, p_hi - base);
        if (it >= kStages) MbarWait(&empty_bar[stage], ((it / kStages) - 1) & 1);
        LoadTile<D, kFp8>(smem + stage * 2 * kTileBytes, src, first, lo, len, page_lo, page_hi,
                          lane, bits);
        MbarArriveOnCopies(&full_bar[stage]);
      }
      CpAsyncWait<0>();
    } else {
      for (int j = 0; j < my_count; ++j) {
        const int it = warp + j * kWarps;
        const int stage = it % kStages;
        MbarWait(&full_bar[stage], (it / kStages) & 1);
        AttendTile<M, D, kFp8, kNH>(smem + stage * 2 * kTileBytes, (my_lo + it) * kTile, lo, len,
                                    logit, qf, o, m, l, lane);
        MbarArrive(&empty_bar[stage]);  // every lane has read the stage (K and V)
      }
    }
  } else {
    // ---- every warp streams its own tiles through its own kStages-deep ring ----
    char* wsmem = smem + warp * kStages * 2 * kTileBytes;
    // Page ids of a warp's tile j, lane-uniform: a 16-token tile spans one page (P >= 16: page_hi
    // is not read) or two (P == 8). Fetched one tile ahead so their latency hides behind the
    // compute. The loads go straight into the loop-carried registers, unconditionally (j past
    // the warp's last tile reads that tile's entry, unused): a conditional load, or the copy
    // page_hi = page_lo, made ptxas move the pending load's register at once, which stalled the
    // warp on the table's latency every tile (ncu, H200, fp8 B64 S4096: a third of the kernel's
    // stall samples on that move).
    auto fetch_pages = [&](int j, int& page_lo, int& page_hi) {
      const int first = (my_lo + warp + min(j, my_count - 1) * kWarps) * kTile;  // < len
      page_lo = pages[TableEntry(first >> p.page_shift, max_pages, a.ring)];
      if (src.page_size < kTile)
        page_hi = pages[TableEntry(min(first + 8, len - 1) >> p.page_shift, max_pages, a.ring)];
    };
    auto load = [&](int j, int page_lo, int page_hi) {
      LoadTile<D, kFp8>(wsmem + (j % kStages) * 2 * kTileBytes, src,
                        (my_lo + warp + j * kWarps) * kTile, lo, len, page_lo, page_hi, lane,
                        bits);
    };
    int page_lo = 0, page_hi = 0;
    if (my_count > 0) fetch_pages(0, page_lo, page_hi);
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {  // one commit group per tile, empty past the last
      if (st < my_count) {
        load(st, page_lo, page_hi);
        fetch_pages(st + 1, page_lo, page_hi);
      }
      CpAsyncCommit();
    }
    for (int j = 0; j < my_count; ++j) {
      CpAsyncWait<kStages - 2>();
      __syncwarp();
      // This warp's arrived tile j (read below, before the next iteration's __syncwarp lets any
      // lane refill its stage).
      const char* ktile = wsmem + (j % kStages) * 2 * kTileBytes;
      if (j + kStages - 1 < my_count) {
        load(j + kStages - 1, page_lo, page_hi);
        fetch_pages(j + kStages, page_lo, page_hi);
      }
      CpAsyncCommit();
      AttendTile<M, D, kFp8, kNH>(ktile, (my_lo + warp + j * kWarps) * kTile, lo, len, logit,
                                  qf, o, m, l, lane);
    }
    CpAsyncWait<0>();
  }
  if (computes) {
#pragma unroll
    for (int nh = 0; nh < kNH; ++nh)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        l[nh][c] += __shfl_xor_sync(0xffffffffu, l[nh][c], 4);
        l[nh][c] += __shfl_xor_sync(0xffffffffu, l[nh][c], 8);
        l[nh][c] += __shfl_xor_sync(0xffffffffu, l[nh][c], 16);
      }
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
  for (int nh = 0; nh < kNH; ++nh)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int head = nh * 8 + c0 + c;
      if (!computes || head >= G) continue;
      float* dst = mo + (warp * G + head) * D;
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = r0 + 8 * hr;
          dst[kFp8 ? PermutedVDim<D>(mt, r) : mt * 16 + r] = o[mt][nh][2 * hr + c];
        }
      if (r0 == 0) {
        mm[warp * G + head] = m[nh][c];
        ml[warp * G + head] = l[nh][c];
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
    num *= v_scale;
    if (bad) num = NAN;
    const int64_t head = int64_t(kvh) * G + row;
    if (splits == 1) {
      // den is 0 only with nothing attended; NaN (a NaN logit) must stay NaN.
      static_cast<T*>(a.out)[(qrow * s.num_heads + head) * D + d] =
          DTypeTraits<T>::from_float(den == 0.f ? (bad ? NAN : 0.f) : num / den);
      if (a.lse != nullptr && d == 0)  // natural log: (log2 max + log2 den) * ln 2
        a.lse[qrow * s.num_heads + head] =
            bad ? NAN : (den == 0.f ? -INFINITY : (mx + log2f(den)) * kLn2);
    } else {  // partials are indexed by sequence b (the combine kernel maps b to its q row)
      const int64_t ph = (int64_t(split) * s.batch + b) * s.num_heads + head;
      p.part_o[ph * D + d] = num;
      if (d == 0) {
        p.part_ml[ph * 2] = mx;
        p.part_ml[ph * 2 + 1] = den;
      }
    }
  }
}

// Splits of a row at most (PlanDecode's bound; the combine kernel holds one weight per split).
constexpr int kMaxSplits = 64;
constexpr int kCombineThreads = 256;

// Merges the splits of each (b, h) from flat head row first_row on (b * H + h; one CTA each):
// out = sum_i 2^(m_i - M) o_i / sum_i 2^(m_i - M) l_i. Ragged calls: only single-query
// sequences, written at their q row. Every load is issued at once, not split after split: thread
// t owns float4 column t % (D / 4) of the splits t / (D / 4) + k * kGroups (its o loads in
// flight together, before the weights are known), warp 0 reduces the splits' (m, l) meanwhile,
// and the groups' sums meet in shared memory. (A loop over the splits per head dim, as before,
// paid one L2 round trip per split: 13 us at bf16 B1 S131072 (49 splits), 16 at fp8 (61); ncu.)
template <typename T, int D>
__global__ void __launch_bounds__(kCombineThreads) CombineSplitsKernel(
    const AttentionArgs a, const float* __restrict__ part_o, const float* __restrict__ part_ml,
    int num_splits, int64_t first_row) {
  constexpr int kCols = D / 4;                       // float4 columns of a head row
  constexpr int kGroups = kCombineThreads / kCols;   // splits summed side by side
  constexpr int kPerThread = (kMaxSplits + kGroups - 1) / kGroups;
  static_assert(kMaxSplits == 64, "warp 0 holds two splits' (m, l) per lane and writes 64 weights");
  const int64_t row = first_row + blockIdx.x, num_rows = a.shape.batch * a.shape.num_heads;
  const int64_t H = a.shape.num_heads;
  const int b = int(row / H);
  int64_t out_row = row;
  if (a.query_start != nullptr) {
    if (!IsRaggedDecodeRow(a, b)) return;  // CTA-uniform
    out_row = int64_t(a.query_start[b]) * H + row % H;
  }
  __shared__ float weight[kMaxSplits];
  __shared__ float den_shared;
  __shared__ float4 sums[kGroups][kCols];
  const int col = threadIdx.x % kCols, group = threadIdx.x / kCols;
  float4 part[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int i = group + k * kGroups;
    part[k] = i < num_splits
                  ? reinterpret_cast<const float4*>(part_o + (i * num_rows + row) * D)[col]
                  : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (threadIdx.x < 32) {  // warp 0: M = max_i m_i, weights 2^(m_i - M), den = sum_i w_i l_i
    const int lane = threadIdx.x;
    float m[2], l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = lane + 32 * h;
      m[h] = i < num_splits ? part_ml[(i * num_rows + row) * 2] : -INFINITY;
      l[h] = i < num_splits ? part_ml[(i * num_rows + row) * 2 + 1] : 0.f;
    }
    float mx = fmaxf(m[0], m[1]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float den = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Nothing attended anywhere (M = -inf): every weight 0, so the output is 0.
      const float w = mx == -INFINITY ? 0.f : FastExp2(m[h] - mx);
      weight[lane + 32 * h] = w;
      den += w * l[h];
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) den += __shfl_xor_sync(0xffffffffu, den, off);
    if (lane == 0) {
      den_shared = den;
      if (a.lse != nullptr)
        a.lse[out_row] = den != den ? NAN : (den == 0.f ? -INFINITY : (mx + log2f(den)) * kLn2);
    }
  }
  __syncthreads();
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (den_shared != 0.f || den_shared != den_shared) {  // else nothing attended: 0 (no 0 * NaN)
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int i = group + k * kGroups;
      if (i < num_splits) {
        const float w = weight[i];
        acc.x += w * part[k].x, acc.y += w * part[k].y;
        acc.z += w * part[k].z, acc.w += w * part[k].w;
      }
    }
  }
  sums[group][col] = acc;
  __syncthreads();
  if (group != 0) return;
#pragma unroll
  for (int g = 1; g < kGroups; ++g) {
    const float4 x = sums[g][col];
    acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
  }
  const float den = den_shared;
  const float num[4] = {acc.x, acc.y, acc.z, acc.w};
  T* __restrict__ out = static_cast<T*>(a.out) + out_row * D + col * 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const bool nan = num[j] != num[j] || den != den;
    out[j] = DTypeTraits<T>::from_float(nan ? NAN : (den == 0.f ? 0.f : num[j] / den));
  }
}

}  // namespace kvcm::cuda::decode
