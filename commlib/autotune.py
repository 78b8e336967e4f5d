"""Autotune (Horovod's HOROVOD_AUTOTUNE): the fusion threshold and the cycle time tuned on the
running job, off by default (`COMMLIB_AUTOTUNE=1`).

Rank 0's controller owns the one `Tuner`: it releases every tensor, so it scores each candidate by
the bytes it released per second (in the steady state, the job's throughput), and the values it
picks travel with its `go` messages, so every rank fuses each batch with the same threshold. The
search is a coordinate search over a grid, as Horovod's first pass does before its Bayesian
optimization: the fusion threshold with the configured cycle time, then the cycle time with the best
threshold. Each candidate runs a warm-up sample (not scored) and `SAMPLES` scored ones of
`autotune_sample_s` each; its score is their median. The trials go to `autotune_log` (CSV: one row
per scored sample, then the choice) and to the log. Once done, the best values stay.
"""
import csv
import logging
import statistics
import time

from commlib.settings import define

log = logging.getLogger("commlib")

define("autotune", False, "tune the fusion threshold and cycle time on the running job (Horovod's HOROVOD_AUTOTUNE); "
       "rank 0 scores each candidate by the bytes released per second")
define("autotune_log", "", "CSV file where rank 0 writes autotune's trials (Horovod's HOROVOD_AUTOTUNE_LOG)")
define("autotune_sample_s", 2.0, "seconds of releases per autotune sample; each candidate has a warm-up and "
       "3 scored samples")

FUSION_MIB = (1, 4, 16, 64, 128)
CYCLE_MS = (0.5, 1.0, 2.5, 5.0, 10.0)
SAMPLES = 3


class Tuner:
    """Proposes (fusion threshold bytes, cycle time ms) and scores them by released bytes per second.
    `clock` is for tests."""

    def __init__(self, fusion_threshold, cycle_time_ms, sample_s, log_path="", clock=time.monotonic):
        self.fusion, self.cycle_ms = int(fusion_threshold), float(cycle_time_ms)
        self.sample_s, self.clock = sample_s, clock
        self.done = False
        self._plan = [("fusion_threshold", mib << 20) for mib in FUSION_MIB] + [("cycle_time_ms", ms) for ms in CYCLE_MS]
        self._best = {"fusion_threshold": (None, self.fusion), "cycle_time_ms": (None, self.cycle_ms)}
        self._scores = []
        self._bytes = 0
        self._sample = -1   # -1: the candidate's warm-up
        self._writer = self._file = None
        if log_path:
            self._file = open(log_path, "w", newline="")
            self._writer = csv.writer(self._file)
            self._writer.writerow(["knob", "fusion_threshold", "cycle_time_ms", "sample", "bytes_per_s"])
        self._start = clock()
        self._apply(*self._plan[0])

    def released(self, nbytes):
        """Count a release's bytes; returns True when the values to use changed."""
        if self.done:
            return False
        self._bytes += nbytes
        now = self.clock()
        if now - self._start < self.sample_s:
            return False
        rate, self._bytes, self._start = self._bytes / (now - self._start), 0, now
        self._sample += 1
        if self._sample == 0:
            return False   # the warm-up: the candidate's first sample is not scored
        knob, _ = self._plan[0]
        self._scores.append(rate)
        self._row(knob, self._sample, rate)
        if self._sample < SAMPLES:
            return False
        score = statistics.median(self._scores)
        if self._best[knob][0] is None or score > self._best[knob][0]:
            self._best[knob] = (score, self.fusion if knob == "fusion_threshold" else self.cycle_ms)
        self._plan.pop(0)
        self._scores, self._sample = [], -1
        if self._plan and self._plan[0][0] != knob:   # the next knob: the best of this one stays
            self._apply(knob, self._best[knob][1])
        if not self._plan:
            self._finish()
        else:
            self._apply(*self._plan[0])
        return True

    def _apply(self, knob, value):
        if knob == "fusion_threshold":
            self.fusion = int(value)
        else:
            self.cycle_ms = float(value)

    def _finish(self):
        self.fusion, self.cycle_ms = self._best["fusion_threshold"][1], self._best["cycle_time_ms"][1]
        self.done = True
        self._row("chosen", "", "")
        log.info("commlib autotune: chose fusion_threshold=%d bytes, cycle_time_ms=%g", self.fusion, self.cycle_ms)
        if self._file is not None:
            self._file.close()

    def _row(self, knob, sample, rate):
        if self._writer is not None:
            self._writer.writerow([knob, self.fusion, self.cycle_ms, sample, rate if rate == "" else round(rate)])
            self._file.flush()
