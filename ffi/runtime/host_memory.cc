// Host tier memory on CPU builds: zero-initialized, aligned host buffers owned by the extension.
//
// HostBuffer(nbytes, alignment=4096) maps anonymous memory (zero pages, committed lazily by the
// kernel) and trims the mapping to the requested alignment. Its address never moves and stays valid
// until the object is destroyed; view() hands out numpy arrays over the same bytes that keep the
// buffer alive (they reference the Python object), so the memory outlives every view.
//
// NOTE: on CPU the "device address" is the host address: the CPU custom calls read and write the
// host tier through it directly.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>

#include "byte_view.h"
#include "system.h"

namespace nb = nanobind;
using kvcm::runtime::SystemPageSize;

namespace {

class HostBuffer {
 public:
  HostBuffer(int64_t nbytes, int64_t alignment) {
    if (nbytes <= 0) {
      throw nb::value_error(("nbytes must be >= 1, got " + std::to_string(nbytes)).c_str());
    }
    if (alignment <= 0 || (alignment & (alignment - 1)) != 0) {
      throw nb::value_error(
          ("alignment must be a power of two, got " + std::to_string(alignment)).c_str());
    }
    const size_t page = SystemPageSize();
    const size_t align = static_cast<size_t>(alignment) > page ? static_cast<size_t>(alignment)
                                                               : page;
    const size_t want = static_cast<size_t>(nbytes);
    // NOTE: checked rounding; a size that cannot be mapped is an allocation failure.
    if (want > SIZE_MAX - 2 * align) throw std::bad_alloc();
    const size_t length = (want + page - 1) / page * page;
    const size_t extra = align > page ? align : 0;  // over-map, then trim to the alignment
    void* raw = mmap(nullptr, length + extra, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    uintptr_t aligned = (start + align - 1) / align * align;
    if (extra) {
      if (aligned > start) munmap(raw, aligned - start);
      uintptr_t end = start + length + extra;
      uintptr_t used_end = aligned + length;
      if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
    }
    data_ = reinterpret_cast<void*>(aligned);
    nbytes_ = want;
    length_ = length;
  }

  ~HostBuffer() {
    if (data_) munmap(data_, length_);
  }

  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  uintptr_t address() const { return reinterpret_cast<uintptr_t>(data_); }
  size_t nbytes() const { return nbytes_; }
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  size_t length_ = 0;
};

}  // namespace

void BindHostMemory(nb::module_& m) {
  nb::class_<HostBuffer>(m, "HostBuffer",
                         "Zero-initialized, aligned host memory owned by the extension (the host "
                         "tier on CPU builds). The address is fixed for the object's lifetime.")
      .def(nb::init<int64_t, int64_t>(), nb::arg("nbytes"), nb::arg("alignment") = 4096,
           "Maps ``nbytes`` zeroed bytes aligned to ``alignment`` (a power of two). Raises "
           "MemoryError when the memory cannot be mapped, ValueError for bad arguments.")
      .def_prop_ro("address", &HostBuffer::address, "Host address of the first byte.")
      .def_prop_ro("device_address", &HostBuffer::address,
                   "Address the custom calls use; equals ``address`` on CPU.")
      .def_prop_ro("nbytes", &HostBuffer::nbytes)
      .def_prop_ro("pinned", [](const HostBuffer&) { return false; },
                   "False: plain (pageable) host memory.")
      .def(
          "view",
          [](nb::handle self) {
            HostBuffer& b = nb::cast<HostBuffer&>(self);
            return kvcm::runtime::ByteViewOf(self, b.data(), b.nbytes());
          },
          "A writable uint8 numpy array over all bytes, without copying; keeps the buffer alive.")
      .def("__repr__", [](const HostBuffer& b) {
        char text[96];
        snprintf(text, sizeof(text), "HostBuffer(nbytes=%zu, address=0x%zx)", b.nbytes(),
                 static_cast<size_t>(b.address()));
        return std::string(text);
      });
}
