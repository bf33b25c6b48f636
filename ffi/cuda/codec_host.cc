// The cold-page codecs' host state (codec_host.h) and its faces to Python: the host index
// registry's C entry points (ctypes) and the side-stream tickets' module functions (_kvcm_cuda).
#include "codec_host.h"

#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

namespace nb = nanobind;

namespace kvcm::cuda {

std::atomic<int64_t> g_concat_kernel_calls{0}, g_concat_memcpy_calls{0};

IndexRegistry& Registry() {
  static IndexRegistry* r = new IndexRegistry();  // NOTE: leaked on purpose (no exit-order issues)
  return *r;
}

TicketRegistry& Tickets() {
  static TicketRegistry* r = new TicketRegistry();  // NOTE: leaked on purpose, like Registry()
  return *r;
}

// Created on first use: see codec_host.h.
cudaStream_t SideStream(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, cudaStream_t>* streams =
      new std::unordered_map<int, cudaStream_t>();  // NOTE: leaked (streams live to exit)
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams->find(device);
  if (it != streams->end()) return it->second;
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, least) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  (*streams)[device] = s;
  return s;
}

}  // namespace kvcm::cuda

// ---- host index registry: C entry points -------------------------------------------------------
// Exported with default visibility so that Python can reach them with ctypes until module.cc binds
// them. The caller keeps an entry until the codec call that uses the device buffer has completed
// (its output is ready); re-registering a pointer replaces its entry.

#define KVCM_EXPORT extern "C" __attribute__((visibility("default")))

// Copies n (dst, src) pairs (2 * n int32) for the device buffer at device_ptr. 0 on success,
// -1 for bad arguments, -2 when out of memory.
// `ticket` (> 0) names the side-stream mover's ticket of the call (0: none).
KVCM_EXPORT int kvcm_register_host_index_pairs_ticket(uintptr_t device_ptr, const int32_t* pairs,
                                                      int64_t n, int64_t ticket) {
  if (n < 0 || (n > 0 && pairs == nullptr) || (n > 0 && device_ptr == 0) || ticket < 0)
    return -1;
  auto& reg = kvcm::cuda::Registry();
  try {
    kvcm::cuda::HostPairs entry{std::vector<int32_t>(pairs, pairs + 2 * n), ticket};
    std::lock_guard<std::mutex> lock(reg.mutex);
    reg.pairs[device_ptr] = std::move(entry);
  } catch (const std::bad_alloc&) {
    return -2;
  }
  return 0;
}

KVCM_EXPORT int kvcm_register_host_index_pairs(uintptr_t device_ptr, const int32_t* pairs,
                                               int64_t n) {
  return kvcm_register_host_index_pairs_ticket(device_ptr, pairs, n, 0);
}

// Removes the entry of device_ptr; 1 when one was removed, 0 when none existed.
KVCM_EXPORT int kvcm_unregister_host_index_pairs(uintptr_t device_ptr) {
  auto& reg = kvcm::cuda::Registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  return reg.pairs.erase(device_ptr) > 0 ? 1 : 0;
}

// Number of pairs registered for device_ptr (-1 when none); copies up to `capacity` pairs to out.
KVCM_EXPORT int64_t kvcm_lookup_host_index_pairs(uintptr_t device_ptr, int32_t* out,
                                                 int64_t capacity) {
  auto& reg = kvcm::cuda::Registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.pairs.find(device_ptr);
  if (it == reg.pairs.end()) return -1;
  const int64_t n = int64_t(it->second.pairs.size() / 2);
  if (out != nullptr && capacity > 0)
    std::memcpy(out, it->second.pairs.data(),
                size_t(std::min(n, capacity)) * 2 * sizeof(int32_t));
  return n;
}

// Number of registered device buffers (leak checks in tests).
KVCM_EXPORT int64_t kvcm_num_host_index_registrations() {
  auto& reg = kvcm::cuda::Registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  return int64_t(reg.pairs.size());
}

// Calls of the concat codec's copy kernel (which = 0) or memcpy mover (which = 1) since load.
KVCM_EXPORT int64_t kvcm_concat_mover_calls(int which) {
  return which == 0 ? kvcm::cuda::g_concat_kernel_calls.load()
                    : kvcm::cuda::g_concat_memcpy_calls.load();
}

// ---- side-stream tickets: module functions ----------------------------------------------------

namespace {

// Ticket states reported by ticket_query.
constexpr int kTicketUnknown = -1, kTicketCreated = 0, kTicketInFlight = 1, kTicketDone = 2;

int64_t TicketCreate() {
  auto& reg = kvcm::cuda::Tickets();
  std::lock_guard<std::mutex> lock(reg.mutex);
  const int64_t id = reg.next++;
  reg.tickets.emplace(id, kvcm::cuda::Ticket{});
  return id;
}

// The ticket's event, or nullptr (state set to unknown / created).
cudaEvent_t TicketEvent(int64_t id, int& state) {
  auto& reg = kvcm::cuda::Tickets();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.tickets.find(id);
  if (it == reg.tickets.end()) {
    state = kTicketUnknown;
    return nullptr;
  }
  state = kTicketCreated;
  return it->second.done;
}

[[noreturn]] void TicketError(int64_t id, const char* what, cudaError_t e) {
  cudaGetLastError();
  throw std::runtime_error("offload ticket " + std::to_string(id) + ": " + what + " failed: " +
                           cudaGetErrorString(e));
}

int TicketQuery(int64_t id) {
  int state = 0;
  cudaEvent_t done = TicketEvent(id, state);
  if (done == nullptr) return state;
  const cudaError_t e = cudaEventQuery(done);
  if (e == cudaSuccess) return kTicketDone;
  if (e == cudaErrorNotReady) return kTicketInFlight;
  TicketError(id, "cudaEventQuery", e);
}

bool TicketWait(int64_t id) {
  int state = 0;
  cudaEvent_t done = TicketEvent(id, state);
  if (state == kTicketUnknown) throw std::invalid_argument("unknown offload ticket " +
                                                           std::to_string(id));
  if (done == nullptr) return false;
  nb::gil_scoped_release release;
  const cudaError_t e = cudaEventSynchronize(done);
  if (e != cudaSuccess) TicketError(id, "cudaEventSynchronize", e);
  return true;
}

void TicketRelease(int64_t id) {
  auto& reg = kvcm::cuda::Tickets();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.tickets.find(id);
  if (it == reg.tickets.end()) return;
  // NOTE: an event still pending is released by the driver once the side stream passed it.
  if (it->second.done != nullptr) cudaEventDestroy(it->second.done);
  reg.tickets.erase(it);
}

int64_t NumTickets() {
  auto& reg = kvcm::cuda::Tickets();
  std::lock_guard<std::mutex> lock(reg.mutex);
  return int64_t(reg.tickets.size());
}

}  // namespace

// Called by _kvcm_cuda's module definition (module.cc).
void BindOffloadTickets(nb::module_& m) {
  m.def("ticket_create", &TicketCreate,
        "A new side-stream offload ticket (an id > 0) to register with an encode call's pairs.");
  m.def("ticket_query", &TicketQuery, nb::arg("ticket"),
        "-1 unknown, 0 created (no call submitted it yet), 1 copies in flight, 2 done; raises "
        "RuntimeError when the copies failed.");
  m.def("ticket_wait", &TicketWait, nb::arg("ticket"),
        "Blocks until the ticket's copies are done (True); False when no call submitted it yet "
        "(wait for the call's token first). Raises RuntimeError when they failed, ValueError for "
        "an unknown ticket.");
  m.def("ticket_release", &TicketRelease, nb::arg("ticket"),
        "Forgets the ticket (no-op when unknown).");
  m.def("num_tickets", &NumTickets, "Live tickets (leak checks in tests).");
}
