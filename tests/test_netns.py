"""commlib across emulated hosts: a network namespace per worker and one for the switch or the
aggregators, links shaped by tc (benchmarks/netem.py). Correctness over real interfaces, each
worker its own host (no loopback shortcuts, no embedded switch); speed is bench_network.py's job."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commlib.switch import auth, control
from commlib.testing import results
from test_core_multiprocess import check_closed_form
from test_omnireduce_multiprocess import check_sums as check_omnireduce
from test_switchml_multiprocess import check as check_switchml

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
sys.path.insert(0, str(ROOT / "benchmarks"))
import netem  # noqa: E402

AVAILABLE, WHY = netem.available()
pytestmark = [pytest.mark.netns, pytest.mark.multiprocess, pytest.mark.timeout(240),
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
            outs = _run(cluster, hosts, "switchml_worker.py", "external", env={"COMMLIB_SWITCH_ADDR": address})
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
                                                                     "COMMLIB_SWITCH_PACKET_ELEMS": "256",
                                                                     "COMMLIB_SWITCH_WINDOW": "128"})
        finally:
            cluster.kill([switch])
    for rank, seen in enumerate(results("\n".join(outs), 2)):
        assert seen["received"] > 8 * 4 * 128, seen
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
    check_omnireduce(results("\n".join(outs), 3), (time.monotonic() - start, outs))
