import sys, numpy as np
from pathlib import Path
from collections import Counter
ROOT = Path(__file__).resolve().parents[3]  # the repository
TRACES = ROOT.parent / 'shared' / 'data' / 'route-traces'
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(Path(__file__).resolve().parent))
from server.bench.replay import load_trace
def load(name):
    t = load_trace(TRACES / f'{name}.route.csv')
    L,E = t.n_layer, t.n_expert
    dec = [r for r in t.routes if r.decode]; T=len(dec)//L
    pr = [r for r in t.routes if not r.decode]
    npt = max(Counter(r.layer for r in pr).values())
    A = np.zeros((npt+T,L,E),bool); cnt=[0]*L
    for r in pr: A[cnt[r.layer], r.layer, list(r.experts)] = True; cnt[r.layer]+=1
    for i,r in enumerate(dec): A[npt+i//L, r.layer, list(r.experts)] = True
    return A, npt
