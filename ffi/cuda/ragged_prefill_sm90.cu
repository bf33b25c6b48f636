// Ragged (prefill / mixed) paged attention on Hopper's warpgroup MMA (wgmma), warp-specialized.
//
// Same contract and rows as the FlashAttention-2 style kernel in ragged_prefill.cu: a work tile
// is 128 rows = (token, head) pairs of one sequence and one kv head; the schedule kernel there
// numbers the row tiles in tile_offsets (by sequence, a sequence's last = heaviest causal tile
// first) and zeroes this kernel's work counter. For bf16/f16 queries over caches of the same
// dtype or float8_e4m3fn caches (below), at head_dim 64 and 128 on sm_90a.
// Persistent, dynamically scheduled: the launch has min(work tile bound, SMs) CTAs (1 CTA/SM);
// work tile w is row tile w / kv_heads of kv head w % kv_heads (consecutive work tiles are the
// kv heads of one row tile: the same page-table entries, Q tokens and key range, and together
// whole token rows of the cache pages). CTA c starts with w = c and claims each further one with
// an atomicAdd on the work counter (w = gridDim.x + old value), one work tile ahead (the
// producer's thread 0 claims work tile k + 1 when it starts k), until a claim is past
// tile_offsets[batch]. A CTA has three warpgroups; setmaxnreg moves registers from the producer
// (kProducerRegs) to the consumers (kConsumerRegs):
// - the producer (warps 0-3) finds each work tile (FindPrefillTileWarp), loads its Q (cp.async,
//   into the one Q buffer once both consumers freed it: Q full / empty mbarriers, the full one
//   also publishing the work tile in work_info, or kv head -1 when there is no more work) and
//   streams its 128-key K/V tiles (kKeys) through a kStages-deep shared-memory ring (3 stages at
//   head_dim 128, 6 at 64) with cp.async; the ring position runs on across work tiles, so the
//   producer loads the next work tile's first K tile and Q while the consumers finish the
//   current one (its last GEMMs, normalization and store). Rows are gathered through the page
//   table, whose entries for a tile each lane of a producer warp loads one tile ahead and hands
//   to the rows by shuffle; each producer thread copies kRowChunks adjacent 16-byte chunks of
//   its rows, into the 128-byte swizzled layout that wgmma reads. The K and V halves of a stage
//   have their own "full" and "empty" mbarriers; the producer issues K of tile j, then V of tile
//   j - 1 (V is used a turn after K), each once its half is empty, and each thread's copies
//   arrive on the half's full barrier when they land (cp.async.mbarrier.arrive), so the producer
//   never waits for data. Exceptions: for a tile that some row of the work tile reads only in
//   part, each producer thread waits for its own V copies, zeroes those of its chunks that hold
//   NaN/inf in keys that some but not all rows read (the keys after the last row are zero-filled
//   copies), its warp flags their keys (bad_keys), then it arrives; the work tile's last V half
//   likewise carries whether its layer or any of its page ids was bad (stage_bad: the whole work
//   tile then outputs NaN; the producer raises the error bits);
// - two consumers (64 rows each) wait for Q, read work_info, compute S = Q K^T with wgmma
//   m64n128k16 from shared memory (Q stays there, K-major), mask and soft-max S in registers
//   (the accumulator layout is the mma.sync one per 8 columns), and O += P V with P from
//   registers and V read MN-major. Within a warpgroup, the S GEMM of tile j is issued together
//   with the P V GEMM of tile j - 1 and waited for alone (wgmma.wait_group 1), which frees tile
//   j's K half; the soft-max of tile j (and the wait for tile j + 1's K) runs while the tensor
//   cores do P V of tile j - 1; then wait_group 0, the rescale of O (only in warps where a row's
//   max moved), P of tile j, and tile j - 1's V half is freed. After its last S GEMM of a work
//   tile a warpgroup frees Q. Across the two warpgroups, the GEMM issues take turns (named
//   barriers 5 and 6, restarted per work tile), so one's soft-max also overlaps the other's
//   GEMMs. A warpgroup runs GEMMs only for the tiles in its rows' causal / window band [ta, tb);
//   for the others it only waits for the data, takes its turn and frees the halves. O, m, l and
//   the non-finite bookkeeping are per work tile.
// fp8 caches (kFp8): the same contract and arithmetic as the FlashAttention-2 kernel's fp8 path:
// the ring keeps 16-bit tiles and the consumers run in f16 (M), on K/V converted exactly from
// e4m3 and, for bf16 queries, Q converted to f16 (the producer, in place, after its copies
// landed, before its Q full arrival); ScaledLogit folds k_scale (per layer and kv head, layer 0
// for a bad layer) into the logit transform and v_scale scales the normalized output: producer
// thread 0 calls it and passes the transform's scales and v_scale on in work_info.
// The producer cp.asyncs a row's D raw bytes into the row's own 128-byte lines in the stage
// (RawFp8Offset), waits for its copies, and converts its rows in place (a row's lanes are one
// warp: __syncwarp between their reads of the raw bytes and their writes), then fence.proxy.async
// and a plain mbarrier arrive on the half's full barrier (the same 128 arrivals). The producer's
// loop turn j issues K of tile j and V of tile j - 1 (each after its empty wait) as one cp.async
// group, then waits for turn j - 1's group (wait_group 1) and converts and arrives on its halves,
// K first: the copies of a turn are in flight while the producer waits for the consumers to free
// the next halves, so in the steady state they have landed when it converts them. Turn j - 1's
// arrivals (K of tile j - 1, V of tile j - 2) so come after turn j's empty waits, which need the
// consumers to free K of tile j - kStages and V of tile j - 1 - kStages; before that they wait
// for K halves up to tile j + 1 - kStages and V halves up to j - kStages (their own and, through
// the turns, the other warpgroup's): all arrived already when kStages >= 3 (3 and 6 here; the
// simulator checks it, and finds the deadlock with 2 stages). The last turn's group is converted
// at the work tile's end (nothing is left across work tiles), and K of tile 0 is converted and
// arrives before Q. For V of a tile that some row reads only in part, raw chunks with a NaN
// (e4m3fn has no inf) in keys that some but not all rows read are zeroed before the conversion
// and their keys flagged, as above.
// Named barriers: 4 (the producer's 128 threads, once per work tile: the next claim), 5 and 6
// (the consumers' turns).
// tools/sim_sm90_prefill_protocol.py models this protocol (several CTAs claiming from one
// counter in random interleavings, random ring depths, work tiles, tile counts and bands; it
// reports deadlocks, phase aliasing, stale shared data, lost or repeated work tiles and dangling
// arrivals): change both.
// Non-finite rule: keys flagged by the producer make the rows that read them output NaN (a
// flagged key's V is zero, so rows that do not read it are unaffected); on the fast path (no
// soft cap) a row whose largest |q.k| is inf outputs NaN, and a NaN logit propagates through exp2.
#include <algorithm>
#include <type_traits>

#include "kvcm/cuda/attention.cuh"
#include "kvcm/cuda/mbarrier.cuh"
#include "kvcm/cuda/mma.cuh"
#include "kvcm/cuda/wgmma_ops.cuh"


namespace kvcm::cuda {
namespace {

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

// T: query / output dtype; kFp8: float8_e4m3fn caches, whose tiles the producer converts to f16
// (exact) in the ring, and bf16 queries to f16 (as the FlashAttention-2 kernel's fp8 path: its
// MMAs run in f16), so that the consumers run in M = f16; else caches of T and M = T.
template <typename T, int D, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) RaggedPrefillSm90Kernel(const PrefillParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using M = std::conditional_t<kFp8, __half, T>;  // wgmma operand type
  // bf16 queries over an fp8 cache: Q is converted to f16 in place by the producer.
  constexpr bool kQToHalf = kFp8 && std::is_same_v<T, __nv_bfloat16>;
  constexpr int kElemBytes = kFp8 ? 1 : 2;  // of the cache
  constexpr int kStages = Stages<D>();
  constexpr int kFlagWords = kKeys / 32;
  constexpr int kChunks = D / 8;                // 16-byte chunks per row
  // A producer thread copies kRowChunks chunks of each of its rows (chunk t + kRowThreads j of
  // row row_base + kRowsPerPass i, t = its index among the row's kRowThreads threads), so that a
  // row's address work (page, bounds, 64-bit offset, swizzle) is paid once per kRowChunks
  // cp.asyncs, and the kRowThreads lanes of a row read adjacent chunks in each instruction
  // (whole 32-byte sectors). With one chunk per thread and row, the producer spent ~30
  // instructions per cp.async (nvdisasm), about as many per tile as the consumers.
  constexpr int kRowChunks = 4;
  constexpr int kRowThreads = kChunks / kRowChunks;  // threads per row: 4 at D 128, 2 at 64
  constexpr int kRowsPerPass = 128 / kRowThreads;    // producer rows per pass over a tile
  constexpr int kRowsPerThread = kKeys / kRowsPerPass;
  // 16-byte chunks of the cache a producer thread copies per K/V row: fp8 rows are D bytes, so
  // half as many (raw chunks ch0 + kRowThreads j of D / 16, each two chunks of the f16 row).
  constexpr int kCopyChunks = kFp8 ? kRowChunks / 2 : kRowChunks;
  constexpr int kTileBytes = TileBytes<D>();
  constexpr int kKvBlock = kKeys * 128;         // one 64-column block of a K/V tile
  constexpr int kQBlock = kRows * 128;
  static_assert(kRowThreads >= 1 && kRowsPerThread >= 1 && kRowsPerPass % 32 == 0 &&
                    kRows % kRowsPerPass == 0,
                "a producer thread's rows: row_base + kRowsPerPass i");
  const AttentionArgs& a = p.a;
  const AttentionShape& s = a.shape;
  const int G = int(s.group());
  const int P = int(s.cache.page_size);
  const int H = int(s.cache.num_kv_heads);

  const int li = *a.layer;  // checked per work tile by the producer (no register held for it)

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~uintptr_t(1023));
  uint8_t* qs = smem;                       // [D / 64][kRows][128 B]
  uint8_t* ring = smem + kRows * D * 2;     // kStages x {K, V} [D / 64][kKeys][128 B]
  // Per stage, K and V halves each: full (the producer's 128 threads arrive) and empty (the
  // consumers' 256 threads arrive). The Q buffer: full (the producer's 128 threads on their
  // copies, + 1 by producer thread 0 after it wrote work_info) and empty (the consumers' 256
  // threads, after their last S GEMM of the work tile).
  __shared__ uint64_t kfull_bar[kStages], vfull_bar[kStages], kempty_bar[kStages],
      vempty_bar[kStages], qfull_bar, qempty_bar;
  __shared__ uint32_t bad_keys[kStages][4][kFlagWords];  // per producer warp, 32 keys a word
  // Per producer warp: a bad page id met in the work tile whose last key tile is in this stage
  // (written before that V half's full barrier, like bad_keys).
  __shared__ uint32_t stage_bad[kStages][4];
  // The work tile whose Q is in the buffer: kv head (-1: no more work), row tile, query_start,
  // query count and length of its sequence; for fp8 caches also ScaledLogit's scale_log2 and
  // scale_over_cap, and v_scale (float bits). Written with Q, read by the consumers before they
  // free Q.
  __shared__ int work_info[8];
  // The producer's next work tile, claimed by its thread 0 (double-buffered by work tile parity:
  // written before named barrier 4 at the end of work tile k, read after it).
  __shared__ int claimed[2];
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      MbarInit(&kfull_bar[i], 128);                 // every producer thread
      MbarInit(&vfull_bar[i], 128);
      MbarInit(&kempty_bar[i], 128 * kConsumers);   // every consumer thread
      MbarInit(&vempty_bar[i], 128 * kConsumers);
    }
    MbarInit(&qfull_bar, 128 + 1);
    MbarInit(&qempty_bar, 128 * kConsumers);
  }
  __syncthreads();

  // The warpgroup index broadcast from lane 0: ptxas then treats the role branches as
  // warp-uniform; otherwise it serializes every wgmma (C7518, "divergent path").
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
  const int wt = threadIdx.x % 128;         // thread within its warpgroup
  const int warp = wt / 32, lane = wt % 32;

  if (wg == 0) {
    // ---- producer ----
    SetMaxRegs<kProducerRegs>();
    const int64_t token_bytes = s.cache.token_stride() * kElemBytes;
    const int ch0 = wt % kRowThreads, row_base = wt / kRowThreads;
    const uint32_t ring_s = SmemAddr(ring);
    const int tile_pages = max(1, kKeys >> p.page_shift);
    const bool lane_pages = tile_pages <= 32;
    // Bytes from one page to the next (the layout's stride); < 2^31: RaggedPrefillSm90Supports.
    const int32_t page_bytes = int32_t(s.cache.page_stride * kElemBytes);
    int g = 0;  // key tiles this CTA streamed before the current work tile (the ring position)
    // Work tiles, dynamically scheduled: work tile w is row tile w / H (tile_offsets order: by
    // sequence, a sequence's heaviest causal tile first) of kv head w % H (consecutive claims
    // read the same pages and Q tokens, at other heads' offsets). CTA c starts with w = c; every
    // further one is claimed from the work counter (zeroed by the schedule kernel on the stream)
    // as gridDim.x + the counter's old value, by thread 0 one work tile ahead: at the start of
    // work tile k it claims k + 1 and stores it (claimed[k & 1]) only after k's search, page
    // lookups, first K tile and Q were issued, so the atomic's latency hides behind those; the
    // producer warps read it after named barrier 4 at k's end. Claims are increasing in the
    // counter, so the first claim past the last work tile ends the CTA (every later one would be
    // past it too).
    int w = int(blockIdx.x);
    for (int k = 0;; ++k) {
      int next_w = 0;
      if (wt == 0) next_w = int(gridDim.x) + atomicAdd(p.work_counter, 1);
      int b = 0, tile = 0;
      const bool has = FindPrefillTileWarp(p, w / H, b, tile);  // warp-uniform
      if (!has) {  // no more work: the consumers read kv head -1 and leave
        if (k > 0) MbarWait(&qempty_bar, (k - 1) & 1);
        if (wt == 0) work_info[0] = -1;
        MbarArrive(&qfull_bar);
        if (wt == 0) MbarArrive(&qfull_bar);
        break;
      }
      const int kvh = w % H;
      const int q_begin = a.query_start[b];
      const int nq = a.query_start[b + 1] - q_begin;
      const int len = a.seq_lens[b];
      const WorkRange r = MakeWorkRange(tile, nq, len, G, a.window);
      const int key_lo = r.key_lo, key_hi = r.key_hi, t_lo = r.t_lo, num_tiles = r.num_tiles;
      const T* q_rows =
          static_cast<const T*>(a.q) + (int64_t(q_begin) * s.num_heads + int64_t(kvh) * G) * D;
      // Q's rows into L2 now, 128-byte lines (a hint: Q's copies below wait for the Q buffer,
      // which the consumers free only with the previous work tile's last S GEMM).
      for (int i = wt; i < kRows * (D / 64); i += 128) {
        const int row = r.row0 + i / (D / 64);
        if (row < r.num_rows)
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(
              q_rows + (int64_t(row / G) * s.num_heads + row % G) * D + (i % (D / 64)) * 64));
      }
      // fp8: ScaledLogit's transform for (layer, kv head), layer 0 for a bad layer (whose
      // output is NaN); thread 0 passes its scales and v_scale on in work_info.
      float v_scale = 1.f;
      LogitTransform scaled = p.logit;
      if constexpr (kFp8) {
        if (wt == 0)
          scaled = ScaledLogit<true>(p.logit, a, li < 0 || li >= s.cache.num_layers ? 0 : li,
                                     kvh, v_scale);
      }
      // Q: once the previous work tile's Q is free (both consumers ran their last S GEMM of
      // it), the tile's rows (zeros past the last), kRowChunks chunks of each of this thread's
      // rows as for K/V, landing on the Q full barrier, which also publishes work_info.
      auto load_q = [&]() {
        if (k > 0) MbarWait(&qempty_bar, (k - 1) & 1);
#pragma unroll
        for (int i = 0; i < kRows / kRowsPerPass; ++i) {
          const int rr = row_base + i * kRowsPerPass;
          const int row = r.row0 + rr;
          const bool valid = row < r.num_rows;
          const T* src = q_rows + (valid ? (int64_t(row / G) * s.num_heads + row % G) * D : 0) +
                         ch0 * 8;
#pragma unroll
          for (int j = 0; j < kRowChunks; ++j) {  // (in bounds also when !valid)
            const int ch = ch0 + kRowThreads * j;
            CpAsync16(SmemAddr(qs + Swizzle128(kRows, rr, ch)), src + kRowThreads * 8 * j, valid);
          }
        }
        if constexpr (kQToHalf) {
          // This thread's copies landed: its own chunks -> f16 in place, before its arrival.
          CpAsyncCommit();
          CpAsyncWait<0>();
#pragma unroll 1
          for (int i = 0; i < kRows / kRowsPerPass; ++i)
#pragma unroll
            for (int j = 0; j < kRowChunks; ++j) {
              uint4* chunk = reinterpret_cast<uint4*>(
                  qs + Swizzle128(kRows, row_base + i * kRowsPerPass, ch0 + kRowThreads * j));
              *chunk = Bf16ChunkToHalf(*chunk);
            }
          FenceProxyAsync();
          MbarArrive(&qfull_bar);
        } else {
          MbarArriveOnCopies(&qfull_bar);
        }
        if (wt == 0) {
          work_info[0] = kvh;
          work_info[1] = tile;
          work_info[2] = q_begin;
          work_info[3] = nq;
          work_info[4] = len;
          if constexpr (kFp8) {
            work_info[5] = __float_as_int(scaled.scale_log2);
            work_info[6] = __float_as_int(scaled.scale_over_cap);
            work_info[7] = __float_as_int(v_scale);
          }
          MbarArrive(&qfull_bar);
        }
      };

      // This work tile's bad page ids and layer: raised, and passed to the consumers in
      // stage_bad (the whole work tile outputs NaN).
      const bool bad_layer = li < 0 || li >= s.cache.num_layers;
      uint32_t bits = bad_layer ? kBadLayer : 0u;
      const int64_t layer_off =
          (int64_t(bad_layer ? 0 : li) * s.cache.layer_stride + int64_t(kvh) * D) * kElemBytes;
      const char* kbase = static_cast<const char*>(a.k_cache) + layer_off;
      const char* vbase = static_cast<const char*>(a.v_cache) + layer_off;
      const int32_t* pages = a.page_table + int64_t(b) * s.max_pages;
      // Pages of at least kKeys / 32 tokens (at most 32 per tile): lane j of every producer warp
      // looks up page j of a tile once, one tile ahead and before the empty-slot wait, as the
      // byte offset of its first token (-1: a bad page id, or no key of the work tile's range in
      // it), and the rows take it by shuffle, so no global load or 64-bit multiply sits on a
      // row's path to its cp.asyncs. Smaller pages are looked up per row.
      auto tile_page_offset = [&](int it) -> int64_t {
        const int pg = (((t_lo + it) * kKeys) >> p.page_shift) + lane;
        if (it >= num_tiles || lane >= tile_pages || (pg << p.page_shift) >= key_hi ||
            ((pg + 1) << p.page_shift) <= key_lo)
          return -1;
        const int page = pages[TableEntry(pg, int(s.max_pages), a.ring)];
        if (page < 0 || page >= s.cache.num_pages) {
          bits |= kBadPage;
          return -1;
        }
        return int64_t(page) * page_bytes;
      };
      // Rows of tile it of one cache (base: K or V) into a stage's half at shared address dst;
      // lane_offset: the lane's page of the tile (lane pages), else looked up per row.
      auto issue_tile = [&](int it, const char* base, uint32_t dst, int64_t lane_offset) {
        const int key0 = (t_lo + it) * kKeys;
        auto issue_row = [&](int i, int64_t page_offset) {  // page_offset < 0: nothing to read
          const int row = row_base + i * kRowsPerPass;
          const int pos = key0 + row;
          const bool ok = pos >= key_lo && pos < key_hi && page_offset >= 0;
          const int64_t off =
              ok ? page_offset + int32_t(pos & (P - 1)) * int32_t(token_bytes) + ch0 * 16 : 0;
#pragma unroll
          for (int j = 0; j < kCopyChunks; ++j) {  // (in bounds also when !ok: chunk < D / 8)
            const int ch = ch0 + kRowThreads * j;
            const int to = kFp8 ? RawFp8Offset<D>(row, ch) : Swizzle128(kKeys, row, ch);
            CpAsync16(dst + uint32_t(to), base + off + kRowThreads * 16 * j, ok);
          }
        };
        if (lane_pages) {
          const int page0 = key0 >> p.page_shift;
#pragma unroll 4
          for (int i = 0; i < kRowsPerThread; ++i) {
            const int pos = key0 + row_base + i * kRowsPerPass;
            const int src = ((pos >> p.page_shift) - page0) & 31;
            const int lo = __shfl_sync(0xffffffffu, int32_t(lane_offset), src);
            const int hi = __shfl_sync(0xffffffffu, int32_t(lane_offset >> 32), src);
            issue_row(i, int64_t((uint64_t(uint32_t(hi)) << 32) | uint32_t(lo)));
          }
        } else {
#pragma unroll 4
          for (int i = 0; i < kRowsPerThread; ++i) {
            const int pos = key0 + row_base + i * kRowsPerPass;
            int64_t page_offset = -1;
            if (pos >= key_lo && pos < key_hi) {
              const int page = pages[TableEntry(pos >> p.page_shift, int(s.max_pages), a.ring)];
              if (page < 0 || page >= s.cache.num_pages) bits |= kBadPage;
              else page_offset = int64_t(page) * page_bytes;
            }
            issue_row(i, page_offset);
          }
        }
      };
      // K of tile it, then V of tile it - 1, each into its half of the tile's stage (ring
      // position g + it) after that half's own empty barrier: V is needed a turn after K (P V of
      // a tile goes with S of the next), and a K half is free again as soon as its S GEMM is
      // done, so both run about two tiles ahead of their use (and into the next work tile while
      // the consumers finish this one). K of tile 0 goes before Q: its half is usually free
      // before the Q buffer (an earlier S GEMM than the previous work tile's last frees it), and
      // waiting for it needs nothing from this work tile, so it cannot hold Q back for good.
      auto issue_k = [&](int it, int64_t lane_offset) {
        const int gk = g + it, stage = gk % kStages;
        if (gk >= kStages) MbarWait(&kempty_bar[stage], ((gk / kStages) - 1) & 1);
        issue_tile(it, kbase, ring_s + stage * 2 * kTileBytes, lane_offset);
        if constexpr (!kFp8) MbarArriveOnCopies(&kfull_bar[stage]);  // fp8: after convert_fp8
      };
      // fp8: this thread's rows of the K / V half at `half` (its copies landed: CpAsyncWait) from
      // the raw bytes at RawFp8Offset to f16 in the swizzled layout, in place. A row's raw bytes
      // are read by its kRowThreads lanes (one warp) before any of them writes (__syncwarp), and a
      // row's f16 chunks overwrite only its own raw bytes. With `scan` (V of a tile that some row
      // reads only in part), as the 16-bit path below: a raw chunk with a NaN in a key that some
      // but not all rows read is zeroed, and the key set in mine (bit row % 32 of word row / 32).
      auto convert_fp8 = [&](uint8_t* half, bool scan, int key0, uint32_t(&mine)[kFlagWords]) {
#pragma unroll 1
        for (int i = 0; i < kRowsPerThread; ++i) {
          const int row = row_base + i * kRowsPerPass;
          uint4 raw[kCopyChunks];
#pragma unroll
          for (int j = 0; j < kCopyChunks; ++j)
            raw[j] = *reinterpret_cast<const uint4*>(half +
                                                     RawFp8Offset<D>(row, ch0 + kRowThreads * j));
          __syncwarp();
          const int key = key0 + row;
          const bool partly_read_key =
              (key > r.q_first || (a.window > 0 && key <= r.q_last - a.window)) && key <= r.q_last;
          bool bad_row = false;
#pragma unroll
          for (int j = 0; j < kCopyChunks; ++j) {
            if (scan && partly_read_key && HasNanE4m3(raw[j])) {
              raw[j] = make_uint4(0u, 0u, 0u, 0u);
              bad_row = true;
            }
            const int ch = ch0 + kRowThreads * j;
            uint4 lo, hi;
            Fp8ChunkToHalf(raw[j], lo, hi);
            *reinterpret_cast<uint4*>(half + Swizzle128(kKeys, row, 2 * ch)) = lo;
            *reinterpret_cast<uint4*>(half + Swizzle128(kKeys, row, 2 * ch + 1)) = hi;
          }
          const uint32_t bit = bad_row ? 1u << (row % 32) : 0u;
#pragma unroll
          for (int wd = 0; wd < kFlagWords; ++wd) mine[wd] |= row / 32 == wd ? bit : 0u;
        }
      };
      // fp8: the K half of ring position g + it, once this thread's copies landed.
      auto finish_k_fp8 = [&](int it) {
        const int stage = (g + it) % kStages;
        uint32_t unused[kFlagWords] = {};
        convert_fp8(ring + stage * 2 * kTileBytes, false, 0, unused);
        FenceProxyAsync();  // the converted chunks, before wgmma reads K
        MbarArrive(&kfull_bar[stage]);
      };
      // fp8: the copies issued in loop turn it below (K of tile it, if any, and V of tile it - 1),
      // once they landed: converted and arrived, K first. V as the 16-bit path's tiles that some
      // row reads only in part, or the work tile's last: its flags and stage_bad with it.
      auto finish_turn_fp8 = [&](int it) {
        if (it < num_tiles) finish_k_fp8(it);
        const int jt = it - 1, stage = (g + jt) % kStages;
        const bool partial = PartlyRead((t_lo + jt) * kKeys, r.q_first, r.q_last, a.window);
        uint32_t mine[kFlagWords];
#pragma unroll
        for (int wd = 0; wd < kFlagWords; ++wd) mine[wd] = 0u;
        convert_fp8(ring + stage * 2 * kTileBytes + kTileBytes, partial, (t_lo + jt) * kKeys,
                    mine);
        if (partial) {
#pragma unroll
          for (int wd = 0; wd < kFlagWords; ++wd) {
            const uint32_t f = __reduce_or_sync(0xffffffffu, mine[wd]);
            if (lane == 0) bad_keys[stage][warp][wd] = f;
          }
        }
        if (jt == num_tiles - 1) {  // every page lookup of the work tile came before this
          const uint32_t any = __any_sync(0xffffffffu, bits != 0u);
          if (lane == 0) stage_bad[stage][warp] = any;
        }
        FenceProxyAsync();  // the converted chunks, before wgmma reads V
        MbarArrive(&vfull_bar[stage]);
      };
      int64_t k_offset = lane_pages ? tile_page_offset(0) : -1;  // the lane's page of tile it
      int64_t v_offset = -1;                                      // ... of tile it - 1
      {  // it = 0 (peeled): K of tile 0, Q, and the claim published (its register freed)
        const int64_t next_offset = lane_pages ? tile_page_offset(1) : -1;
        if (num_tiles > 0) issue_k(0, k_offset);
        if constexpr (kFp8) {
          if (num_tiles > 0) {
            CpAsyncCommit();
            CpAsyncWait<0>();
            finish_k_fp8(0);
          }
        }
        v_offset = k_offset;
        k_offset = next_offset;
        load_q();
        if (wt == 0) claimed[k & 1] = next_w;
      }
      for (int it = 1; it <= num_tiles; ++it) {
        const int64_t next_offset = lane_pages ? tile_page_offset(it + 1) : -1;
        const int64_t k_tile_offset = k_offset, v_tile_offset = v_offset;
        v_offset = k_offset;
        k_offset = next_offset;
        if (it < num_tiles) issue_k(it, k_tile_offset);
        const int jt = it - 1, gv = g + jt, stage = gv % kStages;
        if (gv >= kStages) MbarWait(&vempty_bar[stage], ((gv / kStages) - 1) & 1);
        issue_tile(jt, vbase, ring_s + stage * 2 * kTileBytes + kTileBytes, v_tile_offset);
        const bool partial = PartlyRead((t_lo + jt) * kKeys, r.q_first, r.q_last, a.window);
        const bool last = jt == num_tiles - 1;
        if constexpr (kFp8) {
          // This turn's copies are one commit group; the previous turn's, landed by now in the
          // steady state (the empty waits pace the producer), are converted and arrive behind
          // them (see the header comment: why the ring has room for that).
          CpAsyncCommit();
          if (it >= 2) {
            CpAsyncWait<1>();
            finish_turn_fp8(it - 1);
          }
          continue;
        }
        if (!partial && !last) {
          MbarArriveOnCopies(&vfull_bar[stage]);
          continue;
        }
        // A tile some row of the work tile reads only in part: this thread's copies landed
        // (visible to it), it zeroes those of its V chunks that hold NaN/inf, and its warp flags
        // their keys (bit row % 32 of word row / 32, OR-ed over the warp's lanes). The consumers
        // read a stage's flags after its V full barrier, and only for such tiles; the stage's
        // previous flags were read before its V empty barrier let this tile in. The work tile's
        // last key tile also carries its bad page ids (every page lookup of the work tile came
        // before this point), in stage_bad by the same rule.
        CpAsyncCommit();  // (the copies are in no group yet: wait_group covers committed ones)
        CpAsyncWait<0>();
        if (partial) {
          uint8_t* vs = ring + stage * 2 * kTileBytes + kTileBytes;
          // One row at a time (its kRowChunks chunks), so that few chunks are loaded at once
          // (all of them at once spill). Row row_base + kRowsPerPass i is bit row % 32 of word
          // row / 32.
          uint32_t mine[kFlagWords];
#pragma unroll
          for (int wd = 0; wd < kFlagWords; ++wd) mine[wd] = 0u;
          const int key0 = (t_lo + jt) * kKeys;
#pragma unroll 1
          for (int i = 0; i < kRowsPerThread; ++i) {
            const int row = row_base + i * kRowsPerPass;
            // A key that every row of the work tile reads is left as it is: a NaN / inf there
            // reaches all of them through the GEMM, as in a wholly read tile. So is one after the
            // last row: its copies were zero-fills (issue_row's ok is false past key_hi).
            const int key = key0 + row;
            if (key <= r.q_first && !(a.window > 0 && key <= r.q_last - a.window)) continue;
            if (key > r.q_last) continue;
            bool bad_row = false;
#pragma unroll
            for (int j = 0; j < kRowChunks; ++j) {
              uint4* chunk =
                  reinterpret_cast<uint4*>(vs + Swizzle128(kKeys, row, ch0 + kRowThreads * j));
              const uint4 c = *chunk;
              constexpr uint32_t kExp = std::is_same_v<T, __nv_bfloat16> ? 0x7F80u : 0x7C00u;
              bool bad = false;
              for (const uint32_t x : {c.x, c.y, c.z, c.w})
                bad |= (x & kExp) == kExp || ((x >> 16) & kExp) == kExp;
              if (bad) *chunk = make_uint4(0u, 0u, 0u, 0u);
              bad_row |= bad;
            }
            const uint32_t bit = bad_row ? 1u << (row % 32) : 0u;
#pragma unroll
            for (int wd = 0; wd < kFlagWords; ++wd) mine[wd] |= row / 32 == wd ? bit : 0u;
          }
#pragma unroll
          for (int wd = 0; wd < kFlagWords; ++wd) {
            const uint32_t f = __reduce_or_sync(0xffffffffu, mine[wd]);
            if (lane == 0) bad_keys[stage][warp][wd] = f;
          }
          FenceProxyAsync();  // the zeroed chunks, before wgmma reads V
        }
        if (last) {
          const uint32_t any = __any_sync(0xffffffffu, bits != 0u);
          if (lane == 0) stage_bad[stage][warp] = any;
        }
        MbarArrive(&vfull_bar[stage]);
      }
      if constexpr (kFp8) {
        if (num_tiles > 0) {  // the last turn's copies (none are left across work tiles)
          CpAsyncWait<0>();
          finish_turn_fp8(num_tiles);
        }
      }
      if (bits) RaiseError(a.error_word, bits);
      g += num_tiles;
      // The next work tile: thread 0's claim, in claimed[k & 1] since this work tile's Q.
      NamedBarrier(4, 128);
      w = claimed[k & 1];
    }
    CpAsyncCommit();
    CpAsyncWait<0>();
    return;
  }

  // ---- consumers ----
  SetMaxRegs<kConsumerRegs>();
  LogitTransform logit = p.logit;  // fp8: k_scale folded in per work tile
  const int cw = wg - 1;  // rows [64 cw, 64 cw + 64) of the work tile
  const int r0 = lane / 4, c0 = (lane % 4) * 2;
  const uint8_t* q_wg = qs + cw * 64 * 128;
  // Without a soft cap (and with a positive scale) the row max commutes with the scale: S stays
  // raw q.k, the scale folds into exp2's argument, and the non-finite rule needs only the
  // largest |q.k| a row read (an inf there -> NaN; a NaN propagates through exp2 by itself).
  bool fast = logit.soft_cap <= 0.f && logit.scale_log2 > 0.f;
  float v_scale = 1.f;  // fp8: multiplies the normalized output
  // Descriptors of Q and of stage 0's K and V halves; a stage is 2 kTileBytes further.
  const SmemDescHalves q_desc = MakeSmemDesc(q_wg, 16, 1024);
  const SmemDescHalves k_desc = MakeSmemDesc(ring, 16, 1024);
  // V as B, MN-major: 64-column blocks kKvBlock apart, 8-key groups 1 KiB apart.
  const SmemDescHalves v_desc = MakeSmemDesc(ring + kTileBytes, kKvBlock, 1024);
  int g = 0;  // key tiles of the work tiles before the current one (the ring position)
  for (int k = 0;; ++k) {
    MbarWait(&qfull_bar, k & 1);
    // (broadcast from lane 0: warp-uniform for ptxas, see wg)
    const int kvh = __shfl_sync(0xffffffffu, work_info[0], 0);
    if (kvh < 0) break;
    const int tile = __shfl_sync(0xffffffffu, work_info[1], 0);
    const int q_begin = __shfl_sync(0xffffffffu, work_info[2], 0);
    const int nq = __shfl_sync(0xffffffffu, work_info[3], 0);
    const int len = __shfl_sync(0xffffffffu, work_info[4], 0);
    if constexpr (kFp8) {  // the producer's ScaledLogit transform
      logit.scale_log2 = __int_as_float(__shfl_sync(0xffffffffu, work_info[5], 0));
      logit.scale_over_cap = __int_as_float(__shfl_sync(0xffffffffu, work_info[6], 0));
      v_scale = __int_as_float(__shfl_sync(0xffffffffu, work_info[7], 0));
      fast = logit.soft_cap <= 0.f && logit.scale_log2 > 0.f;
    }
    FenceProxyAsync();  // Q's cp.async (generic proxy) writes, before wgmma reads them
    const WorkRange r = MakeWorkRange(tile, nq, len, G, a.window);
    const int num_rows = r.num_rows, row0 = r.row0, pos0 = r.pos0, t_lo = r.t_lo,
              num_tiles = r.num_tiles;

    int qpos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      qpos[h] = pos0 + min(row0 + cw * 64 + warp * 16 + r0 + 8 * h, num_rows - 1) / G;
    const int wg_q_lo = pos0 + min(row0 + cw * 64, num_rows - 1) / G;
    const int wg_q_hi = pos0 + min(row0 + cw * 64 + 63, num_rows - 1) / G;
    // This warpgroup's tiles [ta, tb): those meeting its rows' causal / window band (the keys
    // [max(0, wg_q_lo - window + 1), wg_q_hi]); t_lo <= ta < tb <= num_tiles.
    const int wg_key_lo = a.window > 0 ? max(0, wg_q_lo - a.window + 1) : 0;
    const int ta = wg_key_lo / kKeys - t_lo;
    const int tb = min(num_tiles, wg_q_hi / kKeys + 1 - t_lo);

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    bool row_nan[2] = {false, false};
    float absmax[2] = {0.f, 0.f};  // the largest |q.k| each row read (fast path)
    bool tile_bad = false;  // a bad page id or layer in the work tile (the producer's stage_bad)
    float sc[kKeys / 8][4];
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
    uint32_t pa[kKeys / 16][4];  // P of the tile whose P V GEMM is next (m16n8k16 A fragments)

    // Ping-pong: the warpgroups issue their GEMMs in turns, one turn per tile. Warpgroup cw
    // waits on named barrier 5 + cw for the other's arrival (after its issues of the previous
    // tile, or warpgroup 1's first arrival below) and arrives on the other's after its own
    // issues; a tile outside a warpgroup's band is an empty turn, so both make num_tiles turns
    // (warpgroup 1's last arrival would have no taker). Each work tile starts the turns afresh
    // (the previous one's turns all completed: warpgroup 1 got here after its last turn, which
    // waited for warpgroup 0's last; warpgroup 0's turns took all of warpgroup 1's arrivals).
    if (cw == 1 && num_tiles > 0) NamedBarrierArrive(5, 128 * kConsumers);  // warpgroup 0 first
    auto turn_begin = [&]() { NamedBarrier(5 + cw, 128 * kConsumers); };
    auto turn_end = [&](int it) {
      if (cw == 0 || it + 1 < num_tiles) NamedBarrierArrive(5 + (1 - cw), 128 * kConsumers);
    };
    // Both warpgroups free Q once per work tile, after their last S GEMM completed.
    auto release_q = [&]() { MbarArrive(&qempty_bar); };
    // Waits for tile it's K / V half to land (ring position g + it); the fence: its cp.async
    // (generic proxy) writes, before wgmma reads them. The work tile's last V half also brings
    // its bad page flag.
    auto wait_k = [&](int it) {
      const int gk = g + it;
      MbarWait(&kfull_bar[gk % kStages], (gk / kStages) & 1);
      FenceProxyAsync();
    };
    auto wait_v = [&](int it) {
      const int gv = g + it, stage = gv % kStages;
      MbarWait(&vfull_bar[stage], (gv / kStages) & 1);
      FenceProxyAsync();
      if (it == num_tiles - 1)
        tile_bad = (stage_bad[stage][0] | stage_bad[stage][1] | stage_bad[stage][2] |
                    stage_bad[stage][3]) != 0u;
    };
    // Releases a half only after waiting for it (also for a tile this warpgroup skips): an
    // arrival for a tile a whole ring ahead would otherwise count toward the phase of the tile
    // before it.
    auto release_k = [&](int it) { MbarArrive(&kempty_bar[(g + it) % kStages]); };
    auto release_v = [&](int it) { MbarArrive(&vempty_bar[(g + it) % kStages]); };
    auto skip_tile = [&](int it) {  // outside this warpgroup's band
      wait_k(it);
      wait_v(it);
      turn_begin();
      turn_end(it);
      release_k(it);
      release_v(it);
    };
    // (offsets in 16-byte units, so that a stage's term and a constant are one three-way add)
    auto issue_s = [&](int stage) {
      const uint32_t ks = uint32_t(stage) * (2 * kTileBytes / 16);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        constexpr int kQ = kQBlock / 16, kKv = kKvBlock / 16;
        const uint32_t qoff = (kk / 4) * kQ + (kk % 4) * 2, koff = (kk / 4) * kKv + (kk % 4) * 2;
        WgmmaSS<M, kKeys>::template run<0>(sc, q_desc.at(qoff), k_desc.at(ks + koff), kk > 0);
      }
      WgmmaCommit();
    };
    // P V over the tile's first n16 16-key steps (the band's last tile: only up to the step of
    // this warpgroup's last row; the keys after it are masked, P = 0 there).
    auto issue_pv = [&](int stage, int n16) {
      const uint32_t vs = uint32_t(stage) * (2 * kTileBytes / 16);
#pragma unroll
      for (int k16 = 0; k16 < kKeys / 16; ++k16)  // 16 keys = 2 KiB
        WgmmaRS<M, D>::template run<1>(o, pa[k16], v_desc.at(vs + k16 * 128), 1, k16 < n16);
      WgmmaCommit();
    };
    // Rows that read a key the producer flagged in tile it (a V chunk with NaN/inf; partial tiles
    // only; after the tile's V full barrier) output NaN.
    auto apply_flags = [&](int it) {
      const int key0 = (t_lo + it) * kKeys;
      if (!PartlyRead(key0, r.q_first, r.q_last, a.window)) return;
      const int stage = (g + it) % kStages;
      uint32_t flagged[kFlagWords];
      bool any_flagged = false;
#pragma unroll
      for (int i = 0; i < kFlagWords; ++i) {
        flagged[i] = bad_keys[stage][0][i] | bad_keys[stage][1][i] | bad_keys[stage][2][i] |
                     bad_keys[stage][3][i];
        any_flagged |= flagged[i] != 0u;
      }
      if (!any_flagged) return;
      const bool needs_mask = PartlyRead(key0, wg_q_lo, wg_q_hi, a.window);
      uint32_t hit[2] = {0u, 0u};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int hi = qpos[h] - key0 - c0;  // as in softmax_tile
        const int lo = a.window > 0 ? qpos[h] - a.window - key0 - c0 : -(1 << 30);
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int kt = nt * 8 + e;  // + c0: the shift below
            const bool masked = needs_mask && (kt > hi || kt <= lo);
            hit[h] |= (flagged[kt / 32] >> (kt % 32 + c0)) & (masked ? 0u : 1u);
          }
      }
      row_nan[0] |= hit[0] != 0u;
      row_nan[1] |= hit[1] != 0u;
    };
    // Mask, non-finite bookkeeping and soft-max of tile it's S (landed); alpha for O. Selects,
    // not branches, per logit, so that each path is straight-line code.
    auto softmax_tile = [&](auto fast_c, int it, float (&alpha)[2]) {
      constexpr bool kFast = decltype(fast_c)::value;
      const int key0 = (t_lo + it) * kKeys;
      const bool needs_mask = PartlyRead(key0, wg_q_lo, wg_q_hi, a.window);
      // Key kt (of this thread: kt = nt * 8 + c0 + (j & 1)) is masked for row half h when
      // nt * 8 + (j & 1) > hi[h] (after the row) or <= lo[h] (before its window).
      int hi[2], lo[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        hi[h] = qpos[h] - key0 - c0;
        lo[h] = a.window > 0 ? qpos[h] - a.window - key0 - c0 : -(1 << 30);
      }
      auto is_masked = [&](int nt, int j) {
        const int kt = nt * 8 + (j & 1);
        return kt > hi[j >> 1] || kt <= lo[j >> 1];
      };
      if constexpr (!kFast) {
        if (logit.soft_cap > 0.f) {
#pragma unroll
          for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float x = sc[nt][j];
              sc[nt][j] = fabsf(x) < INFINITY ? logit.capped(x) : NAN;
            }
        } else {
#pragma unroll
          for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float x = sc[nt][j];
              sc[nt][j] = fabsf(x) < INFINITY ? x * logit.scale_log2 : NAN;
            }
        }
      }
      if (needs_mask) {
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const bool masked = is_masked(nt, j);
            if constexpr (kFast)
              absmax[j >> 1] = fmaxf(absmax[j >> 1], masked ? 0.f : fabsf(sc[nt][j]));
            sc[nt][j] = masked ? -INFINITY : sc[nt][j];
          }
      } else if constexpr (kFast) {  // the hot path: one instruction per logit before soft-max
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j) absmax[j >> 1] = fmaxf(absmax[j >> 1], fabsf(sc[nt][j]));
      }
      SoftmaxStep<kKeys / 8>(sc, m, l, alpha, kFast ? logit.scale_log2 : 1.f);
    };
    auto pack_p = [&]() {
#pragma unroll
      for (int k16 = 0; k16 < kKeys / 16; ++k16) {
        pa[k16][0] = Mma<M>::pack(sc[2 * k16][0], sc[2 * k16][1]);
        pa[k16][1] = Mma<M>::pack(sc[2 * k16][2], sc[2 * k16][3]);
        pa[k16][2] = Mma<M>::pack(sc[2 * k16 + 1][0], sc[2 * k16 + 1][1]);
        pa[k16][3] = Mma<M>::pack(sc[2 * k16 + 1][2], sc[2 * k16 + 1][3]);
      }
    };
    // The band's tiles, one instance per logit path (fast: raw q.k, scale in exp2's argument).
    auto band = [&](auto fast_c) {
      float alpha[2];
      // First tile of the band: S alone (O is still zero, so its alpha is not needed).
      wait_k(ta);
      turn_begin();
      FenceRegisters(sc);
      WgmmaFence();
      issue_s((g + ta) % kStages);
      turn_end(ta);
      WgmmaWait<0>();
      FenceRegisters(sc);
      release_k(ta);
      if (ta + 1 == tb) release_q();  // the band's only S GEMM
      softmax_tile(fast_c, ta, alpha);
      pack_p();
      if (ta + 1 < tb) wait_k(ta + 1);
      // Steady state: S of tile it and P V of tile it - 1 in one turn; while P V runs, the
      // soft-max of tile it and the wait for tile it + 1's K; then O's rescale and the next P.
      for (int it = ta + 1; it < tb; ++it) {
        wait_v(it - 1);
        apply_flags(it - 1);
        turn_begin();
        FenceRegisters(sc);
        FenceRegisters(o);
        FenceRegisters(pa);
        WgmmaFence();
        issue_s((g + it) % kStages);
        issue_pv((g + it - 1) % kStages, kKeys / 16);
        turn_end(it);
        WgmmaWait<1>();  // S of tile it
        FenceRegisters(sc);
        release_k(it);
        if (it + 1 == tb) release_q();  // the band's last S GEMM
        softmax_tile(fast_c, it, alpha);
        // The soft-max's results, pinned before what follows (nvcc could sink them past it).
        FenceRegisters(sc);
        FenceScalars(alpha[0], alpha[1], l[0], l[1]);
        // The next tile's K full barrier sits between the soft-max and the P V wait on purpose:
        // a basic-block boundary (the branch, the spin loop) keeps ptxas from hoisting the wait
        // to the top of the soft-max's block, out of the overlap with the GEMM (it does that to a
        // wgmma wait, which depends on no register, when both share a block).
        if (it + 1 < tb) wait_k(it + 1);
        WgmmaWait<0>();  // P V of tile it - 1
        FenceRegisters(o);
        FenceRegisters(pa);
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
          for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
          }
        }
        pack_p();
        release_v(it - 1);
      }
      // P V of the band's last tile.
      wait_v(tb - 1);
      apply_flags(tb - 1);
      FenceRegisters(o);
      FenceRegisters(pa);
      WgmmaFence();
      issue_pv((g + tb - 1) % kStages,
               min(kKeys / 16, ((wg_q_hi - (t_lo + tb - 1) * kKeys) >> 4) + 1));
      WgmmaWait<0>();
      FenceRegisters(o);
      FenceRegisters(pa);
      release_v(tb - 1);
    };

    for (int it = 0; it < ta; ++it) skip_tile(it);
    if (ta < tb) {
      if (fast) band(std::true_type{});
      else band(std::false_type{});
    } else {
      release_q();  // (not taken: wg_key_lo <= wg_q_hi gives ta < tb; Q is freed on every path)
    }
    for (int it = max(ta, tb); it < num_tiles; ++it) skip_tile(it);
    g += num_tiles;

    // Epilogue, while the producer already streams the next work tile's Q and K / V.
    const bool bad = tile_bad;  // a bad page id or layer in the work tile
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float lh = l[h];
      lh += __shfl_xor_sync(0xffffffffu, lh, 1);
      lh += __shfl_xor_sync(0xffffffffu, lh, 2);
      int nan_row = row_nan[h] || absmax[h] == INFINITY;
      nan_row |= __shfl_xor_sync(0xffffffffu, nan_row, 1);
      nan_row |= __shfl_xor_sync(0xffffffffu, nan_row, 2);
      const int row = row0 + cw * 64 + warp * 16 + r0 + 8 * h;
      if (row >= num_rows) continue;
      const float inv = (bad || nan_row) ? NAN : (lh == 0.f ? 0.f : v_scale / lh);
      T* out = static_cast<T*>(a.out) +
               ((int64_t(q_begin) + row / G) * s.num_heads + int64_t(kvh) * G + row % G) * D;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<uint32_t*>(out + n * 8 + c0) =
            Mma<T>::pack(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// Whether this binary carries the sm_90a kernel and the current device runs it (probed once per
// device: a build for other architectures compiles the kernel body away).
__global__ void ProbeSm90aKernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

bool Sm90aAvailable() {
  static int cached[64];  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (cached[dev] == 0) {
    int major = 0, minor = 0, yes = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (major == 9 && minor == 0) {
      int* flag = nullptr;
      if (cudaMalloc(&flag, sizeof(int)) == cudaSuccess) {
        ProbeSm90aKernel<<<1, 1>>>(flag);
        if (cudaMemcpy(&yes, flag, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) yes = 0;
        cudaFree(flag);
      }
      cudaGetLastError();
    }
    cached[dev] = yes == 1 ? 1 : 2;
  }
  return cached[dev] == 1;
}

template <typename T, int D, bool kFp8>
ffi::Error LaunchSm90(cudaStream_t stream, const PrefillParams& p, int64_t max_tiles) {
  constexpr int smem = Sm90SmemBytes<D>();
  static bool configured = false;  // NOTE: per-template, set on the first launch
  if (!configured) {
    if (cudaFuncSetAttribute(RaggedPrefillSm90Kernel<T, D, kFp8>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
      return LaunchError("ragged_paged_attention: cudaFuncSetAttribute (sm90)");
    configured = true;
  }
  // Persistent: one CTA per SM (1 CTA/SM fits), or fewer when the work is smaller; the CTAs
  // claim the work tiles (at most max_tiles x kv heads; the real count is on the device) from
  // p.work_counter, which the schedule kernel zeroed on this stream.
  const int64_t work = max_tiles * p.a.shape.cache.num_kv_heads;
  const int64_t ctas = std::max<int64_t>(1, std::min<int64_t>(work, NumSMs()));
  RaggedPrefillSm90Kernel<T, D, kFp8><<<unsigned(ctas), kThreads, smem, stream>>>(p);
  return LaunchError("ragged_paged_attention (sm90 prefill kernel)");
}

}  // namespace

bool RaggedPrefillSm90Supports(const AttentionArgs& a) {
  const AttentionShape& s = a.shape;
  const int64_t D = s.cache.head_dim;
  // A page's bytes (per layer) and the page stride fit 31 bits: the producer's per-row offsets
  // and its page stride are 32-bit.
  const int64_t elem_bytes = s.fp8() ? 1 : 2;
  const bool small_pages =
      s.cache.page_size * s.cache.token_stride() * elem_bytes < (int64_t(1) << 31) &&
      s.cache.page_stride * elem_bytes < (int64_t(1) << 31);
  // Work tile ids (and the claims past the last one: at most one per CTA more) fit an int: the
  // bound on row tiles, as in the launch, times the kv heads.
  const int64_t max_tiles = (s.num_queries * s.group() + kRows - 1) / kRows + s.batch;
  const bool small_work = max_tiles * s.cache.num_kv_heads < (int64_t(1) << 30);
  const bool half_q = s.q_dtype == DType::kBF16 || s.q_dtype == DType::kF16;
  // fp8 caches need the scales (AttentionArgs: [num_layers, num_kv_heads]).
  const bool fp8_ok = s.fp8() && half_q && a.k_scale != nullptr && a.v_scale != nullptr;
  return (fp8_ok || (!s.fp8() && s.cache.dtype == s.q_dtype && half_q)) && (D == 64 || D == 128) &&
         s.cache.page_size >= 1 && small_pages && small_work && Sm90aAvailable();
}

ffi::Error LaunchRaggedPrefillSm90(cudaStream_t stream, const PrefillParams& p,
                                   int64_t max_tiles) {
  const AttentionArgs& a = p.a;
  auto by_cache = [&](auto t, auto d) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
    if (a.shape.fp8()) return LaunchSm90<T, D, true>(stream, p, max_tiles);
    return LaunchSm90<T, D, false>(stream, p, max_tiles);
  };
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  if (a.shape.q_dtype == DType::kBF16) {
    if (a.shape.cache.head_dim == 64) return by_cache(__nv_bfloat16{}, D64{});
    return by_cache(__nv_bfloat16{}, D128{});
  }
  if (a.shape.cache.head_dim == 64) return by_cache(__half{}, D64{});
  return by_cache(__half{}, D128{});
}

}  // namespace kvcm::cuda
