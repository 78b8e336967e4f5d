"""What reducing DDP buckets costs in commlib's hook: a model of many small tensors on loopback.

commlib.torch.ddp_comm_hook hands the core one tensor per parameter on DDP's first step (the policy
sees parameter names, PowerSGD sees matrices), and from the second a bucket whose parameters follow
one rule without a compressor as one tensor (CommlibState's whole_buckets); `whole_buckets=False` keeps every
bucket per parameter. With small tensors and no network bottleneck, the per-tensor cost of the core
(staging, planning, negotiation) is what remains. Two local ranks (torchrun's environment), DDP's
default allreduce as the reference, the three interleaved step by step.

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

CONFIGS = ["ddp default", "commlib ring", "commlib ring, per parameter"]


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commlib
    import commlib.torch as cl

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    commlib.init()
    runs = {}
    for label in CONFIGS:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
        model = DDP(net)
        state = None
        if label != "ddp default":
            state = cl.CommlibState(net.named_parameters(), algorithm="ring", whole_buckets="per parameter" not in label)
            model.register_comm_hook(state, cl.ddp_comm_hook)
        runs[label] = (model, state, [], [])
    for step in range(args.warmup + args.steps):
        x = torch.randn(32, args.width)
        for label, (model, state, times, breakdowns) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            model(x).pow(2).mean().backward()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
                if state is not None:
                    breakdowns.append(common.step_breakdown(commlib.records(), state.record_names()))
    if dist.get_rank() == 0:
        common.emit({"tensors": 2 * args.layers, "floats": sum(p.numel() for p in net.parameters()),
                     "results": {label: times for label, (_, _, times, _) in runs.items()},
                     "breakdowns": {label: b for label, (_, _, _, b) in runs.items()}})
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
    rows = [f"| {label} | {1000 * m:.1f} | +{1000 * (m - base):.1f} ({m / base:.2f}x) | {verdicts[label]} |"
            for label, m in medians.items()]
    markdown = (f"Backward pass (with its reduction) of {payload['tensors']} small tensors ({payload['floats']:,} "
                f"floats), 2 ranks on loopback, median of {args.steps} interleaved steps after {args.warmup}: the "
                "per-tensor cost of commlib's DDP hook, with its buckets whole (the default from the second step) "
                "and per parameter. " + common.BOTTLENECK_RULE + " Here the workers' share holds "
                "the core's per-tensor work outside processing and transfer (negotiation, queueing).\n\n"
                "| configuration | ms per backward | vs DDP default | bottleneck |\n"
                "|---|---|---|---|\n" + "\n".join(rows) + "\n")
    settings = {k: getattr(args, k) for k in ("quick", "layers", "width", "steps", "warmup")}
    common.save("ddp_overhead", settings, {"medians_s": medians, "bottleneck": verdicts, **payload}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
