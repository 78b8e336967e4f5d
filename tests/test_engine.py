"""commlib/engine.py: the RendezvousEngine (commlib's set-up without hvd.init()) over the key-value
store horovodrun serves; how a Gloo collective is waited for."""
import datetime
import itertools
import threading

import numpy as np
import pytest
from horovod.runner.http.http_server import KVStoreServer

from commlib.engine import POLL_FOR_S, POLL_S, RendezvousEngine, finished
from commlib.errors import PeerFailure


def store_env(port, rank, size=2):
    return {"HOROVOD_SIZE": str(size), "HOROVOD_RANK": str(rank), "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)}


def test_rendezvous_engine_over_horovods_own_store():
    """commlib's set-up without hvd.init(): an allgather through the key-value store
    horovodrun serves (Horovod's own server class), ranks as threads; a dead store is a clear error."""
    server = KVStoreServer(verbose=0)
    port = server.start_server()
    out = {}

    def rank_main(rank):   # each rank its own count of calls, as in a process of its own
        engine = type("Rank", (RendezvousEngine,), {"_calls": itertools.count()})(10.0, store_env(port, rank))
        gathered = engine.allgather(np.arange(3, dtype=np.uint8) + rank, "keys")
        out[rank] = [g.tolist() for g in gathered]
    try:
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in (1, 0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        server.shutdown_server()
    assert out == {r: [[0, 1, 2], [1, 2, 3]] for r in (0, 1)}, out
    with pytest.raises(PeerFailure, match="rendezvous store .* failed during commlib.init"):
        RendezvousEngine(2.0, store_env(port, 0)).allgather(np.arange(3, dtype=np.uint8), "dead")


class Work:
    """A torch.distributed Work that completes on its `polls`-th is_completed(), with `error` if given."""

    def __init__(self, polls, error=None):
        self.polls, self.error, self.waited = polls, error, False

    def is_completed(self):
        self.polls -= 1
        return self.polls <= 0

    def wait(self):
        self.waited = True
        if self.error:
            raise self.error


def test_a_collective_is_waited_for_by_polling_and_its_error_raised():
    """engine.finished polls a Work to its end for a while (a thread blocked in Gloo's wait is woken
    late on a busy host), then takes its result or error through Work.wait."""
    work = Work(polls=3)
    finished(work)
    assert (work.polls, work.waited) == (0, True)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        finished(Work(polls=2, error=RuntimeError("[gloo] Connection closed by peer")))
    endless = Work(polls=10 ** 9)   # a long wait (a late peer) ends in Work.wait, not in polls
    finished(endless)
    assert endless.waited and 10 ** 9 - endless.polls <= POLL_FOR_S / POLL_S + 1


def test_a_real_gloo_collective_through_finished():
    import torch
    import torch.distributed as dist
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = datetime.timedelta(seconds=10)
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, options)
    tensor = torch.arange(4.0)
    finished(group.allreduce([tensor]))
    assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]
