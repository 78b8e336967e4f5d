"""Process sets: reducing over a subset of the job's ranks, as Horovod's `process_set=` does.

A set is a job of its own among its ranks (commlib.bootstrap.join_set, commlib.runtime.ProcessSets).
The first time its ranks use it (or at `commlib.add_process_set`), they meet through the job's
controller (an exchange among them only),
the set's first rank serves the set's own controller, the ring engine forms a subgroup (commlib's
Gloo ring among them, Horovod's process set, torch.distributed.new_group or MPI Create_group),
and every backend starts for the set: SwitchML registers the set as its own job (on the configured
switch, or on one the set's first rank embeds, keyed with the job's secret as the job's own
embedded switch is), OmniReduce starts the set's own aggregators. The set's tensors are negotiated by its own
controller and run on its own executor thread, so sets run at the same time as each other and
as the whole job. Ranks form a set only with its other ranks, in the same order (as Horovod).
"""
from commlib.context import detect
from commlib.errors import ConfigError


class ProcessSet:
    """commlib's process set, for jobs without Horovod (Horovod's hvd.ProcessSet works alike):
    the job ranks a tensor is reduced over."""

    def __init__(self, ranks):
        ranks = list(ranks)
        if not ranks or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks) \
                or len(set(ranks)) != len(ranks):
            raise ConfigError(f"ProcessSet({ranks!r}): give a non-empty list of distinct ranks (ints >= 0)")
        self.ranks = sorted(ranks)
        self.context = None   # the job's Context, once the job used or added the set

    def _job_rank(self):
        return (self.context or detect()).rank   # before the job used it: the launcher's placement

    def included(self):
        """Is this rank in the set?"""
        return self._job_rank() in self.ranks

    def rank(self):
        """This rank's index in the set (None when it is not in it)."""
        return self.ranks.index(self._job_rank()) if self.included() else None

    def size(self):
        return len(self.ranks)

    def __eq__(self, other):   # the ranks alone: the same set in any job
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
