"""commlib across emulated hosts: a network namespace per worker and one for the switch or the
aggregators, links shaped by tc (benchmarks/netem.py). Correctness over real interfaces, each
worker its own host (no loopback shortcuts, no embedded switch); speed is bench_network.py's job."""
import json
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from commlib.switch import auth, control
from commlib.testing import results
from benchmarks import netem
from helpers import check_closed_form, check_omnireduce_sums, check_switchml

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"

AVAILABLE, WHY = netem.available()
pytestmark = [pytest.mark.long, pytest.mark.netns, pytest.mark.multiprocess, pytest.mark.timeout(240),
              pytest.mark.skipif(not AVAILABLE, reason=WHY)]


def _ready_line(proc, seconds=30):
    """commlib-aggregator's `READY host:port,...` line (switch/control.py's handshake), or a failure that says why."""
    return ",".join(control.wait_ready(proc, seconds, "commlib-aggregator"))


def _run(cluster, hosts, script, *args, env=None):
    ranks = cluster.run(hosts, [sys.executable, str(WORKERS / script), *args], env or {}, timeout=180, cwd=ROOT)
    for rank, (code, out) in enumerate(ranks):
        assert code == 0, f"rank {rank} exited {code}:\n{out}"
    return [out for _, out in ranks]


def test_ring_across_hosts():
    with netem.Cluster(["w0", "w1", "w2"], rate="1gbit") as cluster:
        outs = _run(cluster, ["w0", "w1", "w2"], "basic.py")
    check_closed_form(results("\n".join(outs), 3))   # basic.py reports JSON (commlib.testing.report)


def test_switchml_through_a_switch_on_its_own_host():
    hosts = ["w0", "w1", "w2"]
    with netem.Cluster(hosts + ["switch"], rate="1gbit", unshaped={"switch"}) as cluster:
        switch, address = cluster.start_switch("switch", cwd=ROOT)
        try:
            assert address.startswith(cluster.address("switch"))
            outs = _run(cluster, hosts, "switchml_worker.py", "external", env={"COMMLIB_SWITCH_ADDR": address, "COMMLIB_AUTHENTICATE": "0"})
            counters = subprocess.run(["ip", "netns", "exec", cluster.namespace("w0"), sys.executable, "-m",
                                       "commlib.switch", "counters", address], capture_output=True, text=True,
                                      cwd=ROOT, timeout=30)
        finally:
            cluster.kill([switch])
    check_switchml(results("\n".join(outs), 3), "external", address, packet_elems=355)   # 1500-byte frames
    assert counters.returncode == 0, counters.stderr
    seen = json.loads(counters.stdout)
    assert seen["switch"]["pkts_recv"] > 0 and seen["switch"]["drop_checksum"] == 0, seen
    assert seen["jobs"] == {}, seen   # the job ended at shutdown and gave its slots back


def test_switchml_across_two_switch_hosts_of_two_threads_each():
    """COMMLIB_SWITCH_ADDR names two switches, each on its own host with 2 data-plane threads: every rank
    streams to the 4 threads over real interfaces; the sums hold and each switch aggregated its share."""
    hosts = ["w0", "w1", "w2"]
    with netem.Cluster(hosts + ["s0", "s1"], rate="1gbit", unshaped={"s0", "s1"}) as cluster:
        switches = [cluster.start_switch(host, cwd=ROOT, extra=["--threads", "2"]) for host in ("s0", "s1")]
        address = ",".join(a for _, a in switches)
        try:
            outs = _run(cluster, hosts, "switchml_worker.py", "external", env={
                "COMMLIB_SWITCH_ADDR": address, "COMMLIB_AUTHENTICATE": "0", "COMMLIB_SWITCH_STREAMS": "2"})
            counters = [json.loads(subprocess.run(
                ["ip", "netns", "exec", cluster.namespace("w0"), sys.executable, "-m", "commlib.switch", "counters",
                 a], capture_output=True, text=True, cwd=ROOT, timeout=30, check=True).stdout) for _, a in switches]
        finally:
            cluster.kill([proc for proc, _ in switches])
    ranks = results("\n".join(outs), 3)
    check_switchml(ranks, "external", address, packet_elems=355)
    assert all(r["streams"] == 4 for r in ranks), [r["streams"] for r in ranks]
    for seen in counters:
        assert len(seen["shards"]) == 2 and all(s["pkts_recv"] > 0 for s in seen["shards"]), seen["shards"]
        assert seen["switch"]["pkts_recv"] == sum(s["pkts_recv"] for s in seen["shards"]) and seen["jobs"] == {}


def _tree(cluster, key_file):
    """Two leaf switches and a spine, each on its own host of `cluster`, keyed: {host: (process, address)}."""
    return {host: cluster.start_switch(host, cwd=ROOT, extra=["--threads", "1", "--key-file", str(key_file)])
            for host in ("l0", "l1", "spine")}


def test_two_levels_across_hosts_give_one_switchs_bits(tmp_path):
    """4 ranks on their own hosts stream to 2 leaf switches (2 ranks each: one per host, grouped by host), whose
    partial sums go to a spine, each switch on its own host, keyed (the leaves MAC their sums under the spine's
    job key): every float and int32 sum is the same job's through one of those switches, bit for bit."""
    hosts = ["w0", "w1", "w2", "w3"]
    key_file = tmp_path / "switch.key"
    auth.write_key(str(key_file))
    env = {"COMMLIB_SWITCH_KEY_FILE": str(key_file)}
    with netem.Cluster(hosts + ["l0", "l1", "spine"], rate="1gbit", unshaped={"l0", "l1", "spine"}) as cluster:
        tree = _tree(cluster, key_file)
        leaves, spine = f"{tree['l0'][1]},{tree['l1'][1]}", tree["spine"][1]
        try:
            two = _run(cluster, hosts, "switchml_tree.py", "sums",
                       env=dict(env, COMMLIB_SWITCH_ADDR=leaves, COMMLIB_SWITCH_SPINE=spine))
            seen = {host: json.loads(subprocess.run(
                ["ip", "netns", "exec", cluster.namespace("w0"), sys.executable, "-m", "commlib.switch", "counters",
                 address, "--key-file", str(key_file)], capture_output=True, text=True, cwd=ROOT, timeout=30,
                check=True).stdout)["switch"] for host, (_, address) in tree.items()}
            one = _run(cluster, hosts, "switchml_tree.py", "sums", env=dict(env, COMMLIB_SWITCH_ADDR=tree["l0"][1]))
        finally:
            cluster.kill([proc for proc, _ in tree.values()])
    two, one = results("\n".join(two), 4), results("\n".join(one), 4)
    assert all(seen[host]["pkts_recv"] > 0 for host in tree), seen   # each switch took part
    for rank, (a, b) in enumerate(zip(two, one)):
        assert a["switch"] == f"{leaves},{spine}" and b["switch"] == tree["l0"][1] and a["authenticated"], (a, b)
        for name, got in a["sums"].items():
            assert got == b["sums"][name], f"rank {rank}, {name}: two levels {got}, one switch {b['sums'][name]}"
            assert got == two[0]["sums"][name], f"ranks 0 and {rank} differ in {name}"
            assert got.get("exact", True) and got.get("error_over_bound", 0) <= 1, (rank, name, got)


def test_a_spine_killed_mid_job_fails_every_rank_naming_it(tmp_path):
    """The tree above; after a first allreduce rank 0 kills the spine's process: every rank's next allreduce
    fails within the timeout (10 s: the ranks' rendezvous shares it, on a loaded host; then the probe of the
    tree's switches) with an error naming the spine."""
    hosts = ["w0", "w1", "w2", "w3"]
    key_file = tmp_path / "switch.key"
    auth.write_key(str(key_file))
    with netem.Cluster(hosts + ["l0", "l1", "spine"], rate="1gbit", unshaped={"l0", "l1", "spine"}) as cluster:
        tree = _tree(cluster, key_file)
        (victim, spine) = tree["spine"]
        try:
            outs = _run(cluster, hosts, "switchml_tree.py", "kill", str(victim.pid), env={
                "COMMLIB_SWITCH_KEY_FILE": str(key_file), "COMMLIB_TIMEOUT_S": "10",
                "COMMLIB_SWITCH_ADDR": f"{tree['l0'][1]},{tree['l1'][1]}", "COMMLIB_SWITCH_SPINE": spine})
            assert victim.wait(10) == -9, "rank 0 did not kill the spine"
        finally:
            cluster.kill([proc for proc, _ in tree.values()])
    for rank, seen in enumerate(results("\n".join(outs), 4)):
        assert seen["error"] is not None and f"the spine switch at {spine}" in seen["error"], (rank, seen)
        assert seen["seconds"] < 10 + 5, f"rank {rank} took {seen['seconds']:.1f}s to fail"


BROADCASTS = """
import json
from commlib.errors import ConfigError
from commlib.switch import net, switchml as sw
seen = {a: net.is_broadcast(a) for a in ("10.201.0.255", "10.201.0.2", "10.201.1.255")}
with sw.SwitchServer("10.201.0.1", 0, slots=64) as leaf:
    for what, parent, worker in (("parent", "10.201.0.255", "10.201.0.1"), ("worker", "10.201.0.2", "10.201.0.255")):
        try:
            leaf.register(1, [[worker, 9]], 4, 64, parent={"address": parent + ":9", "ports": [9], "job": 0,
                                                           "rank": 0, "token": 1})
        except ConfigError as exc:
            seen[what] = str(exc)
print(json.dumps(seen))
"""


def test_the_broadcast_address_of_a_hosts_subnet_is_refused():
    """On a host of 10.201.0.0/24: 10.201.0.255 is its subnet's broadcast, a neighbour's address and another
    subnet's .255 are not; a leaf refuses it as its parent and as a rank's address."""
    with netem.Cluster(["w0", "w1"], rate="1gbit") as cluster:
        out = subprocess.run(["ip", "netns", "exec", cluster.namespace("w0"), sys.executable, "-c", BROADCASTS],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen.pop("10.201.0.255") and not seen.pop("10.201.0.2") and not seen.pop("10.201.1.255"), seen
    assert seen == {what: f"{what} address 10.201.0.255: the broadcast address of a subnet of this host, not a "
                          f"unicast one (its packets would go to every host there); give the address of one host"
                    for what in ("parent", "worker")}, seen


def test_switchml_timers_do_not_fire_under_its_own_window_on_a_slow_link():
    """20 Mbit links: a window of 128 packets takes 55 ms to drain, a tensor of 300 values answers
    in about 1 ms. The first answers of a window come back before the queue it builds; were the
    timer to follow them, the packets sent next would time out behind that queue (hot/cold's slab
    resent 20-40% of its packets on 100 Mbit links). No loss here: nearly nothing may be resent."""
    hosts = ["w0", "w1"]
    with netem.Cluster(hosts + ["switch"], rate="20mbit", unshaped={"switch"}) as cluster:
        switch, address = cluster.start_switch("switch", cwd=ROOT)
        try:
            outs = _run(cluster, hosts, "switchml_slow_link.py", env={"COMMLIB_SWITCH_ADDR": address,
                                                                     "COMMLIB_AUTHENTICATE": "0",
                                                                     "COMMLIB_SWITCH_PACKET_ELEMS": "256",
                                                                     "COMMLIB_SWITCH_WINDOW": "128"})
        finally:
            cluster.kill([switch])
    for rank, seen in enumerate(results("\n".join(outs), 2)):
        assert seen["received"] > 8 * 4 * 128, seen
        assert seen["resends"] <= 0.05 * seen["sent"], f"rank {rank} resent {seen['resends']} of {seen['sent']} packets"


def test_a_leafs_timer_does_not_fire_under_its_windows_on_a_slow_link():
    """Two levels, the spine's link at 20 Mbit: each leaf's window of 64 partial sums queues there behind the
    other leaf's (about 55 ms a round trip) while the leaves' timers start at 5 ms. The leaves' timers follow
    the round trip as the workers' do: after the first tensors nearly nothing is resent upward (a timer that
    stayed at 5 ms, doubling, resent about 3 in 4 of the partial sums)."""
    hosts = ["w0", "w1"]
    with netem.Cluster(hosts + ["l0", "l1", "spine"], rate="20mbit", unshaped={"w0", "w1", "l0", "l1"}) as cluster:
        tree = {host: cluster.start_switch(host, cwd=ROOT, extra=["--threads", "1"]) for host in ("l0", "l1", "spine")}
        try:
            outs = _run(cluster, hosts, "switchml_slow_link.py", env={
                "COMMLIB_SWITCH_ADDR": f"{tree['l0'][1]},{tree['l1'][1]}", "COMMLIB_SWITCH_SPINE": tree["spine"][1],
                "COMMLIB_AUTHENTICATE": "0", "COMMLIB_SWITCH_PACKET_ELEMS": "256", "COMMLIB_SWITCH_WINDOW": "64"})
        finally:
            cluster.kill([proc for proc, _ in tree.values()])
    ranks = results("\n".join(outs), 2)
    up = ranks[0]
    assert up["up_sent"] >= 2 * 8 * 4 * 128, up   # both leaves, 8 steps of 4 x 128 packets
    assert up["up_resends"] <= 0.05 * up["up_sent"], f"the leaves resent {up['up_resends']} of {up['up_sent']} sums"
    for rank, seen in enumerate(ranks):
        assert seen["resends"] <= 0.05 * seen["sent"], f"rank {rank} resent {seen['resends']} of {seen['sent']} packets"


@pytest.mark.parametrize("mode", ["colocated", "dedicated"])
def test_omnireduce_across_hosts(mode, tmp_path):
    hosts = ["w0", "w1", "w2"]
    with netem.Cluster(hosts + ["aggregators"], rate="1gbit", unshaped={"aggregators"}) as cluster:
        env, procs = {}, []
        try:
            if mode == "dedicated":   # keyed aggregators of their own, the ranks given the same key file
                key_file = tmp_path / "aggregators.key"
                auth.write_key(str(key_file))
                procs.append(cluster.popen("aggregators", [
                    sys.executable, "-m", "commlib.switch.aggregator_main", "--host", cluster.address("aggregators"),
                    "--port", "0", "--count", "2", "--quiet", "--key-file", str(key_file)],
                    stdout=subprocess.PIPE, text=True, cwd=ROOT))
                env["COMMLIB_OMNIREDUCE_AGGREGATORS"] = _ready_line(procs[0])
                env["COMMLIB_OMNIREDUCE_KEY_FILE"] = str(key_file)
            start = time.monotonic()
            outs = _run(cluster, hosts, "omnireduce_worker.py", "sums", mode, env=env)
        finally:
            cluster.kill(procs)
    check_omnireduce_sums(results("\n".join(outs), 3), (time.monotonic() - start, outs))


def test_omnireduce_blocks_sized_by_the_path():
    """omnireduce_block_size=0 across hosts on 1500-byte veth links: every rank agrees on 349 values
    a block (a result, stamp and MAC included, fills one frame), and an int32 tensor of 28.7 blocks
    sums exactly."""
    hosts = ["w0", "w1", "w2"]
    with netem.Cluster(hosts, rate="1gbit") as cluster:
        outs = _run(cluster, hosts, "omnireduce_worker.py", "path", "colocated")
    for seen in results("\n".join(outs), 3):
        assert seen["exact"] and seen["block_size"] == 349 and seen["authenticated"], seen


def _streams(capture):
    """The payloads of a capture file (tests/workers/capture.py): each TCP direction reassembled in
    sequence order, and each UDP datagram, as byte strings."""
    data, at, tcp, datagrams = capture.read_bytes(), 0, {}, []
    while at < len(data):
        (length,), frame = struct.unpack_from("!I", data, at), None
        frame, at = data[at + 4:at + 4 + length], at + 4 + length
        if frame[12:14] != b"\x08\x00":   # IPv4 only: the cluster has no other
            continue
        ip = frame[14:]
        header, protocol, total = (ip[0] & 15) * 4, ip[9], struct.unpack_from("!H", ip, 2)[0]
        segment = ip[header:total]
        if protocol == socket.IPPROTO_TCP:
            flow = (ip[12:20], segment[:4])
            offset = (segment[12] >> 4) * 4
            tcp.setdefault(flow, {})[struct.unpack_from("!I", segment, 4)[0]] = segment[offset:]
        elif protocol == socket.IPPROTO_UDP:
            datagrams.append(segment[8:])
    streams = [b"".join(parts[seq] for seq in sorted(parts)) for parts in tcp.values()]
    return [s for s in streams + datagrams if s]


def test_no_byte_on_the_launchers_wire_derives_the_job_key(tmp_path):
    """A sniffer on a link between two hosts sees the whole job, set-up included: the launcher's
    channel (torch.distributed's Gloo, over which rank 0 hands out the job's secret), the controller,
    the omnireduce packets. Every 32-byte window of every stream it saw, taken as the daemon key,
    derives a job key, and none is the one the job's packets are MACed with; nor is the secret there."""
    hosts = ["w0", "w1"]
    capture = tmp_path / "capture.bin"
    with netem.Cluster(hosts, rate="1gbit") as cluster:
        sniffer = subprocess.Popen(["ip", "netns", "exec", cluster.fabric, sys.executable, str(WORKERS / "capture.py"),
                                    "p0", str(capture)], stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert sniffer.stdout.readline().strip() == "capturing"
            outs = _run(cluster, hosts, "keyshare_worker.py", env={"COMMLIB_OMNIREDUCE_MODE": "colocated"})
            time.sleep(0.5)   # the last frames reach the file
        finally:
            cluster.kill([sniffer])
    ranks = results("\n".join(outs), 2)
    for r in ranks:
        assert r["exact"] and r["marker_back"] and r["algorithms"] == ["omnireduce", "ring"], r
    secret, job_key, nonce = (ranks[0][k] for k in ("secret", "job_key", "nonce"))
    assert all((r["secret"], r["job_key"]) == (secret, job_key) for r in ranks), ranks
    streams = _streams(capture)
    marker = (np.arange(16, dtype=np.float32) + 271828.0).tobytes()
    assert any(marker in s for s in streams), "the capture missed the ranks' ring traffic: it proves nothing"
    secret, job_key = bytes.fromhex(secret), bytes.fromhex(job_key)
    windows = {s[i:i + auth.DAEMON_KEY_BYTES] for s in streams for i in range(len(s) - auth.DAEMON_KEY_BYTES + 1)}
    assert secret not in windows, "the job's secret crossed the wire in clear"
    derives = [w.hex() for w in windows if auth.job_key(w, nonce) == job_key]
    assert not derives, f"{len(derives)} byte sequences on the wire derive the job key: {derives[:3]}"
