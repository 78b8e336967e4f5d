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
from typing import NamedTuple

import numpy as np
import torch

from commlib.compressors import packing
from commlib.errors import ConfigError, InvalidTensor

# The one compatibility table: which algorithms can carry each kind of payload.
ALGORITHMS = {
    "summable": frozenset({"ring", "switchml"}),      # sum of payloads decodes to the sum of tensors
    "sparse": frozenset({"omnireduce", "allgather"}),  # decoded tensors are mostly zeros; aggregate is a sum
    "gather": frozenset({"allgather"}),                # each rank's payload must be decoded on its own
}
# The order in which to pick an algorithm when the user named none (the sparse collective first).
PREFERENCE = {"summable": ("ring", "switchml"), "sparse": ("omnireduce", "allgather"), "gather": ("allgather",)}
# GRACE's communicator names, and commlib's own, as sets of algorithms.
COMMUNICATORS = {"allreduce": ALGORITHMS["summable"], "allgather": frozenset({"allgather"}),
                 "broadcast": frozenset({"allgather"}),  # GRACE's broadcast moves what allgather moves
                 **{name: frozenset({name}) for name in ("ring", "switchml", "omnireduce")}}

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
      communicator: restrict the algorithms, e.g. "allgather" (GRACE's names work too).
    """
    name = None
    payload = None              # "summable", "sparse" or "gather": what the wire can do with it
    default_memory = "none"
    averages = True             # average=True divides the aggregate by the number of ranks
    divide_before_sum = False   # average by scaling each rank's input (keeps fp16 sums in range)
    state_attrs = ("steps",)

    def __init__(self, memory=None, seed=0, communicator=None):
        if self.payload not in ALGORITHMS:
            raise ConfigError(f"{type(self).__name__}.payload must be one of {sorted(ALGORITHMS)}")
        self.seed = int(seed)
        self.communicator = communicator
        self.steps = {}          # tensor name -> number of compress() calls so far
        self.comm_rank = 0       # set by reduce(); salts per-rank random streams
        self._memory = memory
        if communicator is not None:
            if communicator not in COMMUNICATORS:
                raise ConfigError(f"unknown communicator {communicator!r}; known: {sorted(COMMUNICATORS)}")
            if not self.allowed_algorithms():
                raise ConfigError(f"{self.name} sends a {self.payload} payload, which the {communicator!r} "
                                  f"communicator cannot carry; use one of {sorted(ALGORITHMS[self.payload])}")

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
    def allowed_algorithms(self):
        allowed = ALGORITHMS[self.payload]
        return allowed & COMMUNICATORS[self.communicator] if self.communicator else allowed

    @property
    def memory(self):
        if not isinstance(self._memory, Memory):
            self._memory = make_memory(self._memory or self.default_memory, linked=self)
        return self._memory

    @memory.setter
    def memory(self, memory):
        self._memory = memory

    def reduce(self, tensor, name, comm, average):
        """Compensate -> compress -> memory update -> communicate by payload kind -> average.
        Returns the same type, device, dtype and shape as `tensor`."""
        check_algorithm(self, comm.algorithm)
        x, restore = as_torch(tensor, self.name)
        if x.numel() == 0:   # same shape on every rank: nobody communicates
            return restore(x.clone())
        self.comm_rank = comm.rank
        with torch.no_grad():
            flat = x.reshape(-1).to(work_dtype(x.dtype))
            if average and self.divide_before_sum:
                flat, average = flat / comm.size, False
            flat = self.memory.compensate(flat, name)
            payload, ctx = self.compress(flat, name)
            own = None
            if self.payload != "summable" or self.memory.uses_decompressed:
                own = self.decompress(payload, ctx)
            self.memory.update(flat, name, self, payload, ctx, own)
            out = self.communicate(payload, ctx, own, comm)
            if average and self.averages:
                out = out / comm.size
            return restore(out)

    def communicate(self, payload, ctx, own, comm):
        """The aggregate (before averaging) of every rank's tensor, as a flat work-dtype tensor."""
        if self.payload == "summable":
            return self.decompress(tuple(allreduce(comm, part) for part in payload), ctx)
        if comm.algorithm == "omnireduce":   # the sparse collective skips the zero blocks of `own`
            return allreduce(comm, own)
        blobs = comm.allgather(packing.to_bytes(payload))
        if len(blobs) != comm.size:
            raise InvalidTensor(f"{ctx.name}: allgather returned {len(blobs)} payloads for {comm.size} ranks")
        decoded = [own if r == comm.rank else self.decompress(packing.from_bytes(blob, ctx.device), ctx)
                   for r, blob in enumerate(blobs)]
        return self.aggregate(decoded)

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


def check_algorithm(compression, algorithm):
    """Raise ConfigError, saying what to use instead, when `algorithm` cannot carry the payload."""
    allowed = compression.allowed_algorithms()
    if algorithm not in allowed:
        raise ConfigError(f"compression {compression.name!r} sends a {compression.payload} payload, which "
                          f"algorithm {algorithm!r} cannot carry; use one of {sorted(allowed)}")


def pick_algorithm(compression, available, requested=None):
    """The algorithm for a compressed tensor: `requested` if compatible (else ConfigError), otherwise
    the first of PREFERENCE[payload] that is allowed and in `available`."""
    if requested is not None:
        check_algorithm(compression, requested)
        return requested
    allowed = compression.allowed_algorithms()
    for algorithm in PREFERENCE[compression.payload]:
        if algorithm in allowed and algorithm in available:
            return algorithm
    raise ConfigError(f"compression {compression.name!r} needs one of {sorted(allowed)}, "
                      f"but only {sorted(available)} are available here")


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


def allreduce(comm, part):
    """comm.allreduce of one payload part (any device) -> the summed tensor on the part's device."""
    if part.numel() == 0:   # same size on every rank for summable payloads: all skip together
        return part
    summed = comm.allreduce(np.ascontiguousarray(part.detach().reshape(-1).cpu().numpy()))
    return torch.from_numpy(np.asarray(summed)).to(part.device)


def check_ratio(ratio, what="ratio"):
    if not isinstance(ratio, (int, float)) or not 0 < ratio <= 1 or math.isnan(ratio):
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
