// CUDA handlers for paged_attention and ragged_paged_attention: parse, pick a kernel, launch.
#include "kvcm/cuda/attention.cuh"

namespace kvcm::cuda {
namespace {

ffi::ErrorOr<AttentionArgs> MakeArgs(ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                     ffi::AnyBuffer v_cache, ffi::AnyBuffer page_table,
                                     ffi::AnyBuffer seq_lens, const ffi::AnyBuffer* query_start,
                                     ffi::AnyBuffer layer, ffi::AnyBuffer k_scale,
                                     ffi::AnyBuffer v_scale, ffi::AnyBuffer out, float scale,
                                     int32_t window, float soft_cap, bool ring, bool slot_major) {
  auto shape = ParseAttention(q, k_cache, v_cache, page_table, seq_lens, query_start, layer, out,
                              slot_major);
  if (shape.has_error()) return ffi::Unexpected<ffi::Error>(shape.error());
  if (auto err = CheckScales(shape->cache, k_scale, v_scale); err.failure())
    return ffi::Unexpected<ffi::Error>(err);
  AttentionArgs a;
  a.q = q.untyped_data();
  a.k_cache = k_cache.untyped_data();
  a.v_cache = v_cache.untyped_data();
  a.out = out.untyped_data();
  a.page_table = static_cast<const int32_t*>(page_table.untyped_data());
  a.seq_lens = static_cast<const int32_t*>(seq_lens.untyped_data());
  a.query_start = query_start ? static_cast<const int32_t*>(query_start->untyped_data()) : nullptr;
  a.layer = static_cast<const int32_t*>(layer.untyped_data());
  if (shape->fp8()) {
    a.k_scale = static_cast<const float*>(k_scale.untyped_data());
    a.v_scale = static_cast<const float*>(v_scale.untyped_data());
  }
  a.ring = ring;
  a.shape = *shape;
  a.scale = scale;
  a.window = window;
  a.soft_cap = soft_cap;
  a.error_word = DeviceErrorWord();
  return a;
}

ffi::Error Run(cudaStream_t stream, const AttentionArgs& a, const char* op, bool check_indices) {
  if (a.shape.num_queries == 0) return ffi::Error::Success();
  ffi::Error err = ffi::Error::Success();
  if (a.query_start == nullptr) {
    err = PagedDecodeSupports(a) ? LaunchPagedDecode(stream, a)
                                 : LaunchSimpleAttention(stream, a);
  } else {
    err = RaggedPrefillSupports(a) ? LaunchRaggedPrefill(stream, a)
                                   : LaunchSimpleAttention(stream, a);
  }
  if (err.failure()) return err;
  if (check_indices) return FinishChecked(stream, op);
  return ffi::Error::Success();
}

ffi::Error PagedAttentionCudaImpl(cudaStream_t stream,
                                  ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                  ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens,
                                  ffi::AnyBuffer layer, ffi::AnyBuffer k_scale,
                                  ffi::AnyBuffer v_scale, ffi::Result<ffi::AnyBuffer> out,
                                  float scale, int32_t sliding_window, float soft_cap,
                                  bool ring_table, bool check_indices, bool slot_major) {
  auto a = MakeArgs(q, k_cache, v_cache, page_table, seq_lens, nullptr, layer, k_scale, v_scale,
                    *out, scale, sliding_window, soft_cap, ring_table, slot_major);
  if (a.has_error()) return a.error();
  return Run(stream, *a, "paged_attention", check_indices);
}

ffi::Error PagedAttentionLseCudaImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                     ffi::AnyBuffer v_cache, ffi::AnyBuffer page_table,
                                     ffi::AnyBuffer seq_lens, ffi::AnyBuffer layer,
                                     ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                                     ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::AnyBuffer> lse, float scale,
                                     int32_t sliding_window, float soft_cap, bool ring_table,
                                     bool check_indices, bool slot_major) {
  auto a = MakeArgs(q, k_cache, v_cache, page_table, seq_lens, nullptr, layer, k_scale, v_scale,
                    *out, scale, sliding_window, soft_cap, ring_table, slot_major);
  if (a.has_error()) return a.error();
  if (auto err = CheckLse(a->shape, *lse); err.failure()) return err;
  a->lse = static_cast<float*>(lse->untyped_data());
  return Run(stream, *a, "paged_attention", check_indices);
}

ffi::Error RaggedPagedAttentionCudaImpl(cudaStream_t stream,
                                        ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                        ffi::AnyBuffer v_cache, ffi::AnyBuffer page_table,
                                        ffi::AnyBuffer seq_lens, ffi::AnyBuffer query_start,
                                        ffi::AnyBuffer layer, ffi::AnyBuffer k_scale,
                                        ffi::AnyBuffer v_scale, ffi::Result<ffi::AnyBuffer> out,
                                        float scale, int32_t sliding_window, float soft_cap,
                                        bool ring_table, bool check_indices, bool slot_major) {
  auto a = MakeArgs(q, k_cache, v_cache, page_table, seq_lens, &query_start, layer, k_scale,
                    v_scale, *out, scale, sliding_window, soft_cap, ring_table, slot_major);
  if (a.has_error()) return a.error();
  return Run(stream, *a, "ragged_paged_attention", check_indices);
}

}  // namespace
}  // namespace kvcm::cuda

namespace xffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KvcmPagedAttentionCuda, kvcm::cuda::PagedAttentionCudaImpl,
    kvcm::BindAttentionAttrs(
        kvcm::BindDecodeOperands(xffi::Ffi::Bind().Ctx<xffi::PlatformStream<cudaStream_t>>())
            .Ret<xffi::AnyBuffer>())  // out [B, H, D]
        .Attr<bool>("slot_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmRaggedPagedAttentionCuda,
                              kvcm::cuda::RaggedPagedAttentionCudaImpl,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // q [T, H, D]
                                  .Arg<xffi::AnyBuffer>()  // k_cache (layout: slot_major)
                                  .Arg<xffi::AnyBuffer>()  // v_cache
                                  .Arg<xffi::AnyBuffer>()  // page_table [B, P]
                                  .Arg<xffi::AnyBuffer>()  // seq_lens [B]
                                  .Arg<xffi::AnyBuffer>()  // query_start [B + 1]
                                  .Arg<xffi::AnyBuffer>()  // layer []
                                  .Arg<xffi::AnyBuffer>()  // k_scale [L, Hkv] f32 (fp8) or []
                                  .Arg<xffi::AnyBuffer>()  // v_scale
                                  .Ret<xffi::AnyBuffer>()  // out [T, H, D]
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("ring_table")
                                  .Attr<bool>("check_indices")
                                  .Attr<bool>("slot_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    KvcmPagedAttentionLseCuda, kvcm::cuda::PagedAttentionLseCudaImpl,
    kvcm::BindAttentionAttrs(
        kvcm::BindDecodeOperands(xffi::Ffi::Bind().Ctx<xffi::PlatformStream<cudaStream_t>>())
            .Ret<xffi::AnyBuffer>()   // out [B, H, D]
            .Ret<xffi::AnyBuffer>())  // lse [B, H] f32
        .Attr<bool>("slot_major"));
