// Cold-page codecs: layout math and argument checks shared by the CPU and CUDA handlers.
//
// Hot side (one layer group's hot pool group):
//   k_pool, v_pool   [L, S, P, H, D]   (num_layers, num_slots, page_size, num_kv_heads, head_dim)
//                    or, slot-major (the slot_major attribute; the arena), [S, L, P, H, D]
//   hot page s       = slot s of both pools: 2 * L pieces of P * H * D elements.
//   piece (l, kv, s) = pool_kv[l, s] (slot-major: pool_kv[s, l]), contiguous, at element offset
//                      (l * S + s) * P * H * D (slot-major: (s * L + l) * P * H * D).
//   The cold page of a hot page is the same bytes in both layouts.
//
// Index pairs: int32 [n, 2], array of structures (dst, src), one 8-byte load per pair on the GPU.
//   encode: dst = cold slot, src = hot slot.     decode: dst = hot slot, src = cold slot.
//   Cold page c lives at  address + c * cold_page_bytes.
//
// ConcatCodec cold page (lossless, cold_page_bytes = 2 * L * P * H * D * itemsize):
//   for l in [0, L): piece (l, K) bytes, then piece (l, V) bytes
//   i.e. piece (l, kv) at byte offset (2 * l + kv) * P * H * D * itemsize, in the hot element order
//   [P, H, D]: the cold page is the hot page's bytes, layer-interleaved K/V.
//
// Int8Codec cold page (lossy):
//   payload: for l, for kv in (K, V), for h: int8 [P, D]
//            block (l, kv, h) at byte ((2 * l + kv) * H + h) * P * D; element (p, d) at p * D + d
//   scales:  float32 (native little-endian), scale (l, kv, h) at
//            scales_offset + ((2 * l + kv) * H + h) * 4,
//            scales_offset = RoundUp(2 * L * H * P * D, 16)
//   cold_page_bytes = RoundUp(scales_offset + 2 * L * H * 4, 16); padding bytes are written as 0.
//   The CPU handler computes with IEEE subnormals (XLA's CPU runtime flushes them), like CUDA.
//   Quantization of block (l, kv, h) with values x (converted to float32, exact):
//     amax = max |x| (NaN ignored);  s = amax / 127 in float32 (s = 1 when that is 0);
//     q = rint(clamp(x / s, -127, 127)) (float32 division, round half to even);
//   dequantization: y = T(clamp(float(q) * s, -FLT_MAX, FLT_MAX)) (float32 multiply; the clamp
//     only matters when amax is within 2^-23 of FLT_MAX; round to nearest even into T).
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include "kvcm/shapes.h"

namespace kvcm {

enum class CodecKind { kConcat, kInt8 };

// Bits of the codec handlers' int32 "options" attribute (the codec's configuration; the CPU
// handlers always check indices and have one data mover, so they ignore them).
enum CodecOptionBits : int32_t {
  kOptCheckIndices = 1 << 0,   // CUDA int8: validate the device pairs first, raise on bad ones
  kOptConcatMemcpy = 1 << 1,   // CUDA concat: memcpy mover even when the copy kernel could run
  kOptNoMemcpyBatch = 1 << 2,  // CUDA concat memcpy mover: one cudaMemcpyAsync per piece
  kOptSideStream = 1 << 3,     // CUDA concat encode: memcpy mover on a side stream, with a ticket
};

// Dequantized float32 value of one int8 element (see the file comment).
KVCM_HD inline float Int8Dequantize(int8_t q, float scale) {
  const float y = float(q) * scale;
  constexpr float kMax = 3.40282346638528859812e+38f;  // FLT_MAX
  return y > kMax ? kMax : (y < -kMax ? -kMax : y);
}

KVCM_HD inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Required alignment of the cold tier's base address (both codecs; host tier slots are aligned far
// beyond this). With cold_page_bytes a multiple of 16 for the int8 codec, every int8 cold page,
// payload row block and scale array is 16-byte aligned.
constexpr uint64_t kColdAddressAlignment = 16;

struct HotPoolShape {
  int64_t num_layers = 0;
  int64_t num_slots = 0;
  int64_t page_size = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t itemsize = 0;
  DType dtype = DType::kF32;
  PoolStrides strides;  // of the layout, in elements

  KVCM_HD int64_t piece_elems() const { return page_size * num_kv_heads * head_dim; }
  KVCM_HD int64_t piece_bytes() const { return piece_elems() * itemsize; }
  // Element offset of piece (l, s) inside one pool.
  KVCM_HD int64_t piece_offset(int64_t layer, int64_t slot) const {
    return layer * strides.layer + slot * strides.page;
  }
  KVCM_HD int64_t head_block_elems() const { return page_size * head_dim; }
};

// Byte layout of an int8 cold page (see the file comment).
struct Int8Layout {
  int64_t payload_bytes = 0;  // 2 * L * H * P * D
  int64_t scales_offset = 0;  // RoundUp(payload_bytes, 16)
  int64_t scales_end = 0;     // scales_offset + 2 * L * H * 4
  int64_t cold_page_bytes = 0;

  KVCM_HD static Int8Layout Of(const HotPoolShape& s) {
    Int8Layout r;
    r.payload_bytes = 2 * s.num_layers * s.num_kv_heads * s.head_block_elems();
    r.scales_offset = RoundUp(r.payload_bytes, 16);
    r.scales_end = r.scales_offset + 2 * s.num_layers * s.num_kv_heads * 4;
    r.cold_page_bytes = RoundUp(r.scales_end, 16);
    return r;
  }
  // Index of block (l, kv, h) among the 2 * L * H blocks.
  KVCM_HD static int64_t Block(const HotPoolShape& s, int64_t layer, int64_t kv, int64_t head) {
    return (2 * layer + kv) * s.num_kv_heads + head;
  }
  KVCM_HD int64_t payload_offset(const HotPoolShape& s, int64_t layer, int64_t kv,
                                 int64_t head) const {
    return Block(s, layer, kv, head) * s.head_block_elems();
  }
  KVCM_HD int64_t scale_offset(const HotPoolShape& s, int64_t layer, int64_t kv,
                               int64_t head) const {
    return scales_offset + Block(s, layer, kv, head) * 4;
  }
};

KVCM_HD inline int64_t ConcatColdPageBytes(const HotPoolShape& s) {
  return 2 * s.num_layers * s.piece_bytes();
}

KVCM_HD inline int64_t ColdPageBytes(CodecKind kind, const HotPoolShape& s) {
  return kind == CodecKind::kConcat ? ConcatColdPageBytes(s) : Int8Layout::Of(s).cold_page_bytes;
}

inline const char* CodecName(CodecKind kind) {
  return kind == CodecKind::kConcat ? "concat" : "int8";
}

// A parsed codec call. Cold slot c is valid iff 0 <= c < cold_limit; cold_limit is the caller's
// num_cold_slots (when >= 0) capped so that address + cold_limit * cold_page_bytes cannot overflow.
struct CodecCall {
  HotPoolShape hot;
  int64_t num_pairs = 0;
  int64_t cold_page_bytes = 0;
  int64_t cold_limit = 0;
};

// Shape, dtype and attribute checks of encode_pages / decode_pages (both codecs, both platforms).
// slot_major: the pools are [num_slots, num_layers, page_size, num_kv_heads, head_dim].
inline ffi::ErrorOr<CodecCall> ParseCodecCall(CodecKind kind, const ffi::AnyBuffer& k_pool,
                                              const ffi::AnyBuffer& v_pool,
                                              const ffi::AnyBuffer& index_pairs, uint64_t address,
                                              int64_t num_cold_slots, bool slot_major) {
  auto kd = k_pool.dimensions();
  auto vd = v_pool.dimensions();
  if (kd.size() != 5)
    return Fail(std::string("k_pool must have rank 5 ") +
                (slot_major ? "[num_slots, num_layers" : "[num_layers, num_slots") +
                ", page_size, num_kv_heads, head_dim], got shape " + DimsToString(kd));
  bool same = vd.size() == kd.size();
  for (size_t i = 0; same && i < kd.size(); ++i) same = kd[i] == vd[i];
  if (!same)
    return Fail("v_pool shape " + DimsToString(vd) + " must equal k_pool shape " +
                DimsToString(kd));
  auto dt = ToDType(k_pool.element_type());
  if (!dt) return Fail("k_pool dtype must be float32, bfloat16, float16 or float8_e4m3fn");
  if (kind == CodecKind::kInt8 && *dt == DType::kF8E4M3)
    return Fail("k_pool: the int8 codec does not take float8_e4m3fn pools (their scales live "
                "outside the pages); use the concat codec, which moves fp8 pages byte-exactly");
  if (v_pool.element_type() != k_pool.element_type())
    return Fail("v_pool dtype must equal k_pool dtype");
  CodecCall c;
  c.hot.num_layers = kd[slot_major ? 1 : 0];
  c.hot.num_slots = kd[slot_major ? 0 : 1];
  c.hot.page_size = kd[2];
  c.hot.num_kv_heads = kd[3];
  c.hot.head_dim = kd[4];
  c.hot.itemsize = int64_t(ffi::ByteWidth(k_pool.element_type()));
  c.hot.dtype = *dt;
  for (int64_t d : kd)
    if (d < 1) return Fail("k_pool has an empty dimension: " + DimsToString(kd));
  c.hot.strides =
      PoolStrides::Of(slot_major, c.hot.num_layers, c.hot.num_slots, c.hot.piece_elems());
  // NOTE: at most 2^40 bytes per hot page (the concat cold page, the larger of the two formats)
  // keeps every offset product below far from int64 overflow.
  const double approx = 2.0 * double(c.hot.num_layers) * double(kd[2]) * double(kd[3]) *
                        double(kd[4]) * double(c.hot.itemsize);
  if (approx > double(int64_t(1) << 40) ||
      c.hot.num_slots > int64_t(std::numeric_limits<int32_t>::max()))
    return Fail("k_pool shape " + DimsToString(kd) + " is too large for a cold page");
  auto pd = index_pairs.dimensions();
  if (index_pairs.element_type() != ffi::DataType::S32 || pd.size() != 2 || pd[1] != 2)
    return Fail("index_pairs must be int32 [n, 2] (dst, src) pairs, got shape " +
                DimsToString(pd));
  c.num_pairs = pd[0];
  c.cold_page_bytes = ColdPageBytes(kind, c.hot);
  if (address == 0 && c.num_pairs > 0) return Fail("address (the cold tier base) must not be 0");
  if (address % kColdAddressAlignment != 0)
    return Fail("address " + std::to_string(address) + " must be a multiple of " +
                std::to_string(kColdAddressAlignment));
  const uint64_t room = (std::numeric_limits<uint64_t>::max() - address) /
                        uint64_t(c.cold_page_bytes);
  int64_t limit = room > uint64_t(std::numeric_limits<int32_t>::max())
                      ? int64_t(std::numeric_limits<int32_t>::max()) + 1
                      : int64_t(room);
  if (num_cold_slots >= 0 && num_cold_slots < limit) limit = num_cold_slots;
  c.cold_limit = limit;
  return c;
}

// Host-side check of every pair (CPU handlers; CUDA handlers with host index pairs). Returns an
// error naming index_pairs for the first bad entry; nothing has been written at that point.
inline ffi::Error CheckIndexPairs(const int32_t* pairs, const CodecCall& c, bool encode) {
  for (int64_t i = 0; i < c.num_pairs; ++i) {
    const int32_t dst = pairs[2 * i], src = pairs[2 * i + 1];
    const int32_t hot = encode ? src : dst, cold = encode ? dst : src;
    if (hot < 0 || hot >= c.hot.num_slots || cold < 0 || cold >= c.cold_limit) {
      std::string what =
          (hot < 0 || hot >= c.hot.num_slots)
              ? "hot slot " + std::to_string(hot) + " is outside the hot pool [0, " +
                    std::to_string(c.hot.num_slots) + ")"
              : "cold slot " + std::to_string(cold) + " is outside the cold tier [0, " +
                    std::to_string(c.cold_limit) + ")";
      return Invalid("index_pairs[" + std::to_string(i) + "] = (dst=" + std::to_string(dst) +
                     ", src=" + std::to_string(src) + "): " + what);
    }
  }
  return ffi::Error::Success();
}

}  // namespace kvcm
