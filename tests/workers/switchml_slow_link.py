"""One rank streaming through an external switch on a slow link, as hot/cold's slab does: a few
windows at a time after a tensor of a few packets. Reports the packets it sent and resent over the
timed tensors (commlib.testing.report); tests/test_netns.py checks that no timer fired spuriously."""
import numpy as np

import commlib
from commlib.testing import report

commlib.init(policy="*=switchml")
small, large = np.ones(300, np.float32), np.ones(4 * 128 * 256, np.float32)   # 4 windows of 128 packets
for step in range(2):   # the timer's first measure of the path (before it: a 5 ms floor)
    commlib.allreduce(large, name=f"warm.{step}", op=commlib.Sum, algorithm="switchml")
before = commlib.backend_stats()["switchml"]
for step in range(8):
    commlib.allreduce(small, name=f"small.{step}", op=commlib.Sum, algorithm="switchml")
    out = commlib.allreduce(large, name=f"large.{step}", op=commlib.Sum, algorithm="switchml")
    assert np.all(out == commlib.size()), "switchml's sum differs"
after, rank = commlib.backend_stats()["switchml"], commlib.rank()
commlib.shutdown()
report(rank=rank, **{k: after[k] - before[k] for k in ("sent", "resends", "received")})
