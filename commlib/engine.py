"""Existing collective engines (the `ring` backend and allgather): commlib never hand-rolls a ring.

Each engine sums, allgathers and broadcasts numpy arrays across all ranks. Which one runs is the
`ring_engine` setting. The launcher's engine starts the job (it shares the controller's address):
Horovod when it is (or, under horovodrun, can be) initialized, MPI through mpi4py under mpirun,
torch.distributed under torchrun or where a process group is initialized (Lightning starts its
processes without RANK), else a single process. `auto` then carries the data of a Horovod
job over commlib's own Gloo ring (`gloo`, when torch is installed): Horovod would negotiate every
collective a second time on top of commlib's controller, which made each small collective
(PowerSGD's factors, compressed payloads) several times slower.
"""
import datetime
import importlib.util
import itertools
import os
import time
import urllib.error
import urllib.request

import numpy as np

from commlib.buffers import POOL
from commlib.errors import BackendUnavailable, CommTimeout, ConfigError, PeerFailure
from commlib.net import primary_ip


# A Gloo collective's caller polls for its end for a while before it blocks in Work.wait: on a host
# whose cores are busy, a thread blocked there is often woken a scheduler tick late (4 ms here, where
# a small allreduce takes 0.5). A poll costs a wake-up (7% of a core at POLL_S); past POLL_FOR_S a
# late wake-up matters less than the core a long wait (a late peer) would burn
POLL_S = 0.0002
POLL_FOR_S = 0.02


def finished(work):
    """Wait for a torch.distributed Work; its error, if any, is raised (Work.wait)."""
    give_up = time.monotonic() + POLL_FOR_S
    while not work.is_completed() and time.monotonic() < give_up:
        time.sleep(POLL_S)
    work.wait()


def _in_place(array, scratch):
    """The array an in-place collective reduces: a scratch array itself, else a copy in memory used
    before (the caller's is only read)."""
    return array if scratch else POOL.copy(array)


class Engine:
    name = None

    def __init__(self, size):
        self.size = size

    def allreduce(self, array, name, op="sum", scratch=False):
        """The elementwise reduction over ranks of a 1-D array: op is sum, min, max or product.
        `scratch`: the array is commlib's own (a fusion buffer), the engine's to reduce where it lies."""
        raise NotImplementedError

    def allgather(self, array, name):
        """Per-rank 1-D arrays (lengths may differ), index = rank."""
        raise NotImplementedError

    def subgroup(self, ctx, ranks, hvd_set=None):
        """This engine over `ranks` (job ranks, sorted) only, for a process set whose Context is ctx;
        only those ranks call it. hvd_set: the Horovod process set of those ranks, if one was given."""
        raise BackendUnavailable(f"the {self.name} ring engine cannot reduce over a subset of ranks")

    def allgather_sized(self, array, sizes, name):
        """allgather when every rank's length is already known (`sizes`, by rank): engines that
        exchange lengths first skip that round."""
        return self.allgather(array, name)

    def _split(self, flat, lengths):
        return np.split(flat, np.cumsum(lengths)[:-1])


class LocalEngine(Engine):
    name = "local"

    def allreduce(self, array, name, op="sum", scratch=False):
        return array if scratch else array.copy()

    def allgather(self, array, name):
        return [array.copy()]


class HorovodEngine(Engine):
    """Horovod's ops of the framework whose Horovod module the job initialized (horovod.torch here)."""
    name = "horovod"
    module = "horovod.torch"

    def __init__(self, process_set=None):
        import importlib
        hvd = importlib.import_module(self.module)
        if not hvd.is_initialized():
            hvd.init()
        self.hvd = hvd
        # Horovod's process set this engine reduces over (None: every rank)
        self._over = {} if process_set is None else {"process_set": process_set}
        super().__init__(hvd.size() if process_set is None else len(process_set.ranks))

    def subgroup(self, ctx, ranks, hvd_set=None):
        if hvd_set is None:   # a commlib.ProcessSet: Horovod's set of the same ranks, if the job added one
            from horovod.common import process_sets
            ids = process_sets._basics._get_process_set_ids_and_ranks()
            found = [i for i, members in ids.items() if list(members) == list(ranks)]
            if not found:
                raise BackendUnavailable(f"ring_engine=horovod reduces a process set through Horovod's own: call "
                                         f"hvd.add_process_set({list(ranks)}) on every rank (or pass Horovod's "
                                         f"ProcessSet), or leave COMMLIB_RING_ENGINE=auto")
            hvd_set = process_sets.ProcessSet(list(ranks))
            hvd_set.process_set_id = found[0]
        return type(self)(hvd_set)

    def _tensor(self, array):
        import torch
        return torch.from_numpy(np.ascontiguousarray(array))

    def allreduce(self, array, name, op="sum", scratch=False):
        hvd_op = {"sum": self.hvd.Sum, "min": self.hvd.Min, "max": self.hvd.Max, "product": self.hvd.Product}[op]
        return self.hvd.allreduce(self._tensor(array), op=hvd_op, name=f"commlib.{name}", **self._over).numpy()

    def allgather(self, array, name):
        lengths = self.hvd.allgather(self._tensor(np.array([array.size], np.int64)), name=f"commlib.{name}.lengths",
                                     **self._over)
        flat = self.hvd.allgather(self._tensor(array), name=f"commlib.{name}", **self._over).numpy()
        return self._split(flat, lengths.numpy().tolist())


class HorovodTensorFlowEngine(HorovodEngine):
    """Horovod's TF ops, for jobs that initialized horovod.tensorflow: a second Horovod instance
    (horovod.torch) beside it would rendezvous under the same keys of horovodrun's store and race it."""
    name = "horovod_tensorflow"
    module = "horovod.tensorflow"

    def _tensor(self, array):
        import tensorflow as tf
        return tf.constant(np.ascontiguousarray(array))


class MPIEngine(Engine):
    name = "mpi"

    def __init__(self, comm=None):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm or MPI.COMM_WORLD.Dup()   # our own communicator: no clash with the user's messages
        super().__init__(self.comm.Get_size())

    def subgroup(self, ctx, ranks, hvd_set=None):
        # Create_group: collective over the group's members only (MPI-3), unlike Comm.Split
        return MPIEngine(self.comm.Create_group(self.comm.Get_group().Incl(list(ranks))))

    def allreduce(self, array, name, op="sum", scratch=False):
        out = _in_place(array, scratch)
        mpi_op = {"sum": self.MPI.SUM, "min": self.MPI.MIN, "max": self.MPI.MAX, "product": self.MPI.PROD}[op]
        self.comm.Allreduce(self.MPI.IN_PLACE, out, op=mpi_op)
        return out

    def allgather(self, array, name):
        array = np.ascontiguousarray(array)
        lengths = self.comm.allgather(array.size)
        flat = np.empty(sum(lengths), dtype=array.dtype)
        self.comm.Allgatherv(array, [flat, lengths])
        return self._split(flat, lengths)


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, timeout_s=None, ranks=None):
        import torch.distributed as dist
        timeout = datetime.timedelta(seconds=timeout_s or 1800)   # gloo's own bound on a dead peer
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timeout)
        self.timeout_s = timeout_s
        if ranks is not None:   # a process set's group: only its members take part in making it
            self.group = dist.new_group(list(ranks), timeout=timeout, backend="gloo", use_local_synchronization=True)
            self.dist = dist
            super().__init__(len(ranks))
            return
        # commlib's own gloo group over the job's rendezvous (the one DDP uses): its collectives run
        # on commlib's background thread and must never interleave with those DDP or the user issue
        # on the default group (gloo pairs collectives by call order), and a default NCCL group
        # could not reduce host arrays
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.dist = dist
        super().__init__(dist.get_world_size())

    def subgroup(self, ctx, ranks, hvd_set=None):
        return TorchEngine(self.timeout_s, ranks)

    def allreduce(self, array, name, op="sum", scratch=False):
        import torch
        out = torch.from_numpy(_in_place(array, scratch))
        finished(self.dist.all_reduce(out, op=reduce_op(op), group=self.group, async_op=True))
        return out.numpy()

    def allgather(self, array, name):
        import torch
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        finished(self.dist.all_gather(lengths, torch.tensor([array.size]), group=self.group, async_op=True))
        lengths = [int(n) for n in lengths]
        padded = np.zeros(max(lengths), dtype=array.dtype)   # gloo's all_gather wants equal sizes
        padded[:array.size] = array
        parts = [torch.empty(max(lengths), dtype=torch.from_numpy(padded).dtype) for _ in range(self.size)]
        finished(self.dist.all_gather(parts, torch.from_numpy(padded), group=self.group, async_op=True))
        return [p.numpy()[:n] for p, n in zip(parts, lengths)]


class GlooEngine(Engine):
    """commlib's own Gloo ring: torch.distributed's ProcessGroupGloo over a store that rank 0
    serves, made without touching the user's default process group. Every collective is bounded
    by the `timeout_s` setting."""
    name = "gloo"

    def __init__(self, ctx):
        import torch.distributed as dist
        super().__init__(ctx.size)
        host = "127.0.0.1" if ctx.all_local else primary_ip()
        timeout = datetime.timedelta(seconds=ctx.settings.timeout_s)
        self._store, why = None, ""
        if ctx.rank == 0:
            try:
                self._store = dist.TCPStore(host, 0, ctx.size, True, timeout=timeout, wait_for_workers=False)
            except Exception as exc:   # every rank raises it, below
                why = f"rank 0 could not serve the Gloo store: {exc}"
        served = ctx.exchange("init/gloo", [host, self._store.port] if self._store else why)[0]
        if isinstance(served, str):
            raise BackendUnavailable(served)
        if self._store is None:
            self._store = dist.TCPStore(served[0], served[1], ctx.size, False, timeout=timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(f"commlib/{ctx.job_token}", self._store),
                                           ctx.rank, ctx.size, options)
        self.ctx = ctx

    def subgroup(self, ctx, ranks, hvd_set=None):
        return GlooEngine(ctx)   # a ring of its own among the set, over a store its first rank serves

    def allreduce(self, array, name, op="sum", scratch=False):
        import torch
        import torch.distributed as dist
        options = dist.AllreduceOptions()
        options.reduceOp = reduce_op(op)
        out = torch.from_numpy(_in_place(array, scratch))
        finished(self.group.allreduce([out], options))
        return out.numpy()

    def allgather(self, array, name):
        import torch
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        finished(self.group.allgather([lengths], [torch.tensor([array.size])]))
        lengths = [int(n) for n in lengths]
        padded = torch.zeros(max(lengths), dtype=torch.from_numpy(array[:0]).dtype)   # equal sizes for gloo
        padded[:array.size] = torch.from_numpy(np.ascontiguousarray(array))
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        finished(self.group.allgather([parts], [padded]))
        return [p.numpy()[:n] for p, n in zip(parts, lengths)]

    def allgather_sized(self, array, sizes, name):
        import torch
        if array.size != sizes[self.ctx.rank]:
            raise ValueError(f"allgather {name!r}: this rank's array has {array.size} elements, not {sizes[self.ctx.rank]}")
        padded = torch.zeros(max(sizes), dtype=torch.from_numpy(array[:0]).dtype)
        padded[:array.size] = torch.from_numpy(np.ascontiguousarray(array))
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        finished(self.group.allgather([parts], [padded]))
        return [p.numpy()[:n] for p, n in zip(parts, sizes)]


def reduce_op(op):
    """torch.distributed's ReduceOp for an op name."""
    from torch.distributed import ReduceOp
    return {"sum": ReduceOp.SUM, "min": ReduceOp.MIN, "max": ReduceOp.MAX, "product": ReduceOp.PRODUCT}[op]


class RendezvousEngine(Engine):
    """horovodrun's key-value store (the HTTP rendezvous its Gloo ranks meet through), for commlib's
    set-up in a script that has not initialized Horovod: initializing it here would take
    `hvd.init(process_sets=...)` away from the script. Set-up only (objects travel as JSON, arrays
    as bytes); the ring's data goes through commlib's Gloo ring (data_engine)."""
    name = "horovod_rendezvous"
    _calls = itertools.count()   # per process; every rank makes the same calls in the same order

    def __init__(self, timeout_s=None, environ=None):
        environ = os.environ if environ is None else environ
        super().__init__(int(environ["HOROVOD_SIZE"]))
        self.rank = int(environ["HOROVOD_RANK"])
        self._url = (f"http://{environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{environ['HOROVOD_GLOO_RENDEZVOUS_PORT']}"
                     f"/commlib/")
        self._timeout_s = timeout_s or 60.0

    @staticmethod
    def usable(environ):
        """horovodrun's Gloo rendezvous, outside elastic mode (there the script initializes Horovod
        first), with torch for commlib's own Gloo ring."""
        return ("HOROVOD_GLOO_RENDEZVOUS_ADDR" in environ and environ.get("HOROVOD_ELASTIC") != "1"
                and importlib.util.find_spec("torch") is not None)

    def allgather(self, array, name):
        call = next(self._calls)
        self._put(f"{call}.{self.rank}", np.ascontiguousarray(array).tobytes())
        return [np.frombuffer(self._get(f"{call}.{r}"), array.dtype).copy() for r in range(self.size)]

    def _put(self, key, data):
        request = urllib.request.Request(self._url + key, data=data, method="PUT")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s):
                pass
        except OSError as exc:   # URLError, HTTPError, timeouts
            raise self._unreachable(exc) from exc

    def _get(self, key):
        deadline, pause = time.monotonic() + self._timeout_s, 0.005
        while True:
            try:
                with urllib.request.urlopen(self._url + key, timeout=self._timeout_s) as answer:
                    return answer.read()
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    raise self._unreachable(exc) from exc
            except OSError as exc:
                raise self._unreachable(exc) from exc
            if time.monotonic() > deadline:
                raise CommTimeout(f"horovodrun's rendezvous: rank {key.rpartition('.')[2]} did not call commlib.init() "
                                  f"within {self._timeout_s:.0f}s (or hvd.init()); every rank must")
            time.sleep(pause)
            pause = min(2 * pause, 0.1)

    def _unreachable(self, exc):
        return PeerFailure(f"horovodrun's rendezvous store at {self._url} failed during commlib.init() ({exc}); "
                           f"horovodrun itself has probably stopped: check its output, or call hvd.init() before "
                           f"commlib.init() to set up through Horovod instead")


ENGINES = {"horovod": HorovodEngine, "horovod_rendezvous": RendezvousEngine, "horovod_tensorflow": HorovodTensorFlowEngine, "mpi": MPIEngine,
           "torch": TorchEngine, "local": LocalEngine, "gloo": GlooEngine}


def data_engine(choice, ctx):
    """The engine that carries the ring's data, once the job is up (ctx: its Context): commlib's
    own Gloo ring where `choice` asks for it, else the launcher's engine the job started with."""
    if choice == "auto":
        wanted = ctx.engine.name.startswith("horovod") and importlib.util.find_spec("torch") is not None
    else:
        wanted = choice == "gloo"
    return GlooEngine(ctx) if wanted else ctx.engine


def _auto(placement):
    from commlib.context import initialized_horovod
    hvd = initialized_horovod()
    if placement.launcher in ("horovod", "horovodrun") and hvd is None and RendezvousEngine.usable(os.environ):
        return "horovod_rendezvous"   # Horovod stays the script's to initialize (with its process sets)
    if placement.launcher in ("horovod", "horovodrun") or (placement.launcher == "mpi" and hvd is not None):
        # the Horovod instance the job already has (a second one would race it)
        return "horovod_tensorflow" if hvd is not None and hvd.__name__ == "horovod.tensorflow" else "horovod"
    if placement.launcher == "mpi":
        return "mpi"
    if placement.launcher in ("torchrun", "torch.distributed"):   # the job's process group (Lightning's too)
        return "torch"
    if placement.size == 1:
        return "local"
    raise BackendUnavailable(f"no collective engine for launcher {placement.launcher!r}; set COMMLIB_RING_ENGINE")


def create(choice, placement, timeout_s=None):
    """The launcher's engine (for `gloo`, the one that starts the job: see data_engine)."""
    name = _auto(placement) if choice in ("auto", "gloo") else choice
    if name not in ENGINES:
        raise ConfigError(f"ring_engine={choice!r}: choose one of auto, {', '.join(ENGINES)}")
    if name == "local":
        if placement.size != 1:
            raise ConfigError(f"ring_engine=local only works with one rank, not {placement.size}")
        return LocalEngine(1)
    try:
        engine = ENGINES[name](timeout_s) if name in ("torch", "horovod_rendezvous") else ENGINES[name]()
    except ImportError as exc:
        raise BackendUnavailable(f"ring engine {name!r} is not installed ({exc}); run `make install`") from exc
    if engine.size != placement.size:
        raise ConfigError(f"the {name} engine sees {engine.size} ranks but the launcher says {placement.size}")
    return engine
