// Disk tier: one preallocated, slot-addressed file per cold pool group, with a checksum per page.
//
// DiskFile(path, num_slots, slot_bytes, io_threads=0) creates ``path`` exclusively (O_CREAT |
// O_EXCL, mode 0600), unlinks it at once (the descriptor keeps the file: it lives as long as this
// object, and a killed process leaves nothing behind) and preallocates num_slots * slot_bytes bytes
// with posix_fallocate, so a full disk is reported at construction rather than in the middle of a
// migration. Slot s lives at byte offset s * slot_bytes. close() and destruction close the
// descriptor; only when the early unlink failed do they unlink ``path`` (the file this object
// created: a file another process created there later is never removed).
//
// I/O. write(slots, src_address, src_pages=None) / read(slots, dst_address, dst_pages=None) move
// page i between file offset slots[i] * slot_bytes and host address base + pages[i] * slot_bytes
// (pages default to 0, 1, ...: a contiguous staging region). Pages adjacent both on disk and in
// host memory (slots[i+1] == slots[i] + 1 and pages[i+1] == pages[i] + 1) are coalesced into
// *pieces* of at most 4 MiB (at least one page): one pwrite/pread per piece unless the kernel
// transfers less, in which case the loop continues where it stopped (a transfer that makes no
// progress is EIO). EINTR is retried. All I/O runs with the GIL released; arguments are validated
// (ValueError naming the argument) before any I/O.
//
// Threads. A call runs its pieces on up to io_threads threads (default min(8, hardware threads);
// the calling thread is one of them; one thread per MiB of data at most, so small calls stay on
// the caller): each thread takes the next piece in order and does its checksums and its syscall,
// so one thread's checksums overlap another's I/O. The pieces, their syscalls and the fault
// numbering (below) do not depend on the number of threads. A call that writes a slot twice (or
// reads into one host page twice) runs its pieces in order, so the later page wins. Every thread
// is joined before the call returns.
//
// Checksums. A CRC32C (Castagnoli) per page is kept in an in-memory table indexed by slot; it is
// computed from the source bytes and recorded only after the write of the page's piece succeeded.
// read() verifies every page against the table: a mismatch or a slot with no entry yields False for
// that page (a miss, never served, never an exception). The table is not persisted: the file is
// removed when it is closed.
//
// Failure semantics of write(). Before a piece is written its slots' entries are dropped; after it
// succeeds they are recorded. Once a piece fails, no piece after it (in call order) is started;
// every piece before it runs to the end. The call raises the error of the first failing piece
// (OSError naming its slots). So after a failed call: the pieces before the first failing one hold
// the new data with valid entries; the failing piece's slots have no entry (reads of them return
// False); a piece after it is untouched (file bytes and entries) unless another thread had already
// started it, in which case it holds the new data with valid entries, or reads as missing if it
// failed too. With one thread, and for injected faults (whatever the number of threads: the
// faulting piece is known before any I/O and nothing after it is issued), every piece after the
// failing one is untouched. Either way a valid entry always describes the slot's bytes. The caller
// treats a failed call as failed whole and frees its slots. A failed read() changes no entry.
//
// Thread safety: the table entries are atomics; concurrent I/O calls on one file are allowed (they
// hold a shared lock), close() takes the lock exclusively and so waits for in-flight I/O.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "crc32c.h"
#include "disk_io.h"

namespace nb = nanobind;
using kvcm::runtime::Crc32c;
using kvcm::runtime::Crc32cSoftware;
using kvcm::runtime::DefaultIoThreads;
using kvcm::runtime::FaultPlan;
using kvcm::runtime::ForEachPiece;
using kvcm::runtime::kNoPiece;
using kvcm::runtime::Outcome;
using kvcm::runtime::Piece;
using kvcm::runtime::Pieces;
using kvcm::runtime::TransferAll;

namespace {

// ------------------------------------------------------------------------------------------------
// Errors.

[[noreturn]] void RaiseOSError(int err, const std::string& what, const std::string& path) {
  // OSError(errno, strerror, filename) picks the matching subclass (FileExistsError, ...).
  std::string message = std::strerror(err);
  if (!what.empty()) message += " (" + what + ")";
  nb::object exc = nb::borrow(PyExc_OSError)(err, message, path);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw nb::python_error();
}

// Defaults of the I/O engine (see the module notes).
constexpr int64_t kDefaultPieceBytes = 4 << 20;
constexpr int64_t kDefaultMinThreadBytes = 1 << 20;

using BoolArray = nb::ndarray<nb::numpy, bool, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

class DiskFile {
 public:
  DiskFile(std::string path, int64_t num_slots, int64_t slot_bytes, int64_t io_threads)
      : path_(std::move(path)) {
    if (path_.empty() || path_.find('\0') != std::string::npos) {
      throw nb::value_error("path must be a non-empty string without NUL bytes");
    }
    if (num_slots < 1) {
      throw nb::value_error(("num_slots must be >= 1, got " + std::to_string(num_slots)).c_str());
    }
    if (slot_bytes < 1) {
      throw nb::value_error(
          ("slot_bytes must be >= 1, got " + std::to_string(slot_bytes)).c_str());
    }
    if (num_slots > INT64_MAX / slot_bytes) {
      throw nb::value_error("num_slots * slot_bytes overflows a 64-bit file size");
    }
    set_io_threads(io_threads);
    num_slots_ = num_slots;
    slot_bytes_ = slot_bytes;
    table_.reset(new std::atomic<uint64_t>[static_cast<size_t>(num_slots)]);
    for (int64_t s = 0; s < num_slots; ++s) table_[s].store(0, std::memory_order_relaxed);

    int err = 0;
    const char* step = "";
    {
      nb::gil_scoped_release release;
      fd_ = ::open(path_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
      if (fd_ < 0) {
        err = errno;
        step = "creating the file";
      } else {
        // NOTE: we created it (O_EXCL), so removing its name is ours to do; the descriptor
        // keeps the file. Should the unlink fail, close() retries it.
        linked_ = ::unlink(path_.c_str()) != 0;
        do {
          err = posix_fallocate(fd_, 0, static_cast<off_t>(num_slots * slot_bytes));
        } while (err == EINTR);
        if (err != 0) {
          step = "preallocating the file";
          ::close(fd_);
          if (linked_) ::unlink(path_.c_str());
          linked_ = false;
          fd_ = -1;
        }
      }
    }
    if (err != 0) {
      closed_ = true;
      RaiseOSError(err, std::string(step) + ", " + std::to_string(num_slots * slot_bytes) +
                            " bytes", path_);
    }
  }

  ~DiskFile() { CloseNoThrow(); }

  DiskFile(const DiskFile&) = delete;
  DiskFile& operator=(const DiskFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t num_slots() const { return num_slots_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  bool closed() const { return closed_.load(); }
  int fileno() const { return closed_.load() ? -1 : fd_; }
  bool linked() const { return linked_; }
  uint64_t num_io_calls() const { return num_io_calls_.load(); }

  int64_t io_threads() const { return io_threads_.load(); }
  void set_io_threads(int64_t n) {
    if (n < 0) throw nb::value_error(("io_threads must be >= 0, got " + std::to_string(n)).c_str());
    io_threads_.store(n == 0 ? DefaultIoThreads() : n);
  }
  int64_t piece_bytes() const { return piece_bytes_.load(); }
  void set_piece_bytes(int64_t n) {
    if (n < 1) throw nb::value_error("_io_piece_bytes must be >= 1");
    piece_bytes_.store(n);
  }
  int64_t last_workers() const { return last_workers_.load(); }
  int64_t min_thread_bytes() const { return min_thread_bytes_.load(); }
  void set_min_thread_bytes(int64_t n) {
    if (n < 1) throw nb::value_error("_min_thread_bytes must be >= 1");
    min_thread_bytes_.store(n);
  }

  void Write(nb::handle slots_obj, uintptr_t src_address, nb::handle src_pages_obj) {
    (void)Move(true, slots_obj, src_address, src_pages_obj);
  }

  BoolArray Read(nb::handle slots_obj, uintptr_t dst_address, nb::handle dst_pages_obj) {
    Mask mask = Move(false, slots_obj, dst_address, dst_pages_obj);
    bool* data = mask.ok.release();
    nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<bool*>(p); });
    size_t shape[1] = {mask.n};
    return BoolArray(data, 1, shape, owner);
  }

  void Invalidate(nb::handle slots_obj) {
    std::vector<int64_t> slots = CheckSlots(slots_obj);
    std::shared_lock<std::shared_mutex> lock(io_mutex_);
    if (closed_) throw nb::value_error("I/O on a closed DiskFile");
    for (int64_t s : slots) Entry(s).store(0);
  }

  void Close() {
    int err = 0;
    {
      nb::gil_scoped_release release;
      err = CloseImpl();
    }
    if (err != 0 && err != ENOENT) RaiseOSError(err, "removing the file", path_);
  }

  void InjectFault(const std::string& kind, int64_t after_ios) { faults_.Inject(kind, after_ios); }
  void ClearFaults() { faults_.Clear(); }

 private:
  std::atomic<uint64_t>& Entry(int64_t slot) { return table_[static_cast<size_t>(slot)]; }

  struct Mask {
    std::unique_ptr<bool[]> ok;
    size_t n;
  };

  // write() (is_write) or read(): validates, plans the pieces and the injected fault, runs the
  // pieces on the I/O threads with the GIL released, raises the smallest failing piece's error.
  // Returns the read mask (all false for writes).
  Mask Move(bool is_write, nb::handle slots_obj, uintptr_t address, nb::handle pages_obj) {
    const char* address_name = is_write ? "src_address" : "dst_address";
    const char* pages_name = is_write ? "src_pages" : "dst_pages";
    const std::vector<int64_t> slots = CheckSlots(slots_obj);
    CheckAddress(slots.size(), address, address_name);
    const std::vector<int64_t> pages = CheckPages(pages_obj, slots.size(), address, pages_name);
    const size_t n = slots.size();
    const size_t sb = static_cast<size_t>(slot_bytes_);
    const std::vector<Piece> pieces = Pieces(slots, pages, PagesPerPiece());
    std::unique_ptr<bool[]> ok(new bool[n ? n : 1]());
    std::vector<uint32_t> crcs(is_write ? n : 0);
    bool closed = false;
    Outcome outcome;
    {
      nb::gil_scoped_release release;
      std::shared_lock<std::shared_mutex> lock(io_mutex_);
      closed = closed_;
      if (!closed) {
        const FaultPlan plan = faults_.Plan(is_write, pieces, sb);
        size_t workers = Workers(pieces, plan.num_pieces);
        // NOTE: a slot written twice (a host page read into twice) in one call keeps the later
        // page, as documented: such calls run their pieces in order.
        if (workers > 1 && HasDuplicates(is_write ? slots : pages)) workers = 1;
        uint8_t* base = reinterpret_cast<uint8_t*>(address);
        outcome = ForEachPiece(plan.num_pieces, workers, [&](size_t p) {
          const Piece& piece = pieces[p];
          return MovePiece(is_write, piece, base + static_cast<size_t>(pages[piece.first]) * sb,
                           slots, crcs.data(), ok.get(),
                           p == plan.piece ? plan.syscall : kNoPiece, plan.kind);
        });
      }
    }
    if (closed) throw nb::value_error("I/O on a closed DiskFile");
    last_workers_.store(static_cast<int64_t>(outcome.workers));
    if (outcome.piece != kNoPiece) {
      RaiseOSError(outcome.err,
                   PieceText(is_write ? "writing" : "reading", slots, pieces[outcome.piece]),
                   path_);
    }
    return {std::move(ok), n};
  }

  // One piece at host address `host`: a write computes its pages' checksums into crcs, drops
  // their entries, writes and records them; a read reads and verifies them into ok. Returns 0 or
  // an errno.
  int MovePiece(bool is_write, const Piece& piece, uint8_t* host,
                const std::vector<int64_t>& slots, uint32_t* crcs, bool* ok,
                size_t fault_syscall, int fault_kind) noexcept {
    const size_t sb = static_cast<size_t>(slot_bytes_);
    if (is_write) {
      for (size_t k = 0; k < piece.count; ++k) crcs[piece.first + k] = Crc32c(host + k * sb, sb);
      // NOTE: drop the old entries first: if the write fails half-way, the slot's bytes are
      // neither old nor new, and it must read as missing.
      for (size_t k = 0; k < piece.count; ++k) Entry(slots[piece.first + k]).store(0);
    }
    const int err = TransferAll(fd_, is_write, host, piece.count * sb,
                                static_cast<off_t>(slots[piece.first] * slot_bytes_),
                                fault_syscall, fault_kind, num_io_calls_);
    if (err != 0) return err;
    for (size_t k = 0; k < piece.count; ++k) {
      const size_t i = piece.first + k;
      if (is_write) {
        Entry(slots[i]).store((uint64_t{1} << 32) | crcs[i]);
      } else {
        const uint64_t entry = Entry(slots[i]).load();
        ok[i] = entry != 0 && static_cast<uint32_t>(entry) == Crc32c(host + k * sb, sb);
      }
    }
    return 0;
  }

  std::vector<int64_t> CheckSlots(nb::handle obj) const {
    nb::ndarray<nb::ro, nb::device::cpu> arr;
    if (!nb::try_cast(obj, arr, /*convert=*/false)) {
      std::string type = nb::type_name(obj.type()).c_str();
      throw nb::value_error(("slots must be a 1-D numpy int32 array, got " + type).c_str());
    }
    if (arr.ndim() != 1 || arr.dtype() != nb::dtype<int32_t>()) {
      throw nb::value_error(("slots must be a 1-D int32 array, got ndim=" +
                             std::to_string(arr.ndim()) + " (check the dtype too)")
                                .c_str());
    }
    const size_t n = arr.shape(0);
    const int64_t stride = arr.stride(0);
    const int32_t* data = static_cast<const int32_t*>(arr.data());
    std::vector<int64_t> slots(n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t s = data[static_cast<int64_t>(i) * stride];
      if (s < 0 || s >= num_slots_) {
        throw nb::value_error(("slots[" + std::to_string(i) + "] = " + std::to_string(s) +
                               " is out of range [0, " + std::to_string(num_slots_) + ")")
                                  .c_str());
      }
      slots[i] = s;
    }
    return slots;
  }

  // Host page of each call page: 0, 1, ... when obj is None, else an int32 [n] array of
  // non-negative page numbers whose byte addresses fit in the address space.
  std::vector<int64_t> CheckPages(nb::handle obj, size_t n, uintptr_t address,
                                  const char* name) const {
    std::vector<int64_t> pages(n);
    if (obj.is_none()) {
      for (size_t i = 0; i < n; ++i) pages[i] = static_cast<int64_t>(i);
      return pages;
    }
    nb::ndarray<nb::ro, nb::device::cpu> arr;
    if (!nb::try_cast(obj, arr, /*convert=*/false) || arr.ndim() != 1 ||
        arr.dtype() != nb::dtype<int32_t>() || arr.shape(0) != n) {
      throw nb::value_error((std::string(name) + " must be None or a 1-D int32 array as long as "
                             "slots (" + std::to_string(n) + ")")
                                .c_str());
    }
    const int64_t stride = arr.stride(0);
    const int32_t* data = static_cast<const int32_t*>(arr.data());
    const uint64_t limit = (UINTPTR_MAX - address) / static_cast<uint64_t>(slot_bytes_);
    for (size_t i = 0; i < n; ++i) {
      const int64_t page = data[static_cast<int64_t>(i) * stride];
      if (page < 0 || static_cast<uint64_t>(page) >= limit) {
        throw nb::value_error((std::string(name) + "[" + std::to_string(i) + "] = " +
                               std::to_string(page) + " is negative or beyond the address space")
                                  .c_str());
      }
      pages[i] = page;
    }
    return pages;
  }

  static void CheckAddress(size_t n, uintptr_t address, const char* name) {
    if (n > 0 && address == 0) throw nb::value_error((std::string(name) + " is null").c_str());
  }

  size_t PagesPerPiece() const {
    return static_cast<size_t>(std::max<int64_t>(1, piece_bytes_.load() / slot_bytes_));
  }

  static bool HasDuplicates(std::vector<int64_t> slots) {
    std::sort(slots.begin(), slots.end());
    return std::adjacent_find(slots.begin(), slots.end()) != slots.end();
  }

  // Threads for the first `num` pieces: at most io_threads, one per piece, one per
  // min_thread_bytes of data (a thread costs tens of microseconds to start).
  size_t Workers(const std::vector<Piece>& pieces, size_t num) const {
    uint64_t pages = 0;
    for (size_t p = 0; p < num; ++p) pages += pieces[p].count;
    const uint64_t by_bytes = pages * static_cast<uint64_t>(slot_bytes_) /
                              static_cast<uint64_t>(min_thread_bytes_.load());
    const uint64_t cap = static_cast<uint64_t>(io_threads_.load());
    return static_cast<size_t>(std::max<uint64_t>(1, std::min({cap, uint64_t{num}, by_bytes})));
  }

  static std::string PieceText(const char* verb, const std::vector<int64_t>& slots,
                               const Piece& piece) {
    std::string text = std::string(verb) + " slot";
    if (piece.count == 1) return text + " " + std::to_string(slots[piece.first]);
    return text + "s " + std::to_string(slots[piece.first]) + ".." +
           std::to_string(slots[piece.first + piece.count - 1]);
  }

  // Closes once (and unlinks the name when the early unlink failed); returns the unlink errno
  // (0 when there was nothing to unlink, it was removed, or already closed).
  int CloseImpl() {
    std::unique_lock<std::shared_mutex> lock(io_mutex_);
    if (closed_) return 0;
    closed_ = true;
    ::close(fd_);
    fd_ = -1;
    if (!linked_) return 0;
    linked_ = false;
    return ::unlink(path_.c_str()) == 0 ? 0 : errno;
  }

  void CloseNoThrow() noexcept { (void)CloseImpl(); }

  std::string path_;
  int fd_ = -1;
  bool linked_ = false;  // the name is still in the directory (the early unlink failed)
  int64_t num_slots_ = 0;
  int64_t slot_bytes_ = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> table_;  // 0: no entry; else (1 << 32) | crc32c
  std::shared_mutex io_mutex_;                       // shared: I/O, exclusive: close
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> num_io_calls_{0};
  std::atomic<int64_t> io_threads_{1};
  std::atomic<int64_t> piece_bytes_{kDefaultPieceBytes};
  std::atomic<int64_t> min_thread_bytes_{kDefaultMinThreadBytes};
  std::atomic<int64_t> last_workers_{0};
  kvcm::runtime::FaultInjector faults_;
};

}  // namespace

void BindDiskFile(nb::module_& m) {
  nb::class_<DiskFile>(m, "DiskFile",
                       "A preallocated, slot-addressed file with a CRC32C per page, unlinked right "
                       "after it is created (the disk tier of one cold pool group).")
      .def(nb::init<std::string, int64_t, int64_t, int64_t>(), nb::arg("path"),
           nb::arg("num_slots"), nb::arg("slot_bytes"), nb::arg("io_threads") = 0,
           "Creates ``path`` exclusively (mode 0600), unlinks it (the descriptor keeps it) "
           "and preallocates num_slots * slot_bytes bytes. OSError (errno preserved, e.g. "
           "ENOSPC, EEXIST) on failure; a half-created file is removed. ``io_threads``: "
           "threads per write/read call (0: min(8, hardware threads)).")
      .def_prop_ro("path", &DiskFile::path)
      .def_prop_ro("num_slots", &DiskFile::num_slots)
      .def_prop_ro("slot_bytes", &DiskFile::slot_bytes)
      .def_prop_ro("closed", &DiskFile::closed)
      .def_prop_ro("fileno", &DiskFile::fileno,
                   "The file descriptor (-1 once closed); the file's name is unlinked right "
                   "after creation, so this is the way to the bytes (tests corrupt them).")
      .def_prop_ro("linked", &DiskFile::linked,
                   "Whether the name is still in the directory (the unlink after creation "
                   "failed; close() retries it).")
      .def_prop_ro("num_io_calls", &DiskFile::num_io_calls,
                   "pread/pwrite syscalls issued so far (one per piece: a run of slots adjacent on "
                   "disk and in host memory, cut every 4 MiB, unless the kernel transferred "
                   "less); injected faults count too.")
      .def_prop_rw("io_threads", &DiskFile::io_threads, &DiskFile::set_io_threads,
                   "The most threads one write/read call uses (set 0 for the default, min(8, "
                   "hardware threads)).")
      .def_prop_rw("_io_piece_bytes", &DiskFile::piece_bytes, &DiskFile::set_piece_bytes,
                   "Test hook: the most bytes of one piece (one syscall), at least one page.")
      .def_prop_rw("_min_thread_bytes", &DiskFile::min_thread_bytes,
                   &DiskFile::set_min_thread_bytes,
                   "Test hook: a call uses one thread per this many bytes at most.")
      .def_prop_ro("_last_workers", &DiskFile::last_workers,
                   "Test hook: threads (the caller included) that ran the last write/read.")
      .def("write", &DiskFile::Write, nb::arg("slots"), nb::arg("src_address"),
           nb::arg("src_pages").none() = nb::none(),
           "Writes page i from src_address + src_pages[i] * slot_bytes (src_pages default: i) to "
           "slot slots[i] (int32 [n]), one I/O per piece, and records each page's CRC32C after "
           "its piece is written. OSError on failure (see the module notes for what stays "
           "written).")
      .def("read", &DiskFile::Read, nb::arg("slots"), nb::arg("dst_address"),
           nb::arg("dst_pages").none() = nb::none(),
           "Reads slot slots[i] into dst_address + dst_pages[i] * slot_bytes (dst_pages default: "
           "i); returns a bool [n] mask, False where the checksum does not match or the slot "
           "holds no recorded page. OSError on I/O errors and short reads (EIO).")
      .def("invalidate", &DiskFile::Invalidate, nb::arg("slots"),
           "Drops the checksum entries of ``slots``: reads of them return False until rewritten.")
      .def("close", &DiskFile::Close,
           "Closes the file (its space is freed; its name was unlinked at creation); "
           "idempotent. OSError when the retried unlink of a name still linked fails.")
      .def("_inject_fault", &DiskFile::InjectFault, nb::arg("kind"), nb::arg("after_ios") = 0,
           "Test hook: a one-shot fault on the (after_ios + 1)-th following I/O syscall of the "
           "matching direction: 'enospc', 'short_write' (writes), 'short_read', 'eio_read' "
           "(reads).")
      .def("_clear_faults", &DiskFile::ClearFaults, "Test hook: drops pending faults.")
      .def("__repr__", [](const DiskFile& f) {
        return "DiskFile(path=" + f.path() + ", num_slots=" + std::to_string(f.num_slots()) +
               ", slot_bytes=" + std::to_string(f.slot_bytes()) +
               (f.closed() ? ", closed)" : ")");
      });

  m.def(
      "_crc32c",
      [](nb::bytes data, bool software) {
        const void* p = data.c_str();
        const size_t n = data.size();
        return software ? Crc32cSoftware(p, n) : Crc32c(p, n);
      },
      nb::arg("data"), nb::arg("software") = false,
      "Test hook: CRC32C of ``data`` as the disk tier computes it (or with the table-driven "
      "path).");
  m.attr("_CRC32C_IMPL") = kvcm::runtime::Crc32cImplementation();
}
