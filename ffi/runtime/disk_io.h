// The disk file's I/O engine (framework-free): pieces of adjacent pages, the threads that run
// them in order, the pread/pwrite loop and the injected faults of the tests. See disk_file.cc for
// the semantics a DiskFile call promises.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvcm::runtime {

// Fault injection (tests only): one-shot faults on the (after_ios + 1)-th following I/O syscall of
// the matching direction. Syscalls are numbered in piece order whatever the number of threads (see
// FaultInjector::Plan).
enum FaultKind : int { kEnospc = 0, kShortWrite, kShortRead, kEioRead, kNumFaultKinds };
constexpr int kNoFault = -1;

// The most one pread/pwrite asks for: Linux transfers at most 0x7ffff000 bytes per call (with 4 KiB
// pages; 0x7fff0000 with 64 KiB pages), so a request of this size is never cut by that limit and
// the number of syscalls of a piece is known before it runs.
constexpr size_t kMaxSyscallBytes = 0x7fff0000;
constexpr size_t kNoPiece = SIZE_MAX;

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

// min(8, hardware threads), at least 1.
int64_t DefaultIoThreads();

// Runs of pages adjacent both on disk (slots) and in host memory (pages), cut into pieces of at
// most max_pages pages.
std::vector<Piece> Pieces(const std::vector<int64_t>& slots, const std::vector<int64_t>& pages,
                          size_t max_pages);

// pwrite (is_write) or pread on `fd` until done, at most kMaxSyscallBytes per syscall, counting
// each syscall in num_io_calls; the fault `kind` replaces syscall number `fault_syscall`
// (kNoPiece: none). Returns 0 or an errno (EIO for a transfer that made no progress: a short
// write, or end of file inside the preallocated file).
int TransferAll(int fd, bool is_write, uint8_t* buf, size_t len, off_t off, size_t fault_syscall,
                int kind, std::atomic<uint64_t>& num_io_calls) noexcept;

class FaultInjector {
 public:
  // InvalidArgument for an unknown kind or a negative after_ios.
  void Inject(const std::string& kind, int64_t after_ios);
  void Clear();
  // Consumes the pending faults of the direction for the call's syscalls, numbered in piece order
  // (ceil(bytes / kMaxSyscallBytes) per piece), as if the pieces ran one after the other; stops at
  // the first that fires. So which piece fails, and what the call leaves behind, does not depend
  // on the number of threads.
  FaultPlan Plan(bool is_write, const std::vector<Piece>& pieces, size_t slot_bytes);

 private:
  int TakeLocked(bool is_write);  // the fault that fires on this syscall, or kNoFault

  std::mutex mutex_;
  int64_t faults_[kNumFaultKinds] = {kNoFault, kNoFault, kNoFault, kNoFault};
};

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

}  // namespace kvcm::runtime
