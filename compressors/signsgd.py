"""signsgd: send the sign (1 bit per element), aggregate by majority vote (Bernstein et al.)."""
import torch

from commlib.compressors import packing
from commlib.compressors.base import Compressor, register


def signs(x):
    """Packed bits of x >= 0 (zero counts as +1): n/8 bytes."""
    return packing.pack_bits(x >= 0, 1)


def unsigns(packed, ctx):
    """+-1 tensor of the work dtype from packed sign bits."""
    return packing.unpack_bits(packed, 1, ctx.numel).to(ctx.work).mul_(2).sub_(1)   # in place: 2 passes fewer


def majority(tensors):
    """Elementwise majority vote of +-1 tensors; ties go to +1."""
    votes = torch.stack(tensors).sum(0)
    return torch.where(votes >= 0, 1.0, -1.0).to(votes.dtype)


@register
class SignSGD(Compressor):
    """32x fewer bytes. The result is a vote in {-1, +1}, never divided by the number of ranks;
    scale it with the learning rate (signSGD's lr is typically ~1e-4 for Adam-like steps)."""
    name = "signsgd"
    payload = "gather"
    averages = False

    def encode(self, x, name):
        return (signs(x),)

    def decode(self, payload, ctx):
        return unsigns(payload[0], ctx)

    def aggregate(self, tensors):
        return majority(tensors)

    def expected_bytes(self, numel):
        return -(-numel // 8)
