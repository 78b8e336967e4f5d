"""Bootstrap: from a launcher's environment to a job every rank shares.

The ring engine (Horovod, MPI, torch.distributed) starts first, since it may be what knows this
rank's placement; rank 0 then starts the controller and shares its address, with the job's secret
(the daemon key of the switch and aggregators it embeds), through the engine: the launcher's own
channel, never the controller's, and the secret sealed by an X25519 agreement (commlib.keyshare), since
that channel is in clear too; every rank connects, and the settings that shape communication are
checked equal on all ranks.
The result is the job's Context (placement + settings + engine + exchange) and its controller;
its engine is the one that carries the ring's data (commlib.engine.data_engine).
"""
import logging
import secrets
import socket
import threading

from commlib import autotune, controller, engine as engines, keyshare
from commlib.context import Context, detect
from commlib.dispatch import settler
from commlib.errors import CommError, CommTimeout, ConfigError, Mismatch
from commlib.net import parse_address, primary_ip
from commlib.settings import define, defined
from commlib.switch import auth

log = logging.getLogger("commlib")

define("anchor_key_file", "", "a key file every rank reads (`python -m commlib.switch.auth FILE` writes one): the "
       "trust anchor that keeps an active attacker on the launcher's channel from taking or replacing the job's "
       "secret (without it, only a passive one is kept out)", per_rank=True)


def join(settings, engine=None, placement=None):
    """(Context, ControllerClient, ControllerServer or None) for this rank; from the launcher's
    engine and placement unless given (a torch.distributed process group's)."""
    if engine is None:
        engine = engines.create(settings.ring_engine, detect(), settings.timeout_s)
        placement = detect()   # creating the engine may have initialized Horovod
    bounded = lambda fn: lambda value: within(settings.timeout_s, "sharing the controller's address and the job's "
                                              "secret (commlib.init)", fn, value)
    allgather = bounded(keyshare.allgather_bytes(engine))
    server, client, secret = start_controller(settings, placement, keyshare.broadcast_json(allgather, placement.rank),
                                              allgather=allgather, tune=True)
    ctx = placement.joined(settings=settings, exchange_fn=client.exchange, engine=engine, job_token=client.token,
                           secret=secret)
    try:
        _check_settings_agree(ctx)
        ctx = ctx.joined(engine=engines.data_engine(settings.ring_engine, ctx))
    except Exception:
        client.close()
        raise
    return ctx, client, server


def join_set(parent, client, ranks, hvd_set=None):
    """A process set's (Context, ControllerClient, ControllerServer or None) on this rank, one of
    `ranks`, from its job's Context and controller client: the set's own controller (its first rank
    serves it), its ring (a subgroup of the job's engine; Horovod's own set `hvd_set` if given)."""
    s, key = parent.settings, "process_set/" + ",".join(map(str, ranks))

    def meet(step, value):   # an exchange among the set's ranks through the job's controller
        return client.exchange(f"{key}/{step}", value, s.timeout_s, ranks=ranks)

    me = ranks.index(parent.rank)
    hosts = meet("hosts", socket.gethostname())
    local = [i for i, host in enumerate(hosts) if host == hosts[me]]
    placement = Context(me, len(ranks), local.index(me), len(local), parent.launcher)
    # the set's controller: its first rank serves it; switchml streams: one unless set (the host's cores
    # over the set's ranks would oversubscribe it, beside the job's streams and each set's own switch)
    settings = s.replaced(controller_addr="", switch_streams=s.switch_streams or 1)
    # the job's secret (the daemon key of the switch and aggregators) never travels through a controller
    server, own, _ = start_controller(settings, placement, lambda address: meet("controller", address)[0],
                                      secret=controller.set_secret(parent.secret, key))
    ctx = placement.joined(settings=settings, exchange_fn=own.exchange, job_token=own.token, secret=parent.secret)
    try:
        engine = ctx.agree("process_set/ring", parent.engine.subgroup, ctx, ranks, hvd_set)
    except CommError as exc:   # the set goes on without the ring; records say why
        log.warning("commlib: process set %s has no ring: %s", list(ranks), exc)
        engine = None
    return ctx.joined(engine=engine), own, server


def start_controller(s, placement, broadcast, secret=None, allgather=None, tune=False):
    """Rank 0 serves; every rank connects to the address rank 0 shares (or COMMLIB_CONTROLLER_ADDR).
    broadcast(value) -> rank 0's value, on every rank. `secret`: the job's, when there is one already (a
    process set's), then only the address travels; else rank 0 draws one and shares it sealed
    (commlib.keyshare, which needs `allgather`). `tune`: the job's controller, which autotunes where the
    settings ask (a process set's keeps the configured values). Returns (server or None, client, secret)."""
    tuner = None
    if tune and s.autotune and placement.rank == 0:
        tuner = autotune.Tuner(s, s.autotune_sample_s, s.autotune_log)
    drawn = secret is None
    if drawn and placement.rank == 0:
        secret = secrets.token_bytes(32)
    options = dict(settle=settler(s), timeout_s=s.timeout_s, cycle_time_ms=s.cycle_time_ms, secret=secret,
                   negotiation_timeout_s=s.negotiation_timeout_s, stall_warning_s=s.stall_warning_s, tuner=tuner)
    server = None
    address = None
    if s.controller_addr:
        address = parse_address(s.controller_addr, "COMMLIB_CONTROLLER_ADDR")
        if placement.rank == 0:
            server = controller.ControllerServer(placement.size, *address, **options)
    else:
        host = s.controller_host or ("127.0.0.1" if placement.all_local else primary_ip())
        if placement.rank == 0:
            server = controller.ControllerServer(placement.size, host if placement.all_local else "0.0.0.0", 0,
                                                 **options)
            address = (host, server.address[1])
    try:
        if drawn:
            anchor = auth.read_key(s.anchor_key_file) if s.anchor_key_file else None
            if anchor is None and not placement.all_local and placement.rank == 0:
                log.warning("commlib: a job across hosts without COMMLIB_ANCHOR_KEY_FILE: a host that can write to "
                            "the launcher's channel (horovodrun's rendezvous store, torchrun's TCPStore take writes "
                            "from anyone who reaches their port) can take the job's secret; give every rank the "
                            "same key file (python -m commlib.switch.auth FILE)")
            secret, shared = keyshare.share(placement.rank, allgather, broadcast, secret, address, anchor)
            # every rank fails, not only those whose copy was altered (told over the launcher's channel: the
            # controller's address may be what was altered)
            opened = [part == b"\x01" for part in allgather(b"\x01" if secret is not None else b"\x00")]
            if len(opened) != placement.size:
                raise ConfigError(f"the launcher's allgather gave {len(opened)} answers for {placement.size} ranks: "
                                  f"its traffic was altered on the way")
            if secret is None or not all(opened):
                raise keyshare.unopened(sorted({rank for rank, ok in enumerate(opened) if not ok} |
                                               ({placement.rank} if secret is None else set())))
        else:
            shared = broadcast(address)
        # each rank proves to the controller that it holds the secret
        client = controller.ControllerClient(shared, placement.rank, s.timeout_s, s.cycle_time_ms, secret=secret)
    except BaseException:   # the job did not form: rank 0's controller port is free at once
        if server is not None:
            server.close()
        raise
    return server, client, secret


def _check_settings_agree(ctx):
    """Settings that shape communication must be equal on every rank, or ranks would stream
    different packet sizes, fuse differently, or raise on some ranks only."""
    shared = {name: value for name, value in ctx.settings.as_dict().items() if not defined()[name].per_rank}
    everyone = ctx.exchange("init/settings", shared)
    differ = {name: [ranks[name] for ranks in everyone] for name in shared
              if any(ranks.get(name) != shared[name] for ranks in everyone)}
    if differ:
        details = "; ".join(f"{name}: {values}" for name, values in sorted(differ.items()))
        raise Mismatch(f"ranks disagree on settings (values by rank) {details}; set COMMLIB_* the same "
                       f"on every rank (e.g. export them before horovodrun, or pass -x to mpirun)")


def within(timeout_s, what, fn, *args):
    """fn(*args) for an engine call that has no timeout of its own (Horovod's and MPI's broadcasts
    wait forever for a rank that never joins): CommTimeout after timeout_s instead of a hang."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:   # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=run, name="commlib-bounded-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CommTimeout(f"{what} did not finish within {timeout_s:.0f}s: some rank did not call commlib.init() "
                          f"(or hvd.init()); every rank must (raise COMMLIB_TIMEOUT_S if one is just slow)")
    if "error" in box:
        raise box["error"]
    return box["value"]
