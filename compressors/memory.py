"""Error-feedback memories (GRACE's second role), keyed by tensor name.

none      no feedback: what compression drops is lost (unbiased methods, or sign votes).
residual  e = compensated - decompress(own payload); next step sends beta*e + gamma*g.
          The classic error feedback that makes biased compressors (top-k, 1-bit) converge.
efsignsgd residual with gamma = lr: p = lr*g + e (Karimireddy et al.); its compressor divides by lr.
dgc       momentum correction + factor masking (Lin et al., DGC): u = m*u + g, v = v + u; what
          is sent is cleared from both u and v.
powersgd  residual against the averaged low-rank approximation (PyTorch PowerSGD semantics).
"""
from commlib.compressors.base import Memory, is_number, register
from commlib.errors import ConfigError


def _on(state, tensor):
    return state if state.device == tensor.device and state.dtype == tensor.dtype else state.to(tensor)


@register
class NoneMemory(Memory):
    name = "none"


@register
class ResidualMemory(Memory):
    """beta scales the remembered error, gamma the new gradient (beta=gamma=1: plain feedback)."""
    name = "residual"
    uses_decompressed = True
    state_attrs = ("residuals",)

    def __init__(self, beta=1.0, gamma=1.0):
        for what, value in (("beta", beta), ("gamma", gamma)):
            if not is_number(value):
                raise ConfigError(f"residual memory {what} must be a finite number, got {value!r}")
        self.beta, self.gamma = float(beta), float(gamma)
        self.residuals = {}

    def compensate(self, tensor, name):
        residual = self.residuals.get(name)
        if residual is not None and residual.shape != tensor.shape:   # another tensor under the name now
            del self.residuals[name]
            residual = None
        scaled = tensor if self.gamma == 1 else self.gamma * tensor
        if residual is None:
            return scaled
        return scaled + (residual if self.beta == 1 else self.beta * residual).to(tensor)

    def update(self, tensor, name, compressor, payload, ctx, decompressed=None):
        if decompressed is None:
            decompressed = compressor.decompress(payload, ctx)
        self.residuals[name] = tensor - decompressed


@register
class EFSignSGDMemory(ResidualMemory):
    """p = lr * g + e. Keep lr equal to the compressor's (built from it unless given)."""
    name = "efsignsgd"

    def __init__(self, lr=0.1):
        if not (is_number(lr) and lr > 0):
            raise ConfigError(f"efsignsgd lr must be > 0, got {lr!r} (the aggregate divides by it)")
        super().__init__(beta=1.0, gamma=lr)
        self.lr = float(lr)


@register
class PowerSGDMemory(ResidualMemory):
    """Residual memory; PowerSGD passes the *averaged* approximation as `decompressed`."""
    name = "powersgd"


@register
class DGCMemory(Memory):
    """momentum: DGC's 0.9. Gradient clipping (DGC's other trick) is left to the optimizer."""
    name = "dgc"
    uses_decompressed = True
    state_attrs = ("momentums", "accumulated")

    def __init__(self, momentum=0.9):
        if not (is_number(momentum) and 0 <= momentum < 1):
            raise ConfigError(f"dgc memory momentum must be in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.momentums, self.accumulated = {}, {}

    def compensate(self, tensor, name):
        u, v = self.momentums.get(name), self.accumulated.get(name)
        if u is not None and u.shape != tensor.shape:   # another tensor under the name now
            u = v = None
        u = tensor.clone() if u is None else _on(u, tensor).mul_(self.momentum).add_(tensor)
        v = u.clone() if v is None else _on(v, tensor).add_(u)
        self.momentums[name], self.accumulated[name] = u, v
        return v.clone()

    def update(self, tensor, name, compressor, payload, ctx, decompressed=None):
        if decompressed is None:
            decompressed = compressor.decompress(payload, ctx)
        kept = (decompressed == 0).to(tensor.dtype)   # what was sent is non-zero in its decompression
        self.momentums[name].mul_(kept)
        self.accumulated[name].mul_(kept)
