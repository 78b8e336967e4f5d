"""`auto` on row-sparse tensors: constructed cases where each algorithm moves the fewest bytes.
Reports, per case, the algorithm the controller settled and the traffic estimate commlib.records()
shows, and whether the result equals the dense sum."""
import numpy as np
import torch

import commlib
from commlib.testing import report

VOCAB, DIM = 100_000, 32
commlib.init(policy="*=auto")
rank, size = commlib.rank(), commlib.size()


def rows_for(case, r):
    g = np.random.default_rng(r)
    if case == "few_scattered":        # 0.2% of rows per rank, little overlap: the allgather
        return g.choice(VOCAB, 200, replace=False)
    if case == "shared_block_rows":    # every rank the same 7000 rows: omnireduce sums them once
        return np.arange(7000)
    if case == "most_rows":            # 90% of rows: the dense table through the switch
        return g.choice(VOCAB, 90_000, replace=False)
    raise ValueError(case)


def tensor_for(case, r):
    rows = torch.from_numpy(rows_for(case, r).astype(np.int64))
    values = torch.randn(len(rows), DIM, generator=torch.Generator().manual_seed(r))
    return torch.sparse_coo_tensor(rows.view(1, -1), values, (VOCAB, DIM))


out = {}
for case in ("few_scattered", "shared_block_rows", "most_rows"):
    got = commlib.allreduce(tensor_for(case, rank), name=case, op=commlib.Sum)
    reference = sum(tensor_for(case, r).to_dense() for r in range(size))
    record = commlib.records()[case]
    out[case] = {"algorithm": record["algorithm"], "estimate": record["estimate"],
                 "max_diff": (got.to_dense() - reference).abs().max().item()}
# a density rule compares the densest rank's row density (touched rows / rows)
rule = "few_scattered[density<0.01]=sparse_allgather;most_rows[density<0.01]=sparse_allgather;*=ring"
rules = {}
for case in ("few_scattered", "most_rows"):
    commlib.allreduce(tensor_for(case, rank), name=case, op=commlib.Sum, policy=rule)
    rules[case] = commlib.records()[case]["algorithm"]
report(rank=rank, size=size, cases=out, rules=rules)
commlib.shutdown()
