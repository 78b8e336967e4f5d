"""PyTorch front-end: Horovod's DistributedOptimizer with commlib doing the communication.

    import horovod.torch as hvd, commlib.torch as cl
    hvd.init()
    optimizer = cl.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        policy="embedding.*=omnireduce;*=switchml")
    cl.broadcast_parameters(model.state_dict(), root_rank=0)

Or one line changed in a Horovod script, `import commlib.torch as hvd`: DistributedOptimizer and join
are commlib's, every other name (init, rank, allreduce, allgather, broadcast_parameters, Compression,
...) is horovod.torch's own.

Horovod keeps doing what it does well (autograd hooks, backward_passes_per_step, step() and
zero_grad() checks); only its per-gradient `_allreduce_grad_async` is replaced on the instance, and
the replacement returns a callable handle, which Horovod's synchronize() calls for the result.
Horovod builds the optimizer class on the fly and calls super(self.__class__, ...), so it is never
subclassed, and no Horovod file is patched.
"""
import types

import commlib
from commlib import horovod_options
from commlib.policy import Policy
from commlib.torch.ddp import CommlibState, ddp_comm_hook  # noqa: F401  (DDP comm hook)
from commlib.torch import process_group  # noqa: F401  (registers the "commlib" torch.distributed backend)

# horovod.torch's names beside commlib's (hvd.init, broadcast_parameters, allgather, ...); horovod is
# optional for commlib.allreduce, only these need it
__getattr__ = horovod_options.names_of("horovod.torch", __name__)


def join(device=-1):
    """Horovod's hvd.join for gradients commlib reduces: this rank is out of data; it contributes
    zeros to the others' allreduces until every rank joined. Returns the rank that joined last.
    (`device` is Horovod's, where its zero tensors live; commlib's stand-ins live on the host.)"""
    return commlib.join()


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=None, gradient_predivide_factor=1.0, policy=None, algorithm=None, **horovod_kwargs):
    """Horovod's `hvd.DistributedOptimizer`, with each gradient reduced by commlib.

    compression: a commlib compressor spec ("topk(ratio=0.01)", a GRACE params dict, an object) or
        horovod's Compression.none / Compression.fp16; applies to every gradient.
    policy: a commlib.Policy (or its text) choosing (algorithm, compressor) per parameter name;
        default: the policy commlib.init() was given. `algorithm` forces one algorithm for all.
    Sparse gradients (nn.Embedding(sparse=True)) travel as (rows, values) and come back sparse and
    coalesced (torch.optim.SparseAdam works); with Horovod's sparse_as_dense=True they are densified
    before the policy sees them, as Horovod does.
    Other arguments are Horovod's (sparse_as_dense, backward_passes_per_step, ...).
    """
    import horovod.torch as hvd
    op = horovod_options.check(hvd, op, horovod_kwargs)
    compression = _commlib_compression(compression, hvd)
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    # Horovod's constructor first: before hvd.init() or with duplicate names, its own ValueError
    opt = hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                   backward_passes_per_step=backward_passes_per_step, op=op,
                                   gradient_predivide_factor=gradient_predivide_factor, **horovod_kwargs)
    commlib.init()
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
    sparse_params = set()   # parameters whose gradient came sparse before

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            # other ranks may have a gradient for p (dynamic graphs): contribute zeros, as Horovod does;
            # for a parameter known to have sparse gradients, no rows (dense zeros could not meet the
            # others' rows: Horovod fails there)
            p.grad = _no_rows(p) if p in sparse_params else p.data.new(p.size()).zero_()
        elif p.grad.is_sparse:
            sparse_params.add(p)
        name = self._parameter_names.get(p)
        grad = p.grad
        if grad.is_sparse and self.sparse_as_dense:
            grad = grad.to_dense()   # as Horovod: the policy sees a dense tensor
        average = self.op == hvd.Average
        handle = commlib.allreduce_async(
            grad, name=name, op=commlib.Average if average else commlib.Sum, algorithm=algorithm,
            compression=compression, policy=policy, process_set=self.process_set,
            prescale_factor=1.0 / self.gradient_predivide_factor if average else 1.0,
            postscale_factor=self.gradient_predivide_factor if average else 1.0)
        # Horovod's synchronize() calls this; for a sparse p.grad it adds the result (sparse, or dense
        # with sparse_as_dense, which it turns sparse) into the zeroed gradient, as for its own
        return (lambda: commlib.synchronize(handle)), None
    return _allreduce_grad_async


def _no_rows(p):
    import torch
    return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.long), p.data.new_empty((0, *p.shape[1:])),
                                   p.shape, check_invariants=False)
