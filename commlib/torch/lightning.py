"""Lightning's DDPStrategy with the comm hook registered on every device.

    from commlib.torch.lightning import DDPStrategy
    state = cl.CommlibState(model.named_parameters(), policy="*=auto")
    trainer = pl.Trainer(devices=2, strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=cl.ddp_comm_hook))

Lightning 2.6's own DDPStrategy registers a comm hook on CUDA only (a PyTorch 1.8 limit since
lifted: gloo runs comm hooks), so on CPU commlib's hook would silently never run. This one takes
the same arguments and registers it wherever DDP runs, then starts commlib in the job of the
process group Lightning just formed.
"""
from pytorch_lightning.overrides.distributed import _register_ddp_comm_hook
from pytorch_lightning.strategies import DDPStrategy as _LightningDDPStrategy

from commlib.torch.ddp import CommlibState


class DDPStrategy(_LightningDDPStrategy):
    def _register_ddp_hooks(self):
        if self._ddp_comm_hook is None:
            return
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)
        if isinstance(self._ddp_comm_state, CommlibState):   # every rank here: its set-up errors come now
            self._ddp_comm_state.start()
