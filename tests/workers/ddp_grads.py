"""DDP with commlib's hook vs DDP's default allreduce: same start, same data, every step.

argv: OUT SCENARIOS, SCENARIOS a JSON object {name: [POLICY, OPTIONS]}, run one after another in this
one job (a job's start costs far more than a scenario); OPTIONS a comma list of
  unused      a layer each rank uses on alternate steps only (find_unused_parameters=True)
  accumulate  two backward passes per step, the first under no_sync()
  fp16        the hook inside PyTorch's fp16_compress_wrapper (and DDP's default inside it too)
  bf16        the same with bf16_compress_wrapper
  bfloat16    the model itself in bfloat16
  sparse      an EmbeddingBag(sparse=True) in the model: sparse gradients, each its own bucket
  gan         a second model of the same class (the same parameter names), its own DDP and state,
              in the same backward
  float       normal draws instead of the dyadic fixture below (for bounds that are not exact)
  per_parameter  CommlibState(whole_buckets=False): every bucket per parameter at every step
  static      DDP(static_graph=True)
  view        DDP(gradient_as_bucket_view=True): the gradients are views of the bucket
  cuda        the models and data on the GPU (every rank on cuda:0; gloo reduces CUDA tensors)
  group       both DDPs over a process group of this rank alone (DDP(process_group=...), and
              CommlibState(process_group=...)): the local gradients, not the world's average
Writes OUT/<name>.rank<r>.json per scenario with, per step, the largest |difference| of the two
models' gradients and the largest |gradient|, the hooked gradients of the last step, what commlib
ran per parameter (dispatched in this scenario) and the state's statistics, or the scenario's error;
pytest compares them. Each step starts both models from the same freshly drawn parameters, all
quarter-integers, and the inputs are small integers: every gradient then has few significant bits,
so its sum over ranks is exact in float32 in any order, and a `ring` reduce must match DDP's bit for
bit however gloo orders the additions.
"""
import contextlib
import copy
import datetime
import itertools
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (allreduce_hook, bf16_compress_wrapper,
                                                                       fp16_compress_wrapper)
from torch.nn.parallel import DistributedDataParallel as DDP

import commlib
import commlib.torch as cl
import commlib.torch.ddp

out, scenarios = Path(sys.argv[1]), json.loads(sys.argv[2])
STEPS = 4
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank, size = dist.get_rank(), dist.get_world_size()


class Net(torch.nn.Module):
    def __init__(self, options):
        super().__init__()
        self.options = options
        self.body = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(48, 4)
        if "unused" in options:
            self.side = torch.nn.Linear(48, 4)
        if "sparse" in options:
            self.embedding = torch.nn.EmbeddingBag(50, 16, mode="sum", sparse=True)

    def forward(self, x, step):
        options = self.options
        if "sparse" in options:   # a few rows per sample, from the data: each rank touches its own rows
            x = x + self.embedding((x[:, :3].abs() * 7).long() % 50)
        h = torch.relu(self.body(x))
        y = self.head(h)
        if "unused" in options and (rank + step) % 2 == 0:
            y = y + self.side(h)
        return y


def draw_parameters(model, step, options):
    g = torch.Generator().manual_seed(1000 + step)   # the same on every rank and for both models
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 2 if "float" in options
                    else torch.randint(-8, 9, p.shape, generator=g).float() / 4)


def gradients(ddps, step, options, dtype):
    for ddp in ddps:
        draw_parameters(ddp.module, step, options)
        ddp.zero_grad(set_to_none=False)
    g = torch.Generator().manual_seed(100 * step + rank)
    draw = (lambda *shape: torch.randn(shape, generator=g) * 2) if "float" in options else \
        (lambda *shape: torch.randint(-3, 4, shape, generator=g).float())
    batches = [(draw(32, 16), draw(32, 4)) for _ in range(2 if "accumulate" in options else 1)]
    for i, (x, target) in enumerate(batches):
        last = i == len(batches) - 1
        x, target = x.to(device(options), dtype), target.to(device(options), dtype)
        with contextlib.ExitStack() as stack:
            if not last:
                for ddp in ddps:
                    stack.enter_context(ddp.no_sync())
            sum((ddp(x, step) * target).sum() for ddp in ddps).div(32).backward()
    return [p.grad.to_dense().float().cpu() for ddp in ddps for p in ddp.module.parameters()]


def device(options):
    return "cuda" if "cuda" in options else "cpu"


def bf16_on_cpu(hook):
    """bf16_compress_wrapper(hook) under another name: DDP accepts the wrapper by name only with NCCL."""
    wrapped = bf16_compress_wrapper(hook)
    return lambda state, bucket: wrapped(state, bucket)


def scenario(policy, options):
    """The two DDPs of one scenario, STEPS steps; what pytest checks."""
    dtype = torch.bfloat16 if "bfloat16" in options else torch.float32
    nets = [Net(options).to(device(options), dtype) for _ in range(2 if "gan" in options else 1)]
    # ~1 KB caps: two buckets in the first step, then the one DDP rebuilds in backward order
    ddp_args = dict(bucket_cap_mb_list=[0.001] * 3, find_unused_parameters="unused" in options,
                    static_graph="static" in options, gradient_as_bucket_view="view" in options)
    group = None
    if "group" in options:   # every rank makes every group, in the same order
        group = [dist.new_group([r]) for r in range(size)][rank]
        ddp_args["process_group"] = group
    plain = [DDP(copy.deepcopy(net), **ddp_args) for net in nets]
    hooked = [DDP(net, **ddp_args) for net in nets]
    states = [cl.CommlibState(net.named_parameters(), policy=policy, whole_buckets="per_parameter" not in options,
                              process_group=group) for net in nets]
    wrapper = fp16_compress_wrapper if "fp16" in options else bf16_on_cpu if "bf16" in options else None
    for ddp, state in zip(hooked, states):
        ddp.register_comm_hook(state, wrapper(cl.ddp_comm_hook) if wrapper else cl.ddp_comm_hook)
    if wrapper:
        for ddp in plain:
            ddp.register_comm_hook(dist.group.WORLD, wrapper(allreduce_hook))

    before = commlib.records()   # each dispatch writes a new record: what this scenario dispatched differs
    steps = []
    for step in range(STEPS):
        theirs, ours = gradients(plain, step, options, dtype), gradients(hooked, step, options, dtype)
        steps.append({"max_diff": max((a - b).abs().max().item() for a, b in zip(theirs, ours)),
                      "max_grad": max(a.abs().max().item() for a in theirs)})
    names = [n for state in states for n in state.names.values()]
    result = {"rank": rank, "size": size, "steps": steps, "names": names,
              "record_names": [n for state in states for n in state.record_names()],
              "buckets": {n: r["bucket"] for n, r in commlib.records().items() if before.get(n) is not r},
              "grads": [g.flatten().tolist() for g in ours],
              "records": {n: [r["algorithm"], r["compression"]] for n, r in commlib.records().items()
                          if before.get(n) is not r},
              "iteration": states[0].iteration, "buckets_reduced": states[0].buckets_reduced}
    return result


for name, (policy, options) in scenarios.items():
    commlib.torch.ddp._states = itertools.count()   # states number from 0 in each scenario, as in a fresh process
    try:
        result = scenario(policy, set(options.split(",")) - {""})
    except Exception:   # reported as this scenario's failure; the next scenarios still run
        result = {"rank": rank, "error": traceback.format_exc()}
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(result))
commlib.shutdown()
dist.destroy_process_group()
