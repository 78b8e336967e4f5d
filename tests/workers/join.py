"""commlib.join (Horovod's hvd.join) with uneven data: rank r runs r + 1 steps, then joins; every
rank reports what each of its steps reduced, what join returned, and a reduction after it.

Argument: the policy text ("default" for commlib's own). Mode "timeout" instead: rank 1 neither
reduces nor joins, and rank 0's join must fail with a CommTimeout (COMMLIB_NEGOTIATION_TIMEOUT_S).
Mode "sparse": rank 0 joins while rank 1 reduces a row-sparse tensor: a clear error on rank 1.
"""
import sys
import time

import numpy as np
import torch

import commlib
from commlib.sparse import RowSparse
from commlib.testing import report

mode = sys.argv[1]
commlib.init(policy=None if mode in ("default", "timeout", "sparse") else mode)
rank, size = commlib.rank(), commlib.size()

if mode == "timeout":
    start = time.monotonic()
    try:
        if rank == 0:
            commlib.join()
        else:
            time.sleep(8)
        report(rank=rank, error=None)
    except commlib.CommError as exc:
        report(rank=rank, error=type(exc).__name__, message=str(exc), elapsed_s=time.monotonic() - start)
    sys.exit(0)

if mode == "sparse":
    error = None
    if rank == 0:
        commlib.join()
    else:
        time.sleep(1.0)   # rank 0 has joined
        try:
            commlib.allreduce(RowSparse(np.array([1, 3]), np.ones((2, 4), np.float32), (8, 4)), name="emb", op=commlib.Sum)
        except commlib.CommError as exc:
            error = f"{type(exc).__name__}: {exc}"
        commlib.join()
    report(rank=rank, error=error)
    commlib.shutdown()
    sys.exit(0)

steps = []
for step in range(rank + 1):
    value = (rank + 1) * (step + 1)
    tensors = [torch.full((16 << i,), float(value)) for i in range(4)]   # fused, cached after step 0
    handles = [commlib.allreduce_async(t, name=f"w{i}", op=commlib.Sum) for i, t in enumerate(tensors)]
    sums = [commlib.synchronize(h)[-1].item() for h in handles]
    steps.append({"sums": sums,
                  "min": commlib.allreduce(np.full(3, value, np.float32), name="min", op=commlib.Min)[0].item(),
                  "max": commlib.allreduce(np.full(3, -value, np.int32), name="max", op=commlib.Max)[0].item(),
                  "average": commlib.allreduce(np.full(5, value, np.float64), name="average")[0].item()})
last = commlib.join()
after = commlib.allreduce(np.ones(4, np.float32), name="after", op=commlib.Sum).tolist()
report(rank=rank, steps=steps, last=last, after=after)
commlib.shutdown()
