"""temporal (same-layer, previous visit) affinity: P(f at layer j's next visit | layer j's last route)"""
from pathlib import Path
import sys, numpy as np
ROOT = Path(__file__).resolve().parents[3]  # the repository
TRACES = ROOT.parent / 'shared' / 'data' / 'route-traces'
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim as S
from sim import *

NB = 6  # lift buckets: <1/4, 1/4-1/2, 1/2-1, 1-2, 2-4, >=4
def lift_bucket(x):
    return np.clip(np.floor(np.log2(np.maximum(x, 1e-9))).astype(int) + 3, 0, NB - 1)

class TSim(S.Sim):
    def __init__(s, t, b, src='same'):
        super().__init__(t, b, None)
        L, E = s.L, s.E
        s.C = np.zeros((L, E, E)); s.Ns = np.zeros((L, E)); s.Mg = np.zeros((L, E)); s.T = np.zeros(L)
        s.lastroute = np.zeros((L, E), bool); s.liftb = np.full((L, E), 3)
        s.o3 = np.zeros((AGES, CLASSES, NB)); s.h3 = np.zeros((AGES, CLASSES, NB))
        s.src = src
    def learn(s, l, want):
        row = l * s.E; v = s.visits[l] + 1
        idx = np.arange(row, row + s.E); lv = s.last_visit[idx]
        ab = np.where(lv == 0, NEVER, bucket_of_age(np.maximum(v - lv, 1))); cl = freq_class(s.uses[idx])
        lb = s.liftb[l]
        np.add.at(s.o3, (ab, cl, lb), 1.0); np.add.at(s.h3, (ab[want], cl[want], lb[want]), 1.0)
        super().learn(l, want)
        if s.T[l] > 0:
            src = s.lastroute[l]
            s.C[l][np.ix_(src, want)] += 1; s.Ns[l][src] += 1
        s.Mg[l] += want; s.T[l] += 1; s.lastroute[l] = want
        if s.obs_total == 0: pass
        # new lift for layer l's next visit
        w = PW; k = s.k_seen
        pm = (s.Mg[l] + w * k / s.E) / (s.T[l] + w)
        src = np.nonzero(want)[0]
        pc = ((s.C[l][src] + w * pm[None, :]) / (s.Ns[l][src][:, None] + w)).mean(0)
        s.liftb[l] = lift_bucket(pc / pm)
    def hazard3(s):
        h2 = s.hazard()
        return (s.h3 + PW * h2[:, :, None]) / (s.o3 + PW)
    def scores(s, cur, pinned_idx, hz):
        s.aff = s  # use first_visit hook
        return S.Sim.scores(s, cur, pinned_idx, hz)
    def first_visit(s, sim, res, j, cur, h0):
        ab = np.where(s.last_visit[res] == 0, NEVER, bucket_of_age(np.maximum(s.visits[j] + 1 - s.last_visit[res], 1)))
        return s.H3[ab, freq_class(s.uses[res]), s.liftb[j, res % s.E]]
    def observe(s, *a): pass

def run2(t, b):
    s = TSim(t, b); dh = dm = 0
    for n, r in enumerate(t.routes):
        E = s.E; s.clock += 1
        want = np.zeros(E, bool); want[list(r.experts)] = True
        s.k_seen = max(s.k_seen, int(want.sum()))
        s.aff = None
        s.learn(r.layer, want)
        if n % s.L == 0: s.hz = s.hazard(); s.H3 = s.hazard3()
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
        if r.decode: dh += len(set(r.experts)) - misses; dm += misses
    return 100 * dh / (dh + dm)

if __name__ == '__main__':
    name = sys.argv[1]; t = load(name)
    for b in [int(x) for x in sys.argv[2:]]:
        print(name, 'temporal', b, '%.2f' % run2(t, b), flush=True)
