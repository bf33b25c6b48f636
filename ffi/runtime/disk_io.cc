// The disk file's I/O engine (disk_io.h).
#include "disk_io.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "kvcm/runtime/errors.h"

namespace kvcm::runtime {
namespace {

constexpr const char* kFaultNames[kNumFaultKinds] = {"enospc", "short_write", "short_read",
                                                     "eio_read"};
constexpr bool kFaultIsWrite[kNumFaultKinds] = {true, true, false, false};
constexpr int64_t kMaxDefaultIoThreads = 8;

}  // namespace

int64_t DefaultIoThreads() {
  const int64_t hw = static_cast<int64_t>(std::thread::hardware_concurrency());
  return std::max<int64_t>(1, std::min(kMaxDefaultIoThreads, hw));
}

std::vector<Piece> Pieces(const std::vector<int64_t>& slots, const std::vector<int64_t>& pages,
                          size_t max_pages) {
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

int TransferAll(int fd, bool is_write, uint8_t* buf, size_t len, off_t off, size_t fault_syscall,
                int kind, std::atomic<uint64_t>& num_io_calls) noexcept {
  const int error_fault = is_write ? kEnospc : kEioRead;
  const int error_errno = is_write ? ENOSPC : EIO;
  const int short_fault = is_write ? kShortWrite : kShortRead;
  auto io = [&](size_t n) {
    return is_write ? ::pwrite(fd, buf, n, off) : ::pread(fd, buf, n, off);
  };
  bool zero_next = false;
  for (size_t syscall = 0; len > 0;) {
    num_io_calls.fetch_add(1);
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

void FaultInjector::Inject(const std::string& kind, int64_t after_ios) {
  if (after_ios < 0) {
    throw InvalidArgument("after_ios must be >= 0, got " + std::to_string(after_ios));
  }
  for (int k = 0; k < kNumFaultKinds; ++k) {
    if (kind == kFaultNames[k]) {
      std::lock_guard<std::mutex> lock(mutex_);
      faults_[k] = after_ios;
      return;
    }
  }
  throw InvalidArgument("unknown fault kind " + kind +
                        " (expected one of: enospc, short_write, short_read, eio_read)");
}

void FaultInjector::Clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& f : faults_) f = kNoFault;
}

int FaultInjector::TakeLocked(bool is_write) {
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

FaultPlan FaultInjector::Plan(bool is_write, const std::vector<Piece>& pieces,
                              size_t slot_bytes) {
  FaultPlan plan;
  plan.num_pieces = pieces.size();
  std::lock_guard<std::mutex> lock(mutex_);
  bool pending = false;
  for (int k = 0; k < kNumFaultKinds; ++k) {
    pending |= kFaultIsWrite[k] == is_write && faults_[k] != kNoFault;
  }
  if (!pending) return plan;
  for (size_t p = 0; p < pieces.size(); ++p) {
    const size_t len = pieces[p].count * slot_bytes;
    const size_t syscalls = (len + kMaxSyscallBytes - 1) / kMaxSyscallBytes;
    for (size_t j = 0; j < syscalls; ++j) {
      const int kind = TakeLocked(is_write);
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

}  // namespace kvcm::runtime
