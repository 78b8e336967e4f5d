"""commlib-switch: the SwitchML software switch daemon, and a small client for its control port.

    python -m commlib.switch.auth switch.key             # once: a daemon key (give it to the jobs too)
    commlib-switch --host 0.0.0.0 --port 9099 --key-file switch.key   # serve (UDP data + TCP control on 9099)
    commlib-switch counters 10.0.0.5:9099 --key-file switch.key [--job N]   # counters as JSON
    commlib-switch simulate 10.0.0.5:9099 --ingress 0.01 --egress 0.01 [--duplicate 0.01]
    commlib-switch status 10.0.0.5:9099

Prints `READY host:port` once it serves (switch/control.py, as commlib-aggregator does). Workers
find it through COMMLIB_SWITCH_ADDR=host:port and COMMLIB_SWITCH_KEY_FILE=switch.key (only holders
of the key register jobs; without --key-file anyone who reaches the port may, for a trusted fabric
only). `simulate` changes the drop simulator of
every job on the switch, so only a switch started with --testing accepts it.
"""
import argparse
import json
import logging
import os
import signal
import sys

CLIENT_COMMANDS = ("counters", "simulate", "status")


def _serve(argv):
    parser = argparse.ArgumentParser(prog="commlib-switch", description="SwitchML software switch (UDP data "
                                     "plane + TCP control plane on the same port)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=9099, help="UDP data and TCP control port (0: any free)")
    parser.add_argument("--slots", type=int, default=8192, help="pool size shared by all jobs (a job takes "
                        "its window of slots, each with two sets)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="data-plane threads, "
                        "each with its own UDP port (the first is --port; `status` lists them) and a share of every "
                        "job's slots (default: this host's cores)")
    parser.add_argument("--slot-group", type=int, default=64, help="slots per counter group")
    parser.add_argument("--drop-ingress", type=float, default=0.0, help="drop simulator: P(drop a packet "
                        "on arrival)")
    parser.add_argument("--drop-egress", type=float, default=0.0, help="drop simulator: P(drop a result)")
    parser.add_argument("--duplicate", type=float, default=0.0, help="drop simulator: P(duplicate a packet)")
    parser.add_argument("--seed", type=int, default=0, help="drop simulator seed (0: random)")
    parser.add_argument("--testing", action="store_true", help="accept the control command `simulate` (it "
                        "changes the drop simulator for every job: test switches only)")
    parser.add_argument("--no-offload", action="store_true", help="one datagram per system call (no UDP "
                        "GSO/GRO batching)")
    parser.add_argument("--key-file", default="", help="the daemon key (`python -m commlib.switch.auth FILE` "
                        "writes one): jobs must prove they hold it to register; without it anyone may (a trusted fabric only)")
    parser.add_argument("--job-slots", type=int, default=None, help="most slots one job may take (default: a "
                        "quarter of --slots)")
    parser.add_argument("--source-slots", type=int, default=None, help="most slots the jobs of one source "
                        "address may hold together (default: half of --slots)")
    parser.add_argument("--source-jobs", type=int, default=16, help="most jobs one source address may hold")
    parser.add_argument("--job-expiry-s", type=float, default=60.0, help="remove a job one of whose ranks sent no "
                        "keepalive for this long (it died)")
    parser.add_argument("--port-file", default="", help="also write the bound host:port to this file once serving "
                        "(the READY line on stdout says the same)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s commlib-switch %(message)s")
    from commlib.errors import CommError
    from commlib.switch import auth, control
    from commlib.switch.switchml import Limits, SwitchServer
    if not args.key_file:
        logging.warning("no --key-file: anyone who reaches %s:%d may register jobs (a trusted fabric only)",
                        args.host, args.port)
    defaults = Limits.for_pool(args.slots)
    limits = Limits(args.job_slots or defaults.job_slots, args.source_slots or defaults.source_slots,
                    args.source_jobs)
    try:
        key = auth.read_key(args.key_file) if args.key_file else None
        server = SwitchServer(args.host, args.port, args.slots, args.slot_group, args.drop_ingress,
                              args.drop_egress, args.duplicate, args.seed, offload=not args.no_offload,
                              testing=args.testing, key=key, limits=limits, job_expiry_s=args.job_expiry_s,
                              threads=args.threads).start()
    except CommError as exc:
        print(f"commlib-switch: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server._stopping.set())
    logging.info("serving on %s (UDP data, TCP control), %d slots, %d data-plane threads (UDP ports %s)",
                 server.address, args.slots, args.threads, ",".join(map(str, server.ports)))
    control.announce_ready([server.address], args.port_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    if server.error:
        print(f"commlib-switch: {server.error}", file=sys.stderr)
        return 1
    return 0


def _client(argv):
    parser = argparse.ArgumentParser(prog="commlib-switch " + argv[0])
    parser.add_argument("address", help="host:port of the switch")
    parser.add_argument("--key-file", default="", help="the switch's daemon key (a switch started with --key-file "
                        "answers counters and simulate only to its holders)")
    if argv[0] == "counters":
        parser.add_argument("--job", type=int, default=None)
    if argv[0] == "simulate":
        parser.add_argument("--ingress", type=float, default=0.0)
        parser.add_argument("--egress", type=float, default=0.0)
        parser.add_argument("--duplicate", type=float, default=0.0)
        parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv[1:])
    from commlib.errors import CommError
    from commlib.switch import auth, control
    from commlib.switch.switchml import SwitchClient
    try:
        client = SwitchClient(args.address, key=auth.read_key(args.key_file) if args.key_file else None)
        if argv[0] == "counters":
            reply = client.counters(args.job)
        elif argv[0] == "simulate":
            reply = client.simulate(args.ingress, args.egress, args.duplicate, args.seed)
        else:
            reply = client.status()
    except CommError as exc:
        print(f"commlib-switch: {exc}{control.operator_hint(exc, args.key_file)}", file=sys.stderr)
        return 1
    print(json.dumps(reply, indent=2))
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in CLIENT_COMMANDS:
        return _client(argv)
    return _serve(argv)


if __name__ == "__main__":
    sys.exit(main())
