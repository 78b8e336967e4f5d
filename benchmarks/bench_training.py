"""End-to-end data-parallel training on the emulated network, with and without commlib.

N emulated hosts (benchmarks/netem.py, every worker link shaped to --rate each way), one Horovod job
(Gloo controller, a rendezvous server like horovodrun's on an unshaped host beside the switch). Every
configuration trains the same model from the same start in the same processes, one after the other:
  dense:  an MLP on a teacher task (labels of a fixed random network):
          Horovod's DistributedOptimizer, with fp16 compression, and commlib's over switchml, `auto`
          and PowerSGD (rank 4; its factors summed by the ring or by the switch);
  sparse: an EmbeddingBag(sparse=True) recommendation model whose feature ids follow a Zipf law
          (a few thousand hot rows take most updates, as in the IMC'20 measurements):
          Horovod's own sparse path (allgather of the sparse gradients: the baseline), Horovod with
          sparse_as_dense (dense allreduce), and commlib with the embedding's rows through its sparse
          allgather, omnireduce's row blocks, `auto` (the traffic model's choice) and the hot/cold
          split (hot rows summed by the switch; window and rule: --hotcold-every, --hotcold-rule),
          the rest through switchml. --workload sparse runs only these; --zipf sets the exponent.
Rank 0 prints each in the Horovod synthetic-benchmark format; the loss curve of each configuration is
kept, so a configuration that is fast but does not learn is visible (results/training.png).

    python benchmarks/bench_training.py [--quick] [--workers 4] [--rate 500mbit] [--steps 30]
Results: benchmarks/results/training.json, training.png (training_<workload>.* with --workload) and RESULTS.md.
Needs root (namespaces, tc).
"""
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import netem  # noqa: E402

# (workload, label, how): how = ("horovod", kwargs) or ("commlib", policy, compression)
CONFIGS = [
    ("dense", "horovod", ("horovod", {})),
    ("dense", "horovod fp16", ("horovod", {"compression": "fp16"})),
    ("dense", "commlib switchml", ("commlib", "*=switchml", None)),
    ("dense", "commlib auto", ("commlib", "*=auto", None)),
    # every gradient through PowerSGD, as PyTorch's hook (1-D ones sent whole in the same bucket); its
    # factors over the ring (Horovod), or summed by the switch
    ("dense", "commlib powersgd(rank=4)", ("commlib", "*=ring:powersgd(rank=4)", None)),
    ("dense", "commlib powersgd(rank=4) via switch", ("commlib", "*=switchml:powersgd(rank=4)", None)),
    # the sparse model's baseline first: Horovod's own sparse path (an allgather of indices and values)
    ("sparse", "horovod sparse (allgather)", ("horovod", {})),
    ("sparse", "horovod sparse_as_dense", ("horovod", {"sparse_as_dense": True})),
    ("sparse", "commlib sparse_allgather", ("commlib", "embedding.*=sparse_allgather;*=switchml", None)),
    ("sparse", "commlib omnireduce", ("commlib", "embedding.*=omnireduce;*=switchml", None)),
    ("sparse", "commlib auto (sparse)", ("commlib", "*=auto", None)),
    ("sparse", "commlib hotcold", ("commlib", "embedding.*=hotcold;*=switchml", None)),
    ("sparse", "commlib sparse_allgather + ring", ("commlib", "embedding.*=sparse_allgather;*=ring", None)),
    # the baseline once more at the end: on a shared machine the drift between the two is the noise floor
    ("sparse", "horovod sparse (allgather) again", ("horovod", {})),
]
assert len({label for _, label, _ in CONFIGS}) == len(CONFIGS), "labels key the jobs and results: keep them unique"

RENDEZVOUS = """
import sys, time
from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer
hosts = sys.argv[1]
size = hosts.count(":")
server = RendezvousServer(verbose=0)
port = server.start()
server.init(get_host_assignments(parse_hosts(hosts), size))
print("READY", port, flush=True)
while True:
    time.sleep(3600)
"""


# -- inside each rank (its own namespace) -------------------------------------------------------------
def models(args, torch):
    """(workload -> (build_model(), make_batch(step) -> (inputs, targets), loss_fn)), the same on every
    rank except the data, which is per rank."""
    import horovod.torch as hvd
    gen = torch.Generator().manual_seed(1234)                 # the teacher: the same on every rank
    teacher = torch.randn(args.features, 10, generator=gen)
    row_weight = torch.randn(args.vocab, generator=gen)
    zipf = 1.0 / torch.arange(1, args.vocab + 1, dtype=torch.float64) ** args.zipf
    perm = torch.randperm(args.vocab, generator=gen)          # hot rows scattered over the table

    def dense_model():
        h = args.hidden
        return torch.nn.Sequential(torch.nn.Linear(args.features, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                                   torch.nn.ReLU(), torch.nn.Linear(h, 10))

    def dense_batch(step):
        x = torch.randn(args.batch, args.features, generator=torch.Generator().manual_seed(step * 1000 + hvd.rank()))
        return x, (x @ teacher).argmax(dim=1)

    class Recommender(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.EmbeddingBag(args.vocab, 32, mode="mean", sparse=True)
            self.head = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def forward(self, ids):
            return self.head(self.embedding(ids)).squeeze(1)

    def sparse_batch(step):
        g = torch.Generator().manual_seed(step * 1000 + hvd.rank())
        ids = perm[torch.multinomial(zipf, args.batch * 8, replacement=True, generator=g)].view(args.batch, 8)
        return ids, torch.tanh(2 * row_weight[ids].mean(dim=1))

    # workload -> (model, batch, loss, SGD's lr and momentum)
    return {"dense": (dense_model, dense_batch, torch.nn.functional.cross_entropy, 0.05, 0.9),
            "sparse": (Recommender, sparse_batch, torch.nn.functional.mse_loss, 0.5, 0.0)}


def worker(args):
    import torch

    import horovod.torch as hvd
    import commlib
    import commlib.torch as cl
    from commlib.api import runtime

    hvd.init()
    torch.set_num_threads(1)
    commlib.init()
    rt = runtime()
    workloads = models(args, torch)
    jobs = {}
    for index, (workload, label, how) in enumerate(configs(args)):
        build, batch, loss_fn, lr, momentum = workloads[workload]
        torch.manual_seed(0)
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        # commlib keeps state per tensor name (plans, auto's trials and their reports, hot sets): each
        # configuration's model is a model of its own, so its names are too ("embedding.weight#3" still
        # matches the policies' "embedding.*")
        names = [(f"{name}#{index}", p) for name, p in model.named_parameters()]
        if how[0] == "horovod":
            kwargs = dict(how[1])
            if kwargs.get("compression") == "fp16":
                kwargs["compression"] = hvd.Compression.fp16
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), **kwargs)
        else:
            optimizer = cl.DistributedOptimizer(optimizer, named_parameters=names, policy=how[1], compression=how[2])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        jobs[label] = {"workload": workload, "how": how, "model": model, "optimizer": optimizer, "batch": batch,
                       "loss_fn": loss_fn, "rates": [], "elapsed": [], "losses": [], "algorithms": set(), "breakdowns": [],
                       "tx_bytes": [], "names": [name for name, _ in names]}
    # --rounds > 1 interleaves the configurations, every other round in reverse (A B C C B A A B C ...), so
    # that the shared machine's drift falls on all of them alike and none always follows the same one (a
    # configuration's first steps take what the one before left: omnireduce's threads still busy); each
    # keeps its own model and optimizer across rounds
    total = args.warmup + args.steps
    bounds = [round(i * total / args.rounds) for i in range(args.rounds + 1)]
    for index, (first, last) in enumerate(zip(bounds, bounds[1:])):
        for label, job in list(jobs.items())[::-1 if index % 2 else 1]:
            model, optimizer = job["model"], job["optimizer"]
            for step in range(first, last):
                inputs, targets = job["batch"](step)
                common.unspun(hvd, torch.zeros(1), f"{label}.sync.{step}")   # every rank starts the step together
                with common.Probe(rt.backends if job["how"][0] == "commlib" else None) as probe:
                    start = time.perf_counter()
                    optimizer.zero_grad()
                    loss = job["loss_fn"](model(inputs), targets)
                    loss.backward()
                    optimizer.step()
                    elapsed = time.perf_counter() - start
                job["losses"].append(common.unspun(hvd, loss.detach(), f"{label}.loss.{step}").item())
                job["elapsed"].append(elapsed)
                if step >= args.warmup:
                    job["rates"].append(args.batch / elapsed)
                    job["tx_bytes"].append(probe.tx_bytes)
                    if job["how"][0] == "commlib":
                        job["breakdowns"].append(common.step_breakdown(
                            commlib.records(), job["names"], probe.server_s))
            records = commlib.records()   # by name (a Horovod configuration's have none)
            job["algorithms"] |= {records[name]["algorithm"] + (":" + records[name]["compression"].split("(")[0]
                                                                if records[name]["compression"] else "")
                                  for name in job["names"] if name in records}
            job["trials"] = {name.rpartition("#")[0]: records[name]["auto"] for name in job["names"]   # auto's
                             if records.get(name, {}).get("auto")}
    out = {}
    for label, job in jobs.items():
        rates, model = job["rates"], job["model"]
        if hvd.rank() == 0:
            params = sum(p.numel() for p in model.parameters())
            print(f"Model: {job['workload']} {type(model).__name__} ({params:,} parameters), {label}")
            print(f"Batch size: {args.batch}")
            print(f"Number of CPUs: {hvd.size()}")
            for i, rate in enumerate(rates):
                print(f"Iter #{i}: {rate:.1f} img/sec per CPU")
            mean, std = statistics.fmean(rates), statistics.pstdev(rates)
            print(f"Img/sec per CPU: {mean:.1f} +-{1.96 * std:.1f}")
            print(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * mean:.1f} +-{1.96 * std * hvd.size() ** 0.5:.1f}",
                  flush=True)
            out[label] = {"workload": job["workload"], "parameters": params, "rates": rates, "losses": job["losses"],
                          "all_steps_s": job["elapsed"],
                          "commlib_algorithms": sorted(job["algorithms"]) if job["how"][0] == "commlib" else [],
                          "breakdowns": job["breakdowns"], "tx_bytes": job["tx_bytes"], "auto_trials": job.get("trials")}
    if hvd.rank() == 0:
        common.emit({"size": hvd.size(), "results": out})
    commlib.shutdown()


# -- the launcher -------------------------------------------------------------------------------------
def _read_ready(proc, what, seconds=60):
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    line = proc.stdout.readline().strip() if ready else ""
    if not line.startswith("READY "):
        raise RuntimeError(f"{what} did not start (exit {proc.poll()}): {line!r}")
    return line.split()[1]


def configs(args):
    chosen = [c for c in CONFIGS if args.workload in ("all", c[0])]
    if args.configs:   # the first of each workload stays: the ratios are against it
        firsts = {next(c[1] for c in chosen if c[0] == w) for w in {c[0] for c in chosen}}
        chosen = [c for c in chosen if c[1] in firsts or c[1] in args.configs.split(",")]
    return chosen


def _run(args, n, script=None, forwarded=("steps", "warmup", "batch", "hidden", "features", "vocab", "zipf",
                                          "workload", "configs", "rounds")):
    """The Horovod job on n emulated hosts: `script` (default this file) --worker with the `forwarded`
    settings on every host; returns rank 0's emitted payload (bench_tf.py runs its workers through it)."""
    hosts = [f"w{r}" for r in range(n)]
    with netem.Cluster(hosts + ["switch"], rate=args.rate, unshaped={"switch"}) as cluster:
        switch, address = cluster.start_switch("switch", cwd=ROOT)
        daemons = [switch, cluster.popen("switch", [sys.executable, "-c", RENDEZVOUS, ",".join(f"{h}:1" for h in hosts)],
                                         stdout=subprocess.PIPE, text=True, cwd=ROOT)]
        try:
            rendezvous_port = _read_ready(daemons[1], "Horovod's rendezvous server")
            env = {"COMMLIB_SWITCH_ADDR": address, "COMMLIB_TIMEOUT_S": "120", "COMMLIB_AUTHENTICATE": "0",
                   # what horovodrun --gloo sets for each process (horovod/runner/gloo_run.py)
                   "HOROVOD_GLOO_RENDEZVOUS_ADDR": cluster.address("switch"),
                   "HOROVOD_GLOO_RENDEZVOUS_PORT": rendezvous_port, "HOROVOD_CONTROLLER": "gloo",
                   "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "eth0", "HOROVOD_SIZE": str(n),
                   "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_SIZE": str(n),
                   "HOROVOD_GLOO_TIMEOUT_SECONDS": "120",   # horovodrun --gloo-timeout-seconds, as in tests
                   "COMMLIB_HOTCOLD_EVERY": str(getattr(args, "hotcold_every", 20)),
                   "COMMLIB_HOTCOLD_RULE": getattr(args, "hotcold_rule", "share")}
            forwarded = ["--worker", *[f"--{k}={getattr(args, k)}" for k in forwarded]]
            script = ["bash", "-c", 'HOROVOD_RANK=$RANK HOROVOD_CROSS_RANK=$RANK HOROVOD_HOSTNAME=w$RANK exec "$@"',
                      "rank", sys.executable, str(script or Path(__file__)), *forwarded]
            ranks = cluster.run(hosts, script, env, args.timeout, cwd=ROOT)
        finally:
            cluster.kill(daemons)
    return common.cluster_result(ranks, echo=True)


def bottleneck(r, args, n, how):
    """Fill r's link utilisation and bottleneck (common.bottleneck) over its median step: Horovod's
    configurations have no breakdown (its allreduce is not commlib's), so their link alone speaks."""
    step_s = args.batch * n / r["median_samples_per_s"]
    r["link"] = statistics.median(r["tx_bytes"]) * 8 / (common.rate_bps(args.rate) * step_s)
    server = "aggregators" if how[0] == "commlib" and "omnireduce" in how[1] else "switch"
    r["bottleneck"] = common.bottleneck(step_s, r["breakdowns"], r["link"], server,
                                        unmeasured="n/a: Horovod's allreduce")


def _plot(results, title, suite):
    fig, axes = common.figure(1, 2, figsize=(11, 4))
    for ax, workload in zip(axes, ("dense", "sparse")):
        if not any(r["workload"] == workload for r in results.values()):
            continue
        common.plot_losses(ax, {label: r for label, r in results.items() if r["workload"] == workload})
        ax.set_title(f"{workload} model", fontsize=9)
    fig.suptitle(title, fontsize=9)
    common.save_figure(fig, suite)


def main_arguments(argv=None):
    """This benchmark's options, parsed (bench_auto.py runs its jobs with them)."""
    parser = common.training_arguments(__doc__, steps=30, warmup=common.WARMUP_STEPS, quick_warmup=2,
                                       warmup_help="untimed steps, as Horovod's synthetic benchmark: `auto` "
                                                   "tries its candidates in them")
    parser.add_argument("--vocab", type=int, default=None, help="embedding rows (default 400000; quick 20000)")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the sparse model's ids")
    parser.add_argument("--workload", choices=("all", "dense", "sparse"), default="all")
    parser.add_argument("--configs", default="", help="only these configurations (labels, comma-separated)")
    parser.add_argument("--rounds", type=int, default=1, help="interleave the configurations in this many rounds")
    parser.add_argument("--hotcold-every", type=int, default=5, help="commlib hotcold: window (steps)")
    parser.add_argument("--hotcold-rule", default="traffic", help="commlib hotcold: 'traffic' or 'share'")
    args = common.parse_training_arguments(parser, argv)
    args.vocab = args.vocab or (20000 if args.quick else 400000)
    return args


def main(argv=None):
    args = main_arguments(argv)
    if args.worker:
        return worker(args)
    ok, why = netem.available()
    if not ok:
        raise SystemExit(f"bench_training: {why}")

    print(f"== {args.workers} emulated hosts, links {args.rate} each way, {len(configs(args))} configurations",
          flush=True)
    payload = _run(args, args.workers)
    n, results = payload["size"], payload["results"]
    rows, first = [], {}
    for workload, label, how in configs(args):
        r = results[label]
        r["size"] = n
        every = args.batch * n * len(r["all_steps_s"]) / sum(r["all_steps_s"])   # with the warm-up: auto's trials
        first.setdefault(workload, (r, every))
        rates = common.rate_cells(r, n, first[workload][0])   # the median: robust to the shared machine's stalls
        losses = r["losses"]
        bottleneck(r, args, n, how)
        rows.append(f"| {workload} | {label} | {r['parameters']:,} | {rates} | "
                    f"{every:.0f} | {every / first[workload][1]:.2f}x | "
                    f"{losses[0]:.4f} -> {statistics.fmean(losses[-3:]):.4f} | "
                    f"{', '.join(r['commlib_algorithms']) or '-'} | {r['bottleneck']} |")
    from commlib import analyze   # the table of auto's trials
    title = (f"{n} emulated hosts, links {args.rate} each way, batch {args.batch} per worker, "
             f"{args.steps} timed steps after {args.warmup}")
    suite = "training" if args.workload == "all" else f"training_{args.workload}"   # keeps the other's results
    suite += "" if args.zipf == 1.1 else f"_zipf{args.zipf:g}"
    _plot(results, title, suite)
    markdown = (f"Data-parallel SGD through Horovod's DistributedOptimizer, with and without commlib; {title}. "
                "Samples/s = mean over the timed steps x workers (the Horovod synthetic-benchmark figure); ratios "
                "against the first configuration of each model, measured in the same job. The loss is the mean "
                "over ranks at the first step and over the last three.\n\n"
                "Median: the median step's rate x workers. With warm-up: samples over the time of every step, the untimed "
                "ones too, where `auto` tries its candidates (a job of a few dozen steps pays them all; a long job, "
                "once per `auto_revisit` runs). " + common.BOTTLENECK_RULE + " Here the row's time is the "
                "median step; the server is named aggregators where the policy sends tensors to omnireduce.\n\n"
                "| model | configuration | parameters | samples/s | vs first | median samples/s | vs first (median) | "
                "with warm-up | vs first (with warm-up) | loss first -> last | commlib algorithms | bottleneck |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
                + "".join(f"\n\n{label}, " + analyze.format_trials(results[label]["auto_trials"])
                          for _, label, _ in configs(args) if results[label].get("auto_trials"))
                + f"\n\n![training](results/{suite}.png)\n")
    settings = common.training_settings(args, "vocab", "zipf", "workload", "hotcold_every", "hotcold_rule", "rounds")
    common.save(suite, settings, results, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
