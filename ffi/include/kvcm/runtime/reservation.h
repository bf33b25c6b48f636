// One virtual-address reservation whose super-pages are backed on demand by physical super-pages
// (the contiguous arena's memory), written once for two physical backends:
//   - memfd: a PROT_NONE mmap reservation; a physical super-page is a piece of one memfd, mapped
//     with MAP_FIXED | MAP_SHARED (CPU builds, ffi/runtime/memfd_backend.cc);
//   - vmm: cuMemAddressReserve; a physical super-page is a cuMemCreate allocation, mapped with
//     cuMemMap + cuMemSetAccess (CUDA builds, ffi/runtime/vmm_backend.cc).
//
// Reservation owns what is the same for both: the table super-page -> handle, the handles and how
// many offsets map each (one handle may be mapped at several offsets: prefix aliasing), the
// counters, and every argument check. A handle is a small integer id; freed ids are reused.
// Errors (kvcm/runtime/errors.h) name the argument ("offset", "offsets[3]", "handle", ...); a call
// that raises InvalidArgument changed nothing.
//
// NOTE: nothing here synchronizes with running kernels: the caller unmaps or releases a super-page
// only after every step that may read it has completed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace kvcm::runtime {

class Reservation;

// What differs between the physical memories. Offsets are bytes from the reservation's base and
// multiples of the super-page size; Reservation checked every argument before it calls.
class ReservationBackend {
 public:
  virtual ~ReservationBackend() = default;
  virtual const char* name() const = 0;            // "memfd" or "vmm"
  virtual int32_t dlpack_device_type() const = 0;  // kDLCPU (1) or kDLCUDA (2)
  virtual int device() const = 0;                  // the CUDA device; -1 for host memory
  virtual size_t granularity() const = 0;          // super-pages are multiples of this
  // Reserves `nbytes` of address space that nothing may touch yet; OutOfMemory when it cannot.
  virtual uintptr_t Reserve(size_t nbytes, size_t super_page_bytes) = 0;
  // Frees the reservation after every super-page was unmapped and released; idempotent (a
  // backend's destructor frees it too, for a Reservation whose constructor failed).
  virtual void Free() noexcept = 0;
  // A physical super-page for handle `id` (ids are dense; a freed id comes back); returns the
  // backend's own handle for it. OutOfMemory when it cannot. NOTE: memfd pages read zero,
  // cuMemCreate memory is not cleared.
  virtual uint64_t CreatePhysical(int64_t id) = 0;
  virtual void ReleasePhysical(uint64_t physical) = 0;
  virtual void Map(size_t offset, uint64_t physical) = 0;
  virtual void Unmap(size_t offset) = 0;
  // Synchronous copies between host memory and mapped bytes of the reservation.
  virtual void CopyOut(void* dst, size_t offset, size_t nbytes) = 0;
  virtual void CopyIn(size_t offset, const void* src, size_t nbytes) = 0;
  // The reservation opened (after Reserve) / is closing (before anything is unmapped): the memfd
  // backend enters it in and removes it from the by-address registry (kvcm/arena_registry.h).
  virtual void Opened(const Reservation&) {}
  virtual void Closing(const Reservation&) noexcept {}
};

// How an extension module opens its backend (one per module).
struct BackendFactory {
  const char* name;   // "memfd" or "vmm"
  bool takes_device;  // the Python signatures have a ``device`` argument
  size_t (*granularity)(int device);
  std::unique_ptr<ReservationBackend> (*open)(int device);
};
BackendFactory MemfdBackendFactory();  // memfd_backend.cc, in the CPU module
BackendFactory VmmBackendFactory();    // vmm_backend.cc, in the CUDA module

struct ReservationCounters {
  int64_t map_calls = 0, unmap_calls = 0, create_calls = 0, release_calls = 0;  // super-pages
  int64_t mapped = 0;    // super-pages mapped now
  int64_t physical = 0;  // physical super-pages live now
};

class Reservation {
 public:
  // InvalidArgument unless super_page_bytes is a positive multiple of the backend's granularity
  // and nbytes a positive multiple of super_page_bytes; OutOfMemory when the address space or the
  // backend cannot hold it.
  Reservation(std::unique_ptr<ReservationBackend> backend, int64_t nbytes,
              int64_t super_page_bytes);
  ~Reservation() { Close(); }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  int64_t CreatePhysical();
  // `n` handles, all or none: on a failure the ones created are released and it raises.
  std::vector<int64_t> CreatePhysicalMany(int64_t n);
  void ReleasePhysical(int64_t handle);
  // Every handle is checked first; a backend failure part-way leaves the earlier ones released.
  void ReleasePhysicalMany(const std::vector<int64_t>& handles);
  void Map(int64_t offset, int64_t handle);
  // All or none: every pair is checked first; on a backend failure the pairs mapped are unmapped.
  void MapMany(const std::vector<int64_t>& offsets, const std::vector<int64_t>& handles);
  void Unmap(int64_t offset);
  // Every offset is checked first; a backend failure part-way leaves the earlier ones unmapped.
  void UnmapMany(const std::vector<int64_t>& offsets);
  bool IsMapped(int64_t offset) const;  // false once closed
  int64_t HandleAt(int64_t offset) const;  // -1 when unmapped

  // Copies between host memory and the reservation; every touched super-page must be mapped.
  void Read(int64_t offset, uintptr_t dst_address, int64_t nbytes);
  void Write(int64_t offset, uintptr_t src_address, int64_t nbytes);
  // The address of `nbytes` at `offset` for a zero-copy view (its unmapped parts fault).
  uintptr_t ViewAddress(int64_t offset, uint64_t nbytes) const;

  // Unmaps everything, releases every handle and frees the reservation; idempotent.
  void Close() noexcept;

  // Test hook: the (after + 1)-th following physical create (kind "create") or map ("map") fails
  // with OutOfMemory, once, as if the backend had failed.
  void InjectFault(const std::string& kind, int64_t after);

  // Any thread: whether every super-page [offset, offset + nbytes) touches is mapped (nbytes > 0,
  // the range inside the reservation).
  bool RangeMapped(size_t offset, size_t nbytes) const;

  const ReservationBackend& backend() const { return *backend_; }
  uintptr_t base() const { return base_; }
  size_t nbytes() const { return nbytes_; }
  size_t super_page_bytes() const { return super_page_bytes_; }
  bool closed() const { return !open_; }
  const ReservationCounters& counters() const { return counters_; }

 private:
  struct Arg;
  struct Physical {
    uint64_t backend_handle = 0;
    int64_t refs = -1;  // offsets mapping it; -1: the id is free
  };
  static constexpr int64_t kUnmapped = -1;

  void CheckOpen() const;
  size_t SuperPageIndex(int64_t offset, const Arg& arg) const;
  size_t CheckUnmapped(int64_t offset, const Arg& arg) const;
  size_t CheckMapped(int64_t offset, const Arg& arg) const;
  void CheckLive(int64_t handle, const Arg& arg) const;
  void CheckReleasable(int64_t handle, const Arg& arg) const;
  void CheckMappedSpan(int64_t offset, int64_t nbytes, uintptr_t address,
                       const char* address_name) const;
  int64_t CreateOne();
  void ReleaseOne(int64_t handle);
  void MapIndex(size_t index, int64_t handle);
  void UnmapIndex(size_t index);
  void RestoreCallCounters(const ReservationCounters& before);
  static void FailIfInjected(int64_t& countdown, const char* kind);

  std::unique_ptr<ReservationBackend> backend_;
  uintptr_t base_ = 0;
  size_t nbytes_ = 0, super_page_bytes_ = 0;
  bool open_ = false;
  std::vector<int64_t> mapping_;  // super-page index -> handle, kUnmapped
  std::vector<Physical> physical_;  // handle -> its physical super-page
  std::vector<int64_t> free_ids_;
  ReservationCounters counters_;
  int64_t create_fault_ = -1, map_fault_ = -1;  // InjectFault countdowns; -1: none
  // Guards mapping_ against RangeMapped from another thread (an op running on an XLA thread while
  // the owner maps or unmaps); the owner's own reads need no lock.
  mutable std::mutex table_mu_;
};

}  // namespace kvcm::runtime
