"""The data plane against reordering and an attacker on the wire: packet-level checks on a real
switch (the packets written out by hand, as in test_switch_protocol.py)."""
import functools
import socket
import struct
import threading

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from commlib.errors import CommError
from commlib.switch import auth, net
from commlib.switch.relay import Faults, relayed
from helpers import E, TOKEN, Job, data, header, parse, run_backends, sw, vals

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


# -- the MACs: ChaCha20-Poly1305 (switchml, omnireduce) ---------------------------------------------
M64 = (1 << 64) - 1
SML_LABEL = b"commlib switchml packets"


def sml_mac(job_key, kind, rank, counter, packet_id, raw):
    """switchml.h's packet MAC, with the `cryptography` package: ChaCha20-Poly1305 under
    HKDF-SHA256(job key, label), the nonce (type, rank, 0, 0, counter), the message the 64-bit
    packet id then the packet, all as associated data of an empty plaintext: the tag."""
    key = HKDF(hashes.SHA256(), 32, None, SML_LABEL).derive(job_key)
    nonce = bytes([kind, rank, 0, 0]) + counter.to_bytes(8, "big")
    return ChaCha20Poly1305(key).encrypt(nonce, b"", packet_id.to_bytes(8, "big") + raw)


def sml_result_mac_ok(job_key, raw, packet_id):
    """Whether a RESULT's MAC (after its seq) is the MAC of its bytes for round `packet_id`."""
    seq = int.from_bytes(raw[-24:-16], "big")
    return raw[-16:] == sml_mac(job_key, 2, 0, seq, packet_id, raw[:-16])


def test_the_packet_mac_is_chacha20_poly1305_over_the_full_packet_id():
    """The C MAC (transport.h's tp_mac, OpenSSL) against the `cryptography` package's, for packets
    of every size class, two pieces of associated data as one message, and a check that refuses
    a changed byte, a changed nonce and another label's key."""
    lib, ffi = sw.lib, sw.ffi
    key = bytes(range(7, 23))
    mac = ffi.gc(lib.tp_mac_new(key, SML_LABEL, lib.TP_MAC_CHACHA20_POLY1305), lib.tp_mac_free)
    other = ffi.gc(lib.tp_mac_new(key, b"another use", lib.TP_MAC_CHACHA20_POLY1305), lib.tp_mac_free)
    rng = np.random.default_rng(3)
    tag = ffi.new("uint8_t[16]")
    for length in (0, 1, 20, 1044, 4117, 32808, 41004):
        raw, pid, counter = rng.bytes(length), int(rng.integers(0, 2 ** 63)), int(rng.integers(0, 2 ** 63))
        nonce = bytes([1, 5, 0, 0]) + counter.to_bytes(8, "big")
        assert lib.tp_mac_tag(mac, nonce, pid.to_bytes(8, "big"), 8, raw, length, tag) == 0
        assert bytes(tag) == sml_mac(key, 1, 5, counter, pid, raw), length
        assert lib.tp_mac_check(mac, nonce, pid.to_bytes(8, "big"), 8, raw, length, tag) == 1
        assert lib.tp_mac_check(other, nonce, pid.to_bytes(8, "big"), 8, raw, length, tag) == 0
        assert lib.tp_mac_check(mac, nonce[:-1] + b"x", pid.to_bytes(8, "big"), 8, raw, length, tag) == 0
        assert lib.tp_mac_check(mac, nonce, (pid ^ 1 << 32).to_bytes(8, "big"), 8, raw, length, tag) == 0
        if length:
            changed = bytes([raw[0] ^ 1]) + raw[1:]
            assert lib.tp_mac_check(mac, nonce, pid.to_bytes(8, "big"), 8, changed, length, tag) == 0


OMR_LABEL = b"commlib omnireduce packets"


def omr_mac(job_key, head, payload, counter):
    """omnireduce.h's packet MAC, with the `cryptography` package: the nonce counter (8 bytes,
    little-endian), then ChaCha20-Poly1305's tag under HKDF-SHA256(job key, label) with the nonce
    (type, 0, rank field, counter) over `head` (the header, then a result's stamp) and the block."""
    key = HKDF(hashes.SHA256(), 32, None, OMR_LABEL).derive(job_key)
    ctr = counter.to_bytes(8, "little")
    return ctr + ChaCha20Poly1305(key).encrypt(head[:1] + b"\0" + head[2:4] + ctr, b"", head + payload)


OMR_RIG_KEY, OMR_RIG_JOB_KEY = bytes(range(40, 56)), 0x5EC12E7


def omr_rig(block, timeout):
    """(aggregator, job, its socket, the two ranks' sockets): a C aggregator on loopback with one
    authenticated job (ChaCha20-Poly1305 under OMR_RIG_KEY) of 2 ranks, 1 column of `block` values."""
    lib, ffi = sw.lib, sw.ffi
    agg_sock, *ranks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    for s in (agg_sock, *ranks):
        s.bind(("127.0.0.1", 0))
        s.settimeout(timeout)
    agg = ffi.gc(lib.omr_agg_new(agg_sock.fileno(), 7), lib.omr_agg_free)
    job = lib.omr_agg_add_job(agg, OMR_RIG_JOB_KEY, 2, 1, 1, 0, block, 0.0, 0.0, OMR_RIG_KEY,
                              lib.TP_MAC_CHACHA20_POLY1305)
    assert job >= 0
    for rank, s in enumerate(ranks):
        assert lib.omr_agg_set_worker(agg, job, rank, b"127.0.0.1", s.getsockname()[1]) == 0
    return agg, job, agg_sock, ranks


@pytest.mark.parametrize("block", [5, 1001])
def test_omnireduce_macs_are_chacha20_poly1305_with_the_stamp_inside(block):
    """A C aggregator takes DATA MAC'd by the `cryptography` package (omnireduce.h's construction)
    and sends a RESULT whose MAC that package verifies, the stamp and the block inside it; each
    result is MAC'd under a counter of its own, a tampered DATA is dropped."""
    lib, ffi = sw.lib, sw.ffi
    key, jkey = OMR_RIG_KEY, OMR_RIG_JOB_KEY
    agg, job, agg_sock, ranks = omr_rig(block, 2.0)
    hdr = OMR_HDR
    values = [np.arange(block, dtype=np.float32) * (rank + 1) for rank in range(2)]
    counters = set()
    for seq in range(2):
        for rank, s in enumerate(ranks):
            payload = values[rank].tobytes()
            fields = [lib.OMR_DATA, lib.OMR_F_MAC, rank, job, jkey, seq, 0, 0, 0, lib.OMR_INF, 0, 0]
            fields[-1] = lib.tp_checksum(hdr.pack(*fields) + payload, hdr.size + len(payload))
            head = hdr.pack(*fields)
            mac = omr_mac(key, head, payload, 1000 * seq + rank)
            if rank == 0 and seq == 0:      # tampered first: dropped, the genuine one is taken
                s.sendto(head + payload + mac[:-1] + bytes([mac[-1] ^ 1]), agg_sock.getsockname())
            s.sendto(head + payload + mac, agg_sock.getsockname())
        assert lib.omr_agg_run(agg, 200) >= 0
        for s in ranks:
            raw = s.recv(65536)
            fields = hdr.unpack(raw[:hdr.size])
            assert fields[0] == lib.OMR_RESULT and fields[1] & lib.OMR_F_MAC and fields[1] & lib.OMR_F_STAMP, fields
            body, mac = raw[hdr.size:-lib.OMR_MAC_BYTES], raw[-lib.OMR_MAC_BYTES:]
            block_bytes, stamp = body[:-lib.OMR_STAMP_BYTES], body[-lib.OMR_STAMP_BYTES:]
            counter = int.from_bytes(mac[:8], "little")
            assert mac == omr_mac(key, raw[:hdr.size] + stamp, block_bytes, counter), "the result's MAC"
            assert np.frombuffer(block_bytes, np.float32).tobytes() == (values[0] + values[1]).tobytes()
            counters.add(counter)
    assert len(counters) == 2, f"one MAC per result (sent to every worker), a new counter per result: {counters}"
    stats = ffi.new("omr_astats *")
    lib.omr_agg_stats(agg, stats)
    assert stats.bad_mac == 1 and stats.data_recv == 4, (stats.bad_mac, stats.data_recv)
    for s in (agg_sock, *ranks):
        s.close()


def test_a_replayed_pull_gets_no_results_sent_again():
    """A worker's PULL (it lacks a result) gets the result replayed to it; the same PULL sniffed and
    sent again gets nothing (its nonce counter is not past the last one answered for that column),
    so a replayed request cannot make the aggregator send results over and over; the worker's next
    PULL, under its next counter, is answered."""
    lib, ffi = sw.lib, sw.ffi
    key, jkey, block = OMR_RIG_KEY, OMR_RIG_JOB_KEY, 4
    agg, job, agg_sock, ranks = omr_rig(block, 0.5)

    def sealed(kind, rank, counter, payload=b"", next_=0):
        fields = [kind, lib.OMR_F_MAC, rank, job, jkey, 0, 0, 0, 0, next_, 0, 0]
        fields[-1] = lib.tp_checksum(OMR_HDR.pack(*fields) + payload, OMR_HDR.size + len(payload))
        head = OMR_HDR.pack(*fields)
        return head + payload + omr_mac(key, head, payload, counter)

    def results(rank):
        got = []
        while True:
            try:
                got.append(OMR_HDR.unpack(ranks[rank].recv(65536)[:OMR_HDR.size])[0])
            except socket.timeout:
                return got

    for rank, s in enumerate(ranks):   # round 0 of the column, the last: a result to both
        s.sendto(sealed(lib.OMR_DATA, rank, 100 + rank, bytes(4 * block), lib.OMR_INF), agg_sock.getsockname())
    lib.omr_agg_run(agg, 200)
    assert results(0) == results(1) == [lib.OMR_RESULT]
    pull = sealed(lib.OMR_PULL, 0, 200)   # rank 0 lost it (ack 0): the result again
    sent = []
    for attempt in (pull, pull, pull, sealed(lib.OMR_PULL, 0, 201)):
        ranks[0].sendto(attempt, agg_sock.getsockname())
        lib.omr_agg_run(agg, 100)
        sent.append(results(0))
    assert sent == [[lib.OMR_RESULT], [], [], [lib.OMR_RESULT]], sent
    stats = ffi.new("omr_astats *")
    lib.omr_agg_stats(agg, stats)
    assert stats.pulls_recv == 4 and stats.replays == 2 and stats.bad_mac == 0, (stats.pulls_recv, stats.replays)
    for s in (agg_sock, *ranks):
        s.close()


# -- an authenticated switchml job: packets written by hand ---------------------------------------
DAEMON_KEY = bytes(range(100, 132))


@pytest.fixture
def keyed_switch():
    server = sw.SwitchServer("127.0.0.1", 0, slots=256, slot_group=4, testing=True, key=DAEMON_KEY).start()
    yield server
    server.stop()


class KeyedJob(Job):
    """A job registered with a nonce: its packets carry MACs under auth.job_key(daemon key, nonce)."""

    def __init__(self, server, n, slots=8):
        self.nonce = auth.new_nonce()
        self.key = auth.job_key(DAEMON_KEY, self.nonce)
        self.switch, self.token = server, TOKEN
        self.socks = []
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            self.socks.append(s)
        self.client = sw.SwitchClient(server.address, key=self.key, rank=0)   # a keyed switch admits signed requests
        self.number = self.client.register(TOKEN, [list(s.getsockname()) for s in self.socks], slots, E,
                                           nonce=self.nonce, authenticate=True)["job"]

    def packet(self, rank, pkt, slot, set, values, key=None, wire=None):
        """A DATA packet with SML_F_MAC and its MAC (under `key`, default the job's) for the 64-bit
        packet id `pkt`, whose low bits (`wire`, default all 32) go in the header."""
        payload = struct.pack(f"!{E}i", *values)
        raw = header(1, 1 | 8, self.number, rank, pkt & (wire or M64) & 0xFFFFFFFF, slot | set << 15, 0) + payload
        return raw + sml_mac(key or self.key, 1, rank, pkt, pkt, raw)

    def recv_raw(self, rank, timeout=1.0):
        self.socks[rank].settimeout(timeout)
        return self.socks[rank].recv(4096)


@pytest.fixture
def keyed(keyed_switch):
    job = KeyedJob(keyed_switch, 2)
    yield job
    job.close()


def test_results_carry_a_valid_mac_and_unsigned_data_is_dropped(keyed):
    j = keyed.number
    keyed.send(0, data(j, 0, 1, 0, 0, vals(1)))                         # no MAC at all
    keyed.send(0, keyed.packet(0, 1, 0, 0, vals(1), key=bytes(16)))     # a MAC under another key
    keyed.silent(0)
    assert keyed.counters()["drop_bad_mac"] == 2 and keyed.counters()["aggregated"] == 0
    keyed.send(0, keyed.packet(0, 1, 0, 0, vals(1)))
    keyed.send(1, keyed.packet(1, 1, 0, 0, vals(2)))
    raw, other = keyed.recv_raw(0), keyed.recv_raw(1)
    assert len(raw) == 20 + 4 * E + 8 + 8 + 16 and raw[1] & 8 and raw[1] & 16   # SML_F_MAC, SML_F_STAMP: stamp, seq, MAC
    assert sml_result_mac_ok(keyed.key, raw, 1)                           # the MAC covers the stamp and seq
    assert other == raw                                                   # the multicast: one result, one seq
    assert parse(raw)["values"] == [a + b for a, b in zip(vals(1), vals(2))]
    keyed.send(0, keyed.packet(0, 1, 0, 0, vals(1)))                      # a retransmission: the replay ...
    replay = keyed.recv_raw(0)
    assert replay[20:-24] == raw[20:-24] and replay[3] == 0 and sml_result_mac_ok(keyed.key, replay, 1)
    assert int.from_bytes(replay[-24:-16], "big") == int.from_bytes(raw[-24:-16], "big") + 1   # ... is a new build


def test_each_thread_of_a_switch_takes_only_its_own_streams_key():
    """A job streams to two threads of a keyed switch: the streams' packet ids and ranks coincide, so
    each thread has its own key (auth.stream_key) and no nonce MACs two messages under one key. A
    valid packet of stream 0, replayed into thread 1 from stream 1's own address, is refused; one
    under stream 1's key is aggregated, and its result carries a MAC under that key."""
    server = sw.SwitchServer("127.0.0.1", 0, slots=64, key=DAEMON_KEY, threads=2).start()
    socks = [[socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)] for _ in range(2)]  # [stream][rank]
    try:
        for stream in socks:
            for s in stream:
                s.bind(("127.0.0.1", 0))
                s.settimeout(1.0)
        nonce = auth.new_nonce()
        key = auth.job_key(DAEMON_KEY, nonce)
        client = sw.SwitchClient(server.address, key=key, rank=0)
        addrs = [[list(s.getsockname()) for s in stream] for stream in socks]
        reply = client.register(TOKEN, addrs[0], 8, E, nonce=nonce, authenticate=True, streams=addrs)
        job, ports = reply["job"], [e["port"] for e in reply["endpoints"]]
        assert len(ports) == 2 and ports[0] == server.port and [e["slots"] for e in reply["endpoints"]] == [4, 4]

        def packet(rank, pkt, values, mac_key):
            raw = header(1, 1 | 8, job, rank, pkt, 0, 0) + struct.pack(f"!{E}i", *values)
            return raw + sml_mac(mac_key, 1, rank, pkt, pkt, raw)

        one = auth.stream_key(key, 1)
        assert one != key
        socks[1][0].sendto(packet(0, 1, vals(1), key), ("127.0.0.1", ports[1]))   # stream 0's MAC on thread 1
        with pytest.raises(socket.timeout):
            socks[1][0].recv(4096)
        shards = server.counters(job)["shards"]
        assert shards[1]["drop_bad_mac"] == 1 and shards[1]["aggregated"] == 0, shards
        for rank, seed in ((0, 1), (1, 2)):
            socks[1][rank].sendto(packet(rank, 1, vals(seed), one), ("127.0.0.1", ports[1]))
        raw = socks[1][0].recv(4096)
        assert sml_result_mac_ok(one, raw, 1) and not sml_result_mac_ok(key, raw, 1)
        assert parse(raw)["values"] == [a + b for a, b in zip(vals(1), vals(2))]
        counters = server.counters(job)
        assert counters["counters"]["aggregated"] == 2 and counters["shards"][0]["aggregated"] == 0
    finally:
        for stream in socks:
            for s in stream:
                s.close()
        server.stop()


def test_spoofed_data_into_a_cleared_set_is_refused(keyed):
    """Issue 13's first attack: a DATA packet with a sniffed header (job, token, rank) from the
    worker's own address (a spoofed source: here the worker's socket), into a set the last round
    just cleared. Without a MAC it became the set's first contribution: a silently wrong sum."""
    for pkt, set in ((5, 0), (6, 1)):
        keyed.send(0, keyed.packet(0, pkt, 2, set, vals(1)))
        keyed.send(1, keyed.packet(1, pkt, 2, set, vals(2)))
        keyed.recv_raw(0), keyed.recv_raw(1)
    sniffed = keyed.packet(0, 7, 2, 0, vals(3))                          # what rank 0 will send next
    forged = sniffed[:20] + struct.pack(f"!{E}i", *([999] * E)) + sniffed[-16:]
    keyed.send(0, forged)                                                # arrives first
    keyed.send(0, sniffed)
    keyed.send(1, keyed.packet(1, 7, 2, 0, vals(4)))
    got = parse(keyed.recv_raw(0))
    assert got["values"] == [a + b for a, b in zip(vals(3), vals(4))]
    c = keyed.counters()
    assert c["drop_bad_mac"] == 1 and c["aggregated"] == 6


def test_the_spoof_lands_on_a_job_without_macs(job2):
    """The control of the test above: the same forgery on a job registered without a key (the old
    data plane) becomes the set's first contribution, and the real packet is taken for a
    retransmission: a silently wrong sum."""
    j = job2.number
    for pkt, set in ((5, 0), (6, 1)):
        job2.send(0, data(j, 0, pkt, 2, set, vals(1)))
        job2.send(1, data(j, 1, pkt, 2, set, vals(2)))
        job2.recv(0), job2.recv(1)
    sniffed = data(j, 0, 7, 2, 0, vals(3))
    job2.send(0, sniffed[:20] + struct.pack(f"!{E}i", *([999] * E)))
    job2.send(0, sniffed)
    job2.send(1, data(j, 1, 7, 2, 0, vals(4)))
    assert job2.recv(0)["values"] == [999 + b for b in vals(4)]


def test_replayed_data_is_refused_by_its_round(keyed):
    """A sniffed, validly signed packet sent again after its slot moved on carries an old packet id
    (inside the MAC): dropped as late, never aggregated; sent again while its round is open, it is
    a duplicate (answered with the stored result once complete, as a retransmission is)."""
    old = keyed.packet(0, 10, 4, 0, vals(1))
    keyed.send(0, old)
    keyed.send(0, old)                                                   # replay into the open round
    keyed.send(1, keyed.packet(1, 10, 4, 0, vals(2)))
    first = keyed.recv_raw(0)
    keyed.recv_raw(1)
    for pkt, set in ((11, 1), (12, 0)):
        keyed.send(0, keyed.packet(0, pkt, 4, set, vals(pkt)))
        keyed.send(1, keyed.packet(1, pkt, 4, set, vals(pkt + 1)))
        keyed.recv_raw(0), keyed.recv_raw(1)
    keyed.send(1, keyed.packet(1, 14, 4, 0, vals(9)))                   # round 14 open in set 0
    keyed.send(0, old)                                                   # the replay, rounds later
    keyed.silent(0)
    c = keyed.counters()
    assert (c["drop_late"], c["drop_incomplete"], c["aggregated"]) == (1, 1, 7)
    assert parse(first)["values"] == [a + b for a, b in zip(vals(1), vals(2))]


# -- packet ids that wrap on the wire (issue 24): a forced small id space -------------------------
@pytest.fixture
def id_bits8():
    """Packet ids carry 8 bits on the wire (sml_testing_id_bits): they wrap every 256 packets."""
    sw.lib.sml_testing_id_bits(8)
    yield 256
    sw.lib.sml_testing_id_bits(32)


def test_data_replayed_a_wrap_later_is_refused(keyed, id_bits8):
    """Rank 1's packet of round 5 (slot 0), captured, and replayed into round 5 + 256 of the same
    slot set, whose wire id is the same: its MAC was made for id 5, the switch extends the wire id
    to 261, so it is dropped (drop_bad_mac) and the round sums the real packets. With only the
    wire's bits inside the MAC it was round 261's contribution: a wrong sum, no drop."""
    wrap = id_bits8
    keyed.send(0, keyed.packet(0, 5, 0, 1, vals(1), wire=wrap - 1))
    captured = keyed.packet(1, 5, 0, 1, vals(2), wire=wrap - 1)
    keyed.send(1, captured)
    keyed.recv_raw(0), keyed.recv_raw(1)
    for pkt in range(6, 5 + wrap):                                       # rounds 6 .. 260 in slot 0
        keyed.send(0, keyed.packet(0, pkt, 0, pkt % 2, vals(3), wire=wrap - 1))
        keyed.send(1, keyed.packet(1, pkt, 0, pkt % 2, vals(4), wire=wrap - 1))
        keyed.recv_raw(0), keyed.recv_raw(1)
    last = 5 + wrap
    assert keyed.packet(1, last, 0, 1, vals(2), wire=wrap - 1)[:20] == captured[:20]   # same header on the wire
    keyed.send(0, keyed.packet(0, last, 0, 1, vals(5), wire=wrap - 1))
    keyed.send(1, captured)                                              # the replay, a wrap later
    keyed.send(1, keyed.packet(1, last, 0, 1, vals(6), wire=wrap - 1))
    raw = keyed.recv_raw(0)
    assert sml_result_mac_ok(keyed.key, raw, last)
    assert parse(raw)["values"] == [a + b for a, b in zip(vals(5), vals(6))]
    c = keyed.counters()
    assert c["drop_bad_mac"] == 1 and c["aggregated"] == 2 * (wrap + 1), c


def test_a_result_replayed_a_wrap_later_is_refused(id_bits8):
    """A worker (window 1, one rank, one packet per call) against a switch played here: the result
    of call 3, captured, is sent again just before the result of call 3 + 256, whose wire id is the
    same. The worker extends the wire id to its outstanding packet's, the replay's MAC was made for
    another: refused (bad_mac), and the call returns its own sum. With only the wire's bits inside
    the MAC the worker took the replay: call 259 returned call 3's values."""
    lib, ffi = sw.lib, sw.ffi
    wrap, key, seq = id_bits8, bytes(range(40, 56)), [1000]
    switch_sock, sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    switch_sock.bind(("127.0.0.1", 0))
    switch_sock.settimeout(5.0)
    sock.connect(switch_sock.getsockname())
    worker = ffi.gc(lib.sml_worker_new(sock.fileno(), 0, 0, TOKEN, 1, 1, E, 1000.0, 1000.0, 0, key, lib.TP_MAC_CHACHA20_POLY1305),
                    lib.sml_worker_free)
    calls, captured = 3 + wrap + 1, []

    def result(data, call):
        """The switch's answer to a DATA packet of one rank: its own values, signed for `call`."""
        raw = header(2, 1 | 8 | 16, 0, 0, int.from_bytes(data[4:8], "big"), int.from_bytes(data[8:10], "big"), 0) + \
            data[20:20 + 4 * E] + bytes(8) + seq[0].to_bytes(8, "big")
        seq[0] += 1
        return raw + sml_mac(key, 2, 0, seq[0] - 1, call, raw)

    def switch():
        for call in range(calls):
            data, source = switch_sock.recvfrom(65536)
            answer = result(data, call)
            if call == 3:
                captured.append(answer)
            if call == 3 + wrap:
                switch_sock.sendto(captured[0], source)                   # the replay first
            switch_sock.sendto(answer, source)

    thread = threading.Thread(target=switch, daemon=True)
    thread.start()
    try:
        out = np.zeros(E, np.int32)
        for call in range(calls):
            x = np.full(E, call, np.int32)
            rc = lib.sml_worker_allreduce(worker, 1, ffi.from_buffer(x), ffi.from_buffer(out), E, ffi.NULL, ffi.NULL,
                                          ffi.NULL, 5000)
            assert rc == 0 and (out == call).all(), (call, rc, out[:4])
        c = ffi.new("sml_worker_counters *")
        lib.sml_worker_counters_get(worker, c)
        assert c.bad_mac == 1 and c.received == calls, (c.bad_mac, c.received)
    finally:
        thread.join(5.0)
        switch_sock.close()
        sock.close()


def test_ids_wrap_on_the_wire_and_sums_stay_exact(id_bits8):
    """A real authenticated job whose packet ids wrap many times on the wire (8 bits): the sums
    are exact, and bit-identical to the same job's with 32 bits."""
    import commlib.backends.switchml as sml
    tensors = [closed_form(2, i, size, dtype) for i, (size, dtype) in
               enumerate(((3000, np.int32), (40000, np.float32), (41000, np.int32), (5000, np.float32)))]

    def work(rank, backend):
        return [backend.allreduce(inputs[rank], f"t{i}") for i, (inputs, _) in enumerate(tensors)]

    def job():
        return run_backends(2, sml.SwitchMLBackend, work, switch_packet_elems=E, switch_window=8, timeout_s=20.0)

    wrapped = job()
    sw.lib.sml_testing_id_bits(32)
    plain = job()
    for rank in range(2):
        for i, (_, want) in enumerate(tensors):
            assert wrapped[rank][i].tobytes() == plain[rank][i].tobytes(), f"tensor {i} rank {rank}"
            if want.dtype == np.int32:
                np.testing.assert_array_equal(wrapped[rank][i], want)


# -- an attacker on the wire while real jobs run --------------------------------------------------
OMR_HDR = struct.Struct("<BBHIIIIIIIII")   # switch/csrc/omnireduce.h's omr_hdr


class Attacker:
    """Sees every packet of the job on the relay (tap) and, before the relay forwards it, sends
    forgeries that overtake it: a DATA packet with the sniffed header and other values from the
    worker's address, a RESULT with other values to the worker, a NACK/ERROR to the worker, and
    replays of packets and results it saw earlier. `forge_up`, `forge_down`, `kill` make the
    protocol's forgeries from a sniffed packet (bytes)."""

    def __init__(self, relay, forge_up, forge_down, kill, every=3, back=600):
        self.relay, self.forge_up, self.forge_down, self.kill, self.every = relay, forge_up, forge_down, kill, every
        self.back = back   # a replay resends the packet seen this many packets earlier
        self.seen = {"up": [], "down": []}
        self.sent = dict.fromkeys(("forged_data", "forged_results", "kills", "replays"), 0)
        relay.tap = self.tap

    def tap(self, direction, data, worker):
        seen = self.seen[direction]
        seen.append((data, worker))
        count = len(seen)
        if direction == "up":
            if count % self.every == 0:
                self.relay.inject(self.forge_up(data), via=worker)
                self.sent["forged_data"] += 1
            if count % 5 == 0 and count > self.back:   # an old packet (many rounds back), again
                old, owner = seen[count - self.back]
                self.relay.inject(old, via=owner)
                self.sent["replays"] += 1
        else:
            if count % self.every == 0:
                self.relay.inject(self.forge_down(data), to_worker=worker)
                self.sent["forged_results"] += 1
            if count % 7 == 0 and self.kill is not None:
                self.relay.inject(self.kill(data), to_worker=worker)
                self.sent["kills"] += 1
            if count % 5 == 0 and count > self.back:   # an old result, again
                old, owner = seen[count - self.back]
                self.relay.inject(old, to_worker=owner)
                self.sent["replays"] += 1


def sml_forge(data):
    """Other values under the sniffed header (and its stale MAC, if any)."""
    if len(data) <= 28:
        return data
    body = bytearray(data)
    body[20:24] = (int.from_bytes(body[20:24], "big") ^ 0x00FF0000).to_bytes(4, "big")
    return bytes(body)


def sml_nack(data):
    """A NACK ("the switch does not know this job") for the worker, sealed like the switch's."""
    raw = bytearray(data[:sw.HDR_LEN])
    raw[0], raw[1], raw[11] = 3, 0, 1
    return sw.pack_header(*sw.HEADER.unpack(bytes(raw))[:7], token=int.from_bytes(raw[12:16], "big"), code=1)


def omr_forge(data):
    """Other values in the block, the checksum made right again (it is public)."""
    fields = list(OMR_HDR.unpack(data[:40]))
    mac = sw.lib.OMR_MAC_BYTES if fields[1] & sw.lib.OMR_F_MAC else 0
    payload = bytearray(data[40:len(data) - mac])
    if not payload:
        return data
    payload[0:4] = (int.from_bytes(payload[0:4], "little") ^ 0x40000000).to_bytes(4, "little")
    return omr_seal(fields, bytes(payload)) + data[len(data) - mac:]


def omr_seal(fields, payload):
    fields[11] = 0
    csum = sw.lib.tp_checksum(OMR_HDR.pack(*fields) + payload, 40 + len(payload))
    fields[11] = csum
    return OMR_HDR.pack(*fields) + payload


def omr_error(data):
    """An ERROR (OMR_ERR_JOB: "the aggregator lost the job") for the worker, no MAC."""
    fields = list(OMR_HDR.unpack(data[:40]))
    fields[0], fields[1], fields[9] = 6, 0, 1
    return omr_seal(fields, b"")


def closed_form(n, i, size, dtype):
    """Rank r's tensor i: (r + 1) * (k mod 1000) + i; the sum has a closed form."""
    k = np.arange(size) % 1000
    inputs = [((r + 1) * k + i).astype(dtype) for r in range(n)]
    want = (n * (n + 1) // 2 * k + n * i).astype(dtype)
    return inputs, want


def attack_switchml(n, authenticate, kill=True, elems=0):
    """elems: values per packet (0: the path's, on loopback the largest); replays go back about a
    tensor's packets."""
    import commlib.backends.switchml as sml
    backend_cls, relays = relayed(sml.SwitchMLBackend, Faults(), 7)
    tensors = [closed_form(n, i, size, np.int32) for i, size in enumerate((3000, 40000, 100000, 5000))]
    attackers, stats = [], {}

    def work(rank, backend):
        if rank == 0:
            attackers.append(Attacker(relays[0], sml_forge, sml_forge, sml_nack if kill else None,
                                      back=600 if elems == 256 else 12 * n))
        backend.ctx.barrier("attack")   # the attacker listens before anyone streams
        out = [backend.allreduce(inputs[rank], f"t{i}") for i, (inputs, _) in enumerate(tensors)]
        stats[rank] = backend.stats()
        if rank == 0:
            stats["switch"] = backend.switch_counters()["counters"]
        return out

    try:
        results = run_backends(n, backend_cls, work, authenticate=authenticate, switch_packet_elems=elems,
                            switch_window=32 if elems == 256 else 4,   # sets reused within `back` packets
                            switch_retransmit_ms=2.0, timeout_s=10.0)
    finally:
        for relay in relays:
            relay.stop()
    return results, [want for _, want in tensors], stats, attackers[0].sent


def attack_omnireduce(n, authenticate, kill=True):
    import commlib.backends.omnireduce as om
    backend_cls, relays = relayed(om.OmniReduceBackend, Faults(), 8)
    tensors = [closed_form(n, i, size, np.float32) for i, size in enumerate((3000, 20000, 7777))]
    attackers, stats = [], {}

    def work(rank, backend):
        if rank == 0:
            attackers.append(Attacker(relays[0], omr_forge, omr_forge, omr_error if kill else None))
        backend.ctx.barrier("attack")
        out = [backend.allreduce(inputs[rank], f"o{i}") for i, (inputs, _) in enumerate(tensors)]
        stats[rank] = backend.stats()
        return out

    try:
        results = run_backends(n, backend_cls, work, authenticate=authenticate, omnireduce_mode="dedicated",
                            omnireduce_num_aggregators=1, omnireduce_block_size=64, omnireduce_columns=16,
                            omnireduce_retransmit_ms=3.0, timeout_s=10.0)
    finally:
        for relay in relays:
            relay.stop()
    return results, [want for _, want in tensors], stats, attackers[0].sent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n, elems", [(2, 0), (4, 0), (2, 256)])
def test_switchml_job_stays_exact_under_attack(n, elems):
    results, wants, stats, sent = attack_switchml(n, authenticate=True, elems=elems)
    for rank in range(n):
        for i, want in enumerate(wants):
            np.testing.assert_array_equal(results[rank][i], want, err_msg=f"tensor {i} rank {rank}")
    assert min(sent.values()) > 0, sent
    switch = stats["switch"]
    assert switch["drop_bad_mac"] > 0 and switch["drop_late"] > 0, switch     # forgeries, replays
    workers = [stats[r] for r in range(n)]
    assert sum(w["bad_mac"] for w in workers) > 0 and sum(w["nacks"] for w in workers) > 0, workers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_omnireduce_job_stays_exact_under_attack(n):
    results, wants, stats, sent = attack_omnireduce(n, authenticate=True)
    for rank in range(n):
        for i, want in enumerate(wants):
            assert results[rank][i].tobytes() == want.tobytes(), f"tensor {i} rank {rank}"
    assert min(sent.values()) > 0, sent
    workers = [stats[r] for r in range(n)]
    assert sum(w["bad_mac"] for w in workers) > 0, workers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attack", [attack_switchml, functools.partial(attack_switchml, elems=256),
                                    attack_omnireduce])
def test_the_same_attack_lands_without_macs(attack):
    """The control: with authenticate off (the old data plane), the same attacker's forged data and
    results silently corrupt the sums, and its forged NACK/ERROR ends the job, so the tests above
    would fail on the old code. (The NACK case with 256 values per packet: with the path's large
    packets one rank may be the only one to get a NACK, and the other's timeout is raised first.)"""
    results, wants, _, _ = attack(2, authenticate=False, kill=False)
    wrong = sum(int((results[r][i] != want).sum()) for r in range(2) for i, want in enumerate(wants))
    assert wrong > 0, "the forgeries did not land: the attacker above proves nothing"
    kill = functools.partial(attack, elems=256) if attack is attack_switchml else attack
    with pytest.raises(CommError, match="does not know this job"):
        kill(2, authenticate=False)


# -- omnireduce: an authenticated job on an aggregator of this process ----------------------------
@pytest.fixture
def keyed_aggregator(monkeypatch):
    """A commlib-aggregator with a daemon key, and ranks that hold it (as a key file would give it)."""
    from commlib.backends import keys
    from commlib.switch.aggregator import Aggregator
    monkeypatch.setattr(keys, "daemon_key", lambda ctx, embedded, *args: DAEMON_KEY)
    agg = Aggregator("127.0.0.1", 0, key=DAEMON_KEY).start()
    yield agg
    agg.close()


def omnireduce_group(agg, **kw):
    from commlib.settings import Settings
    from commlib.testing import LocalGroup
    return LocalGroup(2, Settings({"timeout_s": 3.0, "omnireduce_mode": "dedicated", "omnireduce_block_size": 32,
                                   "omnireduce_aggregators": agg.address_str, **kw}))


def test_aggregator_drops_unsigned_packets_of_an_authenticated_job(keyed_aggregator):
    import commlib.backends.omnireduce as om
    agg = keyed_aggregator
    group = omnireduce_group(agg)
    backends = group.run(lambda ctx: om.OmniReduceBackend(ctx), 20)
    group.run(lambda ctx: backends[ctx.rank].start(), 20)
    try:
        x = np.arange(1000, dtype=np.float32)
        out = group.run(lambda ctx: backends[ctx.rank].allreduce(x, "x"), 20)
        assert all(o.tobytes() == (2 * x).tobytes() for o in out) and backends[0].stats()["authenticated"]
        (job,) = agg._jobs.values()
        forged = omr_seal([1, 0, 0, job.id, job.key, 2, 0, 0, 0, 0xFFFFFFFF, 0, 0], bytes(128))
        attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        attacker.settimeout(0.3)
        attacker.sendto(forged, agg.address)                       # the job's id and key, no MAC
        with pytest.raises(socket.timeout):
            attacker.recv(100)                                     # no answer, not even an ERROR
        attacker.close()
        stats = agg.stats()
        assert stats["bad_mac"] == 1 and stats["refused"] == 0, stats
    finally:
        group.run(lambda ctx: backends[ctx.rank].close(), 20)


def test_restarted_aggregator_is_still_a_clear_error_with_macs(keyed_aggregator):
    """A restarted aggregator answers with an unsigned ERROR (it has no key for the job): workers
    wait for their timeout (a forged ERROR must end no job), then report it, not a bare timeout."""
    import time
    import commlib.backends.omnireduce as om
    from commlib.errors import PeerFailure
    from commlib.switch.aggregator import Aggregator
    agg = keyed_aggregator
    group = omnireduce_group(agg)
    backends = group.run(lambda ctx: om.OmniReduceBackend(ctx), 20)
    group.run(lambda ctx: backends[ctx.rank].start(), 20)
    port = agg.address[1]
    agg.close()
    again = Aggregator("127.0.0.1", port, key=DAEMON_KEY).start()   # same address, no memory of the job
    try:
        def reduce(ctx):
            start = time.monotonic()
            try:
                backends[ctx.rank].allreduce(np.ones(100, np.float32), "x")
            except PeerFailure as exc:
                return exc, time.monotonic() - start
            return None, time.monotonic() - start
        for error, elapsed in group.run(reduce, 30):
            assert error is not None and "does not know this job" in str(error), error
            assert 3.0 <= elapsed < 8.0, elapsed
    finally:
        group.run(lambda ctx: backends[ctx.rank].close(), 20)
        again.close()


def test_a_flood_does_not_hold_a_worker_past_its_timeout():
    """Packets that keep the worker's receive batches full (junk from the switch's address, cheap to
    send) must not keep it from its timeout: the worker used to read on while every batch came back
    full, checking neither its timers nor its timeout, for as long as the flood lasted."""
    from commlib._native import ffi, lib
    flood = 10000
    fake_switch = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)      # never answers, only floods
    fake_switch.bind(("127.0.0.1", 0))
    sock = net.udp_socket("127.0.0.1", 0, 16 << 20)                    # as the backends make theirs
    sock.connect(fake_switch.getsockname())
    worker = lib.sml_worker_new(sock.fileno(), 0, 0, TOKEN, 2, 1, 64, 1000.0, 1000.0, 0, ffi.NULL, 0)
    try:
        for _ in range(flood):                       # a backlog standing in for a flood at line rate
            fake_switch.sendto(b"junk", sock.getsockname())
        x, out = np.ones(64, np.int32), np.zeros(64, np.int32)
        rc = lib.sml_worker_allreduce(worker, 1, ffi.from_buffer(x), ffi.from_buffer(out), 64, ffi.NULL, ffi.NULL,
                                      ffi.NULL, 1)
        counters = ffi.new("sml_worker_counters *")
        lib.sml_worker_counters_get(worker, counters)
        sock.setblocking(False)
        left = 0
        try:
            while True:
                sock.recv(64)
                left += 1
        except BlockingIOError:
            pass
        assert rc == lib.SML_E_TIMEOUT
        assert counters.ignored + left == flood, "the socket could not hold the backlog (run as root)"
        assert counters.ignored < flood // 2, (counters.ignored, left)  # it stopped reading at its timeout
    finally:
        lib.sml_worker_free(worker)
        sock.close()
        fake_switch.close()
