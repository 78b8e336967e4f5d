"""The Horovod optimizer options commlib's front-ends accept, checked the same way for every framework."""
from commlib.errors import ConfigError


def check(hvd, op, horovod_kwargs):
    """The op to use (Horovod's Average when None), or a ConfigError for what commlib does not do."""
    op = hvd.Average if op is None else op
    if op not in (hvd.Average, hvd.Sum):
        raise ConfigError("commlib reduces with op=hvd.Average or hvd.Sum; for Adasum use Horovod's own "
                          "hvd.DistributedOptimizer")
    if horovod_kwargs.get("groups") or horovod_kwargs.get("num_groups"):
        raise ConfigError("grouped allreduce (groups=, num_groups=) is Horovod's own fusion; commlib fuses by "
                          "itself (COMMLIB_FUSION_THRESHOLD), so leave groups unset")
    process_set = horovod_kwargs.get("process_set")
    if process_set is not None and (not isinstance(process_set, hvd.ProcessSet) or process_set.process_set_id is None):
        raise ConfigError(f"process_set={process_set}: Horovod's optimizer needs a Horovod ProcessSet registered "
                          f"with hvd.init(process_sets=[...]) or hvd.add_process_set(...) (commlib then reduces "
                          f"over the same ranks)")
    return op
