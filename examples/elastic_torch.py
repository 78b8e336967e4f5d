r"""Elastic training with Horovod's hvd.elastic.run, commlib reducing the gradients.

    echo 'localhost:2' > hosts; printf '#!/bin/sh\ncat hosts\n' > discover.sh; chmod +x discover.sh
    horovodrun -np 2 --min-np 2 --max-np 4 --host-discovery-script ./discover.sh --network-interfaces lo \
        python examples/elastic_torch.py
    echo 'localhost:4' > hosts      # while it runs: two workers join at the next commit

(--network-interfaces: on one machine; without it Horovod's elastic driver waits for a second host.)

Workers may fail or join: commlib's errors are Horovod's HorovodInternalError, so hvd.elastic.run
restores the last commit, and commlib.elastic.register(state) re-forms commlib's job (controller,
ring, switch registration, aggregators) for each new world before the state is synchronized.
"""
import argparse

import torch

import horovod.torch as hvd
import commlib
import commlib.elastic
import commlib.torch as cl


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="*=auto", help="commlib policy, per parameter name")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    commlib.init(policy=args.policy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    target = torch.nn.Linear(32, 1)   # the same on every rank (seeded): a regression to learn
    base_lr = 0.01
    opt = cl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=base_lr * hvd.size()),
                                  named_parameters=model.named_parameters())
    state = commlib.elastic.register(hvd.elastic.TorchState(model, opt, step=0))

    def scale_lr():   # after commlib's re-forming: the learning rate follows the world size
        for group in opt.param_groups:
            group["lr"] = base_lr * hvd.size()
    state.register_reset_callbacks([scale_lr])

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            g = torch.Generator().manual_seed(state.step * 1000 + hvd.rank())
            x = torch.randn(64, 32, generator=g)
            opt.zero_grad()
            loss = (model(x) - target(x).detach()).pow(2).mean()
            loss.backward()
            opt.step()
            state.step += 1
            if state.step % 10 == 0:
                state.commit()   # also where added or removed hosts take effect
                if hvd.rank() == 0:
                    print(f"step {state.step}: loss {loss.item():.4f} on {hvd.size()} workers", flush=True)

    train(state)
    commlib.shutdown()


if __name__ == "__main__":
    main()
