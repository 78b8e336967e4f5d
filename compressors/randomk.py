"""randomk: k values at random indices that every rank draws identically from (seed, name, step)."""
import torch

from commlib.compressors.base import Compressor, check_ratio, register, scatter, top_count


def shared_indices(numel, k, generator):
    """k distinct indices, one uniform in each of k equal strata of [0, numel): O(k), and every
    element is chosen with probability ~k/numel. Drawn on the CPU so CPU and GPU ranks agree."""
    start = torch.arange(k, dtype=torch.int64) * numel // k
    size = torch.arange(1, k + 1, dtype=torch.int64) * numel // k - start
    return start + (torch.rand(k, generator=generator, dtype=torch.float64) * size).long()


@register
class RandomK(Compressor):
    """ratio: fraction of elements sent. The indices never travel (same generator everywhere),
    so the payload is 4k bytes and *summable*: ring or switchml carry it. Biased by the missing
    (1-ratio), hence the residual memory by default. Its own torch.Generator per (seed, name,
    step): the global RNG is never touched."""
    name = "randomk"
    payload = "summable"
    default_memory = "residual"

    def __init__(self, ratio=0.01, **common):
        super().__init__(**common)
        self.ratio = check_ratio(ratio)

    def indices(self, name, step, numel, device):
        generator = self.generator(name, "cpu", shared=True, step=step)
        return shared_indices(numel, top_count(self.ratio, numel), generator).to(device)

    def encode(self, x, name):
        return (x[self.indices(name, self.steps.get(name, 0), x.numel(), x.device)],)

    def decode(self, payload, ctx):
        return scatter(payload[0], self.indices(ctx.name, ctx.step, ctx.numel, ctx.device), ctx)

    def expected_bytes(self, numel):
        return 4 * top_count(self.ratio, numel)
