"""OmniReduce aggregator: a UDP socket served by the C loop (switch/csrc/omnireduce_aggregator.c),
and the registration handshake that admits workers to a job.

One `Aggregator` serves any number of jobs and tensors without restarting: a job is the pair
(job token hash, epoch) a worker presents in its "register" request (switch/control.py's format,
one datagram on the aggregator's UDP port, as the switch takes them over TCP); the answer gives the
job id and a random key that every data packet must carry (the token check), and records the
worker's address under its rank (so several workers on one host work). Jobs leave when a rank
deregisters after the job's closing barrier, or after `job_idle_s` without a packet: workers of a
live job that has nothing to reduce for a while (evaluation, checkpointing) send "keepalive", so
only a job whose workers died is collected. Only "register" is answered (the others are best
effort and must not reach a worker's data path).

Used three ways: `commlib-aggregator` processes (dedicated mode, switch/aggregator_main.py),
a thread inside every worker (colocated mode), or a role of another daemon (`serve()`).
"""
import hashlib
import logging
import secrets
import socket
import threading
import time

from commlib.errors import BackendUnavailable, CommTimeout, ConfigError
from commlib.switch import auth, control, net
from commlib._native import ffi, lib
from commlib.net import parse_address

log = logging.getLogger("commlib.omnireduce")

SOCKET_BUFFER = 4 << 20                  # bytes: a window of blocks
_PARAMS = ("size", "columns", "aggregators", "index", "block")


def token_hash(token):
    """What workers present instead of the job token itself (the token stays on the hosts)."""
    return hashlib.sha256(f"commlib-omnireduce:{token}".encode()).hexdigest()[:32]


def make_socket(host, port=0):
    """A bound UDP socket with buffers for a full window of blocks."""
    try:
        return net.udp_socket(host, port, SOCKET_BUFFER)
    except OSError as exc:
        raise BackendUnavailable(f"omnireduce: cannot bind UDP {host}:{port}: {exc}; "
                                 f"set COMMLIB_OMNIREDUCE_HOST to an address of this host") from None


def resolve_address(text):
    """An aggregator's 'host:port' -> (IPv4 address, port), as the C worker wants it."""
    host, port = parse_address(text, "omnireduce aggregator address (COMMLIB_OMNIREDUCE_AGGREGATORS entry)")
    try:
        return socket.gethostbyname(host), port
    except OSError as exc:
        raise ConfigError(f"omnireduce aggregator {text!r}: cannot resolve {host!r}: {exc}") from None


class _Job:
    __slots__ = ("id", "key", "params", "ranks", "alive")

    def __init__(self, job_id, key, params):
        self.id, self.key, self.params, self.ranks = job_id, key, params, set()
        self.alive = time.monotonic()   # the last registration or keepalive


class Aggregator:
    """One aggregator endpoint. `start()` serves it from a thread; `serve(stop)` from the caller."""

    def __init__(self, host="127.0.0.1", port=0, job_idle_s=600.0, key=None):
        self.key = key                   # the daemon key: the jobs' data-plane keys derive from it
        self.sock = make_socket(host, port)
        self.address = self.sock.getsockname()
        self.job_idle_s = job_idle_s
        self._agg = lib.omr_agg_new(self.sock.fileno(), secrets.randbits(63) | 1)
        if self._agg == ffi.NULL:
            self.sock.close()
            raise MemoryError("omnireduce: cannot allocate an aggregator")
        self._jobs = {}                  # (token hash, epoch) -> _Job
        self._stop = threading.Event()
        self._thread = None
        self._lock = threading.Lock()    # serve() vs close()/stats() from other threads
        self._ctrl = ffi.new("uint8_t[]", 4096)
        self._ip = ffi.new("char[]", 64)
        self._port = ffi.new("int *")

    @property
    def address_str(self):
        return f"{self.address[0]}:{self.address[1]}"

    def start(self, name=None):
        self._thread = threading.Thread(target=self.serve, name=name or f"omnireduce-aggregator-{self.address[1]}",
                                        daemon=True)
        self._thread.start()
        return self

    def serve(self, stop=None, poll_ms=50):
        """Run the data path until `stop` (or our own stop event) is set."""
        stop = stop or self._stop
        last_gc = time.monotonic()
        while not stop.is_set() and not self._stop.is_set():
            with self._lock:
                if self._agg == ffi.NULL:
                    return
                waiting = lib.omr_agg_run(self._agg, poll_ms)      # GIL released while it runs
                if waiting < 0:
                    log.warning("omnireduce aggregator %s: receive failed (errno %d)", self.address_str, -waiting)
                    time.sleep(poll_ms / 1000)
                elif waiting > 0:
                    self._control()
                if time.monotonic() - last_gc > 1.0:
                    last_gc = time.monotonic()
                    self._collect_idle()

    def close(self):
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            if self._agg != ffi.NULL:
                lib.omr_agg_free(self._agg)
                self._agg = ffi.NULL
        self.sock.close()

    def stats(self):
        st = ffi.new("omr_astats *")
        with self._lock:
            if self._agg != ffi.NULL:
                lib.omr_agg_stats(self._agg, st)
        out = {field: getattr(st, field) for field, _ in ffi.typeof("omr_astats").fields}
        out["jobs"] = len(self._jobs)
        return out

    # -- control packets (registration) --------------------------------------------------------
    def _control(self):
        while True:
            n = lib.omr_agg_pop_ctrl(self._agg, self._ctrl, 4096, self._ip, self._port)
            if n < 0:
                return
            request = control.decode(bytes(ffi.buffer(self._ctrl, n)))
            source = (ffi.string(self._ip).decode(), self._port[0])
            op = request.get("op") if request else None
            if op == "register":
                self.sock.sendto(control.encode(control.answer(lambda r: self._register(r, source), request)), source)
            elif op == "keepalive":
                job = self._jobs.get((request.get("job"), request.get("epoch")))
                if job is not None:
                    job.alive = time.monotonic()
            elif op == "unregister":
                job = self._jobs.pop((request.get("job"), request.get("epoch")), None)
                if job is not None:
                    lib.omr_agg_remove_job(self._agg, job.id)
                    log.info("omnireduce aggregator %s: job %s closed", self.address_str, job.id)

    def _register(self, body, source):
        try:
            params = {name: int(body[name]) for name in _PARAMS}
            rank, key = int(body["rank"]), (str(body["job"]), int(body["epoch"]))
            loss, dup = float(body.get("loss", 0.0)), float(body.get("dup", 0.0))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"malformed registration {body!r}") from None
        if not 0 <= rank < params["size"]:
            raise ConfigError(f"rank {rank} is outside the job's size {params['size']}")
        job = self._jobs.get(key)
        if job is None:
            secret = secrets.randbits(32)
            nonce = body.get("nonce")
            mac_key = ffi.NULL   # packets of a job that asks for it carry MACs under its job key
            if self.key is not None and body.get("authenticate", True) and isinstance(nonce, str):
                mac_key = auth.job_key(self.key, nonce)
            job_id = lib.omr_agg_add_job(self._agg, secret, params["size"], params["columns"], params["aggregators"],
                                         params["index"], params["block"], loss, dup, mac_key)
            if job_id < 0:
                raise ConfigError(f"aggregator {self.address_str} cannot take the job (it serves {len(self._jobs)} "
                                  f"jobs, at most {lib.OMR_MAX_JOBS}; or invalid parameters {params})")
            job = self._jobs[key] = _Job(job_id, secret, params)
            log.info("omnireduce aggregator %s: job %d registered %s", self.address_str, job_id, params)
        elif job.params != params:
            raise ConfigError(f"rank {rank} registered with {params}, but the job's other ranks with {job.params}: "
                              f"every rank must use the same omnireduce settings")
        lib.omr_agg_set_worker(self._agg, job.id, rank, source[0].encode(), source[1])
        job.ranks.add(rank)
        job.alive = time.monotonic()
        return {"job": job.id, "key": job.key, "idle_s": self.job_idle_s}

    def _collect_idle(self):
        for key, job in list(self._jobs.items()):
            silent = min(lib.omr_agg_job_idle_s(self._agg, job.id), time.monotonic() - job.alive)
            if silent > self.job_idle_s:
                del self._jobs[key]
                lib.omr_agg_remove_job(self._agg, job.id)
                log.info("omnireduce aggregator %s: job %d idle for %.0fs, dropped", self.address_str, job.id,
                         self.job_idle_s)


def register(sock, aggregators, request, timeout_s, retry_s=0.2):
    """Register this worker (its socket) with every aggregator [(ip, port), ...]:
    [(job, key, idle_s), ...], idle_s being how long that aggregator keeps a silent job.

    "register" is retried until each aggregator answers; an aggregator that never answers is a
    CommTimeout that names it, a refusal a ConfigError with the aggregator's reason."""
    pending = {address: index for index, address in enumerate(aggregators)}
    answers = [None] * len(aggregators)
    deadline = time.monotonic() + timeout_s
    previous = sock.gettimeout()
    try:
        while pending:
            for address, index in pending.items():
                try:
                    sock.sendto(control.encode(dict(request, op="register", index=index)), address)
                except OSError:
                    pass    # ECONNREFUSED from an earlier attempt: nobody listens there (yet)
            resend_at = min(time.monotonic() + retry_s, deadline)
            while pending and time.monotonic() < resend_at:
                sock.settimeout(max(0.001, resend_at - time.monotonic()))
                try:
                    data, source = sock.recvfrom(65536)
                except (socket.timeout, BlockingIOError, InterruptedError):
                    continue
                except ConnectionRefusedError:
                    continue        # ICMP for a request sent to a port nobody listens on: keep trying
                reply = control.decode(data) if data[:1] == control.MARK else None
                if reply is None or source not in pending:
                    continue
                body = control.result(reply, f"omnireduce aggregator {source[0]}:{source[1]} refused rank "
                                             f"{request['rank']}")
                answers[pending.pop(source)] = (int(body["job"]), int(body["key"]),
                                                float(body.get("idle_s", float("inf"))))
            if pending and time.monotonic() >= deadline:
                missing = ", ".join(f"{h}:{p}" for h, p in pending)
                raise CommTimeout(f"omnireduce: aggregator(s) {missing} did not answer registration within "
                                  f"{timeout_s:.0f}s; start them (commlib-aggregator) or fix "
                                  f"COMMLIB_OMNIREDUCE_AGGREGATORS")
    finally:
        sock.settimeout(previous)
    return answers


def deregister(sock, aggregators, job_hash, epoch):
    """Best effort: tell the aggregators the job is over (they also drop idle jobs)."""
    _tell("unregister", sock, aggregators, job_hash, epoch)


def keepalive(sock, aggregators, job_hash, epoch):
    """Best effort: the job is alive though it sends no data (its aggregators keep its state)."""
    _tell("keepalive", sock, aggregators, job_hash, epoch)


def _tell(op, sock, aggregators, job_hash, epoch):
    for address in aggregators:
        try:
            sock.sendto(control.encode({"op": op, "job": job_hash, "epoch": epoch}), address)
        except OSError:
            pass
