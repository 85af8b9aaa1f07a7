"""Python re-implementation of the LAYER policy with a pluggable first-visit probability."""
import sys, numpy as np
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]  # the repository
TRACES = ROOT.parent / 'shared' / 'data' / 'route-traces'
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(Path(__file__).resolve().parent))
from server.bench.replay import load_trace, replay_belady

AGE_EXACT, AGE_CAP, CLASSES, H, PW, WINDOW = 16, 32, 8, 32, 2.0, 256
NEVER = AGE_CAP; AGES = AGE_CAP + 1
def bucket_of_age(a):
    a = np.asarray(a)
    lg = np.floor(np.log2(np.maximum(a, 1))).astype(int)
    b = np.where(a < AGE_EXACT, a, AGE_EXACT + lg - 4)
    return np.minimum(b, AGE_CAP - 1)
def freq_class(u):
    return np.minimum(np.floor(np.log2(1 + np.asarray(u))).astype(int), CLASSES - 1)

class Sim:
    def __init__(s, trace, budget_mib, aff=None):
        s.t = trace; L, E = trace.n_layer, trace.n_expert; s.L, s.E = L, E
        s.bytes = np.array(trace.entry_bytes, float); s.budget = budget_mib * 2**20
        n = L * E
        s.resident = np.zeros(n, bool); s.last_use = np.zeros(n); s.last_visit = np.zeros(n, int)
        s.uses = np.zeros(n); s.visits = np.zeros(L, int); s.obs = np.zeros((AGES, CLASSES)); s.obs_hit = np.zeros((AGES, CLASSES))
        s.obs_total = 0; s.k_seen = 0; s.clock = 0; s.used = 0.0; s.aff = aff
        s.entry_layer = np.repeat(np.arange(L), E); s.entry_exp = np.tile(np.arange(E), L)
    def hazard(s):
        prior = s.k_seen / s.E
        n = s.obs.sum(1); h = s.obs_hit.sum(1)
        by_age = (h + PW * prior) / (n + PW)
        return (s.obs_hit + PW * by_age[:, None]) / (s.obs + PW)
    def learn(s, l, want):
        row = l * s.E; s.visits[l] += 1; v = s.visits[l]
        idx = np.arange(row, row + s.E)
        lv = s.last_visit[idx]
        ab = np.where(lv == 0, NEVER, bucket_of_age(v - lv))
        cl = freq_class(s.uses[idx])
        np.add.at(s.obs, (ab, cl), 1.0); np.add.at(s.obs_hit, (ab[want], cl[want]), 1.0)
        s.uses[idx[want]] += 1; s.last_visit[idx[want]] = v
        s.obs_total += s.E
        if v % WINDOW == 0: s.uses[idx] //= 2
        if s.obs_total > WINDOW * s.L * s.E: s.obs *= .5; s.obs_hit *= .5; s.obs_total *= .5
    def scores(s, cur, pinned_idx, hz):
        res = np.nonzero(s.resident)[0]
        j = s.entry_layer[res]; d = j - cur; d = np.where(d <= 0, d + s.L, d)
        lv = s.last_visit[res]; age0 = s.visits[j] + 1 - lv
        never = lv == 0
        cl = freq_class(s.uses[res])
        J = np.arange(H)
        ages = age0[:, None] + J[None, :]
        ab = np.where(never[:, None], NEVER, bucket_of_age(np.maximum(ages, 1)))
        hh = hz[ab, cl[:, None]]
        if s.aff is not None:
            p1 = s.aff.first_visit(s, res, j, cur, hh[:, 0])
            hh = hh.copy(); hh[:, 0] = p1
        surv = np.cumprod(1 - hh, axis=1)
        hits = 1 - surv
        held = np.concatenate([np.zeros((len(res), 1)), np.cumsum(surv[:, :-1], axis=1)], axis=1)
        val = (hits / (d[:, None] + s.L * held)).max(1) / s.bytes[j]
        val[np.isin(res, pinned_idx)] = np.inf
        return res, val

def run(trace, budget, aff=None):
    """decode hit rate (%) of the re-implemented policy; aff: an optional first-visit hook"""
    s = Sim(trace, budget, aff)
    dh = dm = 0
    for n, r in enumerate(trace.routes):
        m = route_one(s, r, n)
        if r.decode:
            dh += len(set(r.experts)) - m; dm += m
    return 100 * dh / (dh + dm)

def route_one(s, r, n):
    # mimic C: learn first, then (once per cycle) recompute the table, then evict
    E = s.E; s.clock += 1
    want = np.zeros(E, bool); want[list(r.experts)] = True
    s.k_seen = max(s.k_seen, int(want.sum()))
    s.learn(r.layer, want)
    if n % s.L == 0: s.hz = s.hazard()
    if s.aff is not None: s.aff.observe(s, r.layer, want)
    idx = r.layer * E + np.nonzero(want)[0]
    misses = 0; scored = None
    for i in idx:
        s.last_use[i] = s.clock
        if s.resident[i]: continue
        while s.used + s.bytes[r.layer] > s.budget:
            if scored is None:
                res, val = s.scores(r.layer, idx, s.hz); scored = dict(zip(res.tolist(), val.tolist()))
            v = min(scored, key=lambda k: (scored[k], s.last_use[k]))
            del scored[v]; s.resident[v] = False; s.used -= s.bytes[s.entry_layer[v]]
        s.resident[i] = True; s.used += s.bytes[r.layer]; misses += 1
        if scored is not None: scored[i] = np.inf
    return misses

def load(name):
    return load_trace(TRACES / f'{name}.route.csv')

if __name__ == '__main__':
    for name in sys.argv[1:] or ['qwen']:
        t = load(name)
        print(name, 'sim baseline 2000:', run(t, 2000), 'belady', replay_belady(t, 2000).hit_pct_decode)
