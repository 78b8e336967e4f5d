"""Existing collective engines (the `ring` backend and allgather): commlib never hand-rolls a ring.

Each engine sums, allgathers and broadcasts numpy arrays across all ranks. Which one runs is the
`ring_engine` setting; `auto` takes Horovod when it is (or, under horovodrun, can be) initialized,
else MPI through mpi4py under mpirun, else torch.distributed (gloo) under torchrun, else a single
process.
"""
import datetime

import numpy as np

from commlib.errors import BackendUnavailable, ConfigError


class Engine:
    name = None

    def __init__(self, size):
        self.size = size

    def allreduce_sum(self, array, name):
        raise NotImplementedError

    def allgather(self, array, name):
        """Per-rank 1-D arrays (lengths may differ), index = rank."""
        raise NotImplementedError

    def broadcast_object(self, obj):
        raise NotImplementedError

    def _split(self, flat, lengths):
        return np.split(flat, np.cumsum(lengths)[:-1])


class LocalEngine(Engine):
    name = "local"

    def allreduce_sum(self, array, name):
        return array.copy()

    def allgather(self, array, name):
        return [array.copy()]

    def broadcast_object(self, obj):
        return obj


class HorovodEngine(Engine):
    name = "horovod"

    def __init__(self):
        import horovod.torch as hvd
        if not hvd.is_initialized():
            hvd.init()
        self.hvd = hvd
        super().__init__(hvd.size())

    def allreduce_sum(self, array, name):
        import torch
        out = self.hvd.allreduce(torch.from_numpy(array), op=self.hvd.Sum, name=f"commlib.{name}")
        return out.numpy()

    def allgather(self, array, name):
        import torch
        lengths = self.hvd.allgather(torch.tensor([array.size]), name=f"commlib.{name}.lengths").tolist()
        flat = self.hvd.allgather(torch.from_numpy(np.ascontiguousarray(array)), name=f"commlib.{name}").numpy()
        return self._split(flat, lengths)

    def broadcast_object(self, obj):
        return self.hvd.broadcast_object(obj, root_rank=0, name="commlib.broadcast_object")


class MPIEngine(Engine):
    name = "mpi"

    def __init__(self):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()   # our own communicator: no clash with the user's messages
        super().__init__(self.comm.Get_size())

    def allreduce_sum(self, array, name):
        out = np.array(array, copy=True)
        self.comm.Allreduce(self.MPI.IN_PLACE, out, op=self.MPI.SUM)
        return out

    def allgather(self, array, name):
        array = np.ascontiguousarray(array)
        lengths = self.comm.allgather(array.size)
        flat = np.empty(sum(lengths), dtype=array.dtype)
        self.comm.Allgatherv(array, [flat, lengths])
        return self._split(flat, lengths)

    def broadcast_object(self, obj):
        return self.comm.bcast(obj, root=0)


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, timeout_s=None):
        import torch.distributed as dist
        timeout = datetime.timedelta(seconds=timeout_s or 1800)   # gloo's own bound on a dead peer
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timeout)
        # commlib's own gloo group over the job's rendezvous (the one DDP uses): its collectives run
        # on commlib's background thread and must never interleave with those DDP or the user issue
        # on the default group (gloo pairs collectives by call order), and a default NCCL group
        # could not reduce host arrays
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.dist = dist
        super().__init__(dist.get_world_size())

    def allreduce_sum(self, array, name):
        import torch
        out = torch.from_numpy(np.array(array, copy=True))
        self.dist.all_reduce(out, group=self.group)
        return out.numpy()

    def allgather(self, array, name):
        import torch
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.dist.all_gather(lengths, torch.tensor([array.size]), group=self.group)
        lengths = [int(n) for n in lengths]
        padded = np.zeros(max(lengths), dtype=array.dtype)   # gloo's all_gather wants equal sizes
        padded[:array.size] = array
        parts = [torch.empty(max(lengths), dtype=torch.from_numpy(padded).dtype) for _ in range(self.size)]
        self.dist.all_gather(parts, torch.from_numpy(padded), group=self.group)
        return [p.numpy()[:n] for p, n in zip(parts, lengths)]

    def broadcast_object(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


ENGINES = {"horovod": HorovodEngine, "mpi": MPIEngine, "torch": TorchEngine, "local": LocalEngine}


def _auto(placement):
    if placement.launcher in ("horovod", "horovodrun"):
        return "horovod"
    if placement.launcher == "mpi":
        from commlib.context import horovod_initialized
        return "horovod" if horovod_initialized() else "mpi"
    if placement.launcher == "torchrun":
        return "torch"
    if placement.size == 1:
        return "local"
    raise BackendUnavailable(f"no collective engine for launcher {placement.launcher!r}; set COMMLIB_RING_ENGINE")


def create(choice, placement, timeout_s=None):
    name = _auto(placement) if choice == "auto" else choice
    if name not in ENGINES:
        raise ConfigError(f"ring_engine={choice!r}: choose one of auto, {', '.join(ENGINES)}")
    if name == "local":
        if placement.size != 1:
            raise ConfigError(f"ring_engine=local only works with one rank, not {placement.size}")
        return LocalEngine(1)
    try:
        engine = TorchEngine(timeout_s) if name == "torch" else ENGINES[name]()
    except ImportError as exc:
        raise BackendUnavailable(f"ring engine {name!r} is not installed ({exc}); run `make install`") from exc
    if engine.size != placement.size:
        raise ConfigError(f"the {name} engine sees {engine.size} ranks but the launcher says {placement.size}")
    return engine
