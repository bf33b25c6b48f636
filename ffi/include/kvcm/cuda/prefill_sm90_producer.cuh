// The producer role of the sm90 ragged prefill kernel (ffi/cuda/ragged_prefill_sm90.cu's head
// comment gives the protocol between the roles). Framework-free.
#pragma once

#include "kvcm/cuda/prefill_sm90.cuh"

namespace kvcm::cuda::sm90 {

template <typename T, int D, bool kFp8>
__device__ __forceinline__ void Sm90Roles<T, D, kFp8>::Producer(const PrefillParams& p,
                                                               const Shared& sh, int li, int wt,
                                                               int warp, int lane) {
  const AttentionArgs& a = p.a;
  const AttentionShape& s = a.shape;
  [[maybe_unused]] const int G = sh.G, P = sh.P, H = sh.H;
  SetMaxRegs<kProducerRegs>();
  const int64_t token_bytes = s.cache.token_stride() * kElemBytes;
  const int ch0 = wt % kRowThreads, row_base = wt / kRowThreads;
  const uint32_t ring_s = SmemAddr(sh.ring);
  const int tile_pages = max(1, kKeys >> p.page_shift);
  const bool lane_pages = tile_pages <= 32;
  // Bytes from one page to the next (the layout's stride); < 2^31: RaggedPrefillSm90Supports.
  const int32_t page_bytes = int32_t(s.cache.page_stride * kElemBytes);
  int g = 0;  // key tiles this CTA streamed before the current work tile (the ring position)
  // Work tiles, dynamically scheduled: work tile w is row tile w / H (tile_offsets order: by
  // sequence, a sequence's heaviest causal tile first) of kv head w % H (consecutive claims
  // read the same pages and Q tokens, at other heads' offsets). CTA c starts with w = c; every
  // further one is claimed from the work counter (zeroed by the schedule kernel on the stream)
  // as gridDim.x + the counter's old value, by thread 0 one work tile ahead: at the start of
  // work tile k it claims k + 1 and stores it (claimed[k & 1]) only after k's search, page
  // lookups, first K tile and Q were issued, so the atomic's latency hides behind those; the
  // producer warps read it after named barrier 4 at k's end. Claims are increasing in the
  // counter, so the first claim past the last work tile ends the CTA (every later one would be
  // past it too).
  int w = int(blockIdx.x);
  for (int k = 0;; ++k) {
    int next_w = 0;
    if (wt == 0) next_w = int(gridDim.x) + atomicAdd(p.work_counter, 1);
    int b = 0, tile = 0;
    const bool has = FindPrefillTileWarp(p, w / H, b, tile);  // warp-uniform
    if (!has) {  // no more work: the consumers read kv head -1 and leave
      if (k > 0) MbarWait(&sh.qempty_bar, (k - 1) & 1);
      if (wt == 0) sh.work_info[0] = -1;
      MbarArrive(&sh.qfull_bar);
      if (wt == 0) MbarArrive(&sh.qfull_bar);
      break;
    }
    const int kvh = w % H;
    const int q_begin = a.query_start[b];
    const int nq = a.query_start[b + 1] - q_begin;
    const int len = a.seq_lens[b];
    const WorkRange r = MakeWorkRange(tile, nq, len, G, a.window);
    const int key_lo = r.key_lo, key_hi = r.key_hi, t_lo = r.t_lo, num_tiles = r.num_tiles;
    const T* q_rows =
        static_cast<const T*>(a.q) + (int64_t(q_begin) * s.num_heads + int64_t(kvh) * G) * D;
    // Q's rows into L2 now, 128-byte lines (a hint: Q's copies below wait for the Q buffer,
    // which the consumers free only with the previous work tile's last S GEMM).
    for (int i = wt; i < kRows * (D / 64); i += 128) {
      const int row = r.row0 + i / (D / 64);
      if (row < r.num_rows)
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(
            q_rows + (int64_t(row / G) * s.num_heads + row % G) * D + (i % (D / 64)) * 64));
    }
    // fp8: ScaledLogit's transform for (layer, kv head), layer 0 for a bad layer (whose
    // output is NaN); thread 0 passes its scales and v_scale on in work_info.
    float v_scale = 1.f;
    LogitTransform scaled = p.logit;
    if constexpr (kFp8) {
      if (wt == 0)
        scaled = ScaledLogit<true>(p.logit, a, li < 0 || li >= s.cache.num_layers ? 0 : li,
                                   kvh, v_scale);
    }
    // Q: once the previous work tile's Q is free (both consumers ran their last S GEMM of
    // it), the tile's rows (zeros past the last), kRowChunks chunks of each of this thread's
    // rows as for K/V, landing on the Q full barrier, which also publishes work_info.
    auto load_q = [&]() {
      if (k > 0) MbarWait(&sh.qempty_bar, (k - 1) & 1);
#pragma unroll
      for (int i = 0; i < kRows / kRowsPerPass; ++i) {
        const int rr = row_base + i * kRowsPerPass;
        const int row = r.row0 + rr;
        const bool valid = row < r.num_rows;
        const T* src = q_rows + (valid ? (int64_t(row / G) * s.num_heads + row % G) * D : 0) +
                       ch0 * 8;
#pragma unroll
        for (int j = 0; j < kRowChunks; ++j) {  // (in bounds also when !valid)
          const int ch = ch0 + kRowThreads * j;
          CpAsync16(SmemAddr(sh.qs + Swizzle128(kRows, rr, ch)), src + kRowThreads * 8 * j, valid);
        }
      }
      if constexpr (kQToHalf) {
        // This thread's copies landed: its own chunks -> f16 in place, before its arrival.
        CpAsyncCommit();
        CpAsyncWait<0>();
#pragma unroll 1
        for (int i = 0; i < kRows / kRowsPerPass; ++i)
#pragma unroll
          for (int j = 0; j < kRowChunks; ++j) {
            uint4* chunk = reinterpret_cast<uint4*>(
                sh.qs + Swizzle128(kRows, row_base + i * kRowsPerPass, ch0 + kRowThreads * j));
            *chunk = Bf16ChunkToHalf(*chunk);
          }
        FenceProxyAsync();
        MbarArrive(&sh.qfull_bar);
      } else {
        MbarArriveOnCopies(&sh.qfull_bar);
      }
      if (wt == 0) {
        sh.work_info[0] = kvh;
        sh.work_info[1] = tile;
        sh.work_info[2] = q_begin;
        sh.work_info[3] = nq;
        sh.work_info[4] = len;
        if constexpr (kFp8) {
          sh.work_info[5] = __float_as_int(scaled.scale_log2);
          sh.work_info[6] = __float_as_int(scaled.scale_over_cap);
          sh.work_info[7] = __float_as_int(v_scale);
        }
        MbarArrive(&sh.qfull_bar);
      }
    };

    // This work tile's bad page ids and layer: raised, and passed to the consumers in
    // stage_bad (the whole work tile outputs NaN).
    const bool bad_layer = li < 0 || li >= s.cache.num_layers;
    uint32_t bits = bad_layer ? kBadLayer : 0u;
    const int64_t layer_off =
        (int64_t(bad_layer ? 0 : li) * s.cache.layer_stride + int64_t(kvh) * D) * kElemBytes;
    const char* kbase = static_cast<const char*>(a.k_cache) + layer_off;
    const char* vbase = static_cast<const char*>(a.v_cache) + layer_off;
    const int32_t* pages = a.page_table + int64_t(b) * s.max_pages;
    // Pages of at least kKeys / 32 tokens (at most 32 per tile): lane j of every producer warp
    // looks up page j of a tile once, one tile ahead and before the empty-slot wait, as the
    // byte offset of its first token (-1: a bad page id, or no key of the work tile's range in
    // it), and the rows take it by shuffle, so no global load or 64-bit multiply sits on a
    // row's path to its cp.asyncs. Smaller pages are looked up per row.
    auto tile_page_offset = [&](int it) -> int64_t {
      const int pg = (((t_lo + it) * kKeys) >> p.page_shift) + lane;
      if (it >= num_tiles || lane >= tile_pages || (pg << p.page_shift) >= key_hi ||
          ((pg + 1) << p.page_shift) <= key_lo)
        return -1;
      const int page = pages[TableEntry(pg, int(s.max_pages), a.ring)];
      if (page < 0 || page >= s.cache.num_pages) {
        bits |= kBadPage;
        return -1;
      }
      return int64_t(page) * page_bytes;
    };
    // Rows of tile it of one cache (base: K or V) into a stage's half at shared address dst;
    // lane_offset: the lane's page of the tile (lane pages), else looked up per row.
    auto issue_tile = [&](int it, const char* base, uint32_t dst, int64_t lane_offset) {
      const int key0 = (t_lo + it) * kKeys;
      auto issue_row = [&](int i, int64_t page_offset) {  // page_offset < 0: nothing to read
        const int row = row_base + i * kRowsPerPass;
        const int pos = key0 + row;
        const bool ok = pos >= key_lo && pos < key_hi && page_offset >= 0;
        const int64_t off =
            ok ? page_offset + int32_t(pos & (P - 1)) * int32_t(token_bytes) + ch0 * 16 : 0;
#pragma unroll
        for (int j = 0; j < kCopyChunks; ++j) {  // (in bounds also when !ok: chunk < D / 8)
          const int ch = ch0 + kRowThreads * j;
          const int to = kFp8 ? RawFp8Offset<D>(row, ch) : Swizzle128(kKeys, row, ch);
          CpAsync16(dst + uint32_t(to), base + off + kRowThreads * 16 * j, ok);
        }
      };
      if (lane_pages) {
        const int page0 = key0 >> p.page_shift;
#pragma unroll 4
        for (int i = 0; i < kRowsPerThread; ++i) {
          const int pos = key0 + row_base + i * kRowsPerPass;
          const int src = ((pos >> p.page_shift) - page0) & 31;
          const int lo = __shfl_sync(0xffffffffu, int32_t(lane_offset), src);
          const int hi = __shfl_sync(0xffffffffu, int32_t(lane_offset >> 32), src);
          issue_row(i, int64_t((uint64_t(uint32_t(hi)) << 32) | uint32_t(lo)));
        }
      } else {
#pragma unroll 4
        for (int i = 0; i < kRowsPerThread; ++i) {
          const int pos = key0 + row_base + i * kRowsPerPass;
          int64_t page_offset = -1;
          if (pos >= key_lo && pos < key_hi) {
            const int page = pages[TableEntry(pos >> p.page_shift, int(s.max_pages), a.ring)];
            if (page < 0 || page >= s.cache.num_pages) bits |= kBadPage;
            else page_offset = int64_t(page) * page_bytes;
          }
          issue_row(i, page_offset);
        }
      }
    };
    // K of tile it, then V of tile it - 1, each into its half of the tile's stage (ring
    // position g + it) after that half's own empty barrier: V is needed a turn after K (P V of
    // a tile goes with S of the next), and a K half is free again as soon as its S GEMM is
    // done, so both run about two tiles ahead of their use (and into the next work tile while
    // the consumers finish this one). K of tile 0 goes before Q: its half is usually free
    // before the Q buffer (an earlier S GEMM than the previous work tile's last frees it), and
    // waiting for it needs nothing from this work tile, so it cannot hold Q back for good.
    auto issue_k = [&](int it, int64_t lane_offset) {
      const int gk = g + it, stage = gk % kStages;
      if (gk >= kStages) MbarWait(&sh.kempty_bar[stage], ((gk / kStages) - 1) & 1);
      issue_tile(it, kbase, ring_s + stage * 2 * kTileBytes, lane_offset);
      if constexpr (!kFp8) MbarArriveOnCopies(&sh.kfull_bar[stage]);  // fp8: after convert_fp8
    };
    // fp8: this thread's rows of the K / V half at `half` (its copies landed: CpAsyncWait) from
    // the raw bytes at RawFp8Offset to f16 in the swizzled layout, in place. A row's raw bytes
    // are read by its kRowThreads lanes (one warp) before any of them writes (__syncwarp), and a
    // row's f16 chunks overwrite only its own raw bytes. With `scan` (V of a tile that some row
    // reads only in part), as the 16-bit path below: a raw chunk with a NaN in a key that some
    // but not all rows read is zeroed, and the key set in mine (bit row % 32 of word row / 32).
    auto convert_fp8 = [&](uint8_t* half, bool scan, int key0, uint32_t(&mine)[kFlagWords]) {
#pragma unroll 1
      for (int i = 0; i < kRowsPerThread; ++i) {
        const int row = row_base + i * kRowsPerPass;
        uint4 raw[kCopyChunks];
#pragma unroll
        for (int j = 0; j < kCopyChunks; ++j)
          raw[j] = *reinterpret_cast<const uint4*>(half +
                                                   RawFp8Offset<D>(row, ch0 + kRowThreads * j));
        __syncwarp();
        const int key = key0 + row;
        const bool partly_read_key =
            (key > r.q_first || (a.window > 0 && key <= r.q_last - a.window)) && key <= r.q_last;
        bool bad_row = false;
#pragma unroll
        for (int j = 0; j < kCopyChunks; ++j) {
          if (scan && partly_read_key && HasNanE4m3(raw[j])) {
            raw[j] = make_uint4(0u, 0u, 0u, 0u);
            bad_row = true;
          }
          const int ch = ch0 + kRowThreads * j;
          uint4 lo, hi;
          Fp8ChunkToHalf(raw[j], lo, hi);
          *reinterpret_cast<uint4*>(half + Swizzle128(kKeys, row, 2 * ch)) = lo;
          *reinterpret_cast<uint4*>(half + Swizzle128(kKeys, row, 2 * ch + 1)) = hi;
        }
        const uint32_t bit = bad_row ? 1u << (row % 32) : 0u;
#pragma unroll
        for (int wd = 0; wd < kFlagWords; ++wd) mine[wd] |= row / 32 == wd ? bit : 0u;
      }
    };
    // fp8: the K half of ring position g + it, once this thread's copies landed.
    auto finish_k_fp8 = [&](int it) {
      const int stage = (g + it) % kStages;
      uint32_t unused[kFlagWords] = {};
      convert_fp8(sh.ring + stage * 2 * kTileBytes, false, 0, unused);
      FenceProxyAsync();  // the converted chunks, before wgmma reads K
      MbarArrive(&sh.kfull_bar[stage]);
    };
    // fp8: the copies issued in loop turn it below (K of tile it, if any, and V of tile it - 1),
    // once they landed: converted and arrived, K first. V as the 16-bit path's tiles that some
    // row reads only in part, or the work tile's last: its flags and stage_bad with it.
    auto finish_turn_fp8 = [&](int it) {
      if (it < num_tiles) finish_k_fp8(it);
      const int jt = it - 1, stage = (g + jt) % kStages;
      const bool partial = PartlyRead((t_lo + jt) * kKeys, r.q_first, r.q_last, a.window);
      uint32_t mine[kFlagWords];
#pragma unroll
      for (int wd = 0; wd < kFlagWords; ++wd) mine[wd] = 0u;
      convert_fp8(sh.ring + stage * 2 * kTileBytes + kTileBytes, partial, (t_lo + jt) * kKeys,
                  mine);
      if (partial) {
#pragma unroll
        for (int wd = 0; wd < kFlagWords; ++wd) {
          const uint32_t f = __reduce_or_sync(0xffffffffu, mine[wd]);
          if (lane == 0) sh.bad_keys[stage][warp][wd] = f;
        }
      }
      if (jt == num_tiles - 1) {  // every page lookup of the work tile came before this
        const uint32_t any = __any_sync(0xffffffffu, bits != 0u);
        if (lane == 0) sh.stage_bad[stage][warp] = any;
      }
      FenceProxyAsync();  // the converted chunks, before wgmma reads V
      MbarArrive(&sh.vfull_bar[stage]);
    };
    int64_t k_offset = lane_pages ? tile_page_offset(0) : -1;  // the lane's page of tile it
    int64_t v_offset = -1;                                      // ... of tile it - 1
    {  // it = 0 (peeled): K of tile 0, Q, and the claim published (its register freed)
      const int64_t next_offset = lane_pages ? tile_page_offset(1) : -1;
      if (num_tiles > 0) issue_k(0, k_offset);
      if constexpr (kFp8) {
        if (num_tiles > 0) {
          CpAsyncCommit();
          CpAsyncWait<0>();
          finish_k_fp8(0);
        }
      }
      v_offset = k_offset;
      k_offset = next_offset;
      load_q();
      if (wt == 0) sh.claimed[k & 1] = next_w;
    }
    for (int it = 1; it <= num_tiles; ++it) {
      const int64_t next_offset = lane_pages ? tile_page_offset(it + 1) : -1;
      const int64_t k_tile_offset = k_offset, v_tile_offset = v_offset;
      v_offset = k_offset;
      k_offset = next_offset;
      if (it < num_tiles) issue_k(it, k_tile_offset);
      const int jt = it - 1, gv = g + jt, stage = gv % kStages;
      if (gv >= kStages) MbarWait(&sh.vempty_bar[stage], ((gv / kStages) - 1) & 1);
      issue_tile(jt, vbase, ring_s + stage * 2 * kTileBytes + kTileBytes, v_tile_offset);
      const bool partial = PartlyRead((t_lo + jt) * kKeys, r.q_first, r.q_last, a.window);
      const bool last = jt == num_tiles - 1;
      if constexpr (kFp8) {
        // This turn's copies are one commit group; the previous turn's, landed by now in the
        // steady state (the empty waits pace the producer), are converted and arrive behind
        // them (see the header comment: why the ring has room for that).
        CpAsyncCommit();
        if (it >= 2) {
          CpAsyncWait<1>();
          finish_turn_fp8(it - 1);
        }
        continue;
      }
      if (!partial && !last) {
        MbarArriveOnCopies(&sh.vfull_bar[stage]);
        continue;
      }
      // A tile some row of the work tile reads only in part: this thread's copies landed
      // (visible to it), it zeroes those of its V chunks that hold NaN/inf, and its warp flags
      // their keys (bit row % 32 of word row / 32, OR-ed over the warp's lanes). The consumers
      // read a stage's flags after its V full barrier, and only for such tiles; the stage's
      // previous flags were read before its V empty barrier let this tile in. The work tile's
      // last key tile also carries its bad page ids (every page lookup of the work tile came
      // before this point), in stage_bad by the same rule.
      CpAsyncCommit();  // (the copies are in no group yet: wait_group covers committed ones)
      CpAsyncWait<0>();
      if (partial) {
        uint8_t* vs = sh.ring + stage * 2 * kTileBytes + kTileBytes;
        // One row at a time (its kRowChunks chunks), so that few chunks are loaded at once
        // (all of them at once spill). Row row_base + kRowsPerPass i is bit row % 32 of word
        // row / 32.
        uint32_t mine[kFlagWords];
#pragma unroll
        for (int wd = 0; wd < kFlagWords; ++wd) mine[wd] = 0u;
        const int key0 = (t_lo + jt) * kKeys;
#pragma unroll 1
        for (int i = 0; i < kRowsPerThread; ++i) {
          const int row = row_base + i * kRowsPerPass;
          // A key that every row of the work tile reads is left as it is: a NaN / inf there
          // reaches all of them through the GEMM, as in a wholly read tile. So is one after the
          // last row: its copies were zero-fills (issue_row's ok is false past key_hi).
          const int key = key0 + row;
          if (key <= r.q_first && !(a.window > 0 && key <= r.q_last - a.window)) continue;
          if (key > r.q_last) continue;
          bool bad_row = false;
#pragma unroll
          for (int j = 0; j < kRowChunks; ++j) {
            uint4* chunk =
                reinterpret_cast<uint4*>(vs + Swizzle128(kKeys, row, ch0 + kRowThreads * j));
            const uint4 c = *chunk;
            constexpr uint32_t kExp = std::is_same_v<T, __nv_bfloat16> ? 0x7F80u : 0x7C00u;
            bool bad = false;
            for (const uint32_t x : {c.x, c.y, c.z, c.w})
              bad |= (x & kExp) == kExp || ((x >> 16) & kExp) == kExp;
            if (bad) *chunk = make_uint4(0u, 0u, 0u, 0u);
            bad_row |= bad;
          }
          const uint32_t bit = bad_row ? 1u << (row % 32) : 0u;
#pragma unroll
          for (int wd = 0; wd < kFlagWords; ++wd) mine[wd] |= row / 32 == wd ? bit : 0u;
        }
#pragma unroll
        for (int wd = 0; wd < kFlagWords; ++wd) {
          const uint32_t f = __reduce_or_sync(0xffffffffu, mine[wd]);
          if (lane == 0) sh.bad_keys[stage][warp][wd] = f;
        }
        FenceProxyAsync();  // the zeroed chunks, before wgmma reads V
      }
      if (last) {
        const uint32_t any = __any_sync(0xffffffffu, bits != 0u);
        if (lane == 0) sh.stage_bad[stage][warp] = any;
      }
      MbarArrive(&sh.vfull_bar[stage]);
    }
    if constexpr (kFp8) {
      if (num_tiles > 0) {  // the last turn's copies (none are left across work tiles)
        CpAsyncWait<0>();
        finish_turn_fp8(num_tiles);
      }
    }
    if (bits) RaiseError(a.error_word, bits);
    g += num_tiles;
    // The next work tile: thread 0's claim, in claimed[k & 1] since this work tile's Q.
    NamedBarrier(4, 128);
    w = sh.claimed[k & 1];
  }
  CpAsyncCommit();
  CpAsyncWait<0>();
}

}  // namespace kvcm::cuda::sm90
