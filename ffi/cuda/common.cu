// Host-side helpers for the CUDA handlers.
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include <algorithm>

#include "kvcm/cuda/common.cuh"

namespace kvcm::cuda {

namespace {
constexpr int kMaxDevices = 64;
uint32_t* g_error_words[kMaxDevices] = {};
std::mutex g_mutex;
}  // namespace

uint32_t* DeviceErrorWord() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_error_words[dev] == nullptr) {
    void* p = nullptr;
    if (cudaMalloc(&p, sizeof(uint32_t)) != cudaSuccess) return nullptr;
    if (cudaMemset(p, 0, sizeof(uint32_t)) != cudaSuccess) return nullptr;
    g_error_words[dev] = static_cast<uint32_t*>(p);
  }
  return g_error_words[dev];
}

int NumSMs() {
  static int num_sms[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 132;
  if (num_sms[dev] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    num_sms[dev] = n > 0 ? n : 132;
  }
  return num_sms[dev];
}

ffi::ErrorOr<uint32_t> TakeErrorBits(cudaStream_t stream, const char* op) {
  uint32_t* word = DeviceErrorWord();
  if (word == nullptr)
    return ffi::Unexpected<ffi::Error>(
        ffi::Error::Internal("jax_kvcm: could not allocate the error word"));
  // NOTE: an error word left set by an earlier unchecked call is reported here too.
  uint32_t bits = 0;
  if (cudaMemcpyAsync(&bits, word, sizeof(bits), cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess)
    return ffi::Unexpected<ffi::Error>(
        ffi::Error::Internal(std::string(op) + ": reading the error word failed"));
  if (bits != 0) {
    cudaMemsetAsync(word, 0, sizeof(uint32_t), stream);
    cudaStreamSynchronize(stream);
  }
  return bits;
}

ffi::Error FinishChecked(cudaStream_t stream, const char* op) {
  auto taken = TakeErrorBits(stream, op);
  if (taken.has_error()) return taken.error();
  const uint32_t bits = *taken;
  if (bits == 0) return ffi::Error::Success();
  std::string msg = std::string(op) + ": bad index:";
  if (bits & kBadPage) msg += " a page_table entry is outside the cache;";
  if (bits & kBadSlot) msg += " a slot_mapping entry is outside the cache;";
  if (bits & kBadLayer) msg += " layer is outside [0, num_layers);";
  if (bits & kBadSeqLen) msg += " a seq_lens entry is outside [0, max_pages * page_size];";
  if (bits & kBadQueryStart)
    msg += " query_start is not non-decreasing within [0, T] or gives more queries than seq_lens;";
  if (bits & kBadIndexPair)
    msg += " an index_pairs entry is outside the hot pool or the cold tier;";
  return ffi::Error::InvalidArgument(msg);
}

void* Workspace(cudaStream_t stream, size_t bytes) {
  struct Buffer { void* ptr = nullptr; size_t bytes = 0; };
  static std::map<cudaStream_t, Buffer> buffers;  // NOTE: stream-ordered reuse, never shrunk
  std::lock_guard<std::mutex> lock(g_mutex);
  Buffer& buf = buffers[stream];
  if (buf.bytes >= bytes) return buf.ptr;
  if (buf.ptr != nullptr) {
    // Kernels already queued on this stream may still use the old buffer.
    if (cudaStreamSynchronize(stream) != cudaSuccess) return nullptr;
    cudaFree(buf.ptr);
    buf = Buffer{};
  }
  const size_t want = std::max<size_t>(bytes + bytes / 2, size_t(1) << 20);
  if (cudaMalloc(&buf.ptr, want) != cudaSuccess) {
    cudaGetLastError();
    buf = Buffer{};
    return nullptr;
  }
  buf.bytes = want;
  return buf.ptr;
}

}  // namespace kvcm::cuda
