"""The data plane against reordering and an attacker on the wire: packet-level checks on a real
switch (the packets written out by hand, as in test_switch_protocol.py)."""
import pytest

from test_switch_protocol import E, Job, data, vals   # noqa: F401 (fixtures below)
from test_switch_protocol import switch, job2          # noqa: F401

pytestmark = pytest.mark.timeout(30)


def complete(job, pkt, slot, set, seeds=(1, 2)):
    """Every rank contributes packet `pkt` to (slot, set); returns rank 0's result."""
    for rank, seed in enumerate(seeds):
        job.send(rank, data(job.number, rank, pkt, slot, set, vals(seed)))
    result = job.recv(0)
    job.recv(1)
    return result


def test_late_packet_of_a_finished_round_is_never_aggregated(job2):
    """Rounds k (set 0), k+1 (set 1), k+2 (set 0) of one slot; rank 0's packet of round k arrives
    again after round k+2 began in its set (reordered past a whole round). The old switch took it
    as the reused set's first contribution and then refused rank 0's real packet for ever."""
    j = job2.number
    complete(job2, 10, 3, 0)
    complete(job2, 11, 3, 1)
    job2.send(1, data(j, 1, 12, 3, 0, vals(6)))        # round k+2 starts: rank 1 first
    job2.send(0, data(j, 0, 10, 3, 0, vals(1)))        # the late copy of rank 0's round k
    job2.silent(0)
    job2.send(0, data(j, 0, 12, 3, 0, vals(5)))        # rank 0's real packet completes the round
    got = job2.recv(0)
    assert got["pkt"] == 12 and got["values"] == [a + b for a, b in zip(vals(5), vals(6))]
    assert job2.counters()["drop_late"] == 1


def test_late_packet_before_the_set_is_reused_gets_the_stored_result(job2):
    """Rank 0's retransmission of round k arriving while round k+1 runs in the other set: the
    stored result of round k is replayed (unicast), nothing is aggregated."""
    j = job2.number
    first = complete(job2, 20, 1, 0)
    job2.send(1, data(j, 1, 21, 1, 1, vals(3)))
    job2.send(0, data(j, 0, 20, 1, 0, vals(1)))
    replay = job2.recv(0)
    assert replay["pkt"] == 20 and replay["values"] == first["values"]
    c = job2.counters()
    assert (c["replays"], c["aggregated"], c["drop_late"]) == (1, 3, 0)
