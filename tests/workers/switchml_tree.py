"""One rank of a switchml job through the switches the environment names (COMMLIB_SWITCH_ADDR, and
COMMLIB_SWITCH_SPINE for two levels): random tensors, seeded by rank, summed; reports each sum's
digest, its error over the quantization bound and what it saw (commlib.testing.report), so
tests/test_netns.py compares a two-level job with one switch bit for bit.

argv[1] 'sums', or 'kill PID': after a first allreduce rank 0 kills PID (the spine) and every rank
reports the error of its next allreduces and how long it took to fail."""
import hashlib
import os
import signal
import sys
import time

import numpy as np

import commlib
from commlib.errors import CommError
from commlib.testing import report

commlib.init(policy="*=switchml")
r, n = commlib.rank(), commlib.size()


def tensor(length, seed, rank):
    """Values spanning a few binary orders of magnitude per block, so the blocks' exponents differ."""
    rng = np.random.default_rng([seed, rank])
    return (rng.standard_normal(length) * 2.0 ** rng.integers(-6, 6, length)).astype(np.float32)


def allreduce(x, name):
    return commlib.allreduce(x, name=name, op=commlib.Sum, algorithm="switchml")


if sys.argv[1] == "sums":
    sums = {}
    for seed, length in enumerate((1, 300, 5000, 70001)):
        got = allreduce(tensor(length, seed, r), f"f{length}")
        xs = [tensor(length, seed, k).astype(np.float64) for k in range(n)]
        exact = sum(xs)
        # n roundings of 1 / (2 f) each, f = (2^31 - 1) / (n 2^e), e at most the largest value's exponent;
        # then float32's rounding of the sum
        e = np.frexp(max(np.abs(x).max() for x in xs))[1]
        bound = n * n * 2.0 ** e / (2 ** 31 - 1) + np.abs(exact) * 2.0 ** -23
        sums[f"f{length}"] = {"sha256": hashlib.sha256(got.tobytes()).hexdigest(), "head": got[:3].tolist(),
                              "error_over_bound": float((np.abs(got - exact) / bound).max())}
        xi = np.random.default_rng([seed, r, 1]).integers(-2 ** 20, 2 ** 20, length, dtype=np.int32)
        got_i = allreduce(xi, f"i{length}")
        exact_i = sum(np.random.default_rng([seed, k, 1]).integers(-2 ** 20, 2 ** 20, length, dtype=np.int32)
                      for k in range(n))
        sums[f"i{length}"] = {"sha256": hashlib.sha256(got_i.tobytes()).hexdigest(),
                              "exact": bool(np.array_equal(got_i, exact_i))}
    stats = commlib.backend_stats()["switchml"]
    commlib.shutdown()
    report(rank=r, sums=sums, switch=stats["switch"], received=stats["received"],
           authenticated=stats["authenticated"], packet_elems=stats["packet_elems"])
else:
    allreduce(tensor(1000, 7, r), "before")   # every rank has its first sum: none is past the next one
    if r == 0:
        os.kill(int(sys.argv[2]), signal.SIGKILL)
    started, error = time.monotonic(), None
    try:
        for step in range(50):
            allreduce(tensor(1000, 8, r), f"after{step}")
    except CommError as exc:
        error = f"{type(exc).__name__}: {exc}"
    report(rank=r, error=error, seconds=time.monotonic() - started)
    sys.stdout.flush()
    os._exit(0)   # the job failed: shutdown would wait on the dead switch's job to unregister
