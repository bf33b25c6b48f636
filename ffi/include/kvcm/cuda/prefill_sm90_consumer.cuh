// The consumer role of the sm90 ragged prefill kernel (ffi/cuda/ragged_prefill_sm90.cu's head
// comment gives the protocol between the roles). Framework-free.
#pragma once

#include "kvcm/cuda/prefill_sm90.cuh"

namespace kvcm::cuda::sm90 {

template <typename T, int D, bool kFp8>
__device__ __forceinline__ void Sm90Roles<T, D, kFp8>::Consumer(const PrefillParams& p,
                                                               const Shared& sh, int wg, int warp,
                                                               int lane) {
  const AttentionArgs& a = p.a;
  const AttentionShape& s = a.shape;
  [[maybe_unused]] const int G = sh.G, P = sh.P, H = sh.H;
  SetMaxRegs<kConsumerRegs>();
  LogitTransform logit = p.logit;  // fp8: k_scale folded in per work tile
  const int cw = wg - 1;  // rows [64 cw, 64 cw + 64) of the work tile
  const int r0 = lane / 4, c0 = (lane % 4) * 2;
  const uint8_t* q_wg = sh.qs + cw * 64 * 128;
  // Without a soft cap (and with a positive scale) the row max commutes with the scale: S stays
  // raw q.k, the scale folds into exp2's argument, and the non-finite rule needs only the
  // largest |q.k| a row read (an inf there -> NaN; a NaN propagates through exp2 by itself).
  bool fast = logit.soft_cap <= 0.f && logit.scale_log2 > 0.f;
  float v_scale = 1.f;  // fp8: multiplies the normalized output
  // Descriptors of Q and of stage 0's K and V halves; a stage is 2 kTileBytes further.
  const SmemDescHalves q_desc = MakeSmemDesc(q_wg, 16, 1024);
  const SmemDescHalves k_desc = MakeSmemDesc(sh.ring, 16, 1024);
  // V as B, MN-major: 64-column blocks kKvBlock apart, 8-key groups 1 KiB apart.
  const SmemDescHalves v_desc = MakeSmemDesc(sh.ring + kTileBytes, kKvBlock, 1024);
  int g = 0;  // key tiles of the work tiles before the current one (the ring position)
  for (int k = 0;; ++k) {
    MbarWait(&sh.qfull_bar, k & 1);
    // (broadcast from lane 0: warp-uniform for ptxas, see wg)
    const int kvh = __shfl_sync(0xffffffffu, sh.work_info[0], 0);
    if (kvh < 0) break;
    const int tile = __shfl_sync(0xffffffffu, sh.work_info[1], 0);
    const int q_begin = __shfl_sync(0xffffffffu, sh.work_info[2], 0);
    const int nq = __shfl_sync(0xffffffffu, sh.work_info[3], 0);
    const int len = __shfl_sync(0xffffffffu, sh.work_info[4], 0);
    if constexpr (kFp8) {  // the producer's ScaledLogit transform
      logit.scale_log2 = __int_as_float(__shfl_sync(0xffffffffu, sh.work_info[5], 0));
      logit.scale_over_cap = __int_as_float(__shfl_sync(0xffffffffu, sh.work_info[6], 0));
      v_scale = __int_as_float(__shfl_sync(0xffffffffu, sh.work_info[7], 0));
      fast = logit.soft_cap <= 0.f && logit.scale_log2 > 0.f;
    }
    FenceProxyAsync();  // Q's cp.async (generic proxy) writes, before wgmma reads them
    const WorkRange r = MakeWorkRange(tile, nq, len, G, a.window);
    const int num_rows = r.num_rows, row0 = r.row0, pos0 = r.pos0, t_lo = r.t_lo,
              num_tiles = r.num_tiles;

    int qpos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      qpos[h] = pos0 + min(row0 + cw * 64 + warp * 16 + r0 + 8 * h, num_rows - 1) / G;
    const int wg_q_lo = pos0 + min(row0 + cw * 64, num_rows - 1) / G;
    const int wg_q_hi = pos0 + min(row0 + cw * 64 + 63, num_rows - 1) / G;
    // This warpgroup's tiles [ta, tb): those meeting its rows' causal / window band (the keys
    // [max(0, wg_q_lo - window + 1), wg_q_hi]); t_lo <= ta < tb <= num_tiles.
    const int wg_key_lo = a.window > 0 ? max(0, wg_q_lo - a.window + 1) : 0;
    const int ta = wg_key_lo / kKeys - t_lo;
    const int tb = min(num_tiles, wg_q_hi / kKeys + 1 - t_lo);

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    bool row_nan[2] = {false, false};
    float absmax[2] = {0.f, 0.f};  // the largest |q.k| each row read (fast path)
    bool tile_bad = false;  // a bad page id or layer in the work tile (the producer's stage_bad)
    float sc[kKeys / 8][4];
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
    uint32_t pa[kKeys / 16][4];  // P of the tile whose P V GEMM is next (m16n8k16 A fragments)

    // Ping-pong: the warpgroups issue their GEMMs in turns, one turn per tile. Warpgroup cw
    // waits on named barrier 5 + cw for the other's arrival (after its issues of the previous
    // tile, or warpgroup 1's first arrival below) and arrives on the other's after its own
    // issues; a tile outside a warpgroup's band is an empty turn, so both make num_tiles turns
    // (warpgroup 1's last arrival would have no taker). Each work tile starts the turns afresh
    // (the previous one's turns all completed: warpgroup 1 got here after its last turn, which
    // waited for warpgroup 0's last; warpgroup 0's turns took all of warpgroup 1's arrivals).
    if (cw == 1 && num_tiles > 0) NamedBarrierArrive(5, 128 * kConsumers);  // warpgroup 0 first
    auto turn_begin = [&]() { NamedBarrier(5 + cw, 128 * kConsumers); };
    auto turn_end = [&](int it) {
      if (cw == 0 || it + 1 < num_tiles) NamedBarrierArrive(5 + (1 - cw), 128 * kConsumers);
    };
    // Both warpgroups free Q once per work tile, after their last S GEMM completed.
    auto release_q = [&]() { MbarArrive(&sh.qempty_bar); };
    // Waits for tile it's K / V half to land (ring position g + it); the fence: its cp.async
    // (generic proxy) writes, before wgmma reads them. The work tile's last V half also brings
    // its bad page flag.
    auto wait_k = [&](int it) {
      const int gk = g + it;
      MbarWait(&sh.kfull_bar[gk % kStages], (gk / kStages) & 1);
      FenceProxyAsync();
    };
    auto wait_v = [&](int it) {
      const int gv = g + it, stage = gv % kStages;
      MbarWait(&sh.vfull_bar[stage], (gv / kStages) & 1);
      FenceProxyAsync();
      if (it == num_tiles - 1)
        tile_bad = (sh.stage_bad[stage][0] | sh.stage_bad[stage][1] | sh.stage_bad[stage][2] |
                    sh.stage_bad[stage][3]) != 0u;
    };
    // Releases a half only after waiting for it (also for a tile this warpgroup skips): an
    // arrival for a tile a whole ring ahead would otherwise count toward the phase of the tile
    // before it.
    auto release_k = [&](int it) { MbarArrive(&sh.kempty_bar[(g + it) % kStages]); };
    auto release_v = [&](int it) { MbarArrive(&sh.vempty_bar[(g + it) % kStages]); };
    auto skip_tile = [&](int it) {  // outside this warpgroup's band
      wait_k(it);
      wait_v(it);
      turn_begin();
      turn_end(it);
      release_k(it);
      release_v(it);
    };
    // (offsets in 16-byte units, so that a stage's term and a constant are one three-way add)
    auto issue_s = [&](int stage) {
      const uint32_t ks = uint32_t(stage) * (2 * kTileBytes / 16);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        constexpr int kQ = kQBlock / 16, kKv = kKvBlock / 16;
        const uint32_t qoff = (kk / 4) * kQ + (kk % 4) * 2, koff = (kk / 4) * kKv + (kk % 4) * 2;
        WgmmaSS<M, kKeys>::template run<0>(sc, q_desc.at(qoff), k_desc.at(ks + koff), kk > 0);
      }
      WgmmaCommit();
    };
    // P V over the tile's first n16 16-key steps (the band's last tile: only up to the step of
    // this warpgroup's last row; the keys after it are masked, P = 0 there).
    auto issue_pv = [&](int stage, int n16) {
      const uint32_t vs = uint32_t(stage) * (2 * kTileBytes / 16);
#pragma unroll
      for (int k16 = 0; k16 < kKeys / 16; ++k16)  // 16 keys = 2 KiB
        WgmmaRS<M, D>::template run<1>(o, pa[k16], v_desc.at(vs + k16 * 128), 1, k16 < n16);
      WgmmaCommit();
    };
    // Rows that read a key the producer flagged in tile it (a V chunk with NaN/inf; partial tiles
    // only; after the tile's V full barrier) output NaN.
    auto apply_flags = [&](int it) {
      const int key0 = (t_lo + it) * kKeys;
      if (!PartlyRead(key0, r.q_first, r.q_last, a.window)) return;
      const int stage = (g + it) % kStages;
      uint32_t flagged[kFlagWords];
      bool any_flagged = false;
#pragma unroll
      for (int i = 0; i < kFlagWords; ++i) {
        flagged[i] = sh.bad_keys[stage][0][i] | sh.bad_keys[stage][1][i] |
                     sh.bad_keys[stage][2][i] | sh.bad_keys[stage][3][i];
        any_flagged |= flagged[i] != 0u;
      }
      if (!any_flagged) return;
      const bool needs_mask = PartlyRead(key0, wg_q_lo, wg_q_hi, a.window);
      uint32_t hit[2] = {0u, 0u};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int hi = qpos[h] - key0 - c0;  // as in softmax_tile
        const int lo = a.window > 0 ? qpos[h] - a.window - key0 - c0 : -(1 << 30);
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int kt = nt * 8 + e;  // + c0: the shift below
            const bool masked = needs_mask && (kt > hi || kt <= lo);
            hit[h] |= (flagged[kt / 32] >> (kt % 32 + c0)) & (masked ? 0u : 1u);
          }
      }
      row_nan[0] |= hit[0] != 0u;
      row_nan[1] |= hit[1] != 0u;
    };
    // Mask, non-finite bookkeeping and soft-max of tile it's S (landed); alpha for O. Selects,
    // not branches, per logit, so that each path is straight-line code.
    auto softmax_tile = [&](auto fast_c, int it, float (&alpha)[2]) {
      constexpr bool kFast = decltype(fast_c)::value;
      const int key0 = (t_lo + it) * kKeys;
      const bool needs_mask = PartlyRead(key0, wg_q_lo, wg_q_hi, a.window);
      // Key kt (of this thread: kt = nt * 8 + c0 + (j & 1)) is masked for row half h when
      // nt * 8 + (j & 1) > hi[h] (after the row) or <= lo[h] (before its window).
      int hi[2], lo[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        hi[h] = qpos[h] - key0 - c0;
        lo[h] = a.window > 0 ? qpos[h] - a.window - key0 - c0 : -(1 << 30);
      }
      auto is_masked = [&](int nt, int j) {
        const int kt = nt * 8 + (j & 1);
        return kt > hi[j >> 1] || kt <= lo[j >> 1];
      };
      if constexpr (!kFast) {
        if (logit.soft_cap > 0.f) {
#pragma unroll
          for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float x = sc[nt][j];
              sc[nt][j] = fabsf(x) < INFINITY ? logit.capped(x) : NAN;
            }
        } else {
#pragma unroll
          for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float x = sc[nt][j];
              sc[nt][j] = fabsf(x) < INFINITY ? x * logit.scale_log2 : NAN;
            }
        }
      }
      if (needs_mask) {
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const bool masked = is_masked(nt, j);
            if constexpr (kFast)
              absmax[j >> 1] = fmaxf(absmax[j >> 1], masked ? 0.f : fabsf(sc[nt][j]));
            sc[nt][j] = masked ? -INFINITY : sc[nt][j];
          }
      } else if constexpr (kFast) {  // the hot path: one instruction per logit before soft-max
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j) absmax[j >> 1] = fmaxf(absmax[j >> 1], fabsf(sc[nt][j]));
      }
      SoftmaxStep<kKeys / 8>(sc, m, l, alpha, kFast ? logit.scale_log2 : 1.f);
    };
    auto pack_p = [&]() {
#pragma unroll
      for (int k16 = 0; k16 < kKeys / 16; ++k16) {
        pa[k16][0] = Mma<M>::pack(sc[2 * k16][0], sc[2 * k16][1]);
        pa[k16][1] = Mma<M>::pack(sc[2 * k16][2], sc[2 * k16][3]);
        pa[k16][2] = Mma<M>::pack(sc[2 * k16 + 1][0], sc[2 * k16 + 1][1]);
        pa[k16][3] = Mma<M>::pack(sc[2 * k16 + 1][2], sc[2 * k16 + 1][3]);
      }
    };
    // The band's tiles, one instance per logit path (fast: raw q.k, scale in exp2's argument).
    auto band = [&](auto fast_c) {
      float alpha[2];
      // First tile of the band: S alone (O is still zero, so its alpha is not needed).
      wait_k(ta);
      turn_begin();
      FenceRegisters(sc);
      WgmmaFence();
      issue_s((g + ta) % kStages);
      turn_end(ta);
      WgmmaWait<0>();
      FenceRegisters(sc);
      release_k(ta);
      if (ta + 1 == tb) release_q();  // the band's only S GEMM
      softmax_tile(fast_c, ta, alpha);
      pack_p();
      if (ta + 1 < tb) wait_k(ta + 1);
      // Steady state: S of tile it and P V of tile it - 1 in one turn; while P V runs, the
      // soft-max of tile it and the wait for tile it + 1's K; then O's rescale and the next P.
      for (int it = ta + 1; it < tb; ++it) {
        wait_v(it - 1);
        apply_flags(it - 1);
        turn_begin();
        FenceRegisters(sc);
        FenceRegisters(o);
        FenceRegisters(pa);
        WgmmaFence();
        issue_s((g + it) % kStages);
        issue_pv((g + it - 1) % kStages, kKeys / 16);
        turn_end(it);
        WgmmaWait<1>();  // S of tile it
        FenceRegisters(sc);
        release_k(it);
        if (it + 1 == tb) release_q();  // the band's last S GEMM
        softmax_tile(fast_c, it, alpha);
        // The soft-max's results, pinned before what follows (nvcc could sink them past it).
        FenceRegisters(sc);
        FenceScalars(alpha[0], alpha[1], l[0], l[1]);
        // The next tile's K full barrier sits between the soft-max and the P V wait on purpose:
        // a basic-block boundary (the branch, the spin loop) keeps ptxas from hoisting the wait
        // to the top of the soft-max's block, out of the overlap with the GEMM (it does that to a
        // wgmma wait, which depends on no register, when both share a block).
        if (it + 1 < tb) wait_k(it + 1);
        WgmmaWait<0>();  // P V of tile it - 1
        FenceRegisters(o);
        FenceRegisters(pa);
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
          for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
          }
        }
        pack_p();
        release_v(it - 1);
      }
      // P V of the band's last tile.
      wait_v(tb - 1);
      apply_flags(tb - 1);
      FenceRegisters(o);
      FenceRegisters(pa);
      WgmmaFence();
      issue_pv((g + tb - 1) % kStages,
               min(kKeys / 16, ((wg_q_hi - (t_lo + tb - 1) * kKeys) >> 4) + 1));
      WgmmaWait<0>();
      FenceRegisters(o);
      FenceRegisters(pa);
      release_v(tb - 1);
    };

    for (int it = 0; it < ta; ++it) skip_tile(it);
    if (ta < tb) {
      if (fast) band(std::true_type{});
      else band(std::false_type{});
    } else {
      release_q();  // (not taken: wg_key_lo <= wg_q_hi gives ta < tb; Q is freed on every path)
    }
    for (int it = max(ta, tb); it < num_tiles; ++it) skip_tile(it);
    g += num_tiles;

    // Epilogue, while the producer already streams the next work tile's Q and K / V.
    const bool bad = tile_bad;  // a bad page id or layer in the work tile
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float lh = l[h];
      lh += __shfl_xor_sync(0xffffffffu, lh, 1);
      lh += __shfl_xor_sync(0xffffffffu, lh, 2);
      int nan_row = row_nan[h] || absmax[h] == INFINITY;
      nan_row |= __shfl_xor_sync(0xffffffffu, nan_row, 1);
      nan_row |= __shfl_xor_sync(0xffffffffu, nan_row, 2);
      const int row = row0 + cw * 64 + warp * 16 + r0 + 8 * h;
      if (row >= num_rows) continue;
      const float inv = (bad || nan_row) ? NAN : (lh == 0.f ? 0.f : v_scale / lh);
      T* out = static_cast<T*>(a.out) +
               ((int64_t(q_begin) + row / G) * s.num_heads + int64_t(kvh) * G + row % G) * D;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<uint32_t*>(out + n * 8 + c0) =
            Mma<T>::pack(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
  }
}

}  // namespace kvcm::cuda::sm90
