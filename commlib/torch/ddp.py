"""DistributedDataParallel with commlib reducing the buckets: PyTorch's comm-hook contract.

    import torch.distributed as dist, commlib.torch as cl
    dist.init_process_group("gloo")     # torchrun's environment; commlib uses the same rendezvous
    model = DDP(net)
    state = cl.CommlibState(net.named_parameters(), policy="embedding.*=omnireduce;*=switchml")
    model.register_comm_hook(state, cl.ddp_comm_hook)

The hook hands each parameter's slice of the bucket to `commlib.grouped_allreduce_async` (one
message for the bucket) under the parameter's name, so the policy chooses per parameter, compressors keep their state per parameter
(robust to DDP rebuilding its buckets after the first step), and commlib's executor fuses the
slices of one algorithm back into one collective. From the second step, a bucket whose parameters
all follow one rule without a compressor travels whole, as DDP's own buckets do: one tensor for the
core instead of one per parameter (CommlibState's `whole_buckets`). The Future it returns is completed on commlib's
background thread when the bucket's last handle resolves, never by the hook, so DDP overlaps communication with backward
as with its own hooks, and wrappers such as `fp16_compress_wrapper(ddp_comm_hook)` compose.
"""
import functools
import itertools

import numpy as np
import torch

import commlib
from commlib.api import runtime, submit
from commlib.backends import TensorMeta
from commlib.context import placed
from commlib.errors import ConfigError
from commlib.executor import fused
from commlib.handles import when_all
from commlib.tensors import host_array, host_dtype, torch_dtype, viewable


# hook steps (CommlibState.iteration: equal on every rank, as each runs every backward) between the
# per-parameter runs of a density-planned bucket that travels whole; auto's revisits count those runs only
REMEASURE_EVERY = 50


class CommlibState:
    """What `ddp_comm_hook` needs across steps; pass it to `register_comm_hook(state, ddp_comm_hook)`.

    Tuning guide:

    1. ``policy`` (a commlib.Policy or its text; default: what ``commlib.init`` was given) picks
       the algorithm and compressor per parameter name, e.g.
       ``"embedding.*=omnireduce;*.weight=powersgd(rank=4);*=switchml"``. Start from the default
       ``*=auto`` (sparse tensors to omnireduce; dense ones to switchml or the ring, whichever its
       trials on the first steps measure faster), read ``commlib.records()`` to see what each
       parameter went through, then pin rules.
    2. ``algorithm`` / ``compression`` force one choice for every parameter, the policy aside
       (``compression="powersgd(rank=1)"`` is PyTorch's ``powerSGD_hook`` with commlib's
       algorithms underneath; ``fp16(...)`` composes specs).
    3. Bucket size is DDP's ``bucket_cap_mb``; commlib re-fuses up to ``COMMLIB_FUSION_THRESHOLD``
       what its controller releases together, once per ``COMMLIB_CYCLE_TIME_MS`` (1 ms). Smaller DDP
       buckets start communication earlier in backward, larger ones amortize the per-tensor
       negotiation with rank 0's controller. Where CPUs, not links, are the limit, a longer cycle
       makes fewer, larger collectives of many buckets (2 ranks on loopback, 19 buckets a backward:
       1.5-1.6x DDP's time at 1 ms, 0.92-0.97x at 10 ms); ``COMMLIB_AUTOTUNE=1`` tries 0.5 to 10 ms.
    4. PowerSGD: PyTorch needs ``start_powerSGD_iter >= 2`` because its memories are keyed by
       bucket and DDP rebuilds its buckets after the first step; commlib keys them by parameter
       name, so ``powersgd(start_iter=0)`` is safe. A fused bucket would be one flat vector, which
       PowerSGD cannot factor: one more reason the hook reduces per parameter.

    The state is built from the wrapped model's ``named_parameters()`` on every rank, with the
    same names, and starts commlib (``commlib.init()``: under torchrun the ring is a gloo group of
    the job's own rendezvous, and the embedded switch and aggregators need no configuration).
    Each state's tensors have names of their own, so two models can reduce in one backward (a
    GAN's generator and discriminator, both ``nn.Sequential``): the first state built in a process
    uses the parameters' names, later ones prefix them with ``ddp1.``, ``ddp2.``, ... in the order
    they are built (the same on every rank), and that is what policies and ``commlib.records()``
    see; ``prefix=`` chooses it. Initialize torch.distributed first if you want another backend than
    gloo (e.g. nccl): a job without a process group gets a gloo one from commlib. Where the rank is
    not known yet (Lightning builds the state before it starts its processes, which get no RANK),
    commlib starts at the first bucket, over the world of the process group DDP runs in.

    Cost: each parameter is one tensor for the core (about 30 us per parameter and step on
    loopback, benchmarks/bench_ddp_overhead.py); it buys per-name policies and PowerSGD on
    matrices. So from the second step (the first is DDP's own: it rebuilds its buckets after it, and a
    mismatch between ranks is named per parameter there) a bucket whose parameters all follow one rule
    without a compressor travels whole, under the name ``bucket(<first parameter>+<how many more>)``:
    ``commlib.records()`` shows its record under that name and under each of its parameters' (its
    ``nbytes`` the bucket's); ``state.record_names()`` lists each distinct record once.
    Parameters planned by their measured block density (a density rule, or ``auto`` on a tensor of
    ``auto_sparse_min_bytes`` or more) go per parameter until their runs settled a dense algorithm
    (``auto``'s trials done), then whole with the algorithm that carried most of their bytes, and
    per parameter again every ``REMEASURE_EVERY`` (50) steps, when their densities are measured:
    a bucket with a sparse gradient stays per parameter, its sparse one on omnireduce, but one that
    turns sparse while its bucket travels whole is seen at the next such step, and a density rule
    between two dense algorithms is applied only then. ``whole_buckets=False`` keeps every bucket per
    parameter; ``algorithm="auto"`` makes each bucket one tensor that ``auto`` plans.

    ``process_group``: the group DDP reduces over when it is not the world (``DDP(...,
    process_group=group)``, as PyTorch's own hooks take it for their state): the hook then averages
    over that group's ranks, a commlib process set. A GradBucket does not say which group its DDP
    uses, so a state without it averages over every rank.
    """

    __slots__ = (
        # hyperparameters
        "policy", "algorithm", "compression", "prefix", "whole_buckets", "process_group",
        # internal state
        "names", "_started", "_wholes", "_measuring", "_process_set",
        # statistics
        "iteration", "buckets_reduced", "bytes_reduced",
    )

    def __init__(self, named_parameters, policy=None, algorithm=None, compression=None, prefix=None,
                 whole_buckets=True, process_group=None):
        names = {}
        for item in named_parameters:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ConfigError(f"CommlibState needs the model's named_parameters(), (name, parameter) pairs; "
                                  f"it got a {type(item).__name__}: pass model.named_parameters(), not parameters()")
            name, param = item
            if id(param) in names:
                continue   # a shared parameter is reduced once, under its first name (as DDP does)
            names[id(param)] = name
        if not names:
            raise ConfigError("CommlibState needs the model's named_parameters(); it got none")
        if algorithm is not None and policy is not None:
            raise ConfigError("give CommlibState a policy or an algorithm, not both: algorithm= overrides every rule")
        self.policy = commlib.Policy.parse(policy) if isinstance(policy, str) else policy
        self.algorithm, self.compression = algorithm, compression
        if prefix is None:   # two models in one backward (a GAN's) may share parameter names
            built = next(_states)
            prefix = f"ddp{built}." if built else ""
        self.names = {key: prefix + name for key, name in names.items()}
        self.prefix, self.whole_buckets, self.process_group = prefix, whole_buckets, process_group
        self._process_set = None   # process_group's ranks as a commlib.ProcessSet, made at the first bucket
        # (parameter ids, dtype, length) of a bucket -> None (per parameter), or ((its name, its parameters'
        # names), its algorithm), the algorithm None where their runs choose it at each step (_kept)
        self._wholes = {}
        self._measuring = {}   # such a key -> whether that bucket last went per parameter
        self.iteration = self.buckets_reduced = self.bytes_reduced = 0
        self._started = False
        if placed():   # else (Lightning builds it before it starts the processes) at the first bucket
            self.start()

    def start(self):
        """Start commlib (once), in the job this process's placement gives (commlib.context.detect)."""
        if not self._started:
            commlib.init()
            self._started = True

    def name_of(self, param):
        try:
            return self.names[id(param)]
        except KeyError:
            raise ConfigError(f"a parameter of shape {tuple(param.shape)} in a DDP bucket is not among the "
                              f"named_parameters() CommlibState was built from; build it from the module "
                              f"DDP wraps") from None

    def whole(self, params, buffer):
        """((the name to reduce this bucket under as one tensor, its parameters' names), the
        algorithm it travels with); None to reduce it per parameter. The same on every rank: it
        depends on the step, the names, sizes and dtype, the policy, the job's settings and what the
        controller released for the parameters before (a policy that differs between ranks is named
        as a mismatch either way: names that do not pair up)."""
        if not self.whole_buckets or self.compression is not None or self.iteration < 1 or len(params) < 2 \
                or buffer.is_sparse:
            return None
        # the parameters live as long as the model, and the state with it; a wrapper may change the dtype
        key = (tuple(map(id, params)), buffer.dtype, buffer.numel())
        if key not in self._wholes:
            self._wholes[key] = self._whole(params, buffer)
        found = self._wholes[key]
        if found is None or found[1] is not None:
            return found
        algorithm = self._kept(found[0][1], torch_dtype(buffer.dtype)[0])   # planned by density
        self._measuring[key] = algorithm is None
        return None if algorithm is None else (found[0], algorithm)

    def _whole(self, params, buffer):
        if sum(p.numel() for p in params) != buffer.numel():
            return None   # per parameter, which names the error (_views)
        if self.algorithm is not None:
            return self._whole_bucket(params), self.algorithm
        dispatcher = runtime().dispatcher
        policy = self.policy or dispatcher.policy
        dtype, travel, itemsize = torch_dtype(buffer.dtype)   # as each parameter's slice would be staged
        choices = [policy.choose(self.name_of(p), p.numel() * itemsize, dtype) for p in params]
        if len(set(choices)) > 1 or choices[0].compression is not None:
            return None   # the policy tells them apart; compressors keep their state per parameter
        metas = [TensorMeta(self.name_of(p), tuple(p.shape), str(travel), p.numel() * travel.itemsize) for p in params]
        if any(dispatcher.measures_density(choice, meta) for choice, meta in zip(choices, metas)):
            return self._whole_bucket(params), None   # algorithm None: by their last runs (_kept)
        return self._whole_bucket(params), choices[0].algorithm

    def _kept(self, names, dtype):
        """The algorithm a bucket of density-planned parameters travels whole with now (see the class
        docstring), from their last runs: what the controller released, the same on every rank; None:
        per parameter."""
        if self.iteration % REMEASURE_EVERY == 0:
            return None
        rt = runtime()
        carried = {}
        for name in names:
            record = rt.records.get(name) or {}
            algorithm = record.get("algorithm")
            backend = rt.dispatcher.backends.get(algorithm)
            if backend is None or backend.sparse or "dense" not in backend.carries or record.get("compression") \
                    or record.get("dtype") != dtype or "trial" in (record.get("auto") or ()):
                return None   # not run yet, sparse, under trial, or another collective's record of that name
            carried[algorithm] = carried.get(algorithm, 0) + record["nbytes"]
        return max(sorted(carried), key=carried.get)

    def process_set(self):
        """The commlib ProcessSet of `process_group` (None: every rank)."""
        if self.process_group is not None and self._process_set is None:
            import torch.distributed as dist
            ranks = dist.get_process_group_ranks(self.process_group)
            self._process_set = commlib.ProcessSet(ranks) if len(ranks) < dist.get_world_size() else False
        return self._process_set or None

    def _whole_bucket(self, params):
        """(the bucket's name, its parameters' names)."""
        names = [self.name_of(p) for p in params]
        return f"bucket({names[0]}+{len(names) - 1})", names

    def record_names(self):
        """The names of this state's distinct records in commlib.records() once reduced: its whole
        buckets', and its other parameters' (those of a whole bucket show its record); a parameter
        DDP never reduces (frozen) is listed but has no record."""
        whole = {key[0]: found[0][0] for key, found in list(self._wholes.items())
                 if found and not self._measuring.get(key)}
        inside = {param for ids in whole for param in ids}
        return [name for param, name in self.names.items() if param not in inside] + list(whole.values())


_states = itertools.count()   # the states built in this process, in order (the same on every rank)


def ddp_comm_hook(state, bucket):
    """Reduce (average) one DDP bucket through commlib; returns a Future of the reduced buffer."""
    future = torch.futures.Future()
    # set_exception only stores the exception as the value (Python's wait() raises it, DDP's C++
    # side would try to cast it to a tensor); an error raised in a then() callback is a real error
    # to both, so DDP's backward raises the error's own message
    result = future.then(_value)
    try:
        state.start()
        buffer = bucket.buffer()
        params = bucket.parameters()
        last = bucket.is_last()   # DDP waits for the buckets next: this one goes at once (api.submit's hurry)
        whole = state.whole(params, buffer)
        stand_for = None
        if whole is not None:
            (name, names), algorithm = whole
            views = [host_array(buffer) if viewable(buffer) else buffer]
            handles = submit(views, [name], commlib.Average, algorithm, process_set=state.process_set(), hurry=last)
            stand_for = functools.partial(_stand_for, name, names)
        else:   # one message for the bucket: its parameters are released together and fused again
            views = _views(buffer, params)
            handles = submit(views, [state.name_of(param) for param in params], commlib.Average, state.algorithm,
                             state.compression, policy=state.policy, process_set=state.process_set(), hurry=last)
    except Exception as exc:   # surfaces where DDP waits for the bucket, as a failed collective does
        future.set_exception(exc)
        return result
    state.buckets_reduced += 1
    state.bytes_reduced += buffer.numel() * buffer.element_size()
    if last:
        state.iteration += 1
    _complete_when_done(handles, views, buffer, future, stand_for)
    return result


def _stand_for(name, names):
    """A whole bucket's record is each of its parameters' too (commlib.records()[parameter name]), as
    current as when they travelled one by one; where the bucket's algorithm came from its parameters'
    runs (CommlibState._kept), each keeps its own `auto` (its trials and kept choice). Before the
    bucket's Future completes, on the thread that completes it (commlib's background thread, which
    writes records, or the hook's: Records.stand_for, one lock for every parameter, on the way to the Future)."""
    runtime().records.stand_for(name, names)


def _value(future):
    return future.value()


def _views(buffer, params):
    """Each parameter's slice of the flat bucket buffer, in the parameter's shape (a sparse
    gradient is a bucket of its own: DDP gives it whole, and commlib's row-sparse path reduces it)."""
    if buffer.is_sparse:
        if len(params) != 1 or tuple(buffer.shape) != tuple(params[0].shape):
            raise ConfigError(f"a sparse DDP bucket holds one parameter's gradient; this one has shape "
                              f"{tuple(buffer.shape)} for {len(params)} parameters")
        return [buffer]
    sizes = [p.numel() for p in params]
    if sum(sizes) != buffer.numel():
        raise ConfigError(f"DDP bucket of {buffer.numel()} elements holds parameters of {sum(sizes)}; "
                          f"a hook wrapping this one must keep the buffer's length")
    if not viewable(buffer):
        return [view.view(p.shape) for view, p in zip(buffer.split(sizes), params)]
    # numpy views of a host bucket: slicing it in torch costs a GIL release per parameter (tensors._HostView)
    flat, views, start = host_array(buffer), [], 0
    for size, param in zip(sizes, params):
        views.append(flat[start:start + size].reshape(param.shape))
        start += size
    return views


def _complete_when_done(handles, views, buffer, future, before=None):
    """Complete the bucket's Future once its last handle resolves, on the thread that resolves it
    (handles.when_all), so neither the hook nor a thread of its own waits; `before()` first (the
    records of a whole bucket's parameters, which the next step's hook reads: CommlibState._kept)."""
    def done():
        try:
            if before is not None:
                before()
            # all resolved: no wait; host arrays as they came, no torch call per parameter (Handle.set)
            flat = _flat([handle.wait(restored=False) for handle in handles], buffer)
            if flat is None:   # not one piece of memory (several buckets, compressors): into the bucket
                for view, result in zip(views, [handle.wait() for handle in handles]):
                    if torch.is_tensor(view):
                        view.copy_(result)
                    else:
                        view[...] = result
                flat = buffer
        except Exception as exc:   # Mismatch, CommTimeout, PeerFailure: raised where DDP waits
            future.set_exception(exc)
            return
        future.set_result(flat)   # DDP copies the hook's result into the gradients itself

    when_all(handles, done)


def _flat(results, buffer):
    """The results as one flat tensor like the bucket's buffer, without copying, when they lie back
    to back in one piece of host memory (a fused bucket's reduced buffer split per parameter); else None.
    A sparse bucket's result is its one reduced tensor; bfloat16, which numpy lacks, is copied."""
    if buffer.is_sparse:
        return results[0]
    if not viewable(buffer):
        return None
    arrays = [r.reshape(-1) if isinstance(r, np.ndarray) else host_array(r) if viewable(r) else None for r in results]
    if any(a is None for a in arrays):
        return None
    flat = fused(arrays, writeable=True)   # None unless one dtype, back to back
    if flat is None or flat.size != buffer.numel() or flat.dtype != host_dtype(buffer.dtype):
        return None
    return torch.from_numpy(flat)
