"""Issue 13, the control planes: an attacker on the segment (who reads every control request and
sends its own TCP and UDP) can neither stop the switch or an aggregator, nor register, end or
divert a job, nor exhaust their slots, memory, job numbers or threads.

Each test names the bullet of the issue it checks. Daemons run in this process (SwitchServer,
Aggregator) or as their own processes (the CLIs); requests are sent as raw bytes, the way an
attacker would."""
import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from commlib.errors import CommError, ConfigError, PeerFailure
from commlib.settings import Settings
from commlib.testing import LocalGroup

import commlib.switch.switchml as sw   # noqa: E402

if sw.lib is None:   # not built: a failure of the suite, never a quiet skip
    raise ImportError(sw.IMPORT_ERROR)
import commlib.backends.switchml as sml                              # noqa: E402
from commlib.switch import aggregator as agg, auth, control          # noqa: E402
import helpers                                                       # noqa: E402

pytestmark = pytest.mark.timeout(60)

TOKEN = 0x1234ABCD
HOSTILE = [b"[1, 2]\n", b"42\n", b'"op"\n', b"\xff\xfe\n", b"[" * 60000 + b"\n",
           b'{"op": "register", "token": 1e999999, "workers": 5}\n',
           b'{"op": "register", "nonce": [1], "token": {}, "workers": [[1, 2, 3]]}\n',
           b'{"op": "register", "token": 1, "workers": [["localhost", 9]], "slots": 99999999999999999999999}\n',
           b'{"op": "unregister", "job": [1], "token": "x"}\n', b'{"op": "keepalive", "job": 1e308, "rank": null}\n',
           b'{"op": "counters", "job": {"a": 1}}\n', b'{"op": "simulate", "seed": -1}\n', b'{"op": 7}\n',
           b'{"op": "register", "token": 1, "workers": [["1.2.3.4", 9]], "slots": 8, "elems": 64, "nonce": "x"}\n']


def request_line(address, line, timeout=5.0):
    """One raw line to the switch's control port, its answer line decoded."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as conn:
        conn.sendall(line)
        return control.decode(conn.makefile("rb").readline())


def udp_request(address, data, timeout=2.0):
    """One raw datagram to an aggregator; its answer decoded, or None when it answers nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(data, address)
        try:
            return control.decode(sock.recv(65536))
        except socket.timeout:
            return None


@pytest.fixture
def keyed_switch():
    key = auth.new_key()
    server = sw.SwitchServer("127.0.0.1", 0, slots=1024, slot_group=64, key=key,
                             limits=sw.Limits.for_pool(1024)).start()
    yield server, key
    server.stop()


def register(server, key, slots=8, workers=(("127.0.0.1", 9),)):
    """A job as rank 0 registers it: its number, its job key and its rank-0 client."""
    nonce = auth.new_nonce()
    job_key = auth.job_key(key, nonce)
    client = sw.SwitchClient(server.address, key=job_key, rank=0)
    return client.register(TOKEN, [list(w) for w in workers], slots, 64, nonce=nonce)["job"], job_key, client


# -- bullet 1: the token is the only credential of unregister; anyone may register ----------------
def test_sniffed_token_or_request_ends_no_job(keyed_switch):
    """On a keyed switch the token (in every data packet) ends nothing, nor does a request that is
    not signed with the job's key, nor a sniffed signed request sent again (its seq was seen)."""
    server, key = keyed_switch
    job, job_key, client = register(server, key, workers=[("127.0.0.1", 9), ("127.0.0.1", 10)])
    for line in (control.encode({"op": "unregister", "job": job, "token": TOKEN}),
                 control.encode(auth.sign(auth.new_key()[:16], {"op": "unregister", "job": job, "rank": 0}, 1)),
                 control.encode({"op": "counters", "job": job, "token": TOKEN})):
        reply = request_line(server.address, line)
        assert reply["ok"] is False and "not signed" in reply["error"], reply
    sniffed = auth.Signer(job_key)({"op": "keepalive", "job": job, "rank": 1})
    assert request_line(server.address, control.encode(sniffed))["ok"] is True
    replay = request_line(server.address, control.encode(sniffed))
    assert replay["ok"] is False and "replayed" in replay["error"], replay
    assert str(job) in server.status()["jobs"]
    drops = server.drops.snapshot()
    assert drops["bad_mac"] == 3 and drops["replay"] == 1, drops
    client.unregister(job)                                  # the job's own rank ends it
    assert server.status()["jobs"] == {}


def test_concurrent_operator_requests_are_not_replays(keyed_switch):
    """Two operator clients signing at once may reach the switch out of seq order: both are served
    (the replay window), while each one sent again, or one older than the window, is refused."""
    server, key = keyed_switch
    first, second = auth.Signer(key), auth.Signer(key)
    early = first({"op": "counters"})
    late = second({"op": "counters"})
    assert late["seq"] > early["seq"]
    for request in (late, early):                           # the later seq arrives first
        reply = request_line(server.address, control.encode(request))
        assert reply["ok"] is True, reply
    for request in (late, early):
        reply = request_line(server.address, control.encode(request))
        assert reply["ok"] is False and "replayed" in reply["error"], reply
    stale = auth.sign(key, {"op": "counters"}, late["seq"] - auth.Replays.WINDOW_NS - 1)
    reply = request_line(server.address, control.encode(stale))
    assert reply["ok"] is False and "replayed" in reply["error"], reply
    assert server.drops.snapshot()["replay"] == 3


def test_replay_window_is_bounded_and_survives_forgetting():
    """A sender flooding fresh seqs keeps at most `per_sender` of them (an older seq is then refused);
    a forgotten sender (an ended job) and an evicted one still cannot reuse a seq older than the window."""
    now = 10 * auth.Replays.WINDOW_NS
    replays = auth.Replays(limit=2, per_sender=4)
    fresh = [now - 5, now - 4, now - 3, now - 2, now - 1]
    assert all(replays.fresh("a", seq, now) for seq in fresh)
    assert not replays.fresh("a", fresh[0], now) and not replays.fresh("a", fresh[-1], now)
    assert replays.fresh("a", now - 10, now) is False          # below every remembered seq when full
    replays.forget(("a",))                                      # the job ended
    stale = now - auth.Replays.WINDOW_NS
    assert replays.fresh("a", stale, now) is False, "a sniffed seq replayed after its sender was forgotten"
    replays.fresh("b", now, now), replays.fresh("c", now, now)  # a third sender evicts the least recent
    assert replays.fresh("a", now + 1, now) is True             # a new request of "a" is fine
    ahead = now + auth.Replays.WINDOW_NS + 1                     # a key holder's seq from far ahead
    assert replays.fresh("a", ahead, now) is False, "a seq past the window would crowd out the real ones"


def test_registering_needs_the_daemon_key(keyed_switch):
    """Anyone could register jobs: now a register must be signed with the job key derived from the
    daemon key, and a captured register cannot be replayed (a nonce registers once)."""
    server, key = keyed_switch
    unsigned = {"op": "register", "token": TOKEN, "workers": [["127.0.0.1", 9]], "slots": 8, "elems": 64,
                "nonce": auth.new_nonce()}
    reply = request_line(server.address, control.encode(unsigned))
    assert reply["ok"] is False and "COMMLIB_SWITCH_KEY_FILE" in reply["error"], reply
    wrong = auth.sign(auth.job_key(auth.new_key(), unsigned["nonce"]), unsigned, time.time_ns())
    assert request_line(server.address, control.encode(wrong))["ok"] is False
    signed = auth.sign(auth.job_key(key, unsigned["nonce"]), unsigned, time.time_ns())
    first = request_line(server.address, control.encode(signed))
    assert first["ok"] is True and first["expiry_s"] == server.job_expiry_s
    sw.SwitchClient(server.address, key=auth.job_key(key, unsigned["nonce"]), rank=0).unregister(first["job"])
    again = request_line(server.address, control.encode(signed))      # captured, replayed after the job ended
    assert again["ok"] is False and "replayed" in again["error"], again
    assert server.status()["jobs"] == {}
    with pytest.raises(ConfigError, match="refused"):                  # the operator's counters need the key
        sw.SwitchClient(server.address).counters()
    assert "switch" in sw.SwitchClient(server.address, key=key).counters()


# -- bullet 4: one request takes every slot, 256 every job number, nothing expires -----------------
def test_limits_per_job_and_per_source(keyed_switch):
    server, key = keyed_switch                    # 1024 slots: a job may take 256, an address 512
    with pytest.raises(ConfigError, match="at most 256"):
        register(server, key, slots=1024)
    register(server, key, slots=256)
    register(server, key, slots=256)
    with pytest.raises(ConfigError, match="limit of 512 per address"):
        register(server, key, slots=1)
    assert server.status()["free_slots"] == 512
    many = sw.SwitchServer("127.0.0.1", 0, slots=1024, key=key, limits=sw.Limits.for_pool(1024)).start()
    try:
        for _ in range(16):
            register(many, key, slots=1)
        with pytest.raises(ConfigError, match="16 jobs"):
            register(many, key, slots=1)
        assert len(many.status()["jobs"]) == 16
    finally:
        many.stop()


@pytest.mark.parametrize("address", ["127.255.255.255", "224.0.0.1", "255.255.255.255", "0.0.0.0"])
def test_a_worker_at_a_broadcast_or_multicast_address_is_refused(address):
    """A registration naming a broadcast (127.255.255.255: lo's subnet's) or multicast address as a rank's
    would have the switch send that rank's results to many hosts, or none: it is refused, over the wire too."""
    with sw.SwitchServer("127.0.0.1", 0, slots=64) as server:
        with pytest.raises(ConfigError, match=f"worker address {address}: .*unicast"):
            sw.SwitchClient(server.address).register(1, [["127.0.0.1", 9], [address, 9]], 4, 64)
        assert server.status()["jobs"] == {}


def test_jobs_without_keepalives_expire_and_free_their_slots():
    key = auth.new_key()
    with sw.SwitchServer("127.0.0.1", 0, slots=64, key=key, job_expiry_s=2.0) as server:
        job, job_key, client0 = register(server, key, slots=32, workers=[("127.0.0.1", 9), ("127.0.0.1", 10)])
        client1 = sw.SwitchClient(server.address, key=job_key, rank=1)
        for _ in range(10):                       # both ranks live: the job outlasts its expiry
            client0.keepalive(job)
            client1.keepalive(job)
            time.sleep(0.3)
        assert server.status()["free_slots"] == 32
        deadline = time.monotonic() + 5           # rank 1 falls silent (it died): the job goes
        while server.status()["jobs"] and time.monotonic() < deadline:
            try:
                client0.keepalive(job)
            except ConfigError as exc:            # it went between the check and the keepalive
                assert "not registered" in str(exc)
            time.sleep(0.2)
        assert server.status()["jobs"] == {} and server.status()["free_slots"] == 64
        assert server.drops.snapshot()["jobs_expired"] == 1


def test_a_keyless_switch_takes_a_keepalive_only_with_the_jobs_token():
    """`status` lists a keyless switch's jobs to anyone: a keepalive without the token would let a stranger
    keep a job whose ranks died registered, its slots never freed."""
    with sw.SwitchServer("127.0.0.1", 0, slots=64, job_expiry_s=2.0) as server:
        client = sw.SwitchClient(server.address, rank=0)
        job = client.register(4660, [["127.0.0.1", 9]], 32, 64)["job"]
        for token in (None, 4661):
            with pytest.raises(ConfigError, match="with that token is not registered"):
                client.keepalive(job, token)
        assert client.keepalive(job, 4660) == {"expiry_s": 2.0}
        deadline = time.monotonic() + 6           # the stranger keeps sending; the job still expires
        while server.status()["jobs"] and time.monotonic() < deadline:
            with pytest.raises(ConfigError):
                client.keepalive(job)
            time.sleep(0.2)
        assert server.status()["jobs"] == {} and server.drops.snapshot()["bad_token"] >= 2


def test_a_stalled_control_thread_expires_no_job_its_keepalives_could_not_reach():
    """While the control thread does not run, the ranks' keepalives wait unread: that silence is not theirs."""
    with sw.SwitchServer("127.0.0.1", 0, slots=64, job_expiry_s=2.0) as server:
        job = sw.SwitchClient(server.address).register(4660, [["127.0.0.1", 9]], 8, 64)["job"]
        with server._lock:                        # as if the thread had not run for 10 s, nor the ranks been heard
            server._jobs[job].alive[0] -= 10.0
            server._ticked -= 10.0
        server._expire()
        assert job in map(int, server.status()["jobs"])
        with server._lock:                        # a rank silent while the thread ran is still expired
            server._jobs[job].alive[0] -= 10.0
        server._expire()
        assert server.status()["jobs"] == {}


def test_registers_naming_a_silent_parent_stall_no_one_elses_request():
    """A leaf's register asks the parent's control port first (up to 3 s): that ran on the one control
    thread, so a stranger's lines naming a port that never answers stalled every job's keepalives until
    the jobs expired. Now the probes run off it, at most 2 per address at a time (beyond: "busy")."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)                             # takes connections, never answers
    with silent, sw.SwitchServer("127.0.0.1", 0, slots=64, job_expiry_s=2.0) as server:
        client = sw.SwitchClient(server.address, timeout=1.0, rank=0)
        job = client.register(4660, [["127.0.0.1", 9]], 8, 64)["job"]
        parent = {"address": "127.0.0.1:9", "ports": [9], "job": 0, "rank": 0, "token": 1,
                  "control": f"127.0.0.1:{silent.getsockname()[1]}"}
        line = control.encode({"op": "register", "token": 7, "workers": [["127.0.0.1", 9]], "slots": 1, "elems": 1,
                               "parent": parent})
        host, port = server.address.split(":")
        strangers = [socket.create_connection((host, int(port))) for _ in range(4)]
        for stranger in strangers:
            stranger.sendall(line * 8)
        try:
            for _ in range(10):                   # 5 s: over 2 expiries, while the probes wait 3 s each
                assert client.keepalive(job, 4660) == {"expiry_s": 2.0}
                time.sleep(0.5)
            assert job in map(int, server.status()["jobs"])
            assert server.drops.snapshot().get("busy", 0) >= 2, server.drops.snapshot()
            strangers[0].settimeout(10)
            answer = control.decode(strangers[0].makefile("rb").readline())
            assert answer["ok"] is False and "did not confirm" in answer["error"], answer
        finally:
            for stranger in strangers:
                stranger.close()


@pytest.mark.long   # a rank that dies: waits out the switch's expiry on purpose
def test_a_dead_rank_ends_its_switchml_job(tmp_path):
    """Rank 0 dying left its job registered for good (128 slots per crash). Now every rank keeps the
    job alive and any silent rank ends it; the others learn it at their next tensor."""
    key_file = tmp_path / "switch.key"
    key = auth.write_key(str(key_file))
    with sw.SwitchServer("127.0.0.1", 0, slots=512, key=key, job_expiry_s=2.0) as server:
        group = LocalGroup(2, Settings({"timeout_s": 5.0, "switch_retransmit_ms": 2.0, "switch_addr": server.address,
                                        "switch_key_file": str(key_file)}))
        backends = [sml.SwitchMLBackend(ctx) for ctx in group.contexts]
        group.run(lambda ctx: backends[ctx.rank].start(), 30)
        out = group.run(lambda ctx: backends[ctx.rank].allreduce(np.arange(1000, dtype=np.int32), "x"), 30)
        np.testing.assert_array_equal(out[0], 2 * np.arange(1000, dtype=np.int32))
        assert len(server.status()["jobs"]) == 1 and backends[0]._switches[0].control_key is not None
        backends[0]._stopping.set()               # rank 0 dies: its keepalives stop, it unregisters nothing
        backends[0]._keepalive.join(10)
        deadline = time.monotonic() + 10
        while server.status()["jobs"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.status()["jobs"] == {} and server.status()["free_slots"] == 512
        with pytest.raises(PeerFailure, match="does not know this job"):
            backends[1].allreduce(np.ones(10, np.int32), "y")
        for backend in backends:
            backend._release()


@pytest.mark.long
def test_a_killed_rank_0_process_ends_its_job(tmp_path):
    """The same with real processes: rank 0 is SIGKILLed after its first tensor; rank 1 lives on
    (sending keepalives) and sees the switch drop the job within the expiry."""
    from launch import spawn
    key_file = tmp_path / "switch.key"
    key = auth.write_key(str(key_file))
    with sw.SwitchServer("127.0.0.1", 0, slots=512, key=key, job_expiry_s=2.0) as server:
        ranks = spawn(2, "dead_rank.py", 8.0, timeout=150,
                      env={"COMMLIB_SWITCH_ADDR": server.address, "COMMLIB_SWITCH_KEY_FILE": str(key_file)})
        assert ranks[0].returncode == -9 and ranks[1].returncode == 0, ranks.output
        first, last = ranks.results()               # the last report of each rank
        assert first["sum_ok"] and "jobs_after" not in first, ranks.output
        assert last["sum_ok"] and last["jobs_after"] == [], ranks.output
        assert server.drops.snapshot()["jobs_expired"] == 1 and server.status()["free_slots"] == 512


# -- bullet 4: one thread per connection, lines buffered without bound; bullet 3: hostile input ----
def test_switch_control_port_is_bounded_and_survives_hostile_input():
    with sw.SwitchServer("127.0.0.1", 0, slots=64) as server:
        host, port = "127.0.0.1", server.port
        threads = threading.active_count()
        patient = socket.create_connection((host, port), timeout=5, source_address=("127.0.0.2", 0))
        conns = [socket.create_connection((host, port), timeout=5) for _ in range(200)]   # past the 16 kept
        time.sleep(0.5)
        assert threading.active_count() <= threads             # no thread per connection
        assert request_line(server.address, control.encode({"op": "status"}))["ok"] is True   # still answers
        patient.sendall(control.encode({"op": "status"}))      # another address was not pushed out
        assert control.decode(patient.makefile("rb").readline())["ok"] is True
        for conn in conns + [patient]:
            conn.close()
        with socket.create_connection((host, port), timeout=5) as conn:   # a line without end
            try:
                for _ in range(64):
                    conn.sendall(b"x" * 16384)
            except OSError:
                pass                                               # closed by the switch: what we want
            reply = control.decode(conn.makefile("rb").readline())
            assert reply["ok"] is False and "at most" in reply["error"], reply
        for line in HOSTILE:
            reply = request_line(server.address, line)
            assert reply["ok"] is False and reply["error"], (line[:60], reply)
        assert request_line(server.address, control.encode({"op": "status"}))["ok"] is True
        drops = sw.SwitchClient(server.address).counters()["control"]
        assert drops["connections_evicted"] >= 184 and drops["oversize"] == 1, drops
        assert drops["malformed"] >= 5 and drops["invalid"] >= 7 and "internal" not in drops, drops
        assert server.status()["jobs"] == {}                  # nothing half-registered


LINE_FLOODER = """
import socket, sys, threading, time
address, until = (sys.argv[1], int(sys.argv[2])), time.monotonic() + float(sys.argv[3])
sent = []

def flood(burst):   # a connection at a time, sending without reading an answer
    while time.monotonic() < until:
        try:
            with socket.create_connection(address, timeout=2) as conn:
                while time.monotonic() < until:
                    conn.sendall(burst)
                    sent.append(len(burst))
        except OSError:       # closed by the switch for the answers it left unread, or a full buffer: again
            pass

# empty lines, and tiny malformed ones, from 4 connections
threads = [threading.Thread(target=flood, args=(burst,)) for burst in [b"\\n" * 65536, b"x\\n" * 32768] * 2]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(sum(sent))
"""


def status_latency(address, timeout=15.0):
    """Seconds from connecting to the switch's control port, from another address than the
    flooder's, to reading the answer to a status request."""
    start = time.monotonic()
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout, source_address=("127.0.0.2", 0)) as conn:
        conn.sendall(control.encode({"op": "status"}))
        assert control.decode(conn.makefile("rb").readline())["ok"] is True
    return time.monotonic() - start


def test_a_flood_of_short_lines_does_not_stall_the_switch_control_port():
    """The control thread also serves every job's register, keepalive and unregister: one client
    pouring empty and tiny malformed lines into the port (64 KiB bursts, never reading the answers)
    held it for about a second per burst (an answer per line, the buffer's rest copied per line), and
    another client's status took 8-13 s, past a job's keepalive timeout (5 s). Each connection now
    has a bounded slice of each round.

    The switch is its own process, as `python -m commlib.switch` runs: inside this one its control
    thread held the GIL against the probe's own socket calls, and on a busy 2-core host the probe's
    socket() or bind() alone waited up to a second for it (CI measured 1.45 s), while another process's
    probe, under the same flood, had its answer in 2-11 ms."""
    switch, address = helpers.switch_process(extra=("--threads", "1"))
    try:
        flooder = subprocess.Popen([sys.executable, "-c", LINE_FLOODER, *address.rsplit(":", 1), "8"],
                                   stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(1.0)                                     # the flood is under way
            latencies, deadline = [], time.monotonic() + 20
            while len(latencies) < 8 and time.monotonic() < deadline:
                latencies.append(status_latency(address))
                time.sleep(0.2)
            flooded = flooder.poll() is None                   # the flood lasted through every request
            sent = int(flooder.communicate(timeout=30)[0])
        finally:
            flooder.kill()
            flooder.wait()
        drops = sw.SwitchClient(address).counters()["control"]
        assert switch.poll() is None, "the flood stopped the switch"
    finally:
        switch.kill()
        switch.wait()
    print(f"status latency under the flood: max {max(latencies):.3f} s of {len(latencies)}; the flooder sent "
          f"{sent >> 20} MiB; {drops}")
    # 2-21 ms here, two busy loops beside it or not; with every line of a read answered in one round
    # 0.7-1.1 s; the jobs' keepalive timeout is 5 s, the leaf probe's 2 s
    assert len(latencies) == 8 and max(latencies) < 0.3, latencies
    assert flooded and sent > 4 << 20 and drops["empty_lines"] > 10000 and drops["malformed"] > 1000, (sent, drops)
    assert "internal" not in drops, drops


def test_lines_sent_at_once_are_all_answered_in_order():
    """Lines beyond a round's share wait in the connection's buffer: answered in later rounds with
    no more data from the client, in order, then the connection closes after the client's EOF."""
    with sw.SwitchServer("127.0.0.1", 0, slots=64) as server:
        # 200 times: a request the switch refuses naming its number, an empty line, a status request
        lines = b"".join(control.encode({"op": f"#{i}"}) + b"\n" + control.encode({"op": "status"}) for i in range(200))
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(lines)                                 # one read of the switch's, then nothing more
            replies = conn.makefile("rb")
            answers = [control.decode(replies.readline()) for _ in range(400)]
            conn.shutdown(socket.SHUT_WR)
            assert replies.readline() == b""                    # closed after the client's EOF
        assert len(answers) == 400, len(answers)
        for i in range(200):
            assert answers[2 * i]["ok"] is False and f"'#{i}'" in answers[2 * i]["error"], (i, answers[2 * i])
            assert answers[2 * i + 1]["ok"] is True and "jobs" in answers[2 * i + 1], (i, answers[2 * i + 1])
        assert sw.SwitchClient(server.address).counters()["control"]["empty_lines"] == 200


# -- bullet 3: one malformed control packet kills an aggregator; sizes not capped -----------------
def test_aggregator_survives_hostile_control_packets():
    aggregator = agg.Aggregator("127.0.0.1", 0).start()
    try:
        for line in HOSTILE + [b'{"op": "keepalive", "job": [1], "epoch": 1}', b'{"op": "unregister", "job": {}}',
                               b'{"op": "keepalive", "job": "a", "epoch": 99999999999999999999999999}',
                               b'{"op": "register", "rank": 0, "size": 1e400}', b"{" + b"x" * 5000, b"{not json",
                               b'{"op": "register", "job": [], "epoch": 1, "rank": 0, "size": 1, "columns": 1, '
                               b'"aggregators": 1, "index": 0, "block": 16}']:
            udp_request(aggregator.address, line.rstrip(b"\n"), timeout=0.2)
        assert aggregator._thread.is_alive()
        request = {"job": "j", "epoch": 1, "rank": 0, "size": 1, "columns": 4, "aggregators": 1, "block": 16}
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            assert agg.register(sock, [aggregator.address], request, 5.0)[0][0] >= 0   # still serves
        stats = aggregator.stats()     # what does not start with "{" is a data packet to the C loop
        assert stats["bad_recv"] == 5 and stats["control"] == {"invalid": 13, "unpadded": 1}, stats   # counters
        assert stats["ctrl_dropped"] == 2, stats    # "{not json" and the 5001 bytes: no JSON object, dropped in C
    finally:
        aggregator.close()


_MAPPED = """
import socket, sys
from commlib._native import ffi, lib
def vm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
size, columns, block = map(int, sys.argv[1:])
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
aggregator = lib.omr_agg_new(sock.fileno(), 12345)
before = vm()
assert lib.omr_agg_add_job(aggregator, 7, size, columns, 1, 0, block, 0.0, 0.0, ffi.NULL, 0) >= 0
print(vm() - before)
"""


@pytest.mark.parametrize("size,block", [(4096, 1), (2, 16000)])   # per-worker state, then blocks, dominating
def test_a_registrations_limit_counts_what_the_aggregator_allocates(size, block):
    """job_bytes is what the limits are checked against: C's own count of omr_agg_add_job's memory, not an
    estimate (one that left out the 8-byte `asked` per worker and state let a job reserve 1.9x its limit).
    Measured in a process of its own, whose heap has no free room to hide an allocation in."""
    params = {"size": size, "columns": (64 << 20) // (2 * (size * 17 + block * 36 + 400)), "aggregators": 1,
              "index": 0, "block": block}
    grown = int(subprocess.run([sys.executable, "-c", _MAPPED, str(size), str(params["columns"]), str(block)],
                               capture_output=True, text=True, timeout=60, check=True).stdout)
    counted = agg.job_bytes(params)
    assert 0.9 * counted <= grown <= counted + (1 << 20), (f"omr_agg_add_job mapped {grown >> 20} MiB for {params}, "
                                                          f"job_bytes counts {counted >> 20} MiB")


def test_aggregator_caps_what_a_registration_reserves():
    aggregator = agg.Aggregator("127.0.0.1", 0).start()
    try:
        huge = {"op": "register", "job": "big", "epoch": 1, "rank": 0, "size": 64, "columns": 2000,
                "aggregators": 1, "index": 0, "block": 16000}       # 2.3 GB of address space, allocated lazily
        reply = udp_request(aggregator.address, control.encode(huge))
        assert reply["ok"] is False and "MiB" in reply["error"], reply
        assert agg.job_bytes(huge) > 2 << 30
        beyond = dict(huge, columns=1 << 40)
        assert udp_request(aggregator.address, control.encode(beyond))["ok"] is False
        assert aggregator.stats()["jobs"] == 0 and aggregator.stats()["control"] == {"limit": 1, "invalid": 1}
        for epoch in range(5):                                     # 5 x 230 MB would pass the 1 GiB in all
            fits = dict(huge, epoch=epoch, columns=200)
            udp_request(aggregator.address, control.encode(fits))
        assert aggregator.stats()["jobs"] == 4 and aggregator.stats()["control"]["limit"] == 2
    finally:
        aggregator.close()


# -- bullet 2: omnireduce's deregister and a replayed register ---------------------------------------
def keyed_aggregator():
    """A keyed aggregator, a signer under a fresh job key and rank 0's register request for it."""
    key = auth.new_key()
    nonce = auth.new_nonce()
    request = {"op": "register", "job": "j", "epoch": 1, "rank": 0, "size": 2, "columns": 4, "aggregators": 1,
               "index": 0, "block": 16, "nonce": nonce}
    return agg.Aggregator("127.0.0.1", 0, key=key, job_idle_s=600).start(), auth.Signer(auth.job_key(key, nonce)), request


def test_aggregator_refuses_unsigned_and_replayed_requests():
    aggregator, sign, request = keyed_aggregator()
    try:
        unsigned = udp_request(aggregator.address, control.encode(request))
        assert unsigned["ok"] is False and "not signed" in unsigned["error"], unsigned
        signed = control.encode(sign(request))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rank0:
            rank0.settimeout(5)
            rank0.sendto(signed, aggregator.address)
            assert control.decode(rank0.recv(65536))["ok"] is True
        diverted = udp_request(aggregator.address, signed)       # the same bytes from the attacker's port
        assert diverted["ok"] is False and "replayed" in diverted["error"], diverted
        for body in ({"op": "unregister", "job": "j", "epoch": 1}, {"op": "unregister", "job": "j", "epoch": 1,
                                                                   "rank": 0, "seq": 1, "mac": "0" * 32}):
            assert udp_request(aggregator.address, control.encode(body), timeout=0.2) is None
        assert aggregator.stats()["jobs"] == 1                   # nothing ended it
        drops = aggregator.stats()["control"]
        assert drops["bad_mac"] == 3 and drops["replay"] == 1, drops
        goodbye = control.encode(sign({"op": "unregister", "job": "j", "epoch": 1, "rank": 0}))
        assert udp_request(aggregator.address, goodbye, timeout=0.2) is None
        deadline = time.monotonic() + 5
        while aggregator.stats()["jobs"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aggregator.stats()["jobs"] == 0                   # the job's own rank ends it
        revived = udp_request(aggregator.address, signed)         # its sniffed register, replayed after the end
        assert revived["ok"] is False and "replayed" in revived["error"], revived
        assert aggregator.stats()["jobs"] == 0
    finally:
        aggregator.close()


def test_a_register_that_never_arrived_cannot_move_a_rank():
    """A rank's register is retried, each resend signed anew; one the aggregator never handled (lost,
    or its control queue was full) carries a fresh seq. Sniffed and sent from the attacker's address
    after the rank registered, it must not move the rank's results there (the MAC does not cover
    the source address); the rank's own resends are still answered."""
    aggregator, sign, request = keyed_aggregator()
    try:
        lost = control.encode(sign(request))                     # a resend the network dropped
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rank0:
            rank0.bind(("127.0.0.1", 0))
            rank0.settimeout(5)
            rank0.sendto(control.encode(sign(request)), aggregator.address)
            assert control.decode(rank0.recv(65536))["ok"] is True
            moved = udp_request(aggregator.address, lost)        # from the attacker's port
            assert moved is not None and moved["ok"] is False and "registered from" in moved["error"], moved
            rank0.sendto(control.encode(sign(request)), aggregator.address)   # its own resend: answered again
            assert control.decode(rank0.recv(65536))["ok"] is True
            job = aggregator._jobs[("j", 1)]
            assert {rank: pinned for rank, (pinned, _) in job.addresses.items()} == {0: rank0.getsockname()}
        assert aggregator.stats()["control"]["replay"] == 1
    finally:
        aggregator.close()


def test_keyed_omnireduce_job_end_to_end(tmp_path):
    """Dedicated keyed aggregators: the ranks hold only the job key (rank 0 reads the key file) and
    register, keep alive and end the job with signed requests."""
    import commlib.backends.omnireduce as om
    key_file = tmp_path / "agg.key"
    key = auth.write_key(str(key_file))
    aggregators = [agg.Aggregator("127.0.0.1", 0, key=key, job_idle_s=2.0).start() for _ in range(2)]
    try:
        group = LocalGroup(3, Settings({"timeout_s": 10.0, "omnireduce_retransmit_ms": 5.0,
                                        "omnireduce_mode": "dedicated", "omnireduce_block_size": 16,
                                        "omnireduce_aggregators": ",".join(a.address_str for a in aggregators),
                                        "omnireduce_key_file": str(key_file)}))
        backends = [om.OmniReduceBackend(ctx) for ctx in group.contexts]
        group.run(lambda ctx: backends[ctx.rank].start(), 30)
        x = np.arange(3 * 1000, dtype=np.int32).reshape(3, 1000)

        def work(ctx):
            first = backends[ctx.rank].allreduce(x[ctx.rank], "a")
            time.sleep(2.5)                       # longer than the idle time: keepalives of every rank hold it
            return first, backends[ctx.rank].allreduce(x[ctx.rank], "b")

        for first, second in group.run(work, 40):
            np.testing.assert_array_equal(first, x.sum(axis=0))
            np.testing.assert_array_equal(second, x.sum(axis=0))
        group.run(lambda ctx: backends[ctx.rank].close(), 30)
        deadline = time.monotonic() + 5
        while any(a.stats()["jobs"] for a in aggregators) and time.monotonic() < deadline:
            time.sleep(0.05)
        for a in aggregators:
            s = a.stats()
            assert s["jobs"] == 0 and "bad_mac" not in s["control"] and "replay" not in s["control"], s
    finally:
        for a in aggregators:
            a.close()


FLOODER = """
import socket, sys, time
address, until = (sys.argv[1], int(sys.argv[2])), time.monotonic() + float(sys.argv[3])
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
junk = [b'{"op":"register"}', b'{"op":"counters"}', b"x", b'{"op":"unregister","job":"j","epoch":1,"rank":0}']
sent = 0
while time.monotonic() < until:
    for _ in range(500):
        for sock, data in zip(socks, junk):
            try:
                sock.sendto(data, address)
            except OSError:
                pass
    sent += 2000
print(sent)
"""


def test_only_a_ranks_own_keepalives_hold_its_job():
    """Keepalives are data-path packets checked in C: one under another key or with another job
    secret holds nothing (the job expires under them); the rank's own hold it past the idle time."""
    key, nonce = auth.new_key(), auth.new_nonce()
    job_key = auth.job_key(key, nonce)
    aggregator = agg.Aggregator("127.0.0.1", 0, key=key, job_idle_s=1.0).start()
    try:
        request = {"job": "j", "epoch": 1, "rank": 0, "size": 1, "columns": 4, "aggregators": 1, "block": 16,
                   "nonce": nonce, "authenticate": True}
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rank0:
            (job, secret, _), = agg.register(rank0, [aggregator.address], request, 5.0, sign=auth.Signer(job_key))
            for _ in range(12):                          # 2.4 s: the job lives on its own keepalives
                agg.keepalive(rank0, [aggregator.address], [(job, secret)], 0, job_key)
                time.sleep(0.2)
            stats = aggregator.stats()
            assert stats["jobs"] == 1 and stats["keepalives_recv"] >= 10, stats
            forged = auth.new_key()[:16]
            for _ in range(15):                          # 3 s of forged ones: it expires
                agg.keepalive(rank0, [aggregator.address], [(job, secret)], 0, forged)
                agg.keepalive(rank0, [aggregator.address], [(job, secret ^ 1)], 0, job_key)
                time.sleep(0.2)
        stats = aggregator.stats()
        assert stats["jobs"] == 0 and stats["control"]["jobs_expired"] == 1, stats
        assert stats["bad_mac"] >= 4 and stats["bad_recv"] >= 4, stats   # until it expired; then an unknown job
    finally:
        aggregator.close()


def test_a_control_flood_neither_stalls_omnireduce_nor_starves_its_keepalives(tmp_path):
    """An unprivileged process floods a keyed aggregator's port with small datagrams (requests and
    junk, from 4 sockets) while a job runs: the C loop drops them (ctrl_dropped), so the job's calls
    stay about as fast as without the flood, and its keepalives (data-path packets) hold the job
    through a pause longer than the aggregator's idle time."""
    import statistics
    import commlib.backends.omnireduce as om
    key_file = tmp_path / "agg.key"
    auth.write_key(str(key_file))
    aggregator = agg.Aggregator("127.0.0.1", 0, key=auth.read_key(str(key_file)), job_idle_s=2.0).start()
    flooder = None
    try:
        group = LocalGroup(2, Settings({"timeout_s": 10.0, "omnireduce_retransmit_ms": 5.0,
                                        "omnireduce_mode": "dedicated", "omnireduce_block_size": 64,
                                        "omnireduce_aggregators": aggregator.address_str,
                                        "omnireduce_key_file": str(key_file)}))
        backends = [om.OmniReduceBackend(ctx) for ctx in group.contexts]
        group.run(lambda ctx: backends[ctx.rank].start(), 30)
        x = np.arange(2 * 20000, dtype=np.float32).reshape(2, 20000)

        def calls(tag, pause=0.0):
            def work(ctx):
                time.sleep(pause)                  # no data: only keepalives hold the job
                times = []
                for i in range(15):
                    t = time.perf_counter()
                    out = backends[ctx.rank].allreduce(x[ctx.rank], f"{tag}{i}")
                    times.append(time.perf_counter() - t)
                    np.testing.assert_array_equal(out, x.sum(axis=0))
                return statistics.median(times)
            return max(group.run(work, 60))

        quiet = calls("quiet")
        flooder = subprocess.Popen([sys.executable, "-c", FLOODER, *map(str, aggregator.address), "30"],
                                   stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        before = aggregator.stats()["ctrl_dropped"]
        flooded = calls("flood", pause=3.0)        # 1.5 x the idle time
        stats = aggregator.stats()
        flooder.kill()
        print(f"median call {quiet * 1e3:.1f} ms quiet, {flooded * 1e3:.1f} ms flooded; "
              f"{stats['ctrl_dropped'] - before} control datagrams dropped in C, {stats['keepalives_recv']} keepalives")
        assert stats["ctrl_dropped"] - before > 10000, stats        # the flood reached it
        assert stats["jobs"] == 1 and "jobs_expired" not in stats["control"], stats
        # a functional bound (a loaded 2-core host: the flooder takes a core), not a benchmark
        assert flooded < max(3 * quiet, quiet + 0.5), (f"median call {flooded * 1e3:.1f} ms under the flood, "
                                                       f"{quiet * 1e3:.1f} ms without")
        group.run(lambda ctx: backends[ctx.rank].close(), 30)
    finally:
        if flooder is not None:
            flooder.kill()
            flooder.wait()
        aggregator.close()


# -- bullet 3: the aggregator's counters while it runs; the daemons' key files -----------------------
def test_aggregator_cli_counters_and_key_file(tmp_path):
    key_file = tmp_path / "agg.key"
    auth.write_key(str(key_file))
    cmd = [sys.executable, "-m", "commlib.switch.aggregator_main"]
    proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", "0", "--key-file", str(key_file), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address, = control.wait_ready(proc, 30, "commlib-aggregator")
        host, port = address.rsplit(":", 1)
        udp_request((host, int(port)), b"{nope}", timeout=0.2)    # may be JSON: the C loop hands it up
        out = subprocess.run(cmd + ["counters", address, "--key-file", str(key_file)], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        counters = json.loads(out.stdout)
        assert counters["ctrl_recv"] >= 1 and counters["control"]["malformed"] == 1, counters
        out = subprocess.run(cmd + ["counters", address], capture_output=True, text=True, timeout=30)
        assert out.returncode == 1 and "not signed" in out.stderr, out.stderr
        _says_what_to_do_without_the_key(out.stderr)
    finally:
        proc.kill()
        proc.wait()


def _says_what_to_do_without_the_key(stderr):
    """A counters CLI refused for want of the key tells its user (not a job) what to do: pass the
    daemon's --key-file, or, for the switch and aggregators a job embeds (keyed with the job's
    secret, which no file holds), read their counters in that job's trace."""
    assert "--key-file" in stderr and "COMMLIB_STUDY" in stderr and "COMMLIB_TIMELINE" in stderr, stderr


def test_switch_cli_with_a_key_file(tmp_path):
    key_file = tmp_path / "switch.key"
    key = auth.write_key(str(key_file))
    cli = [sys.executable, "-m", "commlib.switch"]
    proc = subprocess.Popen(cli + ["--port", "0", "--slots", "1000", "--key-file", str(key_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address, = control.wait_ready(proc, 30, "commlib-switch")
        status = sw.SwitchClient(address).status()
        assert status["authenticated"] is True and status["slots"] == 1000
        with pytest.raises(ConfigError, match="at most 250"):                 # --job-slots default: a quarter
            register(type("S", (), {"address": address})(), key, slots=251)
        out = subprocess.run(cli + ["counters", address, "--key-file", str(key_file)], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0 and json.loads(out.stdout)["control"]["limit"] == 1, (out.stdout, out.stderr)
        out = subprocess.run(cli + ["counters", address], capture_output=True, text=True, timeout=30)
        assert out.returncode == 1 and "refused" in out.stderr
        _says_what_to_do_without_the_key(out.stderr)
    finally:
        proc.kill()
        proc.wait()
    bad = tmp_path / "short.key"
    bad.write_text("abcd\n")
    bad.chmod(0o600)
    out = subprocess.run(cli + ["--port", "0", "--key-file", str(bad)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "at least 16" in out.stderr


def test_key_files_are_private(tmp_path):
    """A key file others may read is refused with what to do (as ssh); writing a key over an
    existing file makes it private, whatever its mode was."""
    path = tmp_path / "daemon.key"
    path.write_text("ab" * 32 + "\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=f"chmod 600 {path}"):
        auth.read_key(str(path))
    subprocess.run([sys.executable, "-m", "commlib.switch.auth", str(path)], check=True, capture_output=True, timeout=30)
    assert path.stat().st_mode & 0o777 == 0o600, oct(path.stat().st_mode)
    assert len(auth.read_key(str(path))) == auth.DAEMON_KEY_BYTES


def test_an_aggregator_answers_no_datagram_with_more_bytes_than_it_had():
    """No amplification: junk, an unpadded counters or register gets nothing longer than itself (it
    got 79 and 351 bytes for 1 and 17); the clients pad theirs, so they are answered."""
    aggregator = agg.Aggregator("127.0.0.1", 0).start()
    try:
        for data in (b"x", b"{}", b"{" + b" " * 30 + b"}", control.encode({"op": "counters"}),
                     control.encode({"op": "register", "job": "j", "epoch": 1})):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.settimeout(0.3)
                sock.sendto(data, aggregator.address)
                try:
                    answer = sock.recv(65536)
                except socket.timeout:
                    answer = b""
            assert len(answer) <= len(data), (data, answer)
        assert agg.query(aggregator.address, {"op": "counters"})["jobs"] == 0     # padded: answered
    finally:
        aggregator.close()


# -- a job with COMMLIB_AUTHENTICATE on (the default) refuses a keyless daemon, on every rank ----------
def _start_errors(group, make):
    """Each rank's error from starting its backend (None where it started)."""
    backends = [make(ctx) for ctx in group.contexts]

    def start(ctx):
        try:
            backends[ctx.rank].start()
        except Exception as exc:   # the test looks at every rank's
            return exc
        backends[ctx.rank].close()
        return None
    return group.run(start, 40)


def _says_how_to_go_on(errors, *words):
    assert len(errors) == 2, errors
    for exc in errors:                 # the failing rank's ConfigError, as ctx.agree raises it on each rank
        assert isinstance(exc, CommError) and "ConfigError" in str(exc) or isinstance(exc, ConfigError), errors
        for word in ("COMMLIB_AUTHENTICATE=0", "--key-file", *words):
            assert word in str(exc), (word, str(exc))


@pytest.mark.parametrize("key_file", [False, True])
def test_a_job_refuses_a_keyless_switch(tmp_path, key_file):
    """No key file: the job would run without MACs; a key file the switch was not started with:
    the switch would register it without MACs. Both are a clear error on every rank."""
    path = tmp_path / "switch.key"
    auth.write_key(str(path))
    with sw.SwitchServer("127.0.0.1", 0, slots=256) as server:
        fields = {"timeout_s": 5.0, "switch_addr": server.address,
                  **({"switch_key_file": str(path)} if key_file else {})}
        errors = _start_errors(LocalGroup(2, Settings(fields)), sml.SwitchMLBackend)
        _says_how_to_go_on(errors, "the switch has no key" if key_file else "COMMLIB_SWITCH_KEY_FILE")
        assert server.status()["jobs"] == {} or key_file          # no key file: nothing was registered
        fine = _start_errors(LocalGroup(2, Settings(dict(fields, authenticate=False))), sml.SwitchMLBackend)
        assert fine == [None, None], fine                          # said explicitly: a trusted fabric


@pytest.mark.parametrize("key_file", [False, True])
def test_a_job_refuses_a_keyless_aggregator(tmp_path, key_file):
    import commlib.backends.omnireduce as om
    path = tmp_path / "agg.key"
    auth.write_key(str(path))
    aggregator = agg.Aggregator("127.0.0.1", 0).start()
    try:
        fields = {"timeout_s": 5.0, "omnireduce_mode": "dedicated", "omnireduce_aggregators": aggregator.address_str,
                  **({"omnireduce_key_file": str(path)} if key_file else {})}
        errors = _start_errors(LocalGroup(2, Settings(fields)), om.OmniReduceBackend)
        _says_how_to_go_on(errors, "the aggregator has no key" if key_file else "COMMLIB_OMNIREDUCE_KEY_FILE")
        fine = _start_errors(LocalGroup(2, Settings(dict(fields, authenticate=False))), om.OmniReduceBackend)
        assert fine == [None, None], fine
    finally:
        aggregator.close()


def test_a_sniffed_register_sent_first_from_elsewhere_does_not_keep_the_rank():
    """A register's MAC does not cover its source: a copy sniffed and sent from elsewhere before the
    original pinned the rank's results there, and the rank failed with 'seq seen before'. Now its next
    resend, newer, takes the rank back; an older copy sent later moves nothing."""
    key = auth.new_key()
    aggregator = agg.Aggregator("127.0.0.1", 0, key=key).start()
    nonce = auth.new_nonce()
    request = {"job": agg.token_hash("tok"), "epoch": 1, "rank": 1, "size": 2, "columns": 4, "aggregators": 1,
               "block": 16, "nonce": nonce, "authenticate": True}
    attacker, worker = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
    copies = []

    class Sniffed:   # the worker's socket, its first datagram copied to the attacker, who sends it first
        def sendto(self, data, address):
            if not copies:
                copies.append(data)
                attacker.sendto(data, address)
                time.sleep(0.005)
            return worker.sendto(data, address)

        def __getattr__(self, name):
            return getattr(worker, name)

    try:
        for sock in (attacker, worker):
            sock.bind(("127.0.0.1", 0))
        answers = agg.register(Sniffed(), [aggregator.address], request, 5.0, sign=auth.Signer(auth.job_key(key, nonce)))
        assert len(answers) == 1
        (job,) = aggregator._jobs.values()
        assert job.addresses[1][0] == worker.getsockname(), "the rank's results go to the attacker"
        attacker.sendto(copies[0], aggregator.address)   # the old copy again, later: older than the rank's
        time.sleep(0.3)
        assert job.addresses[1][0] == worker.getsockname()
        assert aggregator.drops.snapshot()["replay"] >= 2
    finally:
        aggregator.close()
        attacker.close()
        worker.close()
