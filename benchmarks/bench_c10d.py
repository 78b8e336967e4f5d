"""commlib as a torch.distributed backend on the emulated network, against Gloo in the same job.

N emulated hosts (benchmarks/netem.py, every worker link shaped to --rate each way), one torchrun-like
job whose default process group is `dist.init_process_group("commlib")` (its all_reduce through
commlib's core: dense float32 to the switch, here a commlib-switch on an unshaped host), and a Gloo
group of the same ranks. The configurations train the dense MLP of bench_training.py from the same
start in the same processes, taking turns step by step:
  DDP on Gloo (no hook), DDP on the commlib backend (no hook), DDP on Gloo with commlib's comm hook
  (the hook path, for comparison), FSDP2 (`fully_shard` per layer) on Gloo, on the commlib backend and
  on it with int8 reduce-scatter and all-gather (COMMLIB_C10D_INT8's, on a group of its own here).
Rank 0 prints samples/s per configuration; each configuration's loss curve is kept.

    python benchmarks/bench_c10d.py [--quick] [--workers 4] [--rate 500mbit] [--steps 20]
Results: benchmarks/results/c10d.json, c10d.png and RESULTS.md. Needs root (namespaces, tc).
"""
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

CONFIGS = ["DDP on gloo", "DDP on commlib backend", "DDP on gloo + commlib hook", "FSDP2 on gloo",
           "FSDP2 on commlib backend", "FSDP2 on commlib backend, int8"]
PEERS = {"DDP on commlib backend": "DDP on gloo", "DDP on gloo + commlib hook": "DDP on gloo",
         "FSDP2 on commlib backend": "FSDP2 on gloo", "FSDP2 on commlib backend, int8": "FSDP2 on gloo"}


# -- inside each rank (its own namespace) -------------------------------------------------------------
def build(label, args, gloo, int8):
    """(net, the module to train) for `label`, from the same start as every other."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commlib.torch as cl
    torch.manual_seed(0)
    h = args.hidden
    net = torch.nn.Sequential(torch.nn.Linear(args.features, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                              torch.nn.ReLU(), torch.nn.Linear(h, 10))
    group = (int8 if label.endswith("int8") else dist.group.WORLD) if "commlib backend" in label else gloo
    if label.startswith("FSDP2"):
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in (net[0], net[2], net[4], net):
            fully_shard(layer, mesh=mesh)
        return net, net
    model = DDP(net, process_group=group)
    if label.endswith("commlib hook"):
        model.register_comm_hook(cl.CommlibState(net.named_parameters()), cl.ddp_comm_hook)
    return net, model


def worker(args):
    import torch
    import torch.distributed as dist

    import commlib
    import commlib.torch  # noqa: F401  (registers the backend)
    from commlib.api import runtime

    torch.set_num_threads(1)
    dist.init_process_group("commlib")
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    int8 = dist.new_group(backend="commlib")   # its reduce-scatter and all-gather in int8 (ZeRO++'s qgZ, qwZ)
    int8.int8 = {"reduce_scatter", "all_gather"}
    rt = runtime()
    teacher = torch.randn(args.features, 10, generator=torch.Generator().manual_seed(1234))
    runs = {}
    for label in CONFIGS:
        net, model = build(label, args, gloo, int8)
        runs[label] = (net, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), [], [], [])
    # turns step by step: a change of load on this shared machine falls on every configuration alike
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.features, generator=torch.Generator().manual_seed(step * 1000 + rank))
        y = (x @ teacher).argmax(dim=1)
        for label, (net, model, optimizer, rates, losses, sent) in runs.items():
            elapsed, loss, probe = common.train_step(model, optimizer, x, y, rt.backends, group=gloo)
            losses.append(loss)
            if step >= args.warmup:
                rates.append(args.batch / elapsed)
                sent.append(probe.tx_bytes)
    out = {}
    for label, (net, model, optimizer, rates, losses, sent) in runs.items():
        if rank == 0:
            print(f"{label}: {size * statistics.median(rates):.1f} samples/s on {size} workers, "
                  f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        out[label] = {"parameters": sum(p.numel() for p in net.parameters()), "rates": rates, "losses": losses,
                      "tx_bytes": sent}
    out["algorithms"] = sorted({r["algorithm"] for r in commlib.records().values()})
    if rank == 0:
        common.emit({"size": size, "results": out})
    dist.destroy_process_group()


# -- the launcher -------------------------------------------------------------------------------------
def main(argv=None):
    args = common.parse_training_arguments(common.training_arguments(__doc__, steps=20), argv)
    if args.worker:
        return worker(args)
    payload = common.switch_job(args, Path(__file__), len(CONFIGS))
    n, results = payload["size"], payload["results"]
    algorithms = results.pop("algorithms")
    rows = []
    for label in CONFIGS:
        r = results[label]
        r["total_samples_per_s"] = statistics.median(r["rates"]) * n
        peer = PEERS.get(label)
        # per-step ratios, paired: each step's configurations ran back to back
        r["vs_peer"] = statistics.median(a / b for a, b in zip(r["rates"], results[peer]["rates"])) if peer else None
        losses = r["losses"]
        versus = f"{r['vs_peer']:.2f}x {peer}" if peer else "-"
        rows.append(f"| {label} | {r['total_samples_per_s']:.0f} | {versus} | "
                    f"{losses[0]:.4f} -> {statistics.fmean(losses[-3:]):.4f} |")
    title = (f"torch.distributed backends, {n} emulated hosts, links {args.rate} each way, MLP "
             f"{results[CONFIGS[0]]['parameters']:,} parameters, batch {args.batch} per worker, {args.steps} timed steps "
             f"after {args.warmup}")
    fig, axes = common.figure(1, 1, figsize=(7, 4))
    common.plot_losses(axes, results)
    fig.suptitle(title, fontsize=9)
    common.save_figure(fig, "c10d")
    markdown = (f"{title}. Samples/s = median over the timed steps x workers; 'vs' = the median of the per-step "
                f"ratios against the peer that ran beside it in the same step. The commlib backend's all_reduce "
                f"went through {', '.join(algorithms)}; FSDP2's reduce-scatter (as an all-to-all and a sum) and "
                f"all-gather go through the backend's Gloo group, by design (README), in int8 with a scale per 256 values where the row says "
                f"so (lossy: see the loss column and commlib/torch/int8_collectives.py).\n\n"
                "| configuration | samples/s | vs | loss first -> last |\n|---|---|---|---|\n"
                + "\n".join(rows) + "\n\n![c10d](results/c10d.png)\n")
    common.save("c10d", common.training_settings(args), results, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
