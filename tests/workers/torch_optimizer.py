"""commlib.torch.DistributedOptimizer vs Horovod's own, from the same start, on every rank.

After a few steps with different data per rank: parameters are identical on all ranks and equal
to plain Horovod's within `tolerance` (tight for ring, the quantization bound for switchml, the
compressor's error for a lossy `compression`)."""
import sys

import torch

import horovod.torch as hvd
import commlib
import commlib.torch as cl

policy, tolerance = sys.argv[1], float(sys.argv[2])
compression = sys.argv[3] if len(sys.argv) > 3 else None   # a commlib spec, or "hvd.fp16" for Horovod's
hvd.init()
commlib.init(policy=policy)
torch.set_num_threads(1)


def train(make_optimizer, extra=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    opt = make_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    g = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(5):
        x = torch.randn(32, 20, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


if compression == "hvd.fp16":
    compression = hvd.Compression.fp16
ours = train(lambda o, named: cl.DistributedOptimizer(o, named_parameters=named, backward_passes_per_step=1,
                                                      gradient_predivide_factor=2.0, compression=compression))
theirs = train(lambda o, named: hvd.DistributedOptimizer(o, named_parameters=named, gradient_predivide_factor=2.0))
everyone = hvd.allgather(ours.unsqueeze(0), name="check.params")
assert all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size())), "ranks diverged"
diff = (ours - theirs).abs().max().item()
assert diff <= tolerance, f"commlib vs horovod differ by {diff} > {tolerance}"
algorithms = {(r["algorithm"], r["compression"]) for r in commlib.records().values()}
print(f"OPTIMIZER-OK rank {hvd.rank()} max|diff| {diff:.3g} algorithms {sorted(algorithms)}")
commlib.shutdown()
