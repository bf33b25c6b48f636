"""Randomized simulation of the sm90 prefill kernel's synchronization protocol
(ffi/cuda/ragged_prefill_sm90.cu): per stage K and V "full" mbarriers (the producer arrives) and
"empty" ones (both consumer warpgroups arrive), the producer issuing K of tile j then V of tile
j - 1, the consumers' band [ta, tb) (S of tile j with P V of tile j - 1; K freed after S, V after
P V; tiles outside the band waited for, turned and freed) and the ping-pong turns on named
barriers 5 / 6. Reports deadlocks, phase aliasing (an arrival or a wait a whole ring ahead) and
dangling barrier arrivals, for random ring depths, tile counts and bands. Mirror kernel changes
here before relying on it.

    python scripts/sim_sm90_prefill_protocol.py
"""
import random


def run(n, S, bands, seed):
    rnd = random.Random(seed)
    full = {'k': [0]*S, 'v': [0]*S}
    edone = {'k': [0]*S, 'v': [0]*S}
    ewho = {'k': [set() for _ in range(S)], 'v': [set() for _ in range(S)]}
    nb = {5: set(), 6: set()}; gen = {5: 0, 6: 0}
    errors = []
    def pwait(h, it):
        st = it % S; k = it // S - 1
        while edone[h][st] <= k: yield 'wait'
        if edone[h][st] > k + 1: errors.append(('empty alias', h, it))
    def pfill(h, it):
        st = it % S
        if full[h][st] != it // S: errors.append(('full order', h, it))
        full[h][st] += 1
    def prod():
        for it in range(n + 1):
            if it < n:
                if it >= S: yield from pwait('k', it)
                pfill('k', it); yield 'step'
            if it >= 1:
                jt = it - 1
                if jt >= S: yield from pwait('v', jt)
                pfill('v', jt); yield 'step'
    def cwait(h, it):
        st = it % S
        while full[h][st] <= it // S: yield 'wait'
        if full[h][st] > it // S + 1: errors.append(('full alias', h, it))
    def rel(c, h, it):
        st = it % S
        if edone[h][st] != it // S: errors.append(('release phase', c, h, it))
        if c in ewho[h][st]: errors.append(('double release', c, h, it))
        ewho[h][st].add(c)
        if len(ewho[h][st]) == 2: ewho[h][st] = set(); edone[h][st] += 1
    def arrive(c, b):
        if c in nb[b]: errors.append(('double arrive', c, b))
        nb[b].add(c)
        if len(nb[b]) == 2: nb[b] = set(); gen[b] += 1
    def sync(c, b):
        g = gen[b]; arrive(c, b)
        while gen[b] == g: yield 'wait'
    def wg(c):
        ta, tb = bands[c]
        if c == 1: arrive(1, 5)
        def tbeg(): yield from sync(c, 5 + c)
        def tend(it):
            if c == 0 or it + 1 < n: arrive(c, 6 - c)
        def skip(it):
            yield from cwait('k', it); yield from cwait('v', it)
            yield from tbeg(); tend(it); rel(c, 'k', it); rel(c, 'v', it); yield 'step'
        for it in range(ta): yield from skip(it)
        if ta < tb:
            yield from cwait('k', ta)
            yield from tbeg(); tend(ta); yield 'step'
            rel(c, 'k', ta)
            if ta + 1 < tb: yield from cwait('k', ta + 1)
            for it in range(ta + 1, tb):
                yield from cwait('v', it - 1)
                yield from tbeg(); tend(it); yield 'step'
                rel(c, 'k', it)
                if it + 1 < tb: yield from cwait('k', it + 1)
                rel(c, 'v', it - 1); yield 'step'
            yield from cwait('v', tb - 1)
            rel(c, 'v', tb - 1)
        for it in range(max(ta, tb), n): yield from skip(it)
    agents = {'p': prod(), 0: wg(0), 1: wg(1)}
    alive = set(agents); stuck = 0
    while alive:
        k = rnd.choice(sorted(alive, key=str))
        try: r = next(agents[k])
        except StopIteration: alive.discard(k); stuck = 0; continue
        stuck = stuck + 1 if r == 'wait' else 0
        if stuck > 3000: return ['deadlock', n, S, bands] + errors
    if nb[5] or nb[6]: errors.append(('dangling', nb))
    for h in 'kv':
        for st in range(S):
            if ewho[h][st]: errors.append(('partial release at end', h, st))
    return errors


def main() -> None:
    bad = 0
    for trial in range(5000):
        S = random.choice([2, 3, 4, 6, 8]); n = random.randint(1, 14)
        bands = []
        for c in range(2):
            ta = random.randint(0, n - 1); tb = random.randint(ta + 1, n); bands.append((ta, tb))
        e = run(n, S, bands, trial)
        if e:
            bad += 1
            if bad < 4: print(e)
    print('violations:', bad)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
