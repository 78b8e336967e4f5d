"""OmniReduce block-sparse allreduce vs the dense ring allreduce, in the same processes.

N workers (default 4) on loopback reduce one float32 tensor (default 64 MiB) whose non-zero
256-element blocks are placed independently on each rank at block densities 1%, 10% and 100%.
For each density it reports the median time of omnireduce (colocated and/or dedicated
aggregators) and of the core's ring backend on the same tensor (Horovod's Gloo allreduce under
horovodrun when Horovod is built, else torch.distributed's Gloo), the MEASURED block density
(own and union), and the bytes each worker sent and received against the traffic models:
OMNIREDUCE.md's (own blocks + 4 B up, the union down), commlib's exact wire model, and the ring's
2(N-1)/N * S each way. At the densest density it also times omnireduce under each packet MAC algorithm
(COMMLIB_PACKET_MAC; the other runs take the default, `auto`) and without MACs (COMMLIB_AUTHENTICATE=0, a
trusted fabric): each algorithm's cost in time and in CPU ns per element of each role, and one MAC of a
block's packet (bench_kernels.mac_call_ns); and with blocks sized by the path (omnireduce_block_size=0:
on loopback OMR_MAX_BLOCK values per packet).

The fast-network view (issue 25): each role's CPU ns per element, beside a memcpy of the same tensor
on this machine (a worker: its calling thread's CPU time in the C call; the aggregators: their
serving threads' CPU time, all of them, per element and per contribution), the loopback goodput
(elements x 32 bits / time) of omnireduce and of the ring in the same processes, and what those CPU
costs mean on a fast network: the link rate one core of each role feeds and the cores per role for
10, 25 and 100 Gbit/s per worker (bench_switchml.line_rate). On a loaded host the goodputs are
noisy; the CPU times much less so.

    python benchmarks/bench_omnireduce.py [--quick] [--workers 4] [--mib 64] [--densities 0.01,0.1,1]
                                          [--modes colocated,dedicated] [--runs 5]
Results: benchmarks/results/omnireduce.json (and RESULTS.md).
"""
import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from bench_kernels import mac_algorithms, mac_call_ns  # noqa: E402
from bench_switchml import line_rate  # noqa: E402

BLOCK = 256


def masks_of(rank, nblocks, density, seed=1234):
    """Which blocks rank holds (exactly round(density * nblocks) of them, independent placement)."""
    import numpy as np
    k = max(1, round(density * nblocks))
    mask = np.zeros(nblocks, dtype=np.uint8)
    mask[np.random.default_rng([seed, rank, int(density * 1e6)]).choice(nblocks, k, replace=False)] = 1
    return mask


# -- inside each rank --------------------------------------------------------------------------------
def worker(args):
    import numpy as np

    import commlib
    from commlib.api import runtime
    from commlib.switch.omnireduce_model import paper_model, wire_model

    commlib.init(policy="*=omnireduce")
    rt = runtime()
    ctx, rank, n = rt.ctx, rt.ctx.rank, rt.ctx.size
    elements = args.mib * (1 << 20) // 4
    nblocks = -(-elements // BLOCK)
    omni = rt.backend("omnireduce")
    try:
        ring, engine = rt.backend("ring"), None
    except commlib.CommError as exc:
        ring, engine = None, f"unavailable: {exc}"

    splits = {}   # tag -> per run, the slowest rank's processing and transfer (common.slowest_call)

    def timed(backend, x, tag):
        backend.allreduce(x, f"{tag}.warmup")
        samples, out, splits[tag] = [], None, []
        for i in range(args.runs):
            ctx.barrier(f"bench/{tag}/{i}")
            out, seconds, split = common.slowest_call(ctx, f"bench/{tag}/{i}/s", lambda: backend.allreduce(x, f"{tag}"))
            samples.append(seconds)
            splits[tag].append(split)
        return samples, out

    def costed(backend, x, tag):
        """timed(), and the CPU ns per element of a worker (the ranks' mean) and of all aggregators
        (rank 0's reading; None elsewhere) over the timed calls and the warm-up."""
        agg_before, cpu_before = aggregator_cpu_ns(backend), backend.stats()["cpu_ns"]
        samples, out = timed(backend, x, tag)
        agg_after, cpu_after = aggregator_cpu_ns(backend), backend.stats()["cpu_ns"]
        calls = (args.runs + 1) * x.size
        workers = ctx.exchange(f"bench/cpu/{tag}", (cpu_after - cpu_before) / calls)
        cpu = {"worker_cpu_ns_per_element": sum(workers) / len(workers),
               "aggregator_cpu_ns_per_element": None if agg_before is None else (agg_after - agg_before) / calls}
        return samples, out, cpu

    results = {}
    for density in args.densities:
        masks = [masks_of(r, nblocks, density) for r in range(n)]
        x = np.zeros(nblocks * BLOCK, dtype=np.float32)
        x.reshape(nblocks, BLOCK)[masks[rank] > 0] = rank + 1           # closed-form sum, checked below
        x = x[:elements]
        served = common.daemon_ns({"omnireduce": omni})   # rank 0: the aggregators' queue_ns + proc_ns
        omni_s, out, cpu = costed(omni, x, f"omni{density}")
        server_s = common.server_seconds(served, common.daemon_ns({"omnireduce": omni}), args.runs + 1)
        expected = (np.stack(masks) * np.arange(1, n + 1)[:, None]).sum(axis=0).astype(np.float32)
        assert np.array_equal(out.reshape(-1)[: (elements // BLOCK) * BLOCK].reshape(-1, BLOCK)[:, 0],
                              expected[: elements // BLOCK]), "omnireduce sum is wrong"
        st = omni.stats()["tensors"][f"omni{density}"]
        per_rank = ctx.exchange(f"bench/bytes/{density}", [st["bytes_sent"], st["bytes_recv"], st["resends"],
                                                            st["density"], st["union_density"]])
        ring_s = timed(ring, x, f"ring{density}")[0] if ring is not None else None
        if engine is None and ring is not None:
            engine = ring.stats().get("engine", "ring")
        if rank == 0:
            wire = wire_model(masks, elements, BLOCK, omni.columns, authenticated=ctx.settings.authenticate)
            union = int(np.any(masks, axis=0).sum())
            paper = [paper_model(int(m.sum()), union, BLOCK * 4) for m in masks]
            results[str(density)] = {
                "omnireduce_s": omni_s, "ring_s": ring_s,
                "breakdowns": [dict(b, server_s=server_s) for b in splits[f"omni{density}"]],
                "bytes_sent": [p[0] for p in per_rank], "bytes_recv": [p[1] for p in per_rank],
                "resends": [p[2] for p in per_rank],
                "measured_density": [p[3] for p in per_rank], "measured_union_density": per_rank[0][4],
                "paper_model": paper, "wire_model": wire,
                "ring_model_bytes": 2 * (n - 1) / n * elements * 4, "cpu": cpu,
            }
        if density == max(args.densities):
            used = omni.stats()["packet_mac"]   # the default's algorithm: the run above
            macs = {mac: (omni_s, cpu) if mac == used else
                    timed_with(ctx, costed, x, f"{mac}{density}", packet_mac=mac)[::2] for mac in mac_algorithms()}
            no_mac_s, _, no_mac_cpu = timed_with(ctx, costed, x, f"nomac{density}", authenticate=False)
            path_s, _, path_cpu = timed_with(ctx, costed, x, f"path{density}", omnireduce_block_size=0)
            if rank == 0:
                results[str(density)].update(
                    no_mac_s=no_mac_s, no_mac_cpu=no_mac_cpu, path_s=path_s, path_cpu=path_cpu, default_mac=used,
                    macs={m: {"s": s, "cpu": c} for m, (s, c) in macs.items()},
                    mac_ns_per_packet={m: mac_call_ns(m, 40 + 4 * omni.block) for m in mac_algorithms()})
    if rank == 0:
        common.emit({"engine": engine, "size": n, "columns": omni.columns, "mode": omni.mode, "block": omni.block,
                     "elements": elements, "results": results})
    commlib.shutdown()


def timed_with(ctx, costed, x, tag, **settings):
    """costed() through an omnireduce backend of its own (same mode) with other settings: another packet
    MAC (packet_mac), packets without MACs (authenticate=False), blocks sized by the path
    (omnireduce_block_size=0)."""
    from commlib.backends.omnireduce import OmniReduceBackend
    from commlib.settings import Settings
    backend = OmniReduceBackend(ctx.joined(settings=Settings(dict(ctx.settings.as_dict(), **settings), environ={})))
    backend.start()
    try:
        return costed(backend, x, tag)
    finally:
        backend.close()


def aggregator_cpu_ns(backend):
    """The CPU time of every aggregator of the backend's job so far (their counters; rank 0 alone asks,
    the others get None)."""
    counters = backend.daemon_counters()
    return sum(fn()["cpu_ns"] for fn in counters.values()) if counters else None


def memcpy_ns(elements, repeats=5):
    """CPU ns per float32 element of copying a tensor of `elements` (the floor of a pass over it)."""
    import time
    import numpy as np
    src, dst = np.ones(elements, np.float32), np.empty(elements, np.float32)
    samples = []
    for _ in range(repeats):
        start = time.process_time_ns()
        np.copyto(dst, src)
        samples.append((time.process_time_ns() - start) / elements)
    return statistics.median(samples)


# -- the launcher ------------------------------------------------------------------------------------
def _run_workers(n, args, env):
    forwarded = ["--worker", "--mib", args.mib, "--runs", args.runs, "--densities", ",".join(map(str, args.densities))]
    return common.launch(n, Path(__file__), *forwarded, env=env, timeout=args.timeout)[0]


def fast_view(elements, seconds, ring_seconds, cpu, floor, n):
    """Goodputs (Gbit/s), the CPU ns per element of each role and what they mean on fast networks."""
    worker_ns, aggregator_ns = cpu["worker_cpu_ns_per_element"], cpu["aggregator_cpu_ns_per_element"]
    gbps, ring = elements * 32 / seconds / 1e9, ring_seconds and elements * 32 / ring_seconds / 1e9
    # an aggregator core serves every worker's contributions: per contribution, aggregator_ns / n
    return dict(line_rate(worker_ns, aggregator_ns / n, n), gbps=gbps, ring_gbps=ring, ratio=ring and gbps / ring,
                worker_ns=worker_ns, aggregator_ns=aggregator_ns, memcpy_ns=floor)


def _mib(b):
    return b / 2 ** 20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 MiB, 2 runs, colocated only: seconds (CI)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--mib", type=int, default=None, help="tensor size in MiB (float32)")
    parser.add_argument("--densities", default="0.01,0.1,1.0")
    parser.add_argument("--modes", default=None, help="colocated,dedicated")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.mib = args.mib or (4 if args.quick else 64)
    args.runs = args.runs or (2 if args.quick else 5)
    args.densities = [float(d) for d in args.densities.split(",")]
    if args.worker:
        return worker(args)
    modes = (args.modes or ("colocated" if args.quick else "colocated,dedicated")).split(",")

    n, results, rows, mac_rows, fast_rows = args.workers, {}, [], [], []
    load_before = os.getloadavg()
    floor = memcpy_ns(args.mib * (1 << 20) // 4)
    print(f"memcpy of the tensor: {floor:.3f} CPU ns per element", flush=True)
    for mode in modes:
        print(f"== omnireduce {mode}, {n} workers, {args.mib} MiB float32, block {BLOCK}", flush=True)
        payload = _run_workers(n, args, {"COMMLIB_OMNIREDUCE_MODE": mode, "COMMLIB_TIMEOUT_S": "120",
                                         "COMMLIB_FUSION_THRESHOLD": "0"})
        results[mode] = payload
        engine = payload["engine"]
        for density, r in payload["results"].items():
            omni, ring = statistics.median(r["omnireduce_s"]), (statistics.median(r["ring_s"]) if r["ring_s"] else None)
            own = statistics.fmean(r["measured_density"])
            sent, recv = statistics.fmean(r["bytes_sent"]), statistics.fmean(r["bytes_recv"])
            up = statistics.fmean(p[0] for p in r["paper_model"])
            down = statistics.fmean(p[1] for p in r["paper_model"])
            wire_up = statistics.fmean(w[0] for w in r["wire_model"])
            wire_down = statistics.fmean(w[1] for w in r["wire_model"])
            r.update(omnireduce=common.summarize(r["omnireduce_s"]),
                     ring=common.summarize(r["ring_s"]) if r["ring_s"] else None,
                     speedup_vs_ring=ring / omni if ring else None,
                     sent_vs_paper=sent / up, recv_vs_paper=recv / down,
                     sent_vs_wire=sent / wire_up, recv_vs_wire=recv / wire_down)
            print(f"  density {float(density):>5.0%}: measured own {own:.4f} union {r['measured_union_density']:.4f} | "
                  f"omnireduce {omni * 1e3:8.1f} ms | {engine} {ring * 1e3 if ring else float('nan'):8.1f} ms | "
                  f"speedup {ring / omni if ring else float('nan'):5.2f}x | "
                  f"sent {_mib(sent):7.2f} MiB (paper {_mib(up):7.2f}, wire {_mib(wire_up):7.2f}) | "
                  f"recv {_mib(recv):7.2f} MiB (paper {_mib(down):7.2f}, wire {_mib(wire_down):7.2f}) | "
                  f"ring {_mib(r['ring_model_bytes']):.2f} MiB each way | resends {sum(r['resends'])}", flush=True)
            if "no_mac_s" in r:
                no_mac = statistics.median(r["no_mac_s"])
                runs = {m: (v["s"], v["cpu"]) for m, v in r["macs"].items()}
                runs["off"] = (r["no_mac_s"], r["no_mac_cpu"])
                r["mac_cost"] = {}
                for m, (samples, cpu) in runs.items():
                    t = statistics.median(samples)
                    cost = r["mac_cost"][m] = 1 - no_mac / t
                    one = r["mac_ns_per_packet"].get(m)
                    print(f"  density {float(density):>5.0%}, MACs {m:<18}: omnireduce {t * 1e3:8.1f} ms "
                          f"({ring / t if ring else float('nan'):.2f}x the ring), the MACs' share {cost:5.1%} | "
                          f"CPU ns/element worker {cpu['worker_cpu_ns_per_element']:.2f}, aggregators "
                          f"{cpu['aggregator_cpu_ns_per_element']:.2f} (memcpy {floor:.2f})"
                          + (f" | one MAC {one:.0f} CPU ns per {payload['block']}-value block" if one else ""),
                          flush=True)
                    mac_rows.append(f"| {mode} | {float(density):.0%} | {m} | {t * 1e3:.1f} | "
                                    f"{ring / t if ring else float('nan'):.2f}x | {cost:.1%} | "
                                    f"{cpu['worker_cpu_ns_per_element']:.2f} | "
                                    f"{cpu['aggregator_cpu_ns_per_element']:.2f} | "
                                    + (f"{one:.0f} |" if one else "- |"))
            cases = [(f"{float(density):.0%}, {BLOCK}-value blocks", r["omnireduce_s"], r["cpu"])]
            if "path_s" in r:
                cases.append((f"{float(density):.0%}, path-sized blocks", r["path_s"], r["path_cpu"]))
            for label, samples, cpu in cases:
                fast = fast_view(payload["elements"], statistics.median(samples), ring, cpu, floor, n)
                r.setdefault("fast", {})[label] = fast
                print(f"  {label}: goodput omnireduce {fast['gbps']:.2f} Gbit/s, {engine} "
                      f"{fast['ring_gbps'] or float('nan'):.2f} ({fast['ratio'] or float('nan'):.2f}x) | CPU ns/element "
                      f"(memcpy {floor:.2f}): worker {fast['worker_ns']:.2f} ({fast['worker_ns'] / floor:.1f}x), "
                      f"aggregators {fast['aggregator_ns']:.2f} | one core feeds: a worker "
                      f"{fast['worker_core_gbps']:.1f} Gbit/s, aggregators {fast['switch_core_gbps_per_worker']:.1f} "
                      f"Gbit/s per worker | cores for " + ", ".join(
                          f"{k} Gbit/s per worker: worker {c['worker']:.1f}, aggregators {c['switch']:.1f}"
                          for k, c in fast["cores"].items()), flush=True)
                fast_rows.append(f"| {mode} | {label} | {fast['gbps']:.2f} | {fast['ring_gbps'] or float('nan'):.2f} | "
                                 f"{fast['ratio'] or float('nan'):.2f}x | {fast['worker_ns']:.2f} "
                                 f"({fast['worker_ns'] / floor:.1f}x) | {fast['aggregator_ns']:.2f} | "
                                 f"{fast['worker_core_gbps']:.1f} / {fast['switch_core_gbps_per_worker']:.1f} | "
                                 + " | ".join(f"{c['worker']:.1f} / {c['switch']:.1f}" for c in fast["cores"].values())
                                 + " |")
            r["bottleneck"] = common.bottleneck(omni, r["breakdowns"], "n/a: loopback", "aggregators")
            rows.append(f"| {mode} | {float(density):.0%} | {own:.4f} / {r['measured_union_density']:.4f} | "
                        f"{omni * 1e3:.1f} | {ring * 1e3 if ring else float('nan'):.1f} | "
                        f"{ring / omni if ring else float('nan'):.2f}x | {_mib(sent):.2f} / {_mib(up):.2f} | "
                        f"{_mib(recv):.2f} / {_mib(down):.2f} | {_mib(r['ring_model_bytes']):.2f} | "
                        f"{r['bottleneck']} |")
    engine = next(iter(results.values()))["engine"] if results else "?"
    markdown = (f"{n} workers on loopback, {args.mib} MiB float32, 256-element blocks placed independently per "
                f"rank; median of {args.runs} runs after a warm-up; dense peer = {engine} allreduce in the same "
                f"processes. Bytes are per worker (UDP payload, mean over ranks) vs OMNIREDUCE.md's model "
                f"(own blocks + 4 B up, union down); the ring moves 2(N-1)/N*S each way. Load average "
                f"{load_before[0]:.1f} on {os.cpu_count()} CPUs at the start. " + common.BOTTLENECK_RULE +
                " Here, omnireduce's, per run of the slowest rank: processing = its calling thread's CPU time "
                "(packing, MACs, its socket calls), transfer = the rest (common.slowest_call); colocated "
                "aggregators are threads of the workers' processes; on loopback the network is this host's "
                "kernel and CPUs.\n\n"
                "| aggregators | nominal density | measured own / union | omnireduce ms | ring ms | ring/omni | "
                "sent / model MiB | recv / model MiB | ring MiB each way | bottleneck (omnireduce) |\n"
                "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
                "\nThe packet MACs (from OpenSSL over every packet and result, switch/csrc/transport.h; the rows above "
                "are with MACs under the default algorithm, `auto`): the same allreduce under each algorithm "
                "(COMMLIB_PACKET_MAC) and without MACs (COMMLIB_AUTHENTICATE=0, `off`): median time, against the ring "
                "(wall time: noisy on a busy host), the MACs' share of the time against `off`, the CPU ns per "
                f"element of a worker and of all aggregators (robust; memcpy {floor:.2f}), one MAC of a block's packet.\n\n"
                "| aggregators | density | MAC | ms | ring/omni | MACs' share | worker CPU ns/elem | aggregators CPU "
                "ns/elem | one MAC, CPU ns/packet |\n|---|---|---|---|---|---|---|---|---|\n"
                + "\n".join(mac_rows) + "\n"
                f"\nThe fast-network view (issue 25): loopback goodput (elements x 32 bits / median time) against "
                f"the ring in the same processes; CPU ns per element of a worker (its calling thread in the C call, "
                f"mean over ranks; x the memcpy of the tensor, {floor:.2f} ns here) and of all aggregators together "
                f"(their serving threads); from those, the link rate one core of each role feeds (Gbit/s of float32 "
                f"gradients per worker) and the cores per role for 10, 25 and 100 Gbit/s per worker (worker / "
                f"aggregators). The host was loaded (load average {load_before[0]:.1f} on {os.cpu_count()} CPUs): "
                f"goodputs are noisy, CPU times less so.\n\n"
                "| aggregators | case | omnireduce Gbit/s | ring Gbit/s | ratio | worker ns/element | aggregators "
                "ns/element | one core feeds, worker / aggregators (Gbit/s) | cores at 10 Gbit/s | at 25 | at 100 |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(fast_rows) + "\n")
    settings = {"workers": n, "mib": args.mib, "runs": args.runs, "densities": args.densities, "modes": modes,
                "block": BLOCK, "quick": args.quick, "loadavg": load_before, "memcpy_ns": floor}
    common.save("omnireduce", settings, results, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
