"""DistributedDataParallel under torchrun with commlib reducing the gradients; no Horovod.

    torchrun --nproc-per-node 4 examples/ddp_torchrun.py
    torchrun --nproc-per-node 4 examples/ddp_torchrun.py --policy '*.weight=powersgd(rank=4);*=ring'

torchrun's environment gives rank, size and local rank; commlib's ring is a gloo group of the
same rendezvous as DDP's, and the embedded SwitchML switch and OmniReduce aggregators start on
loopback with no configuration (all ranks are local). The default policy, `*=auto`, sends dense
gradients to the switch or the ring, whichever it measured faster on the first steps.
"""
import argparse
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import commlib
import commlib.torch as cl


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="*=auto", help="commlib policy, per parameter name")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()

    torch.manual_seed(0)   # the same teacher everywhere; DDP broadcasts rank 0's student anyway
    teacher = torch.nn.Linear(64, 4)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    model = DDP(net)
    state = cl.CommlibState(net.named_parameters(), policy=args.policy)
    model.register_comm_hook(state, cl.ddp_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    g = torch.Generator().manual_seed(rank)   # each rank its own data
    for step in range(args.steps):
        x = torch.randn(64, 64, generator=g)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if rank == 0:
        records = commlib.records()   # the last run of each tensor (a bucket whole from the second step)
        used = sorted({(records[n]["algorithm"], records[n]["compression"]) for n in state.record_names()
                       if n in records}, key=str)
        print(f"step {args.steps}: loss {loss.item():.4f}; {state.iteration} steps, {state.buckets_reduced} buckets "
              f"through commlib: {used}", flush=True)
    commlib.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
