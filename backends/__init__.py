"""Algorithms behind one interface (base.Backend). Every module here that defines a Backend
subclass with a `name` registers itself by being imported; a backend defined elsewhere registers
with `@register` too. Each declares the kinds of data it carries and its place among their
carriers (`Backend.carries`): dispatch and the policies read the order from here, so a new
algorithm is one module (backends/IMPLEMENTING.md)."""
import importlib
import logging
import pkgutil

from commlib.backends.base import Backend, TensorMeta
from commlib.errors import CommError, ConfigError

log = logging.getLogger("commlib")
_REGISTRY = {}
_scanned = []   # this package's modules imported once
KINDS = ("dense", "summable", "sparse", "gather", "rows")   # see Backend.carries


def register(cls):
    """Class decorator: make a Backend selectable by its name, and a carrier of what it `carries`."""
    unknown = set(cls.carries) - set(KINDS)
    if not cls.name or unknown:
        raise ConfigError(f"backend {cls.__name__}: needs a name and carries only {KINDS} (got {sorted(unknown)})")
    _REGISTRY[cls.name] = cls
    return cls


def registry():
    """Every backend, after importing each module of this package once (a module imported on
    its own before, e.g. by a test, must not hide the others)."""
    if not _scanned:
        for module in pkgutil.iter_modules(__path__):
            if module.name != "base" and not module.name.startswith("_"):
                importlib.import_module(f"{__name__}.{module.name}")
        _scanned.append(True)
    return dict(_REGISTRY)


def carriers(kind):
    """The algorithms that carry this kind of data, best first (each backend's `carries` place;
    equal places in name order)."""
    return tuple(name for _, name in sorted((cls.carries[kind], name) for name, cls in registry().items()
                                            if kind in cls.carries))


def start_all(ctx):
    """Build and start every backend that can run here, on every rank in the same order; a step that
    fails on any rank makes that backend unavailable on all. Returns ({name: backend}, {name: why})."""
    backends, unavailable = {}, {}
    for name, cls in sorted(registry().items()):
        ok, why = cls.available(ctx)
        if not ok:
            unavailable[name] = why
            continue
        built = []   # this rank's instance, even when another rank's build failed
        try:
            ctx.agree(f"backend/{name}/build", lambda: built.append(cls(ctx)))
            ctx.agree(f"backend/{name}/start", built[0].start)
        except CommError as exc:
            log.warning("commlib: algorithm %s is unavailable: %s", name, exc)
            unavailable[name] = str(exc)
            for backend in built:
                backend.close()
            continue
        backends[name] = built[0]
    return backends, unavailable


__all__ = ["Backend", "KINDS", "TensorMeta", "carriers", "register", "registry", "start_all"]
