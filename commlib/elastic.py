"""Elastic training (Horovod's `hvd.elastic.run`): commlib re-forms its job for every new world.

    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    commlib.elastic.register(state)      # before the state's other reset callbacks

When a worker fails, commlib's collectives raise errors that are Horovod's HorovodInternalError
(commlib.errors), so `hvd.elastic.run` restores the last commit and resets Horovod; when hosts are
added or removed, it resets at the next commit. At each reset, after Horovod formed the new world,
the callback closes commlib's old job as far as its lost ranks allow (its controller, its SwitchML
registration, its OmniReduce aggregators, its Gloo ring, its process sets) and forms a new one
with the arguments commlib.init() was given: the new world's rank 0 serves the controller, the
switch registers the new job, backends start for the new size. A worker that joins calls
commlib.init() (e.g. through commlib.torch.DistributedOptimizer) before hvd.elastic.run syncs the
state, at the same point where the others re-form, so every rank of the new world meets there.
"""
import logging

from commlib import api

log = logging.getLogger("commlib")


def register(state):
    """Re-form commlib at each of `state`'s resets (a horovod.common.elastic.State: TorchState,
    TensorFlowKerasState, ObjectState). Returns the state."""
    state.register_reset_callbacks([reset])
    return state


def reset():
    """Close commlib's job and form a new one over Horovod's current world, with the same init
    arguments; a no-op when commlib was never initialized."""
    runtime = api._runtime
    if runtime is None:
        return
    policy, settings = runtime.init_args
    before = (runtime.ctx.rank, runtime.ctx.size)
    api.shutdown()
    api.init(policy, **settings)
    log.info("commlib: re-formed for the new world: rank %d of %d (was %d of %d)", api.rank(), api.size(), *before)
