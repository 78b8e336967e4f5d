"""Bootstrap: from a launcher's environment to a job every rank shares.

The ring engine (Horovod, MPI, torch.distributed) starts first, since it may be what knows this
rank's placement; rank 0 then starts the controller and shares its address through the engine;
every rank connects, and the settings that shape communication are checked equal on all ranks.
The result is the job's Context (placement + settings + engine + exchange) and its controller;
its engine is the one that carries the ring's data (commlib.engine.data_engine).
"""
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
    share = lambda address: within(settings.timeout_s, "sharing the controller's address (commlib.init)",
                                   engine.broadcast_object, address)
    server, client = start_controller(settings, placement, share)
    ctx = placement.joined(settings=settings, exchange_fn=client.exchange, engine=engine, job_token=client.token)
    try:
        _check_settings_agree(ctx)
        ctx = ctx.joined(engine=engines.data_engine(settings.ring_engine, ctx))
    except Exception:
        client.close()
        raise
    return ctx, client, server


def start_controller(s, placement, share):
    """Rank 0 serves; every rank connects to the address rank 0 shares (or COMMLIB_CONTROLLER_ADDR).
    share(address or None) -> rank 0's address, on every rank."""
    options = dict(timeout_s=s.timeout_s, cycle_time_ms=s.cycle_time_ms,
                   negotiation_timeout_s=s.negotiation_timeout_s, stall_warning_s=s.stall_warning_s)
    server = None
    if s.controller_addr:
        address = parse_address(s.controller_addr, "COMMLIB_CONTROLLER_ADDR")
        if placement.rank == 0:
            server = controller.ControllerServer(placement.size, *address, **options)
    else:
        host = s.controller_host or ("127.0.0.1" if placement.all_local else primary_ip())
        address = None
        if placement.rank == 0:
            server = controller.ControllerServer(placement.size, host if placement.all_local else "0.0.0.0", 0,
                                                 **options)
            address = (host, server.address[1])
        address = share(address)
    return server, controller.ControllerClient(address, placement.rank, s.timeout_s)


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
