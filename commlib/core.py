"""The core: tensors are queued by the caller, negotiated by the controller, fused and dispatched
to a backend by one background thread, and handed back through handles.

The life of a tensor: `allreduce_async` stages it (host view), picks (algorithm, compressor) from
the policy, and submits its metadata; the controller releases it in a `go` batch once every rank
agrees; the background thread fuses consecutive small tensors of the same kind into one buffer,
runs the backend (or the compressor pipeline), scales, splits and resolves the handles.
"""
import atexit
import itertools
import logging
import os
import threading
import time

import numpy as np

from commlib import compressors, controller, engine as engines
from commlib.backends import TensorMeta, registry
from commlib.context import detect
from commlib.net import parse_address, primary_ip
from commlib.errors import BackendUnavailable, CommError, CommTimeout, ConfigError, InvalidTensor, Mismatch
from commlib.policy import DensityChoice, Policy
from commlib.settings import Settings, defined
from commlib.tensors import Staged
from commlib.timeline import Timeline

log = logging.getLogger("commlib")

Sum = "sum"
Average = "average"
_OPS = (Sum, Average)
_STOP = {"t": "stop"}


class Handle:
    """The result of an asynchronous allreduce: `synchronize(handle)` or `poll(handle)`."""

    __slots__ = ("name", "_event", "_result", "_error", "_timeout")

    def __init__(self, name, timeout):
        self.name, self._timeout = name, timeout
        self._event = threading.Event()
        self._result = self._error = None

    def _set(self, result=None, error=None):
        self._result, self._error = result, error
        self._event.set()

    def done(self):
        return self._event.is_set()

    def wait(self):
        if not self._event.wait(self._timeout):
            raise CommTimeout(f"tensor {self.name!r} got no result within {self._timeout:.0f}s; "
                              f"a peer, the switch or an aggregator is stuck (see the other ranks' output)")
        if self._error is not None:
            raise self._error.with_traceback(None)   # one error may fail many handles: no piling tracebacks
        return self._result


class _Entry:
    """One queued tensor."""

    def __init__(self, tensor, staged, name, op, compression, prescale, postscale, handle):
        self.tensor, self.staged, self.name, self.op = tensor, staged, name, op
        self.compression, self.prescale, self.postscale, self.handle = compression, prescale, postscale, handle
        self.algorithm = None
        self.meta = None
        self.times = {"enqueue": time.monotonic()}

    def fusion_key(self):
        if self.compression is not None:
            return None
        return (self.algorithm, self.staged.travel_dtype, self.op, self.prescale, self.postscale)


class Communicator:
    """What a compressor's reduce() sees: collectives over the algorithm chosen for its payload."""

    def __init__(self, runtime, algorithm, name):
        self.rank, self.size = runtime.topology.rank, runtime.topology.size
        self.algorithm, self._runtime, self._name = algorithm, runtime, name
        self._calls = itertools.count()

    def allreduce(self, array):
        """Elementwise sum over ranks of a 1-D array, through the chosen backend."""
        algorithm = "ring" if self.algorithm == "allgather" else self.algorithm
        backend = self._runtime.backend(algorithm)
        array = np.ascontiguousarray(array).reshape(-1)
        native = array.dtype in backend.dtypes
        out = backend.allreduce(array if native else array.astype(np.float32), f"{self._name}.{next(self._calls)}")
        return out.astype(array.dtype, copy=False)

    def allgather(self, array):
        """Every rank's 1-D array (lengths may differ), index = rank."""
        return self._runtime.engine.allgather(np.ascontiguousarray(array).reshape(-1), f"{self._name}.{next(self._calls)}")


class Runtime:
    def __init__(self, settings, policy):
        self.settings = settings
        self.policy = policy
        self.engine = engines.create(settings.ring_engine, detect(), settings.timeout_s)
        self.topology = detect()   # creating the engine may have initialized Horovod
        self.timeline = Timeline(settings.timeline, self.topology.rank)
        self._server, self.client = self._start_controller()
        t = self.topology
        self.ctx = t.joined(settings=settings, exchange_fn=self.client.exchange, engine=self.engine,
                            job_token=self.client.token)
        self._check_settings_agree()
        self.backends, self.unavailable = self._start_backends()
        self._entries = {}
        self._lock = threading.Lock()
        self._names = itertools.count()
        self._broken = None
        self.records = {}
        self._thread = threading.Thread(target=self._loop, name="commlib-background", daemon=True)
        self._thread.start()

    # -- set-up -------------------------------------------------------------------------------
    def _start_controller(self):
        s, t = self.settings, self.topology
        all_local = t.local_size == t.size
        host = s.controller_host or ("127.0.0.1" if all_local else primary_ip())
        server = None
        if s.controller_addr:
            address = parse_address(s.controller_addr, "COMMLIB_CONTROLLER_ADDR")
            if t.rank == 0:
                server = controller.ControllerServer(t.size, *address, **self._controller_settings())
        else:
            if t.rank == 0:
                server = controller.ControllerServer(t.size, host if all_local else "0.0.0.0", 0,
                                                     **self._controller_settings())
                address = (host, server.address[1])
            else:
                address = None
            address = _within(s.timeout_s, "sharing the controller's address (commlib.init)",
                              self.engine.broadcast_object, address)
        return server, controller.ControllerClient(address, t.rank, s.timeout_s)

    def _controller_settings(self):
        s = self.settings
        return dict(timeout_s=s.timeout_s, cycle_time_ms=s.cycle_time_ms,
                    negotiation_timeout_s=s.negotiation_timeout_s, stall_warning_s=s.stall_warning_s)

    def _check_settings_agree(self):
        """Settings that shape communication must be equal on every rank, or ranks would stream
        different packet sizes, fuse differently, or raise on some ranks only."""
        shared = {name: value for name, value in self.settings.as_dict().items() if not defined()[name].per_rank}
        everyone = self.ctx.exchange("init/settings", shared)
        differ = {name: [ranks[name] for ranks in everyone] for name in shared
                  if any(ranks.get(name) != shared[name] for ranks in everyone)}
        if differ:
            self.client.close()
            details = "; ".join(f"{name}: {values}" for name, values in sorted(differ.items()))
            raise Mismatch(f"ranks disagree on settings (values by rank) {details}; set COMMLIB_* the same "
                           f"on every rank (e.g. export them before horovodrun, or pass -x to mpirun)")

    def _start_backends(self):
        """Build every available backend on every rank, and agree on which ones work."""
        backends, unavailable = {}, {}
        for name, cls in sorted(registry().items()):
            ok, why = cls.available(self.ctx)
            backend = None
            for stage in ("build", "start"):   # every rank agrees on each stage before the next
                if ok and not why:
                    try:
                        if stage == "build":
                            backend = cls(self.ctx)
                        else:
                            backend.start()
                    except Exception as exc:   # one rank's failure must not split the job
                        log.warning("commlib: backend %s failed to %s on rank %d: %s", name, stage,
                                    self.topology.rank, exc)
                        why = f"failed to {stage} on rank {self.topology.rank}: {exc}"
                reasons = [v for v in self.ctx.exchange(f"init/backend/{name}/{stage}", why or "") if v]
                if reasons:
                    unavailable[name] = reasons[0]
                    if backend is not None:
                        backend.close()
                    break
            else:
                backends[name] = backend
        return backends, unavailable

    def backend(self, name):
        try:
            return self.backends[name]
        except KeyError:
            if name not in registry():
                raise ConfigError(f"unknown algorithm {name!r}; choose one of {sorted(registry())}, "
                                  f"'allgather' (for compressed payloads) or 'auto'") from None
            raise BackendUnavailable(f"algorithm {name!r} is not available: {self.unavailable[name]}") from None

    # -- the caller's side ----------------------------------------------------------------------
    def allreduce_async(self, tensor, name, op, algorithm, compression, prescale, postscale):
        if self._broken:
            raise self._broken
        if op not in _OPS:
            raise ConfigError(f"op={op!r}: use commlib.Sum or commlib.Average")
        named, name = name is not None, name or f"allreduce.noname.{next(self._names)}"
        staged = Staged(tensor)
        if op == Average and staged.travel_dtype.kind in "iu":
            raise InvalidTensor(f"tensor {name!r}: op=Average on {staged.dtype_name} would truncate; use op=commlib.Sum")
        if algorithm is None and compression is None:
            algorithm, compression = self.policy.choose(name, staged.nbytes, staged.dtype_name)
        if compression is not None and not named:
            raise ConfigError(f"compressed tensors need a name= that is the same at every step: error feedback "
                              f"and random streams are kept per name (compression {compression!r})")
        s = self.settings
        # resolve() hands out one object per spec: memories (error feedback, PowerSGD's Q) persist
        entry = _Entry(tensor, staged, name, op, compressors.resolve(compression), prescale, postscale,
                       Handle(name, s.negotiation_timeout_s + 3 * s.timeout_s + 10))
        meta = self._plan(entry, algorithm or "auto")
        with self._lock:
            if name in self._entries:
                raise ConfigError(f"tensor {name!r} is already in flight; give each tensor of a step a unique name")
            self._entries[name] = entry
        self.client.submit([meta])
        return entry.handle

    def _plan(self, entry, requested):
        """The negotiation metadata; `auto` is settled by the controller from every rank's density."""
        staged = entry.staged
        meta = TensorMeta(entry.name, tuple(staged.shape), str(staged.travel_dtype),
                          staged.numel * staged.travel_dtype.itemsize)
        bands, density = None, None
        if entry.compression is not None:
            algorithm = self._compressed_algorithm(entry, requested)
        else:
            if requested == "allgather":
                raise ConfigError(f"tensor {entry.name!r}: algorithm 'allgather' carries compressed payloads; "
                                  f"give a compression= or choose ring, switchml or omnireduce")
            dense = self._first_enabled(("switchml", "ring"), meta)
            if dense is None:
                raise InvalidTensor(f"tensor {entry.name!r}: no algorithm here reduces {staged.dtype_name}; "
                                    f"cast it to float32, float64 or an int dtype")
            sparse = self._first_enabled(("omnireduce",), meta)
            bands = self._bands(requested, dense, sparse, meta)
            if len(bands) == 1:
                algorithm, bands = bands[0][1], None
            else:   # settled by the controller from every rank's density
                algorithm, density = "auto", self.backends[sparse].density(staged.array)
        entry.meta = {"name": entry.name, "shape": list(meta.shape), "dtype": staged.dtype_name, "op": entry.op,
                      "algorithm": algorithm, "bands": bands, "density": density,
                      "compression": repr(entry.compression) if entry.compression is not None else None,
                      "prescale": entry.prescale, "postscale": entry.postscale}
        return entry.meta

    def _bands(self, requested, dense, sparse, meta):
        """[[density bound or None, algorithm], ...]: the controller takes the first band whose bound is
        above the densest rank's block density (measured by omnireduce: none without it)."""
        if isinstance(requested, DensityChoice):
            *conditional, fallback = requested
            for _, algorithm in conditional:
                self._check_enabled(algorithm, meta)
            rest = self._bands(fallback, dense, sparse, meta)
            return rest if sparse is None else [list(band) for band in conditional] + rest
        if requested == "auto":
            return [[None, dense]] if sparse is None else [[self.settings.auto_sparse_density, sparse], [None, dense]]
        self._check_enabled(requested, meta)
        return [[None, requested]]

    def _first_enabled(self, names, meta):
        return next((n for n in names if n in self.backends and self.backends[n].enabled(meta)), None)

    def _check_enabled(self, algorithm, meta):
        backend = self.backend(algorithm)
        if not backend.enabled(meta):
            kinds = ", ".join(str(d) for d in backend.dtypes)
            raise InvalidTensor(f"tensor {meta.name!r}: algorithm {algorithm!r} does not take {meta.dtype} "
                                f"tensors of {meta.nbytes} bytes (it reduces {kinds}); cast it or choose 'ring'")

    def _compressed_algorithm(self, entry, requested):
        """The compressor's payload decides which algorithms can carry it (compressors' one table)."""
        algorithm = compressors.pick_algorithm(entry.compression, set(self.backends) | {"allgather"},
                                               None if requested == "auto" else requested)
        if algorithm != "allgather":
            self.backend(algorithm)   # unavailable: BackendUnavailable with the reason
        return algorithm

    # -- the background thread ------------------------------------------------------------------
    def _loop(self):
        while True:
            msg = self.client.events.get()
            if msg is _STOP:
                return
            try:
                if msg["t"] == "go":
                    self._execute(msg["batch"])
                elif msg["t"] == "error":
                    self._fail(msg["names"], controller.error_from(msg))
                elif msg["t"] == "stall":
                    log.warning("commlib: %s", msg["message"])
            except Exception as exc:   # never leave callers waiting on a dead thread
                log.exception("commlib: background thread failed")
                self._fail(None, CommError(f"commlib's background thread failed: {exc!r}"))

    def _fail(self, names, error):
        with self._lock:
            if names is None:
                self._broken = self._broken or error   # the first fatal error is the cause
                names = list(self._entries)
            entries = [self._entries.pop(n) for n in names if n in self._entries]
        for entry in entries:
            entry.handle._set(error=error)

    def _execute(self, batch):
        now = time.monotonic()
        entries = []
        with self._lock:
            for item in batch:
                entry = self._entries.pop(item["name"], None)
                if entry is not None:   # None: failed by a fatal error (or shutdown) that raced this batch
                    entry.algorithm, entry.times["go"] = item["algorithm"], now
                    entries.append(entry)
        for group in _fuse(entries, self.settings.fusion_threshold):
            try:
                self._run(group)
            except CommError as exc:
                for entry in group:
                    entry.handle._set(error=exc)
            except Exception as exc:
                error = CommError(f"{group[0].algorithm} failed on tensor {group[0].name!r}: {exc!r}")
                error.__cause__ = exc
                for entry in group:
                    entry.handle._set(error=error)

    def _run(self, group):
        first = group[0]
        start = time.monotonic()
        if first.compression is not None:
            results = [self._run_compressed(first)]
        else:
            results = self._run_dense(group)
        end = time.monotonic()
        for entry, result in zip(group, results):
            self._record(entry, start, end, len(group))
            entry.handle._set(result=result)

    def _run_dense(self, group):
        first = group[0]
        arrays = [e.staged.array for e in group]
        buf = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        if first.prescale != 1.0:
            buf = (buf * first.prescale).astype(buf.dtype)
        name = first.name if len(group) == 1 else f"{first.name}+{len(group) - 1}"
        backend = self.backend(first.algorithm)
        out = backend.allreduce(buf, name)
        measured = backend.measured_density(name)   # of the fused buffer when fused
        if measured is not None:
            for entry in group:
                entry.meta["density"] = measured[0]
        scale = first.postscale / (self.topology.size if first.op == Average else 1)
        if scale != 1.0:
            out = (out * scale).astype(buf.dtype)
        parts = np.split(out, np.cumsum([a.size for a in arrays])[:-1]) if len(group) > 1 else [out]
        return [e.staged.restore(part) for e, part in zip(group, parts)]

    def _run_compressed(self, entry):
        tensor = entry.staged.dense()
        if entry.prescale != 1.0:
            tensor = tensor * entry.prescale
        comm = Communicator(self, entry.algorithm, entry.name)
        out = entry.compression.reduce(tensor, entry.name, comm, entry.op == Average)
        return out * entry.postscale if entry.postscale != 1.0 else out

    def _record(self, entry, start, end, fused):
        t = entry.times
        self.records[entry.name] = {
            "algorithm": entry.algorithm, "compression": entry.meta["compression"], "dtype": entry.meta["dtype"],
            "nbytes": entry.staged.nbytes, "density": entry.meta["density"], "fused_with": fused - 1,
            "negotiate_s": t["go"] - t["enqueue"], "queue_s": start - t["go"], "run_s": end - start}
        self.timeline.tensor(entry.name, t["enqueue"], t["go"], start, end, entry.algorithm)

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self):
        self._fail(None, CommError("commlib was shut down while this tensor was waiting for the other ranks"))
        self.client.events.put(_STOP)
        self._thread.join(self.settings.timeout_s)
        if self._thread.is_alive():   # still inside a collective: its native state must outlive it
            log.warning("commlib: shutdown while a collective is still running; backends left open")
            self.client.close()
            return
        for backend in self.backends.values():
            try:
                backend.close()
            except Exception as exc:   # shutting down: report, keep closing the rest
                log.warning("commlib: closing backend %s: %s", backend.name, exc)
        self.client.close()
        if self._server is not None:
            self._server.join(self.settings.timeout_s)
        self.timeline.close()


def _within(timeout_s, what, fn, *args):
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


def _fuse(entries, threshold):
    """Consecutive entries of the same kind, each group at most `threshold` bytes."""
    group, size = [], 0
    for entry in entries:
        nbytes = entry.staged.nbytes
        key = entry.fusion_key()
        if group and (key is None or key != group[0].fusion_key() or size + nbytes > threshold):
            yield group
            group, size = [], 0
        group.append(entry)
        size += nbytes
    if group:
        yield group



# -- the module-level API (commlib/__init__.py re-exports it) ---------------------------------------
_runtime = None
_init_lock = threading.Lock()


def init(policy=None, **settings):
    """Start commlib on this rank (idempotent). `policy`: a Policy or its text; other keyword
    arguments are settings (see commlib.settings). COMMLIB_<NAME> variables override both."""
    global _runtime
    args = (policy, settings)
    with _init_lock:
        if _runtime is not None:
            if args != _runtime.init_args and (policy is not None or settings):
                log.warning("commlib.init() was called again with other arguments, which are ignored: "
                            "call commlib.shutdown() first to change them")
            return
        registry()                       # backends declare their settings on import
        text = policy if isinstance(policy, str) else None
        resolved = Settings(settings if text is None else dict(settings, policy=text))
        if not isinstance(policy, Policy) or "COMMLIB_POLICY" in os.environ:
            policy = Policy.parse(resolved.policy)
        _runtime = Runtime(resolved, policy)
        _runtime.init_args = args
        atexit.register(shutdown)


def shutdown():
    global _runtime
    with _init_lock:
        if _runtime is not None:
            runtime, _runtime = _runtime, None
            runtime.shutdown()


def is_initialized():
    return _runtime is not None


def runtime():
    if _runtime is None:
        raise CommError("commlib is not initialized: call commlib.init() first")
    return _runtime


def rank():
    return runtime().topology.rank


def size():
    return runtime().topology.size


def local_rank():
    return runtime().topology.local_rank


def local_size():
    return runtime().topology.local_size


def allreduce_async(tensor, name=None, op=Average, algorithm=None, compression=None,
                    prescale_factor=1.0, postscale_factor=1.0):
    """Start reducing `tensor` across ranks; returns a Handle for synchronize()/poll()."""
    return runtime().allreduce_async(tensor, name, op, algorithm, compression,
                                     float(prescale_factor), float(postscale_factor))


def synchronize(handle):
    """Wait for a Handle; returns the reduced tensor (same type, device, dtype, shape)."""
    return handle.wait()


def poll(handle):
    """True when the handle's result is ready."""
    return handle.done()


def allreduce(tensor, name=None, op=Average, algorithm=None, compression=None,
              prescale_factor=1.0, postscale_factor=1.0):
    """Reduce `tensor` across ranks (Average by default) and return the result."""
    return synchronize(allreduce_async(tensor, name, op, algorithm, compression, prescale_factor, postscale_factor))


def records():
    """Per tensor name, the last dispatch: algorithm, compression, bytes, block density (as `auto`
    measured it, or as omnireduce saw it: of the fused buffer when fused), timings."""
    return dict(runtime().records)


def backend_stats():
    """Counters of every running backend (bytes, packets, resends, ...)."""
    return {name: backend.stats() for name, backend in runtime().backends.items()}
