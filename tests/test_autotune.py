"""commlib.autotune: the tuner's search on a fake clock, and a job whose fusion threshold and cycle
time change under it (every result exact, the trials logged)."""
import csv

import pytest

from commlib import autotune
from launch import spawn


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_tuner_keeps_the_fastest_of_each_knob_and_logs_every_sample(tmp_path):
    clock, path = Clock(), tmp_path / "trials.csv"
    tuner = autotune.Tuner(64 << 20, 1.0, sample_s=1.0, log_path=str(path), clock=clock)
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
    assert tried == ({m << 20 for m in autotune.FUSION_MIB}, set(autotune.CYCLE_MS) | {1.0}), tried
    rows = list(csv.DictReader(path.open()))
    candidates = len(autotune.FUSION_MIB) + len(autotune.CYCLE_MS)
    assert len(rows) == candidates * autotune.SAMPLES + 1, rows[-3:]
    assert rows[-1]["knob"] == "chosen" and rows[-1]["fusion_threshold"] == str(16 << 20), rows[-1]
    assert tuner.released(10**9) is False, "a finished tuner changes nothing"


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
