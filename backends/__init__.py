"""Algorithms behind one interface (base.Backend). Every module here that defines a Backend
subclass with a `name` registers itself by being imported."""
import importlib
import pkgutil

from commlib.backends.base import Backend, TensorMeta

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


__all__ = ["Backend", "TensorMeta", "register", "registry"]
