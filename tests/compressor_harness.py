"""N ranks in one process for compressor tests: each rank is a thread with its own compressor,
and FakeComm's collectives meet at a condition variable, as the core's `comm` would over the
network. A rank that fails aborts the group, so the others fail fast instead of hanging.

    outs = run_ranks(4, lambda rank, comm: compressor[rank].reduce(x[rank], "w", comm, True), "allgather")
"""
import threading

import numpy as np

from commlib.errors import CommTimeout, Mismatch, PeerFailure


class Group:
    """Collectives of `size` thread-ranks. The i-th collective call of every rank pairs up."""

    def __init__(self, size, algorithm="allgather", timeout=20.0):
        self.size, self.algorithm, self.timeout = size, algorithm, timeout
        self._cond = threading.Condition()
        self._slots, self._calls = {}, [0] * size
        self._aborted = None
        self.log = []   # (rank, op, dtype, nbytes) of every call: what went on the wire

    def comm(self, rank):
        return FakeComm(self, rank)

    def abort(self, why):
        with self._cond:
            self._aborted = why
            self._cond.notify_all()

    def collective(self, rank, op, array):
        if not isinstance(array, np.ndarray) or array.ndim != 1:
            raise TypeError(f"rank {rank}: comm.{op} takes a 1-D numpy array, got {type(array).__name__} "
                            f"{getattr(array, 'shape', '')}")
        with self._cond:
            seq = self._calls[rank]
            self._calls[rank] += 1
            self.log.append((rank, op, array.dtype, array.nbytes))
            slot = self._slots.setdefault(seq, {"op": op, "data": {}, "read": 0})
            if slot["op"] != op:
                raise Mismatch(f"collective #{seq}: rank {rank} calls {op}, another rank {slot['op']}")
            slot["data"][rank] = array.copy()
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: len(slot["data"]) == self.size or self._aborted, self.timeout)
            if self._aborted:
                raise PeerFailure(f"rank {rank}: another rank failed: {self._aborted}")
            if not done:
                missing = sorted(set(range(self.size)) - set(slot["data"]))
                raise CommTimeout(f"collective #{seq} ({op}): ranks {missing} never called")
            data = [slot["data"][r] for r in range(self.size)]
            slot["read"] += 1
            if slot["read"] == self.size:
                del self._slots[seq]
        if op == "allgather":
            return [d.copy() for d in data]
        if len({(d.dtype, d.size) for d in data}) != 1:
            raise Mismatch(f"allreduce #{seq}: ranks disagree on dtype/size {[(d.dtype, d.size) for d in data]}")
        return np.sum(data, axis=0, dtype=data[0].dtype)


class FakeComm:
    """What the core hands a compressor: rank, size, algorithm, allreduce (sum), allgather."""

    def __init__(self, group, rank):
        self.group, self.rank, self.size, self.algorithm = group, rank, group.size, group.algorithm

    def allreduce(self, array):
        return self.group.collective(self.rank, "allreduce", array)

    def allgather(self, array):
        return self.group.collective(self.rank, "allgather", array)


def run_ranks(size, fn, algorithm="allgather", timeout=30.0, group=None):
    """Run fn(rank, comm) on `size` thread-ranks; returns their results by rank, re-raises the
    first failure, and fails (never hangs) when a rank does not finish within `timeout`."""
    group = group or Group(size, algorithm, timeout=timeout)
    results, errors = [None] * size, [None] * size

    def main(rank):
        try:
            results[rank] = fn(rank, group.comm(rank))
        except BaseException as exc:   # noqa: B902 - reported below
            errors[rank] = exc
            group.abort(f"rank {rank}: {exc!r}")

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        group.abort("test timeout")
        raise AssertionError(f"ranks {hung} did not finish within {timeout}s")
    first = next((e for e in errors if e is not None and not isinstance(e, PeerFailure)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
