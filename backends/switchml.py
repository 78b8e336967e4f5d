"""SwitchML: in-network aggregation through a (software) switch.

Every rank streams its tensor through a pool of `switch_window` slots of a commlib-switch, one
block of `switch_packet_elems` values per packet (sized by the path unless set); the switch adds the blocks of all ranks and
sends each sum back to every rank. Each rank sends S and receives S bytes whatever the number of
ranks. The per-packet loop is C (switch/csrc/switchml_worker.c), one call per tensor, the GIL
released. Packets and results carry a MAC under the job key (backends/keys.py; `authenticate`),
and the packet id is each slot set's version, so reordered, late and replayed packets are never
aggregated (switch/csrc/switchml.h).

Tuning guide
  switch_window          packets in flight per rank (= slots the job takes on the switch). Larger
                         hides more latency; 0 (the default) keeps WINDOW_BYTES of values in flight,
                         at most MAX_WINDOW packets (loopback: 32 of 8192 values; Tofino's 256: 128),
                         which fills loopback and a 10-100G LAN.
  switch_packet_elems    values per packet, agreed by every rank at registration. 0 (the default)
                         sizes packets by the path: the most that fit one datagram of the path's MTU
                         (1500-byte Ethernet: 355; 9000-byte jumbo frames: 2,230; loopback:
                         PATH_MAX_ELEMS), so
                         the kernel's per-datagram cost is paid per thousands of values. 256 or 64:
                         Tofino's sizes (a hardware switch's registers bound them).
  switch_retransmit_ms   floor of the per-packet timer; the timer follows the measured round trip,
                         which includes waiting for the slowest rank (srtt + max(4 rttvar, srtt / 2):
                         RFC 6298 with a margin, switch/csrc/transport.h), and doubles per resend
                         up to switch_retransmit_max_ms. Too small only
                         costs duplicate packets; too large slows loss recovery.
  switch_nonfinite       "propagate": Inf/NaN in any rank's input reach the sum as IEEE would
                         (+Inf, -Inf, NaN for NaN or +Inf + -Inf); "error": every rank raises
                         InvalidTensor after the collective (no rank is left waiting).

Numbers
  int32 is summed exactly (wrapping like the switch's adders).
  float32 is quantized per block with the max exponent e over ranks (max|x| < 2^e), exchanged one
  window ahead: f = (2^31 - 1) / (n * 2^e), q = round(x * f), so |q| <= (2^31 - 1) / n and the
  n-way int32 sum cannot overflow. Per element the error of the sum is at most
      n * 0.5 / f = n^2 * 2^(e-1) / (2^31 - 1)       (plus float32 rounding of the result),
  i.e. about n^2 * 2^-31 relative to the block's largest magnitude. All-zero blocks stay exactly
  zero. Finite values with |x| >= 2^127 cannot be quantized: every rank sends that tensor through
  the ring instead (a warning, and stats()["range_fallbacks"]), or raises InvalidTensor without one.
  float16 is widened to float32 (exactly), summed as float32 and rounded back to float16 (the
  core hands bfloat16 over as float32 already); other dtypes are rejected.
"""
import logging
import os
import socket
import threading
import time

import numpy as np

from commlib import kernels
from commlib.backends import Backend, keys, register
from commlib.backends.base import server_share
from commlib.errors import (BackendUnavailable, CommError, CommTimeout, ConfigError, InvalidTensor,
                            PeerFailure)
from commlib.settings import define
from commlib.switch import auth, net
from commlib.switch import switchml as sw
from commlib.net import parse_address

log = logging.getLogger("commlib.switchml")

define("switch_addr", "", "host:port of a commlib-switch (UDP data + TCP control on one port); empty: "
       "rank 0 starts a switch on loopback when every rank is on this machine")
define("switch_key_file", "", "the daemon key of a commlib-switch started with --key-file (COMMLIB_SWITCH_ADDR), "
       "read by every rank; the embedded switch uses the job's secret", per_rank=True)
define("switch_window", 0, "SwitchML window: packets in flight per rank = slots the job takes on the switch; "
       "0: about 1 MiB of values in flight, at most 128 packets")
define("switch_packet_elems", 0, "values per SwitchML packet: 0 sizes them by the path's MTU; 256 or 64 are "
       "Tofino's sizes; any 1..8192")

PATH_MAX_ELEMS = 8192    # values per packet on loopback and other paths of a large MTU
WINDOW_BYTES = 1 << 20    # values in flight per rank with the default window (32 packets of 8192 on loopback:
MAX_WINDOW = 128          # measured 5.5 against 4.5 Gbps with 4 packets, 128 KiB), in at most this many packets
define("switch_retransmit_ms", 5.0, "SwitchML per-packet retransmission timer (ms): the floor of the adaptive "
       "timer (srtt + max(4 rttvar, srtt / 2)); doubles on each resend of a packet")
define("switch_retransmit_max_ms", 200.0, "upper bound of the SwitchML retransmission timer's backoff (ms)")
define("switch_offload", True, "SwitchML workers batch datagrams per system call with UDP GSO/GRO where the "
       "kernel has them (each is still its own packet on the wire)")
define("switch_nonfinite", "propagate", "Inf/NaN in switchml inputs: 'propagate' them to the sum or 'error'")
define("switch_drop_probability", 0.0, "testing: the embedded switch drops each packet with this probability "
       "on ingress and each result on egress")
define("switch_duplicate_probability", 0.0, "testing: the embedded switch duplicates packets with this probability")

F16, F32, I32 = np.dtype("float16"), np.dtype("float32"), np.dtype("int32")


@register
class SwitchMLBackend(Backend):
    name = "switchml"
    # first for dense tensors; after the ring for compressor payloads, whose error its quantization
    # would add to
    carries = {"dense": 10, "summable": 20}

    @classmethod
    def dense_traffic(cls, nbytes, n):
        return nbytes   # the switch sums: each worker sends its tensor once and gets the sum once
    dtypes = (F32, F16, I32)

    @classmethod
    def available(cls, ctx):
        if sw.lib is None:
            return False, sw.IMPORT_ERROR
        if not ctx.settings.switch_addr and not ctx.all_local:
            return False, ("no switch configured and the ranks span several hosts: start `commlib-switch "
                           "--host 0.0.0.0 --port 9099` on a host every rank reaches and set "
                           "COMMLIB_SWITCH_ADDR=thathost:9099")
        if ctx.size > sw.MAX_WORKERS:
            return False, f"a switchml job has at most {sw.MAX_WORKERS} ranks, this one has {ctx.size}"
        return True, ""

    def __init__(self, ctx):
        super().__init__(ctx)
        s = ctx.settings
        if not 0 <= s.switch_packet_elems <= sw.MAX_ELEMS:
            raise ConfigError(f"switch_packet_elems={s.switch_packet_elems}: use 1..{sw.MAX_ELEMS} values per packet "
                              f"(256 or 64 for Tofino's sizes), or 0 to size packets by the path")
        if not 0 <= s.switch_window <= sw.MAX_SLOTS:
            raise ConfigError(f"switch_window={s.switch_window}: use 1..{sw.MAX_SLOTS}, or 0 for about "
                              f"{WINDOW_BYTES >> 10} KiB of values in flight (at most {MAX_WINDOW} packets)")
        if s.switch_nonfinite not in ("propagate", "error"):
            raise ConfigError(f"switch_nonfinite={s.switch_nonfinite!r}: use 'propagate' or 'error'")
        if not 0 < s.switch_retransmit_ms <= s.switch_retransmit_max_ms:
            raise ConfigError("need 0 < switch_retransmit_ms <= switch_retransmit_max_ms")
        self.window = self.elems = None   # agreed in start(): the path sizes the packets
        self.token = sw.token32(ctx.job_token)
        self.server = None       # the embedded switch (rank 0 only)
        self.address = None
        self.job = None
        self.nonce = None        # the job's public nonce: its packets' key is auth.job_key(daemon key, nonce)
        self._key = None         # that job key (None: packets without MACs)
        self._daemon_key = None  # the switch's key (the job's secret for the embedded one, else the key file's)
        self._control_key = None  # signs this rank's control requests (keepalive, unregister, counters)
        self._client = None      # this rank's control requests
        self._keepalive = None
        self._stopping = threading.Event()
        self._sock = None
        self._worker = None
        self._broken = None      # why the stream is out of step with the switch
        self.range_fallbacks = 0  # tensors sent through the ring: finite values beyond int32 quantization
        self._scope = ctx.scope("switchml")   # this instance's exchange keys

    # -- set-up: collective, once, on every rank (the core calls it at commlib.init()) ------------------
    def start(self):
        """The switch (embedded in rank 0 unless configured), every rank's address, the job's
        registration. Each step runs on every rank and every rank raises the first failing rank's
        error (ctx.agree), so no rank goes on half set up."""
        try:
            self._setup()
        except Exception:
            self._unregister()   # the job's slots on a shared switch, if it got that far
            self._release()
            raise

    def _step(self, step, fn):
        """fn() on every rank; every rank raises the first rank's error, else gets every rank's result."""
        key = f"{self._scope}/{step}"
        return self.ctx.exchange(key, self.ctx.agree(key, fn))

    def _setup(self):
        # 1. the switch: configured, or embedded in rank 0
        self.address = self._step("switch", self._switch_address)[0]
        # 2. every rank's UDP address, as the switch will see it, and the packets its path takes
        paths = self._step("addrs", self._open_socket)
        workers = [path["addr"] for path in paths]
        s = self.ctx.settings
        self.elems = int(s.switch_packet_elems) or min(path["elems"] for path in paths)
        self.window = int(s.switch_window) or max(1, min(MAX_WINDOW, -(-WINDOW_BYTES // (4 * self.elems))))
        if self.window * self.elems > sw.MAX_POOL_VALUES:
            raise ConfigError(f"switch_window={self.window} packets of {self.elems} values pass the "
                              f"{sw.MAX_POOL_VALUES} values a job may hold on the switch: lower COMMLIB_SWITCH_WINDOW")
        # 3. rank 0 registers the job; everyone learns its job number and nonce, derives its keys and
        #    keeps the job alive
        self._daemon_key = self.ctx.agree(f"{self._scope}/key", keys.daemon_key, self.ctx,   # agreed, never sent
                                          not self.ctx.settings.switch_addr, self.ctx.settings.switch_key_file,
                                          "switch_key_file", f"commlib-switch at {self.address}")
        job = self._step("job", lambda: self._register(workers))[0]
        self.job, self.nonce = job["job"], job["nonce"]
        self._key = keys.job_key(self.ctx, self._daemon_key, self.nonce)
        self._control_key = self._daemon_key and auth.job_key(self._daemon_key, self.nonce)
        self._client = sw.SwitchClient(self.address, 5.0, key=self._control_key, rank=self.rank)
        self._keepalive = threading.Thread(target=self._keep_alive, args=(job["expiry_s"] / 4,),
                                           name="switchml-keepalive", daemon=True)
        self._keepalive.start()
        # 4. every rank's C worker (so that either all ranks stream or none does)
        self._step("worker", self._make_worker)
        log.debug("switchml: rank %d in job #%d on switch %s", self.rank, self.job, self.address)

    def _make_worker(self):
        s = self.ctx.settings
        worker = sw.lib.sml_worker_new(self._sock.fileno(), self.job, self.rank, self.token, self.size,
                                       self.window, self.elems, float(s.switch_retransmit_ms),
                                       float(s.switch_retransmit_max_ms), int(bool(s.switch_offload)),
                                       sw.ffi.NULL if self._key is None else self._key)
        if worker == sw.ffi.NULL:
            raise MemoryError("switchml: could not allocate the worker state")
        self._worker = worker

    def _switch_address(self):
        s = self.ctx.settings
        if s.switch_addr or self.rank != 0:
            return s.switch_addr
        try:
            p = float(s.switch_drop_probability)
            self.server = sw.SwitchServer("127.0.0.1", 0, slots=max(int(s.switch_window), 1024), ingress=p, egress=p,
                                          duplicate=float(s.switch_duplicate_probability),
                                          offload=bool(s.switch_offload), key=self.ctx.secret or None).start()
        except Exception as exc:
            raise BackendUnavailable(f"could not start the embedded switch: {exc}") from exc
        return self.server.address

    def _open_socket(self):
        try:
            host, port = parse_address(self.address, "switch address")
            self._sock = net.udp_socket(buffer_bytes=4 << 20)
            self._sock.connect((socket.gethostbyname(host), port))
            elems = min(PATH_MAX_ELEMS, sw.path_elems(net.path_mtu(self._sock)))
            return {"addr": list(self._sock.getsockname()[:2]), "elems": elems}
        except (OSError, CommError) as exc:
            raise BackendUnavailable(f"cannot open a UDP socket towards the switch {self.address}: {exc}") from exc

    def _register(self, workers):
        if self.rank != 0:
            return None
        nonce = auth.new_nonce()
        key = self._daemon_key and auth.job_key(self._daemon_key, nonce)
        authenticate = keys.job_key(self.ctx, self._daemon_key, nonce) is not None
        reply = sw.SwitchClient(self.address, min(self.ctx.settings.timeout_s, 30.0), key=key, rank=0).register(
            self.token, workers, self.window, self.elems, nonce=nonce, authenticate=authenticate)
        if authenticate and reply.get("authenticated") is False:   # the key file names a key the switch lacks
            raise ConfigError(auth.unauthenticated(f"commlib-switch at {self.address}", "the switch has no key"))
        return {"job": reply["job"], "nonce": nonce, "expiry_s": reply.get("expiry_s", 60.0)}

    def _keep_alive(self, every_s):
        """Every rank tells the switch it lives: a job one of whose ranks falls silent is removed."""
        while not self._stopping.wait(every_s):
            try:
                self._client.keepalive(self.job)
            except CommError as exc:
                log.warning("switchml: keepalive of job #%s failed: %s", self.job, exc)

    # -- the collective ---------------------------------------------------------------------------------
    def allreduce(self, array, name):
        self.last_busy_s = self.last_server_share = None
        array = np.ascontiguousarray(array).reshape(-1)
        dtype = array.dtype
        if dtype not in self.dtypes:
            raise InvalidTensor(f"switchml cannot reduce tensor {name!r} of dtype {dtype}: it sums float32 and "
                                f"float16 (quantized to int32 on the switch) and int32 (exactly); convert it, or "
                                f"use algorithm='ring'")
        if dtype == F16:   # float32 holds every float16 exactly; the sum stays float32 so that a sum
            return self.allreduce(array.astype(F32), name)   # beyond 65504 is averaged before the core rounds it
        out = np.empty_like(array)
        if array.size == 0:
            return out
        if self._broken is not None:
            raise PeerFailure(f"switchml: tensor {name!r} not reduced: an earlier error left this job's stream "
                              f"out of step with the switch ({self._broken}); restart the job")
        if self._worker is None:
            raise BackendUnavailable(f"switchml: tensor {name!r} not reduced: the backend is not started (start() "
                                     f"is the collective set-up, called once on every rank) or is closed")
        ffi, lib = sw.ffi, sw.lib
        timeout_ms = int(self.ctx.settings.timeout_s * 1000)
        start, before = time.perf_counter(), self._counters()
        if dtype == I32:
            rc = lib.sml_worker_allreduce(self._worker, 1, ffi.from_buffer(array), ffi.from_buffer(out), array.size,
                                          ffi.NULL, ffi.NULL, ffi.NULL, timeout_ms)
        else:
            exps, nf = _exponents(array, self.elems)
            mexp = np.empty_like(exps)
            rc = lib.sml_worker_allreduce(self._worker, 0, ffi.from_buffer(array), ffi.from_buffer(out), array.size,
                                          ffi.cast("int8_t *", ffi.from_buffer(exps)),
                                          ffi.cast("uint8_t *", ffi.from_buffer(nf)),
                                          ffi.cast("int8_t *", ffi.from_buffer(mexp)), timeout_ms)
        # all but the C worker's time blocked in poll(): exponents, quantizing, MACs, syscalls
        after = self._counters()
        self.last_busy_s = max(0.0, time.perf_counter() - start - (after.wait_ns - before.wait_ns) / 1e9)
        self.last_server_share = server_share(*(getattr(after, f) - getattr(before, f) for f in (
            "server_queue_ns", "server_proc_ns", "server_packets", "received", "round_ns")))
        if rc < 0:
            error = self._error(rc, name)
            self._broken = str(error)
            raise error
        if rc & lib.SML_R_RANGE:
            return self._beyond_range(array, name)
        if rc & lib.SML_R_NONFINITE and self.ctx.settings.switch_nonfinite == "error":
            raise InvalidTensor(f"switchml: tensor {name!r} holds Inf or NaN on some rank (switch_nonfinite="
                                f"'error'); every rank raises this. Check the loss / learning rate, or set "
                                f"COMMLIB_SWITCH_NONFINITE=propagate")
        return out

    def _beyond_range(self, array, name):
        """Finite values with |x| >= 2^127 on some rank cannot be quantized to int32. Every rank sees
        the switch's flag for this tensor, so every rank sends it through the ring instead: a run
        whose gradients diverge for a step and recover keeps going, as under Horovod."""
        if self.ctx.engine is None:
            raise InvalidTensor(f"switchml: tensor {name!r} holds finite values with |x| >= 2^127 on some rank; "
                                f"they cannot be quantized to int32 and this job has no ring engine to send it "
                                f"through instead: scale the tensor or use algorithm='ring'")
        self.range_fallbacks += 1
        if self.range_fallbacks == 1:
            log.warning("switchml: tensor %r holds finite values with |x| >= 2^127, beyond int32 quantization: "
                        "it went through the ring instead (counted in stats()['range_fallbacks'])", name)
        return self.ctx.engine.allreduce(array, name, "sum")

    def _error(self, rc, name):
        where = f"switchml: tensor {name!r}, rank {self.rank}, job #{self.job} on switch {self.address}"
        lib = sw.lib
        if rc == lib.SML_E_NACK:
            return PeerFailure(f"{where}: the switch does not know this job (it was restarted, or the job was "
                               f"unregistered): restart the training job so that it registers again")
        if rc == lib.SML_E_REFUSED:
            return PeerFailure(f"{where}: the switch is not running (its port is closed): restart commlib-switch "
                               f"and the job")
        if rc == lib.SML_E_TIMEOUT:
            hint = ""
            try:   # ask the control plane why: a restarted switch no longer lists the job
                sw.SwitchClient(self.address, 2.0, key=self._control_key, rank=self.rank).counters(self.job, self.token)
                hint = "the switch still holds the job, so another rank probably stopped or is far behind"
            except ConfigError:
                return PeerFailure(f"{where}: no answer for {self.ctx.settings.timeout_s}s and the switch no longer "
                                   f"knows the job (it was restarted): restart the training job")
            except CommError as exc:
                hint = f"its control port does not answer either ({exc})"
            return CommTimeout(f"{where}: no result for {self.ctx.settings.timeout_s}s ({hint}); check every rank "
                               f"is alive and `commlib-switch counters {self.address} --job {self.job}`")
        if rc == lib.SML_E_NOMEM:
            return PeerFailure(f"{where}: out of memory")
        code = lib.sml_worker_errno(self._worker)
        return PeerFailure(f"{where}: socket error {os.strerror(code) if code else f'(code {rc})'}")

    # -- counters and shutdown -----------------------------------------------------------------------
    def stats(self):
        out = {"switch": self.address, "job": self.job, "embedded": self.server is not None,
               "packet_elems": self.elems, "window": self.window,
               "authenticated": self._key is not None, "range_fallbacks": self.range_fallbacks}
        if self._worker is not None:
            c = sw.ffi.new("sml_worker_counters *")
            sw.lib.sml_worker_counters_get(self._worker, c)
            out.update({name: int(getattr(c, name)) for name in sw.WORKER_COUNTERS})
        return out

    def switch_counters(self):
        """The switch's counters for this job (packets received, aggregated, results, replays, drops)."""
        if self.job is None:
            return {}
        return self._client.counters(self.job, self.token)

    def switch_wide_counters(self):
        """The switch's own counters (CPU time, packets of every job), asked as its operator: signed
        with its daemon key, which the job holds for an embedded switch or a key file's."""
        return sw.SwitchClient(self.address, 5.0, key=self._daemon_key).counters()["switch"]

    def _counters(self):
        c = sw.ffi.new("sml_worker_counters *")
        sw.lib.sml_worker_counters_get(self._worker, c)
        return c

    def daemon_counters(self):
        if self.rank != 0 or self.job is None:
            return {}
        return {f"switch {self.address}": lambda: self.switch_counters()["counters"]}

    def close(self):
        if self._worker is not None:
            try:   # nobody may still wait for a result when rank 0 ends the job
                self.ctx.exchange(f"{self._scope}/close", None, min(self.ctx.settings.timeout_s, 10.0))
            except CommError as exc:
                log.warning("switchml: closing without every rank (%s)", exc)
            self._unregister()
        self._release()

    def _unregister(self):
        """Every rank that ends ends the job on a switch that outlives it (an embedded one goes with
        rank 0); the first one does it, the others find it gone."""
        if self.ctx.settings.switch_addr and self._client is not None:
            try:
                self._client.unregister(self.job, self.token)
            except ConfigError:
                pass   # another rank ended it first
            except CommError as exc:
                log.warning("switchml: could not unregister job #%s: %s", self.job, exc)

    def _release(self):
        self._stopping.set()
        if self._keepalive is not None:
            self._keepalive.join(10.0)
            self._keepalive = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._worker is not None:
            sw.lib.sml_worker_free(self._worker)
            self._worker = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _exponents(x, elems):
    """Per-block exponents over the finite values, and a per-block flag for blocks holding Inf/NaN
    or |x| >= 2^127 (their elements travel as flags, see switch/csrc/switchml.h)."""
    exps, bad = kernels.block_exponents(x, elems)
    nf = np.zeros(exps.size, np.uint8)
    if bad < 0:
        return exps, nf
    # rare path: such blocks got EXP_MAX; look at each candidate's values again
    cand = np.flatnonzero(exps == kernels.EXP_MAX)
    index = cand[:, None] * elems + np.arange(elems)
    valid = index < x.size
    values = np.where(valid, x[np.minimum(index, x.size - 1)], np.float32(0))
    with np.errstate(invalid="ignore"):
        magnitude = np.abs(values)
        ok = np.isfinite(values) & (magnitude < np.float32(2.0 ** 127))
    flagged = ~ok.all(axis=1)
    top = np.where(ok, magnitude, np.float32(0)).max(axis=1).astype(np.float64)
    e = np.clip(np.frexp(top)[1], kernels.EXP_MIN, kernels.EXP_MAX)
    e = np.where(top == 0, kernels.EXP_ZERO, e)
    exps[cand[flagged]] = e[flagged]
    nf[cand[flagged]] = 1
    return exps, nf
