"""SwitchML: in-network aggregation through a (software) switch.

Every rank streams its tensor through a pool of `switch_window` slots of a commlib-switch, one
block of `switch_packet_elems` values per packet (sized by the path unless set); the switch adds the blocks of all ranks and
sends each sum back to every rank. Each rank sends S and receives S bytes whatever the number of
ranks. The per-packet loop is C (switch/csrc/switchml_worker.c), one call per tensor, the GIL
released. Packets and results carry a MAC under the job key (backends/keys.py; `authenticate`;
`packet_mac` its algorithm, switch/packet_mac.py), and the packet id is each slot set's version, so
reordered, late and replayed packets are never aggregated (switch/csrc/switchml.h).

Streams: a rank splits each tensor, on block boundaries, over several streams, each its own socket,
C worker and thread towards one data-plane thread (shard) of a switch, with its share of the job's
slots and its own packet ids, window, timers and loss recovery (`_Stream`). The streams of one
switch go to its threads (`commlib-switch --threads`); `switch_addr` may name several switches, each
given its share of the window and of every tensor, each its own registration, keepalive and expiry.
Every block is quantized alone, so the sum is bit-identical however the blocks are split.

Tuning guide
  switch_window          packets in flight per rank (= slots the job takes on the switch). Larger
                         hides more latency; 0 (the default) keeps WINDOW_BYTES of values in flight,
                         at most MAX_WINDOW packets (loopback: 32 of 8192 values; Tofino's 256: 128),
                         which fills loopback and a 10-100G LAN. COMMLIB_AUTOTUNE tries fewer of
                         them in flight (switch_inflight_share of the window; stats()["inflight"]).
  switch_packet_elems    values per packet, agreed by every rank at registration. 0 (the default)
                         sizes packets by the path: the most that fit one datagram of the path's MTU
                         (1500-byte Ethernet: 355; 9000-byte jumbo frames: 2,230; loopback:
                         PATH_MAX_ELEMS), so
                         the kernel's per-datagram cost is paid per thousands of values. 256 or 64:
                         Tofino's sizes (a hardware switch's registers bound them).
  switch_streams         streams per switch (at most its `--threads`): more streams feed more of the
                         switch's cores and of this host's; each takes a share of the window. 0 (the
                         default): on loopback (the embedded switch and every rank on this host) the
                         host's cores over its ranks, else 1: streams sharing a slow link resend a
                         lot, not yet understood (netns, 20 Mbit/s, window 128 of 256 values, a
                         loaded 2-core host: 2 streams resent from none to half of their packets from
                         run to run, with srtt about twice the queue's 53 ms and the link's queue
                         dropping only 9-31 packets, so mostly timers firing early; one stream under
                         5%), so more streams are for fast links, where a core or the window bounds
                         a rank.
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
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from commlib import kernels
from commlib.backends import Backend, keys, register
from commlib.backends.base import server_share
from commlib.buffers import POOL
from commlib.errors import (BackendUnavailable, CommError, CommTimeout, ConfigError, InvalidTensor,
                            PeerFailure)
from commlib.settings import define
from commlib.switch import auth, net, packet_mac
from commlib.switch import switchml as sw
from commlib.net import parse_address

log = logging.getLogger("commlib.switchml")

define("switch_addr", "", "host:port of a commlib-switch (UDP data + TCP control on one port), or several "
       "separated by commas (a:9099,b:9099: the job's slots and tensors are split over them); empty: "
       "rank 0 starts a switch on loopback when every rank is on this machine")
define("switch_spine", "", "host:port of the spine commlib-switch of a two-level job (more than 64 ranks): "
       "switch_addr then lists the leaf switches, each rank streams to one leaf (switch_placement) and each "
       "leaf's partial sums go to the spine; every switch of it started with the same --key-file")
define("switch_placement", "", "with switch_spine: the leaf (its index in switch_addr) of each rank, comma-separated "
       "(0,0,1,1: ranks 0-1 on the first leaf); empty: ranks grouped by host, in balanced chunks of at most 64")
define("switch_streams", 0, "SwitchML worker streams per switch (each a socket and a thread towards one of "
       "the switch's data-plane threads, with its share of the window): more where a rank's CPU or window bounds "
       "it (fast links); 0: this host's cores over its ranks where every rank and the switch share this host "
       "(loopback), else 1")
define("switch_key_file", "", "the daemon key of a commlib-switch started with --key-file (COMMLIB_SWITCH_ADDR), "
       "read by every rank; the embedded switch uses the job's secret", per_rank=True)
define("switch_window", 0, "SwitchML window: packets in flight per rank = slots the job takes on the switch; "
       "0: about 1 MiB of values in flight, at most 128 packets")
define("switch_packet_elems", 0, "values per SwitchML packet: 0 sizes them by the path's MTU; 256 or 64 are "
       "Tofino's sizes; any 1..8192")

PATH_MAX_ELEMS = 8192    # values per packet on loopback and other paths of a large MTU
WINDOW_BYTES = 1 << 20    # values in flight per rank with the default window (32 packets of 8192 on loopback:
MAX_WINDOW = 128          # measured 5.5 against 4.5 Gbps with 4 packets, 128 KiB), in at most this many packets
MIN_DEFAULT_WINDOW = WINDOW_BYTES // (4 * PATH_MAX_ELEMS)   # the default window is never smaller (packets)
MAX_STREAMS = 16
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
        if ctx.size > sw.MAX_WORKERS and not ctx.settings.switch_spine:
            return False, (f"a switchml job through one switch has at most {sw.MAX_WORKERS} ranks, this one has "
                           f"{ctx.size}: run {-(-ctx.size // sw.MAX_WORKERS)} or more leaf switches and a spine "
                           f"(commlib-switch, one --key-file), set COMMLIB_SWITCH_ADDR to the leaves and "
                           f"COMMLIB_SWITCH_SPINE to the spine (README: two-level deployment)")
        if ctx.settings.switch_spine and not ctx.settings.switch_addr:
            return False, ("switch_spine is set but switch_addr is not: list the leaf switches in "
                           "COMMLIB_SWITCH_ADDR")
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
        if s.packet_mac != packet_mac.AUTO:
            packet_mac.code(s.packet_mac)   # a bad name fails on every rank, here
        if s.switch_nonfinite not in ("propagate", "error"):
            raise ConfigError(f"switch_nonfinite={s.switch_nonfinite!r}: use 'propagate' or 'error'")
        if not 0 < s.switch_retransmit_ms <= s.switch_retransmit_max_ms:
            raise ConfigError("need 0 < switch_retransmit_ms <= switch_retransmit_max_ms")
        if not 0 <= s.switch_streams <= MAX_STREAMS:
            raise ConfigError(f"switch_streams={s.switch_streams}: use 1..{MAX_STREAMS} streams per switch, or 0 "
                              f"for what this host's cores allow")
        self.window = self.elems = None   # agreed in start(): the path sizes the packets
        self.token = sw.token32(ctx.job_token)
        self.server = None       # the embedded switch (rank 0 only)
        self.address = None      # the switches' addresses, comma-separated
        self.job = None          # the job's number on the first switch
        self._daemon_key = None  # the switch's key (the job's secret for the embedded one, else the key file's)
        self._mac = None         # rank 0: the packets' MAC algorithm it chose (switch/packet_mac.py)
        self._switches = []      # _Switch per switch this rank registers on and keeps alive (its leaf and the spine)
        self._tree = []          # every switch of the job (the leaves, then the spine of a two-level job)
        self._spine = None       # the spine's _Switch (a two-level job)
        self._leaf_of = None     # the leaf of each rank (a two-level job)
        self._streams = []       # _Stream per (switch, data-plane thread), the order tensors are split in
        self._pool = None        # threads running the streams after the first (the caller runs that one)
        self._keepalive = None
        self._stopping = threading.Event()
        self._broken = None      # why the stream is out of step with the switch
        self._inflight_share = 1.0   # of each stream's window in flight (autotune: tune)
        self.range_fallbacks = 0  # tensors sent through the ring: finite values beyond int32 quantization
        self._scope = ctx.scope("switchml")   # this instance's exchange keys

    # -- set-up: collective, once, on every rank (the core calls it at commlib.init()) ------------------
    def start(self):
        """The switches (embedded in rank 0 unless configured), every rank's addresses, the job's
        registrations. Each step runs on every rank and every rank raises the first failing rank's
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
        # 1. the switches, configured or embedded in rank 0, and the streams to each (rank 0 plans)
        self._tree = self._switches = [_Switch(address, ports) for address, ports in self._step("switch", self._plan)[0]]
        self.address = ",".join(switch.address for switch in self._switches)
        if self.ctx.settings.switch_spine:   # two levels: this rank streams to its leaf, its leaf to the spine
            leaf_of = placement(self.ctx.settings.switch_placement, self._step("hosts", socket.gethostname),
                                len(self._tree) - 1)
            leaf, self._spine = self._tree[leaf_of[self.rank]], self._tree[-1]
            leaf.rank, self._spine.rank = leaf_of[:self.rank].count(leaf_of[self.rank]), leaf_of[self.rank]
            self._switches, self._leaf_of = [leaf, self._spine], leaf_of
        # 2. every rank's UDP address of each stream, as the switch will see it, and the packets its path takes
        self._streams = [_Stream(switch, i, port) for switch in self._switches if switch is not self._spine
                         for i, port in enumerate(switch.ports)]
        paths = self._step("addrs", lambda: [self._open_socket(stream) for stream in self._streams])
        s = self.ctx.settings
        self.elems = int(s.switch_packet_elems) or min(path["elems"] for rank in paths for path in rank)
        self.window = int(s.switch_window) or max(1, min(MAX_WINDOW, -(-WINDOW_BYTES // (4 * self.elems))))
        if self.window * self.elems > sw.MAX_POOL_VALUES:
            raise ConfigError(f"switch_window={self.window} packets of {self.elems} values pass the "
                              f"{sw.MAX_POOL_VALUES} values a job may hold on the switch: lower COMMLIB_SWITCH_WINDOW")
        # 3. rank 0 registers the job on each switch, each stream with its share of the window; everyone
        #    learns the job numbers and nonces, derives its keys and keeps the job alive
        self._daemon_key = self.ctx.agree(f"{self._scope}/key", keys.daemon_key, self.ctx,   # agreed, never sent
                                          not self.ctx.settings.switch_addr, self.ctx.settings.switch_key_file,
                                          "switch_key_file", f"commlib-switch at {self.address}")
        def register():   # the job keys stay on rank 0 (every rank derives its own)
            jobs = self._register([[path["addr"] for path in rank] for rank in paths])
            return jobs and [{k: v for k, v in job.items() if k != "key"} for job in jobs]
        jobs = self._step("job", register)[0]
        for switch, job in zip(self._tree, jobs):
            switch.job, switch.nonce = job["job"], job["nonce"]
            for stream, slots in zip([t for t in self._streams if t.switch is switch], job["slots"]):
                stream.slots = slots
            switch.key = keys.job_key(self.ctx, self._daemon_key, switch.nonce)
            switch.mac_name = job["mac"]   # rank 0's choice, in its signed registration
            switch.mac = packet_mac.code(switch.mac_name)
            switch.control_key = self._daemon_key and auth.job_key(self._daemon_key, switch.nonce)
        for switch in self._switches:
            switch.client = sw.SwitchClient(switch.address, 5.0, key=switch.control_key,
                                            rank=self.rank if switch.rank is None else switch.rank)
        self.job = self._switches[0].job
        self._keepalive = threading.Thread(target=self._keep_alive, args=(min(j["expiry_s"] for j in jobs) / 4,),
                                           name="switchml-keepalive", daemon=True)
        self._keepalive.start()
        # 4. every rank's C workers (so that either all ranks stream or none does)
        self._step("worker", self._make_workers)
        if len(self._streams) > 1:
            self._pool = ThreadPoolExecutor(len(self._streams) - 1, thread_name_prefix="switchml-stream")
        log.debug("switchml: rank %d in job #%d on switch %s, %d streams", self.rank, self.job, self.address,
                  len(self._streams))

    def _make_workers(self):
        s = self.ctx.settings
        for stream in self._streams:
            switch = stream.switch
            key = switch.key and auth.stream_key(switch.key, stream.index)
            rank = self.rank if switch.rank is None else switch.rank   # its rank on its leaf; the scale is the job's
            stream.worker = sw.lib.sml_worker_new(stream.sock.fileno(), switch.job, rank, self.token, self.size,
                                                  stream.slots, self.elems, float(s.switch_retransmit_ms),
                                                  float(s.switch_retransmit_max_ms), int(bool(s.switch_offload)),
                                                  sw.ffi.NULL if key is None else key, switch.mac)
            if stream.worker == sw.ffi.NULL:
                raise MemoryError("switchml: could not allocate the worker state")

    def _plan(self):
        """Rank 0: [(address, ports of its streams)] per switch. Each switch's status lists its data-plane
        threads' ports; the first stream uses the address's own port (shard 0's, or a relay's in tests)."""
        if self.rank != 0:
            return None
        s = self.ctx.settings
        addresses = [a.strip() for a in self._switch_address().split(",") if a.strip()]
        tree = bool(s.switch_spine)   # the leaves, then the spine: each holds the whole window
        if tree:
            addresses.append(self._spine_address())
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"switch_addr={s.switch_addr!r} names a switch twice")
        # each stream takes at least one slot of the window; the default window has MIN_DEFAULT_WINDOW
        budget = int(s.switch_window) or MIN_DEFAULT_WINDOW
        if budget < len(addresses) and not tree:
            raise ConfigError(f"switch_window={budget} is smaller than the {len(addresses)} switches the job "
                              f"streams to (each takes one slot or more): raise COMMLIB_SWITCH_WINDOW")
        plan = []
        for address in addresses:
            host, _ = parse_address(address, "switch address")
            try:
                net.unicast(socket.gethostbyname(host), f"switch address {address}, at")
            except socket.gaierror:   # status() says it cannot reach it
                pass
            status = sw.SwitchClient(address, min(s.timeout_s, 30.0)).status()
            ports = status.get("ports") or [None]   # a switch of one thread
            plan.append((address, [None] + ports[1:self._streams_per_switch()]))
        if tree:   # a leaf's stream i goes up to the spine's stream i: as many streams everywhere, one slot each
            n = min(budget, *(len(ports) for _, ports in plan))
            return [(address, ports[:n]) for address, ports in plan]
        while sum(len(ports) for _, ports in plan) > budget:   # fewer streams than slots: trim the longest
            max(plan, key=lambda p: len(p[1]))[1].pop()
        return plan

    def _streams_per_switch(self):
        """The streams rank 0 asks of each switch: switch_streams, or by default on loopback (the embedded
        switch, every rank on this host) this host's cores over its ranks, since a stream waits on its
        window, not on a core (16 cores, 4 ranks, MACs on: 1 stream 0.39x the ring, 2 0.72x, 4 1.04x, 5
        1.25x); over links one (streams sharing a slow link resend a lot: see the module's docstring). A
        rank streams to each of the switch's threads at most: the embedded one has a third of the cores
        (_switch_address), so 16 cores and 2 ranks ask for 8 streams and get 5. A process set streams once
        unless switch_streams is set (bootstrap.join_set)."""
        streams = int(self.ctx.settings.switch_streams)
        if streams:
            return streams
        if self.ctx.settings.switch_addr or not self.ctx.all_local:
            return 1
        return max(1, min(MAX_STREAMS, _cores() // max(1, self.ctx.local_size)))

    def _spine_address(self):
        return self.ctx.settings.switch_spine

    def _switch_address(self):
        s = self.ctx.settings
        if s.switch_addr or self.rank != 0:
            return s.switch_addr
        # the embedded switch shares this host with the ranks: a third of its cores, at most one thread per
        # stream (a shard without a stream idles); on a small host 1 thread, which the ranks leave room for
        threads = max(1, min(self._streams_per_switch(), _cores() // 3))
        try:
            p = float(s.switch_drop_probability)
            self.server = sw.SwitchServer("127.0.0.1", 0, slots=max(int(s.switch_window), 1024), ingress=p, egress=p,
                                          duplicate=float(s.switch_duplicate_probability),
                                          offload=bool(s.switch_offload), key=self.ctx.secret or None,
                                          threads=threads).start()
        except Exception as exc:
            raise BackendUnavailable(f"could not start the embedded switch: {exc}") from exc
        return self.server.address

    def _open_socket(self, stream):
        """The stream's socket, connected to its switch thread; returns its address and path's packet size."""
        try:
            host, port = parse_address(stream.switch.address, "switch address")
            stream.sock = net.udp_socket(buffer_bytes=4 << 20)
            stream.sock.connect((socket.gethostbyname(host), stream.port or port))
            elems = min(PATH_MAX_ELEMS, sw.path_elems(net.path_mtu(stream.sock)))
            return {"addr": list(stream.sock.getsockname()[:2]), "elems": elems}
        except (OSError, CommError) as exc:
            raise BackendUnavailable(f"cannot open a UDP socket towards the switch {stream.switch.address}: "
                                     f"{exc}") from exc

    def _register(self, addrs):
        """Rank 0 registers the job on every switch (addrs[rank][stream]), each switch its streams' share of
        the window (a two-level job: _register_tree); a failure unregisters what it registered."""
        if self.rank != 0:
            return None
        done = []   # (client, job number) of every registration made
        # one MAC algorithm for the job on every switch (a leaf's partial sums go up with it)
        self._mac = packet_mac.resolve(self.ctx.settings.packet_mac, sw.lib.SML_HDR_LEN + 4 * self.elems)
        try:
            if self._spine is not None:
                return self._register_tree(addrs, done)
            shares, first, jobs = iter(sw.split(self.window, len(self._streams))), 0, []
            for switch in self._switches:
                streams = [[addrs[r][first + i] for r in range(self.size)] for i in range(len(switch.ports))]
                first += len(streams)
                jobs.append(self._register_on(switch, streams, sum(next(shares) for _ in streams), done))
            return jobs
        except Exception:
            for client, job in done:
                try:
                    client.unregister(job, self.token)
                except CommError as exc:
                    log.warning("switchml: could not unregister job #%s: %s", job, exc)
            raise

    def _register_tree(self, addrs, done):
        """A two-level job: on the spine, whose ranks are the leaves (stream i of each from the leaf's stream
        i), then on each leaf with its ranks and the spine as its parent. Returns the jobs of self._tree (the
        leaves, then the spine)."""
        s, leaves, spine = self.ctx.settings, self._tree[:-1], self._spine
        up = self._register_on(spine, [[self._leaf_address(leaf, i) for leaf in leaves]
                                       for i in range(len(spine.ports))], self.window, done)
        host, port = parse_address(spine.address, "switch_spine")
        # the leaf's timer within the switch's bounds (switchml.h: SML_UP_RTO_*), and its resends within the timeout
        rto = max(float(s.switch_retransmit_ms), sw.lib.SML_UP_RTO_MIN_US / 1e3)
        parent = {"address": f"{socket.gethostbyname(host)}:{port}", "ports": [p or port for p in spine.ports],
                  "job": up["job"], "token": self.token, "nonce": up["nonce"], "rto_ms": rto,
                  "rto_max_ms": max(float(s.switch_retransmit_max_ms), rto, sw.lib.SML_UP_RTO_FLOOR_US / 1e3),
                  "timeout_s": float(s.timeout_s), "authenticated": up["key"] is not None}
        if up["key"] is not None:   # a leaf derives the spine's job key from its own daemon key: the same one?
            parent["check"] = auth.key_check(up["key"])
        jobs = [self._register_on(leaf, [[addrs[r][i] for r in range(self.size) if self._leaf_of[r] == j]
                                         for i in range(len(leaf.ports))], self.window, done, dict(parent, rank=j))
                for j, leaf in enumerate(leaves)]
        return jobs + [up]

    def _register_on(self, switch, streams, slots, done, parent=None):
        """Register the job on one switch: streams[i][rank] the ranks' addresses of stream i, `slots` of the
        window over them; parent: the switch is a leaf of it. Appends (client, job number) to `done`; returns
        {job, nonce, mac, expiry_s, slots per stream} (and key: the job key where its packets carry MACs, which
        _setup keeps on rank 0)."""
        nonce, mac = auth.new_nonce(), self._mac
        key = self._daemon_key and auth.job_key(self._daemon_key, nonce)
        authenticate = keys.job_key(self.ctx, self._daemon_key, nonce) is not None
        client = sw.SwitchClient(switch.address, min(self.ctx.settings.timeout_s, 30.0), key=key, rank=0)
        reply = client.register(self.token, streams[0], slots, self.elems, nonce=nonce, authenticate=authenticate,
                                streams=streams, parent=parent, mac=mac)
        done.append((client, reply["job"]))
        if authenticate and reply.get("authenticated") is False:   # the key file names a key the switch lacks
            raise ConfigError(auth.unauthenticated(f"commlib-switch at {switch.address}", "the switch has no key"))
        if reply.get("packet_mac", mac) != mac:
            raise ConfigError(f"commlib-switch at {switch.address} keys the packets' MAC with {reply['packet_mac']!r}, "
                              f"not the job's {mac!r}: run the same commlib version everywhere")
        endpoints = reply.get("endpoints") or [{"slots": slots}]   # a switch of one thread
        if len(endpoints) != len(streams):
            raise ConfigError(f"commlib-switch at {switch.address} took {len(endpoints)} of the job's "
                              f"{len(streams)} streams: set COMMLIB_SWITCH_STREAMS={len(endpoints)}")
        return {"job": reply["job"], "nonce": nonce, "expiry_s": reply.get("expiry_s", 60.0), "mac": mac,
                "slots": [int(e["slots"]) for e in endpoints], "key": key if authenticate else None}

    def _leaf_address(self, leaf, stream):
        """[ip, port] the spine sees the leaf's stream `stream` send from: its data-plane thread's port."""
        host, port = parse_address(leaf.address, "switch address")
        return [socket.gethostbyname(host), leaf.ports[stream] or port]

    def _keep_alive(self, every_s):
        """Every rank tells each switch it lives: a job one of whose ranks falls silent is removed."""
        while not self._stopping.wait(every_s):
            for switch in self._switches:
                try:
                    switch.client.keepalive(switch.job, self.token)
                except CommError as exc:
                    log.warning("switchml: keepalive of job #%s on %s failed: %s", switch.job, switch.address, exc)

    # -- the collective ---------------------------------------------------------------------------------
    def allreduce(self, array, name):
        out = self.allreduce_apart(array, name)
        return self.allreduce_on_engine(array, name) if out is None else out

    def allreduce_apart(self, array, name):
        """The switch's sum, or None where some rank's values are beyond int32 quantization (allreduce_on_engine)."""
        self.last_busy_s = self.last_server_share = None
        array = np.ascontiguousarray(array).reshape(-1)
        dtype = array.dtype
        if dtype not in self.dtypes:
            raise InvalidTensor(f"switchml cannot reduce tensor {name!r} of dtype {dtype}: it sums float32 and "
                                f"float16 (quantized to int32 on the switch) and int32 (exactly); convert it, or "
                                f"use algorithm='ring'")
        if dtype == F16:   # float32 holds every float16 exactly; the sum stays float32 so that a sum
            return self.allreduce_apart(array.astype(F32), name)   # beyond 65504 is averaged before the core rounds it
        out = POOL.empty(array.size, dtype)
        if array.size == 0:
            return out
        if self._broken is not None:
            raise PeerFailure(f"switchml: tensor {name!r} not reduced: an earlier error left this job's stream "
                              f"out of step with the switch ({self._broken}); restart the job")
        if not self._streams or self._streams[0].worker is None:
            raise BackendUnavailable(f"switchml: tensor {name!r} not reduced: the backend is not started (start() "
                                     f"is the collective set-up, called once on every rank) or is closed")
        timeout_ms = int(self.ctx.settings.timeout_s * 1000)
        start, before = time.perf_counter(), self._counters()
        if dtype == I32:
            exps = nf = mexp = None
        else:
            exps, nf = _exponents(array, self.elems)
            mexp = np.empty_like(exps)
        # each stream its share of the blocks by its window (every rank splits alike), the first on this
        # thread; a tensor of less than a window per stream takes fewer streams (handing a small one to
        # another thread costs more than it saves: 65536 values, 2 streams: 0.65 against 0.46 ms)
        nblocks = -(-array.size // self.elems)
        streams = self._streams[:max(1, min(len(self._streams), nblocks // max(t.slots for t in self._streams)))]
        bounds, cum, total = [0], 0, sum(stream.slots for stream in streams)
        for stream in streams:
            cum += stream.slots
            bounds.append(nblocks * cum // total)
        calls = [(stream, array, out, exps, nf, mexp, b0, b1, timeout_ms)
                 for stream, b0, b1 in zip(streams, bounds, bounds[1:]) if b1 > b0]
        later = [self._pool.submit(self._run, *call) for call in calls[1:]]
        codes = [(calls[0][0], self._run(*calls[0]))] + [(call[0], f.result()) for call, f in zip(calls[1:], later)]
        # all but the C workers' time blocked in poll() (their mean, as they run side by side): exponents,
        # quantizing, MACs, syscalls
        after = self._counters()
        self.last_busy_s = max(0.0, time.perf_counter() - start - (after["wait_ns"] - before["wait_ns"]) / 1e9 /
                               len(calls))
        self.last_server_share = server_share(*(after[f] - before[f] for f in (
            "server_queue_ns", "server_proc_ns", "server_packets", "received", "round_ns")))
        failed = [(stream, rc) for stream, rc in codes if rc < 0]
        if failed:
            error = self._error(*failed[0], name)
            self._broken = str(error)
            raise error
        rc = 0
        for _, code in codes:
            rc |= code
        lib = sw.lib
        if rc & lib.SML_R_RANGE:
            return None
        if rc & lib.SML_R_NONFINITE and self.ctx.settings.switch_nonfinite == "error":
            raise InvalidTensor(f"switchml: tensor {name!r} holds Inf or NaN on some rank (switch_nonfinite="
                                f"'error'); every rank raises this. Check the loss / learning rate, or set "
                                f"COMMLIB_SWITCH_NONFINITE=propagate")
        return out

    def tune(self, values):
        """autotune's switch_inflight_share: the share of each stream's slots in flight (sml_worker_set_inflight)."""
        self._inflight_share = values.get("switch_inflight_share", self._inflight_share)
        for stream in self._streams:
            if stream.worker is not None:
                sw.lib.sml_worker_set_inflight(stream.worker, self._inflight(stream))

    def _inflight(self, stream):
        return max(1, min(stream.slots, round(stream.slots * self._inflight_share)))

    def allreduce_on_engine(self, array, name):
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

    def _run(self, stream, array, out, exps, nf, mexp, b0, b1, timeout_ms):
        """Blocks b0..b1 of the tensor through one stream (the C call releases the GIL)."""
        ffi, lib = sw.ffi, sw.lib
        lo, hi = b0 * self.elems, min(b1 * self.elems, array.size)
        x, y = ffi.from_buffer(array[lo:hi]), ffi.from_buffer(out[lo:hi])
        if exps is None:
            return lib.sml_worker_allreduce(stream.worker, 1, x, y, hi - lo, ffi.NULL, ffi.NULL, ffi.NULL, timeout_ms)
        return lib.sml_worker_allreduce(stream.worker, 0, x, y, hi - lo,
                                        ffi.cast("int8_t *", ffi.from_buffer(exps[b0:b1])),
                                        ffi.cast("uint8_t *", ffi.from_buffer(nf[b0:b1])),
                                        ffi.cast("int8_t *", ffi.from_buffer(mexp[b0:b1])), timeout_ms)

    def _error(self, stream, rc, name):
        switch = stream.switch
        where = f"switchml: tensor {name!r}, rank {self.rank}, job #{switch.job} on switch {switch.address}"
        if len(self._streams) > 1:
            where += f" (stream {self._streams.index(stream)}, UDP port {stream.sock.getpeername()[1]})"
        lib = sw.lib
        if rc == lib.SML_E_NACK:
            return PeerFailure(f"{where}: the switch does not know this job (it was restarted, or the job was "
                               f"unregistered): restart the training job so that it registers again")
        if rc == lib.SML_E_REFUSED:
            return PeerFailure(f"{where}: the switch is not running (its port is closed): restart commlib-switch "
                               f"and the job")
        if rc == lib.SML_E_TIMEOUT and self._spine is not None:   # two levels: any switch of the job may have died
            for i, other in enumerate(self._tree):
                role = "the spine switch" if other is self._spine else f"leaf switch {i}"
                try:
                    sw.SwitchClient(other.address, 2.0).status()
                except CommError as exc:
                    return PeerFailure(f"{where}: no result for {self.ctx.settings.timeout_s}s and {role} at "
                                       f"{other.address} does not answer ({exc}): it died or is unreachable; restart "
                                       f"it and the job")
        if rc == lib.SML_E_TIMEOUT:
            hint = ""
            try:   # ask the control plane why: a restarted switch no longer lists the job
                sw.SwitchClient(switch.address, 2.0, key=switch.control_key, rank=self.rank).counters(switch.job,
                                                                                                      self.token)
                hint = "the switch still holds the job, so another rank probably stopped or is far behind"
            except ConfigError:
                return PeerFailure(f"{where}: no answer for {self.ctx.settings.timeout_s}s and the switch no longer "
                                   f"knows the job (it was restarted): restart the training job")
            except CommError as exc:
                hint = f"its control port does not answer either ({exc})"
            return CommTimeout(f"{where}: no result for {self.ctx.settings.timeout_s}s ({hint}); check every rank "
                               f"is alive and `commlib-switch counters {switch.address} --job {switch.job}`")
        if rc == lib.SML_E_NOMEM:
            return PeerFailure(f"{where}: out of memory")
        code = lib.sml_worker_errno(stream.worker)
        return PeerFailure(f"{where}: socket error {os.strerror(code) if code else f'(code {rc})'}")

    # -- counters and shutdown -----------------------------------------------------------------------
    def stats(self):
        out = {"switch": self.address, "job": self.job, "embedded": self.server is not None,
               "packet_elems": self.elems, "window": self.window, "streams": len(self._streams),
               "inflight": sum(self._inflight(stream) for stream in self._streams if stream.slots),
               "authenticated": any(switch.key is not None for switch in self._switches),
               "packet_mac": next((s.mac_name for s in self._switches if s.key is not None), None),   # None: no MACs
               "range_fallbacks": self.range_fallbacks}
        if self._streams and self._streams[0].worker is not None:
            out.update(self._counters())
        return out

    def _counters(self):
        """The workers' counters, summed over the streams (the timers: the largest)."""
        c, out = sw.ffi.new("sml_worker_counters *"), dict.fromkeys(sw.WORKER_COUNTERS, 0)
        for stream in self._streams:
            sw.lib.sml_worker_counters_get(stream.worker, c)
            for name in sw.WORKER_COUNTERS:
                value = int(getattr(c, name))
                out[name] = max(out[name], value) if name in ("srtt_ns", "rto_ns") else out[name] + value
        return out

    def switch_counters(self):
        """The switches' counters for this job (packets received, aggregated, results, replays, drops),
        summed over the switches; each switch's own under "switches"."""
        if self.job is None:
            return {}
        each = [switch.client.counters(switch.job, self.token) for switch in self._switches]
        if len(each) == 1:
            return each[0]
        return {"job": self.job, "counters": sw.summed([c["counters"] for c in each]),
                "switches": {switch.address: c for switch, c in zip(self._switches, each)}}

    def switch_wide_counters(self):
        """The switches' own counters (CPU time, packets of every job), summed, asked as their operator:
        signed with the daemon key, which the job holds for an embedded switch or a key file's."""
        return sw.summed([sw.SwitchClient(switch.address, 5.0, key=self._daemon_key).counters()["switch"]
                          for switch in self._switches])

    def daemon_counters(self):
        if self.rank != 0 or self.job is None:
            return {}
        return {f"switch {switch.address}": (lambda s=switch: s.client.counters(s.job, self.token)["counters"])
                for switch in self._switches}

    def close(self):
        if self._streams and self._streams[0].worker is not None:
            try:   # nobody may still wait for a result when rank 0 ends the job
                self.ctx.exchange(f"{self._scope}/close", None, min(self.ctx.settings.timeout_s, 10.0))
            except CommError as exc:
                log.warning("switchml: closing without every rank (%s)", exc)
            self._unregister()
        self._release()

    def _unregister(self):
        """Every rank that ends ends the job on the switches that outlive it (an embedded one goes with
        rank 0); the first one does it, the others find it gone."""
        if not self.ctx.settings.switch_addr:
            return
        for switch in self._switches:
            if switch.client is None:
                continue
            try:
                switch.client.unregister(switch.job, self.token)
            except ConfigError:
                pass   # another rank ended it first
            except CommError as exc:
                log.warning("switchml: could not unregister job #%s on %s: %s", switch.job, switch.address, exc)

    def _release(self):
        self._stopping.set()
        if self._keepalive is not None:
            self._keepalive.join(10.0)
            self._keepalive = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        for stream in self._streams:
            stream.close()


class _Switch:
    """One switch of the job: its address, the ports of the job's streams to it (None: the address's
    own), and its registration (job number, nonce, keys, control client; rank: this rank's on it, where
    not the job's: its index on its leaf, its leaf's on the spine)."""

    def __init__(self, address, ports):
        self.address, self.ports = address, ports
        self.job = self.nonce = self.key = self.control_key = self.client = self.rank = None
        self.mac = self.mac_name = None   # the packets' MAC algorithm: its TP_MAC_* code and name


class _Stream:
    """One socket and C worker towards one data-plane thread of a switch, with its share of the job's
    slots (its window) and its own packet ids, timers and loss recovery."""

    def __init__(self, switch, index, port):
        self.switch, self.index, self.port = switch, index, port
        self.slots = None
        self.sock = self.worker = None

    def close(self):
        if self.worker is not None:
            sw.lib.sml_worker_free(self.worker)
            self.worker = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def placement(setting, hosts, leaves):
    """The leaf of each rank of a two-level job: `setting` (switch_placement, one leaf index per rank), or
    the ranks grouped by host (hosts[rank], in the order of their first rank) cut into `leaves` balanced
    chunks; every leaf gets 1..MAX_WORKERS ranks."""
    n = len(hosts)
    if not 1 <= leaves <= sw.MAX_WORKERS:
        raise ConfigError(f"switch_addr lists {leaves} leaf switches; a spine takes 1..{sw.MAX_WORKERS}")
    if setting:
        try:
            leaf_of = [int(v) for v in str(setting).split(",")]
        except ValueError:
            leaf_of = []
        if len(leaf_of) != n or not all(0 <= leaf < leaves for leaf in leaf_of):
            raise ConfigError(f"switch_placement={str(setting)[:80]!r}: give one leaf index 0..{leaves - 1} per rank "
                              f"({n} of them, comma-separated), or leave it empty to place ranks by host")
    else:
        first = {}
        for rank, host in enumerate(hosts):
            first.setdefault(host, rank)
        order = sorted(range(n), key=lambda rank: (first[hosts[rank]], rank))
        leaf_of, start = [0] * n, 0
        for leaf, count in enumerate(sw.split(n, leaves)):
            for rank in order[start:start + count]:
                leaf_of[rank] = leaf
            start += count
    for leaf in range(leaves):
        count = leaf_of.count(leaf)
        if not 1 <= count <= sw.MAX_WORKERS:
            raise ConfigError(f"leaf switch {leaf} would serve {count} ranks; a leaf serves 1..{sw.MAX_WORKERS}: "
                              f"list at least {-(-n // sw.MAX_WORKERS)} leaves in COMMLIB_SWITCH_ADDR (and at most "
                              f"{n}), or fix COMMLIB_SWITCH_PLACEMENT")
    return leaf_of


def _cores():
    return len(os.sched_getaffinity(0))


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
