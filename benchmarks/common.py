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


def step_breakdown(records, names):
    """Seconds of one step spent by commlib's buckets in the worker's processing (fusion copies,
    scaling, compression) and in the algorithms' collectives (network + switch/aggregators), from
    commlib.records() after the step; a bucket's tensors share its times, so each bucket counts once."""
    buckets = {records[n]["bucket"]: records[n] for n in names if n in records}
    return {"process_s": sum(r["process_s"] for r in buckets.values()),
            "transfer_s": sum(r["transfer_s"] for r in buckets.values())}


def bottleneck(step_s, breakdowns):
    """'transfer 70%' style summary: the median share of the step time in commlib's collectives and
    processing; transfer near the whole step means the network (or switch) bounds it."""
    if not breakdowns:
        return "-"
    transfer = statistics.median(b["transfer_s"] for b in breakdowns) / step_s
    process = statistics.median(b["process_s"] for b in breakdowns) / step_s
    return f"transfer {transfer:.0%}, worker processing {process:.0%}"


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


def training_arguments(description, steps, warmup=2, warmup_help="untimed steps"):
    """The options the emulated-network training benchmarks share (bench_training, bench_ddp,
    bench_tf); a benchmark adds its own, then parses with parse_training_arguments."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model, few steps: well under 2 minutes")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", default="500mbit", help="each worker link, both directions (tc tbf)")
    parser.add_argument("--steps", type=int, default=None, help=f"timed steps per configuration (default {steps})")
    parser.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=None, help="MLP width (default 2048; quick 256)")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(default_steps=steps)
    return parser


TRAINING_SETTINGS = ("quick", "workers", "rate", "steps", "warmup", "batch", "hidden", "features")


def training_settings(args, *extra):
    """The settings a training benchmark records: the shared options and its own `extra` ones."""
    return {k: getattr(args, k) for k in TRAINING_SETTINGS + extra}


def parse_training_arguments(parser, argv):
    """Parsed options with the quick/full defaults filled in."""
    args = parser.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else args.default_steps)
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


def horovod_built():
    """Horovod with its torch ops is installed (tried in a child process, so this one stays light)."""
    return subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True).returncode == 0


def launch(nprocs, script, *args, timeout=600, env=None):
    """Run `script` on nprocs local ranks and return the payloads they emit(): under horovodrun
    (Gloo) when Horovod is built, so the ring peer is Horovod's own allreduce, else as plain
    processes with torchrun's environment (the core's ring then runs on torch.distributed's Gloo).
    A launch that outlives `timeout` has its process groups killed and waited for, and raises."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    if horovod_built():
        ranks = [horovodrun(nprocs, str(script), *args, timeout=timeout, env=env)]
    else:
        ranks = spawn(nprocs, str(script), *args, timeout=timeout, env=env)
    output = "\n".join(rank.stdout for rank in ranks)
    found = payloads(output)
    if any(rank.returncode for rank in ranks) or not found:
        raise RuntimeError(f"{script} on {nprocs} ranks failed (exit {[rank.returncode for rank in ranks]}):\n"
                           f"{output[-6000:]}")
    return found
