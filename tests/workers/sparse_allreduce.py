"""Row-sparse allreduce through every algorithm against the dense reference, on every rank.

Each rank builds its own torch sparse COO tensor per case from a seed, so every rank can also build
every other rank's and sum them densely: the reference. Reports, per case and algorithm, the
largest difference from the reference, whether the result is a coalesced sparse tensor holding
exactly the union of the rows the ranks sent, and the algorithm commlib.records() says ran.
argv: the algorithms to try (default: all of them, and auto)."""
import sys

import numpy as np
import torch

import commlib
from commlib.testing import report

VOCAB, DIM = 1000, 8
ALGORITHMS = sys.argv[1].split(",") if len(sys.argv) > 1 else [
    "sparse_allgather", "omnireduce", "ring", "switchml", "auto"]


def ids_for(case, rank, size):
    g = np.random.default_rng(1000 * rank + len(case))
    if case == "random":
        return g.integers(0, VOCAB, 60)
    if case == "zipf":
        return np.minimum(g.zipf(1.2, 300), VOCAB) - 1     # heavy repeats within a rank and across ranks
    if case == "repeated":
        return np.array([7, 7, 7, 7, 7, 3, 999, 3])
    if case == "some_empty":
        return np.array([], dtype=np.int64) if rank % 2 else g.integers(0, VOCAB, 40)
    if case == "all_empty":
        return np.array([], dtype=np.int64)
    if case == "one_rank_rows":                              # rows only this rank touches
        return rank * 100 + g.integers(0, 10, 12)
    raise ValueError(case)


def tensor_for(case, rank, size, shape=(VOCAB, DIM)):
    ids = torch.from_numpy(ids_for(case, rank, size).astype(np.int64))
    g = torch.Generator().manual_seed(7 + rank)
    values = torch.randn(len(ids), *shape[1:], generator=g)
    return torch.sparse_coo_tensor(ids.view(1, -1), values, shape)   # uncoalesced, as autograd makes them


def multi_dim_for(rank):
    """sparse_dim 2: a matrix made sparse element by element (rows are single elements)."""
    g = torch.Generator().manual_seed(50 + rank)
    dense = torch.randn(30, 20, generator=g) * (torch.rand(30, 20, generator=g) < 0.05)
    return dense.to_sparse()


commlib.init()
rank, size = commlib.rank(), commlib.size()
cases = {case: lambda r, case=case: tensor_for(case, r, size)
         for case in ("random", "zipf", "repeated", "some_empty", "all_empty", "one_rank_rows")}
cases["dense_dims"] = lambda r: tensor_for("random", r, size, shape=(VOCAB, 2, 3))
cases["sparse_dim_2"] = multi_dim_for
out = {}
for case, make in cases.items():
    everyone = [make(r) for r in range(size)]
    reference = sum(t.to_dense() for t in everyone)
    union = torch.cat([t.coalesce().indices() for t in everyone], dim=1).unique(dim=1)
    for algorithm in ALGORITHMS:
        name = f"{case}.{algorithm}"
        got = commlib.allreduce(everyone[rank], name=name, op=commlib.Sum, algorithm=algorithm)
        rec = commlib.records()[name]
        out[name] = {"sparse": got.is_sparse, "coalesced": got.is_sparse and got.is_coalesced(),
                     "union": got.is_sparse and torch.equal(got.indices(), union),
                     "max_diff": (got.to_dense() - reference).abs().max().item() if reference.numel() else 0.0,
                     "scale": reference.abs().max().item() if reference.numel() else 0.0,
                     "algorithm": rec["algorithm"], "rows": rec.get("rows"), "union_rows": rec.get("union_rows"),
                     "expected_union_rows": union.shape[1]}
# Average divides by the number of ranks, prescale/postscale apply (Horovod's predivide)
t = tensor_for("random", rank, size)
avg = commlib.allreduce(t, name="average", op=commlib.Average, algorithm="sparse_allgather",
                        prescale_factor=0.5, postscale_factor=2.0)
reference = sum(tensor_for("random", r, size).to_dense() for r in range(size)) / size
report(rank=rank, size=size, cases=out, average_diff=(avg.to_dense() - reference).abs().max().item())
commlib.shutdown()
