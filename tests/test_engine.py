"""commlib/engine.py: the RendezvousEngine (commlib's set-up without hvd.init()) over the key-value
store horovodrun serves."""
import itertools
import threading

import numpy as np
import pytest
from horovod.runner.http.http_server import KVStoreServer

from commlib.engine import RendezvousEngine
from commlib.errors import PeerFailure


def store_env(port, rank, size=2):
    return {"HOROVOD_SIZE": str(size), "HOROVOD_RANK": str(rank), "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)}


def test_rendezvous_engine_over_horovods_own_store():
    """commlib's set-up without hvd.init(): an allgather and a broadcast through the key-value store
    horovodrun serves (Horovod's own server class), ranks as threads; a dead store is a clear error."""
    server = KVStoreServer(verbose=0)
    port = server.start_server()
    out = {}

    def rank_main(rank):   # each rank its own count of calls, as in a process of its own
        engine = type("Rank", (RendezvousEngine,), {"_calls": itertools.count()})(10.0, store_env(port, rank))
        gathered = engine.allgather(np.arange(3, dtype=np.uint8) + rank, "keys")
        out[rank] = ([g.tolist() for g in gathered], engine.broadcast_object(["addr", rank] if rank == 0 else None))
    try:
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in (1, 0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        server.shutdown_server()
    assert out == {r: ([[0, 1, 2], [1, 2, 3]], ["addr", 0]) for r in (0, 1)}, out
    with pytest.raises(PeerFailure, match="rendezvous store .* failed during commlib.init"):
        RendezvousEngine(2.0, store_env(port, 0)).broadcast_object("x")
