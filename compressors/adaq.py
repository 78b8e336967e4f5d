"""adaq: per sign, the elements beyond a sampled top-ratio threshold become that sign's mean;
only their indices and two means travel."""
import torch

from commlib.compressors.base import Compressor, check_ratio, index_dtype, register


def sampled_cut(values, ratio, sample_size, generator):
    """The value above which about `ratio` of `values` (non-negative) lie, from a random sample;
    inf when there is nothing to sample."""
    n = values.numel()
    if n == 0:
        return float("inf")
    sample = values if n <= sample_size else values[torch.randint(n, (sample_size,), generator=generator,
                                                                    device=values.device)]
    rank = max(1, round(ratio * sample.numel()))
    return torch.topk(sample, rank, sorted=False).values.min()


@register
class AdaQ(Compressor):
    """ratio: fraction of each sign's elements sent (0.01); each side is replaced by its mean, so
    the payload is 4 bytes per selected index plus 8. Biased: residual memory by default.
    sample_ratio: fraction sampled per sign to find the thresholds (at least 1000)."""
    name = "adaq"
    payload = "sparse"
    default_memory = "residual"

    def __init__(self, ratio=0.01, sample_ratio=0.01, **common):
        super().__init__(**common)
        self.ratio = check_ratio(ratio)
        self.sample_ratio = check_ratio(sample_ratio, "sample_ratio")

    def encode(self, x, name):
        generator = self.generator(name, x.device)
        sample_size = max(1000, int(x.numel() * self.sample_ratio))
        parts = []
        for side in (x.clamp_min(0), (-x).clamp_min(0)):          # two signs, not a loop over elements
            positive = side[side > 0]
            cut = sampled_cut(positive, self.ratio, sample_size, generator)
            chosen = torch.nonzero((side >= cut) & (side > 0)).squeeze(1)
            parts.append((chosen, side[chosen].mean() if chosen.numel() else side.new_zeros(())))
        (pos, pos_mean), (neg, neg_mean) = parts
        dtype = index_dtype(x.numel())
        return pos.to(dtype), neg.to(dtype), torch.stack([pos_mean, -neg_mean])

    def decode(self, payload, ctx):
        pos, neg, means = payload
        out = torch.zeros(ctx.numel, dtype=ctx.work, device=ctx.device)
        means = means.to(ctx.work)
        out[pos.long()] = means[0]
        out[neg.long()] = means[1]
        return out
