// Decode attention, one 16-token tile at a time: the CTA layout (warps, rings, shared memory),
// the fp8 tile swizzle, and the device functions that load a row's query and its K/V tiles and
// attend one tile (the transposed "swap AB" MMAs). Framework-free (CUDA and kvcm's own headers);
// the kernel that drives them is in decode_kernel.cuh, its schedule and launch in
// ffi/cuda/paged_decode.cu, whose head comment describes the design.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcm/cuda/attention.cuh"
#include "kvcm/cuda/mbarrier.cuh"
#include "kvcm/cuda/mma.cuh"

namespace kvcm::cuda::decode {

constexpr int kTile = 16;  // tokens per tile
constexpr float kLn2 = 0.6931471805599453f;  // lse: log2-domain softmax state -> natural log
constexpr int kWarps = 4;  // warps that compute tiles (tile i of a CTA's: warp i % kWarps)

// How a CTA's tiles reach shared memory, per cache dtype (measured on the H200, 2026-12-02;
// benchmarks/RESULTS.md):
// - 16-bit caches: a producer ring. One more warp streams the CTA's tiles, in order, into a
//   CTA-wide ring of kRingBytes (cp.async; a stage's "full" mbarrier completes when its copies
//   land, its "empty" one when its consumer warp has read it), so every stage that no warp is
//   reading is in flight: 3 CTAs per SM, 3 x 72 KiB of the SM's 227 KiB. 0.98-1.02x FlashInfer's
//   tensor-core decode at B64 S4096 .. B1 S131072, where per-warp rings ran at 0.87-0.95x.
// - fp8 caches: per-warp rings. Each warp streams its own tiles through a private 3-stage ring
//   (48 KiB per CTA at head_dim 128: 4 CTAs, 16 computing warps per SM). A tile of half the bytes
//   costs its warp more work (the e4m3 conversions); the producer ring with 4 (3 CTAs/SM) or 8
//   (2 CTAs/SM) consumer warps ran fp8 1.1x-2x slower than this.
// - short rows (16-bit caches, head_dim <= 128, tables of at most kShortRowTiles tiles): a
//   48 KiB ring, 4 CTAs per SM instead of 3. Such a grid runs in waves of whole rows whose CTAs
//   do not get faster alone (Nsight Compute, H100, bf16 B256 S256: 2,048 CTAs of 17 tiles are
//   5.17 waves at 3 a SM, the sixth 17% full, 0.90x of the copy rate); at 4 a SM they are 3.88
//   waves, and a 17-tile row needs no 9-stage ring. Chosen by paged_decode.cu's schedule.
constexpr int kRingBytes = 72 * 1024;
constexpr int kShortRowRingBytes = 48 * 1024;
constexpr int kFp8WarpStages = 3;

template <int D, bool kFp8>
constexpr int TileBytes() {  // one arriving {K or V} tile
  return kTile * D * (kFp8 ? 1 : 2);
}
template <bool kFp8>
constexpr int CtaThreads() {
  return (kWarps + (kFp8 ? 0 : 1)) * 32;
}
// Register bound: fp8 at head_dim 64 fits 5 CTAs per SM by shared memory (24 KiB each), which
// its registers allow only under 102 per thread. 0 elsewhere: no bound (ptxas then keeps its own
// register target; an explicit 1 let it take up to 255: 94 -> 111 registers for bf16 at head_dim
// 128, 122 -> 137 for fp8, one CTA per SM fewer).
template <int D, bool kFp8>
constexpr int MinCtasPerSm() {
  return kFp8 && D == 64 ? 5 : 0;
}
// Stages of the CTA's ring of kRing bytes (16-bit caches) or of each warp's (fp8, kRing unused).
template <int D, bool kFp8, int kRing = kRingBytes>
constexpr int RingStages() {
  if constexpr (kFp8) return kFp8WarpStages;
  return kRing / (2 * TileBytes<D, kFp8>());  // 9 at head_dim 128 (6 in the short-row ring)
}

// The ring(s); at least the end-of-kernel merge's [kWarps][G <= 16][D] floats and [kWarps][G]
// maxima and sums, which reuse them.
constexpr int kSmemAlign = 128;
template <int D, bool kFp8, int kRing = kRingBytes>
constexpr int DecodeSmemBytes() {
  constexpr int ring =
      (kFp8 ? kWarps : 1) * RingStages<D, kFp8, kRing>() * 2 * TileBytes<D, kFp8>();
  constexpr int merge = kWarps * 16 * (D + 2) * 4;
  return ring > merge ? ring : merge;
}

// fp8 tiles ([16 tokens][D bytes] in shared memory): 16-byte chunk c of row r lives at chunk
// position c ^ Fp8ChunkSwizzle<D>(r). Chosen so that the fragment reads of the kernel hit 32
// distinct banks per shared-memory wavefront (checked by tests/test_decode_fragments.py):
// - K reads 4 bytes of chunk kk of rows g (and g + 8), lane = 4g + q: the swizzle must differ on
//   the rows sharing banks: r & 7 at D = 128 (row stride 128 bytes), (r >> 1) & 3 at D = 64
//   (two rows per 128 bytes);
// - V reads 16 bytes of chunks 2g and 2g + 1 of rows 2q (+1, +8, +9) at D = 256 (8 lanes per
//   wavefront: g in {2p, 2p + 1}, q = 0..3): r & 7 with bits 0 and 1 swapped, so the four rows
//   2q (or 2q + 1) of a wavefront differ from each other by more than the xor 2 between chunks
//   2g of g = 2p and 2p + 1. D = 128 reads chunk g of the same rows (conflict-free with r & 7);
//   D = 64 reads 8 bytes per row and its four rows 2q share 64 bytes of banks: 2-way, unavoidable
//   with a per-row swizzle.
template <int D>
__device__ __forceinline__ int Fp8ChunkSwizzle(int row) {
  if constexpr (D == 64) return (row >> 1) & 3;
  else if constexpr (D == 128) return row & 7;
  else return ((row & 1) << 1) | ((row >> 1) & 1) | (row & 4);
}
// Byte offset of chunk `chunk` of row `row` in an fp8 [16][D] tile.
template <int D>
__device__ __forceinline__ int Fp8TileOffset(int row, int chunk) {
  return row * D + ((chunk ^ Fp8ChunkSwizzle<D>(row)) << 4);
}

// fp8 caches: head-dim index of row r (0..15) of m-tile mt of O^T (see the P V step): lane
// (g, q)'s rows g and g + 8 of every m-tile lie in the D / 8 bytes at g * (D / 8) of a token row,
// in pieces of kPiece = min(D / 8, 16) bytes, row g in a piece's first half, g + 8 in its second.
template <int D>
__host__ __device__ constexpr int PermutedVDim(int mt, int r) {
  constexpr int kPiece = D / 8 < 16 ? D / 8 : 16;
  return (r & 7) * (D / 8) + (mt / (kPiece / 2)) * kPiece + (r >> 3) * (kPiece / 2) +
         mt % (kPiece / 2);
}

// The transpose of an 8x8 matrix of 16-bit values held as row fragments (lane l: row l / 4,
// columns 2 (l % 4) + {0, 1}), returned in the same layout.
__device__ __forceinline__ uint32_t MovMatrixTrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Four e4m3 values (bytes 0..3 of w) -> two f16x2 words: lo = {byte 0, byte 1}, hi = {byte 2,
// byte 3}, the lower-addressed byte in the low half; exact, and e4m3fn NaN (0x7f / 0xff) -> f16
// NaN, as in Fp8ChunkToHalf (the same cvt.rn.f16x2.e4m3x2). The inline form lets ptxas read the
// high half in place (no shift).
__device__ __forceinline__ void Fp8QuadToHalf2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
      "cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
#else
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w & 0xffffu), __NV_E4M3);
  const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w >> 16), __NV_E4M3);
  lo = uint32_t(a.x) | (uint32_t(a.y) << 16);
  hi = uint32_t(b.x) | (uint32_t(b.y) << 16);
#endif
}

// Two query elements (one 32-bit word of T) as the MMA operand type M.
template <typename T, typename M>
__device__ __forceinline__ uint32_t QueryWord(const T* p) {
  const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
  if constexpr (std::is_same_v<T, M>) {
    return w;
  } else {  // bf16 -> f16
    __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&w);
    const float2 f = __bfloat1622float2(b);
    __half2 h = __floats2half2_rn(f.x, f.y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

struct DecodeParams {
  AttentionArgs a;
  LogitTransform logit;
  int page_shift;
  int page_rows;      // CacheShape::page_rows
  int full_rows;      // rows [0, full_rows) run whole, one CTA each
  int num_splits;     // CTAs per row for rows >= full_rows
  float* part_o;   // [num_splits, B, H, D] (num_splits > 1)
  float* part_ml;  // [num_splits, B, H, 2]
};

// Q^T as B fragments, one pair per 16-wide k step and column tile: lane (g = lane / 4,
// q = lane % 4) holds head nh * 8 + g at k {2q, 2q + 1} (word 0) and {2q + 8, 2q + 9} (word 1).
// 16-bit caches: k = d - 16 kk. fp8 caches permute the d's of a k step so that a lane's four K
// bytes are one word: k {2q, 2q + 1} holds d = 16 kk + 4q + {0, 1}, k {2q + 8, 2q + 9} holds
// d = 16 kk + 4q + {2, 3} (the dot product is a sum over d: any permutation shared by Q and K
// gives the same S). qb: the row's first query head.
template <typename T, typename M, int D, bool kFp8, int kNH>
__device__ __forceinline__ void LoadQueryFragments(uint32_t (&qf)[D / 16][kNH][2], const T* qb,
                                                   int G, int lane) {
  const int r0 = lane / 4, c0 = (lane % 4) * 2;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int nh = 0; nh < kNH; ++nh) {
      const int head = nh * 8 + r0;
      const int col = kFp8 ? kk * 16 + 2 * c0 : kk * 16 + c0;  // fp8: 4q
      constexpr int kHi = kFp8 ? 2 : 8;  // offset of word 1's d from word 0's
      qf[kk][nh][0] = head < G ? QueryWord<T, M>(qb + head * D + col) : 0u;
      qf[kk][nh][1] = head < G ? QueryWord<T, M>(qb + head * D + col + kHi) : 0u;
    }
}

// Where a row's K / V bytes are (the layer's and kv head's offset applied).
struct RowSource {
  const char* k;
  const char* v;
  int64_t token_bytes;  // bytes from one token of a page to the next
  int64_t num_pages;
  int page_size, page_shift;
  int page_rows;  // token rows from one page to the next (CacheShape::page_rows)
};

// One warp's cp.asyncs of the {K, V} tile of tokens [first, first + kTile) into ks (V at ks +
// TileBytes), both swizzled (16-bit tiles for ldmatrix, fp8 tiles for the fragment reads).
// page_lo / page_hi: the pages of its first and last token (equal unless the page size is 8).
// Rows outside [lo, len), or in a bad page (kBadPage in bits), are zero-filled: a zero V row
// times its zero probability adds nothing, and its K row's logit is masked.
template <int D, bool kFp8>
__device__ __forceinline__ void LoadTile(char* ks, const RowSource& src, int first, int lo,
                                         int len, int page_lo, int page_hi, int lane,
                                         uint32_t& bits) {
  constexpr int kChunks = D / 8;                      // 16-byte chunks of a 16-bit tile row
  constexpr int kLoadChunks = kFp8 ? D / 16 : D / 8;  // 16-byte chunks per cached row
  char* vs = ks + TileBytes<D, kFp8>();
  const int P = src.page_size;
  // Fast path (every tile but a row's first and last, and pages of 16+ tokens): the whole tile
  // is attended and lies in one valid page, so one lane-uniform check replaces the per-chunk
  // ones and each lane's rows are a fixed stride apart (its chunk column is fixed: kLoadChunks
  // divides 32).
  if (P >= kTile && first >= lo && first + kTile <= len && page_lo >= 0 &&
      page_lo < src.num_pages) {
    constexpr int kRowStep = 32 / kLoadChunks;
    const int ch = lane % kLoadChunks, row0 = lane / kLoadChunks;
    const int64_t off0 =
        (int64_t(page_lo) * src.page_rows + ((first + row0) & (P - 1))) * src.token_bytes +
        ch * 16;
#pragma unroll
    for (int k = 0; k < kTile / kRowStep; ++k) {
      const int row = row0 + k * kRowStep;
      const int so = kFp8 ? Fp8TileOffset<D>(row, ch) : SwizzledOffset<kChunks>(row, ch) * 2;
      const int64_t off = off0 + int64_t(k * kRowStep) * src.token_bytes;
      CpAsync16(SmemAddr(ks + so), src.k + off, true);
      CpAsync16(SmemAddr(vs + so), src.v + off, true);
    }
    return;
  }
  const int p_lo = first >> src.page_shift;
#pragma unroll
  for (int i = lane; i < kTile * kLoadChunks; i += 32) {
    const int row = i / kLoadChunks, ch = i % kLoadChunks;
    const int pos = first + row;
    const int page = (pos >> src.page_shift) == p_lo ? page_lo : page_hi;
    bool valid = pos >= lo && pos < len;
    int64_t off = 0;
    if (valid) {
      if (page < 0 || page >= src.num_pages) {
        bits |= kBadPage;
        valid = false;
      } else {
        off = (int64_t(page) * src.page_rows + (pos & (P - 1))) * src.token_bytes + ch * 16;
      }
    }
    const int so = kFp8 ? Fp8TileOffset<D>(row, ch) : SwizzledOffset<kChunks>(row, ch) * 2;
    CpAsync16(SmemAddr(ks + so), src.k + off, valid);
    CpAsync16(SmemAddr(vs + so), src.v + off, valid);
  }
}

// One warp's attention over the tile at ktile (V at ktile + TileBytes) of tokens [tile_pos,
// tile_pos + kTile), positions outside [lo, len) masked: the online softmax state (m, l) and the
// O^T accumulators o of this lane (see the kernel) are updated.
template <typename M, int D, bool kFp8, int kNH>
__device__ __forceinline__ void AttendTile(const char* ktile, int tile_pos, int lo, int len,
                                           const LogitTransform& logit,
                                           const uint32_t (&qf)[D / 16][kNH][2],
                                           float (&o)[D / 16][kNH][4], float (&m)[kNH][2],
                                           float (&l)[kNH][2], int lane) {
  constexpr int kChunks = D / 8;
  const char* vtile = ktile + TileBytes<D, kFp8>();
  const int r0 = lane / 4, c0 = (lane % 4) * 2;
  // S^T = K Q^T. Two independent accumulator chains (even / odd k steps) halve the dependent
  // MMA latency.
  float sc[kNH][4], sd[kNH][4];
#pragma unroll
  for (int nh = 0; nh < kNH; ++nh)
#pragma unroll
    for (int j = 0; j < 4; ++j) sc[nh][j] = sd[nh][j] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t ka[4];  // A fragment: tokens g (words 0, 2) and g + 8 (1, 3)
    if constexpr (kFp8) {
      // Words 0 / 2 hold k {2q, 2q + 1} / {2q + 8, 2q + 9} = d 16 kk + 4q + {0, 1} / {2, 3}:
      // the low and high halves of the word at byte 4q of chunk kk of the token's row.
      const uint32_t w0 =
          *reinterpret_cast<const uint32_t*>(ktile + Fp8TileOffset<D>(r0, kk) + 2 * c0);
      const uint32_t w1 =
          *reinterpret_cast<const uint32_t*>(ktile + Fp8TileOffset<D>(r0 + 8, kk) + 2 * c0);
      Fp8QuadToHalf2x2(w0, ka[0], ka[2]);
      Fp8QuadToHalf2x2(w1, ka[1], ka[3]);
    } else {
      // Matrices 0..3 of the x4 load: tokens 0-7 / 8-15 (bit 3 of the lane) at chunk 2 kk /
      // 2 kk + 1 (bit 4).
      const M* ks = reinterpret_cast<const M*>(ktile);
      const int row = (lane & 7) + (((lane >> 3) & 1) << 3);
      LdMatrixX4(ka, SmemAddr(ks + SwizzledOffset<kChunks>(row, 2 * kk + (lane >> 4))));
    }
#pragma unroll
    for (int nh = 0; nh < kNH; ++nh) {
      if (kk % 2 == 0) Mma<M>::mma(sc[nh], ka, qf[kk][nh][0], qf[kk][nh][1]);
      else Mma<M>::mma(sd[nh], ka, qf[kk][nh][0], qf[kk][nh][1]);
    }
  }
  uint32_t pb[kNH][2];  // P^T as B fragments
#pragma unroll
  for (int nh = 0; nh < kNH; ++nh) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int pos = tile_pos + r0 + 8 * (j >> 1);
      sc[nh][j] = (pos >= lo && pos < len) ? logit(sc[nh][j] + sd[nh][j]) : -INFINITY;
    }
    // Online softmax per column (head): the max over the tile's 16 tokens is over this
    // lane's two rows and the 8 lanes of the column (lane bits 2-4).
    float alpha[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float mx = fmaxf(sc[nh][c], sc[nh][2 + c]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m[nh][c], mx);
      const float base = m_new == -INFINITY ? 0.f : m_new;
      alpha[c] = FastExp2(m[nh][c] - base);
      sc[nh][c] = FastExp2(sc[nh][c] - base);
      sc[nh][2 + c] = FastExp2(sc[nh][2 + c] - base);
      l[nh][c] = l[nh][c] * alpha[c] + (sc[nh][c] + sc[nh][2 + c]);
      m[nh][c] = m_new;
    }
    // NOTE: skipped warp-uniformly when no column's max moved (every alpha exactly 1).
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt) {
        o[mt][nh][0] *= alpha[0];
        o[mt][nh][1] *= alpha[1];
        o[mt][nh][2] *= alpha[0];
        o[mt][nh][3] *= alpha[1];
      }
    }
    // Tokens g (g + 8) x heads 2q, 2q + 1 is the row fragment of an 8x8 matrix; its transpose
    // gives lane (g, q) head g at tokens 2q, 2q + 1 (2q + 8, 2q + 9): P^T's B fragment.
    pb[nh][0] = MovMatrixTrans(Mma<M>::pack(sc[nh][0], sc[nh][1]));
    pb[nh][1] = MovMatrixTrans(Mma<M>::pack(sc[nh][2], sc[nh][3]));
  }

  // O^T += V^T P^T.
  if constexpr (kFp8) {
    // V^T's A fragment of m-tile mt: words 0 / 1 hold rows g / g + 8 at tokens {2q, 2q + 1},
    // words 2 / 3 the same rows at tokens {2q + 8, 2q + 9}. The rows are permuted
    // (PermutedVDim): lane (g, q) finds every byte it needs in the D / 8 contiguous bytes at
    // g * (D / 8) of token rows 2q, 2q + 1, 2q + 8, 2q + 9, read in pieces of up to 16 bytes
    // whose first half holds row g and second half row g + 8 of kPiece / 2 m-tiles. The
    // bytes of rows t and t + 1 are interleaved into e4m3 pairs (row t's byte low: the smaller
    // k index), each pair converted to one f16x2 word.
    constexpr int kPiece = D / 8 < 16 ? D / 8 : 16;
    constexpr int kWords = kPiece / 4;
#pragma unroll
    for (int pc = 0; pc < D / 8 / kPiece; ++pc) {
      const int byte = r0 * (D / 8) + pc * kPiece;  // in the unswizzled row
      uint32_t w[4][kWords];  // rows 2q, 2q + 1, 2q + 8, 2q + 9
#pragma unroll
      for (int rr = 0; rr < 4; ++rr) {
        const int row = c0 + (rr & 1) + (rr >> 1) * 8;
        const char* src = vtile + Fp8TileOffset<D>(row, byte >> 4) + (byte & 15);
        if constexpr (kPiece == 16) {
          const uint4 v = *reinterpret_cast<const uint4*>(src);
          w[rr][0] = v.x; w[rr][1] = v.y; w[rr][2] = v.z; w[rr][3] = v.w;
        } else {
          const uint2 v = *reinterpret_cast<const uint2*>(src);
          w[rr][0] = v.x; w[rr][1] = v.y;
        }
      }
#pragma unroll
      for (int j = 0; j < kWords / 2; ++j) {  // m-tiles pc * kPiece / 2 + 4j + i, i < 4
        uint32_t va[4][4];  // [i][A word]
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)        // A rows g / g + 8: word j / j + kWords / 2
#pragma unroll
          for (int tp = 0; tp < 2; ++tp) {    // tokens {2q, 2q + 1} / {2q + 8, 2q + 9}
            const uint32_t x = w[2 * tp][j + hr * (kWords / 2)];
            const uint32_t y = w[2 * tp + 1][j + hr * (kWords / 2)];
            const int word = hr + 2 * tp;
            Fp8QuadToHalf2x2(__byte_perm(x, y, 0x5140), va[0][word], va[1][word]);
            Fp8QuadToHalf2x2(__byte_perm(x, y, 0x7362), va[2][word], va[3][word]);
          }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int nh = 0; nh < kNH; ++nh)
            Mma<M>::mma(o[pc * (kPiece / 2) + 4 * j + i][nh], va[i], pb[nh][0], pb[nh][1]);
      }
    }
  } else {
    const M* vs = reinterpret_cast<const M*>(vtile);
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      // Matrices 0..3 of the x4 transposed load: d 16 mt + 0-7 / + 8-15 (chunk 2 mt / 2 mt + 1,
      // lane bit 3) at tokens 0-7 / 8-15 (lane bit 4).
      uint32_t va[4];
      const int row = (lane & 7) + ((lane >> 4) << 3);
      LdMatrixX4Trans(va, SmemAddr(vs + SwizzledOffset<kChunks>(row, 2 * mt + ((lane >> 3) & 1))));
#pragma unroll
      for (int nh = 0; nh < kNH; ++nh) Mma<M>::mma(o[mt][nh], va, pb[nh][0], pb[nh][1]);
    }
  }
}

}  // namespace kvcm::cuda::decode
