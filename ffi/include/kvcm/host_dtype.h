// Host-side bfloat16 / float16 <-> float32 conversions (round to nearest even), for the CPU twin.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvcm {

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

inline float BitsToFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t FloatToBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float ToFloat(float x) { return x; }
inline float ToFloat(bf16_t x) { return BitsToFloat(uint32_t(x.bits) << 16); }
inline float ToFloat(f16_t x) {
  uint32_t sign = uint32_t(x.bits & 0x8000) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1f;
  uint32_t man = x.bits & 0x3ff;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {                                                          // zero / subnormal
    if (man == 0) return BitsToFloat(sign);
    float v = float(man) * (1.0f / 16777216.0f);  // man * 2^-24
    return sign ? -v : v;
  }
  return BitsToFloat(sign | ((exp + 112) << 23) | (man << 13));
}

template <typename T> T FromFloat(float x);
template <> inline float FromFloat<float>(float x) { return x; }
template <> inline bf16_t FromFloat<bf16_t>(float x) {
  uint32_t u = FloatToBits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40)};  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{uint16_t(u >> 16)};
}
template <> inline f16_t FromFloat<f16_t>(float x) {
  uint32_t u = FloatToBits(x);
  uint16_t sign = uint16_t((u >> 16) & 0x8000);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16_t{uint16_t(sign | 0x7e00)};  // nan
  if (a >= 0x477ff000u) return f16_t{uint16_t(sign | 0x7c00)};  // rounds to inf
  if (a < 0x38800000u) {                                        // subnormal or zero in f16
    float v = BitsToFloat(a) * 16777216.0f;                     // scale by 2^24, round to int
    uint32_t m = uint32_t(v);
    float frac = v - float(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
    return f16_t{uint16_t(sign | m)};
  }
  uint32_t exp = (a >> 23) - 112;
  uint32_t man = a & 0x7fffffu;
  uint32_t h = (exp << 10) | (man >> 13);
  uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return f16_t{uint16_t(sign | h)};
}

}  // namespace kvcm
