"""commlib.join (Horovod's hvd.join) with uneven data: rank r runs r + 1 steps, then joins; every
rank reports what each of its steps reduced, what join returned, and a reduction after it.

Argument: the policy text ("default" for commlib's own). Mode "timeout" instead: rank 1 neither
reduces nor joins, and rank 0's join must fail with a CommTimeout (COMMLIB_NEGOTIATION_TIMEOUT_S).
Mode "sparse": rank 0 joins while rank 1 reduces a row-sparse tensor: a clear error on rank 1.
Mode "bf16": rank 0 joins while rank 1 reduces two bfloat16 tensors that fill a fusion bucket
(COMMLIB_FUSION_THRESHOLD): the joined rank's stand-ins must fuse as rank 1's tensors do.
Mode "compressed": PowerSGD with start_iter=2, rank 0 runs 3 steps and rank 1 5: the joined rank's
stand-ins go through its own compressor, which has passed start_iter as rank 1's has.
Mode "late": rank 0 reduces once, waits past the negotiation timeout, then joins while rank 1 is
still reducing: the wait counts from the join, not from the last tensor.
"""
import sys
import time

import numpy as np
import torch

import commlib
from commlib.sparse import RowSparse
from commlib.testing import report

mode = sys.argv[1]
MODES = ("default", "timeout", "sparse", "bf16", "compressed", "late")
commlib.init(policy=None if mode in MODES else mode)
rank, size = commlib.rank(), commlib.size()

if mode in ("bf16", "compressed", "late"):
    got = []
    if mode == "bf16":
        if rank == 1:
            time.sleep(1.0)   # rank 0 has joined
            handles = [commlib.allreduce_async(torch.full((1000,), 1.0, dtype=torch.bfloat16), name=n, op=commlib.Sum)
                       for n in "ab"]
            got = [commlib.synchronize(h)[0].item() for h in handles]
    elif mode == "compressed":
        for step in range(3 if rank == 0 else 5):
            matrix = torch.full((64, 32), float(rank + 1))
            got.append(commlib.allreduce(matrix, name="w", op=commlib.Sum, compression="powersgd(rank=1, start_iter=2)")
                       [0, 0].item())
    else:
        commlib.allreduce(np.ones(4, np.float32), name="first", op=commlib.Sum)
        time.sleep(4.0 if rank == 0 else 5.0)   # COMMLIB_NEGOTIATION_TIMEOUT_S=3
        if rank == 1:
            got = commlib.allreduce(np.ones(4, np.float32), name="second", op=commlib.Sum).tolist()
    report(rank=rank, got=got, last=commlib.join())
    commlib.shutdown()
    sys.exit(0)

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
