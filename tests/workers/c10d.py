"""torch.distributed programs on `dist.init_process_group("commlib")`, each against a Gloo group of the
same job on the same inputs. argv: scenario (collectives | ddp | fsdp | int8 | mismatch | missing).

Inputs are small integers (as floats, too), so every sum, average over 2 or 4 ranks, product, min
and max is exact in any order and dtype: the comparison with Gloo is equality, whatever the
algorithm's reduction order. Each rank reports (commlib.testing.report) what differed, by name.
"""
import sys
import time

import torch
import torch.distributed as dist

import commlib
import commlib.torch  # noqa: F401  (registers the "commlib" backend)
from commlib.testing import report

scenario = sys.argv[1]
dist.init_process_group("commlib")
rank, size = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
       "product": dist.ReduceOp.PRODUCT}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}


def inputs(dtype, op, n=1000, of=None):
    """Rank `of`'s small integers: 1 or 2 for a product (no overflow), else 0..7."""
    g = torch.Generator().manual_seed(17 * (rank if of is None else of) + n)
    high = 3 if op == "product" else 8
    return torch.randint(1 if op == "product" else 0, high, (n,), generator=g).to(dtype)


def reference(dtype, op, n=1000):
    """The result from Gloo (which has no AVG: its sum, divided, exact for these inputs)."""
    out = inputs(dtype, op, n)
    dist.all_reduce(out, op=OPS["sum" if op == "avg" else op], group=gloo)
    return out / size if op == "avg" else out


SEEN = set()


def note_algorithm():
    """What reduced the last all_reduce (the core's unnamed calls share one record)."""
    last = commlib.records().get("allreduce.noname")
    if last is not None:
        SEEN.add(last["algorithm"])


def outcome(fn):
    try:
        return fn()
    except Exception as exc:   # compared by the test: which error, on which rank
        return f"{type(exc).__name__}: {exc}"


def allreduce_cases():
    cases = {}
    for dname, dtype in DTYPES.items():
        for op in OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue   # neither Gloo nor NCCL averages integers
            ours = inputs(dtype, op)
            work = dist.all_reduce(ours, op=OPS[op], async_op=True)
            waited = work.wait()
            note_algorithm()
            theirs = reference(dtype, op)
            cases[f"{dname}/{op}"] = {"equal": bool(torch.equal(ours, theirs)), "dtype": str(ours.dtype),
                                      "completed": work.is_completed(), "waited": waited,
                                      "future": torch.equal(work.get_future().wait()[0], ours)}
    return cases


def other_collectives():
    got = {}
    x = inputs(torch.float32, "sum", 8)
    out, ref = torch.empty(8 * size), torch.empty(8 * size)
    dist.all_gather_into_tensor(out, x)
    dist.all_gather_into_tensor(ref, x, group=gloo)
    got["all_gather_into_tensor"] = torch.equal(out, ref)
    x = inputs(torch.float32, "sum", 4 * size)
    out, ref = torch.empty(4), torch.empty(4)
    dist.reduce_scatter_tensor(out, x)
    dist.reduce_scatter_tensor(ref, x, group=gloo)
    got["reduce_scatter_tensor"] = torch.equal(out, ref)
    x = torch.arange(2.0 * size) + 100 * rank
    out = torch.empty(2 * size)
    dist.all_to_all_single(out, x)
    got["all_to_all_single"] = out.tolist() == [100.0 * src + 2 * rank + i for src in range(size) for i in range(2)]
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=size - 1)
    got["broadcast"] = b.tolist() == [float(size - 1)] * 3
    dist.barrier()
    if rank == 0:
        dist.send(torch.arange(3.0), dst=size - 1)
    if rank == size - 1:
        r = torch.empty(3)
        dist.recv(r, src=0)
        got["send_recv"] = r.tolist() == [0.0, 1.0, 2.0]
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        z = torch.full((2,), float(rank + 1))
        dist.all_reduce(z, group=pair)
        got["new_group"] = z.tolist() == [3.0, 3.0]
    return got


def train(wrap, steps=3):
    """Losses of a small MLP wrapped by wrap(net) -> module, from the same start and data on every call."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = wrap(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]), losses


def ddp_against_gloo():
    """DDP with no hook on the commlib group and on the Gloo group."""
    ddp = lambda group: lambda net: torch.nn.parallel.DistributedDataParallel(net, process_group=group)
    (ours, our_losses), (theirs, their_losses) = train(ddp(None)), train(ddp(gloo))
    diff = float((ours - theirs).abs().max() / theirs.abs().max())
    return {"relative_diff": diff, "losses": our_losses, "gloo_losses": their_losses}


def fsdp_against_gloo():
    """FSDP2 (`fully_shard` per layer) on the commlib group's mesh and on the Gloo group's."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def fsdp(group):
        def wrap(net):
            for layer in (net[0], net[2], net):
                fully_shard(layer, mesh=DeviceMesh.from_group(group, "cpu"))
            return net
        return wrap
    return {"losses": train(fsdp(dist.group.WORLD))[1], "gloo_losses": train(fsdp(gloo))[1]}


def int8_against_gloo(n=4096):
    """reduce_scatter (Sum, Avg) and all_gather in int8 (COMMLIB_C10D_INT8) against Gloo's exact result:
    the largest error over the bound int8_collectives states, per element (<= 1 holds it)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(size * n, generator=g) * torch.logspace(-3, 3, size * n)   # blocks of every magnitude
    gathered = torch.empty(size * size * n)
    dist.all_gather_into_tensor(gathered, x, group=gloo)
    mine_from_each = [block_max(part) for part in gathered.view(size, size, n)[:, rank]]   # what rank r sends me
    worst = {}
    for op in ("sum", "avg"):
        ours, exact = torch.empty(n), torch.empty(n)
        dist.reduce_scatter_tensor(ours, x, op=OPS[op])
        dist.reduce_scatter_tensor(exact, x, group=gloo)
        exact = exact / size if op == "avg" else exact
        bound = sum(mine_from_each) / 254 / (size if op == "avg" else 1)
        worst[f"reduce_scatter/{op}"] = float(((ours - exact).abs() / bound).max())
    ours, exact = torch.empty(size * n), torch.empty(size * n)
    dist.all_gather_into_tensor(ours, x[:n])
    dist.all_gather_into_tensor(exact, x[:n], group=gloo)
    bound = torch.cat([block_max(part) for part in exact.view(size, n)]) / 254
    worst["all_gather"] = float(((ours - exact).abs() / bound).max())
    return {"worst_over_bound": worst, "fsdp": fsdp_against_gloo()}


def block_max(x):
    """Per element, the largest magnitude in its int8 block (the scale's source)."""
    from commlib.torch.int8_collectives import BLOCK
    blocks = torch.nn.functional.pad(x.abs(), (0, -x.numel() % BLOCK)).view(-1, BLOCK).amax(dim=1)
    return blocks.repeat_interleave(BLOCK)[:x.numel()]


if scenario == "collectives":
    results = {"allreduce": allreduce_cases(), "other": other_collectives()}
elif scenario == "ddp":
    results = ddp_against_gloo()
elif scenario == "fsdp":
    results = fsdp_against_gloo()
elif scenario == "int8":
    results = int8_against_gloo()
elif scenario == "mismatch":   # the last rank reduces a tensor of another length
    start = time.monotonic()
    t = torch.ones(10 if rank == size - 1 else 12)
    results = {"error": outcome(lambda: dist.all_reduce(t)), "seconds": time.monotonic() - start}
elif scenario == "missing":    # the last rank never calls it, and stays (one that leaves is a PeerFailure at once)
    start = time.monotonic()
    t = torch.ones(10)
    if rank == size - 1:
        time.sleep(float(sys.argv[2]))
        results = {"error": None}
    else:
        results = {"error": outcome(lambda: dist.all_reduce(t))}
    results["seconds"] = time.monotonic() - start
note_algorithm()
results["algorithms"] = sorted(SEEN)
report(rank=rank, size=size, **results)
if scenario in ("collectives", "ddp", "fsdp", "int8"):
    dist.destroy_process_group()
