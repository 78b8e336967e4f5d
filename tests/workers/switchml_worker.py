"""One rank of a job through commlib.init() with algorithm='switchml': closed-form sums.

Rank r contributes (r + 1) * x, so the sum is n(n+1)/2 * x: exact for int32, within the
quantization bound for float32. argv[1]: 'embedded' (no switch configured: rank 0 runs one on
loopback) or 'external' (COMMLIB_SWITCH_ADDR points at a commlib-switch the test started)."""
import socket
import sys

import numpy as np
import torch

import commlib

mode = sys.argv[1]
commlib.init(policy="*=switchml")
r, n = commlib.rank(), commlib.size()
at_init = commlib.backend_stats()["switchml"]   # init started the switch (embedded) and registered the job
assert at_init["job"] is not None and at_init["embedded"] == (mode == "embedded" and r == 0), at_init
total = n * (n + 1) // 2
for length in (0, 1, 7, 300, 70001):
    xi = (r + 1) * np.arange(length, dtype=np.int32)
    got = commlib.allreduce(xi, name=f"i{length}", op=commlib.Sum, algorithm="switchml")
    assert got.dtype == np.int32 and np.array_equal(got, total * np.arange(length, dtype=np.int32)), got[:10]
    xf = (r + 1) * np.linspace(-1, 1, length, dtype=np.float32)
    got = commlib.allreduce(xf, name=f"f{length}", op=commlib.Sum, algorithm="switchml")
    exact = sum(((k + 1) * np.linspace(-1, 1, length, dtype=np.float32)).astype(np.float64) for k in range(n))
    # |x| <= n per block, so e <= ceil(log2(n)) + 1: error <= n^2 2^(e-1) / (2^31 - 1) + rounding
    bound = n * n * 2.0 ** (np.ceil(np.log2(n)) + 1) / (2 ** 31 - 1) + np.abs(exact) * 2.0 ** -24
    assert got.dtype == np.float32 and np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact))
t = torch.full((3, 4), float(r + 1))
out = commlib.allreduce(t, name="torch.avg")              # Average, through the policy: switchml
assert isinstance(out, torch.Tensor) and torch.allclose(out, torch.full((3, 4), total / n), atol=1e-5)
# float16 is summed as float32 and rounded back: small integers stay exact
half = commlib.allreduce(np.full(300, r + 1, np.float16), name="half", op=commlib.Sum, algorithm="switchml")
assert half.dtype == np.float16 and np.all(half == total), half[:5]
# n * 40000 overflows float16 (max 65504), the average does not: the sum stays float32 until averaged
big = commlib.allreduce(np.full(10, 40000, np.float16), name="half.avg", algorithm="switchml")
assert big.dtype == np.float16 and np.all(big == 40000), big
t = torch.full((5,), 0.5 * (r + 1), dtype=torch.float16)
out = commlib.allreduce(t, name="torch.half", op=commlib.Sum, algorithm="switchml")
assert out.dtype == torch.float16 and torch.equal(out, torch.full((5,), 0.5 * total, dtype=torch.float16)), out
stats = commlib.backend_stats()["switchml"]
assert stats["received"] > 0 and stats["embedded"] == (mode == "embedded" and r == 0), stats
used = {rec["algorithm"] for rec in commlib.records().values()}
assert used == {"switchml"}, used
host, port = stats["switch"].rsplit(":", 1)
socket.create_connection((host, int(port)), timeout=5).close()   # its control port answers while it runs
commlib.shutdown()
if stats["embedded"]:   # shutdown stopped the embedded switch
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        raise SystemExit(f"the embedded switch at {stats['switch']} still answers after shutdown")
    except ConnectionRefusedError:
        pass
print("OK", r, stats["switch"], stats["sent"], flush=True)
