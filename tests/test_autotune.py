"""commlib.autotune: the tuner's search on a fake clock, and a job whose fusion threshold and cycle
time change under it (every result exact, the trials logged)."""
import csv
import types

import pytest

from commlib import autotune
from launch import spawn


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def settings(**values):
    return types.SimpleNamespace(**{"fusion_threshold": 64 << 20, "cycle_time_ms": 1.0, "hotcold_share": 0.5,
                                    "hotcold_every": 20, "hotcold_k": 0, "hotcold_rule": "share", **values})


def test_tuner_keeps_the_fastest_of_each_knob_and_logs_every_sample(tmp_path):
    clock, path = Clock(), tmp_path / "trials.csv"
    tuner = autotune.Tuner(settings(), sample_s=1.0, log_path=str(path), clock=clock)
    tuner.ran("ring")
    # bytes per second by candidate: 16 MiB and 2.5 ms are the fastest
    speed = lambda t: (10 if t.fusion == 16 << 20 else 5) * (3 if t.cycle_ms == 2.5 else 1)
    seen = []
    while not tuner.done:
        seen.append((tuner.fusion, tuner.cycle_ms))
        clock.now += 1.0
        tuner.released(speed(tuner))
        assert clock.now < 1000, "the search never ended"
    assert (tuner.fusion, tuner.cycle_ms) == (16 << 20, 2.5)
    tried = {f for f, _ in seen}, {c for _, c in seen}
    assert tried == (set(autotune.GRIDS["fusion_threshold"]), set(autotune.GRIDS["cycle_time_ms"])), tried
    rows = list(csv.DictReader(path.open()))
    candidates = len(autotune.GRIDS["fusion_threshold"]) + len(autotune.GRIDS["cycle_time_ms"])
    assert len(rows) == candidates * autotune.SAMPLES + 1, rows[-3:]
    assert rows[-1]["knob"] == "chosen" and rows[-1]["fusion_threshold"] == str(16 << 20), rows[-1]
    assert tuner.released(10**9) is False, "a finished tuner changes nothing"


def test_tuner_tunes_the_knobs_of_the_algorithms_the_job_ran_each_after_the_core():
    clock = Clock()
    tuner = autotune.Tuner(settings(), sample_s=1.0, clock=clock)
    tuner.ran("switchml")
    tuner.ran("hotcold")
    fastest = {"switch_inflight_share": 0.25, "hotcold_share": 0.75, "hotcold_every": 10}
    speed = lambda t: 1 + sum(t.values[k] == v for k, v in fastest.items())
    order = []
    while not tuner.done:
        knob = tuner._plan[0][0]
        if not order or order[-1] != knob:
            order.append(knob)
        clock.now += 1.0
        tuner.released(speed(tuner))
        assert clock.now < 1000, "the search never ended"
    assert order == ["fusion_threshold", "cycle_time_ms", "switch_inflight_share", "hotcold_share", "hotcold_every"], \
        order
    assert {k: tuner.values[k] for k in fastest} == fastest
    assert tuner.values["omnireduce_block_share"] == 1.0, "omnireduce never ran: its block stays"


@pytest.mark.multiprocess
def test_a_job_under_autotune_stays_exact_on_every_rank(tmp_path):
    path = tmp_path / "trials.csv"
    results = spawn(2, "autotune.py", timeout=120, env={
        "COMMLIB_AUTOTUNE": "1", "COMMLIB_AUTOTUNE_SAMPLE_S": "0.1", "COMMLIB_AUTOTUNE_LOG": str(path),
        "COMMLIB_POLICY": "*=ring"}).check().results()
    for result in results:
        assert result["wrong"] == 0, result
    assert results[0]["fused"] == results[1]["fused"], "the ranks fused differently"
    assert len(results[0]["fused"]) > 1, f"the threshold never changed the buckets: {results[0]}"
    rows = list(csv.DictReader(path.open()))
    assert rows and rows[-1]["knob"] == "chosen", f"the search did not finish in the job: {rows[-3:]}"


@pytest.mark.multiprocess
def test_switchml_and_omnireduce_stay_exact_while_autotune_changes_their_window_and_block(tmp_path):
    """Every rank takes the new packets in flight and block size before the same tensor: a rank on
    another would put packets in other slots, or blocks of another size, and the sums would be wrong."""
    path = tmp_path / "trials.csv"
    results = spawn(2, "autotune.py", timeout=150, env={
        "COMMLIB_AUTOTUNE": "1", "COMMLIB_AUTOTUNE_SAMPLE_S": "0.1", "COMMLIB_AUTOTUNE_LOG": str(path),
        "COMMLIB_POLICY": "t1*=omnireduce;*=switchml", "AUTOTUNE_TEST_S": "12"}).check().results()
    for result in results:
        assert result["wrong"] == 0, result
    rows = list(csv.DictReader(path.open()))
    knobs = ("switch_inflight_share", "omnireduce_block_share")
    tried = {(row["knob"], row[row["knob"]]) for row in rows if row["knob"] in knobs}
    assert tried == {(knob, str(v)) for knob in knobs for v in autotune.GRIDS[knob]}, sorted(tried)
    assert rows[-1]["knob"] == "chosen", f"the search did not finish in the job: {rows[-3:]}"
