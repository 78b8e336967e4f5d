"""Autotune on a running job: ranks reduce small tensors for a few seconds (AUTOTUNE_TEST_S, default
6) while rank 0's tuner changes the fusion threshold, the cycle time and the knobs of the algorithms
the policy sends them to (COMMLIB_AUTOTUNE_SAMPLE_S short); every result must stay exact (switchml:
within its quantization bound, far below what a packet in the wrong slot would do). Each rank reports
the number of wrong results and the bucket sizes it saw."""
import os
import time

import numpy as np

import commlib
from commlib.testing import report

commlib.init()
rank, size = commlib.rank(), commlib.size()
tensors = [np.full(1 << (8 + i % 8), rank + 1, np.float32) for i in range(40)]   # 1 KiB to 128 KiB
expected = size * (size + 1) / 2
wrong, fused = 0, set()
deadline = time.monotonic() + float(os.environ.get("AUTOTUNE_TEST_S", "6"))
steps = 0
while steps < 20 or commlib.allreduce(np.array([time.monotonic() < deadline], np.int32), name="go", op=commlib.Min)[0]:
    handles = [commlib.allreduce_async(t, name=f"t{i}", op=commlib.Sum) for i, t in enumerate(tensors)]
    wrong += sum(int(np.any(np.abs(commlib.synchronize(h) - expected) > 1e-6 * expected)) for h in handles)
    fused.add(commlib.records()["t0"]["fused_with"])
    steps += 1
report(rank=rank, wrong=wrong, steps=steps, fused=sorted(fused))
commlib.shutdown()
