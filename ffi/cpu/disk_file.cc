// Disk tier: one preallocated, slot-addressed file per cold pool group, with a checksum per page.
//
// DiskFile(path, num_slots, slot_bytes) creates ``path`` exclusively (O_CREAT | O_EXCL, mode 0600)
// and preallocates num_slots * slot_bytes bytes with posix_fallocate, so a full disk is reported
// at construction rather than in the middle of a migration. Slot s lives at byte offset
// s * slot_bytes. The file is closed and unlinked by close() and on destruction.
//
// I/O. write(slots, src_address) / read(slots, dst_address) move page i between file offset
// slots[i] * slot_bytes and host address base + i * slot_bytes (a contiguous staging region).
// Runs of adjacent slots (slots[i+1] == slots[i] + 1) are coalesced into one pwrite/pread: one I/O
// syscall per run unless the kernel transfers less, in which case the loop continues where it
// stopped (a transfer that makes no progress is EIO). EINTR is retried. All I/O runs with the GIL
// released; arguments are validated (ValueError naming the argument) before any I/O.
//
// Checksums. A CRC32C (Castagnoli) per page is kept in an in-memory table indexed by slot; it is
// computed from the source bytes and recorded only after the write of the page's run succeeded.
// read() verifies every page against the table: a mismatch or a slot with no entry yields False for
// that page (a miss, never served, never an exception). The table is not persisted: the file is
// removed when it is closed.
//
// Failure semantics of write(): runs are written in order. Before a run is written its slots'
// entries are dropped; after it succeeds they are recorded. So when a call fails (OSError), the
// slots of runs written before the failure hold the new data with valid entries, the failing run's
// slots have no entry (reads of them return False), and the slots of later runs are untouched (file
// bytes and entries). The caller treats a failed call as failed whole and frees its slots.
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

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
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
// the matching direction.

enum FaultKind : int { kEnospc = 0, kShortWrite, kShortRead, kEioRead, kNumFaultKinds };
constexpr const char* kFaultNames[kNumFaultKinds] = {"enospc", "short_write", "short_read",
                                                     "eio_read"};
constexpr bool kFaultIsWrite[kNumFaultKinds] = {true, true, false, false};
constexpr int kNoFault = -1;

using BoolArray = nb::ndarray<nb::numpy, bool, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

struct Run {
  size_t first;  // index into slots
  size_t count;  // pages in the run
};

class DiskFile {
 public:
  DiskFile(std::string path, int64_t num_slots, int64_t slot_bytes) : path_(std::move(path)) {
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
        do {
          err = posix_fallocate(fd_, 0, static_cast<off_t>(num_slots * slot_bytes));
        } while (err == EINTR);
        if (err != 0) {
          step = "preallocating the file";
          ::close(fd_);
          ::unlink(path_.c_str());  // NOTE: we created it (O_EXCL), so removing it is ours to do
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
  uint64_t num_io_calls() const { return num_io_calls_.load(); }

  void Write(nb::handle slots_obj, uintptr_t src_address) {
    std::vector<int64_t> slots = CheckSlots(slots_obj);
    CheckAddress(slots.size(), src_address, "src_address");
    const std::vector<Run> runs = Runs(slots);
    int err = 0;
    size_t failed_run = 0;
    {
      nb::gil_scoped_release release;
      std::shared_lock<std::shared_mutex> lock(io_mutex_);
      if (closed_) {
        err = -1;
      } else {
        const uint8_t* src = reinterpret_cast<const uint8_t*>(src_address);
        const size_t sb = static_cast<size_t>(slot_bytes_);
        std::vector<uint32_t> crcs;
        for (size_t r = 0; r < runs.size(); ++r) {
          const Run& run = runs[r];
          const uint8_t* base = src + run.first * sb;
          crcs.resize(run.count);
          for (size_t k = 0; k < run.count; ++k) crcs[k] = Crc32c(base + k * sb, sb);
          // NOTE: drop the old entries first: if the write fails half-way, the slot's bytes are
          // neither old nor new, and it must read as missing.
          for (size_t k = 0; k < run.count; ++k) Entry(slots[run.first + k]).store(0);
          err = PwriteAll(base, run.count * sb, static_cast<off_t>(slots[run.first]) * sb);
          if (err != 0) {
            failed_run = r;
            break;
          }
          for (size_t k = 0; k < run.count; ++k) {
            Entry(slots[run.first + k]).store((uint64_t{1} << 32) | crcs[k]);
          }
        }
      }
    }
    if (err == -1) throw nb::value_error("I/O on a closed DiskFile");
    if (err != 0) RaiseOSError(err, RunText("writing", slots, runs[failed_run]), path_);
  }

  BoolArray Read(nb::handle slots_obj, uintptr_t dst_address) {
    std::vector<int64_t> slots = CheckSlots(slots_obj);
    CheckAddress(slots.size(), dst_address, "dst_address");
    const std::vector<Run> runs = Runs(slots);
    const size_t n = slots.size();
    std::unique_ptr<bool[]> ok(new bool[n ? n : 1]);
    for (size_t i = 0; i < n; ++i) ok[i] = false;
    int err = 0;
    size_t failed_run = 0;
    {
      nb::gil_scoped_release release;
      std::shared_lock<std::shared_mutex> lock(io_mutex_);
      if (closed_) {
        err = -1;
      } else {
        uint8_t* dst = reinterpret_cast<uint8_t*>(dst_address);
        const size_t sb = static_cast<size_t>(slot_bytes_);
        for (size_t r = 0; r < runs.size(); ++r) {
          const Run& run = runs[r];
          uint8_t* base = dst + run.first * sb;
          err = PreadAll(base, run.count * sb, static_cast<off_t>(slots[run.first]) * sb);
          if (err != 0) {
            failed_run = r;
            break;
          }
          for (size_t k = 0; k < run.count; ++k) {
            const uint64_t entry = Entry(slots[run.first + k]).load();
            ok[run.first + k] =
                entry != 0 && static_cast<uint32_t>(entry) == Crc32c(base + k * sb, sb);
          }
        }
      }
    }
    if (err == -1) throw nb::value_error("I/O on a closed DiskFile");
    if (err != 0) RaiseOSError(err, RunText("reading", slots, runs[failed_run]), path_);
    bool* data = ok.release();
    nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<bool*>(p); });
    size_t shape[1] = {n};
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

  static void CheckAddress(size_t n, uintptr_t address, const char* name) {
    if (n > 0 && address == 0) throw nb::value_error((std::string(name) + " is null").c_str());
  }

  static std::vector<Run> Runs(const std::vector<int64_t>& slots) {
    std::vector<Run> runs;
    size_t i = 0;
    while (i < slots.size()) {
      size_t j = i + 1;
      while (j < slots.size() && slots[j] == slots[j - 1] + 1) ++j;
      runs.push_back({i, j - i});
      i = j;
    }
    return runs;
  }

  static std::string RunText(const char* verb, const std::vector<int64_t>& slots, const Run& run) {
    std::string text = std::string(verb) + " slot";
    if (run.count == 1) return text + " " + std::to_string(slots[run.first]);
    return text + "s " + std::to_string(slots[run.first]) + ".." +
           std::to_string(slots[run.first + run.count - 1]);
  }

  // The fault that fires on this syscall of the given direction, or kNoFault.
  int TakeFault(bool is_write) {
    std::lock_guard<std::mutex> lock(fault_mutex_);
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

  // pwrite (is_write) or pread until done, with the direction's injected faults. Returns 0 or an
  // errno (EIO for a transfer that made no progress: a short write, or end of file inside the
  // preallocated file).
  int TransferAll(bool is_write, uint8_t* buf, size_t len, off_t off) {
    const int error_fault = is_write ? kEnospc : kEioRead;
    const int error_errno = is_write ? ENOSPC : EIO;
    const int short_fault = is_write ? kShortWrite : kShortRead;
    auto io = [&](size_t n) {
      return is_write ? ::pwrite(fd_, buf, n, off) : ::pread(fd_, buf, n, off);
    };
    bool zero_next = false;
    while (len > 0) {
      num_io_calls_.fetch_add(1);
      ssize_t n;
      const int fault = zero_next ? kNoFault : TakeFault(is_write);
      if (zero_next) {
        n = 0;
      } else if (fault == error_fault) {
        n = -1;
        errno = error_errno;
      } else if (fault == short_fault) {
        n = len / 2 ? io(len / 2) : 0;
        zero_next = true;
      } else {
        n = io(len);
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

  int PwriteAll(const uint8_t* buf, size_t len, off_t off) {
    return TransferAll(true, const_cast<uint8_t*>(buf), len, off);  // NOTE: pwrite only reads buf
  }
  int PreadAll(uint8_t* buf, size_t len, off_t off) { return TransferAll(false, buf, len, off); }

  // Closes and unlinks once; returns the unlink errno (0 when removed or already closed).
  int CloseImpl() {
    std::unique_lock<std::shared_mutex> lock(io_mutex_);
    if (closed_) return 0;
    closed_ = true;
    ::close(fd_);
    fd_ = -1;
    return ::unlink(path_.c_str()) == 0 ? 0 : errno;
  }

  void CloseNoThrow() noexcept { (void)CloseImpl(); }

  std::string path_;
  int fd_ = -1;
  int64_t num_slots_ = 0;
  int64_t slot_bytes_ = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> table_;  // 0: no entry; else (1 << 32) | crc32c
  std::shared_mutex io_mutex_;                       // shared: I/O, exclusive: close
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> num_io_calls_{0};
  std::mutex fault_mutex_;
  int64_t faults_[kNumFaultKinds];
};

}  // namespace

void BindDiskFile(nb::module_& m) {
  nb::class_<DiskFile>(m, "DiskFile",
                       "A preallocated, slot-addressed file with a CRC32C per page, removed on "
                       "close (the disk tier of one cold pool group).")
      .def(nb::init<std::string, int64_t, int64_t>(), nb::arg("path"), nb::arg("num_slots"),
           nb::arg("slot_bytes"),
           "Creates ``path`` exclusively (mode 0600) and preallocates num_slots * slot_bytes "
           "bytes. OSError (errno preserved, e.g. ENOSPC, EEXIST) on failure; the half-created "
           "file is removed.")
      .def_prop_ro("path", &DiskFile::path)
      .def_prop_ro("num_slots", &DiskFile::num_slots)
      .def_prop_ro("slot_bytes", &DiskFile::slot_bytes)
      .def_prop_ro("closed", &DiskFile::closed)
      .def_prop_ro("num_io_calls", &DiskFile::num_io_calls,
                   "pread/pwrite syscalls issued so far (one per run of adjacent slots unless "
                   "the kernel transferred less); injected faults count too.")
      .def("write", &DiskFile::Write, nb::arg("slots"), nb::arg("src_address"),
           "Writes page i from src_address + i * slot_bytes to slot slots[i] (int32 [n]), one "
           "I/O per run of adjacent slots, and records each page's CRC32C after its run is "
           "written. OSError on failure (see the module notes for what stays written).")
      .def("read", &DiskFile::Read, nb::arg("slots"), nb::arg("dst_address"),
           "Reads slot slots[i] into dst_address + i * slot_bytes; returns a bool [n] mask, "
           "False where the checksum does not match or the slot holds no recorded page. "
           "OSError on I/O errors and short reads (EIO).")
      .def("invalidate", &DiskFile::Invalidate, nb::arg("slots"),
           "Drops the checksum entries of ``slots``: reads of them return False until rewritten.")
      .def("close", &DiskFile::Close, "Closes and removes the file; idempotent.")
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
