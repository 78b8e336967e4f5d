"""Autotune on a running job: ranks reduce small tensors for a few seconds while rank 0's tuner
changes the fusion threshold and cycle time (COMMLIB_AUTOTUNE_SAMPLE_S short); every result must stay
exact. Each rank reports the number of wrong results and the bucket sizes it saw."""
import time

import numpy as np

import commlib
from commlib.testing import report

commlib.init()
rank, size = commlib.rank(), commlib.size()
tensors = [np.full(1 << (8 + i % 8), rank + 1, np.float32) for i in range(40)]   # 1 KiB to 128 KiB
expected = size * (size + 1) / 2
wrong, fused = 0, set()
deadline = time.monotonic() + 6.0
steps = 0
while steps < 20 or commlib.allreduce(np.array([time.monotonic() < deadline], np.int32), name="go", op=commlib.Min)[0]:
    handles = [commlib.allreduce_async(t, name=f"t{i}", op=commlib.Sum) for i, t in enumerate(tensors)]
    wrong += sum(int(np.any(commlib.synchronize(h) != expected)) for h in handles)
    fused.add(commlib.records()["t0"]["fused_with"])
    steps += 1
report(rank=rank, wrong=wrong, steps=steps, fused=sorted(fused))
commlib.shutdown()
