// Facts about the host the runtime asks more than once.
#pragma once

#include <unistd.h>

#include <cstddef>

namespace kvcm::runtime {

// The system page size (4096 when sysconf cannot say).
inline size_t SystemPageSize() {
  const long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<size_t>(page) : 4096;
}

}  // namespace kvcm::runtime
