"""commlib's powersgd through the DDP hook vs PyTorch's own powerSGD_hook: the same run twice.

argv: OUT RANK STEPS. Both runs start from the same model (seed 0) and see the same batches
(per rank); both use matrix rank RANK, error feedback, warm start, plain allreduce for the first
2 steps (PyTorch's minimum with error feedback) and min_compression_rate 2. DDP's default
allreduce runs too, as the reference. Writes OUT/rank<r>.json with each run's loss per step
(averaged over ranks) and what commlib ran per parameter.
"""
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import commlib
import commlib.torch as cl

out, rank_r, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank, size = dist.get_rank(), dist.get_world_size()
teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
torch.manual_seed(1)
for p in teacher.parameters():
    p.requires_grad_(False)


def train(register):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
                              torch.nn.Linear(128, 8))
    model = DDP(net)
    register(model, net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), teacher(x))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / size)
    return losses


def pytorch_powersgd(model, net):
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r, start_powerSGD_iter=2,
                                   min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
    model.register_comm_hook(state, powersgd.powerSGD_hook)


def commlib_powersgd(model, net):
    spec = f"powersgd(rank={rank_r},start_iter=2,min_compression_rate=2,warm_start=True,seed=0)"
    model.register_comm_hook(cl.CommlibState(net.named_parameters(), algorithm="ring", compression=spec),
                             cl.ddp_comm_hook)


result = {"rank": rank, "default": train(lambda model, net: None), "pytorch": train(pytorch_powersgd),
          "commlib": train(commlib_powersgd),
          "records": {n: [r["algorithm"], r["compression"], r["fused_with"]] for n, r in commlib.records().items()}}
(out / f"rank{rank}.json").write_text(json.dumps(result))
commlib.shutdown()
