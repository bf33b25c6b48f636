// The contiguous arena's memory on CPU builds: one PROT_NONE virtual reservation whose
// super-pages are backed on demand by pages of one memfd (mmap MAP_FIXED | MAP_SHARED).
//
// ArenaReservation(nbytes, super_page_bytes) has the same semantics as the CUDA VmmReservation
// (ffi/cuda/arena_vmm.cc), so CI tests all of the arena's logic for real:
//   - create_physical() returns a handle to one super-page of physical memory (a super-page-sized
//     piece of the memfd; zero-filled), release_physical(h) returns it (hole punched).
//   - map(offset, h) backs the reservation's super-page at byte ``offset`` with handle h;
//     unmap(offset) puts PROT_NONE anonymous memory back. The same handle may be mapped at several
//     offsets (prefix aliasing): writes through one address are seen through the others.
//   - counters of every call and of mapped / physical bytes; close() (or the destructor) unmaps
//     everything, releases every handle and frees the reservation.
//
// NOTE: the reservation is MAP_NORESERVE, so reserving far more than physical memory is fine; a
// size the address space cannot hold fails with MemoryError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kvcm/arena_dtype.h"
#include "kvcm/arena_registry.h"

namespace nb = nanobind;

namespace {

size_t SystemPageSize() {
  long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<size_t>(page) : 4096;
}

[[noreturn]] void RaiseMemory(const std::string& message) {
  PyErr_SetString(PyExc_MemoryError, message.c_str());
  throw nb::python_error();
}

std::string Errno(const char* call) { return std::string(call) + ": " + std::strerror(errno); }

class ArenaReservation;

// The open reservations by base address (kvcm/arena_registry.h). The mutex also guards every
// reservation's super-page table against a concurrent lookup from an op running on an XLA
// thread while the Python thread maps or unmaps.
std::mutex registry_mu;
std::map<uintptr_t, ArenaReservation*>& Registry() {
  static std::map<uintptr_t, ArenaReservation*> registry;
  return registry;
}

class ArenaReservation {
 public:
  ArenaReservation(int64_t nbytes, int64_t super_page_bytes) {
    const int64_t gran = static_cast<int64_t>(SystemPageSize());
    if (super_page_bytes <= 0 || super_page_bytes % gran != 0) {
      throw nb::value_error(("super_page_bytes must be a positive multiple of the granularity " +
                             std::to_string(gran) + ", got " + std::to_string(super_page_bytes))
                                .c_str());
    }
    if (nbytes <= 0 || nbytes % super_page_bytes != 0) {
      throw nb::value_error(("nbytes must be a positive multiple of super_page_bytes (" +
                             std::to_string(super_page_bytes) + "), got " + std::to_string(nbytes))
                                .c_str());
    }
    sp_ = static_cast<size_t>(super_page_bytes);
    nbytes_ = static_cast<size_t>(nbytes);
    void* p = mmap(nullptr, nbytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      RaiseMemory("cannot reserve " + std::to_string(nbytes_) +
                  " bytes of address space for the arena (" + Errno("mmap") + ")");
    }
    base_ = static_cast<uint8_t*>(p);
    fd_ = static_cast<int>(syscall_memfd());
    if (fd_ < 0) {
      std::string e = Errno("memfd_create");
      munmap(base_, nbytes_);
      base_ = nullptr;
      RaiseMemory("cannot create the arena's physical memory: " + e);
    }
    mapping_.assign(nbytes_ / sp_, -1);
    std::lock_guard<std::mutex> lock(registry_mu);
    Registry()[reinterpret_cast<uintptr_t>(base_)] = this;
  }

  ~ArenaReservation() { Close(); }
  ArenaReservation(const ArenaReservation&) = delete;
  ArenaReservation& operator=(const ArenaReservation&) = delete;

  int64_t CreatePhysical() {
    CheckOpen();
    int64_t h;
    if (!free_handles_.empty()) {
      h = free_handles_.back();
      free_handles_.pop_back();
    } else {
      h = static_cast<int64_t>(handle_refs_.size());
      if (ftruncate(fd_, static_cast<off_t>((h + 1) * sp_)) != 0) {
        RaiseMemory("cannot grow the arena's physical memory to " +
                    std::to_string((h + 1) * sp_) + " bytes: " + Errno("ftruncate"));
      }
      handle_refs_.push_back(-1);
    }
    handle_refs_[h] = 0;  // live, mapped nowhere
    ++num_create_;
    ++num_physical_;
    return h;
  }

  void ReleasePhysical(int64_t h) {
    CheckOpen();
    CheckHandle(h, "handle");
    if (handle_refs_[h] > 0) {
      throw nb::value_error(("handle " + std::to_string(h) + " is still mapped at " +
                             std::to_string(handle_refs_[h]) + " offset(s); unmap it first")
                                .c_str());
    }
    // NOTE: punching the hole returns the memory and makes the next user see zeros.
    fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(h * sp_),
              static_cast<off_t>(sp_));
    handle_refs_[h] = -1;
    free_handles_.push_back(h);
    ++num_release_;
    --num_physical_;
  }

  void Map(int64_t offset, int64_t h) {
    CheckOpen();
    size_t i = SuperPage(offset);
    CheckHandle(h, "handle");
    if (mapping_[i] >= 0) {
      throw nb::value_error(("offset " + std::to_string(offset) + " is already mapped").c_str());
    }
    void* want = base_ + i * sp_;
    void* p = mmap(want, sp_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
                   static_cast<off_t>(h * sp_));
    if (p == MAP_FAILED) RaiseMemory("cannot map an arena super-page: " + Errno("mmap"));
    std::lock_guard<std::mutex> lock(registry_mu);
    mapping_[i] = h;
    ++handle_refs_[h];
    ++num_map_;
    ++num_mapped_;
  }

  void Unmap(int64_t offset) {
    CheckOpen();
    size_t i = SuperPage(offset);
    if (mapping_[i] < 0) {
      throw nb::value_error(("offset " + std::to_string(offset) + " is not mapped").c_str());
    }
    UnmapIndex(i);
  }

  bool IsMapped(int64_t offset) const {
    if (!base_) return false;
    return mapping_[SuperPage(offset)] >= 0;
  }

  int64_t HandleAt(int64_t offset) const {
    CheckOpen();
    return mapping_[SuperPage(offset)];
  }

  // Byte copies between the reservation and host memory; every touched super-page must be mapped.
  void Read(int64_t offset, uintptr_t dst, int64_t nbytes) {
    CheckSpan(offset, nbytes);
    std::memcpy(reinterpret_cast<void*>(dst), base_ + offset, static_cast<size_t>(nbytes));
  }
  void Write(int64_t offset, uintptr_t src, int64_t nbytes) {
    CheckSpan(offset, nbytes);
    std::memcpy(base_ + offset, reinterpret_cast<const void*>(src), static_cast<size_t>(nbytes));
  }

  void Close() noexcept {
    if (!base_) return;
    {
      std::lock_guard<std::mutex> lock(registry_mu);
      Registry().erase(reinterpret_cast<uintptr_t>(base_));
    }
    for (size_t i = 0; i < mapping_.size(); ++i) {
      if (mapping_[i] >= 0) UnmapIndex(i);
    }
    for (size_t h = 0; h < handle_refs_.size(); ++h) {
      if (handle_refs_[h] >= 0) {
        handle_refs_[h] = -1;
        ++num_release_;
        --num_physical_;
      }
    }
    munmap(base_, nbytes_);
    close(fd_);
    base_ = nullptr;
    fd_ = -1;
  }

  // Under registry_mu: true when every super-page of [offset, offset + nbytes) is mapped.
  bool MappedLocked(size_t offset, size_t nbytes) const {
    for (size_t i = offset / sp_; i <= (offset + nbytes - 1) / sp_; ++i)
      if (mapping_[i] < 0) return false;
    return true;
  }

  uintptr_t base() const { return reinterpret_cast<uintptr_t>(base_); }
  size_t nbytes() const { return nbytes_; }
  size_t super_page_bytes() const { return sp_; }
  bool closed() const { return base_ == nullptr; }
  int64_t num_map_calls() const { return num_map_; }
  int64_t num_unmap_calls() const { return num_unmap_; }
  int64_t num_create_calls() const { return num_create_; }
  int64_t num_release_calls() const { return num_release_; }
  int64_t num_physical() const { return num_physical_; }
  int64_t mapped_bytes() const { return num_mapped_ * static_cast<int64_t>(sp_); }
  int64_t physical_bytes() const { return num_physical_ * static_cast<int64_t>(sp_); }
  uint8_t* data() const { return base_; }

 private:
  static long syscall_memfd() { return memfd_create("jax_kvcm_arena", MFD_CLOEXEC); }

  void CheckOpen() const {
    if (!base_) throw nb::value_error("the arena reservation is closed");
  }
  void CheckHandle(int64_t h, const char* name) const {
    if (h < 0 || h >= static_cast<int64_t>(handle_refs_.size()) || handle_refs_[h] < 0) {
      throw nb::value_error((std::string(name) + " " + std::to_string(h) +
                             " is not a live physical handle of this arena")
                                .c_str());
    }
  }
  size_t SuperPage(int64_t offset) const {
    if (offset < 0 || static_cast<size_t>(offset) >= nbytes_ ||
        static_cast<size_t>(offset) % sp_ != 0) {
      throw nb::value_error(("offset must be a multiple of super_page_bytes inside the "
                             "reservation, got " + std::to_string(offset))
                                .c_str());
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
                               std::to_string(i * sp_))
                                  .c_str());
      }
    }
  }
  void UnmapIndex(size_t i) noexcept {
    // NOTE: replacing the mapping (MAP_FIXED) keeps the address range reserved: nothing else can
    // be mapped there between our calls.
    const int64_t h = mapping_[i];
    {
      std::lock_guard<std::mutex> lock(registry_mu);  // unmapped for lookups before the pages go
      mapping_[i] = -1;
    }
    mmap(base_ + i * sp_, sp_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
         -1, 0);
    --handle_refs_[h];
    ++num_unmap_;
    --num_mapped_;
  }

  uint8_t* base_ = nullptr;
  size_t nbytes_ = 0, sp_ = 0;
  int fd_ = -1;
  std::vector<int64_t> mapping_;      // super-page index -> handle, -1 = unmapped
  std::vector<int64_t> handle_refs_;  // handle -> number of offsets mapping it, -1 = free
  std::vector<int64_t> free_handles_;
  int64_t num_map_ = 0, num_unmap_ = 0, num_create_ = 0, num_release_ = 0;
  int64_t num_mapped_ = 0, num_physical_ = 0;
};

// Under registry_mu: the open reservation holding [address, address + nbytes), or null.
const ArenaReservation* FindLocked(uintptr_t address, size_t nbytes) {
  auto& reg = Registry();
  auto it = reg.upper_bound(address);
  if (it == reg.begin()) return nullptr;
  --it;
  const ArenaReservation* r = it->second;
  if (nbytes > r->nbytes() || address - it->first > r->nbytes() - nbytes) return nullptr;
  return r;
}

using ByteView = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

}  // namespace

namespace kvcm {

bool ArenaHolds(uintptr_t address, size_t nbytes) {
  std::lock_guard<std::mutex> lock(registry_mu);
  return FindLocked(address, nbytes) != nullptr;
}

bool ArenaMapped(uintptr_t address, size_t nbytes) {
  std::lock_guard<std::mutex> lock(registry_mu);
  const ArenaReservation* r = nbytes ? FindLocked(address, nbytes) : nullptr;
  return r != nullptr && r->MappedLocked(address - r->base(), nbytes);
}

}  // namespace kvcm

void BindArena(nb::module_& m) {
  m.def("arena_granularity", []() { return static_cast<int64_t>(SystemPageSize()); },
        "The smallest super-page the CPU arena accepts (the system page size).");
  nb::class_<ArenaReservation>(m, "ArenaReservation",
                               "A PROT_NONE virtual reservation backed on demand by memfd "
                               "super-pages (the contiguous arena on CPU builds).")
      .def(nb::init<int64_t, int64_t>(), nb::arg("nbytes"), nb::arg("super_page_bytes"))
      .def("create_physical", &ArenaReservation::CreatePhysical)
      .def("release_physical", &ArenaReservation::ReleasePhysical, nb::arg("handle"))
      .def("map", &ArenaReservation::Map, nb::arg("offset"), nb::arg("handle"))
      .def("unmap", &ArenaReservation::Unmap, nb::arg("offset"))
      .def("is_mapped", &ArenaReservation::IsMapped, nb::arg("offset"))
      .def("handle_at", &ArenaReservation::HandleAt, nb::arg("offset"))
      .def("read", &ArenaReservation::Read, nb::arg("offset"), nb::arg("dst_address"),
           nb::arg("nbytes"))
      .def("write", &ArenaReservation::Write, nb::arg("offset"), nb::arg("src_address"),
           nb::arg("nbytes"))
      .def("close", &ArenaReservation::Close)
      .def_prop_ro("base", &ArenaReservation::base)
      .def_prop_ro("nbytes", &ArenaReservation::nbytes)
      .def_prop_ro("super_page_bytes", &ArenaReservation::super_page_bytes)
      .def_prop_ro("closed", &ArenaReservation::closed)
      .def_prop_ro("num_map_calls", &ArenaReservation::num_map_calls)
      .def_prop_ro("num_unmap_calls", &ArenaReservation::num_unmap_calls)
      .def_prop_ro("num_create_calls", &ArenaReservation::num_create_calls)
      .def_prop_ro("num_release_calls", &ArenaReservation::num_release_calls)
      .def_prop_ro("num_physical", &ArenaReservation::num_physical)
      .def_prop_ro("mapped_bytes", &ArenaReservation::mapped_bytes)
      .def_prop_ro("physical_bytes", &ArenaReservation::physical_bytes)
      .def(
          "dlpack",
          [](nb::handle self, int64_t offset, std::vector<size_t> shape, const std::string& dt) {
            ArenaReservation& a = nb::cast<ArenaReservation&>(self);
            if (a.closed()) throw nb::value_error("the arena reservation is closed");
            nb::dlpack::dtype d = kvcm::ArenaDType(dt);
            size_t count = 1;
            for (size_t s : shape) count *= s;
            if (offset < 0 || offset + count * (d.bits / 8) > a.nbytes()) {
              throw nb::value_error("shape and offset describe bytes outside the reservation");
            }
            return nb::ndarray<nb::array_api>(a.data() + offset, shape.size(), shape.data(), self,
                                              nullptr, d, nb::device::cpu::value, 0);
          },
          nb::arg("offset"), nb::arg("shape"), nb::arg("dtype"),
          "An array (DLPack, kDLCPU) of ``shape``/``dtype`` at byte ``offset``, no copy.")
      .def(
          "view",
          [](nb::handle self) {
            ArenaReservation& a = nb::cast<ArenaReservation&>(self);
            if (a.closed()) throw nb::value_error("the arena reservation is closed");
            size_t shape[1] = {a.nbytes()};
            return ByteView(a.data(), 1, shape, self);  // references ``self``
          },
          "uint8 [nbytes] over the whole reservation, no copy; touching an unmapped super-page "
          "faults, so only mapped pieces may be read or written.");
}
