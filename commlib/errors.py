"""The one error hierarchy of commlib. Every message says what to do about it."""


class CommError(RuntimeError):
    """Base of every commlib error."""


class ConfigError(CommError, ValueError):
    """A setting, policy rule or argument is invalid."""


class CommTimeout(CommError, TimeoutError):
    """A wait ran past its timeout (a rank that never calls, a dead peer, a lost switch)."""


class Mismatch(CommError):
    """Ranks disagree about a tensor (name, shape, dtype, algorithm or op)."""


class BackendUnavailable(CommError):
    """The chosen algorithm cannot run here (not built, not configured, or unsupported input)."""


class InvalidTensor(CommError, ValueError):
    """Input the algorithm cannot reduce faithfully: unsupported dtype, NaN/Inf where rejected."""


class PeerFailure(CommError):
    """Another rank, the controller, a switch or an aggregator went away."""
