"""Process sets: reducing over a subset of the job's ranks, as Horovod's `process_set=` does.

A set is a job of its own among its ranks. The first time its ranks use it (or at
`commlib.add_process_set`), they meet through the job's controller (an exchange among them only),
the set's first rank serves the set's own controller, the ring engine forms a subgroup (commlib's
Gloo ring among them, Horovod's process set, torch.distributed.new_group or MPI Create_group),
and every backend starts for the set: SwitchML registers the set as its own job (on the configured
switch, or on one the set's first rank embeds, keyed with the job's secret as the job's own
embedded switch is), OmniReduce starts the set's own aggregators. The set's tensors are negotiated by its own
controller and run on its own executor thread, so sets run at the same time as each other and
as the whole job. Ranks form a set only with its other ranks, in the same order (as Horovod).
"""
import logging
import socket
import threading

from commlib import bootstrap
from commlib.context import Context
from commlib.errors import CommError, ConfigError

log = logging.getLogger("commlib")


class ProcessSet:
    """commlib's process set, for jobs without Horovod (Horovod's hvd.ProcessSet works alike):
    the job ranks a tensor is reduced over."""

    def __init__(self, ranks):
        ranks = list(ranks)
        if not ranks or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks) \
                or len(set(ranks)) != len(ranks):
            raise ConfigError(f"ProcessSet({ranks!r}): give a non-empty list of distinct ranks (ints >= 0)")
        self.ranks = sorted(ranks)

    def included(self):
        """Is this rank in the set?"""
        from commlib import api
        return api.rank() in self.ranks

    def rank(self):
        """This rank's index in the set (None when it is not in it)."""
        from commlib import api
        return self.ranks.index(api.rank()) if self.included() else None

    def size(self):
        return len(self.ranks)

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and other.ranks == self.ranks

    def __hash__(self):
        return hash(tuple(self.ranks))

    def __repr__(self):
        return f"commlib.ProcessSet({self.ranks})"


def ranks_of(process_set, size):
    """The sorted ranks of a commlib or Horovod process set; None for the whole job (None, Horovod's
    global_process_set, or a set of every rank)."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:   # 0: Horovod's global set
        return None
    ranks = getattr(process_set, "ranks", None)
    if ranks is None:
        raise ConfigError(f"process_set={process_set!r} has no ranks: pass a commlib.ProcessSet(ranks), or a Horovod "
                          f"ProcessSet registered with hvd.init(process_sets=...) or hvd.add_process_set")
    ranks = sorted(int(r) for r in ranks)
    if not ranks or ranks[-1] >= size or ranks[0] < 0:
        raise ConfigError(f"process set {ranks} names ranks outside this job of {size} ranks (0..{size - 1})")
    return None if ranks == list(range(size)) else tuple(ranks)


class ProcessSets:
    """The sets a job's Runtime formed on this rank, by their ranks."""

    def __init__(self, parent):
        self.parent = parent
        self._runtimes = {}
        self._lock = threading.Lock()

    def runtime(self, process_set):
        """The Runtime that reduces over `process_set` (the job's own for None or every rank)."""
        ranks = ranks_of(process_set, self.parent.ctx.size)
        if ranks is None:
            return self.parent
        rank = self.parent.ctx.rank
        if rank not in ranks:
            raise ConfigError(f"rank {rank} reduced a tensor over process set {list(ranks)}, which it is not in: only "
                              f"the set's ranks may (check process_set.included() first)")
        with self._lock:
            if ranks not in self._runtimes:
                hvd_set = None if isinstance(process_set, ProcessSet) else process_set
                self._runtimes[ranks] = form(self.parent, ranks, hvd_set)
            return self._runtimes[ranks]

    def runtimes(self):
        with self._lock:
            return list(self._runtimes.values())

    def shutdown(self, error=None):
        with self._lock:
            runtimes, self._runtimes = list(self._runtimes.values()), {}
        for runtime in reversed(runtimes):
            runtime.shutdown(error)


def form(parent, ranks, hvd_set=None):
    """The set's Runtime on this rank (one of `ranks`): its own controller, ring and backends."""
    from commlib.runtime import Runtime   # runtime imports this module
    s, key = parent.settings, "process_set/" + ",".join(map(str, ranks))

    def meet(step, value):   # an exchange among the set's ranks through the job's controller
        return parent.client.exchange(f"{key}/{step}", value, s.timeout_s, ranks=ranks)

    me = ranks.index(parent.ctx.rank)
    hosts = meet("hosts", socket.gethostname())
    local = [i for i, host in enumerate(hosts) if host == hosts[me]]
    placement = Context(me, len(ranks), local.index(me), len(local), parent.ctx.launcher)
    settings = s.replaced(controller_addr="")   # the set's controller: its first rank serves it
    # the job's secret (the daemon key of the switch and aggregators) never travels through a controller
    server, client, _ = bootstrap.start_controller(settings, placement, lambda address: meet("controller", address)[0],
                                                   secret=parent.ctx.secret)
    ctx = placement.joined(settings=settings, exchange_fn=client.exchange, job_token=client.token,
                           secret=parent.ctx.secret)
    try:
        engine = ctx.agree("process_set/ring", parent.ctx.engine.subgroup, ctx, ranks, hvd_set)
    except CommError as exc:   # the set goes on without the ring; records say why
        log.warning("commlib: process set %s has no ring: %s", list(ranks), exc)
        engine = None
    return Runtime(settings, parent.dispatcher.policy, job=(ctx.joined(engine=engine), client, server), parent=parent)

