"""Lightning's DDPStrategy with its comm hook registered on every device.

    from commlib.torch.lightning import DDPStrategy
    trainer = pl.Trainer(strategy=DDPStrategy(ddp_comm_state=cl.CommlibState(model.named_parameters()),
                                              ddp_comm_hook=cl.ddp_comm_hook), ...)

Lightning 2.6 registers a strategy's comm hook on CUDA only (a PyTorch 1.8 limit, since lifted:
gloo runs comm hooks), so with its own DDPStrategy on CPU commlib's hook would never run and the
job would train on DDP's allreduce without a word. This one registers it everywhere; on CUDA it is
Lightning's own. (`DDPStrategy(process_group_backend="commlib")` is the other way: no hook at all.)
"""
from pytorch_lightning.overrides.distributed import _register_ddp_comm_hook
from pytorch_lightning.strategies import DDPStrategy as _LightningDDPStrategy


class DDPStrategy(_LightningDDPStrategy):
    def _register_ddp_hooks(self):
        if self.root_device.type == "cuda" or self._ddp_comm_hook is None:
            return super()._register_ddp_hooks()
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)
