// Warp-level tensor-core and async-copy primitives (sm_80+ instructions, used on Hopper).
//
// Fragment layouts follow PTX's mma.m16n8k16 (row.col): lane l owns rows l/4 and l/4+8 and
// columns 2*(l%4)+{0,1} (+8) of the A and C tiles. K/V tiles in shared memory are stored as
// [rows][D/8 chunks of 16 bytes] with chunk c of row r at position c ^ (r & 7): ldmatrix then
// reads eight rows at the same logical chunk from eight different bank groups.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace kvcm::cuda {

template <typename T> struct Mma;

template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <> struct Mma<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte global->shared copy; when !valid the destination is zero-filled and src is not read.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 16 float8_e4m3fn values (one 16-byte chunk) -> two 16-byte chunks of f16 (exact).
__device__ __forceinline__ void Fp8ChunkToHalf(const uint4 in, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {in.x, in.y, in.z, in.w};
  uint32_t h[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w[i] & 0xffffu), __NV_E4M3);
    const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w[i] >> 16), __NV_E4M3);
    h[2 * i] = uint32_t(a.x) | (uint32_t(a.y) << 16);
    h[2 * i + 1] = uint32_t(b.x) | (uint32_t(b.y) << 16);
  }
  lo = make_uint4(h[0], h[1], h[2], h[3]);
  hi = make_uint4(h[4], h[5], h[6], h[7]);
}

// 8 bfloat16 values (one 16-byte chunk) -> 8 float16 values (exact within f16's normal range).
__device__ __forceinline__ uint4 Bf16ChunkToHalf(const uint4 in) {
  uint32_t w[4] = {in.x, in.y, in.z, in.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
    __half2 h = __floats2half2_rn(f.x, f.y);
    w[i] = *reinterpret_cast<uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float FastTanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][kChunks] tile.
template <int kChunks>
__device__ __forceinline__ int SwizzledOffset(int row, int chunk) {
  return (row * kChunks + (chunk ^ (row & 7))) * 8;
}

// The non-finite rule for tiles that some query rows read only in part (causal diagonal, window
// edge): P = 0 for a masked key still gives 0 * NaN = NaN in P.V, so a NaN/inf in V at a position
// a row does not read would poison that row. Each 16-byte chunk of a [kRows][D] tile of 16-bit M
// holding a non-finite element is zeroed, and bit r of flags[r / 32] is set for its row r; rows
// that do read a flagged key are set to NaN by the caller. Threads thread, thread + stride, ...
template <typename M, int kRows, int D>
__device__ __forceinline__ void SanitizeTileRows(M* tile, uint32_t* flags, int thread, int stride) {
  constexpr uint32_t kExp = std::is_same_v<M, __nv_bfloat16> ? 0x7F80u : 0x7C00u;
  constexpr int kChunksPerRow = D / 8;
  for (int i = thread; i < kRows * kChunksPerRow; i += stride) {
    uint4* chunk = reinterpret_cast<uint4*>(tile) + i;
    const uint4 c = *chunk;
    bool bad = false;
    for (const uint32_t w : {c.x, c.y, c.z, c.w})
      bad |= (w & kExp) == kExp || ((w >> 16) & kExp) == kExp;
    if (bad) {
      *chunk = make_uint4(0u, 0u, 0u, 0u);
      const int row = i / kChunksPerRow;
      atomicOr(&flags[row / 32], 1u << (row % 32));
    }
  }
}

// Logit transform shared by the tensor-core kernels: scale, optional soft cap, then log2(e) so
// that softmax uses exp2. A non-finite q.k becomes NaN (the non-finite rule: a NaN/inf that a
// query reads shows in its output, even under a soft cap, which would map inf to a finite cap).
struct LogitTransform {
  float scale_log2;      // scale * log2(e), used when there is no soft cap
  float soft_cap;        // <= 0: none
  float scale_over_cap;  // scale / soft_cap
  float cap_log2;        // soft_cap * log2(e)
  static LogitTransform Make(float scale, float soft_cap) {
    constexpr float kLog2e = 1.4426950408889634f;
    return {scale * kLog2e, soft_cap, soft_cap > 0.f ? scale / soft_cap : 0.f, soft_cap * kLog2e};
  }
  __device__ __forceinline__ float capped(float dot) const {
    return cap_log2 * FastTanh(dot * scale_over_cap);
  }
  __device__ __forceinline__ float operator()(float dot) const {
    if (!(fabsf(dot) < INFINITY)) return NAN;
    return soft_cap > 0.f ? capped(dot) : dot * scale_log2;
  }
};

// Online-softmax update for one warp's 16-row tile of NT n-tiles of logits (log2 domain, already
// masked with -inf). Rescales the output accumulator o[NO][4]; turns s into probabilities.
// NOTE: the rescale of o (NO * 4 multiplies per lane) is skipped, warp-uniformly, when no row's
// running max moved (every alpha is exactly 1: the common case once a row has seen its largest
// logits); the result is bit-identical.
template <int NT, int NO>
__device__ __forceinline__ void OnlineSoftmax(float (&s)[NT][4], float (&o)[NO][4], float (&m)[2],
                                              float (&l)[2]) {
  float alphas[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[h], mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = FastExp2(m[h] - base);
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][2 * h] = FastExp2(s[nt][2 * h] - base);
      s[nt][2 * h + 1] = FastExp2(s[nt][2 * h + 1] - base);
      sum += s[nt][2 * h] + s[nt][2 * h + 1];
    }
    l[h] = l[h] * alpha + sum;
    alphas[h] = alpha;
    m[h] = m_new;
  }
  if (__any_sync(0xffffffffu, alphas[0] != 1.f || alphas[1] != 1.f)) {
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      o[n][0] *= alphas[0];
      o[n][1] *= alphas[0];
      o[n][2] *= alphas[1];
      o[n][3] *= alphas[1];
    }
  }
}

// One online soft-max step over a tile's logits s (log2 domain after the factor `scale`: raw q.k
// with scale = scale_log2 on the fast path, pre-transformed logits with scale = 1 otherwise;
// masked entries -inf): s becomes exp2(s * scale - m_new * scale), l is rescaled and summed (per
// thread; the 4 threads of a row add up at the end), and alpha[h] is the factor O's row half h
// must be multiplied by (applied by the caller once the P V GEMM in flight has landed).
template <int NT>
__device__ __forceinline__ void SoftmaxStep(float (&s)[NT][4], float (&m)[2], float (&l)[2],
                                            float (&alpha)[2], float scale) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[h], mx);
    // Rounded up (scale > 0), so that s * scale - base <= 0 for every s <= m_new: the fused
    // multiply-add below takes the exact s * scale, and with base rounded to nearest its
    // argument at s = m_new would be up to half an ulp of m_new * scale above 0, which overflows
    // exp2 once |m_new * scale| >= 2^31 (an inf / inf row that should be finite).
    const float base = m_new == -INFINITY ? 0.f : __fmul_ru(m_new, scale);
    alpha[h] = FastExp2(m[h] * scale - base);
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][2 * h] = FastExp2(fmaf(s[nt][2 * h], scale, -base));
      s[nt][2 * h + 1] = FastExp2(fmaf(s[nt][2 * h + 1], scale, -base));
      sum += s[nt][2 * h] + s[nt][2 * h + 1];
    }
    l[h] = l[h] * alpha[h] + sum;
    m[h] = m_new;
  }
}

}  // namespace kvcm::cuda
