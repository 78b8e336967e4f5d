"""The benchmarks' bottleneck rule (benchmarks/common.bottleneck) on constructed breakdowns: which of
the network, the workers and the switch/aggregators each configuration names, and why."""
import pytest

from benchmarks import common


def samples(process_s, transfer_s, server_s=None, runs=3):
    """`runs` identical breakdowns (the rule takes medians); server_s left out when None."""
    one = {"process_s": process_s, "transfer_s": transfer_s}
    if server_s is not None:
        one["server_s"] = server_s
    return [dict(one) for _ in range(runs)]


@pytest.mark.parametrize("case, seconds, breakdowns, link, server, expected", [
    ("transfer dominates", 1.0, samples(0.1, 0.8), 0.9, "switch", "network (80%; workers 20%, switch n/a, link 90%)"),
    ("processing dominates", 1.0, samples(0.7, 0.2), 0.2, "switch", "workers (80%; network 20%, switch n/a, link 20%)"),
    ("server share dominates", 1.0, samples(0.1, 0.8, server_s=0.6), None, "switch",
     "switch (60%; network 20%, workers 20%, link n/a)"),
    ("aggregators named as such", 2.0, samples(0.2, 1.6, server_s=1.0), "n/a: loopback", "aggregators",
     "aggregators (50%; network 30%, workers 20%, link n/a: loopback)"),
    # a training step: what neither processing nor transfer covers is the model's compute, on the workers
    ("compute outside commlib", 1.0, samples(0.05, 0.3), None, "switch",
     "workers (70%; network 30%, switch n/a, link n/a)"),
    # the network's share is the largest, but the wire carried 20% of its rate over 60% of the time
    ("transfer dominates on an idle link", 1.0, samples(0.2, 0.6), 0.2, "switch",
     "workers (CPU-bound: network 60% with link 20%; workers 40%, switch n/a)"),
    ("transfer dominates, link busy while it lasts", 1.0, samples(0.3, 0.6), 0.35, "switch",
     "network (60%; workers 40%, switch n/a, link 35%)"),
    ("medians over the samples", 1.0, samples(0.1, 0.8) + samples(0.9, 0.05, runs=1), None, "switch",
     "network (80%; workers 20%, switch n/a, link n/a)"),
    ("no server (an allgather, the ring)", 1.0, samples(0.1, 0.8), 0.9, None, "network (80%; workers 20%, link 90%)"),
    ("no breakdown, busy link", 1.0, [], 0.93, "switch", "network (link 93%)"),
    ("no breakdown, quiet link", 1.0, [], 0.3, "switch", "n/a: Horovod's allreduce; link 30%"),
    ("nothing measured", 1.0, [], "n/a: loopback", "switch", "n/a: Horovod's allreduce; link n/a: loopback"),
])
def test_bottleneck_rule(case, seconds, breakdowns, link, server, expected):
    got = common.bottleneck(seconds, breakdowns, link=link, server=server, unmeasured="n/a: Horovod's allreduce")
    assert got == expected, f"{case}: expected {expected!r}, the rule said {got!r}"


def test_step_breakdown_sums_the_server_share_of_the_buckets_that_have_a_server():
    records = {"a": {"bucket": 1, "process_s": 0.1, "transfer_s": 0.5, "server_queue_s": 0.2, "server_proc_s": 0.05},
               "b": {"bucket": 1, "process_s": 0.1, "transfer_s": 0.5, "server_queue_s": 0.2, "server_proc_s": 0.05},
               "c": {"bucket": 2, "process_s": 0.2, "transfer_s": 0.3, "server_queue_s": 0.1, "server_proc_s": 0.0}}
    got = common.step_breakdown(records, ["a", "b", "c", "not reduced"])
    assert got == pytest.approx({"process_s": 0.3, "transfer_s": 0.8, "server_s": 0.35}), \
        f"bucket 1 counted once, bucket 2 added: {got}"
    records["c"].update(server_queue_s=None, server_proc_s=None)   # the ring's bucket: no server (records() say None)
    got = common.step_breakdown(records, ["a", "c"], server_s=9.0)
    assert got["server_s"] == pytest.approx(0.25), f"the stamped bucket's share only, not the daemons' 9 s: {got}"
    records["a"].update(server_queue_s=None, server_proc_s=None)
    assert common.step_breakdown(records, ["a", "c"], server_s=9.0)["server_s"] == 9.0, "no stamps: the daemons' share"
    assert "server_s" not in common.step_breakdown(records, ["a", "c"]), "no stamps and no daemons: no server share"


class FakeBackend:
    """A backend as server_seconds sees it: its window, its job's size and its daemons' counters."""

    def __init__(self, counters, size=4, window=128):
        self.counters, self.window = counters, window
        self.ctx = type("Ctx", (), {"size": size})()

    def daemon_counters(self):
        return {f"daemon {i}": (lambda c=c: c) for i, c in enumerate(self.counters)}


def test_server_seconds_from_the_daemons_counters():
    backend = FakeBackend([{"queue_ns": 1_000, "proc_ns": 500, "rx": 9}, {"queue_ns": 0, "proc_ns": 0}])
    before = common.daemon_ns({"switchml": backend, "ring": FakeBackend([])})
    assert set(before) == {"switchml"}, f"only a backend whose daemons report queue_ns is read: {before}"
    backend.counters = [{"queue_ns": 1_000 + 2_000_000_000, "proc_ns": 500 + 560_000_000},
                        {"queue_ns": 300_000_000, "proc_ns": 100_000_000}]
    after = common.daemon_ns({"switchml": backend})
    # 2.96 s of queue + processing over 4 workers x 128 packets in flight, over 2 calls
    assert common.server_seconds(before, after, calls=2) == pytest.approx(2.96 / (4 * 128) / 2)
    assert common.daemon_ns({"switchml": FakeBackend([{"rx": 5}])}) == {}, "a daemon without queue_ns counted as zero"
    assert common.server_seconds({}, after) is None, "no reading before: no server share"


def test_call_breakdown_splits_a_call_into_cpu_and_waiting():
    import time
    result, b = common.call_breakdown(lambda: time.sleep(0.2) or 7)
    assert result == 7
    assert b["transfer_s"] >= 0.15 and b["process_s"] < 0.05, f"a sleep is waiting, not processing: {b}"
    assert b["process_s"] + b["transfer_s"] == pytest.approx(b["seconds"])


def test_slowest_call_reports_the_slowest_ranks_breakdown():
    class Ctx:   # two ranks: this one (a short sleep) and another whose call took 9 s, 1 of them CPU
        def exchange(self, key, value):
            assert key == "bench/x/0/s"
            return [value, [9.0, 1.0, 8.0]]

    import time
    result, seconds, split = common.slowest_call(Ctx(), "bench/x/0/s", lambda: time.sleep(0.01) or "out")
    assert (result, seconds, split) == ("out", 9.0, {"process_s": 1.0, "transfer_s": 8.0}), \
        "the row's time and breakdown must be the slowest rank's, the result this rank's own"


def test_line_rate_from_cpu_costs():
    """bench_switchml's fast-network view: 3.2 CPU ns per float32 element is 10 Gbit/s per core; a
    switch at 0.8 ns per element per contribution serves 40 Gbit/s of contributions, 10 per worker
    at 4 workers, so 25 Gbit/s per worker takes 2.5 worker cores and 2.5 switch cores."""
    from benchmarks import bench_switchml
    fast = bench_switchml.line_rate(3.2, 0.8, 4)
    assert fast["worker_core_gbps"] == pytest.approx(10.0) and fast["switch_core_gbps"] == pytest.approx(40.0)
    assert fast["switch_core_gbps_per_worker"] == pytest.approx(10.0)
    assert fast["cores"]["25"] == pytest.approx({"worker": 2.5, "switch": 2.5})
    assert fast["cores"]["100"] == pytest.approx({"worker": 10.0, "switch": 10.0})
