"""The controller in one process (a server and a client per rank on loopback): tensor names that
pair up late are released, names that never can are a Mismatch at once, and a rank that leaves
fails what waits for it, with its error when it had one."""
import threading
import time

import pytest

from commlib import controller
from commlib.controller import ControllerClient, ControllerServer


@pytest.fixture
def job():
    """(server, clients) of a 2-rank job; PAIRING_GRACE_S is 1 s."""
    grace, controller.PAIRING_GRACE_S = controller.PAIRING_GRACE_S, 1.0
    server = ControllerServer(2, "127.0.0.1", 0, timeout_s=20.0, cycle_time_ms=1.0, negotiation_timeout_s=60.0)
    clients = [None, None]

    def connect(rank):
        clients[rank] = ControllerClient(server.address, rank, 20.0)

    threads = [threading.Thread(target=connect, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    yield server, clients
    controller.PAIRING_GRACE_S = grace
    for client in clients:
        client.close()
    server.join(5)


def submit(client, *names):
    client.submit([{"name": name, "choices": [[None, "ring"]]} for name in names])


def events(client, seconds):
    """What the client received within `seconds`, up to the first error: ('go', names) and
    ('error', kind, message)."""
    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            msg = client.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:   # queue.Empty: nothing more
            break
        got.append(("go", sorted(item["name"] for item in msg["batch"])) if msg["t"] == "go"
                   else (msg["t"], msg.get("kind"), msg.get("message")))
        if msg["t"] == "error":
            break
    return got


def released(got):
    return sorted(name for event in got if event[0] == "go" for name in event[1])


def test_names_submitted_in_other_orders_pair_up(job):
    _, clients = job
    submit(clients[0], "a")
    submit(clients[1], "b")
    time.sleep(0.5)   # both wait for a name the other has not submitted yet, for less than the grace
    submit(clients[0], "b")
    submit(clients[1], "a")
    for rank, client in enumerate(clients):
        got = events(client, 2.0)
        assert released(got) == ["a", "b"] and all(e[0] == "go" for e in got), f"rank {rank} got {got}"


def test_a_slow_rank_with_nothing_pending_is_waited_for(job):
    _, clients = job
    submit(clients[0], "a")
    time.sleep(2.5)   # longer than the grace: only rank 0 waits, rank 1 is on its way
    submit(clients[1], "a")
    for rank, client in enumerate(clients):
        got = events(client, 2.0)
        assert got == [("go", ["a"])], f"rank {rank} got {got}"


def test_names_that_never_pair_up_are_a_mismatch_naming_tensors_and_ranks(job):
    _, clients = job
    start = time.monotonic()
    submit(clients[0], "head.weight", "head.bias")
    submit(clients[1], "tail.weight", "tail.bias")
    for rank, client in enumerate(clients):
        got = events(client, 5.0)
        assert [e[:2] for e in got] == [("error", "Mismatch")], f"rank {rank} got {got}"
        message = got[0][2]
        assert "rank 0 submitted 'head.bias', 'head.weight' (not rank 1)" in message, message
        assert "rank 1 submitted 'tail.bias', 'tail.weight' (not rank 0)" in message, message
    assert time.monotonic() - start < 8.0


def test_a_rank_leaving_with_an_error_fails_the_others_with_it(job):
    _, clients = job
    submit(clients[1], "x")
    clients[0].leave("ValueError: rank 0's own failure")
    got = events(clients[1], 3.0)
    assert got == [("error", "PeerFailure", "rank 0 failed and left the job: ValueError: rank 0's own failure")], got


def test_a_rank_leaving_without_a_tensor_fails_it_on_the_others(job):
    _, clients = job
    submit(clients[1], "x")
    clients[0].leave()
    got = events(clients[1], 3.0)
    assert [e[:2] for e in got] == [("error", "PeerFailure")], got
    assert "'x' was submitted by rank 1, but rank 0 shut commlib down without it" in got[0][2], got
