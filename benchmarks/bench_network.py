"""Allreduce on an emulated network: every algorithm against the ring, when the network is the bottleneck.

A network namespace per worker and one for the SwitchML switch, joined by a bridge; every worker
link is shaped to --rate in both directions (benchmarks/netem.py). Each worker runs the core's
backends directly, all in the same run, pair by pair:
  - dense float32 tensor: ring (torch.distributed Gloo), switchml (switch in its own namespace),
    omnireduce (colocated aggregators);
  - sparse tensors (block densities --densities, blocks placed independently per rank): omnireduce
    and the ring.
Reported: median time of --runs runs after a warm-up (the slowest rank's), goodput, the ratio to the
ring, and each worker's link utilization (bytes its eth0 sent / (rate x time)), so a reader sees
whether the link or the 2-core CPU was the bottleneck. Results are checked against the ring's.

    python benchmarks/bench_network.py [--quick] [--workers 4,8] [--rate 500mbit] [--elements 4194304]
Results: benchmarks/results/network.json, network.png and RESULTS.md. Needs root (namespaces, tc).
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

BLOCK = 256   # omnireduce's default block: the densities are of these blocks


# -- inside each rank (its own namespace) -------------------------------------------------------------
def worker(args):
    import numpy as np

    import commlib
    from commlib.api import runtime

    commlib.init(policy="*=ring")
    rt = runtime()
    ctx, rank, n = rt.ctx, rt.ctx.rank, rt.ctx.size

    def timed(algorithm, x, tag):
        backend = rt.backend(algorithm)
        out = backend.allreduce(x, f"{tag}.warmup")
        served = common.daemon_ns({algorithm: backend})   # rank 0: the switch's or aggregators' counters
        samples, breakdowns, (tx, rx) = [], [], common.link_bytes()
        for i in range(args.runs):
            ctx.barrier(f"bench/{tag}/{i}")
            _, seconds, split = common.slowest_call(ctx, f"bench/{tag}/{i}/s", lambda: backend.allreduce(x, tag))
            samples.append(seconds)
            breakdowns.append(split)
        tx2, rx2 = common.link_bytes()
        server_s = common.server_seconds(served, common.daemon_ns({algorithm: backend}), args.runs)
        sent = ctx.exchange(f"bench/{tag}/bytes", [(tx2 - tx) / args.runs, (rx2 - rx) / args.runs])
        return {"seconds": samples, "tx_bytes": [b[0] for b in sent], "rx_bytes": [b[1] for b in sent],
                "breakdowns": [dict(b, server_s=server_s) for b in breakdowns]}, out

    workloads = {}
    dense = np.random.default_rng(rank).standard_normal(args.elements).astype(np.float32)
    results = {}
    results["ring"], exact = timed("ring", dense, "dense.ring")
    results["switchml"], out = timed("switchml", dense, "dense.switchml")
    error = float(np.max(np.abs(out - exact)))
    assert error <= n * n * 2.0 ** -20 * max(1.0, float(np.max(np.abs(exact)))), f"switchml error {error}"
    results["omnireduce"], out = timed("omnireduce", dense, "dense.omnireduce")
    assert np.allclose(out, exact, rtol=1e-5, atol=1e-4), "omnireduce differs from the ring"
    workloads["dense"] = {"density": 1.0, **{a: r for a, r in results.items()}}

    nblocks = -(-args.elements // BLOCK)
    for density in args.densities:
        rng = np.random.default_rng(1000 + rank)
        x = np.zeros(nblocks * BLOCK, dtype=np.float32)
        chosen = rng.choice(nblocks, max(1, round(density * nblocks)), replace=False)
        x.reshape(nblocks, BLOCK)[chosen] = rng.standard_normal((chosen.size, BLOCK)).astype(np.float32)
        x = x[:args.elements]
        omni, out = timed("omnireduce", x, f"sparse{density}.omnireduce")
        ring, exact = timed("ring", x, f"sparse{density}.ring")
        assert np.allclose(out, exact, rtol=1e-5, atol=1e-5), "omnireduce differs from the ring"
        measured = rt.backend("omnireduce").measured_density(f"sparse{density}.omnireduce")
        workloads[f"sparse {density:g}"] = {"density": measured[0], "union_density": measured[1],
                                            "omnireduce": omni, "ring": ring}
    if rank == 0:
        common.emit({"size": n, "engine": rt.backend("ring").stats().get("engine"), "workloads": workloads})
    commlib.shutdown()


# -- the launcher -------------------------------------------------------------------------------------
def _run(args, n):
    """One job of n workers on a fresh cluster: the payload rank 0 emits."""
    hosts = [f"w{r}" for r in range(n)]
    with netem.Cluster(hosts + ["switch"], rate=args.rate, delay_ms=args.delay_ms, unshaped={"switch"}) as cluster:
        switch, address = cluster.start_switch("switch", cwd=ROOT)
        try:
            env = {"COMMLIB_SWITCH_ADDR": address, "COMMLIB_TIMEOUT_S": "60", "COMMLIB_FUSION_THRESHOLD": "0", "COMMLIB_AUTHENTICATE": "0"}
            forwarded = ["--worker", "--elements", str(args.elements), "--runs", str(args.runs),
                         "--densities", ",".join(map(str, args.densities))]
            ranks = cluster.run(hosts, [sys.executable, str(Path(__file__)), *forwarded], env, args.timeout, cwd=ROOT)
        finally:
            cluster.kill([switch])
    return common.cluster_result(ranks)


def _plot(rows, title):
    fig, ax = common.figure(figsize=(10, 4.5))
    common.grouped_bars(ax, rows, lambda r: f"N={r['workers']} {r['workload']}", lambda r: r["algorithm"],
                        "median_ms", "vs_ring", "ring", ylabel="median allreduce time (ms)")
    common.titled(fig, title)
    common.save_figure(fig, "network")


def _title(args, engine):
    return f"{args.elements:,} float32 per worker, links {args.rate} each way; ring = {engine} allreduce; " \
           f"median of {args.runs} runs"


def replot():
    """Draw the figure again from results/network.json (no run)."""
    saved = json.loads((common.RESULTS / "network.json").read_text())
    engine = next(iter(saved["results"]["raw"].values()))["engine"] if saved["results"]["raw"] else "?"
    _plot(saved["results"]["rows"], _title(argparse.Namespace(**saved["settings"]), engine))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small tensor, few runs: seconds")
    parser.add_argument("--workers", default=None, help="comma-separated worker counts (default 4,8; quick: 4)")
    parser.add_argument("--rate", default="500mbit", help="each worker link, both directions (tc tbf)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link (netem)")
    parser.add_argument("--elements", type=int, default=None, help="float32 values per tensor")
    parser.add_argument("--densities", default="0.01,0.1", help="block densities of the sparse workloads")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replot", action="store_true", help="redraw the figure from results/network.json, no run")
    args = parser.parse_args(argv)
    if args.replot:
        return replot()
    args.elements = args.elements or (1 << 18 if args.quick else 1 << 22)
    args.runs = args.runs or (3 if args.quick else 5)
    args.workers = args.workers or ("4" if args.quick else "4,8")
    args.densities = [float(d) for d in str(args.densities).split(",") if d]
    if args.worker:
        return worker(args)
    ok, why = netem.available()
    if not ok:
        raise SystemExit(f"bench_network: {why}")

    rate = common.rate_bps(args.rate)
    results, rows = {}, []
    for n in [int(v) for v in args.workers.split(",")]:
        print(f"== {n} emulated hosts, links {args.rate} each way, {args.elements:,} float32 "
              f"({args.elements * 4 / 2 ** 20:.1f} MiB)", flush=True)
        payload = _run(args, n)
        results[str(n)] = payload
        for workload, by_algorithm in payload["workloads"].items():
            ring_ms = statistics.median(by_algorithm["ring"]["seconds"]) * 1e3
            for algorithm in ("ring", "switchml", "omnireduce"):
                if algorithm not in by_algorithm:
                    continue
                r = by_algorithm[algorithm]
                ms = statistics.median(r["seconds"]) * 1e3
                tx = statistics.fmean(r["tx_bytes"])
                row = {"workers": n, "workload": workload, "algorithm": algorithm, "median_ms": ms,
                       "goodput_gbps": args.elements * 32 / (ms * 1e6), "vs_ring": ring_ms / ms,
                       "tx_mib": tx / 2 ** 20, "link_utilization": tx * 8 / (rate * ms / 1e3)}
                row["bottleneck"] = common.bottleneck(ms / 1e3, r["breakdowns"], row["link_utilization"],
                                                      common.SERVERS[algorithm])
                rows.append(row)
                print(f"  {workload:<12} {algorithm:<10} {ms:8.1f} ms  {row['goodput_gbps']:6.3f} Gbps  "
                      f"x{row['vs_ring']:5.2f} vs ring  sent {row['tx_mib']:7.2f} MiB/worker  "
                      f"link {row['link_utilization']:4.0%}", flush=True)
    engine = next(iter(results.values()))["engine"] if results else "?"
    title = _title(args, engine)
    _plot(rows, title)
    table = "\n".join(f"| {r['workers']} | {r['workload']} | {r['algorithm']} | {r['median_ms']:.1f} | "
                      f"{r['goodput_gbps']:.3f} | {r['vs_ring']:.2f}x | {r['tx_mib']:.2f} | "
                      f"{r['link_utilization']:.0%} | {r['bottleneck']} |" for r in rows)
    markdown = (f"Emulated cluster (benchmarks/netem.py): a namespace per worker and for the switch, every worker "
                f"link shaped to {args.rate} each way with tc; {title}. Sparse workloads: 256-element blocks "
                f"placed independently per rank, density as measured. 'link' = bytes the worker's eth0 sent / "
                f"(rate x time): near 100% the network is the bottleneck, well below it the 2 CPUs are. "
                + common.BOTTLENECK_RULE + " Here, per run of the slowest rank: processing = its calling thread's "
                "CPU time, transfer = the rest (common.slowest_call).\n\n"
                "| workers | workload | algorithm | median ms | goodput Gbps | vs ring | sent MiB/worker | link | "
                "bottleneck |\n|---|---|---|---|---|---|---|---|---|\n" + table
                + "\n\n![network](results/network.png)\n")
    settings = {"quick": args.quick, "rate": args.rate, "delay_ms": args.delay_ms, "elements": args.elements,
                "runs": args.runs, "densities": args.densities, "workers": args.workers}
    common.save("network", settings, {"rows": rows, "raw": results}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
