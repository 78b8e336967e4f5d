"""commlib.torch.DistributedOptimizer vs Horovod's own on a sparse embedding model, same job.

For each optimizer (SGD on a model with sparse and dense gradients; SparseAdam, which refuses dense
gradients, on the embedding alone), each policy and sparse_as_dense off/on: train with commlib and
with plain Horovod from the same start and report the largest parameter difference, whether the
embedding's gradient handed to the optimizer was sparse, and the algorithms commlib used.
argv: policies separated by '|' (default: auto and each sparse carrier)."""
import sys

import torch

import horovod.torch as hvd
import commlib
import commlib.torch as cl
from commlib.testing import report

POLICIES = sys.argv[1].split("|") if len(sys.argv) > 1 else [
    "*=auto", "embedding.*=sparse_allgather;*=ring", "embedding.*=omnireduce;*=ring", "embedding.*=switchml;*=ring"]
VOCAB, DIM = 500, 8
hvd.init()
commlib.init()
torch.set_num_threads(1)


class Model(torch.nn.Module):
    def __init__(self, head):
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)
        self.head = torch.nn.Linear(DIM, 1) if head else None

    def forward(self, ids):
        h = self.embedding(ids)
        return (self.head(h) if self.head is not None else h.sum(1, keepdim=True)).squeeze(1)


def train(kind, wrap, sparse_as_dense):
    torch.manual_seed(0)
    model = Model(head=kind == "sgd")
    base = (torch.optim.SGD(model.parameters(), lr=0.1) if kind == "sgd"
            else torch.optim.SparseAdam(model.parameters(), lr=0.05))
    opt = wrap(base, model.named_parameters(), sparse_as_dense)
    zipf = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64) ** 1.1
    g = torch.Generator().manual_seed(100 + hvd.rank())
    grad_sparse = []
    for _ in range(4):
        ids = torch.multinomial(zipf, 16 * 4, replacement=True, generator=g).view(16, 4)
        opt.zero_grad()
        loss = (model(ids) - 1.0).pow(2).mean()
        loss.backward()
        opt.synchronize()
        grad_sparse.append(model.embedding.weight.grad.is_sparse)
        with opt.skip_synchronize():
            opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), all(grad_sparse)


out = {}
for kind in ("sgd", "sparse_adam"):
    for sparse_as_dense in (False, True):
        if kind == "sparse_adam" and sparse_as_dense:
            continue   # Horovod itself hands SparseAdam an element-sparse gradient then; nothing to compare
        theirs, _ = train(kind, lambda o, named, sad: hvd.DistributedOptimizer(
            o, named_parameters=named, sparse_as_dense=sad), sparse_as_dense)
        for policy in POLICIES:
            if sparse_as_dense and "sparse_allgather" in policy:
                continue   # a dense gradient then: naming a sparse-only algorithm is a ConfigError
            label = f"{kind}|sparse_as_dense={int(sparse_as_dense)}|{policy}"
            try:
                ours, grad_sparse = train(kind, lambda o, named, sad: cl.DistributedOptimizer(
                    o, named_parameters=named, sparse_as_dense=sad, policy=policy), sparse_as_dense)
            except Exception as exc:   # reported, and the test names it
                out[label] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            everyone = hvd.allgather(ours.unsqueeze(0), name=f"check.{label}")
            records = commlib.records()
            out[label] = {"max_diff_vs_horovod": (ours - theirs).abs().max().item(),
                          "same_on_all_ranks": all(torch.equal(everyone[0], e) for e in everyone),
                          "grad_sparse": grad_sparse,
                          "embedding": [records["embedding.weight"]["algorithm"],
                                        records["embedding.weight"].get("union_rows")]}


def skipped_embedding():
    """A rank that does not use the embedding at a step (its gradient is None there) contributes no
    rows once the embedding's gradient has been sparse: the others' rows come back, on every rank."""
    torch.manual_seed(0)
    model = Model(head=True)
    opt = cl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                  policy="*=auto")
    ids = [torch.randint(0, VOCAB, (16, 4), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    for step in range(3):
        opt.zero_grad()
        skip = step == 2 and hvd.rank() > 0
        out = model.head(torch.zeros(16, DIM)).squeeze(1) if skip else model(ids[step])
        (out - 1.0).pow(2).mean().backward()
        opt.step()
    grad = model.embedding.weight.grad
    everyone = hvd.allgather(torch.cat([p.detach().flatten() for p in model.parameters()]).unsqueeze(0),
                             name="check.skipped")
    return {"grad_sparse": grad.is_sparse, "same_on_all_ranks": all(torch.equal(everyone[0], e) for e in everyone),
            "rows_are_rank0s": grad.is_sparse and torch.equal(grad.coalesce().indices()[0], ids[2].unique())}


report(rank=hvd.rank(), size=hvd.size(), results=out, skipped=skipped_embedding())
commlib.shutdown()
