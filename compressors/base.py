"""The Compressor and Memory interfaces, the payload/algorithm table and the registries.

A method module defines a Compressor subclass with `encode(x, name) -> payload` (a tuple of 1-D
tensors, the only thing that crosses the wire) and `decode(payload, ctx) -> 1-D tensor`, both on
flat torch tensors of the work dtype; this base class adds everything else once: numpy and
torch inputs on any device, shapes and dtypes, error-feedback memory, the communication per
payload kind, averaging, step counters, per-(name, step) RNG and checkpointable state.
"""
import copy
import hashlib
import inspect
import math
import numbers
from typing import NamedTuple

import numpy as np
import torch

from commlib.backends import carriers, registry
from commlib.compressors import packing
from commlib.errors import ConfigError, InvalidTensor

# GRACE's communicator names, as the algorithms they allow (commlib.backends.carriers says which
# algorithms can carry each payload kind at all).
GRACE_COMMUNICATORS = {"allreduce": ("ring", "switchml"), "allgather": ("allgather",), "broadcast": ("allgather",)}
PAYLOADS = ("summable", "sparse", "gather")

_COMPRESSORS, _MEMORIES = {}, {}


def register(cls):
    """Class decorator: make a Compressor or Memory selectable by its `name`."""
    table = _MEMORIES if issubclass(cls, Memory) else _COMPRESSORS
    if cls.name in table and table[cls.name] is not cls:
        raise ConfigError(f"two classes register the name {cls.name!r}: {table[cls.name]} and {cls}")
    table[cls.name] = cls
    return cls


def lookup(kind, name):
    table, plural = (_MEMORIES, "memories") if kind == "memory" else (_COMPRESSORS, "compressors")
    try:
        return table[str(name).lower()]
    except KeyError:
        raise ConfigError(f"unknown {kind} {name!r}; known {plural}: {', '.join(sorted(table))}") from None


def seed_for(*key):
    """A 63-bit seed from a tuple of str/int, identical in every process (unlike hash())."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def work_dtype(dtype):
    """Compressors compute in float32, or float64 for float64 input (halves lose too much)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _copy(state):
    if torch.is_tensor(state):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    return copy.deepcopy(state)


class Stateful:
    """state_dict/load_state_dict of the attributes named in `state_attrs` (dicts keyed by tensor name)."""
    state_attrs = ()

    def state_dict(self):
        return {attr: _copy(getattr(self, attr)) for attr in self.state_attrs}

    def load_state_dict(self, state):
        for attr in self.state_attrs:
            setattr(self, attr, _copy(state.get(attr, {})))


class Memory(Stateful):
    """Error feedback, GRACE's role: `compensate` before compressing, `update` after.
    Tensors are the flat work-dtype tensors the compressor sees; state is keyed by tensor name."""
    name = None
    uses_decompressed = False   # does update() need decompress(own payload)? (the pipeline computes it once)

    def compensate(self, tensor, name):
        return tensor

    def update(self, tensor, name, compressor, payload, ctx, decompressed=None):
        """tensor: what compensate returned; decompressed: decompress(payload, ctx) when uses_decompressed."""


UNCHANGED = Memory()   # what a step whose gradient is not finite uses instead of the compressor's memory


def finite(tensor):
    """Whether every value of a non-empty tensor is finite. A gradient that is not (an fp16 overflow,
    which a loss scaler then skips) travels as it is, and leaves the error feedback as it was: its
    residual would carry the Inf or NaN into every later step. (On a GPU: one wait for the device.)"""
    low, high = torch.aminmax(tensor)   # (one pass, no tensor of flags; NaN is either)
    return bool(torch.isfinite(low) & torch.isfinite(high))


class Ctx(NamedTuple):
    """What stays local: enough to decode any rank's payload (identical on every rank)."""
    shape: tuple
    dtype: torch.dtype    # of the input; decode works in work_dtype(dtype)
    device: torch.device
    numel: int
    name: str
    step: int

    @property
    def work(self):
        return work_dtype(self.dtype)


class Compressor(Stateful):
    """Subclasses set the class attributes and implement encode/decode (and maybe aggregate).

    Common hyperparameters (every method accepts them):
      memory: None (the method's default_memory), a memory name or a Memory object.
      seed: base of every random stream; identical on all ranks by construction.
      algorithm: restrict the algorithms that may carry the payload, e.g. "allgather" (GRACE's
        `communicator` names work too: allreduce, allgather, broadcast).
    A compressor with a summable payload can also carry another compressor's collectives:
    `fp16(powersgd(rank=4))`, like PyTorch's fp16_compress_wrapper(powerSGD_hook) (see `wrap`).
    """
    name = None
    payload = None              # "summable", "sparse" or "gather": what the wire can do with it
    default_memory = "none"
    averages = True             # average=True divides the aggregate by the number of ranks
    divide_before_sum = False   # average by scaling each rank's input (keeps fp16 sums in range)
    state_attrs = ("steps",)

    def __init__(self, memory=None, seed=0, algorithm=None):
        if self.payload not in PAYLOADS:
            raise ConfigError(f"{type(self).__name__}.payload must be one of {PAYLOADS}")
        if not is_int(seed):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        self.seed = int(seed)
        self.algorithm = algorithm
        self.carrier = None      # a summable compressor that carries this one's collectives (wrap)
        self.steps = {}          # tensor name -> number of compress() calls so far
        self.comm_rank = 0       # set by reduce(); salts per-rank random streams
        self._memory = memory
        if algorithm is not None:
            known = set(GRACE_COMMUNICATORS) | set(registry())
            if algorithm not in known:
                raise ConfigError(f"unknown algorithm (GRACE communicator) {algorithm!r}; known: {sorted(known)}")
            if not self.carriers():
                raise ConfigError(f"{self.name} sends a {self.payload} payload, which {algorithm!r} cannot carry; "
                                  f"use one of {list(carriers(self.payload))}")

    # --- what subclasses implement -------------------------------------------------------------
    def encode(self, x, name):
        """x: flat tensor of the work dtype, numel >= 1 -> payload, a tuple of 1-D tensors."""
        raise NotImplementedError

    def decode(self, payload, ctx):
        """payload from any rank (or the sum of all ranks' when summable) -> flat work-dtype tensor."""
        raise NotImplementedError

    def aggregate(self, tensors):
        """Combine every rank's decoded tensor (allgather path). GRACE's default: the sum."""
        out = tensors[0].clone()
        for t in tensors[1:]:
            out += t
        return out

    def expected_bytes(self, numel):
        """Bytes on the wire for a float32 tensor of numel elements, or None where data dependent."""
        return None

    # --- GRACE's compress/decompress on tensors of any shape ------------------------------------
    def compress(self, tensor, name="tensor"):
        x, _ = as_torch(tensor, self.name)
        step = self.steps.get(name, 0)
        ctx = Ctx(tuple(x.shape), x.dtype, x.device, x.numel(), name, step)
        payload = self.encode(x.reshape(-1).to(ctx.work), name) if ctx.numel else ()
        self.steps[name] = step + 1
        return payload, ctx

    def decompress(self, payload, ctx):
        if not ctx.numel:
            return torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        return self.decode(payload, ctx).view(ctx.shape).to(ctx.dtype)

    # --- the pipeline the core calls --------------------------------------------------------------
    def check_carrier(self, algorithm, where):
        """ConfigError unless `algorithm` can carry this compressor's payload ("auto" can)."""
        if algorithm != "auto" and algorithm not in self.carriers():
            raise ConfigError(f"{where}: compression {self.name!r} sends a {self.payload} payload, which "
                              f"algorithm {algorithm!r} cannot carry; use one of {self.carriers()}")

    def accepts(self, algorithm):
        """May `algorithm` carry this compressor's payload (its `algorithm=` restriction allowing)?"""
        return self.algorithm is None or algorithm in GRACE_COMMUNICATORS.get(self.algorithm, (self.algorithm,))

    def carriers(self):
        """The algorithms that can carry the payload, best first (commlib.backends.carriers)."""
        return [algorithm for algorithm in carriers(self.payload) if self.accepts(algorithm)]

    @property
    def memory(self):
        if not isinstance(self._memory, Memory):
            self._memory = make_memory(self._memory or self.default_memory, linked=self)
        return self._memory

    @memory.setter
    def memory(self, memory):
        self._memory = memory

    def reduce(self, tensor, name, channel, average):
        """One tensor: reduce_bucket of one."""
        return self.reduce_bucket([tensor], [name], channel, average)[0]

    def reduce_bucket(self, tensors, names, channel, average):
        """Compensate -> compress -> memory update -> ONE collective for the whole bucket -> decode ->
        average. `channel` is the algorithm's collectives (rank, size, algorithm, sparse, allreduce(array),
        allgather(array)); returns each tensor reduced, in its own type, device, dtype and shape."""
        channel = self._checked(channel)
        inputs = [as_torch(t, self.name) for t in tensors]
        work = [(x.reshape(-1).to(work_dtype(x.dtype)), name) for (x, _), name in zip(inputs, names) if x.numel()]
        with torch.no_grad():
            divided = average and self.divide_before_sum
            encoded = []   # (payload, ctx, own decoded or None)
            for flat, name in work:
                flat = flat / channel.size if divided else flat
                memory = self.memory
                if memory.name != "none" and not finite(flat):   # an overflow leaves the memory as it was
                    memory = UNCHANGED
                flat = memory.compensate(flat, name)
                payload, ctx = self.compress(flat, name)
                own = None
                if self.payload != "summable" or memory.uses_decompressed:
                    own = self.decompress(payload, ctx)
                memory.update(flat, name, self, payload, ctx, own)
                encoded.append((payload, ctx, own))
            sums = iter(self.communicate(encoded, channel))
            scale = channel.size if average and self.averages and not divided else 1
            return [restore(x.clone()) if not x.numel() else restore(next(sums) / scale if scale != 1 else next(sums))
                    for x, restore in inputs]

    def _checked(self, channel):
        self.check_carrier(channel.algorithm, f"{self.name}.reduce")
        self.comm_rank = channel.rank
        return self.carrier.wrap(channel) if self.carrier is not None else channel

    def communicate(self, encoded, channel):
        """The aggregate (before averaging) of every rank's tensor for each (payload, ctx, own) of the
        bucket, as flat work-dtype tensors: one collective per payload dtype, whatever the bucket size
        (none for a bucket of empty tensors: shapes agree, so every rank skips alike)."""
        if not encoded:
            return []
        if self.payload == "summable":
            parts = allreduce_all(channel, [part for payload, _, _ in encoded for part in payload])
            sums, at = [], 0
            for payload, ctx, _ in encoded:
                sums.append(self.decompress(tuple(parts[at:at + len(payload)]), ctx).reshape(-1).to(ctx.work))
                at += len(payload)
            return sums
        if channel.sparse:   # a sparse collective (omnireduce) skips the zero blocks of `own`
            return allreduce_all(channel, [own.reshape(-1) for _, _, own in encoded])
        blobs = channel.allgather(packing.to_bytes(tuple(part for payload, _, _ in encoded for part in payload)))
        if len(blobs) != channel.size:
            raise InvalidTensor(f"allgather returned {len(blobs)} payloads for {channel.size} ranks")
        device = encoded[0][1].device
        ranks = [None if r == channel.rank else packing.from_bytes(blob, device) for r, blob in enumerate(blobs)]
        sums, at = [], 0
        for payload, ctx, own in encoded:
            decoded = [own if parts is None else self.decompress(tuple(parts[at:at + len(payload)]), ctx)
                       for parts in ranks]
            sums.append(self.aggregate([d.reshape(-1).to(ctx.work) for d in decoded]))
            at += len(payload)
        return sums

    def wrap(self, channel):
        """A channel whose allreduce carries its arrays compressed by this (summable) compressor, as
        DDP's fp16_compress_wrapper(hook) carries another hook's allreduce in float16."""
        return Wrapped(self.checked_carrier(), channel)

    def checked_carrier(self):
        """self, if it can carry another compressor's collectives (summable, no memory to keep)."""
        if self.payload != "summable" or self.memory.name != "none":
            raise ConfigError(f"{self.name} cannot carry another compressor's collectives: only summable "
                              f"compressors without memory can (e.g. fp16(powersgd(rank=4)))")
        return self

    # --- state -------------------------------------------------------------------------------------
    def state_dict(self):
        return {**super().state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.memory.load_state_dict(state.get("memory", {}))

    def generator(self, name, device, shared=False, step=None):
        """A fresh torch.Generator for this (seed, name, step[, rank]): reproducible, checkpointable
        through the step counters, and never the global RNG. step defaults to the current one.
        shared=True: the same stream on every rank (on the CPU, so that CPU and GPU ranks agree)."""
        step = self.steps.get(name, 0) if step is None else step
        key = (self.seed, name, step) + (() if shared else (self.comm_rank,))
        device = torch.device("cpu") if shared else torch.device(device)
        return torch.Generator(device=device).manual_seed(seed_for(*key))

    def __repr__(self):
        params = {k: getattr(self, k) for k in parameters(type(self)) if hasattr(self, k) and k != "memory"}
        args = ", ".join(f"{k}={v!r}" for k, v in params.items())
        return f"{self.name}({args}, memory={self.memory.name})"


def make_memory(name, linked=None, **params):
    """Build a memory by name; parameters it does not get explicitly are taken from the
    compressor's attributes of the same name (efsignsgd's lr is shared by both)."""
    cls = lookup("memory", name)
    for param in parameters(cls):
        if param not in params and hasattr(linked, param):
            params[param] = getattr(linked, param)
    return cls(**params)


def parameters(cls):
    """The keyword parameters a Compressor/Memory class accepts (its own and the common ones)."""
    names = []
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            sig = inspect.signature(vars(klass)["__init__"])
            names += [p.name for p in sig.parameters.values() if p.name != "self" and p.name not in names
                      and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            if not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
                break
    return names


def as_torch(tensor, method="compressor"):
    """(torch tensor viewing the input, restore(out) -> output of the input's type/dtype/shape)."""
    if isinstance(tensor, (np.ndarray, np.generic)):
        array = np.ascontiguousarray(tensor)
        if not array.flags.writeable:
            array = array.copy()
        x = torch.from_numpy(array)
        shape, dtype = tensor.shape, x.dtype
        restore = lambda out: out.reshape(shape).to(dtype).cpu().numpy()
    elif torch.is_tensor(tensor):
        x, shape, dtype = tensor.detach(), tensor.shape, tensor.dtype
        restore = lambda out: out.reshape(shape).to(dtype)
    else:
        raise InvalidTensor(f"{method}: expected a torch.Tensor or numpy.ndarray, got {type(tensor).__name__}")
    if not x.is_floating_point():
        raise InvalidTensor(f"{method} compresses floating-point tensors, got {x.dtype}; "
                            "send integer tensors with compression=None")
    return x, restore


def allreduce_all(channel, parts):
    """Sum every rank's flat tensors `parts` (any devices) with one channel.allreduce per dtype;
    returns the sums in order, each on its part's device. Summable payloads have the same sizes on
    every rank, so all ranks skip or concatenate alike."""
    sums = list(parts)
    by_dtype = {}
    for i, part in enumerate(parts):
        if part.numel():
            by_dtype.setdefault(part.dtype, []).append(i)
    for indices in by_dtype.values():
        flat = np.concatenate([parts[i].detach().reshape(-1).cpu().numpy() for i in indices])
        summed = torch.from_numpy(np.asarray(channel.allreduce(flat)))
        for i, piece in zip(indices, torch.split(summed, [parts[i].numel() for i in indices])):
            sums[i] = piece.to(parts[i].device)
    return sums


def allreduce(channel, part):
    """One flat tensor summed over ranks (see allreduce_all)."""
    return allreduce_all(channel, [part])[0]


class Wrapped:
    """A channel whose allreduce travels compressed by a summable compressor (Compressor.wrap)."""

    def __init__(self, carrier, channel):
        self.carrier, self.channel = carrier, channel
        self.rank, self.size, self.algorithm, self.sparse = channel.rank, channel.size, channel.algorithm, channel.sparse

    def allreduce(self, array):
        x = torch.from_numpy(np.ascontiguousarray(array))
        payload, ctx = self.carrier.compress(x.reshape(-1).to(work_dtype(x.dtype)), "wrapped")
        summed = tuple(allreduce_all(self.channel, list(payload)))
        return self.carrier.decompress(summed, ctx).numpy().astype(array.dtype, copy=False)

    def allgather(self, array):
        return self.channel.allgather(array)


def is_int(value):
    """A parameter that counts (a rank, levels, bins): an int (numpy's too), not a bool (JSON's `true`
    counts nothing)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_number(value):
    """A parameter that measures (a ratio, a threshold, a learning rate): a finite real number (numpy's
    too), not a bool."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:   # an int past any float
        return False


def check_ratio(ratio, what="ratio"):
    if not (is_number(ratio) and 0 < ratio <= 1):
        raise ConfigError(f"{what} must be in (0, 1], got {ratio!r}: it is the fraction of elements sent")
    return float(ratio)


def top_count(ratio, numel):
    """k = max(1, floor(ratio * n)), never more than n."""
    return min(numel, max(1, math.floor(ratio * numel * (1 + 1e-12))))   # 0.29 * 100 is 28.999...


def index_dtype(numel):
    return torch.int32 if numel < 2 ** 31 else torch.int64


def scatter(values, indices, ctx):
    """Dense flat tensor of ctx.numel zeros with `values` at `indices`."""
    out = torch.zeros(ctx.numel, dtype=ctx.work, device=ctx.device)
    return out.index_put_((indices.long(),), values.to(ctx.work))
