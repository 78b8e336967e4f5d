"""A Horovod user's training script with one line changed: `import commlib.torch as hvd` where it read
`import horovod.torch as hvd`. Its optimizer is then commlib's, every other hvd name Horovod's own.
Each rank reports its parameters against plain Horovod's from the same start (tests/test_horovod.py)."""
import torch

import commlib.torch as hvd          # the one line (was: import horovod.torch as hvd)
import commlib
import horovod.torch as horovod      # the reference only
from commlib.testing import report


def train(distributed_optimizer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    optimizer = distributed_optimizer(optimizer, named_parameters=model.named_parameters(),
                                      compression=hvd.Compression.none, op=hvd.Average)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(torch.randn(32, 20, generator=data)).pow(2).mean()
        loss.backward()
        optimizer.step()
        hvd.allreduce(loss.detach(), name="loss")   # the usual metric average, through Horovod
    return torch.cat([p.detach().flatten() for p in model.parameters()])


hvd.init()
torch.set_num_threads(1)
ours = train(hvd.DistributedOptimizer)
theirs = train(horovod.DistributedOptimizer)
everyone = hvd.allgather(ours.unsqueeze(0), name="check.params")
report(rank=hvd.rank(), size=hvd.size(), same_on_all_ranks=all(torch.equal(everyone[0], row) for row in everyone),
       max_diff_vs_horovod=(ours - theirs).abs().max().item(),
       reduced_by_commlib=sorted(name for name in commlib.records() if name.startswith(("0.", "2."))),
       horovods_own=[name for name in ("init", "rank", "allreduce", "allgather", "broadcast_parameters", "Compression")
                     if getattr(hvd, name) is getattr(horovod, name)])
commlib.shutdown()
