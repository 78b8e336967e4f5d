"""The Backend interface: one algorithm that sums 1-D arrays across ranks.

Lifecycle, the same for every backend: `available(ctx)` (may it run in this job at all; the same
answer on every rank), `__init__(ctx)` (local work only: settings, sockets), `start()` (the only
collective set-up, called once on every rank at commlib.init, after every rank built it), then
`allreduce`/`allgather` calls, then `close()` once on every rank. The core runs each step on every
rank through `ctx.agree`, so a failure anywhere makes the backend unavailable everywhere.

The core hands a backend contiguous 1-D numpy arrays of a dtype it declared, already negotiated
(every rank calls `allreduce` for the same tensors in the same order from the core's single
background thread), and expects the elementwise SUM back as a new array, of the input's dtype or a
wider one (a float16 sum may come back as float32 so that averaging happens before rounding);
averaging, scaling, fusion and framework conversion are the core's job.
"""
import abc
from dataclasses import dataclass

import numpy as np

from commlib import traffic


@dataclass(frozen=True)
class TensorMeta:
    """What `enabled()` may look at: the tensor as the backend would receive it."""
    name: str
    shape: tuple
    dtype: str
    nbytes: int


class Backend(abc.ABC):
    name = None          # registry key, e.g. "ring"
    dtypes = ()          # numpy dtypes reduced natively, e.g. (np.dtype("float32"),)
    ops = ("sum",)       # the reductions it does; the core asks for others with allreduce(..., op=)
    sparse = False       # skips zero blocks: `auto` sends block-sparse tensors to it (see density())
    # The kinds of data it carries, each with its place among their carriers (lower first; dispatch
    # takes the first that runs in the job and is enabled for the tensor):
    #   dense     uncompressed tensors (a `sparse` one is auto's choice for block-sparse tensors)
    #   summable  compressor payloads that add up (fp16, powersgd's factors)
    #   sparse    sparsifiers' output (a sparse collective skips the zeros, or gathered)
    #   gather    payloads decoded one by one (signs, quantized codes): implements allgather
    #   rows      row-sparse tensors (rows, values): implements allreduce_rows; `auto` weighs every
    #             row carrier, and the first dense one, by `traffic`
    carries = {}
    # its collectives run on ctx.engine, which pairs them by the order they are called in (Gloo, MPI):
    # two at once on one engine, from two threads, could pair differently on each rank
    on_engine = False

    @classmethod
    def dense_traffic(cls, nbytes, n):
        """Bytes each way per worker to sum `nbytes` of dense data over n ranks: a ring's by default."""
        return 2 * nbytes * (n - 1) / n

    @classmethod
    def traffic(cls, stats):
        """{"up", "down"} bytes per worker to reduce a row-sparse tensor, from every rank's
        measurements (commlib.traffic.estimate; `row_stats` adds this backend's own under its
        name); by default, as the dense table of row slots."""
        up = cls.dense_traffic(traffic.table_bytes(stats), len(stats))
        return {"up": up, "down": up}

    def row_stats(self, name, rows, nrows, width):
        """What `traffic` needs from this rank beyond the common measurements, for a tensor of
        `nrows` rows of `width` values whose unique touched rows are `rows`; None: nothing."""
        return None

    def __init__(self, ctx):
        """Local set-up only. ctx is a commlib.context.Context: rank, size, local_rank, local_size,
        settings, engine, exchange(key, value) (allgather of small JSON values), agree, job_token."""
        self.ctx = ctx

    @property
    def rank(self):
        return self.ctx.rank

    @property
    def size(self):
        return self.ctx.size

    @classmethod
    def available(cls, ctx):
        """Can this backend run in this job at all? Must give the same answer on every rank.
        Returns (True, "") or (False, "why, and what to do")."""
        return True, ""

    def start(self):
        """Collective set-up once every rank built this backend (a switch, registrations), at
        commlib.init(): every rank calls it, in the same order. Raise to make the backend unavailable."""

    def enabled(self, meta):
        """Horovod's Enabled(): will this backend take this tensor? Same answer on every rank."""
        return np.dtype(meta.dtype) in self.dtypes

    def density(self, array):
        """The density of `array` as this backend would see it (a sparse algorithm's own block size
        and threshold), for the `auto` policy; None for dense algorithms."""
        return None

    # allreduce(array, name, scratch=True) may reduce the array where it lies: commlib's own buffer
    # (a fused bucket), not the caller's memory, which every backend only reads
    reduces_scratch = False

    @abc.abstractmethod
    def allreduce(self, array, name):
        """Return the elementwise sum over ranks of `array` (1-D, contiguous) as a new array."""

    def allreduce_apart(self, array, name):
        """allreduce, run beside another algorithm's collectives on ctx.engine (hotcold's slab beside
        its cold rows): None where this array needs the engine too (switchml's fallback for values
        beyond its quantization), and the caller then calls allreduce_on_engine once the engine is free
        (every rank alike: the switch flags the array on every rank). Only for a backend not on_engine."""
        return self.allreduce(array, name)

    def allreduce_on_engine(self, array, name):
        """The sum of an array allreduce_apart returned None for, through ctx.engine."""
        return self.allreduce(array, name)

    def allgather(self, array, name):
        """Every rank's 1-D array (lengths may differ), index = rank. Only algorithms that carry
        gathered payloads implement it."""
        raise NotImplementedError(f"algorithm {self.name!r} does not gather")

    # Seconds of this rank's last allreduce spent processing (quantizing, packing, MACs, syscalls)
    # rather than waiting for the network and the switch/aggregators; None: the algorithm cannot
    # tell them apart. commlib.records() and the timeline count it as the worker's processing.
    last_busy_s = None
    # The server's (switch's, aggregators') share of this rank's last allreduce: (queue, processing)
    # as fractions of its round time, from the stamps its results piggyback (`server_share`); None:
    # the algorithm has no server. commlib.records() and the timeline scale them to the transfer time.
    last_server_share = None

    def learning(self, name, shape):
        """Whether this backend's calls named `name`, now of `shape`, are not yet as they will stay: it
        still learns from them (hotcold's first window of counts, anew for a resized table). `auto`
        counts no trial run of it meanwhile."""
        return False

    def measured_density(self, name):
        """(this rank's, the union's) block density a sparse algorithm measured on its last call
        named `name`, for commlib.records(); None for dense algorithms."""
        return None

    def tune(self, values):
        """Autotune's values ({knob: value}, commlib.autotune), the same on every rank before the same
        batch: take those of this backend's knobs (none by default)."""

    def stats(self):
        """Counters for users (bytes, packets, resends, ...)."""
        return {}

    def daemon_counters(self):
        """{row name: fn() -> {counter: number}} of the daemons (switch, aggregators) this rank
        reports in the timeline; only rank 0 reports, so each daemon is asked once."""
        return {}

    def close(self):
        """Release sockets, processes and switch/aggregator state. Called once, on every rank."""


def server_share(queue_ns, proc_ns, packets, rounds, round_ns):
    """(queue, processing) of the server as fractions of a round, from one call's totals: the
    stamps' sums (`packets` contributions, each round's summed over its contributions) and this
    worker's `rounds` round times (`round_ns`, its own clock). Per-packet means over the mean round,
    because a window keeps many rounds in flight at once: the sum of the round times exceeds the
    call's wall time, their ratio does not. Clipped to 1 (the rest is the network); None without rounds."""
    if packets <= 0 or rounds <= 0 or round_ns <= 0:
        return None
    mean_round = round_ns / rounds
    queue, proc = queue_ns / packets / mean_round, proc_ns / packets / mean_round
    if queue + proc > 1.0:   # the server's clock and ours differ in rate by nothing measurable: noise
        queue, proc = queue / (queue + proc), proc / (queue + proc)
    return queue, proc
