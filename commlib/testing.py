"""Testing utilities, for commlib's tests and for users testing their own backends or jobs.

LocalGroup: the ranks of a job as threads of one process (in the manner of Gloo's tests), for unit
tests of backends and anything else that takes a Context:

    group = LocalGroup(4, Settings({"timeout_s": 5}))
    sums = group.run(lambda ctx: MyBackend(ctx).allreduce(np.full(8, ctx.rank, np.int32), "t"))
    outs = run_ranks(4, lambda rank, channel: compressor[rank].reduce(x[rank], "w", channel, True), "ring")

report: in a multi-process job, each rank prints its result as one JSON line, which the launching
test parses (`results`) and checks field by field, so a failure says what differed on which rank:

    report(rank=commlib.rank(), sums=[...], error=str(exc))       # in the worker
    for r in results(completed.stdout, 4): assert r["sums"] == expected, r    # in the test
"""
import json
import re
import secrets
import threading
import time

import numpy as np

from commlib.backends import registry
from commlib.context import Context
from commlib.errors import CommTimeout, Mismatch, PeerFailure


class LocalGroup:
    """`size` ranks as threads of this process: contexts whose `exchange` meets here, and channels
    (what a compressor's reduce sees) whose collectives meet here; the i-th collective call of
    every rank pairs up. A rank that fails in `run` aborts the group: the others' exchanges and
    collectives raise PeerFailure at once instead of waiting for their timeout."""

    def __init__(self, size, settings=None, job_token="local-test-token", algorithm="allgather", timeout=20.0):
        self.size, self.algorithm, self.timeout = size, algorithm, timeout
        self._cond = threading.Condition()
        self._values, self._slots, self._calls = {}, {}, [0] * size
        self._aborted = None
        self.log = []   # (rank, op, dtype, nbytes) of every collective: what went on the wire
        secret = secrets.token_bytes(32)   # what rank 0 would share through the launcher
        self.contexts = [Context(rank, size, rank, size, "threads", settings, self._exchanger(rank),
                                 job_token=job_token, secret=secret) for rank in range(size)]

    def channel(self, rank):
        return LocalChannel(self, rank)

    def run(self, fn, timeout=60.0):
        """fn(ctx) on every rank, each in its own thread; the results by rank. Re-raises the first
        rank's error (one that is not just another rank's abort, if there is one); a rank still
        running after `timeout` is a CommTimeout."""
        results, errors = [None] * self.size, [None] * self.size
        self._aborted = None   # a group may run again after a run that failed

        def rank_main(rank):
            try:
                results[rank] = fn(self.contexts[rank])
            except BaseException as exc:   # handed to the caller below
                errors[rank] = exc
                self.abort(f"rank {rank}: {exc!r}")
        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(self.size)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, thread in enumerate(threads) if thread.is_alive()]
        if stuck:
            self.abort("test timeout")
            raise CommTimeout(f"ranks {stuck} still running after {timeout}s")
        failed = [e for e in errors if e is not None]
        if failed:
            raise next((e for e in failed if not isinstance(e, PeerFailure)), failed[0])
        return results

    def abort(self, why):
        with self._cond:
            self._aborted = why
            self._cond.notify_all()

    def _meet(self, table, key, rank, value, timeout, what):
        """Put this rank's value under key; every rank's values once all arrived."""
        with self._cond:
            slot = table.setdefault(key, {})
            slot[rank] = value
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: len(slot) == self.size or self._aborted, timeout)
            if self._aborted:
                raise PeerFailure(f"rank {rank}: another rank failed: {self._aborted}")
            if not done:
                missing = sorted(set(range(self.size)) - set(slot))
                raise CommTimeout(f"{what}: ranks {missing} did not arrive within {timeout}s")
            return [slot[r] for r in range(self.size)]

    def _exchanger(self, rank):
        return lambda key, value, timeout: self._meet(self._values, key, rank, value, timeout, f"exchange {key!r}")

    def collective(self, rank, op, array):
        if not isinstance(array, np.ndarray) or array.ndim != 1:
            raise TypeError(f"rank {rank}: channel.{op} takes a 1-D numpy array, got {type(array).__name__} "
                            f"{getattr(array, 'shape', '')}")
        with self._cond:
            seq = self._calls[rank]
            self._calls[rank] += 1
            self.log.append((rank, op, array.dtype, array.nbytes))
        data = self._meet(self._slots, seq, rank, (op, array.copy()), self.timeout, f"collective #{seq} ({op})")
        ops = {o for o, _ in data}
        if len(ops) > 1:
            raise Mismatch(f"collective #{seq}: ranks call different collectives {sorted(ops)}")
        data = [d for _, d in data]
        if op == "allgather":
            return [d.copy() for d in data]
        if len({(d.dtype, d.size) for d in data}) != 1:
            raise Mismatch(f"allreduce #{seq}: ranks disagree on dtype/size {[(d.dtype, d.size) for d in data]}")
        return np.sum(data, axis=0, dtype=data[0].dtype)


class LocalChannel:
    """What the core hands a compressor (commlib.executor.Channel): rank, size, algorithm, sparse
    (the algorithm's allreduce skips zero blocks), allreduce (sum) and allgather, over a LocalGroup."""

    def __init__(self, group, rank):
        self.group, self.rank, self.size, self.algorithm = group, rank, group.size, group.algorithm
        known = registry().get(group.algorithm)
        self.sparse = known is not None and known.sparse

    def allreduce(self, array):
        return self.group.collective(self.rank, "allreduce", array)

    def allgather(self, array):
        return self.group.collective(self.rank, "allgather", array)


def run_ranks(size, fn, algorithm="allgather", timeout=30.0, group=None):
    """fn(rank, channel) on `size` thread-ranks of a LocalGroup; their results by rank."""
    group = group or LocalGroup(size, algorithm=algorithm, timeout=timeout)
    return group.run(lambda ctx: fn(ctx.rank, group.channel(ctx.rank)), timeout)


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


def full_submissions():
    """{name: how many times rank 0's controller got its metadata in full} from now on (empty on the
    other ranks): a name the response cache keeps stops counting. For tests of the cache, after commlib.init()."""
    from commlib.api import runtime
    counts, server = {}, runtime()._server
    if server is not None:
        submit_one = server._submit

        def counted(rank, meta):
            counts[meta["name"]] = counts.get(meta["name"], 0) + 1
            return submit_one(rank, meta)
        server._submit = counted
    return counts
