// Ragged (prefill / mixed) paged attention on Hopper's warpgroup MMA (wgmma), warp-specialized.
// This file: the design (below), the kernel's shared memory and barriers, its launch and entry
// points. The roles' code: kvcm/cuda/prefill_sm90_producer.cuh and prefill_sm90_consumer.cuh,
// their layout constants and helpers: kvcm/cuda/prefill_sm90.cuh.
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

#include "kvcm/cuda/prefill_sm90_consumer.cuh"
#include "kvcm/cuda/prefill_sm90_producer.cuh"

namespace kvcm::cuda {
namespace {

using namespace sm90;  // the layout, the helpers and the two roles

// The CTA's shared memory and its barriers, then each warpgroup runs its role (T, kFp8: see
// Sm90Roles in kvcm/cuda/prefill_sm90.cuh; the roles are prefill_sm90_{producer,consumer}.cuh).
template <typename T, int D, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) RaggedPrefillSm90Kernel(const PrefillParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using R = Sm90Roles<T, D, kFp8>;
  constexpr int kStages = R::kStages;
  constexpr int kFlagWords = R::kFlagWords;
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

  const typename R::Shared sh{qs,        ring,       kfull_bar,  vfull_bar, kempty_bar,
                               vempty_bar, qfull_bar, qempty_bar, bad_keys,  stage_bad,
                               work_info, claimed,   G,          P,          H};
  if (wg == 0) {
    R::Producer(p, sh, li, wt, warp, lane);
    return;
  }
  R::Consumer(p, sh, wg, warp, lane);
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
