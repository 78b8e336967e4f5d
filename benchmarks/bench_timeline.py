"""What the timeline costs: commlib with the timeline off and on, interleaved step by step.

Two local ranks (torchrun's environment), the ring on loopback; a step reduces 32 small tensors at
once (the per-tensor cost shows) and one of 1M floats. "off" is commlib as every job runs it (the
phases are still measured for commlib.records(): a few clock reads per bucket); "on" also writes
every phase to a per-rank Chrome trace (commlib.start_timeline). Rank 0 prints the median step time
of each and the breakdown table of the traced steps (python -m commlib.analyze).

    python benchmarks/bench_timeline.py [--quick] [--steps 40]
Results: benchmarks/results/timeline.json and RESULTS.md.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

CONFIGS = ["timeline off", "timeline on"]


def worker(args):
    import numpy as np

    import commlib
    from commlib import analyze, timeline

    commlib.init(policy="*=ring")
    rank = commlib.rank()
    small = [np.full(256, float(rank), np.float32) for _ in range(32)]
    large = np.full(1 << 20, float(rank), np.float32)
    traces = tempfile.mkdtemp(prefix="commlib-timeline-")
    path = f"{traces}/trace.{{rank}}.json"
    times = {label: [] for label in CONFIGS}
    for step in range(args.warmup + args.steps):
        for label in (CONFIGS if step % 2 else CONFIGS[::-1]):   # alternate the order: no bias to going second
            if label == "timeline on":
                commlib.start_timeline(path.replace(".json", f".{step}.json"))
            commlib.allreduce(np.zeros(1, np.float32), name=f"sync.{label}")   # start together
            start = time.perf_counter()
            handles = [commlib.allreduce_async(t, name=f"small.{i}") for i, t in enumerate(small)]
            handles.append(commlib.allreduce_async(large, name="large"))
            for h in handles:
                commlib.synchronize(h)
            elapsed = time.perf_counter() - start
            if label == "timeline on":
                commlib.stop_timeline()
            if step >= args.warmup:
                times[label].append(elapsed)
    commlib.shutdown()
    if rank == 0:
        events = [e for step in range(args.warmup, args.warmup + args.steps)
                  for e in timeline.load(path.replace(".json", f".{step}.json").replace("{rank}", "0"))]
        table = analyze.format_table(analyze.table(analyze.rounds(events)))
        common.emit({"results": times, "tensors": len(small) + 1, "breakdown": table})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps: seconds")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 40; quick 5)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (5 if args.quick else 40)
    if args.worker:
        return worker(args)
    forwarded = [f"--{k}={getattr(args, k)}" for k in ("steps", "warmup")]
    payload = common.local_result(__file__, forwarded)
    medians = {label: statistics.median(times) for label, times in payload["results"].items()}
    off = medians["timeline off"]
    rows = [f"| {label} | {1000 * m:.2f} | {m / off - 1:+.1%} |" for label, m in medians.items()]
    markdown = (f"A step of {payload['tensors']} tensors (32 x 256 floats and 1M floats) through the ring, 2 ranks on "
                f"loopback, median of {args.steps} steps, the two configurations interleaved step by step, their order alternating.\n\n"
                "| configuration | ms per step | vs off |\n|---|---|---|\n" + "\n".join(rows) +
                "\n\nBreakdown of the traced steps on rank 0 (`python -m commlib.analyze`), ms:\n\n```\n" +
                payload["breakdown"] + "\n```\n")
    settings = {k: getattr(args, k) for k in ("quick", "steps", "warmup")}
    common.save("timeline", settings, {"medians_s": medians, **payload}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
