"""Closed-form fixture: rank r contributes (r + 1) * arange(n); the sum is size*(size+1)/2 * arange(n).
Reports what it got; tests/test_core_multiprocess.py and test_horovod.py check it field by field."""
import numpy as np
import torch

import commlib
from commlib.testing import report

commlib.init(policy="*=ring")
r, n = commlib.rank(), commlib.size()
sums = {length: commlib.allreduce((r + 1) * np.arange(length, dtype=np.float32), name=f"np{length}", op=commlib.Sum)
        for length in (0, 1, 7, 1000)}
out = commlib.allreduce(torch.full((3, 4), float(r + 1)), name="torch")
handles = [commlib.allreduce_async(np.full(5, r, dtype=np.int32), name=f"small{i}", op=commlib.Sum) for i in range(20)]
small = [commlib.synchronize(h).tolist() for h in handles]
records = commlib.records()
commlib.shutdown()
report(rank=r, size=n,
       sums={length: {"dtype": str(s.dtype), "shape": list(s.shape), "values": s[:8].tolist(), "sum": float(s.sum())}
             for length, s in sums.items()},
       torch={"type": type(out).__name__, "shape": list(out.shape), "values": sorted(set(out.reshape(-1).tolist()))},
       small=small, records=len(records), fused=max(v["fused_with"] for v in records.values()))
