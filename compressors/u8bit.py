"""u8bit: scale by max|x| and round to a 128-entry log-spaced dictionary; sign in the top bit."""
import torch

from commlib.compressors.base import Compressor, register

STEPS_PER_OCTAVE = 8
# entry 0 is zero; entry i >= 1 is 2**((i - 127) / 8): 127 levels from 2**-15.75 to 1, 9% apart
TABLE = torch.cat([torch.zeros(1), 2.0 ** ((torch.arange(1, 128) - 127) / STEPS_PER_OCTAVE)])
MIDPOINTS = (TABLE[1:] + TABLE[:-1]) / 2   # entry i is chosen when MIDPOINTS[i-1] < y <= MIDPOINTS[i]


def nearest_entry(y):
    """Index of the nearest TABLE entry for y in [0, 1], without a binary search: the log gives
    the entry just below, one comparison with the midpoint picks between it and the next."""
    mids = MIDPOINTS.to(y.device)
    below = (torch.log2(y.clamp_min(2.0 ** -20)) * STEPS_PER_OCTAVE).floor().long() + 127
    below = below.clamp(0, 126)
    return below + (y > mids[below]).long()


@register
class U8bit(Compressor):
    """8 bits per element; relative error <= 4.5% above 2**-16 of the max, smaller values flush
    to zero. Deterministic and biased: add memory=residual for long runs."""
    name = "u8bit"
    payload = "gather"

    def encode(self, x, name):
        scale = x.abs().max()
        index = nearest_entry(x.abs() / scale.clamp_min(torch.finfo(x.dtype).tiny))
        return (index | ((x < 0).long() << 7)).to(torch.uint8), scale.reshape(1)

    def decode(self, payload, ctx):
        codes, scale = payload
        magnitude = TABLE.to(device=ctx.device, dtype=ctx.work)[(codes & 127).long()] * scale.to(ctx.work)
        return torch.where(codes >= 128, -magnitude, magnitude)

    def expected_bytes(self, numel):
        return numel + 4
