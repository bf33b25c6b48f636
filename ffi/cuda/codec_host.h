// The cold-page codecs' host state: the registry of host index pairs (keyed by the device buffer
// XLA hands a handler), the side-stream mover's tickets and its side streams, and the movers'
// call counters. Defined in codec_host.cc with their C entry points and module functions; the
// handlers in codec.cu use them.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace kvcm::cuda {

struct HostPairs {
  std::vector<int32_t> pairs;  // 2 * n ints
  int64_t ticket = 0;          // the side-stream mover's ticket (0: none)
};

struct IndexRegistry {
  std::mutex mutex;
  std::unordered_map<uintptr_t, HostPairs> pairs;  // device pointer -> its host copy
};

IndexRegistry& Registry();

// A ticket: created by the host (0 events), given its completion event by the encode call that
// names it (submitted), then queried / waited on and released by the host.
struct Ticket {
  cudaEvent_t done = nullptr;
};

struct TicketRegistry {
  std::mutex mutex;
  int64_t next = 1;
  std::unordered_map<int64_t, Ticket> tickets;
};

TicketRegistry& Tickets();

// The side stream of `device`, created on first use (lowest priority, not synchronizing with the
// legacy stream); nullptr when it cannot be created.
cudaStream_t SideStream(int device);

// Calls per data mover since load (tests check which mover a configuration really took).
extern std::atomic<int64_t> g_concat_kernel_calls, g_concat_memcpy_calls;

}  // namespace kvcm::cuda
