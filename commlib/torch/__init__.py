"""PyTorch front-end: Horovod's DistributedOptimizer with commlib doing the communication.

    import horovod.torch as hvd, commlib.torch as cl
    hvd.init()
    optimizer = cl.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        policy="embedding.*=omnireduce;*=switchml")
    cl.broadcast_parameters(model.state_dict(), root_rank=0)

Horovod keeps doing what it does well (autograd hooks, backward_passes_per_step, step() and
zero_grad() checks); only its per-gradient `_allreduce_grad_async` is replaced on the instance, and
the replacement returns a callable handle, which Horovod's synchronize() calls for the result.
Horovod builds the optimizer class on the fly and calls super(self.__class__, ...), so it is never
subclassed, and no Horovod file is patched.
"""
import types

import commlib
from commlib.errors import BackendUnavailable
from commlib import horovod_options
from commlib.policy import Policy
from commlib.torch.ddp import CommlibState, ddp_comm_hook  # noqa: F401  (DDP comm hook)

try:
    from horovod.torch import (broadcast_object, broadcast_optimizer_state,  # noqa: F401  (re-exported)
                               broadcast_parameters)
except ImportError:   # horovod is optional for commlib.allreduce; only this front-end needs it
    def __getattr__(name):
        if name in ("broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"):
            raise BackendUnavailable(f"commlib.torch.{name} needs horovod; run `make install`")
        raise AttributeError(name)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=None, gradient_predivide_factor=1.0, policy=None, algorithm=None, **horovod_kwargs):
    """Horovod's `hvd.DistributedOptimizer`, with each gradient reduced by commlib.

    compression: a commlib compressor spec ("topk(ratio=0.01)", a GRACE params dict, an object) or
        horovod's Compression.none / Compression.fp16; applies to every gradient.
    policy: a commlib.Policy (or its text) choosing (algorithm, compressor) per parameter name;
        default: the policy commlib.init() was given. `algorithm` forces one algorithm for all.
    Other arguments are Horovod's (process_set, sparse_as_dense, ...).
    """
    import horovod.torch as hvd
    if not hvd.is_initialized():
        raise commlib.CommError("call hvd.init() before commlib.torch.DistributedOptimizer")
    op = horovod_options.check(hvd, op, horovod_kwargs)
    compression = _commlib_compression(compression, hvd)
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    commlib.init()
    opt = hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                   backward_passes_per_step=backward_passes_per_step, op=op,
                                   gradient_predivide_factor=gradient_predivide_factor, **horovod_kwargs)
    # Horovod calls it only when it registered its hooks (several ranks, or an elastic job whose
    # world may grow); commlib reduces over the optimizer's process set, as Horovod would
    opt._allreduce_grad_async = types.MethodType(_reducer(hvd, compression, policy, algorithm), opt)
    return opt


def _commlib_compression(compression, hvd):
    if compression is None or compression is hvd.Compression.none:
        return None
    if compression is hvd.Compression.fp16:
        return "fp16"
    return compression


def _reducer(hvd, compression, policy, algorithm):
    def _allreduce_grad_async(self, p):
        if p.grad is None:
            # other ranks may have a gradient for p (dynamic graphs): contribute zeros, as Horovod does
            p.grad = p.data.new(p.size()).zero_()
        name = self._parameter_names.get(p)
        grad = p.grad
        average = self.op == hvd.Average
        handle = commlib.allreduce_async(
            grad, name=name, op=commlib.Average if average else commlib.Sum, algorithm=algorithm,
            compression=compression, policy=policy, process_set=self.process_set,
            prescale_factor=1.0 / self.gradient_predivide_factor if average else 1.0,
            postscale_factor=self.gradient_predivide_factor if average else 1.0)

        def result():
            out = commlib.synchronize(handle)
            if p.grad.is_sparse:       # the sum of sparse gradients comes back dense
                p.grad = out
            return out
        return result, None
    return _allreduce_grad_async
