// _kvcm_cpu: exports the CPU FFI handlers as capsules for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* KvcmWriteKvCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* KvcmPagedAttentionCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* KvcmRaggedPagedAttentionCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* KvcmPagedAttentionLseCpu(XLA_FFI_CallFrame* call_frame);
// The same ops over the CPU arena's pools given by address (arena_ops_cpu.cc).
XLA_FFI_Error* KvcmArenaWriteKvCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* KvcmArenaPagedAttentionCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* KvcmArenaRaggedPagedAttentionCpu(XLA_FFI_CallFrame* call_frame);
}

// Cold-tier pieces, each in its own file.
void BindHostMemory(nb::module_& m);        // ffi/runtime/host_memory.cc
void BindDiskFile(nb::module_& m);          // ffi/runtime/disk_file.cc
void BindMemfdReservation(nb::module_& m);  // ffi/runtime/memfd_binding.cc (the arena's memory)
void AddCodecRegistrations(nb::dict& d);    // codec_cpu.cc

template <typename Fn>
static nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_kvcm_cpu, m) {
  m.doc() = "jax_kvcm CPU custom-call handlers (XLA FFI).";
  m.def("registrations", []() {
    nb::dict d;
    d["kvcm_write_kv"] = Capsule(KvcmWriteKvCpu);
    d["kvcm_paged_attention"] = Capsule(KvcmPagedAttentionCpu);
    d["kvcm_ragged_paged_attention"] = Capsule(KvcmRaggedPagedAttentionCpu);
    d["kvcm_paged_attention_lse"] = Capsule(KvcmPagedAttentionLseCpu);
    d["kvcm_arena_write_kv"] = Capsule(KvcmArenaWriteKvCpu);
    d["kvcm_arena_paged_attention"] = Capsule(KvcmArenaPagedAttentionCpu);
    d["kvcm_arena_ragged_paged_attention"] = Capsule(KvcmArenaRaggedPagedAttentionCpu);
    AddCodecRegistrations(d);
    return d;
  }, "Handler capsules by FFI target name.");
  BindHostMemory(m);
  BindDiskFile(m);
  BindMemfdReservation(m);
}
