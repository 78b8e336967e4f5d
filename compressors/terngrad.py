"""terngrad: ternary {-1, 0, +1} * max|g| with Bernoulli(|g|/max|g|), 2 bits per element (Wen et al.)."""
import torch

from commlib.compressors import packing
from commlib.compressors.base import Compressor, is_number, register
from commlib.compressors.signsgd import unsigns
from commlib.errors import ConfigError


def ternarize(x, clip, generator):
    """-> (kept mask, sign mask, scalar): element i is sign_i * scalar if kept, else 0; kept with
    probability |x_i| / scalar, so unbiased for the clipped tensor."""
    if clip:
        bound = clip * x.std(correction=0)
        bound = torch.where(bound > 0, bound, torch.inf)   # a constant tensor needs no clipping
        x = x.clamp(-bound, bound)
    magnitude = x.abs()
    scalar = magnitude.max()
    keep = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype).mul_(scalar) < magnitude
    return keep, x >= 0, scalar.reshape(1)


@register
class TernGrad(Compressor):
    """clip: clip to clip*std before ternarizing (TernGrad's 2.5); it lowers the variance and
    biases outliers; clip=0 disables (then unbiased). Two bit planes (kept, sign) per element:
    16x fewer bytes than fp32."""
    name = "terngrad"
    payload = "gather"

    def __init__(self, clip=2.5, **common):
        super().__init__(**common)
        if clip is not None and not (is_number(clip) and clip >= 0):
            raise ConfigError(f"terngrad clip must be >= 0 (0 or None: no clipping), got {clip!r}")
        self.clip = clip

    def encode(self, x, name):
        keep, positive, scalar = ternarize(x, self.clip, self.generator(name, x.device))
        return packing.pack_bits(keep, 1), packing.pack_bits(positive, 1), scalar

    def decode(self, payload, ctx):
        kept, signs, scalar = payload
        values = unsigns(signs, ctx).mul_(scalar.to(ctx.work))
        return values.mul_(packing.unpack_bits(kept, 1, ctx.numel))

    def expected_bytes(self, numel):
        return 2 * packing.packed_nbytes(numel, 1) + 4
