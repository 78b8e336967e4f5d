"""From what users write to compressor objects: "topk", "topk(ratio=0.01,memory=residual)",
GRACE's params dicts, or objects. Parameters unknown to the compressor go to its memory (GRACE
passes dgc's momentum that way); a parameter both accept (efsignsgd's lr) goes to both."""
import ast
import threading

from commlib.compressors.base import Compressor, lookup, make_memory, parameters, Memory
from commlib.errors import ConfigError

# Other names for parameters: GRACE's params keys and PyTorch PowerSGDState's arguments.
ALIASES = {"communicator": "algorithm", "compress_ratio": "ratio", "quantum_num": "levels", "compress_rank": "rank",
           "matrix_approximation_rank": "rank", "start_powerSGD_iter": "start_iter",
           "random_seed": "seed", "threshold": "tau", "quantiles": "bins"}

_CACHE, _LOCK = {}, threading.Lock()


def parse(text):
    """'topk(ratio=0.01, memory=residual)' -> ('topk', {'ratio': 0.01, 'memory': 'residual'}, None);
    'fp16(powersgd(rank=4))' -> ('powersgd', {'rank': 4}, ('fp16', {}, None)): the outer compressor
    carries the inner one's collectives."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        node = None
    try:
        return _spec(node)
    except ValueError:
        raise ConfigError(f"cannot parse compression {text!r}; write a name or name(key=value, ...), e.g. "
                          "'topk(ratio=0.01,memory=residual)', or carrier(inner), e.g. 'fp16(powersgd(rank=4))'") from None


def _spec(node, carrier=None):
    if isinstance(node, ast.Name):
        return node.id, {}, carrier
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) <= 1
            and all(kw.arg for kw in node.keywords)):
        raise ValueError(node)
    own = (node.func.id, {kw.arg: _value(kw.value) for kw in node.keywords}, carrier)
    return _spec(node.args[0], own) if node.args else own


def _value(node):
    if isinstance(node, ast.Name):   # bare words are strings: memory=residual, estimator=gamma
        return {"true": True, "false": False}.get(node.id.lower(), node.id)
    return ast.literal_eval(node)


def build(name, params=None, carrier=None, memory=None, algorithm=None):
    """A new compressor object (never cached): `build(*parse(text))`. `carrier`: a (name, params,
    carrier) spec of a summable compressor that carries this one's collectives."""
    cls = lookup("compressor", name)
    params = {ALIASES.get(k, k): v for k, v in (params or {}).items()}
    memory = params.pop("memory", memory)
    algorithm = params.pop("algorithm", algorithm)
    if isinstance(memory, Memory):
        mem_cls, memory_name = None, None
    else:
        memory_name = str(memory).lower() if memory is not None else cls.default_memory
        mem_cls = lookup("memory", memory_name)
    own = set(parameters(cls)) - {"memory", "algorithm"}
    mem_own = set(parameters(mem_cls)) if mem_cls else set()
    unknown = sorted(set(params) - own - mem_own)
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown} for compressor {cls.name!r} with memory "
                          f"{memory_name or type(memory).__name__!r}; accepted: {sorted(own | mem_own)}")
    compressor = cls(algorithm=algorithm, **{k: v for k, v in params.items() if k in own})
    if mem_cls is not None:
        memory = make_memory(memory_name, linked=compressor, **{k: v for k, v in params.items() if k in mem_own})
    compressor.memory = memory
    if carrier is not None:
        compressor.carrier = build(*carrier).checked_carrier()
    return compressor


def from_params(params):
    """GRACE's entry point: {'compressor': 'topk', 'memory': 'residual', 'communicator': 'allgather',
    'compress_ratio': 0.01, ...}. As in GRACE, memory defaults to 'none'; communicator defaults to
    letting commlib pick (GRACE's default, allreduce, cannot carry most payloads)."""
    if not isinstance(params, dict):
        raise ConfigError(f"from_params expects a dict of GRACE params, got {type(params).__name__}")
    params = dict(params)
    params.pop("world_size", None)   # GRACE's communicators needed it; commlib takes the size from the job
    if params.pop("gradient_clipping", False):
        raise ConfigError("gradient_clipping=True (GRACE's dgc memory) is not done by commlib: clip in the "
                          "training loop (torch.nn.utils.clip_grad_norm_) and leave gradient_clipping unset")
    name = params.pop("compressor", "none")
    memory = params.pop("memory", "none")
    return build(name, params, memory=memory)


def resolve(spec):
    """The compression object for a spec, or None for no compression. Objects are shared per
    distinct spec, so state (memories, steps) persists however often the core resolves."""
    if spec is None or isinstance(spec, Compressor):
        return spec
    if isinstance(spec, str):
        if spec.strip().lower() in ("", "none"):
            return None
        parsed = parse(spec)
        key = _key(parsed)
        factory = lambda: build(*parsed)
    elif isinstance(spec, dict):
        key = f"grace({_canonical(spec)})"
        factory = lambda: from_params(spec)
    else:
        raise ConfigError(f"compression must be None, a name, 'name(key=value,...)', a GRACE params dict "
                          f"or a Compressor, got {type(spec).__name__}")
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = factory()
        return _CACHE[key]


def _canonical(params):
    return ",".join(f"{k}={v!r}" for k, v in sorted(params.items()))


def _key(parsed):
    name, params, carrier = parsed
    own = f"{name.lower()}({_canonical(params)})"
    return own if carrier is None else f"{_key(carrier)[:-1]}{',' if carrier[1] else ''}{own})"


def resolved():
    """{canonical spec: object} of every object resolve() has handed out."""
    with _LOCK:
        return dict(_CACHE)


def state_dict():
    """Checkpoint of every resolved compressor, keyed by its canonical spec."""
    return {key: obj.state_dict() for key, obj in resolved().items()}


def load_state_dict(state):
    """Restore a state_dict(): resolve the same specs first (e.g. by building the policy again)."""
    objects = resolved()
    missing = sorted(set(state) - set(objects))
    if missing:
        raise ConfigError(f"saved compressor state for {missing}, which nothing resolved yet; "
                          "resolve those specs (build the policy) before loading")
    for key, value in state.items():
        objects[key].load_state_dict(value)
