"""OmniReduce through commlib.init() across real processes.

sums <mode>: block-sparse float32/int32 tensors at densities 0..1 (independent and overlapping
             placement), an nn.Embedding(sparse=True) gradient; every rank compares with the dense
             sum (it can rebuild every rank's input from the seeds) and reports what differed.
path <mode>: blocks sized by the path (omnireduce_block_size=0): an int32 sum and the block size agreed.
dead <mode>: rank 1 dies (os._exit) while a large tensor is on the wire; the others report the
             error they raised and how long it took (a clear CommError naming rank 1 is expected).
Reports go through commlib.testing.report; tests/test_omnireduce_multiprocess.py checks them.
"""
import os
import sys
import threading
import time

import numpy as np
import torch

import commlib
from commlib.testing import report

mode, agg_mode = sys.argv[1], sys.argv[2]
TIMEOUT = 4.0 if mode == "dead" else 30.0
commlib.init(policy="*=omnireduce", timeout_s=TIMEOUT, omnireduce_mode=agg_mode,
             omnireduce_block_size=0 if mode == "path" else 64, fusion_threshold=0)
r, n = commlib.rank(), commlib.size()


def sparse(rank, size, density, placement, dtype, seed):
    nb = -(-size // 64)
    k = 0 if density == 0 else max(1, round(density * nb))
    blocks = np.random.default_rng(seed if placement == "overlap" else seed * 100 + rank).choice(nb, k, replace=False)
    x = np.zeros(nb * 64, dtype=dtype)
    x.reshape(nb, 64)[blocks] = (rank + 1) * np.arange(64, dtype=dtype)[None, :] + 1
    return x[:size]


if mode == "sums":
    wrong = []
    for i, (density, placement, dtype) in enumerate(
            [(d, p, t) for d in (0.0, 0.01, 0.1, 0.5, 1.0) for p in ("independent", "overlap")
             for t in (np.float32, np.int32)]):
        size = 64 * 300 + 17
        x = sparse(r, size, density, placement, dtype, i)
        out = commlib.allreduce(x, name=f"t{i}", op=commlib.Sum)
        expected = sum(sparse(q, size, density, placement, dtype, i) for q in range(n))
        if not (out.dtype == dtype and np.array_equal(out, expected)):
            wrong.append(f"t{i}: density {density} {placement} {np.dtype(dtype).name}: got {out.dtype}, "
                         f"{int((out != expected).sum())} elements differ")
    emb = torch.nn.Embedding(5000, 32, sparse=True)
    torch.manual_seed(r)
    emb(torch.randint(0, 5000, (50,))).sum().backward()
    grad = emb.weight.grad
    out = commlib.allreduce(grad, name="embedding.grad", op=commlib.Sum)
    grads = [None] * n
    for q in range(n):
        torch.manual_seed(q)
        grads[q] = torch.randint(0, 5000, (50,))
    expected = torch.zeros(5000, 32)
    for ids in grads:
        expected.index_add_(0, ids, torch.ones(len(ids), 32))
    embedding_error = float(((out.to_dense() if out.is_sparse else out) - expected).abs().max())
    st = commlib.backend_stats()["omnireduce"]
    commlib.shutdown()
    report(rank=r, wrong=wrong, embedding_error=embedding_error, bytes_sent=st["bytes_sent"],
           authenticated=st["authenticated"],
           densities={name: round(v["density"], 4) for name, v in st["tensors"].items()})
elif mode == "path":   # blocks sized by the path: int32, not a multiple of the block
    x = np.arange(10_007, dtype=np.int32) * (r + 1)
    out = commlib.allreduce(x, name="path", op=commlib.Sum)
    st = commlib.backend_stats()["omnireduce"]
    commlib.shutdown()
    report(rank=r, exact=bool(np.array_equal(out, np.arange(10_007, dtype=np.int32) * (n * (n + 1) // 2))),
           block_size=st["block_size"], authenticated=st["authenticated"])
elif mode == "dead":
    commlib.allreduce(np.ones(1000, np.float32), name="warmup", op=commlib.Sum)
    big = np.ones(8 << 20, dtype=np.float32)            # 32 MiB, dense: on the wire for a while
    if r == 1:
        threading.Timer(0.3, lambda: os._exit(3)).start()
    start = time.monotonic()
    try:
        commlib.allreduce(big, name="big", op=commlib.Sum)
        commlib.allreduce(big, name="big2", op=commlib.Sum)
        error, message = None, ""
    except commlib.CommError as exc:
        error, message = type(exc).__name__, str(exc)
    report(rank=r, error=error, message=message, elapsed_s=round(time.monotonic() - start, 2), timeout_s=TIMEOUT)
    os._exit(0)     # skip interpreter teardown of a process group whose peer is gone
