"""Fuzz targets (atheris, tests/fuzz/run.py) for what an attacker on the segment reaches first:

  controller_hello    rank 0's controller before the job forms (commlib.controller: its challenge, then a
                      stranger's hello: raw bytes, or framed hellos with fuzzed fields and lengths)
  switch_control      SwitchServer.handle behind control.answer (the switch's TCP control port)
  aggregator_control  Aggregator.handle behind control.answer (an aggregator's control datagrams)
  switch_packets      the switch's C packet handler (sml_switch_run on a loopback socket)
  switch_leaf_packets the same for a leaf switch: its workers' packets and its parent's results (switchml.h:
                      hierarchy), with its upward resend timers firing
  aggregator_packets  the aggregator's C packet handler (omr_agg_run on a loopback socket)

Each takes the fuzzer's bytes and fails (an exception: atheris reports it as a crash, with the
input) when a daemon would misbehave: a handler raising past `answer`, an error counted as
"internal" (an exception nobody foresaw), an answer that is not JSON, slots that leak, a controller
that admits a stranger, keeps its connection or stops. The C
targets crash the process when ASan/UBSan (tests/fuzz/build_sanitized.py) sees a memory error or
undefined behaviour. Half of the inputs are built as plausible requests or sealed packets (the
right job, token, key and checksum) so that the fuzzer gets past the first checks. The packet rigs'
jobs MAC with the algorithm COMMLIB_FUZZ_MAC names (switch/packet_mac.py; default aes-256-gcm):
tests/test_mac.py runs them with each.
"""
import json
import logging
import os
import socket
import struct
import time

import atheris

with atheris.instrument_imports(include=["commlib"]):      # coverage of the Python control handlers guides the fuzzer
    from commlib import controller
    from commlib.switch import aggregator as agg, auth, control, packet_mac
    from commlib.switch import switchml as sw

from commlib._native import ffi, lib   # noqa: E402  (the sanitized build when run.py loaded it)

if os.environ.get("COMMLIB_FUZZ_PLANTED_BUG"):   # tests/test_fuzz.py: the harness must find this one
    _handle = sw.SwitchServer._handle

    def _buggy(self, request, source):
        if request.get("op") == "status" and "job" in request:
            return {"bug": 1 // 0}
        return _handle(self, request, source)
    sw.SwitchServer._handle = _buggy

OPS = ["register", "unregister", "keepalive", "counters", "simulate", "status", "nope"]
FIELDS = ["op", "token", "workers", "streams", "slots", "elems", "nonce", "job", "rank", "seq", "mac", "epoch", "size",
          "columns", "aggregators", "index", "block", "loss", "dup", "ingress", "egress", "duplicate", "seed"]
KEY = bytes(range(32))
TOKEN = 0x1234ABCD
JOB_KEY = bytes(range(100, 116))        # the rigs' data-plane job key (their packets' MACs)
SOURCE = ("127.0.0.1", 40000)
MAC = packet_mac.code(os.environ.get("COMMLIB_FUZZ_MAC", "aes-256-gcm"))   # the rigs' packet MAC algorithm


def _value(fdp, depth=0):
    kind = fdp.ConsumeIntInRange(0, 9)
    if kind == 0:
        return fdp.ConsumeIntInRange(-2, 300)
    if kind == 1:
        return fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 20))
    if kind == 2:
        return fdp.ConsumeFloat()
    if kind == 3:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
    if kind == 4:
        return None
    if kind == 5:
        return fdp.ConsumeBool()
    if kind == 6 and depth < 3:
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    if kind == 7 and depth < 3:
        return {fdp.ConsumeUnicodeNoSurrogates(8): _value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))}
    if kind == 8:
        return [["127.0.0.1", fdp.ConsumeIntInRange(0, 70000)] for _ in range(fdp.ConsumeIntInRange(0, 70))]
    if kind == 9 and depth < 1 and fdp.ConsumeBool():   # a register's streams: worker lists
        return [_value(fdp, 3) if fdp.ConsumeBool() else [["127.0.0.1", fdp.ConsumeIntInRange(0, 70000)]] * 3
                for _ in range(fdp.ConsumeIntInRange(0, 3))]
    return auth.new_nonce()


def _request(fdp):
    """Raw bytes, or a request dict with fuzzed fields, signed or not."""
    if fdp.ConsumeBool():
        return control.decode(fdp.ConsumeBytes(fdp.remaining_bytes()))
    request = {"op": fdp.PickValueInList(OPS)}
    for _ in range(fdp.ConsumeIntInRange(0, 10)):
        request[fdp.PickValueInList(FIELDS)] = _value(fdp)
    how = fdp.ConsumeIntInRange(0, 2)
    if how == 1:       # as a job would sign it (register: the job key of its nonce)
        nonce = request.get("nonce") if isinstance(request.get("nonce"), str) else ""
        return auth.sign(auth.job_key(KEY, nonce), request, fdp.ConsumeInt(8))
    if how == 2:       # as the operator would
        return auth.sign(KEY, request, fdp.ConsumeInt(8))
    return request


def _check_answer(reply, drops):
    assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
    control.encode(reply)                                   # every answer can go on the wire
    assert "internal" not in drops.snapshot(), "a handler raised an exception nobody foresaw (see the log)"


# -- control handlers -------------------------------------------------------------------------------
_switches = None


def switch_control(data):
    global _switches
    if _switches is None:
        _switches = [sw.SwitchServer("127.0.0.1", 0, slots=1024, testing=True, limits=sw.Limits.for_pool(1024),
                                     threads=2),
                     sw.SwitchServer("127.0.0.1", 0, slots=1024, key=KEY)]
        for server in _switches:
            server.start()
    fdp = atheris.FuzzedDataProvider(data)
    server = _switches[fdp.ConsumeIntInRange(0, 1)]
    reply = control.answer(lambda r: server.handle(r, "10.0.0.1"), _request(fdp), server.drops)
    if isinstance(reply, control.Deferred):                 # a leaf's register: its probe of the parent here
        reply = reply.answer(server.drops)
    _check_answer(reply, server.drops)
    with server._lock:
        for i, (_, shard) in enumerate(server._shards):      # each thread's pool against the jobs' shares on it
            held = sum(sw.split(job.slots, job.streams)[i] for job in server._jobs.values() if i < job.streams)
            assert lib.sml_switch_free_slots(shard) + held == server.slots, "slots leaked"
        for job in list(server._jobs.values()):             # the next input starts with an empty switch
            server._remove(job)


_aggregators = None


def aggregator_control(data):
    global _aggregators
    if _aggregators is None:
        _aggregators = [agg.Aggregator("127.0.0.1", 0), agg.Aggregator("127.0.0.1", 0, key=KEY)]
    fdp = atheris.FuzzedDataProvider(data)
    aggregator = _aggregators[fdp.ConsumeIntInRange(0, 1)]
    reply = control.answer(lambda r: aggregator.handle(r, SOURCE), _request(fdp), aggregator.drops)
    _check_answer(reply, aggregator.drops)
    for ident in list(aggregator._jobs):
        aggregator._remove(ident)


# -- rank 0's controller before the job forms ----------------------------------------------------------
_controller = None
SECRET = bytes(range(200, 232))   # the job's


def _hello(fdp, challenge):
    """What a stranger sends after the challenge: raw bytes, or a framed hello whose fields and length
    are fuzzed; its proof is the secret's where the hello could not admit it anyway (another kind of
    message, a rank outside the job), so that the checks after the proof's are reached too."""
    if fdp.ConsumeIntInRange(0, 3) == 0:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 2 * controller.HELLO_BYTES))
    nonce = fdp.ConsumeBytes(controller.NONCE_BYTES if fdp.ConsumeIntInRange(0, 3) else fdp.ConsumeIntInRange(0, 40))
    kind = fdp.PickValueInList(["hello", "hello", "welcome", "submit", None])
    rank = fdp.ConsumeIntInRange(-2, 4) if fdp.ConsumeIntInRange(0, 3) else _value(fdp)
    hello = {"t": kind, "rank": rank, "nonce": nonce.hex(), "proof": fdp.ConsumeUnicodeNoSurrogates(40)}
    for _ in range(fdp.ConsumeIntInRange(0, 2)):   # missing, extra or retyped fields
        field = fdp.PickValueInList(["t", "rank", "nonce", "proof", "extra"])
        if fdp.ConsumeBool():
            hello.pop(field, None)
        else:
            hello[field] = _value(fdp)
    rank = hello.get("rank")
    admissible = hello.get("t") == "hello" and type(rank) is int and 0 <= rank < _controller.size
    if not admissible and isinstance(rank, int) and hello.get("nonce") == nonce.hex() and \
            len(nonce) == controller.NONCE_BYTES and fdp.ConsumeBool():
        hello["proof"] = controller.proof(controller.session_key(SECRET, challenge, nonce, rank & 0xFFFFFFFF))
    body = json.dumps(hello).encode()
    length = len(body) if fdp.ConsumeIntInRange(0, 3) else fdp.ConsumeInt(4) & 0xFFFFFFFF
    return struct.pack("!I", length) + body[:fdp.ConsumeIntInRange(0, len(body))] if length != len(body) \
        else struct.pack("!I", length) + body


def controller_hello(data):
    """A stranger connects to rank 0's controller of a job of 4 ranks that has not formed yet: it is
    never admitted, its connection ends once it stopped sending (at once here: it half-closes), and
    the controller keeps serving the next one."""
    global _controller
    if _controller is None:
        logging.getLogger("commlib").setLevel(logging.ERROR)   # a refusal per input is logged as a warning
        _controller = controller.ControllerServer(4, "127.0.0.1", 0, None, 1e6, 1.0, secret=SECRET)
    fdp = atheris.FuzzedDataProvider(data)
    with socket.create_connection(_controller.address, timeout=5.0) as sock:
        challenge = controller.recv_msg(sock, deadline=time.monotonic() + 5.0)
        try:
            sock.sendall(_hello(fdp, bytes.fromhex(challenge["nonce"])))
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(4096):   # until the controller closes it
                pass
        except socket.timeout:
            raise AssertionError(f"the controller kept a stranger's connection open (ranks admitted: "
                                 f"{sorted(_controller._clients)})") from None
        except OSError:   # reset: it closed while bytes were unread
            pass
    assert _controller._thread.is_alive(), "the controller stopped"
    assert not _controller._clients, f"a stranger was admitted as rank(s) {sorted(_controller._clients)}"


# -- C packet handlers ------------------------------------------------------------------------------
def _loopback(n):
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
        socks.append(s)
    return socks


def _drain(socks):
    for s in socks:
        try:
            while s.recv(65536):
                pass
        except (BlockingIOError, ConnectionRefusedError):
            pass


class _SwitchRig:
    """A C switch on a loopback socket with jobs 0 and 1 (2 ranks each: our two sender sockets), of
    Tofino's 64 values per packet and of 1001 (a path's size, not a multiple of any vector width)."""
    ELEMS = (64, 1001)

    def __init__(self):
        self.sock, *self.ranks = _loopback(3)
        self.sw = lib.sml_switch_new(self.sock.fileno(), 1024, 64, 0)
        self.mac = lib.tp_mac_new(JOB_KEY, b"commlib switchml packets", MAC)
        for job, elems in enumerate(self.ELEMS):
            assert lib.sml_switch_add_job(self.sw, job, TOKEN, 2, 64, elems, JOB_KEY, MAC) == 0
            for rank, s in enumerate(self.ranks):
                ip = struct.unpack("!I", socket.inet_aton("127.0.0.1"))[0]
                lib.sml_switch_set_addr(self.sw, job, rank, ip, s.getsockname()[1])
        self.address = self.sock.getsockname()


_switch_rig = None


def _switch_packet(fdp, rank):
    """A DATA-like packet of job 0 or 1 whose fields are fuzzed within (or just beyond) their ranges,
    with the payload its size code asks for, sealed with the job's token, a valid checksum and
    mostly a valid MAC."""
    job = fdp.ConsumeIntInRange(0, 1)
    size_code = fdp.ConsumeIntInRange(0, 3)
    flags = size_code | (lib.SML_F_NONFINITE if fdp.ConsumeBool() else 0) | \
        (lib.SML_F_MAC if fdp.ConsumeIntInRange(0, 7) else 0) | (fdp.ConsumeIntInRange(0, 15) << 4 if fdp.ConsumeIntInRange(0, 7) == 0 else 0)
    kind = fdp.PickValueInList([lib.SML_DATA, lib.SML_DATA, lib.SML_DATA, lib.SML_RESULT, lib.SML_NACK, 0, 255])
    slot = fdp.ConsumeIntInRange(0, 3) if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(0, 70)
    packet_id = slot if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(0, 300)   # mostly the slot's own
    sender = rank if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(0, 255)
    header = sw.pack_header(kind, flags & 0xFF, job, sender, packet_id, slot | fdp.ConsumeIntInRange(0, 1) << 15,
                            fdp.ConsumeIntInRange(-128, 127), TOKEN)
    elems = {0: 0, 1: 64, 2: 256, 3: _SwitchRig.ELEMS[job]}[size_code]
    extra = fdp.ConsumeIntInRange(-2, 2) if fdp.ConsumeIntInRange(0, 7) == 0 else 0
    payload = fdp.ConsumeBytes(max(0, elems * (5 if flags & lib.SML_F_NONFINITE else 4) + extra))
    if not flags & lib.SML_F_MAC or not fdp.ConsumeIntInRange(0, 7):
        return header + payload
    return header + payload + _sml_mac(sender, packet_id, header + payload)


def _sml_mac(rank, packet_id, data):
    """switchml.h's MAC of a DATA packet (ids stay small here: the switch extends them to themselves)."""
    tag = ffi.new("uint8_t[16]")
    full = packet_id.to_bytes(8, "big")
    lib.tp_mac_tag(_switch_rig.mac, bytes([lib.SML_DATA, rank & 0xFF, 0, 0]) + full, full, 8, data, len(data), tag)
    return bytes(tag)


def _omr_mac(rig, header, payload):
    """omnireduce.h's MAC of a worker's packet (no stamp): the next nonce counter, then the tag."""
    rig.counter += 1
    counter = rig.counter.to_bytes(lib.OMR_NONCE_BYTES, "little")
    tag = ffi.new("uint8_t[16]")
    lib.tp_mac_tag(rig.mac, header[:1] + b"\0" + header[2:4] + counter, header, len(header), payload, len(payload), tag)
    return counter + bytes(tag)


class _LeafRig:
    """A C switch whose job 0 (2 ranks, 4 slots of 64 values) is a leaf: rank 1 of job 7 of a parent at a
    third loopback socket, whose results the fuzzer sends; job 1 a decoy leaf of the same parent job."""
    PARENT_JOB = 7

    def __init__(self):
        self.sock, *self.ranks, self.parent = _loopback(4)
        self.sw = lib.sml_switch_new(self.sock.fileno(), 1024, 64, 0)
        self.mac = lib.tp_mac_new(JOB_KEY, b"commlib switchml packets", MAC)
        ip = struct.unpack("!I", socket.inet_aton("127.0.0.1"))[0]
        assert lib.sml_switch_add_job(self.sw, 0, TOKEN, 2, 4, 64, JOB_KEY, MAC) == 0
        for rank, s in enumerate(self.ranks):
            lib.sml_switch_set_addr(self.sw, 0, rank, ip, s.getsockname()[1])
        assert lib.sml_switch_set_parent(self.sw, 0, ip, self.parent.getsockname()[1], self.PARENT_JOB, 1, TOKEN,
                                         JOB_KEY, MAC, 1.0, 10.0, 1000) == 0
        # a decoy: job 1, another leaf of the same parent job (no MAC, another token), is offered every result too
        assert lib.sml_switch_add_job(self.sw, 1, TOKEN + 1, 1, 4, 64, ffi.NULL, 0) == 0
        lib.sml_switch_set_addr(self.sw, 1, 0, ip, self.ranks[0].getsockname()[1])
        assert lib.sml_switch_set_parent(self.sw, 1, ip, self.parent.getsockname()[1], self.PARENT_JOB, 0, TOKEN + 1,
                                         ffi.NULL, MAC, 0.05, 10.0, 3) == 0
        self.address = self.sock.getsockname()
        self.seq = 0


_leaf_rig = None


def _parent_result(fdp, rig):
    """A RESULT of the parent's job for one of the leaf's sets: fuzzed fields, the payload its size code asks
    for, the stamp, and mostly the seq and a valid MAC (switchml.h)."""
    size_code = fdp.PickValueInList([0, 0, 0, 1, 3, 2])
    flags = size_code | lib.SML_F_STAMP | lib.SML_F_MAC | (lib.SML_F_NONFINITE if fdp.ConsumeIntInRange(0, 3) == 0 else 0)
    packet_id = fdp.ConsumeIntInRange(0, 12)
    slot = packet_id % 4 if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(0, 70)
    job = rig.PARENT_JOB if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(0, 255)
    header = sw.pack_header(lib.SML_RESULT, flags, job, fdp.ConsumeIntInRange(0, 2), packet_id,
                            slot | fdp.ConsumeIntInRange(0, 1) << 15, fdp.ConsumeIntInRange(-128, 127), TOKEN)
    elems = {0: 0, 1: 64, 2: 256, 3: 64}[size_code]
    extra = fdp.ConsumeIntInRange(-2, 2) if fdp.ConsumeIntInRange(0, 7) == 0 else 0
    body = header + fdp.ConsumeBytes(max(0, elems * (5 if flags & lib.SML_F_NONFINITE else 4) + extra)) + \
        fdp.ConsumeBytes(lib.SML_STAMP_LEN)
    rig.seq += 1
    body += rig.seq.to_bytes(8, "big")
    if not fdp.ConsumeIntInRange(0, 7):
        return body + fdp.ConsumeBytes(16)
    tag, full = ffi.new("uint8_t[16]"), packet_id.to_bytes(8, "big")
    lib.tp_mac_tag(rig.mac, bytes([lib.SML_RESULT, 0, 0, 0]) + rig.seq.to_bytes(8, "big"), full, 8, body, len(body), tag)
    return body + bytes(tag)


def switch_leaf_packets(data):
    global _leaf_rig, _switch_rig
    _leaf_rig = _leaf_rig or _LeafRig()
    _switch_rig = _switch_rig or _leaf_rig   # _switch_packet's MACs: the same job key
    fdp = atheris.FuzzedDataProvider(data)
    for _ in range(fdp.ConsumeIntInRange(1, 8)):             # workers complete sets, the parent answers them
        what = fdp.ConsumeIntInRange(0, 4)
        if what <= 1:    # both ranks' exponent of packet p: its set completes and goes up
            p = fdp.ConsumeIntInRange(0, 12)
            for rank, sock in enumerate(_leaf_rig.ranks):
                header = sw.pack_header(lib.SML_DATA, lib.SML_F_MAC, 0, rank, p, p % 4 | (p // 4 % 2) << 15,
                                        fdp.ConsumeIntInRange(-128, 127), TOKEN)
                sock.sendto(header + _sml_mac(rank, p, header), _leaf_rig.address)
        elif what == 2:
            _leaf_rig.parent.sendto(_parent_result(fdp, _leaf_rig), _leaf_rig.address)
        elif what == 3:
            rank = fdp.ConsumeIntInRange(0, 1)
            _leaf_rig.ranks[rank].sendto(_switch_packet(fdp, rank), _leaf_rig.address)
        else:
            _leaf_rig.parent.sendto(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 400)), _leaf_rig.address)
    assert lib.sml_switch_run(_leaf_rig.sw, fdp.ConsumeIntInRange(0, 2)) >= 0   # 1-2 ms: resend timers fire
    _drain(_leaf_rig.ranks + [_leaf_rig.parent])


def switch_packets(data):
    global _switch_rig
    _switch_rig = _switch_rig or _SwitchRig()
    fdp = atheris.FuzzedDataProvider(data)
    rank = fdp.ConsumeIntInRange(0, 1)
    for _ in range(fdp.ConsumeIntInRange(1, 8)):             # a few packets per input: slots fill and complete
        if fdp.ConsumeBool():
            packet = _switch_packet(fdp, rank)
        else:
            packet = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 1400))
        _switch_rig.ranks[rank].sendto(packet, _switch_rig.address)
        rank = fdp.ConsumeIntInRange(0, 1)
    assert lib.sml_switch_run(_switch_rig.sw, 0) >= 0
    _drain(_switch_rig.ranks)


class _AggregatorRig:
    """A C aggregator on a loopback socket with one job (2 ranks: our two sender sockets) of
    BLOCK-element blocks (not a multiple of the 8-lane vectors)."""
    KEY = 0x5EC12E7
    BLOCK = 1001

    def __init__(self):
        self.sock, *self.ranks = _loopback(3)
        self.agg = lib.omr_agg_new(self.sock.fileno(), 12345)
        self.job = lib.omr_agg_add_job(self.agg, self.KEY, 2, 8, 1, 0, self.BLOCK, 0.0, 0.0, JOB_KEY, MAC)
        self.mac, self.counter = lib.tp_mac_new(JOB_KEY, b"commlib omnireduce packets", MAC), 0
        assert self.job >= 0
        for rank, s in enumerate(self.ranks):
            assert lib.omr_agg_set_worker(self.agg, self.job, rank, b"127.0.0.1", s.getsockname()[1]) == 0
        self.address = self.sock.getsockname()
        self.ctrl, self.ip, self.port = ffi.new("uint8_t[]", 4096), ffi.new("char[]", 64), ffi.new("int *")


_aggregator_rig = None


def _aggregator_packet(fdp, rig, rank):
    """A packet of the rig's job, fields fuzzed within (or just beyond) their ranges, sealed with
    the job's key, a valid checksum and mostly a valid MAC (omr_hdr: little-endian,
    switch/csrc/omnireduce.h)."""
    kind = lib.OMR_DATA if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 7)
    flags = fdp.ConsumeIntInRange(0, 15) if fdp.ConsumeIntInRange(0, 3) == 0 else fdp.ConsumeIntInRange(0, 1)
    small = lambda top: fdp.ConsumeIntInRange(0, top) if fdp.ConsumeIntInRange(0, 15) else fdp.ConsumeInt(4) & 0xFFFFFFFF
    col, rnd = small(2), small(2)
    block = col + 8 * rnd if fdp.ConsumeIntInRange(0, 7) else small(30)        # mostly the round's own block
    nxt = 0xFFFFFFFF if fdp.ConsumeBool() else block + 8 * fdp.ConsumeIntInRange(0, 2)   # OMR_INF: the column ends
    fields = [v & 0xFFFFFFFF for v in (small(1), col, rnd, block, nxt, small(8))]   # seq col round block next ack
    if fdp.ConsumeIntInRange(0, 7):
        flags |= lib.OMR_F_MAC
    pack = lambda csum: struct.pack("<BBHIIIIIIIII", kind, flags, rank_field, rig.job, rig.KEY, *fields, csum)
    rank_field = rank if fdp.ConsumeIntInRange(0, 7) else small(70) & 0xFFFF
    length = 0 if flags & lib.OMR_F_ZERO else rig.BLOCK * 4
    if fdp.ConsumeIntInRange(0, 7) == 0:
        length = fdp.ConsumeIntInRange(0, rig.BLOCK * 4 + 8)
    payload = fdp.ConsumeBytes(length)
    header = pack(lib.tp_checksum(pack(0) + payload, lib.OMR_HDR_BYTES + len(payload)))
    mac = _omr_mac(rig, header, payload) if flags & lib.OMR_F_MAC and fdp.ConsumeIntInRange(0, 7) else b""
    return header + payload + mac


def aggregator_packets(data):
    global _aggregator_rig
    _aggregator_rig = rig = _aggregator_rig or _AggregatorRig()
    fdp = atheris.FuzzedDataProvider(data)
    for _ in range(fdp.ConsumeIntInRange(1, 8)):
        rank = fdp.ConsumeIntInRange(0, 1)
        packet = _aggregator_packet(fdp, rig, rank) if fdp.ConsumeBool() else fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 300))
        rig.ranks[rank].sendto(packet, rig.address)
    while lib.omr_agg_run(rig.agg, 1) > 0:                  # control datagrams wait for Python: pop them
        while lib.omr_agg_pop_ctrl(rig.agg, rig.ctrl, 4096, rig.ip, rig.port) >= 0:
            pass
    _drain(rig.ranks)


def asan_selftest(data):
    """Not a target: a checksum read 64 bytes past a 4-byte buffer, which the sanitized build must
    report (tests/test_fuzz.py checks that it does, so a build that lost its sanitizers fails)."""
    lib.tp_checksum(ffi.new("uint8_t[]", 4), 68)


TARGETS = {f.__name__: f for f in (controller_hello, switch_control, aggregator_control, switch_packets,
                                   switch_leaf_packets, aggregator_packets)}
SELFTESTS = {"asan_selftest": asan_selftest}
