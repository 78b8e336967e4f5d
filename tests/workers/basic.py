"""Closed-form fixture: rank r contributes (r + 1) * arange(n); the sum is size*(size+1)/2 * arange(n)."""
import sys

import numpy as np
import torch

import commlib

commlib.init(policy="*=ring")
r, n = commlib.rank(), commlib.size()
total = n * (n + 1) // 2
for length in (0, 1, 7, 1000):
    x = (r + 1) * np.arange(length, dtype=np.float32)
    assert np.allclose(commlib.allreduce(x, name=f"np{length}", op=commlib.Sum), total * np.arange(length))
t = torch.full((3, 4), float(r + 1))
out = commlib.allreduce(t, name="torch")
assert isinstance(out, torch.Tensor) and out.shape == (3, 4) and torch.allclose(out, torch.full((3, 4), total / n))
handles = [commlib.allreduce_async(np.full(5, r, dtype=np.int32), name=f"small{i}", op=commlib.Sum) for i in range(20)]
for i, h in enumerate(handles):
    assert (commlib.synchronize(h) == n * (n - 1) // 2).all()
# one write per line: mpirun forwards the ranks' output in chunks, and print() writes its pieces apart
sys.stdout.write(f"records {len(commlib.records())} fused {max(v['fused_with'] for v in commlib.records().values())}\n")
commlib.shutdown()
sys.stdout.write(f"OK {r}\n")
