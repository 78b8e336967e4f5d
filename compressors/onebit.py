"""onebit: 1-bit SGD (Seide et al.): a sign mask plus the mean of the negatives and of the rest."""
import torch

from commlib.compressors import packing
from commlib.compressors.base import Compressor, register


def split_means(x, negative):
    """(mean of x where negative, mean of x elsewhere); 0 for an empty side."""
    count = torch.count_nonzero(negative)
    rest = x.numel() - count
    mean_neg = x.clamp(max=0).sum() / count.clamp_min(1)     # clamp, not where: branch-free, 2x faster
    mean_pos = x.clamp(min=0).sum() / rest.clamp_min(1)
    return torch.stack([mean_neg, mean_pos])


@register
class OneBit(Compressor):
    """32x fewer bytes plus 8. Biased: use the residual memory (default), as 1-bit SGD does."""
    name = "onebit"
    payload = "gather"
    default_memory = "residual"

    def encode(self, x, name):
        negative = x < 0
        return packing.pack_bits(negative, 1), split_means(x, negative)

    def decode(self, payload, ctx):
        packed, means = payload
        negative = packing.unpack_bits(packed, 1, ctx.numel)
        means = means.to(ctx.work)
        return negative.to(ctx.work).mul_(means[0] - means[1]).add_(means[1])

    def expected_bytes(self, numel):
        return -(-numel // 8) + 8
