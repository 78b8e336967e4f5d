"""What a step of many small tensors costs: commlib against Horovod (its response cache on, the
default) and DDP's default, on loopback, where the per-tensor cost of each library is what remains.

Each step reduces 100 or 400 tensors of 16 to 4096 floats (16 << (i % 9)): Horovod and commlib
get one allreduce_async per tensor (as their DistributedOptimizers do) and wait for all; DDP runs
the backward of a model whose parameters are those tensors (its buckets, negotiated once).

Horovod runs in a job of its own (horovodrun), commlib and DDP together in another (torchrun's
environment), interleaved step by step; the two jobs alternate, `--rounds` times, and the steps of
all rounds are pooled: medians per rank count. Not all three in one job: once initialized,
Horovod's background thread keeps one rank's core busy even while idle (100% of a core here;
horovod/horovod#2804), which would tax whatever runs beside it on a 2-core host.

    python benchmarks/bench_overhead.py [--quick] [--ranks 2 4 8] [--tensors 100 400] [--steps 30] [--rounds 4]
Results: benchmarks/results/overhead.json and RESULTS.md.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

CONFIGS = ("horovod", "commlib", "ddp default")
JOBS = ("horovod", "commlib")   # the libraries of each job: Horovod alone; commlib and DDP


def sizes(count):
    return [16 << (i % 9) for i in range(count)]


def worker(args):
    import torch
    torch.set_num_threads(1)
    if args.job == "horovod":
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        out = {count: _timed(*_horovod_runs(hvd, count), args) for count in args.tensors}
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        import commlib
        dist.init_process_group("gloo")
        commlib.init()
        rank, size, out = commlib.rank(), commlib.size(), {}
        for count in args.tensors:
            tensors = [torch.randn(n) for n in sizes(count)]
            model = DDP(torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in tensors]))

            def ours():
                for h in [commlib.allreduce_async(t, name=f"c{count}.{i}", algorithm=args.algorithm)
                          for i, t in enumerate(tensors)]:
                    commlib.synchronize(h)

            def ddp():
                sum(p.sum() for p in model.module).backward()

            out[count] = _timed({"commlib": ours, "ddp default": ddp}, dist.barrier, args)
            out[count]["algorithms"] = sorted({r["algorithm"] for n, r in commlib.records().items()
                                               if n.startswith(f"c{count}.")})
        commlib.shutdown()
        dist.destroy_process_group()
    if rank == 0:
        common.emit({"size": size, "results": out})


def _horovod_runs(hvd, count):
    import torch
    tensors = [torch.randn(n) for n in sizes(count)]

    def horovod():
        for h in [hvd.allreduce_async(t, name=f"h{count}.{i}") for i, t in enumerate(tensors)]:
            hvd.synchronize(h)
    return {"horovod": horovod}, lambda: hvd.allreduce(torch.zeros(1), name="barrier")


def _timed(runs, barrier, args):
    """Each run's step times, the runs interleaved step by step, every rank starting each together."""
    times = {label: [] for label in runs}
    for step in range(args.warmup + args.steps):
        for label, fn in runs.items():
            barrier()
            start = time.perf_counter()
            fn()
            if step >= args.warmup:
                times[label].append(time.perf_counter() - start)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps, 2 ranks: seconds")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts (default 2 4 8; quick 2)")
    parser.add_argument("--tensors", type=int, nargs="+", default=[100, 400], help="tensors per step")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 30; quick 5)")
    # untimed first steps: Horovod's response cache fills at its first; commlib's `auto` tries its
    # candidates on its first (the ring and switchml here: 2 x (1 warm-up + 5 measured) rounds, a
    # step each), once per job. The timed steps are the steady state both then run in
    parser.add_argument("--warmup", type=int, default=16, help="untimed first steps (default 16)")
    parser.add_argument("--algorithm", default=None, help="commlib's algorithm (default: its policy's choice)")
    # Horovod's own figure swings up to 2x from one job to the next on this host: the full run pools more
    parser.add_argument("--rounds", type=int, default=None, help="times each job runs, alternating (default 4; quick 2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", choices=JOBS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (5 if args.quick else 30)
    args.rounds = args.rounds or (2 if args.quick else 4)
    args.ranks = args.ranks or ([2] if args.quick else [2, 4, 8])
    if args.worker:
        return worker(args)
    if not common.horovod_built():
        raise SystemExit("bench_overhead needs Horovod with its torch ops (pip install horovod[pytorch])")
    rows, results = [], {}
    for ranks in args.ranks:
        pooled = {}
        for _ in range(args.rounds):
            for job in JOBS:
                payload = common.launch(ranks, HERE / "bench_overhead.py", "--worker", f"--job={job}",
                                        f"--steps={args.steps}", f"--warmup={args.warmup}",
                                        *([f"--algorithm={args.algorithm}"] if args.algorithm else []),
                                        "--tensors", *map(str, args.tensors), horovod=job == "horovod")[0]
                for count, runs in payload["results"].items():
                    into = pooled.setdefault(count, {})
                    for label, values in runs.items():
                        into[label] = sorted(set(into.get(label, []) + values)) if label == "algorithms" else \
                            into.get(label, []) + values
        results[ranks] = pooled
        for count, runs in pooled.items():
            m = {label: statistics.median(runs[label]) for label in CONFIGS}
            rows.append(f"| {ranks} | {count} | {1000 * m['horovod']:.1f} | {1000 * m['commlib']:.1f} | "
                        f"{1000 * m['ddp default']:.1f} | {m['commlib'] / m['horovod']:.2f}x | "
                        f"{m['commlib'] / m['ddp default']:.2f}x | {', '.join(runs['algorithms'])} |")
    markdown = (f"A step of many small tensors (16 to 4096 floats each) on loopback, median of {args.steps} steps "
                f"x {args.rounds} rounds after {args.warmup} untimed (commlib's `auto` tries its candidates on its "
                "first 13, Horovod's response cache fills at its first): Horovod (its response cache on) in its "
                "own job, commlib and DDP's default in another, interleaved step by step; the jobs alternate "
                "(Horovod's idle background thread keeps a core busy: it would tax a library beside it). "
                "Horovod and commlib with one "
                "allreduce_async per tensor, waiting for all; DDP's default the backward of a model with "
                "those tensors as parameters.\n\n"
                "| ranks | tensors | horovod ms | commlib ms | ddp default ms | commlib vs horovod | "
                "commlib vs ddp | commlib's algorithm |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    settings = {k: getattr(args, k) for k in ("quick", "ranks", "tensors", "steps", "warmup", "algorithm", "rounds")}
    common.save("overhead", settings, results, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
