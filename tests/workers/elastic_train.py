"""Elastic training through commlib.torch.DistributedOptimizer (hvd.elastic.run, TorchState).

argv: steps kill_at hosts_file [noregister|exit]. Started by horovodrun --min-np 2 --max-np 4 with a discovery
script that prints hosts_file (localhost:2 and 127.0.0.1:1 at first). The worker on 127.0.0.1
kills itself (SIGKILL) at step kill_at, after its backward pass, while the others wait for its
gradients; Horovod blacklists that host and the survivors go on as a world of 2. Rank 0 then adds
a slot on localhost to hosts_file, and waits for Horovod's notice before it commits, so a new
worker joins and the last steps run on 3 ranks again. At every step each rank compares the
gradients commlib reduced with Horovod's allreduce of the same local gradients; at the end it
reports the worlds it saw, that difference, whether the parameters are identical on every rank
and equal to Horovod's average of them, and commlib's view of the job (size, switch job).
With `noregister` commlib is not told of resets: each rank reports the error it then gets. With `exit` the
worker calls sys.exit(1) instead of being killed: its atexit commlib.shutdown() runs.
"""
import os
import signal
import sys
import time

import torch

import horovod.torch as hvd
import commlib
import commlib.api
import commlib.elastic
import commlib.torch as cl
from commlib.testing import report

steps, kill_at, hosts_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
hvd.init()
torch.set_num_threads(1)
host = os.environ.get("HOROVOD_HOSTNAME")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = cl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, step=0)
if sys.argv[4:] != ["noregister"]:
    commlib.elastic.register(state)
seen = {"worlds": [], "grad_diff": 0.0, "steps": 0, "switch_jobs": []}


def flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


def switch_job():
    backend = commlib.api.runtime().backends.get("switchml")
    return None if backend is None else backend.job


@hvd.elastic.run
def train(state):
    seen["worlds"].append([hvd.size(), commlib.size()])
    seen["switch_jobs"].append(switch_job())
    while state.step < steps:
        opt.zero_grad()
        g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
        model(torch.randn(16, 16, generator=g)).pow(2).mean().backward()   # hooks submit to commlib
        if host == "127.0.0.1" and state.step == kill_at:   # mid-step: the others wait for these gradients
            if sys.argv[4:] == ["exit"]:
                sys.exit(1)
            os.kill(os.getpid(), signal.SIGKILL)
        local = flat(p.grad for p in model.parameters()).clone()
        reference = hvd.allreduce(local, name="reference", op=hvd.Average)
        opt.step()
        diff = (flat(p.grad for p in model.parameters()) - reference).abs().max().item()
        seen["grad_diff"] = max(seen["grad_diff"], diff)
        seen["steps"] += 1
        state.step += 1
        if hvd.rank() == 0 and hvd.size() == 2:   # the survivors: a new slot appears on localhost
            with open(hosts_file, "w") as f:
                f.write("localhost:3\n127.0.0.1:1\n")
            deadline = time.monotonic() + 90
            while state._host_messages.empty() and time.monotonic() < deadline:   # as Horovod's own tests
                time.sleep(0.1)
        state.commit()


if sys.argv[4:] == ["noregister"]:
    try:
        train(state)
    except commlib.CommError as exc:
        report(rank=hvd.rank(), error=f"{type(exc).__name__}: {exc}", worlds=seen["worlds"])
        sys.exit(0)
train(state)
params = flat(model.parameters())
everyone = hvd.allgather(params.unsqueeze(0), name="check.params")
average = hvd.allreduce(params, name="check.average", op=hvd.Average)
report(rank=hvd.rank(), host=host, worlds=seen["worlds"], steps_here=seen["steps"], final_step=state.step,
       grad_diff_vs_horovod=seen["grad_diff"], same_on_all_ranks=all(torch.equal(everyone[0], row) for row in everyone),
       diff_vs_horovod_average=(average - params).abs().max().item(), commlib_size=commlib.size(),
       hvd_size=hvd.size(), switch_jobs=seen["switch_jobs"] + [switch_job()],
       algorithms=sorted({r["algorithm"] for r in commlib.records().values()}))
commlib.shutdown()
