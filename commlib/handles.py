"""Handles: what an asynchronous allreduce returns, resolved by the background thread."""
import threading
import time

from commlib.errors import CommTimeout

WAIT_SLICE_S = 1.0


def when_all(handles, fn):
    """fn() once every handle has its result or error, on the thread that resolves the last one
    (Handle.add_done_callback): a caller's Future completes without a thread of its own waiting."""
    left, lock = [len(handles)], threading.Lock()

    def one_done(_):
        with lock:
            left[0] -= 1
            if left[0]:
                return
        fn()

    for handle in handles:
        handle.add_done_callback(one_done)


class Handle:
    """The result of an asynchronous allreduce: `synchronize(handle)` or `poll(handle)`."""

    __slots__ = ("name", "_latch", "_set", "_result", "_error", "_timeout", "_restore", "_then", "_callbacks",
                 "_lock", "_on_wait")

    def __init__(self, name, timeout, on_wait=None):
        """on_wait: called (without arguments) when a caller is about to wait for the result, which
        is not in yet: the client sends what it holds for the cycle at once (see hurry)."""
        self.name, self._timeout, self._on_wait = name, timeout, on_wait
        # a lock held until the result is in, not a threading.Event (a Condition and a deque per tensor):
        # a waiter acquires it and passes it on
        self._latch = threading.Lock()
        self._latch.acquire()
        self._set = False
        self._result = self._error = self._restore = self._then = self._callbacks = None   # a list once asked for
        self._lock = threading.Lock()

    def set(self, result=None, error=None, restore=None):
        """restore: applied to `result` once, on the thread that first waits for it: a torch call
        releases the GIL, and taking it back behind a busy caller costs commlib's background thread
        tens of us per tensor; the caller, about to wait, pays it cheaply (see tensors._HostView)."""
        with self._lock:
            self._result, self._error, self._restore = result, error, restore
            if not self._set:
                self._set = True
                self._latch.release()
            callbacks, self._callbacks = self._callbacks or (), None
        for fn in callbacks:
            fn(self)

    def add_done_callback(self, fn):
        """fn(handle) once the result or error is in: now if it is, else on the thread that sets it
        (commlib's background thread: keep fn short, as torch's Future.then callbacks)."""
        with self._lock:
            if not self._set:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def then(self, fn):
        """Apply fn to the result once, when the caller first waits for it."""
        self._then = fn

    def hurry(self):
        """Its caller waits for it next: what the client holds back to send once per cycle goes now, and
        the controller releases it at once (a caller that knows it will wait submits hurried: api.submit)."""
        if self._on_wait is not None and not self._set:
            self._on_wait()

    def done(self, wait_s=0.0):
        """True when the result or error is in (waiting up to wait_s for it)."""
        return self._set or (bool(wait_s) and self._wait(wait_s))

    def _wait(self, timeout):
        """Whether the result came within `timeout` seconds (None: however long it takes). The latch is
        taken in slices: a waiter interrupted between taking and passing it on (Ctrl-C) delays the
        others by one slice at most, never strands them."""
        if self._set:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        self.hurry()
        while not self._set:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                return False
            if self._latch.acquire(timeout=left):
                self._latch.release()   # the next waiter's turn
                return True
        return True

    def wait(self, restored=True):
        """The result, or its error. restored=False: the backend's host array while its restore is
        pending (commlib's own callbacks that only read it: no torch call), else the result."""
        if not self._wait(self._timeout):
            raise CommTimeout(f"tensor {self.name!r} got no result within {self._timeout:.0f}s; "
                              f"a peer, the switch or an aggregator is stuck (see the other ranks' output)")
        if self._error is not None:
            raise self._error.with_traceback(None)   # one error may fail many handles: no piling tracebacks
        if not restored:
            return self._result
        if self._restore is not None or self._then is not None:
            with self._lock:   # once, however many threads wait
                if self._restore is not None:
                    self._result, self._restore = self._restore(self._result), None
                if self._then is not None:
                    self._result, self._then = self._then(self._result), None
        return self._result
