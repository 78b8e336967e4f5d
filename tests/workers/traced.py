"""A short job with the timeline on: dense tensors through ring, switchml and omnireduce, a fused
bucket and a compressed one (PowerSGD), a few steps each; then a window of steps traced by
start_timeline/stop_timeline. argv: the trace path ('{rank}' in it), the window's trace path."""
import sys
import time

import numpy as np

import commlib
from commlib.api import runtime
from commlib.testing import report

trace, window = sys.argv[1], sys.argv[2]
commlib.init(policy="dense.ring=ring; dense.switchml=switchml; sparse=omnireduce; low.rank=powersgd(rank=2); *=ring",
             timeline=trace)
r = commlib.rank()
rng = np.random.default_rng(r)
waited = {}   # per name, the seconds the caller waited for its last call, on its own clock


def allreduce(tensor, name):
    start = time.monotonic()
    commlib.allreduce(tensor, name=name)
    waited[name] = time.monotonic() - start


for step in range(3):
    allreduce(np.full(1 << 16, r + 1.0, np.float32), "dense.ring")
    allreduce(np.full(1 << 16, r + 1.0, np.float32), "dense.switchml")
    sparse = np.zeros(1 << 16, np.float32)
    sparse[rng.integers(0, sparse.size, 100)] = 1.0
    allreduce(sparse, "sparse")
    allreduce(rng.standard_normal((64, 32)).astype(np.float32), "low.rank")
    start = time.monotonic()
    handles = [commlib.allreduce_async(np.full(100, float(i), np.float32), name=f"small.{i}") for i in range(8)]
    [commlib.synchronize(h) for h in handles]
    waited.update({f"small.{i}": time.monotonic() - start for i in range(8)})
records = {name: {k: v for k, v in rec.items() if k.endswith("_s")} | {"algorithm": rec["algorithm"]}
           for name, rec in commlib.records().items()}
# the server's share this worker summed from the results' stamps, and (rank 0) the daemons' own counters
stats = commlib.backend_stats()
stamped = {algorithm: {k: stats[algorithm][k] for k in ("server_queue_ns", "server_proc_ns", "server_packets")}
           for algorithm in ("switchml", "omnireduce")}
daemons = None
if r == 0:
    backends = runtime().backends
    daemons = {"switch": backends["switchml"].switch_counters()["counters"],
               "aggregators": [ask() for ask in backends["omnireduce"].daemon_counters().values()]}
commlib.stop_timeline()
commlib.allreduce(np.ones(10, np.float32), name="untraced")
commlib.start_timeline(window)
commlib.allreduce(np.ones(10, np.float32), name="windowed")
commlib.shutdown()
report(rank=r, records=records, waited=waited, stamped=stamped, daemons=daemons)
