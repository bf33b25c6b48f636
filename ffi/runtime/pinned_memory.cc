// Pinned, mapped host memory for the host tier on CUDA builds.
//
// PinnedHostBuffer(nbytes) first asks cudaHostAlloc for mapped, portable pinned memory. If that
// fails it maps anonymous memory and registers it with cudaHostRegister (mapped, portable) in
// adjacent regions of at most 2 GiB; every region's device pointer must equal its host pointer
// (unified virtual addressing), so the buffer has one device-accessible address for the whole
// range. When neither works (no driver, no GPU, pinned-memory limits) it raises MemoryError with the
// CUDA error strings. The bytes are zeroed. The address never moves; view() hands out numpy arrays
// that reference the Python object, so the memory outlives every view.
//
// NOTE: the CUDA runtime is linked statically and calls into the driver lazily, so importing this
// module needs no driver; only constructing a buffer does.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "byte_view.h"
#include "system.h"

namespace nb = nanobind;
using kvcm::runtime::SystemPageSize;

namespace {

constexpr size_t kMaxRegisterBytes = size_t{1} << 31;  // 2 GiB per cudaHostRegister region

std::string CudaText(const char* call, cudaError_t err) {
  return std::string(call) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

class PinnedHostBuffer {
 public:
  explicit PinnedHostBuffer(int64_t nbytes) {
    if (nbytes <= 0) {
      throw nb::value_error(("nbytes must be >= 1, got " + std::to_string(nbytes)).c_str());
    }
    nbytes_ = static_cast<size_t>(nbytes);
    std::string error;
    {
      nb::gil_scoped_release release;
      error = Allocate();
    }
    if (!error.empty()) {
      std::string message = "cannot allocate " + std::to_string(nbytes_) +
                            " bytes of pinned host memory: " + error;
      PyErr_SetString(PyExc_MemoryError, message.c_str());
      throw nb::python_error();
    }
  }

  ~PinnedHostBuffer() { Release(); }

  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  uintptr_t address() const { return reinterpret_cast<uintptr_t>(data_); }
  uintptr_t device_address() const { return device_address_; }
  size_t nbytes() const { return nbytes_; }
  void* data() const { return data_; }
  bool registered() const { return !regions_.empty(); }

 private:
  // Returns "" on success, else the reasons of both attempts.
  std::string Allocate() {
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, nbytes_, cudaHostAllocMapped | cudaHostAllocPortable);
    if (err == cudaSuccess) {
      void* d = nullptr;
      cudaError_t derr = cudaHostGetDevicePointer(&d, p, 0);
      if (derr == cudaSuccess) {
        std::memset(p, 0, nbytes_);
        data_ = p;
        device_address_ = reinterpret_cast<uintptr_t>(d);
        return "";
      }
      cudaFreeHost(p);
      err = derr;
    }
    (void)cudaGetLastError();  // NOTE: clear the (non-sticky) error before the fallback
    std::string first = CudaText("cudaHostAlloc", err);
    std::string second = AllocateRegistered();
    if (second.empty()) return "";
    (void)cudaGetLastError();
    return first + "; fallback " + second;
  }

  std::string AllocateRegistered() {
    const size_t page = SystemPageSize();
    if (nbytes_ > SIZE_MAX - page) return "size overflow";
    const size_t length = (nbytes_ + page - 1) / page * page;
    void* raw = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return std::string("mmap: ") + std::strerror(errno);
    uint8_t* base = static_cast<uint8_t*>(raw);
    std::vector<std::pair<void*, size_t>> regions;
    std::string error;
    for (size_t offset = 0; offset < length; offset += kMaxRegisterBytes) {
      size_t len = length - offset < kMaxRegisterBytes ? length - offset : kMaxRegisterBytes;
      void* region = base + offset;
      cudaError_t err =
          cudaHostRegister(region, len, cudaHostRegisterMapped | cudaHostRegisterPortable);
      if (err != cudaSuccess) {
        error = CudaText("cudaHostRegister", err);
        break;
      }
      regions.emplace_back(region, len);
      void* d = nullptr;
      err = cudaHostGetDevicePointer(&d, region, 0);
      if (err != cudaSuccess) {
        error = CudaText("cudaHostGetDevicePointer", err);
        break;
      }
      if (d != region) {
        // NOTE: adjacent regions form one device range only when device == host address (UVA).
        char text[128];
        snprintf(text, sizeof(text),
                 "registered region at %p maps to device address %p (no unified addressing)",
                 region, d);
        error = text;
        break;
      }
    }
    if (!error.empty()) {
      for (auto& r : regions) cudaHostUnregister(r.first);
      munmap(raw, length);
      return error;
    }
    data_ = raw;
    device_address_ = reinterpret_cast<uintptr_t>(raw);
    map_length_ = length;
    regions_ = std::move(regions);
    return "";
  }

  void Release() noexcept {
    if (!data_) return;
    // NOTE: errors are ignored here (e.g. cudaErrorCudartUnloading at interpreter exit).
    if (regions_.empty()) {
      cudaFreeHost(data_);
    } else {
      for (auto& r : regions_) cudaHostUnregister(r.first);
      munmap(data_, map_length_);
    }
    (void)cudaGetLastError();
    data_ = nullptr;
  }

  void* data_ = nullptr;
  size_t nbytes_ = 0;
  uintptr_t device_address_ = 0;
  size_t map_length_ = 0;                           // registered path only
  std::vector<std::pair<void*, size_t>> regions_;  // registered path only
};

}  // namespace

void BindPinnedMemory(nb::module_& m) {
  nb::class_<PinnedHostBuffer>(m, "PinnedHostBuffer",
                               "Zeroed, pinned, device-mapped host memory (the host tier on CUDA "
                               "builds). The address is fixed for the object's lifetime.")
      .def(nb::init<int64_t>(), nb::arg("nbytes"),
           "cudaHostAlloc (mapped, portable), else aligned memory registered with "
           "cudaHostRegister in regions of at most 2 GiB. MemoryError (with the CUDA error "
           "strings) when neither works.")
      .def_prop_ro("address", &PinnedHostBuffer::address, "Host address of the first byte.")
      .def_prop_ro("device_address", &PinnedHostBuffer::device_address,
                   "Device-accessible address of the first byte (cudaHostGetDevicePointer).")
      .def_prop_ro("nbytes", &PinnedHostBuffer::nbytes)
      .def_prop_ro("pinned", [](const PinnedHostBuffer&) { return true; })
      .def_prop_ro("registered", &PinnedHostBuffer::registered,
                   "True when the memory came from the cudaHostRegister fallback.")
      .def(
          "view",
          [](nb::handle self) {
            PinnedHostBuffer& b = nb::cast<PinnedHostBuffer&>(self);
            return kvcm::runtime::ByteViewOf(self, b.data(), b.nbytes());
          },
          "A writable uint8 numpy array over all bytes, without copying; keeps the buffer alive.")
      .def("__repr__", [](const PinnedHostBuffer& b) {
        char text[128];
        snprintf(text, sizeof(text), "PinnedHostBuffer(nbytes=%zu, address=0x%zx%s)", b.nbytes(),
                 static_cast<size_t>(b.address()), b.registered() ? ", registered" : "");
        return std::string(text);
      });
}
