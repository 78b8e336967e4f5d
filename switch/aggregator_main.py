"""`commlib-aggregator`: dedicated OmniReduce aggregator processes.

    python -m commlib.switch.auth agg.key                        # once: a daemon key (the jobs get it too)
    commlib-aggregator --host 0.0.0.0 --port 9200 --count 2 --key-file agg.key   # two aggregators: 9200, 9201
    COMMLIB_OMNIREDUCE_MODE=dedicated COMMLIB_OMNIREDUCE_AGGREGATORS=host:9200,host:9201 \
        COMMLIB_OMNIREDUCE_KEY_FILE=agg.key <launcher> train.py
    commlib-aggregator counters host:9200 --key-file agg.key     # its counters as JSON, while it runs

Prints `READY host:port[,host:port...]` once it serves (switch/control.py, as commlib-switch does), then runs until SIGINT/SIGTERM. Without --key-file
anyone who reaches the port may register jobs (a trusted fabric only); `--key-file -` (or /dev/stdin)
reads the key from standard input (how rank 0 hands one to the aggregators it starts). Any number
of jobs and tensors share it without restarts; columns are interleaved across the listed
aggregators in the order of COMMLIB_OMNIREDUCE_AGGREGATORS.
"""
import argparse
import json
import logging
import os
import signal
import sys
import threading


def counters(argv):
    parser = argparse.ArgumentParser(prog="commlib-aggregator counters")
    parser.add_argument("address", help="host:port of the aggregator")
    parser.add_argument("--key-file", default="", help="the aggregator's daemon key (a keyed aggregator answers "
                        "counters only to its holders)")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    from commlib.errors import CommError
    from commlib.switch import auth, control
    from commlib.switch.aggregator import query, resolve_address
    try:
        key = auth.read_key(args.key_file) if args.key_file else None
        reply = query(resolve_address(args.address), {"op": "counters"}, args.timeout, key)
    except CommError as exc:
        print(f"commlib-aggregator: {exc}{control.operator_hint(exc, args.key_file)}", file=sys.stderr)
        return 1
    print(json.dumps(reply, indent=2))
    return 0


def _read_key(path):
    from commlib.switch import auth
    if path != "-":
        return auth.read_key(path)
    text = sys.stdin.readline().strip()
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise SystemExit("commlib-aggregator: --key-file -: standard input does not start with a hex key")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "counters":
        return counters(argv[1:])
    parser = argparse.ArgumentParser(prog="commlib-aggregator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=9200, help="UDP port of the first aggregator (0: any free port)")
    parser.add_argument("--count", type=int, default=1, help="aggregators in this process, on consecutive ports, "
                        "each with its own C loop")
    parser.add_argument("--job-idle-s", type=float, default=600.0, help="drop a job after this long without packets")
    parser.add_argument("--key-file", default="", help="the daemon key (`python -m commlib.switch.auth FILE`; "
                        "'-': read it from standard input): jobs must hold it to register")
    parser.add_argument("--job-mib", type=int, default=256, help="most MiB one job's registration may reserve")
    parser.add_argument("--total-mib", type=int, default=1024, help="most MiB all jobs may reserve together")
    parser.add_argument("--source-jobs", type=int, default=16, help="most jobs one source address may hold")
    parser.add_argument("--exit-with-parent", action="store_true", help="exit when the parent process goes away "
                        "(embedded aggregators)")
    parser.add_argument("--port-file", default="", help="also write the addresses to this file once serving "
                        "(the READY line on stdout says the same)")
    parser.add_argument("--quiet", action="store_true", help="log warnings only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s commlib-aggregator %(message)s")

    from commlib.errors import CommError
    from commlib.switch import control
    from commlib.switch.aggregator import Aggregator, Limits

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    aggregators = []
    limits = Limits(args.job_mib << 20, args.total_mib << 20, args.source_jobs)
    try:
        key = _read_key(args.key_file) if args.key_file else None
        if key is None:
            logging.warning("no --key-file: anyone who reaches the port may register jobs (a trusted fabric only)")
        for i in range(args.count):
            aggregators.append(Aggregator(args.host, args.port + i if args.port else 0, args.job_idle_s, key, limits))
    except CommError as exc:
        print(f"commlib-aggregator: {exc}", file=sys.stderr)
        return 2
    threads = [threading.Thread(target=a.serve, args=(stop,), daemon=True) for a in aggregators]
    for t in threads:
        t.start()
    control.announce_ready([a.address_str for a in aggregators], args.port_file)
    parent = os.getppid()
    while not stop.wait(0.5):
        if args.exit_with_parent and os.getppid() != parent:
            break
    stop.set()
    for t in threads:
        t.join(timeout=5)
    for a in aggregators:
        logging.info("%s: %s", a.address_str, {k: v for k, v in a.stats().items() if v})
        a.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
