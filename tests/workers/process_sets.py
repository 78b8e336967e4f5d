"""commlib's process sets against Horovod's own, in one horovodrun job (2 or 4 ranks).

argv: algorithm (ring, switchml, omnireduce), then optionally "commlib-first" (commlib.init() before
hvd.init(process_sets=...)). The job registers Horovod process sets ({0} and {1}
on 2 ranks; {0,1}, {2,3} and {1,2,3} on 4); every rank reduces, over each set it is in, the same
tensors through commlib and through Horovod, all sets' (and the whole job's) tensors in flight at
once, then trains through commlib.torch.DistributedOptimizer(process_set=) beside Horovod's. It
reports the differences, the algorithms records name, each set's SwitchML job, and the error a
rank gets when it reduces over a set it is not in; tests/test_process_sets.py checks them.
"""
import os
import sys

import numpy as np
import torch

import commlib
import commlib.api
from commlib.testing import report

if sys.argv[1] == "plain":   # no Horovod: commlib.ProcessSet under mpirun (MPI groups) or torchrun (new_group)
    commlib.init(policy="*=ring", timeout_s=60.0)
    rank, size = commlib.rank(), commlib.size()
    halves = [commlib.add_process_set(list(range(size))[i::2]) for i in (0, 1)]   # {0,2,..} and {1,3,..}
    mine = next(ps for ps in halves if ps.included())
    x = np.full(8, rank + 1.0, np.float32)
    both = [commlib.allreduce_async(x, name="half", op=commlib.Sum, process_set=mine),
            commlib.allreduce_async(x, name="all", op=commlib.Sum)]
    got = [commlib.synchronize(h).tolist() for h in both]
    rt = commlib.api.runtime()
    report(rank=rank, set=mine.ranks, half=got[0], all=got[1], set_rank=mine.rank(),
           engines=[rt.backends["ring"].stats()["engine"], rt.process_sets.runtime(mine).backends["ring"].stats()["engine"]])
    commlib.shutdown()
    sys.exit(0)

if sys.argv[1] == "tf":   # commlib.tensorflow's DistributedGradientTape(process_set=) beside Horovod's
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import commlib.tensorflow as cl
    sets = [hvd.ProcessSet([0, 1])]
    hvd.init(process_sets=sets)
    commlib.init(policy="*=ring")   # every rank: init is the job's collective set-up
    result = {"rank": hvd.rank(), "included": sets[0].included()}
    if sets[0].included():
        v = tf.Variable(np.arange(6, dtype=np.float32))
        grads = []
        for make in (cl.DistributedGradientTape, hvd.DistributedGradientTape):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(v * v * (hvd.rank() + 1.0))
            grads.append(make(tape, process_set=sets[0]).gradient(loss, [v])[0].numpy().tolist())
        result.update(ours=grads[0], horovod=grads[1])
    report(**result)
    commlib.shutdown()
    sys.exit(0)

import horovod.torch as hvd   # noqa: E402  (the plain and tf modes run without it)
import commlib.torch as cl   # noqa: E402

algorithm = sys.argv[1]
size = int(os.environ["HOROVOD_SIZE"])
LAYOUT = {2: [[0], [1]], 4: [[0, 1], [2, 3], [1, 2, 3]]}[size]
sets = [hvd.ProcessSet(ranks) for ranks in LAYOUT]
commlib_first = "commlib-first" in sys.argv[2:]   # commlib.init() must leave Horovod's init to the user
if commlib_first:
    commlib.init(policy=f"*={algorithm}", timeout_s=60.0)
hvd.init(process_sets=sets)
if not commlib_first:
    commlib.init(policy=f"*={algorithm}", timeout_s=60.0)
torch.set_num_threads(1)
rank = hvd.rank()
mine = [ps for ps in sets if ps.included()]
for ps in sets:   # every rank, in the same order: members form the set now, the others only get it
    commlib.add_process_set(commlib.ProcessSet(ps.ranks))


def tensor(tag, step):
    """Integer values (sums are exact in float32 whatever the order), half of the 256-element blocks
    zero (omnireduce skips them), a different pattern per rank, set and step."""
    g = np.random.default_rng(1000 * rank + 17 * tag + step)
    x = g.integers(-50, 50, 4096).astype(np.float32)
    x.reshape(16, 256)[g.permutation(16)[:8]] = 0
    return torch.from_numpy(x)


def name_of(ps):
    return "set" + "".join(map(str, ps.ranks))


# 1. every set this rank is in and the whole job, all in flight at once, then each waited for
diffs, handles, inputs = {}, {}, {}
for step in range(3):
    for ps in mine + [None]:
        label = f"{name_of(ps) if ps else 'all'}.{step}"
        inputs[label] = tensor(len(inputs), step)
        handles[label] = commlib.allreduce_async(inputs[label], name=label, process_set=ps)
        handles[label + ".sum"] = commlib.allreduce_async(inputs[label], name=label + ".sum", op=commlib.Sum,
                                                          process_set=ps)
        for suffix, op in (("", hvd.Average), (".sum", hvd.Sum)):
            theirs = hvd.allreduce(inputs[label], name="hvd." + label + suffix, op=op,
                                   process_set=ps or hvd.global_process_set)
            inputs[label + suffix + ".horovod"] = theirs
for label in handles:
    ours = commlib.synchronize(handles[label])
    theirs = inputs[label + ".horovod"]
    diffs[label] = float((ours - theirs).abs().max() / max(1.0, float(theirs.abs().max())))

# 2. commlib's own ProcessSet (no Horovod set object) over the same ranks
own = commlib.ProcessSet(mine[0].ranks)
x = tensor(99, 0)
diffs["own." + name_of(own)] = float((commlib.allreduce(x, name="own", process_set=own) -
                                      hvd.allreduce(x, name="hvd.own", process_set=mine[0])).abs().max())

# 3. a set this rank is not in
outside = next(ps for ps in sets if not ps.included())
try:
    commlib.allreduce(torch.ones(4), name="outside", process_set=outside)
    outside_error = None
except commlib.CommError as exc:
    outside_error = f"{type(exc).__name__}: {exc}"


# 4. DistributedOptimizer over this rank's first set, beside Horovod's over the same set
def train(make_optimizer, ps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    opt = make_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(16, 20, generator=g)).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


first = mine[0]
ours = train(lambda o, named: cl.DistributedOptimizer(o, named_parameters=named, process_set=first), first)
theirs = train(lambda o, named: hvd.DistributedOptimizer(o, named_parameters=named, process_set=first), first)
in_set = hvd.allgather(ours.unsqueeze(0), name="check.params", process_set=first)

rt = commlib.api.runtime()
switch = {}
if algorithm == "switchml":   # each set is its own job on the job's switch
    for ps in [None] + mine:
        backend = rt.process_sets.runtime(ps).backends["switchml"]
        switch[name_of(ps) if ps else "all"] = [str(backend.address), backend.job,
                                                backend.ctx.settings.switch_streams]
aggregators = {}
if algorithm == "omnireduce":   # each set streams to aggregators of its own (colocated: one per set rank)
    for ps in [None] + mine:
        aggregators[name_of(ps) if ps else "all"] = rt.process_sets.runtime(ps).backends["omnireduce"].stats()[
            "aggregators"]
report(rank=rank, sets=[ps.ranks for ps in mine], diffs=diffs, outside_error=outside_error, aggregators=aggregators,
       optimizer_vs_horovod=float((ours - theirs).abs().max()),
       optimizer_same_in_set=all(torch.equal(in_set[0], row) for row in in_set),
       algorithms={label: r["algorithm"] for label, r in commlib.records().items()},
       set_sizes={name_of(ps): rt.process_sets.runtime(ps).ctx.size for ps in mine}, switch=switch)
commlib.shutdown()
