"""The timeline and its analysis: a real 2-rank job with the timeline on (ring, switchml, omnireduce,
PowerSGD, a fused bucket), its traces parsed back, merged and analysed."""
import json

import pytest

from commlib import analyze, timeline
from launch import spawn

pytestmark = pytest.mark.multiprocess
ALGORITHMS = {"dense.ring": "RING", "dense.switchml": "SWITCHML", "sparse": "OMNIREDUCE", "low.rank": "RING"}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("timeline")
    trace, window = out / "trace.{rank}.json", out / "window.{rank}.json"
    ranks = spawn(2, "traced.py", trace, window, timeout=180).check()
    paths = [str(trace).replace("{rank}", str(r)) for r in range(2)]
    return out, paths, [str(window).replace("{rank}", str(r)) for r in range(2)], ranks.results()


def spans_by_tensor(events):
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    out = {}
    for e in events:
        if e.get("ph") == "X":
            out.setdefault((e["pid"], names[(e["pid"], e["tid"])]), []).append(e)
    return out


def test_every_tensor_has_its_phases_in_order_without_overlap(job):
    _, paths, _, _ = job
    for rank, path in enumerate(paths):
        events = json.load(open(path))   # a finished trace is strict JSON
        by_tensor = spans_by_tensor(events)
        for tensor, phase in ALGORITHMS.items():
            spans = sorted(by_tensor[(rank, tensor)], key=lambda e: e["ts"])
            names = [e["name"] for e in spans]
            assert names.count("NEGOTIATE") == 3 and phase in names, (rank, tensor, names)
            for a, b in zip(spans, spans[1:]):   # ordered, non-overlapping (1 µs of float rounding)
                assert a["ts"] + a["dur"] <= b["ts"] + 1.0, (rank, tensor, a, b)
        low_rank = [e["name"] for e in by_tensor[(rank, "low.rank")]]
        assert low_rank[:6] == ["NEGOTIATE", "QUEUE", "COMPRESS", "RING", "COMPRESS", "RING"], low_rank
        assert low_rank[6] == "DECOMPRESS", low_rank   # PowerSGD: P's, then Q's, then decompress
        small = [e["name"] for e in by_tensor[(rank, "small.3")]]
        assert "FUSE" in small and "RESTORE" in small, small
        comm = [e for e in by_tensor[(rank, "dense.switchml")] if e["cat"] == "comm"]
        assert all(e["args"]["bytes"] == 4 << 16 and e["args"]["algorithm"] == "switchml" for e in comm), comm
        assert all(0 < e["args"]["busy_s"] * 1e6 <= e["dur"] + 1.0 for e in comm), comm   # quantizing, MACs


def test_records_phases_fit_in_what_the_caller_waited(job):
    """A tensor's negotiation, queue and run happen while its caller waits: on the caller's own
    clock (tests/workers/traced.py), its last call took at least their sum, and its run at least
    the worker's processing and the collectives it is made of."""
    _, _, _, results = job
    for result in results:
        assert set(result["waited"]) == set(result["records"]), (result["waited"], result["records"])
        for name, rec in result["records"].items():
            assert all(v >= 0 for v in rec.values() if isinstance(v, float)), (name, rec)
            phases = rec["negotiate_s"] + rec["queue_s"] + rec["run_s"]
            waited = result["waited"][name]
            assert phases <= waited, f"{name}: phases {phases:.6f}s > the caller's wait {waited:.6f}s: {rec}"
            assert rec["process_s"] <= rec["run_s"] and rec["transfer_s"] <= rec["run_s"], (name, rec)


def test_records_split_the_transfer_into_server_queue_processing_and_network(job):
    _, _, _, results = job
    for result in results:
        for name, rec in result["records"].items():
            split = [rec["server_queue_s"], rec["server_proc_s"], rec["network_s"]]
            if rec["algorithm"] == "ring":   # no server: nothing to split
                assert split == [None, None, None], (name, rec)
                continue
            assert rec["algorithm"] in ("switchml", "omnireduce"), (name, rec)
            assert all(v >= 0 for v in split) and rec["server_proc_s"] > 0, (name, rec)   # the results carried stamps
            # the server's share of a round, as the stamps tell it, cannot exceed the round
            server = rec["server_queue_s"] + rec["server_proc_s"]
            assert server <= rec["transfer_s"], f"{name}: the server's {server:.6f}s > the transfer's {rec['transfer_s']:.6f}s: {rec}"


def test_the_stamped_server_share_is_what_the_daemons_counted(job):
    """Every result piggybacks its round's queue and processing time; each worker gets every round's
    result, so its sums equal the switch's own per-job counters over the same packets: exactly for
    the queue when every packet the switch took was a contribution (else the retransmissions' queue
    is only in the counters), and at most the counters' processing (the result's MAC and send are
    not stamped: 60% of it in a 2-rank run here, no lower bound, as one preemption while a result
    is signed can put milliseconds into the counter alone). The aggregators count every packet
    (ACKs, control, duplicates) in theirs. A switch or aggregator that stopped stamping fails the
    `0 <` checks (and the worker's sums could not equal the switch's queue counter)."""
    _, _, _, results = job
    switch = next(r for r in results if r["rank"] == 0)["daemons"]["switch"]
    aggregators = next(r for r in results if r["rank"] == 0)["daemons"]["aggregators"]
    for result in results:
        sml, omr = result["stamped"]["switchml"], result["stamped"]["omnireduce"]
        assert sml["server_packets"] == switch["aggregated"] > 0, (sml, switch)
        if switch["pkts_recv"] == switch["aggregated"]:
            assert sml["server_queue_ns"] == switch["queue_ns"] > 0, (sml, switch)
        else:
            assert 0 < sml["server_queue_ns"] <= switch["queue_ns"], (sml, switch)
        assert 0 < sml["server_proc_ns"] <= switch["proc_ns"], (sml, switch)
        counted = {k: sum(a[k] for a in aggregators) for k in ("queue_ns", "proc_ns", "data_recv")}
        assert 0 < omr["server_packets"] <= counted["data_recv"], (omr, counted)
        assert 0 < omr["server_queue_ns"] <= counted["queue_ns"], (omr, counted)
        assert 0 < omr["server_proc_ns"] <= counted["proc_ns"], (omr, counted)


def test_rank_0_traces_the_switch_and_aggregator_counters_in_their_own_rows(job):
    _, paths, _, _ = job
    events = timeline.load(paths[0])
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    switch = [pid for pid, name in rows.items() if name.startswith("switch ")]
    assert len(switch) == 1, rows
    samples = [e["args"] for e in events if e.get("ph") == "C" and e["pid"] == switch[0]]
    assert samples and max(s["pkts_recv"] for s in samples) > 0, samples   # packets per second reached the switch
    aggregators = [pid for pid, name in rows.items() if name.startswith("aggregator ")]
    assert len(aggregators) == 2, rows   # colocated: one in each rank
    for pid in aggregators:
        samples = [e["args"] for e in events if e.get("ph") == "C" and e["pid"] == pid]
        assert samples and max(s["data_recv"] for s in samples) > 0, (rows[pid], samples)
    assert not any(e.get("name", "").startswith("switch ") for e in timeline.load(paths[1])), \
        "only rank 0 asks the switch"


def test_start_and_stop_timeline_trace_a_window(job):
    _, _, windows, _ = job
    for rank, path in enumerate(windows):
        tensors = {name for _, name in spans_by_tensor(timeline.load(path))}
        assert tensors == {"windowed"}, (rank, tensors)


def test_merge_and_analyze(job, capsys):
    out, paths, _, _ = job
    merged = out / "merged.json"
    assert timeline.main(["merge", str(merged), *paths]) == 0
    events = json.load(open(merged))["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, *range(timeline.DAEMON_ROWS, timeline.DAEMON_ROWS + 3)} and min(e["ts"] for e in events if "ts" in e) == 0
    found = analyze.rounds(events)
    assert {r.algorithm for r in found} == {"ring", "switchml", "omnireduce"}
    for r in found:
        assert all(v >= 0 for v in r.seconds.values()), r.seconds
    assert analyze.main([str(merged), "--out", str(out / "plots")]) == 0
    printed = capsys.readouterr().out
    for algorithm in ("ring", "switchml", "omnireduce"):
        assert f"\n{algorithm} " in printed, printed
    head = next(line for line in printed.splitlines() if line.startswith("algorithm"))
    for component in analyze.COMPONENTS:   # the study's five and the negotiation
        assert f"{component} p50/p99" in head, head
    for line in printed.splitlines():
        if line.startswith(("switchml ", "omnireduce ")):   # server columns filled in
            assert line.count(" / ") == len(analyze.COMPONENTS), line
        if line.startswith("ring "):                          # no server: '-' in its two columns
            assert line.count(" / ") == len(analyze.COMPONENTS) - 2, line
    served = [r for r in found if r.algorithm in ("switchml", "omnireduce")]
    assert served and all(r.server and r.seconds["server_proc"] > 0 for r in served)
    assert "switch 127.0.0.1:" in printed and "aggregated" in printed, printed
    for row, samples in analyze.daemon_samples(events).items():   # the switch's and aggregators' own share
        share = analyze.per_packet(samples)
        assert share["packets"] > 0 and share["queue_us"] >= 0 and share["proc_us"] > 0, (row, share)
    assert printed.count("its share of a packet's round") == 3, printed
    switch = next(samples for row, samples in analyze.daemon_samples(events).items() if row.startswith("switch "))
    ranks = analyze.server_concurrency(switch)   # 2 ranks: milliseconds with one or both
    assert ranks and set(ranks) <= {1, 2} and "ranks whose packets arrived in the same millisecond" in printed, \
        (ranks, printed)
    for png in ("latency_cdf.png", "breakdown.png", "concurrency.png"):
        assert (out / "plots" / png).stat().st_size > 1000, png


def test_server_concurrency_adds_up_the_switchs_counter_rates():
    def sample(ts_s, **rates):
        return {"ts": ts_s * 1e6, "args": rates}
    samples = [sample(0), sample(0.1, ms_ranks_1=20.0, ms_ranks_2=50.0, pkts_recv=9.0),
               sample(0.3, ms_ranks_2=100.0, ms_ranks_4=5.0)]
    assert analyze.server_concurrency(samples) == {1: 2, 2: 25, 4: 1}   # rate x interval, summed
    assert analyze.server_concurrency(samples[:1]) == {}


def test_analyze_reads_an_unfinished_trace_and_update_counts(tmp_path):
    trace = timeline.Timeline(str(tmp_path / "t.json"), 0)
    trace.counts("embedding", [5, 1, 9], [90, 5, 5])
    trace._file.flush()   # the job crashed here: no closing bracket
    events = timeline.load(str(tmp_path / "t.json"))
    counts = analyze.update_counts(events)
    assert counts["embedding"].tolist() == [90, 5, 5]
    assert analyze.skew_summary(events) == {"embedding": 0.9}


def test_one_setting_gives_the_study_of_a_job(tmp_path):
    """COMMLIB_STUDY=DIR alone: at shutdown rank 0 leaves the merged trace of both ranks, the breakdown
    table with the hot/cold tensor's update skew, and the plots."""
    study = tmp_path / "study"
    spawn(2, "sparse_hotcold.py", env={"COMMLIB_STUDY": str(study), "COMMLIB_HOTCOLD_EVERY": "3"}, timeout=180).check()
    events = json.load(open(study / "trace.json"))["traceEvents"]
    assert {0, 1} <= {e["pid"] for e in events}, "both ranks' rows in the merged trace"
    assert {r.algorithm for r in analyze.rounds(events)} >= {"hotcold"}
    breakdown = (study / "breakdown.txt").read_text()
    assert "\nhotcold " in breakdown and "embedding: the hottest 1% of rows take" in breakdown, breakdown
    assert "wrote their traces on their own hosts" not in breakdown, breakdown
    for png in ("latency_cdf.png", "breakdown.png", "concurrency.png", "update_skew.png"):
        assert (study / png).stat().st_size > 1000, png


def test_study_names_the_ranks_whose_traces_are_on_other_hosts(tmp_path):
    """Rank 0 analyzes what it can read and says which ranks' traces to copy in."""
    from types import SimpleNamespace
    from commlib import study
    timeline.Timeline(str(tmp_path / "trace.{rank}.json"), 0).close()   # rank 0 traced nothing
    where = [["host-a", (tmp_path / "trace.0.json").stat().st_size], ["host-b", 1234]]   # rank 1's file is on host-b
    ctx = SimpleNamespace(rank=0, size=2, settings=SimpleNamespace(study=str(tmp_path)),
                          exchange=lambda key, value: where)
    breakdown = open(study.report(study.gather(ctx))).read()
    assert "Ranks [1] wrote their traces on their own hosts (['host-b'])" in breakdown, breakdown
    assert "no tensor rounds in these traces" in breakdown, breakdown
