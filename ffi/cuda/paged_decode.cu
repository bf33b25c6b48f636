// Split-KV paged decode attention on tensor cores (bf16 / f16 queries; caches of the query dtype
// or float8_e4m3fn).
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

#include "kvcm/cuda/attention.cuh"
#include "kvcm/cuda/mbarrier.cuh"
#include "kvcm/cuda/mma.cuh"

namespace kvcm::cuda {
namespace {

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
constexpr int kRingBytes = 72 * 1024;
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
// Stages of the CTA's ring (16-bit caches) or of each warp's (fp8).
template <int D, bool kFp8>
constexpr int RingStages() {
  if constexpr (kFp8) return kFp8WarpStages;
  return kRingBytes / (2 * TileBytes<D, kFp8>());  // 9 at head_dim 128
}

// The ring(s); at least the end-of-kernel merge's [kWarps][G <= 16][D] floats and [kWarps][G]
// maxima and sums, which reuse them.
constexpr int kSmemAlign = 128;
template <int D, bool kFp8>
constexpr int DecodeSmemBytes() {
  constexpr int ring = (kFp8 ? kWarps : 1) * RingStages<D, kFp8>() * 2 * TileBytes<D, kFp8>();
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

// T: query / output dtype; kFp8: float8_e4m3fn caches (MMAs in f16), else caches of T; kNH:
// column tiles of 8 query heads (G <= 8 * kNH). 16-bit caches: kWarps computing warps and a
// producer warp around one CTA-wide ring; fp8 caches: kWarps warps with a ring each (see
// kRingBytes).
template <typename T, int D, bool kFp8, int kNH>
__global__ void __launch_bounds__(CtaThreads<kFp8>(), MinCtasPerSm<D, kFp8>())
    PagedDecodeKernel(const DecodeParams p) {
  using M = std::conditional_t<kFp8, __half, T>;  // MMA operand type
  constexpr int kStages = RingStages<D, kFp8>();
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
// - B256 S256 (17 tiles a row): no split (at most 2 ways, which the combine eats).
// max_tiles bounds the tiles of the longest row (the table width, or the window).
struct DecodeSchedule {
  int64_t full_rows;  // rows [0, full_rows) run whole
  int64_t splits;     // CTAs per row for the others (1: no split, full_rows = rows)
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
  return best == 1 ? DecodeSchedule{rows, 1} : DecodeSchedule{full_rows, best};
}

// CTAs per SM of one kernel instance (configures its shared memory on the first call); 0 when
// the attribute cannot be set.
template <typename T, int D, bool kFp8, int kNH>
int CtasPerSm() {
  static int per_sm = [] {  // NOTE: per-template, on the first launch
    constexpr int smem = DecodeSmemBytes<D, kFp8>();
    auto kernel = PagedDecodeKernel<T, D, kFp8, kNH>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess)
      return 0;
    int n = 1;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, CtaThreads<kFp8>(), smem);
    return std::max(n, 1);
  }();
  return per_sm;
}

template <typename T, int D, bool kFp8, int kNH>
ffi::Error Launch(cudaStream_t stream, const AttentionArgs& a, size_t workspace_offset) {
  const AttentionShape& s = a.shape;
  constexpr int smem = DecodeSmemBytes<D, kFp8>();
  auto kernel = PagedDecodeKernel<T, D, kFp8, kNH>;
  const int per_sm = CtasPerSm<T, D, kFp8, kNH>();
  if (per_sm == 0) return LaunchError("paged_attention: cudaFuncSetAttribute");
  const int64_t rows = s.batch * s.cache.num_kv_heads;
  const int64_t slots = int64_t(NumSMs()) * per_sm;
  // Tiles a row can read: its table's pages (a ring's reads span at most max_pages pages too),
  // fewer under a window.
  int64_t max_tiles = (s.max_pages * s.cache.page_size + kTile - 1) / kTile + 1;
  if (a.window > 0) max_tiles = std::min<int64_t>(max_tiles, (a.window + kTile - 1) / kTile + 1);
  const DecodeSchedule plan = PlanDecode(rows, slots, max_tiles);
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
      return Launch<T, D, decltype(fp8)::value, decltype(nh)::value>(stream, a, workspace_offset);
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
