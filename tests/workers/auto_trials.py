"""`auto` measures: two row carriers registered from outside the package, both the sparse allgather
under other names. The traffic model ranks `toy_slow` first (it claims the fewest bytes) but it
sleeps SLOW_S per call; `toy_fast` claims a few bytes more and is fast until step FLIP, then sleeps
FLIPPED_S. Every built-in carrier claims far more bytes, outside the margin. Tensor 'a' is reduced
every step, 'b' (the same kind: one group) every other step; 'dense' is a mostly-zero dense tensor
that `auto` sends to omnireduce by its density. Reports, per step, what commlib.records() shows of
each tensor (and whether the traffic model ran for it), whether each result is the sum, and on rank 0
the full submissions its controller handled per name and those that carried sketches."""
import time

import numpy as np
import torch

import commlib
from commlib.backends import register
from commlib.backends.sparse_allgather import SparseAllgatherBackend
from commlib.testing import full_submissions, report

STEPS, FLIP, SLOW_S, FLIPPED_S = 36, 14, 0.05, 0.3
VOCAB, DIM = 5000, 4
flipped = False


class Toy(SparseAllgatherBackend):
    carries = {"rows": 0}
    claimed = 0   # bytes the traffic model is told, each way
    sleep_s = 0.0

    @classmethod
    def traffic(cls, stats):
        return {"up": cls.claimed, "down": cls.claimed}

    def allreduce_rows(self, rows, values, nrows, name, counts=None):
        time.sleep(self.delay())
        return super().allreduce_rows(rows, values, nrows, name, counts)

    def delay(self):
        return self.sleep_s


@register
class ToySlow(Toy):
    name, claimed, sleep_s = "toy_slow", 10, SLOW_S


@register
class ToyFast(Toy):
    name, claimed = "toy_fast", 15

    def delay(self):
        return FLIPPED_S if flipped else 0.0


commlib.init(policy="*=auto")
rank, size = commlib.rank(), commlib.size()
full = full_submissions()   # per name, on rank 0
sketched = {}   # per name, on rank 0: the submissions whose row stats carried the sketches the model needs
server = commlib.api.runtime()._server
if server is not None:
    submit_one = server._submit

    def counted(rank, meta):
        if "sketch" in (meta.get("rows") or {}):
            sketched[meta["name"]] = sketched.get(meta["name"], 0) + 1
        return submit_one(rank, meta)
    server._submit = counted


def rows_tensor(step, r):
    g = np.random.default_rng(100 * step + r)
    rows = np.sort(g.choice(VOCAB, 50, replace=False))
    values = g.standard_normal((rows.size, DIM)).astype(np.float32)
    return torch.sparse_coo_tensor(torch.from_numpy(rows).view(1, -1), torch.from_numpy(values), (VOCAB, DIM))


def dense_tensor(step, r):
    x = np.zeros(100_000, np.float32)
    x[(step * 7 + r) % 1000] = 1.0   # one non-zero block: far below auto's density bound every step
    return x


steps = []
for step in range(STEPS):
    flipped = step >= FLIP
    got, exact = {}, {}
    names = ["a", "b"] if step % 2 == 0 else ["a"]
    for name in names:
        out = commlib.allreduce(rows_tensor(step, rank), name=name, op=commlib.Sum)
        want = sum(rows_tensor(step, r).to_dense() for r in range(size))
        exact[name] = bool(torch.allclose(out.to_dense(), want, atol=1e-5))
    out = commlib.allreduce(dense_tensor(step, rank), name="dense", op=commlib.Sum)
    exact["dense"] = bool(np.array_equal(out, sum(dense_tensor(step, r) for r in range(size))))
    records = commlib.records()
    steps.append({"records": {name: {"algorithm": records[name]["algorithm"], "auto": records[name].get("auto"),
                                     "modelled": records[name].get("estimate") is not None}
                              for name in names + ["dense"]}, "exact": exact, "full": dict(full),
                  "sketched": dict(sketched)})
report(rank=rank, steps=steps, flip=FLIP)
commlib.shutdown()
