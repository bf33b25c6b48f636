// The reservation's memfd backend (CPU builds): one PROT_NONE, MAP_NORESERVE address range whose
// super-pages are backed on demand by super-page-sized pieces of one memfd (mmap MAP_FIXED |
// MAP_SHARED), so the same piece may appear at several addresses. A handle id is the piece's index
// in the file; releasing it punches a hole, so the next user of the id reads zeros.
//
// NOTE: MAP_NORESERVE makes reserving far more than physical memory fine; a size the address space
// cannot hold fails with OutOfMemory. Unmapping puts PROT_NONE anonymous memory back with
// MAP_FIXED, which keeps the range reserved: nothing else can be mapped there between our calls.
//
// Also here: the registry of open memfd reservations by address (kvcm/arena_registry.h), for the
// CPU ops that take an arena pool by address.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "kvcm/arena_registry.h"
#include "kvcm/runtime/errors.h"
#include "kvcm/runtime/reservation.h"
#include "system.h"

namespace kvcm::runtime {
namespace {

std::string Errno(const char* call) { return std::string(call) + ": " + std::strerror(errno); }

// The open memfd reservations by base address.
std::mutex registry_mu;
std::map<uintptr_t, const Reservation*>& Registry() {
  static std::map<uintptr_t, const Reservation*> registry;
  return registry;
}

// Under registry_mu: the open reservation holding [address, address + nbytes), or null.
const Reservation* FindLocked(uintptr_t address, size_t nbytes) {
  auto& registry = Registry();
  auto it = registry.upper_bound(address);
  if (it == registry.begin()) return nullptr;
  --it;
  const Reservation* r = it->second;
  if (nbytes > r->nbytes() || address - it->first > r->nbytes() - nbytes) return nullptr;
  return r;
}

class MemfdBackend final : public ReservationBackend {
 public:
  ~MemfdBackend() override { Free(); }

  const char* name() const override { return "memfd"; }
  int32_t dlpack_device_type() const override { return 1; }  // kDLCPU
  int device() const override { return -1; }
  size_t granularity() const override { return SystemPageSize(); }

  uintptr_t Reserve(size_t nbytes, size_t super_page_bytes) override {
    void* p = mmap(nullptr, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw OutOfMemory("cannot reserve " + std::to_string(nbytes) +
                        " bytes of address space for the arena (" + Errno("mmap") + ")");
    }
    fd_ = memfd_create("jax_kvcm_arena", MFD_CLOEXEC);
    if (fd_ < 0) {
      const std::string error = Errno("memfd_create");
      munmap(p, nbytes);
      throw OutOfMemory("cannot create the arena's physical memory: " + error);
    }
    base_ = static_cast<uint8_t*>(p);
    nbytes_ = nbytes;
    super_page_bytes_ = super_page_bytes;
    return reinterpret_cast<uintptr_t>(base_);
  }

  void Free() noexcept override {
    if (!base_) return;
    munmap(base_, nbytes_);
    close(fd_);
    base_ = nullptr;
    fd_ = -1;
  }

  uint64_t CreatePhysical(int64_t id) override {
    const size_t need = (static_cast<size_t>(id) + 1) * super_page_bytes_;
    if (need > file_bytes_) {
      if (ftruncate(fd_, static_cast<off_t>(need)) != 0) {
        throw OutOfMemory("cannot grow the arena's physical memory to " + std::to_string(need) +
                          " bytes: " + Errno("ftruncate"));
      }
      file_bytes_ = need;
    }
    return static_cast<uint64_t>(id);
  }

  void ReleasePhysical(uint64_t physical) override {
    // NOTE: punching the hole returns the memory and makes the next user see zeros.
    fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, FileOffset(physical),
              static_cast<off_t>(super_page_bytes_));
  }

  void Map(size_t offset, uint64_t physical) override {
    void* p = mmap(base_ + offset, super_page_bytes_, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED, fd_, FileOffset(physical));
    if (p == MAP_FAILED) throw OutOfMemory("cannot map an arena super-page: " + Errno("mmap"));
  }

  void Unmap(size_t offset) override {
    void* p = mmap(base_ + offset, super_page_bytes_, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) throw OutOfMemory("cannot unmap an arena super-page: " + Errno("mmap"));
  }

  void CopyOut(void* dst, size_t offset, size_t nbytes) override {
    std::memcpy(dst, base_ + offset, nbytes);
  }
  void CopyIn(size_t offset, const void* src, size_t nbytes) override {
    std::memcpy(base_ + offset, src, nbytes);
  }

  void Opened(const Reservation& r) override {
    std::lock_guard<std::mutex> lock(registry_mu);
    Registry()[r.base()] = &r;
  }
  void Closing(const Reservation& r) noexcept override {
    std::lock_guard<std::mutex> lock(registry_mu);
    Registry().erase(r.base());
  }

 private:
  off_t FileOffset(uint64_t physical) const {
    return static_cast<off_t>(physical * super_page_bytes_);
  }

  uint8_t* base_ = nullptr;
  size_t nbytes_ = 0, super_page_bytes_ = 0;
  size_t file_bytes_ = 0;
  int fd_ = -1;
};

size_t MemfdGranularity(int /*device*/) { return SystemPageSize(); }
std::unique_ptr<ReservationBackend> OpenMemfd(int /*device*/) {
  return std::make_unique<MemfdBackend>();
}

}  // namespace

BackendFactory MemfdBackendFactory() { return {"memfd", false, MemfdGranularity, OpenMemfd}; }

}  // namespace kvcm::runtime

namespace kvcm {

bool ArenaHolds(uintptr_t address, size_t nbytes) {
  std::lock_guard<std::mutex> lock(runtime::registry_mu);
  return runtime::FindLocked(address, nbytes) != nullptr;
}

bool ArenaMapped(uintptr_t address, size_t nbytes) {
  std::lock_guard<std::mutex> lock(runtime::registry_mu);
  const runtime::Reservation* r = nbytes ? runtime::FindLocked(address, nbytes) : nullptr;
  return r != nullptr && r->RangeMapped(address - r->base(), nbytes);
}

}  // namespace kvcm
