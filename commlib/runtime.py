"""The runtime wires the steps a gradient travels through, each its own module:

    bootstrap (the job)  ->  dispatch (a plan per tensor)  ->  controller (every rank agrees)
    ->  executor (fuse, run the backend or compressor, scale, record)  ->  handles

`grouped_allreduce_async` is the caller's side: stage each tensor, plan it, submit the plans.
"""
import itertools
import logging
import os
import threading
import time

from commlib import bootstrap, differentiable, study
from commlib.backends import start_all
from commlib.context import check_world, initialized_horovod, world_group
from commlib.dispatch import Dispatcher
from commlib.errors import CommError, CommTimeout, ConfigError, InvalidTensor
from commlib.executor import HOROVOD_OPS, OPS, Average, Entry, Executor, Sum
from commlib.handles import Handle
from commlib.process_sets import ProcessSet, ranks_of
from commlib.tensors import Staged

log = logging.getLogger("commlib")
REPEATS_KEPT = 4096   # names whose last submission is kept (Repeat)
UNNAMED = "allreduce.noname"   # the record of every unnamed call (each travels under a name of its own)


class Runtime:
    """The job's (or, with job= and parent=, a process set's: see ProcessSets)."""

    def __init__(self, settings, policy, job=None, parent=None):
        self.settings = settings
        self.ctx, self.client, self._server = job or bootstrap.join(settings)
        self._hurry = self.client.hurry   # every Handle's on_wait: one bound method, not one a tensor
        self.timeline = parent.timeline if parent else _timeline(study.trace_path(settings), self.ctx.rank)
        self.backends, self.unavailable = start_all(self.ctx)
        self.dispatcher = Dispatcher(self.backends, self.unavailable, policy, settings)
        self.executor = Executor(self.ctx, self.client, self.dispatcher, self.timeline)
        if parent is not None:   # one commlib.records() and one timeline for the job and its sets
            self.executor.records = parent.records
        self.process_sets = ProcessSets(self)
        self._is_set = parent is not None
        # horovodrun's elastic mode: Horovod's world may change at a reset (see _check_world)
        self._elastic = not self._is_set and self.ctx.launcher == "horovod" and os.environ.get("HOROVOD_ELASTIC") == "1"
        if not self._is_set:
            self._watch_daemons()
        self._names = itertools.count()
        self._repeats = {}   # name -> its last submission, where the next one may repeat it (Repeat)
        self._wait_s = settings.negotiation_timeout_s + 3 * settings.timeout_s + 10   # a Handle's longest wait
        self._checked_group = False   # the process group check_world last passed for (None: none)

    def backend(self, name):
        return self.dispatcher.backend(name)

    def set_timeline(self, path):
        old, self.timeline = self.timeline, _timeline(path, self.ctx.rank)
        self.executor.timeline = self.timeline
        for runtime in self.process_sets.runtimes():   # they write into the job's
            runtime.timeline = runtime.executor.timeline = self.timeline
        old.close()
        self._watch_daemons()

    def _watch_daemons(self):
        self.timeline.watch({row: fn for backend in self.backends.values()
                             for row, fn in backend.daemon_counters().items()})

    @property
    def records(self):
        return self.executor.records

    def grouped_allreduce_async(self, tensors, names, op, algorithm, compression, prescale, postscale, policy=None,
                                hurry=False):
        """Handles for tensors submitted in one message: they are negotiated, released and fused
        together (`hurry`: at once, see api.submit). A tensor refused here is refused on every rank;
        this rank raises its error."""
        self._check_world()
        entries, metas, refused = [], [], None
        for index, (tensor, name) in enumerate(zip(tensors, names)):
            named, name = name is not None, name or f"{UNNAMED}.{next(self._names)}"   # unique while in flight
            # its place in the group, the order the group is released and fused in: a new order is
            # negotiated anew (DDP rebuilds its buckets after the first step; their parameters' views
            # then fuse in place, and the result is the bucket without a copy)
            call = _call(op, algorithm, compression, policy, prescale, postscale, index if len(tensors) > 1 else None)
            repeat = self._repeats.get(name) if named else None
            staged = repeat.again(tensor, call, self.dispatcher) if repeat is not None else None
            if staged is not None:   # the call of its last step: planned and described as then
                op_name, plan, compressor, meta = repeat.op, repeat.plan, None, repeat.meta
            else:
                try:
                    staged, op_name, plan, compressor = self._plan(tensor, name, named, op, algorithm, compression,
                                                                    policy)
                except Exception as exc:   # the other ranks wait for this tensor: tell them why it never comes
                    if not isinstance(exc, CommError):   # a refusal nobody foresaw: still this tensor's, on every rank
                        exc = InvalidTensor(f"tensor {name!r} cannot be reduced ({type(exc).__name__}: {exc})")
                    metas.append({"name": name, "error": {"kind": type(exc).__name__, "message": str(exc)}})
                    refused = refused or exc
                    continue
                meta = self._meta(name, named, staged, op_name, plan, call)
                if named and Repeat.fits(staged, plan, compressor, tensor):
                    self._remember(name, Repeat(call, staged.again(), op_name, plan, meta))
            handle = Handle(name, self._wait_s, self._hurry)
            entries.append(Entry(staged, name, op_name, plan, compressor, prescale, postscale, handle,
                                 None if named else UNNAMED))
            metas.append(meta)
        self._send(entries, metas, hurry)
        if refused is not None:
            raise refused
        return [entry.handle for entry in entries]

    def again(self, tensor, name, op, algorithm, compression, policy, prescale, postscale):
        """allreduce_async's steady state: the Handle of a named tensor whose call repeats its last
        one (Repeat), sent as then, without a group's lists and loops (a step's hundreds of calls:
        a microsecond each); None where it does not repeat it (grouped_allreduce_async plans it)."""
        repeat = self._repeats.get(name)
        if repeat is None:
            return None
        self._check_world()
        call = _call(op, algorithm, compression, policy, float(prescale), float(postscale))
        staged = repeat.again(tensor, call, self.dispatcher)
        if staged is None:
            return None
        handle = Handle(name, self._wait_s, self._hurry)
        self._send((Entry(staged, name, repeat.op, repeat.plan, None, call[5], call[6], handle),), (repeat.meta,))
        return handle

    def _send(self, entries, metas, hurry=False):
        """Track a submission's entries and send their metas: all in flight, or none."""
        self.executor.track(entries)   # raises the job's fatal error, if any
        try:
            self.client.submit(metas, hurry)
        except BaseException as exc:   # never sent: nothing of this call stays in flight
            self.executor.fail([entry.name for entry in entries], exc)
            raise

    @staticmethod
    def _meta(name, named, staged, op, plan, call):
        """What this rank submits of a tensor for every rank to agree on."""
        *_, prescale, postscale, place = call
        meta = {"name": name, "shape": list(staged.shape), "dtype": staged.dtype_name, "op": op,
                "choices": plan.choices, "compression": plan.compression, "side": plan.side,
                "prescale": prescale, "postscale": postscale, "rows": plan.rows, "report": plan.report}
        if not named:   # an unnamed call's name is never submitted again: not worth a cache bit
            meta["once"] = True
        if place is not None:
            meta["index"] = place
        return meta

    def _remember(self, name, repeat):
        if len(self._repeats) >= REPEATS_KEPT:   # a program that makes up names: kept bounded (one step, safe
            self._repeats.clear()                # beside another thread's submission)
        self._repeats[name] = repeat

    def join(self):
        """commlib.join: wait, running the others' tensors with stand-ins, until every rank joined.
        The others may run for long (uneven data): this fails only when no tensor came for
        the negotiation timeout (a rank that neither reduces nor joins)."""
        handle = self.executor.start_join()
        try:
            self.client.join()
            limit, since = self.settings.negotiation_timeout_s, time.monotonic()
            while not handle.done():
                idle = time.monotonic() - max(since, self.executor.last_go)
                if idle > limit:
                    raise CommTimeout(f"commlib.join: no tensor was released for {limit:.0f}s and not every rank "
                                      f"joined; every rank must call commlib.join() once out of data "
                                      f"(raise COMMLIB_NEGOTIATION_TIMEOUT_S if a rank is just slow)")
                handle.done(wait_s=min(1.0, limit - idle))
            return handle.wait()
        finally:
            self.executor.end_join(handle)

    def _check_world(self):
        """A process group formed after commlib's job (Lightning's, around a CommlibState built
        early) must not leave commlib reducing over another world. An elastic reset gives Horovod a
        new world: a job formed for the old one would fail (or hang) on every call, and
        hvd.elastic.run would reset again and again."""
        if not self._is_set and not self._elastic:
            group = world_group()
            if group != self._checked_group:   # checked once per process group
                check_world(self.ctx)
                self._checked_group = group
        if not self._elastic:
            return
        hvd = initialized_horovod()
        if hvd is not None and (hvd.rank(), hvd.size()) != (self.ctx.rank, self.ctx.size):
            raise ConfigError(f"Horovod's world changed under commlib (now rank {hvd.rank()} of {hvd.size()}, commlib's "
                              f"job: rank {self.ctx.rank} of {self.ctx.size}): in an elastic job call "
                              f"commlib.elastic.register(state) so that commlib re-forms at each reset")

    def _plan(self, tensor, name, named, op, algorithm, compression, policy):
        """(Staged, op name, Plan, compressor) for a tensor, or the error that refuses it."""
        op = reduction(op)
        if op not in (Sum, Average) and differentiable.wants_grad(tensor):
            raise ConfigError(f"tensor {name!r}: op={op} is not differentiable here; reduce tensor.detach(), "
                              f"or use Sum or Average")
        staged = Staged(tensor).read()   # op=Average on integers truncates toward zero, as Horovod's (executor.scaled)
        plan, compressor = self.dispatcher.plan(name, staged, algorithm, compression, policy, op, remember=named)
        if compressor is not None and not named:
            raise ConfigError(f"compressed tensors need a name= that is the same at every step: error feedback "
                              f"and random streams are kept per name (compression {plan.compression})")
        return staged, op, plan, compressor

    def shutdown(self, error=None):
        """error: why this rank leaves, when it fails (text): the other ranks get it at once."""
        self.client.leave(error)
        self.process_sets.shutdown(error)
        if not self.executor.stop(self.settings.timeout_s):   # still inside a collective: its native state must outlive it
            log.warning("commlib: shutdown while a collective is still running; backends left open")
            self.client.close()
            return
        found = None
        if not self._is_set:   # a set writes into the job's timeline
            self.timeline.close()   # before the backends: its last sample asks the switch and aggregators
            found = self._study(study.gather, self.ctx)
        for backend in self.backends.values():
            try:
                backend.close()
            except Exception as exc:   # shutting down: report, keep closing the rest
                log.warning("commlib: closing backend %s: %s", backend.name, exc)
        self.client.close()
        if self._server is not None:
            self._server.join(self.settings.timeout_s)
        if found is not None:   # rank 0, the job closed: the other ranks are not kept waiting
            self._study(study.report, found)

    def _study(self, step, *args):
        try:
            return step(*args)
        except Exception as exc:   # shutting down: the job's own work is done; say why there is no study
            log.warning("commlib: the study of this job (%s) failed: %s", self.settings.study, exc)


def _call(op, algorithm, compression, policy, prescale, postscale, place=None):
    """What a submission asks of a tensor, compared with its name's last (Repeat). (op=True equals 1, is no op.)"""
    return op, type(op), algorithm, compression, policy, prescale, postscale, place


class Repeat:
    """A named tensor's last submission: the same call at its next step (a model's hundreds of
    parameters, every step) takes its plan and its meta as they were, the meta the same object (the
    client's response cache then knows it at a glance), and only reads the new tensor. It keeps the
    tensor's description (Staged.again()), none of its memory."""

    __slots__ = ("call", "description", "op", "plan", "meta")

    def __init__(self, call, description, op, plan, meta):
        self.call, self.description, self.op, self.plan, self.meta = call, description, op, plan, meta

    @staticmethod
    def fits(staged, plan, compressor, tensor):
        """Whether a submission may be repeated: a dense tensor outside autograd's tape whose plan is
        settled (no density measured at each step, no report of `auto`'s, no compressor's state)."""
        return staged.sparse is None and compressor is None and plan.density is None and plan.report is None \
            and not differentiable.wants_grad(tensor)

    def again(self, tensor, call, dispatcher):
        """The Staged of `tensor`, read, where this call repeats the last one; else None (plan it)."""
        if call != self.call or dispatcher.reports.waiting(self.meta["name"]):
            return None
        staged = self.description.again(tensor)
        if staged is None or (staged.torch and tensor.requires_grad):
            return None
        return staged.read()


class ProcessSets:
    """The sets a job's Runtime formed on this rank, by their ranks."""

    def __init__(self, parent):
        self.parent = parent
        self._runtimes = {}
        self._lock = threading.Lock()

    def runtime(self, process_set):
        """The Runtime that reduces over `process_set` (the job's own for None or every rank)."""
        ranks = ranks_of(process_set, self.parent.ctx.size)
        if ranks is None:
            return self.parent
        rank = self.parent.ctx.rank
        if rank not in ranks:
            raise ConfigError(f"rank {rank} reduced a tensor over process set {list(ranks)}, which it is not in: only "
                              f"the set's ranks may (check process_set.included() first)")
        if isinstance(process_set, ProcessSet):
            process_set.context = self.parent.ctx
        with self._lock:
            if ranks not in self._runtimes:
                hvd_set = None if isinstance(process_set, ProcessSet) else process_set
                parent = self.parent
                job = bootstrap.join_set(parent.ctx, parent.client, ranks, hvd_set)
                self._runtimes[ranks] = Runtime(parent.settings, parent.dispatcher.policy, job=job, parent=parent)
            return self._runtimes[ranks]

    def runtimes(self):
        with self._lock:
            return list(self._runtimes.values())

    def shutdown(self, error=None):
        with self._lock:
            runtimes, self._runtimes = list(self._runtimes.values()), {}
        for runtime in reversed(runtimes):
            runtime.shutdown(error)


def _timeline(path, rank):
    from commlib.timeline import Timeline   # imported late: `python -m commlib.timeline` runs the module as __main__
    return Timeline(path, rank)


def reduction(op):
    """commlib's op name for commlib's constants or Horovod's (hvd.Sum, hvd.Min, ...)."""
    if op in OPS:
        return op
    if isinstance(op, int) and not isinstance(op, bool) and op in HOROVOD_OPS:
        return HOROVOD_OPS[op]
    if op == 2:
        raise ConfigError("op=Adasum is Horovod's own algorithm: use hvd.DistributedOptimizer(op=hvd.Adasum)")
    raise ConfigError(f"op={op!r}: use commlib.Sum, Average, Min, Max or Product (or Horovod's)")
