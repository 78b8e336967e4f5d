"""commlib.torch.DistributedOptimizer vs Horovod's own, from the same start, on every rank.

After a few steps with different data per rank: parameters are identical on all ranks and equal
to plain Horovod's within a tolerance (tight for ring, the quantization bound for switchml, the
compressor's error for a lossy `compression`). argv: policy [compression|none [options]], options
e.g. "op=sum,passes=2" (Horovod's op and backward_passes_per_step, on both optimizers). Every rank
also tries what commlib does not support. It reports all of it; tests/test_horovod.py checks."""
import sys

import torch

import horovod.torch as hvd
import commlib
import commlib.torch as cl
from commlib.testing import report

policy = sys.argv[1]
compression = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "none" else None   # or "hvd.fp16"
options = dict(kv.split("=") for kv in sys.argv[3].split(",")) if len(sys.argv) > 3 else {}
passes = int(options.get("passes", 1))
hvd.init()
op = {"average": hvd.Average, "sum": hvd.Sum}[options.get("op", "average")]
predivide = 2.0 if op == hvd.Average else 1.0   # Horovod allows a predivide factor with Average only
commlib.init(policy=policy)
torch.set_num_threads(1)


def train(make_optimizer, extra=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    opt = make_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    g = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(5):
        opt.zero_grad()
        for _ in range(passes):   # gradients accumulate locally; the last pass reduces them
            model(torch.randn(32, 20, generator=g)).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


if compression == "hvd.fp16":
    compression = hvd.Compression.fp16
ours = train(lambda o, named: cl.DistributedOptimizer(o, named_parameters=named, backward_passes_per_step=passes,
                                                      op=op, gradient_predivide_factor=predivide,
                                                      compression=compression))
theirs = train(lambda o, named: hvd.DistributedOptimizer(o, named_parameters=named, backward_passes_per_step=passes,
                                                         op=op, gradient_predivide_factor=predivide))
everyone = hvd.allgather(ours.unsqueeze(0), name="check.params")
unsupported = {"op=Adasum": dict(op=hvd.Adasum), "groups": dict(groups=2),
               "process_set": dict(process_set=hvd.ProcessSet([0]))}
errors = {}
for label, kwargs in unsupported.items():
    try:
        cl.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), **kwargs)
        errors[label] = None
    except commlib.CommError as exc:
        errors[label] = f"{type(exc).__name__}: {exc}"
report(rank=hvd.rank(), same_on_all_ranks=all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size())),
       max_diff_vs_horovod=(ours - theirs).abs().max().item(), unsupported=errors,
       algorithms=sorted(f"{r['algorithm']}:{r['compression']}" for r in commlib.records().values()))
commlib.shutdown()
