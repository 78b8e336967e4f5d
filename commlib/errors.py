"""The one error hierarchy of commlib. Every message says what to do about it.

A collective that failed (a timeout, a mismatch, a peer gone) is also Horovod's
HorovodInternalError where Horovod is installed: what Horovod users and `hvd.elastic` catch.
"""
try:
    from horovod.common.exceptions import HorovodInternalError as _CollectiveFailure   # pure Python, cheap
except ImportError:
    class _CollectiveFailure(RuntimeError):
        """Stands in for Horovod's HorovodInternalError where Horovod is not installed."""


class CommError(RuntimeError):
    """Base of every commlib error."""


class ConfigError(CommError, ValueError):
    """A setting, policy rule or argument is invalid."""


class CommTimeout(CommError, TimeoutError, _CollectiveFailure):
    """A wait ran past its timeout (a rank that never calls, a dead peer, a lost switch)."""


class Mismatch(CommError, _CollectiveFailure):
    """Ranks disagree about a tensor (name, shape, dtype, algorithm or op)."""


class BackendUnavailable(CommError):
    """The chosen algorithm cannot run here (not built, not configured, or unsupported input)."""


class InvalidTensor(CommError, ValueError):
    """Input the algorithm cannot reduce faithfully: unsupported dtype, NaN/Inf where rejected."""


class PeerFailure(CommError, _CollectiveFailure):
    """Another rank, the controller, a switch or an aggregator went away."""


class CollectiveFailure(CommError, _CollectiveFailure):
    """An algorithm or its transport failed inside a collective (its own error is the cause): as Horovod's
    failed ops, what `hvd.elastic.run` recovers from."""


# the errors a controller message may name, by their class name
KINDS = {cls.__name__: cls for cls in (CommError, Mismatch, CommTimeout, PeerFailure, ConfigError, InvalidTensor,
                                       BackendUnavailable, CollectiveFailure)}


def error_from(msg):
    """The error of a controller message {"kind", "message"}."""
    return KINDS[msg["kind"]](msg["message"])
