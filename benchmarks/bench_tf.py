"""TensorFlow on the emulated network: Horovod's DistributedGradientTape vs commlib's.

N emulated hosts (benchmarks/netem.py, every worker link shaped to --rate each way), one Horovod job
started as bench_training.py starts one (Gloo controller, Horovod's rendezvous server on an unshaped
host beside the commlib-switch). Every configuration trains bench_training's dense MLP on its teacher
task in TensorFlow, a tf.function step, from the same start in the same processes, the
configurations taking turns step by step (as in bench_ddp.py):
  horovod:           hvd.DistributedGradientTape (Horovod's allreduce ops inside the graph)
  commlib switchml:  commlib.tensorflow.DistributedGradientTape(..., policy="*=switchml")
  commlib auto:      the same with policy "*=auto"
Rank 0 prints samples/s per configuration and the cost of the TF/commlib boundary per step: the
time the graph spends in the gradient reduction (tf.timestamp ops just before the gradients enter it
and just after they all leave it) minus the time commlib's allreduce took inside the one
tf.numpy_function (submit of every gradient to the last synchronize). What is left is the crossing:
TF tensors handed to Python as numpy arrays, the results copied back into TF tensors, the Python
call itself. For Horovod the same graph-side timestamps give its in-graph allreduce time.

    python benchmarks/bench_tf.py [--quick] [--workers 4] [--rate 500mbit] [--steps 30]
Results: benchmarks/results/tf.json, tf.png and RESULTS.md. Needs root (namespaces, tc).
"""
import statistics
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_training  # noqa: E402  its emulated Horovod job (_run)
import common  # noqa: E402
import netem  # noqa: E402

CONFIGS = {"horovod": None, "commlib switchml": "*=switchml", "commlib auto": "*=auto"}


# -- inside each rank (its own namespace) -------------------------------------------------------------
class TimedReduction:
    """Wraps a distributed tape's gradient reduction (`_allreduce_grads`, Horovod's or commlib's
    GradientReducer) with graph timestamps: `seconds` is a tensor, the wall time from the moment
    every gradient is ready to the moment every reduced one is, as the graph sees it."""

    def __init__(self, reduce, tf):
        self.reduce, self.tf, self.seconds = reduce, tf, None   # tf passed in: an import here trips AutoGraph

    def __call__(self, grads, vars=None, use_generic_names=False):
        tf = self.tf
        with tf.control_dependencies(grads):
            start = tf.timestamp()
        with tf.control_dependencies([start]):
            grads = [tf.identity(g) for g in grads]
        reduced = self.reduce(grads, vars, use_generic_names)
        with tf.control_dependencies(reduced):
            self.seconds = tf.timestamp() - start
        return reduced


def time_python_side(reducer, samples):
    """Append to `samples` the seconds each call of reducer.reduce_arrays takes: commlib's allreduce of
    a step's gradients (every submit, every synchronize), run inside the tf.numpy_function."""
    reduce_arrays = reducer.reduce_arrays

    def timed(names, *arrays):
        start = time.perf_counter()
        out = reduce_arrays(names, *arrays)
        samples.append(time.perf_counter() - start)
        return out
    reducer.reduce_arrays = timed   # the numpy_function's lambda looks it up on every call


def worker(args):
    import numpy as np
    import tensorflow as tf

    import horovod.tensorflow as hvd
    import commlib
    import commlib.tensorflow as cl
    from commlib.api import runtime

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    commlib.init()
    rt = runtime()
    rank, size = hvd.rank(), hvd.size()
    teacher = np.random.default_rng(1234).standard_normal((args.features, 10)).astype(np.float32)   # every rank's
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build(label, policy):
        tf.keras.utils.set_random_seed(0)   # the same start for every configuration and rank
        model = tf.keras.Sequential([tf.keras.Input((args.features,)),
                                     tf.keras.layers.Dense(args.hidden, activation="relu"),
                                     tf.keras.layers.Dense(args.hidden, activation="relu"),
                                     tf.keras.layers.Dense(10)])
        optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
        inside = []   # commlib's allreduce time per step (Python side of the numpy_function)
        timer = {}

        # plain Python that builds the tape: AutoGraph would convert Horovod's and commlib's constructors,
        # and warn about the import inside commlib.tensorflow's
        @tf.autograph.experimental.do_not_convert
        def distributed(tape):
            if policy is None:
                tape = hvd.DistributedGradientTape(tape)
            else:
                tape = cl.DistributedGradientTape(tape, policy=policy)
                time_python_side(tape._allreduce_grads, inside)
            tape._allreduce_grads = timer["reduction"] = TimedReduction(tape._allreduce_grads, tf)
            return tape

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = distributed(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss, timer["reduction"].seconds

        return {"model": model, "step": step, "inside": inside, "rates": [], "losses": [], "in_graph": [],
                "python": [], "breakdowns": [], "tx_bytes": []}

    runs = {label: build(label, policy) for label, policy in CONFIGS.items()}
    for run in runs.values():
        hvd.broadcast_variables(run["model"].variables, root_rank=0)   # what a user does (the seeds agree anyway)
    # the configurations take turns step by step, so a change of load on this shared machine falls on
    # all of them alike
    for step in range(args.warmup + args.steps):
        x = np.random.default_rng(step * 1000 + rank).standard_normal((args.batch, args.features)).astype(np.float32)
        x, y = tf.constant(x), tf.constant((x @ teacher).argmax(axis=1))
        for label, run in runs.items():
            hvd.allreduce(tf.zeros(1), name="sync")   # every rank starts the step together
            with common.Probe(rt.backends if CONFIGS[label] else None) as probe:
                start = time.perf_counter()
                loss, in_graph = run["step"](x, y)
                elapsed = time.perf_counter() - start
            run["losses"].append(float(hvd.allreduce(loss, name="loss")))
            python = run["inside"].pop() if run["inside"] else None
            assert not run["inside"], "one reduction per step"
            if step >= args.warmup:
                run["rates"].append(args.batch / elapsed)
                run["in_graph"].append(float(in_graph))
                run["python"].append(python)
                run["tx_bytes"].append(probe.tx_bytes)
                if CONFIGS[label]:
                    names = [v.name.split(":")[0] for v in run["model"].trainable_variables]
                    run["breakdowns"].append(common.step_breakdown(commlib.records(), names, probe.server_s))
    out = {}
    records = commlib.records()
    for label, run in runs.items():
        names = [v.name.split(":")[0] for v in run["model"].trainable_variables]
        algorithms = sorted({records[n]["algorithm"] for n in names if n in records}) if CONFIGS[label] else []
        result = {"parameters": int(sum(np.prod(v.shape) for v in run["model"].trainable_variables)),
                  "rates": run["rates"], "losses": run["losses"], "reduction_s": run["in_graph"],
                  "commlib_allreduce_s": run["python"] if CONFIGS[label] else [], "commlib_algorithms": algorithms,
                  "breakdowns": run["breakdowns"], "tx_bytes": run["tx_bytes"]}
        out[label] = result
        if rank == 0:
            line = (f"{label}: {size * statistics.fmean(run['rates']):.1f} samples/s on {size} workers, loss "
                    f"{run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}, reduction in graph "
                    f"{1e3 * statistics.median(run['in_graph']):.1f} ms")
            if CONFIGS[label]:
                line += (f", commlib allreduce {1e3 * statistics.median(run['python']):.1f} ms, algorithms "
                         f"{algorithms}")
            print(line, flush=True)
    if rank == 0:
        common.emit({"size": size, "results": out})
    commlib.shutdown()


# -- the launcher -------------------------------------------------------------------------------------
def _boundary_ms(r):
    """Per-step boundary cost in ms: the graph's reduction time minus commlib's allreduce, step by step
    (median, and the 10th percentile as the cost on a quiet step)."""
    costs = sorted(1e3 * (g - p) for g, p in zip(r["reduction_s"], r["commlib_allreduce_s"]))
    return statistics.median(costs), costs[len(costs) // 10]


def _plot(results, title):
    fig, axes = common.figure(1, 1, figsize=(7, 4))
    common.plot_losses(axes, results)
    fig.suptitle(textwrap.fill(title, 110), fontsize=8)
    common.save_figure(fig, "tf")


def main(argv=None):
    parser = common.training_arguments(__doc__, steps=30, warmup=common.WARMUP_STEPS, quick_warmup=2,
                                       warmup_help="untimed steps (the first traces the tf.function; auto's trials)")
    args = common.parse_training_arguments(parser, argv)
    if args.worker:
        return worker(args)
    ok, why = netem.available()
    if not ok:
        raise SystemExit(f"bench_tf: {why}")

    print(f"== {args.workers} emulated hosts, links {args.rate} each way, {len(CONFIGS)} configurations", flush=True)
    payload = bench_training._run(args, args.workers, script=Path(__file__),
                                  forwarded=("steps", "warmup", "batch", "hidden", "features"))
    n, results = payload["size"], payload["results"]
    labels = list(CONFIGS)
    first = results[labels[0]]
    rows = []
    for label in labels:
        r = results[label]
        rates = common.rate_cells(r, n, first)
        losses = r["losses"]
        reduction = 1e3 * statistics.median(r["reduction_s"])
        if CONFIGS[label]:
            median, quiet = _boundary_ms(r)
            r["boundary_ms_median"], r["boundary_ms_p10"] = median, quiet
            inside = f"{1e3 * statistics.median(r['commlib_allreduce_s']):.1f}"
            boundary = f"{median:.2f} (p10 {quiet:.2f})"
        else:
            inside, boundary = "-", "-"
        # the same start, data and arithmetic up to summation order: the curves should coincide
        r["max_loss_diff_vs_horovod"] = max(abs(a - b) for a, b in zip(losses, results[labels[0]]["losses"]))
        step_s = args.batch * n / r["total_samples_per_s"]
        r["link"] = statistics.median(r["tx_bytes"]) * 8 / (common.rate_bps(args.rate) * step_s)
        r["bottleneck"] = common.bottleneck(step_s, r["breakdowns"], r["link"],
                                            unmeasured="n/a: Horovod's allreduce")
        rows.append(f"| {label} | {rates} | "
                    f"{losses[0]:.4f} -> {statistics.fmean(losses[-3:]):.4f} | {r['max_loss_diff_vs_horovod']:.1e} | "
                    f"{reduction:.1f} | {inside} | "
                    f"{boundary} | {', '.join(r['commlib_algorithms']) or '-'} | {r['bottleneck']} |")
    title = (f"TF {_tf_version()}, tf.function, {n} emulated hosts, links {args.rate} each way, MLP "
             f"{results[labels[0]]['parameters']:,} parameters, batch {args.batch} per worker, {args.steps} timed "
             f"steps after {args.warmup}")
    _plot(results, title)
    markdown = (f"{title}. Samples/s = mean over the timed steps x workers; ratios against Horovod's own "
                "DistributedGradientTape in the same job, the configurations taking turns step by step. The loss is "
                "the mean over ranks at the first step and over the last three; max loss diff: the largest gap, "
                "over all steps, between this configuration's loss curve and Horovod's. Reduction = rank 0's median time "
                "the graph spends from all gradients ready to all reduced (tf.timestamp ops around the tape's "
                "reduction); commlib allreduce = the median time commlib's submit-all/synchronize-all took inside "
                "the one tf.numpy_function; boundary = per step, reduction minus commlib allreduce (median, and "
                "p10 for a quiet step): handing the gradients to Python as numpy arrays and the results back into "
                "TF tensors (outside commlib's records: the workers' share). Median: the median step's rate x "
                "workers. " + common.BOTTLENECK_RULE + "\n\n"
                "| configuration | samples/s | vs horovod | median samples/s | vs horovod (median) | loss first -> last | "
                "max loss diff vs horovod | reduction ms | commlib allreduce ms | boundary ms/step | commlib algorithms | "
                "bottleneck |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
                + "\n".join(rows) + "\n\n![tf](results/tf.png)\n")
    settings = common.training_settings(args)
    common.save("tf", settings, results, markdown)
    print(markdown)
    return 0


def _tf_version():
    import importlib.metadata
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "?"


if __name__ == "__main__":
    sys.exit(main())
