"""Golden protocol cases at the SwitchML software switch: hand-built packets, byte by byte.

Each test registers a job whose workers are plain UDP sockets of this process, sends DATA packets
built with struct, and checks the switch's answers and counters (see switch/csrc/switchml.h)."""
import socket
import struct
import time

import pytest

from commlib.errors import ConfigError
from helpers import E, TOKEN, Job, data, header, parse, sw, vals

pytestmark = pytest.mark.timeout(30)   # the switch and job2 fixtures are in conftest.py


def test_header_layout_and_result(job2):
    j = job2.number
    pkt = data(j, 0, 7, 3, 1, vals(1), exp=5)
    assert len(pkt) == 20 + 4 * E
    assert pkt[:4] == bytes([1, 1, j, 0]) and pkt[4:8] == b"\0\0\0\x07" and pkt[8:10] == b"\x80\x03"
    assert pkt[10] == 5 and pkt[12:16] == bytes.fromhex("1234abcd")
    assert sw.pack_header(1, 1, j, 0, 7, 3 | 1 << 15, 5, TOKEN) == pkt[:20]   # the library's packer agrees
    job2.send(0, pkt)
    job2.silent(0)                                                        # consumed: slot incomplete
    job2.send(1, data(j, 1, 7, 3, 1, vals(2), exp=2))
    stamps = []
    for rank in (0, 1):                                                    # completion goes to everyone
        raw = job2.socks[rank].recv(4096)
        r = parse(raw)
        assert len(raw) == 20 + 4 * E + 8 and r["checksum_ok"]
        stamps.append(r["stamp"])
        assert (r["type"], r["flags"], r["job"], r["pkt"], r["pool"], r["code"], r["token"]) == \
            (2, 1 | 16, j, 7, 3 | 1 << 15, 0, TOKEN)                        # 16: the stamp follows
        assert r["rank"] == 1                                              # the packet that completed it
        assert r["exp"] == 5                                               # max exponent echoed
        assert r["values"] == [a + b for a, b in zip(vals(1), vals(2))]
    c = job2.counters()
    assert (c["pkts_recv"], c["aggregated"], c["results"], c["replays"]) == (2, 2, 2, 0)
    # the stamp: the round's queue and processing ns summed over its two contributions, as the
    # job's counters over the same two packets (processing: less the result's MAC and send)
    queue, proc = stamps[0]
    assert stamps[1] == stamps[0] and queue == c["queue_ns"] and 0 < proc <= c["proc_ns"], (stamps, c)
    job2.send(0, data(j, 0, 7, 3, 1, vals(1), exp=5))                   # a retransmission: the replay
    assert job2.recv(0)["stamp"] == stamps[0]                             # carries the round's stamp


def test_overwrite_on_first_contribution(job2):
    """A slot is cleared lazily: the first contribution of a new use overwrites the old sum."""
    j = job2.number
    for use, set in enumerate((0, 1, 0)):
        a, b = vals(10 + use), vals(20 + use)
        job2.send(0, data(j, 0, 100 + use, 5, set, a))
        job2.send(1, data(j, 1, 100 + use, 5, set, b))
        for rank in (0, 1):
            assert job2.recv(rank)["values"] == [x + y for x, y in zip(a, b)]


def test_unicast_replay_to_retransmission_on_complete_slot(job2):
    j = job2.number
    job2.send(0, data(j, 0, 1, 0, 0, vals(1)))
    job2.send(1, data(j, 1, 1, 0, 0, vals(2)))
    first = [job2.recv(r) for r in (0, 1)]
    job2.send(0, data(j, 0, 1, 0, 0, vals(1)))           # rank 0 lost its result and resends
    replay = job2.recv(0)
    assert replay["values"] == first[0]["values"] and replay["pkt"] == 1 and replay["rank"] == 0
    job2.silent(1)                                        # unicast: rank 1 hears nothing
    c = job2.counters()
    assert (c["replays"], c["aggregated"], c["results"]) == (1, 2, 2)


def test_drop_retransmission_to_incomplete_slot(job2):
    j = job2.number
    job2.send(0, data(j, 0, 1, 2, 0, vals(1)))
    job2.send(0, data(j, 0, 1, 2, 0, vals(1)))           # resent before rank 1 contributed
    job2.silent(0)
    assert job2.counters()["drop_incomplete"] == 1
    job2.send(1, data(j, 1, 1, 2, 0, vals(2)))
    for rank in (0, 1):                                   # counted once, not twice
        assert job2.recv(rank)["values"] == [a + b for a, b in zip(vals(1), vals(2))]
        job2.silent(rank)


def test_max_exponent_and_exponent_only_packets(job2):
    j = job2.number
    for slot, (e0, e1, want) in enumerate([(3, -5, 3), (-128, 7, 7), (-128, -128, -128), (-126, -127, -126)]):
        job2.send(0, data(j, 0, slot, slot, 0, None, exp=e0))   # size code 0: exponent only
        job2.send(1, data(j, 1, slot, slot, 0, None, exp=e1))
        r = job2.recv(0)
        assert (r["exp"], r["flags"], r["values"]) == (want, 16, [])
        job2.recv(1)


def test_int32_sum_wraps_like_hardware(job2):
    j = job2.number
    big = [2 ** 31 - 1] * E
    job2.send(0, data(j, 0, 0, 1, 0, big))
    job2.send(1, data(j, 1, 0, 1, 0, [1] * E))
    assert job2.recv(0)["values"] == [-2 ** 31] * E


def test_packets_of_the_jobs_own_size(switch):
    """A job registered with 1001 values per packet (not a multiple of any vector width) takes size
    code 3 (the job's size) with exactly that payload; its results carry the same; Tofino's codes
    and other lengths are refused for it."""
    n = 1001
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
            s.settimeout(1.0)
        client = sw.SwitchClient(switch.address)
        j = client.register(TOKEN, [list(s.getsockname()) for s in socks], 4, n)["job"]
        a, b = [[(r * 7919 + i) * (-1) ** i for i in range(n)] for r in (1, 2)]
        for rank, values in enumerate((a, b)):
            socks[rank].sendto(header(1, 3, j, rank, 9, 2, 4) + struct.pack(f"!{n}i", *values), ("127.0.0.1", switch.port))
        for rank in (0, 1):
            raw = socks[rank].recv(65536)
            assert len(raw) == 20 + 4 * n + 8 and raw[1] == 3 | 16, (len(raw), raw[1])
            assert list(struct.unpack(f"!{n}i", raw[20:20 + 4 * n])) == [x + y for x, y in zip(a, b)]
        socks[0].sendto(header(1, 1, j, 0, 10, 3, 4) + bytes(4 * 64), ("127.0.0.1", switch.port))       # Tofino's 64
        socks[0].sendto(header(1, 3, j, 0, 10, 3, 4) + bytes(4 * n - 4), ("127.0.0.1", switch.port))   # one value short
        socks[0].sendto(header(1, 3, j, 0, 10, 3, 4) + bytes(4 * n + 4), ("127.0.0.1", switch.port))   # one too many
        time.sleep(0.2)
        assert client.counters(j)["counters"]["drop_malformed"] == 1
        assert client.counters()["switch"]["drop_short"] == 2
        for elems, slots in ((0, 4), (sw.MAX_ELEMS + 1, 4), (sw.MAX_ELEMS, sw.MAX_POOL_VALUES // sw.MAX_ELEMS + 1)):
            with pytest.raises(ConfigError, match="values per packet"):
                client.register(TOKEN, [list(s.getsockname()) for s in socks], slots, elems)
    finally:
        for s in socks:
            s.close()


def test_multicast_to_every_worker(switch):
    job = Job(switch, 3)
    try:
        for rank in range(3):
            job.send(rank, data(job.number, rank, 9, 1, 0, [rank + 1] * E))
        for rank in range(3):
            assert job.recv(rank)["values"] == [6] * E
        assert job.counters()["results"] == 3
    finally:
        job.close()


def test_nonfinite_flags_are_ored(job2):
    j = job2.number
    nf0 = [1 if i == 0 else 2 if i == 1 else 0 for i in range(E)]
    nf1 = [4 if i == 1 else 0 for i in range(E)]
    job2.send(0, data(j, 0, 0, 4, 0, [0] * E, nf=nf0))
    job2.send(1, data(j, 1, 0, 4, 0, [5] * E, nf=nf1))
    r = job2.recv(0)
    assert r["flags"] == 1 | 4 | 16 and r["nf"][:3] == [1, 6, 0] and r["values"] == [5] * E
    job2.send(0, data(j, 0, 1, 6, 0, [1] * E))            # no flags from anyone: no region
    job2.send(1, data(j, 1, 1, 6, 0, [1] * E))
    assert job2.recv(0)["nf"] is None


def test_stale_job_number_dropped_and_nacked(switch, job2):
    j = job2.number
    job2.client.unregister(j, TOKEN)                      # the job ended: its number is stale
    job2.send(0, data(j, 0, 1, 0, 0, vals(1)))
    nack = job2.recv(0)
    assert (nack["type"], nack["code"], nack["job"], nack["pkt"]) == (3, 1, j, 1) and nack["checksum_ok"]
    stats = job2.client.counters()["switch"]
    assert stats["drop_unknown_job"] == 1 and stats["nacks"] == 1
    assert str(j) not in job2.client.counters()["jobs"]


def test_unregistered_sender_and_bad_token_dropped(switch, job2):
    j = job2.number
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stranger.bind(("127.0.0.1", 0))
    try:
        stranger.sendto(data(j, 0, 1, 0, 0, vals(1)), ("127.0.0.1", switch.port))   # poses as rank 0
        job2.send(1, data(j, 0, 1, 0, 0, vals(1)))       # rank 1's address claiming rank 0
        job2.send(0, data(j, 5, 1, 0, 0, vals(1)))       # rank outside the job
        job2.send(0, data(j, 0, 1, 0, 0, vals(1), token=TOKEN ^ 1))
        job2.silent(0)
        c = job2.counters()
        assert (c["drop_sender"], c["drop_token"], c["pkts_recv"], c["aggregated"]) == (3, 1, 0, 0)
        # the real rank 0 still aggregates normally afterwards
        job2.send(0, data(j, 0, 1, 0, 0, vals(1)))
        job2.send(1, data(j, 1, 1, 0, 0, vals(2)))
        assert job2.recv(0)["values"] == [a + b for a, b in zip(vals(1), vals(2))]
    finally:
        stranger.close()


def test_malformed_packets_dropped(switch, job2):
    j = job2.number
    good = data(j, 0, 1, 0, 0, vals(1))
    job2.send(0, good[:19])                                   # shorter than a header
    job2.send(0, good[:-4])                                   # payload shorter than its size code
    job2.send(0, good[:16] + b"\0\0\0\0" + good[20:])         # checksum wrong
    job2.send(0, data(j, 0, 1, 40, 0, vals(1)))               # slot outside the job's pool (8 slots)
    job2.send(0, header(2, 0, j, 0, 1, 0, 0))                 # a RESULT sent to the switch
    job2.silent(0)
    g = job2.client.counters()["switch"]
    assert (g["drop_short"], g["drop_checksum"], g["drop_type"]) == (2, 1, 1)
    assert job2.counters()["drop_malformed"] == 1


def test_ranks_out_of_step_are_not_mixed(job2):
    """Packets of different packet ids in one slot use (ranks streaming different tensors) are refused."""
    j = job2.number
    job2.send(0, data(j, 0, 1, 0, 0, vals(1)))
    job2.send(1, data(j, 1, 2, 0, 0, vals(2)))
    job2.silent(0)
    assert job2.counters()["drop_malformed"] == 1


def test_two_jobs_are_isolated(switch, job2):
    other = Job(switch, 2, token=0x0BADF00D)
    try:
        assert other.number != job2.number
        # job 2's ranks cannot touch job 1's slots, even with the right rank numbers
        other.send(0, data(job2.number, 0, 1, 0, 0, vals(1), token=0x0BADF00D))
        other.send(0, data(job2.number, 0, 1, 0, 0, vals(1)))
        for job, seed in ((job2, 1), (other, 5)):
            job.send(0, data(job.number, 0, 1, 0, 0, vals(seed), token=job.token))
            job.send(1, data(job.number, 1, 1, 0, 0, vals(seed + 1), token=job.token))
        assert job2.recv(0)["values"] == [a + b for a, b in zip(vals(1), vals(2))]
        assert other.recv(0)["values"] == [a + b for a, b in zip(vals(5), vals(6))]
        c = job2.counters()
        assert (c["drop_token"], c["drop_sender"]) == (1, 1)
    finally:
        other.close()


def test_counters_per_slot_group_and_freed_slots(switch, job2):
    j = job2.number
    for slot in (0, 5):                                       # slot groups of 4: groups 0 and 1
        job2.send(0, data(j, 0, slot, slot, 0, vals(1)))
        job2.send(1, data(j, 1, slot, slot, 0, vals(2)))
        job2.recv(0), job2.recv(1)
    groups = job2.client.counters(j)["groups"]
    assert [g["aggregated"] for g in groups] == [2, 2]
    assert switch.status()["free_slots"] == 256 - 8
    job2.client.unregister(j, TOKEN)
    assert switch.status()["free_slots"] == 256


def test_concurrency_counts_the_ranks_whose_packets_arrived_in_each_millisecond(switch, job2):
    j, pairs = job2.number, 10
    for pkt in range(pairs):   # both ranks back to back, then a pause: a millisecond of 2 ranks each time
        job2.send(0, data(j, 0, pkt, pkt % 8, pkt // 8, vals(1)))
        job2.send(1, data(j, 1, pkt, pkt % 8, pkt // 8, vals(2)))
        job2.recv(0), job2.recv(1)
        time.sleep(0.003)
    job2.send(0, data(j, 0, pairs, pairs % 8, 1, vals(1)))   # a later millisecond closes the last pair's
    c = job2.client.counters(j)
    per_ms = {int(k.rsplit("_", 1)[1]): n for k, n in c["counters"].items() if k.startswith("ms_ranks_")}
    # every pair is 2 rank-milliseconds, split or not; a pair split by a millisecond boundary is rare
    assert sum(k * n for k, n in per_ms.items()) == 2 * pairs and set(per_ms) <= {1, 2}, per_ms
    assert per_ms.get(2, 0) >= pairs // 2, per_ms
    assert not any(k.startswith("ms_ranks_") for g in c["groups"] for k in g), "slot groups count no concurrency"


def test_drop_simulator_counts(switch, job2):
    j = job2.number
    job2.client.simulate(ingress=0.5, egress=0.0, seed=7)
    for pkt in range(40):
        job2.send(0, data(j, 0, pkt, pkt % 8, (pkt // 8) % 2, None))
    job2.silent(0)
    c = job2.counters()
    assert 5 < c["drop_sim_ingress"] < 35 and c["drop_sim_ingress"] + c["pkts_recv"] == 40


def test_simulate_is_refused_unless_the_switch_is_for_testing():
    with sw.SwitchServer("127.0.0.1", 0, slots=16) as server:
        with pytest.raises(ConfigError, match="--testing"):
            sw.SwitchClient(server.address).simulate(ingress=0.5)
        assert server.status()["simulate"]["ingress"] == 0.0


def test_out_of_range_numbers_get_an_error_reply(switch):
    client = sw.SwitchClient(switch.address)
    with pytest.raises(ConfigError, match="32-bit"):
        client.register(2 ** 32, [["127.0.0.1", 9]], 8, E)
    with pytest.raises(ConfigError, match="port"):
        client.register(TOKEN, [["127.0.0.1", 70000]], 8, E)
    with pytest.raises(ConfigError, match="out of range"):          # caught from cffi: uint64_t seed
        client.simulate(seed=2 ** 64)
    assert switch.status()["free_slots"] == 256 and switch.status()["jobs"] == {}   # nothing half-registered
    assert client.status()["slots"] == 256                                         # the switch still answers


def test_job_pool_limit_is_the_headers():
    assert sw.MAX_SLOTS == 1 << 15                  # the pool index carries 15 bits of slot
    with sw.SwitchServer("127.0.0.1", 0, slots=sw.MAX_SLOTS + 1, slot_group=1024) as server:
        client = sw.SwitchClient(server.address)
        client.register(TOKEN, [["127.0.0.1", 9]], sw.MAX_SLOTS, E)
        with pytest.raises(ConfigError, match="slots="):
            client.register(TOKEN, [["127.0.0.1", 9]], sw.MAX_SLOTS + 1, E)


def test_one_control_format_for_the_switch_and_the_aggregators(switch):
    """Both daemons take switch/control.py's messages, the same bytes: the switch line by line over
    TCP, an aggregator one datagram each on its UDP port; both answer {"ok": ..., ...}."""
    from commlib.switch import control
    from commlib.switch.aggregator import Aggregator
    with socket.create_connection(("127.0.0.1", switch.port), timeout=5) as conn, conn.makefile("rwb") as stream:
        for request, ok, says in ((control.encode({"op": "status"}), True, "free_slots"),
                                  (b"[1, 2]\n", False, "one JSON object"),
                                  (control.encode({"op": "nope"}), False, "unknown op"),
                                  (control.encode({"op": "register"}), False, "lacks the field")):
            stream.write(request)
            stream.flush()
            reply = control.decode(stream.readline())
            assert reply["ok"] is ok and says in str(reply), reply
    agg = Aggregator("127.0.0.1", 0).start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(5)
    try:
        # padded: the aggregator answers no datagram with more bytes than it had (no amplification)
        sock.sendto(control.encode(control.pad({"op": "register", "rank": 0}, 1024)), agg.address)
        data, _ = sock.recvfrom(65536)
        assert data[:1] == control.MARK
        reply = control.decode(data)
        assert reply["ok"] is False and "malformed registration" in reply["error"], reply
    finally:
        sock.close()
        agg.close()


def test_results_queued_in_one_batch_keep_their_rounds_sums():
    """The switch sends a result from its set's sums (switchml_switch.c: build_result) once the batch is
    done, so a later round of that set in the same batch must not change what the queued result carries:
    the packets reach the switch before it runs, so its first receive takes them all in one batch."""
    from commlib._native import ffi, lib
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.bind(("127.0.0.1", 0))
    rank = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rank.bind(("127.0.0.1", 0))
    rank.settimeout(1.0)
    switch = ffi.gc(lib.sml_switch_new(srv.fileno(), 16, 4, 0), lib.sml_switch_free)
    try:
        assert lib.sml_switch_add_job(switch, 3, TOKEN, 1, 2, E, ffi.NULL, 0) == 0
        assert lib.sml_switch_set_addr(switch, 3, 0, 0x7F000001, rank.getsockname()[1]) == 0
        rounds = range(1, 11)   # one rank: each packet completes its round, the next one starts anew
        for pkt in rounds:
            rank.sendto(data(3, 0, pkt, 1, 0, vals(pkt)), srv.getsockname())
            if pkt == 5:        # a retransmission: the replay is sent from the sums too
                rank.sendto(data(3, 0, pkt, 1, 0, vals(pkt)), srv.getsockname())
        time.sleep(0.05)
        assert lib.sml_switch_run(switch, 20) == len(rounds) + 1
        got = [parse(rank.recv(4096)) for _ in range(len(rounds) + 1)]
        assert [r["pkt"] for r in got] == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]
        assert all(r["values"] == vals(r["pkt"]) for r in got), [r["pkt"] for r in got if r["values"] != vals(r["pkt"])]
    finally:
        srv.close()
        rank.close()
