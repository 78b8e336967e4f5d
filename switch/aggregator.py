"""OmniReduce aggregator: a UDP socket served by the C loop (switch/csrc/omnireduce_aggregator.c),
and the registration handshake that admits workers to a job.

One `Aggregator` serves any number of jobs and tensors without restarting: a job is the pair
(job token hash, epoch) a worker presents in its "register" request (switch/control.py's format,
one datagram on the aggregator's UDP port, as the switch takes them over TCP); the answer gives the
job id and a random key that every data packet must carry (the token check), and records the
worker's address under its rank (so several workers on one host work).

    {"op": "register", "job": H, "epoch": E, "rank": r, "size": n, "columns": c, "aggregators": a,
     "index": i, "block": b, "nonce": N}  -> {"ok": true, "job": id, "key": k, "idle_s": s}
    {"op": "unregister", "job": H, "epoch": E, "rank": r}    (no answer)
    {"op": "counters"}  -> {"ok": true, ...packet counters, "control": drops by reason, "jobs": n}

Keepalives are not control messages but packets of the data path (OMR_KEEPALIVE, omnireduce.h),
checked in C with the job's key and MAC like its data: a flood of control datagrams cannot crowd
them out. The C loop hands Python only datagrams that may be requests, at most OMR_CTRL_RATE a
second per source, and Python answers no request with more bytes than it had (no amplification:
clients pad theirs, `control.pad`).

Admission (an aggregator with a daemon key, switch/auth.py; `commlib-aggregator --key-file`): a
register is signed (`seq`, `mac`) with the job key auth.job_key(daemon key, nonce), which only a
holder of the daemon key computes; a job's unregister with that job key, by one of its ranks;
counters with the daemon key. A seq is accepted once per sender (auth.Replays' window), so a sniffed request replayed
is refused (it cannot move a rank's results elsewhere nor end the job). Without a key (a trusted
fabric) requests are unsigned, as before. Registrations are capped (`Limits`: the memory a job
reserves, the total, jobs per source address), so no request reserves gigabytes.

Every rank of a job sends a keepalive every idle_s / 4; a job one of whose registered ranks has
sent nothing valid for `job_idle_s` is dropped (that rank died), as are jobs a rank deregisters
after the job's closing barrier. Every control datagram, however malformed, is answered (register,
counters: when the answer is no longer than the request) or dropped and counted by reason; none
ends the serving loop.

Used three ways: `commlib-aggregator` processes (dedicated mode, switch/aggregator_main.py),
a thread inside every worker (colocated mode), or a role of another daemon (`serve()`).
"""
import hashlib
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict

from commlib.errors import BackendUnavailable, CommTimeout, ConfigError
from commlib.switch import auth, control, net, packet_mac
from commlib._native import ffi, lib
from commlib.net import parse_address

log = logging.getLogger("commlib.omnireduce")

SOCKET_BUFFER = 4 << 20                  # bytes: a window of blocks
_PARAMS = ("size", "columns", "aggregators", "index", "block")
REGISTER_BYTES = 1024                    # a register's padded size: room for its answer or refusal
QUERY_BYTES = 4000                       # a counters request's padded size (OMR_CTRL_MAX is 4096)


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


def path_block(addresses):
    """Elements per block for the paths to these aggregators ((ip, port) each): the most whose RESULT
    (header, block, stamp, MAC) fits one datagram of the smallest path MTU unfragmented, within
    OMR_MAX_BLOCK (loopback: OMR_MAX_BLOCK; a 1500-byte path: 349)."""
    mtu = min(net.path_mtu_to(address) for address in addresses)
    return net.path_values(mtu, lib.OMR_HDR_BYTES + lib.OMR_STAMP_BYTES + lib.OMR_MAC_BYTES, lib.OMR_MAX_BLOCK)


def resolve_address(text):
    """An aggregator's 'host:port' -> (IPv4 address, port), as the C worker wants it."""
    host, port = parse_address(text, "omnireduce aggregator address (COMMLIB_OMNIREDUCE_AGGREGATORS entry)")
    try:
        return socket.gethostbyname(host), port
    except OSError as exc:
        raise ConfigError(f"omnireduce aggregator {text!r}: cannot resolve {host!r}: {exc}") from None


class Limits:
    """What registrations may reserve on one aggregator: bytes per job (see `job_bytes`), bytes in
    all, jobs per source address. The defaults hold a 14 MiB window per job, far beyond the default
    512 KiB."""

    def __init__(self, job_bytes=256 << 20, total_bytes=1 << 30, source_jobs=16):
        self.job_bytes, self.total_bytes, self.source_jobs = job_bytes, total_bytes, source_jobs


def job_bytes(params):
    """The memory omr_agg_add_job allocates for a job of these (checked) parameters, as C counts it."""
    size, columns, aggregators, index, block = (params[name] for name in _PARAMS)
    return lib.omr_agg_job_bytes(size, columns, aggregators, index, block)


def _check_params(params):
    size, columns, aggregators, index, block = (params[name] for name in _PARAMS)
    if not (1 <= size <= lib.OMR_MAX_WORKERS and 1 <= block <= lib.OMR_MAX_BLOCK and 1 <= columns <= 1 << 24
            and 1 <= aggregators <= 1 << 16 and 0 <= index < aggregators):
        raise ConfigError(f"registration out of range: size 1..{lib.OMR_MAX_WORKERS}, block 1..{lib.OMR_MAX_BLOCK}, "
                          f"columns 1..{1 << 24}, aggregators 1..65536, 0 <= index < aggregators; got {params}")


class _Job:
    __slots__ = ("id", "key", "params", "ranks", "nonce", "job_key", "source", "bytes", "addresses", "mac")

    def __init__(self, job_id, key, params, nonce=None, job_key=None, source=None, mac=packet_mac.PORTABLE):
        self.id, self.key, self.params, self.ranks = job_id, key, params, set()
        self.nonce, self.job_key, self.source, self.mac = nonce, job_key, source, mac
        self.bytes = job_bytes(params)
        self.addresses = {}              # rank -> ((ip, port) its results go to, the seq of the register that set it)


class Aggregator:
    """One aggregator endpoint. `start()` serves it from a thread; `serve(stop)` from the caller."""

    def __init__(self, host="127.0.0.1", port=0, job_idle_s=600.0, key=None, limits=None):
        # key: the daemon key (None: unsigned requests, packets without MACs); the jobs' keys derive from it
        self.key, self.limits = key, limits or Limits()
        self.drops = control.Drops()                     # control datagrams refused or dropped, by reason
        self._replays = auth.Replays()
        self._ended = OrderedDict()   # nonces of ended jobs (bounded): a sniffed register of one revives nothing
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
        self._lock = threading.RLock()   # serve() vs close()/stats() from other threads (and counters within serve)
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
                try:   # control handling never ends this loop (the colocated aggregator lives in a rank)
                    if waiting > 0:
                        self._control()
                    if time.monotonic() - last_gc > 1.0:
                        last_gc = time.monotonic()
                        self._collect_idle()
                except Exception:
                    log.exception("omnireduce aggregator %s: control handling failed", self.address_str)
                    self.drops.add("internal")

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
        out["control"] = self.drops.snapshot()
        return out

    # -- control packets ---------------------------------------------------------------------------
    def _control(self):
        while True:
            n = lib.omr_agg_pop_ctrl(self._agg, self._ctrl, 4096, self._ip, self._port)
            if n < 0:
                return
            source = (ffi.string(self._ip).decode(), self._port[0])
            request = control.decode(bytes(ffi.buffer(self._ctrl, n)))
            reply = control.answer(lambda r: self.handle(r, source), request, self.drops)
            if request is None or request.get("op") not in ("register", "counters"):
                continue                        # unregister is not answered, nor what is no request
            data = control.fit(reply, n)
            if data is None:
                self.drops.add("unpadded")      # its answer would be longer than it: amplification
                continue
            try:
                self.sock.sendto(data, source)
            except OSError:
                self.drops.add("send_failed")

    def handle(self, request, source):
        """The fields of the answer to one control request from `source` (ip, port)."""
        op = request.get("op")
        if op == "register":
            return self._register(request, source)
        if op == "unregister":
            job_ident = self._job_ident(request)
            job = self._jobs.get(job_ident)
            if job is None:
                raise ConfigError(f"job {job_ident} is not registered here")
            self._authenticate_job(job, request)
            self._remove(job_ident)
            log.info("omnireduce aggregator %s: job %s closed", self.address_str, job.id)
            return {}
        if op == "counters":
            if self.key is not None:
                self._check(self.key, request, ("operator",), "counters")
            return self.stats()
        raise ValueError(f"unknown op {str(op)[:40]!r}; use register, unregister or counters")

    @staticmethod
    def _job_ident(request):
        """(job token hash, epoch): the job a request is about."""
        job, epoch = request["job"], request["epoch"]
        if not isinstance(job, str) or len(job) > 64 or not isinstance(epoch, int):
            raise ValueError("a job is named by 'job' (a string of at most 64 characters) and 'epoch' (an integer)")
        return job, epoch

    def _check(self, key, request, sender, what):
        self._replays.admit(key, request, sender, what, "this aggregator's key (give the job its key file: "
                                                        "COMMLIB_OMNIREDUCE_KEY_FILE)")

    def _authenticate_job(self, job, request):
        """The rank an unregister comes from; signed with the job's key on a keyed aggregator."""
        rank = request.get("rank")
        if self.key is not None:
            if auth.verify(job.job_key, request):
                self._check(job.job_key, request, (job.nonce, rank), request["op"])
            else:
                self._check(self.key, request, ("operator",), request["op"])
        if rank is None and self.key is None:    # an unsigned request of a client before ranks were named
            return min(job.ranks, default=0)
        if not isinstance(rank, int) or rank not in job.ranks:
            raise ValueError(f"rank {rank!r} is not a registered rank of job {job.id}")
        return rank

    def _register(self, body, source):
        try:
            params = {name: int(body[name]) for name in _PARAMS}
            rank, ident = int(body["rank"]), self._job_ident(body)
            loss, dup = float(body.get("loss", 0.0)), float(body.get("dup", 0.0))
            mac = str(body.get("packet_mac", packet_mac.PORTABLE))
        except (KeyError, TypeError, ValueError, OverflowError):
            raise ConfigError(f"malformed registration {str(body)[:300]}") from None
        if not 0 <= rank < params["size"]:
            raise ConfigError(f"rank {rank} is outside the job's size {params['size']}")
        if not (0.0 <= loss < 1.0 and 0.0 <= dup < 1.0):
            raise ConfigError(f"loss={loss} and dup={dup} must be probabilities in [0, 1)")
        _check_params(params)
        nonce = job_key = None
        if self.key is not None:
            nonce = auth.check_nonce(body.get("nonce"))
            job_key = auth.job_key(self.key, nonce)
            self._check(job_key, body, (nonce, rank), "register")
            if nonce in self._ended:
                raise control.Refused("replay", "register refused: the job of this nonce ended here (a replayed "
                                                "request; a new job draws a new nonce)")
        job = self._jobs.get(ident)
        if job is None:
            self._admit(params, source)
            secret = secrets.randbits(32)
            # packets carry MACs under the job key, unless the job asks for none (a trusted fabric)
            mac_key = job_key if job_key is not None and body.get("authenticate", True) else ffi.NULL
            job_id = lib.omr_agg_add_job(self._agg, secret, params["size"], params["columns"], params["aggregators"],
                                         params["index"], params["block"], loss, dup, mac_key, packet_mac.code(mac))
            if job_id < 0:
                raise control.Refused("limit", f"aggregator {self.address_str} cannot take the job (it serves "
                                               f"{len(self._jobs)} jobs, at most {lib.OMR_MAX_JOBS}; or out of memory)")
            job = self._jobs[ident] = _Job(job_id, secret, params, nonce, job_key, source[0], mac)
            log.info("omnireduce aggregator %s: job %d registered %s", self.address_str, job_id, params)
        elif job.nonce != nonce:
            raise control.Refused("bad_mac", f"job {ident} is registered here by another job (another nonce)")
        elif job.params != params or job.mac != mac:
            raise ConfigError(f"rank {rank} registered with {params} and packet_mac={mac}, but the job's other ranks "
                              f"with {job.params} and packet_mac={job.mac}: "
                              f"every rank must use the same omnireduce settings")
        seq = body.get("seq") if self.key is not None else None
        pinned, pinned_seq = job.addresses.setdefault(rank, (source, seq))
        if pinned != source:
            # the MAC does not cover the source: a sniffed copy may come from elsewhere, and first. Only a
            # newer request moves the rank, which only its signer makes after (Signer: its clock): the rank
            # whose first copy an attacker's beat is refused as a replay, resends, and takes its place back
            if seq is None or seq <= pinned_seq:   # (a keyed aggregator: every register has its seq)
                raise control.Refused("replay", f"register refused: rank {rank} of job {job.id} is registered from "
                                                f"{pinned[0]}:{pinned[1]} (a request replayed from elsewhere?); a "
                                                f"rank registers from one socket")
            log.warning("omnireduce aggregator %s: rank %d of job %d moves from %s:%d to %s:%d (a newer register)",
                        self.address_str, rank, job.id, *pinned, *source)
        if seq is not None and seq > pinned_seq:
            job.addresses[rank] = (source, seq)   # the newest: a sniffed resend of before it moves nothing
        lib.omr_agg_set_worker(self._agg, job.id, rank, source[0].encode(), source[1])
        job.ranks.add(rank)
        return {"job": job.id, "key": job.key, "idle_s": self.job_idle_s, "authenticated": job.job_key is not None
                and body.get("authenticate", True) is not False}

    def _admit(self, params, source):
        lim, need = self.limits, job_bytes(params)
        if need > lim.job_bytes:
            raise control.Refused("limit", f"the job would reserve {need >> 20} MiB on this aggregator, at most "
                                           f"{lim.job_bytes >> 20} MiB per job: lower omnireduce_window_bytes or "
                                           f"the block size, or add aggregators")
        held = sum(j.bytes for j in self._jobs.values())
        if held + need > lim.total_bytes:
            raise control.Refused("limit", f"the aggregator holds {held >> 20} MiB for {len(self._jobs)} jobs; this "
                                           f"one's {need >> 20} MiB would pass its {lim.total_bytes >> 20} MiB")
        mine = sum(1 for j in self._jobs.values() if j.source == source[0])
        if mine >= lim.source_jobs:
            raise control.Refused("limit", f"{source[0]} already holds {mine} jobs on this aggregator, the most one "
                                           f"address may hold")

    def _remove(self, ident):
        job = self._jobs.pop(ident)
        lib.omr_agg_remove_job(self._agg, job.id)
        if job.nonce is not None:
            self._replays.forget((job.nonce,))
            self._ended[job.nonce] = None
            while len(self._ended) > 65536:
                self._ended.popitem(last=False)

    def _collect_idle(self):
        """Drop the jobs one of whose ranks has been silent (no keepalive, no data) for job_idle_s: it died."""
        for ident, job in list(self._jobs.items()):
            silent = lib.omr_agg_job_idle_s(self._agg, job.id)
            if silent > self.job_idle_s:
                self._remove(ident)
                self.drops.add("jobs_expired")
                log.info("omnireduce aggregator %s: job %d: a rank silent for %.0fs, dropped", self.address_str,
                         job.id, silent)


def register(sock, aggregators, request, timeout_s, retry_s=0.2, sign=None):
    """Register this worker (its socket) with every aggregator [(ip, port), ...]:
    [(job, key, idle_s), ...], idle_s being how long that aggregator keeps a silent job.
    sign: signs each request (auth.Signer of the job key) on keyed aggregators: every resend is
    signed anew, so a resend is not a replay.

    "register" is retried until each aggregator answers; an aggregator that never answers is a
    CommTimeout that names it, a refusal a ConfigError with the aggregator's reason. A signed request
    refused as a replay (a copy sniffed and sent from elsewhere came first) is retried too: its next
    resend is newer and takes the rank back (Aggregator._register)."""
    retry_replays, sign = sign is not None, sign or (lambda r: r)
    pending = {address: index for index, address in enumerate(aggregators)}
    replays = {}   # aggregator -> its last "replay" refusal
    answers = [None] * len(aggregators)
    deadline = time.monotonic() + timeout_s
    previous = sock.gettimeout()
    try:
        while pending:
            for address, index in pending.items():
                try:
                    sock.sendto(control.encode(sign(control.pad(dict(request, op="register", index=index),
                                                                REGISTER_BYTES))), address)
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
                if retry_replays and reply.get("reason") == "replay":
                    replays[source] = reply.get("error")
                    continue
                body = control.result(reply, f"omnireduce aggregator {source[0]}:{source[1]} refused rank "
                                             f"{request['rank']}")
                if request.get("authenticate") and body.get("authenticated") is False:
                    raise ConfigError(auth.unauthenticated(   # the key file names a key the aggregator lacks
                        f"omnireduce aggregator {source[0]}:{source[1]}", "the aggregator has no key"))
                answers[pending.pop(source)] = (int(body["job"]), int(body["key"]),
                                                float(body.get("idle_s", float("inf"))))
            if pending and time.monotonic() >= deadline:
                missing = ", ".join(f"{h}:{p}" for h, p in pending)
                said = "; ".join(f"{h}:{p}: {replays[h, p]}" for h, p in pending if (h, p) in replays)
                if said:
                    raise ConfigError(f"omnireduce: aggregator(s) refused rank {request['rank']}'s registration for "
                                      f"{timeout_s:.0f}s ({said})")
                raise CommTimeout(f"omnireduce: aggregator(s) {missing} did not answer registration within "
                                  f"{timeout_s:.0f}s; start them (commlib-aggregator) or fix "
                                  f"COMMLIB_OMNIREDUCE_AGGREGATORS")
    finally:
        sock.settimeout(previous)
    return answers


def deregister(sock, aggregators, job_hash, epoch, rank=None, sign=None):
    """Best effort: tell the aggregators the job is over (they also drop jobs whose ranks fell silent)."""
    request = {"op": "unregister", "job": job_hash, "epoch": epoch}
    if rank is not None:
        request["rank"] = rank
    for address in aggregators:
        try:
            sock.sendto(control.encode(sign(request) if sign else request), address)
        except OSError:
            pass


def keepalive(sock, aggregators, jobs, rank, mac_key=None, mac=packet_mac.PORTABLE):
    """Best effort: this rank of the job lives though it may send no data (its aggregators keep its
    state). jobs: (job, key) at each aggregator, as `register` answered; mac_key: the job key of its
    packets (None: no MACs), mac: their MAC algorithm (switch/packet_mac.py)."""
    buf = ffi.new("uint8_t[]", lib.OMR_HDR_BYTES + lib.OMR_MAC_BYTES)
    for address, (job, key) in zip(aggregators, jobs):
        n = lib.omr_keepalive_packet(buf, job, key, rank, ffi.NULL if mac_key is None else mac_key,
                                     packet_mac.code(mac))
        if n < 0:   # no MAC (OpenSSL failed): the job's idle timer will say the rest
            continue
        try:
            sock.sendto(bytes(ffi.buffer(buf, n)), address)
        except OSError:
            pass


def query(address, request, timeout_s=5.0, key=None):
    """One answered control request (counters) to the aggregator at (ip, port), signed with the
    daemon key `key` when given: the answer's fields, or ConfigError/CommTimeout."""
    request = control.pad(request, QUERY_BYTES)      # room for the answer (no amplification)
    if key is not None:
        request = auth.Signer(key)(request)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        sock.sendto(control.encode(request), address)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                data, source = sock.recvfrom(65536)
            except socket.timeout:
                break
            if source == address and data[:1] == control.MARK:
                return control.result(control.decode(data), f"omnireduce aggregator {address[0]}:{address[1]}")
    raise CommTimeout(f"omnireduce aggregator {address[0]}:{address[1]} did not answer {request.get('op')!r} "
                      f"within {timeout_s}s")
