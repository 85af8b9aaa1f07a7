import sys, numpy as np
from pathlib import Path
from collections import Counter
ROOT = Path(__file__).resolve().parents[3]  # the repository
TRACES = ROOT.parent / 'shared' / 'data' / 'route-traces'
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokens import load
for name in ['qwen','gemma']:
    A, npt = load(name); NT,L,E = A.shape; k=A[0,0].sum(); base=k/E
    for dist in [1,4,16]:
        C = np.zeros((L,E,E)); N = np.zeros((L,E)); M=np.zeros((L,E)); ntok=np.zeros(L)
        last = np.full((L,E), -1); uses=np.zeros((L,E))
        rows=[]
        for ti in range(NT):
            for j in range(L):
                dst=A[ti,j]
                if j>=dist:
                    src=A[ti,j-dist]
                    if ti>=npt:
                        pc = ((C[j][src] + 2*base) / (N[j][src][:,None] + 2)).mean(0)
                        pm = (M[j]+2*base)/(ntok[j]+2)
                        lift = pc/pm
                        age = np.where(last[j]<0, 99, ti-last[j]); age=np.minimum(age,99)
                        fc = np.floor(np.log2(1+uses[j])).astype(int)
                        rows.append(np.stack([dst, lift, age, fc, pm],1))
                    C[j][np.ix_(src,dst)] += 1; N[j][src] += 1
                M[j]+=dst; ntok[j]+=1; last[j][dst]=ti; uses[j][dst]+=1
        X=np.concatenate(rows); y=X[:,0]; lift=X[:,1]; age=X[:,2]; fc=X[:,3]
        lb = np.digitize(lift,[0.5,1,2,4])
        print(name,'dist',dist)
        for agesel,desc in [(age==1,'age1'),((age>=2)&(age<=4),'age2-4'),((age>4)&(age<99),'age>4'),(age==99,'never')]:
            for fsel in [fc<=1, (fc>=2)&(fc<=3), fc>=4]:
                m=agesel&fsel
                if m.sum()<500: continue
                print('  %-7s fc %d-%d n=%6d P=%.3f | by lift <.5,.5-1,1-2,2-4,>4: %s' % (desc, fc[m].min(), fc[m].max(), m.sum(), y[m].mean(),
                    ' '.join('%.3f(%d)'%(y[m&(lb==b)].mean() if (m&(lb==b)).sum() else -1,(m&(lb==b)).sum()) for b in range(5))))
