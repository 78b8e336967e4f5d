"""Settings: keyword arguments, overridden by COMMLIB_<NAME> environment variables.

Each module declares the settings it reads with `define()` at import time (the core here, each
backend in its own module), so there is one place per setting and unknown names are an error.
"""
import logging
import os
from dataclasses import dataclass

from commlib.errors import ConfigError

log = logging.getLogger("commlib")


@dataclass(frozen=True)
class Setting:
    name: str
    default: object
    help: str
    per_rank: bool = False   # may differ between ranks (a path, a local address); others must agree
    most: float = None       # a number's largest value (and its least: above 0), where it has one

    def parse(self, text):
        kind = type(self.default)
        try:
            if kind is bool:
                if text.lower() in ("1", "true", "yes", "on"):
                    return True
                if text.lower() in ("0", "false", "no", "off", ""):
                    return False
                raise ValueError(text)
            return kind(text)
        except ValueError:
            raise ConfigError(f"COMMLIB_{self.name.upper()}={text!r} is not a valid {kind.__name__} ({self.help})") from None


_DEFINED = {}


def define(name, default, help, per_rank=False, most=None):
    """Declare a setting (idempotent for identical re-definitions). Settings must be equal on
    every rank (commlib.init checks) unless per_rank=True. most: a number's bounds, (0, most]."""
    if name.startswith("_") or hasattr(Settings, name):   # values are attributes of a Settings: no shadowing
        raise ConfigError(f"setting {name!r} would hide Settings.{name}; choose another name")
    setting = Setting(name, default, help, per_rank, most)
    if _DEFINED.get(name, setting) != setting:
        raise ConfigError(f"setting {name!r} is defined twice with different defaults")
    _DEFINED[name] = setting
    return setting


def defined():
    return dict(_DEFINED)


class Settings:
    """Resolved values: COMMLIB_<NAME> > keyword > default, so a launcher's environment (exported
    before horovodrun, or mpirun -x) can retune a script without editing it. Read as attributes."""

    def __init__(self, overrides=None, environ=None):
        environ = os.environ if environ is None else environ
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(_DEFINED))
        if unknown:
            raise ConfigError(f"unknown setting(s) {unknown}; known settings: {sorted(_DEFINED)}")
        stray = sorted(key for key in environ if key.startswith("COMMLIB_") and key[8:].lower() not in _DEFINED)
        if stray:   # a misspelt variable would otherwise be ignored without a word
            log.warning("commlib: ignoring unknown environment variable(s) %s; `python -m commlib` lists the "
                        "settings", ", ".join(stray))
        values = {}
        for name, setting in _DEFINED.items():
            if f"COMMLIB_{name.upper()}" in environ:
                value = setting.parse(environ[f"COMMLIB_{name.upper()}"])
            elif name in overrides:
                value = overrides[name]
                if isinstance(value, str) and not isinstance(setting.default, str):
                    value = setting.parse(value)
            else:
                value = setting.default
            if setting.most is not None and not (isinstance(value, (int, float)) and 0 < value <= setting.most):
                raise ConfigError(f"{name}={value!r}: must be above 0 and at most {setting.most:g} ({setting.help})")
            values[name] = value
        self._take(values)

    def _take(self, values):
        self._values = values
        self.__dict__.update(values)   # plain attributes: read on every tensor, __getattr__ costs 10x

    def __getattr__(self, name):
        if name.startswith("_"):   # copy and pickle look for __reduce_ex__ and the like before _values exists
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no setting {name!r}; declare it with commlib.settings.define()") from None

    def replaced(self, **values):
        """A copy with these values (a process set's job: the parent's switch, its own controller)."""
        copy = object.__new__(Settings)
        copy._take(dict(self._values, **values))
        return copy

    def as_dict(self):
        return dict(self._values)

    def __repr__(self):
        return f"Settings({self._values})"


define("policy", "*=auto", "dispatch rules 'pattern=algorithm[:compressor];...' (see commlib.Policy)")
define("fusion_threshold", 64 * 1024 * 1024, "bytes: small tensors are fused into buckets up to this size (0 disables)")
define("cycle_time_ms", 1.0, "how often the controller releases a batch of negotiated tensors")
LONGEST_WAIT_S = 1e6   # 11.6 days (a selector's wait overflows past about 24)
define("timeout_s", 60.0, "every wait on the network (data, switch, aggregators, set-up) gives up after this many "
       "seconds", most=LONGEST_WAIT_S)
define("negotiation_timeout_s", 600.0, "a tensor some ranks submitted but others did not within this many seconds "
       "is an error on every rank (a rank that never calls)", most=LONGEST_WAIT_S)
define("stall_warning_s", 60.0, "warn (naming the missing ranks) when a tensor waits this long for other ranks")
define("controller_addr", "", "host:port of the negotiation controller (default: rendezvous through the launcher)")
define("controller_host", "", "address rank 0 binds the controller to (default: 127.0.0.1 when all ranks are local)",
       per_rank=True)
define("ring_engine", "auto", "engine for the ring backend: auto, gloo, horovod, horovod_tensorflow, mpi, torch or local")
define("auto_sparse_density", 0.25, "policy 'auto': tensors whose block density is below this go to omnireduce")
define("auto_sparse_min_bytes", 64 * 1024, "policy 'auto': smaller tensors are not measured for density and stay "
       "dense (their zero blocks save less than a collective of their own costs)")
define("timeline", "", "path of a Chrome trace (chrome://tracing) of every tensor's stages; '{rank}' in the path "
       "gives one file per rank, else rank 0 writes it", per_rank=True)
