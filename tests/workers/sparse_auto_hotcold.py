"""`auto` weighing the hot/cold split: a skewed tensor (every rank touches the same 1000 hot rows and
50 scattered ones per step) and a uniform one (1000 scattered rows per rank per step), each reduced
STEPS times with the hot set agreed every COMMLIB_HOTCOLD_EVERY calls. Reports per step the
algorithm auto settled, its estimate, hotcold's record, and the difference from the dense sum."""
import numpy as np
import torch

import commlib
from commlib.testing import report

VOCAB, DIM, STEPS = 100_000, 32, 6
commlib.init(policy="*=auto")
rank, size = commlib.rank(), commlib.size()
hot = np.random.default_rng(99).choice(VOCAB, 1000, replace=False)


def tensor_for(case, step, r):
    g = np.random.default_rng(1000 * step + r)
    if case == "skewed":
        rows = np.concatenate([hot, g.choice(VOCAB, 50, replace=False)])
    else:
        rows = g.choice(VOCAB, 1000, replace=False)
    values = torch.from_numpy(g.standard_normal((rows.size, DIM)).astype(np.float32))
    return torch.sparse_coo_tensor(torch.from_numpy(rows.astype(np.int64)).view(1, -1), values, (VOCAB, DIM))


out = {}
for case in ("skewed", "uniform"):
    steps = []
    for step in range(STEPS):
        everyone = [tensor_for(case, step, r) for r in range(size)]
        got = commlib.allreduce(everyone[rank], name=case, op=commlib.Sum)
        reference = sum(t.to_dense() for t in everyone)
        union = torch.cat([t.coalesce().indices() for t in everyone], dim=1).unique(dim=1)
        record = commlib.records()[case]
        steps.append({"algorithm": record["algorithm"], "estimate": record["estimate"], "skew": record["skew"],
                      "max_diff": (got.to_dense() - reference).abs().max().item(),
                      "union": got.is_sparse and got.is_coalesced() and torch.equal(got.indices(), union)})
    out[case] = steps
report(rank=rank, size=size, cases=out)
commlib.shutdown()
