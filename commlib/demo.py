"""The embedded-default job: data-parallel training of a small MLP on a learnable synthetic task,
through Horovod's DistributedOptimizer with commlib doing the communication. No configuration:
`make demo` runs it with 4 local workers under horovodrun; the policy (default `auto`) tries the
dense gradients on a local software switch (SwitchML, embedded in rank 0) and on the ring over the
first steps and keeps the faster (on one host, often the ring: see the closing lines).

    horovodrun -np 4 -H localhost:4 --gloo python -m commlib.demo [--steps 60] [--policy '*=ring']
"""
import argparse
import time

import torch

import commlib
import commlib.torch as cl


def teacher_task(seed, samples, features=64, classes=10):
    """A fixed random teacher network labels Gaussian inputs: learnable, deterministic per seed."""
    g = torch.Generator().manual_seed(1234)       # the same teacher on every rank
    teacher = torch.randn(features, classes, generator=g)
    x = torch.randn(samples, features, generator=torch.Generator().manual_seed(seed))
    return x, (x @ teacher).argmax(dim=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--policy", default=None, help="commlib policy text (default: COMMLIB_POLICY or auto)")
    args = parser.parse_args(argv)

    import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    commlib.init(policy=args.policy)
    x, y = teacher_task(seed=hvd.rank(), samples=args.batch_size * args.steps)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 10))
    optimizer = cl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                        named_parameters=model.named_parameters())
    cl.broadcast_parameters(model.state_dict(), root_rank=0)

    if hvd.rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"Model: MLP 64-{args.hidden}-{args.hidden}-10 ({params:,} parameters)")
        print(f"Batch size: {args.batch_size}")
        print(f"Number of CPUs: {hvd.size()}")
    rates = []
    for step in range(args.steps):
        batch = slice(step * args.batch_size, (step + 1) * args.batch_size)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        rates.append(args.batch_size / (time.perf_counter() - start))
        mean_loss = hvd.allreduce(loss.detach(), name="demo.loss").item()
        if hvd.rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"Iter #{step}: loss {mean_loss:.4f}  {rates[-1]:.1f} img/sec per CPU")
    if hvd.rank() == 0:
        tail = torch.tensor(rates[len(rates) // 5:])   # after warm-up
        print(f"Img/sec per CPU: {tail.mean():.1f} +-{1.96 * tail.std():.1f}")
        print(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * tail.mean():.1f} +-{1.96 * tail.std() * hvd.size() ** 0.5:.1f}")
        records = commlib.records().values()
        used = sorted({(r["algorithm"], r["compression"] or "none") for r in records})
        print("Algorithms used: " + ", ".join(f"{a} ({c})" for a, c in used))
        for measured in {repr(r["auto"]["times"]): r["auto"] for r in records if (r.get("auto") or {}).get("times")}.values():
            times = ", ".join(f"{a} {1000 * t:.2f} ms" for a, t in sorted(measured["times"].items()))
            kept = measured.get("choice")   # none yet where a group's trials run (again) at the last step
            print(f"auto measured {times} a step of a group and " + (f"kept {kept}" if kept else "is still trying"))
    commlib.shutdown()


if __name__ == "__main__":
    main()
