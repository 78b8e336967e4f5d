"""The module-level API (commlib/__init__.py re-exports it): init once per process, then allreduce."""
import atexit
import functools
import logging
import os
import sys
import threading

from commlib import differentiable
from commlib.backends import registry
from commlib.errors import CommError, ConfigError
from commlib.executor import Average, Max, Min, Product, Sum
from commlib.handles import Handle
from commlib.policy import Policy
from commlib.process_sets import ProcessSet
from commlib.runtime import Runtime
from commlib.settings import Settings

log = logging.getLogger("commlib")
_runtime = None
_init_lock = threading.Lock()

__all__ = ["Average", "Sum", "Min", "Max", "Product", "Handle", "init", "shutdown", "is_initialized", "runtime",
           "rank", "size", "local_rank", "local_size", "ProcessSet", "add_process_set", "allreduce_async", "join",
           "grouped_allreduce_async", "grouped_allreduce", "synchronize", "poll", "allreduce", "records",
           "backend_stats", "start_timeline", "stop_timeline"]


def init(policy=None, **settings):
    """Start commlib on this rank (idempotent). `policy`: a Policy or its text; other keyword
    arguments are settings (see commlib.settings). COMMLIB_<NAME> variables override both."""
    start(policy, settings)


def start(policy, settings, join=None):
    """init(); join(settings) -> (Context, ControllerClient, server) forms the job where the caller
    knows it better than the launcher's environment (commlib's torch.distributed backend)."""
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
        _runtime = Runtime(resolved, policy, job=join(resolved) if join else None)
        _runtime.init_args = args
        atexit.register(shutdown)
        if sys.excepthook is not _excepthook:
            _excepthook.previous, sys.excepthook = sys.excepthook, _excepthook


def shutdown():
    """End commlib on this rank. Called while an exception is handled, or at exit after an uncaught
    one, it tells the other ranks that this rank failed and why, so they fail at once too."""
    global _runtime
    with _init_lock:
        if _runtime is not None:
            runtime, _runtime = _runtime, None
            runtime.shutdown(_failure())


_uncaught = None   # the exception that ended the main thread, seen by _excepthook before atexit's shutdown


def _excepthook(kind, value, traceback):
    global _uncaught
    _uncaught = value
    _excepthook.previous(kind, value, traceback)


def _failure():
    """'Type: message' of the error this rank is failing with, or None."""
    error = sys.exc_info()[1] or _uncaught
    if error is None or isinstance(error, SystemExit):
        return None
    return f"{type(error).__name__}: {error}"


def is_initialized():
    return _runtime is not None


def runtime():
    if _runtime is None:
        raise CommError("commlib is not initialized: call commlib.init() first")
    return _runtime


def rank():
    return runtime().ctx.rank


def size():
    return runtime().ctx.size


def local_rank():
    return runtime().ctx.local_rank


def local_size():
    return runtime().ctx.local_size


def add_process_set(process_set):
    """Horovod's hvd.add_process_set for commlib: returns the ProcessSet (from a ProcessSet, a
    Horovod one, or a list of ranks) that `process_set=` reduces over. Its ranks form it now, so
    each of them must call this, in the same order for all its sets; other ranks only get the object."""
    process_set = process_set if hasattr(process_set, "ranks") else ProcessSet(process_set)
    rt = runtime()
    if isinstance(process_set, ProcessSet):
        process_set.context = rt.ctx
    if process_set.ranks is not None and rt.ctx.rank in process_set.ranks:
        rt.process_sets.runtime(process_set)
    return process_set


def allreduce_async(tensor, name=None, op=Average, algorithm=None, compression=None,
                    prescale_factor=1.0, postscale_factor=1.0, policy=None, process_set=None):
    """Start reducing `tensor` across ranks; returns a Handle for synchronize()/poll(). For a torch
    tensor that requires grad the result is differentiable, as Horovod's allreduce is.
    `algorithm`/`compression` force a choice; otherwise `policy` (a Policy or its text; default:
    commlib.init's) picks them from the name, size and dtype. `process_set`: reduce over those
    ranks only (a commlib.ProcessSet or Horovod's; only its ranks may call), default every rank."""
    if isinstance(policy, str):
        policy = _parsed(policy)
    if name is not None:   # the steady state, a step's hundreds of calls: the same as this name's last one
        over = runtime() if process_set is None else runtime().process_sets.runtime(process_set)
        handle = over.again(tensor, name, op, algorithm, compression, policy, prescale_factor, postscale_factor)
        if handle is not None:
            return handle
    return submit([tensor], [name], op, algorithm, compression, prescale_factor, postscale_factor, policy,
                  process_set)[0]


def grouped_allreduce_async(tensors, names=None, op=Average, algorithm=None, compression=None,
                            prescale_factor=1.0, postscale_factor=1.0, policy=None, process_set=None):
    """allreduce_async of several tensors at once (Horovod's grouped_allreduce): one message to the
    controller, so they are released together and fused into as few collectives as they allow.
    `names`: one per tensor (or None). Returns their Handles."""
    return submit(tensors, names, op, algorithm, compression, prescale_factor, postscale_factor, policy,
                  process_set)


def submit(tensors, names=None, op=Average, algorithm=None, compression=None, prescale_factor=1.0,
           postscale_factor=1.0, policy=None, process_set=None, hurry=False):
    """grouped_allreduce_async; `hurry`: the caller waits for these next (a synchronous call, DDP's last
    bucket), so they go to the controller now, from this thread, to be released at once (Handle.hurry
    without a second message or the sender thread's wake-up)."""
    if isinstance(policy, str):
        policy = _parsed(policy)
    names = [None] * len(tensors) if names is None else list(names)
    if len(names) != len(tensors):
        raise ConfigError(f"grouped_allreduce: {len(tensors)} tensors but {len(names)} names")
    over = runtime()
    if process_set is not None:
        over = over.process_sets.runtime(process_set)
    handles = over.grouped_allreduce_async(tensors, names, op, algorithm, compression, float(prescale_factor),
                                           float(postscale_factor), policy, hurry)
    for tensor, handle in zip(tensors, handles):
        if differentiable.wants_grad(tensor):   # as Horovod's: backward reduces the gradient the same way
            reduce_grad = lambda grad, name=handle.name: allreduce(grad, f"{name}.grad", op, algorithm, compression,
                                                                    prescale_factor, postscale_factor, policy,
                                                                    process_set)
            handle.then(lambda out, tensor=tensor, reduce_grad=reduce_grad:
                        differentiable.attach(tensor, out, reduce_grad))
    return handles


@functools.lru_cache(maxsize=64)
def _parsed(text):
    """A policy's text parsed once: the same Policy object, call after call (what plans are kept by)."""
    return Policy.parse(text)


def grouped_allreduce(tensors, names=None, op=Average, algorithm=None, compression=None,
                      prescale_factor=1.0, postscale_factor=1.0, policy=None, process_set=None):
    """Reduce several tensors at once (see grouped_allreduce_async); returns their results."""
    return [synchronize(h) for h in submit(tensors, names, op, algorithm, compression, prescale_factor,
                                           postscale_factor, policy, process_set, hurry=True)]


def synchronize(handle):
    """Wait for a Handle; returns the reduced tensor (same type, device, dtype, shape)."""
    return handle.wait()


def poll(handle):
    """True when the handle's result is ready."""
    return handle.done()


def allreduce(tensor, name=None, op=Average, algorithm=None, compression=None,
              prescale_factor=1.0, postscale_factor=1.0, policy=None, process_set=None):
    """Reduce `tensor` across ranks (Average by default: over the process set's size when one is
    given) and return the result."""
    return synchronize(submit([tensor], [name], op, algorithm, compression, prescale_factor, postscale_factor,
                              policy, process_set, hurry=True)[0])


def join():
    """Horovod's hvd.join: this rank is out of data. Until every rank has joined, the others'
    allreduces go on without it (it contributes zeros, or for min, max and product the op's identity,
    so Average still divides by the job's size, as Horovod's). Blocks until every rank joined;
    returns the rank that joined last. Row-sparse tensors cannot be reduced while a rank is joined."""
    return runtime().join()


def records():
    """Per tensor name, the last dispatch: algorithm, compression, bytes, block density (as `auto`
    measured it, or as omnireduce saw it: of the fused buffer when fused), timings: negotiate_s,
    queue_s, run_s = process_s (fusion, scaling, compression on this worker) + transfer_s (the
    algorithm's collectives: network, switch and aggregators), and transfer_s = server_queue_s +
    server_proc_s + network_s where the algorithm has a server that stamps its results (switchml,
    omnireduce; None otherwise): see commlib.executor.Phases. The 65536 names run most recently
    (commlib.executor.RECORDS_KEPT: a program that makes up names keeps its memory bounded)."""
    return runtime().records.snapshot()


def start_timeline(path):
    """Write a Chrome trace of every tensor's phases to `path` from now on ('{rank}' in the path:
    one file per rank, else rank 0 only), as Horovod's hvd.start_timeline; see commlib.timeline."""
    runtime().set_timeline(path)


def stop_timeline():
    """End the trace that start_timeline or the `timeline` setting began."""
    runtime().set_timeline("")


def backend_stats():
    """Counters of every running backend (bytes, packets, resends, ...)."""
    return {name: backend.stats() for name, backend in runtime().backends.items()}
