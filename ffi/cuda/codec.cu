// CUDA handlers of the cold-page codecs: encode_pages / decode_pages, concat and int8 codecs.
//
// Layouts and quantization: kvcm/codec.h. Both run on XLA's stream and never synchronize it
// (except in checked mode, the check_indices option, the debugging mode of every CUDA handler).
// Options arrive as the int32 "options" attribute (bits in kvcm/codec.h), set per codec.
//
// concat (HOST index location): the pairs are validated on the host while the handler runs (bad
//   pairs are refused before anything is submitted). XLA hands the handler a DEVICE buffer of
//   pairs, so the host copy comes from a registry keyed by that buffer's device pointer (its
//   extern "C" functions are in codec_host.cc); the handler fails with an error naming
//   index_pairs when none is registered. Two data movers, chosen per call:
//   - copy kernel (default whenever the cold tier is device-accessible: mapped pinned host memory
//     or device memory): one CTA per (pair, layer, K/V) piece moves it with 16-byte loads/stores,
//     reading its pair from the device operand. Measured on the H200 (benchmarks/RESULTS.md) the
//     batched memcpy below reached only 0.39x a contiguous pinned copy for 32 KiB pieces, its
//     submission alone taking as long as the copies; the kernel is what reaches the target.
//   - memcpy (cold tier in pageable host memory, which only DMA reaches, or
//     the concat_memcpy option): one copy descriptor per page per pool (2 * L per page) in ONE
//     cuMemcpyBatchAsync per call (stream-ordered source access, prefer-overlap-with-compute hint),
//     the seed's design. The driver entry point is looked up once at run time
//     (cudaGetDriverEntryPointByVersion, ABI of 12.8); where it does not exist (driver < 12.8), or
//     with the no_memcpy_batch option, the same descriptors go as one cudaMemcpyAsync each.
//   - side stream (encode only, the side_stream option; the write-back-ahead offloads): the memcpy
//     mover's descriptors, issued on a side stream of the device (created once, lowest priority,
//     non-blocking) so that the copy engines move the pages while XLA's stream runs the next steps
//     on every SM. Ordering: an event recorded on XLA's stream at this call and waited on by the
//     side stream (the copies read what earlier steps wrote); completion: an event recorded on the
//     side stream after the copies, kept in a *ticket* (codec_host.h) that the host creates
//     before the call, names in the registered host pairs, and queries / waits on through the
//     module (ticket_query, ticket_wait). The call's token is ready once the copies are ISSUED,
//     not done. NOTE (the caller's side, jax_kvcm/_storage.py): the hot slots read and the cold
//     slots written belong to the copy until its ticket completes, and the pools must stay at
//     their addresses meanwhile (steps donate them and XLA aliases them in place).
// int8 (DEVICE index location): one CTA per (pair, layer, K/V) reads its pair with one 8-byte load;
//   a pair outside the hot pool or the cold tier makes the CTA raise kBadIndexPair in the error
//   word and touch nothing (reported as an error naming index_pairs only in checked mode).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <nanobind/nanobind.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvcm/codec.h"
#include "kvcm/cuda/codec_kernels.cuh"
#include "kvcm/cuda/common.cuh"
#include "codec_host.h"

namespace nb = nanobind;

namespace kvcm::cuda {
namespace {

using namespace codec;  // the kernels of kvcm/cuda/codec_kernels.cuh

// ---- cuMemcpyBatchAsync ------------------------------------------------------------------------

PFN_cuMemcpyBatchAsync_v12080 MemcpyBatchFn() {
  static PFN_cuMemcpyBatchAsync_v12080 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemcpyBatchAsync", &p, 12080, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuMemcpyBatchAsync_v12080>(p);
  }();
  return fn;
}

struct CopyList {
  std::vector<CUdeviceptr> dsts, srcs;
  std::vector<size_t> sizes;
};

// ---- concat copy kernel launch (the kernel: kvcm/cuda/codec_kernels.cuh) -----------------------


// True when a kernel on the current device can load and store at `address`: device memory of this
// device, managed memory, or mapped pinned host memory whose device address equals its host address
// (what PinnedHostBuffer hands out). Pageable host memory is reached only by DMA (memcpy).
bool DeviceAccessible(uint64_t address) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(uintptr_t(address))) !=
      cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  int device = 0;
  cudaGetDevice(&device);
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      return attr.device == device;
    case cudaMemoryTypeManaged:
      return true;
    case cudaMemoryTypeHost:
      return attr.devicePointer == reinterpret_cast<void*>(uintptr_t(address));
    default:
      return false;
  }
}

ffi::Error ConcatKernelLaunch(bool encode, cudaStream_t stream, const CodecCall& c, char* k_base,
                              char* v_base, const ffi::AnyBuffer& index_pairs, uint64_t address) {
  const bool vec = c.hot.piece_bytes() % 16 == 0 && reinterpret_cast<uintptr_t>(k_base) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(v_base) % 16 == 0 && address % 16 == 0 &&
                   c.cold_page_bytes % 16 == 0;
  const dim3 grid(unsigned(c.num_pairs), unsigned(2 * c.hot.num_layers));
  const auto* pairs = static_cast<const int32_t*>(index_pairs.untyped_data());
  char* cold = reinterpret_cast<char*>(uintptr_t(address));
  auto kernel = encode ? (vec ? ConcatCopyKernel<true, true> : ConcatCopyKernel<true, false>)
                       : (vec ? ConcatCopyKernel<false, true> : ConcatCopyKernel<false, false>);
  kernel<<<grid, kCopyThreads, 0, stream>>>(k_base, v_base, pairs, cold, c.hot,
                                            c.cold_page_bytes);
  return LaunchError(encode ? "concat encode_pages" : "concat decode_pages");
}

// One descriptor per page per pool (2 * L per pair), in cold-page order.
ffi::Error BuildCopyList(CopyList& list, const int32_t* pairs, const CodecCall& c, bool encode,
                         uint64_t address, char* k_base, char* v_base, const char* op) {
  const int64_t piece = c.hot.piece_bytes();
  const size_t count = size_t(c.num_pairs) * size_t(2 * c.hot.num_layers);
  try {
    list.dsts.resize(count);
    list.srcs.resize(count);
    list.sizes.assign(count, size_t(piece));
  } catch (const std::bad_alloc&) {
    return ffi::Error::Internal(std::string(op) + ": out of host memory for copy descriptors");
  }
  size_t j = 0;
  for (int64_t i = 0; i < c.num_pairs; ++i) {
    const int64_t hot = encode ? pairs[2 * i + 1] : pairs[2 * i];
    const int64_t cold = encode ? pairs[2 * i] : pairs[2 * i + 1];
    const uint64_t page = address + uint64_t(cold) * uint64_t(c.cold_page_bytes);
    for (int64_t l = 0; l < c.hot.num_layers; ++l) {
      for (int kv = 0; kv < 2; ++kv, ++j) {
        const auto hot_ptr =
            CUdeviceptr((kv ? v_base : k_base) + c.hot.piece_offset(l, hot) * c.hot.itemsize);
        const auto cold_ptr = CUdeviceptr(page + uint64_t((2 * l + kv) * piece));
        list.dsts[j] = encode ? cold_ptr : hot_ptr;
        list.srcs[j] = encode ? hot_ptr : cold_ptr;
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error IssueCopies(CopyList& list, cudaStream_t stream, bool encode, int32_t options,
                       const char* op);
ffi::Error IssueOnSideStream(CopyList& list, cudaStream_t stream, int64_t ticket,
                             int32_t options, const char* op);

ffi::Error ConcatCuda(bool encode, cudaStream_t stream, const ffi::AnyBuffer& k_pool,
                      const ffi::AnyBuffer& v_pool, const ffi::AnyBuffer& index_pairs,
                      uint64_t address, int64_t num_cold_slots, int32_t options, bool slot_major,
                      char* k_base, char* v_base) {
  const char* op = encode ? "concat encode_pages" : "concat decode_pages";
  auto call = ParseCodecCall(CodecKind::kConcat, k_pool, v_pool, index_pairs, address,
                             num_cold_slots, slot_major);
  if (call.has_error()) return call.error();
  const CodecCall& c = *call;
  if (c.num_pairs == 0) return ffi::Error::Success();

  thread_local CopyList list;
  const bool side = (options & kOptSideStream) != 0;
  int64_t ticket = 0;
  bool use_kernel = false;
  {
    IndexRegistry& reg = Registry();
    std::lock_guard<std::mutex> lock(reg.mutex);
    auto it = reg.pairs.find(reinterpret_cast<uintptr_t>(index_pairs.untyped_data()));
    if (it == reg.pairs.end())
      return Invalid(std::string(op) +
                     ": index_pairs: the concat codec reads its index pairs on the host (HOST "
                     "index location), but no host copy is registered for this device buffer; "
                     "call codec.register_host_index_pairs(index_pairs, host_pairs) before the "
                     "call and unregister it once the call's output is ready");
    const std::vector<int32_t>& host = it->second.pairs;
    if (int64_t(host.size()) != 2 * c.num_pairs)
      return Invalid(std::string(op) + ": index_pairs: the registered host copy has " +
                     std::to_string(host.size() / 2) + " pairs, the operand has " +
                     std::to_string(c.num_pairs));
    if (side) {
      if (!encode) return Invalid(std::string(op) + ": the side_stream option is for encode only");
      ticket = it->second.ticket;
      if (ticket <= 0)
        return Invalid(std::string(op) + ": index_pairs: the side_stream option needs a ticket "
                       "registered with the host pairs (register_host_index_pairs(..., ticket))");
    }
    const int32_t* pairs = host.data();
    if (auto err = CheckIndexPairs(pairs, c, encode); err.failure()) return err;
    use_kernel = !side && !(options & kOptConcatMemcpy) && c.num_pairs <= int64_t(INT32_MAX) &&
                 2 * c.hot.num_layers <= 65535 && DeviceAccessible(address);
    if (!use_kernel) {
      if (auto err = BuildCopyList(list, pairs, c, encode, address, k_base, v_base, op);
          err.failure())
        return err;
    }
  }
  (use_kernel ? g_concat_kernel_calls : g_concat_memcpy_calls).fetch_add(1);
  if (use_kernel)
    return ConcatKernelLaunch(encode, stream, c, k_base, v_base, index_pairs, address);
  if (side) return IssueOnSideStream(list, stream, ticket, options, op);
  return IssueCopies(list, stream, encode, options, op);
}

// The memcpy mover: the descriptors of `list` on `stream`, batched where the driver can.
ffi::Error IssueCopies(CopyList& list, cudaStream_t stream, bool encode, int32_t options,
                       const char* op) {
  const size_t count = list.dsts.size();
  // NOTE: cuMemcpyBatchAsync refuses the legacy NULL stream; XLA never hands us that one.
  PFN_cuMemcpyBatchAsync_v12080 batch =
      stream != nullptr && !(options & kOptNoMemcpyBatch) ? MemcpyBatchFn() : nullptr;
  if (batch != nullptr) {
    int device = 0;
    cudaGetDevice(&device);
    CUmemcpyAttributes attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    CUmemLocation on_device = {CU_MEM_LOCATION_TYPE_DEVICE, device};
    CUmemLocation on_host = {CU_MEM_LOCATION_TYPE_HOST, 0};
    attr.srcLocHint = encode ? on_device : on_host;
    attr.dstLocHint = encode ? on_host : on_device;
    attr.flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE;
    size_t attr_index = 0;
    size_t fail_index = SIZE_MAX;
    CUresult r = batch(list.dsts.data(), list.srcs.data(), list.sizes.data(), count, &attr,
                       &attr_index, 1, &fail_index, reinterpret_cast<CUstream>(stream));
    if (r != CUDA_SUCCESS)
      return ffi::Error::Internal(
          std::string(op) + ": cuMemcpyBatchAsync of " + std::to_string(count) +
          " copies failed with CUresult " + std::to_string(int(r)) +
          (fail_index != SIZE_MAX ? " at copy " + std::to_string(fail_index) : std::string()));
    return ffi::Error::Success();
  }
  for (size_t j = 0; j < count; ++j) {
    cudaError_t e = cudaMemcpyAsync(reinterpret_cast<void*>(list.dsts[j]),
                                    reinterpret_cast<const void*>(list.srcs[j]), list.sizes[j],
                                    cudaMemcpyDefault, stream);
    if (e != cudaSuccess)
      return ffi::Error::Internal(std::string(op) + ": cudaMemcpyAsync " + std::to_string(j) +
                                  " of " + std::to_string(count) +
                                  " failed: " + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

// The side-stream mover: the side stream waits for what XLA's stream did up to this call, runs
// the copies, and records the completion event into `ticket`. On failure nothing is recorded (the
// ticket stays unsubmitted) and the error names the step that failed.
ffi::Error IssueOnSideStream(CopyList& list, cudaStream_t stream, int64_t ticket,
                             int32_t options, const char* op) {
  int device = 0;
  cudaGetDevice(&device);
  cudaStream_t side = SideStream(device);
  if (side == nullptr)
    return ffi::Error::Internal(std::string(op) + ": cannot create the side stream");
  cudaEvent_t start = nullptr, done = nullptr;
  bool issued = false;  // copies on the side stream: a failure waits for them (they write the
                        // host slots the caller's rollback frees)
  auto fail = [&](const char* what, cudaError_t e) {
    if (issued) cudaStreamSynchronize(side);
    if (start != nullptr) cudaEventDestroy(start);
    if (done != nullptr) cudaEventDestroy(done);
    cudaGetLastError();
    return ffi::Error::Internal(std::string(op) + ": side stream: " + what + " failed: " +
                                cudaGetErrorString(e));
  };
  cudaError_t e = cudaEventCreateWithFlags(&start, cudaEventDisableTiming);
  if (e != cudaSuccess) return fail("cudaEventCreate", e);
  if ((e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming)) != cudaSuccess)
    return fail("cudaEventCreate", e);
  if ((e = cudaEventRecord(start, stream)) != cudaSuccess) return fail("cudaEventRecord", e);
  if ((e = cudaStreamWaitEvent(side, start, 0)) != cudaSuccess)
    return fail("cudaStreamWaitEvent", e);
  issued = true;  // NOTE: even a failed IssueCopies may have issued some of them
  if (auto err = IssueCopies(list, side, /*encode=*/true, options, op); err.failure()) {
    fail("the copies", cudaSuccess);
    return err;
  }
  if ((e = cudaEventRecord(done, side)) != cudaSuccess) return fail("cudaEventRecord", e);
  cudaEventDestroy(start);  // NOTE: released by the driver once the side stream passed it
  TicketRegistry& reg = Tickets();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.tickets.find(ticket);
  if (it == reg.tickets.end() || it->second.done != nullptr) {
    // The copies are issued but nobody can wait on them: wait here rather than lose the order.
    cudaEventSynchronize(done);
    cudaEventDestroy(done);
    return Invalid(std::string(op) + ": ticket " + std::to_string(ticket) +
                   " is unknown or already used (create one per call: ticket_create)");
  }
  it->second.done = done;
  return ffi::Error::Success();
}

// ---- int8 launches (the kernels: kvcm/cuda/codec_kernels.cuh) ---------------------------------

// Checked mode only: waits for the stream and turns the error word into an error naming
// index_pairs (the word is shared with the other ops; bits they left are reported too).
ffi::Error FinishCodecChecked(cudaStream_t stream, const char* op) {
  auto taken = TakeErrorBits(stream, op);
  if (taken.has_error()) return taken.error();
  const uint32_t bits = *taken;
  if (bits == 0) return ffi::Error::Success();
  if (bits & kBadIndexPair)
    return Invalid(std::string(op) +
                   ": bad index: an index_pairs entry is outside the hot pool [0, num_slots) or "
                   "the cold tier [0, num_cold_slots)");
  return Invalid(std::string(op) + ": the error word holds bits " + std::to_string(bits) +
                 " left by an earlier unchecked op (see the check_indices options)");
}

template <typename T>
ffi::Error Int8Launch(bool encode, cudaStream_t stream, const CodecCall& c, char* k_base,
                      char* v_base, const ffi::AnyBuffer& index_pairs, uint64_t address,
                      bool checked) {
  const char* op = encode ? "int8 encode_pages" : "int8 decode_pages";
  Int8Args a;
  a.s = c.hot;
  a.lay = Int8Layout::Of(c.hot);
  a.cold_page_bytes = c.cold_page_bytes;
  a.cold_limit = c.cold_limit;
  const bool vec = c.hot.head_dim % 16 == 0 && reinterpret_cast<uintptr_t>(k_base) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(v_base) % 16 == 0 &&
                   address % kColdAddressAlignment == 0;
  const dim3 grid(unsigned(c.num_pairs), unsigned(c.hot.num_layers), 2);
  const size_t smem = size_t(c.hot.num_kv_heads) * sizeof(float);
  const auto* pairs = static_cast<const int32_t*>(index_pairs.untyped_data());
  char* cold = reinterpret_cast<char*>(uintptr_t(address));
  uint32_t* error_word = DeviceErrorWord();
  auto launch = [&](bool validate_only) {
    T* k = reinterpret_cast<T*>(k_base);
    T* v = reinterpret_cast<T*>(v_base);
    if (encode) {
      auto kernel = vec ? Int8EncodeKernel<T, true> : Int8EncodeKernel<T, false>;
      kernel<<<grid, kInt8Threads, smem, stream>>>(k, v, pairs, cold, a, error_word,
                                                   validate_only);
    } else {
      auto kernel = vec ? Int8DecodeKernel<T, true> : Int8DecodeKernel<T, false>;
      kernel<<<grid, kInt8Threads, smem, stream>>>(k, v, pairs, cold, a, error_word,
                                                   validate_only);
    }
  };
  if (checked) {  // validate first so that a refused call writes nothing
    launch(true);
    if (auto err = LaunchError(op); err.failure()) return err;
    if (auto err = FinishCodecChecked(stream, op); err.failure()) return err;
  }
  launch(false);
  return LaunchError(op);
}

ffi::Error Int8Cuda(bool encode, cudaStream_t stream, const ffi::AnyBuffer& k_pool,
                    const ffi::AnyBuffer& v_pool, const ffi::AnyBuffer& index_pairs,
                    uint64_t address, int64_t num_cold_slots, int32_t options, bool slot_major,
                    char* k_base, char* v_base) {
  const bool checked = (options & kOptCheckIndices) != 0;
  if (options & kOptSideStream)
    return Invalid("int8 codec: the side_stream option is for the concat codec only");
  auto call = ParseCodecCall(CodecKind::kInt8, k_pool, v_pool, index_pairs, address,
                             num_cold_slots, slot_major);
  if (call.has_error()) return call.error();
  const CodecCall& c = *call;
  if (c.num_pairs == 0) return ffi::Error::Success();
  if (c.num_pairs > int64_t(INT32_MAX) || c.hot.num_layers > 65535)
    return Invalid("int8 codec: at most 2^31-1 index_pairs and 65535 layers per call");
  if (c.hot.num_kv_heads > kMaxInt8Heads || c.hot.piece_elems() > int64_t(INT32_MAX))
    return Invalid("int8 codec: k_pool has too many kv heads (max " +
                   std::to_string(kMaxInt8Heads) + ") or too large a page piece");
  switch (c.hot.dtype) {
    case DType::kF32:
      return Int8Launch<float>(encode, stream, c, k_base, v_base, index_pairs, address, checked);
    case DType::kBF16:
      return Int8Launch<__nv_bfloat16>(encode, stream, c, k_base, v_base, index_pairs, address,
                                       checked);
    case DType::kF16:
      return Int8Launch<__half>(encode, stream, c, k_base, v_base, index_pairs, address, checked);
    case DType::kF8E4M3:
      return Invalid("int8 codec: float8_e4m3fn pools are refused");
  }
  return ffi::Error::Internal("int8 codec: unreachable dtype");
}

// The FFI handlers: one encode and one decode shape for both codecs.
using CodecCudaFn = ffi::Error (*)(bool encode, cudaStream_t stream, const ffi::AnyBuffer& k_pool,
                                   const ffi::AnyBuffer& v_pool, const ffi::AnyBuffer& index_pairs,
                                   uint64_t address, int64_t num_cold_slots, int32_t options,
                                   bool slot_major, char* k_base, char* v_base);

template <CodecCudaFn kCodec>
ffi::Error EncodeCudaImpl(cudaStream_t stream, ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                          ffi::AnyBuffer index_pairs, uint64_t address, int64_t num_cold_slots,
                          int32_t options, bool slot_major, ffi::Result<ffi::AnyBuffer> token) {
  if (auto err = kCodec(true, stream, k_pool, v_pool, index_pairs, address, num_cold_slots, options,
                        slot_major, static_cast<char*>(k_pool.untyped_data()),
                        static_cast<char*>(v_pool.untyped_data()));
      err.failure())
    return err;
  cudaMemsetAsync(token->untyped_data(), 0, token->size_bytes(), stream);
  return LaunchError("encode_pages");
}

template <CodecCudaFn kCodec>
ffi::Error DecodeCudaImpl(cudaStream_t stream, ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                          ffi::AnyBuffer index_pairs, uint64_t address, int64_t num_cold_slots,
                          int32_t options, bool slot_major, ffi::Result<ffi::AnyBuffer> k_out,
                          ffi::Result<ffi::AnyBuffer> v_out) {
  // NOTE: k_out / v_out alias the pools (input_output_aliases {0: 0, 1: 1}).
  return kCodec(false, stream, k_pool, v_pool, index_pairs, address, num_cold_slots, options,
                slot_major, static_cast<char*>(k_out->untyped_data()),
                static_cast<char*>(v_out->untyped_data()));
}


}  // namespace
}  // namespace kvcm::cuda


// ---- handler symbols and registrations ---------------------------------------------------------

namespace xffi = xla::ffi;

#define KVCM_ENCODE_BINDING                                        \
  xffi::Ffi::Bind()                                                \
      .Ctx<xffi::PlatformStream<cudaStream_t>>()                   \
      .Arg<xffi::AnyBuffer>()           /* k_pool [L,S,P,H,D] */   \
      .Arg<xffi::AnyBuffer>()           /* v_pool */               \
      .Arg<xffi::AnyBuffer>()           /* index_pairs [n,2] */    \
      .Attr<uint64_t>("address")        /* cold tier base */       \
      .Attr<int64_t>("num_cold_slots")  /* -1: unchecked */        \
      .Attr<int32_t>("options")         /* CodecOptionBits */      \
      .Attr<bool>("slot_major")         /* pools [S,L,P,H,D] */    \
      .Ret<xffi::AnyBuffer>()           /* token int32 [1] */

#define KVCM_DECODE_BINDING                                        \
  xffi::Ffi::Bind()                                                \
      .Ctx<xffi::PlatformStream<cudaStream_t>>()                   \
      .Arg<xffi::AnyBuffer>()           /* k_pool [L,S,P,H,D] */   \
      .Arg<xffi::AnyBuffer>()           /* v_pool */               \
      .Arg<xffi::AnyBuffer>()           /* index_pairs [n,2] */    \
      .Attr<uint64_t>("address")        /* cold tier base */       \
      .Attr<int64_t>("num_cold_slots")  /* -1: unchecked */        \
      .Attr<int32_t>("options")         /* CodecOptionBits */      \
      .Attr<bool>("slot_major")         /* pools [S,L,P,H,D] */    \
      .Ret<xffi::AnyBuffer>()           /* k_pool (aliased) */     \
      .Ret<xffi::AnyBuffer>()           /* v_pool (aliased) */

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmConcatEncodeCuda,
                              kvcm::cuda::EncodeCudaImpl<kvcm::cuda::ConcatCuda>,
                              KVCM_ENCODE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmConcatDecodeCuda,
                              kvcm::cuda::DecodeCudaImpl<kvcm::cuda::ConcatCuda>,
                              KVCM_DECODE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmInt8EncodeCuda,
                              kvcm::cuda::EncodeCudaImpl<kvcm::cuda::Int8Cuda>,
                              KVCM_ENCODE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmInt8DecodeCuda,
                              kvcm::cuda::DecodeCudaImpl<kvcm::cuda::Int8Cuda>,
                              KVCM_DECODE_BINDING);

// Called by _kvcm_cuda's registrations() (module.cc).
void AddCodecRegistrationsCuda(nb::dict& d) {
  d["kvcm_concat_encode_pages"] = nb::capsule(reinterpret_cast<void*>(KvcmConcatEncodeCuda));
  d["kvcm_concat_decode_pages"] = nb::capsule(reinterpret_cast<void*>(KvcmConcatDecodeCuda));
  d["kvcm_int8_encode_pages"] = nb::capsule(reinterpret_cast<void*>(KvcmInt8EncodeCuda));
  d["kvcm_int8_decode_pages"] = nb::capsule(reinterpret_cast<void*>(KvcmInt8DecodeCuda));
}
