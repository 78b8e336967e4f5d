"""The SwitchML software switch: control plane in Python, data plane in C (switch/csrc).

One `SwitchServer` listens on host:port twice: UDP for the data plane (SwitchML packets, see
`HEADER` and switch/csrc/switchml.h) and TCP on the same port number for the control plane, the
job of SwitchML's controller, in the control format of both daemons (switch/control.py: one JSON
object per line, answered by {"ok": true, ...} or {"ok": false, "error": ...}):

    {"op": "register", "token": T, "workers": [[ip, port], ...], "slots": W, "elems": 256,
     "nonce": N, "authenticate": true}
        -> {"ok": true, "job": n, "epoch": "..."}   (job number 0..255; pool of W slots x 2 sets;
        on a switch with a daemon key, the job's packets carry MACs under auth.job_key(key, N))
    {"op": "unregister", "job": n, "token": T}      frees the job's slots
    {"op": "counters", "job": n}                    per-job and per-slot-group counters
    {"op": "counters"}                              switch-wide counters and every job
    {"op": "simulate", "ingress": p, "egress": p, "duplicate": p, "seed": s}   drop simulator
    {"op": "status"}

Only the registered address of each rank, with the job's token, can touch the job's slots;
anything else is dropped and counted. Several jobs share one switch, each in its own slots.
The drop simulator acts on every job at once, so `simulate` answers only on a switch started
for testing (`commlib-switch --testing`, `SwitchServer(testing=True)`); elsewhere it is refused.
"""
import hashlib
import logging
import os
import random
import socket
import struct
import threading

from commlib.errors import BackendUnavailable, CommTimeout, ConfigError, PeerFailure
from commlib.switch import auth, control, net
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
# checksum; then 0/64/256 big-endian int32 and, with SML_F_NONFINITE, one flag byte per value.
# The constants and counters are switch/csrc/switchml.h's, read through cffi.
HEADER = struct.Struct("!BBBBIHbBII")
HDR_LEN = HEADER.size


def _fields(struct_name):
    return tuple(name for name, _ in ffi.typeof(struct_name).fields)


if lib is not None:
    assert HDR_LEN == lib.SML_HDR_LEN and HEADER.size - 4 == lib.SML_CSUM_OFF
    MAX_WORKERS, MAX_JOBS, MAX_SLOTS = lib.SML_MAX_WORKERS, lib.SML_MAX_JOBS, lib.SML_MAX_SLOTS
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


def token32(job_token):
    """The 32-bit token check carried in every packet, derived from the job's token."""
    return int.from_bytes(hashlib.sha256(str(job_token).encode()).digest()[:4], "big")


def _counters_dict(c):
    return {name: int(getattr(c, name)) for name in COUNTERS}


class _Job:
    def __init__(self, number, token, workers, slots, elems):
        self.number, self.token, self.workers, self.slots, self.elems = number, token, workers, slots, elems


class SwitchServer:
    """A software switch: `start()` binds UDP and TCP host:port and serves until `stop()`.

    slots: capacity of the pool shared by all jobs (each job takes its window); slot_group: slots
    per counter group; ingress/egress/duplicate: the drop simulator's probabilities; testing: the
    control command `simulate` may change them (for every job) while the switch runs."""

    def __init__(self, host="127.0.0.1", port=0, slots=8192, slot_group=64, ingress=0.0, egress=0.0,
                 duplicate=0.0, seed=0, run_ms=50, offload=True, testing=False, key=None):
        if lib is None:
            raise BackendUnavailable(IMPORT_ERROR)
        if not 1 <= slots <= MAX_SLOTS * MAX_JOBS:
            raise ConfigError(f"slots={slots}: the switch pool holds 1..{MAX_SLOTS * MAX_JOBS} slots")
        self.host, self.port, self.slots, self.slot_group = host, port, slots, max(1, slot_group)
        self.sim = (ingress, egress, duplicate, seed)
        self.run_ms = run_ms
        self.offload = offload
        self.testing = testing
        self.key = key           # the daemon key: the jobs' data-plane keys derive from it
        self.epoch = f"{random.getrandbits(32):08x}"
        self._jobs = {}
        self._next_job = random.randrange(MAX_JOBS)
        self._lock = threading.RLock()   # control operations against stop()
        self._stopping = threading.Event()
        self._sw = None
        self._udp = self._tcp = None
        self._threads = []
        self.error = None

    # -- life cycle -------------------------------------------------------------------------------
    def start(self):
        self._udp, self._tcp = self._bind()
        self.port = self._udp.getsockname()[1]
        self._sw = lib.sml_switch_new(self._udp.fileno(), self.slots, self.slot_group, int(self.offload))
        if self._sw == ffi.NULL:
            raise MemoryError("could not allocate the switch")
        self.simulate(*self.sim)
        self._threads = [threading.Thread(target=self._data_loop, name="commlib-switch-data", daemon=True),
                         threading.Thread(target=self._control_loop, name="commlib-switch-control", daemon=True)]
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

    def stop(self):
        if self._sw is None:
            return
        self._stopping.set()
        try:
            self._tcp.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._tcp.close()
        for thread in self._threads:
            thread.join(5.0)
        with self._lock:
            lib.sml_switch_free(self._sw)
            self._sw = None
        self._udp.close()

    def serve_forever(self):
        """Block until stop() (or the data plane fails)."""
        while not self._stopping.wait(0.5):
            pass

    def __enter__(self):
        return self.start() if self._sw is None else self

    def __exit__(self, *exc):
        self.stop()

    def _data_loop(self):
        while not self._stopping.is_set():
            rc = lib.sml_switch_run(self._sw, self.run_ms)
            if rc < 0 and not self._stopping.is_set():
                self.error = f"data plane socket error: {os.strerror(-rc)}"
                log.error("commlib-switch %s: %s", self.address, self.error)
                self._stopping.set()

    def _control_loop(self):
        while not self._stopping.is_set():
            try:
                conn, _ = self._tcp.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_client, args=(conn,), daemon=True).start()

    def _serve_client(self, conn):
        with conn, conn.makefile("rwb") as stream:
            for line in stream:
                stream.write(control.encode(control.answer(self.handle, control.decode(line))))
                stream.flush()

    # -- control operations ------------------------------------------------------------------------
    def handle(self, request):
        with self._lock:
            if self._sw is None:
                raise ValueError("the switch is shutting down")
            return self._handle(request)

    def _handle(self, request):
        op = request.get("op")
        if op == "register":
            nonce = request.get("nonce")
            key = None
            if self.key is not None and request.get("authenticate", True) and isinstance(nonce, str):
                key = auth.job_key(self.key, nonce)
            return self.register(int(request["token"]), request["workers"], int(request.get("slots", 128)),
                                 int(request.get("elems", 256)), key)
        if op == "unregister":
            return self.unregister(int(request["job"]), int(request["token"]))
        if op == "counters":
            return self.counters(request.get("job"), request.get("token"))
        if op == "simulate":
            if not self.testing:
                raise ConfigError("the drop simulator acts on every job of this switch, so 'simulate' is refused; "
                                  "start commlib-switch with --testing to allow it")
            self.simulate(float(request.get("ingress", 0)), float(request.get("egress", 0)),
                          float(request.get("duplicate", 0)), int(request.get("seed", 0)))
            return {}
        if op == "status":
            return self.status()
        raise ValueError(f"unknown op {op!r}; use register, unregister, counters, simulate or status")

    def register(self, token, workers, slots, elems, key=None):
        """Add a job; returns its job number. workers[rank] = [ipv4, port]; key: the job key its
        packets are authenticated with (None: no MACs)."""
        if not 0 <= token < 2 ** 32:
            raise ConfigError(f"token {token} is not a 32-bit unsigned integer (see token32())")
        if not 1 <= len(workers) <= MAX_WORKERS:
            raise ConfigError(f"a job has 1..{MAX_WORKERS} workers, got {len(workers)}")
        if not 1 <= slots <= MAX_SLOTS or elems not in (64, 256):
            raise ConfigError(f"slots={slots} (1..{MAX_SLOTS}) and elems={elems} (64 or 256) are not valid")
        addrs = []
        for host, port in workers:
            try:
                addrs.append((struct.unpack("!I", socket.inet_aton(socket.gethostbyname(host)))[0], int(port)))
            except OSError:
                raise ConfigError(f"worker address {host}:{port} is not an IPv4 address") from None
            if not 0 < addrs[-1][1] < 65536:
                raise ConfigError(f"worker address {host}:{port}: the port is not in 1..65535")
        with self._lock:
            free = [n for n in ((self._next_job + i) % MAX_JOBS for i in range(MAX_JOBS)) if n not in self._jobs]
            if not free:
                raise ConfigError(f"the switch already serves {MAX_JOBS} jobs; end one first")
            number = free[0]
            rc = lib.sml_switch_add_job(self._sw, number, token, len(workers), slots, elems,
                                        ffi.NULL if key is None else key)
            if rc == lib.SML_ADD_NO_SLOTS:
                raise ConfigError(f"the switch has {lib.sml_switch_free_slots(self._sw)} free slots, the job asks "
                                  f"for {slots}: lower COMMLIB_SWITCH_WINDOW or start the switch with more --slots")
            if rc != 0:
                why = {lib.SML_ADD_IN_USE: "its job number is in use", lib.SML_ADD_ARG: "invalid parameters",
                       lib.SML_ADD_NOMEM: "out of memory"}.get(rc, f"code {rc}")
                raise ConfigError(f"the switch could not add the job: {why}")
            for rank, (ip, port) in enumerate(addrs):
                lib.sml_switch_set_addr(self._sw, number, rank, ip, port)
            self._jobs[number] = _Job(number, token, [list(w) for w in workers], slots, elems)
            self._next_job = (number + 1) % MAX_JOBS   # a just-ended number is not reused at once
        log.info("commlib-switch %s: job #%d registered (%d workers, %d slots)", self.address, number,
                 len(workers), slots)
        return {"job": number, "epoch": self.epoch, "slots": slots}

    def unregister(self, number, token):
        with self._lock:
            job = self._jobs.get(number)
            if job is None or job.token != token:
                raise ConfigError(f"job #{number} with that token is not registered on this switch")
            lib.sml_switch_remove_job(self._sw, number)
            del self._jobs[number]
        log.info("commlib-switch %s: job #%d ended", self.address, number)
        return {}

    def counters(self, number=None, token=None):
        """Counters of one job (with `token`: only if the job is still the one holding that token),
        or the switch-wide ones and every job's totals."""
        c = ffi.new("sml_counters *")
        if number is not None:
            number = int(number)
            with self._lock:
                job = self._jobs.get(number)
                if job is None or (token is not None and job.token != int(token)) or \
                        lib.sml_switch_job_counters(self._sw, number, c) != 0:
                    raise ConfigError(f"job #{number}{' with that token' if token is not None else ''} is not "
                                      f"registered on this switch")
                total = _counters_dict(c)
                groups = []
                for g in range(lib.sml_switch_groups(self._sw, number)):
                    lib.sml_switch_group_counters(self._sw, number, g, c)
                    groups.append(_counters_dict(c))
            return {"job": number, "counters": total, "slot_group": self.slot_group, "groups": groups}
        g = ffi.new("sml_global *")
        with self._lock:
            lib.sml_switch_global_counters(self._sw, g)
            jobs = {}
            for n in self._jobs:
                lib.sml_switch_job_counters(self._sw, n, c)
                jobs[str(n)] = _counters_dict(c)
        return {"switch": {name: int(getattr(g, name)) for name in GLOBAL_COUNTERS}, "jobs": jobs}

    def simulate(self, ingress=0.0, egress=0.0, duplicate=0.0, seed=0):
        for p in (ingress, egress, duplicate):
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"drop simulator probability {p} is not in [0, 1)")
        with self._lock:
            lib.sml_switch_set_sim(self._sw, ingress, egress, duplicate, seed or random.getrandbits(63) | 1)
            self.sim = (ingress, egress, duplicate, seed)
        return {}

    def status(self):
        with self._lock:
            jobs = {str(n): {"workers": len(j.workers), "slots": j.slots, "elems": j.elems}
                    for n, j in self._jobs.items()}
            free = int(lib.sml_switch_free_slots(self._sw))
        return {"address": self.address, "epoch": self.epoch, "slots": self.slots, "free_slots": free, "jobs": jobs,
                "simulate": dict(zip(("ingress", "egress", "duplicate", "seed"), self.sim))}


class SwitchClient:
    """The control plane seen from a job or a user: one TCP request per call."""

    def __init__(self, address, timeout=10.0):
        self.address = address if isinstance(address, str) else f"{address[0]}:{address[1]}"
        self.host, self.port = parse_address(self.address, "switch address")
        self.timeout = timeout

    def request(self, op, **fields):
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout) as sock:
                sock.sendall(control.encode({"op": op, **fields}))
                with sock.makefile("rb") as stream:
                    line = stream.readline()
        except socket.timeout:
            raise CommTimeout(f"the switch at {self.address} did not answer {op!r} within {self.timeout}s; "
                              f"is commlib-switch running there?") from None
        except OSError as exc:
            raise PeerFailure(f"cannot reach the switch's control port at {self.address} ({exc}); start it with "
                              f"`commlib-switch --host {self.host} --port {self.port}` or fix COMMLIB_SWITCH_ADDR")
        if not line:
            raise PeerFailure(f"the switch at {self.address} closed the connection during {op!r}")
        return control.result(control.decode(line), f"switch {self.address}: {op}")

    def register(self, token, workers, slots, elems, nonce=None, authenticate=False):
        return self.request("register", token=token, workers=workers, slots=slots, elems=elems, nonce=nonce,
                            authenticate=authenticate)

    def unregister(self, job, token):
        return self.request("unregister", job=job, token=token)

    def counters(self, job=None, token=None):
        fields = {} if job is None else {"job": job}
        if token is not None:
            fields["token"] = token
        return self.request("counters", **fields)

    def simulate(self, ingress=0.0, egress=0.0, duplicate=0.0, seed=0):
        return self.request("simulate", ingress=ingress, egress=egress, duplicate=duplicate, seed=seed)

    def status(self):
        return self.request("status")
