"""efsignsgd: error-feedback signSGD (Karimireddy et al.): p = lr*g + e; send sign(p) and mean|p|."""
import torch

from commlib.compressors.base import Compressor, is_number, register
from commlib.compressors.signsgd import signs, unsigns
from commlib.errors import ConfigError


@register
class EFSignSGD(Compressor):
    """lr: the step size folded into the memory (p = lr*g + e, Karimireddy et al.'s gamma); the
    aggregate is sum/lr, so the result is in gradient units again (average=True then divides by
    the ranks: a mean gradient). The division undoes whatever scale the memory applied, so
    memory=residual or none give sum/1, never a gradient 1/lr too large."""
    name = "efsignsgd"
    payload = "gather"
    default_memory = "efsignsgd"

    def __init__(self, lr=0.1, **common):
        super().__init__(**common)
        if not (is_number(lr) and lr > 0):
            raise ConfigError(f"efsignsgd lr must be > 0, got {lr!r} (the aggregate divides by it)")
        self.lr = float(lr)

    def encode(self, x, name):
        return signs(x), x.abs().mean().reshape(1)

    def decode(self, payload, ctx):
        packed, scale = payload
        return unsigns(packed, ctx).mul_(scale.to(ctx.work))

    def aggregate(self, tensors):
        return torch.stack(tensors).sum(0) / getattr(self.memory, "gamma", 1.0)

    def expected_bytes(self, numel):
        return -(-numel // 8) + 4
