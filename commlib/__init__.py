"""commlib: the communication layer data-parallel training reaches for when the network is the
bottleneck. Each gradient is dispatched to SwitchML in-network aggregation, OmniReduce sparse
block allreduce, a GRACE-style compressor, or a ring allreduce through Horovod/MPI.

    import commlib
    commlib.init()                                   # rank/size from horovodrun, mpirun, torchrun
    avg = commlib.allreduce(tensor, name="grad.w")   # policy picks the algorithm
"""
from commlib.api import (Average, Handle, Max, Min, Product, ProcessSet, Sum, add_process_set, allreduce, allreduce_async, backend_stats,
                          grouped_allreduce, grouped_allreduce_async, init,
                          is_initialized, join, local_rank, local_size, poll, rank, records, shutdown, size,
                          start_timeline, stop_timeline, synchronize)
from commlib.errors import (BackendUnavailable, CollectiveFailure, CommError, CommTimeout, ConfigError, InvalidTensor,
                            Mismatch, PeerFailure)
from commlib.policy import Policy, Rule

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async", "synchronize", "poll", "join", "Handle", "Sum", "Average", "Min", "Max", "Product", "Policy", "Rule",
    "records", "backend_stats", "start_timeline", "stop_timeline", "ProcessSet", "add_process_set",
    "CommError", "CommTimeout", "Mismatch", "BackendUnavailable", "ConfigError", "InvalidTensor", "PeerFailure",
    "CollectiveFailure",
]
