"""What every benchmark shares: timing, medians, the machine's facts, result files and RESULTS.md.

A benchmark measures each peer in the same run (pair by pair), quotes medians of several runs
after a warm-up, and saves one JSON file per suite under benchmarks/results/ with the machine,
the commit, the settings and the raw samples; RESULTS.md is regenerated from all of them.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
RESULT_MARK = "RESULT-JSON "

sys.path.insert(0, str(ROOT / "tests"))
from launch import horovodrun, spawn  # noqa: E402  tests/launch.py: process groups killed on timeout


# the server of each algorithm, as bottleneck() names it (None: the algorithm has none)
SERVERS = {"ring": None, "sparse_allgather": None, "switchml": "switch", "hotcold": "switch", "omnireduce": "aggregators"}
LINK_BUSY = 0.5   # the share of its rate a link must carry for the wire to count as the limit (bottleneck())
# bottleneck()'s rule as each RESULTS.md section states it
BOTTLENECK_RULE = (
    "Bottleneck (benchmarks/common.bottleneck), of the row's time: the server's share (switch or aggregators: "
    "their queue + processing, from commlib.records() or, where it lacks them, their counters by Little's law "
    "over the window: a lower bound), the network's (commlib's transfer minus the server's share) and the "
    "workers' (commlib's processing, plus what neither covers, e.g. the model's compute); the largest is "
    "named, with the shares. Link = bytes the worker's link sent / (rate x time); a network share during "
    f"which the link carried under {LINK_BUSY:.0%} of its rate is named workers (CPU-bound). With no "
    f"breakdown, a link busy {LINK_BUSY:.0%} of the time or more names the network; else the column says "
    "what was not measured.")


def step_breakdown(records, names, server_s=None):
    """Seconds of one step spent by commlib's buckets in the worker's processing (fusion copies,
    scaling, compression) and in the algorithms' collectives (network + switch/aggregators), from
    commlib.records() after the step; a bucket's tensors share its times, so each bucket counts once.
    server_s, the switch's/aggregators' share of transfer_s: records()' server_queue_s + server_proc_s
    of the buckets whose server stamped its results, else the `server_s` given (Probe's, from the daemons)."""
    buckets = {records[n]["bucket"]: records[n] for n in names if n in records}
    out = {"process_s": sum(r["process_s"] for r in buckets.values()),
           "transfer_s": sum(r["transfer_s"] for r in buckets.values())}
    stamped = [r for r in buckets.values() if r.get("server_queue_s") is not None]   # None: no server (the ring)
    if stamped:
        out["server_s"] = sum(r["server_queue_s"] + r["server_proc_s"] for r in stamped)
    elif server_s is not None:
        out["server_s"] = server_s
    return out


class Probe:
    """Around a rank's timed step on the emulated network: `tx_bytes` its eth0 sent (link_bytes) and
    `server_s` the server's share of its transfer (daemon_ns before and after, server_seconds; None
    but on rank 0, or with no `backends` given). The daemons are asked outside the link's count."""

    def __init__(self, backends=None):
        self.backends, self.tx_bytes, self.server_s = backends or {}, None, None

    def __enter__(self):
        self._before = daemon_ns(self.backends)
        self._tx = link_bytes()[0]
        return self

    def __exit__(self, *exc):
        self.tx_bytes = link_bytes()[0] - self._tx
        self.server_s = server_seconds(self._before, daemon_ns(self.backends))


def call_breakdown(fn):
    """(fn()'s result, its breakdown) for a benchmark that calls a backend directly (no records()):
    process_s = the calling thread's CPU time in the call (packing, quantizing, MACs and its own
    socket calls: the backends' workers run in the caller's thread), transfer_s = the rest of its
    wall time (waiting for the network and the server; also for a CPU on a busy host, and the work of
    other threads: Horovod's, gloo's, colocated aggregators')."""
    wall, cpu = time.perf_counter(), time.thread_time()
    result = fn()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    return result, {"process_s": cpu, "transfer_s": max(0.0, wall - cpu), "seconds": wall}


def slowest_call(ctx, key, fn):
    """(fn()'s result on this rank, the slowest rank's seconds, its breakdown: call_breakdown), the
    ranks' measurements exchanged over the job's context under `key`; every rank calls it."""
    result, split = call_breakdown(fn)
    seconds, process_s, transfer_s = max(ctx.exchange(key, [split["seconds"], split["process_s"], split["transfer_s"]]))
    return result, seconds, {"process_s": process_s, "transfer_s": transfer_s}


def daemon_ns(backends):
    """{name: (backend, ns)} for each of `backends` ({name: backend}, e.g. runtime().backends) whose
    server (switch job, aggregators) reports its queue + processing nanoseconds: their sum over its
    daemons so far. Only rank 0 reads them (the others get {}); two readings around timed calls
    give server_seconds."""
    out = {}
    for name, backend in backends.items():
        counters = [fn() for fn in backend.daemon_counters().values()]
        if counters and all("queue_ns" in c for c in counters):
            out[name] = (backend, sum(c["queue_ns"] + c["proc_ns"] for c in counters))
    return out


def server_seconds(before, after, calls=1):
    """The server's share of one worker's transfer per call, from two daemon_ns readings `calls`
    calls apart (None where no backend reported both), when records() lack it: by Little's law on a
    worker's window of W packets in flight (switchml's window, omnireduce's columns), a round lasts
    W x transfer / P for its P packets, so the server's share of the transfer is (queue + processing
    per packet) x P / W; over the n workers' packets, their total queue + processing / (n x W). A
    window not always full (a tensor smaller than it, its tail) makes rounds shorter than that, so
    this is a lower bound of the server's share."""
    shared = before.keys() & after.keys()
    if not shared:
        return None
    return sum((after[k][1] - before[k][1]) / (b.ctx.size * (getattr(b, "window", None) or b.columns))
               for k in shared for b in [after[k][0]]) / 1e9 / calls


def bottleneck(seconds, breakdowns=(), link=None, server="switch", unmeasured="n/a"):
    """What bounded a benchmark row whose median time is `seconds`: "network", "workers" or the server
    (`server`: "switch" or "aggregators"; None for algorithms without one), with the shares that
    decided it, e.g. "network (81%; workers 12%, switch 7%, link 93%)".

    breakdowns: per timed sample, the seconds it spent in commlib's processing on the worker (process_s:
    fusion, scaling, compression, quantization), in its collectives (transfer_s: network + server) and,
    where measured, the server's part of transfer_s (server_s: queue + processing; step_breakdown,
    server_seconds); medians over the samples. link: the bytes the worker's link carried / (rate x
    seconds), or a text saying why it is unknown ("n/a: loopback"). unmeasured: what the column says
    with no breakdown and no busy link: why (e.g. "n/a: Horovod's own allreduce").

    The rule is BOTTLENECK_RULE (printed under every table that has the column): the largest of the
    server's, the network's and the workers' shares of `seconds` names the bottleneck; a network share
    during which the link carried under LINK_BUSY of its rate goes to the workers (the CPUs moving
    the packets, not the wire).
    """
    link_text = None if link is None else f"link {link}" if isinstance(link, str) else f"link {link:.0%}"
    if not breakdowns:
        if isinstance(link, (int, float)) and link >= LINK_BUSY:
            return f"network ({link_text})"
        return unmeasured + (f"; {link_text}" if link_text else "")
    process = statistics.median(b["process_s"] for b in breakdowns) / seconds
    transfer = statistics.median(b["transfer_s"] for b in breakdowns) / seconds
    served = [b["server_s"] for b in breakdowns if b.get("server_s") is not None]
    switch = statistics.median(served) / seconds if served else None
    shares = {"network": max(0.0, transfer - (switch or 0.0)), "workers": max(process, 1.0 - transfer)}
    if server:   # None: an algorithm without one (the ring, an allgather)
        shares[server] = switch
    verdict = max((k for k in shares if shares[k] is not None), key=shares.get)
    others = [f"{k} {'n/a' if v is None else format(v, '.0%')}" for k, v in shares.items() if k != verdict]
    if verdict == "network" and isinstance(link, (int, float)) and link < LINK_BUSY * shares["network"]:
        return f"workers (CPU-bound: network {shares['network']:.0%} with {link_text}; " + ", ".join(others) + ")"
    return f"{verdict} ({shares[verdict]:.0%}; " + ", ".join(others + [link_text or "link n/a"]) + ")"


def timeit(fn, repeats, warmup=1):
    """Seconds per call of fn(), `repeats` samples after `warmup` unmeasured calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def summarize(samples):
    return {"min": min(samples), "max": max(samples), "median": statistics.median(samples),
            "mean": statistics.fmean(samples), "runs": len(samples)}


def machine():
    """The facts a reader needs to judge a figure: cores, memory, versions, commit."""
    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError):
        pass
    for module in ("torch", "numpy", "horovod"):
        try:
            info[module] = __import__(module).__version__
        except (ImportError, AttributeError):
            pass
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def save(suite, settings, results, markdown):
    """Write results/<suite>.json and regenerate RESULTS.md. `markdown`: this suite's section."""
    RESULTS.mkdir(exist_ok=True)
    record = {"suite": suite, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(),
              "settings": settings, "results": results, "markdown": markdown}
    (RESULTS / f"{suite}.json").write_text(json.dumps(record, indent=1, default=float))
    regenerate()
    return record


def regenerate():
    """RESULTS.md from every results/*.json, so figures and the text never drift apart."""
    sections = ["# commlib benchmark results\n",
                "Regenerated from `benchmarks/results/*.json` by every benchmark run "
                "(`make bench`; `make bench-quick` for the CI smoke sizes). Medians of several runs after a "
                "warm-up; ratios are measured pair by pair in the same run.\n"]
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        m = record["machine"]
        sections.append(f"## {record['suite']}\n\n_{record['time']}, commit {m.get('commit', '?')}, "
                        f"{m.get('cpus')} CPUs, {m.get('memory_gib', '?')} GiB, "
                        f"settings {json.dumps(record['settings'])}_\n\n{record['markdown']}\n")
    (HERE / "RESULTS.md").write_text("\n".join(sections))


def figure(*args, **kwargs):
    """matplotlib's (figure, axes) for a results plot, drawn without a display."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(*args, **kwargs)


def plot_losses(ax, results):
    """Each configuration's loss curve, labelled with its samples/s (the training benchmarks)."""
    for label, r in results.items():
        ax.plot(r["losses"], label=f"{label}: {r['total_samples_per_s']:.0f} samples/s")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.legend(fontsize=7)


def grouped_bars(ax, rows, group, series, value, ratio, peer, bound=None, ylabel=""):
    """Bars of rows[value] grouped by group(row) along x, one colour per series(row) with a legend; each
    bar labelled with rows[ratio] against `peer` (the series every ratio is to); bound(row), where
    given, a black line over its bar: the time the physical bound allows."""
    groups = list(dict.fromkeys(group(r) for r in rows))
    names = list(dict.fromkeys(series(r) for r in rows))
    width = 0.8 / len(names)
    colors = dict(zip(names, ["#888888", "#1f77b4", "#2ca02c", "#d62728", "#ff7f0e", "#9467bd", "#8c564b"]))
    for r in rows:
        x = groups.index(group(r)) - 0.4 + width * (names.index(series(r)) + 0.5)
        bar = ax.bar(x, r[value], width, color=colors[series(r)], label=series(r))
        ax.bar_label(bar, [f"{r[ratio]:.2f}x"], fontsize=6, rotation=90, padding=2)
        if bound is not None and bound(r):
            ax.hlines(bound(r), x - width / 2, x + width / 2, colors="black", linewidth=1.5,
                      label="bound (link time of the fewest bytes)")
    handles = dict(zip(*reversed(ax.get_legend_handles_labels())))   # one entry per label
    ax.legend(handles.values(), handles.keys(), fontsize=7, title=f"bar labels: speed vs {peer}",
              title_fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xticks(range(len(groups)), groups, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)


def titled(fig, title, width=110):
    """A title wrapped to the figure instead of cut at its edges."""
    import textwrap
    fig.suptitle("\n".join(textwrap.wrap(title, width)), fontsize=8)


# untimed steps, as Horovod's synthetic benchmark's --num-warmup-batches (10): auto's trials fall in
# them (up to 3 candidates x (1 warm-up + 5 measured) steps and the step that keeps one, and a lost
# report's block)
WARMUP_STEPS = 24


def training_arguments(description, steps, warmup=2, warmup_help="untimed steps", quick_warmup=None):
    """The options the emulated-network training benchmarks share (bench_training, bench_ddp,
    bench_tf); a benchmark adds its own, then parses with parse_training_arguments. `quick_warmup`:
    --quick's warm-up steps, when fewer than `warmup`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model, few steps: well under 2 minutes")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", default="500mbit", help="each worker link, both directions (tc tbf)")
    parser.add_argument("--steps", type=int, default=None, help=f"timed steps per configuration (default {steps})")
    parser.add_argument("--warmup", type=int, default=None, help=f"{warmup_help} (default {warmup}"
                        + (f"; quick {quick_warmup})" if quick_warmup is not None else ")"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=None, help="MLP width (default 2048; quick 256)")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(default_steps=steps, default_warmup=warmup,
                        quick_warmup=warmup if quick_warmup is None else quick_warmup)
    return parser


TRAINING_SETTINGS = ("quick", "workers", "rate", "steps", "warmup", "batch", "hidden", "features")


def train_step(model, optimizer, x, y, backends=None, group=None):
    """One timed SGD step of a classifier, every rank starting together (a barrier on `group`), with a
    Probe of `backends`: (seconds, the loss's mean over ranks, the probe)."""
    import torch
    import torch.distributed as dist
    dist.barrier(group=group)
    with Probe(backends) as probe:
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        elapsed = time.perf_counter() - start
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=group)
    return elapsed, mean.item() / dist.get_world_size(group), probe


def rate_cells(result, n, first):
    """A training table's "samples/s | vs first | median samples/s | vs first (median)" cells of one
    configuration's per-worker step rates (x n workers) against the `first` configuration's result;
    the figures go into `result` (total_samples_per_s, median_samples_per_s, vs_first)."""
    total, median = statistics.fmean(result["rates"]) * n, statistics.median(result["rates"]) * n
    base, base_median = statistics.fmean(first["rates"]) * n, statistics.median(first["rates"]) * n
    result.update(total_samples_per_s=total, median_samples_per_s=median, vs_first=total / base)
    return f"{total:.0f} | {total / base:.2f}x | {median:.0f} | {median / base_median:.2f}x"


def training_settings(args, *extra):
    """The settings a training benchmark records: the shared options and its own `extra` ones."""
    return {k: getattr(args, k) for k in TRAINING_SETTINGS + extra}


def parse_training_arguments(parser, argv):
    """Parsed options with the quick/full defaults filled in."""
    args = parser.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else args.default_steps)
    if args.warmup is None:
        args.warmup = args.quick_warmup if args.quick else args.default_warmup
    args.hidden = args.hidden or (256 if args.quick else 2048)
    return args


def save_figure(fig, name):
    """Write results/<name>.png and release the figure; returns the path."""
    import matplotlib.pyplot as plt
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def emit(payload):
    """From inside a rank: hand a JSON result to the launching benchmark (rank 0 prints it)."""
    print(RESULT_MARK + json.dumps(payload, default=float), flush=True)


def payloads(output):
    """The payloads emit() put in a rank's output, in order."""
    return [json.loads(line.split(RESULT_MARK, 1)[1]) for line in output.splitlines() if RESULT_MARK in line]


def local_result(script, forwarded, nprocs=2, timeout=300):
    """Rank 0's payload of `script --worker FORWARDED...` run by `nprocs` local ranks (torchrun's
    environment); RuntimeError with their output when a rank fails or nothing was emitted."""
    ranks = spawn(nprocs, str(Path(script).resolve()), "--worker", *forwarded, timeout=timeout)
    output = "\n".join(rank.stdout for rank in ranks)
    found = payloads(output)
    if any(rank.returncode for rank in ranks) or not found:
        raise RuntimeError(f"workers failed (exit {[rank.returncode for rank in ranks]}):\n{output[-6000:]}")
    return found[0]


def rate_bps(text):
    """A tc rate ("500mbit", "1gbit") in bits per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if text.lower().endswith(unit):
            return float(text[:-len(unit)]) * scale
    raise SystemExit(f"--rate {text!r}: write e.g. 500mbit or 1gbit")


def link_bytes():
    """(bytes sent, bytes received) so far on this namespace's eth0 (benchmarks/netem.py's link)."""
    stats = Path("/sys/class/net/eth0/statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def cluster_result(ranks, echo=False):
    """Rank 0's payload from netem.Cluster.run's [(exit code, output)], or a RuntimeError with every
    rank's output. echo: print rank 0's other output (a benchmark's per-step lines)."""
    output = ranks[0][1]
    found = payloads(output)
    if any(code for code, _ in ranks) or not found:
        raise RuntimeError(f"workers failed (exit {[code for code, _ in ranks]}):\n" + "\n".join(
            f"--- rank {r} ---\n{out[-4000:]}" for r, (_, out) in enumerate(ranks)))
    if echo:
        print("\n".join(line for line in output.splitlines() if RESULT_MARK not in line))
    return found[0]


def switch_job(args, script, configs, forwarded=("steps", "warmup", "batch", "hidden", "features")):
    """A torchrun-like job of `script --worker` (with the `forwarded` options) on args.workers emulated
    hosts, links shaped to args.rate, a commlib-switch on an unshaped host; rank 0's payload. Exits
    saying why where this host cannot emulate the network; prints what it runs (`configs` of them)."""
    import netem
    ok, why = netem.available()
    if not ok:
        raise SystemExit(f"{Path(script).stem}: {why}")
    print(f"== {args.workers} emulated hosts, links {args.rate} each way, {configs} configurations", flush=True)
    hosts = [f"w{r}" for r in range(args.workers)]
    with netem.Cluster(hosts + ["switch"], rate=args.rate, unshaped={"switch"}) as cluster:
        switch, address = cluster.start_switch("switch", cwd=ROOT)
        try:
            argv = [sys.executable, str(script), "--worker", *[f"--{k}={getattr(args, k)}" for k in forwarded]]
            env = {"COMMLIB_SWITCH_ADDR": address, "COMMLIB_TIMEOUT_S": "120",
                   "COMMLIB_AUTHENTICATE": "0"}   # the switch is keyless: a benchmark of the datapath, not the MACs
            ranks = cluster.run(hosts, argv, env, args.timeout, cwd=ROOT)
        finally:
            cluster.kill([switch])
    return cluster_result(ranks, echo=True)


def unspun(hvd, tensor, name, poll_s=0.0005):
    """hvd.allreduce for the benchmarks' own bookkeeping (a step's start, its loss): Horovod's
    synchronize spins (WaitAndClear yields in a loop), and a rank that arrived first would spin
    while the others still run their timed step; several ranks share this host's cores."""
    handle = hvd.allreduce_async(tensor, name=name)
    while not hvd.poll(handle):
        time.sleep(poll_s)
    return hvd.synchronize(handle)


def horovod_built():
    """Horovod with its torch ops is installed (tried in a child process, so this one stays light)."""
    return subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True).returncode == 0


def launch(nprocs, script, *args, timeout=600, env=None, horovod=True):
    """Run `script` on nprocs local ranks and return the payloads they emit(): under horovodrun
    (Gloo) when Horovod is built (and `horovod`), so the ring peer is Horovod's own allreduce, else as plain
    processes with torchrun's environment (the core's ring then runs on torch.distributed's Gloo).
    A launch that outlives `timeout` has its process groups killed and waited for, and raises."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    if horovod and horovod_built():
        ranks = [horovodrun(nprocs, str(script), *args, timeout=timeout, env=env)]
    else:
        ranks = spawn(nprocs, str(script), *args, timeout=timeout, env=env)
    output = "\n".join(rank.stdout for rank in ranks)
    found = payloads(output)
    if any(rank.returncode for rank in ranks) or not found:
        raise RuntimeError(f"{script} on {nprocs} ranks failed (exit {[rank.returncode for rank in ranks]}):\n"
                           f"{output[-6000:]}")
    return found
