"""inceptionn: per-element precision under an error bound (Li et al., INCEPTIONN), 2-bit classes."""
import torch

from commlib.compressors import packing
from commlib.compressors.base import Compressor, is_number, register
from commlib.errors import ConfigError

TINY, SMALL, MID, LARGE = 0, 1, 2, 3   # dropped, int8 fixed point, fp16, full precision


def classify(x, bound):
    """The cheapest class whose error stays within `bound` for each element."""
    a = x.abs()
    half_error = (x.to(torch.float16).to(x.dtype) - x).abs()
    mid = torch.where(half_error <= bound, MID, LARGE)      # inf/nan fail the test: full precision
    return torch.where(a <= bound, TINY, torch.where(a < 254 * bound, SMALL, mid)).to(torch.uint8)


@register
class Inceptionn(Compressor):
    """error_bound: every element is reconstructed within it (INCEPTIONN's 2**-10 by default):
    |x| <= bound is dropped, |x| < 254*bound is int8 in steps of 2*bound, values that fp16
    holds within the bound are fp16, the rest keep full precision. Size depends on the data:
    small gradients compress ~12x, large ones barely."""
    name = "inceptionn"
    payload = "gather"

    def __init__(self, error_bound=2 ** -10, **common):
        super().__init__(**common)
        if not (is_number(error_bound) and error_bound > 0):
            raise ConfigError(f"inceptionn error_bound must be > 0, got {error_bound!r}")
        self.error_bound = float(error_bound)

    def encode(self, x, name):
        cls = classify(x, self.error_bound)
        small = torch.round(x[cls == SMALL] / (2 * self.error_bound)).to(torch.int8)
        return packing.pack_bits(cls, 2), small, x[cls == MID].to(torch.float16), x[cls == LARGE]

    def decode(self, payload, ctx):
        packed, small, mid, large = payload
        cls = packing.unpack_bits(packed, 2, ctx.numel)
        out = torch.zeros(ctx.numel, dtype=ctx.work, device=ctx.device)
        out[cls == SMALL] = small.to(ctx.work) * (2 * self.error_bound)
        out[cls == MID] = mid.to(ctx.work)
        out[cls == LARGE] = large.to(ctx.work)
        return out
