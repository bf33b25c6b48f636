// The uint8 numpy view the runtime's memory objects hand out (``view()``).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>

namespace kvcm::runtime {

using ByteView = nanobind::ndarray<nanobind::numpy, uint8_t, nanobind::ndim<1>,
                                   nanobind::c_contig, nanobind::device::cpu>;

// A writable uint8 [nbytes] array over `data`, no copy. NOTE: it references `owner` (the Python
// object owning the memory), so the memory outlives every view.
inline ByteView ByteViewOf(nanobind::handle owner, void* data, size_t nbytes) {
  size_t shape[1] = {nbytes};
  return ByteView(data, 1, shape, owner);
}

}  // namespace kvcm::runtime
