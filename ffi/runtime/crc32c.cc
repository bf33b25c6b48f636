// CRC32C (crc32c.h). Hardware instructions when the CPU has them (SSE4.2 on x86, the
// CRC extension on ARMv8), else slicing-by-8 tables. The hardware path runs three independent
// streams over thirds of a large buffer and combines them (GF(2) polynomial arithmetic, as zlib's
// crc32_combine), which hides the instruction's latency.
#include "crc32c.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#define KVCM_CRC32C_X86 1
#elif defined(__aarch64__) && defined(__linux__)
#include <arm_acle.h>
#include <asm/hwcap.h>
#include <sys/auxv.h>
#define KVCM_CRC32C_ARM 1
#endif

#include <cstring>

namespace kvcm::runtime {
namespace {

constexpr uint32_t kCrc32cPoly = 0x82F63B78u;

struct Crc32cTables {
  uint32_t slice[8][256];
  uint32_t x2n[32];  // x^(2^k) mod P
};

uint32_t MultModP(uint32_t a, uint32_t b) {  // a(x) * b(x) mod P(x), reflected
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kCrc32cPoly : b >> 1;
  }
  return p;
}

const Crc32cTables& Tables() {
  static const Crc32cTables tables = [] {
    Crc32cTables t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
      t.slice[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) {
        uint32_t prev = t.slice[s - 1][i];
        t.slice[s][i] = (prev >> 8) ^ t.slice[0][prev & 0xff];
      }
    }
    uint32_t p = 1u << 30;  // x^1
    t.x2n[0] = p;
    for (int k = 1; k < 32; ++k) t.x2n[k] = p = MultModP(p, p);
    return t;
  }();
  return tables;
}

// x^(8 * nbytes) mod P: the operator that shifts a CRC over nbytes zero bytes.
uint32_t ShiftOperator(uint64_t nbytes) {
  const Crc32cTables& t = Tables();
  uint32_t p = 1u << 31;  // x^0
  unsigned k = 3;         // 8 * nbytes = nbytes * 2^3
  while (nbytes) {
    if (nbytes & 1) p = MultModP(t.x2n[k & 31], p);
    nbytes >>= 1;
    ++k;
  }
  return p;
}

// Raw (unconditioned) update: the caller applies the ~ before and after.
uint32_t Crc32cSoftwareRaw(uint32_t crc, const uint8_t* p, size_t n) {
  const Crc32cTables& t = Tables();
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = (crc >> 8) ^ t.slice[0][(crc ^ *p++) & 0xff];
    --n;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);  // little-endian hosts only (x86, aarch64 Linux)
    v ^= crc;
    crc = t.slice[7][v & 0xff] ^ t.slice[6][(v >> 8) & 0xff] ^ t.slice[5][(v >> 16) & 0xff] ^
          t.slice[4][(v >> 24) & 0xff] ^ t.slice[3][(v >> 32) & 0xff] ^
          t.slice[2][(v >> 40) & 0xff] ^ t.slice[1][(v >> 48) & 0xff] ^ t.slice[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t.slice[0][(crc ^ *p++) & 0xff];
  return crc;
}

// The hardware step: one 8-byte word (crc64 keeps the 32-bit CRC in its low half).
#if defined(KVCM_CRC32C_X86)
#define KVCM_HW_TARGET __attribute__((target("sse4.2")))
KVCM_HW_TARGET inline uint32_t HwWord(uint32_t c, uint64_t v) {
  return static_cast<uint32_t>(_mm_crc32_u64(c, v));
}
KVCM_HW_TARGET inline uint32_t HwByte(uint32_t c, uint8_t v) { return _mm_crc32_u8(c, v); }
bool HaveHwCrc() {
  __builtin_cpu_init();  // NOTE: needed when called from a static initializer
  return __builtin_cpu_supports("sse4.2");
}
constexpr const char* kHwName = "sse4.2";
#elif defined(KVCM_CRC32C_ARM)
#define KVCM_HW_TARGET __attribute__((target("+crc")))
KVCM_HW_TARGET inline uint32_t HwWord(uint32_t c, uint64_t v) { return __crc32cd(c, v); }
KVCM_HW_TARGET inline uint32_t HwByte(uint32_t c, uint8_t v) { return __crc32cb(c, v); }
bool HaveHwCrc() { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
constexpr const char* kHwName = "armv8-crc";
#endif

#if defined(KVCM_HW_TARGET)
KVCM_HW_TARGET uint32_t Crc32cHwRaw(uint32_t crc, const uint8_t* p, size_t n) {
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);  // unaligned loads are fine on x86-64 and aarch64
    crc = HwWord(crc, v);
  }
  for (; n; --n) crc = HwByte(crc, *p++);
  return crc;
}

// Three independent streams in one loop, so the instruction's latency is hidden.
KVCM_HW_TARGET void Crc32cHwRaw3(uint32_t* a, uint32_t* b, uint32_t* c, const uint8_t* pa,
                                 const uint8_t* pb, const uint8_t* pc, size_t words) {
  uint32_t x = *a, y = *b, z = *c;
  for (size_t i = 0; i < words; ++i) {
    uint64_t u, v, w;
    std::memcpy(&u, pa + 8 * i, 8);
    std::memcpy(&v, pb + 8 * i, 8);
    std::memcpy(&w, pc + 8 * i, 8);
    x = HwWord(x, u);
    y = HwWord(y, v);
    z = HwWord(z, w);
  }
  *a = x;
  *b = y;
  *c = z;
}

// Conditioned CRC with the hardware instruction; large buffers run as three streams over thirds
// A, B, C. The raw register update is linear: R(s, X || Y) = shift(R(s, X), |Y|) ^ R(0, Y), so
// crc = ~(shift(shift(R(~0, A), |B|) ^ R(0, B), |C|) ^ R(0, C)).
uint32_t Crc32cHardware(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  constexpr size_t kStreamMin = 3 * 4096;
  if (n < kStreamMin) return ~Crc32cHwRaw(~0u, p, n);
  const size_t third = (n / 3) & ~size_t{7};
  const size_t last = n - 2 * third;
  uint32_t a = ~0u, b = 0, c = 0;
  Crc32cHwRaw3(&a, &b, &c, p, p + third, p + 2 * third, third / 8);
  c = Crc32cHwRaw(c, p + 3 * third, last - third);
  const uint32_t ab = MultModP(ShiftOperator(third), a) ^ b;
  return ~(MultModP(ShiftOperator(last), ab) ^ c);
}
#else
bool HaveHwCrc() { return false; }
constexpr const char* kHwName = "software";
uint32_t Crc32cHardware(const void* data, size_t n) {
  return ~Crc32cSoftwareRaw(~0u, static_cast<const uint8_t*>(data), n);
}
#endif

const bool kUseHwCrc = HaveHwCrc();

}  // namespace

uint32_t Crc32c(const void* data, size_t nbytes) {
  return kUseHwCrc ? Crc32cHardware(data, nbytes) : Crc32cSoftware(data, nbytes);
}

uint32_t Crc32cSoftware(const void* data, size_t nbytes) {
  return ~Crc32cSoftwareRaw(~0u, static_cast<const uint8_t*>(data), nbytes);
}

const char* Crc32cImplementation() { return kUseHwCrc ? kHwName : "software"; }

}  // namespace kvcm::runtime
