"""Testing utilities, for commlib's tests and for users testing their own backends or jobs.

LocalGroup: the ranks of a job as threads of one process (in the manner of Gloo's tests), for unit
tests of backends and anything else that takes a Context:

    group = LocalGroup(4, Settings({"timeout_s": 5}))
    sums = group.run(lambda ctx: MyBackend(ctx).allreduce(np.full(8, ctx.rank, np.int32), "t"))

report: in a multi-process job, each rank prints its result as one JSON line, which the launching
test parses (`results`) and checks field by field, so a failure says what differed on which rank:

    report(rank=commlib.rank(), sums=[...], error=str(exc))       # in the worker
    for r in results(completed.stdout, 4): assert r["sums"] == expected, r    # in the test
"""
import json
import re
import threading
import time

from commlib.context import Context
from commlib.errors import CommTimeout


class LocalGroup:
    """`size` contexts whose `exchange` meets in this process; one thread per rank in `run`."""

    def __init__(self, size, settings, job_token="local-test-token"):
        self.size = size
        self._lock = threading.Condition()
        self._values = {}
        self.contexts = [Context(rank, size, rank, size, "threads", settings, self._exchanger(rank),
                                 job_token=job_token) for rank in range(size)]

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


RESULT = "COMMLIB-RESULT"


def report(**fields):
    """Print this rank's result (JSON-able fields, one of them `rank`) as one line: one write, so
    launchers that forward output in chunks (mpirun) never split it."""
    import sys
    sys.stdout.write(f"{RESULT} {json.dumps(fields, default=str)}\n")
    sys.stdout.flush()


def results(output, size, silent=()):
    """Every rank's report() in a job's output (launchers may prefix lines, e.g. '[1,0]<stdout>:'),
    as a list indexed by rank (None for the `silent` ranks, which are not expected to report);
    AssertionError with the whole output when another rank did not report."""
    found = {}
    for match in re.finditer(rf"{RESULT} (\{{.*\}})\s*$", output, re.MULTILINE):
        fields = json.loads(match.group(1))
        found[fields["rank"]] = fields
    missing = sorted(set(range(size)) - set(found) - set(silent))
    assert not missing, f"ranks {missing} reported no result; output:\n{output}"
    return [found.get(rank) for rank in range(size)]
