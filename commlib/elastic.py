"""Elastic training (Horovod's `hvd.elastic.run`): commlib re-forms its job for every new world.

    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    commlib.elastic.register(state)      # before the state's other reset callbacks

When a worker fails, commlib's collectives raise errors that are Horovod's HorovodInternalError
(commlib.errors), so `hvd.elastic.run` restores the last commit and resets Horovod; when hosts are
added or removed, it resets at the next commit. At each reset (after a failure: at the restore before
it), commlib's old job is closed as far as its lost ranks allow (its controller, its SwitchML
registration, its OmniReduce aggregators, its Gloo ring, its process sets); after Horovod formed
the new world, the callback forms a new one with the arguments commlib.init() was given: the new world's rank 0 serves the controller, the
switch registers the new job, backends start for the new size. A worker that joins calls
commlib.init() (e.g. through commlib.torch.DistributedOptimizer) before hvd.elastic.run syncs the
state, at the same point where the others re-form, so every rank of the new world meets there.
"""
import logging

from commlib import api

log = logging.getLogger("commlib")


_closed = None   # (init arguments, (rank, size)) of the job closed since the last reset, for reset to re-form


def register(state):
    """Re-form commlib at each of `state`'s resets (a horovod.common.elastic.State: TorchState,
    TensorFlowKerasState, ObjectState). Returns the state.

    After a failure (hvd.elastic.run restores the state, then resets Horovod) the old job is closed at
    the restore, before Horovod forms the new world: a rank that left waits in its own close for the
    others (omnireduce keeps its aggregator for their replays), and Horovod's new world waits for that
    rank to exit, so closing only at the reset held both up for COMMLIB_TIMEOUT_S."""
    restore = state.restore

    def restore_then_close():
        restore()
        close()
    state.restore = restore_then_close
    state.register_reset_callbacks([reset])
    return state


def close():
    """Close commlib's job on this rank, keeping what reset() needs to form the next one."""
    global _closed
    runtime = api._runtime
    if runtime is None:
        return
    _closed = runtime.init_args, (runtime.ctx.rank, runtime.ctx.size)
    api.shutdown()


def reset():
    """Form commlib's job anew over Horovod's current world (closing the old one, where the restore
    did not), with the arguments commlib.init() was given; a no-op when commlib was never initialized."""
    global _closed
    close()
    if _closed is None:
        return
    ((policy, settings), before), _closed = _closed, None
    api.init(policy, **settings)
    log.info("commlib: re-formed for the new world: rank %d of %d (was %d of %d)", api.rank(), api.size(), *before)
