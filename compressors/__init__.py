"""GRACE-style gradient compressors, written once on torch, for torch tensors and numpy arrays.

    compression = resolve("topk(ratio=0.01)")   # or a name, a GRACE params dict, an object, None
    compression.payload                          # "summable" | "sparse" | "gather"
    compression.carriers()                       # the algorithms that can carry it (commlib.dispatch)
    outs = compression.reduce_bucket(tensors, names, channel, average)   # one collective per bucket

One module per method registers itself with @register; see IMPLEMENTING.md for the contracts.
Importing this package is cheap: torch and the methods load on first use.
"""
import importlib
import pkgutil

_INFRASTRUCTURE = {"base", "packing", "spec", "memory", "sidco"}
_EXPORTS = {
    "base": ("Compressor", "Memory", "Ctx", "register", "make_memory"),
    "spec": ("resolve", "from_params", "build", "parse", "resolved", "state_dict", "load_state_dict"),
}
_loaded = False


def _load():
    """Import every method module once (each registers its classes)."""
    global _loaded
    if not _loaded:
        importlib.import_module(f"{__name__}.memory")
        for module in pkgutil.iter_modules(__path__):
            if module.name not in _INFRASTRUCTURE and not module.name.startswith("_"):
                importlib.import_module(f"{__name__}.{module.name}")
        _loaded = True


def resolve(spec):
    """None for no compression (None, "none", ""); otherwise the shared object for the spec.
    Raises commlib.errors.ConfigError naming the known compressors/parameters."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "none")):
        return None
    _load()
    return importlib.import_module(f"{__name__}.spec").resolve(spec)


def from_params(params):
    """GRACE's grace_from_params: {'compressor', 'memory', 'communicator', 'compress_ratio', ...}."""
    _load()
    return importlib.import_module(f"{__name__}.spec").from_params(params)


def compressors():
    """{name: class} of every registered compressor."""
    _load()
    return dict(importlib.import_module(f"{__name__}.base")._COMPRESSORS)


def memories():
    """{name: class} of every registered memory."""
    _load()
    return dict(importlib.import_module(f"{__name__}.base")._MEMORIES)


def __getattr__(attr):
    for module, names in _EXPORTS.items():
        if attr in names:
            _load()
            return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = ["resolve", "from_params", "compressors", "memories"] + [n for v in _EXPORTS.values() for n in v]
