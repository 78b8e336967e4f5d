"""One rank streaming through an external switch on a slow link, as hot/cold's slab does: a few
windows at a time after a tensor of a few packets. Reports the packets it sent and resent over the
timed tensors, and the partial sums the job's leaf switches sent up to a spine and resent (two
levels; keyless switches, asked by rank 0) (commlib.testing.report); tests/test_netns.py checks that
no timer fired spuriously."""
import numpy as np

import commlib
from commlib.switch import switchml as sw
from commlib.testing import report


def up_counters():
    """Rank 0: the up_sent and up_resends of every job on every switch of this job, summed."""
    if commlib.rank() != 0:
        return {}
    jobs = [c for address in commlib.backend_stats()["switchml"]["switch"].split(",")
            for c in sw.SwitchClient(address).counters()["jobs"].values()]
    return {name: sum(c[name] for c in jobs) for name in ("up_sent", "up_resends")}


commlib.init(policy="*=switchml")
small, large = np.ones(300, np.float32), np.ones(4 * 128 * 256, np.float32)   # 4 windows of 128 packets
for step in range(2):   # the timer's first measure of the path (before it: a 5 ms floor)
    commlib.allreduce(large, name=f"warm.{step}", op=commlib.Sum, algorithm="switchml")
before, up_before = commlib.backend_stats()["switchml"], up_counters()
for step in range(8):
    commlib.allreduce(small, name=f"small.{step}", op=commlib.Sum, algorithm="switchml")
    out = commlib.allreduce(large, name=f"large.{step}", op=commlib.Sum, algorithm="switchml")
    assert np.all(out == commlib.size()), "switchml's sum differs"
after, up_after, rank = commlib.backend_stats()["switchml"], up_counters(), commlib.rank()
commlib.shutdown()
report(rank=rank, **{k: after[k] - before[k] for k in ("sent", "resends", "received")},
       **{k: up_after[k] - up_before[k] for k in up_after})
