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

#if defined(__x86_64__)
#include <nmmintrin.h>
#define KVCM_CRC32C_X86 1
#elif defined(__aarch64__) && defined(__linux__)
#include <arm_acle.h>
#include <asm/hwcap.h>
#include <sys/auxv.h>
#define KVCM_CRC32C_ARM 1
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

namespace nb = nanobind;

namespace {

// ------------------------------------------------------------------------------------------------
// CRC32C (Castagnoli, reflected polynomial 0x82F63B78, init and final xor ~0): check value
// crc32c("123456789") == 0xE3069283. Hardware instructions when the CPU has them (SSE4.2 on x86,
// the CRC extension on ARMv8), else slicing-by-8 tables. The hardware path runs three independent
// streams over thirds of a large buffer and combines them (GF(2) polynomial arithmetic, as zlib's
// crc32_combine), which hides the instruction's latency.

constexpr uint32_t kCrc32cPoly = 0x82F63B78u;

struct Crc32cTables {
  uint32_t slice[8][256];
  uint32_t x2n[32];  // x^(2^k) mod P
};

uint32_t MultModP(uint32_t a, uint32_t b) {  // a(x) * b(x) mod P(x), reflected
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kCrc32cPoly : b >> 1;
  }
  return p;
}

const Crc32cTables& Tables() {
  static const Crc32cTables tables = [] {
    Crc32cTables t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
      t.slice[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) {
        uint32_t prev = t.slice[s - 1][i];
        t.slice[s][i] = (prev >> 8) ^ t.slice[0][prev & 0xff];
      }
    }
    uint32_t p = 1u << 30;  // x^1
    t.x2n[0] = p;
    for (int k = 1; k < 32; ++k) t.x2n[k] = p = MultModP(p, p);
    return t;
  }();
  return tables;
}

// x^(8 * nbytes) mod P: the operator that shifts a CRC over nbytes zero bytes.
uint32_t ShiftOperator(uint64_t nbytes) {
  const Crc32cTables& t = Tables();
  uint32_t p = 1u << 31;  // x^0
  unsigned k = 3;         // 8 * nbytes = nbytes * 2^3
  while (nbytes) {
    if (nbytes & 1) p = MultModP(t.x2n[k & 31], p);
    nbytes >>= 1;
    ++k;
  }
  return p;
}

// Raw (unconditioned) update: the caller applies the ~ before and after.
uint32_t Crc32cSoftwareRaw(uint32_t crc, const uint8_t* p, size_t n) {
  const Crc32cTables& t = Tables();
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = (crc >> 8) ^ t.slice[0][(crc ^ *p++) & 0xff];
    --n;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);  // little-endian hosts only (x86, aarch64 Linux)
    v ^= crc;
    crc = t.slice[7][v & 0xff] ^ t.slice[6][(v >> 8) & 0xff] ^ t.slice[5][(v >> 16) & 0xff] ^
          t.slice[4][(v >> 24) & 0xff] ^ t.slice[3][(v >> 32) & 0xff] ^
          t.slice[2][(v >> 40) & 0xff] ^ t.slice[1][(v >> 48) & 0xff] ^ t.slice[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t.slice[0][(crc ^ *p++) & 0xff];
  return crc;
}

// The hardware step: one 8-byte word (crc64 keeps the 32-bit CRC in its low half).
#if defined(KVCM_CRC32C_X86)
#define KVCM_HW_TARGET __attribute__((target("sse4.2")))
KVCM_HW_TARGET inline uint32_t HwWord(uint32_t c, uint64_t v) {
  return static_cast<uint32_t>(_mm_crc32_u64(c, v));
}
KVCM_HW_TARGET inline uint32_t HwByte(uint32_t c, uint8_t v) { return _mm_crc32_u8(c, v); }
bool HaveHwCrc() {
  __builtin_cpu_init();  // NOTE: needed when called from a static initializer
  return __builtin_cpu_supports("sse4.2");
}
constexpr const char* kHwName = "sse4.2";
#elif defined(KVCM_CRC32C_ARM)
#define KVCM_HW_TARGET __attribute__((target("+crc")))
KVCM_HW_TARGET inline uint32_t HwWord(uint32_t c, uint64_t v) { return __crc32cd(c, v); }
KVCM_HW_TARGET inline uint32_t HwByte(uint32_t c, uint8_t v) { return __crc32cb(c, v); }
bool HaveHwCrc() { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
constexpr const char* kHwName = "armv8-crc";
#endif

#if defined(KVCM_HW_TARGET)
KVCM_HW_TARGET uint32_t Crc32cHwRaw(uint32_t crc, const uint8_t* p, size_t n) {
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);  // unaligned loads are fine on x86-64 and aarch64
    crc = HwWord(crc, v);
  }
  for (; n; --n) crc = HwByte(crc, *p++);
  return crc;
}

// Three independent streams in one loop, so the instruction's latency is hidden.
KVCM_HW_TARGET void Crc32cHwRaw3(uint32_t* a, uint32_t* b, uint32_t* c, const uint8_t* pa,
                                 const uint8_t* pb, const uint8_t* pc, size_t words) {
  uint32_t x = *a, y = *b, z = *c;
  for (size_t i = 0; i < words; ++i) {
    uint64_t u, v, w;
    std::memcpy(&u, pa + 8 * i, 8);
    std::memcpy(&v, pb + 8 * i, 8);
    std::memcpy(&w, pc + 8 * i, 8);
    x = HwWord(x, u);
    y = HwWord(y, v);
    z = HwWord(z, w);
  }
  *a = x;
  *b = y;
  *c = z;
}

// Conditioned CRC with the hardware instruction; large buffers run as three streams over thirds
// A, B, C. The raw register update is linear: R(s, X || Y) = shift(R(s, X), |Y|) ^ R(0, Y), so
// crc = ~(shift(shift(R(~0, A), |B|) ^ R(0, B), |C|) ^ R(0, C)).
uint32_t Crc32cHardware(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  constexpr size_t kStreamMin = 3 * 4096;
  if (n < kStreamMin) return ~Crc32cHwRaw(~0u, p, n);
  const size_t third = (n / 3) & ~size_t{7};
  const size_t last = n - 2 * third;
  uint32_t a = ~0u, b = 0, c = 0;
  Crc32cHwRaw3(&a, &b, &c, p, p + third, p + 2 * third, third / 8);
  c = Crc32cHwRaw(c, p + 3 * third, last - third);
  const uint32_t ab = MultModP(ShiftOperator(third), a) ^ b;
  return ~(MultModP(ShiftOperator(last), ab) ^ c);
}
#else
bool HaveHwCrc() { return false; }
constexpr const char* kHwName = "software";
uint32_t Crc32cHardware(const void* data, size_t n) {
  return ~Crc32cSoftwareRaw(~0u, static_cast<const uint8_t*>(data), n);
}
#endif

const bool kUseHwCrc = HaveHwCrc();

uint32_t Crc32cSoftware(const void* data, size_t n) {
  return ~Crc32cSoftwareRaw(~0u, static_cast<const uint8_t*>(data), n);
}

uint32_t Crc32c(const void* data, size_t n) {
  return kUseHwCrc ? Crc32cHardware(data, n) : Crc32cSoftware(data, n);
}

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

// ------------------------------------------------------------------------------------------------
// Fault injection (tests only): one-shot faults on the (after_ios + 1)-th following I/O syscall of
// the matching direction. Syscalls are numbered in piece order whatever the number of threads (see
// PlanFaults).

enum FaultKind : int { kEnospc = 0, kShortWrite, kShortRead, kEioRead, kNumFaultKinds };
constexpr const char* kFaultNames[kNumFaultKinds] = {"enospc", "short_write", "short_read",
                                                     "eio_read"};
constexpr bool kFaultIsWrite[kNumFaultKinds] = {true, true, false, false};
constexpr int kNoFault = -1;

// The most one pread/pwrite asks for: Linux transfers at most 0x7ffff000 bytes per call (with 4 KiB
// pages; 0x7fff0000 with 64 KiB pages), so a request of this size is never cut by that limit and
// the number of syscalls of a piece is known before it runs.
constexpr size_t kMaxSyscallBytes = 0x7fff0000;
constexpr size_t kNoPiece = SIZE_MAX;

// Defaults of the I/O engine (see the module notes).
constexpr int64_t kMaxDefaultIoThreads = 8;
constexpr int64_t kDefaultPieceBytes = 4 << 20;
constexpr int64_t kDefaultMinThreadBytes = 1 << 20;

using BoolArray = nb::ndarray<nb::numpy, bool, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

struct Piece {
  size_t first;  // index into slots (and host pages)
  size_t count;  // pages in the piece
};

// The injected fault one call meets: the (syscall + 1)-th syscall of piece `piece` gets `kind`.
// The call runs pieces [0, num_pieces) only: as when pieces ran one after the other, nothing after
// the failing piece is started.
struct FaultPlan {
  size_t num_pieces = 0;
  size_t piece = kNoPiece;
  size_t syscall = 0;
  int kind = kNoFault;
};

// What a call did: the smallest failing piece (kNoPiece when none), its errno, and how many
// threads ran pieces (the caller included).
struct Outcome {
  size_t piece = kNoPiece;
  int err = 0;
  size_t workers = 0;
};

int64_t DefaultIoThreads() {
  const int64_t hw = static_cast<int64_t>(std::thread::hardware_concurrency());
  return std::max<int64_t>(1, std::min(kMaxDefaultIoThreads, hw));
}

// Runs body(p) for p in [0, num) on `workers` threads (the caller is one of them; fewer when
// threads cannot be created), handing indices out in increasing order. body returns 0 or an errno.
// Once a piece has failed, pieces above the smallest failing one are not started; pieces below it
// were all handed out before it and run to the end. Every thread is joined before this returns.
template <class Body>
Outcome ForEachPiece(size_t num, size_t workers, const Body& body) {
  std::vector<int> errs(num, 0);
  std::atomic<size_t> next{0};
  std::atomic<size_t> first_failed{kNoPiece};
  auto work = [&]() noexcept {
    for (;;) {
      const size_t p = next.fetch_add(1);
      if (p >= num || p > first_failed.load()) return;
      const int err = body(p);
      if (err != 0) {
        errs[p] = err;
        size_t seen = first_failed.load();
        while (p < seen && !first_failed.compare_exchange_weak(seen, p)) {
        }
      }
    }
  };
  std::vector<std::thread> threads;
  try {
    threads.reserve(workers > 1 ? workers - 1 : 0);
    for (size_t w = 1; w < workers; ++w) threads.emplace_back(work);
  } catch (...) {
    // NOTE: no thread (or no memory) for more workers: the ones started and the caller finish
  }
  work();
  for (std::thread& t : threads) t.join();
  Outcome out;
  out.piece = first_failed.load();
  if (out.piece != kNoPiece) out.err = errs[out.piece];
  out.workers = threads.size() + 1;
  return out;
}

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
    for (auto& f : faults_) f = kNoFault;
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

  void InjectFault(const std::string& kind, int64_t after_ios) {
    if (after_ios < 0) {
      throw nb::value_error(("after_ios must be >= 0, got " + std::to_string(after_ios)).c_str());
    }
    for (int k = 0; k < kNumFaultKinds; ++k) {
      if (kind == kFaultNames[k]) {
        std::lock_guard<std::mutex> lock(fault_mutex_);
        faults_[k] = after_ios;
        return;
      }
    }
    throw nb::value_error(("unknown fault kind " + kind +
                           " (expected one of: enospc, short_write, short_read, eio_read)")
                              .c_str());
  }

  void ClearFaults() {
    std::lock_guard<std::mutex> lock(fault_mutex_);
    for (auto& f : faults_) f = kNoFault;
  }

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
        const FaultPlan plan = PlanFaults(is_write, pieces);
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
    const int err = TransferAll(is_write, host, piece.count * sb,
                                static_cast<off_t>(slots[piece.first] * slot_bytes_),
                                fault_syscall, fault_kind);
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

  // Runs of pages adjacent both on disk (slots) and in host memory (pages), cut into pieces of at
  // most max_pages pages.
  static std::vector<Piece> Pieces(const std::vector<int64_t>& slots,
                                   const std::vector<int64_t>& pages, size_t max_pages) {
    std::vector<Piece> pieces;
    size_t i = 0;
    while (i < slots.size()) {
      size_t j = i + 1;
      while (j < slots.size() && j - i < max_pages && slots[j] == slots[j - 1] + 1 &&
             pages[j] == pages[j - 1] + 1) {
        ++j;
      }
      pieces.push_back({i, j - i});
      i = j;
    }
    return pieces;
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

  // The fault that fires on this syscall of the given direction, or kNoFault (fault_mutex_ held).
  int TakeFaultLocked(bool is_write) {
    int fired = kNoFault;
    for (int k = 0; k < kNumFaultKinds; ++k) {
      if (kFaultIsWrite[k] != is_write || faults_[k] == kNoFault) continue;
      if (faults_[k] == 0) {
        if (fired == kNoFault) {
          fired = k;
          faults_[k] = kNoFault;
        }
      } else {
        --faults_[k];
      }
    }
    return fired;
  }

  // Consumes the pending faults of the direction for the call's syscalls, numbered in piece order
  // (ceil(bytes / kMaxSyscallBytes) per piece), as if the pieces ran one after the other; stops at
  // the first that fires. So which piece fails, and what the call leaves behind, does not depend
  // on the number of threads.
  FaultPlan PlanFaults(bool is_write, const std::vector<Piece>& pieces) {
    FaultPlan plan;
    plan.num_pieces = pieces.size();
    std::lock_guard<std::mutex> lock(fault_mutex_);
    bool pending = false;
    for (int k = 0; k < kNumFaultKinds; ++k) {
      pending |= kFaultIsWrite[k] == is_write && faults_[k] != kNoFault;
    }
    if (!pending) return plan;
    for (size_t p = 0; p < pieces.size(); ++p) {
      const size_t len = pieces[p].count * static_cast<size_t>(slot_bytes_);
      const size_t syscalls = (len + kMaxSyscallBytes - 1) / kMaxSyscallBytes;
      for (size_t j = 0; j < syscalls; ++j) {
        const int kind = TakeFaultLocked(is_write);
        if (kind != kNoFault) {
          plan.num_pieces = p + 1;
          plan.piece = p;
          plan.syscall = j;
          plan.kind = kind;
          return plan;
        }
      }
    }
    return plan;
  }

  // pwrite (is_write) or pread until done, at most kMaxSyscallBytes per syscall; the fault `kind`
  // replaces syscall number `fault_syscall` (kNoPiece: none). Returns 0 or an errno (EIO for a
  // transfer that made no progress: a short write, or end of file inside the preallocated file).
  int TransferAll(bool is_write, uint8_t* buf, size_t len, off_t off, size_t fault_syscall,
                  int kind) noexcept {
    const int error_fault = is_write ? kEnospc : kEioRead;
    const int error_errno = is_write ? ENOSPC : EIO;
    const int short_fault = is_write ? kShortWrite : kShortRead;
    auto io = [&](size_t n) {
      return is_write ? ::pwrite(fd_, buf, n, off) : ::pread(fd_, buf, n, off);
    };
    bool zero_next = false;
    for (size_t syscall = 0; len > 0;) {
      num_io_calls_.fetch_add(1);
      const size_t want = std::min(len, kMaxSyscallBytes);
      ssize_t n;
      if (zero_next) {  // the syscall after a short transfer: no progress (not a counted one)
        n = 0;
      } else {
        const int fault = syscall++ == fault_syscall ? kind : kNoFault;
        if (fault == error_fault) {
          n = -1;
          errno = error_errno;
        } else if (fault == short_fault) {
          n = want / 2 ? io(want / 2) : 0;
          zero_next = true;
        } else {
          n = io(want);
        }
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        return errno;
      }
      if (n == 0) return EIO;
      buf += n;
      len -= static_cast<size_t>(n);
      off += n;
    }
    return 0;
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
  std::mutex fault_mutex_;
  int64_t faults_[kNumFaultKinds];
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
           "ENOSPC, EEXIST) on failure; a half-created file is removed. ``io_threads``: threads per write/read call (0: min(8, hardware "
           "threads)).")
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
  m.attr("_CRC32C_IMPL") = kUseHwCrc ? kHwName : "software";
}
