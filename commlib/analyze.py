"""`python -m commlib.analyze TRACE... [--out DIR]`: where the time of a job went.

Reads commlib timelines (one per rank, or one merged by `python -m commlib.timeline merge`), cuts
them into rounds (one tensor's NEGOTIATE through its last phase on one rank) and prints, per
algorithm and size band, the median and p99 of each component, the IMC'20 study's five (worker
queue, worker processing, server queue, server processing, network) and commlib's negotiation:

    negotiate     waiting for every rank to agree (the controller)
    queue         agreed, waiting for its bucket to start (the worker queue)
    process       the worker's processing: fusion copies, scaling, compression, restoring, and inside
                  a collective its own packing (quantizing, MACs, syscalls) where it reports it (switchml)
    server_queue  the switch's / aggregators' queue: kernel arrival -> processing, per packet
    server_proc   their processing of a packet (switchml, omnireduce: stamped on their results)
    network       the rest of the collectives' time: the transfer time less the server's share, which
                  holds the wire, the sockets and the wait for the slowest rank. For algorithms
                  without a server (the ring) the whole transfer time, and no server columns.

The server's share is what its results piggyback (a round's queue and processing time, summed over
its contributions, on the server's clock); the worker scales the per-packet means to its collective's
transfer time by its mean round time on its own clock (a window keeps many rounds in flight: the
shares of a round, not the sum of overlapping rounds, make the split). See commlib.executor.Phases.

and `auto`'s trials (commlib.trials): per tensor, its group's candidates, their measured times (of a
step of the group: the sum of its tensors' typical times, on the rank that arrived last) and the one kept. It writes PNG plots after the IMC'20 study of a production parameter server: CDFs of transfer time
per algorithm, the stacked breakdown (its Figure 5), concurrency (its Figure 7b: per millisecond, how
many ranks' packets reached the switch, from its ms_ranks_k counters, and how many ranks were inside
a collective, from the workers' spans) and, when the trace holds per-row update counts of
sparse tensors, the update skew (share of updates taken by the hottest K rows, its Figure 10).
"""
import argparse
import collections
import os
import sys

import numpy as np

from commlib.timeline import load

COMPONENTS = ("negotiate", "queue", "process", "server_queue", "server_proc", "network")
SERVER = ("server_queue", "server_proc")
BANDS = ((64 << 10, "< 64 KiB"), (1 << 20, "64 KiB - 1 MiB"), (16 << 20, "1 - 16 MiB"), (float("inf"), ">= 16 MiB"))
_COMPONENT_OF = {"NEGOTIATE": "negotiate", "QUEUE": "queue"}


class Round:
    """One tensor's round on one rank: its components (seconds) and its collectives' spans (µs)."""

    def __init__(self, rank, tensor):
        self.rank, self.tensor = rank, tensor
        self.algorithm, self.nbytes = None, 0
        self.seconds = dict.fromkeys(COMPONENTS, 0.0)
        self.comm_spans = []
        self.server = False   # its collectives reported the server's share (else network = the transfer)

    def add(self, event):
        seconds = event["dur"] / 1e6
        if event.get("cat") == "comm":   # its busy_s (packing, MACs, syscalls) is the worker's processing
            args = event["args"]
            busy = args.get("busy_s", 0.0)
            self.seconds["process"] += busy
            if "network_s" in args:
                self.server = True
                for c in (*SERVER, "network"):
                    self.seconds[c] += args[c + "_s"]
            else:   # no server (the ring), or a trace from before the stamps
                self.seconds["network"] += seconds - busy
            self.algorithm = event["args"]["algorithm"]
            self.nbytes = event["args"]["bytes"]
            self.comm_spans.append((event["ts"], event["ts"] + event["dur"]))
        else:
            self.seconds[_COMPONENT_OF.get(event["name"], "process")] += seconds

    @property
    def total(self):
        return sum(self.seconds.values())

    @property
    def transfer(self):
        """Seconds inside the collectives, less the worker's own processing there."""
        return self.seconds["server_queue"] + self.seconds["server_proc"] + self.seconds["network"]


def rounds(events):
    """The rounds in `events`, in time order per (rank, tensor)."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("worker", "comm")),
                   key=lambda e: (e["pid"], e["tid"], e["ts"]))
    out, current = [], {}
    for event in spans:
        key = (event["pid"], event["tid"])
        if event["name"] == "NEGOTIATE" or key not in current:
            current[key] = Round(event["pid"], names.get(key, str(event["tid"])))
            out.append(current[key])
        current[key].add(event)
    return [r for r in out if r.algorithm is not None]


def band(nbytes):
    return next(label for limit, label in BANDS if nbytes < limit)


def table(found):
    """Rows (algorithm, band, n, {component: (median ms, p99 ms), None for the server's components
    of an algorithm without a server}, dominant component)."""
    groups = collections.defaultdict(list)
    for r in found:
        groups[(r.algorithm, band(r.nbytes))].append(r)
    order = [label for _, label in BANDS]
    rows = []
    for (algorithm, size), members in sorted(groups.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        stats, server = {}, any(r.server for r in members)
        for c in COMPONENTS:
            values = np.array([r.seconds[c] for r in members]) * 1e3
            stats[c] = (float(np.median(values)), float(np.percentile(values, 99))) if server or c not in SERVER else None
        shown = [c for c in COMPONENTS if stats[c] is not None]
        rows.append((algorithm, size, len(members), stats, max(shown, key=lambda c: stats[c][0])))
    return rows


def format_table(rows):
    head = f"{'algorithm':<12} {'size':<15} {'n':>6} " + " ".join(f"{c + ' p50/p99 ms':>24}" for c in COMPONENTS)
    lines = [head + "  dominant", "-" * (len(head) + 10)]
    for algorithm, size, n, stats, dominant in rows:
        cells = " ".join(f"{'-':>24}" if stats[c] is None else f"{stats[c][0]:>11.3f} / {stats[c][1]:>10.3f}"
                         for c in COMPONENTS)
        lines.append(f"{algorithm:<12} {size:<15} {n:>6} {cells}  {dominant}")
    lines.append("network: the collectives' time less the server's share (stamped on its results); "
                 "'-': no server, network = the whole transfer time")
    return "\n".join(lines)


def concurrency(found, bin_us=1000.0):
    """Per time bin, the number of distinct ranks inside a collective."""
    spans = [(r.rank, b, e) for r in found for b, e in r.comm_spans]
    if not spans:
        return np.zeros(0, int)
    origin, end = min(b for _, b, _ in spans), max(e for _, _, e in spans)
    bins = [set() for _ in range(int((end - origin) // bin_us) + 1)]
    for rank, b, e in spans:
        for i in range(int((b - origin) // bin_us), int((e - origin) // bin_us) + 1):
            bins[i].add(rank)
    return np.array([len(s) for s in bins])


def daemon_samples(events):
    """daemon row name (switch, aggregators) -> its counter samples in time order (rates per second,
    each since the sample before; a row starts with a sample of zeros)."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    rows = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "C" and e["pid"] in names:
            rows[names[e["pid"]]].append(e)
    return {row: sorted(samples, key=lambda e: e["ts"]) for row, samples in rows.items()}


def daemon_rates(samples):
    """{counter: (median, max) per second} over a daemon's samples, the counters that moved."""
    values = collections.defaultdict(list)
    for e in samples:
        for counter, rate in e["args"].items():
            values[counter].append(rate)
    return {c: (float(np.median(v)), float(np.max(v))) for c, v in values.items() if max(v) > 0}


def _totals(samples, counters):
    """Each counter's increase over a daemon's samples (its rates times the intervals they cover)."""
    totals = collections.Counter()
    for before, after in zip(samples, samples[1:]):
        for counter in counters(after["args"]):
            totals[counter] += after["args"][counter] * (after["ts"] - before["ts"]) / 1e6
    return totals


def per_packet(samples):
    """A daemon's mean queue and processing time per packet over its samples (queue_ns, proc_ns and
    packets per second, each rate times the interval it covers), or None when it lacks them."""
    totals = _totals(samples, lambda args: [c for c in ("queue_ns", "proc_ns", "pkts_recv") if c in args])
    if not totals["pkts_recv"] or "queue_ns" not in samples[-1]["args"]:
        return None
    return {"queue_us": totals["queue_ns"] / totals["pkts_recv"] / 1e3,
            "proc_us": totals["proc_ns"] / totals["pkts_recv"] / 1e3, "packets": totals["pkts_recv"]}


def server_concurrency(samples):
    """{k: milliseconds in which the switch got packets of exactly k ranks} over a daemon's samples
    (its ms_ranks_k counters: the study's Figure 7b seen by the switch), {} where it lacks them."""
    totals = _totals(samples, lambda args: [c for c in args if c.startswith("ms_ranks_")])
    return {int(c.rsplit("_", 1)[1]): round(n) for c, n in sorted(totals.items()) if round(n)}


def update_counts(events):
    """tensor -> per-row update counts summed over ranks and windows, most updated first."""
    totals = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("name") == "UPDATE_COUNTS":
            totals[e["args"]["tensor"]].update(dict(zip(e["args"]["rows"], e["args"]["counts"])))
    return {t: np.sort(np.fromiter(c.values(), float))[::-1] for t, c in totals.items()}


def plot(found, events, out_dir):
    """The PNG plots; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    by_algorithm = collections.defaultdict(list)
    for r in found:
        by_algorithm[r.algorithm].append(r)

    fig, ax = plt.subplots(figsize=(6, 4))
    for algorithm, members in sorted(by_algorithm.items()):
        x = np.sort([r.transfer * 1e3 for r in members])
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=algorithm)
    ax.set(xscale="log", xlabel="transfer time per round (ms)", ylabel="CDF", title="Round latency per algorithm")
    ax.legend()
    paths.append(_save(fig, out_dir, "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = sorted(by_algorithm)
    bottom = np.zeros(len(labels))
    for c in COMPONENTS:
        heights = np.array([np.median([r.seconds[c] for r in by_algorithm[a]]) * 1e3 for a in labels])
        ax.bar(labels, heights, bottom=bottom, label=c)
        bottom += heights
    ax.set(ylabel="median ms per round", title="Latency breakdown (stacked medians)")
    ax.legend()
    paths.append(_save(fig, out_dir, "breakdown.png"))

    busy = concurrency(found)
    fig, ax = plt.subplots(figsize=(6, 4))
    views = [("workers: ranks inside a collective", dict(zip(*np.unique(busy[busy > 0], return_counts=True))))]
    views += [(f"{row}: ranks whose packets arrived", server_concurrency(samples))
              for row, samples in daemon_samples(events).items()]
    views = [(label, counts) for label, counts in views if counts]
    for i, (label, counts) in enumerate(views):   # side by side bars, one series per view
        total = sum(counts.values())
        ax.bar(np.array(list(counts), float) + (i - (len(views) - 1) / 2) * 0.8 / len(views),
               [n / total for n in counts.values()], width=0.8 / len(views), label=label)
    ax.set(xlabel="ranks in the same millisecond", ylabel="share of busy milliseconds", title="Concurrency")
    if views:
        ax.set_xticks(sorted({k for _, counts in views for k in counts}))
        ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir, "concurrency.png"))

    counts = update_counts(events)
    if counts:
        fig, ax = plt.subplots(figsize=(6, 4))
        for tensor, c in sorted(counts.items()):
            k = np.arange(1, len(c) + 1)
            ax.plot(k, np.cumsum(c) / c.sum(), label=tensor)
        ax.set(xscale="log", xlabel="hottest K rows", ylabel="share of updates", title="Update skew")
        ax.legend()
        paths.append(_save(fig, out_dir, "update_skew.png"))
    return paths


def _save(fig, out_dir, name):
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m commlib.analyze", description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="timeline files (one per rank, or merged)")
    parser.add_argument("--out", default="commlib-analysis", help="folder for the PNG plots")
    args = parser.parse_args(argv)
    events = [e for path in args.traces for e in load(path)]
    found = rounds(events)
    if not found:
        print("no tensor rounds in these traces: was the timeline on while tensors were reduced?", file=sys.stderr)
        return 1
    print(f"{len(found)} rounds of {len({r.tensor for r in found})} tensors on {len({r.rank for r in found})} ranks\n")
    print(format_table(table(found)))
    for row, samples in daemon_samples(events).items():
        print(f"\n{row}, per second (median / max over the samples):")
        for counter, (median, peak) in sorted(daemon_rates(samples).items()):
            print(f"  {counter:<20} {median:>12.0f} / {peak:.0f}")
        share = per_packet(samples)
        if share:
            print(f"  its share of a packet's round: queue {share['queue_us']:.1f} us, processing "
                  f"{share['proc_us']:.1f} us (mean over {share['packets']:.0f} packets)")
        ranks = server_concurrency(samples)
        if ranks:
            total = sum(ranks.values())
            print("  concurrency, ranks whose packets arrived in the same millisecond: " +
                  ", ".join(f"{k}: {n / total:.0%}" for k, n in ranks.items()) + f" of {total} ms")
    trials = auto_trials(events)
    if trials:
        print("\n" + format_trials(trials))
    for c, share in skew_summary(events).items():
        print(f"\n{c}: the hottest 1% of rows take {share:.0%} of updates")
    for path in plot(found, events, args.out):
        print(f"wrote {path}")
    return 0


def auto_trials(events):
    """tensor -> what its last round showed of `auto`'s trials (Release.auto: the candidates and
    their measured times, the choice once kept), from rank 0's rounds (every rank's are the same)."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    shown = [e for e in events if e.get("cat") == "comm" and "auto" in e.get("args", {})]
    rank = min((e["pid"] for e in shown), default=None)
    return {names.get((e["pid"], e["tid"]), str(e["tid"])): e["args"]["auto"]
            for e in sorted(shown, key=lambda e: e["ts"]) if e["pid"] == rank}


def format_trials(trials):
    lines = ["auto's trials (each candidate's time for a step of the tensor's group: the sum of its tensors' "
             "typical times (commlib.trials.typical), on the rank that arrived last; * kept):"]
    for tensor, auto in sorted(trials.items()):
        times = auto.get("times", {})
        shown = ", ".join(f"{'*' if a == auto.get('choice') else ''}{a} "
                          + (f"{times[a] * 1e3:.2f} ms" if a in times else "not measured")
                          for a in auto.get("candidates") or sorted(times, key=times.get))
        lines.append(f"  {tensor:<24} {shown}" + ("" if "choice" in auto else "  (still trying)"))
    return "\n".join(lines)


def skew_summary(events):
    """tensor -> share of updates taken by its hottest 1% of rows."""
    return {t: float(c[:max(1, len(c) // 100)].sum() / c.sum()) for t, c in update_counts(events).items() if c.sum()}


if __name__ == "__main__":
    sys.exit(main())
