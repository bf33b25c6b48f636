// _kvcm_cuda: exports the CUDA FFI handlers as capsules for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* KvcmWriteKvCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* KvcmPagedAttentionCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* KvcmRaggedPagedAttentionCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* KvcmPagedAttentionLseCuda(XLA_FFI_CallFrame* call_frame);
}

// Cold-tier pieces, each in its own file.
void BindPinnedMemory(nb::module_& m);        // ffi/runtime/pinned_memory.cc
void BindVmmReservation(nb::module_& m);      // ffi/runtime/vmm_binding.cc (the arena's memory)
void AddCodecRegistrationsCuda(nb::dict& d);  // codec.cu (declared with C++ linkage there)
void BindOffloadTickets(nb::module_& m);      // codec_host.cc (the side-stream mover's tickets)

template <typename Fn>
static nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_kvcm_cuda, m) {
  m.doc() = "jax_kvcm CUDA custom-call handlers (XLA FFI).";
  m.def("registrations", []() {
    nb::dict d;
    d["kvcm_write_kv"] = Capsule(KvcmWriteKvCuda);
    d["kvcm_paged_attention"] = Capsule(KvcmPagedAttentionCuda);
    d["kvcm_ragged_paged_attention"] = Capsule(KvcmRaggedPagedAttentionCuda);
    d["kvcm_paged_attention_lse"] = Capsule(KvcmPagedAttentionLseCuda);
    AddCodecRegistrationsCuda(d);
    return d;
  }, "Handler capsules by FFI target name.");
  BindPinnedMemory(m);
  BindVmmReservation(m);
  BindOffloadTickets(m);
}
