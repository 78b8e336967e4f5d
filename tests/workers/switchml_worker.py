"""One rank of a job through commlib.init() with algorithm='switchml': closed-form sums.

Rank r contributes (r + 1) * x, so the sum is n(n+1)/2 * x: exact for int32, within the
quantization bound for float32. argv[1]: 'embedded' (no switch configured: rank 0 runs one on
loopback) or 'external' (COMMLIB_SWITCH_ADDR points at a commlib-switch the test started).
Reports what it saw (commlib.testing.report); tests/test_switchml_multiprocess.py checks it."""
import socket
import sys

import numpy as np
import torch

import commlib
from commlib.testing import report

mode = sys.argv[1]
commlib.init(policy="*=switchml")
r, n = commlib.rank(), commlib.size()
at_init = commlib.backend_stats()["switchml"]   # init started the switch (embedded) and registered the job
total = n * (n + 1) // 2
sums = {}   # length -> int32 max |error|, float32 worst error as a fraction of its bound, dtypes
for length in (0, 1, 7, 300, 70001):
    xi = (r + 1) * np.arange(length, dtype=np.int32)
    got_i = commlib.allreduce(xi, name=f"i{length}", op=commlib.Sum, algorithm="switchml")
    xf = (r + 1) * np.linspace(-1, 1, length, dtype=np.float32)
    got_f = commlib.allreduce(xf, name=f"f{length}", op=commlib.Sum, algorithm="switchml")
    exact = sum(((k + 1) * np.linspace(-1, 1, length, dtype=np.float32)).astype(np.float64) for k in range(n))
    # |x| <= n per block, so e <= ceil(log2(n)) + 1: error <= n^2 2^(e-1) / (2^31 - 1) + rounding
    bound = n * n * 2.0 ** (np.ceil(np.log2(n)) + 1) / (2 ** 31 - 1) + np.abs(exact) * 2.0 ** -24
    sums[length] = {"dtypes": [str(got_i.dtype), str(got_f.dtype)],
                    "int_error": int(np.abs(got_i.astype(np.int64) - total * np.arange(length)).max(initial=0)),
                    "float_error_over_bound": float((np.abs(got_f - exact) / bound).max(initial=0))}
t = torch.full((3, 4), float(r + 1))
avg = commlib.allreduce(t, name="torch.avg")              # Average, through the policy: switchml
# float16 is summed as float32 and rounded back: small integers stay exact
half = commlib.allreduce(np.full(300, r + 1, np.float16), name="half", op=commlib.Sum, algorithm="switchml")
# n * 40000 overflows float16 (max 65504), the average does not: the sum stays float32 until averaged
big = commlib.allreduce(np.full(10, 40000, np.float16), name="half.avg", algorithm="switchml")
t = torch.full((5,), 0.5 * (r + 1), dtype=torch.float16)
torch_half = commlib.allreduce(t, name="torch.half", op=commlib.Sum, algorithm="switchml")
stats = commlib.backend_stats()["switchml"]
used = sorted({rec["algorithm"] for rec in commlib.records().values()})
host, port = stats["switch"].split(",")[0].rsplit(":", 1)   # the first switch (COMMLIB_SWITCH_ADDR may name several)
socket.create_connection((host, int(port)), timeout=5).close()   # its control port answers while it runs
commlib.shutdown()
try:   # shutdown stopped the embedded switch
    socket.create_connection((host, int(port)), timeout=2).close()
    answers_after = True
except ConnectionRefusedError:
    answers_after = False
report(rank=r, size=n, mode=mode, job_at_init=at_init["job"] is not None, embedded=[at_init["embedded"], stats["embedded"]],
       sums=sums, avg={"type": type(avg).__name__, "values": sorted(set(avg.reshape(-1).tolist()))},
       half={"dtype": str(half.dtype), "values": sorted(set(half.tolist()))},
       half_avg={"dtype": str(big.dtype), "values": sorted(set(big.tolist()))},
       torch_half={"dtype": str(torch_half.dtype), "values": sorted(set(torch_half.tolist()))},
       received=stats["received"], authenticated=stats["authenticated"], algorithms=used, switch=stats["switch"], answers_after_shutdown=answers_after,
       packet_elems=stats["packet_elems"], streams=stats["streams"])
