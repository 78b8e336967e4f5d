"""What reducing DDP buckets costs in commlib's hook: a model of many small tensors on loopback.

commlib.torch.ddp_comm_hook hands the core one tensor per parameter on DDP's first step (the policy
sees parameter names, PowerSGD sees matrices), and from the second a bucket whose parameters follow
one rule without a compressor as one tensor (CommlibState's whole_buckets); `whole_buckets=False` keeps every
bucket per parameter. With small tensors and no network bottleneck, the per-tensor cost of the core
(staging, planning, negotiation) is what remains. Two local ranks (torchrun's environment), DDP's
default allreduce as the reference, the three interleaved step by step.

Many buckets: a wider model in DDP buckets of 0.1 MB (about 20 a backward), where each bucket's
collective and negotiation cost more than its bytes; commlib at its default cycle time, and in a
job of its own with `COMMLIB_AUTOTUNE=1` (timed once autotune chose its values), each against
DDP's default in the same job.

    python benchmarks/bench_ddp_overhead.py [--quick] [--layers 40] [--steps 40]
Results: benchmarks/results/ddp_overhead.json and RESULTS.md.
"""
import argparse
import csv
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

CONFIGS = ["ddp default", "commlib ring", "commlib ring, per parameter"]
MANY = {"width": 128, "bucket_mb": 0.1}   # the many-buckets model: 40 Linear(128, 128) in 0.1 MB buckets


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commlib
    import commlib.torch as cl

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tuned = args.autotune_log is not None
    if tuned:   # short samples: the tuner's whole search in seconds
        commlib.init(autotune=True, autotune_sample_s=args.sample_s, autotune_log=args.autotune_log)
    else:
        commlib.init()
    runs = {}
    for label in args.configs.split(";"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
        model = DDP(net, bucket_cap_mb=args.bucket_mb) if args.bucket_mb else DDP(net)
        state = None
        if label != "ddp default":
            state = cl.CommlibState(net.named_parameters(), algorithm="ring", whole_buckets="per parameter" not in label)
            model.register_comm_hook(state, cl.ddp_comm_hook)
        runs[label] = (model, state, [], [])
    deadline, step, timed, chose = time.monotonic() + args.tune_limit_s, 0, 0, not tuned
    while timed < args.steps:
        x = torch.randn(32, args.width)
        chose = chose or _tuner_chose(args.autotune_log, deadline)
        warm = step >= args.warmup and chose
        for label, (model, state, times, breakdowns) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            model(x).pow(2).mean().backward()
            if warm:
                times.append(time.perf_counter() - start)
                if state is not None:
                    breakdowns.append(common.step_breakdown(commlib.records(), state.record_names()))
        step, timed = step + 1, timed + warm
    if dist.get_rank() == 0:
        common.emit({"tensors": 2 * args.layers, "floats": sum(p.numel() for p in net.parameters()),
                     "buckets": state.buckets_reduced / step, "search_steps": step - args.steps,
                     "chosen": _chosen(args.autotune_log) if tuned else None,
                     "results": {label: times for label, (_, _, times, _) in runs.items()},
                     "breakdowns": {label: b for label, (_, _, _, b) in runs.items()}})
    commlib.shutdown()
    dist.destroy_process_group()


def _tuner_chose(log, deadline):
    """Whether autotune chose its values (rank 0 reads its log, and gives up past the deadline), the
    same on every rank."""
    import torch
    import torch.distributed as dist
    verdict = torch.tensor([0])   # 0: not yet, 1: chosen, 2: given up
    if dist.get_rank() == 0:
        verdict[0] = 1 if _chosen(log) is not None else 2 if time.monotonic() > deadline else 0
    dist.broadcast(verdict, 0)
    if verdict.item() == 2:
        raise SystemExit(f"autotune chose nothing within --tune-limit-s; its log so far: {log}")
    return verdict.item() == 1


def _chosen(log):
    """Autotune's choice from its CSV log ({knob: value}), or None before it chose."""
    if not Path(log).exists():
        return None
    with open(log, newline="") as file:
        rows = list(csv.reader(file))
    chosen = [row for row in rows if row and row[0] == "chosen"]
    return dict(zip(rows[0][1:], chosen[0][1:])) if chosen else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps: seconds")
    parser.add_argument("--layers", type=int, default=40, help="Linear layers (two tensors each)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None, help="timed backward passes (default 40; quick 5)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sample-s", type=float, default=None,
                        help="autotune's sample (COMMLIB_AUTOTUNE_SAMPLE_S; default 0.25 s, quick 0.05)")
    parser.add_argument("--tune-limit-s", type=float, default=240.0, help="most seconds autotune may take to choose")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--configs", default=";".join(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--bucket-mb", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--autotune-log", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (5 if args.quick else 40)
    args.sample_s = args.sample_s or (0.05 if args.quick else 0.25)
    if args.worker:
        return worker(args)
    forwarded = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("layers", "steps", "warmup", "sample_s",
                                                                          "tune_limit_s")]
    one = common.local_result(__file__, forwarded + [f"--width={args.width}"])
    many = [f"--width={MANY['width']}", f"--bucket-mb={MANY['bucket_mb']}"]
    default = common.local_result(__file__, forwarded + many + ["--configs=ddp default;commlib ring"])
    with tempfile.TemporaryDirectory() as tmp:
        tuned = common.local_result(__file__, forwarded + many + ["--configs=ddp default;commlib ring, autotuned",
                                                                  f"--autotune-log={tmp}/autotune.csv"],
                                    timeout=args.tune_limit_s + 300)
    medians = {label: statistics.median(times) for label, times in one["results"].items()}
    base = medians[CONFIGS[0]]
    verdicts = {label: common.bottleneck(m, one["breakdowns"][label], "n/a: loopback", None,
                                         unmeasured="n/a: DDP's own allreduce") for label, m in medians.items()}
    rows = [f"| {label} | {1000 * m:.1f} | +{1000 * (m - base):.1f} ({m / base:.2f}x) | {verdicts[label]} |"
            for label, m in medians.items()]
    many_medians = {("default cycle", label): statistics.median(times) for label, times in default["results"].items()}
    many_medians.update({("autotuned", label): statistics.median(times) for label, times in tuned["results"].items()})
    chosen = tuned["chosen"]
    markdown = (f"Backward pass (with its reduction) of {one['tensors']} small tensors ({one['floats']:,} "
                f"floats), 2 ranks on loopback, median of {args.steps} interleaved steps after {args.warmup}: the "
                "per-tensor cost of commlib's DDP hook, with its buckets whole (the default from the second step) "
                "and per parameter. " + common.BOTTLENECK_RULE + " Here the workers' share holds "
                "the core's per-tensor work outside processing and transfer (negotiation, queueing).\n\n"
                "| configuration | ms per backward | vs DDP default | bottleneck |\n"
                "|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
                f"Many buckets: {default['tensors']} tensors ({default['floats']:,} floats) in DDP buckets of "
                f"{MANY['bucket_mb']} MB ({default['buckets']:.0f} a backward), commlib at its default cycle time "
                f"(1 ms) and, in a job of its own, with COMMLIB_AUTOTUNE=1 (samples of {args.sample_s} s; timed after "
                f"its {tuned['search_steps']} steps of warm-up and search, once it chose a fusion threshold of "
                f"{int(chosen['fusion_threshold']) >> 20} MiB and a cycle time of {float(chosen['cycle_time_ms']):g} "
                "ms), each against DDP's default in the same job.\n\n"
                "| job | configuration | ms per backward | vs DDP default |\n"
                "|---|---|---|---|\n" + "\n".join(
                    f"| {job} | {label} | {1000 * m:.1f} | {m / many_medians[(job, 'ddp default')]:.2f}x |"
                    for (job, label), m in many_medians.items()) + "\n")
    settings = {k: getattr(args, k) for k in ("quick", "layers", "width", "steps", "warmup", "sample_s")}
    common.save("ddp_overhead", settings, {"medians_s": medians, "bottleneck": verdicts, **one,
                                           "many_buckets": {"default cycle": default, "autotuned": tuned}}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
