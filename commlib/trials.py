"""Trials: `auto` measures what the traffic model only estimates.

For each group of tensors `auto` decides together (the payload kind, its candidates, the size band,
for row-sparse tensors the band of the densest rank's row density, for dense ones the dtype), the
candidates that the model ranks within `auto_trial_margin` of the best are tried in turn, a block of
rounds each: a round is every release of the group until a name comes again (a training step's
tensors of that group), and all of them run the round's candidate, so they fuse as they will once
one is kept. A candidate's rounds run back to back, the first a warm-up: it also takes what the
candidate before left behind (a sparse allgather right after omnireduce's rounds took 6.2 ms, after
another allgather's 4.5-5.1, 4 ranks on loopback; rounds in turn, one each, measured that in two of
its three samples and kept a slower candidate). The controller (rank 0's settle, `Trials.choose`)
picks each round's candidate, so every rank runs the same candidate on the same step by
construction. Dense tensors' candidates are the dense carriers that run and take the tensor
(switchml, the ring), ranked by Backend.dense_traffic; a block-sparse one goes to the sparse carrier
by its density bound, untried.

A release under trial carries an id; every rank measures its run and reports (id, seconds) in the
metadata it submits next for that name (`Reports`). A run's seconds are the tensor's share by bytes
of its bucket's time (a row-sparse tensor travels alone: the whole), so a tensor costs alike fused
or alone. Rank 0 ranks the candidates by the quickest rank's time: a collective ends alike on every
rank, so that is the time from the last rank's arrival to the end, what the candidate adds to a
step; the other ranks' times also hold their wait for the last one, the same whichever candidate
runs (with the slowest rank's, 8 tensors of 4 MiB on loopback kept switchml over a ring twice as
fast). Once every candidate was measured in `auto_trial_samples` rounds (after one warm-up round
each) the fastest is kept, by what a round costs: the sum of its tensors' typical times (each
tensor's run is its share of its bucket, and each candidate fuses the group differently; typical:
the lower quartile of its samples, see `typical`); a candidate already `auto_trial_drop` times the
best one's in the quickest of two or more rounds is tried no more (a candidate ten times slower costs
a step per round it runs; one stalled round is no measure). The kept one's releases carry a round's
time by its slowest rank (None: never measured), and a rank reports again after `auto_revisit` runs,
or when five runs in a row took `auto_drift` times longer than the tensor's own first five runs
under it: the group's candidates (the model's when it formed) are then tried anew, less those
measured `auto_trial_margin` times slower than the kept one now runs (they sit that round out). A
round ends at ROUND_NAMES names too (made-up names never come again). A settled release no longer
depends on the controller's state, so the response cache may keep it; the model needs no sketches of
a row-sparse tensor under a kept choice, so the ranks send its counts only (Dispatcher._row_stats).
"""
import logging
import math
import statistics

from commlib import recent
from commlib.settings import define

define("auto_trial_margin", 4.0, "policy 'auto': candidates the traffic model ranks within this factor of the "
       "best are tried on early steps and the fastest measured is kept")
define("auto_trial_samples", 5, "policy 'auto': measured rounds (steps) per candidate (after one warm-up round) "
       "before the fastest is kept; 0: no trials, the traffic model (dense: the first dense carrier) decides")
define("auto_trial_drop", 2.0, "policy 'auto': a candidate whose quickest of two or more rounds measured this "
       "many times slower than the best so far is tried no more (0: every candidate runs all its rounds)")
define("auto_revisit", 500, "policy 'auto': runs of a tensor after which its group's candidates are tried again")
define("auto_drift", 1.5, "policy 'auto': five runs of a tensor in a row this many times slower than its "
       "first five under the kept candidate try the candidates again")

WARMUP = 1   # rounds of each candidate not counted: first calls set up state (buffers, hot sets)
SLOW_RUNS = 5   # in a row: a shared machine's stalls last a step or two
SLACK_S = 0.005   # a slow run is also this much slower: small tensors' times vary by milliseconds with the load
ROUND_NAMES = 4096   # a round's names at most (a new name every step would never end one)
NAMES_KEPT = 65536   # names a rank keeps reports and runs of (commlib.recent)
MOST = 1e9   # a report's seconds or slowdown above this are not a run's

log = logging.getLogger("commlib")


class Trials:
    """Rank 0's record of every group's candidates, their measured times and the choice."""

    def __init__(self, margin, samples, revisit, drop=0.0):
        self.margin, self.samples, self.revisit, self.drop = margin, samples, revisit, drop
        self._groups = {}
        # group -> (its number in Release.auto, the candidates the model ranked within the margin when it
        # formed): the same across its revisits
        self._formed = {}
        self._ids = 0
        self._issued = {}   # trial id -> the group that issued it, until reported (its tensor may move)

    @classmethod
    def of(cls, settings):
        return cls(settings.auto_trial_margin, settings.auto_trial_samples, settings.auto_revisit,
                   settings.auto_trial_drop)

    def kept(self, group, reports, name=None):
        """Take every rank's report of its last run of tensor `name` of `group` (None where it has none).
        (algorithm, what commlib.records() shows of it) where the group's measured choice stands;
        else None, and `choose` picks with the model's ranking (the model runs only then). A choice is
        made only where a round begins, so that every tensor of a round runs one candidate."""
        sent, malformed = [], []
        for report in reports:
            if report:
                (sent if well_formed(report) else malformed).append(report)
        if malformed:
            log.warning("commlib auto: a rank's report of its run of %r is malformed (%.200r); that run is not "
                        "counted", name, malformed[0])
        trial = sent[0].get("trial") if sent else None
        if trial is not None:   # heard by the group that issued it: a tensor whose density band moved sends
            issuer = self._groups.get(self._issued.pop(trial, None))   # it with a release of another
            if issuer is not None:
                self._heard(issuer, trial, sent, len(reports))
        state = self._groups.get(group)
        if state is None:
            return None
        state.checked = self._checked(state, sent) if trial is None else None
        if state.checked is not None:
            return None
        if state.choice is None:
            if not (state.begins(name) and state.decide(self.samples)):
                return None
            self._close(state)
        return state.choice, state.shown(self.revisit)

    def choose(self, group, ranked, name=None):
        """(algorithm, what commlib.records() shows of it) for a release of tensor `name` that `kept` left
        open: `ranked` the candidates best first as the model ranks them, [(algorithm, cost)] (cost None:
        not weighed, the ranks sent no sketches). The candidate of the group's round (a new round when
        `name` comes again, or is None), the group formed anew when it is new or was checked."""
        state = self._groups.get(group)
        if state is None or state.checked is not None:
            if state is None:   # new: the candidates the model ranks within the margin of the best
                best = ranked[0][1]
                weighed = self.samples > 0 and best is not None
                pool = [a for a, cost in ranked if cost <= best * self.margin] if weighed else []
                if len(pool) < 2:   # nothing to try (or not weighed): the model decides, release by release
                    return ranked[0][0], None
                number, candidates = self._formed[group] = len(self._formed), pool
            else:   # a revisit: what measured `margin` times slower than the kept one now runs sits it out
                (number, pool), measured = self._formed[group], state.round_times()
                kept = measured.get(state.choice)   # a round's time; `checked`: how much slower it runs now
                bound = None if kept is None else kept * max(1.0, state.checked) * self.margin
                candidates = [a for a in pool if a == state.choice or bound is None or measured.get(a, 0.0) <= bound]
            state = self._groups[group] = _Group(candidates, number, restart=state is not None)
        if state.begins(name):
            state.next_round(self.samples)
        state.named.add(name)
        algorithm = state.current
        self._ids += 1
        self._issued[self._ids] = group
        # the round it counts for (None: a warm-up round, not counted)
        state.pending[self._ids] = (algorithm, state.given[algorithm], name) if state.streak > WARMUP else None
        return algorithm, state.said({"trial": self._ids, "group": state.number, "candidates": state.candidates,
                                      "times": state.round_times()})

    def _close(self, state):
        """A group kept its choice: the reports its trials still wait for are not heard (some may never
        come: a tensor that appeared once)."""
        for trial in state.pending:
            self._issued.pop(trial, None)
        state.pending.clear()

    @staticmethod
    def _checked(state, sent):
        """A check of the kept choice (due, or drifted), which starts the trials anew: how many times its
        first runs the slowest rank's run took; None where no check of this group's choice came (a
        tensor may have left another group)."""
        checks = [r["slowdown"] for r in sent if "check" in r and r.get("group") == state.number]
        return max(checks) if checks and state.choice is not None else None

    def _heard(self, state, trial_id, sent, ranks):
        """A trial's times, kept only when every rank reported and measured it: the quickest and the
        slowest rank's (ranks: how many)."""
        trial = state.pending.pop(trial_id, None)   # None too for a warm-up round's
        if trial is None:
            return
        algorithm, round_, name = trial
        if len(sent) == ranks and all(r.get("trial") == trial_id and r["seconds"] is not None for r in sent):
            quickest = state.times[algorithm].setdefault(name, [])
            if len(quickest) < self.samples:   # the last candidate runs a round more while its reports come in:
                quickest.append(min(r["seconds"] for r in sent))   # counted, it could only lower its `typical`
                state.slowest[algorithm].setdefault(name, []).append(max(r["seconds"] for r in sent))
            state.measured.add((algorithm, round_))
            if self.drop:
                state.prune(self.drop, min(2, self.samples))
        if (algorithm, round_) in state.measured and not any(t and t[:2] == (algorithm, round_)
                                                             for t in state.pending.values()):
            state.heard[algorithm].add(round_)   # its last report: the round counts, whole


class _Group:
    def __init__(self, candidates, number, restart=False):
        self.candidates, self.number = candidates, number
        self.times = {a: {} for a in candidates}   # tensor -> the quickest rank's seconds per trial, after the warm-up
        self.slowest = {a: {} for a in candidates}   # the slowest rank's
        self.heard = {a: set() for a in candidates}   # the rounds those came from, every report of them in
        self.measured = set()   # (candidate, round) with a tensor measured
        self.given = dict.fromkeys(candidates, 0)  # rounds handed out
        self.current, self.named = None, set()     # the round's candidate, the names released in it
        self.streak = 0                            # its rounds in a row
        self.pending = {}                          # trial id -> (candidate, round, tensor) (None: warm-up), until reported
        self.choice = None   # (a revisit's one candidate too: measured anew; `expect` None: never measured,
        # and its tensors' drift goes unchecked)
        self.expect = None
        self.dropped = set()   # measured `drop` times slower than the best: no more rounds
        self.checked = None   # a check of the kept choice (how much slower it ran): formed anew at the next release
        self.restart = restart   # formed anew by a check, no release of it yet

    def shown(self, revisit):
        """The kept choice's Release.auto."""
        return {"choice": self.choice, "group": self.number, "candidates": self.candidates,
                "times": self.round_times(), "expect": self.expect, "revisit": revisit}

    def said(self, auto):
        """auto, and on the first release of a revisit "restart": rank 0's controller then drops the
        group's releases from its cache, so that all its tensors take part (ControllerServer._evict_auto)."""
        if self.restart:
            auto["restart"], self.restart = True, False
        return auto

    def round_times(self):
        """Each measured candidate's time for a round: the running ones' (_per_round), and a dropped one's
        sum over what it was measured on (a lower bound: it was dropped on part of a round, and compared
        on those tensors only, the running ones would be too)."""
        dropped = {a: _total(t) for a, t in self.times.items() if a in self.dropped and t}
        return {**dropped, **self._running_rounds(self.times)}

    def _running_rounds(self, times):
        """The running candidates' times for a round (_per_round) from `times`: the quickest or the slowest rank's."""
        return _per_round({a: times[a] for a in self.running()})

    def running(self):
        return [a for a in self.candidates if a not in self.dropped]

    def next_round(self, samples):
        """The next round's candidate: the current one until its block ends (its rounds measured or
        under way cover `samples`, or it had the rounds `decide` waits for at most), then the next
        that lacks samples, fewest rounds first, and its first round a warm-up (a report that never
        came is made up in a block of its own, after a warm-up too)."""
        def ended(a):
            rounds = set(self.heard[a])
            if a == self.current:   # and its block's rounds whose reports are still to come
                before = self.given[a] - self.streak
                rounds |= {trial[1] for trial in self.pending.values() if trial and trial[0] == a and trial[1] > before}
            return len(rounds) >= samples or self.spent(a, samples)

        running = self.running()
        if self.current not in running or ended(self.current):
            after = min(running, key=lambda a: (ended(a), self.given[a], self.candidates.index(a)))
            if not (ended(after) and self.current in running):   # every block ended: the current one goes on
                self.current, self.streak = after, 0               # (its rounds count) until `decide` keeps one
        self.streak += 1
        self.given[self.current] += 1
        self.named = set()

    def spent(self, a, samples):
        """Whether `a` had the rounds `decide` waits for at most (three times what its samples need)."""
        return self.given[a] >= 3 * (WARMUP + samples)

    def begins(self, name):
        """Whether a release of `name` begins the group's next round (it came again, or none is under way,
        or the round has ROUND_NAMES names: made-up names never come again, and the reports of their
        runs never come either, so that the group keeps its choice once its rounds are spent)."""
        return name is None or name in self.named or self.current is None or len(self.named) >= ROUND_NAMES

    def prune(self, drop, least):
        """Drop the running candidates measured `drop` times slower than the best running one measured on
        every tensor seen (never that one: some candidate always runs), each by the least of its samples
        of the tensors it has `least` of (a lower bound of its `typical`: one stalled round drops none).
        Measured on some of them, the sum is a lower bound of a round's time too (a ring 200 times slower
        goes at a tensor; compared on that tensor alone, switchml's weight against a ring's biases went)."""
        # the tensors some candidate has `least` samples of (one measured once under all would leave no best)
        seen = {name for per_name in self.times.values() for name, samples in per_name.items() if len(samples) >= least}
        whole = [a for a in self.running() if all(len(self.times[a].get(name, ())) >= least for name in seen)]
        if seen and whole:
            best = min(whole, key=lambda a: _total(self.times[a]))
            limit = drop * _total(self.times[best])
            for a in self.running():
                bound = [min(samples) for samples in self.times[a].values() if len(samples) >= least]
                if a != best and bound and sum(bound) > limit:
                    self.dropped.add(a)

    def decide(self, samples):
        """Keep the fastest running candidate once each was measured in `samples` whole rounds (or, when
        reports go missing, after three times the rounds that needed; none measured on a tensor all
        were: the model's best)."""
        running = self.running()
        if not all(len(self.heard[a]) >= samples or self.spent(a, samples) for a in running):
            return False
        rounds = self._running_rounds(self.times)
        self.choice = min(rounds, key=rounds.get) if rounds else running[0]
        self.expect = self._running_rounds(self.slowest).get(self.choice)
        return True


def _per_round(times):
    """Each measured candidate's time for a round of the group: the sum of its tensors' typical times, over
    the tensors measured under every measured candidate (a tensor of every other step may miss a
    block). A tensor's time is its share of its bucket's, so it depends on what it fused with: one
    median of all the shares mixed compared a ring's 4-byte biases with switchml's 8 KiB weight
    (bench_training's head: the ring kept at 0.16 ms against 0.60, 0.68x the fixed choice)."""
    measured = {a: per_name for a, per_name in times.items() if per_name}
    common = set.intersection(*(set(per_name) for per_name in measured.values())) if measured else set()
    return {a: _total(per_name, common) for a, per_name in measured.items() if common}


def _total(per_name, names=None):
    """One candidate's time for these tensors (default: all it was measured on): their typical times, summed."""
    return sum(typical(per_name[name]) for name in (per_name if names is None else names))


def typical(samples):
    """A tensor's time under a candidate from its trial runs: their lower quartile (the median of three,
    the second least of five). A trial step is negotiated in full, beside the buckets being timed: at 2
    ranks on 2 cores about 45% of trial rounds ran 2-10x their candidate's usual time, and the median of
    three kept the slower candidate in about one run of four (bench_overhead, 2 x 400 tensors). The least
    would keep a candidate that was fast once and then slow for good; the second least of five needs two
    quiet runs and is not fooled by one fast one (of two samples: the least)."""
    ordered = sorted(samples)
    return ordered[(len(ordered) + 1) // 4]


def well_formed(report):
    """Whether a report holds what Reports writes: it came from another rank (a string or 10**400 for
    seconds stopped the controller's handling, a NaN would win every comparison)."""
    if type(report) is not dict:
        return False
    if "trial" in report:
        seconds = report.get("seconds")
        return "check" not in report and type(report["trial"]) is int and (seconds is None or _number(seconds))
    return "check" in report and type(report.get("group")) is int and _number(report.get("seconds")) \
        and _number(report.get("slowdown"))


def _number(value):
    return type(value) in (int, float) and 0 <= value <= MOST   # (NaN fails the comparison)


class Reports:
    """A rank's side: what it measured of the releases `auto` asked about, for the metadata it
    submits next under the same name (the executor writes, the caller's thread takes: a pop, and
    recent.put, which is safe beside it)."""

    def __init__(self, drift):
        self.drift = drift
        self._ready = {}   # name -> report for its next submission
        self._kept = {}    # name -> _Kept: its runs under the choice its group keeps, since its last check

    def ran(self, name, auto, seconds):
        """This rank ran a release of `name` whose `auto` (Release.auto) was given, in `seconds` (None:
        not a measure of its algorithm, which still learns the tensor: Backend.learning)."""
        if "revisit" not in (auto or ()):   # a trial's run, or no choice kept (None: the model's): nothing to check
            self._kept.pop(name, None)
            if "trial" in (auto or ()):
                recent.put(self._ready, name, {"trial": auto["trial"], "seconds": seconds}, NAMES_KEPT)
            return
        kept = self._kept.get(name)
        if kept is None:
            kept = _Kept()
        recent.put(self._kept, name, kept, NAMES_KEPT)   # as the newest: a name that runs every step stays
        if kept.auto is auto:   # its last run's release again (the response cache's, every step): the same
            kept.streak += 1    # group and choice, its first runs under them in
            kept.runs += 1
            kept.slow = kept.slow + 1 if seconds > kept.limit else 0
        else:
            self._measure(kept, auto, seconds)
        if kept.runs >= auto["revisit"] or kept.slow >= SLOW_RUNS:   # checked by the group it ran in
            self._ready[name] = {"check": kept.runs, "seconds": seconds, "group": auto["group"],
                                 "slowdown": seconds / kept.usual if kept.usual > 0 else 1.0}
            del self._kept[name]

    def _measure(self, kept, auto, seconds):
        """A run under another release than the last one's, or before its first runs under it are all in:
        counted, and slow or not against the tensor's own first runs under this group's choice. The
        group's measured time is a round's, of all its tensors, and a tensor's share of a bucket depends
        on what it fused with (a 256-byte tensor that the cache releases alone takes a whole bucket's
        time: bench_training's head was tried anew in the timed window, 0.73x the fixed choice); never
        measured: no check."""
        kept.streak = kept.streak + 1 if kept.group == auto["group"] else 1
        kept.group, kept.choice = auto["group"], auto["choice"]
        kept.runs += 1
        key = auto["group"], auto["choice"]
        first, usual = kept.first.get(key, ((), None))
        if len(first) < SLOW_RUNS:   # their median is fixed once they are in (not computed at every run)
            first += (seconds,)
            usual = statistics.median(first)
            kept.first[key] = first, usual
        kept.usual = usual
        kept.limit = self.drift * usual + SLACK_S if auto["expect"] is not None else math.inf
        kept.slow = kept.slow + 1 if len(first) == SLOW_RUNS and seconds > kept.limit else 0
        kept.auto = auto if len(first) == SLOW_RUNS else None   # the next run of this release: the quick way

    def settled(self, name):
        """The choice the last two runs of `name` ran under, which its group keeps, no check of it due
        (else None): the model then needs no sketches of it. Two: a tensor whose density moves between
        two bands step by step keeps sending them, so that its other group can form."""
        kept = self._kept.get(name)
        return kept.choice if kept is not None and kept.streak >= 2 else None

    def take(self, name):
        return self._ready.pop(name, None)

    def waiting(self, name):
        """Whether a report waits for the next submission of `name`."""
        return name in self._ready


class _Kept:
    """A name's runs under the choices its groups keep: in all since its last check, slow in a row, its
    last one's group and choice with the runs of that group in a row, and per (group, choice) the
    seconds of its first runs with their median (a tensor whose density moves between two bands has two)."""

    __slots__ = ("runs", "slow", "group", "choice", "streak", "first", "auto", "usual", "limit")

    def __init__(self):
        self.runs = self.slow = self.streak = 0
        self.group = self.choice = None
        self.first = {}
        self.auto = None    # the release its last run came with, once its first runs under it are in
        self.usual = None   # the median of those first runs, and the time above which a run is slow
        self.limit = math.inf
