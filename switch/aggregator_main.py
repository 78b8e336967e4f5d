"""`commlib-aggregator`: dedicated OmniReduce aggregator processes.

    commlib-aggregator --host 0.0.0.0 --port 9200 --count 2     # two aggregators: 9200, 9201
    COMMLIB_OMNIREDUCE_MODE=dedicated COMMLIB_OMNIREDUCE_AGGREGATORS=host:9200,host:9201 <launcher> train.py

Prints `READY host:port[,host:port...]` once it serves (switch/control.py, as commlib-switch does), then runs until SIGINT/SIGTERM. Any number
of jobs and tensors share it without restarts; columns are interleaved across the listed
aggregators in the order of COMMLIB_OMNIREDUCE_AGGREGATORS.
"""
import argparse
import logging
import os
import signal
import sys
import threading


def main(argv=None):
    parser = argparse.ArgumentParser(prog="commlib-aggregator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=9200, help="UDP port of the first aggregator (0: any free port)")
    parser.add_argument("--count", type=int, default=1, help="aggregators in this process, on consecutive ports, "
                        "each with its own C loop")
    parser.add_argument("--job-idle-s", type=float, default=600.0, help="drop a job after this long without packets")
    parser.add_argument("--exit-with-parent", action="store_true", help="exit when the parent process goes away "
                        "(embedded aggregators)")
    parser.add_argument("--port-file", default="", help="also write the addresses to this file once serving "
                        "(the READY line on stdout says the same)")
    parser.add_argument("--quiet", action="store_true", help="log warnings only")
    parser.add_argument("--key-file", default="", help="the daemon key (`python -m commlib.switch.auth FILE`); "
                        "/dev/stdin: read from the starter (a job's embedded aggregators)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s commlib-aggregator %(message)s")

    from commlib.errors import CommError
    from commlib.switch import auth, control
    from commlib.switch.aggregator import Aggregator

    key = auth.read_key(args.key_file) if args.key_file else None

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    aggregators = []
    try:
        for i in range(args.count):
            aggregators.append(Aggregator(args.host, args.port + i if args.port else 0, args.job_idle_s, key))
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
