// The contiguous arena's memory on CUDA builds: one virtual reservation (cuMemAddressReserve) whose
// super-pages are backed on demand by physical allocations (cuMemCreate + cuMemMap +
// cuMemSetAccess), the same semantics as the CPU ArenaReservation (ffi/cpu/arena_cpu.cc).
//
// The driver functions are looked up once at run time (cudaGetDriverEntryPointByVersion, ABI of
// CUDA 10.2 when VMM appeared): the runtime is linked statically, so the module imports with no
// driver; constructing a reservation on a machine without VMM support raises RuntimeError saying
// so (the paged backend keeps working).
//
// NOTE: unmap() does not synchronize anything: the caller (jax_kvcm/_arena.py) unmaps only after
// the fences of every dispatched step that may read the super-page are complete (the seed's bug
// (c): cuMemUnmap under a running reader faults).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvcm/arena_dtype.h"

namespace nb = nanobind;

namespace {

struct VmmApi {
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  std::string missing;  // "" when every entry point was found
};

template <typename Fn>
void Lookup(const char* name, int version, Fn& fn, std::string& missing) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess || p == nullptr) {
    (void)cudaGetLastError();
    if (!missing.empty()) missing += ", ";
    missing += name;
    p = nullptr;
  }
  fn = reinterpret_cast<Fn>(p);
}

const VmmApi& Api() {
  static const VmmApi api = [] {
    VmmApi a;
    Lookup("cuDeviceGet", 2000, a.device_get, a.missing);
    Lookup("cuDeviceGetAttribute", 2000, a.device_get_attribute, a.missing);
    Lookup("cuMemGetAllocationGranularity", 10020, a.granularity, a.missing);
    Lookup("cuMemAddressReserve", 10020, a.address_reserve, a.missing);
    Lookup("cuMemAddressFree", 10020, a.address_free, a.missing);
    Lookup("cuMemCreate", 10020, a.create, a.missing);
    Lookup("cuMemRelease", 10020, a.release, a.missing);
    Lookup("cuMemMap", 10020, a.map, a.missing);
    Lookup("cuMemUnmap", 10020, a.unmap, a.missing);
    Lookup("cuMemSetAccess", 10020, a.set_access, a.missing);
    Lookup("cuGetErrorName", 6000, a.error_name, a.missing);
    return a;
  }();
  return api;
}

std::string CuText(const char* call, CUresult r) {
  const char* name = nullptr;
  if (Api().error_name) Api().error_name(r, &name);
  return std::string(call) + " failed: " + (name ? name : ("CUresult " + std::to_string(r)));
}

[[noreturn]] void Raise(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw nb::python_error();
}

// Checks the driver, the device and its VMM support; returns the CUdevice.
CUdevice CheckedDevice(int device) {
  const VmmApi& api = Api();
  if (!api.missing.empty()) {
    Raise(PyExc_RuntimeError,
          "the CUDA driver has no virtual memory management entry points (" + api.missing +
              "): the arena backend cannot be used here; the paged backend still works");
  }
  if (device < 0) {
    cudaError_t e = cudaGetDevice(&device);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      Raise(PyExc_RuntimeError, std::string("cudaGetDevice failed: ") + cudaGetErrorName(e));
    }
  }
  cudaFree(nullptr);  // NOTE: initializes the driver and the device's primary context
  (void)cudaGetLastError();
  CUdevice dev = 0;
  CUresult r = api.device_get(&dev, device);
  if (r != CUDA_SUCCESS) Raise(PyExc_RuntimeError, CuText("cuDeviceGet", r));
  int supported = 0;
  r = api.device_get_attribute(&supported,
                               CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (r != CUDA_SUCCESS) Raise(PyExc_RuntimeError, CuText("cuDeviceGetAttribute", r));
  if (!supported) {
    Raise(PyExc_RuntimeError, "device " + std::to_string(device) +
                                  " does not support CUDA virtual memory management: the arena "
                                  "backend cannot be used here; the paged backend still works");
  }
  return dev;
}

CUmemAllocationProp Prop(int device) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

int64_t Granularity(int device) {
  CUdevice dev = CheckedDevice(device);
  CUmemAllocationProp prop = Prop(static_cast<int>(dev));
  size_t g = 0;
  CUresult r = Api().granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) Raise(PyExc_RuntimeError, CuText("cuMemGetAllocationGranularity", r));
  return static_cast<int64_t>(g);
}

class VmmReservation {
 public:
  VmmReservation(int64_t nbytes, int64_t super_page_bytes, int device) {
    CUdevice dev = CheckedDevice(device);
    device_ = static_cast<int>(dev);
    const int64_t gran = Granularity(device_);
    if (super_page_bytes <= 0 || super_page_bytes % gran != 0) {
      throw nb::value_error(("super_page_bytes must be a positive multiple of the driver's "
                             "granularity " + std::to_string(gran) + ", got " +
                             std::to_string(super_page_bytes)).c_str());
    }
    if (nbytes <= 0 || nbytes % super_page_bytes != 0) {
      throw nb::value_error(("nbytes must be a positive multiple of super_page_bytes (" +
                             std::to_string(super_page_bytes) + "), got " +
                             std::to_string(nbytes)).c_str());
    }
    sp_ = static_cast<size_t>(super_page_bytes);
    nbytes_ = static_cast<size_t>(nbytes);
    CUresult r = Api().address_reserve(&base_, nbytes_, sp_, 0, 0);
    if (r != CUDA_SUCCESS) {
      base_ = 0;
      Raise(PyExc_MemoryError, "cannot reserve " + std::to_string(nbytes_) +
                                   " bytes of device address space for the arena (" +
                                   CuText("cuMemAddressReserve", r) + ")");
    }
    mapping_.assign(nbytes_ / sp_, -1);
  }

  ~VmmReservation() { Close(); }
  VmmReservation(const VmmReservation&) = delete;
  VmmReservation& operator=(const VmmReservation&) = delete;

  int64_t CreatePhysical() {
    CheckOpen();
    CUmemAllocationProp prop = Prop(device_);
    CUmemGenericAllocationHandle handle = 0;
    CUresult r = Api().create(&handle, sp_, &prop, 0);
    if (r != CUDA_SUCCESS) {
      Raise(PyExc_MemoryError, "cannot allocate a " + std::to_string(sp_) +
                                   "-byte arena super-page: " + CuText("cuMemCreate", r));
    }
    int64_t h;
    if (!free_ids_.empty()) {
      h = free_ids_.back();
      free_ids_.pop_back();
      handles_[h] = handle;
    } else {
      h = static_cast<int64_t>(handles_.size());
      handles_.push_back(handle);
      refs_.push_back(-1);
    }
    refs_[h] = 0;
    ++num_create_;
    ++num_physical_;
    return h;
  }

  void ReleasePhysical(int64_t h) {
    CheckOpen();
    CheckHandle(h);
    if (refs_[h] > 0) {
      throw nb::value_error(("handle " + std::to_string(h) + " is still mapped at " +
                             std::to_string(refs_[h]) + " offset(s); unmap it first").c_str());
    }
    CUresult r = Api().release(handles_[h]);
    if (r != CUDA_SUCCESS) Raise(PyExc_RuntimeError, CuText("cuMemRelease", r));
    refs_[h] = -1;
    free_ids_.push_back(h);
    ++num_release_;
    --num_physical_;
  }

  void Map(int64_t offset, int64_t h) {
    CheckOpen();
    size_t i = SuperPage(offset);
    CheckHandle(h);
    if (mapping_[i] >= 0) {
      throw nb::value_error(("offset " + std::to_string(offset) + " is already mapped").c_str());
    }
    CUdeviceptr va = base_ + i * sp_;
    CUresult r = Api().map(va, sp_, 0, handles_[h], 0);
    if (r != CUDA_SUCCESS) Raise(PyExc_RuntimeError, CuText("cuMemMap", r));
    CUmemAccessDesc access;
    std::memset(&access, 0, sizeof(access));
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = Api().set_access(va, sp_, &access, 1);
    if (r != CUDA_SUCCESS) {
      Api().unmap(va, sp_);
      Raise(PyExc_RuntimeError, CuText("cuMemSetAccess", r));
    }
    mapping_[i] = h;
    ++refs_[h];
    ++num_map_;
    ++num_mapped_;
  }

  void Unmap(int64_t offset) {
    CheckOpen();
    size_t i = SuperPage(offset);
    if (mapping_[i] < 0) {
      throw nb::value_error(("offset " + std::to_string(offset) + " is not mapped").c_str());
    }
    CUresult r = UnmapIndex(i);
    if (r != CUDA_SUCCESS) Raise(PyExc_RuntimeError, CuText("cuMemUnmap", r));
  }

  bool IsMapped(int64_t offset) const {
    if (!base_) return false;
    return mapping_[SuperPage(offset)] >= 0;
  }
  int64_t HandleAt(int64_t offset) const {
    CheckOpen();
    return mapping_[SuperPage(offset)];
  }

  // Synchronous byte copies between the reservation and host memory (the caller has waited for
  // every step that writes the range); every touched super-page must be mapped.
  void Read(int64_t offset, uintptr_t dst, int64_t nbytes) {
    CheckSpan(offset, nbytes);
    Copy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(base_ + offset), nbytes,
         cudaMemcpyDeviceToHost);
  }
  void Write(int64_t offset, uintptr_t src, int64_t nbytes) {
    CheckSpan(offset, nbytes);
    Copy(reinterpret_cast<void*>(base_ + offset), reinterpret_cast<const void*>(src), nbytes,
         cudaMemcpyHostToDevice);
  }

  // A DLPack-exportable array over the reservation (kDLCUDA); it keeps the reservation object
  // alive. Touching an unmapped super-page through it faults.
  nb::ndarray<nb::array_api> DLPack(nb::handle self, int64_t offset, std::vector<size_t> shape,
                       const std::string& dtype) {
    CheckOpen();
    nb::dlpack::dtype dt = kvcm::ArenaDType(dtype);
    size_t count = 1;
    for (size_t s : shape) count *= s;
    if (offset < 0 || offset + count * (dt.bits / 8) > nbytes_) {
      throw nb::value_error("shape and offset describe bytes outside the reservation");
    }
    return nb::ndarray<nb::array_api>(reinterpret_cast<void*>(base_ + offset), shape.size(),
                                      shape.data(), self, nullptr, dt, nb::device::cuda::value,
                                      device_);
  }

  void Close() noexcept {
    if (!base_) return;
    for (size_t i = 0; i < mapping_.size(); ++i) {
      if (mapping_[i] >= 0) (void)UnmapIndex(i);
    }
    for (size_t h = 0; h < refs_.size(); ++h) {
      if (refs_[h] >= 0) {
        (void)Api().release(handles_[h]);
        refs_[h] = -1;
        ++num_release_;
        --num_physical_;
      }
    }
    (void)Api().address_free(base_, nbytes_);
    base_ = 0;
  }

  uintptr_t base() const { return static_cast<uintptr_t>(base_); }
  size_t nbytes() const { return nbytes_; }
  size_t super_page_bytes() const { return sp_; }
  int device() const { return device_; }
  bool closed() const { return base_ == 0; }
  int64_t num_map_calls() const { return num_map_; }
  int64_t num_unmap_calls() const { return num_unmap_; }
  int64_t num_create_calls() const { return num_create_; }
  int64_t num_release_calls() const { return num_release_; }
  int64_t num_physical() const { return num_physical_; }
  int64_t mapped_bytes() const { return num_mapped_ * static_cast<int64_t>(sp_); }
  int64_t physical_bytes() const { return num_physical_ * static_cast<int64_t>(sp_); }

 private:
  void CheckOpen() const {
    if (!base_) throw nb::value_error("the arena reservation is closed");
  }
  void CheckHandle(int64_t h) const {
    if (h < 0 || h >= static_cast<int64_t>(refs_.size()) || refs_[h] < 0) {
      throw nb::value_error(("handle " + std::to_string(h) +
                             " is not a live physical handle of this arena").c_str());
    }
  }
  size_t SuperPage(int64_t offset) const {
    if (offset < 0 || static_cast<size_t>(offset) >= nbytes_ ||
        static_cast<size_t>(offset) % sp_ != 0) {
      throw nb::value_error(("offset must be a multiple of super_page_bytes inside the "
                             "reservation, got " + std::to_string(offset)).c_str());
    }
    return static_cast<size_t>(offset) / sp_;
  }
  void CheckSpan(int64_t offset, int64_t nbytes) const {
    CheckOpen();
    if (offset < 0 || nbytes < 0 || static_cast<size_t>(offset + nbytes) > nbytes_) {
      throw nb::value_error("byte range outside the reservation");
    }
    if (nbytes == 0) return;
    for (size_t i = offset / sp_; i <= static_cast<size_t>(offset + nbytes - 1) / sp_; ++i) {
      if (mapping_[i] < 0) {
        throw nb::value_error(("byte range touches the unmapped super-page at offset " +
                               std::to_string(i * sp_)).c_str());
      }
    }
  }
  void Copy(void* dst, const void* src, int64_t nbytes, cudaMemcpyKind kind) {
    cudaError_t e;
    {
      nb::gil_scoped_release release;
      e = cudaMemcpy(dst, src, static_cast<size_t>(nbytes), kind);
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      Raise(PyExc_RuntimeError, std::string("cudaMemcpy failed: ") + cudaGetErrorName(e));
    }
  }
  CUresult UnmapIndex(size_t i) noexcept {
    CUresult r = Api().unmap(base_ + i * sp_, sp_);
    if (r != CUDA_SUCCESS) return r;
    --refs_[mapping_[i]];
    mapping_[i] = -1;
    ++num_unmap_;
    --num_mapped_;
    return r;
  }

  CUdeviceptr base_ = 0;
  size_t nbytes_ = 0, sp_ = 0;
  int device_ = 0;
  std::vector<int64_t> mapping_;                   // super-page index -> handle id, -1 = unmapped
  std::vector<CUmemGenericAllocationHandle> handles_;  // handle id -> driver handle
  std::vector<int64_t> refs_;                      // handle id -> offsets mapping it, -1 = free
  std::vector<int64_t> free_ids_;
  int64_t num_map_ = 0, num_unmap_ = 0, num_create_ = 0, num_release_ = 0;
  int64_t num_mapped_ = 0, num_physical_ = 0;
};

}  // namespace

void BindArenaVmm(nb::module_& m) {
  m.def("vmm_granularity", &Granularity, nb::arg("device") = -1,
        "The driver's minimum VMM allocation granularity for ``device`` (-1: the current one); "
        "RuntimeError when the driver or device has no VMM support.");
  nb::class_<VmmReservation>(m, "VmmReservation",
                             "A CUDA virtual reservation backed on demand by cuMemCreate "
                             "super-pages (the contiguous arena on GPU).")
      .def(nb::init<int64_t, int64_t, int>(), nb::arg("nbytes"), nb::arg("super_page_bytes"),
           nb::arg("device") = -1)
      .def("create_physical", &VmmReservation::CreatePhysical)
      .def("release_physical", &VmmReservation::ReleasePhysical, nb::arg("handle"))
      .def("map", &VmmReservation::Map, nb::arg("offset"), nb::arg("handle"))
      .def("unmap", &VmmReservation::Unmap, nb::arg("offset"))
      .def("is_mapped", &VmmReservation::IsMapped, nb::arg("offset"))
      .def("handle_at", &VmmReservation::HandleAt, nb::arg("offset"))
      .def("read", &VmmReservation::Read, nb::arg("offset"), nb::arg("dst_address"),
           nb::arg("nbytes"))
      .def("write", &VmmReservation::Write, nb::arg("offset"), nb::arg("src_address"),
           nb::arg("nbytes"))
      .def(
          "dlpack",
          [](nb::handle self, int64_t offset, std::vector<size_t> shape, const std::string& dt) {
            return nb::cast<VmmReservation&>(self).DLPack(self, offset, std::move(shape), dt);
          },
          nb::arg("offset"), nb::arg("shape"), nb::arg("dtype"),
          "An array (DLPack, kDLCUDA) of ``shape``/``dtype`` at byte ``offset``, no copy.")
      .def("close", &VmmReservation::Close)
      .def_prop_ro("base", &VmmReservation::base)
      .def_prop_ro("nbytes", &VmmReservation::nbytes)
      .def_prop_ro("super_page_bytes", &VmmReservation::super_page_bytes)
      .def_prop_ro("device", &VmmReservation::device)
      .def_prop_ro("closed", &VmmReservation::closed)
      .def_prop_ro("num_map_calls", &VmmReservation::num_map_calls)
      .def_prop_ro("num_unmap_calls", &VmmReservation::num_unmap_calls)
      .def_prop_ro("num_create_calls", &VmmReservation::num_create_calls)
      .def_prop_ro("num_release_calls", &VmmReservation::num_release_calls)
      .def_prop_ro("num_physical", &VmmReservation::num_physical)
      .def_prop_ro("mapped_bytes", &VmmReservation::mapped_bytes)
      .def_prop_ro("physical_bytes", &VmmReservation::physical_bytes);
}
