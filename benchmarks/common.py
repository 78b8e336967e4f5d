"""What every benchmark shares: timing, medians, the machine's facts, result files and RESULTS.md.

A benchmark measures each peer in the same run (pair by pair), quotes medians of several runs
after a warm-up, and saves one JSON file per suite under benchmarks/results/ with the machine,
the commit, the settings and the raw samples; RESULTS.md is regenerated from all of them.
"""
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
    payloads = [json.loads(line.split(RESULT_MARK, 1)[1]) for line in output.splitlines() if RESULT_MARK in line]
    if any(rank.returncode for rank in ranks) or not payloads:
        raise RuntimeError(f"{script} on {nprocs} ranks failed (exit {[rank.returncode for rank in ranks]}):\n"
                           f"{output[-6000:]}")
    return payloads
