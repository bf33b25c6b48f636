// Shared-memory mbarrier and named-barrier primitives (sm_90 PTX: try_wait), used by the
// producer/consumer rings of the decode and Hopper prefill kernels.
#pragma once

#include <cstdint>

#include "kvcm/cuda/mma.cuh"

namespace kvcm::cuda {

__device__ __forceinline__ void MbarInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count));
}
// Arrives on `bar` once every cp.async this thread issued so far has landed (counted in the
// barrier's initial arrival count: .noinc).
__device__ __forceinline__ void MbarArriveOnCopies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(SmemAddr(bar))
               : "memory");
}
// One arrival of the calling thread (release: its earlier shared-memory reads and writes happen
// before the phase completes).
__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddr(bar)) : "memory");
}
// Waits until the phase of parity `parity` of `bar` has completed (acquire).
__device__ __forceinline__ void MbarWait(uint64_t* bar, int parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void NamedBarrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace kvcm::cuda
