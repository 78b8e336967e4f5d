"""Does `auto` pick what is fastest? `auto` against every fixed uncompressed commlib configuration of
bench_training's workloads, in the same jobs, over several jobs.

One job of bench_training (4 emulated hosts, --rate links) has `auto` and the fixed configurations
of one workload take turns in --rounds rounds; on this shared 2-core host the ratio of two
configurations moves by 10% and more from one job to the next (rounds of the same job: 0.78-1.43x),
so one job says little, and a median of a few jobs' ratios little more (a step's samples/s moves by 2x
from one step to the next: a 30-step median is known to about 5%). Each workload (dense; sparse at each
--zipf) runs --jobs jobs; the ratio is auto's median samples/s over the fastest fixed configuration's,
both over every timed step of every job (uncompressed: commlib's configurations without a compressor;
Horovod's baseline runs too, bench_training keeps it first), and the same ratio per job beside it.

    python benchmarks/bench_auto.py [--quick] [--jobs 3] [--rounds 6] [--steps 60] [--zipf 0.8 1.1 1.4]
Results: benchmarks/results/auto.json and RESULTS.md. Needs root (namespaces, tc).
"""
import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_training  # noqa: E402
import common  # noqa: E402
import netem  # noqa: E402


def fixed(workload):
    """The labels of a workload's fixed uncompressed commlib configurations (bench_training.CONFIGS)."""
    return [label for w, label, how in bench_training.CONFIGS
            if w == workload and how[0] == "commlib" and how[1] != "*=auto" and how[2] is None and ":" not in how[1]]


def auto_label(workload):
    return next(label for w, label, how in bench_training.CONFIGS if w == workload and how[:2] == ("commlib", "*=auto"))


def kept_of(auto):
    """'switchml (of ring, switchml)': a tensor's kept candidate and those it tried (commlib.trials)."""
    return f"{auto.get('choice', 'trying')} (of {', '.join(sorted(auto.get('candidates') or auto.get('times', ())))})"


def job(args, workload, zipf, labels, auto):
    """One bench_training job of the workload's configurations `labels` (`auto` the last): {label: each
    timed step's samples/s}, auto's trials at the end (commlib.records()[name]["auto"] by tensor) and
    the algorithms its tensors ran at the rounds' ends."""
    argv = ["--workload", workload, "--zipf", str(zipf), "--configs", ",".join(labels), "--rounds", str(args.rounds),
            "--workers", str(args.workers), "--rate", args.rate, "--steps", str(args.steps),
            "--warmup", str(common.WARMUP_STEPS)] + (["--quick"] if args.quick else [])   # quick too: auto's trials
    run = bench_training.main_arguments(argv)
    payload = bench_training._run(run, run.workers)
    results = payload["results"]
    rates = {label: [rate * payload["size"] for rate in results[label]["rates"]] for label in labels}
    ran = results[auto]
    return rates, ran["auto_trials"] or {}, ran["commlib_algorithms"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bench_training's quick model, one job, Zipf 1.1 "
                        "(its warm-up stays: auto tries its candidates in it)")
    parser.add_argument("--jobs", type=int, default=None, help="jobs per workload (default 3; quick 1)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds the configurations take turns in, per job")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration and job "
                        "(default 60; quick 12)")
    parser.add_argument("--zipf", type=float, nargs="+", default=None, help="the sparse workload's exponents")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", default="500mbit")
    args = parser.parse_args(argv)
    args.jobs = args.jobs or (1 if args.quick else 3)
    args.steps = args.steps or (12 if args.quick else 60)
    args.zipf = args.zipf or ([1.1] if args.quick else [0.8, 1.1, 1.4])
    ok, why = netem.available()
    if not ok:
        raise SystemExit(f"bench_auto: {why}")
    workloads = [("dense", 1.1)] + [("sparse", z) for z in args.zipf]   # the dense model has no Zipf
    rows, results = [], {}
    for workload, zipf in workloads:
        key = workload if workload == "dense" else f"sparse, zipf {zipf:g}"
        fixed_labels, auto = fixed(workload), auto_label(workload)
        jobs = []
        for index in range(args.jobs):
            print(f"== {key}: job {index + 1} of {args.jobs}", flush=True)
            rates, trials, algorithms = job(args, workload, zipf, fixed_labels + [auto], auto)
            medians = {label: statistics.median(samples) for label, samples in rates.items()}
            best = max(fixed_labels, key=medians.get)
            jobs.append({"rates": rates, "medians": medians, "fastest_fixed": best, "auto_trials": trials,
                         "auto_algorithms": algorithms,
                         "ratio": medians[auto] / medians[best]})
        pooled = {label: statistics.median(rate for j in jobs for rate in j["rates"][label]) for label in jobs[0]["rates"]}
        best = max(fixed_labels, key=pooled.get)
        ratio = pooled[auto] / pooled[best]
        results[key] = {"jobs": jobs, "medians": pooled, "fastest_fixed": best, "ratio": ratio}
        kept = "; ".join(sorted({kept_of(trial) for j in jobs for trial in j["auto_trials"].values()}))
        ran = ", ".join(sorted({a for j in jobs for a in j["auto_algorithms"]}))
        ratios = " ".join(f"{j['ratio']:.2f}x" for j in jobs)
        rows.append(f"| {key} | {best} | {ratio:.2f}x | {ratios} | {kept} | {ran} |")
    markdown = (f"`auto` against the fastest fixed uncompressed commlib configuration of the same job (bench_training: "
                f"{args.workers} emulated hosts, links {args.rate} each way, the configurations in {args.rounds} rounds), "
                f"{args.jobs} job(s) of {args.steps} timed steps per workload: auto's median samples/s over the fastest "
                "fixed one's, over every timed step of every job, and per job. Fixed: " +
                "; ".join(f"{w}: {', '.join(fixed(w))}" for w in ("dense", "sparse")) + ". Auto kept: what each tensor's "
                "records showed at the job's end, of the candidates it tried (trying: its trials under way); ran: "
                "the algorithms its tensors ran at a round's end, the warm-up's rounds too (where one ends during "
                "a trial, the candidate under trial shows there).\n\n"
                "| workload | fastest fixed | auto / fastest fixed | per job | auto kept | ran |\n"
                "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    settings = {"quick": args.quick, "jobs": args.jobs, "rounds": args.rounds, "steps": args.steps,
                "zipf": args.zipf, "workers": args.workers, "rate": args.rate}
    common.save("auto", settings, results, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
