"""What a step of many small tensors costs: commlib against Horovod (its response cache on, the
default) and DDP's default, on loopback, where the per-tensor cost of each library is what remains.

Each step reduces 100 or 400 tensors of 16 to 4096 floats (16 << (i % 9)): Horovod and commlib
get one allreduce_async per tensor (as their DistributedOptimizers do) and wait for all; DDP runs
the backward of a model whose parameters are those tensors (its buckets, negotiated once). The
three run in the same processes (horovodrun), interleaved step by step; medians per rank count.

    python benchmarks/bench_overhead.py [--quick] [--ranks 2 4] [--tensors 100 400] [--steps 30]
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
from launch import free_port  # noqa: E402  (tests/launch.py, on the path through common)

CONFIGS = ("horovod", "commlib", "ddp default")


def sizes(count):
    return [16 << (i % 9) for i in range(count)]


def worker(args):
    import horovod.torch as hvd
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commlib

    torch.set_num_threads(1)
    hvd.init()
    port = int(hvd.broadcast(torch.tensor([free_port() if hvd.rank() == 0 else 0]), 0, name="port"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(), world_size=hvd.size())
    commlib.init()
    out = {}
    for count in args.tensors:
        tensors = [torch.randn(n) for n in sizes(count)]
        model = DDP(torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in tensors]))

        def horovod():
            for h in [hvd.allreduce_async(t, name=f"h{count}.{i}") for i, t in enumerate(tensors)]:
                hvd.synchronize(h)

        def ours():
            for h in [commlib.allreduce_async(t, name=f"c{count}.{i}", algorithm=args.algorithm)
                      for i, t in enumerate(tensors)]:
                commlib.synchronize(h)

        def ddp():
            sum(p.sum() for p in model.module).backward()

        runs = {"horovod": (horovod, []), "commlib": (ours, []), "ddp default": (ddp, [])}
        for step in range(args.warmup + args.steps):
            for label, (fn, times) in runs.items():
                dist.barrier()
                start = time.perf_counter()
                fn()
                if step >= args.warmup:
                    times.append(time.perf_counter() - start)
        out[count] = {label: times for label, (_, times) in runs.items()}
        out[count]["algorithms"] = sorted({r["algorithm"] for n, r in commlib.records().items()
                                           if n.startswith(f"c{count}.")})
    if hvd.rank() == 0:
        common.emit({"size": hvd.size(), "results": out})
    commlib.shutdown()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps, 2 ranks: seconds")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts (default 2 4; quick 2)")
    parser.add_argument("--tensors", type=int, nargs="+", default=[100, 400], help="tensors per step")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 30; quick 5)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--algorithm", default=None, help="commlib's algorithm (default: its policy's choice)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (5 if args.quick else 30)
    args.ranks = args.ranks or ([2] if args.quick else [2, 4])
    if args.worker:
        return worker(args)
    if not common.horovod_built():
        raise SystemExit("bench_overhead needs Horovod with its torch ops (pip install horovod[pytorch])")
    rows, results = [], {}
    for ranks in args.ranks:
        payload = common.launch(ranks, HERE / "bench_overhead.py", "--worker", f"--steps={args.steps}",
                                f"--warmup={args.warmup}", *([f"--algorithm={args.algorithm}"] if args.algorithm else []),
                                "--tensors", *map(str, args.tensors))[0]
        results[ranks] = payload["results"]
        for count, runs in payload["results"].items():
            m = {label: statistics.median(runs[label]) for label in CONFIGS}
            rows.append(f"| {ranks} | {count} | {1000 * m['horovod']:.1f} | {1000 * m['commlib']:.1f} | "
                        f"{1000 * m['ddp default']:.1f} | {m['commlib'] / m['horovod']:.2f}x | "
                        f"{m['commlib'] / m['ddp default']:.2f}x | {', '.join(runs['algorithms'])} |")
    markdown = (f"A step of many small tensors (16 to 4096 floats each) on loopback, median of {args.steps} "
                "interleaved steps in the same processes: Horovod (its response cache on) and commlib with one "
                "allreduce_async per tensor, waiting for all; DDP's default the backward of a model with "
                "those tensors as parameters.\n\n"
                "| ranks | tensors | horovod ms | commlib ms | ddp default ms | commlib vs horovod | "
                "commlib vs ddp | commlib's algorithm |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    settings = {k: getattr(args, k) for k in ("quick", "ranks", "tensors", "steps", "warmup", "algorithm")}
    common.save("overhead", settings, results, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
