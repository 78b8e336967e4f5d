"""What commlib's front-ends share about Horovod: the optimizer options they accept, checked the same way
for every framework, and the Horovod names they give beside their own."""
import importlib

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


def names_of(module, owner, hint="run `make install`"):
    """A front-end's module __getattr__: the public names of Horovod's `module` (horovod.torch, ...) beside
    `owner`'s own, so a Horovod script changes its import only. Where that module cannot be imported it is
    still an AttributeError (hasattr() and getattr(..., default) must not raise), saying what to do (`hint`)."""
    def __getattr__(name):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            hvd = importlib.import_module(module)
        except Exception as exc:   # absent (ImportError), or built against another framework (its ops fail to load)
            raise AttributeError(f"{owner}.{name} would be {module}'s, which cannot be imported here ({exc}); "
                                 f"{hint}") from None
        try:
            return getattr(hvd, name)
        except AttributeError:
            raise AttributeError(f"module {owner!r} has no attribute {name!r}, nor has {module}") from None
    return __getattr__
