"""Host-side oracle for the index algebra of the fp8 path of the paged decode kernel.

``ffi/cuda/paged_decode.cu`` converts fp8 (float8_e4m3fn) K/V tile bytes straight into the
fragments of ``mma.m16n8k16`` (f16 operands, f32 accumulators): swizzled raw tiles in shared
memory, a permuted head-dim order for the k steps of S = Q K^T (the Q fragments use the same one),
a permuted head-dim order for the columns of O = P V (undone at the write-out), and bytes of two
token rows interleaved with ``__byte_perm`` into e4m3 pairs. No GPU runs here, so this test
emulates that kernel code lane by lane in numpy (the functions named ``kernel_*`` mirror it line
for line) and checks the assembled S and O tiles against plain ``Q @ K.T`` and ``P @ V``.

The MMA is emulated independently of the kernel's choices, from the fragment layouts that PTX
documents for ``mma.m16n8k16.row.col`` (``ptx_*``): with g = lane / 4 and q = lane % 4, A register
i holds row g (i = 0, 2) or g + 8 (i = 1, 3) at columns 2q, 2q + 1 (+ 8 for i = 2, 3); B register
i holds column g at rows 2q, 2q + 1 (+ 8 for i = 1); C element i is row g (+ 8 for i >= 2),
column 2q + i % 2. A 32-bit operand register's low half is its first element, and
``cvt.rn.f16x2.e4m3x2`` puts the value of the low byte of its 16-bit source in the low half.

It also counts shared-memory bank conflicts of the kernel's fragment reads (32 banks of 4 bytes;
a request of w-byte accesses is served 128 / w lanes per wavefront), the reason for the swizzle.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

TILE = 16  # tokens per tile
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3 = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float64)  # byte -> value


# ----- PTX's mma.m16n8k16.row.col fragment layouts (the oracle for the hardware) ----------------

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


def kernel_quad_to_half2x2(w):  # Fp8QuadToHalf2x2: (lo, hi) from bytes {0, 1} and {2, 3}
    return cvt_e4m3x2(w & 0xFFFF), cvt_e4m3x2(w >> 16)


def kernel_store_tile(raw, path):
    """load_tile's cp.asyncs of a [16][D]-byte tile into shared memory (its fast or general path)."""
    D = raw.shape[1]
    load_chunks = D // 16
    smem = np.zeros(TILE * D, np.uint8)
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
            so = kernel_tile_offset(D, row, ch)
            smem[so:so + 16] = raw[row, ch * 16:ch * 16 + 16]
            written[so:so + 16] += 1
    assert (written == 1).all(), "the tile store must write every shared byte exactly once"
    return smem


def kernel_q_fragments(Q):
    """qf[kk][lane][word] as (lo, hi) pairs: words 0/1 at d = 16 kk + 4q (+1), 2/3 at +2 (+3)."""
    D = Q.shape[1]
    qf = []
    for kk in range(D // 16):
        per_lane = []
        for lane in range(32):
            r0, c0 = lane // 4, (lane % 4) * 2
            col, hi = kk * 16 + 2 * c0, 2
            word = lambda r, c: (Q[r, c], Q[r, c + 1])  # noqa: E731
            per_lane.append([word(r0, col), word(r0 + 8, col), word(r0, col + hi),
                             word(r0 + 8, col + hi)])
        qf.append(per_lane)
    return qf


def kernel_k_fragments(smem, D, kk, lane):
    """r[4] of k step kk: words {2nt, 2nt + 1} are n-tile nt's B fragment."""
    r0, c0 = lane // 4, (lane % 4) * 2
    r = []
    for nt in range(2):
        w = le32(smem, kernel_tile_offset(D, nt * 8 + r0, kk) + 2 * c0)
        r += list(kernel_quad_to_half2x2(w))
    return r


def kernel_v_fragments(smem, D, lane):
    """B fragments of all D / 8 n-tiles of O = P V for one lane: b[n] = (word 0, word 1)."""
    r0, c0 = lane // 4, (lane % 4) * 2
    row_bytes = D // 8
    piece = min(row_bytes, 16)
    b = [None] * (D // 8)
    for pc in range(row_bytes // piece):
        byte = r0 * row_bytes + pc * piece
        w = []
        for rr in range(4):
            row = c0 + (rr & 1) + (rr >> 1) * 8
            src = kernel_tile_offset(D, row, byte >> 4) + (byte & 15)
            w.append([le32(smem, src + 4 * j) for j in range(piece // 4)])
        for j in range(piece // 4):
            lo0 = byte_perm(w[0][j], w[1][j], 0x5140)
            hi0 = byte_perm(w[0][j], w[1][j], 0x7362)
            lo1 = byte_perm(w[2][j], w[3][j], 0x5140)
            hi1 = byte_perm(w[2][j], w[3][j], 0x7362)
            b0 = kernel_quad_to_half2x2(lo0) + kernel_quad_to_half2x2(hi0)
            b1 = kernel_quad_to_half2x2(lo1) + kernel_quad_to_half2x2(hi1)
            for i in range(4):
                b[pc * piece + 4 * j + i] = (b0[i], b1[i])
    return b


def kernel_p_fragments(sc):
    """pa[lane] from the S accumulators sc[nt][lane][4], as the kernel packs them."""
    return [[(sc[0][ln][0], sc[0][ln][1]), (sc[0][ln][2], sc[0][ln][3]),
             (sc[1][ln][0], sc[1][ln][1]), (sc[1][ln][2], sc[1][ln][3])] for ln in range(32)]


def kernel_write_out(o, D):
    """The merge's stores of o[n][lane][4] into a [16][D] tile (fp8 column order)."""
    out = np.full((16, D), np.nan)
    for lane in range(32):
        r0, c0 = lane // 4, (lane % 4) * 2
        for h in range(2):
            row = r0 + 8 * h
            for n in range(D // 8):
                d0, d1 = c0 * (D // 8) + n, (c0 + 1) * (D // 8) + n
                assert np.isnan(out[row, d0]) and np.isnan(out[row, d1]), "column written twice"
                out[row, d0] = o[n][lane][2 * h]
                out[row, d1] = o[n][lane][2 * h + 1]
    return out


def emulate_tile(Q, Kraw, Vraw, P, path):
    """S (from Q and the K tile) and O = P V (from P and the V tile) as the kernel assembles them."""
    D = Q.shape[1]
    ks, vs = kernel_store_tile(Kraw, path), kernel_store_tile(Vraw, path)
    qf = kernel_q_fragments(Q)
    sc = [[[0.0] * 4 for _ in range(32)] for _ in range(2)]
    for kk in range(D // 16):
        r = [kernel_k_fragments(ks, D, kk, lane) for lane in range(32)]
        for nt in range(2):
            ptx_mma(qf[kk], [r[ln][2 * nt:2 * nt + 2] for ln in range(32)], sc[nt])
    S = np.full((16, 16), np.nan)
    for nt in range(2):
        for lane in range(32):
            for i in range(4):
                row, col = ptx_c_coords(lane, i)
                S[row, nt * 8 + col] = sc[nt][lane][i]
    # P V with P laid out in S's accumulators (the kernel's probabilities sit where its logits were).
    pc = [[[P[ptx_c_coords(ln, i)[0], nt * 8 + ptx_c_coords(ln, i)[1]] for i in range(4)]
           for ln in range(32)] for nt in range(2)]
    pa = kernel_p_fragments(pc)
    vb = [kernel_v_fragments(vs, D, lane) for lane in range(32)]
    o = [[[0.0] * 4 for _ in range(32)] for _ in range(D // 8)]
    for n in range(D // 8):
        ptx_mma(pa, [vb[ln][n] for ln in range(32)], o[n])
    return S, kernel_write_out(o, D)


def random_fp8_bytes(rng, shape):
    """Random finite e4m3 bytes (every code but the NaNs 0x7f and 0xff)."""
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    return rng.choice(codes, size=shape)


@pytest.mark.parametrize("path", ["fast", "general"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_fragments_assemble_qk_and_pv(D, path, seed):
    print(f"seed={seed}")
    rng = np.random.default_rng(seed * 1000 + D)
    Q = rng.standard_normal((16, D)).astype(np.float16).astype(np.float64)
    Kraw, Vraw = random_fp8_bytes(rng, (TILE, D)), random_fp8_bytes(rng, (TILE, D))
    P = rng.random((16, TILE)).astype(np.float16).astype(np.float64)
    S, O = emulate_tile(Q, Kraw, Vraw, P, path)
    K, V = E4M3[Kraw], E4M3[Vraw]
    np.testing.assert_allclose(S, Q @ K.T, rtol=1e-12, atol=0,
                               err_msg=f"S = Q K^T, D={D} (seed={seed})")
    np.testing.assert_allclose(O, P @ V, rtol=1e-12, atol=0,
                               err_msg=f"O = P V, D={D} (seed={seed})")


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
        for nt in range(2):
            addrs = [kernel_tile_offset(D, nt * 8 + ln // 4, kk) + 4 * (ln % 4) for ln in range(32)]
            assert wavefronts(addrs, 4) == ideal[4], f"K read kk={kk} nt={nt} D={D}"
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
