"""signsgd: send the sign (1 bit per element), aggregate by majority vote (Bernstein et al.)."""
import math

import torch

from commlib.compressors import packing
from commlib.compressors.base import Compressor, finite, register


def signs(x):
    """Packed bits of x >= 0 (zero counts as +1): n/8 bytes."""
    return packing.pack_bits(x >= 0, 1)


def unsigns(packed, ctx):
    """+-1 tensor of the work dtype from packed sign bits."""
    return packing.unpack_bits(packed, 1, ctx.numel).to(ctx.work).mul_(2).sub_(1)   # in place: 2 passes fewer


def vote(x, is_finite):
    """A vote's payload: x's sign bits, then a byte saying x was not finite (an fp16 overflow), which
    no sign can say: the vote is then NaN on every rank, so that a loss scaler skips the step."""
    flag = torch.tensor([0 if is_finite else 1], dtype=torch.uint8, device=x.device)
    return (torch.cat((signs(x), flag)),)


def ballot(payload, ctx):
    """A rank's +-1 votes, or NaN throughout where its gradient was not finite (vote)."""
    packed = payload[0]
    if packed[-1]:
        return torch.full((ctx.numel,), math.nan, dtype=ctx.work, device=packed.device)
    return unsigns(packed[:-1], ctx)


def majority(tensors):
    """Elementwise majority vote of +-1 tensors; ties go to +1. A NaN ballot (a rank's gradient
    was not finite) makes the whole vote NaN."""
    votes = torch.stack(tensors).sum(0)
    if torch.isnan(votes.reshape(-1)[0]):   # +-1 sums are never NaN: a NaN ballot is in
        return votes
    return torch.where(votes >= 0, 1.0, -1.0).to(votes.dtype)


@register
class SignSGD(Compressor):
    """32x fewer bytes. The result is a vote in {-1, +1}, never divided by the number of ranks;
    scale it with the learning rate (signSGD's lr is typically ~1e-4 for Adam-like steps)."""
    name = "signsgd"
    payload = "gather"
    averages = False

    def encode(self, x, name):
        return vote(x, finite(x))

    def decode(self, payload, ctx):
        return ballot(payload, ctx)

    def aggregate(self, tensors):
        return majority(tensors)

    def expected_bytes(self, numel):
        return -(-numel // 8) + 1
