// The CPU ops over the contiguous arena's pools given by address (jax_kvcm/_arena_pool.py).
//
// Why: XLA's CPU client aliases a donated input only when it allocated that buffer itself; a
// buffer imported from outside (DLPack, device_put of host memory) is immutable to it, so a step
// that donates the arena gets a fresh output and the whole input memcpy'd into it -- which reads
// the reservation's PROT_NONE super-pages and faults. So on CPU the pools never enter XLA as
// arrays: these handlers take the pools' addresses, geometry, layout and dtype as the attribute
// ``pool`` (kvcm/arena_pools.h) and run the same CPU code as write_kv / paged_attention /
// ragged_paged_attention on the reservation itself. Ordering inside a step comes from int32
// scalar tokens, one per pool: write_kv returns ``after + 1`` for each and the attention ops take
// them as operands, so XLA runs an attention after the writes before it.
//
// Every call checks that the pools lie in an open reservation (an error, not a fault, after
// the arena is closed); write_kv also checks that each row it writes is on a mapped super-page
// before writing anything.
#include <cstdint>
#include <string>

#include "kvcm/arena_pools.h"
#include "kvcm/shapes.h"

namespace kvcm {

ffi::Error WriteKvCpuImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::AnyBuffer slot_mapping, ffi::AnyBuffer layer,
                          ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                          ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                          bool check_indices, bool slot_major);  // write_kv_cpu.cc
ffi::Error AttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                        ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens,
                        const ffi::AnyBuffer* query_start, ffi::AnyBuffer layer,
                        ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, ffi::AnyBuffer out,
                        float scale, int32_t window, float soft_cap, bool ring,
                        bool slot_major, ffi::AnyBuffer* lse);  // attention_cpu.cc

namespace {

ffi::Error ArenaWriteKvImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer slot_mapping,
                            ffi::AnyBuffer layer, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                            ffi::AnyBuffer after_k, ffi::AnyBuffer after_v,
                            ffi::Result<ffi::AnyBuffer> token_k,
                            ffi::Result<ffi::AnyBuffer> token_v, ffi::Span<const int64_t> pool) {
  ArenaPools p;
  if (auto err = p.Init(pool); err.failure()) return err;
  for (auto [t, name] : {std::pair{&after_k, "after_k"}, {&after_v, "after_v"},
                         {&*token_k, "token_k"}, {&*token_v, "token_v"}})
    if (auto err = CheckToken(*t, name); err.failure()) return err;
  auto shape = ParseWriteKv(p.k(), p.v(), k, v, slot_mapping, layer, p.slot_major());
  if (shape.has_error()) return shape.error();
  const int32_t li = *static_cast<const int32_t*>(layer.untyped_data());
  if (li < 0 || li >= shape->num_layers)
    return Invalid("layer " + std::to_string(li) + " is outside [0, " +
                   std::to_string(shape->num_layers) + ")");
  if (auto err = p.CheckRowsMapped(slot_mapping, li); err.failure()) return err;
  auto err = WriteKvCpuImpl(p.k(), p.v(), k, v, slot_mapping, layer, k_scale, v_scale, p.k(),
                            p.v(), true, p.slot_major());
  if (err.failure()) return err;
  AdvanceToken(after_k, *token_k);
  AdvanceToken(after_v, *token_v);
  return ffi::Error::Success();
}

ffi::Error ArenaAttention(ffi::AnyBuffer q, ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens,
                          const ffi::AnyBuffer* query_start, ffi::AnyBuffer layer,
                          ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, ffi::AnyBuffer after_k,
                          ffi::AnyBuffer after_v, ffi::AnyBuffer out,
                          ffi::Span<const int64_t> pool, float scale, int32_t window,
                          float soft_cap, bool ring) {
  ArenaPools p;
  if (auto err = p.Init(pool); err.failure()) return err;
  for (auto [t, name] : {std::pair{&after_k, "after_k"}, {&after_v, "after_v"}})
    if (auto err = CheckToken(*t, name); err.failure()) return err;
  return AttentionCpu(q, p.k(), p.v(), page_table, seq_lens, query_start, layer, k_scale,
                      v_scale, out, scale, window, soft_cap, ring, p.slot_major(),
                      nullptr);
}

ffi::Error ArenaPagedAttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer page_table,
                                   ffi::AnyBuffer seq_lens, ffi::AnyBuffer layer,
                                   ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                                   ffi::AnyBuffer after_k, ffi::AnyBuffer after_v,
                                   ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> pool,
                                   float scale, int32_t sliding_window, float soft_cap,
                                   bool ring_table, bool check_indices) {
  (void)check_indices;  // the CPU handler always checks
  return ArenaAttention(q, page_table, seq_lens, nullptr, layer, k_scale, v_scale, after_k,
                        after_v, *out, pool, scale, sliding_window, soft_cap, ring_table);
}

ffi::Error ArenaRaggedPagedAttentionImpl(
    ffi::AnyBuffer q, ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens,
    ffi::AnyBuffer query_start, ffi::AnyBuffer layer, ffi::AnyBuffer k_scale,
    ffi::AnyBuffer v_scale, ffi::AnyBuffer after_k, ffi::AnyBuffer after_v,
    ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> pool, float scale,
    int32_t sliding_window, float soft_cap, bool ring_table, bool check_indices) {
  (void)check_indices;
  return ArenaAttention(q, page_table, seq_lens, &query_start, layer, k_scale, v_scale, after_k,
                        after_v, *out, pool, scale, sliding_window, soft_cap, ring_table);
}

}  // namespace
}  // namespace kvcm

namespace xffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmArenaWriteKvCpu, kvcm::ArenaWriteKvImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()  // k [T, Hkv, D]
                                  .Arg<xffi::AnyBuffer>()  // v
                                  .Arg<xffi::AnyBuffer>()  // slot_mapping [T] int32
                                  .Arg<xffi::AnyBuffer>()  // layer [] int32
                                  .Arg<xffi::AnyBuffer>()  // k_scale [L, Hkv] f32 (fp8) or []
                                  .Arg<xffi::AnyBuffer>()  // v_scale
                                  .Arg<xffi::AnyBuffer>()  // after_k [] int32 token
                                  .Arg<xffi::AnyBuffer>()  // after_v [] int32 token
                                  .Ret<xffi::AnyBuffer>()  // token_k = after_k + 1
                                  .Ret<xffi::AnyBuffer>()  // token_v = after_v + 1
                                  .Attr<xffi::Span<const int64_t>>("pool"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmArenaPagedAttentionCpu, kvcm::ArenaPagedAttentionImpl,
                              kvcm::BindAttentionAttrs(xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()  // q [B, H, D]
                                  .Arg<xffi::AnyBuffer>()  // page_table [B, P]
                                  .Arg<xffi::AnyBuffer>()  // seq_lens [B]
                                  .Arg<xffi::AnyBuffer>()  // layer []
                                  .Arg<xffi::AnyBuffer>()  // k_scale
                                  .Arg<xffi::AnyBuffer>()  // v_scale
                                  .Arg<xffi::AnyBuffer>()  // after_k
                                  .Arg<xffi::AnyBuffer>()  // after_v
                                  .Ret<xffi::AnyBuffer>()  // out [B, H, D]
                                  .Attr<xffi::Span<const int64_t>>("pool")));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmArenaRaggedPagedAttentionCpu,
                              kvcm::ArenaRaggedPagedAttentionImpl,
                              kvcm::BindAttentionAttrs(xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()  // q [T, H, D]
                                  .Arg<xffi::AnyBuffer>()  // page_table [B, P]
                                  .Arg<xffi::AnyBuffer>()  // seq_lens [B]
                                  .Arg<xffi::AnyBuffer>()  // query_start [B + 1]
                                  .Arg<xffi::AnyBuffer>()  // layer []
                                  .Arg<xffi::AnyBuffer>()  // k_scale
                                  .Arg<xffi::AnyBuffer>()  // v_scale
                                  .Arg<xffi::AnyBuffer>()  // after_k
                                  .Arg<xffi::AnyBuffer>()  // after_v
                                  .Ret<xffi::AnyBuffer>()  // out [T, H, D]
                                  .Attr<xffi::Span<const int64_t>>("pool")));
