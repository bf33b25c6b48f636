// The reservation's CUDA VMM backend (CUDA builds): cuMemAddressReserve for the address range,
// one cuMemCreate allocation per physical super-page, cuMemMap + cuMemSetAccess to back a
// super-page, cuMemUnmap / cuMemRelease to undo it.
//
// The driver functions are looked up once at run time (cudaGetDriverEntryPointByVersion, the ABI
// of CUDA 10.2 when VMM appeared): the runtime is linked statically, so the module imports with no
// driver; opening the backend on a machine without VMM support raises DriverError saying so (the
// paged backend keeps working).
//
// NOTE: cuMemUnmap under a running reader faults: the caller unmaps only after the fences of every
// dispatched step that may read the super-page are complete.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>

#include "kvcm/runtime/errors.h"
#include "kvcm/runtime/reservation.h"

namespace kvcm::runtime {
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

void Check(const char* call, CUresult r) {
  if (r != CUDA_SUCCESS) throw DriverError(CuText(call, r));
}

// Checks the driver, the device (-1: the current one) and its VMM support; returns the CUdevice.
CUdevice CheckedDevice(int device) {
  const VmmApi& api = Api();
  if (!api.missing.empty()) {
    throw DriverError("the CUDA driver has no virtual memory management entry points (" +
                      api.missing +
                      "): the arena backend cannot be used here; the paged backend still works");
  }
  if (device < 0) {
    const cudaError_t e = cudaGetDevice(&device);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw DriverError(std::string("cudaGetDevice failed: ") + cudaGetErrorName(e));
    }
  }
  cudaFree(nullptr);  // NOTE: initializes the driver and the device's primary context
  (void)cudaGetLastError();
  CUdevice dev = 0;
  Check("cuDeviceGet", api.device_get(&dev, device));
  int supported = 0;
  Check("cuDeviceGetAttribute",
        api.device_get_attribute(&supported,
                                 CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
  if (!supported) {
    throw DriverError("device " + std::to_string(device) +
                      " does not support CUDA virtual memory management: the arena backend "
                      "cannot be used here; the paged backend still works");
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

size_t Granularity(int device) {
  const CUmemAllocationProp prop = Prop(static_cast<int>(CheckedDevice(device)));
  size_t g = 0;
  Check("cuMemGetAllocationGranularity",
        Api().granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  return g;
}

class VmmBackend final : public ReservationBackend {
 public:
  explicit VmmBackend(int device)
      : device_(static_cast<int>(CheckedDevice(device))), granularity_(Granularity(device_)) {}
  ~VmmBackend() override { Free(); }

  const char* name() const override { return "vmm"; }
  int32_t dlpack_device_type() const override { return 2; }  // kDLCUDA
  int device() const override { return device_; }
  size_t granularity() const override { return granularity_; }

  uintptr_t Reserve(size_t nbytes, size_t super_page_bytes) override {
    const CUresult r = Api().address_reserve(&base_, nbytes, super_page_bytes, 0, 0);
    if (r != CUDA_SUCCESS) {
      base_ = 0;
      throw OutOfMemory("cannot reserve " + std::to_string(nbytes) +
                        " bytes of device address space for the arena (" +
                        CuText("cuMemAddressReserve", r) + ")");
    }
    nbytes_ = nbytes;
    super_page_bytes_ = super_page_bytes;
    return static_cast<uintptr_t>(base_);
  }

  void Free() noexcept override {
    if (!base_) return;
    (void)Api().address_free(base_, nbytes_);
    base_ = 0;
  }

  uint64_t CreatePhysical(int64_t /*id*/) override {
    const CUmemAllocationProp prop = Prop(device_);
    CUmemGenericAllocationHandle handle = 0;
    const CUresult r = Api().create(&handle, super_page_bytes_, &prop, 0);
    if (r != CUDA_SUCCESS) {
      throw OutOfMemory("cannot allocate a " + std::to_string(super_page_bytes_) +
                        "-byte arena super-page: " + CuText("cuMemCreate", r));
    }
    return static_cast<uint64_t>(handle);
  }

  void ReleasePhysical(uint64_t physical) override {
    Check("cuMemRelease", Api().release(static_cast<CUmemGenericAllocationHandle>(physical)));
  }

  void Map(size_t offset, uint64_t physical) override {
    const CUdeviceptr va = base_ + offset;
    Check("cuMemMap", Api().map(va, super_page_bytes_, 0,
                                static_cast<CUmemGenericAllocationHandle>(physical), 0));
    CUmemAccessDesc access;
    std::memset(&access, 0, sizeof(access));
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    const CUresult r = Api().set_access(va, super_page_bytes_, &access, 1);
    if (r != CUDA_SUCCESS) {
      Api().unmap(va, super_page_bytes_);
      throw DriverError(CuText("cuMemSetAccess", r));
    }
  }

  void Unmap(size_t offset) override {
    Check("cuMemUnmap", Api().unmap(base_ + offset, super_page_bytes_));
  }

  // NOTE: synchronous; the caller waited for every step that writes the range.
  void CopyOut(void* dst, size_t offset, size_t nbytes) override {
    Copy(dst, reinterpret_cast<const void*>(base_ + offset), nbytes, cudaMemcpyDeviceToHost);
  }
  void CopyIn(size_t offset, const void* src, size_t nbytes) override {
    Copy(reinterpret_cast<void*>(base_ + offset), src, nbytes, cudaMemcpyHostToDevice);
  }

 private:
  static void Copy(void* dst, const void* src, size_t nbytes, cudaMemcpyKind kind) {
    const cudaError_t e = cudaMemcpy(dst, src, nbytes, kind);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw DriverError(std::string("cudaMemcpy failed: ") + cudaGetErrorName(e));
    }
  }

  int device_;
  size_t granularity_;
  CUdeviceptr base_ = 0;
  size_t nbytes_ = 0, super_page_bytes_ = 0;
};

std::unique_ptr<ReservationBackend> OpenVmm(int device) {
  return std::make_unique<VmmBackend>(device);
}

}  // namespace

BackendFactory VmmBackendFactory() { return {"vmm", true, Granularity, OpenVmm}; }

}  // namespace kvcm::runtime
