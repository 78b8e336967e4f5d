"""What a backend sees of the job: who it is, the settings, the engine, and `exchange`."""
import threading
import time
from dataclasses import dataclass, field

from commlib.errors import CommTimeout


@dataclass
class Context:
    rank: int
    size: int
    local_rank: int
    local_size: int
    settings: object                 # commlib.settings.Settings
    exchange_fn: object              # (key, value, timeout) -> list of every rank's value
    engine: object = None            # commlib.engine.Engine: the existing ring engine (may be None in unit tests)
    job_token: str = ""              # random hex, identical on every rank of the job
    counters: dict = field(default_factory=dict)

    @property
    def all_local(self):
        """Every rank runs on this host, so embedded switches/aggregators on loopback work."""
        return self.local_size == self.size

    def exchange(self, key, value, timeout=None):
        """Allgather of a small JSON-able value: returns [value of rank 0, ..., rank size-1].
        Every rank must call it with the same key; raises CommTimeout / PeerFailure."""
        return self.exchange_fn(key, value, self.settings.timeout_s if timeout is None else timeout)

    def barrier(self, key):
        self.exchange(f"barrier/{key}", None)

    def scope(self, name):
        """A prefix for one backend instance's exchange keys, the same on every rank (ranks
        build backends in the same order), distinct from every other instance's."""
        number = self.counters.get(("scope", name), 0)
        self.counters[("scope", name)] = number + 1
        return f"{name}/{number}"


class LocalGroup:
    """`size` contexts for ranks that are threads of one process (unit tests of backends)."""

    def __init__(self, size, settings, job_token="local-test-token"):
        self.size = size
        self._lock = threading.Condition()
        self._values = {}
        self.contexts = [Context(rank, size, rank, size, settings, self._exchanger(rank), job_token=job_token)
                         for rank in range(size)]

    def run(self, fn, timeout=60.0):
        """fn(ctx) on every rank, each in its own thread; the results by rank. The first rank's
        exception is re-raised; a rank still running after `timeout` is a CommTimeout."""
        results, errors = [None] * self.size, [None] * self.size

        def rank_main(rank):
            try:
                results[rank] = fn(self.contexts[rank])
            except BaseException as exc:   # handed to the caller below
                errors[rank] = exc
        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(self.size)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, thread in enumerate(threads) if thread.is_alive()]
        if stuck:
            raise CommTimeout(f"ranks {stuck} still running after {timeout}s")
        for error in errors:
            if error is not None:
                raise error
        return results

    def _exchanger(self, rank):
        def exchange(key, value, timeout):
            with self._lock:
                slot = self._values.setdefault(key, {})
                slot[rank] = value
                self._lock.notify_all()
                if not self._lock.wait_for(lambda: len(slot) == self.size, timeout):
                    missing = sorted(set(range(self.size)) - set(slot))
                    raise CommTimeout(f"exchange {key!r}: ranks {missing} did not arrive within {timeout}s")
                return [slot[r] for r in range(self.size)]
        return exchange
