// The CPU ops over the contiguous arena's pools given by address (jax_kvcm/_arena_ops.py).
//
// Why: XLA's CPU client aliases a donated input only when it allocated that buffer itself; a
// buffer imported from outside (DLPack, device_put of host memory) is immutable to it, so a step
// that donates the arena gets a fresh output and the whole input memcpy'd into it -- which reads
// the reservation's PROT_NONE super-pages and faults. So on CPU the pools never enter XLA as
// arrays: these handlers take the pools' addresses and geometry as an attribute
// ``pool = [k_address, v_address, num_layers, num_pages, page_size, num_kv_heads, head_dim]``
// and run the same CPU code as write_kv / paged_attention / ragged_paged_attention on the
// reservation itself. Ordering inside a step comes from int32 scalar tokens, one per pool:
// write_kv returns ``after + 1`` for each and the attention ops take them as operands, so XLA
// runs an attention after the writes before it.
//
// Every call checks that the pools lie in an open reservation (an error, not a fault, after
// the arena is closed); write_kv also checks that each row it writes is on a mapped super-page
// before writing anything.
#include <cstdint>
#include <string>

#include "kvcm/arena_registry.h"
#include "kvcm/shapes.h"

namespace kvcm {

ffi::Error WriteKvCpuImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::AnyBuffer slot_mapping, ffi::AnyBuffer layer,
                          ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                          ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                          bool check_indices);  // write_kv_cpu.cc
ffi::Error AttentionCpu(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                        ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens,
                        const ffi::AnyBuffer* query_start, ffi::AnyBuffer layer,
                        ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, ffi::AnyBuffer out,
                        float scale, int32_t window, float soft_cap,
                        bool ring);  // attention_cpu.cc

namespace {

// The two pools as buffers over the reservation (no copy), built from the ``pool`` attribute.
class ArenaPools {
 public:
  ffi::Error Init(ffi::Span<const int64_t> pool, ffi::DataType dtype) {
    if (pool.size() != 7)
      return Invalid("pool must be [k_address, v_address, num_layers, num_pages, page_size, "
                     "num_kv_heads, head_dim], got " + std::to_string(pool.size()) + " values");
    int64_t count = 1;
    for (int i = 0; i < 5; ++i) {
      dims_[i] = pool[2 + i];
      if (dims_[i] < 1) return Invalid("pool has an empty dimension");
      count *= dims_[i];
    }
    if (!ToComputeDType(dtype)) return Invalid("arena pools are float32, bfloat16 or float16");
    bytes_ = size_t(count) * ffi::ByteWidth(dtype);
    for (int i = 0; i < 2; ++i) {
      const auto address = static_cast<uintptr_t>(pool[i]);
      if (!ArenaHolds(address, bytes_))
        return Invalid(std::string(i ? "v" : "k") +
                       " pool is not inside an open arena reservation (closed arena?)");
      buf_[i] = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr,
                               static_cast<XLA_FFI_DataType>(dtype),
                               reinterpret_cast<void*>(address), 5, dims_};
    }
    return ffi::Error::Success();
  }

  ffi::AnyBuffer k() const { return ffi::AnyBuffer(&buf_[0]); }
  ffi::AnyBuffer v() const { return ffi::AnyBuffer(&buf_[1]); }

  // Refuses a row in an unmapped super-page (the checks ParseWriteKv and WriteKvCpuImpl make
  // on shapes and slot bounds come first).
  ffi::Error CheckRowsMapped(const ffi::AnyBuffer& slot_mapping, int32_t layer) const {
    const int64_t row = dims_[3] * dims_[4] * int64_t(ffi::ByteWidth(
                                                  static_cast<ffi::DataType>(buf_[0].dtype)));
    const int64_t layer_bytes = dims_[1] * dims_[2] * row;
    const auto* slots = static_cast<const int32_t*>(slot_mapping.untyped_data());
    const int64_t n = slot_mapping.dimensions()[0];
    for (int64_t t = 0; t < n; ++t) {
      if (slots[t] < 0 || slots[t] >= dims_[1] * dims_[2]) continue;  // padding / refused later
      for (int i = 0; i < 2; ++i) {
        auto at = reinterpret_cast<uintptr_t>(buf_[i].data) +
                  static_cast<uintptr_t>(layer * layer_bytes + slots[t] * row);
        if (!ArenaMapped(at, size_t(row)))
          return Invalid("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slots[t]) +
                         " is in an unmapped part of the arena");
      }
    }
    return ffi::Error::Success();
  }

 private:
  int64_t dims_[5] = {};
  size_t bytes_ = 0;
  XLA_FFI_Buffer buf_[2] = {};
};

ffi::Error CheckToken(const ffi::AnyBuffer& t, const char* name) {
  if (t.element_type() != ffi::DataType::S32 || t.dimensions().size() != 0)
    return Invalid(std::string(name) + " must be an int32 scalar");
  return ffi::Error::Success();
}

ffi::Error ArenaWriteKvImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer slot_mapping,
                            ffi::AnyBuffer layer, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                            ffi::AnyBuffer after_k, ffi::AnyBuffer after_v,
                            ffi::Result<ffi::AnyBuffer> token_k,
                            ffi::Result<ffi::AnyBuffer> token_v, ffi::Span<const int64_t> pool) {
  ArenaPools p;
  if (auto err = p.Init(pool, k.element_type()); err.failure()) return err;
  for (auto [t, name] : {std::pair{&after_k, "after_k"}, {&after_v, "after_v"},
                         {&*token_k, "token_k"}, {&*token_v, "token_v"}})
    if (auto err = CheckToken(*t, name); err.failure()) return err;
  auto shape = ParseWriteKv(p.k(), p.v(), k, v, slot_mapping, layer);
  if (shape.has_error()) return shape.error();
  const int32_t li = *static_cast<const int32_t*>(layer.untyped_data());
  if (li < 0 || li >= shape->num_layers)
    return Invalid("layer " + std::to_string(li) + " is outside [0, " +
                   std::to_string(shape->num_layers) + ")");
  if (auto err = p.CheckRowsMapped(slot_mapping, li); err.failure()) return err;
  auto err = WriteKvCpuImpl(p.k(), p.v(), k, v, slot_mapping, layer, k_scale, v_scale, p.k(),
                            p.v(), true);
  if (err.failure()) return err;
  *static_cast<int32_t*>(token_k->untyped_data()) =
      *static_cast<const int32_t*>(after_k.untyped_data()) + 1;
  *static_cast<int32_t*>(token_v->untyped_data()) =
      *static_cast<const int32_t*>(after_v.untyped_data()) + 1;
  return ffi::Error::Success();
}

ffi::Error ArenaAttention(ffi::AnyBuffer q, ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens,
                          const ffi::AnyBuffer* query_start, ffi::AnyBuffer layer,
                          ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, ffi::AnyBuffer after_k,
                          ffi::AnyBuffer after_v, ffi::AnyBuffer out,
                          ffi::Span<const int64_t> pool, float scale, int32_t window,
                          float soft_cap, bool ring) {
  ArenaPools p;
  if (auto err = p.Init(pool, q.element_type()); err.failure()) return err;
  for (auto [t, name] : {std::pair{&after_k, "after_k"}, {&after_v, "after_v"}})
    if (auto err = CheckToken(*t, name); err.failure()) return err;
  return AttentionCpu(q, p.k(), p.v(), page_table, seq_lens, query_start, layer, k_scale,
                      v_scale, out, scale, window, soft_cap, ring);
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
                                  .Arg<xffi::AnyBuffer>()  // k_scale (empty: no fp8 arena)
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
