"""Lightning starting its own processes (`python lightning_backend.py`, Trainer(devices=2) on CPU)
with Lightning's own DDPStrategy(process_group_backend="commlib"): no hook, the commlib backend
under DDP. Each rank reports whether the ranks' weights are equal after training, the size of
commlib's job and what reduced the last bucket. (The hook's case: lightning_launch.py.)"""
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

import commlib
import commlib.torch  # noqa: F401  (registers the backend)
from commlib.testing import report


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self):
        import torch.distributed as dist
        mine = self.net.weight.detach().clone()
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        report(rank=dist.get_rank(), size=dist.get_world_size(), backend=dist.get_backend(), commlib_size=commlib.size(),
               same_on_all_ranks=all(torch.equal(everyone[0], w) for w in everyone),
               trained=not torch.equal(mine, Model().net.weight),
               algorithms=sorted({r["algorithm"] for r in commlib.records().values()}))


model = Model()
strategy = DDPStrategy(process_group_backend="commlib")
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
trainer = pl.Trainer(devices=2, accelerator="cpu", strategy=strategy, max_epochs=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
