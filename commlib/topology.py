"""Who am I: rank and size from Horovod, the launcher's environment, mpi4py, or a single process."""
import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str   # horovod, horovodrun, mpi, torchrun, single


# (launcher, rank, size, local rank, local size) variables, in the order they are trusted.
_ENVIRONMENTS = (
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
)


def horovod_initialized():
    hvd = sys.modules.get("horovod.torch")
    try:
        return hvd is not None and hvd.is_initialized()
    except Exception:
        return False


def detect(environ=None):
    environ = os.environ if environ is None else environ
    if horovod_initialized():
        hvd = sys.modules["horovod.torch"]
        return Topology(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), "horovod")
    for launcher, rank, size, local_rank, local_size in _ENVIRONMENTS:
        if rank in environ and size in environ:
            n = int(environ[size])
            return Topology(int(environ[rank]), n, int(environ.get(local_rank, environ[rank])),
                            int(environ.get(local_size, n)), launcher)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        world = mpi.COMM_WORLD
        local = world.Split_type(mpi.COMM_TYPE_SHARED)
        return Topology(world.Get_rank(), world.Get_size(), local.Get_rank(), local.Get_size(), "mpi")
    return Topology(0, 1, 0, 1, "single")


def primary_ip():
    """The address other hosts reach this one by (the interface of the default route)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))   # TEST-NET-1: connect() on UDP sends no packet
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def parse_address(text, what="address"):
    """'host:port' -> (host, port), or a ConfigError that says what was expected."""
    from commlib.errors import ConfigError
    host, sep, port = str(text).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{what} {text!r} must read host:port, e.g. 127.0.0.1:9099")
    return host, int(port)
