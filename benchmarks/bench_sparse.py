"""Row-sparse allreduce on the emulated network: sparse allgather, omnireduce (row blocks), hot/cold
and dense, against each one's traffic model, over Zipf exponent x vocabulary x workers.

Each rank draws --ids embedding ids per step from a Zipf law (hot rows scattered over the table, a
fresh draw every step and rank), its gradient is the touched rows (width --dim), coalesced, and
every algorithm reduces the same steps' gradients in the same job, taking turns within each step
so that the machine's drift touches them alike (the backends called directly, as bench_network.py
does). Reported per algorithm: the median time of the slowest rank, its speed-up over the
allgather (the median over steps of the paired ratio), the bytes each worker's eth0 sent and
received per call, and what commlib.traffic predicts (hot/cold, with its one-round slab and with
presence counts first: the slab both ways plus the allgather of the cold rows), and the bound no
exact algorithm can go below (commlib.traffic: the busiest worker receives at least every row
some other rank touched, once), so allgather / bound is the most any algorithm can gain; the skew
plot shows the share of updates the hottest rows take (the IMC'20 study's Figure 10) from
hotcold's counts.
Every rank's row count is handed over as the core's negotiation does (the allgather then needs one
round); hot/cold's cold rows are counted only inside it, so its allgather exchanges sizes first.

    python benchmarks/bench_sparse.py [--quick] [--workers 4,8] [--rate 500mbit] [--zipf 0.8,1.1,1.4]
Results: benchmarks/results/sparse.json, sparse.png, sparse_skew.png and RESULTS.md (another --rate or
--ids: sparse_<rate>_ids<ids>). Needs root.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import netem  # noqa: E402

# hotcold twice: its one-round slab, and with presence counts first (hotcold_presence)
ALGORITHMS = ("sparse_allgather", "omnireduce", "hotcold", "hotcold+presence", "switchml")


# -- inside each rank (its own namespace) -------------------------------------------------------------
def worker(args):
    import numpy as np

    import commlib
    from commlib import dispatch, sparse
    from commlib.api import runtime
    from commlib.backends.hotcold import FIRST_WINDOW

    commlib.init(policy="*=ring")
    rt = runtime()
    ctx, rank, n = rt.ctx, rt.ctx.rank, rt.ctx.size
    first = min(rt.settings.hotcold_every, FIRST_WINDOW)   # hotcold's first window of counts
    out = {}
    for vocab in args.vocabs:
        for s in args.zipf:
            weights = 1.0 / np.arange(1, vocab + 1) ** s
            weights /= weights.sum()
            perm = np.random.default_rng(7).permutation(vocab)

            def gradient(step):
                g = np.random.default_rng(10_000 * step + rank)
                rows = perm[g.choice(vocab, args.ids, p=weights)]
                return sparse.coalesce(rows.astype(np.int64), g.standard_normal((rows.size, args.dim), np.float32))

            tag = f"v{vocab}.s{s}"
            steps = [gradient(i) for i in range(first + args.runs)]   # hotcold's first window, then timed
            for algorithm in ALGORITHMS:
                backend = _backend(rt, algorithm)
                for i in range(first if backend.name == "hotcold" else 1):
                    sparse.reduce_rows(backend, *steps[i], vocab, f"{tag}.{algorithm}")
            runs = {a: {"seconds": [], "breakdowns": [], "model": [], "tx": 0, "rx": 0} for a in ALGORITHMS}
            # the algorithms take turns within each step, so the machine's drift touches them alike
            for i in range(first, first + args.runs):
                rows, values = steps[i]
                counts = ctx.exchange(f"bench/{tag}/{i}/n", int(rows.size))   # as the negotiation hands them
                exact = None
                for algorithm in ALGORITHMS:
                    backend, name, r = _backend(rt, algorithm), f"{tag}.{algorithm}", runs[algorithm]
                    r["model"].append(_model(ctx, backend, name, rows, vocab, args.dim, dispatch, sparse, i))
                    served = common.daemon_ns({algorithm: backend})   # rank 0: the switch's or aggregators' counters
                    before = common.link_bytes()   # the call and the few bytes of the exchange that times it
                    got, seconds, split = common.slowest_call(ctx, f"bench/{name}/{i}/s", lambda: sparse.reduce_rows(
                        backend, rows, values, vocab, name, counts))
                    after = common.link_bytes()
                    split["server_s"] = common.server_seconds(served, common.daemon_ns({algorithm: backend}))
                    r["tx"], r["rx"] = r["tx"] + after[0] - before[0], r["rx"] + after[1] - before[1]
                    r["seconds"].append(seconds)
                    r["breakdowns"].append(split)
                    if exact is None:   # the allgather's, first
                        exact = got
                        continue
                    assert np.array_equal(got[0], exact[0]), f"{algorithm}: rows differ from the allgather's"
                    bound = 1e-3 if backend.name in ("switchml", "hotcold") else 1e-4
                    scale = max(1.0, float(np.abs(exact[1]).max(initial=0.0)))
                    assert np.allclose(got[1], exact[1], atol=bound * scale), f"{algorithm} differs from the allgather"
            workload = {}
            for algorithm, r in runs.items():
                name, backend = f"{tag}.{algorithm}", _backend(rt, algorithm)
                moved = ctx.exchange(f"bench/{name}/bytes", [r["tx"] / args.runs, r["rx"] / args.runs])
                workload[algorithm] = {"seconds": r["seconds"], "breakdowns": r["breakdowns"],
                                       "tx_bytes": [m[0] for m in moved], "rx_bytes": [m[1] for m in moved],
                                       "model_up": statistics.fmean(m[backend.name]["up"] for m in r["model"]),
                                       "model_down": statistics.fmean(m[backend.name]["down"] for m in r["model"]),
                                       "bound": statistics.fmean(m["bound"] for m in r["model"])}
                if backend.name == "hotcold":
                    workload[algorithm]["skew"] = backend.row_record(name)
            own = ctx.exchange(f"bench/{tag}/rows", int(np.mean([s[0].size for s in steps])))
            rows, counts = rt.backend("hotcold").counts(f"{tag}.hotcold")
            workload["rows_per_rank"] = own
            workload["counts"] = np.sort(counts)[::-1].tolist()[:20000]   # the skew plot's curve
            out[tag] = workload
    if rank == 0:
        common.emit({"size": n, "workloads": out})
    commlib.shutdown()


def _backend(rt, algorithm):
    """The backend measured as `algorithm`; hotcold set to the form it names."""
    backend = rt.backend(algorithm.split("+")[0])
    if backend.name == "hotcold":
        backend.presence = algorithm.endswith("+presence")
    return backend


def _model(ctx, backend, name, rows, vocab, dim, dispatch, sparse, step):
    """Every rank's measurements (as dispatch submits them), the traffic model's estimate."""
    stats = {"rows": int(rows.size), "sketch": sparse.sketch(rows), "nrows": vocab, "width": dim, "itemsize": 4}
    own = backend.row_stats(name, rows, vocab, dim)   # hotcold's split, omnireduce's row blocks
    if own is not None:
        stats[backend.name] = own
    everyone = ctx.exchange(f"bench/{name}/{step}/stats", stats)
    return dispatch.estimate_traffic(everyone, [backend.name])


# -- the launcher -------------------------------------------------------------------------------------
def _run(args, n):
    hosts = [f"w{r}" for r in range(n)]
    with netem.Cluster(hosts + ["switch"], rate=args.rate, unshaped={"switch"}) as cluster:
        switch, address = cluster.start_switch("switch", cwd=ROOT)
        try:
            env = {"COMMLIB_SWITCH_ADDR": address, "COMMLIB_TIMEOUT_S": "60", "COMMLIB_AUTHENTICATE": "0", "COMMLIB_HOTCOLD_EVERY": str(args.every),
                   "COMMLIB_HOTCOLD_SHARE": str(args.share), "COMMLIB_HOTCOLD_RULE": args.rule,
                   "COMMLIB_OMNIREDUCE_BLOCK_SIZE": str(args.omnireduce_block)}
            forwarded = ["--worker", "--runs", str(args.runs), "--ids", str(args.ids), "--dim", str(args.dim),
                         "--vocabs", ",".join(map(str, args.vocabs)), "--zipf", ",".join(map(str, args.zipf)),
                         "--every", str(args.every)]
            ranks = cluster.run(hosts, [sys.executable, str(Path(__file__)), *forwarded], env, args.timeout, cwd=ROOT)
        finally:
            cluster.kill([switch])
    return common.cluster_result(ranks)


def _plots(rows, raw, title, suite, rate):
    fig, ax = common.figure(figsize=(10, 4.5))
    link_ms = lambda r: r["bound_kib"] * 1024 * 8 / common.rate_bps(rate) * 1e3
    common.grouped_bars(ax, rows, lambda r: f"N={r['workers']} {r['workload'].replace('.s', ', Zipf ')}",
                        lambda r: r["algorithm"], "median_ms", "vs_allgather", "sparse_allgather",
                        bound=link_ms, ylabel="median time per allreduce (ms)")
    ax.set_yscale("log")
    common.titled(fig, title)
    common.save_figure(fig, suite)
    fig, ax = common.figure(figsize=(6, 4))
    for n, payload in raw.items():
        for tag, workload in payload["workloads"].items():
            counts = workload["counts"]
            total = sum(counts) or 1
            share, running = [], 0
            for c in counts:
                running += c
                share.append(running / total)
            ax.plot(range(1, len(share) + 1), share, label=f"N={n} {tag}")
    ax.set_xscale("log")
    ax.set_xlabel("hottest rows (count)")
    ax.set_ylabel("share of row updates in a window")
    ax.set_title("update skew (hotcold's per-row counts, summed over ranks)", fontsize=8)
    ax.legend(fontsize=6)
    common.save_figure(fig, f"{suite}_skew")


def _title(args):
    return (f"row-sparse allreduce, {args.ids} Zipf ids per rank per step, rows of {args.dim} float32, links "
            f"{args.rate}; median of {args.runs} steps (slowest rank), the algorithms taking turns in each")


def _suite(args):
    """Another rate or batch: files of its own."""
    return "sparse" + ("" if args.rate == "500mbit" else f"_{args.rate}") + ("" if args.ids == 4096 else f"_ids{args.ids}")


def replot(suite):
    """Draw `suite`'s figures again from its results file (no run)."""
    saved = json.loads((common.RESULTS / f"{suite}.json").read_text())
    args = argparse.Namespace(**saved["settings"])
    _plots(saved["results"]["rows"], saved["results"]["raw"], _title(args), suite, args.rate)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small workload, 4 workers: seconds")
    parser.add_argument("--workers", default=None, help="comma-separated worker counts (default 4,8; quick: 4)")
    parser.add_argument("--rate", default="500mbit", help="each worker link, both directions (tc tbf)")
    parser.add_argument("--zipf", default=None, help="Zipf exponents (default 0.8,1.1,1.4; quick 1.1)")
    parser.add_argument("--vocabs", default=None, help="embedding rows (default 100000,400000; quick 20000)")
    parser.add_argument("--ids", type=int, default=4096, help="ids per rank per step (batch x features)")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--every", type=int, default=5, help="hotcold's window (calls)")
    parser.add_argument("--rule", default="traffic", help="hotcold's hot set: 'traffic' or 'share'")
    parser.add_argument("--share", type=float, default=0.5, help="hotcold's target share of updates (--rule share)")
    # the job's block bounds a row-sparse tensor's own (one row by default: omnireduce_rows_per_block) and
    # sets the job's columns (omnireduce_window_bytes / its bytes), which row blocks use as they are
    parser.add_argument("--omnireduce-block", type=int, default=256, help="omnireduce's job block, elements")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=170)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replot", metavar="SUITE", help="redraw SUITE's figures from its results file, no run")
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.replot)
    args.runs = args.runs or (2 if args.quick else 7)
    args.workers = args.workers or ("4" if args.quick else "4,8")
    args.zipf = [float(v) for v in (args.zipf or ("1.1" if args.quick else "0.8,1.1,1.4")).split(",")]
    args.vocabs = [int(v) for v in str(args.vocabs or ("20000" if args.quick else "100000,400000")).split(",")]
    if args.worker:
        return worker(args)
    ok, why = netem.available()
    if not ok:
        raise SystemExit(f"bench_sparse: {why}")
    raw, rows = {}, []
    for n in [int(v) for v in args.workers.split(",")]:
        print(f"== {n} emulated hosts, links {args.rate} each way", flush=True)
        payload = raw[str(n)] = _run(args, n)
        for tag, workload in payload["workloads"].items():
            base = workload["sparse_allgather"]["seconds"]
            for algorithm in ALGORITHMS:
                r = workload[algorithm]
                ms = statistics.median(r["seconds"]) * 1e3
                paired = statistics.median(b / t for b, t in zip(base, r["seconds"]))   # the same steps
                row = {"workers": n, "workload": tag, "algorithm": algorithm, "median_ms": ms,
                       "vs_allgather": paired, "rows_per_rank": statistics.fmean(workload["rows_per_rank"]),
                       "tx_kib": statistics.fmean(r["tx_bytes"]) / 1024, "rx_kib": statistics.fmean(r["rx_bytes"]) / 1024,
                       "model_up_kib": r["model_up"] / 1024, "model_down_kib": r["model_down"] / 1024,
                       "bound_kib": r["bound"] / 1024, "model_vs_bound": r["model_down"] / r["bound"]}
                if "skew" in r:
                    row["hot_k"], row["hot_share"] = r["skew"].get("hot_k"), r["skew"].get("hot_share")
                row["link"] = row["tx_kib"] * 1024 * 8 / (common.rate_bps(args.rate) * ms / 1e3)
                row["bottleneck"] = common.bottleneck(ms / 1e3, r["breakdowns"], row["link"], common.SERVERS[algorithm.split("+")[0]])
                rows.append(row)
                print(f"  {tag:<14} {algorithm:<16} {ms:9.1f} ms  x{row['vs_allgather']:5.2f} vs allgather  "
                      f"sent {row['tx_kib']:9.1f} KiB (model {row['model_up_kib']:9.1f})  "
                      f"received {row['rx_kib']:9.1f} KiB (model {row['model_down_kib']:9.1f}, "
                      f"bound {row['bound_kib']:7.1f}: x{row['model_vs_bound']:4.2f})", flush=True)
    title, suite = _title(args), _suite(args)
    _plots(rows, raw, title, suite, args.rate)
    table = "\n".join(
        f"| {r['workers']} | {r['workload']} | {r['rows_per_rank']:.0f} | {r['algorithm']} | {r['median_ms']:.1f} | "
        f"{r['vs_allgather']:.2f}x | {r['tx_kib']:.0f} / {r['model_up_kib']:.0f} | {r['rx_kib']:.0f} / "
        f"{r['model_down_kib']:.0f} | {r['bound_kib']:.0f} ({r['model_vs_bound']:.2f}x) | " +
        (f"K={r['hot_k']}, {r['hot_share']:.0%}" if "hot_k" in r else "") +
        f" | {r['bottleneck']} |" for r in rows)
    markdown = (f"Emulated cluster (benchmarks/netem.py); {title}. Workload v<rows>.s<Zipf exponent>; each "
                f"algorithm reduces the same steps' gradients (results checked against the allgather's); vs allgather: "
                f"the median over the steps of the allgather's time / this algorithm's in the same step. "
                f"Bytes per worker and call: measured on eth0 / predicted by commlib.traffic (hot/cold: slab "
                f"+ cold allgather). Bound: the fewest bytes any exact algorithm delivers to the busiest worker "
                f"(every row some other rank touched, its values once; commlib.traffic), and the model's "
                f"received bytes over it: the allgather's is the most any algorithm can gain over the allgather "
                f"on a link-bound call. Hot/cold's window: {args.every} calls (the first at most 4), hot set: " + (
                    f"the rows carrying {args.share:.0%} of the window's updates" if args.rule == "share" else
                    "the rows whose slab slot costs less than their expected allgather bytes") + ". "
                + common.BOTTLENECK_RULE + " Here, per call of the slowest rank: processing = its calling thread's "
                "CPU time, transfer = the rest (common.slowest_call); hot/cold's switch share is not measured.\n\n"
                "| workers | workload | rows/rank | algorithm | median ms | vs allgather | sent KiB (model) | "
                "received KiB (model) | bound KiB (model / bound) | hot set | bottleneck |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|\n" + table +
                f"\n\n![sparse](results/{suite}.png) ![skew](results/{suite}_skew.png)\n")
    settings = {k: getattr(args, k) for k in ("quick", "workers", "rate", "zipf", "vocabs", "ids", "dim", "every",
                                              "rule", "share", "omnireduce_block", "runs")}
    for payload in raw.values():   # the curves are in the plot; keep the file small
        for workload in payload["workloads"].values():
            workload["counts"] = workload["counts"][:200]
    common.save(suite, settings, {"rows": rows, "raw": raw}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
