// The cold-page codecs' device kernels: the concat codec's copy kernel (one CTA per piece,
// 16-byte loads all in flight before the stores) and the int8 codec's encode / decode kernels
// (one CTA per (pair, layer, K/V): per-head scales in shared memory). Framework-free (CUDA and
// kvcm's own headers); the layouts are kvcm/codec.h's, the handlers and their launches
// ffi/cuda/codec.cu's.
#pragma once

#include <cstdint>

#include "kvcm/codec.h"
#include "kvcm/cuda/common.cuh"

namespace kvcm::cuda::codec {

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 8;  // 16-byte loads in flight per thread (a 32 KiB piece: one round)

// grid (n, 2L): CTA (pair, piece j = 2 * layer + kv). The pairs were validated on the host.
template <bool kEncode, bool kVec>
__global__ void __launch_bounds__(kCopyThreads)
    ConcatCopyKernel(char* __restrict__ k_pool, char* __restrict__ v_pool,
                     const int32_t* __restrict__ pairs, char* __restrict__ cold_base,
                     HotPoolShape s, int64_t cold_page_bytes) {
  const int2 pr = reinterpret_cast<const int2*>(pairs)[blockIdx.x];
  const int64_t hot = kEncode ? pr.y : pr.x;
  const int64_t cold = kEncode ? pr.x : pr.y;
  const int64_t j = blockIdx.y, piece = s.piece_bytes();
  char* hot_ptr = ((j & 1) ? v_pool : k_pool) + s.piece_offset(j >> 1, hot) * s.itemsize;
  char* cold_ptr = cold_base + cold * cold_page_bytes + j * piece;
  const char* src = kEncode ? hot_ptr : cold_ptr;
  char* dst = kEncode ? cold_ptr : hot_ptr;
  if constexpr (kVec) {
    const auto* src4 = reinterpret_cast<const uint4*>(src);
    auto* dst4 = reinterpret_cast<uint4*>(dst);
    const int64_t n = piece / 16;
    int64_t i = threadIdx.x;
    for (; i + (kCopyUnroll - 1) * kCopyThreads < n; i += kCopyUnroll * kCopyThreads) {
      uint4 r[kCopyUnroll];  // all loads issued before the first store: latency of the slow link
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) r[u] = src4[i + u * kCopyThreads];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) dst4[i + u * kCopyThreads] = r[u];
    }
    for (; i < n; i += kCopyThreads) dst4[i] = src4[i];
  } else {
    for (int64_t i = threadIdx.x; i < piece; i += kCopyThreads) dst[i] = src[i];
  }
}

constexpr int kInt8Threads = 256;
constexpr int64_t kMaxInt8Heads = 4096;  // shared memory: one float per kv head

struct Int8Args {
  HotPoolShape s;
  Int8Layout lay;
  int64_t cold_page_bytes;
  int64_t cold_limit;
};

// 16 consecutive elements <-> float, with 16-byte vector accesses (needs 16 * sizeof(T) alignment
// of the element, which D % 16 == 0 and 16-byte aligned pools give).
template <typename T>
__device__ __forceinline__ void Load16(const T* p, float (&x)[16]) {
  constexpr int kVecs = int(sizeof(T));  // 16 elements = sizeof(T) uint4
  uint4 raw[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) raw[i] = reinterpret_cast<const uint4*>(p)[i];
  const T* t = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = DTypeTraits<T>::to_float(t[i]);
}

template <typename T>
__device__ __forceinline__ void Store16(T* p, const float (&x)[16]) {
  constexpr int kVecs = int(sizeof(T));
  uint4 raw[kVecs];
  T* t = reinterpret_cast<T*>(raw);
#pragma unroll
  for (int i = 0; i < 16; ++i) t[i] = DTypeTraits<T>::from_float(x[i]);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) reinterpret_cast<uint4*>(p)[i] = raw[i];
}

__device__ __forceinline__ int8_t Quantize(float x, float scale) {
  float r = x / scale;  // IEEE division (no fast-math in this build)
  r = fminf(fmaxf(r, -127.f), 127.f);
  return int8_t(int(rintf(r)));  // round half to even
}

// Reads pair `i` with one 8-byte load; false (and kBadIndexPair raised once) when it is outside.
__device__ __forceinline__ bool LoadPair(const int32_t* __restrict__ pairs, const Int8Args& a,
                                         bool encode, int64_t& hot, int64_t& cold,
                                         uint32_t* error_word) {
  const int2 pr = reinterpret_cast<const int2*>(pairs)[blockIdx.x];
  hot = encode ? pr.y : pr.x;
  cold = encode ? pr.x : pr.y;
  if (hot < 0 || hot >= a.s.num_slots || cold < 0 || cold >= a.cold_limit) {
    if (threadIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
      RaiseError(error_word, kBadIndexPair);
    return false;
  }
  return true;
}

// Element c * width of a page piece walked head-major, as the cold payload stores it ([H][P][D]),
// against the piece's own [P][H][D] layout: the head, the element within the head's P x D block,
// and the offset in the piece. per_head = P * D / width.
struct PieceSlot {
  int h, e;
  int64_t offset;
};
__device__ __forceinline__ PieceSlot SlotInPiece(int c, int per_head, int width, int H, int D) {
  const int h = c / per_head, e = (c - h * per_head) * width, p = e / D, d = e - p * D;
  return {h, e, (int64_t(p) * H + h) * D + d};
}

// This thread's 16-element vectors of a page piece in head-major (cold) order, each loaded as
// float and handed to visit(slot, x): the encoder's two passes (amax, then quantize) walk alike.
template <typename T, typename Visit>
__device__ __forceinline__ void ForEachVectorOfPiece(const T* piece, int H, int D, int PD,
                                                     Visit&& visit) {
  const int per_head = PD / 16, total = H * per_head;
  for (int v = threadIdx.x; v < total; v += blockDim.x) {
    const PieceSlot at = SlotInPiece(v, per_head, 16, H, D);
    float x[16];
    Load16(piece + at.offset, x);
    visit(at, x);
  }
}

// grid (n, L, 2): CTA (pair, layer, K/V). Iterates in cold (payload) order so that the writes to
// the cold tier (the slow link when it is host memory) are contiguous.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kInt8Threads)
    Int8EncodeKernel(const T* __restrict__ k_pool, const T* __restrict__ v_pool,
                     const int32_t* __restrict__ pairs, char* __restrict__ cold_base, Int8Args a,
                     uint32_t* error_word, bool validate_only) {
  extern __shared__ float smem[];  // [H]: amax bits, then scales
  int64_t hot, cold;
  if (!LoadPair(pairs, a, true, hot, cold, error_word) || validate_only) return;
  const int l = blockIdx.y, kv = blockIdx.z;
  const int P = int(a.s.page_size), H = int(a.s.num_kv_heads), D = int(a.s.head_dim);
  const int PD = P * D;
  const T* piece = (kv ? v_pool : k_pool) + a.s.piece_offset(l, hot);
  char* page = cold_base + cold * a.cold_page_bytes;
  int8_t* payload = reinterpret_cast<int8_t*>(page + a.lay.payload_offset(a.s, l, kv, 0));
  auto* amax = reinterpret_cast<unsigned*>(smem);

  for (int h = threadIdx.x; h < H; h += blockDim.x) amax[h] = 0u;
  __syncthreads();
  // NOTE: |x| >= 0, so float order equals unsigned bit order; NaN never passes `> m`.
  if constexpr (kVec) {
    ForEachVectorOfPiece(piece, H, D, PD, [&](const PieceSlot& at, const float (&x)[16]) {
      float m = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) m = fabsf(x[j]) > m ? fabsf(x[j]) : m;
      if (m > 0.f) atomicMax(&amax[at.h], __float_as_uint(m));
    });
  } else {
    const int total = H * PD;
    for (int e = threadIdx.x; e < total; e += blockDim.x) {
      const float t = fabsf(DTypeTraits<T>::to_float(piece[e]));
      if (t > 0.f) atomicMax(&amax[(e / D) % H], __float_as_uint(t));
    }
  }
  __syncthreads();
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    float s = __uint_as_float(amax[h]) / 127.f;
    if (!(s > 0.f)) s = 1.f;
    smem[h] = s;
    *reinterpret_cast<float*>(page + a.lay.scale_offset(a.s, l, kv, h)) = s;
  }
  __syncthreads();
  if constexpr (kVec) {
    ForEachVectorOfPiece(piece, H, D, PD, [&](const PieceSlot& at, const float (&x)[16]) {
      const float s = smem[at.h];
      uint4 out;
      int8_t* q = reinterpret_cast<int8_t*>(&out);
#pragma unroll
      for (int j = 0; j < 16; ++j) q[j] = Quantize(x[j], s);
      *reinterpret_cast<uint4*>(payload + int64_t(at.h) * PD + at.e) = out;
    });
  } else {
    const int total = H * PD;
    for (int c = threadIdx.x; c < total; c += blockDim.x) {
      const PieceSlot at = SlotInPiece(c, PD, 1, H, D);
      payload[c] = Quantize(DTypeTraits<T>::to_float(piece[at.offset]), smem[at.h]);
    }
  }
  if (l == gridDim.y - 1 && kv == 1) {  // zero the padding (< 16 bytes each)
    for (int64_t b = a.lay.payload_bytes + threadIdx.x; b < a.lay.scales_offset; b += blockDim.x)
      page[b] = 0;
    for (int64_t b = a.lay.scales_end + threadIdx.x; b < a.cold_page_bytes; b += blockDim.x)
      page[b] = 0;
  }
}

// grid (n, L, 2): CTA (pair, layer, K/V), reading the cold page contiguously.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kInt8Threads)
    Int8DecodeKernel(T* __restrict__ k_pool, T* __restrict__ v_pool,
                     const int32_t* __restrict__ pairs, const char* __restrict__ cold_base,
                     Int8Args a, uint32_t* error_word, bool validate_only) {
  extern __shared__ float smem[];  // [H] scales
  int64_t hot, cold;
  if (!LoadPair(pairs, a, false, hot, cold, error_word) || validate_only) return;
  const int l = blockIdx.y, kv = blockIdx.z;
  const int P = int(a.s.page_size), H = int(a.s.num_kv_heads), D = int(a.s.head_dim);
  const int PD = P * D;
  T* piece = (kv ? v_pool : k_pool) + a.s.piece_offset(l, hot);
  const char* page = cold_base + cold * a.cold_page_bytes;
  const int8_t* payload =
      reinterpret_cast<const int8_t*>(page + a.lay.payload_offset(a.s, l, kv, 0));
  for (int h = threadIdx.x; h < H; h += blockDim.x)
    smem[h] = *reinterpret_cast<const float*>(page + a.lay.scale_offset(a.s, l, kv, h));
  __syncthreads();
  if constexpr (kVec) {
    const int per_head = PD / 16, total = H * per_head;
    for (int v = threadIdx.x; v < total; v += blockDim.x) {
      const PieceSlot at = SlotInPiece(v, per_head, 16, H, D);
      const uint4 in = *reinterpret_cast<const uint4*>(payload + int64_t(at.h) * PD + at.e);
      const int8_t* q = reinterpret_cast<const int8_t*>(&in);
      const float s = smem[at.h];
      float x[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) x[j] = Int8Dequantize(q[j], s);
      Store16(piece + at.offset, x);
    }
  } else {
    const int total = H * PD;
    for (int c = threadIdx.x; c < total; c += blockDim.x) {
      const PieceSlot at = SlotInPiece(c, PD, 1, H, D);
      piece[at.offset] = DTypeTraits<T>::from_float(Int8Dequantize(payload[c], smem[at.h]));
    }
  }
}

}  // namespace kvcm::cuda::codec
