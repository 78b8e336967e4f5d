"""What reducing DDP buckets per parameter costs: a model of many small tensors on loopback.

commlib.torch.ddp_comm_hook hands the core one tensor per parameter (the policy sees parameter
names, PowerSGD sees matrices); the alternative hands it the bucket's flat buffer under one name
(bench_ddp.bucket_hook). With small tensors and no network bottleneck, the per-tensor cost of the
core (staging, planning, one controller message each) is what remains. Two local ranks (torchrun's
environment), DDP's default allreduce as the reference, the three interleaved step by step.

    python benchmarks/bench_ddp_overhead.py [--quick] [--layers 40] [--steps 40]
Results: benchmarks/results/ddp_overhead.json and RESULTS.md.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

CONFIGS = ["ddp default", "commlib ring, per parameter", "commlib ring, one buffer per bucket"]


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commlib
    import commlib.torch as cl
    from bench_ddp import bucket_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    commlib.init()
    runs = {}
    for label in CONFIGS:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
        model = DDP(net)
        if label != "ddp default":
            hook = cl.ddp_comm_hook if "per parameter" in label else bucket_hook
            model.register_comm_hook(cl.CommlibState(net.named_parameters(), algorithm="ring"), hook)
        runs[label] = (model, [], [])
    names = [n for n, _ in net.named_parameters()]   # every configuration's model has the same names
    for step in range(args.warmup + args.steps):
        x = torch.randn(32, args.width)
        for label, (model, times, breakdowns) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            model(x).pow(2).mean().backward()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
                if label != "ddp default":
                    breakdowns.append(common.step_breakdown(commlib.records(), names))
    if dist.get_rank() == 0:
        common.emit({"tensors": 2 * args.layers, "floats": sum(p.numel() for p in net.parameters()),
                     "results": {label: times for label, (_, times, _) in runs.items()},
                     "breakdowns": {label: b for label, (_, _, b) in runs.items()}})
    commlib.shutdown()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps: seconds")
    parser.add_argument("--layers", type=int, default=40, help="Linear layers (two tensors each)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None, help="timed backward passes (default 40; quick 5)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (5 if args.quick else 40)
    if args.worker:
        return worker(args)
    forwarded = [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "steps", "warmup")]
    payload = common.local_result(__file__, forwarded)
    medians = {label: statistics.median(times) for label, times in payload["results"].items()}
    base = medians[CONFIGS[0]]
    verdicts = {label: common.bottleneck(m, payload["breakdowns"][label], "n/a: loopback", None,
                                         unmeasured="n/a: DDP's own allreduce") for label, m in medians.items()}
    rows = [f"| {label} | {1000 * m:.1f} | +{1000 * (m - base):.1f} | {verdicts[label]} |"
            for label, m in medians.items()]
    markdown = (f"Backward pass (with its reduction) of {payload['tensors']} small tensors ({payload['floats']:,} "
                f"floats), 2 ranks on loopback, median of {args.steps} interleaved steps: the per-tensor cost of "
                "reducing DDP buckets per parameter. " + common.BOTTLENECK_RULE + " Here the workers' share holds "
                "the core's per-tensor work outside processing and transfer (negotiation, queueing).\n\n"
                "| configuration | ms per backward | vs DDP default | bottleneck |\n"
                "|---|---|---|---|\n" + "\n".join(rows) + "\n")
    settings = {k: getattr(args, k) for k in ("quick", "layers", "width", "steps", "warmup")}
    common.save("ddp_overhead", settings, {"medians_s": medians, "bottleneck": verdicts, **payload}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
