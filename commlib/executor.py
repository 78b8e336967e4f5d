"""The executor: one background thread runs what the controller released, in its order.

Every rank receives the same `go` batches in the same order, so every rank fuses them alike:
a batch's tensors with the same fusion key (same algorithm and dtype, or the same compressor
object, same op and scaling), taken together in the order each key first comes (`grouped`),
become buckets of at most `fusion_threshold` bytes. A dense
bucket is one backend allreduce of the concatenated buffer; a compressed bucket is one
`Compressor.reduce_bucket` (one collective per payload dtype). Results are scaled, split back,
recorded, and handed to the callers' handles.
"""
import itertools
import logging
import threading
import time
from collections.abc import MutableMapping

import numpy as np

from commlib import compressors, recent, sparse
from commlib.buffers import POOL
from commlib.dispatch import Plan
from commlib.errors import CollectiveFailure, CommError, ConfigError, error_from
from commlib.handles import Handle
from commlib.tensors import Staged, nbytes as tensor_bytes, numeric_dtype

log = logging.getLogger("commlib")

Sum = "sum"
Average = "average"
Min, Max, Product = "min", "max", "product"
OPS = (Sum, Average, Min, Max, Product)
# Horovod's op constants (horovod.common.basics / mpi_ops: Average=0, Sum=1, Adasum=2, Min=3, ...)
HOROVOD_OPS = {0: Average, 1: Sum, 3: Min, 4: Max, 5: Product}
STOP = {"t": "stop"}
RECORDS_KEPT = 65536   # names commlib.records() holds (commlib.recent)


class Entry:
    """One tensor in flight: the caller's tensor, its plan, its handle and its timestamps."""

    __slots__ = ("staged", "name", "op", "plan", "compressor", "record", "prescale", "postscale", "handle",
                 "algorithm", "estimate", "auto", "counts", "density", "rows", "skew", "enqueued", "went")

    def __init__(self, staged, name, op, plan, compressor, prescale, postscale, handle, record=None):
        self.staged, self.name, self.op, self.plan, self.compressor = staged, name, op, plan, compressor
        self.record = record or name   # its commlib.records() key: unnamed calls share one (bounded memory)
        self.prescale, self.postscale, self.handle = prescale, postscale, handle
        self.algorithm = None    # settled by the controller
        self.estimate = None     # the traffic model's, when it settled the algorithm
        self.auto = None         # `auto`'s trials, from the release (commlib.trials)
        self.counts = None       # row-sparse: every rank's row count, from the release
        self.density = plan.density
        self.rows = None         # row-sparse tensors: (this rank's rows, the union's)
        self.skew = None         # hotcold's hot set for this tensor
        self.enqueued = time.monotonic()   # submitted
        self.went = None                   # released by the controller

    def fusion_key(self):
        if self.staged.sparse is not None and self.compressor is None and self.op in (Sum, Average):
            return (id(self),)   # row-sparse tensors travel one by one
        payload = self.staged.travel_dtype if self.compressor is None else id(self.compressor)
        return (self.algorithm, payload, self.op, self.prescale, self.postscale)


class Channel:
    """The collectives of one algorithm, as a compressor's reduce_bucket sees them: rank, size,
    algorithm, sparse (its allreduce skips zero blocks), allreduce(array) and allgather(array),
    each call named after the bucket."""

    def __init__(self, backend, algorithm, ctx, name, phases):
        self.rank, self.size, self.algorithm = ctx.rank, ctx.size, algorithm
        self.sparse = backend.sparse   # its allreduce skips zero blocks
        self._backend, self._name, self._phases = backend, name, phases
        self._calls = itertools.count()

    def allreduce(self, array):
        """Elementwise sum over ranks of a 1-D array (cast to float32 if the algorithm lacks its dtype)."""
        array = np.ascontiguousarray(array).reshape(-1)
        native = array.dtype in self._backend.dtypes
        self._phases.mark("COMPRESS")
        out = self._backend.allreduce(array if native else array.astype(np.float32), self._next())
        self._phases.mark(self.algorithm.upper(), comm=True, sent=array.nbytes, received=out.nbytes,
                          **collective(self._backend))
        return out.astype(array.dtype, copy=False)

    def allgather(self, array):
        """Every rank's 1-D array (lengths may differ), index = rank."""
        self._phases.mark("COMPRESS")
        out = self._backend.allgather(np.ascontiguousarray(array).reshape(-1), self._next())
        self._phases.mark(self.algorithm.upper(), comm=True, sent=array.nbytes, received=sum(a.nbytes for a in out))
        return out

    def _next(self):
        return f"{self._name}.{next(self._calls)}"


class Phases:
    """The phases of one bucket's run, in order: (name, begin, end, comm, args) with monotonic times;
    comm=True for the algorithm's collectives. `mark` closes the phase that just ended.

    A collective's transfer time (its span less its `busy_s`) splits, where the algorithm has a
    server that stamps its results (switchml, omnireduce), into server_queue_s + server_proc_s +
    network_s: the server's shares (fractions of a round, `server_share`: per-packet means over the
    mean round time, so rounds that overlap in a window count once) times the transfer time, the
    rest the network (and the wait for the slowest rank, which no clock can tell apart)."""

    __slots__ = ("spans", "_last")

    def __init__(self, start):
        self.spans, self._last = [], start

    def mark(self, name, comm=False, server_share=None, **args):
        now = time.monotonic()
        if server_share is not None:
            transfer = max(0.0, now - self._last - args.get("busy_s", 0.0))
            queue, proc = transfer * server_share[0], transfer * server_share[1]
            args.update(server_queue_s=queue, server_proc_s=proc, network_s=max(0.0, transfer - queue - proc))
        self.spans.append((name, self._last, now, comm, args))
        self._last = now

    def server(self):
        """{server_queue_s, server_proc_s, network_s} summed over the collectives that report them,
        each None when none does (an algorithm without a server: the ring, allgathers)."""
        keys = ("server_queue_s", "server_proc_s", "network_s")
        reported = [args for _, _, _, comm, args in self.spans if comm and "network_s" in args]
        return {k: sum(a[k] for a in reported) if reported else None for k in keys}

    def seconds(self, comm):
        """Time waiting in the collectives (comm=True: network, switch, aggregators) or in the
        worker's processing (False), which includes a collective's own `busy_s` where it reports one."""
        total = 0.0
        for _, begin, end, is_comm, args in self.spans:
            waiting = end - begin - args.get("busy_s", 0.0) if is_comm else 0.0
            total += waiting if comm else end - begin - waiting
        return total


class Records(MutableMapping):
    """commlib.records(): per name, its last run. The executor puts a run's parts, and its dict is made
    when first read (a step puts hundreds of names, and they are seldom read); the same run reads as
    the same dict."""

    def __init__(self):
        self._runs = {}
        self._made = {}   # name -> (the run, the dict made of it)
        self._lock = threading.Lock()   # two executors put (the job's and a process set's), readers make

    def put(self, name, algorithm, plan, dtype, nbytes, density, negotiate_s, queue_s, shared, rows=None,
            estimate=None, skew=None, auto=None):
        """shared: the bucket's (Executor._run); rows: a row-sparse tensor's (this rank's, the union's)."""
        run = (algorithm, plan, dtype, nbytes, density, negotiate_s, queue_s, shared, rows, estimate, skew, auto)
        with self._lock:
            for dropped in recent.put(self._runs, name, run, RECORDS_KEPT):
                self._made.pop(dropped, None)

    def snapshot(self):
        """A dict of every record, read at once: the executor may drop the oldest meanwhile (RECORDS_KEPT)."""
        with self._lock:
            runs = list(self._runs.items())
        return {name: self._record(name, run) for name, run in runs}

    def __getitem__(self, name):
        return self._record(name, self._runs[name])

    def _record(self, name, run):
        if type(run) is not tuple:
            return run
        made = self._made.get(name)
        if made is not None and made[0] is run:
            return made[1]
        algorithm, plan, dtype, nbytes, density, negotiate_s, queue_s, shared, rows, estimate, skew, auto = run
        record = {"algorithm": algorithm, "compression": plan.compression, "dtype": dtype, "nbytes": nbytes,
                  "density": density, "negotiate_s": negotiate_s, "queue_s": queue_s, **shared, "note": plan.note}
        if rows is not None:   # row-sparse: rows sent by this rank and in the union, the model's estimate
            record.update(rows=rows[0], union_rows=rows[1], estimate=estimate, skew=skew)
        if auto is not None:   # `auto` measures: its trial or choice
            record["auto"] = auto
        with self._lock:
            if self._runs.get(name) is run:   # kept only while its run is (one dropped meanwhile is not)
                self._made[name] = (run, record)
        return record

    def stand_for(self, name, names):
        """`name`'s record as each of `names`' too (a whole DDP bucket's, as its parameters'), under one lock;
        where the record has no `auto`, each keeps its own (a run's is its last part, see put)."""
        record = self.get(name)
        if record is None:
            return
        with self._lock:
            for other in names:
                run = None if "auto" in record else self._runs.get(other)
                decided = run.get("auto") if type(run) is dict else run[-1] if run is not None else None
                self._runs[other] = record if decided is None else {**record, "auto": decided}
                self._made.pop(other, None)

    def __setitem__(self, name, record):
        with self._lock:
            self._runs[name] = record
            self._made.pop(name, None)

    def __delitem__(self, name):
        with self._lock:
            del self._runs[name]
            self._made.pop(name, None)

    def __iter__(self):   # the names now, at once: the executor may add one meanwhile
        with self._lock:
            return iter(list(self._runs))

    def __len__(self):
        return len(self._runs)


class Executor:
    """Tracks the tensors in flight and runs the controller's batches on one background thread."""

    def __init__(self, ctx, client, dispatcher, timeline):
        self.ctx, self.client, self.dispatcher, self.timeline = ctx, client, dispatcher, timeline
        self.records = Records()
        self._tuned = None          # autotune's values the backends last took
        self._traced_windows = {}   # tensor name -> the hot/cold agreement whose counts are in the timeline
        self.broken = None       # the first fatal error: every later call raises it
        self._entries = {}
        self.joining = None      # this rank's commlib.join: its handle, resolved when every rank joined
        self.last_go = time.monotonic()   # when a batch last came (a joined rank waits while the others run)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="commlib-background", daemon=True)
        self._thread.start()

    def track(self, entries):
        """Track one submission's entries, all or none (a refused one leaves nothing in flight)."""
        with self._lock:
            if self.broken is not None:   # a fatal error between the caller's check and here: fail() drained
                raise self.broken         # what was in flight, and nothing would fail this
            if len(entries) == 1 and entries[0].name not in self._entries:   # allreduce_async's: no batch to build
                self._entries[entries[0].name] = entries[0]
                return
            batch = {}
            for entry in entries:
                if entry.name in self._entries or entry.name in batch:
                    raise ConfigError(f"tensor {entry.name!r} is already in flight; give each tensor of a step a unique name")
                batch[entry.name] = entry
            self._entries.update(batch)

    def start_join(self):
        """The handle of this rank's commlib.join: resolved with the last rank to join."""
        with self._lock:
            if self.broken is not None:
                raise self.broken
            if self.joining is not None:
                raise ConfigError("commlib.join() is already waiting on this rank (another thread called it)")
            self.joining = Handle("join", None)
            return self.joining

    def _take_join(self):
        """This rank's join handle, taken (the lock held): whoever takes it resolves it."""
        joining, self.joining = self.joining, None
        return joining

    def end_join(self, handle):
        """This rank's commlib.join returned or failed: a later one may start."""
        with self._lock:
            if self.joining is handle:
                self.joining = None

    def stop(self, timeout):
        """Fail what is waiting, end the thread; False if a collective is still running."""
        self.fail(None, CommError("commlib was shut down while this tensor was waiting for the other ranks"))
        self.client.events.put(STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def fail(self, names, error):
        """Fail these tensors' handles, or (names=None) every tensor in flight and all later calls."""
        with self._lock:
            if names is None:
                self.broken = self.broken or error   # the first fatal error is the cause
                names = list(self._entries)
            entries = [self._entries.pop(n) for n in names if n in self._entries]
            joining = self._take_join() if self.broken else None   # a fatal error ends a join too
        for entry in entries:
            entry.handle.set(error=error)
        if joining is not None:
            joining.set(error=error)

    def _loop(self):
        while True:
            msg = self.client.events.get()
            if msg is STOP:
                return
            try:
                if msg["t"] == "go":
                    self.last_go = time.monotonic()
                    self._execute(msg["batch"], msg.get("tuned"))   # [Release]; autotune's values
                elif msg["t"] == "joined":
                    with self._lock:
                        joining = self._take_join()
                    if joining is not None:
                        joining.set(result=msg["last"])
                elif msg["t"] == "error" and self.ctx.rank not in msg.get("refused_by", ()):
                    self.fail(msg["names"], error_from(msg))
                elif msg["t"] == "stall":
                    log.warning("commlib: %s", msg["message"])
            except CommError as exc:   # a fatal error it explains itself
                self.fail(None, exc)
            except Exception as exc:   # never leave callers waiting on a dead thread
                log.exception("commlib: background thread failed")
                self.fail(None, CommError(f"commlib's background thread failed: {exc!r}"))

    def _execute(self, batch, tuned=None):
        now = time.monotonic()
        if tuned and tuned != self._tuned:   # autotune's, the same on every rank before this batch
            self._tuned = tuned
            for backend in self.dispatcher.backends.values():
                backend.tune(tuned)
        fusion_threshold = tuned["fusion_threshold"] if tuned else self.ctx.settings.fusion_threshold
        entries = []
        with self._lock:
            for release in batch:
                entry = self._entries.pop(release.name, None)
                if entry is None and release.joined and self.ctx.rank in release.joined["ranks"]:
                    try:
                        entry = self._stand_in(release)
                    except Exception as exc:   # the others wait in its collective: the job cannot go on
                        error = CommError(f"commlib.join: this rank cannot take part in tensor {release.name!r} "
                                          f"({exc}); the job stops")
                        for taken in entries:
                            taken.handle.set(error=error)
                        raise error from exc
                if entry is not None:   # None: failed by a fatal error (or shutdown) that raced this batch
                    entry.algorithm, entry.went = release.algorithm, now
                    entry.estimate, entry.counts, entry.auto = release.estimate, release.counts, release.auto
                    entries.append(entry)
        for bucket in fuse(grouped(entries), fusion_threshold):
            try:
                self._run(bucket)
            except Exception as exc:
                error = exc
                if not isinstance(exc, CommError):   # Gloo's timeout on a peer gone, a socket error, ...
                    error = CollectiveFailure(f"{bucket[0].algorithm} failed on tensor {bucket[0].name!r}: {exc!r}")
                    error.__cause__ = exc
                for entry in bucket:
                    entry.handle.set(error=error)

    def _stand_in(self, release):
        """What this rank, joined (commlib.join), contributes to a tensor the others reduce: zeros, or for
        min, max and product the op's identity, so that the result is the others' reduction. It fuses
        as the others' tensor does (its bytes as they count them) and compresses with this rank's own
        compressor of that spec, whose state per name goes on."""
        meta = release.joined
        shape, op = meta["shape"], meta["op"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)) or op not in OPS:
            raise ConfigError(f"malformed metadata (shape {shape!r}, op {op!r})")
        dtype = numeric_dtype(meta["dtype"])
        identity = 0
        if op in (Min, Max):   # the largest value for a min, the smallest for a max
            identity = (np.inf if op == Min else -np.inf) if dtype.kind == "f" else \
                getattr(np.iinfo(dtype), "max" if op == Min else "min")
        elif op == Product:
            identity = 1
        staged = Staged(np.full(shape, identity, dtype=dtype))
        staged.nbytes = tensor_bytes(shape, meta["dtype"])
        text = meta["compression"]
        compressor = self.dispatcher.compressors.get(text) or compressors.resolve(text)
        return Entry(staged, release.name, op, Plan(((None, release.algorithm),), text), compressor,
                     meta["prescale"], meta["postscale"], Handle(release.name, None))

    def _run(self, bucket):
        first = bucket[0]
        name = first.name if len(bucket) == 1 else f"{first.name}+{len(bucket) - 1}"
        backend = self.dispatcher.backend(first.algorithm)
        start = time.monotonic()
        phases = Phases(start)
        rows = first.staged.sparse is not None and first.op in (Sum, Average)
        dense = first.compressor is None and not rows   # host arrays, restored on the caller's thread (Handle.set)
        run = self._run_dense if dense else self._run_rows if first.compressor is None else self._run_compressed
        # `auto` counts no trial run of a backend that still learns the tensor (asked before it runs)
        learning = {e.name for e in bucket if "trial" in (e.auto or ()) and backend.learning(e.name, e.staged.shape)}
        try:
            results = run(bucket, backend, name, phases)
        finally:
            end = time.monotonic()
            if first.rows is not None:   # a row-sparse collective returned (_run_rows), as on the other ranks:
                self._count_rows(first, backend, name)   # hotcold counts it, outside the run's time
        shared = {"bucket": name, "fused_with": len(bucket) - 1, "run_s": end - start,   # the bucket's, once
                  "process_s": phases.seconds(comm=False), "transfer_s": phases.seconds(comm=True), **phases.server()}
        nbytes = sum(entry.staged.nbytes for entry in bucket)
        traced = self.timeline.active
        for entry, result in zip(bucket, results):
            self._record(entry, shared, start, end, phases, nbytes, traced, entry.name in learning)
            entry.handle.set(result=result, restore=entry.staged.restore if dense else None)

    def _run_dense(self, bucket, backend, name, phases):
        first = bucket[0]
        arrays = [e.staged.array for e in bucket]
        buf, own = fused(arrays), False   # own: commlib's buffer, not the callers' memory
        if buf is None:
            buf, own = POOL.concatenate(arrays), True
            phases.mark("FUSE")
        if first.prescale != 1.0:
            buf, own = scaled(buf, first.prescale), True
            phases.mark("SCALE")
        extra = {} if first.op in (Sum, Average) else {"op": first.op}
        if own and backend.reduces_scratch:
            extra["scratch"] = True   # reduced where it lies: no copy of the bucket first
        out = backend.allreduce(buf, name, **extra)
        phases.mark(first.algorithm.upper(), comm=True, sent=buf.nbytes, received=out.nbytes, **collective(backend))
        measured = backend.measured_density(name)   # of the fused buffer when fused
        if measured is not None:
            for entry in bucket:
                entry.density = measured[0]
        scale = first.postscale / (self.ctx.size if first.op == Average else 1)
        if scale != 1.0:
            out = scaled(out, scale, inplace=own or not np.may_share_memory(out, buf))
            phases.mark("SCALE")
        parts, start = [], 0   # slices, not np.split: it costs microseconds per part
        for a in arrays:
            parts.append(out[start:start + a.size])
            start += a.size
        phases.mark("RESTORE")
        return parts   # each restored on the thread that waits for it (Handle.set)

    def _run_rows(self, bucket, backend, name, phases):
        """A row-sparse tensor: its (rows, values) summed by the backend, a sparse result."""
        (entry,) = bucket
        rows = entry.staged.sparse
        values = rows.values
        if entry.prescale != 1.0:
            values = scaled(values, entry.prescale)
            phases.mark("SCALE")
        out_rows, out_values = sparse.reduce_rows(backend, rows.rows, values, rows.nrows, name, entry.counts)
        phases.mark(entry.algorithm.upper(), comm=True, sent=values.nbytes + rows.rows.nbytes,
                    received=out_values.nbytes + out_rows.nbytes, **collective(backend))
        scale = entry.postscale / (self.ctx.size if entry.op == Average else 1)
        if scale != 1.0:
            out_values = scaled(out_values, scale)
        entry.rows = (int(rows.rows.size), int(out_rows.size))
        result = entry.staged.restore_rows(out_rows, out_values)
        phases.mark("RESTORE")
        return [result]

    def _count_rows(self, entry, backend, name):
        """hotcold's windows of row counts: the hot set's size and share of updates in the record, and
        where auto weighed the split and chose another, its window goes on all the same (collective
        at the window's end: every rank counts the same calls)."""
        rows = entry.staged.sparse
        counter = backend if hasattr(backend, "row_record") else None
        for weighed in (entry.estimate or ()):
            other = self.dispatcher.backends.get(weighed)
            if weighed != entry.algorithm and hasattr(other, "observe"):
                other.observe(rows.rows, rows.nrows, name, rows.width, rows.values.dtype.itemsize)
                counter = other
        if counter is not None:
            entry.skew = counter.row_record(name)
            self._trace_counts(entry, counter)

    def _run_compressed(self, bucket, backend, name, phases):
        first = bucket[0]
        tensors = [e.staged.dense() for e in bucket]
        if first.prescale != 1.0:
            tensors = [t * first.prescale for t in tensors]
        channel = Channel(backend, first.algorithm, self.ctx, name, phases)
        outs = first.compressor.reduce_bucket(tensors, [e.name for e in bucket], channel, first.op == Average)
        results = [out * first.postscale if first.postscale != 1.0 else out for out in outs]
        phases.mark("DECOMPRESS")
        return results

    def _trace_counts(self, entry, backend):
        """Rank 0 writes a finished window's update counts per row (summed over ranks) to the
        timeline once per agreement: the skew `commlib.analyze` plots."""
        agreements = entry.skew.get("agreements", 0)
        if agreements and self.ctx.rank == 0 and self.timeline.active and \
                self._traced_windows.get(entry.name) != agreements:
            self._traced_windows[entry.name] = agreements
            counts = backend.counts(entry.name)
            if counts is not None:
                self.timeline.counts(entry.name, counts[0], counts[1].reshape(-1))

    def _record(self, entry, shared, start, end, phases, bucket_bytes, traced, learning=False):
        self.records.put(entry.record, entry.algorithm, entry.plan, entry.staged.dtype_name, entry.staged.nbytes,
                         entry.density, entry.went - entry.enqueued, start - entry.went, shared, entry.rows,
                         entry.estimate, entry.skew, entry.auto)
        if entry.auto is not None or entry.rows is not None:   # `auto` measures, and row-sparse tensors' stats
            # depend on its choice: this run's time goes to rank 0 with the next submission, its share of
            # the bucket's time by bytes (fused with others or alone, a tensor costs alike)
            share = entry.staged.nbytes / bucket_bytes if bucket_bytes else 1.0
            self.dispatcher.reports.ran(entry.name, entry.auto, None if learning else (end - start) * share)
        if entry.auto is not None:
            for *_, comm, args in (phases.spans if traced else ()):
                if comm:   # the study's table of candidates (commlib.analyze)
                    args["auto"] = entry.auto
        if traced:
            self.timeline.tensor(entry.name, entry.algorithm, (entry.enqueued, entry.went), start, phases,
                                 entry.staged.nbytes, shared["fused_with"])


def collective(backend):
    """What the backend tells of its last allreduce, where it can: `busy_s`, the seconds it spent
    processing, and `server_share`, the server's (queue, processing) fractions of its round time."""
    out = {}
    if backend.last_busy_s is not None:
        out["busy_s"] = backend.last_busy_s
    if backend.last_server_share is not None:
        out["server_share"] = backend.last_server_share
    return out


def scaled(array, factor, inplace=False):
    """array * factor in the array's dtype, computed in float32 at least (as Horovod scales float16:
    a factor rounded to float16 would put the result one float16 step off); in place when allowed
    and the array is float32/float64 (the same result without a second buffer)."""
    if inplace and array.dtype in (np.float32, np.float64) and array.flags.writeable:
        array *= factor
        return array
    wide = np.promote_types(array.dtype, np.float32) if array.dtype.kind == "f" else np.float64
    return (array.astype(wide, copy=False) * factor).astype(array.dtype)


def fused(arrays, writeable=False):
    """The bucket's 1-D arrays as one buffer without copying when they lie back to back in memory (a
    DDP bucket's per-parameter views of its flat buffer, or a single array); else None. Read-only
    unless asked: the backends must not write the caller's memory."""
    first = arrays[0]
    address = first.ctypes.data
    for array in arrays:
        if array.dtype != first.dtype or not array.flags.c_contiguous or array.ctypes.data != address:
            return None
        address += array.nbytes
    if len(arrays) == 1:
        return first
    total = sum(a.size for a in arrays)
    return np.lib.stride_tricks.as_strided(first, shape=(total,), strides=(first.itemsize,), writeable=writeable)


def grouped(entries):
    """A batch's entries, those of one fusion key together in the order each key first comes: a batch
    that mixes algorithms (a policy by name or size, `auto`'s choice per size band) fuses into a
    bucket per key, not one per run of equal keys. Every rank holds the same batch: the same order.
    (key, entry) pairs: a key is computed once per entry."""
    keys = {}
    for entry in entries:
        key = entry.fusion_key()
        keys.setdefault(key, []).append((key, entry))
    return [keyed for same in keys.values() for keyed in same]


def fuse(keyed, threshold):
    """Consecutive entries with the same fusion key ((key, entry) pairs), each bucket at most
    `threshold` bytes."""
    bucket, size, bucket_key = [], 0, None
    for key, entry in keyed:
        nbytes = entry.staged.nbytes
        if bucket and (key != bucket_key or size + nbytes > threshold):
            yield bucket
            bucket, size = [], 0
        if not bucket:
            bucket_key = key
        bucket.append(entry)
        size += nbytes
    if bucket:
        yield bucket
