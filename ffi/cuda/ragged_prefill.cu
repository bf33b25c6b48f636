// Ragged (prefill / mixed) paged attention on tensor cores, FlashAttention-2 style.
//
// Rows: the G = H / Hkv query heads that share a kv head are packed with the query tokens, row
// r of sequence b = (token r / G, head r % G), so one K/V tile serves G heads. A CTA owns 128 rows
// (64 for D = 256) of one sequence and one kv head: each warp holds two m16 tiles, so every K/V
// fragment it reads from shared memory feeds two MMAs. Q sits in shared memory; K/V tiles stream
// through a shared cp.async ring; warps keep their own online-softmax state.
// fp8 caches: K/V tiles arrive as raw bytes and the CTA converts each to f16 in shared memory
// (exact) before the same MMA path runs in f16 (bf16 queries are converted to f16 in shared memory
// once); k_scale is folded into the logit scale, v_scale into the output normalization.
// A schedule kernel turns query_start into per-sequence tile offsets first (one CTA per tile,
// heaviest tiles of each sequence first), and a fill kernel zeroes the padding rows of q.
// On sm_90a, bf16/f16 caches and fp8 caches at head_dim 64 and 128 run the wgmma kernel of
// ragged_prefill_sm90.cu instead, on the same schedule (its fp8 path: the same f16 MMAs and
// scales as here).
// Single-query sequences (the decode rows of a mixed batch) go to the split-KV decode kernel in
// the same call when it supports the shape: a 128-row tile for one token's G rows would do 128 /
// G times the MMA work per K/V byte and run at a fraction of the memory rate (measured: 256
// decode rows at context 1,024 took 5x the decode kernel's time inside a mixed call).
// Non-finite values: tiles that the CTA's rows read only in part are sanitized
// (SanitizeTileRows) so that NaN/inf in V at a position a row does not read never reaches it.
#include <algorithm>

#include <cub/block/block_scan.cuh>

#include "kvcm/cuda/attention.cuh"
#include "kvcm/cuda/mma.cuh"

namespace kvcm::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kScheduleThreads = 1024;

// Per head_dim: m16 tiles per warp (each K/V fragment read from shared memory feeds all of
// them), K/V tile length and ring depth, chosen to stay within 255 registers. nvcc 13.0 still
// spills 4-44 bytes per thread (ptxas -warn-spills; 4 at head_dim 256, up to 44 with fp8).
template <int D> constexpr int MTiles() { return D <= 128 ? 2 : 1; }
template <int D> constexpr int RowsPerCta() { return 16 * kWarps * MTiles<D>(); }
template <int D> constexpr int KvTile() { return D <= 64 ? 64 : 32; }
template <int D> constexpr int Stages() { return D <= 128 ? 3 : 2; }
// Q [rows][D] (2 bytes), the ring of arriving {K, V} tiles (1 byte per element for fp8), and for
// fp8 one converted f16 {K, V} tile.
template <int D, bool kFp8> constexpr int SmemBytes() {
  return RowsPerCta<D>() * D * 2 + Stages<D>() * 2 * KvTile<D>() * D * (kFp8 ? 1 : 2) +
         (kFp8 ? 2 * KvTile<D>() * D * 2 : 0);
}

// tile_offsets[b] = sum over b' < b of ceil(num_queries(b') * G / rows_per_cta); invalid sequences
// (bad query_start or seq_lens) get no tiles and raise error bits. Also zeroes the sm90 kernel's
// work counter, tile_offsets[batch + 1]: every launch's counter starts at 0, in stream order,
// without a host sync.
__global__ void ScheduleKernel(AttentionArgs a, int32_t* tile_offsets, int rows_per_cta,
                               bool decode_rows_elsewhere) {
  using Scan = cub::BlockScan<int32_t, kScheduleThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int32_t carry;
  const AttentionShape& s = a.shape;
  const int G = int(s.group());
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < s.batch; base += kScheduleThreads) {
    const int64_t b = base + threadIdx.x;
    int32_t tiles = 0;
    if (b < s.batch) {
      const int32_t q0 = a.query_start[b], q1 = a.query_start[b + 1], len = a.seq_lens[b];
      uint32_t bits = 0;
      if (q0 < 0 || q1 < q0 || q1 > s.num_queries || q1 - q0 > len) bits |= kBadQueryStart;
      const int64_t lo = a.window > 0 ? max(int64_t(0), int64_t(len) - (q1 - q0) + 1 - a.window) : 0;
      if (len < 0 || !RowFitsTable(lo, len, a)) bits |= kBadSeqLen;
      if (bits) RaiseError(a.error_word, bits);
      else if (!(decode_rows_elsewhere && IsRaggedDecodeRow(a, b)))
        tiles = int32_t((int64_t(q1 - q0) * G + rows_per_cta - 1) / rows_per_cta);
    }
    int32_t excl, total;
    Scan(temp).ExclusiveSum(tiles, excl, total);
    if (b < s.batch) tile_offsets[b] = carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    tile_offsets[s.batch] = carry;
    tile_offsets[s.batch + 1] = 0;  // the work counter
  }
}

// Zeroes rows outside [query_start[0], query_start[B]) (NaN if query_start itself is invalid).
// CTAs take the padding rows in turn: a CTA per row of q (most of them real rows, with nothing
// to do) cost 12 us at T = 16384 on the H200, 2% of a B8 S2048 prefill.
template <typename T>
__global__ void FillPaddingKernel(AttentionArgs a) {
  const AttentionShape& s = a.shape;
  const int64_t first = a.query_start[0], last = a.query_start[s.batch];
  const bool broken = first < 0 || last > s.num_queries || first > last;
  if (broken && blockIdx.x == 0 && threadIdx.x == 0) RaiseError(a.error_word, kBadQueryStart);
  // Padding rows: [0, first) then [last, T); all T rows when broken.
  const int64_t head = broken ? s.num_queries : first;
  const int64_t count = broken ? s.num_queries : first + (s.num_queries - last);
  const T v = DTypeTraits<T>::from_float(broken ? NAN : 0.f);
  const int64_t row_elems = s.num_heads * s.cache.head_dim;
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    const int64_t row = i < head ? i : last + (i - head);
    T* out = static_cast<T*>(a.out) + row * row_elems;
    for (int64_t j = threadIdx.x; j < row_elems; j += blockDim.x) out[j] = v;
  }
}

// T: query / output dtype; kFp8: float8_e4m3fn caches (MMAs in f16), else caches of T.
template <typename T, int D, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32) RaggedPrefillKernel(const PrefillParams p) {
  using M = std::conditional_t<kFp8, __half, T>;  // MMA operand type
  constexpr int kChunks = D / 8;
  constexpr int kLoadChunks = kFp8 ? D / 16 : D / 8;  // 16-byte chunks per cached row
  constexpr int kTileBytes = KvTile<D>() * D * (kFp8 ? 1 : 2);
  constexpr int kMt = MTiles<D>();
  constexpr int kRows = RowsPerCta<D>();
  constexpr int kKv = KvTile<D>();
  constexpr int kStages = Stages<D>();
  constexpr int kTileElems = kKv * D;
  constexpr int kNt = kKv / 8;  // logit n-tiles per K/V tile
  const AttentionArgs& a = p.a;
  const AttentionShape& s = a.shape;
  const int kvh = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int G = int(s.group());
  const int P = int(s.cache.page_size);

  int b, tile;
  if (!FindPrefillTile(p, int(blockIdx.x), b, tile)) return;
  const int q_begin = a.query_start[b];
  const int nq = a.query_start[b + 1] - q_begin;
  const int len = a.seq_lens[b];
  const int num_rows = nq * G;
  const int row0 = tile * kRows;
  const int pos0 = len - nq;  // position of the sequence's first query token

  // 128-byte aligned: the base otherwise follows the static variables at 16 mod 32, and then
  // every cp.async destination straddles 32-byte units, which doubles the L2 sectors of the
  // gathers (measured on the decode kernel, which had the same defect; see paged_decode.cu).
  extern __shared__ __align__(128) uint4 smem_raw[];
  M* qs = reinterpret_cast<M*>(smem_raw);  // [kRows][D], swizzled (arrives as T)
  char* kv = reinterpret_cast<char*>(qs + kRows * D);  // kStages x {K, V} [kKv][D] as they arrive
  M* conv = reinterpret_cast<M*>(kv + kStages * 2 * kTileBytes);  // fp8: converted {K, V}
  __shared__ int cta_bad;
  __shared__ uint32_t bad_keys[2][(kKv + 31) / 32];  // by tile parity: SanitizeTileRows flags
  if (threadIdx.x == 0) {
    cta_bad = 0;
    for (int i = 0; i < (kKv + 31) / 32; ++i) bad_keys[0][i] = bad_keys[1][i] = 0u;
  }

  int li = *a.layer;
  uint32_t bits = 0;
  if (li < 0 || li >= s.cache.num_layers) { bits |= kBadLayer; li = 0; }
  float v_scale;
  const LogitTransform logit = ScaledLogit<kFp8>(p.logit, a, li, kvh, v_scale);

  // Q rows -> shared memory (zero-filled past num_rows): row r = (token r / G, head r % G).
  for (int i = threadIdx.x; i < kRows * kChunks; i += kWarps * 32) {
    const int r = i / kChunks, ch = i % kChunks;
    const int row = row0 + r;
    const bool valid = row < num_rows;
    const T* src = static_cast<const T*>(a.q) +
                   (valid ? ((int64_t(q_begin) + row / G) * s.num_heads + int64_t(kvh) * G + row % G) * D + ch * 8
                          : 0);
    CpAsync16(SmemAddr(qs + SwizzledOffset<kChunks>(r, ch)), src, valid);
  }
  CpAsyncCommit();

  // Fragment rows of this lane: m-tile mt covers CTA rows [mt * 64 + warp * 16, +16).
  const int r0 = lane / 4, c0 = (lane % 4) * 2;
  int qpos[kMt][2];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mt * 16 * kWarps + warp * 16 + r0 + 8 * h;
      qpos[mt][h] = pos0 + min(row, num_rows - 1) / G;
    }

  // K/V range of the whole CTA: [key_lo, key_hi).
  const int last_row = min(row0 + kRows, num_rows) - 1;
  const int q_first = pos0 + row0 / G, q_last = pos0 + last_row / G;
  const int key_lo = a.window > 0 ? max(0, q_first - a.window + 1) : 0;
  const int key_hi = q_last + 1;
  const int t_lo = key_lo / kKv, t_hi = (key_hi + kKv - 1) / kKv;

  constexpr int kElemBytes = kFp8 ? 1 : 2;
  const int64_t layer_off = (int64_t(li) * s.cache.layer_stride + int64_t(kvh) * D) * kElemBytes;
  const char* kbase = static_cast<const char*>(a.k_cache) + layer_off;
  const char* vbase = static_cast<const char*>(a.v_cache) + layer_off;
  const int32_t* pages = a.page_table + int64_t(b) * s.max_pages;
  const int64_t token_bytes = s.cache.token_stride() * kElemBytes;

  auto load_tile = [&](int t, int stage) {
    char* ks = kv + stage * 2 * kTileBytes;
    char* vs = ks + kTileBytes;
#pragma unroll
    for (int i = threadIdx.x; i < kKv * kLoadChunks; i += kWarps * 32) {
      const int row = i / kLoadChunks, ch = i % kLoadChunks;
      const int pos = t * kKv + row;
      bool valid = pos >= key_lo && pos < key_hi;
      int64_t off = 0;
      if (valid) {
        const int page = pages[TableEntry(pos >> p.page_shift, int(s.max_pages), a.ring)];
        if (page < 0 || page >= s.cache.num_pages) {
          bits |= kBadPage;
          valid = false;
        } else {
          off = (int64_t(page) * p.page_rows + (pos & (P - 1))) * token_bytes + ch * 16;
        }
      }
      // fp8 tiles arrive unswizzled (converted below); 16-bit tiles swizzled for ldmatrix.
      const int so = kFp8 ? i * 16 : SwizzledOffset<kChunks>(row, ch) * 2;
      CpAsync16(SmemAddr(ks + so), kbase + off, valid);
      CpAsync16(SmemAddr(vs + so), vbase + off, valid);
    }
  };
  float o[kMt][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
  float m[kMt][2], l[kMt][2];
  bool row_nan[kMt][2];  // the row read a key whose V held a non-finite value (zeroed in smem)
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
    m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;
    row_nan[mt][0] = row_nan[mt][1] = false;
  }
  // This warp's query band: keys beyond warp_q_hi or at/below warp_q_lo - W are masked.
  const int warp_q_lo = pos0 + min(row0 + warp * 16, num_rows - 1) / G;
  const int warp_q_hi = pos0 + min(row0 + (kMt - 1) * 16 * kWarps + warp * 16 + 15, num_rows - 1) / G;

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (t_lo + st < t_hi) load_tile(t_lo + st, st);
    CpAsyncCommit();
  }
  for (int t = t_lo; t < t_hi; ++t) {
    const int it = t - t_lo;
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    // Flags of tile parity it + 1 were last read in iteration it - 1 (before the barrier above).
    if (threadIdx.x == 0)
      for (int i = 0; i < (kKv + 31) / 32; ++i) bad_keys[(it + 1) & 1][i] = 0u;
    const M* ks;
    if constexpr (kFp8) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        if (it == 0) {  // Q has landed (its group precedes the first tile's): bf16 -> f16
          for (int i = threadIdx.x; i < kRows * kChunks; i += kWarps * 32) {
            uint4* chunk = reinterpret_cast<uint4*>(qs) + i;
            *chunk = Bf16ChunkToHalf(*chunk);
          }
        }
      }
      if constexpr (kFp8)  // the CTA's arrived tile -> f16 in conv
        ConvertFp8Tiles<kKv, D>(kv + (it % kStages) * 2 * kTileBytes, conv, threadIdx.x,
                                kWarps * 32);
      __syncthreads();
      ks = conv;
    } else {
      ks = reinterpret_cast<const M*>(kv + (it % kStages) * 2 * kTileBytes);
    }
    const M* vs = ks + kTileElems;
    if (t + kStages - 1 < t_hi) load_tile(t + kStages - 1, (it + kStages - 1) % kStages);
    CpAsyncCommit();

    const int key0 = t * kKv;
    // Keys of this tile that some row of the CTA does not read (CTA-uniform).
    const bool partial_tile =
        key0 + kKv - 1 > q_first || (a.window > 0 && key0 <= q_last - a.window);
    uint32_t flagged[(kKv + 31) / 32] = {};
    bool any_flagged = false;
    if (partial_tile) {
      SanitizeTileRows<M, kKv, D>(const_cast<M*>(vs), bad_keys[it & 1], threadIdx.x, kWarps * 32);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < (kKv + 31) / 32; ++i) {
        flagged[i] = bad_keys[it & 1][i];
        any_flagged |= flagged[i] != 0u;
      }
    }
    // Skip tiles entirely outside this warp's causal / window band.
    if (key0 > warp_q_hi || (a.window > 0 && key0 + kKv - 1 <= warp_q_lo - a.window)) continue;
    float sc[kMt][kNt][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) sc[mt][nt][0] = sc[mt][nt][1] = sc[mt][nt][2] = sc[mt][nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[kMt][4];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        const int row = mt * 16 * kWarps + warp * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        LdMatrixX4(qa[mt], SmemAddr(qs + SwizzledOffset<kChunks>(row, 2 * kk + (lane >> 4))));
      }
#pragma unroll
      for (int nt = 0; nt < kNt; nt += 2) {
        uint32_t r[4];
        const int row = nt * 8 + (lane & 7) + ((lane >> 4) << 3);
        LdMatrixX4(r, SmemAddr(ks + SwizzledOffset<kChunks>(row, 2 * kk + ((lane >> 3) & 1))));
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          Mma<M>::mma(sc[mt][nt], qa[mt], r[0], r[1]);
          Mma<M>::mma(sc[mt][nt + 1], qa[mt], r[2], r[3]);
        }
      }
    }
    const bool needs_mask =
        key0 + kKv - 1 > warp_q_lo || (a.window > 0 && key0 <= warp_q_hi - a.window);
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float x = logit(sc[mt][nt][j]);
          const int kt = nt * 8 + c0 + (j & 1);  // key within the tile
          bool masked = false;
          if (needs_mask) {
            const int key = key0 + kt;
            const int qp = qpos[mt][j >> 1];
            masked = key > qp || (a.window > 0 && key <= qp - a.window);
            if (masked) x = -INFINITY;
          }
          if (any_flagged && !masked && ((flagged[kt / 32] >> (kt % 32)) & 1u))
            row_nan[mt][j >> 1] = true;
          sc[mt][nt][j] = x;
        }
      OnlineSoftmax<kNt, D / 8>(sc[mt], o[mt], m[mt], l[mt]);
    }
#pragma unroll
    for (int ks16 = 0; ks16 < kKv / 16; ++ks16) {
      uint32_t pa[kMt][4];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        pa[mt][0] = Mma<M>::pack(sc[mt][2 * ks16][0], sc[mt][2 * ks16][1]);
        pa[mt][1] = Mma<M>::pack(sc[mt][2 * ks16][2], sc[mt][2 * ks16][3]);
        pa[mt][2] = Mma<M>::pack(sc[mt][2 * ks16 + 1][0], sc[mt][2 * ks16 + 1][1]);
        pa[mt][3] = Mma<M>::pack(sc[mt][2 * ks16 + 1][2], sc[mt][2 * ks16 + 1][3]);
      }
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        uint32_t r[4];
        const int row = ks16 * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        LdMatrixX4Trans(r, SmemAddr(vs + SwizzledOffset<kChunks>(row, n + (lane >> 4))));
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          Mma<M>::mma(o[mt][n], pa[mt], r[0], r[1]);
          Mma<M>::mma(o[mt][n + 1], pa[mt], r[2], r[3]);
        }
      }
    }
  }
  CpAsyncWait<0>();
  if (bits) {
    atomicOr(&cta_bad, 1);
    RaiseError(a.error_word, bits);
  }
  __syncthreads();
  const bool bad = cta_bad != 0;
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float lh = l[mt][h];
      lh += __shfl_xor_sync(0xffffffffu, lh, 1);
      lh += __shfl_xor_sync(0xffffffffu, lh, 2);
      int nan_row = row_nan[mt][h];
      nan_row |= __shfl_xor_sync(0xffffffffu, nan_row, 1);
      nan_row |= __shfl_xor_sync(0xffffffffu, nan_row, 2);
      const int row = row0 + mt * 16 * kWarps + warp * 16 + r0 + 8 * h;
      if (row >= num_rows) continue;
      // lh is 0 only with nothing attended; NaN (a NaN logit) stays NaN.
      const float inv = (bad || nan_row) ? NAN : (lh == 0.f ? 0.f : v_scale / lh);
      T* out = static_cast<T*>(a.out) +
               ((int64_t(q_begin) + row / G) * s.num_heads + int64_t(kvh) * G + row % G) * D;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<uint32_t*>(out + n * 8 + c0) =
            Mma<T>::pack(o[mt][n][2 * h] * inv, o[mt][n][2 * h + 1] * inv);
    }
}

template <typename T, int D, bool kFp8>
ffi::Error Launch(cudaStream_t stream, const AttentionArgs& a) {
  const AttentionShape& s = a.shape;
  constexpr int smem = SmemBytes<D, kFp8>();
  static bool configured = false;  // NOTE: per-template, set on the first launch
  if (!configured) {
    if (cudaFuncSetAttribute(RaggedPrefillKernel<T, D, kFp8>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
      return LaunchError("ragged_paged_attention: cudaFuncSetAttribute");
    configured = true;
  }
  // The decode kernel takes this call's single-query sequences (see the header comment); its
  // split partials sit in the workspace after the tile offsets and the sm90 kernel's work
  // counter. It is launched first: growing the workspace may reallocate it.
  const size_t offsets_bytes = (size_t(s.batch + 2) * sizeof(int32_t) + 255) / 256 * 256;
  const bool decode_rows_elsewhere = PagedDecodeSupports(a);
  if (decode_rows_elsewhere)
    if (auto err = LaunchPagedDecode(stream, a, offsets_bytes); err.failure()) return err;
  void* offsets = Workspace(stream, offsets_bytes);
  if (offsets == nullptr)
    return ffi::Error::Internal("ragged_paged_attention: workspace allocation failed");
  PrefillParams p;
  p.a = a;
  p.logit = LogitTransform::Make(a.scale, a.soft_cap);
  p.page_shift = __builtin_ctzll(uint64_t(s.cache.page_size));
  p.page_rows = int(s.cache.page_rows());
  p.tile_offsets = static_cast<const int32_t*>(offsets);
  p.work_counter = static_cast<int32_t*>(offsets) + s.batch + 1;

  const int64_t fill_ctas = std::max<int64_t>(1, std::min<int64_t>(s.num_queries, 2 * NumSMs()));
  FillPaddingKernel<T><<<unsigned(fill_ctas), 128, 0, stream>>>(a);
  constexpr int kRows = RowsPerCta<D>();
  ScheduleKernel<<<1, kScheduleThreads, 0, stream>>>(a, static_cast<int32_t*>(offsets), kRows,
                                                     decode_rows_elsewhere);
  if (auto err = LaunchError("ragged_paged_attention (schedule)"); err.failure()) return err;
  // Upper bound on the number of tiles: sum_b ceil(n_b G / kRows) <= T G / kRows + B.
  const int64_t max_tiles = (s.num_queries * s.group() + kRows - 1) / kRows + s.batch;
  if constexpr (D == 64 || D == 128) {
    static_assert(RowsPerCta<D>() == kSm90RowsPerCta, "one schedule for both kernels");
    if (RaggedPrefillSm90Supports(a)) return LaunchRaggedPrefillSm90(stream, p, max_tiles);
  }
  dim3 grid(unsigned(max_tiles), unsigned(s.cache.num_kv_heads));
  RaggedPrefillKernel<T, D, kFp8><<<grid, kWarps * 32, smem, stream>>>(p);
  return LaunchError("ragged_paged_attention (prefill kernel)");
}

}  // namespace

bool RaggedPrefillSupports(const AttentionArgs& a) {
  const AttentionShape& s = a.shape;
  const int64_t D = s.cache.head_dim, P = s.cache.page_size;
  const bool half_q = s.q_dtype == DType::kBF16 || s.q_dtype == DType::kF16;
  return half_q && (s.cache.dtype == s.q_dtype || s.fp8()) &&
         (D == 64 || D == 128 || D == 256) && P > 0 && (P & (P - 1)) == 0 &&
         s.cache.num_kv_heads <= 65535 && s.num_queries * s.group() < (int64_t(1) << 30) &&
         s.cache.page_rows() < (int64_t(1) << 31);
}

ffi::Error LaunchRaggedPrefill(cudaStream_t stream, const AttentionArgs& a) {
  return DispatchHalfDtypeAndHeadDim(a, "ragged_paged_attention", [&](auto t, auto d) {
    if (a.shape.fp8()) return Launch<decltype(t), decltype(d)::value, true>(stream, a);
    return Launch<decltype(t), decltype(d)::value, false>(stream, a);
  });
}

}  // namespace kvcm::cuda
