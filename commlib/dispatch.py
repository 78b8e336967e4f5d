"""Dispatch: which algorithm, and which compressor, carries each tensor. The one place that decides.

In the manner of Horovod's OperationManager: for each kind of data, an ordered list of algorithms
(`carriers(kind)`, best first, from each backend's own `carries`); the first one that runs in this
job and is enabled for the tensor wins.
Policy rules only filter and reorder that list (a rule names an algorithm, `auto` keeps the order,
a compressor turns the data into its payload kind). The result is one `Plan` per tensor, which
every rank submits and the controller compares and settles (`settle`) before any data moves.

A plan may depend on the measured block density (`auto`, and rules such as
`emb.*[density<0.05]=omnireduce`): each rank measures its own tensor, so its plan holds a list of
choices, (bound, algorithm) pairs, and the controller takes the first whose bound lies above the
densest rank's density. A rank submits only which side of the bounds it lies on (`side_of`; the
controller takes the max over ranks: the same choice), so a tensor whose side stays the same
submits the same metadata step after step, which the controller's response cache keeps.

A dense tensor under `auto` (no rule or caller naming an algorithm) lists the dense carriers that run
and take it as ("traffic", algorithm) choices after the sparse carrier's density bound: the
controller picks among them (`_settle_dense`): the one measured fastest on early steps for its group
(dtype, size band; commlib.trials), or the one under trial on this release.

Row-sparse tensors (torch sparse COO gradients, commlib.sparse.RowSparse) travel as (rows, values):
`auto` lists the row carriers and the best dense algorithm as ("traffic", algorithm) choices, each
rank adds what it measured (its rows, a sketch of them), and the controller takes the algorithm
that commlib.traffic estimates moves the fewest bytes per worker (`settle_release`), or, where
others come within a margin of it, the one measured fastest on early steps (commlib.trials); a density
rule there compares the row density (touched rows / rows). The hot/cold split is weighed from the
hot set its last window of counts agreed on (none before the first window ends: it then costs what
its cold carrier costs and loses the tie); the executor counts the rows of every tensor `auto`
weighed it for, whichever algorithm carried them, so the windows end alike on every rank.
"""
import math
from dataclasses import dataclass, replace

import numpy as np

from commlib import compressors, sparse, traffic
from commlib.backends import TensorMeta, carriers, registry
from commlib.errors import BackendUnavailable, ConfigError, InvalidTensor
from commlib.release import Release
from commlib.tensors import nbytes as tensor_bytes
from commlib.trials import Reports, Trials

TRAFFIC = "traffic"   # the bound of choices the traffic model settles
SMALL_BYTES = 1 << 16   # `auto`: dense tensors below this size are tried and kept together (_settle_dense)


PLANS_KEPT = 4096


@dataclass(frozen=True)
class Plan:
    """What every rank must agree on for one tensor, besides its shape, dtype, op and scaling."""
    choices: tuple            # ((bound or None, algorithm), ...); the last one has no bound
    compression: str = None   # the compressor's canonical text (its repr), None for none
    density: float = None     # this rank's measured block density, when the choices depend on it (records)
    side: int = None          # what it submits of it: the index of the first choice above it (side_of)
    note: str = None          # why the policy's choice was not taken, for commlib.records()
    rows: dict = None         # a row-sparse tensor's measurements for the traffic model (not agreed)
    report: dict = None       # this rank's time of its last run `auto` asked about (commlib.trials.Reports)

    @property
    def algorithm(self):
        """The algorithm, when no density decides it."""
        return self.choices[0][1] if len(self.choices) == 1 else None


def settler(settings):
    """The controller's settle for one job: `settle_release` with `auto`'s trials kept across releases."""
    trials = Trials.of(settings)
    return lambda name, metas: settle_release(name, metas, trials)


def settle_release(name, metas, trials=None):
    """The controller's release of a tensor every rank submitted (metas in rank order): its name,
    the algorithm, for traffic choices the model's estimate, and with `trials` (commlib.trials.Trials)
    the candidate measured fastest, or the one under trial on this release."""
    algorithm, estimate, auto = _settle_metas(name, metas, trials)
    rows = all(meta.get("rows") for meta in metas)   # row-sparse: every rank's row count, for the allgather
    return Release(name, algorithm, estimate, [meta["rows"]["rows"] for meta in metas] if rows else None,
                   auto=auto)


def _settle_metas(name, metas, trials):
    if metas[0].get("once"):   # an unnamed call's name never comes again, nor its run's report: the model decides
        trials = None
    choices = metas[0]["choices"]
    bound, algorithm = choices[max(_side(meta, choices) for meta in metas)]
    if bound != TRAFFIC:   # a density rule, or a plan with one choice
        return algorithm, None, None
    weighed = [algorithm for bound, algorithm in choices if bound == TRAFFIC]
    if not metas[0].get("rows"):
        return _settle_dense(name, weighed, metas, trials)
    stats = [meta["rows"] for meta in metas]
    if trials is not None:
        group = _group(weighed, stats)
        kept = trials.kept(group, [meta.get("report") for meta in metas], name)
        if kept is not None:   # the measured choice stands: the model need not run (nor hotcold's windows count)
            return kept[0], None, kept[1]
    if all("sketch" in s for s in stats):
        estimate = estimate_traffic(stats, weighed)
        ranked = sorted(((a, max(estimate[a]["up"], estimate[a]["down"])) for a in weighed), key=lambda ac: ac[1])
    else:   # ranks under a kept choice sent counts only (Dispatcher._row_stats): the model cannot weigh them,
        # and where a group must form, the tensor runs that choice once more (the sketches come next time)
        last = next((s["kept"] for s in stats if s.get("kept") in weighed), weighed[0])
        estimate, ranked = None, [(a, None) for a in sorted(weighed, key=lambda a: a != last)]
    if trials is None:
        return ranked[0][0] if estimate is None else estimate["choice"], estimate, None
    algorithm, auto = trials.choose(group, ranked, name)
    return algorithm, estimate, auto


def _settle_dense(name, weighed, metas, trials):
    """A dense tensor's dense candidates (`auto`, Dispatcher._dense): the one kept or under trial, ranked
    by each one's bytes per worker (Backend.dense_traffic; equal costs in carriers order). The group:
    the same candidates, dtype and size (powers of 4 of its bytes; every tensor under SMALL_BYTES one
    band: their buckets' time is mostly per-collective latency, and a step whose small tensors took
    two algorithms runs twice the collectives)."""
    if trials is None:
        return weighed[0], None, None
    first = metas[0]
    nbytes = tensor_bytes(first["shape"], first["dtype"])
    band = "small" if nbytes < SMALL_BYTES else round(math.log(nbytes, 4))
    group = ("dense", tuple(weighed), first["dtype"], band)
    kept = trials.kept(group, [meta.get("report") for meta in metas], name)
    if kept is not None:
        return kept[0], None, kept[1]
    ranked = sorted(((a, registry()[a].dense_traffic(nbytes, len(metas))) for a in weighed), key=lambda ac: ac[1])
    algorithm, auto = trials.choose(group, ranked, name)
    return algorithm, None, auto


def _group(weighed, stats):
    """The row-sparse tensors `auto` decides together: the same candidates, table size (powers of 4)
    and densest rank's row density (powers of 4)."""
    first = stats[0]
    density = max(s["rows"] for s in stats) / max(1, first["nrows"])
    return ("rows", tuple(weighed), round(math.log(traffic.table_bytes(stats) or 1, 4)),
            math.floor(math.log(max(density, 1e-9), 4)))


def _side(meta, choices):
    """A rank's side of the bounds (a meta without one: measured nothing, dense)."""
    side = meta.get("side")
    return side_of(choices, None) if side is None else side


def side_of(choices, density):
    """The index of the first choice whose bound lies above `density` (None: measured nothing, which
    counts as dense; a traffic choice: the model decides). The max over ranks is the densest rank's."""
    for i, (bound, _) in enumerate(choices):
        if bound is None or bound == TRAFFIC or (density is not None and density < bound):
            return i
    raise AssertionError(f"choices {choices} end with a bounded choice")


def estimate_traffic(stats, algorithms):
    """commlib.traffic.estimate with each algorithm's own model (Backend.traffic)."""
    return traffic.estimate(stats, {algorithm: registry()[algorithm].traffic for algorithm in algorithms})


def settle(choices, densities):
    """The algorithm of a plan given every rank's measured density: the first choice whose bound
    lies above the densest rank's (a rank that measured nothing counts as dense)."""
    return choices[max(side_of(choices, density) for density in densities)][1]


class Dispatcher:
    """Plans tensors over the backends this job started (`backends`: name -> Backend)."""

    def __init__(self, backends, unavailable, policy, settings):
        self.backends, self.unavailable = backends, unavailable
        self.policy, self.settings = policy, settings
        self.reports = Reports(settings.auto_drift)   # the executor's measurements `auto` asked for
        self._plans = {}   # (name, shape, dtype, algorithm, policy, op) -> Plan, oldest first
        self.compressors = {}   # a plan's compression text -> the object that compressed it (state per name)
        for backend in backends.values():   # composite algorithms (hotcold) run over the others
            if hasattr(backend, "bind"):
                backend.bind(backends)

    def plan(self, name, staged, algorithm=None, compression=None, policy=None, op="sum", remember=True):
        """(Plan, compressor object or None) for a tensor. `algorithm`/`compression` given by the
        caller win over the policy; `policy` (a Policy) replaces commlib.init's for this tensor.
        A dense tensor's plan is remembered (unless `remember` is off: an unnamed call, whose name never
        comes again): the same tensor at the next step costs a lookup (a model's hundreds of parameters,
        every step), and a density measurement where its choices depend on one. The plan carries this rank's report of the
        tensor's last run where `auto` asked for one."""
        plan, compressor = self._known(name, staged, algorithm, compression, policy, op, remember)
        report = self.reports.take(name)
        return (plan if report is None else replace(plan, report=report)), compressor

    def _known(self, name, staged, algorithm, compression, policy, op, remember):
        key = None
        if remember and staged.sparse is None and compression is None:
            key = (name, staged.shape, staged.dtype_name, algorithm, policy, op)   # the key holds the policy: no id reuse
            known = self._plans.get(key)
            if known is not None:
                return (known if known.density is None else self._measured(known, staged)), None
        plan, compressor = self._plan(name, staged, algorithm, compression, policy, op)
        if key is not None and compressor is None and plan.rows is None:
            if len(self._plans) >= PLANS_KEPT:   # a program that makes up names: keep it bounded (one step,
                self._plans.clear()                # safe beside another thread's submission)
            self._plans[key] = plan
        return plan, compressor

    def _plan(self, name, staged, algorithm, compression, policy, op):
        meta = TensorMeta(name, tuple(staged.shape), str(staged.travel_dtype),
                          staged.numel * staged.travel_dtype.itemsize)
        chosen_by_caller = algorithm is not None or compression is not None
        if chosen_by_caller:
            bounded = ()
        else:
            rule = (policy or self.policy).choose(name, staged.nbytes, staged.dtype_name)
            algorithm, compression, bounded = rule.algorithm, rule.compression, rule.bounded
        if op not in ("sum", "average"):
            return self._reduction(meta, op, algorithm or "auto", compression, chosen_by_caller), None
        compressor = compressors.resolve(compression)
        if compressor is not None:
            self.compressors[repr(compressor)] = compressor
            return Plan(((None, self._compressed(compressor, algorithm or "auto", name)),), repr(compressor)), compressor
        if staged.sparse is not None:
            return self._rows(meta, staged.sparse, algorithm or "auto", bounded), None
        choices = tuple((bound, self._explicit(alg, meta)) for bound, alg in bounded)
        choices += self._dense(algorithm or "auto", meta)
        if all(bound in (None, TRAFFIC) for bound, _ in choices):   # no density bound: nothing to measure
            return Plan(choices), None
        return self._measured(Plan(choices), staged), None

    def _measured(self, plan, staged):
        """A dense plan whose choices depend on the density, with this step's (the choices are remembered,
        the density measured anew: it changes step to step)."""
        # the sparse choice's own measure; for a density rule among dense algorithms only, that of a
        # sparse algorithm running in the job (the block density the rules speak of)
        measure = next((alg for _, alg in plan.choices if self.backends[alg].sparse), None) or \
            next((alg for alg, backend in self.backends.items() if backend.sparse), None)
        if measure is None:
            raise ConfigError(f"a density rule ({plan.choices}) needs the block density a sparse algorithm "
                              f"(omnireduce) measures, and none runs here: {self.unavailable.get('omnireduce')}")
        density = self.backends[measure].density(staged.array)
        # not dataclasses.replace: every dense tensor `auto` decides comes here at every step
        return Plan(plan.choices, compression=plan.compression, density=density, side=side_of(plan.choices, density),
                    note=plan.note, rows=plan.rows, report=plan.report)

    def backend(self, name):
        """The running backend of that name, or the error that says why there is none."""
        try:
            return self.backends[name]
        except KeyError:
            if name not in registry():
                raise ConfigError(f"unknown algorithm {name!r}; choose one of {sorted(registry())} or 'auto'") from None
            raise BackendUnavailable(f"algorithm {name!r} is not available: {self.unavailable[name]}") from None

    # -- min, max, product: only algorithms that do that reduction, never a compressor ---------------
    def _reduction(self, meta, op, requested, compression, chosen_by_caller):
        able = [name for name in carriers("dense") if self._enabled(name, meta) and op in self.backends[name].ops]
        if chosen_by_caller and (compression is not None or (requested != "auto" and requested not in able)):
            what = f"compression {compression!r}" if compression is not None else f"algorithm {requested!r}"
            raise ConfigError(f"tensor {meta.name!r}: {what} cannot reduce with op={op}; leave it unset "
                              f"or choose one of {able}")
        if not able:
            raise InvalidTensor(f"tensor {meta.name!r}: no algorithm here reduces {meta.dtype} with op={op}")
        if requested in able and compression is None:
            return Plan(((None, requested),))
        asked = ":".join(filter(None, (None if requested == "auto" else requested, compression)))
        note = f"the policy's {asked} cannot reduce with op={op}; {able[0]} did" if asked else None
        return Plan(((None, able[0]),), note=note)

    # -- uncompressed tensors ------------------------------------------------------------------------
    def _dense(self, requested, meta):
        if requested != "auto":
            return ((None, self._explicit(requested, meta)),)
        enabled = [name for name in carriers("dense") if self._enabled(name, meta)]
        dense = [name for name in enabled if not self.backends[name].sparse]
        if not dense:
            raise InvalidTensor(f"tensor {meta.name!r}: no algorithm here reduces {meta.dtype}; "
                                f"cast it to float32, float64 or an int dtype")
        sparse = self._sparse_for(meta)
        below = ((self.settings.auto_sparse_density, sparse),) if sparse else ()
        if len(dense) > 1 and self.settings.auto_trial_samples > 0:   # measured: the controller picks (_settle_dense)
            return below + tuple((TRAFFIC, name) for name in dense)
        return below + ((None, dense[0]),)

    def _sparse_for(self, meta):
        """The sparse algorithm `auto` offers a dense tensor below its density bound: the first here that
        takes its dtype, for a tensor of auto_sparse_min_bytes or more as it travels; else None."""
        if meta.nbytes < self.settings.auto_sparse_min_bytes:
            return None
        return next((name for name in carriers("dense") if self._enabled(name, meta) and self.backends[name].sparse),
                    None)

    def measures_density(self, choice, meta):
        """Whether a dense tensor (`meta`: as it travels) that the policy gave `choice` (Policy.choose) is
        planned by its block density, measured at every step: a density rule, or `auto` with a sparse
        algorithm here that takes it."""
        return bool(choice.bounded) or (choice.compression is None and choice.algorithm == "auto" and
                                        self._sparse_for(meta) is not None)

    def _explicit(self, name, meta):
        backend = self.backend(name)
        if name not in carriers("dense"):
            raise ConfigError(f"tensor {meta.name!r}: algorithm {name!r} carries compressed or sparse payloads; "
                              f"give a compression= or choose one of {list(carriers('dense'))}")
        if not backend.enabled(meta):
            kinds = ", ".join(str(d) for d in backend.dtypes)
            raise InvalidTensor(f"tensor {meta.name!r}: algorithm {name!r} does not take {meta.dtype} "
                                f"tensors of {meta.nbytes} bytes (it reduces {kinds}); cast it or choose 'ring'")
        return name

    def _enabled(self, name, meta):
        return name in self.backends and self.backends[name].enabled(meta)

    # -- row-sparse tensors: row carriers, or the best dense algorithm on a table of row slots ---------
    def _rows(self, meta, rows, requested, bounded):
        density = rows.rows.size / rows.nrows if rows.nrows else 0.0
        count = {"rows": int(rows.rows.size)}   # every rank's reaches the release (the allgather's sizes)
        choices = tuple((bound, self._row_carrier(alg, meta)) for bound, alg in bounded)   # density rules first
        if requested != "auto":
            choices += ((None, self._row_carrier(requested, meta)),)
            return Plan(choices, density=density, side=side_of(choices, density), rows=count)
        candidates = [a for a in carriers("rows") if a in self.backends and _carries(self.backends[a], meta)]
        dense = [a for a in carriers("dense") if self._enabled(a, meta) and not self.backends[a].sparse]
        candidates += dense[:1]
        if not candidates:
            raise InvalidTensor(f"tensor {meta.name!r}: no algorithm here reduces sparse {meta.dtype} tensors")
        if len(candidates) == 1 and not choices:
            return Plan(((None, candidates[0]),), density=density, rows=count)
        choices += tuple((TRAFFIC, a) for a in candidates)
        return Plan(choices, density=density, side=side_of(choices, density),
                    rows=self._row_stats(rows, meta, candidates))

    def _row_carrier(self, name, meta):
        """An algorithm a policy names for a row-sparse tensor: one that reduces rows (a carrier of
        "rows"), or a dense one (the rows then travel as a table of slots); `allgather` means
        Horovod's sparse path."""
        name = "sparse_allgather" if name == "allgather" else name
        if "rows" in self.backend(name).carries:
            return name
        return self._explicit(name, TensorMeta(meta.name, meta.shape, "float32", meta.nbytes))

    def _row_stats(self, rows, meta, candidates):
        """What the traffic models need from this rank (commlib.traffic.estimate): the common
        measurements, and each candidate's own under its name (Backend.row_stats). Under a choice `auto`
        keeps (Reports.settled), the counts, which name the group, and that choice: the controller runs
        no model then, and the sketches cost a rank a fifth of its submission and the controller
        kilobytes a step (a revisit retries the group's candidates; a tensor that left its group runs
        its choice once more, and the ranks send the sketches next time)."""
        stats = {"rows": int(rows.rows.size), "nrows": rows.nrows, "width": rows.width,
                 "itemsize": rows.values.dtype.itemsize}
        kept = self.reports.settled(meta.name)
        if kept is not None:
            return {**stats, "kept": kept}
        stats["sketch"] = sparse.sketch(rows.rows)
        for algorithm in candidates:
            own = self.backends[algorithm].row_stats(meta.name, rows.rows, rows.nrows, rows.width)
            if own is not None:
                stats[algorithm] = own
        return stats

    # -- compressed tensors: the payload kind decides ------------------------------------------------
    def _compressed(self, compressor, requested, name):
        allowed = compressor.carriers()
        if requested != "auto":
            compressor.check_carrier(requested, f"tensor {name!r}")
            self.backend(requested)
            return requested
        for algorithm in allowed:
            if algorithm in self.backends:
                return algorithm
        raise BackendUnavailable(f"tensor {name!r}: compression {compressor.name!r} needs one of {allowed}, none of "
                                 f"which runs here ({'; '.join(f'{a}: {self.unavailable.get(a)}' for a in allowed)})")


def _carries(backend, meta):
    """The backend sums this dtype, natively or widened to float32 without loss."""
    dtype = np.dtype(meta.dtype)
    return dtype in backend.dtypes or (dtype.kind == "f" and dtype.itemsize < 4)

