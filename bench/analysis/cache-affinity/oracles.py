import sys, numpy as np
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]  # the repository
TRACES = ROOT.parent / 'shared' / 'data' / 'route-traces'
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim import *

class Oracle:
    def __init__(s, t):
        L = t.n_layer; s.fut = {}
        s.n = -1
        # map route index -> (token start index) for decode routes
        s.tok = {}
        idxs = [i for i, r in enumerate(t.routes) if r.decode]
        for q, i in enumerate(idxs):
            s.tok[i] = idxs[q - q % L]
        s.routes = t.routes
    def observe(s, sim, l, want): s.n += 1
    def first_visit(s, sim, res, j, cur, h0):
        if s.n not in s.tok: return h0
        start = s.tok[s.n]; L = sim.L; p = h0.copy()
        later = j > cur
        for q in np.nonzero(later)[0]:
            jj = j[q]; r = s.routes[start + jj]
            p[q] = 1.0 if (res[q] % sim.E) in r.experts else 0.0
        return p

class Online:
    """all-pairs co-occurrence within a token; source = the current layer; p1 = calibrated."""
    def __init__(s, t, mode='lift', maxd=None):
        L, E = t.n_layer, t.n_expert; s.L, s.E = L, E
        s.C = np.zeros((L, L, E, E), np.float32); s.N = np.zeros((L, L, E), np.float32)
        s.M = np.zeros((L, E)); s.T = np.zeros(L)
        s.prev = -1; s.tok = {}  # layer -> routed bool array in current token
        s.mode = mode; s.maxd = maxd
        s.cobs = {}  # calibration
    def lift(s, i, src, j):
        # mean over e in src of P(f at j | e at i) / P(f at j)
        base = 6 / s.E
        pc = ((s.C[i, j][src] + 2 * base) / (s.N[i, j][src][:, None] + 2)).mean(0)
        pm = (s.M[j] + 2 * base) / (s.T[j] + 2)
        return pc / pm
    def observe(s, sim, l, want):
        if l <= s.prev: s.tok = {}
        for i, src in s.tok.items():
            s.C[i, l][np.ix_(src, want)] += 1; s.N[i, l][src] += 1
        s.tok[l] = want.copy(); s.prev = l
        s.M[l] += want; s.T[l] += 1
    def first_visit(s, sim, res, j, cur, h0):
        p = h0.copy()
        if cur not in s.tok: return p
        src = s.tok[cur]
        later = j > cur
        if s.maxd: later &= (j - cur) <= s.maxd
        for jj in np.unique(j[later]):
            m = later & (j == jj)
            lf = s.lift(cur, src, jj)[res[m] % s.E]
            p[m] = np.clip(h0[m] * lf, 0, 0.999)
        return p

class OracleVar(Oracle):
    def __init__(s, t, mode): super().__init__(t); s.mode = mode
    def first_visit(s, sim, res, j, cur, h0):
        p = super().first_visit(sim, res, j, cur, h0)
        if s.mode == 'raise': return np.maximum(p, h0)
        if s.mode == 'lower': return np.minimum(p, h0)
        return p


class OracleNext(Oracle):
    """exact first visit for entries whose next visit is in the NEXT token (layers <= cur)."""
    def first_visit(s, sim, res, j, cur, h0):
        if s.n not in s.tok: return h0
        start = s.tok[s.n] + sim.L; p = h0.copy()
        if start + sim.L > len(s.routes): return p
        for q in np.nonzero(j <= cur)[0]:
            p[q] = 1.0 if (res[q] % sim.E) in s.routes[start + j[q]].experts else 0.0
        return p


class OracleBoth(OracleNext):
    def first_visit(s, sim, res, j, cur, h0):
        p = OracleNext.first_visit(s, sim, res, j, cur, h0)
        q = Oracle.first_visit(s, sim, res, j, cur, h0)
        later = j > cur
        p[later] = q[later]
        return p

if __name__ == '__main__':
    name = sys.argv[1]; what = sys.argv[2]; budgets = [int(b) for b in sys.argv[3:]] or [2000]
    t = load(name)
    for b in budgets:
        if what == 'oracle': aff = Oracle(t)
        elif what == 'online': aff = Online(t)
        elif what.startswith('online-d'): aff = Online(t, maxd=int(what[8:]))
        elif what in ('raise', 'lower'): aff = OracleVar(t, what)
        elif what == 'next': aff = OracleNext(t)
        elif what == 'both': aff = OracleBoth(t)
        else: aff = None
        print(name, what, b, '%.2f' % run(t, b, aff), 'belady %.2f' % replay_belady(t, b).hit_pct_decode, flush=True)
