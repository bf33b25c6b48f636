"""Randomized simulation of the sm90 prefill kernel's synchronization protocol
(ffi/cuda/ragged_prefill_sm90.cu), persistent with a dynamic tile scheduler: several CTAs claim
work tiles from one global counter in random interleavings, and each CTA runs its work tiles one
after the other.

Per CTA: two producer warps (standing for the four: every producer thread runs the same loop)
and two consumer warpgroups. Work tiles: CTA c starts with work tile c; the producer's thread 0
(in warp 0) claims the next one (gridDim.x + the counter's old value) at the start of each work
tile, stores it in claimed[k & 1] after that work tile's K of tile 0 and Q, and both producer
warps read it after named barrier 4 at the work tile's end; a work tile past the last ends the
CTA. Per ring stage, K and V "full" mbarriers (both producer warps arrive) and "empty" ones (both
consumer warpgroups arrive), the ring position continuing across work tiles; the producer issuing
K of tile j then V of tile j - 1, and the work tile's Q after K of its tile 0; the consumers'
band [ta, tb) per work tile (S of tile j with P V of tile j - 1; K freed after S, V after P V;
tiles outside the band waited for, turned and freed) and the ping-pong turns on named barriers
5 / 6, restarted per work tile (warpgroup 1's first arrival on 5); the Q buffer's full barrier
(both producer warps after their Q copies, + thread 0 after it wrote the work info; a last phase
with "no more work") and empty barrier (both consumers, after their last S GEMM of the work tile,
or at once without a band).

Checked: deadlocks, phase aliasing (an arrival or a wait a whole ring ahead), stale or
overwritten shared data by version (Q and the work info, read by every S GEMM / at the work
tile's start; each producer warp's part of a K / V half; the bad-key flags and the work tile's
bad-page flag, written with a V half and read between its full and empty barriers; the claimed
work tile, read after barrier 4), lost or repeated work tiles (every work tile stored exactly
once by each consumer, over all CTAs), and dangling barrier arrivals. Work lists: random, runs of
one-tile work tiles, and the kernel's own geometry (every row tile x kv head of a random ragged
batch in the kernel's order, bands from the row geometry and windows, which also checks the
kernel's claim 0 <= ta < tb <= num_tiles). Grids of 1 to 6 CTAs, also more than the work tiles
(the launch sizes the grid from an upper bound).

The fp8 cache path (--cache fp8; by default each trial picks one of the two paths): loop turn j
issues K of tile j and V of tile j - 1 (after their empty waits) as one cp.async group, and the
producer converts and arrives on turn j - 1's halves only after turn j's issues, so a half's full
arrival comes after the next turn's empty waits; the last turn's halves are converted at the
work tile's end, and K of tile 0 still arrives before Q. That needs S >= 3 (fp8 trials draw
S from 3 up; with S = 2 the fp8 path deadlocks).

    python -m tools.sim_sm90_prefill_protocol             # expects 0 violations
    python -m tools.sim_sm90_prefill_protocol --mutate X  # a broken protocol step: expects >0

Mirror kernel changes here before relying on it.
"""
import argparse
import random

NPW = 2   # producer warps modeled
MUTATIONS = {
    'claim_single_buffer': 'claimed[0] instead of claimed[k & 1]',
    'no_barrier4': 'producer warps read the claim without named barrier 4',
    'claim_no_grid_offset': 'a claim is the counter value, not gridDim.x + it',
    'no_q_empty_wait': 'the producer loads Q without waiting for the Q empty barrier',
    'q_freed_early': 'a consumer frees Q after its first S GEMM instead of its last',
    'ring_not_advanced': 'the consumers do not advance the ring position per work tile',
    'no_stage_bad': 'the producer does not write stage_bad with the last V half',
}


def run(works, S, grid, seed, mutate=None, fp8=False):
    """works: per work tile (n, bands): n key tiles, bands[c] = (ta, tb) of consumer c.
    fp8: the fp8 cache path (loop turn j's K of tile j and V of tile j - 1 arrive only after
    turn j + 1's empty waits; S >= 3)."""
    rnd = random.Random(seed)
    W = len(works)
    errors = []
    counter = [0]
    stored = {}                  # (w, c) -> times stored
    agents = {}

    def cta(cid):
        full = {'k': [0]*S, 'v': [0]*S}          # completed phases
        fwho = {'k': [set() for _ in range(S)], 'v': [set() for _ in range(S)]}
        edone = {'k': [0]*S, 'v': [0]*S}
        ewho = {'k': [set() for _ in range(S)], 'v': [set() for _ in range(S)]}
        nb = {4: set(), 5: set(), 6: set()}; gen = {4: 0, 5: 0, 6: 0}
        qf = [0]; qfwho = []     # Q full: completed phases, arrivals (NPW warps + info)
        qe = [0]; qewho = set()
        shared = {'q': [None]*NPW, 'info': None, 'claimed': [None, None]}
        data = {'k': [[None]*NPW for _ in range(S)], 'v': [[None]*NPW for _ in range(S)]}
        flags = [[None]*NPW for _ in range(S)]
        sbad = [[None]*NPW for _ in range(S)]

        def pwait(h, gi):
            st = gi % S; k = gi // S - 1
            while edone[h][st] <= k: yield 'wait'
            if edone[h][st] > k + 1: errors.append(('empty alias', cid, h, gi))
        def pfill(pw, h, gi, tag):
            st = gi % S
            if full[h][st] != gi // S: errors.append(('full order', cid, h, gi))
            if pw in fwho[h][st]: errors.append(('double full arrival', cid, h, gi))
            data[h][st][pw] = tag
            fwho[h][st].add(pw)
            if len(fwho[h][st]) == NPW: fwho[h][st] = set(); full[h][st] += 1
        def qfull_arrive(who, k):
            if qf[0] != k: errors.append(('q full order', cid, k))
            if who in qfwho: errors.append(('double q full arrival', cid, who))
            qfwho.append(who)
            if len(qfwho) == NPW + 1: qfwho.clear(); qf[0] += 1
        def qwait_empty(k):      # before Q of work tile k + 1 (or the "no more work" phase)
            if mutate == 'no_q_empty_wait': return
            while qe[0] <= k: yield 'wait'
            if qe[0] > k + 1: errors.append(('q empty alias', cid, k))
        def arrive(who, b, count):
            if who in nb[b]: errors.append(('double arrive', cid, who, b))
            nb[b].add(who)
            if len(nb[b]) == count: nb[b] = set(); gen[b] += 1
        def sync(who, b, count):
            g0 = gen[b]; arrive(who, b, count)
            while gen[b] == g0: yield 'wait'

        def producer(pw):
            g = 0; w = cid; k = 0
            while True:
                next_w = None
                if pw == 0:      # thread 0's atomicAdd, at the start of work tile k
                    old = counter[0]; counter[0] += 1
                    next_w = old if mutate == 'claim_no_grid_offset' else grid + old
                    yield 'step'
                if w >= W:       # no more work
                    if k > 0: yield from qwait_empty(k - 1)
                    if pw == 0: shared['info'] = ('done', k)
                    qfull_arrive(pw, k)
                    if pw == 0: qfull_arrive('info', k)
                    yield 'step'; return
                n = works[w][0]
                if n > 0:        # K of tile 0
                    if g >= S: yield from pwait('k', g)
                    pfill(pw, 'k', g, (w, 0)); yield 'step'
                if k > 0: yield from qwait_empty(k - 1)
                shared['q'][pw] = w; yield 'step'           # Q copies (land before the arrival)
                qfull_arrive(pw, k)
                if pw == 0:
                    shared['info'] = ('work', k, w); qfull_arrive('info', k)
                    slot = 0 if mutate == 'claim_single_buffer' else k & 1
                    shared['claimed'][slot] = (k, next_w)
                yield 'step'
                def fill_v(jt):
                    gv = g + jt; st = gv % S
                    flags[st][pw] = (w, jt)
                    if jt == n - 1 and mutate != 'no_stage_bad': sbad[st][pw] = w
                    pfill(pw, 'v', gv, (w, jt)); yield 'step'
                def finish_turn(i):  # fp8: turn i's copies converted (K of tile i, V of i - 1)
                    if i < n: pfill(pw, 'k', g + i, (w, i)); yield 'step'
                    yield from fill_v(i - 1)
                for it in range(1, n + 1):
                    gk = g + it
                    if it < n:
                        if gk >= S: yield from pwait('k', gk)
                        if not fp8: pfill(pw, 'k', gk, (w, it)); yield 'step'
                    jt = it - 1; gv = g + jt
                    if gv >= S: yield from pwait('v', gv)
                    if not fp8: yield from fill_v(jt)
                    elif it >= 2: yield from finish_turn(it - 1)
                if fp8 and n > 0: yield from finish_turn(n)   # nothing left across work tiles
                g += n
                if mutate != 'no_barrier4': yield from sync(('p', pw), 4, NPW)
                slot = 0 if mutate == 'claim_single_buffer' else k & 1
                got = shared['claimed'][slot]
                if got is None or got[0] != k: errors.append(('stale claim', cid, pw, k, got))
                if got is None: return
                w = got[1]; k += 1
                yield 'step'

        def cwait(h, gi, tag):
            st = gi % S
            while full[h][st] <= gi // S: yield 'wait'
            if full[h][st] > gi // S + 1: errors.append(('full alias', cid, h, gi))
            if any(d != tag for d in data[h][st]):
                errors.append(('stale data', cid, h, gi, data[h][st], tag))
        def rel(c, h, gi):
            st = gi % S
            if edone[h][st] != gi // S: errors.append(('release phase', cid, c, h, gi))
            if c in ewho[h][st]: errors.append(('double release', cid, c, h, gi))
            ewho[h][st].add(c)
            if len(ewho[h][st]) == 2: ewho[h][st] = set(); edone[h][st] += 1

        def consumer(c):
            g = 0; k = 0
            while True:
                while qf[0] <= k: yield 'wait'
                if qf[0] > k + 1: errors.append(('q full alias', cid, c, k))
                info = shared['info']
                if info is None or info[1] != k:
                    errors.append(('info', cid, c, k, info)); return
                if info[0] == 'done': return
                w = info[2]
                n, bands = works[w]
                ta, tb = bands[c]
                released = [False]
                def release_q():
                    if released[0]: errors.append(('double q release', cid, c, w))
                    released[0] = True
                    if qe[0] != k: errors.append(('q release phase', cid, c, k))
                    qewho.add(c)
                    if len(qewho) == 2: qewho.clear(); qe[0] += 1
                def s_gemm(it):  # reads Q and K of tile it
                    if any(q != w for q in shared['q']):
                        errors.append(('q overwritten', cid, c, w, it))
                    st = (g + it) % S
                    if any(d != (w, it) for d in data['k'][st]):
                        errors.append(('k overwritten', cid, c, w, it))
                def pv(it):
                    st = (g + it) % S
                    if any(d != (w, it) for d in data['v'][st]):
                        errors.append(('v overwritten', cid, c, w, it))
                def waitv(it):
                    yield from cwait('v', g + it, (w, it))
                    st = (g + it) % S
                    if any(f != (w, it) for f in flags[st]): errors.append(('flags', cid, c, w, it))
                    if it == n - 1 and any(b != w for b in sbad[st]):
                        errors.append(('stage_bad', cid, c, w, it))
                if c == 1 and n > 0: arrive(1, 5, 2)
                def tbeg(): yield from sync(c, 5 + c, 2)
                def tend(it):
                    if c == 0 or it + 1 < n: arrive(c, 6 - c, 2)
                def skip(it):
                    yield from cwait('k', g + it, (w, it)); yield from waitv(it)
                    yield from tbeg(); tend(it); rel(c, 'k', g + it); rel(c, 'v', g + it)
                    yield 'step'
                for it in range(ta): yield from skip(it)
                if ta < tb:
                    yield from cwait('k', g + ta, (w, ta))
                    yield from tbeg(); s_gemm(ta); tend(ta); yield 'step'
                    s_gemm(ta)   # (still reading until the wait)
                    rel(c, 'k', g + ta)
                    if ta + 1 == tb or mutate == 'q_freed_early': release_q()
                    if ta + 1 < tb: yield from cwait('k', g + ta + 1, (w, ta + 1))
                    for it in range(ta + 1, tb):
                        yield from waitv(it - 1)
                        yield from tbeg(); s_gemm(it); pv(it - 1); tend(it); yield 'step'
                        s_gemm(it)
                        rel(c, 'k', g + it)
                        if it + 1 == tb and mutate != 'q_freed_early': release_q()
                        if it + 1 < tb: yield from cwait('k', g + it + 1, (w, it + 1))
                        pv(it - 1)
                        rel(c, 'v', g + it - 1); yield 'step'
                    yield from waitv(tb - 1)
                    pv(tb - 1); yield 'step'; pv(tb - 1)
                    rel(c, 'v', g + tb - 1)
                else:
                    release_q()
                for it in range(max(ta, tb), n): yield from skip(it)
                if mutate != 'ring_not_advanced': g += n
                yield 'step'     # epilogue: O of work tile w stored
                stored[(w, c)] = stored.get((w, c), 0) + 1
                if not released[0]: errors.append(('no q release', cid, c, w))
                k += 1

        def leftovers():
            if nb[4] or nb[5] or nb[6]: errors.append(('dangling', cid, nb))
            if qewho or qfwho: errors.append(('partial q barrier at end', cid, qewho, qfwho))
            for h in 'kv':
                for st in range(S):
                    if ewho[h][st] or fwho[h][st]:
                        errors.append(('partial arrival at end', cid, h, st))
        for pw in range(NPW): agents[(cid, 'p', pw)] = producer(pw)
        for c in range(2): agents[(cid, 'c', c)] = consumer(c)
        return leftovers

    checks = [cta(cid) for cid in range(grid)]
    alive = set(agents); stuck = 0
    order = sorted(alive, key=str)
    while alive:
        key = rnd.choice([a for a in order if a in alive])
        try: r = next(agents[key])
        except StopIteration: alive.discard(key); stuck = 0; continue
        stuck = stuck + 1 if r == 'wait' else 0
        if stuck > 2000 * len(alive): return ['deadlock', S, grid, works] + errors
    for check in checks: check()
    for w in range(W):
        for c in range(2):
            if stored.get((w, c), 0) != 1: errors.append(('work tile stored', w, c, stored.get((w, c), 0)))
    for (w, c) in stored:
        if w >= W: errors.append(('work tile past the last stored', w, c))
    return errors


def random_work(rnd):
    n = rnd.randint(1, 14)
    bands = []
    for c in range(2):
        ta = rnd.randint(0, n - 1); tb = rnd.randint(ta + 1, n); bands.append((ta, tb))
    return (n, bands)


def kernel_work(tile, nq, length, G, window, keys=128, rows=128):
    """(n, bands) of row tile `tile` of a sequence with nq queries and length `length`, by the
    kernel's formulas (MakeWorkRange, the consumers' ta / tb); asserts 0 <= ta < tb <= n."""
    num_rows = nq * G; row0 = tile * rows; pos0 = length - nq
    last_row = min(row0 + rows, num_rows) - 1
    q_first = pos0 + row0 // G; q_last = pos0 + last_row // G
    key_lo = max(0, q_first - window + 1) if window > 0 else 0
    t_lo = key_lo // keys; n = (q_last + 1 + keys - 1) // keys - t_lo
    bands = []
    for cw in range(2):
        lo = pos0 + min(row0 + cw * 64, num_rows - 1) // G
        hi = pos0 + min(row0 + cw * 64 + 63, num_rows - 1) // G
        wkl = max(0, lo - window + 1) if window > 0 else 0
        ta = wkl // keys - t_lo; tb = min(n, hi // keys + 1 - t_lo)
        assert 0 <= ta < tb <= n, (tile, nq, length, G, window, ta, tb, n)
        bands.append((ta, tb))
    return (n, bands)


def kernel_works(rnd):
    """Every work tile of a random ragged batch in the kernel's order: work tile w is row tile
    w // H (by sequence, each sequence's heaviest row tile first) of kv head w % H."""
    G = rnd.choice([1, 2, 4, 8, 16]); window = rnd.choice([0, 0, 1, 5, 100, 300, 1000])
    tiles = []
    for _ in range(rnd.randint(1, 3)):
        nq = rnd.choice([1, 1, rnd.randint(1, 40), rnd.randint(1, 400)])
        length = nq + rnd.choice([0, 0, rnd.randint(0, 1200)])
        count = (nq * G + 127) // 128
        tiles += [(count - 1 - t, nq, length) for t in range(count)]
    H = rnd.choice([1, 2, 3])
    work = [tiles[w // H] for w in range(len(tiles) * H)][:16]
    return [kernel_work(t, nq, length, G, window) for t, nq, length in work]


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools.sim_sm90_prefill_protocol``."""
    ap = argparse.ArgumentParser(prog="python -m tools.sim_sm90_prefill_protocol")
    ap.add_argument('--mutate', choices=sorted(MUTATIONS), default=None)
    ap.add_argument('--trials', type=int, default=20000)
    ap.add_argument('--cache', choices=['both', 'fp16', 'fp8'], default='both',
                    help='the producer path modeled: 16-bit caches, fp8 caches, or each trial at '
                         'random (default)')
    return ap


def main() -> None:
    args = build_parser().parse_args()
    bad = 0
    rnd = random.Random(12345)
    for trial in range(args.trials):
        fp8 = args.cache == 'fp8' or (args.cache == 'both' and rnd.random() < 0.5)
        S = rnd.choice([3, 4, 6, 8] if fp8 else [2, 3, 4, 6, 8])  # the kernel: 3 and 6
        W = rnd.choice([0, 1, 2, 3, 5, 8, 12])
        works = [random_work(rnd) for _ in range(W)]
        if rnd.random() < 0.3:   # runs of one-tile work tiles (decode rows, short sequences)
            works = [(1, [(0, 1), (0, 1)]) for _ in range(W)]
        if rnd.random() < 0.3:   # the kernel's own geometry (bands from rows, windows)
            works = kernel_works(rnd)
        grid = rnd.choice([1, 1, 2, 3, 4, 6])
        e = run(works, S, grid, trial, args.mutate, fp8)
        if e:
            bad += 1
            if bad < 4: print(str(e)[:600])
    what = f' (mutation {args.mutate}: {MUTATIONS[args.mutate]})' if args.mutate else ''
    print(f'trials: {args.trials} violations: {bad}{what}')
    # Without a mutation, success is 0 violations; with one, catching it.
    raise SystemExit((1 if bad else 0) if not args.mutate else (0 if bad else 1))


if __name__ == "__main__":
    main()
