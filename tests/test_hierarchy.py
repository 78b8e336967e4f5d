"""Two-level switchml aggregation (switch/csrc/switchml.h: hierarchy): jobs of more than 64 ranks stream
to leaf switches, whose complete partial sums go to a spine switch as one contribution each and whose
results come back down.

The large jobs run as worker processes (tests/hierarchy_worker.py) that drive the C worker data path
directly, several ranks per process as threads, numpy only, so 96 ranks fit a 2-core machine; the
switches are SwitchServers of this process, registered here (the registration the backend does is
tested through the backend with a few ranks). Every float result is checked bit for bit against numpy's
sum of the quantized values (the workers' own kernels, the scale of the whole job's ranks)."""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import commlib.backends.switchml as sml
from commlib import kernels
from commlib.errors import CommError, ConfigError, PeerFailure
from commlib.settings import Settings
from commlib.switch import auth, control, net
from commlib.switch import switchml as sw
from commlib.switch.relay import FaultRelay, Faults
from commlib.testing import LocalGroup

from hierarchy_worker import TOKEN, tensor
from helpers import fuzz

if sw.lib is None:   # not built: a failure of the suite, never a quiet skip
    raise ImportError(sw.IMPORT_ERROR)

pytestmark = pytest.mark.timeout(180)

HELPER = str(Path(__file__).with_name("hierarchy_worker.py"))
KEY = auth.new_key()     # the daemon key of every switch of these trees
WINDOW, ELEMS = 4, 256
TENSORS = [("float", 3000, 1), ("int", 700, 2), ("float", 1, 3), ("float", 1500, 4)]


def switches(count, **kw):
    return [sw.SwitchServer("127.0.0.1", 0, slots=64, key=KEY, **kw).start() for _ in range(count)]


def stop(servers):
    for server in servers:
        server.stop()


def register(leaves, leaf_of, addrs, spine=None, up_relay=None):
    """One job: rank r on leaves[leaf_of[r]], seen there at addrs[r]; with `spine` the leaves' parent (behind
    up_relay if given). Returns per rank (job number, its rank on its switch, its key in hex)."""
    parent = None
    if spine is not None:
        nonce = auth.new_nonce()
        key = auth.job_key(KEY, nonce)
        seen = [("127.0.0.1", leaf.port) for leaf in leaves]
        if up_relay is not None:
            seen = [up_relay.link(a) for a in seen]
        reply = spine.register(TOKEN, [list(a) for a in seen], WINDOW, ELEMS, nonce, key)
        host, port = up_relay.address if up_relay is not None else ("127.0.0.1", spine.port)
        parent = {"address": f"{host}:{port}", "ports": [port], "job": reply["job"], "token": TOKEN, "nonce": nonce,
                  "authenticated": True, "check": auth.key_check(key), "rto_ms": 2.0, "rto_max_ms": 50.0,
                  "control": spine.address}
    out = [None] * len(leaf_of)
    for j, leaf in enumerate(leaves):
        ranks = [r for r in range(len(leaf_of)) if leaf_of[r] == j]
        nonce = auth.new_nonce()
        key = auth.job_key(KEY, nonce)
        reply = leaf.register(TOKEN, [list(addrs[r]) for r in ranks], WINDOW, ELEMS, nonce, key,
                              parent=None if parent is None else dict(parent, rank=j))
        for local, r in enumerate(ranks):
            out[r] = (reply["job"], local, key.hex())
    return out


def run_ranks(connect, setup, procs=8, timeout_ms=30000):
    """Rank r streams to connect[r] (host, port); setup(addrs) registers the job and returns register()'s
    list. Returns each rank's outputs (a list per rank) and return codes."""
    n = len(connect)
    tmp = tempfile.mkdtemp(prefix="commlib-hier-")
    children = []
    try:
        for c, ranks in enumerate(np.array_split(np.arange(n), procs)):
            ranks = [int(r) for r in ranks]
            child = subprocess.Popen([sys.executable, HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
            spec = {"connect": [list(connect[r]) for r in ranks], "ranks": ranks, "n": n, "window": WINDOW,
                    "elems": ELEMS, "tensors": TENSORS, "timeout_ms": timeout_ms, "rto_ms": 2.0,
                    "out": os.path.join(tmp, f"{c}.npz")}
            child.stdin.write(json.dumps(spec) + "\n")
            child.stdin.flush()
            children.append((child, ranks, spec["out"]))
        addrs = [None] * n
        for child, ranks, _ in children:
            for r, a in zip(ranks, json.loads(child.stdout.readline())["addrs"]):
                addrs[r] = tuple(a)
        regs = setup(addrs)
        for child, ranks, _ in children:
            child.stdin.write(json.dumps({"jobs": [regs[r][0] for r in ranks], "locals": [regs[r][1] for r in ranks],
                                          "keys": [regs[r][2] for r in ranks]}) + "\n")
            child.stdin.flush()
        outs, codes = {}, {}
        for child, ranks, path in children:
            assert json.loads(child.stdout.readline()) == {"done": True}, f"worker process of ranks {ranks} failed"
            child.wait(30)
            with np.load(path) as data:
                for r in ranks:
                    codes[r] = list(data[f"rc_{r}"])
                    outs[r] = [data[f"r{r}_{t}"] for t in range(len(codes[r]))]
        return outs, codes
    finally:
        for child, _, _ in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def expected(kind, size, seed, n):
    """numpy's sum of every rank's quantized blocks (the workers' kernel, the job's scale), dequantized."""
    xs = [tensor(kind, size, seed, r) for r in range(n)]
    if kind == "int":
        total = np.sum(np.stack(xs).astype(np.int64), axis=0) % 2 ** 32
        return np.where(total >= 2 ** 31, total - 2 ** 32, total).astype(np.int32)
    exps = np.max([kernels.block_exponents(x, ELEMS)[0] for x in xs], axis=0)
    out = np.empty(size, np.float32)
    ffi, lib = sw.ffi, sw.lib
    for b, e in enumerate(exps):
        lo, hi = b * ELEMS, min(size, (b + 1) * ELEMS)
        total = np.zeros(hi - lo, np.int64)
        for x in xs:
            be = ffi.new("uint8_t[]", 4 * (hi - lo))
            lib.cl_quantize_be(ffi.cast("float *", ffi.from_buffer(x[lo:hi])), hi - lo, int(e), n, be)
            total += np.frombuffer(ffi.buffer(be), ">i4")
        assert np.all(np.abs(total) <= 2 ** 31 - 1), "the n-way sum of values quantized for n ranks overflowed"
        summed = total.astype(">i4").tobytes()   # held: a cast keeps no reference to its buffer
        lib.cl_dequantize_be(ffi.cast("uint8_t *", ffi.from_buffer(summed)), hi - lo, int(e), n,
                             ffi.cast("float *", ffi.from_buffer(out[lo:hi])))
    return out


def assert_exact(outs, codes, n):
    for t, (kind, size, seed) in enumerate(TENSORS):
        want = expected(kind, size, seed, n)
        for r in range(n):
            assert codes[r][t] >= 0, f"rank {r}, tensor {t}: error code {codes[r][t]}"
            got = outs[r][t]
            assert got.tobytes() == want.tobytes(), (
                f"rank {r}, tensor {t} ({kind} of {size}): {np.count_nonzero(got != want)} values differ from numpy's "
                f"sum of the quantized values, first at {np.flatnonzero(got != want)[:5]}")


def loopback(servers):
    return [("127.0.0.1", s.port) for s in servers]


def test_96_ranks_through_two_leaves_and_a_spine_are_exact():
    *leaves, spine = switches(3)
    try:
        n, leaf_of = 96, [r // 48 for r in range(96)]
        outs, codes = run_ranks([loopback(leaves)[leaf_of[r]] for r in range(n)],
                                lambda addrs: register(leaves, leaf_of, addrs, spine))
        assert_exact(outs, codes, n)
        for leaf in leaves:
            (c,) = leaf.counters()["jobs"].values()
            assert c["up_sent"] >= c["up_results"] > 0 and c["up_results"] * 48 == c["aggregated"], c
            # every result the spine multicast was taken (it names the leaf whose packet completed the round)
            assert c["drop_token"] == c["drop_bad_mac"] == c["drop_malformed"] == 0, c
        (c,) = spine.counters()["jobs"].values()
        assert c["aggregated"] == 2 * leaves[0].counters()["jobs"].popitem()[1]["up_results"], c
    finally:
        stop(leaves + [spine])


def test_a_two_level_job_gives_one_switchs_bits():
    """48 ranks through one switch, and through 2 leaves of 24 and a spine: the same bits, numpy's."""
    n = 48
    (one,) = switches(1)
    try:
        flat = run_ranks(loopback([one]) * n, lambda addrs: register([one], [0] * n, addrs), procs=4)
    finally:
        stop([one])
    *leaves, spine = switches(3)
    try:
        leaf_of = [r % 2 for r in range(n)]     # interleaved: a placement is any split
        tree = run_ranks([loopback(leaves)[leaf_of[r]] for r in range(n)],
                         lambda addrs: register(leaves, leaf_of, addrs, spine), procs=4)
    finally:
        stop(leaves + [spine])
    assert_exact(*flat, n)
    for r in range(n):
        for t in range(len(TENSORS)):
            assert tree[0][r][t].tobytes() == flat[0][r][t].tobytes(), f"rank {r}, tensor {t}: the two levels differ"


def test_loss_duplication_and_reordering_at_both_levels_stay_exact():
    """Relays on every worker-leaf link and on both leaf-spine links: 5% loss, 5% duplication, 25%
    reordering each way. Both levels recover (the leaves resend upward on their own timers) and the sums
    stay numpy's bit for bit."""
    faults = Faults(loss=0.05, duplicate=0.05, reorder=0.25, reorder_ms=3.0)
    *leaves, spine = switches(3)
    relays = [FaultRelay(("127.0.0.1", s.port), up=faults, down=faults, seed=i).start()
              for i, s in enumerate(leaves + [spine])]
    try:
        n, leaf_of = 16, [r // 8 for r in range(16)]
        outs, codes = run_ranks([relays[leaf_of[r]].address for r in range(n)],
                                lambda addrs: register(leaves, leaf_of, [relays[leaf_of[r]].link(a) for r, a in
                                                                         enumerate(addrs)], spine, relays[2]), procs=2)
        assert_exact(outs, codes, n)
        up = relays[2].counters
        assert up["up"]["lost"] and up["down"]["lost"] and up["up"]["duplicated"], up
        resent = sum(c["up_resends"] for leaf in leaves for c in leaf.counters()["jobs"].values())
        assert resent > 0, "no leaf resent a partial sum, though the relay lost some of them or their results"
        (c,) = spine.counters()["jobs"].values()
        assert c["replays"] > 0, c   # a leaf whose result was lost got it again from the spine's shadow copy
    finally:
        stop(relays + leaves + [spine])


def test_the_leaf_takes_only_its_parents_authentic_current_results():
    """An observer of the leaf-spine link replays every result of the spine to the leaf later, and sends a
    copy with one payload bit flipped: the leaf drops them (an old round, a bad MAC), the sums stay exact."""
    *leaves, spine = switches(3)
    relay = FaultRelay(("127.0.0.1", spine.port)).start()
    seen = []

    def tap(direction, data, worker):
        if direction == "down" and data[0] == sw.lib.SML_RESULT:
            seen.append((bytes(data), worker))
            forged = bytearray(data)
            forged[sw.HDR_LEN] ^= 1
            relay.inject(bytes(forged), to_worker=worker)
            if len(seen) > 2:
                relay.inject(*seen[-3])   # a result two rounds old, authentic
    relay.tap = tap
    try:
        n, leaf_of = 8, [r // 4 for r in range(8)]
        outs, codes = run_ranks([loopback(leaves)[leaf_of[r]] for r in range(n)],
                                lambda addrs: register(leaves, leaf_of, addrs, spine, relay), procs=2)
        assert_exact(outs, codes, n)
        totals = sw.summed(c for leaf in leaves for c in leaf.counters()["jobs"].values())
        assert totals["drop_bad_mac"] > 0 and totals["drop_late"] > 0, totals
    finally:
        stop([relay] + leaves + [spine])


def test_a_leaf_with_another_key_refuses_the_job():
    (leaf,) = [sw.SwitchServer("127.0.0.1", 0, slots=64, key=auth.new_key()).start()]
    try:
        nonce = auth.new_nonce()
        parent = {"address": "127.0.0.1:9", "ports": [9], "job": 1, "rank": 0, "token": TOKEN, "nonce": nonce,
                  "authenticated": True, "check": auth.key_check(auth.job_key(KEY, nonce))}
        with pytest.raises(ConfigError, match="same --key-file"):
            leaf.register(TOKEN, [["127.0.0.1", 9]], WINDOW, ELEMS, auth.new_nonce(), auth.job_key(KEY, nonce),
                          parent=parent)
        assert leaf.status()["jobs"] == {}
    finally:
        leaf.stop()


@pytest.mark.long   # as test_fuzz's packet targets
def test_the_leaf_packet_handler_under_asan_and_ubsan(tmp_path):
    """tests/fuzz's switch_leaf_packets: workers' packets and the parent's results, fuzzed, with the upward
    resend timers firing, through the sanitized C switch."""
    rc, log = fuzz(tmp_path, "switch_leaf_packets", "--sanitized", "-runs=1500", "-max_total_time=30")
    assert rc == 0 and "Done 1500 runs" in log, log[-3000:]


# -- a leaf's parent: bounds, resends, results (a C switch the test runs itself, or a keyless SwitchServer) -----

IP = int.from_bytes(bytes([127, 0, 0, 1]), "big")


def _udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(0.05)
    return s


class _Leaf:
    """A C switch without a thread (run() serves it) whose jobs (1 rank each, 4 slots of 64 values, no MACs) are
    leaves of job 7 of a parent socket that answers only when the test does; job k's worker is workers[k]."""
    PARENT_JOB, ELEMS = 7, 64

    def __init__(self, tokens=(TOKEN,), tries=3, rto_ms=1.0, rto_max_ms=10.0):
        self.sock, self.parent = _udp(), _udp()
        self.workers = [_udp() for _ in tokens]
        self.sw = sw.lib.sml_switch_new(self.sock.fileno(), 64, 64, 0)
        for job, (token, worker) in enumerate(zip(tokens, self.workers)):
            assert sw.lib.sml_switch_add_job(self.sw, job, token, 1, 4, self.ELEMS, sw.ffi.NULL, 0) == 0
            sw.lib.sml_switch_set_addr(self.sw, job, 0, IP, worker.getsockname()[1])
            assert sw.lib.sml_switch_set_parent(self.sw, job, IP, self.parent.getsockname()[1], self.PARENT_JOB, job,
                                                token, sw.ffi.NULL, 0, rto_ms, rto_max_ms, tries) == 0

    def data(self, job, token=TOKEN, packet=0):
        """Job `job`'s one rank sends `packet` (slot packet % 4 and its set): the set completes and goes up."""
        pool = packet % 4 | (packet // 4 % 2) << 15
        header = sw.pack_header(sw.lib.SML_DATA, sw.lib.SML_SIZE_JOB, job, 0, packet, pool, 0, token)
        self.workers[job].sendto(header + np.arange(self.ELEMS, dtype=">i4").tobytes(), self.sock.getsockname())

    def run(self, ms):
        end = time.monotonic() + ms / 1e3
        while time.monotonic() < end:
            assert sw.lib.sml_switch_run(self.sw, 5) >= 0

    def answer(self, up):
        """The parent's result to the packet `up` the leaf sent it: the same values."""
        _, _, job, rank, packet_id, pool, exp, code, token, _ = sw.HEADER.unpack(up[:sw.HDR_LEN])
        result = sw.pack_header(sw.lib.SML_RESULT, sw.lib.SML_SIZE_JOB | sw.lib.SML_F_STAMP, job, rank, packet_id,
                                pool, exp, token, code) + up[sw.HDR_LEN:] + bytes(sw.lib.SML_STAMP_LEN)
        self.parent.sendto(result, self.sock.getsockname())

    def counters(self, job):
        c = sw.ffi.new("sml_counters *")
        assert sw.lib.sml_switch_job_counters(self.sw, job, c) == 0
        return sw._counters_dict(c)

    def close(self):
        sw.lib.sml_switch_free(self.sw)
        for s in [self.sock, self.parent] + self.workers:
            s.close()


def received(sock):
    out = []
    while True:
        try:
            out.append(sock.recv(65536))
        except socket.timeout:
            return out


def test_a_set_whose_parent_never_answers_is_resent_tries_times_then_abandoned():
    """A parent address that never answers (a host someone named as a spine) gets the set and `tries` resends,
    not a stream for the job's life; the abandoned set gives its worker no result, not even a replay."""
    leaf = _Leaf(tries=3)
    try:
        leaf.data(0)
        leaf.run(300)     # 1 + 2 + 4 + 8 ms of timers: long over
        up = received(leaf.parent)
        c = leaf.counters(0)
        assert len(up) == 4 and c["up_sent"] == 4 and c["up_resends"] == 3 and c["up_abandoned"] == 1, (len(up), c)
        leaf.data(0)      # the worker's retransmission
        leaf.run(30)
        assert received(leaf.workers[0]) == [] and received(leaf.parent) == [], "an abandoned set was answered"
        assert leaf.counters(0)["drop_incomplete"] == 1, leaf.counters(0)
    finally:
        leaf.close()


def test_a_leafs_timer_follows_its_parents_round_trip():
    """A parent that answers each window of 4 sets 40 ms after they went up, the leaf's timer at 1 ms doubling
    to 200 ms: a timer found short backs the next window's off, until one window's answers come before it; from
    then on the timer follows the round trip (the spine's wait for the other leaves, a queue on the link) and no
    set is resent. A timer that did not follow it resent every set 5 times (at 1, 3, 7, 15 and 31 ms)."""
    leaf = _Leaf(tries=50, rto_ms=1.0, rto_max_ms=200.0)
    leaf.parent.settimeout(0.002)
    leaf.workers[0].settimeout(0.002)
    try:
        resent = []
        for window in range(14):
            for packet in range(4 * window, 4 * window + 4):
                leaf.data(0, packet=packet)
            leaf.run(40)
            firsts = {}
            for up in received(leaf.parent):     # the sets and their resends: each set answered once
                firsts.setdefault(up[8:10], up)
            assert len(firsts) == 4, f"window {window}: {len(firsts)} sets went up"
            for up in firsts.values():
                leaf.answer(up)
            leaf.run(5)
            assert len(received(leaf.workers[0])) == 4, f"window {window}: the worker lacks results"
            resent.append(leaf.counters(0)["up_resends"] - sum(resent))
        assert sum(resent[:4]) >= 4, f"the timer started short but fired little: {resent}"
        assert sum(resent[-8:]) <= 1, f"resends per window of 4 sets, after the first: {resent}"
    finally:
        leaf.close()


@pytest.mark.parametrize("rto_ms, rto_max_ms, tries", [(1e-7, 50.0, 10), (2.0, float("inf"), 10), (2.0, 1e300, 10),
                                                      (float("nan"), 50.0, 10), (2.0, float("nan"), 10),
                                                      (2.0, 5.0, 10), (60.0, 50.0, 10), (2.0, 50.0, 0)])
def test_a_parent_timer_out_of_bounds_is_refused(rto_ms, rto_max_ms, tries):
    """A timer of 0 ns (or an infinite one, converted to anything) resent every waiting set on every pass of the
    data plane, and sml_switch_run never returned: the C switch and the control plane refuse it."""
    leaf = _Leaf()
    try:
        assert sw.lib.sml_switch_add_job(leaf.sw, 1, TOKEN, 1, 4, 64, sw.ffi.NULL, 0) == 0
        rc = sw.lib.sml_switch_set_parent(leaf.sw, 1, IP, 9, 7, 0, TOKEN, sw.ffi.NULL, 0, rto_ms, rto_max_ms, tries)
        assert rc == -1, f"sml_switch_set_parent took rto_ms={rto_ms}, rto_max_ms={rto_max_ms}, tries={tries}"
    finally:
        leaf.close()
    if tries:
        with sw.SwitchServer("127.0.0.1", 0, slots=64) as server:
            with pytest.raises(ConfigError, match="rto_ms <= rto_max_ms"):
                server.register(TOKEN, [["127.0.0.1", 9]], WINDOW, ELEMS, parent={
                    "address": "127.0.0.1:9", "ports": [9], "job": 1, "rank": 0, "token": TOKEN, "rto_ms": rto_ms,
                    "rto_max_ms": rto_max_ms})
            assert server.status()["jobs"] == {}


def test_json_infinity_as_a_parent_timer_is_refused_over_the_control_port():
    with sw.SwitchServer("127.0.0.1", 0, slots=64) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(b'{"op": "register", "token": 1, "workers": [["127.0.0.1", 9]], "slots": 4, "elems": 64, '
                         b'"parent": {"address": "127.0.0.1:9", "ports": [9], "job": 1, "rank": 0, "token": 1, '
                         b'"rto_ms": 2, "rto_max_ms": Infinity}}\n')
            answer = json.loads(conn.makefile("rb").readline())
        assert answer["ok"] is False and "rto_max_ms" in answer["error"], answer
        assert server.status()["jobs"] == {}


LO_BROADCAST = "127.255.255.255"   # the directed broadcast of lo's subnet, 127.0.0.0/8: on every host


@pytest.mark.parametrize("address", ["224.0.0.1", "255.255.255.255", "0.0.0.0", "240.1.2.3", LO_BROADCAST])
def test_a_parent_that_is_not_a_unicast_address_is_refused(address):
    with sw.SwitchServer("127.0.0.1", 0, slots=64) as server:
        with pytest.raises(ConfigError, match="unicast"):
            server.register(TOKEN, [["127.0.0.1", 9]], WINDOW, ELEMS, parent={
                "address": f"{address}:9", "ports": [9], "job": 1, "rank": 0, "token": TOKEN})
        assert server.status()["jobs"] == {}


def test_the_broadcast_address_of_every_local_subnet_is_told_apart():
    """net.is_broadcast against the interfaces' own broadcast addresses (psutil reads them apart from the kernel's
    routes): each is one, no interface's own address is."""
    psutil = pytest.importorskip("psutil")   # `make install` brings it
    found = [(a.address, a.broadcast) for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family == socket.AF_INET and a.broadcast]
    for own, broadcast in found + [("127.0.0.1", LO_BROADCAST)]:
        assert net.is_broadcast(broadcast) and not net.is_broadcast(own), (own, broadcast)


@pytest.mark.parametrize("setting", ["switch_addr", "switch_spine"])
def test_a_switch_at_a_broadcast_address_is_refused(setting):
    """A job whose leaf or spine address is a subnet's broadcast fails its start with the reason (each of its
    packets would go to every host there, or nowhere: the kernel refuses them), before any request."""
    with sw.SwitchServer("127.0.0.1", 0, slots=64) as one, sw.SwitchServer("127.0.0.1", 0, slots=64) as other:
        addresses = {"switch_addr": f"{one.address},{other.address}", "switch_spine": other.address}
        addresses[setting] = f"{LO_BROADCAST}:{one.port}" if setting == "switch_spine" else \
            f"{one.address},{LO_BROADCAST}:{other.port}"
        with pytest.raises(CommError, match=f"switch address {LO_BROADCAST}:.*broadcast address of a subnet"):
            _backend_run(2, lambda rank, backend: None, authenticate=False, **addresses)
        assert one.status()["jobs"] == other.status()["jobs"] == {}


def test_a_switch_does_not_listen_on_a_broadcast_address():
    with pytest.raises(ConfigError, match="broadcast or multicast"):
        sw.SwitchServer(LO_BROADCAST, 0, slots=64)


def test_a_parent_that_does_not_confirm_the_job_is_refused_and_sent_nothing():
    """Amplification: whoever registers a leaf job named any host as its parent, and the leaf sent (and resent)
    every complete set there. Now the parent's control port must confirm the job first: a UDP socket (no
    control port), a switch without that job, or with another token, or without that rank, is refused."""
    victim = _udp()
    host, port = victim.getsockname()
    with sw.SwitchServer("127.0.0.1", 0, slots=64) as leaf, sw.SwitchServer("127.0.0.1", 0, slots=64) as spine:
        good = _keyless_spine(spine)
        for parent in [{"address": f"{host}:{port}", "ports": [port], "job": 0, "rank": 0, "token": TOKEN},
                       dict(good, job=(good["job"] + 1) % sw.MAX_JOBS), dict(good, token=TOKEN + 1)]:
            with pytest.raises(ConfigError, match="did not confirm"):
                leaf.register(TOKEN, [["127.0.0.1", 9]], WINDOW, ELEMS, parent=parent)
        assert leaf.status()["jobs"] == {} and received(victim) == []
        leaf.register(TOKEN, [["127.0.0.1", 9]], WINDOW, ELEMS, parent=dict(good))   # the spine's job, its rank 0
    victim.close()
    keyed_leaf, keyed_spine = switches(2)
    try:   # a keyed spine: the request is signed with the spine job's key as the leaf's rank, which must exist
        nonce = auth.new_nonce()
        key = auth.job_key(KEY, nonce)
        job = keyed_spine.register(TOKEN, [["127.0.0.1", 9]], WINDOW, ELEMS, nonce, key)["job"]
        parent = {"address": keyed_spine.address, "ports": [keyed_spine.port], "job": job, "token": TOKEN,
                  "nonce": nonce, "authenticated": True, "check": auth.key_check(key)}
        with pytest.raises(ConfigError, match="did not confirm"):
            n = auth.new_nonce()
            keyed_leaf.register(TOKEN, [["127.0.0.1", 9]], WINDOW, ELEMS, n, auth.job_key(KEY, n),
                                parent=dict(parent, rank=1))
        n = auth.new_nonce()
        keyed_leaf.register(TOKEN, [["127.0.0.1", 9]], WINDOW, ELEMS, n, auth.job_key(KEY, n), parent=dict(parent, rank=0))
    finally:
        stop([keyed_leaf, keyed_spine])


@pytest.mark.parametrize("keyed", [False, True])
def test_a_leaf_the_job_did_not_announce_is_refused_by_the_spine(keyed):
    """The spine's job announced its one leaf at 127.0.0.1; a switch on 127.0.0.2 (another host, on loopback)
    that names the spine's job as its parent, with its number, token (and the daemon key), is refused by the
    spine's answer to its probe, which names both addresses; it sends nothing. The announced leaf is confirmed."""
    key = KEY if keyed else None
    spine, leaf, stranger = [sw.SwitchServer(host, 0, slots=64, key=key).start()
                             for host in ("127.0.0.1", "127.0.0.1", "127.0.0.2")]
    try:
        nonce = auth.new_nonce() if keyed else None
        job = spine.register(TOKEN, [["127.0.0.1", leaf.port]], WINDOW, ELEMS, nonce,
                             key and auth.job_key(KEY, nonce))["job"]
        parent = {"address": spine.address, "ports": [spine.port], "job": job, "rank": 0, "token": TOKEN}
        if keyed:
            parent.update(nonce=nonce, authenticated=True, check=auth.key_check(auth.job_key(KEY, nonce)))

        def leaf_job(switch, host):
            n = auth.new_nonce() if keyed else None
            return switch.register(TOKEN, [[host, 9]], WINDOW, ELEMS, n, key and auth.job_key(KEY, n),
                                   parent=dict(parent))
        with pytest.raises(ConfigError, match=rf"did not confirm job #{job} .*a leaf at 127\.0\.0\.2 asked to be "
                                              rf"rank 0 of job #{job}, whose leaf the job announced at 127\.0\.0\.1"):
            leaf_job(stranger, "127.0.0.2")
        assert stranger.status()["jobs"] == {} and stranger.counters()["switch"]["pkts_sent"] == 0
        assert spine.counters()["control"]["leaf_address"] == 1, spine.counters()["control"]
        leaf_job(leaf, "127.0.0.1")
    finally:
        stop([stranger, leaf, spine])


@pytest.mark.long   # a switch that dies or a thread that outlives its stop: waits on purpose
def test_stop_never_frees_a_switch_whose_thread_still_runs(caplog):
    """A data-plane thread that does not return within stop()'s wait: its C switch is left allocated (and an
    error logged) rather than freed under it."""
    server = sw.SwitchServer("127.0.0.1", 0, slots=64).start()
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, name="commlib-switch-data-stuck", daemon=True)
    stuck.start()
    server._threads.append(stuck)
    (shard,) = server._shards
    try:
        server.stop()
        assert server._leaked == [shard], "stop() freed the C switch of a thread still running"
        assert sw.lib.sml_switch_free_slots(shard[1]) == 64      # still a switch
        assert "still running" in caplog.text, caplog.text
    finally:
        release.set()
        stuck.join()
        sw.lib.sml_switch_free(shard[1])
        shard[0].close()


def test_a_parents_result_goes_to_the_leaf_job_whose_checks_it_passes():
    """Two leaf jobs of one switch name the same parent job: the result for the second (its token) is not the
    first's drop, it reaches the second's worker."""
    leaf = _Leaf(tokens=(1, TOKEN), tries=50)
    try:
        leaf.data(1)
        leaf.run(20)
        (up, *_) = received(leaf.parent)
        leaf.answer(up)
        leaf.run(20)
        down = [p for p in received(leaf.workers[1]) if p[0] == sw.lib.SML_RESULT]
        assert len(down) == 1 and down[0][sw.HDR_LEN:sw.HDR_LEN + 4 * 64] == np.arange(64, dtype=">i4").tobytes(), \
            f"the second leaf job's worker got {len(down)} results (the first job took the parent's result)"
        assert leaf.counters(0)["drop_token"] == 1 and leaf.counters(1)["up_results"] == 1
    finally:
        leaf.close()


def _keyless_spine(server, ranks=2):
    """A job of `ranks` ranks on a keyless switch `server`; the parent of a leaf of it, as rank 0."""
    job = server.register(TOKEN, [["127.0.0.1", 9 + r] for r in range(ranks)], WINDOW, ELEMS)["job"]
    return {"address": server.address, "ports": [server.port], "job": job, "rank": 0, "token": TOKEN}


def test_two_leaf_jobs_of_one_parent_job_are_refused():
    with sw.SwitchServer("127.0.0.1", 0, slots=64) as leaf, sw.SwitchServer("127.0.0.1", 0, slots=64) as spine:
        parent = _keyless_spine(spine)
        leaf.register(TOKEN, [["127.0.0.1", 9]], WINDOW, ELEMS, parent=dict(parent))
        with pytest.raises(control.Refused, match=f"another job on this switch is a leaf of job #{parent['job']}"):
            leaf.register(TOKEN, [["127.0.0.1", 10]], WINDOW, ELEMS, parent=dict(parent, rank=1))
        assert len(leaf.status()["jobs"]) == 1


def test_an_authenticated_leaf_job_needs_an_authenticated_parent():
    (leaf,) = switches(1)
    try:
        nonce = auth.new_nonce()
        with pytest.raises(ConfigError, match="its parent's is not"):
            leaf.register(TOKEN, [["127.0.0.1", 9]], WINDOW, ELEMS, nonce, auth.job_key(KEY, nonce), parent={
                "address": "127.0.0.1:9", "ports": [9], "job": 3, "rank": 0, "token": TOKEN})
        assert leaf.status()["jobs"] == {}
    finally:
        leaf.stop()


def test_a_parent_the_c_switch_refuses_unregisters_the_job(monkeypatch):
    class Lib:   # the C switch's answer when the job could not be made a leaf
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def sml_switch_set_parent(*args):
            return -1
    real = sw.lib
    with sw.SwitchServer("127.0.0.1", 0, slots=64) as server, sw.SwitchServer("127.0.0.1", 0, slots=64) as spine:
        parent = _keyless_spine(spine)
        monkeypatch.setattr(sw, "lib", Lib())
        with pytest.raises(ConfigError, match="could not make the job a leaf"):
            server.register(TOKEN, [["127.0.0.1", 9]], WINDOW, ELEMS, parent=parent)
        monkeypatch.setattr(sw, "lib", real)
        assert server.status()["jobs"] == {} and real.sml_switch_free_slots(server._shards[0][1]) == 64


# -- the backend ---------------------------------------------------------------------------------------

class _Ctx:
    def __init__(self, size, **kw):
        self.size, self.all_local, self.settings = size, False, Settings(kw)


def test_more_than_64_ranks_need_a_spine_and_get_it():
    ok, why = sml.SwitchMLBackend.available(_Ctx(96, switch_addr="10.0.0.1:9099"))
    assert not ok and "COMMLIB_SWITCH_SPINE" in why and "2 or more leaf switches" in why, why
    ok, why = sml.SwitchMLBackend.available(_Ctx(96, switch_addr="10.0.0.1:9099,10.0.0.2:9099",
                                                 switch_spine="10.0.0.3:9099"))
    assert ok, why


def test_placement_by_host_or_setting():
    hosts = ["a"] * 3 + ["b"] * 3 + ["a"]          # rank 6 on host a too
    assert sml.placement("", hosts, 2) == [0, 0, 0, 1, 1, 1, 0]     # host a's ranks share a leaf
    assert sml.placement("1,1,0", ["h"] * 3, 2) == [1, 1, 0]
    with pytest.raises(ConfigError, match="at least 2 leaves"):
        sml.placement("", ["h"] * 96, 1)
    with pytest.raises(ConfigError, match="one leaf index"):
        sml.placement("0,2", ["h"] * 2, 2)


def _backend_run(n, work, **kw):
    group = LocalGroup(n, Settings({"timeout_s": 4.0, "switch_retransmit_ms": 2.0, **kw}))
    backends = [sml.SwitchMLBackend(ctx) for ctx in group.contexts]

    def main(ctx):
        try:
            backends[ctx.rank].start()
            return work(ctx.rank, backends[ctx.rank])
        finally:
            backends[ctx.rank].close()

    return group.run(main, 60.0)


@pytest.mark.parametrize("streams", [1, 2])
def test_backend_two_levels_equal_one_switch(tmp_path, streams):
    """The backend's registration of a tree (placement set, keyed; with 2 streams each leaf's thread i goes up
    to the spine's thread i): every rank's sums are one switch's bits."""
    key_file = str(tmp_path / "switch.key")
    auth.write_key(key_file, KEY)
    *leaves, spine = switches(3, threads=2)
    try:
        def work(rank, backend):
            assert backend.stats()["streams"] == streams
            return [backend.allreduce(tensor("float", 20000, 5, rank), "f"),
                    backend.allreduce(tensor("int", 9, 6, rank), "i")]
        common = dict(switch_key_file=key_file, switch_packet_elems=ELEMS, switch_window=2 * WINDOW,
                      switch_streams=streams)
        tree = _backend_run(5, work, switch_addr=",".join(s.address for s in leaves), switch_spine=spine.address,
                            switch_placement="0,1,1,0,1", **common)
        flat = _backend_run(5, work, switch_addr=leaves[0].address, **common)
        for r in range(5):
            for a, b in zip(tree[r], flat[r]):
                assert a.tobytes() == b.tobytes(), f"rank {r}: the two-level sum differs from one switch's"
    finally:
        stop(leaves + [spine])


@pytest.mark.long   # a switch that dies or a thread that outlives its stop: waits on purpose
@pytest.mark.parametrize("victim", ["spine", "leaf"])
def test_a_switch_killed_mid_job_fails_every_rank_naming_it(tmp_path, victim):
    """Three commlib-switch processes; after a first allreduce the spine (or leaf 1) is killed: every rank
    fails its next allreduce within the timeout with an error naming that switch (the ranks of a dead leaf
    at once: its port is closed; the others when their results stop, probing the tree's switches)."""
    key_file = str(tmp_path / "switch.key")
    auth.write_key(key_file, KEY)
    children = [subprocess.Popen([sys.executable, "-m", "commlib.switch", "--port", "0", "--threads", "1",
                                  "--key-file", key_file], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        (leaf0,), (leaf1,), (spine,) = [control.wait_ready(child, 30, "a switch") for child in children]
        dead, child = (spine, children[2]) if victim == "spine" else (leaf1, children[1])
        before = threading.Barrier(4)

        def work(rank, backend):
            backend.allreduce(tensor("float", 1000, 7, rank), "before")
            before.wait(20)   # every rank has its sum: the switch dies between two allreduces
            if rank == 0:
                child.send_signal(signal.SIGKILL)
                child.wait(10)
            started = time.monotonic()
            try:
                for i in range(50):
                    backend.allreduce(tensor("float", 1000, 8, rank), f"after{i}")
            except PeerFailure as exc:
                return str(exc), time.monotonic() - started
            return None, time.monotonic() - started

        results = _backend_run(4, work, switch_addr=f"{leaf0},{leaf1}", switch_spine=spine, switch_key_file=key_file,
                               switch_packet_elems=ELEMS, switch_window=WINDOW)
        for rank, (error, seconds) in enumerate(results):
            assert error is not None and dead in error, f"rank {rank}: {error!r} does not name {dead}"
            if victim == "spine":
                assert f"the spine switch at {spine}" in error, f"rank {rank}: {error!r}"
            assert seconds < 4.0 * 3, f"rank {rank} took {seconds:.1f}s to fail"
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
