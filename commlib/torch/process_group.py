"""commlib as a torch.distributed backend: `dist.init_process_group("commlib")`, one line.

    import torch.distributed as dist, commlib.torch   # registers "commlib"
    dist.init_process_group("commlib")                 # under torchrun; or "cpu:commlib,cuda:nccl"

The world's process group sends each all_reduce (Sum, Avg, Min, Max, Product) through commlib's
core like every other front-end: the policy picks the algorithm (the embedded switch, omnireduce,
the ring), ranks negotiate and fuse, `commlib.records()` and the study see it. Everything else
(reduce_scatter, all_gather, broadcast, barrier, all_to_all, send/recv, bitwise ops, subgroups
from `new_group`) goes through a Gloo group this backend owns over the same store: in-network
aggregation saves no bytes on a reduce-scatter or an all-gather (a ring moves (N-1)/N of the
tensor each way; through a switch every worker uploads all of it).

Collectives pair up across ranks by their order, as in every process group: commlib's names for
them are a counter (the core's unnamed allreduces), so a rank that skips or reorders one gets a
Mismatch or a timeout naming the tensor, never a silent wrong sum.
"""
import datetime
import os
import socket

import numpy as np
import torch
import torch.distributed as dist

import commlib
from commlib import api, bootstrap
from commlib.context import Context
from commlib.engine import GlooEngine
from commlib.handles import when_all
from commlib.errors import ConfigError
from commlib.settings import define
from commlib.torch import int8_collectives

_OPS = {dist.ReduceOp.SUM: commlib.Sum, dist.ReduceOp.AVG: commlib.Average, dist.ReduceOp.MIN: commlib.Min,
        dist.ReduceOp.MAX: commlib.Max, dist.ReduceOp.PRODUCT: commlib.Product}
_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64}
NAME = "commlib"
INT8 = {"reduce_scatter", "all_gather"}
define("c10d_int8", "", "the commlib torch.distributed backend's collectives that travel as int8 with a scale "
       "per block (ZeRO++'s qgZ/qwZ; lossy, see commlib/torch/int8_collectives.py): reduce_scatter, all_gather")


class CommlibProcessGroup(dist.ProcessGroup):
    """all_reduce through commlib's core (the world's group only), the rest through its own Gloo."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._size = size
        gloo = lambda prefix: dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, _options(timeout))
        self.gloo = gloo("commlib/gloo")
        # what asks for the group's backend (FSDP2's device mesh) finds it; collectives go through the
        # Python methods below, never torch's C++ path into it (see _on_gloo)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        self._core = size > 1 and (not api.is_initialized() or api.size() == size) and _is_world(size)
        if self._core and not api.is_initialized():
            # the core's ring gets a Gloo group of its own: its collectives run on commlib's thread and
            # must never interleave with the caller's on self.gloo (Gloo pairs collectives by order)
            api.start(None, {}, lambda settings: bootstrap.join(settings, *_job_of(gloo("commlib/ring"), rank, size)))
        self.int8 = _int8_collectives()   # which collectives travel as int8: COMMLIB_C10D_INT8's, per group

    def getBackendName(self):
        return NAME

    def size(self):
        return self._size

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        op = _OPS.get(opts.reduceOp.op)   # a ReduceOp; its RedOpType is what compares
        if not self._core or op is None or any(t.dtype not in _DTYPES or t.is_sparse for t in tensors):
            return self.gloo.allreduce(tensors, opts)
        work = _Work()
        try:
            handles = commlib.grouped_allreduce_async(tensors, [None] * len(tensors), op=op)
        except Exception as exc:   # refused on every rank (the core tells the others): raised at wait()
            work.future.set_exception(exc)
            return work
        _complete(handles, tensors, work.future)
        return work

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        op = _OPS.get(opts.reduceOp.op)
        if op not in (commlib.Sum, commlib.Average) or input.numel() != self._size * output.numel():
            return self.gloo._reduce_scatter_base(output, input, opts)
        if "reduce_scatter" in self.int8 and output.is_floating_point():
            return _done(lambda: int8_collectives.reduce_scatter(self.gloo, output, input, op == commlib.Average),
                         [output])
        return _reduce_scatter(self.gloo, output, input, op == commlib.Average)

    def all_gather_single(self, output, input, opts=None):
        if "all_gather" not in self.int8 or not input.is_floating_point():
            return self.gloo._allgather_base(output, input, opts or dist.AllgatherOptions())
        return _done(lambda: int8_collectives.all_gather(self.gloo, output, input), [output])

    # Gloo has no coalesced forms of these: one after the other, as torch's own Python process group does
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return _last([self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return _last([self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)])

    def allreduce_coalesced(self, tensors, opts=None):
        options = dist.AllreduceOptions()
        options.reduceOp = (opts or dist.AllreduceCoalescedOptions()).reduceOp
        return self.allreduce(tensors, options)


def _on_gloo(method):
    """A collective run by the backend's Gloo group, called from Python, which lets the GIL go while Gloo
    queues it. Torch's C++ path from a Python process group into a registered backend keeps the GIL
    while it waits for Gloo's queue lock, and Gloo's worker, holding that lock, may wait for the GIL
    to free a finished Work's tensors: a deadlock (seen: all_to_all_single, then broadcast)."""
    return lambda self, *args, **kwargs: getattr(self.gloo, method)(*args, **kwargs)


for _name, _method in {"broadcast": "broadcast", "barrier": "barrier", "allgather": "allgather",
                       "_allgather_base": "_allgather_base", "allgather_coalesced": "allgather_coalesced",
                       "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "_reduce_scatter_base",
                       "alltoall": "alltoall",
                       "all_to_all_single": "alltoall_base", "alltoall_base": "alltoall_base", "send": "send",
                       "recv": "recv", "recv_anysource": "recv_anysource", "reduce": "reduce", "gather": "gather",
                       "scatter": "scatter", "monitored_barrier": "monitored_barrier"}.items():
    setattr(CommlibProcessGroup, _name, _on_gloo(_method))


def _int8_collectives():
    text = api.runtime().settings.c10d_int8 if api.is_initialized() else os.environ.get("COMMLIB_C10D_INT8", "")
    chosen = {c.strip() for c in text.split(",") if c.strip()}
    if chosen - INT8:
        raise ConfigError(f"COMMLIB_C10D_INT8={','.join(sorted(chosen))}: name some of {', '.join(sorted(INT8))}")
    return chosen


def _reduce_scatter(group, output, input, average):
    """Exact reduce-scatter: one all-to-all (rank r gets every rank's chunk r), then the chunks summed in
    rank order. Gloo's own reduce-scatter moves an allreduce's bytes (2(N-1)/N of the input each way; this
    (N-1)/N): 8 MB, 4 hosts at 500 Mbit, 215 ms against 114. Asynchronous, as Gloo's: the sum runs when
    the all-to-all completes."""
    size, n = group.size(), output.numel()
    received, work = torch.empty(size * n, dtype=input.dtype), _Work()

    def finish(future):
        try:
            future.wait()
            total = received.view(size, n).sum(dim=0)
            output.copy_((total / size if average else total).view_as(output))
            work.future.set_result([output])
        except Exception as exc:   # raised where the caller waits
            work.future.set_exception(exc)

    group.alltoall_base(received, input.reshape(-1).contiguous(), [], []).get_future().then(finish)
    return work


def _last(works):
    for work in works[:-1]:
        work.wait()
    return works[-1]


def _done(fn, outputs):
    """A finished Work: fn() ran here (a collective with no async form), its error raised at wait()."""
    work = _Work()
    try:
        fn()
        work.future.set_result(outputs)
    except Exception as exc:   # raised where the caller waits, as an asynchronous one would be
        work.future.set_exception(exc)
    return work


def _options(timeout):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]   # as torch's own gloo group
    return options


class _Work(dist.Work):
    """One all_reduce: done when commlib's handles are. wait() raises the collective's own error (a
    Work made by `_create_work_from_future` returns True from wait() even when it failed)."""

    def __init__(self):
        super().__init__()
        self.future = torch.futures.Future()
        # set_exception only stores the error as the future's value; one raised in a then() callback
        # is an error to C++ callers (DDP's reducer) too
        self._checked = self.future.then(lambda future: future.value())

    def wait(self, timeout=None):
        self.future.wait()   # raises the error set on it
        return True

    def is_completed(self):
        return self.future.done()

    def is_success(self):
        return self._checked.done() and not self._failed()

    def exception(self):
        return self._failed()

    def _failed(self):
        try:
            self._checked.value()
        except Exception as exc:   # the collective's error, as torch's own Work reports it
            return exc
        return None

    def get_future(self):
        return self._checked

    def result(self):
        return self.future.wait()


def _is_world(size):
    """The group being made is the world's (torch makes it first; later ones are `new_group`s)."""
    return not dist.is_initialized() and size == int(os.environ.get("WORLD_SIZE", size))


class _GroupEngine(GlooEngine):
    """commlib's ring engine over the backend's own Gloo group (no store of its own to serve)."""

    def __init__(self, group, rank, size):
        self.size, self.group, self.ctx = size, group, Context(rank, size, rank, size)


def _job_of(group, rank, size):
    """(engine, placement) of the job this process group is: the local ranks as torchrun says, else
    those on this host by name."""
    engine = _GroupEngine(group, rank, size)
    if "LOCAL_WORLD_SIZE" in os.environ:
        local_rank, local_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["LOCAL_WORLD_SIZE"])
    else:
        name = np.frombuffer(socket.gethostname().encode(), np.uint8).copy()
        hosts = [part.tobytes() for part in engine.allgather(name, "hosts")]
        local = [r for r, host in enumerate(hosts) if host == hosts[rank]]
        local_rank, local_size = local.index(rank), len(local)
    return engine, Context(rank, size, local_rank, local_size, "torch.distributed")


def _complete(handles, tensors, future):
    """Complete `future` with `tensors` once every handle resolved, each result copied into its tensor
    (all_reduce is in place), or with the first error; on commlib's thread, as the handles resolve."""
    def done():
        try:
            for handle, tensor in zip(handles, tensors):
                result = handle.wait()   # resolved: returns at once, or raises its error
                if result is not tensor:
                    tensor.copy_(result)
        except Exception as exc:   # Mismatch, CommTimeout, PeerFailure: raised where the caller waits
            future.set_exception(exc)
            return
        future.set_result(tensors)

    when_all(handles, done)


def _create(store, rank, size, timeout):
    return CommlibProcessGroup(store, rank, size, timeout or datetime.timedelta(seconds=1800))


if NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(NAME, _create, devices=["cpu"])
