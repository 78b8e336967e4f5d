"""Who this rank is in the job, and what a backend sees of the job: one Context.

`detect()` fills in the placement (rank, size, local rank and size, launcher) from Horovod, the
launcher's environment or mpi4py; commlib's bootstrap then adds the job: settings, the ring
engine, `exchange` (an allgather of small JSON values through the controller), a job token and
the job's secret.
"""
import dataclasses
import os
import sys
from dataclasses import dataclass, field

from commlib.errors import CommError, ConfigError


@dataclass
class Context:
    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str = "single"         # horovod, horovodrun, mpi, torchrun, torch.distributed (the backend), single, threads
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


def initialized_process_group():
    """(rank, size) of torch.distributed's default process group when this process initialized one."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:   # a half-imported or broken torch.distributed counts as absent
        pass
    return None


def _check_agrees(where, rank, size, group):
    """The launcher's word against the process group's: a disagreement would reduce over the wrong ranks."""
    if group is not None and group != (rank, size):
        raise ConfigError(f"{where} says rank {rank} of {size} but torch.distributed's process group is rank "
                          f"{group[0]} of {group[1]}: commlib would reduce over other ranks than the job's. Start "
                          f"every process with the same launcher and world size (or unset the stale variables)")


def detect(environ=None):
    """This process's placement: Horovod if initialized, else torch.distributed's process group if
    initialized (Lightning's own launcher sets no RANK), else the launcher's variables, else mpi4py, else
    a single process. Where two of them speak, they must agree."""
    environ = os.environ if environ is None else environ
    group = initialized_process_group()
    hvd = initialized_horovod()
    if hvd is not None:
        _check_horovod_sees_the_launch(hvd, environ)
        _check_agrees("Horovod", hvd.rank(), hvd.size(), group)
        return Context(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), "horovod")
    for launcher, rank, size, local_rank, local_size in _ENVIRONMENTS:
        if rank in environ and size in environ:
            n = int(environ[size])
            _check_agrees(f"the {launcher} environment ({rank}, {size})", int(environ[rank]), n, group)
            return Context(int(environ[rank]), n, int(environ.get(local_rank, environ[rank])),
                           int(environ.get(local_size, n)), launcher)
    if group is not None:   # ranks and local ranks as the launcher set them (Lightning: LOCAL_RANK, no RANK)
        rank, size = group
        local_size = int(environ.get("LOCAL_WORLD_SIZE", 0)) or _local_size_by_host()
        return Context(rank, size, int(environ.get("LOCAL_RANK", 0)), local_size, "torchrun")
    if "WORLD_SIZE" in environ and int(environ["WORLD_SIZE"]) > 1:   # a launcher whose group is not up yet
        raise ConfigError(f"WORLD_SIZE={environ['WORLD_SIZE']} but no RANK and no torch.distributed process group: "
                          f"commlib would run a job of one rank. Initialize torch.distributed first "
                          f"(dist.init_process_group; Lightning does it in Trainer.fit) or launch with torchrun")
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        world = mpi.COMM_WORLD
        local = world.Split_type(mpi.COMM_TYPE_SHARED)
        return Context(world.Get_rank(), world.Get_size(), local.Get_rank(), local.Get_size(), "mpi")
    return Context(0, 1, 0, 1, "single")


def _local_size_by_host():
    """How many ranks of the default process group run on this host (a collective on that group)."""
    import socket
    import torch.distributed as dist
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts.count(socket.gethostname())
