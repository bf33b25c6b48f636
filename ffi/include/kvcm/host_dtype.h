// Host-side bfloat16 / float16 <-> float32 conversions (round to nearest even), for the CPU twin.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvcm {

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };
struct fp8e4m3_t { uint8_t bits; };  // float8_e4m3fn: bias 7, no inf, 0x7f / 0xff = NaN

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

inline float ToFloat(fp8e4m3_t x) {
  const uint32_t sign = uint32_t(x.bits & 0x80) << 24;
  const uint32_t exp = (x.bits >> 3) & 0xf;
  const uint32_t man = x.bits & 0x7;
  if (exp == 0xf && man == 0x7) return BitsToFloat(sign | 0x7fc00000u);  // nan
  if (exp == 0) {                                                         // zero / subnormal
    const float v = float(man) * (1.0f / 512.0f);                         // man * 2^-9
    return sign ? -v : v;
  }
  return BitsToFloat(sign | ((exp + 120) << 23) | (man << 20));
}

// float8_e4m3fn of x, rounded to nearest even and saturated to +-448 (inf included); NaN -> NaN.
inline fp8e4m3_t SaturateToFp8(float x) {
  const uint32_t u = FloatToBits(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return fp8e4m3_t{uint8_t(sign | 0x7f)};
  if (a >= 0x43e00000u) return fp8e4m3_t{uint8_t(sign | 0x7e)};  // >= 448
  if (a < 0x3c800000u) {                                          // < 2^-6: subnormal (or 0)
    const float v = BitsToFloat(a) * 512.0f;                      // exact; < 8
    uint32_t m = uint32_t(v);
    const float frac = v - float(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;           // m == 8 is 2^-6, encoded 0x08
    return fp8e4m3_t{uint8_t(sign | m)};
  }
  uint32_t r = ((((a >> 23) - 120) << 3) | ((a >> 20) & 0x7));
  const uint32_t rest = a & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (r & 1u))) ++r;  // < 448 stays <= 0x7e
  return fp8e4m3_t{uint8_t(sign | r)};
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
