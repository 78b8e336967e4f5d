"""Short data-parallel training runs, one per family: 4 thread-ranks train copies of a small MLP
on a teacher-student regression (each rank its own batches), gradients reduced through the
compressor, and the final loss must come within FACTOR of the uncompressed run's."""
import copy

import pytest
import torch

import commlib.compressors as C
from commlib.testing import run_ranks

pytestmark = [pytest.mark.long, pytest.mark.timeout(120)]   # training runs: a soak

RANKS, STEPS, BATCH, LR = 4, 120, 32, 0.1
FACTOR = 1.5     # compressed final loss <= FACTOR * uncompressed final loss


def batch(seed, n):
    """y = teacher(x), a fixed random tanh network: learnable, and not linear."""
    teacher = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(8, 16, generator=teacher), torch.randn(16, 1, generator=teacher) / 4
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return x, torch.tanh(x @ w1) @ w2


def train(spec):
    """Final eval loss of rank 0 (all ranks hold the same weights when the reduce is consistent)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1))
    models = [copy.deepcopy(model) for _ in range(RANKS)]
    comps = [C.build(*C.parse(spec)) for _ in range(RANKS)]
    x_eval, y_eval = batch(10 ** 6, 2000)

    def rank_main(rank, comm):
        net = models[rank]
        opt = torch.optim.SGD(net.parameters(), lr=LR)   # plain SGD: error feedback with momentum needs its own tuning
        for step in range(STEPS):
            x, y = batch(rank * 10 ** 5 + step, BATCH)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            for name, p in net.named_parameters():
                p.grad = comps[rank].reduce(p.grad, name, comm, True)
            opt.step()
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(net(x_eval), y_eval)), [p.clone() for p in net.parameters()]

    results = run_ranks(RANKS, rank_main, sorted(comps[0].carriers())[0], timeout=100)
    for _, params in results[1:]:                        # the ranks stayed in sync
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][1]))
    with torch.no_grad():
        initial = float(torch.nn.functional.mse_loss(model(x_eval), y_eval))
    return results[0][0], initial


@pytest.fixture(scope="module")
def uncompressed():
    loss, initial = train("none")
    assert loss < 0.2 * initial, "the task must be learnable in STEPS steps"
    return loss


@pytest.mark.parametrize("family, spec", [("quantization", "qsgd"),
                                          ("sparsification", "topk(ratio=0.05)"),
                                          ("low rank", "powersgd(rank=2)")])
def test_training_reaches_uncompressed_loss(family, spec, uncompressed):
    loss, _ = train(spec)
    assert loss <= FACTOR * uncompressed, f"{family} ({spec}): {loss:.4f} vs uncompressed {uncompressed:.4f}"
