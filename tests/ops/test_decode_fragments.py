"""Host-side oracle for the index algebra of the paged decode kernel's tensor-core tiles.

The decode kernel (``ffi/include/kvcm/cuda/decode_tile.cuh``) computes the transposed products
of one 16-token tile per warp with ``mma.m16n8k16`` (f32 accumulators): S^T = K Q^T (A = the K
tile, B = Q^T, the G query heads of a kv head on the 8 columns) and O^T += V^T P^T (A = V^T, B =
P^T, taken from the S^T accumulators by ``movmatrix.trans``). 16-bit caches read the swizzled
tiles with ``ldmatrix`` (V transposed); fp8 (float8_e4m3fn) caches convert the raw tile bytes
straight into A fragments, with a permuted head-dim order for the k steps of S^T (Q^T uses the
same) and for the rows of O^T (undone at the write-out), and the bytes of two token rows
interleaved with ``__byte_perm`` into e4m3 pairs. No GPU runs here, so this test emulates that
kernel code lane by lane in numpy (the ``kernel_*`` functions mirror it line for line) and
checks the assembled S^T and O^T against plain ``K @ Q.T`` and ``V.T @ P.T``.

The hardware is emulated independently of the kernel's choices, from the layouts PTX documents
(``ptx_*``), with g = lane / 4 and q = lane % 4: for ``mma.m16n8k16.row.col``, A register i holds
row g (i = 0, 2) or g + 8 (i = 1, 3) at columns 2q, 2q + 1 (+ 8 for i = 2, 3); B register i
holds column g at rows 2q, 2q + 1 (+ 8 for i = 1); C element i is row g (+ 8 for i >= 2), column
2q + i % 2. ``ldmatrix.x4``: lanes 8j .. 8j + 7 give the row addresses of matrix j, and register
j of a lane holds row g, columns 2q, 2q + 1 of matrix j (``.trans``: of its transpose); so does
``movmatrix.trans`` of one 8x8 matrix held that way. A 32-bit register's low half is its first
element, and ``cvt.rn.f16x2.e4m3x2`` puts the value of the low byte of its source in the low half.

It also counts shared-memory bank conflicts of the kernel's fp8 fragment reads (32 banks of 4
bytes; a request of w-byte accesses is served 128 / w lanes per wavefront), the reason for the
swizzle.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

TILE = 16  # tokens per tile
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3 = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float64)  # byte -> value


# ----- PTX's layouts (the oracle for the hardware) -----------------------------------------------

def ptx_a_coords(lane, reg, half):
    g, q = lane // 4, lane % 4
    return g + 8 * (reg % 2), 2 * q + half + 8 * (reg // 2)


def ptx_b_coords(lane, reg, half):
    g, q = lane // 4, lane % 4
    return 2 * q + half + 8 * reg, g


def ptx_c_coords(lane, i):
    g, q = lane // 4, lane % 4
    return g + 8 * (i // 2), 2 * q + i % 2


def ptx_mma(a, b, c):
    """c[32][4] += A @ B, A given as a[32][4] (lo, hi) pairs and B as b[32][2] pairs."""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    for lane in range(32):
        for reg in range(4):
            for half in range(2):
                r, k = ptx_a_coords(lane, reg, half)
                assert np.isnan(A[r, k]), "A element held twice"
                A[r, k] = a[lane][reg][half]
        for reg in range(2):
            for half in range(2):
                k, n = ptx_b_coords(lane, reg, half)
                assert np.isnan(B[k, n]), "B element held twice"
                B[k, n] = b[lane][reg][half]
    assert not np.isnan(A).any() and not np.isnan(B).any()
    C = A @ B
    for lane in range(32):
        for i in range(4):
            c[lane][i] += C[ptx_c_coords(lane, i)]


def ptx_ldmatrix_x4(smem16, lane_addr, trans):
    """ldmatrix.sync.aligned.m8n8.x4[.trans].b16: lane_addr[l] is the element offset of row l % 8
    of matrix l // 8 in the 16-bit shared array; returns r[lane][j] as (lo, hi) pairs."""
    mats = [np.array([smem16[lane_addr[8 * j + r]:lane_addr[8 * j + r] + 8] for r in range(8)])
            for j in range(4)]
    out = []
    for lane in range(32):
        g, q = lane // 4, lane % 4
        regs = []
        for j in range(4):
            m = mats[j].T if trans else mats[j]
            regs.append((m[g, 2 * q], m[g, 2 * q + 1]))
        out.append(regs)
    return out


def ptx_movmatrix_trans(x):
    """movmatrix.sync.aligned.m8n8.trans.b16: x[lane] = (lo, hi) of row g, columns 2q, 2q + 1."""
    m = np.full((8, 8), np.nan)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        m[g, 2 * q], m[g, 2 * q + 1] = x[lane]
    return [(m.T[ln // 4, 2 * (ln % 4)], m.T[ln // 4, 2 * (ln % 4) + 1]) for ln in range(32)]


def cvt_e4m3x2(pair16):
    """cvt.rn.f16x2.e4m3x2 on a 16-bit value: (low half, high half) = (low byte, high byte)."""
    return E4M3[pair16 & 0xFF], E4M3[(pair16 >> 8) & 0xFF]


def byte_perm(x, y, s):
    """__byte_perm / prmt: result byte n = byte (s >> 4n) & 7 of the 8 bytes {y, x} (x low)."""
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(s >> (4 * n)) & 7] << (8 * n) for n in range(4))


def le32(smem, off):
    return int.from_bytes(bytes(smem[off:off + 4]), "little")


# ----- the kernel's code, mirrored ----------------------------------------------------------------

def kernel_swizzle(D, row):  # Fp8ChunkSwizzle<D>
    if D == 64:
        return (row >> 1) & 3
    if D == 128:
        return row & 7
    return ((row & 1) << 1) | ((row >> 1) & 1) | (row & 4)


def kernel_tile_offset(D, row, chunk):  # Fp8TileOffset<D>
    return row * D + ((chunk ^ kernel_swizzle(D, row)) << 4)


def kernel_swizzled_offset(chunks, row, chunk):  # SwizzledOffset<kChunks>: 16-bit elements
    return (row * chunks + (chunk ^ (row & 7))) * 8


def kernel_permuted_v_dim(D, mt, r):  # PermutedVDim<D>
    piece = min(D // 8, 16)
    return (r & 7) * (D // 8) + (mt // (piece // 2)) * piece + (r >> 3) * (piece // 2) + \
        mt % (piece // 2)


def kernel_quad_to_half2x2(w):  # Fp8QuadToHalf2x2: (lo, hi) from bytes {0, 1} and {2, 3}
    return cvt_e4m3x2(w & 0xFFFF), cvt_e4m3x2(w >> 16)


def kernel_store_tile(raw, path, fp8):
    """load_tile's cp.asyncs of a [16][D] tile into shared memory (its fast or general path):
    bytes for fp8 tiles, 16-bit elements otherwise."""
    D = raw.shape[1]
    load_chunks = D // 16 if fp8 else D // 8
    per_chunk = 16 if fp8 else 8
    smem = np.zeros(TILE * D, raw.dtype)
    written = np.zeros(TILE * D, np.int64)
    for lane in range(32):
        if path == "fast":
            row_step = 32 // load_chunks
            ch, row0 = lane % load_chunks, lane // load_chunks
            pairs = [(row0 + k * row_step, ch) for k in range(TILE // row_step)]
        else:
            pairs = [(i // load_chunks, i % load_chunks)
                     for i in range(lane, TILE * load_chunks, 32)]
        for row, ch in pairs:
            so = kernel_tile_offset(D, row, ch) if fp8 else kernel_swizzled_offset(D // 8, row, ch)
            smem[so:so + per_chunk] = raw[row, ch * per_chunk:(ch + 1) * per_chunk]
            written[so:so + per_chunk] += 1
    assert (written == 1).all(), "the tile store must write every shared element exactly once"
    return smem


def kernel_q_fragments(Q, fp8, nh):
    """qf[kk][lane] = (word 0, word 1) of column tile nh (heads nh * 8 + g; rows >= G are 0)."""
    G, D = Q.shape
    qf = []
    for kk in range(D // 16):
        per_lane = []
        for lane in range(32):
            r0, c0 = lane // 4, (lane % 4) * 2
            head = nh * 8 + r0
            col = kk * 16 + 2 * c0 if fp8 else kk * 16 + c0
            hi = 2 if fp8 else 8
            word = lambda c: (Q[head, c], Q[head, c + 1]) if head < G else (0.0, 0.0)  # noqa: E731
            per_lane.append([word(col), word(col + hi)])
        qf.append(per_lane)
    return qf


def kernel_k_fragments(smem, D, kk, fp8):
    """ka[lane][4] of k step kk (A: tokens g / g + 8)."""
    if not fp8:
        addrs = []
        for lane in range(32):
            row = (lane & 7) + (((lane >> 3) & 1) << 3)
            addrs.append(kernel_swizzled_offset(D // 8, row, 2 * kk + (lane >> 4)))
        return ptx_ldmatrix_x4(smem, addrs, trans=False)
    out = []
    for lane in range(32):
        r0, c0 = lane // 4, (lane % 4) * 2
        w0 = le32(smem, kernel_tile_offset(D, r0, kk) + 2 * c0)
        w1 = le32(smem, kernel_tile_offset(D, r0 + 8, kk) + 2 * c0)
        a0, a2 = kernel_quad_to_half2x2(w0)
        a1, a3 = kernel_quad_to_half2x2(w1)
        out.append([a0, a1, a2, a3])
    return out


def kernel_p_fragments(sc):
    """pb[lane] = (word 0, word 1) from the S^T accumulators sc[lane][4] of one column tile."""
    x0 = [(sc[ln][0], sc[ln][1]) for ln in range(32)]
    x1 = [(sc[ln][2], sc[ln][3]) for ln in range(32)]
    t0, t1 = ptx_movmatrix_trans(x0), ptx_movmatrix_trans(x1)
    return [[t0[ln], t1[ln]] for ln in range(32)]


def kernel_v_fragments(smem, D, fp8):
    """va[mt][lane][4]: V^T's A fragments of every m-tile."""
    if not fp8:
        va = []
        for mt in range(D // 16):
            addrs = []
            for lane in range(32):
                row = (lane & 7) + ((lane >> 4) << 3)
                addrs.append(kernel_swizzled_offset(D // 8, row, 2 * mt + ((lane >> 3) & 1)))
            va.append(ptx_ldmatrix_x4(smem, addrs, trans=True))
        return va
    piece = min(D // 8, 16)
    words = piece // 4
    va = [[None] * 32 for _ in range(D // 16)]
    for lane in range(32):
        r0, c0 = lane // 4, (lane % 4) * 2
        for pc in range(D // 8 // piece):
            byte = r0 * (D // 8) + pc * piece
            w = []
            for rr in range(4):
                row = c0 + (rr & 1) + (rr >> 1) * 8
                src = kernel_tile_offset(D, row, byte >> 4) + (byte & 15)
                w.append([le32(smem, src + 4 * j) for j in range(words)])
            for j in range(words // 2):
                frag = [[None] * 4 for _ in range(4)]
                for hr in range(2):
                    for tp in range(2):
                        x, y = w[2 * tp][j + hr * (words // 2)], w[2 * tp + 1][j + hr * (words // 2)]
                        word = hr + 2 * tp
                        frag[0][word], frag[1][word] = kernel_quad_to_half2x2(byte_perm(x, y, 0x5140))
                        frag[2][word], frag[3][word] = kernel_quad_to_half2x2(byte_perm(x, y, 0x7362))
                for i in range(4):
                    va[pc * (piece // 2) + 4 * j + i][lane] = frag[i]
    return va


def kernel_write_out(o, D, G, nh, fp8):
    """The merge's stores of o[mt][lane][4] (column tile nh) into a [G][D] tile."""
    out = np.full((G, D), np.nan)
    for lane in range(32):
        r0, c0 = lane // 4, (lane % 4) * 2
        for c in range(2):
            head = nh * 8 + c0 + c
            if head >= G:
                continue
            for mt in range(D // 16):
                for hr in range(2):
                    r = r0 + 8 * hr
                    d = kernel_permuted_v_dim(D, mt, r) if fp8 else mt * 16 + r
                    assert np.isnan(out[head, d]), "element written twice"
                    out[head, d] = o[mt][lane][2 * hr + c]
    return out


def emulate_tile(Q, Kt, Vt, P, path, fp8):
    """S (= Q K^T, [G][16]) and O (= P V, [G][D]) of one tile, assembled as the kernel does from Q,
    the K / V tiles (raw bytes for fp8) and P, per column tile of 8 heads."""
    G, D = Q.shape
    ks, vs = kernel_store_tile(Kt, path, fp8), kernel_store_tile(Vt, path, fp8)
    S = np.full((G, TILE), np.nan)
    O = np.full((G, D), np.nan)
    va = kernel_v_fragments(vs, D, fp8)
    for nh in range((G + 7) // 8):
        qf = kernel_q_fragments(Q, fp8, nh)
        sc = [[0.0] * 4 for _ in range(32)]
        for kk in range(D // 16):
            ptx_mma(kernel_k_fragments(ks, D, kk, fp8), qf[kk], sc)
        for lane in range(32):
            for i in range(4):
                tok, col = ptx_c_coords(lane, i)
                if nh * 8 + col < G:
                    S[nh * 8 + col, tok] = sc[lane][i]
        # P^T in S^T's accumulators (the kernel's probabilities sit where its logits were).
        pc = []
        for lane in range(32):
            row = []
            for i in range(4):
                tok, col = ptx_c_coords(lane, i)
                row.append(P[nh * 8 + col, tok] if nh * 8 + col < G else 0.0)
            pc.append(row)
        pb = kernel_p_fragments(pc)
        o = [[[0.0] * 4 for _ in range(32)] for _ in range(D // 16)]
        for mt in range(D // 16):
            ptx_mma(va[mt], pb, o[mt])
        part = kernel_write_out(o, D, G, nh, fp8)
        O[nh * 8:min(G, nh * 8 + 8)] = part[nh * 8:min(G, nh * 8 + 8)]
    return S, O


def random_fp8_bytes(rng, shape):
    """Random finite e4m3 bytes (every code but the NaNs 0x7f and 0xff)."""
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    return rng.choice(codes, size=shape)


@pytest.mark.parametrize("path", ["fast", "general"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("G", [4, 8, 13])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "f16"])
def test_decode_fragments_assemble_qk_and_pv(fp8, G, D, path):
    seed = D * 100 + G * 10 + (path == "fast") + 2 * fp8
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((G, D)).astype(np.float16).astype(np.float64)
    if fp8:
        Kt, Vt = random_fp8_bytes(rng, (TILE, D)), random_fp8_bytes(rng, (TILE, D))
        K, V = E4M3[Kt], E4M3[Vt]
    else:  # 16-bit elements: the values are what the emulation moves (exact in float64)
        K = rng.standard_normal((TILE, D)).astype(np.float16).astype(np.float64)
        V = rng.standard_normal((TILE, D)).astype(np.float16).astype(np.float64)
        Kt, Vt = K, V
    P = rng.random((G, TILE)).astype(np.float16).astype(np.float64)
    S, O = emulate_tile(Q, Kt, Vt, P, path, fp8)
    np.testing.assert_allclose(S, Q @ K.T, rtol=1e-12, atol=1e-12,
                               err_msg=f"S^T = K Q^T, D={D} G={G} (seed={seed})")
    np.testing.assert_allclose(O, P @ V, rtol=1e-12, atol=1e-12,
                               err_msg=f"O^T = V^T P^T, D={D} G={G} (seed={seed})")


def test_permuted_v_dim_is_a_permutation():
    for D in (64, 128, 256):
        dims = sorted(kernel_permuted_v_dim(D, mt, r) for mt in range(D // 16) for r in range(16))
        assert dims == list(range(D)), D


def wavefronts(addrs, width):
    """Wavefronts of one warp-wide shared load of `width` bytes per lane at byte `addrs`."""
    per_phase = 128 // width
    total = 0
    for p in range(0, 32, per_phase):
        banks = {}
        for a in addrs[p:p + per_phase]:
            for word in range(a // 4, (a + width) // 4):
                banks.setdefault(word % 32, set()).add(word)
        total += max(len(w) for w in banks.values())
    return total


@pytest.mark.parametrize("D", [64, 128, 256])
def test_fp8_fragment_reads_bank_conflicts(D):
    """K reads are conflict-free; V reads too except at D = 64 (2-way: its 8-byte reads of rows
    2q, q = 0..3, share 64 bytes of banks, which no per-row swizzle changes)."""
    ideal = {4: 1, 8: 2, 16: 4}
    for kk in range(D // 16):
        for hr in range(2):
            addrs = [kernel_tile_offset(D, ln // 4 + 8 * hr, kk) + 4 * (ln % 4) for ln in range(32)]
            assert wavefronts(addrs, 4) == ideal[4], f"K read kk={kk} rows+{8 * hr} D={D}"
    row_bytes = D // 8
    piece = min(row_bytes, 16)
    for pc in range(row_bytes // piece):
        for rr in range(4):
            addrs = []
            for ln in range(32):
                byte = (ln // 4) * row_bytes + pc * piece
                row = 2 * (ln % 4) + (rr & 1) + (rr >> 1) * 8
                addrs.append(kernel_tile_offset(D, row, byte >> 4) + (byte & 15))
            want = ideal[piece] * (2 if D == 64 else 1)
            assert wavefronts(addrs, piece) == want, f"V read pc={pc} rr={rr} D={D}"
