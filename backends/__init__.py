"""Algorithms behind one interface (base.Backend). Every module here that defines a Backend
subclass with a `name` registers itself by being imported."""
import importlib
import logging
import pkgutil

from commlib.backends.base import Backend, TensorMeta
from commlib.errors import CommError

log = logging.getLogger("commlib")
_REGISTRY = {}


def register(cls):
    """Class decorator: make a Backend selectable by its name."""
    _REGISTRY[cls.name] = cls
    return cls


def registry():
    """Every backend, after importing each module of this package once (a module imported on
    its own before, e.g. by a test, must not hide the others)."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base" and not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
    return dict(_REGISTRY)


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


__all__ = ["Backend", "TensorMeta", "register", "registry", "start_all"]
