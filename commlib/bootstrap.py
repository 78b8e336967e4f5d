"""Bootstrap: from a launcher's environment to a job every rank shares.

The ring engine (Horovod, MPI, torch.distributed) starts first, since it may be what knows this
rank's placement; rank 0 then starts the controller and shares its address, with the job's secret
(the daemon key of the switch and aggregators it embeds), through the engine: the launcher's own
channel, never the controller's (which would carry it in clear on the job's network);
every rank connects, and the settings that shape communication are checked equal on all ranks.
The result is the job's Context (placement + settings + engine + exchange) and its controller;
its engine is the one that carries the ring's data (commlib.engine.data_engine).
"""
import secrets
import threading

from commlib import controller, engine as engines
from commlib.context import detect
from commlib.errors import CommTimeout, Mismatch
from commlib.net import parse_address, primary_ip
from commlib.settings import defined


def join(settings):
    """(Context, ControllerClient, ControllerServer or None) for this rank."""
    engine = engines.create(settings.ring_engine, detect(), settings.timeout_s)
    placement = detect()   # creating the engine may have initialized Horovod
    share = lambda value: within(settings.timeout_s, "sharing the controller's address and the job's secret "
                                 "(commlib.init)", engine.broadcast_object, value)
    server, client, secret = start_controller(settings, placement, share)
    ctx = placement.joined(settings=settings, exchange_fn=client.exchange, engine=engine, job_token=client.token,
                           secret=secret)
    try:
        _check_settings_agree(ctx)
        ctx = ctx.joined(engine=engines.data_engine(settings.ring_engine, ctx))
    except Exception:
        client.close()
        raise
    return ctx, client, server


def start_controller(s, placement, share, secret=None):
    """Rank 0 serves; every rank connects to the address rank 0 shares (or COMMLIB_CONTROLLER_ADDR),
    and gets rank 0's secret in the same broadcast. share(value) -> rank 0's value, on every rank.
    `secret`: the job's, when there is one already (a process set's), then only the address travels.
    Returns (server or None, client, secret)."""
    options = dict(timeout_s=s.timeout_s, cycle_time_ms=s.cycle_time_ms,
                   negotiation_timeout_s=s.negotiation_timeout_s, stall_warning_s=s.stall_warning_s)
    server = None
    drawn = secret is None
    if drawn:
        secret = secrets.token_bytes(32) if placement.rank == 0 else None
    if s.controller_addr:
        address = parse_address(s.controller_addr, "COMMLIB_CONTROLLER_ADDR")
        if placement.rank == 0:
            server = controller.ControllerServer(placement.size, *address, **options)
        if drawn:
            secret = share(secret)
    else:
        host = s.controller_host or ("127.0.0.1" if placement.all_local else primary_ip())
        address = None
        if placement.rank == 0:
            server = controller.ControllerServer(placement.size, host if placement.all_local else "0.0.0.0", 0,
                                                 **options)
            address = (host, server.address[1])
        if drawn:
            address, secret = share((address, secret))
        else:
            address = share(address)
    return server, controller.ControllerClient(address, placement.rank, s.timeout_s), secret


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
