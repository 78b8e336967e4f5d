"""PyTorch Lightning's DDPStrategy with commlib's comm hook.

    python examples/lightning_ddp.py                          # Lightning starts the processes
    torchrun --nproc-per-node 2 examples/lightning_ddp.py

The hook and its state go to DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...), as PyTorch's
own hooks do, with commlib.torch.lightning's DDPStrategy: Lightning's own registers a comm hook
on CUDA devices only, so on CPU commlib's hook would never run. The state is built before
Lightning starts its processes; commlib starts in each of them once the process group is up.
"""
import argparse

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import commlib
import commlib.torch as cl
from commlib.torch.lightning import DDPStrategy


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def dataset(n=2048):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 1, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.01 * torch.randn(n, 1, generator=g))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="*=auto", help="commlib policy, per parameter name")
    parser.add_argument("--devices", type=int, default=2,
                        help="processes on this host (torchrun's --nproc-per-node, or Lightning's own)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Regression()
    state = cl.CommlibState(model.named_parameters(), policy=args.policy)   # commlib starts with the process group
    strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=cl.ddp_comm_hook)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, DataLoader(dataset(), batch_size=32, shuffle=True))
    if trainer.global_rank == 0:
        first, last = sum(model.losses[:5]) / 5, sum(model.losses[-5:]) / 5
        used = sorted({(r["algorithm"], r["compression"]) for r in commlib.records().values()}, key=str)
        print(f"lightning: loss {first:.4f} -> {last:.4f}; {state.iteration} steps, {state.buckets_reduced} buckets "
              f"through commlib: {used}", flush=True)
    commlib.shutdown()


if __name__ == "__main__":
    main()
