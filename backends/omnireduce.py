"""OmniReduce: block-sparse allreduce where only non-zero blocks travel.

The tensor is cut into blocks of `omnireduce_block_size` elements; a block is zero when every
|x| <= `omnireduce_threshold` (0: exact). Blocks are dealt to columns (block mod C); each column
is a lock-step chain driven by an aggregator with the "next non-zero block" protocol
(switch/csrc/omnireduce.h): every worker bootstraps each column with its first block and the
index of its own next non-zero block, the aggregator completes a block once the minimum of the
announced `next` values lies beyond it, sends the sum to every worker with that minimum, and
only the workers whose next block it is send again. A worker uploads its own non-zero blocks
(density d) and downloads the union (density D). Transport: UDP with per-column timers (adaptive,
from the measured round trip), shadow sets and replay of finished results (idempotent under loss
and duplication); datagrams to one peer leave in UDP GSO batches and arrive GRO-coalesced. Every
packet and result carries a MAC under the job key (backends/keys.py; `authenticate`; `packet_mac` its
algorithm, switch/packet_mac.py): a forged or altered block or result is dropped, a replayed one is a
duplicate the protocol already ignores.

Aggregators
  colocated (default)  every worker runs an aggregator thread for a 1/N share of the columns; no
                       extra process. Bound vs ring allreduce: ~2 / (d + D).
  dedicated            A `commlib-aggregator` processes (COMMLIB_OMNIREDUCE_AGGREGATORS=host:port,...),
                       columns interleaved across them; when nothing is configured and every rank
                       is on this host, rank 0 starts omnireduce_num_aggregators of them on
                       loopback. Bound: ~2(N-1) / (N D).

Tuning guide
  omnireduce_block_size     256 elements (1 KiB + a 40-byte header and a 24-byte MAC per packet). Larger blocks cost
                            fewer packets but see fewer all-zero blocks: a block is the unit of sparsity,
                            so the default stays the paper's. 0 sizes blocks by the path (agreed at
                            start: the most whose result fits one datagram of the smallest path MTU to
                            the aggregators, over all ranks; loopback 16000, 1500-byte paths 349):
                            the fewest packets, for dense tensors.
  omnireduce_window_bytes   bytes in flight per worker: each column moves one block per round trip,
                            so throughput <= window / RTT. 512 KiB (512 columns of 1 KiB) covers
                            10 Gbps x 400 us or 40 Gbps x 100 us, and is the best of 256..1024
                            columns on loopback; omnireduce_columns overrides the column count.
  omnireduce_retransmit_ms  per-column timer (doubles per resend): a few times the RTT; too small
                            only costs duplicate packets.
  omnireduce_rows_per_block  row-sparse tensors: 1 (default) sends the fewest bytes when touched rows
                            are scattered (hashed ids); more only when touched rows come in runs.
  omnireduce_threshold      > 0 turns blocks with all |x| <= threshold into zeros (lossy, like a
                            sparsifier without error feedback).

Inputs: float32 and int32 (int32 exact, wrapping; float32 sums are added in arrival order, so they
match a dense sum to float32 rounding). Dense arrays that are mostly zero and the output of
sparsifying compressors (`densify`) become a dense array and its block bitmap. Row-sparse tensors
(the core's path for torch sparse COO and TF IndexedSlices gradients) go through `allreduce_rows`:
each row with its presence count in a block of its own (omnireduce_rows_per_block whole rows: the
tensor's block, at most omnireduce_block_size; a longer row in the fewest blocks that hold it;
commlib.sparse.RowSlots), the bitmap taken from the rows, the union's rows back; so a touched row
costs one row and a header, not a job-sized block. `allreduce_sparse` is
the older entry for a torch tensor (densified; the result dense unless dense=False).
"""
import functools
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import numpy as np

from commlib import traffic
from commlib.net import primary_ip
from commlib.backends import Backend, keys, register
from commlib.backends.base import server_share
from commlib.errors import BackendUnavailable, CommError, CommTimeout, ConfigError, InvalidTensor, PeerFailure
from commlib.settings import define
from commlib.sparse import RowSlots
from commlib.tensors import Staged

try:
    from commlib.switch import aggregator as agg, auth, control, packet_mac
    from commlib import kernels
    from commlib._native import ffi, lib
    IMPORT_ERROR = ""
except ImportError as exc:   # the C extension is not built
    agg = ffi = lib = kernels = None
    IMPORT_ERROR = (f"the omnireduce C extension is not built ({exc}); build it with "
                    f"`python setup.py build_ext --inplace` (or `make develop`)")

log = logging.getLogger("commlib.omnireduce")

define("omnireduce_mode", "colocated", "omnireduce aggregators: 'colocated' (a 1/N share in every worker) or "
       "'dedicated' (commlib-aggregator processes)")
define("omnireduce_block_size", 256, "omnireduce block: elements per block (and per packet); 0 = the most one "
       "datagram of the path's MTU holds")
define("omnireduce_rows_per_block", 1, "omnireduce, row-sparse tensors: whole rows per block (0 = as many as fit "
       "in omnireduce_block_size); a touched row costs its block")
define("omnireduce_threshold", 0.0, "omnireduce: a block is zero when every |x| <= this (0 = exact)")
define("omnireduce_window_bytes", 512 * 1024, "omnireduce window: bytes in flight per worker (one block per "
       "column); cover bandwidth x RTT, e.g. 10 Gbps x 400 us or 40 Gbps x 100 us = 512 KiB")
define("omnireduce_columns", 0, "omnireduce columns (blocks in flight per worker); 0 = omnireduce_window_bytes / "
       "block bytes")
define("omnireduce_aggregators", "", "dedicated omnireduce aggregators 'host:port,host:port' (commlib-aggregator); "
       "empty: rank 0 starts them on loopback when every rank is on this host")
define("omnireduce_num_aggregators", 0, "dedicated omnireduce: aggregators rank 0 starts when none are "
       "configured (0 = one per worker)")
define("omnireduce_key_file", "", "the daemon key of the commlib-aggregator processes in "
       "COMMLIB_OMNIREDUCE_AGGREGATORS (started with --key-file), read by every rank; aggregators the job "
       "starts itself (colocated, spawned) use the job's secret", per_rank=True)
define("omnireduce_host", "", "address omnireduce workers and colocated aggregators bind and advertise "
       "(default: 127.0.0.1 when every rank is local, else the default route's interface)", per_rank=True)
define("omnireduce_retransmit_ms", 20.0, "omnireduce per-column retransmission timer (ms); doubles per resend")
define("omnireduce_sim_loss", 0.0, "testing: omnireduce workers and aggregators drop each packet they send with "
       "this probability")
define("omnireduce_sim_dup", 0.0, "testing: omnireduce workers and aggregators send each packet twice with this "
       "probability")

F32, I32 = np.dtype("float32"), np.dtype("int32")
_DTYPE_CODE = {F32: lib.OMR_FLOAT32, I32: lib.OMR_INT32} if lib is not None else {}   # omnireduce.h's
_MAX_TENSOR_STATS = 4096
# how long a closing rank's aggregator waits for the others to close: after the job's last collective a rank
# may only miss a lost result, which it asks again for within its retransmission timers. Not COMMLIB_TIMEOUT_S:
# a rank that leaves an elastic job mid-step waits here for ranks that wait (in Horovod) for it to exit
CLOSE_WAIT_S = 5.0


# -- sparse inputs ---------------------------------------------------------------------------------
def block_mask(array, block=256, threshold=0.0):
    """uint8 per block: 1 when any |x| > threshold (NaN counts as non-zero)."""
    return _scan(array, block, threshold)[0]


def block_density(array, block=256, threshold=0.0):
    """Fraction of blocks that omnireduce would send (OmniReduceBackend.density, for `auto`, which
    measures every dense tensor at every step: one C call and no numpy reduction)."""
    mask, count = _scan(array, block, threshold)
    return count / mask.size if mask.size else 0.0


def _scan(array, block, threshold):
    """(block mask, number of non-zero blocks)."""
    array = np.ascontiguousarray(array).reshape(-1)
    nblocks = -(-array.size // block)
    if lib is not None and array.dtype in _DTYPE_CODE:
        return kernels.nonzero_blocks(array, block, threshold, int(array.dtype == I32))
    padded = np.zeros(nblocks * block, dtype=np.float64)
    padded[:array.size] = array
    mask = (~(np.abs(padded.reshape(-1, block)) <= threshold)).any(axis=1).astype(np.uint8)
    return mask, int(np.count_nonzero(mask))


def densify(values, indices, numel, dtype=None):
    """Dense 1-D array from a sparsifier's output (values at flat indices; repeats are summed)."""
    values = np.asarray(values).reshape(-1)
    out = np.zeros(numel, dtype=dtype or values.dtype)
    np.add.at(out, np.asarray(indices, dtype=np.int64).reshape(-1), values.astype(out.dtype, copy=False))
    return out


# -- the backend -----------------------------------------------------------------------------------
@register
class OmniReduceBackend(Backend):
    """Sparse block allreduce over UDP; one instance per job on every rank (see module docstring)."""

    name = "omnireduce"
    sparse = True        # skips zero blocks: auto sends block-sparse tensors here
    carries = {"dense": 30, "sparse": 10, "rows": 20}   # rows: in row-aligned blocks (allreduce_rows)
    dtypes = (F32, I32)

    @classmethod
    def available(cls, ctx):
        if lib is None:
            return False, IMPORT_ERROR
        s = ctx.settings
        if s.omnireduce_mode not in ("colocated", "dedicated"):
            return False, (f"COMMLIB_OMNIREDUCE_MODE={s.omnireduce_mode!r}: use 'colocated' or 'dedicated'")
        if s.omnireduce_mode == "dedicated" and not s.omnireduce_aggregators and not ctx.all_local:
            return False, ("dedicated mode with ranks on several hosts needs aggregators: start "
                           "`commlib-aggregator --host 0.0.0.0 --port 9200` on some hosts and set "
                           "COMMLIB_OMNIREDUCE_AGGREGATORS=host:9200,..., or use COMMLIB_OMNIREDUCE_MODE=colocated")
        if ctx.size > lib.OMR_MAX_WORKERS:
            return False, f"omnireduce supports at most {lib.OMR_MAX_WORKERS} ranks"
        return True, ""

    def __init__(self, ctx):
        super().__init__(ctx)
        s = ctx.settings
        self.block = int(s.omnireduce_block_size)
        self._block = self.block   # a dense tensor's (sized in start() when 0; autotune may take less: tune)
        self.threshold = float(s.omnireduce_threshold)
        if lib is not None and s.packet_mac != packet_mac.AUTO:
            packet_mac.code(s.packet_mac)   # a bad name fails on every rank, here
        self.rows_per_block = int(s.omnireduce_rows_per_block)
        if self.rows_per_block < 0:
            raise ConfigError(f"omnireduce_rows_per_block={self.rows_per_block}: use 0 (as many as fit) or >= 1")
        if not 0 <= self.block <= lib.OMR_MAX_BLOCK:
            raise ConfigError(f"omnireduce_block_size={self.block}: use 1..{lib.OMR_MAX_BLOCK} elements "
                              f"(a block and its header must fit one UDP datagram), or 0 (sized by the path)")
        self._window = int(s.omnireduce_window_bytes)
        self.columns = int(s.omnireduce_columns) or max(1, self._window // (4 * (self.block or lib.OMR_MAX_BLOCK)))
        self.mode = s.omnireduce_mode
        self.retransmit_ms = float(s.omnireduce_retransmit_ms)
        self.timeout_s = float(s.timeout_s)
        if self.columns < 1:
            raise ConfigError(f"omnireduce_columns={self.columns}: use 0 (from omnireduce_window_bytes) or >= 1")
        if self.threshold < 0:
            raise ConfigError(f"omnireduce_threshold={self.threshold}: must be >= 0 (0 = exact)")
        if self.retransmit_ms < 0.1:
            raise ConfigError(f"omnireduce_retransmit_ms={self.retransmit_ms}: must be >= 0.1")
        for name in ("omnireduce_sim_loss", "omnireduce_sim_dup"):
            if not 0.0 <= getattr(s, name) < 0.5:
                raise ConfigError(f"{name}={getattr(s, name)}: a probability in [0, 0.5)")
        self._prefix = ctx.scope("omnireduce")      # this instance's exchange keys
        self._sock = self._worker = self._colocated = None
        self._processes, self._aggregators, self._agg_desc, self._jobs = [], [], [], []
        self._job_hash = agg.token_hash(ctx.job_token or "no-token")
        self._seq, self._broken, self._closed = 0, None, False
        self._key = self._nonce = None              # the job key of its packets (None: no MACs), its nonce
        self._mac = None                            # the packets' MAC algorithm (rank 0's packet_mac)
        self._sign = None                           # signs its control requests (keyed aggregators)
        self._daemon_key = None
        self._stopping, self._keepalive = threading.Event(), None
        self._lock = threading.Lock()          # stats
        self._call_lock = threading.Lock()     # one tensor at a time on the socket
        self._tensors, self._last = OrderedDict(), {}
        self._totals = dict.fromkeys(("tensors", "bytes_sent", "bytes_recv", "pkts_sent", "pkts_recv",
                                      "resends", "sim_dropped", "sim_duplicated", "bad_mac", "server_queue_ns",
                                      "server_proc_ns", "server_packets", "rounds", "cpu_ns"), 0)
        self._host = s.omnireduce_host or ("127.0.0.1" if ctx.all_local else primary_ip())
        self._bind = "0.0.0.0" if self._host != "127.0.0.1" else self._host
        self._sock = agg.make_socket(self._bind)   # local work only here: the set-up with the others is start()

    # -- set-up: collective, once, on every rank (the core calls it at commlib.init()) -----------------
    def start(self):
        """The aggregators (one colocated in every rank, or commlib-aggregator processes rank 0 starts
        when none are configured), the check that every rank has the same settings, the registration
        with every aggregator. Each step runs on every rank and every rank raises the first failing
        rank's error (ctx.agree), so no rank goes on half set up."""
        try:
            self._start()
        except BaseException:
            self._release()
            raise

    def _step(self, step, fn, timeout):
        """fn() on every rank, agreed (every rank raises the first failing rank's error); ranks wait
        for each other up to `timeout`: starting processes and retrying registrations is slower than
        the data path's timeout allows."""
        return self.ctx.agree(f"{self._prefix}/{step}", fn, timeout=timeout)

    def _start(self):
        ctx, s = self.ctx, self.ctx.settings
        setup_s = max(self.timeout_s, 30.0)   # set-up waits on process starts (a spawned aggregator)
        mine = self._step("aggregators", self._start_aggregators, setup_s)
        everyone = ctx.exchange(f"{self._prefix}/setup", mine, setup_s)
        if any(v["params"] != everyone[0]["params"] for v in everyone):   # the same verdict on every rank
            raise ConfigError(f"omnireduce settings differ across ranks (block, columns, mode, threshold, rows per block): "
                              f"{[v['params'] for v in everyone]}; set them identically everywhere")
        self._epoch = everyone[0]["epoch"]
        embedded = self.mode == "colocated" or not s.omnireduce_aggregators
        daemon_key = self._step("key", lambda: keys.daemon_key(ctx, embedded, s.omnireduce_key_file, "omnireduce_key_file",
                                                               f"commlib-aggregator at {s.omnireduce_aggregators}"),
                                setup_s)
        self._daemon_key = daemon_key   # rank 0 reads the aggregators' counters with it (timeline)
        self._nonce = everyone[0]["nonce"]
        self._key = keys.job_key(ctx, daemon_key, self._nonce)
        if daemon_key is not None:   # keyed aggregators take only requests signed with the job key
            self._sign = auth.Signer(auth.job_key(daemon_key, self._nonce))
        if self.mode == "colocated":
            addresses = [v["agg"] for v in everyone]
            self._agg_desc = [f"{a} (colocated in rank {r})" for r, a in enumerate(addresses)]
        else:
            addresses = (s.omnireduce_aggregators.split(",") if s.omnireduce_aggregators
                         else everyone[0]["spawned"])
            self._agg_desc = [f"{a} (commlib-aggregator)" for a in addresses]
        self._aggregators = [agg.resolve_address(a) for a in addresses]
        if self.block == 0:   # sized by the path: the smallest over every rank's paths
            self.block = min(ctx.exchange(f"{self._prefix}/path", agg.path_block(self._aggregators), setup_s))
            self.columns = int(s.omnireduce_columns) or max(1, self._window // (4 * self.block))
        self._block = self.block
        # rank 0 chooses the packets' MAC algorithm for blocks of this size; every rank takes its choice
        mac = packet_mac.resolve(s.packet_mac, lib.OMR_HDR_BYTES + 4 * self.block) if self.rank == 0 else None
        self._mac = ctx.exchange(f"{self._prefix}/mac", mac, setup_s)[0]
        self._step("register", self._register, setup_s)

    def _start_aggregators(self):
        """This rank's part of the aggregators; returns what the others need to know."""
        s = self.ctx.settings
        mine = {"epoch": secrets.randbits(31), "params": [self.block, self.columns, self.mode, self.threshold,
                                                          self.rows_per_block],
                "nonce": auth.new_nonce()}
        if self.mode == "colocated":
            # it lives exactly as long as this backend: it never collects its job as idle
            self._colocated = agg.Aggregator(self._bind, job_idle_s=float("inf"), key=self.ctx.secret or None).start(
                f"omnireduce-aggregator-rank{self.rank}")
            mine["agg"] = f"{self._host}:{self._colocated.address[1]}"
        elif not s.omnireduce_aggregators and self.rank == 0:
            mine["spawned"] = self._spawn_aggregators(s.omnireduce_num_aggregators or self.size)
        return mine

    def _register(self):
        """Register with every aggregator, make the C worker, and (rank 0) keep a dedicated job alive."""
        s = self.ctx.settings
        request = {"job": self._job_hash, "epoch": self._epoch, "rank": self.rank, "size": self.size,
                   "columns": self.columns, "aggregators": len(self._aggregators), "block": self.block,
                   "loss": s.omnireduce_sim_loss, "dup": s.omnireduce_sim_dup,
                   "nonce": self._nonce, "authenticate": self._key is not None,
                   "packet_mac": self._mac}
        jobs = agg.register(self._sock, self._aggregators, request, self.timeout_s,
                            retry_s=max(0.05, 10 * self.retransmit_ms / 1000), sign=self._sign)
        seed = secrets.randbits(63) | 1
        self._worker = lib.omr_worker_new(self._sock.fileno(), self.rank, self.size, self.columns,
                                          len(self._aggregators), self.block, int(self.retransmit_ms * 1000),
                                          s.omnireduce_sim_loss, s.omnireduce_sim_dup, seed)
        if self._worker == ffi.NULL:
            self._worker = None
            raise BackendUnavailable("omnireduce: cannot create the worker (invalid settings or out of memory)")
        self._jobs = [(job, key) for job, key, _ in jobs]
        for index, ((ip, port), (job, key, _)) in enumerate(zip(self._aggregators, jobs)):
            lib.omr_worker_set_agg(self._worker, index, ip.encode(), port, job, key,
                                   ffi.NULL if self._key is None else self._key, packet_mac.code(self._mac))
        idle_s = min(idle for _, _, idle in jobs)
        if idle_s != float("inf"):   # every rank's keepalives hold the job's state: a silent rank died
            self._keepalive = threading.Thread(target=self._keep_alive, args=(idle_s / 4,),
                                               name="omnireduce-keepalive", daemon=True)
            self._keepalive.start()

    def _keep_alive(self, every_s):
        """Dedicated aggregators drop a job that is silent for their idle time: while this backend
        is open, tell them it lives (a job may reduce nothing for a long evaluation)."""
        while not self._stopping.wait(every_s):
            agg.keepalive(self._sock, self._aggregators, self._jobs, self.rank, self._key, self._mac)

    def _spawn_aggregators(self, count):
        """Rank 0, all ranks local, nothing configured: start `count` commlib-aggregator processes."""
        cmd = [sys.executable, "-m", "commlib.switch.aggregator_main", "--host", "127.0.0.1", "--port", "0",
               "--exit-with-parent", "--quiet"]
        if self.ctx.secret:   # the daemon key on the child's stdin: never on its command line
            cmd += ["--key-file", "/dev/stdin"]
        for _ in range(count):
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    stdin=subprocess.PIPE if self.ctx.secret else subprocess.DEVNULL, text=True)
            self._processes.append(proc)
            if self.ctx.secret:
                proc.stdin.write(self.ctx.secret.hex() + "\n")
                proc.stdin.close()
        addresses, deadline = [], time.monotonic() + max(self.timeout_s, 30.0)   # a start on a busy host is slow
        for proc in self._processes:
            try:
                addresses += control.wait_ready(proc, deadline - time.monotonic(), "an embedded commlib-aggregator")
            except RuntimeError as exc:
                raise BackendUnavailable(f"omnireduce: {exc}") from None
        return addresses

    # -- the collective -------------------------------------------------------------------------
    def allreduce(self, array, name, mask=None, block=None):
        """Elementwise sum over ranks; `mask` (uint8 per block) skips the bitmap scan when known;
        `block`: this tensor's elements per block (the same on every rank), at most the job's."""
        self.last_server_share = None
        if self._broken is not None:
            raise type(self._broken)(f"omnireduce is unusable after an earlier failure: {self._broken}")
        if self._closed or self._worker is None:
            raise BackendUnavailable(f"omnireduce: tensor {name!r} not reduced: the backend is "
                                     f"{'closed' if self._closed else 'not started (start() is the collective set-up, called once on every rank)'}")
        x = np.ascontiguousarray(array).reshape(-1)
        if x.dtype not in _DTYPE_CODE:
            raise InvalidTensor(f"tensor {name!r}: omnireduce sums float32 and int32, not {x.dtype}")
        block = self._block if block is None else int(block)
        if not 1 <= block <= self.block:
            raise InvalidTensor(f"tensor {name!r}: block={block} must lie in 1..{self.block} (omnireduce_block_size)")
        if mask is None:
            mask = block_mask(x, block, self.threshold)
        elif mask.dtype != np.uint8 or mask.size != -(-x.size // block):
            raise InvalidTensor(f"tensor {name!r}: mask must be uint8 with one entry per block of {block}")
        out = np.zeros(x.size, dtype=x.dtype)      # calloc: only pages of union blocks get touched
        st = ffi.new("omr_wstats *")
        with self._call_lock:
            seq, self._seq = self._seq, self._seq + 1
            start = time.perf_counter()
            rc = lib.omr_worker_allreduce(self._worker, seq, ffi.from_buffer(x), ffi.from_buffer(out), x.size,
                                          _DTYPE_CODE[x.dtype], block, ffi.from_buffer(mask), self.timeout_s, st)
            seconds = time.perf_counter() - start
        self._record(name, st, seconds)
        if rc != lib.OMR_OK:
            self._broken = self._error(rc, st, name)
            raise self._broken
        return out

    def allreduce_rows(self, rows, values, nrows, name, counts=None):
        """Row-sparse sum (commlib.sparse): unique `rows` and their values placed in row-aligned
        blocks (whole rows per block, each with its presence count), the block bitmap taken from the
        rows (no scan); returns the union's (rows, values)."""
        slots = self.row_slots(nrows, values.shape[1])
        flat, mask = slots.scatter(rows, values, values.dtype)
        return slots.gather(self.allreduce(flat, name, mask=mask, block=slots.block))

    @classmethod
    def traffic(cls, stats):
        up, down = traffic.omnireduce([s[cls.name] for s in stats], stats[0]["itemsize"])
        return {"up": up, "down": down}

    def row_stats(self, name, rows, nrows, width):
        return traffic.omnireduce_stats(self.row_slots(nrows, width), rows, self.columns)

    def row_slots(self, nrows, width):
        """The row-aligned layout of a table of `nrows` rows of `width` elements: its own block of
        omnireduce_rows_per_block whole rows (at most the job's block)."""
        return RowSlots(nrows, width, self.block, self.rows_per_block)

    def allreduce_sparse(self, tensor, name, dense=True):
        """Sum a torch tensor, dense or sparse COO (nn.Embedding(sparse=True) gradients): the result
        is a dense tensor, or with dense=False a sparse COO tensor of the same sparse dims."""
        staged = Staged(tensor)
        x = staged.array
        if x.dtype not in _DTYPE_CODE:
            x = x.astype(np.float32)
        out = staged.restore(self.allreduce(x, name))
        if dense:
            return out
        return out.to_sparse(tensor.sparse_dim() if tensor.is_sparse else out.dim())

    # -- errors and stats --------------------------------------------------------------------------
    def _error(self, rc, st, name):
        where = self._agg_desc[st.err_agg] if 0 <= st.err_agg < len(self._agg_desc) else "an aggregator"
        head = f"omnireduce on rank {self.rank}, tensor {name!r}"
        if rc == lib.OMR_ETIMEOUT:
            if st.agg_silent_s > 0:
                if self.mode == "colocated":
                    hint = (f"rank {st.err_agg} probably died or hung (its aggregator runs inside it); "
                            f"check that rank's log")
                else:
                    hint = "check that commlib-aggregator is running and reachable (COMMLIB_OMNIREDUCE_AGGREGATORS)"
                return CommTimeout(f"{head}: no progress for {self.timeout_s:.1f}s; aggregator {where} has not "
                                   f"answered for {st.agg_silent_s:.1f}s: {hint}")
            if st.err_rank >= 0:
                what = "acknowledgements" if st.err_code else "blocks"
                more = f" and {st.err_nwaiting - 1} other rank(s)" if st.err_nwaiting > 1 else ""
                return PeerFailure(f"{head}: no progress for {self.timeout_s:.1f}s; aggregator {where} is waiting "
                                   f"for the {what} of rank {st.err_rank}{more}: that rank died, hung or stopped "
                                   f"calling allreduce for this tensor; check its log")
            return CommTimeout(f"{head}: no progress for {self.timeout_s:.1f}s ({st.cols_left} of {st.ncols} "
                               f"columns unfinished, aggregator {where}); a rank or aggregator died or the network "
                               f"drops every packet; raise COMMLIB_TIMEOUT_S if the link is just slow")
        if rc == lib.OMR_EREFUSED:
            why = {lib.OMR_ERR_JOB: "does not know this job (it was restarted or the job was closed)",
                   lib.OMR_ERR_KEY: "has this job under another key (it was restarted)",
                   lib.OMR_ERR_SLOT: "does not serve that column (ranks disagree on the aggregator list)"}
            return PeerFailure(f"{head}: aggregator {where} {why.get(st.err_code, 'refused our packets')}; "
                               f"restart the job")
        if rc == lib.OMR_EPROTO:
            return PeerFailure(f"{head}: inconsistent result from aggregator {where} (column {st.err_col}): ranks "
                               f"disagree on the tensor (size or dtype) or two jobs share a token")
        if rc == lib.OMR_ESYS:
            return PeerFailure(f"{head}: socket error: {os.strerror(st.err_code)}")
        if rc == lib.OMR_ENOMEM:
            return CommError(f"{head}: out of memory for the state of {st.ncols or self.columns} columns; free memory "
                             f"on this host or lower omnireduce_columns / omnireduce_window_bytes")
        return InvalidTensor(f"{head}: invalid arguments (code {rc})")

    def _record(self, name, st, seconds):
        entry = {"bytes_sent": st.bytes_sent, "bytes_recv": st.bytes_recv, "pkts_sent": st.pkts_sent,
                 "pkts_recv": st.pkts_recv, "resends": st.resends, "acks_sent": st.acks_sent,
                 "pulls_sent": st.pulls_sent, "resend_bytes": st.resend_bytes, "extra_recv_bytes": st.extra_recv_bytes, "blocks": st.nblocks,
                 "columns": st.ncols, "own_blocks": st.own_blocks, "union_blocks": st.union_blocks,
                 "density": st.own_blocks / st.nblocks if st.nblocks else 0.0,
                 "union_density": st.union_blocks / st.nblocks if st.nblocks else 0.0,
                 "sim_dropped": st.sim_dropped, "sim_duplicated": st.sim_duplicated,
                 "dup_recv": st.dup_recv, "ooo_recv": st.ooo_recv, "bad_mac": st.bad_mac, "srtt_ms": st.srtt_us / 1e3, "rto_ms": st.rto_us / 1e3,
                 "server_queue_ns": st.server_queue_ns, "server_proc_ns": st.server_proc_ns,
                 "server_packets": st.server_packets, "rounds": st.results_recv, "round_ns": st.round_ns,
                 "cpu_ns": st.cpu_ns, "seconds": seconds}
        self.last_server_share = server_share(st.server_queue_ns, st.server_proc_ns, st.server_packets,
                                              st.results_recv, st.round_ns)
        with self._lock:
            self._tensors.pop(name, None)
            self._tensors[name] = entry
            while len(self._tensors) > _MAX_TENSOR_STATS:
                self._tensors.popitem(last=False)
            self._last = dict(entry, name=name)
            t = self._totals
            t["tensors"] += 1
            for key in ("bytes_sent", "bytes_recv", "pkts_sent", "pkts_recv", "resends", "sim_dropped",
                        "sim_duplicated", "bad_mac", "server_queue_ns", "server_proc_ns", "server_packets", "rounds",
                        "cpu_ns"):
                t[key] += entry[key]

    def density(self, array):
        """Fraction of `array`'s blocks this backend would send, with its own block size and threshold."""
        return block_density(array, self.block, self.threshold)

    def tune(self, values):
        """autotune's omnireduce_block_share: a share of the job's block (the aggregators take any up to it)."""
        share = values.get("omnireduce_block_share")
        if share is not None and self.block:
            self._block = max(1, min(self.block, round(self.block * share)))

    def measured_density(self, name):
        """Measured block density of the last `name` (this rank's own, and of the union)."""
        entry = self._tensors.get(name)
        return None if entry is None else (entry["density"], entry["union_density"])

    def daemon_counters(self):
        if self.rank != 0 or not self._aggregators:
            return {}
        return {f"aggregator {host}:{port}": functools.partial(agg.query, (host, port), {"op": "counters"},
                                                               key=self._daemon_key)
                for host, port in self._aggregators}

    def stats(self):
        """Bytes/packets per tensor and in total (UDP payload: 40-byte header + block), measured block
        density of the last tensor (own: this rank's; union: identical on every rank), resends."""
        with self._lock:
            out = dict(self._totals)
            out.update(mode=self.mode, authenticated=self._key is not None,
                       packet_mac=self._mac if self._key is not None else None,   # None: no MACs
                       block_size=self.block, columns=self.columns, threshold=self.threshold,
                       aggregators=[f"{h}:{p}" for h, p in self._aggregators],
                       last=dict(self._last), density=self._last.get("density"),
                       union_density=self._last.get("union_density"),
                       tensors={k: dict(v) for k, v in self._tensors.items()})
        if self._colocated is not None:
            out["aggregator"] = self._colocated.stats()
        return out

    # -- tear-down ------------------------------------------------------------------------------
    def close(self):
        if self._closed:
            return
        self._closed = True
        if self._worker is None:   # never started (or its start failed): nobody needs our aggregator
            self._release()
            return
        # the others may still need replays from our aggregator: wait until every rank is done, a while
        try:
            self.ctx.exchange(f"{self._prefix}/close", None,
                              timeout=1.0 if self._broken else min(CLOSE_WAIT_S, self.ctx.settings.timeout_s))
        except CommError as exc:
            log.warning("omnireduce rank %d: closing without the others (%s)", self.rank, exc)
        if self.mode == "dedicated" and self._sock is not None:   # without the others too: the job is over
            agg.deregister(self._sock, self._aggregators, self._job_hash, self._epoch, self.rank, self._sign)
        self._release()

    def _release(self):
        self._stopping.set()
        if self._keepalive is not None:
            self._keepalive.join()
            self._keepalive = None
        if self._colocated is not None:
            self._colocated.close()
            self._colocated = None
        for proc in self._processes:
            proc.terminate()
        for proc in self._processes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._processes = []
        if self._worker is not None and self._worker != ffi.NULL:
            lib.omr_worker_free(self._worker)
        self._worker = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

