"""DistributedDataParallel on the emulated network: DDP's own allreduce vs commlib's comm hook.

N emulated hosts (benchmarks/netem.py, every worker link shaped to --rate each way), one
torch.distributed job as torchrun would start it (rank 0's store, gloo), a commlib-switch on an
unshaped host. Every configuration trains the dense MLP of bench_training.py from the same start
in the same processes, the configurations taking turns step by step:
  DDP default (gloo ring allreduce), commlib's hook with switchml and with `auto` (buckets whole
  from the second step, the default), switchml with every bucket per parameter (whole_buckets=False),
  PyTorch's powerSGD_hook and commlib's powersgd over the ring, both rank 4 after 2 plain steps,
  both with the model in one DDP bucket (see worker()).
Rank 0 prints samples/s per configuration; each configuration's loss curve is kept.

    python benchmarks/bench_ddp.py [--quick] [--workers 4] [--rate 500mbit] [--steps 20]
Results: benchmarks/results/ddp.json, ddp.png and RESULTS.md. Needs root (namespaces, tc).
"""
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

POWERSGD_RANK, POWERSGD_START = 4, 2
CONFIGS = ["ddp default", "commlib switchml", "commlib auto", "commlib switchml, per parameter",
           "pytorch powersgd", "commlib powersgd"]


# -- inside each rank (its own namespace) -------------------------------------------------------------
def register(label, model, net):
    """Give the DDP model `label`'s comm hook; its CommlibState (None for PyTorch's own hooks)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    import commlib.torch as cl
    if label == "ddp default":
        return None
    if label == "pytorch powersgd":
        state = powersgd.PowerSGDState(process_group=dist.group.WORLD, matrix_approximation_rank=POWERSGD_RANK,
                                       start_powerSGD_iter=POWERSGD_START, use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        return None
    if label == "commlib powersgd":
        spec = f"powersgd(rank={POWERSGD_RANK},start_iter={POWERSGD_START})"
        state = cl.CommlibState(net.named_parameters(), algorithm="ring", compression=spec)
    elif label == "commlib switchml, per parameter":
        state = cl.CommlibState(net.named_parameters(), policy="*=switchml", whole_buckets=False)
    else:
        policy = {"commlib switchml": "*=switchml", "commlib auto": "*=auto"}[label]
        state = cl.CommlibState(net.named_parameters(), policy=policy)
    model.register_comm_hook(state, cl.ddp_comm_hook)
    return state   # its record_names(): prefixed after the first state, each configuration's records apart


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commlib
    from commlib.api import runtime

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    commlib.init()
    rt = runtime()
    gen = torch.Generator().manual_seed(1234)                 # the teacher: the same on every rank
    teacher = torch.randn(args.features, 10, generator=gen)
    runs, states = {}, {}
    for label in CONFIGS:
        torch.manual_seed(0)
        h = args.hidden
        net = torch.nn.Sequential(torch.nn.Linear(args.features, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                                  torch.nn.ReLU(), torch.nn.Linear(h, 10))
        # PyTorch's powerSGD_hook on gloo launches each bucket's second allreduce from a completion
        # callback, in another order on each rank when there are several buckets (a collective
        # mismatch): both PowerSGD configurations get the model in one bucket
        model = DDP(net, bucket_cap_mb=64) if "powersgd" in label else DDP(net)
        states[label] = register(label, model, net)
        runs[label] = (net, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), [], [], [], [])
    # the configurations take turns step by step, so a change of load on this shared machine
    # falls on all of them alike
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.features, generator=torch.Generator().manual_seed(step * 1000 + rank))
        y = (x @ teacher).argmax(dim=1)
        for label, (net, model, optimizer, rates, losses, breakdowns, sent) in runs.items():
            elapsed, loss, probe = common.train_step(model, optimizer, x, y,
                                                     rt.backends if label.startswith("commlib") else None)
            losses.append(loss)
            if step >= args.warmup:
                rates.append(args.batch / elapsed)
                sent.append(probe.tx_bytes)
                if label.startswith("commlib"):
                    breakdowns.append(common.step_breakdown(commlib.records(), states[label].record_names(),
                                                            probe.server_s))
    out = {}
    for label, (net, model, optimizer, rates, losses, breakdowns, sent) in runs.items():
        if rank == 0:
            total = size * statistics.fmean(rates)
            print(f"{label}: {total:.1f} samples/s on {size} workers, loss {losses[0]:.4f} -> {losses[-1]:.4f}",
                  flush=True)
        out[label] = {"parameters": sum(p.numel() for p in net.parameters()), "rates": rates, "losses": losses,
                      "breakdowns": breakdowns, "tx_bytes": sent, "auto_trials": _trials(states[label])}
    if rank == 0:
        common.emit({"size": size, "results": out})
    commlib.shutdown()
    dist.destroy_process_group()


def _trials(state):
    """auto's trials by name: each record's once (a whole bucket's, or its parameters' where they keep
    their own: CommlibState's buckets planned by density)."""
    import commlib
    records, trials = commlib.records(), {}
    for name in (state.record_names() + list(state.names.values())) if state else []:
        auto = records.get(name, {}).get("auto")
        if auto and not any(auto is seen for seen in trials.values()):
            trials[name] = auto
    return trials


# -- the launcher -------------------------------------------------------------------------------------
def _plot(results, title):
    fig, axes = common.figure(1, 1, figsize=(7, 4))
    common.plot_losses(axes, results)
    fig.suptitle(title, fontsize=9)
    common.save_figure(fig, "ddp")


def main(argv=None):
    parser = common.training_arguments(__doc__, steps=20, warmup=common.WARMUP_STEPS, quick_warmup=POWERSGD_START + 1,
                                       warmup_help="untimed steps, as Horovod's synthetic benchmark (quick: past "
                                                   "PowerSGD's start): `auto` tries its candidates in them")
    args = common.parse_training_arguments(parser, argv)
    if args.worker:
        return worker(args)
    payload = common.switch_job(args, Path(__file__), len(CONFIGS))
    n, results = payload["size"], payload["results"]
    first = results[CONFIGS[0]]
    rows = []
    for label in CONFIGS:
        r = results[label]
        rates = common.rate_cells(r, n, first)
        losses = r["losses"]
        step_s = args.batch * n / r["total_samples_per_s"]
        r["link"] = statistics.median(r["tx_bytes"]) * 8 / (common.rate_bps(args.rate) * step_s)
        r["bottleneck"] = common.bottleneck(step_s, r["breakdowns"], r["link"],
                                            unmeasured="n/a: DDP's own allreduce")
        rows.append(f"| {label} | {rates} | {losses[0]:.4f} -> {statistics.fmean(losses[-3:]):.4f} | "
                    f"{r['bottleneck']} |")
    title = (f"DDP, {n} emulated hosts, links {args.rate} each way, MLP {results[CONFIGS[0]]['parameters']:,} "
             f"parameters, batch {args.batch} per worker, {args.steps} timed steps after {args.warmup}")
    _plot(results, title)
    from commlib import analyze   # the table of auto's trials
    markdown = (f"{title}. Samples/s = mean over the timed steps x workers; ratios against DDP's default "
                "allreduce (gloo ring) in the same job. PowerSGD: rank 4, plain allreduce for the first "
                f"{POWERSGD_START} steps, error feedback and warm start, PyTorch's hook vs commlib's over the ring, both "
                "with the model in one DDP bucket (PyTorch's hook on gloo mismatches collectives with several). "
                "The loss is the mean over ranks at the first step and over the last three. "
                + common.BOTTLENECK_RULE + "\n\n"
                "Median: the median step's rate x workers.\n\n"
                "| configuration | samples/s | vs DDP default | median samples/s | vs DDP default (median) | "
                "loss first -> last | bottleneck |\n"
                "|---|---|---|---|---|---|---|\n"
                + "\n".join(rows)
                + "".join(f"\n\n{label}, " + analyze.format_trials(results[label]["auto_trials"])
                          for label in CONFIGS if results[label].get("auto_trials"))
                + "\n\n![ddp](results/ddp.png)\n")
    settings = common.training_settings(args)
    common.save("ddp", settings, results, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
