"""Who this rank is in the job, and what a backend sees of the job: one Context.

`detect()` fills in the placement (rank, size, local rank and size, launcher) from Horovod,
torch.distributed's process group, the launcher's environment or mpi4py; commlib's bootstrap then
adds the job: settings, the ring engine, `exchange` (an allgather of small JSON values through the
controller), a job token and the job's secret.
"""
import dataclasses
import os
import socket
import sys
from dataclasses import dataclass, field

from commlib.errors import CommError, ConfigError


@dataclass
class Context:
    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str = "single"         # horovod, horovodrun, mpi, torchrun, torch.distributed, single, threads
    settings: object = None          # commlib.settings.Settings
    exchange_fn: object = None       # (key, value, timeout) -> list of every rank's value
    engine: object = None            # commlib.engine.Engine: the existing ring engine (None in unit tests)
    job_token: str = ""              # random hex, identical on every rank of the job
    secret: bytes = field(default=b"", repr=False)   # rank 0's random key for the daemons it embeds
                                     # (switch, aggregators), shared through the launcher's broadcast
    counters: dict = field(default_factory=dict)

    def joined(self, **job):
        """This placement with the job's fields (settings, exchange_fn, engine, job_token, secret) set."""
        return dataclasses.replace(self, **job)

    @property
    def all_local(self):
        """Every rank runs on this host, so embedded switches/aggregators on loopback work."""
        return self.local_size == self.size

    def exchange(self, key, value, timeout=None):
        """Allgather of a small JSON-able value: returns [value of rank 0, ..., rank size-1].
        Every rank must call it with the same key; raises CommTimeout / PeerFailure."""
        return self.exchange_fn(key, value, self.settings.timeout_s if timeout is None else timeout)

    def barrier(self, key):
        self.exchange(f"barrier/{key}", None)

    def agree(self, key, fn, *args, timeout=None):
        """fn(*args) on every rank; if it raised on any rank, every rank raises a CommError naming the
        first failing rank and its error (so no rank waits for one that gave up). Returns fn's result.
        `timeout`: how long a rank waits for the slowest (default: the timeout_s setting)."""
        result, why, local = None, "", None
        try:
            result = fn(*args)
        except Exception as exc:   # shared with every rank below; the local traceback is chained
            why, local = f"{type(exc).__name__}: {exc}", exc
        reasons = self.exchange(f"agree/{key}", why, timeout)
        failed = [(rank, reason) for rank, reason in enumerate(reasons) if reason]
        if failed:
            rank, reason = failed[0]
            error = CommError(f"{key} failed on rank {rank}: {reason}")
            raise error from local
        return result

    def scope(self, name):
        """A prefix for one backend instance's exchange keys, the same on every rank (ranks
        build backends in the same order), distinct from every other instance's."""
        number = self.counters.get(("scope", name), 0)
        self.counters[("scope", name)] = number + 1
        return f"{name}/{number}"


# (launcher, rank, size, local rank, local size) variables, in the order they are trusted.
_ENVIRONMENTS = (
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
)


def initialized_horovod():
    """The Horovod framework module this process initialized (horovod.torch first), or None."""
    for module in ("horovod.torch", "horovod.tensorflow"):
        hvd = sys.modules.get(module)
        try:
            if hvd is not None and hvd.is_initialized():
                return hvd
        except Exception:   # a half-imported or broken horovod counts as absent
            pass
    return None


def _launched(environ):
    """The placement the launcher's variables give, or None."""
    for launcher, rank, size, local_rank, local_size in _ENVIRONMENTS:
        if rank in environ and size in environ:
            n = int(environ[size])
            return Context(int(environ[rank]), n, int(environ.get(local_rank, environ[rank])),
                           int(environ.get(local_size, n)), launcher)
    return None


def _group_world():
    """(rank, size) in torch.distributed's initialized default process group, or None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


def _process_group(environ):
    """The placement of torch.distributed's initialized default process group, or None. Its world
    is the job's even where the launcher exports no RANK (Lightning starts its processes itself)."""
    world = _group_world()
    if world is None:
        return None
    rank, size = world
    if "LOCAL_WORLD_SIZE" in environ:
        local = [int(environ.get("LOCAL_RANK", rank)), int(environ["LOCAL_WORLD_SIZE"])]
    else:   # the ranks on this host, from the group itself
        import torch.distributed as dist
        hosts = [None] * size
        dist.all_gather_object(hosts, socket.gethostname())
        local = [hosts[:rank].count(hosts[rank]), hosts.count(hosts[rank])]
    return Context(rank, size, *local, "torch.distributed")


def _disagree(what, world, other, other_name):
    """What is wrong when two sources of this process's placement, (rank, size) each, disagree, else None."""
    if other is None or tuple(other) == tuple(world):
        return None
    return (f"{what} says this process is rank {world[0]} of {world[1]}, but {other_name} says rank "
            f"{other[0]} of {other[1]}: commlib would reduce over the wrong ranks")


def _refuse(problem):
    if problem:
        raise ConfigError(f"{problem}. Start every process with one launcher and initialize torch.distributed "
                          f"(or Horovod) with the launcher's RANK and WORLD_SIZE")


def _check_horovod_sees_the_launch(hvd, environ):
    """hvd.init() under torchrun (which Horovod does not know) gives every process a job of its own:
    each would train alone as rank 0. Refuse that rather than take it for the job."""
    launched = int(environ.get("WORLD_SIZE", 1))
    by_horovod = any(rank in environ for _, rank, *_ in _ENVIRONMENTS[:3])   # horovodrun's or mpirun's ranks
    if hvd.size() == 1 and launched > 1 and not by_horovod:
        raise ConfigError(f"hvd.init() sees 1 rank but torchrun started {launched}: Horovod joins only the ranks "
                          f"horovodrun or mpirun start. Launch with `horovodrun -np {launched} ...` or "
                          f"`mpirun -np {launched} ...`; under torchrun use commlib without Horovod "
                          f"(commlib.torch.ddp_comm_hook with DDP, or commlib.allreduce)")


def detect(environ=None):
    """This process's placement: Horovod if initialized, else torch.distributed's process group if
    initialized, else the launcher's variables, else mpi4py, else a single process. Where two of
    them speak they must agree (ConfigError): commlib never forms a job of one rank in a process
    that belongs to a larger world."""
    environ = os.environ if environ is None else environ
    launched = _launched(environ)
    hvd = initialized_horovod()
    if hvd is not None:
        _check_horovod_sees_the_launch(hvd, environ)
        world = Context(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), "horovod")
        _refuse(_disagree("Horovod", (world.rank, world.size), _group_world(), "torch.distributed"))
        return world
    world = _process_group(environ)
    if world is not None:
        _refuse(_disagree("torch.distributed", (world.rank, world.size), launched and (launched.rank, launched.size),
                          f"the launcher ({launched and launched.launcher})"))
        return dataclasses.replace(world, launcher=launched.launcher) if launched else world
    if launched is not None:
        return launched
    if int(environ.get("WORLD_SIZE", 1)) > 1:   # Lightning's launcher: WORLD_SIZE and LOCAL_RANK, no RANK
        raise ConfigError(f"WORLD_SIZE={environ['WORLD_SIZE']} but no RANK in the environment, and torch.distributed "
                          f"is not initialized: commlib cannot tell this process's rank. Start commlib after the "
                          f"process group is up (under Lightning, commlib.torch.lightning.DDPStrategy does), or "
                          f"launch with torchrun")
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        world = mpi.COMM_WORLD
        local = world.Split_type(mpi.COMM_TYPE_SHARED)
        return Context(world.Get_rank(), world.Get_size(), local.Get_rank(), local.Get_size(), "mpi")
    return Context(0, 1, 0, 1, "single")


def placed(environ=None):
    """Whether this process's world is known now: Horovod or torch.distributed initialized, or a
    launcher's rank in the environment. (Lightning's first process looks like a single one until
    it starts the others.)"""
    environ = os.environ if environ is None else environ
    return initialized_horovod() is not None or _group_world() is not None or _launched(environ) is not None


def world_group():
    """What identifies torch.distributed's default process group: None when there is none, else
    ("up", its object). Equal, the same world: cheaper to compare on every call than asking the
    group its rank and size."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return ("up", dist.group.WORLD)


def check_world(ctx):
    """A ConfigError when torch.distributed's process group is up with another world than the job
    commlib formed (commlib.init() ran before the process group did): such a job would reduce
    over the wrong ranks, or none."""
    problem = _disagree("commlib's job", (ctx.rank, ctx.size), _group_world(), "torch.distributed's process group")
    if problem:
        raise ConfigError(f"{problem}. commlib started before the process group was formed: call commlib.init() "
                          f"(or build CommlibState) after torch.distributed is initialized, or commlib.shutdown() "
                          f"and init again")
