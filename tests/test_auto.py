"""`auto` measures (commlib.trials): the candidates the traffic model ranks within a margin of the best
are tried a block of steps each, the controller picks each release's, the time of the rank that
arrived last counts, the fastest is kept and tried again on drift; a settled choice, and a density's
side of its bounds, are cached by the controller."""
import numpy as np
import pytest

from commlib import analyze, timeline, trials as trials_module
from commlib.dispatch import TRAFFIC, settle, settle_release, side_of
from commlib.trials import SLACK_S, SLOW_RUNS, WARMUP, Reports, Trials
from launch import spawn

RANKED = [("allgather", 100), ("omnireduce", 150), ("hotcold", 390), ("switchml", 10_000)]


def release(trials, reports, group="g"):
    """What settle_release asks of the trials for one release."""
    return trials.kept(group, reports) or trials.choose(group, RANKED)


def run(trials, times, steps, ranks=2, group="g"):
    """Release `steps` times in a row, every rank reporting each trial as `times[rank](algorithm)`
    took; the (algorithm, auto) of each release."""
    out, reports = [], [None] * ranks
    for _ in range(steps):
        algorithm, auto = release(trials, reports, group)
        out.append((algorithm, auto))
        reports = [{"trial": auto["trial"], "seconds": times[r](algorithm)} if auto and "trial" in auto else None
                   for r in range(ranks)]
    return out


def test_candidates_within_the_margin_are_tried_a_block_each_model_first_and_the_fastest_by_the_quickest_rank_kept():
    trials = Trials(margin=4.0, samples=2, revisit=100)
    late_on_1 = {"allgather": 0.02, "omnireduce": 0.01, "hotcold": 0.03}   # rank 1 arrives last: its times count
    waits_on_0 = {"allgather": 0.09, "omnireduce": 0.15, "hotcold": 0.06}  # rank 0's hold its wait for rank 1 too
    got = run(trials, [waits_on_0.get, late_on_1.get], 12)
    tried = [a for a, auto in got if "trial" in auto]
    # each candidate's rounds back to back: its warm-up takes what the one before left behind
    assert tried == [a for a in ("allgather", "omnireduce", "hotcold") for _ in range(WARMUP + 2)], \
        f"the model's order, each once to warm up and twice measured, not switchml (outside the margin): {tried}"
    algorithm, auto = got[-1]
    assert algorithm == auto["choice"] == "omnireduce", f"the quickest rank's times decide: {auto}"
    assert auto["times"] == late_on_1 and auto["expect"] == 0.15, f"a rank's runs are checked by the slowest's: {auto}"


def test_a_candidate_measured_drop_times_slower_than_the_best_runs_no_more_rounds():
    trials = Trials(margin=4.0, samples=3, revisit=100, drop=2.0)
    times = {"allgather": 0.01, "omnireduce": 0.1, "hotcold": 0.015}.get   # omnireduce 10x the best
    got = run(trials, [times, times], 14)
    tried = [a for a, auto in got if "trial" in auto]
    assert tried == ["allgather"] * 4 + ["omnireduce"] * 3 + ["hotcold"] * 4, \
        f"omnireduce warms up, is measured twice (one stalled round drops none) and sits the other rounds out: {tried}"
    assert got[-1][1]["choice"] == "allgather" and got[-1][1]["times"]["omnireduce"] == 0.1, got[-1]
    trials = Trials(margin=4.0, samples=3, revisit=100, drop=0.5)   # below 1: every other one drops
    got = run(trials, [times, times], 14)
    assert got[-1][1]["choice"] == "allgather", f"the best running candidate is never dropped: {got[-1]}"
    runs = {"allgather": [0.01, 0.01, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], "omnireduce": [0.03] * 8, "hotcold": [0.2] * 8}
    trials = Trials(margin=4.0, samples=3, revisit=100, drop=2.0)   # the best slows down after a dropped one's sample
    got = run(trials, [lambda a: runs[a].pop(0), lambda a: runs[a][0]], 14)
    assert got[-1][1]["choice"] == "omnireduce", f"a dropped candidate's time still counts: {got[-1]}"


def test_a_candidate_stalled_in_most_of_its_rounds_still_wins_and_one_fast_round_does_not():
    """A trial step is negotiated in full beside the buckets being timed: on a busy host most of a
    candidate's rounds may stall, and the median kept the slower one; the least would keep a candidate
    that was fast once (its rounds: warm-up first, then the measured ones)."""
    def kept(first, steady="omnireduce", stalled="allgather", drop=0.0):
        rounds, trials = {stalled: list(first), steady: [0.015] * 6, "hotcold": [0.5] * 7}, \
            Trials(margin=4.0, samples=5, revisit=100, drop=drop)
        run, choice = tried(trials, lambda a, n: rounds[a].pop(0))
        if not drop:
            assert len(run) == 3 * (WARMUP + 5), run
        return choice
    assert kept([0.01, 0.05, 0.01, 0.08, 0.01, 0.03]) == "allgather", "two quiet rounds of five show its time"
    assert kept([0.01, 0.01, 0.1, 0.1, 0.1, 0.1]) == "omnireduce", "one fast round of five does not"
    # tried second, its first measured round 3x the first candidate's: not dropped (auto_trial_drop) on it
    assert kept([0.01, 0.05, 0.01, 0.08, 0.01, 0.03], "allgather", "omnireduce", drop=2.0) == "omnireduce"
    assert kept([0.01, 0.05, 0.08, 0.01, 0.01, 0.01], "allgather", "omnireduce", drop=2.0) == "allgather", \
        "two stalled rounds in a row drop it"
    assert [trials_module.typical(s) for s in ([3.0], [2.0, 1.0], [3.0, 1.0, 2.0], [5.0, 4.0, 3.0, 2.0, 1.0])] \
        == [3.0, 1.0, 2.0, 2.0], "one, the least of two, the median of three, the second least of five"


def test_a_trial_not_every_rank_reported_is_not_counted():
    trials = Trials(margin=4.0, samples=1, revisit=100)
    _, auto = release(trials, [None, None])
    release(trials, [{"trial": auto["trial"], "seconds": 0.5}, None])
    assert trials._groups["g"].times["allgather"] == {}, "a rank's report alone is not the time of the rank that arrived last"


@pytest.mark.parametrize("bad", [{"seconds": "0.1"}, {"seconds": 10**400}, {"seconds": float("nan")},
                                 {"seconds": -1.0}, {"trial": [1]}, {"check": 3, "slowdown": "x"},
                                 {"check": 3, "slowdown": 10**400}, {"check": 3, "group": None}, ["not", "a", "dict"]])
def test_a_malformed_report_is_not_counted_and_raises_nothing(bad, caplog):
    """Reports come from the other ranks: what is not a run's (Reports.ran) is left out, as a lost one."""
    trials = Trials(margin=4.0, samples=1, revisit=100)
    times = {"allgather": 0.01, "omnireduce": 0.02, "hotcold": 0.03}.get
    _, auto = release(trials, [None, None])
    check = isinstance(bad, dict) and "check" in bad
    if check:   # a kept choice, and a check of it from one rank: malformed, it starts no trials
        run(trials, [times, times], 10)
        reports = [None, {"seconds": 0.5, "group": 0, "slowdown": 50.0, **bad}]
    else:
        report = {"trial": auto["trial"], "seconds": 0.5}
        reports = [report, {**report, **bad} if isinstance(bad, dict) else bad]
    _, auto = release(trials, reports)
    assert "malformed" in caplog.text, f"the controller says a report was left out: {caplog.text!r}"
    if check:
        assert "choice" in auto, f"a malformed check tries nothing anew: {auto}"
    else:
        assert not trials._groups["g"].times["allgather"], "a trial one rank's report of is malformed is not counted"
    assert run(trials, [times, times], 14)[-1][0] == "allgather", "the trials go on with well-formed reports"


def test_one_candidate_within_the_margin_or_no_samples_leave_it_to_the_model():
    assert release(Trials(margin=1.2, samples=3, revisit=100), [None]) == ("allgather", None)
    assert release(Trials(margin=4.0, samples=0, revisit=100), [None]) == ("allgather", None)


def test_a_check_of_the_kept_choice_tries_the_candidates_again():
    trials = Trials(margin=4.0, samples=1, revisit=100)
    times = {"allgather": 0.01, "omnireduce": 0.02, "hotcold": 0.03}.get
    assert run(trials, [times, times], 10)[-1][0] == "allgather"
    assert "choice" in release(trials, [{"check": 3, "seconds": 0.5, "group": 7, "slowdown": 50.0}, None])[1], \
        "a check of another group's choice (the tensor left it) is not this group's"
    algorithm, auto = release(trials, [{"check": 3, "seconds": 0.5, "group": 0, "slowdown": 50.0}, None])
    assert "trial" in auto and auto["times"] == {}, f"a drifted time starts the trials anew: {auto}"
    assert auto.get("restart") and not release(trials, [None, None])[1].get("restart"), \
        "the revisit's first release says so (the controller drops its group's releases from its cache), once"
    assert auto["group"] == 0 and release(trials, [None, None], group="h")[1]["group"] == 1, \
        "a group keeps its number across revisits; another has its own"
    slower = {"allgather": 0.5, "omnireduce": 0.02, "hotcold": 0.03}.get
    assert run(trials, [slower, slower], 10)[-1][0] == "omnireduce"


def test_a_revisit_leaves_out_what_measured_margin_times_slower_than_the_kept_choice_now_runs():
    trials = Trials(margin=4.0, samples=1, revisit=100)
    times = {"allgather": 0.01, "omnireduce": 0.2, "hotcold": 0.03}.get
    assert run(trials, [times, times], 10)[-1][0] == "allgather"
    _, auto = release(trials, [{"check": 100, "seconds": 0.012, "group": 0, "slowdown": 1.2}, None])
    assert auto["candidates"] == ["allgather", "hotcold"], f"omnireduce (0.2 s > 4 x 1.2 x 0.01 s) sits out: {auto}"
    run(trials, [times, times], 6)
    _, auto = release(trials, [{"check": 5, "seconds": 0.1, "group": 0, "slowdown": 10.0}, None])   # drifted: all retried
    assert auto["candidates"] == ["allgather", "omnireduce", "hotcold"], auto
    trials = Trials(margin=4.0, samples=1, revisit=100)
    times = {"allgather": 0.01, "omnireduce": 0.2, "hotcold": 0.3}.get
    run(trials, [times, times], 10)
    _, auto = release(trials, [{"check": 100, "seconds": 0.01, "group": 0, "slowdown": 1.0}, None])
    assert auto["candidates"] == ["allgather"] and "trial" in auto, \
        f"one candidate left: measured anew, for the time its drift is checked by: {auto}"
    assert run(trials, [times, times], WARMUP + 2)[-1][1] == {
        "choice": "allgather", "group": 0, "candidates": ["allgather"], "times": {"allgather": 0.01}, "expect": 0.01,
        "revisit": 100}


def test_a_rank_reports_each_trial_then_checks_the_kept_choice_on_drift_and_on_schedule():
    reports = Reports(drift=1.5)
    reports.ran("w", {"trial": 7, "candidates": ["a", "b"]}, 0.02)
    assert reports.take("w") == {"trial": 7, "seconds": 0.02} and reports.take("w") is None
    kept = {"choice": "a", "group": 0, "times": {"a": 0.1}, "expect": 0.1, "revisit": 50}
    slow = 1.5 * 0.1 + SLACK_S + 0.001
    for i in range(SLOW_RUNS + 2 * SLOW_RUNS):   # its first runs as measured, then slow runs not in a row: no check
        reports.ran("w", kept, 0.1 if i < SLOW_RUNS or i % 2 == 0 else slow)
    assert reports.take("w") is None
    for _ in range(SLOW_RUNS):
        reports.ran("w", kept, slow)
    assert reports.take("w") == {"check": 3 * SLOW_RUNS + SLOW_RUNS, "seconds": slow, "group": 0,
                                 "slowdown": pytest.approx(slow / 0.1)}, "checked, with how much slower than its first runs"
    for _ in range(50):
        reports.ran("w", kept, 0.1)
    assert reports.take("w") == {"check": 50, "seconds": 0.1, "group": 0, "slowdown": 1.0}, "revisited after `revisit` runs"


def simulate(trials, shares, steps, names=("w", "b1", "b2", "b3"), group_of=lambda name, step: "g"):
    """Release `names` each step, in order, each in its group; every rank (2) reports each trial run as
    taking shares[algorithm][name]. Per group, the step its choice was first kept (None: never)."""
    ranked = [(a, 1.0) for a in shares]
    reports, kept_at = {}, {}
    for step in range(steps):
        for name in names:
            group = group_of(name, step)
            algorithm, auto = trials.kept(group, reports.pop(name, [None, None]), name) or \
                trials.choose(group, ranked, name)
            if "trial" in auto:
                reports[name] = [{"trial": auto["trial"], "seconds": shares[algorithm][name]}] * 2
            elif "choice" in auto:
                kept_at.setdefault(group, step)
    return kept_at


def test_a_groups_candidates_are_compared_by_what_a_round_of_all_its_tensors_costs():
    """A tensor's time is its share of its bucket's, and each candidate fuses the group differently:
    the shares compare only summed over a round (one median of all of them mixed kept the ring for
    bench_training's head, where it cost 0.68x of switchml's step)."""
    shares = {"switchml": {"w": 0.004, "b1": 0.0001, "b2": 0.0001, "b3": 0.0001},   # 4.3 ms a round
              "ring": {"w": 0.002, "b1": 0.0005, "b2": 0.0005, "b3": 0.0005}}   # 3.5 ms; each bias 5x switchml's
    for samples, order in [(s, o) for s in (1, 3) for o in (["w", "b1", "b2", "b3"], ["b1", "b2", "b3", "w"])]:
        # and never weighed, nor dropped, on part of a round (its first tensors: switchml's weight against
        # the ring's biases kept the ring; the biases alone dropped it)
        trials = Trials(margin=4.0, samples=samples, revisit=100, drop=2.0)
        kept_at = simulate(trials, shares, 2 * (WARMUP + samples) + 2, names=order)
        group = trials._groups["g"]
        assert "g" in kept_at and group.choice == "ring" and \
            group.round_times() == pytest.approx({"switchml": 0.0043, "ring": 0.0035}), (samples, order, group.round_times())
        counted = {len(runs) for per_name in group.times.values() for runs in per_name.values()}
        assert counted == {samples}, f"the last candidate's round run while its reports came in counts none: {counted}"


def test_a_candidate_dropped_on_part_of_a_round_leaves_the_others_compared_on_whole_rounds():
    trials = Trials(margin=4.0, samples=3, revisit=100, drop=2.0)
    shares = {"A": {"w": 0.002, "b1": 0.0005, "b2": 0.0005, "b3": 0.0005},   # 3.5 ms a round
              "B": {"w": 0.0015, "b1": 0.001, "b2": 0.001, "b3": 0.001},     # 4.5 ms; its weight is A's less
              "C": {"w": 0.05, "b1": 0.001, "b2": 0.001, "b3": 0.001}}       # dropped at its weight's second run
    simulate(trials, shares, 20)
    group = trials._groups["g"]
    assert group.choice == "A" and group.round_times() == pytest.approx({"A": 0.0035, "B": 0.0045, "C": 0.053}), \
        (group.choice, group.round_times())


def test_a_tensor_that_moves_between_groups_reports_to_the_group_that_tried_it():
    """Its density band moves step by step: its reports come with a release settled in the other group;
    heard there, the trying group's rounds never counted whole (it decided at its cap, or never)."""
    trials = Trials(margin=4.0, samples=3, revisit=100, drop=0.0)
    shares = {"A": {"a": 0.0005, "b": 0.001, "u": 0.001}, "B": {"a": 0.001, "b": 0.001, "u": 0.001}}
    kept_at = simulate(trials, shares, 30, names=("a", "b", "u"),
                       group_of=lambda name, step: ("G2" if step % 2 else "G1") if name == "u" else "G1")
    assert kept_at["G1"] <= 2 * (WARMUP + 3) + 2 and trials._groups["G1"].choice == "A", (kept_at, trials._groups)


def test_a_group_whose_names_never_come_again_keeps_a_choice_and_what_it_holds_stays_bounded(monkeypatch):
    """A new name every step (name=f"loss.{step}"): a round ends at ROUND_NAMES names, no report ever
    comes, and once the candidates' rounds are spent the group keeps the model's best."""
    monkeypatch.setattr(trials_module, "ROUND_NAMES", 50)
    trials, most_pending = Trials(margin=4.0, samples=3, revisit=100), 0
    for step in range(3000):
        name = f"loss.{step}"
        algorithm, auto = trials.kept("g", [None, None], name) or trials.choose("g", RANKED, name)
        most_pending = max(most_pending, len(trials._groups["g"].pending))
    group = trials._groups["g"]
    assert algorithm == group.choice == "allgather" and "trial" not in auto, f"kept the model's best: {algorithm}, {auto}"
    assert len(group.named) <= 50 and not group.pending and not trials._issued, \
        f"names {len(group.named)}, trials waiting for a report {len(group.pending)}, issued {len(trials._issued)}"
    assert most_pending <= 3 * 3 * (WARMUP + 3) * 50, most_pending


def test_a_group_of_more_than_round_names_tensors_is_still_measured(monkeypatch):
    """A round ends at ROUND_NAMES names: a model of more same-sized tensors than that (an MoE's experts)
    still has its candidates measured on all of them, and keeps the fastest."""
    monkeypatch.setattr(trials_module, "ROUND_NAMES", 50)
    names = [f"expert.{i}" for i in range(120)]
    shares = {"A": dict.fromkeys(names, 0.01), "B": dict.fromkeys(names, 0.001)}   # the model's second, 10x faster
    trials = Trials(margin=4.0, samples=3, revisit=100)
    kept_at = simulate(trials, shares, 12, names=names)
    group = trials._groups["g"]
    assert "g" in kept_at and group.choice == "B", (kept_at, group.choice, group.round_times())


def test_a_ranks_reports_of_made_up_names_stay_bounded_and_a_tensor_of_every_step_keeps_its_schedule(monkeypatch):
    monkeypatch.setattr(trials_module, "NAMES_KEPT", 80)
    reports, checks = Reports(drift=1.5), []
    kept = {"choice": "a", "group": 0, "times": {"a": 0.1}, "expect": 0.1, "revisit": 50}
    for step in range(60):
        for i in range(30):   # 30 made-up names a step, each once (the kept names then turn over every 3 steps)
            reports.ran(f"loss.{step}.{i}", kept, 0.1)
            reports.ran(f"metric.{step}.{i}", {"trial": step, "candidates": ["a", "b"]}, 0.1)
        reports.ran("w", kept, 0.1)
        checks.append(reports.take("w"))
    assert len(reports._kept) <= 80 and len(reports._ready) <= 80, (len(reports._kept), len(reports._ready))
    assert [step for step, check in enumerate(checks) if check] == [49], \
        "the tensor of every step is checked after `revisit` runs, however many names came and went"


def test_a_revisit_after_a_check_quicker_than_the_first_runs_still_tries_the_kept_choice():
    trials = Trials(margin=4.0, samples=1, revisit=100)   # hotcold never measured (its runs all learning)
    assert run(trials, [{"allgather": 0.01, "omnireduce": 0.03}.get] * 2, 20)[-1][1]["choice"] == "allgather"
    _, auto = release(trials, [{"check": 100, "seconds": 0.002, "group": 0, "slowdown": 0.2}, None])
    assert auto["candidates"] == ["allgather", "omnireduce", "hotcold"], \
        f"a check 0.2x its first runs: what measured within the margin of the kept choice, and it: {auto}"


def test_a_tensor_whose_own_runs_cost_more_than_its_groups_time_drifts_only_from_its_own():
    """A group's time is a round's, of all its tensors; a tensor's runs are its shares of its buckets'
    time (alone in a bucket, the whole): its drift is checked against its own first runs."""
    reports = Reports(drift=1.5)
    kept = {"choice": "a", "group": 0, "times": {"a": 0.001}, "expect": 0.001, "revisit": 500}
    own = 0.004   # 1.5 x 1 ms + 5 ms slack < 7 ms < 1.5 x 4 ms + 5 ms
    for i in range(SLOW_RUNS + 2 * SLOW_RUNS):
        reports.ran("w", kept, own if i < SLOW_RUNS else 0.007)
    assert reports.take("w") is None, "7 ms runs checked against 1 ms, not the tensor's own 4 ms"
    for _ in range(SLOW_RUNS):
        reports.ran("w", kept, 1.5 * own + SLACK_S + 0.001)
    assert reports.take("w") is not None, "slow against its own first runs: checked"
    other = dict(kept, group=1)   # another group's choice: its first runs there anew
    for _ in range(SLOW_RUNS):
        reports.ran("v", kept, 0.1)
    for _ in range(SLOW_RUNS + SLOW_RUNS):
        reports.ran("v", other, 0.007)
    assert reports.take("v") is None, "a tensor that moved to another group measures its first runs there anew"
    for i in range(4 * SLOW_RUNS):   # its density moves between two bands step by step: each group's first runs
        reports.ran("u", kept if i % 2 else other, (0.004 if i % 2 else 0.001) * (1 if i < 2 * SLOW_RUNS else 10))
    assert reports.take("u") is not None, "a tensor alternating between two groups is still checked for drift"


def test_a_rank_submits_its_side_of_the_density_bounds_and_the_max_over_ranks_is_the_densest_ranks_choice():
    choices = [[0.05, "omnireduce"], [0.25, "hotcold"], [None, "ring"]]
    g = np.random.default_rng(0)
    for densities in g.random((200, 3)) * 0.4:
        sides = [side_of(choices, d) for d in densities]
        assert choices[max(sides)][1] == settle(choices, [max(densities)]), densities
    assert side_of(choices, 0.01) == side_of(choices, 0.04), "a density that moves within its side: the same meta"
    assert side_of(choices, None) == 2, "a rank that measured nothing counts as dense"
    metas = [{"choices": choices, "side": 0}, {"choices": choices, "side": 1}]
    assert settle_release("w", metas).algorithm == "hotcold"
    traffic = [[0.01, "ring"], [TRAFFIC, "sparse_allgather"]]
    assert side_of(traffic, 0.5) == 1, "above the density rules: the traffic model decides"



def tried(trials, seconds, lost=()):
    """Release until a choice is kept, both ranks reporting each trial as taking seconds(algorithm, its
    round's number from 1) (None: not measured), rank 1's report missing for the rounds in `lost`:
    ([(algorithm, counted)] per round, the kept algorithm)."""
    reports, rounds = [None, None], []
    while True:
        algorithm, auto = release(trials, reports)
        if "trial" not in auto:
            return rounds, algorithm
        rounds.append((algorithm, trials._groups["g"].pending[auto["trial"]] is not None))
        report = {"trial": auto["trial"], "seconds": seconds(algorithm, len(rounds))}
        reports = [report, None if len(rounds) in lost else report]


def test_a_run_of_a_backend_still_learning_the_tensor_is_not_counted_and_its_block_goes_on():
    rounds, _ = tried(Trials(margin=4.0, samples=2, revisit=100), lambda a, n: None if n <= 3 else 0.01)
    assert [a for a, _ in rounds] == ["allgather"] * 5 + ["omnireduce"] * 3 + ["hotcold"] * 3, \
        f"allgather's two runs still learning (Backend.learning) are made up in its block: {rounds}"
    rounds, kept = tried(Trials(margin=4.0, samples=2, revisit=100), lambda a, n: None if a == "hotcold" else 0.01)
    assert [a for a, _ in rounds] == ["allgather"] * 3 + ["omnireduce"] * 3 + ["hotcold"] * 3 * (WARMUP + 2), \
        f"a candidate never measured runs to the cap, the others no more: {rounds}"
    assert kept != "hotcold", kept


def test_a_rank_under_a_kept_choice_sends_counts_only_and_a_tensor_that_left_its_group_runs_it_once_more():
    reports = Reports(drift=1.5)
    kept = {"choice": "a", "group": 0, "times": {"a": 0.1}, "expect": 0.1, "revisit": 4}
    reports.ran("w", {"trial": 1}, 0.1)
    reports.ran("w", kept, 0.1)
    assert reports.settled("w") is None, "one kept run: the tensor may be moving between groups"
    reports.ran("w", kept, 0.1)
    assert reports.settled("w") == "a", "two kept runs of one group: counts only, and the choice"
    reports.ran("w", dict(kept, group=1), 0.1)
    assert reports.settled("w") is None, "another group's kept run: its first"
    reports.ran("w", kept, 0.1)
    reports.ran("w", kept, 0.1)
    reports.ran("w", None, 0.1)
    assert reports.settled("w") is None, "a release the model decided alone"
    for _ in range(4):
        reports.ran("w", kept, 0.1)
    assert reports.settled("w") is None and reports.waiting("w"), "a check is due: it goes with the sketches"
    choices = [[TRAFFIC, "sparse_allgather"], [TRAFFIC, "hotcold"]]
    counts = {"rows": 10, "nrows": 1000, "width": 4, "itemsize": 4, "kept": "hotcold"}
    metas = [{"choices": choices, "rows": counts}, {"choices": choices, "rows": counts}]
    release = settle_release("w", metas, Trials(margin=4.0, samples=2, revisit=100))
    reports = Reports(drift=1.5)
    for run_ in range(4):   # a tensor moving between two groups every step: never counts only, still checked
        reports.ran("x", dict(kept, group=run_ % 2), 0.1)
        assert reports.settled("x") is None, run_
    assert reports.take("x") == {"check": 4, "seconds": 0.1, "group": 1, "slowdown": 1.0}
    assert (release.algorithm, release.estimate, release.auto) == ("hotcold", None, None), \
        f"no sketches, no group yet: its kept choice once more, no trial until the model weighs them: {release}"


def test_a_lost_report_is_made_up_in_its_candidates_block_never_measured_right_after_another():
    # omnireduce's first measured round (the 5th): rank 1's report never comes
    rounds, _ = tried(Trials(margin=4.0, samples=2, revisit=100), lambda a, n: 0.01, lost={5})
    block = [False, True, True]   # measured?
    assert rounds == [("allgather", m) for m in block] + [("omnireduce", m) for m in block + [True]] + \
        [("hotcold", m) for m in block], f"omnireduce's lost sample is made up in its own block: {rounds}"


@pytest.mark.multiprocess
def test_trials_and_choices_are_the_same_on_every_rank_a_slow_candidate_loses_drift_is_retried_and_cached(tmp_path):
    """2 ranks, two row carriers registered from outside (tests/workers/auto_trials.py): the model's
    favourite sleeps and loses to the other, which keeps the choice until it turns slow at step FLIP;
    then both are tried again and the first one wins. 'b' (every other step) shares their group. A
    mostly-zero dense tensor under `auto` goes to omnireduce by its side of the density bound and,
    after its first step, rank 0's controller never sees its metadata again. The study's table
    (commlib.analyze, from rank 0's timeline) shows the candidates, their times and the choice."""
    trace = tmp_path / "trace.json"
    env = {"COMMLIB_AUTO_TRIAL_SAMPLES": "2", "COMMLIB_AUTO_DRIFT": "3", "COMMLIB_TIMELINE": trace}
    results = spawn(2, "auto_trials.py", timeout=300, env=env).check().results()
    steps, flip = results[0]["steps"], results[0]["flip"]
    for rank, result in enumerate(results[1:], 1):
        for i, (mine, theirs) in enumerate(zip(steps, result["steps"])):
            assert mine["records"] == theirs["records"], f"step {i}: rank 0 and rank {rank} differ"
    last = {}   # name -> its last release's auto
    for i, step in enumerate(steps):
        assert all(step["exact"].values()), f"step {i}: a result is not the sum: {step['exact']}"
        for name, record in step["records"].items():
            if name != "dense":
                auto = record["auto"]
                assert auto is not None, (i, name, record)
                trial, after_kept = "trial" in auto, "choice" in last.get(name, {})
                # under a kept choice a rank sends no sketches (unless a check is due): a trial right after it
                # may go without the model
                assert record["modelled"] <= trial and record["modelled"] >= (trial and not after_kept), \
                    f"step {i}: the model runs only for trials, for each but those right after a kept run: {record}"
                last[name] = auto
                assert set(record["auto"].get("candidates", ["toy_fast", "toy_slow"])) == {"toy_fast", "toy_slow"}, \
                    f"step {i}: only the toys are within the margin: {record}"

    def kept(i):
        return {name: r["auto"].get("choice") for name, r in steps[i]["records"].items() if name != "dense"}

    assert steps[0]["records"]["a"]["algorithm"] == "toy_slow", "the model's favourite is tried first"
    assert set(kept(flip - 1).values()) == {"toy_fast"}, f"before the flip the fast toy is kept: {steps[flip - 1]}"
    assert steps[flip - 1]["records"]["a"]["auto"]["times"]["toy_slow"] >= 0.05, steps[flip - 1]
    kept_at = next(i for i in range(flip) if "choice" in steps[i]["records"]["a"]["auto"])
    sketched = [s["sketched"].get("a", 0) for s in steps]
    assert kept_at + 2 < flip and sketched[kept_at + 1] == sketched[flip - 1], \
        f"from its third kept run on, 'a' went without sketches (kept at step {kept_at}): {sketched}"
    retried = [i for i in range(flip, len(steps)) if "trial" in steps[i]["records"]["a"]["auto"]]
    assert retried, "the fast toy turned slow and was never tried again"
    assert set(kept(len(steps) - 1).values()) == {"toy_slow"}, f"after the drift the other wins: {steps[-1]}"
    assert {s["records"]["dense"]["algorithm"] for s in steps} == {"omnireduce"}, steps[0]["records"]["dense"]
    assert steps[-1]["full"]["dense"] == 2, f"the dense tensor was negotiated in full after its first step: {steps[-1]['full']}"
    trials = analyze.auto_trials(timeline.load(str(trace)))
    assert trials["a"] == steps[-1]["records"]["a"]["auto"], (trials, steps[-1])
    table = analyze.format_trials(trials)
    assert "*toy_slow" in table and "toy_fast 3" in table, table   # ~300 ms once it turned slow


def test_dense_candidates_are_ranked_by_their_bytes_and_tried_by_round_one_round_per_step():
    """A round: every release of the group until a name comes again, all with one candidate (they
    fuse as they will once one is kept); a candidate's rounds back to back."""
    trials = Trials(margin=4.0, samples=1, revisit=100)
    choices = [[TRAFFIC, "switchml"], [TRAFFIC, "ring"]]

    def meta(nbytes_floats, report=None, dtype="float32"):
        return {"choices": choices, "shape": [nbytes_floats], "dtype": dtype, "side": 0, "rows": None,
                "report": report}

    got = [settle_release(name, [meta(1000), meta(1000)], trials) for name in ("a", "b") * 4]
    assert [r.algorithm for r in got] == ["switchml"] * 4 + ["ring"] * 4, f"two rounds (a, b) each: {got}"
    assert all("trial" in r.auto for r in got) and got[0].estimate is None, got
    tiny = settle_release("e", [meta(16), meta(16)], trials)   # under 64 KiB: one group, whatever the size
    assert tiny.algorithm == "ring" and "trial" in tiny.auto, f"small tensors are tried together: {tiny}"
    other = settle_release("c", [meta(100_000), meta(100_000)], trials)   # another size band: its own group
    assert other.algorithm == "switchml" and other.auto["trial"] != got[-1].auto["trial"], other
    four = settle_release("d", [meta(10, dtype="float16")] * 4, trials)
    assert four.auto["candidates"] == ["switchml", "ring"], four   # with 4 ranks the switch moves fewer bytes
    assert settle_release("a", [meta(1000), meta(1000)]).algorithm == "switchml", "no trials: the first"
    once = settle_release("noname.7", [dict(meta(1000), once=True)] * 2, trials)
    assert (once.algorithm, once.auto) == ("switchml", None), f"an unnamed call never reports: not tried {once}"


@pytest.mark.multiprocess
def test_dense_auto_tries_switchml_and_the_ring_on_the_same_steps_keeps_the_faster_caches_it_and_retries_on_drift():
    """2 ranks (tests/workers/auto_dense.py): the ring sleeps until step FLIP, then switchml does.
    The group of 'w.0' and 'w.1' tries both, a block of steps each, keeps switchml, is released from the
    cache until it drifts, then tries both again and keeps the ring. A tensor a policy rule or the
    caller names is never tried."""
    env = {"COMMLIB_AUTO_TRIAL_SAMPLES": "2", "COMMLIB_AUTO_DRIFT": "3"}
    results = spawn(2, "auto_dense.py", timeout=120, env=env).check().results()
    steps, flip, slow_s = results[0]["steps"], results[0]["flip"], results[0]["slow_s"]
    for i, (mine, theirs) in enumerate(zip(steps, results[1]["steps"])):
        assert mine["records"] == theirs["records"], f"step {i}: rank 0 and rank 1 differ"
        assert all(mine["exact"].values()), f"step {i}: a result is not the sum: {mine['exact']}"
        assert mine["records"]["named.w"] == {"algorithm": "ring", "auto": None}, f"step {i}: a rule's choice: {mine}"
        assert mine["records"]["caller.w"] == {"algorithm": "switchml", "auto": None}, f"step {i}: the caller's: {mine}"
        w0, w1 = ((r["algorithm"], "trial" in r["auto"]) for r in (mine["records"]["w.0"], mine["records"]["w.1"]))
        assert w0 == w1, f"step {i}: one group, one round: the same candidate {mine}"

    def auto(i):
        return steps[i]["records"]["w.0"]["auto"]

    tried = [steps[i]["records"]["w.0"]["algorithm"] for i in range(len(steps)) if "trial" in auto(i)]
    rounds = 2 * (WARMUP + 1) + 1   # the sleeping ring, measured once, sits out its second round
    assert tried[:rounds] == ["switchml"] * (WARMUP + 2) + ["ring"] * (WARMUP + 1), \
        f"in carriers order, a block of steps each: {tried}"
    assert auto(flip - 1)["choice"] == "switchml" and auto(flip - 1)["times"]["ring"] >= slow_s / 2, auto(flip - 1)
    kept_at = next(i for i in range(len(steps)) if "choice" in auto(i))
    assert kept_at <= rounds + 1, f"kept once the last round's reports came: step {kept_at}"
    full = [s["full"] for s in steps]
    assert full[flip - 1]["w.0"] == full[kept_at + 1]["w.0"], f"the kept choice comes from the cache: {full}"
    assert (full[-1]["named.w"], full[-1]["caller.w"]) == (full[0]["named.w"], full[0]["caller.w"]), \
        f"named ones: negotiated in full on the first step only: {full}"
    retried = [i for i in range(flip, len(steps)) if "trial" in auto(i)]
    assert retried, "switchml turned slow and was never tried again"
    assert auto(len(steps) - 1)["choice"] == "ring", f"after the drift the ring wins: {auto(len(steps) - 1)}"
    assert full[-1]["w.0"] == full[-2]["w.0"], f"cached again: {full[-2:]}"


def test_a_tensor_measured_once_under_every_candidate_still_lets_a_slow_one_drop():
    """A tensor of every other step may be measured once per block (its one step the warm-up's): the
    tensors some candidate has two runs of decide the best, not that one."""
    group = trials_module._Group(["A", "B"], number=0)
    group.times = {"A": {"w": [0.01, 0.01], "x": [0.01]}, "B": {"w": [0.1, 0.1], "x": [0.1]}}
    group.prune(drop=2.0, least=2)
    assert group.dropped == {"B"}, f"B, 10x slower on w's two runs, sits out: {group.dropped}"
