"""The hot/cold split against the plain sparse sum, step by step across re-agreements of the hot set.

Every rank draws Zipf ids per step (its own seed), so every rank can build every rank's gradient
and the dense reference. The hot set is re-agreed every COMMLIB_HOTCOLD_EVERY calls; reports per
step the difference from the reference, whether the rows are exactly the union, and hotcold's
record (hot_k, hot_share, this rank's hot and cold rows). HUGE_STEP: a step whose hottest row is
beyond switchml's quantization on rank 0."""
import os

import numpy as np
import torch

import commlib
import commlib.api
from commlib.testing import report

VOCAB, DIM, STEPS = 2000, 8, 10
commlib.init(policy="embedding=hotcold;*=ring")
rank, size = commlib.rank(), commlib.size()
zipf = 1.0 / np.arange(1, VOCAB + 1) ** 1.2
zipf /= zipf.sum()
perm = np.random.default_rng(0).permutation(VOCAB)   # hot rows scattered over the table


HUGE_STEP = int(os.environ.get("HUGE_STEP", "-1"))   # the step at which rank 0's hottest row holds 2^127


def gradient(step, r):
    g = np.random.default_rng(step * 100 + r)
    ids = torch.from_numpy(perm[g.choice(VOCAB, 64, p=zipf)].astype(np.int64))
    values = torch.from_numpy(g.standard_normal((64, DIM)).astype(np.float32))
    if step == HUGE_STEP and r == 0:   # beyond switchml's int32 quantization: its slab goes through the ring
        at = (ids == int(perm[0])).nonzero().view(-1)
        values[at] = 0.0
        values[at[:1]] = 2.0 ** 127   # once: the row's draws add up when coalesced
    return torch.sparse_coo_tensor(ids.view(1, -1), values, (VOCAB, DIM))


steps, nnz = [], []
for step in range(STEPS):
    everyone = [gradient(step, r) for r in range(size)]
    got = commlib.allreduce(everyone[rank], name="embedding", op=commlib.Sum)
    reference = sum(t.to_dense() for t in everyone)
    nnz.append(sum(t.coalesce().indices().shape[1] for t in everyone))   # row updates this step, all ranks
    union = torch.cat([t.coalesce().indices() for t in everyone], dim=1).unique(dim=1)
    record = commlib.records()["embedding"]
    steps.append({"max_diff": (got.to_dense() - reference).abs().max().item(), "scale": reference.abs().max().item(),
                  "union": got.is_sparse and got.is_coalesced() and torch.equal(got.indices(), union),
                  "algorithm": record["algorithm"], "skew": record["skew"]})
backend = commlib.api.runtime().backend("hotcold")
rows, counts = backend.counts("embedding")
every = int(os.environ.get("COMMLIB_HOTCOLD_EVERY", "20"))
last = STEPS // every * every   # the call that closed the last window
report(rank=rank, size=size, steps=steps, counted_updates=int(counts.sum()), counted_rows=int(rows.size),
       expected_updates=sum(nnz[last - every:last]),
       range_fallbacks=commlib.backend_stats().get("switchml", {}).get("range_fallbacks"))
commlib.shutdown()
