"""Lightning starting its own processes: `python lightning_launch.py OUT` with
Trainer(devices=2, accelerator="cpu", strategy=commlib.torch.lightning.DDPStrategy(...)).

Lightning reruns this script for rank 1 with WORLD_SIZE and LOCAL_RANK but no RANK. Every rank
writes OUT/rank<r>.json: its weights after training, commlib's job size and rank, and how many
buckets went through commlib; pytest compares them.
"""
import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import commlib
import commlib.torch as cl
from commlib.torch.lightning import DDPStrategy

out = Path(sys.argv[1])


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.set_num_threads(1)
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(128, 8, generator=g)
data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=16, shuffle=True)
model = Net()
state = cl.CommlibState(model.named_parameters(), policy="*=ring")   # before Lightning starts rank 1
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(ddp_comm_state=state,
                                                                         ddp_comm_hook=cl.ddp_comm_hook),
                     max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(model, data)
rank = trainer.global_rank
(out / f"rank{rank}.json").write_text(json.dumps({
    "rank": rank, "commlib": [commlib.rank(), commlib.size()], "buckets": state.buckets_reduced,
    "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()}))
commlib.shutdown()
