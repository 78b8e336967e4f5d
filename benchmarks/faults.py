"""`make faults`: switchml and omnireduce jobs with faults on the wire, as `tc netem` would make them.

Each algorithm runs a job of --ranks ranks (threads of this process, commlib.testing.LocalGroup)
whose embedded daemons (rank 0's switch; one spawned commlib-aggregator) sit behind the user-space
fault relay (switch/relay.py), which applies the fault to both directions of every worker's link:

    none | loss 5% | duplication 5% | reordering 25% (held back 5 ms) | jitter 2 +- 1 ms | all at once

The job allreduces the same tensors under each fault (switchml: float32 and int32 of --elements;
omnireduce: block-sparse integer-valued float32 and int32), packets authenticated as by default.
The table gives the completion time of the allreduces (the slowest rank's, set-up excluded; the
median of --repeat jobs) and whether every result of every job is bit-identical to the fault-free
run's, with what the relay did and what
the daemons and workers counted (retransmissions, late packets refused).

With --switches N, switchml's job streams to N commlib-switch servers of this process (keyed, the
ranks given the key file), each behind its own relay, each holding a share of every tensor. With --spine
they are leaves (2 unless --switches says more) of a two-level job: each rank streams to one leaf, the
leaves to a spine behind its own relay, so the faults hit both levels.

    python benchmarks/faults.py [--quick] [--ranks 4] [--elements 1048576] [--repeat 3] [--packet-elems 0]
                                [--omnireduce-block 256] [--switches 1] [--spine]
Results: benchmarks/results/faults.json (and RESULTS.md). Exits 1 when a result differs.
The relay is Python on the same cores as the job: its own latency is part of every time, the
fault-free one included, so the times compare faults with each other, not with a real fabric.
"""
import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import commlib.backends.omnireduce as om
import commlib.backends.switchml as sml
from commlib.settings import Settings
from commlib.switch import auth
from commlib.switch.relay import Faults, relayed
from commlib.testing import LocalGroup

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

PROFILES = [
    ("none", Faults()),
    ("loss 5%", Faults(loss=0.05)),
    ("duplication 5%", Faults(duplicate=0.05)),
    ("reordering 25% (+5 ms)", Faults(reorder=0.25, reorder_ms=5.0)),
    ("jitter 2+-1 ms", Faults(delay_ms=2.0, jitter_ms=1.0)),
    ("all of the above", Faults(loss=0.05, duplicate=0.05, reorder=0.25, reorder_ms=5.0, delay_ms=2.0, jitter_ms=1.0)),
]

ALGORITHMS = {
    "switchml": (sml.SwitchMLBackend, dict(switch_window=64, switch_retransmit_ms=10.0, switch_retransmit_max_ms=100.0)),
    "omnireduce": (om.OmniReduceBackend, dict(omnireduce_mode="dedicated", omnireduce_num_aggregators=1,
                                              omnireduce_columns=64,
                                              omnireduce_retransmit_ms=10.0)),
}


def inputs(algorithm, ranks, elements):
    """Per tensor, every rank's array."""
    rng = np.random.default_rng(0)
    if algorithm == "switchml":
        return [rng.standard_normal((ranks, elements)).astype(np.float32),
                rng.integers(-2 ** 24, 2 ** 24, (ranks, elements // 4), dtype=np.int32)]
    nb = elements // 256
    out = []
    for dtype, density in ((np.float32, 0.3), (np.int32, 0.05)):
        x = np.zeros((ranks, nb, 256), dtype)
        for r in range(ranks):
            chosen = rng.choice(nb, int(density * nb), replace=False)
            x[r, chosen] = rng.integers(-1000, 1000, (len(chosen), 256))
        out.append(x.reshape(ranks, -1))
    return out


@contextlib.contextmanager
def switches(count, spine=False):
    """Settings for switchml through `count` keyed switches of this process (none for 1: the embedded one),
    with `spine` the leaves of a spine of this process too."""
    if count <= 1 and not spine:
        yield {}
        return
    with tempfile.TemporaryDirectory() as folder:
        key_file = f"{folder}/daemon.key"
        key = auth.write_key(key_file)
        servers = [sml.sw.SwitchServer("127.0.0.1", 0, slots=1024, key=key).start() for _ in range(count + spine)]
        try:
            yield {"switch_addr": ",".join(server.address for server in servers[:count]), "switch_key_file": key_file,
                   **({"switch_spine": servers[-1].address} if spine else {})}
        finally:
            for server in servers:
                server.stop()


def run(algorithm, faults, ranks, tensors, seed, packet_elems=0, omnireduce_block=256, nswitches=1, spine=False):
    """(seconds of the slowest rank, results by rank, relay counters (summed), backend counters of rank 0)."""
    switchml = algorithm == "switchml"
    with switches(nswitches if switchml else 1, spine and switchml) as extra:
        return _run(algorithm, faults, ranks, tensors, seed, packet_elems, omnireduce_block, extra)


def _run(algorithm, faults, ranks, tensors, seed, packet_elems, omnireduce_block, extra):
    base, settings = ALGORITHMS[algorithm]
    if algorithm == "switchml":
        settings = dict(settings, switch_packet_elems=packet_elems, **extra)
    else:
        settings = dict(settings, omnireduce_block_size=omnireduce_block)
    backend_cls, relays = relayed(base, faults, seed)
    group = LocalGroup(ranks, Settings({"timeout_s": 60.0, **settings}))
    stats = {}

    def main(ctx):
        backend = backend_cls(ctx)
        backend.start()
        try:
            ctx.barrier("go")
            start = time.perf_counter()
            out = [backend.allreduce(x[ctx.rank], f"t{i}") for i, x in enumerate(tensors)]
            seconds = max(ctx.exchange("seconds", time.perf_counter() - start))
            if ctx.rank == 0:
                stats.update(backend.stats())
                if algorithm == "switchml":
                    stats["switch"] = backend.switch_counters()["counters"]
            return seconds, out
        finally:
            backend.close()

    try:
        done = group.run(main, 170.0)
    finally:
        for relay in relays:
            relay.stop()
    counters = {d: {k: sum(relay.counters[d][k] for relay in relays) for k in relays[0].counters[d]}
                for d in relays[0].counters}
    return done[0][0], [out for _, out in done], counters, stats


def counted(algorithm, relay, stats):
    """What the relay did and what the job counted, in a few words."""
    made = ", ".join(f"{k} {relay['up'][k] + relay['down'][k]}" for k in ("lost", "duplicated", "reordered")
                     if relay["up"][k] + relay["down"][k])
    if algorithm == "switchml":
        s = stats["switch"]
        seen = f"resends {stats['resends']}, late refused {s['drop_late']}, replays {s['replays']}"
        if s.get("up_sent"):   # a two-level job: rank 0's leaf's resends of partial sums to the spine
            seen += f", leaf resends {s['up_resends']}"
    else:
        seen = f"resends {stats['resends']}, bad_mac {stats['bad_mac']}"
    return made or "-", seen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--elements", type=int, default=1 << 20, help="float32 elements per tensor and rank")
    parser.add_argument("--repeat", type=int, default=3, help="jobs per fault (the median time is shown)")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 64 Ki elements, one job per fault")
    parser.add_argument("--packet-elems", type=int, default=0, help="switchml's values per packet (0: the path's)")
    parser.add_argument("--omnireduce-block", type=int, default=256, help="omnireduce's values per block and packet "
                        "(0: the path's)")
    parser.add_argument("--switches", type=int, default=1, help="switchml through this many switches (1: the "
                        "embedded one)")
    parser.add_argument("--spine", action="store_true", help="the switches are leaves (2 at least) of a spine: a "
                        "two-level job")
    args = parser.parse_args(argv)
    if args.spine:
        args.switches = max(2, args.switches)
    if args.quick:
        args.ranks, args.elements, args.repeat = 2, 1 << 16, 1
    rows, lines, identical = [], [], True
    through = f"{args.switches} {'leaves and a spine' if args.spine else 'switch(es)'}"
    print(f"{args.ranks} ranks, {args.elements} elements per tensor, switchml through {through}; "
          f"faults on both directions of every link")
    print(f"{'algorithm':<11} {'fault':<24} {'seconds':>8} {'x none':>7}  {'identical':<9}  relay / job counters")
    for algorithm in ALGORITHMS:
        tensors = inputs(algorithm, args.ranks, args.elements)
        reference = None
        for i, (name, faults) in enumerate(PROFILES):
            times, same = [], True
            for k in range(args.repeat):
                seconds, results, relay, stats = run(algorithm, faults, args.ranks, tensors, seed=100 * k + i + 1,
                                                     packet_elems=args.packet_elems,
                                                     omnireduce_block=args.omnireduce_block, nswitches=args.switches,
                                                     spine=args.spine)
                if reference is None:
                    reference = results[0]
                same &= all(got.tobytes() == want.tobytes() for rank in results for got, want in zip(rank, reference))
                times.append(seconds)
            seconds = statistics.median(times)
            if i == 0:
                base = seconds
            identical &= same
            made, seen = counted(algorithm, relay, stats)
            print(f"{algorithm:<11} {name:<24} {seconds:8.3f} {seconds / base:7.1f}  {'yes' if same else 'NO':<9}  "
                  f"{made} / {seen}", flush=True)
            rows.append({"algorithm": algorithm, "fault": name, "faults": str(faults), "seconds": times,
                         "identical": same, "relay": relay, "job": seen})
            lines.append(f"| {algorithm} | {name} | {seconds:.3f} | {seconds / base:.1f} | {'yes' if same else 'NO'} | "
                         f"{made} | {seen} |")
    markdown = (f"{args.ranks} ranks (threads), {args.elements:,} elements per tensor, switchml through "
                f"{through}, the daemons behind the "
                f"user-space fault relay (faults on both directions of every link; `make faults`). Time: the "
                f"allreduces, slowest rank, median of {args.repeat} jobs (the relay is Python on the same 2 CPUs: "
                f"its own delay is in every time); identical: every result of every job bit-identical to the "
                f"fault-free run's. Counters: the last job's.\n\n"
                "| algorithm | fault | seconds | x none | identical | relay made | job counted |\n"
                "|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n")
    common.save("faults", {"ranks": args.ranks, "elements": args.elements, "repeat": args.repeat,
                             "quick": args.quick, "packet_elems": args.packet_elems,
                             "omnireduce_block": args.omnireduce_block, "switches": args.switches,
                             "spine": args.spine}, rows, markdown)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
