// CRC32C (Castagnoli, reflected polynomial 0x82F63B78, init and final xor ~0), the disk tier's
// per-page checksum: Crc32c("123456789") == 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvcm::runtime {

// With the CPU's CRC instruction when it has one, else the table-driven path.
uint32_t Crc32c(const void* data, size_t nbytes);

// The table-driven path (slicing-by-8) only: a test oracle for the hardware one.
uint32_t Crc32cSoftware(const void* data, size_t nbytes);

// Which path Crc32c takes: "sse4.2", "armv8-crc" or "software".
const char* Crc32cImplementation();

}  // namespace kvcm::runtime
