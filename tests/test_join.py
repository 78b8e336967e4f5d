"""commlib.join (Horovod's hvd.join): ranks whose data runs out at different steps. Each rank's
results are checked against the reduction over the ranks still running that step."""
import queue
import threading
import time

import pytest

from commlib.controller import ControllerClient, ControllerServer
from commlib.release import Release
from launch import spawn



def expected(step, size):
    """tests/workers/join.py: rank r reduces (r + 1) * (step + 1) and runs r + 1 steps."""
    running = [(r + 1) * (step + 1) for r in range(step, size)]
    return {"sums": [float(sum(running))] * 4, "min": float(min(running)), "max": -min(running),
            "average": sum(running) * (1 / size)}   # over the job's size, as Horovod's


@pytest.mark.multiprocess
@pytest.mark.parametrize("policy", ["*=ring", pytest.param("default", marks=pytest.mark.long),
                                    pytest.param("w*=omnireduce", marks=pytest.mark.long),
                                    pytest.param("w*=allgather:topk(ratio=1.0)", marks=pytest.mark.long)])
def test_uneven_ranks_join(policy):
    size = 3
    for result in spawn(size, "join.py", policy, timeout=120).check().results():
        for step, got in enumerate(result["steps"]):
            assert got == expected(step, size), (policy, result["rank"], step, got)
        assert result["last"] == size - 1, f"rank {size - 1} joined last: {result}"
        assert result["after"] == [float(size)] * 4, f"a job goes on after every rank joined: {result}"


@pytest.mark.multiprocess
@pytest.mark.long   # waits out a timeout on purpose
def test_join_fails_when_a_rank_neither_reduces_nor_joins():
    results = spawn(2, "join.py", "timeout", timeout=60, env={"COMMLIB_NEGOTIATION_TIMEOUT_S": "3"}).check().results()
    assert results[0]["error"] == "CommTimeout" and results[0]["elapsed_s"] < 6, results[0]
    assert "every rank must call commlib.join()" in results[0]["message"], results[0]


@pytest.mark.multiprocess
def test_sparse_tensor_with_a_joined_rank_is_refused_clearly():
    results = spawn(2, "join.py", "sparse", timeout=60).check().results()
    assert results[0]["error"] is None, results[0]
    assert results[1]["error"].startswith("Mismatch") and "rank 0 joined" in results[1]["error"], results[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, env, expected", [
    ("bf16", {"COMMLIB_FUSION_THRESHOLD": "4000"}, [1.0, 1.0]),   # fused as rank 1 counts bf16 bytes
    # PowerSGD past start_iter on both; its factors are exact up to rounding (which BLAS kernel runs
    # depends on the CPU): a stand-in outside the compressor would be off by 1 or more
    ("compressed", {"COMMLIB_POLICY": "*=ring"}, pytest.approx([3.0, 3.0, 3.0, 2.0, 2.0], rel=1e-6)),
    pytest.param("late", {"COMMLIB_NEGOTIATION_TIMEOUT_S": "3"}, [1.0] * 4, marks=pytest.mark.long),   # waits 5 s
])
def test_joined_rank_takes_part_as_the_others_do(mode, env, expected):
    results = spawn(2, "join.py", mode, timeout=90, env=env).check().results()
    assert results[1]["got"] == expected, results
    assert results[0]["last"] == results[1]["last"] == 1, results


def test_a_join_keeps_the_response_cache_as_it_was():
    """A hit waiting when a rank joins travels in full; the tensor keeps its one cache bit."""
    secret = bytes(32)
    server = ControllerServer(2, "127.0.0.1", 0, lambda name, metas: Release(name, "ring"), 10.0, 1.0, secret=secret)
    clients = [None, None]
    starts = [threading.Thread(target=lambda r=r: clients.__setitem__(
        r, ControllerClient(server.address, r, 10.0, secret=secret))) for r in range(2)]
    for thread in starts:
        thread.start()
    for thread in starts:
        thread.join()
    meta = {"name": "w", "shape": [4], "dtype": "float32", "op": "sum", "choices": [[None, "ring"]],
            "compression": None, "density": None, "prescale": 1.0, "postscale": 1.0, "rows": None}

    def next_event(rank):
        try:
            return clients[rank].events.get(timeout=5)
        except queue.Empty:
            raise AssertionError(f"rank {rank} got no event within 5 s") from None

    try:
        for client in clients:
            client.submit([dict(meta)])
        for rank in (0, 1):   # both have cached it before they submit it again
            assert [r.bit for r in next_event(rank)["batch"]] == [0]
        clients[1].submit([dict(meta)])   # a hit, waiting for rank 0's
        clients[1].join()
        time.sleep(0.3)   # the controller has both (a channel per rank: no order between ranks)
        clients[0].submit([dict(meta)])
        clients[0].join()
        released = next_event(0)
        assert [(r.name, r.bit) for r in released["batch"]] == [("w", None)], released
        assert next_event(0) == {"t": "joined", "last": 0}
        assert len(server._cache) == 1 and server._bit_of == {"w": 0}, "the join assigned the tensor a new bit"
        for client in clients:
            client.submit([dict(meta)])
        assert [r.bit for r in next_event(0)["batch"]] == [0], "the tensor no longer hits its cached release"
    finally:
        for client in clients:
            client.close()
