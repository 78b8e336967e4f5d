"""Handles: what an asynchronous allreduce returns, resolved by the background thread."""
import threading

from commlib.errors import CommTimeout


class Handle:
    """The result of an asynchronous allreduce: `synchronize(handle)` or `poll(handle)`."""

    __slots__ = ("name", "_event", "_result", "_error", "_timeout")

    def __init__(self, name, timeout):
        self.name, self._timeout = name, timeout
        self._event = threading.Event()
        self._result = self._error = None

    def set(self, result=None, error=None):
        self._result, self._error = result, error
        self._event.set()

    def done(self):
        return self._event.is_set()

    def wait(self):
        if not self._event.wait(self._timeout):
            raise CommTimeout(f"tensor {self.name!r} got no result within {self._timeout:.0f}s; "
                              f"a peer, the switch or an aggregator is stuck (see the other ranks' output)")
        if self._error is not None:
            raise self._error.with_traceback(None)   # one error may fail many handles: no piling tracebacks
        return self._result
