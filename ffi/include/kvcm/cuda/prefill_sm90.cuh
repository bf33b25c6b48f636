// The sm90 (wgmma) ragged prefill kernel's layout constants and device helpers, and the
// declaration of its two roles (Sm90Roles). Framework-free (CUDA and kvcm's own headers); the
// kernel, its protocol and its launch are in ffi/cuda/ragged_prefill_sm90.cu.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcm/cuda/attention.cuh"
#include "kvcm/cuda/mbarrier.cuh"
#include "kvcm/cuda/mma.cuh"
#include "kvcm/cuda/wgmma_ops.cuh"

namespace kvcm::cuda::sm90 {

constexpr int kConsumers = 2;                     // consumer warpgroups, 64 rows each
constexpr int kThreads = 128 * (1 + kConsumers);  // + the producer warpgroup
constexpr int kRows = 64 * kConsumers;
// Keys per K/V tile: m64n128k16 S GEMMs, 3 stages at head_dim 128. Measured on the H200
// (2026-12-02, B8 S2048 / B1 S16384 causal): 235 / 322 TFLOP/s with 64-key tiles and no overlap,
// 301 / 412 with 128-key tiles, 356 / 495 with the lean producer, 388 / 504 persistent.
constexpr int kKeys = 128;
// setmaxnreg budgets: the launch gets 168 registers per thread (65536 / 384, rounded down to a
// multiple of 8), and the CTA's pool is what it was launched with: the producer gives back
// 168 - kProducerRegs per thread, the consumers take kConsumerRegs - 168 each from that, so
// kProducerRegs + 2 * kConsumerRegs <= 3 * 168 (else setmaxnreg.inc waits forever).
constexpr int kLaunchRegs = 168;
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;  // ptxas needs ~208 (zero spills)
static_assert(kProducerRegs + kConsumers * kConsumerRegs <= (1 + kConsumers) * kLaunchRegs,
              "setmaxnreg budgets exceed the CTA's registers");

template <int D> constexpr int TileBytes() { return kKeys * D * 2; }
// Ring depth: as many K/V stages as fit next to Q (at most 8), with 2 KiB for the static part and
// the 1 KiB alignment slack: 3 at head_dim 128, 6 at head_dim 64.
template <int D> constexpr int Stages() {
  const int n = (227 * 1024 - 2048 - kRows * D * 2) / (2 * TileBytes<D>());
  return n < 8 ? n : 8;
}
// + 1 KiB to align the base to the 128-byte swizzle's 1 KiB period.
template <int D> constexpr int Sm90SmemBytes() {
  return 1024 + kRows * D * 2 + Stages<D>() * 2 * TileBytes<D>();
}
static_assert(Stages<128>() == 3 && Stages<64>() == 6);
static_assert(Stages<128>() >= 3 && Stages<64>() >= 3,
              "the fp8 producer arrives on a turn's halves behind the next turn's empty waits");

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of `rows` rows of D 16-bit values,
// stored as D / 64 column blocks of [rows][128 bytes] with the 128-byte swizzle (chunk ^ row % 8).
__device__ __forceinline__ int Swizzle128(int rows, int row, int chunk) {
  return (chunk / 8) * rows * 128 + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t SmemDesc(const void* p, uint32_t lead_bytes,
                                             uint32_t stride_bytes) {
  return uint64_t((SmemAddr(p) & 0x3FFFF) >> 4) | (uint64_t(lead_bytes >> 4) << 16) |
         (uint64_t(stride_bytes >> 4) << 32) | (uint64_t(1) << 62);
}

// A descriptor split in its 32-bit halves: lo (start address >> 4 in bits 0-13, leading byte
// offset >> 4 in 16-29) and hi (stride >> 4, the swizzle mode), so that the descriptor of an
// operand `units` x 16 bytes further is one 32-bit add to lo (the address field cannot carry:
// shared memory ends below 2^18 bytes). Built once per operand base; SmemDesc per wgmma cost
// five uniform instructions each (nvdisasm), ~80 per tile and consumer thread.
struct SmemDescHalves {
  uint32_t lo, hi;
  __device__ __forceinline__ uint64_t at(uint32_t units) const {
    return (uint64_t(hi) << 32) | (lo + units);
  }
};
__device__ __forceinline__ SmemDescHalves MakeSmemDesc(const void* p, uint32_t lead_bytes,
                                                       uint32_t stride_bytes) {
  const uint64_t d = SmemDesc(p, lead_bytes, stride_bytes);
  return {uint32_t(d), uint32_t(d >> 32)};
}

// Generic-proxy shared-memory writes (cp.async, st.shared) -> visible to wgmma's async proxy.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N of this warpgroup's committed wgmma groups are still in flight (groups
// complete in commit order).
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void SetMaxRegs() {
  if constexpr (N < 168) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
  }
}
// Pins registers at this point of the program: the compiler sees them read and written here, so
// no access to them moves across an asynchronous wgmma's issue (wgmma.fence) or completion
// (wgmma.wait_group), and registers a wgmma still reads stay live until its wait.
// R: float (accumulators) or uint32_t (packed operand fragments).
template <typename R, int N>
__device__ __forceinline__ void FenceRegisters(R (&d)[N][4]) {
  static_assert(std::is_same_v<R, float> || std::is_same_v<R, uint32_t>);
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (std::is_same_v<R, float>) asm volatile("" : "+f"(d[i][j])::"memory");
      else asm volatile("" : "+r"(d[i][j])::"memory");
    }
}

__device__ __forceinline__ void FenceScalars(float& a, float& b, float& c, float& d) {
  asm volatile("" : "+f"(a), "+f"(b), "+f"(c), "+f"(d)::"memory");
}

// FindPrefillTile (attention.cuh), searched 32 ways per step (lane i probes entry
// lo + (hi - lo) (i + 1) / 32 of the non-decreasing tile_offsets, and a ballot splits the span),
// so that up to 32 sequences cost one round trip of dependent loads instead of log2(batch) + 1 of
// the binary search (1024: two). Same result: b is the largest index with tile_offsets[b] <= cta
// (tile_offsets[0] = 0), tile counts down from the sequence's last tile. Every lane of the warp
// must call it.
__device__ __forceinline__ bool FindPrefillTileWarp(const PrefillParams& p, int cta, int& b,
                                                    int& tile) {
  const int lane = threadIdx.x % 32;
  int lo = 0, hi = int(p.a.shape.batch);  // the answer is in [lo, hi)
  int vhi = 0;                             // tile_offsets[hi], once a step has loaded it
  bool first = true;  // the first step also checks cta < tile_offsets[batch] (lane 31)
  while (first || hi - lo > 1) {
    first = false;
    const int idx = lo + int(int64_t(hi - lo) * (lane + 1) / 32);  // lane 31: hi
    const int v = p.tile_offsets[idx];
    const int t = __popc(__ballot_sync(0xffffffffu, v <= cta));  // lanes 0 .. t - 1
    if (t == 32) return false;  // cta >= tile_offsets[batch]: past the last tile
    const int new_lo = __shfl_sync(0xffffffffu, idx, max(t - 1, 0));
    hi = __shfl_sync(0xffffffffu, idx, t);
    vhi = __shfl_sync(0xffffffffu, v, t);
    if (t > 0) lo = new_lo;
  }
  b = lo;
  tile = vhi - 1 - cta;  // (tile_offsets[b + 1] - tile_offsets[b]) - 1 - (cta - tile_offsets[b])
  return true;
}

// Whether some query in [q_lo, q_hi] does not read every key of the tile from key0 (causal: a
// key after the first query; window: a key at or before the last query's window start), so the
// tile needs the mask and the producer's non-finite V scan.
__device__ __forceinline__ bool PartlyRead(int key0, int q_lo, int q_hi, int window) {
  return key0 + kKeys - 1 > q_lo || (window > 0 && key0 <= q_hi - window);
}

// A work tile's rows and key range, from its row tile and its sequence's query count and length:
// the producer and the consumers compute it alike (the ring position of every key tile depends
// on num_tiles).
struct WorkRange {
  int num_rows, row0, pos0, q_first, q_last, key_lo, key_hi, t_lo, num_tiles;
};
__device__ __forceinline__ WorkRange MakeWorkRange(int tile, int nq, int len, int G, int window) {
  WorkRange r;
  r.num_rows = nq * G;
  r.row0 = tile * kRows;
  r.pos0 = len - nq;
  const int last_row = min(r.row0 + kRows, r.num_rows) - 1;
  r.q_first = r.pos0 + r.row0 / G;
  r.q_last = r.pos0 + last_row / G;
  r.key_lo = window > 0 ? max(0, r.q_first - window + 1) : 0;
  r.key_hi = r.q_last + 1;
  r.t_lo = r.key_lo / kKeys;
  r.num_tiles = (r.key_hi + kKeys - 1) / kKeys - r.t_lo;
  return r;
}

// fp8 caches: where the producer stages the raw float8_e4m3fn bytes of row `row` of a K/V tile
// (D bytes) before converting them in place: within the row's own 128-byte lines of the 16-bit
// tile, so that converting a row overwrites only that row's raw bytes (those of no other row).
// At D 128 the row's line in column block 1; at D 64 one half of its line, by row parity. Raw
// chunk `chunk` (16 bytes) is placed so that the 8 lanes of a 16-byte access phase (2 rows of 4
// lanes at D 128, 4 rows of 2 at D 64, adjacent chunks) hit distinct banks.
template <int D>
__device__ __forceinline__ int RawFp8Offset(int row, int chunk) {
  static_assert(D == 64 || D == 128);
  if constexpr (D == 128) return kKeys * 128 + row * 128 + ((chunk ^ ((row & 1) << 2)) << 4);
  return row * 128 + ((row & 1) << 6) + ((chunk ^ (row & 2)) << 4);
}

// Whether a 16-byte chunk of float8_e4m3fn values holds a NaN (0x7f / 0xff: e4m3fn's only
// non-finite values), per byte: (x & 0x7f) + 1 carries into bit 7 only for 0x7f.
__device__ __forceinline__ bool HasNanE4m3(const uint4 c) {
  uint32_t any = 0u;
  for (const uint32_t x : {c.x, c.y, c.z, c.w})
    any |= ((x & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
  return any != 0u;
}

// The kernel's compile-time layout and its two roles, each run by its warpgroups
// (prefill_sm90_producer.cuh, prefill_sm90_consumer.cuh). T: query / output dtype; kFp8:
// float8_e4m3fn caches, whose tiles the producer converts to f16 (exact) in the ring, and bf16
// queries to f16 (as the FlashAttention-2 kernel's fp8 path: its MMAs run in f16), so that the
// consumers run in M = f16; else caches of T and M = T.
template <typename T, int D, bool kFp8>
struct Sm90Roles {
  using M = std::conditional_t<kFp8, __half, T>;  // wgmma operand type
  // bf16 queries over an fp8 cache: Q is converted to f16 in place by the producer.
  static constexpr bool kQToHalf = kFp8 && std::is_same_v<T, __nv_bfloat16>;
  static constexpr int kElemBytes = kFp8 ? 1 : 2;  // of the cache
  static constexpr int kStages = Stages<D>();
  static constexpr int kFlagWords = kKeys / 32;
  static constexpr int kChunks = D / 8;                // 16-byte chunks per row
  // A producer thread copies kRowChunks chunks of each of its rows (chunk t + kRowThreads j of
  // row row_base + kRowsPerPass i, t = its index among the row's kRowThreads threads), so that a
  // row's address work (page, bounds, 64-bit offset, swizzle) is paid once per kRowChunks
  // cp.asyncs, and the kRowThreads lanes of a row read adjacent chunks in each instruction
  // (whole 32-byte sectors). With one chunk per thread and row, the producer spent ~30
  // instructions per cp.async (nvdisasm), about as many per tile as the consumers.
  static constexpr int kRowChunks = 4;
  static constexpr int kRowThreads = kChunks / kRowChunks;  // threads per row: 4 at D 128, 2 at 64
  static constexpr int kRowsPerPass = 128 / kRowThreads;    // producer rows per pass over a tile
  static constexpr int kRowsPerThread = kKeys / kRowsPerPass;
  // 16-byte chunks of the cache a producer thread copies per K/V row: fp8 rows are D bytes, so
  // half as many (raw chunks ch0 + kRowThreads j of D / 16, each two chunks of the f16 row).
  static constexpr int kCopyChunks = kFp8 ? kRowChunks / 2 : kRowChunks;
  static constexpr int kTileBytes = TileBytes<D>();
  static constexpr int kKvBlock = kKeys * 128;         // one 64-column block of a K/V tile
  static constexpr int kQBlock = kRows * 128;
  static_assert(kRowThreads >= 1 && kRowsPerThread >= 1 && kRowsPerPass % 32 == 0 &&
                    kRows % kRowsPerPass == 0,
                "a producer thread's rows: row_base + kRowsPerPass i");

  // The CTA's shared memory, declared by the kernel (see there for each buffer's protocol), and
  // the call's scalars both roles use.
  struct Shared {
    uint8_t* qs;    // [D / 64][kRows][128 B]
    uint8_t* ring;  // kStages x {K, V} [D / 64][kKeys][128 B]
    uint64_t (&kfull_bar)[kStages];
    uint64_t (&vfull_bar)[kStages];
    uint64_t (&kempty_bar)[kStages];
    uint64_t (&vempty_bar)[kStages];
    uint64_t& qfull_bar;
    uint64_t& qempty_bar;
    uint32_t (&bad_keys)[kStages][4][kFlagWords];
    uint32_t (&stage_bad)[kStages][4];
    int (&work_info)[8];
    int (&claimed)[2];
    int G, P, H;  // query heads per kv head, page size, kv heads (computed once by the kernel)
  };

  // Warpgroup 0 (wt: thread within it): finds, claims and loads the work tiles. li: *a.layer.
  static __device__ __forceinline__ void Producer(const PrefillParams& p, const Shared& sh, int li,
                                                  int wt, int warp, int lane);
  // Warpgroups 1 and 2 (wg): the GEMMs, the softmax and the output of their 64 rows.
  static __device__ __forceinline__ void Consumer(const PrefillParams& p, const Shared& sh, int wg,
                                                  int warp, int lane);
};

}  // namespace kvcm::cuda::sm90
