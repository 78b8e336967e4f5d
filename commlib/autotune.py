"""Autotune (Horovod's HOROVOD_AUTOTUNE): the core's and the algorithms' knobs tuned on the running
job, off by default (`COMMLIB_AUTOTUNE=1`).

Rank 0's controller owns the one `Tuner`: it releases every tensor, so it scores each candidate by
the bytes it released per second (in the steady state, the job's throughput), and the values it
picks travel with its `go` messages, so every rank runs each batch with the same ones (the fusion
threshold, and each algorithm's knobs: `Backend.tune`). The search is a coordinate search over a
grid, as Horovod's first pass does before its Bayesian optimization: the fusion threshold with the
configured cycle time, then the cycle time with the best threshold, then the knobs of each algorithm
the job ran by then (switchml's window in flight, omnireduce's block, hot/cold's share and window),
each with the best of those before. Each candidate runs a warm-up sample (not scored) and `SAMPLES`
scored ones of `autotune_sample_s` each; its score is their median. The trials go to `autotune_log`
(CSV: one row per scored sample, then the choice) and to the log. Once done, the best values stay.
"""
import csv
import logging
import statistics
import time

from commlib.settings import define

log = logging.getLogger("commlib")

define("autotune", False, "tune the fusion threshold, the cycle time and the algorithms' knobs on the running job "
       "(Horovod's HOROVOD_AUTOTUNE); rank 0 scores each candidate by the bytes released per second")
define("autotune_log", "", "CSV file where rank 0 writes autotune's trials (Horovod's HOROVOD_AUTOTUNE_LOG)")
define("autotune_sample_s", 2.0, "seconds of releases per autotune sample; each candidate has a warm-up and "
       "3 scored samples")

SAMPLES = 3
# each knob's grid, in the order they are tuned
GRIDS = {
    "fusion_threshold": tuple(mib << 20 for mib in (1, 4, 16, 64, 128)),   # bytes
    "cycle_time_ms": (0.5, 1.0, 2.5, 5.0, 10.0),
    "switch_inflight_share": (0.125, 0.25, 0.5, 1.0),   # of each stream's slots (its window), in flight
    "omnireduce_block_share": (0.25, 0.5, 1.0),         # of the job's block size, for dense tensors
    "hotcold_share": (0.25, 0.5, 0.75, 0.9),            # of the updates the hot rows carry (their K)
    "hotcold_every": (5, 10, 20, 40),                   # the counting window, in calls
}
CORE = ("fusion_threshold", "cycle_time_ms")
# the algorithm of each other knob: tuned once the job ran it
ALGORITHM = {"switch_inflight_share": "switchml", "omnireduce_block_share": "omnireduce", "hotcold_share": "hotcold",
             "hotcold_every": "hotcold"}


class Tuner:
    """Proposes values of every knob (`values`) and scores them by released bytes per second.
    `settings`: the job's, the values to start from. `clock` is for tests."""

    def __init__(self, settings, sample_s, log_path="", clock=time.monotonic):
        self.values = {"fusion_threshold": int(settings.fusion_threshold),
                       "cycle_time_ms": float(settings.cycle_time_ms), "switch_inflight_share": 1.0,
                       "omnireduce_block_share": 1.0, "hotcold_share": float(settings.hotcold_share),
                       "hotcold_every": int(settings.hotcold_every)}
        self.sample_s, self.clock = sample_s, clock
        self.done = False
        self._plan = [(knob, value) for knob in CORE for value in GRIDS[knob]]
        self._planned = set(CORE)
        if settings.hotcold_k or settings.hotcold_rule != "share":   # the share does not choose K then
            self._planned.add("hotcold_share")
        self._best = {}   # knob: (score, value)
        self._ran = set()   # the algorithms the job released, whose knobs join the plan
        self._scores = []
        self._bytes = 0
        self._sample = -1   # -1: the candidate's warm-up
        self._writer = self._file = None
        if log_path:
            self._file = open(log_path, "w", newline="")
            self._writer = csv.writer(self._file)
            self._writer.writerow(["knob", *GRIDS, "sample", "bytes_per_s"])
        self._start = clock()
        self._try_next()

    @property
    def fusion(self):
        return self.values["fusion_threshold"]

    @property
    def cycle_ms(self):
        return self.values["cycle_time_ms"]

    def ran(self, algorithm):
        """The job released a tensor to `algorithm`: its knobs are tuned after those planned."""
        self._ran.add(algorithm)

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
        knob, value = self._plan[0]
        self._scores.append(rate)
        self._row(knob, self._sample, rate)
        if self._sample < SAMPLES:
            return False
        score = statistics.median(self._scores)
        if knob not in self._best or score > self._best[knob][0]:
            self._best[knob] = (score, value)
        self._plan.pop(0)
        self._scores, self._sample = [], -1
        if not self._plan:   # the knobs of the algorithms the job ran by now, not tuned yet
            for more in GRIDS:
                if more not in self._planned and ALGORITHM.get(more) in self._ran:
                    self._planned.add(more)
                    self._plan += [(more, v) for v in GRIDS[more]]
        if not self._plan or self._plan[0][0] != knob:   # this knob is done: its best value stays
            self.values[knob] = self._best[knob][1]
        if not self._plan:
            self._finish()
        else:
            self._try_next()
        return True

    def _try_next(self):
        knob, value = self._plan[0]
        self.values[knob] = value

    def _finish(self):
        self.done = True
        self._row("chosen", "", "")
        log.info("commlib autotune: chose %s", ", ".join(f"{knob}={self.values[knob]}" for knob in GRIDS
                                                          if knob in self._best))
        if self._file is not None:
            self._file.close()

    def _row(self, knob, sample, rate):
        if self._writer is not None:
            self._writer.writerow([knob, *self.values.values(), sample, rate if rate == "" else round(rate)])
            self._file.flush()
