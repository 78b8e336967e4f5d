"""The runtime wires the steps a gradient travels through, each its own module:

    bootstrap (the job)  ->  dispatch (a plan per tensor)  ->  controller (every rank agrees)
    ->  executor (fuse, run the backend or compressor, scale, record)  ->  handles

`allreduce_async` is the caller's side: stage the tensor, plan it, submit the plan.
"""
import itertools
import logging

from commlib import bootstrap
from commlib.backends import start_all
from commlib.dispatch import Dispatcher
from commlib.errors import ConfigError, InvalidTensor
from commlib.executor import Average, Entry, Executor, Sum
from commlib.handles import Handle
from commlib.tensors import Staged
from commlib.timeline import Timeline

log = logging.getLogger("commlib")


class Runtime:
    def __init__(self, settings, policy):
        self.settings = settings
        self.ctx, self.client, self._server = bootstrap.join(settings)
        self.timeline = Timeline(settings.timeline, self.ctx.rank)
        self.backends, self.unavailable = start_all(self.ctx)
        self.dispatcher = Dispatcher(self.backends, self.unavailable, policy, settings)
        self.executor = Executor(self.ctx, self.client, self.dispatcher, self.timeline)
        self._names = itertools.count()

    def backend(self, name):
        return self.dispatcher.backend(name)

    @property
    def records(self):
        return self.executor.records

    def allreduce_async(self, tensor, name, op, algorithm, compression, prescale, postscale, policy=None):
        if self.executor.broken:
            raise self.executor.broken
        if op not in (Sum, Average):
            raise ConfigError(f"op={op!r}: use commlib.Sum or commlib.Average")
        named, name = name is not None, name or f"allreduce.noname.{next(self._names)}"
        staged = Staged(tensor)
        if op == Average and staged.travel_dtype.kind in "iu":
            raise InvalidTensor(f"tensor {name!r}: op=Average on {staged.dtype_name} would truncate; use op=commlib.Sum")
        plan, compressor = self.dispatcher.plan(name, staged, algorithm, compression, policy)
        if compressor is not None and not named:
            raise ConfigError(f"compressed tensors need a name= that is the same at every step: error feedback "
                              f"and random streams are kept per name (compression {plan.compression})")
        s = self.settings
        handle = Handle(name, s.negotiation_timeout_s + 3 * s.timeout_s + 10)
        entry = Entry(staged, name, op, plan, compressor, prescale, postscale, handle)
        self.executor.track(entry)
        self.client.submit([{"name": name, "shape": list(staged.shape), "dtype": staged.dtype_name, "op": op,
                             "choices": plan.choices, "compression": plan.compression, "density": plan.density,
                             "prescale": prescale, "postscale": postscale}])
        return handle

    def shutdown(self):
        if not self.executor.stop(self.settings.timeout_s):   # still inside a collective: its native state must outlive it
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
