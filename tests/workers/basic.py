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
# differentiable, as Horovod's: y = mean_j (j+1) x_j; backward averages the ranks' upstream (r+1)
x = torch.ones(3, requires_grad=True)
y = commlib.allreduce(x * (r + 1), name="differentiable")
(y * (r + 1)).sum().backward()
# min, max, product (commlib's and Horovod's op constants): the ring does them, whatever the policy says
ops = {op: commlib.allreduce(np.full(4, r + 1, np.float32), name=f"op.{op}", op=op, policy="*=switchml").tolist()
       for op in (commlib.Min, commlib.Max, commlib.Product)}
ops["horovod max"] = commlib.allreduce(np.full(2, r + 1, np.int32), name="op.hvd", op=4).tolist()   # hvd.Max
# op=Average on integers: the sum times 1/size, truncated toward zero (Horovod's ScaleBuffer)
ops["int average"] = commlib.allreduce(np.array([r + 1, -(r + 1), r], np.int32), name="int.average").tolist()
ops["torch int average"] = commlib.allreduce(torch.tensor([r + 1, -(r + 1), r], dtype=torch.int64),
                                             name="int.torch").tolist()
records = commlib.records()
commlib.shutdown()
report(rank=r, size=n,
       sums={length: {"dtype": str(s.dtype), "shape": list(s.shape), "values": s[:8].tolist(), "sum": float(s.sum())}
             for length, s in sums.items()},
       torch={"type": type(out).__name__, "shape": list(out.shape), "values": sorted(set(out.reshape(-1).tolist()))},
       small=small, grad=x.grad.tolist(), ops=ops,
       op_records={k: [v["algorithm"], v["note"]] for k, v in records.items() if k.startswith("op.")}, records=len(records), fused=max(v["fused_with"] for v in records.values()))
