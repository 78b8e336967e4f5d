"""The SwitchML software switch: control plane in Python, data plane in C (switch/csrc).

One `SwitchServer` listens on host:port twice: UDP for the data plane (SwitchML packets, see
`HEADER` and switch/csrc/switchml.h) and TCP on the same port number for the control plane, the
job of SwitchML's controller, in the control format of both daemons (switch/control.py: one JSON
object per line, answered by {"ok": true, ...} or {"ok": false, "error": ...}).

A switch of K `threads` is K shards: K C switches (switchml.h's sml_switch), each with its own UDP
socket (shard 0 on the port, the others on free ports of the host, listed by `status`) and its own
data-plane thread, sharing nothing, so no lock is contended on the packet path (each shard's own
mutex is taken by its thread per batch and by a control call for a copy). A job streams each shard
a share of its slots from its own socket (a worker stream, backends/switchml.py); a shard's MACs
are under its own stream key (auth.stream_key), so two streams never share a nonce under one key.

    {"op": "register", "nonce": N, "token": T, "workers": [[ip, port], ...], "slots": W, "elems": E,
     "authenticate": true, "streams": [[[ip, port], ...], ...]}
        (E values per packet: 1..MAX_ELEMS, slots * E <= MAX_POOL_VALUES; streams, optional: the ranks'
        addresses for each of up to K streams, replacing workers, which is the one-stream case)
        optional "parent": {"address": "ip:port", "ports": [p, ...], "job": m, "rank": i, "token": t, "nonce": N,
        "authenticated": true, "check": "...", "rto_ms": r, "rto_max_ms": m, "timeout_s": t, "control": "ip:port"} makes this switch a leaf of the job (switchml.h: hierarchy):
        stream i sends its complete sets to the parent's port ports[i] as rank i of the parent's job m, MACed
        under auth.stream_key(auth.job_key(key, N), i), so every switch of a hierarchy holds the same daemon
        key (check: auth.key_check of the parent's job key, so a leaf with another key refuses at once); the
        parent's control port (control, default address) must first confirm the job, token and rank; a set is
        resent after rto_ms, doubling up to rto_max_ms, for about timeout_s, then abandoned
        -> {"ok": true, "job": n, "epoch": "...", "slots": W, "expiry_s": s,
            "endpoints": [{"port": p, "slots": w}, ...]}   (job 0..255; stream i goes to shard i's port with
        w of the W slots x 2 sets; on a switch with a daemon key, the job's packets carry MACs under
        auth.stream_key(auth.job_key(key, N), i) unless "authenticate" is false)
    {"op": "keepalive", "job": n, "rank": r, "token": t}   rank r of the job lives (every rank, every expiry_s / 4)
    {"op": "leaf", "job": n, "rank": r, "token": t} a leaf's probe of its parent (SwitchServer._confirm):
                                                    confirmed only from the address registered for rank r
    {"op": "unregister", "job": n, "rank": r}       frees the job's slots (any rank that ends)
    {"op": "counters", "job": n}                    per-job and per-slot-group counters
    {"op": "counters"}                              switch-wide counters, control drops, every job
    {"op": "simulate", "ingress": p, "egress": p, "duplicate": p, "seed": s}   drop simulator
    {"op": "status"}                                pool, free slots, jobs, threads, ports (nothing secret)

Admission (a switch with a daemon key, switch/auth.py; `commlib-switch --key-file`): a register
carries `seq` and `mac` under the job key (auth.job_key(daemon key, nonce)), which only a holder of
the daemon key can compute; a job's keepalive, unregister and counters are signed with that job
key (or the daemon key: the operator); switch-wide counters and simulate with the daemon key. A
seq is accepted once per sender (auth.Replays' window) and a nonce registers once, so a sniffed request cannot be replayed. A
switch without a key (a trusted fabric) takes unsigned requests with the job's token for
keepalive and unregister (and counters: a wrong one is refused), so a stranger who read `status` can
neither end a job nor keep a dead one's slots. Limits (`Limits`) cap slots per job, and jobs and slots per source
address; a job one of whose ranks sent no keepalive for expiry_s is removed (a rank died).

Only the registered address of each rank, with the job's token, can touch the job's slots;
anything else is dropped and counted. Several jobs share one switch, each in its own slots.
The drop simulator acts on every job at once, so `simulate` answers only on a switch started
for testing (`commlib-switch --testing`, `SwitchServer(testing=True)`); elsewhere it is refused.
"""
import functools
import hashlib
import ipaddress
import logging
import math
import os
import random
import socket
import struct
import threading
import time
from collections import OrderedDict

from commlib.errors import BackendUnavailable, CommError, CommTimeout, ConfigError, PeerFailure
from commlib.switch import auth, control, net, packet_mac
from commlib.net import parse_address

log = logging.getLogger("commlib.switch")

try:
    from commlib._native import ffi, lib
    IMPORT_ERROR = None
except ImportError as exc:   # not built: say how to build it where it is used
    ffi = lib = None
    IMPORT_ERROR = (f"the SwitchML C module is not built ({exc}); run "
                    f"`python setup.py build_ext --inplace` (or `make install`)")

# Header: type, flags, job, rank, packet id, pool index (bit 15 = set), exponent, code, token,
# checksum; then none or the job's values per packet as big-endian int32 and, with SML_F_NONFINITE,
# one flag byte per value.
# The constants and counters are switch/csrc/switchml.h's, read through cffi.
HEADER = struct.Struct("!BBBBIHbBII")
HDR_LEN = HEADER.size
MAX_THREADS = 64   # data-plane threads (shards) of one switch
CONFIRM_TIMEOUT_S = 3.0   # a leaf's wait for its parent's control port (SwitchServer._confirm)
STALL_S = 2.0   # a gap between two expiry ticks (every 0.25 s) beyond which the control thread stalled


def _fields(struct_name):
    return tuple(name for name, _ in ffi.typeof(struct_name).fields)


if lib is not None:
    assert HDR_LEN == lib.SML_HDR_LEN and HEADER.size - 4 == lib.SML_CSUM_OFF
    MAX_WORKERS, MAX_JOBS, MAX_SLOTS = lib.SML_MAX_WORKERS, lib.SML_MAX_JOBS, lib.SML_MAX_SLOTS
    MAX_ELEMS, MAX_POOL_VALUES = lib.SML_MAX_ELEMS, lib.SML_MAX_POOL_VALUES
    COUNTERS, GLOBAL_COUNTERS = _fields("sml_counters"), _fields("sml_global")
    WORKER_COUNTERS = _fields("sml_worker_counters")


def checksum(header):
    """The header's checksum (transport.h's tp_checksum over the 20 header bytes, its own field zero)."""
    off = lib.SML_CSUM_OFF
    return lib.tp_checksum(bytes(header[:off]) + bytes(HDR_LEN - off), HDR_LEN)


def pack_header(type, flags, job, rank, packet_id, pool, exponent, token, code=0):
    """A sealed header (pool = slot | set << 15)."""
    raw = HEADER.pack(type, flags, job, rank, packet_id, pool, exponent, code, token, 0)
    return raw[:lib.SML_CSUM_OFF] + struct.pack("!I", checksum(raw))


def path_elems(mtu):
    """Values per packet for a path of this MTU: the most whose DATA packet and RESULT (stamp and MAC
    included) fit one IPv4 datagram unfragmented, within MAX_ELEMS (a block holding Inf/NaN adds its
    flag region and may fragment: rare, and still correct)."""
    return net.path_values(mtu, HDR_LEN + lib.SML_STAMP_LEN + lib.SML_SEQ_LEN + lib.SML_MAC_LEN, MAX_ELEMS)


def token32(job_token):
    """The 32-bit token check carried in every packet, derived from the job's token."""
    return int.from_bytes(hashlib.sha256(str(job_token).encode()).digest()[:4], "big")


def _counters_dict(c):
    """Flat numbers (the CLI and the timeline's counter tracks read them): ranks_per_ms[k] becomes
    ms_ranks_k, for the k that occurred."""
    out = {name: int(getattr(c, name)) for name in COUNTERS if name != "ranks_per_ms"}
    out.update((f"ms_ranks_{k}", int(n)) for k, n in enumerate(c.ranks_per_ms) if n)
    return out


def split(total, parts):
    """`total` in `parts` shares as equal as may be, the larger first (slots over streams)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def summed(dicts):
    """Counters (flat dicts of numbers) of several shards, added key by key."""
    out = {}
    for d in dicts:
        for name, value in d.items():
            out[name] = out.get(name, 0) + value
    return out


class _Job:
    def __init__(self, number, token, workers, slots, elems, nonce=None, key=None, source=None, streams=1,
                 parents=()):
        self.number, self.token, self.workers, self.slots, self.elems = number, token, workers, slots, elems
        self.parents = set(parents)   # (shard, parent ipv4, port, parent job) of a leaf job's streams
        self.streams = streams   # shards 0..streams-1 hold its slots
        self.nonce, self.key, self.source = nonce, key, source   # key: the job key (bytes) on a keyed switch
        self.alive = dict.fromkeys(range(len(workers[0])), time.monotonic())   # rank -> its last keepalive


class Limits:
    """What one job and one source address (of control requests) may take; None: no limit but the
    pool's. `for_pool` gives commlib-switch's defaults."""

    def __init__(self, job_slots=None, source_slots=None, source_jobs=None):
        self.job_slots, self.source_slots, self.source_jobs = job_slots, source_slots, source_jobs

    @classmethod
    def for_pool(cls, slots):
        return cls(job_slots=max(1, slots // 4), source_slots=max(1, slots // 2), source_jobs=16)


class SwitchServer:
    """A software switch: `start()` binds UDP and TCP host:port and serves until `stop()`.

    slots: capacity of the pool shared by all jobs (each job takes its window); slot_group: slots
    per counter group; ingress/egress/duplicate: the drop simulator's probabilities; testing: the
    control command `simulate` may change them (for every job) while the switch runs. key: the daemon
    key (None: a trusted fabric, requests unsigned); limits: a `Limits`; job_expiry_s: a job one of
    whose ranks is silent (no keepalive) this long is removed."""

    def __init__(self, host="127.0.0.1", port=0, slots=8192, slot_group=64, ingress=0.0, egress=0.0,
                 duplicate=0.0, seed=0, run_ms=50, offload=True, testing=False, key=None, limits=None,
                 job_expiry_s=60.0, threads=1):
        if lib is None:
            raise BackendUnavailable(IMPORT_ERROR)
        if not 1 <= slots <= MAX_SLOTS * MAX_JOBS:
            raise ConfigError(f"slots={slots}: the switch pool holds 1..{MAX_SLOTS * MAX_JOBS} slots")
        if not 1 <= threads <= MAX_THREADS:
            raise ConfigError(f"threads={threads}: a switch runs 1..{MAX_THREADS} data-plane threads")
        self.threads = int(threads)
        try:
            listen = ipaddress.IPv4Address(host)
        except ValueError:   # a name: bind() resolves it
            listen = None
        if listen is not None and (listen.is_multicast or net.is_broadcast(listen)):
            raise ConfigError(f"host {listen}: a broadcast or multicast address; a switch listens on one of this "
                              f"host's own addresses (or 0.0.0.0: all of them)")
        self.host, self.port, self.slots, self.slot_group = host, port, slots, max(1, slot_group)
        self.sim = (ingress, egress, duplicate, seed)
        self.run_ms = run_ms
        self.offload = offload
        self.testing = testing
        # key: the daemon key; the jobs' control requests are signed and their packets MACed under keys derived from it
        self.key, self.limits, self.job_expiry_s = key, limits or Limits(), float(job_expiry_s)
        self._ticked = time.monotonic()   # the control thread's last _expire
        self.drops = control.Drops()             # control requests refused, by reason
        self._replays = auth.Replays()
        self._nonces = OrderedDict()              # nonces registered so far (bounded): each registers once
        self.epoch = f"{random.getrandbits(32):08x}"
        self._jobs = {}
        self._next_job = random.randrange(MAX_JOBS)
        self._lock = threading.RLock()   # control operations against stop()
        self._stopping = threading.Event()
        self._shards = []   # (UDP socket, C switch) per data-plane thread; empty: not started
        self._tcp = None
        self._threads = []
        self.error = None

    # -- life cycle -------------------------------------------------------------------------------
    def start(self):
        udp, self._tcp = self._bind()
        self.port = udp.getsockname()[1]
        socks = [udp]
        try:
            socks += [net.udp_socket(self.host, 0, 8 << 20) for _ in range(self.threads - 1)]
        except OSError as exc:
            for sock in socks:
                sock.close()
            self._tcp.close()
            raise PeerFailure(f"commlib-switch cannot bind {self.threads} UDP ports on {self.host} ({exc})") from None
        for sock in socks:   # every shard may hold the whole pool: register() counts the slots over shards
            sw = lib.sml_switch_new(sock.fileno(), self.slots, self.slot_group, int(self.offload))
            if sw == ffi.NULL:
                raise MemoryError("could not allocate the switch")
            self._shards.append((sock, sw))
        self.simulate(*self.sim)
        self._threads = [threading.Thread(target=self._data_loop, args=(sw,), name=f"commlib-switch-data{i}",
                                          daemon=True) for i, (_, sw) in enumerate(self._shards)]
        self._threads.append(threading.Thread(target=self._control_loop, name="commlib-switch-control", daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def _bind(self):
        """UDP and TCP on the same port number (a free one when port is 0)."""
        for _ in range(20):
            udp = None
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                udp = net.udp_socket(self.host, self.port, 8 << 20)
                tcp.bind((self.host, udp.getsockname()[1]))
                tcp.listen(64)
                return udp, tcp
            except OSError as exc:
                if udp is not None:
                    udp.close()
                tcp.close()
                if self.port:
                    raise PeerFailure(f"commlib-switch cannot listen on {self.host}:{self.port} ({exc}); "
                                      f"pick another --port") from None
        raise PeerFailure(f"commlib-switch found no free port on {self.host} for UDP and TCP together")

    @property
    def address(self):
        return f"{self.host}:{self.port}"

    @property
    def ports(self):
        """The UDP port of each shard (data-plane thread); the first is the switch's port."""
        return [sock.getsockname()[1] for sock, _ in self._shards]

    def stop(self):
        if not self._shards:
            return
        self._stopping.set()
        try:
            self._tcp.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._tcp.close()
        for thread in self._threads:
            thread.join(5.0)
        stuck = [t.name for t in self._threads if t.is_alive()]
        with self._lock:
            shards, self._shards = self._shards, []
            if stuck:   # a thread may still be in sml_switch_run: freeing under it would be a use after free
                log.error("commlib-switch %s: %s still running 5 s after stop(); its C switches are left allocated",
                          self.address, ", ".join(stuck))
                self._leaked = shards   # never freed, nor their sockets closed
                return
            for sock, sw in shards:
                lib.sml_switch_free(sw)
                sock.close()

    def serve_forever(self):
        """Block until stop() (or the data plane fails)."""
        while not self._stopping.wait(0.5):
            pass

    def __enter__(self):
        return self if self._shards else self.start()

    def __exit__(self, *exc):
        self.stop()

    def _data_loop(self, sw):
        while not self._stopping.is_set():
            rc = lib.sml_switch_run(sw, self.run_ms)   # cffi releases the GIL: the shards run in parallel
            if rc < 0 and not self._stopping.is_set():
                self.error = f"data plane socket error: {os.strerror(-rc)}"
                log.error("commlib-switch %s: %s", self.address, self.error)
                self._stopping.set()

    def _control_loop(self):
        try:
            control.LineServer(self._tcp, self.handle, self.drops, tick=self._expire).serve(self._stopping)
        except (OSError, ValueError):
            if not self._stopping.is_set():   # stop() right after start() closes the socket under it
                raise

    # -- control operations ------------------------------------------------------------------------
    def handle(self, request, source=None):
        """The fields of the answer to one control request from `source` (an IP address), or a
        control.Deferred of them (a leaf's register, which waits on its parent)."""
        with self._lock:
            if not self._shards:
                raise ValueError("the switch is shutting down")
            return self._handle(request, source)

    def _handle(self, request, source):
        op = request.get("op")
        if op == "register":
            nonce = auth.check_nonce(request["nonce"]) if self.key is not None or "nonce" in request else None
            key = None
            if self.key is not None:
                key = auth.job_key(self.key, nonce)
                self._authenticate(request, key, ("register", nonce), "register")
            register = functools.partial(
                self.register, int(request["token"]), request.get("streams") or request["workers"],
                int(request.get("slots", 128)), int(request.get("elems", 256)), nonce, key, source,
                authenticate=request.get("authenticate", True) is not False, streams="streams" in request,
                parent=request.get("parent"), mac=request.get("packet_mac", packet_mac.PORTABLE))
            # a leaf first asks its parent's control port (_confirm, up to CONFIRM_TIMEOUT_S): off this thread
            return register() if request.get("parent") is None else control.Deferred(register)
        if op in ("unregister", "keepalive", "leaf") or (op == "counters" and request.get("job") is not None):
            job = self._job(request)
            if op == "leaf":
                return self._leaf(job, request, source)
            if op == "unregister":
                return self.unregister(job.number, job.token)
            if op == "keepalive":
                return self.keepalive(job.number, int(request["rank"]))
            return self.counters(job.number, request.get("token"))
        if op in ("counters", "simulate") and self.key is not None:
            self._authenticate(request, self.key, ("operator",), op)
        if op == "counters":
            return self.counters()
        if op == "simulate":
            if not self.testing:
                raise ConfigError("the drop simulator acts on every job of this switch, so 'simulate' is refused; "
                                  "start commlib-switch with --testing to allow it")
            self.simulate(float(request.get("ingress", 0)), float(request.get("egress", 0)),
                          float(request.get("duplicate", 0)), int(request.get("seed", 0)))
            return {}
        if op == "status":
            return self.status()
        raise ValueError(f"unknown op {str(op)[:40]!r}; use register, keepalive, unregister, counters, simulate "
                         f"or status")

    def _leaf(self, job, request, source):
        """Confirm a leaf's probe (SwitchServer._confirm) of `job`, whose rank request["rank"] it is to be:
        the job's token, that rank, and the probe from the address the job registered for that rank, where
        the data plane takes that rank's packets from. A switch elsewhere naming this job as its parent (an
        attacker's, a misconfigured one) is refused: its partial sums would never be taken."""
        rank, token = request.get("rank"), request.get("token")
        if type(token) is not int or token != job.token:   # JSON's 4660.0 and true are not the token 4660 and 1
            raise control.Refused("bad_token", f"job #{job.number} with that token is not registered on this switch")
        if type(rank) is not int or rank not in job.alive:
            raise ConfigError(f"job #{job.number} has no rank {str(rank)[:20]} (its leaves are 0..{len(job.alive) - 1})")
        announced = sorted({stream[rank][0] for stream in job.workers})
        if source is not None and source not in announced:
            raise control.Refused("leaf_address", f"a leaf at {source} asked to be rank {rank} of job #{job.number}, "
                                                  f"whose leaf the job announced at {', '.join(announced)}: start "
                                                  f"that leaf switch on the address COMMLIB_SWITCH_ADDR names")
        return {"job": job.number, "rank": rank}

    def _authenticate(self, request, key, sender, what):
        """Refuse `request` unless it is signed with `key` and its seq is fresh for `sender`."""
        self._replays.admit(key, request, sender, what, "this switch's key (give the job the switch's key file: "
                                                        "COMMLIB_SWITCH_KEY_FILE)")

    def _job(self, request):
        """The registered job a keepalive/unregister/counters request is about, authenticated: on a keyed
        switch signed with that job's key (by one of its ranks) or the daemon key, else with its token."""
        number = int(request["job"])
        job = self._jobs.get(number)
        if job is None:
            raise ConfigError(f"job #{number} is not registered on this switch")
        if self.key is None:
            token = request.get("token")
            if token is not None and int(token) != job.token or \
                    token is None and request.get("op") in ("keepalive", "unregister"):
                raise control.Refused("bad_token", f"job #{number} with that token is not registered on this switch")
            return job
        if auth.verify(job.key, request):
            rank = request.get("rank")
            if type(rank) is not int or rank not in job.alive:   # JSON's true is not rank 1
                raise ValueError(f"rank {rank!r} is not a rank of job #{number}")
            sender = (number, job.nonce, rank)
        elif auth.verify(self.key, request):
            sender = ("operator",)
        else:
            raise control.Refused("bad_mac", f"{request.get('op')} of job #{number} refused: not signed with the "
                                             f"job's key")
        self._replays.check(sender, request["seq"], request.get("op"))
        return job

    def register(self, token, workers, slots, elems, nonce=None, key=None, source=None, authenticate=True,
                 streams=False, parent=None, mac=packet_mac.PORTABLE):
        """Add a job; returns its job number and endpoints. workers[rank] = [ipv4, port], or with `streams`
        workers[stream][rank] (up to `threads` streams, each on its own shard with a share of the slots);
        key: the job key that signs its control requests and, with `authenticate`, MACs its packets
        with the algorithm `mac` (switch/packet_mac.py; a leaf's packets to its parent too) (None: a keyless
        switch); parent: this switch is a leaf of the job (see the module docstring)."""
        if not 0 <= token < 2 ** 32:
            raise ConfigError(f"token {token} is not a 32-bit unsigned integer (see token32())")
        lists = workers if streams else [workers]
        if not isinstance(lists, list) or not 1 <= len(lists) <= min(self.threads, slots):
            raise ConfigError(f"a job streams to 1..{self.threads} threads of this switch, at most one per slot; "
                              f"it asked for {len(lists) if isinstance(lists, list) else lists!r} streams")
        for w in lists:
            if not isinstance(w, list) or not 1 <= len(w) <= MAX_WORKERS or len(w) != len(lists[0]):
                raise ConfigError(f"a job has 1..{MAX_WORKERS} workers, a list of [ip, port] (the same number in "
                                  f"every stream)")
        if not 1 <= slots <= MAX_SLOTS or not 1 <= elems <= MAX_ELEMS or slots * elems > MAX_POOL_VALUES:
            raise ConfigError(f"slots={slots} (1..{MAX_SLOTS}) and elems={elems} (values per packet, 1..{MAX_ELEMS}) "
                              f"are not valid, or together pass the {MAX_POOL_VALUES} values a job may hold")
        addrs = [[_ipv4_port(worker) for worker in w] for w in lists]
        shares = split(slots, len(lists))
        algorithm = packet_mac.code(mac)
        up = None
        if parent is not None:
            with self._lock:   # a replay or a request beyond the limits probes no parent
                self._admit(slots, nonce, source)
            up = self._parent(parent, len(lists), key is not None and authenticate)
        with self._lock:
            if not self._shards:
                raise ValueError("the switch is shutting down")
            self._admit(slots, nonce, source)   # (again: jobs came while the parent answered)
            parents = set() if up is None else {(i, ip, port, parent["job"]) for i, (ip, port, _) in enumerate(up)}
            if any(parents & job.parents for job in self._jobs.values()):   # the parent's results would go to either
                raise control.Refused("parent", f"another job on this switch is a leaf of job #{parent['job']} at "
                                                f"{parent['address']}: a spine's job has one job per leaf switch")
            if self._free() < slots:
                raise control.Refused("limit", f"the switch has {self._free()} free slots, the job asks for {slots}: "
                                               f"lower COMMLIB_SWITCH_WINDOW or start the switch with more --slots")
            free = [n for n in ((self._next_job + i) % MAX_JOBS for i in range(MAX_JOBS)) if n not in self._jobs]
            if not free:
                raise control.Refused("limit", f"the switch already serves {MAX_JOBS} jobs; end one first")
            number = free[0]
            for i, (share, ranks) in enumerate(zip(shares, addrs)):
                sw = self._shards[i][1]
                stream_key = auth.stream_key(key, i) if key is not None and authenticate else ffi.NULL
                rc = lib.sml_switch_add_job(sw, number, token, len(ranks), share, elems, stream_key, algorithm)
                if rc != 0:
                    for _, done in self._shards[:i]:
                        lib.sml_switch_remove_job(done, number)
                    why = {lib.SML_ADD_IN_USE: "its job number is in use", lib.SML_ADD_ARG: "invalid parameters",
                           lib.SML_ADD_NOMEM: "out of memory"}.get(rc, f"code {rc}")
                    raise ConfigError(f"the switch could not add the job: {why}")
                for rank, (ip, port) in enumerate(ranks):
                    lib.sml_switch_set_addr(sw, number, rank, ip, port)
                rc = 0 if up is None else lib.sml_switch_set_parent(
                    sw, number, up[i][0], up[i][1], parent["job"], parent["rank"], parent["token"], up[i][2],
                    algorithm, parent["rto_ms"], parent["rto_max_ms"], parent["tries"])
                if rc != 0:
                    for _, done in self._shards[:i + 1]:
                        lib.sml_switch_remove_job(done, number)
                    raise ConfigError(f"the switch could not make the job a leaf of {parent['address']} (code {rc})")
            self._jobs[number] = _Job(number, token, lists, slots, elems, nonce, key, source, len(lists), parents)
            if nonce is not None:
                self._nonces[nonce] = number
                while len(self._nonces) > 65536:
                    self._nonces.popitem(last=False)
            self._next_job = (number + 1) % MAX_JOBS   # a just-ended number is not reused at once
        log.info("commlib-switch %s: job #%d registered (%d workers, %d slots, %d streams)", self.address, number,
                 len(lists[0]), slots, len(lists))
        return {"job": number, "epoch": self.epoch, "slots": slots, "expiry_s": self.job_expiry_s,
                "authenticated": key is not None and authenticate, "packet_mac": mac,
                "endpoints": [{"port": port, "slots": share} for port, share in zip(self.ports, shares)]}

    def _parent(self, parent, nstreams, authenticated):
        """Per stream, the parent's (ipv4, port, MAC key or NULL) of a leaf registration, checked; parent gets
        "tries": the resends of a set that fit the job's timeout_s at rto_max_ms (then it is abandoned).
        authenticated: the leaf's own job is, so its parent's must be too."""
        try:
            host, _ = parse_address(parent["address"], "parent address")
            ports = [int(p) for p in parent["ports"]]
            for name in ("job", "rank", "token"):
                parent[name] = int(parent[name])
            for name, default in (("rto_ms", 5.0), ("rto_max_ms", 200.0), ("timeout_s", 60.0)):
                parent[name] = float(parent.get(name, default))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"parent {str(parent)[:200]}: needs address, ports, job, rank and token ({exc})") from None
        lo, floor, hi = lib.SML_UP_RTO_MIN_US / 1e3, lib.SML_UP_RTO_FLOOR_US / 1e3, lib.SML_UP_RTO_MAX_US / 1e3
        rto, rto_max, timeout = parent["rto_ms"], parent["rto_max_ms"], parent["timeout_s"]
        if len(ports) != nstreams or not 0 <= parent["job"] < MAX_JOBS or not 0 <= parent["rank"] < MAX_WORKERS or \
                not 0 <= parent["token"] < 2 ** 32 or not lo <= rto <= rto_max <= hi or not floor <= rto_max or \
                not 0 < timeout <= 3600:   # written so that NaN fails: a zero or endless timer is a resend storm
            raise ConfigError(f"parent {str(parent)[:200]}: one port per stream ({nstreams}), job 0..{MAX_JOBS - 1}, "
                              f"rank 0..{MAX_WORKERS - 1}, a 32-bit token, {lo} <= rto_ms <= rto_max_ms <= {hi} with "
                              f"rto_max_ms >= {floor}, 0 < timeout_s <= 3600")
        net.unicast(host, "parent address")
        parent["tries"] = min(lib.SML_UP_MAX_TRIES, math.ceil(math.log2(rto_max / rto)) +
                              math.ceil(timeout * 1e3 / rto_max))
        job_key = None
        if authenticated and not parent.get("authenticated"):
            raise ConfigError("this leaf's job is authenticated and its parent's is not: register the spine's job "
                              "with authentication (the same --key-file on every switch of the hierarchy)")
        if parent.get("authenticated"):
            if self.key is None:
                raise ConfigError("the spine's job is authenticated and this leaf switch has no key: start every "
                                  "switch of a hierarchy with the same --key-file")
            job_key = auth.job_key(self.key, auth.check_nonce(parent.get("nonce")))
            if auth.key_check(job_key) != parent.get("check"):
                raise ConfigError("this leaf switch's key is not the spine's: start every switch of a hierarchy with "
                                  "the same --key-file")
        self._confirm(parent, job_key)
        return [(*_ipv4_port([host, port]), ffi.NULL if job_key is None else auth.stream_key(job_key, i))
                for i, port in enumerate(ports)]

    def _confirm(self, parent, job_key):
        """Refuse a parent whose control port does not confirm its job: a switch there serving job parent["job"]
        with parent["token"] and that rank (on a keyed switch: the request is signed with that job's key as
        rank parent["rank"]), registered at the address this probe comes from (_leaf). Before it a leaf sends
        nothing, so no one names an arbitrary host as a parent to have the leaf's sets sent there, and a leaf
        the job did not announce is refused at once rather than its sets dropped. parent["control"]: its
        control address where its data address is not (a relay)."""
        address = parent.get("control", parent["address"])
        try:
            host, port = parse_address(address, "parent control address")
            ipaddress.IPv4Address(host)   # a literal: a control request must not wait on a name lookup
        except (ConfigError, ValueError):
            raise ConfigError(f"parent control address {str(address)[:60]}: not an IPv4 address:port") from None
        if job_key is None and self.key is not None and parent.get("nonce") is not None:   # a keyed spine's job
            job_key = auth.job_key(self.key, auth.check_nonce(parent["nonce"]))            # whose packets are not
        client = SwitchClient(f"{host}:{port}", CONFIRM_TIMEOUT_S, key=job_key,
                              source=None if self.host in ("", "0.0.0.0") else self.host)   # from the leaf's address
        try:
            client.request("leaf", job=parent["job"], rank=parent["rank"], token=parent["token"])
        except CommError as exc:
            if "unknown op 'leaf'" in str(exc):
                raise ConfigError(f"the parent switch at {address} runs an older commlib, which cannot confirm a "
                                  f"leaf: run the same commlib version on the spine and its leaves") from None
            raise ConfigError(f"the parent switch at {address} did not confirm job #{parent['job']} with that token "
                              f"and rank {parent['rank']} ({exc}); register the job on the spine first, with this "
                              f"leaf's address as that rank's") from None

    def _free(self):
        return self.slots - sum(job.slots for job in self._jobs.values())

    def _admit(self, slots, nonce, source):
        """Refuse a registration beyond the limits, or of a nonce seen before (a replayed register)."""
        if nonce is not None and nonce in self._nonces:
            raise control.Refused("replay", "register refused: a job with this nonce was registered already (a "
                                            "replayed request?); a job makes a new nonce for each registration")
        lim = self.limits
        if lim.job_slots is not None and slots > lim.job_slots:
            raise control.Refused("limit", f"the job asks for {slots} slots, this switch gives a job at most "
                                           f"{lim.job_slots}: lower COMMLIB_SWITCH_WINDOW")
        mine = [j for j in self._jobs.values() if j.source == source]
        if lim.source_jobs is not None and len(mine) >= lim.source_jobs:
            raise control.Refused("limit", f"{source} already holds {len(mine)} jobs on this switch, the most one "
                                           f"address may hold; end one first")
        held = sum(j.slots for j in mine)
        if lim.source_slots is not None and held + slots > lim.source_slots:
            raise control.Refused("limit", f"{source} holds {held} slots on this switch; {slots} more would pass "
                                           f"its limit of {lim.source_slots} per address")

    def keepalive(self, number, rank):
        with self._lock:
            job = self._jobs.get(number)
            if job is None or rank not in job.alive:
                raise ConfigError(f"job #{number} has no rank {rank} on this switch")
            job.alive[rank] = time.monotonic()
        return {"expiry_s": self.job_expiry_s}

    def unregister(self, number, token=None):
        with self._lock:
            job = self._jobs.get(number)
            if job is None or (token is not None and job.token != token):
                raise ConfigError(f"job #{number} with that token is not registered on this switch")
            self._remove(job)
        log.info("commlib-switch %s: job #%d ended", self.address, number)
        return {}

    def _remove(self, job):
        for _, sw in self._shards[:job.streams]:
            lib.sml_switch_remove_job(sw, job.number)
        del self._jobs[job.number]
        self._replays.forget((job.number, job.nonce))

    def _expire(self):
        """Remove the jobs one of whose ranks sent no keepalive for job_expiry_s (it died or hangs). A
        time the control thread did not run (the daemon stopped, a host that swapped) is no rank's
        silence: its keepalives wait unread, so every rank is credited with it."""
        now = time.monotonic()
        stalled, self._ticked = now - self._ticked, now
        with self._lock:
            if not self._shards:
                return
            if stalled > STALL_S:
                for job in self._jobs.values():
                    for rank in job.alive:
                        job.alive[rank] += stalled
            for job in [j for j in self._jobs.values() if now - min(j.alive.values()) > self.job_expiry_s]:
                rank = min(job.alive, key=job.alive.get)
                self._remove(job)
                self.drops.add("jobs_expired")
                log.warning("commlib-switch %s: job #%d expired (rank %d silent for %.0fs)", self.address,
                            job.number, rank, now - job.alive[rank])

    def counters(self, number=None, token=None):
        """Counters of one job (with `token`: only if the job is still the one holding that token),
        or the switch-wide ones, the control plane's drops and every job's totals; summed over the
        shards, each shard's own under "shards"."""
        c = ffi.new("sml_counters *")
        if number is not None:
            number = int(number)
            with self._lock:
                job = self._jobs.get(number)
                if job is None or (token is not None and job.token != int(token)):
                    raise ConfigError(f"job #{number}{' with that token' if token is not None else ''} is not "
                                      f"registered on this switch")
                shards, groups = [], []   # groups: shard 0's, then shard 1's, ...
                for _, sw in self._shards[:job.streams]:
                    lib.sml_switch_job_counters(sw, number, c)
                    shards.append(_counters_dict(c))
                    for g in range(lib.sml_switch_groups(sw, number)):
                        lib.sml_switch_group_counters(sw, number, g, c)
                        groups.append(_counters_dict(c))
            return {"job": number, "counters": summed(shards), "slot_group": self.slot_group, "groups": groups,
                    "shards": shards}
        g = ffi.new("sml_global *")
        with self._lock:
            shards = []
            for _, sw in self._shards:
                lib.sml_switch_global_counters(sw, g)
                shards.append({name: int(getattr(g, name)) for name in GLOBAL_COUNTERS})
            jobs = {}
            for n, job in self._jobs.items():
                totals = []
                for _, sw in self._shards[:job.streams]:
                    lib.sml_switch_job_counters(sw, n, c)
                    totals.append(_counters_dict(c))
                jobs[str(n)] = summed(totals)
        return {"switch": summed(shards), "shards": shards, "jobs": jobs, "control": self.drops.snapshot()}

    def simulate(self, ingress=0.0, egress=0.0, duplicate=0.0, seed=0):
        for p in (ingress, egress, duplicate):
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"drop simulator probability {p} is not in [0, 1)")
        with self._lock:
            first = seed or random.getrandbits(62) | 1
            for i, (_, sw) in enumerate(self._shards):   # each shard its own stream of draws
                lib.sml_switch_set_sim(sw, ingress, egress, duplicate, first + 2 * i)
            self.sim = (ingress, egress, duplicate, seed)
        return {}

    def status(self):
        with self._lock:
            jobs = {str(n): {"workers": len(j.alive), "slots": j.slots, "elems": j.elems, "streams": j.streams}
                    for n, j in self._jobs.items()}
            free = self._free()
        return {"address": self.address, "epoch": self.epoch, "slots": self.slots, "free_slots": free, "jobs": jobs,
                "threads": self.threads, "ports": self.ports,
                "authenticated": self.key is not None, "simulate": dict(zip(("ingress", "egress", "duplicate", "seed"), self.sim))}


def _ipv4_port(worker):
    """[ip, port] of a worker as the C switch wants it: (IPv4 as an integer, port). Only literal
    addresses: a control request must not make the switch wait on a name lookup."""
    try:
        host, port = worker
        ip = struct.unpack("!I", socket.inet_pton(socket.AF_INET, host))[0]
    except (OSError, TypeError, ValueError):
        raise ConfigError(f"worker address {str(worker)[:60]} is not [IPv4 address, port]") from None
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"worker address {host}:{port}: the port is not in 1..65535")
    net.unicast(host, "worker address")   # results sent there must reach one host
    return ip, port


class SwitchClient:
    """The control plane seen from a job or a user: one TCP request per call. key: the job key (a
    rank, with its `rank`) or the daemon key (an operator) that signs every request; None for a
    switch without a key. source: the local address the requests leave from (a leaf's probe: its own)."""

    def __init__(self, address, timeout=10.0, key=None, rank=None, source=None):
        self.address = address if isinstance(address, str) else f"{address[0]}:{address[1]}"
        self.host, self.port = parse_address(self.address, "switch address")
        self.timeout = timeout
        self.rank = rank
        self.source = None if source is None else (source, 0)   # the local address requests leave from
        self._sign = auth.Signer(key) if key is not None else None
        # one request at a time: two threads' requests (keepalive, counters) must reach the switch in
        # the order of their seq, or the later-signed one arriving first makes the other a "replay"
        self._lock = threading.Lock()

    def request(self, op, **fields):
        message = {"op": op, **fields}
        if self.rank is not None:
            message.setdefault("rank", self.rank)
        try:
            with self._lock, socket.create_connection((self.host, self.port), timeout=self.timeout,
                                                      source_address=self.source) as sock:
                if self._sign is not None and op != "status":
                    message = self._sign(message)
                sock.sendall(control.encode(message))
                with sock.makefile("rb") as stream:
                    line = stream.readline(1 << 20)
        except socket.timeout:
            raise CommTimeout(f"the switch at {self.address} did not answer {op!r} within {self.timeout}s; "
                              f"is commlib-switch running there?") from None
        except OSError as exc:
            raise PeerFailure(f"cannot reach the switch's control port at {self.address} ({exc}); start it with "
                              f"`commlib-switch --host {self.host} --port {self.port}` or fix COMMLIB_SWITCH_ADDR")
        if not line:
            raise PeerFailure(f"the switch at {self.address} closed the connection during {op!r}")
        return control.result(control.decode(line), f"switch {self.address}: {op}")

    def register(self, token, workers, slots, elems, nonce=None, authenticate=None, streams=None, parent=None,
                 mac=None):
        """streams: the ranks' addresses per stream (several streams; workers is the first's); parent: this
        switch is a leaf of the job (see the module docstring); mac: the packets' MAC algorithm
        (switch/packet_mac.py; None: the switch's default, the portable one)."""
        fields = {} if nonce is None else {"nonce": nonce}
        if mac is not None:   # the request's own "mac" is its signature (auth.sign)
            fields["packet_mac"] = mac
        if parent is not None:
            fields["parent"] = parent
        if streams is not None and len(streams) > 1:
            fields["streams"] = streams
        if authenticate is not None:
            fields["authenticate"] = authenticate
        return self.request("register", token=token, workers=workers, slots=slots, elems=elems, **fields)

    def unregister(self, job, token=None):
        return self.request("unregister", job=job, **({} if token is None else {"token": token}))

    def keepalive(self, job, token=None):
        return self.request("keepalive", job=job, **({} if token is None else {"token": token}))

    def counters(self, job=None, token=None):
        fields = {} if job is None else {"job": job}
        if token is not None:
            fields["token"] = token
        return self.request("counters", **fields)

    def simulate(self, ingress=0.0, egress=0.0, duplicate=0.0, seed=0):
        return self.request("simulate", ingress=ingress, egress=egress, duplicate=duplicate, seed=seed)

    def status(self):
        return self.request("status")
