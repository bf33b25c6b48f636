// CPU handlers of the cold-page codecs: encode_pages / decode_pages for the concat and int8 codecs.
//
// The cold tier is addressed by the static attribute `address` (on CPU builds the host address);
// layouts and quantization are spelled out in kvcm/codec.h. Every pair is validated before
// anything is written: a refused call leaves the hot pools and the cold tier untouched.
// The hot pools are layer-major arrays, slot-major arrays (the slot_major attribute), or a CPU
// arena's pools by address (the kvcm_arena_* handlers at the end, kvcm/arena_pools.h); the cold
// bytes are the same in every case.
#include <nanobind/nanobind.h>

#include <cmath>
#include <cstring>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "kvcm/arena_pools.h"
#include "kvcm/codec.h"
#include "kvcm/host_dtype.h"

namespace nb = nanobind;

namespace kvcm {
namespace {

char* ColdPage(uint64_t address, int64_t slot, int64_t cold_page_bytes) {
  return reinterpret_cast<char*>(uintptr_t(address)) + slot * cold_page_bytes;
}

// ---- concat ------------------------------------------------------------------------------------

ffi::Error ConcatCopy(bool encode, char* k_pool, char* v_pool, const ffi::AnyBuffer& index_pairs,
                      const CodecCall& c, uint64_t address) {
  const auto* pairs = static_cast<const int32_t*>(index_pairs.untyped_data());
  if (auto err = CheckIndexPairs(pairs, c, encode); err.failure()) return err;
  const int64_t piece = c.hot.piece_bytes();
  for (int64_t i = 0; i < c.num_pairs; ++i) {
    const int64_t hot = encode ? pairs[2 * i + 1] : pairs[2 * i];
    const int64_t cold = encode ? pairs[2 * i] : pairs[2 * i + 1];
    char* page = ColdPage(address, cold, c.cold_page_bytes);
    for (int64_t l = 0; l < c.hot.num_layers; ++l) {
      char* k = k_pool + c.hot.piece_offset(l, hot) * c.hot.itemsize;
      char* v = v_pool + c.hot.piece_offset(l, hot) * c.hot.itemsize;
      char* ck = page + (2 * l) * piece;
      char* cv = page + (2 * l + 1) * piece;
      if (encode) {
        std::memcpy(ck, k, size_t(piece));
        std::memcpy(cv, v, size_t(piece));
      } else {
        std::memcpy(k, ck, size_t(piece));
        std::memcpy(v, cv, size_t(piece));
      }
    }
  }
  return ffi::Error::Success();
}

// ---- int8 --------------------------------------------------------------------------------------

// XLA's CPU runtime runs handlers with denormals flushed (FTZ/DAZ). The int8 format is defined with
// IEEE float32 arithmetic (as on the GPU, where nvcc keeps subnormals without fast-math), so the
// quantization runs with them restored, and the caller's mode is put back on exit.
class ScopedIeeeDenormals {
 public:
  ScopedIeeeDenormals() {
#if defined(__SSE__) || defined(__x86_64__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(0x8000u | 0x0040u));  // clear FTZ (bit 15) and DAZ (bit 6)
#elif defined(__aarch64__)
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t ieee = saved_ & ~(uint64_t(1) << 24);  // clear FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(ieee));
#endif
  }
  ~ScopedIeeeDenormals() {
#if defined(__SSE__) || defined(__x86_64__)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  ScopedIeeeDenormals(const ScopedIeeeDenormals&) = delete;
  ScopedIeeeDenormals& operator=(const ScopedIeeeDenormals&) = delete;

 private:
#if defined(__SSE__) || defined(__x86_64__)
  unsigned int saved_ = 0;
#else
  uint64_t saved_ = 0;
#endif
};

template <typename T>
void Int8EncodePage(const T* k_pool, const T* v_pool, const CodecCall& c, const Int8Layout& lay,
                    int64_t hot, char* page) {
  const HotPoolShape& s = c.hot;
  const int64_t P = s.page_size, H = s.num_kv_heads, D = s.head_dim;
  for (int64_t l = 0; l < s.num_layers; ++l) {
    for (int64_t kv = 0; kv < 2; ++kv) {
      const T* piece = (kv ? v_pool : k_pool) + s.piece_offset(l, hot);
      for (int64_t h = 0; h < H; ++h) {
        float amax = 0.f;
        for (int64_t p = 0; p < P; ++p)
          for (int64_t d = 0; d < D; ++d) {
            const float a = std::fabs(ToFloat(piece[(p * H + h) * D + d]));
            if (a > amax) amax = a;  // NaN ignored
          }
        float scale = amax / 127.f;
        if (!(scale > 0.f)) scale = 1.f;
        auto* q = reinterpret_cast<int8_t*>(page + lay.payload_offset(s, l, kv, h));
        for (int64_t p = 0; p < P; ++p)
          for (int64_t d = 0; d < D; ++d) {
            float r = ToFloat(piece[(p * H + h) * D + d]) / scale;
            r = std::fmin(std::fmax(r, -127.f), 127.f);
            q[p * D + d] = int8_t(std::nearbyint(r));  // round half to even (default mode)
          }
        std::memcpy(page + lay.scale_offset(s, l, kv, h), &scale, sizeof(float));
      }
    }
  }
  std::memset(page + lay.payload_bytes, 0, size_t(lay.scales_offset - lay.payload_bytes));
  std::memset(page + lay.scales_end, 0, size_t(lay.cold_page_bytes - lay.scales_end));
}

template <typename T>
void Int8DecodePage(T* k_pool, T* v_pool, const CodecCall& c, const Int8Layout& lay,
                    const char* page, int64_t hot) {
  const HotPoolShape& s = c.hot;
  const int64_t P = s.page_size, H = s.num_kv_heads, D = s.head_dim;
  for (int64_t l = 0; l < s.num_layers; ++l) {
    for (int64_t kv = 0; kv < 2; ++kv) {
      T* piece = (kv ? v_pool : k_pool) + s.piece_offset(l, hot);
      for (int64_t h = 0; h < H; ++h) {
        float scale;
        std::memcpy(&scale, page + lay.scale_offset(s, l, kv, h), sizeof(float));
        const auto* q = reinterpret_cast<const int8_t*>(page + lay.payload_offset(s, l, kv, h));
        for (int64_t p = 0; p < P; ++p)
          for (int64_t d = 0; d < D; ++d)
            piece[(p * H + h) * D + d] = FromFloat<T>(Int8Dequantize(q[p * D + d], scale));
      }
    }
  }
}

template <typename T>
void Int8Run(bool encode, char* k_pool, char* v_pool, const int32_t* pairs, const CodecCall& c,
             uint64_t address) {
  const Int8Layout lay = Int8Layout::Of(c.hot);
  for (int64_t i = 0; i < c.num_pairs; ++i) {
    const int64_t dst = pairs[2 * i], src = pairs[2 * i + 1];
    if (encode)
      Int8EncodePage<T>(reinterpret_cast<const T*>(k_pool), reinterpret_cast<const T*>(v_pool), c,
                        lay, src, ColdPage(address, dst, c.cold_page_bytes));
    else
      Int8DecodePage<T>(reinterpret_cast<T*>(k_pool), reinterpret_cast<T*>(v_pool), c, lay,
                        ColdPage(address, src, c.cold_page_bytes), dst);
  }
}

ffi::Error Int8Dispatch(bool encode, char* k_pool, char* v_pool,
                        const ffi::AnyBuffer& index_pairs, const CodecCall& c, uint64_t address) {
  const auto* pairs = static_cast<const int32_t*>(index_pairs.untyped_data());
  if (auto err = CheckIndexPairs(pairs, c, encode); err.failure()) return err;
  ScopedIeeeDenormals ieee;
  switch (c.hot.dtype) {
    case DType::kF32: Int8Run<float>(encode, k_pool, v_pool, pairs, c, address); break;
    case DType::kBF16: Int8Run<bf16_t>(encode, k_pool, v_pool, pairs, c, address); break;
    case DType::kF16: Int8Run<f16_t>(encode, k_pool, v_pool, pairs, c, address); break;
    case DType::kF8E4M3: return Invalid("int8 codec: float8_e4m3fn pools are refused");
  }
  return ffi::Error::Success();
}

// ---- handlers ----------------------------------------------------------------------------------

ffi::Error RunCodec(CodecKind kind, bool encode, char* k_pool, char* v_pool,
                    const ffi::AnyBuffer& index_pairs, const CodecCall& c, uint64_t address) {
  return kind == CodecKind::kConcat ? ConcatCopy(encode, k_pool, v_pool, index_pairs, c, address)
                                    : Int8Dispatch(encode, k_pool, v_pool, index_pairs, c, address);
}

template <CodecKind kKind>
ffi::Error EncodeCpuImpl(ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, ffi::AnyBuffer index_pairs,
                         uint64_t address, int64_t num_cold_slots, int32_t options,
                         bool slot_major, ffi::Result<ffi::AnyBuffer> token) {
  (void)options;
  auto call = ParseCodecCall(kKind, k_pool, v_pool, index_pairs, address, num_cold_slots,
                             slot_major);
  if (call.has_error()) return call.error();
  if (auto err = RunCodec(kKind, true, static_cast<char*>(k_pool.untyped_data()),
                          static_cast<char*>(v_pool.untyped_data()), index_pairs, *call, address);
      err.failure())
    return err;
  std::memset(token->untyped_data(), 0, token->size_bytes());
  return ffi::Error::Success();
}

template <CodecKind kKind>
ffi::Error DecodeCpuImpl(ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool, ffi::AnyBuffer index_pairs,
                         uint64_t address, int64_t num_cold_slots, int32_t options,
                         bool slot_major, ffi::Result<ffi::AnyBuffer> k_out,
                         ffi::Result<ffi::AnyBuffer> v_out) {
  (void)options;
  auto call = ParseCodecCall(kKind, k_pool, v_pool, index_pairs, address, num_cold_slots,
                             slot_major);
  if (call.has_error()) return call.error();
  // NOTE: the outputs alias the pools (input_output_aliases {0: 0, 1: 1}): they hold the pool
  // contents already; only the decoded slots are written.
  return RunCodec(kKind, false, static_cast<char*>(k_out->untyped_data()),
                  static_cast<char*>(v_out->untyped_data()), index_pairs, *call, address);
}

// A CPU arena's pools by address: the pairs and the mapping of every hot page they name are
// checked before anything moves.
ffi::Error ArenaCodec(CodecKind kind, bool encode, const ffi::AnyBuffer& index_pairs,
                      const ffi::AnyBuffer& after_k, const ffi::AnyBuffer& after_v,
                      uint64_t address, int64_t num_cold_slots, ffi::Span<const int64_t> pool) {
  ArenaPools p;
  if (auto err = p.Init(pool); err.failure()) return err;
  for (auto [t, name] : {std::pair{&after_k, "after_k"}, {&after_v, "after_v"}})
    if (auto err = CheckToken(*t, name); err.failure()) return err;
  auto call = ParseCodecCall(kind, p.k(), p.v(), index_pairs, address, num_cold_slots,
                             p.slot_major());
  if (call.has_error()) return call.error();
  const auto* pairs = static_cast<const int32_t*>(index_pairs.untyped_data());
  if (auto err = CheckIndexPairs(pairs, *call, encode); err.failure()) return err;
  for (int64_t i = 0; i < call->num_pairs; ++i)
    if (auto err = p.CheckPageMapped(pairs[2 * i + (encode ? 1 : 0)], "index_pairs");
        err.failure())
      return err;
  return RunCodec(kind, encode, static_cast<char*>(p.k().untyped_data()),
                  static_cast<char*>(p.v().untyped_data()), index_pairs, *call, address);
}

template <CodecKind kKind>
ffi::Error ArenaEncodeCpuImpl(ffi::AnyBuffer index_pairs, ffi::AnyBuffer after_k,
                              ffi::AnyBuffer after_v, uint64_t address, int64_t num_cold_slots,
                              int32_t options, ffi::Span<const int64_t> pool,
                              ffi::Result<ffi::AnyBuffer> token) {
  (void)options;
  if (auto err = ArenaCodec(kKind, true, index_pairs, after_k, after_v, address, num_cold_slots,
                            pool);
      err.failure())
    return err;
  std::memset(token->untyped_data(), 0, token->size_bytes());
  return ffi::Error::Success();
}

template <CodecKind kKind>
ffi::Error ArenaDecodeCpuImpl(ffi::AnyBuffer index_pairs, ffi::AnyBuffer after_k,
                              ffi::AnyBuffer after_v, uint64_t address, int64_t num_cold_slots,
                              int32_t options, ffi::Span<const int64_t> pool,
                              ffi::Result<ffi::AnyBuffer> token_k,
                              ffi::Result<ffi::AnyBuffer> token_v) {
  (void)options;
  for (auto [t, name] : {std::pair{&*token_k, "token_k"}, {&*token_v, "token_v"}})
    if (auto err = CheckToken(*t, name); err.failure()) return err;
  if (auto err = ArenaCodec(kKind, false, index_pairs, after_k, after_v, address, num_cold_slots,
                            pool);
      err.failure())
    return err;
  AdvanceToken(after_k, *token_k);
  AdvanceToken(after_v, *token_v);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kvcm

namespace xffi = xla::ffi;

#define KVCM_CODEC_ATTRS                                          \
  .Attr<uint64_t>("address")        /* cold tier base */          \
      .Attr<int64_t>("num_cold_slots")  /* -1: unchecked */       \
      .Attr<int32_t>("options")         /* ignored on CPU */

#define KVCM_ENCODE_BINDING                                       \
  xffi::Ffi::Bind()                                               \
      .Arg<xffi::AnyBuffer>()           /* k_pool [L,S,P,H,D] */  \
      .Arg<xffi::AnyBuffer>()           /* v_pool */              \
      .Arg<xffi::AnyBuffer>()           /* index_pairs [n,2] */   \
      KVCM_CODEC_ATTRS                                            \
      .Attr<bool>("slot_major")         /* pools [S,L,P,H,D] */   \
      .Ret<xffi::AnyBuffer>()           /* token int32 [1] */

#define KVCM_DECODE_BINDING                                       \
  xffi::Ffi::Bind()                                               \
      .Arg<xffi::AnyBuffer>()           /* k_pool [L,S,P,H,D] */  \
      .Arg<xffi::AnyBuffer>()           /* v_pool */              \
      .Arg<xffi::AnyBuffer>()           /* index_pairs [n,2] */   \
      KVCM_CODEC_ATTRS                                            \
      .Attr<bool>("slot_major")         /* pools [S,L,P,H,D] */   \
      .Ret<xffi::AnyBuffer>()           /* k_pool (aliased) */    \
      .Ret<xffi::AnyBuffer>()           /* v_pool (aliased) */

#define KVCM_ARENA_CODEC_ARGS                                             \
  xffi::Ffi::Bind()                                                       \
      .Arg<xffi::AnyBuffer>()                 /* index_pairs [n,2] */     \
      .Arg<xffi::AnyBuffer>()                 /* after_k [] int32 */      \
      .Arg<xffi::AnyBuffer>()                 /* after_v [] int32 */      \
      KVCM_CODEC_ATTRS                                                    \
      .Attr<xffi::Span<const int64_t>>("pool")  /* kvcm/arena_pools.h */

using kvcm::CodecKind;
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmConcatEncodeCpu, kvcm::EncodeCpuImpl<CodecKind::kConcat>,
                              KVCM_ENCODE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmConcatDecodeCpu, kvcm::DecodeCpuImpl<CodecKind::kConcat>,
                              KVCM_DECODE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmInt8EncodeCpu, kvcm::EncodeCpuImpl<CodecKind::kInt8>,
                              KVCM_ENCODE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmInt8DecodeCpu, kvcm::DecodeCpuImpl<CodecKind::kInt8>,
                              KVCM_DECODE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmArenaConcatEncodeCpu,
                              kvcm::ArenaEncodeCpuImpl<CodecKind::kConcat>,
                              KVCM_ARENA_CODEC_ARGS.Ret<xffi::AnyBuffer>());  // token int32 [1]
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmArenaConcatDecodeCpu,
                              kvcm::ArenaDecodeCpuImpl<CodecKind::kConcat>,
                              KVCM_ARENA_CODEC_ARGS.Ret<xffi::AnyBuffer>()   // token_k = after_k + 1
                                  .Ret<xffi::AnyBuffer>());                  // token_v = after_v + 1
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmArenaInt8EncodeCpu, kvcm::ArenaEncodeCpuImpl<CodecKind::kInt8>,
                              KVCM_ARENA_CODEC_ARGS.Ret<xffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvcmArenaInt8DecodeCpu, kvcm::ArenaDecodeCpuImpl<CodecKind::kInt8>,
                              KVCM_ARENA_CODEC_ARGS.Ret<xffi::AnyBuffer>()
                                  .Ret<xffi::AnyBuffer>());

// Called by _kvcm_cpu's registrations() (module.cc).
void AddCodecRegistrations(nb::dict& d) {
  d["kvcm_concat_encode_pages"] = nb::capsule(reinterpret_cast<void*>(KvcmConcatEncodeCpu));
  d["kvcm_concat_decode_pages"] = nb::capsule(reinterpret_cast<void*>(KvcmConcatDecodeCpu));
  d["kvcm_int8_encode_pages"] = nb::capsule(reinterpret_cast<void*>(KvcmInt8EncodeCpu));
  d["kvcm_int8_decode_pages"] = nb::capsule(reinterpret_cast<void*>(KvcmInt8DecodeCpu));
  d["kvcm_arena_concat_encode_pages"] =
      nb::capsule(reinterpret_cast<void*>(KvcmArenaConcatEncodeCpu));
  d["kvcm_arena_concat_decode_pages"] =
      nb::capsule(reinterpret_cast<void*>(KvcmArenaConcatDecodeCpu));
  d["kvcm_arena_int8_encode_pages"] = nb::capsule(reinterpret_cast<void*>(KvcmArenaInt8EncodeCpu));
  d["kvcm_arena_int8_decode_pages"] = nb::capsule(reinterpret_cast<void*>(KvcmArenaInt8DecodeCpu));
}
