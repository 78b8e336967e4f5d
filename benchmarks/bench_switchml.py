"""SwitchML allreduce goodput through the software switch, as the SwitchML benchmark reports it.

For each worker count, a `commlib-switch` process and N worker processes on loopback; each run
allreduces one float32 tensor of --elements values (quantized to int32 per packet of the job's size) and
prints, like p4app-switchML's allreduce benchmark,

    Job(s) #i# finished. Duration: #ns# ns Goodput: #x# Gbps.

then Min/Max/Median/Mean; goodput = elements * 32 / ns (the job's duration is the slowest rank's).
The same processes then time the ring allreduce of the same tensor through the core's engine
(Horovod with Gloo under horovodrun, else torch.distributed's Gloo) for the ratio, and the cost
of the packet MACs: the same allreduce through a switch embedded in rank 0 (the default set-up),
with MACs (the default) under each algorithm (COMMLIB_PACKET_MAC: AES-256-GCM, ChaCha20-Poly1305; `auto`
takes the faster on the job's packets) and without (COMMLIB_AUTHENTICATE=0, a trusted fabric), in two
rounds of opposite order (the runs of both pooled), each role's
CPU ns per element beside a memcpy of the tensor on this host, one MAC's CPU ns per packet
(bench_kernels.mac_call_ns) and the goodput each algorithm costs. CPU ns per element are robust on a
busy host; wall-clock goodput and the ratios to the ring are noisy there (medians of --runs). The switch's
own counters give the profile: its CPU time per element and its busy fraction (CPU time / wall
time of the timed runs; well below 1 means the switch is not the bottleneck).

The switch's scaling over cores: for each of --switch-threads (1,2), a `commlib-switch --threads T`
process and the workers with COMMLIB_SWITCH_STREAMS=T (each rank streams one share of every tensor to
each data-plane thread), in two rounds of opposite order; the switch's aggregation rate, the median
over the runs of contributions (packets added into a slot) per second, its CPU time per contribution
(its own process's data-plane threads), and the workers' CPU time per element apart (rank 0's C
workers, every stream summed).

The hierarchy's latency: the same workers through one `commlib-switch` and through two leaves and a spine
(three processes, COMMLIB_SWITCH_SPINE; no MACs), allreducing a small tensor (LATENCY_ELEMS values) many
times: the mean round of a packet (its first send to its result, the workers' round_ns), the median
allreduce, and what the second level adds to each.

    python benchmarks/bench_switchml.py [--quick] [--workers 2,4] [--elements 16777216] [--runs 10]
                                        [--switch-threads 1,2]
Results: benchmarks/results/switchml.json (and RESULTS.md).
"""
import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from bench_kernels import mac_algorithms, mac_call_ns, memcpy_ns  # noqa: E402

LATENCY_ELEMS = 4096   # the hierarchy's latency: a small tensor, a packet or two per rank


def _report(label, durations_ns, elements):
    """Per run and summary lines in the SwitchML benchmark's format; returns the goodputs (Gbps)."""
    goodputs = [elements * 32 / ns for ns in durations_ns]
    for i, (ns, gbps) in enumerate(zip(durations_ns, goodputs)):
        print(f"  [{label}] Job(s) #{i}# finished. Duration: #{int(ns)}# ns Goodput: #{gbps:.4f}# Gbps.")
    print(f"  [{label}] Min {min(goodputs):.4f} Gbps Max {max(goodputs):.4f} Gbps "
          f"Median {statistics.median(goodputs):.4f} Gbps Mean {statistics.fmean(goodputs):.4f} Gbps")
    return goodputs


# -- inside each rank --------------------------------------------------------------------------------
def worker(args):
    import numpy as np

    import commlib
    from commlib.api import runtime

    commlib.init(policy="*=switchml")
    rt = runtime()
    ctx, rank = rt.ctx, rt.ctx.rank
    x = np.random.default_rng(rank).standard_normal(args.elements).astype(np.float32)

    splits = {}   # tag -> per run, the slowest rank's processing and transfer (common.slowest_call)

    def timed(backend, tag):
        backend.allreduce(x, f"{tag}.warmup")
        out, splits[tag] = [], []
        for i in range(args.runs):
            ctx.barrier(f"bench/{tag}/{i}")
            _, seconds, split = common.slowest_call(ctx, f"bench/{tag}/{i}/s",
                                                    lambda: backend.allreduce(x, f"{tag}.{i}"))
            out.append(seconds * 1e9)
            splits[tag].append(split)
        return out

    switchml = rt.backend("switchml")
    switchml.allreduce(x[:1], "setup")   # registration happens on the first call
    if args.latency:   # small allreduces: the round trip per packet and per call (rank 0 reports)
        small, times = x[:LATENCY_ELEMS], []
        switchml.allreduce(small, "latency.warmup")
        w0 = switchml.stats()
        for i in range(4 * args.runs):
            ctx.barrier(f"bench/latency/{i}")
            times.append(common.slowest_call(ctx, f"bench/latency/{i}/s",
                                             lambda: switchml.allreduce(small, f"latency.{i}"))[1] * 1e9)
        w1 = switchml.stats()
        if rank == 0:
            common.emit({"allreduce_ns": times,
                         "round_ns": (w1["round_ns"] - w0["round_ns"]) / max(1, w1["received"] - w0["received"])})
        commlib.shutdown()
        return
    before, w_before = switch_counters(switchml, rank), switchml.stats()
    job_before = switchml.switch_counters()["counters"] if rank == 0 else None
    served = common.daemon_ns({"switchml": switchml})   # rank 0: the job's queue_ns + proc_ns on the switch
    wall = time.perf_counter_ns()
    sml_ns = timed(switchml, "switchml")
    wall = time.perf_counter_ns() - wall
    server_s = common.server_seconds(served, common.daemon_ns({"switchml": switchml}), args.runs + 1)
    after, w_after = switch_counters(switchml, rank), switchml.stats()
    if args.scaling:   # the switch's aggregation rate only (rank 0 reports)
        if rank == 0:
            job_after = switchml.switch_counters()["counters"]
            common.emit({"switchml_ns": sml_ns, "streams": w_after["streams"],
                         "aggregated": job_after["aggregated"] - job_before["aggregated"],
                         "switch_cpu_ns": after["cpu_ns"] - before["cpu_ns"],
                         "worker_cpu_ns": w_after["cpu_ns"] - w_before["cpu_ns"],
                         "elements": args.elements * (args.runs + 1)})
        commlib.shutdown()
        return
    try:
        ring = rt.backend("ring")
        ring_ns, engine = timed(ring, "ring"), ring.stats().get("engine")
    except commlib.CommError as exc:
        ring_ns, engine = None, f"unavailable: {exc}"
    mac_ns, mac_cpu = {}, {}
    for mac in embedded_runs() + embedded_runs()[::-1]:   # two rounds of opposite order: drift weighs on each alike
        ns, cpu = timed_embedded(ctx, timed, mac, args.elements * (args.runs + 1))
        mac_ns.setdefault(mac, []).extend(ns)
        if cpu is not None:   # rank 0: the mean of the rounds
            mac_cpu[mac] = {k: (v + mac_cpu[mac][k]) / 2 for k, v in cpu.items()} if mac in mac_cpu else cpu
    if rank != 0:   # rank 0 reports
        commlib.shutdown()
        return
    elements = args.elements * (args.runs + 1)   # the warm-up is inside the counter window too
    profile = {
        "switch_cpu_ns_per_element": (after["cpu_ns"] - before["cpu_ns"]) / elements,
        "switch_busy_fraction": (after["cpu_ns"] - before["cpu_ns"]) / wall,
        "worker_cpu_ns_per_element": (w_after["cpu_ns"] - w_before["cpu_ns"]) / elements,
        "worker_wait_fraction": (w_after["wait_ns"] - w_before["wait_ns"]) / wall,
        "switch_gso_messages": after["gso_messages"] - before["gso_messages"],
        "switch_packets": after["pkts_recv"] - before["pkts_recv"],
        "worker_resends": w_after["resends"] - w_before["resends"],
    }
    profile["packet_elems"], profile["window"] = w_after["packet_elems"], w_after["window"]
    profile["mac_cpu_ns_per_packet"] = {mac: mac_call_ns(mac, 20 + 4 * profile["packet_elems"])
                                        for mac in mac_algorithms()}
    from commlib.switch import packet_mac
    # what the default set-up (packet_mac=auto) chooses for these packets on this host: rank 0 times it so
    profile["default_mac"] = packet_mac.resolve(packet_mac.AUTO, 20 + 4 * profile["packet_elems"])
    breakdowns = [dict(b, server_s=server_s) for b in splits["switchml"]]
    common.emit({"switchml_ns": sml_ns, "ring_ns": ring_ns, "engine": engine, "profile": profile,
                 "breakdowns": breakdowns,
                 "size": ctx.size, "embedded_ns": mac_ns, "embedded_cpu": mac_cpu})
    commlib.shutdown()


def switch_counters(backend, rank):
    """The switch-wide counters, asked by rank 0 alone: requests signed as the switch's operator must
    reach it one at a time (each must carry a larger seq than the last), so the ranks do not all ask."""
    return backend.switch_wide_counters() if rank == 0 else None


OFF = "off"   # the embedded runs without MACs


def embedded_runs():
    """The embedded switch's runs: with MACs under each algorithm, then without."""
    return mac_algorithms() + [OFF]


def timed_embedded(ctx, timed, mac, elements):
    """timed() through a switchml backend of its own, with the switch embedded in rank 0 (the
    default set-up, whose daemon key the job holds) and the packets' MACs under algorithm `mac` or
    off (OFF); with the CPU time per element of this rank's worker and of the switch (CPU time: robust
    to a busy host, where goodput is not)."""
    from commlib.backends.switchml import SwitchMLBackend
    from commlib.settings import Settings
    authenticate = mac != OFF
    settings = Settings(dict(ctx.settings.as_dict(), switch_addr="", authenticate=authenticate,
                             packet_mac=mac if authenticate else "auto"), environ={})
    backend = SwitchMLBackend(ctx.joined(settings=settings))
    backend.start()
    try:
        rank = ctx.rank
        before, w_before = switch_counters(backend, rank), backend.stats()["cpu_ns"]
        ns = timed(backend, f"switchml.mac.{mac}")
        after, w_after = switch_counters(backend, rank), backend.stats()["cpu_ns"]
        if rank != 0:
            return ns, None
        cpu = {"worker_cpu_ns_per_element": (w_after - w_before) / elements,
               "switch_cpu_ns_per_element": (after["cpu_ns"] - before["cpu_ns"]) / elements}
        return ns, cpu
    finally:
        backend.close()


def line_rate(worker_ns, switch_ns, n, rates=(10, 25, 100)):
    """What the measured CPU costs mean on a fast network: the link rate (Gbit/s of float32
    gradients) one core of each role feeds, and the cores per role for each of `rates` Gbit/s per
    worker. worker_ns: a worker's CPU ns per element; switch_ns: the switch's per element of one
    contribution, which serves n workers' contributions. A cost too small to be seen (a run shorter
    than the clock's grain) gives nan, not a division by zero."""
    worker_gbps, switch_gbps = (32 / ns if ns > 0 else math.nan for ns in (worker_ns, switch_ns))
    return {"worker_core_gbps": worker_gbps, "switch_core_gbps": switch_gbps,
            "switch_core_gbps_per_worker": switch_gbps / n,
            "cores": {str(r): {"worker": r / worker_gbps, "switch": n * r / switch_gbps} for r in rates}}


# -- the launcher ------------------------------------------------------------------------------------
def _scaling(n, threads, args, env):
    """The switch's aggregation rate with `threads` data-plane threads, each rank streaming to each."""
    proc, address = _start_switch(["--threads", str(threads)] + (["--no-offload"] if args.no_offload else []))
    try:
        payload = _run_workers(n, args, dict(env, COMMLIB_SWITCH_ADDR=address, COMMLIB_AUTHENTICATE="0",
                                             COMMLIB_SWITCH_STREAMS=str(threads)), "--scaling")
    finally:
        proc.kill()
        proc.wait()
    goodput = _report(f"switchml, switch of {threads} threads", payload["switchml_ns"], args.elements)
    per_run = payload["aggregated"] / (args.runs + 1)   # every run (and the warm-up) the same tensor
    return {"streams": payload["streams"], "contributions_per_s": [per_run * 1e9 / ns for ns in payload["switchml_ns"]],
            "values_per_contribution": payload["elements"] * n / max(1, payload["aggregated"]),
            "switch_cpu_ns_per_contribution": payload["switch_cpu_ns"] / max(1, payload["aggregated"]),
            "worker_cpu_ns_per_element": payload["worker_cpu_ns"] / payload["elements"], "gbps": goodput}


def _scalings(n, args, env):
    """_scaling for each of --switch-threads, in two rounds of opposite order (a busy host's drift then
    weighs on each alike), the runs of both rounds pooled: per thread count the median contributions/s
    (per run: the tensor's contributions over its duration), against the first thread count's."""
    counts = [int(v) for v in args.switch_threads.split(",") if v]
    pooled = {}
    for order in (counts, counts[::-1]):
        for threads in order:
            run = _scaling(n, threads, args, env)
            into = pooled.setdefault(str(threads), dict(run, contributions_per_s=[], gbps=[], cpu=[], worker=[]))
            into["contributions_per_s"] += run["contributions_per_s"]
            into["gbps"] += run["gbps"]
            into["cpu"].append(run["switch_cpu_ns_per_contribution"])
            into["worker"].append(run["worker_cpu_ns_per_element"])
    out = {}
    for threads, run in pooled.items():
        out[threads] = {"streams": run["streams"], "contributions_per_s": run["contributions_per_s"],
                        "median_contributions_per_s": statistics.median(run["contributions_per_s"]),
                        "values_per_contribution": run["values_per_contribution"],
                        "switch_cpu_ns_per_contribution": statistics.median(run["cpu"]),
                        "worker_cpu_ns_per_element": statistics.median(run["worker"]),
                        "median_gbps": statistics.median(run["gbps"])}
    first = out[str(counts[0])]["median_contributions_per_s"] if counts else 1.0
    for run in out.values():
        run["ratio"] = run["median_contributions_per_s"] / first
    return out


def _latency(n, args, env):
    """The workers' mean packet round and median small allreduce through one switch and through two leaves and
    a spine (each switch its own process, no MACs); what the second level adds."""
    out = {}
    for name, count in (("one switch", 1), ("two levels", 3)):
        procs = [_start_switch([]) for _ in range(count)]
        addrs = [address for _, address in procs]
        where = {"COMMLIB_SWITCH_ADDR": addrs[0]} if count == 1 else \
            {"COMMLIB_SWITCH_ADDR": ",".join(addrs[:2]), "COMMLIB_SWITCH_SPINE": addrs[2]}
        try:
            payload = _run_workers(n, args, dict(env, COMMLIB_AUTHENTICATE="0", **where), "--latency")
        finally:
            for proc, _ in procs:
                proc.kill()
                proc.wait()
        out[name] = {"round_us": payload["round_ns"] / 1e3,
                     "allreduce_us": statistics.median(payload["allreduce_ns"]) / 1e3}
    out["extra_round_us"] = out["two levels"]["round_us"] - out["one switch"]["round_us"]
    out["extra_allreduce_us"] = out["two levels"]["allreduce_us"] - out["one switch"]["allreduce_us"]
    return out


def _start_switch(extra):
    port_file = Path(tempfile.mkdtemp()) / "port"
    proc = subprocess.Popen([sys.executable, "-m", "commlib.switch", "--port", "0", "--port-file", str(port_file),
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("commlib-switch did not start")
        time.sleep(0.05)
    return proc, port_file.read_text()


def _run_workers(n, args, env, *extra):
    forwarded = ["--worker", "--elements", args.elements, "--runs", args.runs, *extra]
    return common.launch(n, Path(__file__), *forwarded, env=env, timeout=args.timeout)[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small tensor, few runs: seconds")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--elements", type=int, default=None, help="float32 values per tensor")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--window", type=int, default=0, help="packets in flight per rank (0: the backend's default)")
    parser.add_argument("--packet-elems", type=int, default=0, help="values per packet (0: sized by the path)")
    parser.add_argument("--no-offload", action="store_true", help="one datagram per system call (no GSO/GRO)")
    parser.add_argument("--switch-threads", default="1,2", help="data-plane threads of the switch to compare "
                        "(its aggregation rate); empty: skip")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scaling", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--latency", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.elements = args.elements or (1 << 20 if args.quick else 1 << 24)
    args.runs = args.runs or (5 if args.quick else 10)
    if args.worker:
        return worker(args)

    env = {"COMMLIB_SWITCH_WINDOW": str(args.window), "COMMLIB_SWITCH_PACKET_ELEMS": str(args.packet_elems),
           "COMMLIB_SWITCH_OFFLOAD": "0" if args.no_offload else "1",
           "COMMLIB_TIMEOUT_S": "60"}
    results, rows, mac_rows, fast_rows, scale_rows, tree_rows = {}, [], [], [], [], []
    copy_ns = memcpy_ns(4 * args.elements, calls=20) / args.elements   # a memcpy of the tensor, per element
    for n in [int(v) for v in args.workers.split(",")]:
        proc, address = _start_switch(["--no-offload"] if args.no_offload else [])
        try:
            print(f"== {n} workers, {args.elements} float32 ({args.elements * 4 / 2 ** 20:.1f} MiB), "
                  f"switch {address}")
            payload = _run_workers(n, args, dict(env, COMMLIB_SWITCH_ADDR=address, COMMLIB_AUTHENTICATE="0"))   # keyless switch
        finally:
            proc.kill()
            proc.wait()
        sml = _report("switchml", payload["switchml_ns"], args.elements)
        ring = _report(f"ring/{payload['engine']}", payload["ring_ns"], args.elements) if payload["ring_ns"] else None
        embedded = {mac: _report("switchml embedded, " + (f"MACs {mac}" if mac != OFF else "no MACs"),
                                 payload["embedded_ns"][mac], args.elements) for mac in embedded_runs()}
        cpu, no_mac = payload["embedded_cpu"], embedded[OFF]
        mac_cost = {mac: 1 - statistics.median(embedded[mac]) / statistics.median(no_mac) for mac in mac_algorithms()}
        prof = payload["profile"]
        default_mac = prof["default_mac"]
        verdict = common.bottleneck(statistics.median(payload["switchml_ns"]) / 1e9, payload["breakdowns"],
                                    "n/a: loopback")
        print(f"  CPU ns/element beside a memcpy of the tensor ({copy_ns:.2f} ns/element on this host); worker, switch "
              f"per contribution (of {n}), goodput vs the ring in the same processes, the MACs' share of the goodput:")
        for mac in embedded_runs():
            c = cpu[mac]
            share = (f", MACs cost {mac_cost[mac]:.1%} of the goodput, one MAC "
                     f"{prof['mac_cpu_ns_per_packet'][mac]:.0f} CPU ns per {prof['packet_elems']}-value packet"
                     if mac != OFF else "")
            ratio = f", {statistics.median(embedded[mac]) / statistics.median(ring):.2f}x the ring" if ring else ""
            print(f"    {mac:<18} worker {c['worker_cpu_ns_per_element']:.2f} "
                  f"({c['worker_cpu_ns_per_element'] / copy_ns:.1f}x memcpy), switch {c['switch_cpu_ns_per_element'] / n:.2f}/contribution{ratio}{share}")
        print(f"  profile: switch {prof['switch_cpu_ns_per_element']:.2f} CPU ns/element, busy "
              f"{prof['switch_busy_fraction']:.0%}; worker {prof['worker_cpu_ns_per_element']:.2f} CPU ns/element, "
              f"waiting {prof['worker_wait_fraction']:.0%}; {prof['worker_resends']} resends")
        on, mac = cpu[default_mac], embedded[default_mac]
        per_contribution = on["switch_cpu_ns_per_element"] / n
        fast = line_rate(on["worker_cpu_ns_per_element"], per_contribution, n)
        default_ratio = statistics.median(mac) / statistics.median(ring) if ring else None
        if ring:
            print(f"  default set-up (switch embedded in rank 0, MACs {default_mac}): {statistics.median(mac):.3f} "
                  f"Gbps = {default_ratio:.2f}x the ring in the same processes")
        print(f"  fast networks, from the CPU costs with MACs (worker {on['worker_cpu_ns_per_element']:.2f} ns/element, "
              f"switch {per_contribution:.2f} ns/element/contribution): one core feeds a worker's "
              f"{fast['worker_core_gbps']:.1f} Gbit/s, a switch's {fast['switch_core_gbps']:.1f} Gbit/s of "
              f"contributions ({fast['switch_core_gbps_per_worker']:.1f} per worker at {n}); cores for "
              + ", ".join(f"{r} Gbit/s per worker: worker {c['worker']:.1f}, switch {c['switch']:.1f}"
                          for r, c in fast["cores"].items()))
        results[str(n)] = {"switchml_ns": payload["switchml_ns"], "switchml_gbps": common.summarize(sml),
                           "default_ratio_median": default_ratio, "line_rate": fast,
                           "ring_engine": payload["engine"], "ring_ns": payload["ring_ns"],
                           "ring_gbps": common.summarize(ring) if ring else None,
                           "ratio_median": statistics.median(sml) / statistics.median(ring) if ring else None,
                           "profile": prof, "default_mac": default_mac, "memcpy_ns_per_element": copy_ns,
                           "embedded_gbps": {m: common.summarize(g) for m, g in embedded.items()},
                           "embedded_ratio_median": {m: statistics.median(g) / statistics.median(ring)
                                                     for m, g in embedded.items()} if ring else None,
                           "mac_cost": mac_cost, "embedded_cpu": cpu, "breakdowns": payload["breakdowns"],
                           "bottleneck": verdict}
        scaling = _scalings(n, args, env)
        for threads, run in scaling.items():
            rate = run["median_contributions_per_s"]
            print(f"  switch of {threads} threads, {run['streams']} streams per rank: median {rate:,.0f} "
                  f"contributions/s of {run['values_per_contribution']:.0f} values ({run['ratio']:.2f}x the first), "
                  f"switch {run['switch_cpu_ns_per_contribution']:.0f} CPU ns/contribution, worker "
                  f"{run['worker_cpu_ns_per_element']:.2f} CPU ns/element")
            scale_rows.append(f"| {n} | {threads} | {run['streams']} | {rate:,.0f} | "
                              f"{rate * run['values_per_contribution'] / 1e9:.2f} | {run['ratio']:.2f}x | "
                              f"{run['switch_cpu_ns_per_contribution']:.0f} | {run['worker_cpu_ns_per_element']:.2f} | "
                              f"{run['median_gbps']:.3f} |")
        results[str(n)]["switch_threads"] = scaling
        tree = results[str(n)]["hierarchy"] = _latency(n, args, env)
        one, two = tree["one switch"], tree["two levels"]
        print(f"  two levels (2 leaves, a spine) against one switch: packet round {two['round_us']:.0f} against "
              f"{one['round_us']:.0f} us (+{tree['extra_round_us']:.0f} us), allreduce of {LATENCY_ELEMS} values "
              f"{two['allreduce_us']:.0f} against {one['allreduce_us']:.0f} us (+{tree['extra_allreduce_us']:.0f} us)")
        tree_rows.append(f"| {n} | {one['round_us']:.0f} | {two['round_us']:.0f} | +{tree['extra_round_us']:.0f} | "
                         f"{one['allreduce_us']:.0f} | {two['allreduce_us']:.0f} | +{tree['extra_allreduce_us']:.0f} |")
        rows.append(f"| {n} | {statistics.median(sml):.3f} | "
                    + (f"{statistics.median(ring):.3f} | {results[str(n)]['ratio_median']:.2f}x" if ring else "- | -")
                    + f" | {prof['switch_busy_fraction']:.0%} | {prof['switch_cpu_ns_per_element']:.2f} | "
                    f"{prof['worker_cpu_ns_per_element']:.2f} | {verdict} |")
        for m in embedded_runs():
            c = cpu[m]
            mac_rows.append(f"| {n} | {m} | {statistics.median(embedded[m]):.3f} | "
                            + (f"{statistics.median(embedded[m]) / statistics.median(ring):.2f}x" if ring else "-")
                            + f" | {c['worker_cpu_ns_per_element']:.2f} | {c['switch_cpu_ns_per_element'] / n:.2f} | "
                            f"{copy_ns:.2f} | " + (f"{mac_cost[m]:.1%} | {prof['mac_cpu_ns_per_packet'][m]:.0f} |"
                                                   if m != OFF else "- | - |"))
        fast_rows.append(f"| {n} | {statistics.median(mac):.3f} | "
                         + (f"{default_ratio:.2f}x" if ring else "-")
                         + f" | {on['worker_cpu_ns_per_element']:.2f} | {per_contribution:.2f} | "
                         f"{fast['worker_core_gbps']:.1f} | {fast['switch_core_gbps_per_worker']:.1f} | "
                         + " | ".join(f"{c['worker']:.1f} / {c['switch']:.1f}" for c in fast["cores"].values()) + " |")
    engine = next(iter(results.values()))["ring_engine"] if results else "?"
    markdown = (f"float32 allreduce of {args.elements:,} values on loopback (median goodput, Gbps = elements*32/ns; "
                f"ring = {engine} allreduce in the same processes). " + common.BOTTLENECK_RULE + " Here, switchml's, per "
                "run of the slowest rank: processing = its calling thread's CPU time (quantizing, packing, MACs, its "
                "socket calls), transfer = the rest (common.slowest_call); on loopback the network is this host's "
                "kernel and CPUs.\n\n"
                "| workers | switchml Gbps | ring Gbps | switchml/ring | switch busy | switch CPU ns/elem | "
                "worker CPU ns/elem | bottleneck (switchml) |\n"
                "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
                "\nThe packet MACs, the switch embedded in rank 0 (the default set-up: MACs under `auto`, which chose "
                + ", ".join(f"{r['profile']['default_mac']} at {n} workers" for n, r in results.items())
                + " here), under each algorithm (COMMLIB_PACKET_MAC, from OpenSSL over every packet and result, "
                "switch/csrc/transport.h) and off (COMMLIB_AUTHENTICATE=0): median goodput and against the ring in "
                "the same processes (wall time: noisy on a busy host), the worker's CPU ns per element and the "
                "switch's per element of one contribution (robust), a memcpy of the tensor per element on this host, "
                "the goodput the MACs cost against no MACs, and one MAC of a packet of the job's size (a worker makes "
                "two per packet, the switch n + 1 per round of n contributions).\n\n"
                "| workers | MAC | Gbps | / ring | worker CPU ns/elem | switch CPU ns/elem/contribution | memcpy ns/elem "
                "| MAC cost | one MAC, CPU ns/packet |\n"
                "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(mac_rows) + "\n"
                "\nFast networks, from the CPU costs of the default set-up (switch embedded in rank 0, MACs on): the "
                "link rate one core of each role feeds (Gbit/s of float32 gradients per worker; a switch core serves "
                "every worker's contributions) and the cores per role for 10, 25 and 100 Gbit/s per worker (worker / "
                "switch), with the default set-up's goodput against the ring in the same processes.\n\n"
                "| workers | default set-up Gbps | / ring | worker CPU ns/elem | switch CPU ns/elem/contribution | "
                "worker core Gbit/s | switch core Gbit/s per worker | cores at 10 Gbit/s | at 25 | at 100 |\n"
                "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(fast_rows) + "\n"
                "\nThe switch over cores: a standalone `commlib-switch --threads T` (no MACs), each rank streaming to "
                "each of its T threads (COMMLIB_SWITCH_STREAMS=T), in two rounds of opposite order; its aggregation "
                "rate = the median over both rounds' runs of contributions (packets added into a slot, each of the "
                "job's values per packet) per second of the run, also in values per second, against the first "
                "thread count in the same invocation; its CPU per "
                "contribution (its data-plane threads); the workers' CPU per element apart (rank 0's C workers, "
                "every stream summed). On a host with fewer free cores than workers + threads, the threads share "
                "cores with the workers and the ratio says so.\n\n"
                "| workers | switch threads | streams per rank | contributions/s | Gvalues/s | / 1 thread | switch CPU "
                "ns/contribution | worker CPU ns/elem | goodput Gbps |\n"
                "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(scale_rows) + "\n"
                f"\nThe hierarchy's latency: the workers through one `commlib-switch`, and through two leaves and a "
                f"spine (COMMLIB_SWITCH_SPINE; three processes, no MACs), allreducing {LATENCY_ELEMS} values "
                f"{4 * args.runs} times: a packet's mean round (first send to result) and the median allreduce (slowest "
                f"rank), in us; the difference is what the second level adds (on loopback: a switch's processing and "
                f"two more datagrams through this host's kernel).\n\n"
                "| workers | round, one switch | round, two levels | added | allreduce, one switch | allreduce, two "
                "levels | added |\n"
                "|---|---|---|---|---|---|---|\n" + "\n".join(tree_rows) + "\n")
    settings = {"elements": args.elements, "runs": args.runs, "window": args.window, "quick": args.quick,
                "offload": not args.no_offload, "packet_elems": args.packet_elems}
    common.save("switchml", settings, results, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
