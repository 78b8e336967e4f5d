"""signum: signSGD of a momentum, m = (1 - b) * g + b * m, with majority vote (Bernstein et al.)."""
import torch

from commlib.compressors.base import finite, is_number, register
from commlib.compressors.signsgd import SignSGD, vote
from commlib.errors import ConfigError


@register
class Signum(SignSGD):
    """momentum b: 0.9 as in the paper; the momentum lives here, per tensor name, and is
    checkpointed. Sends 1 bit per element, aggregates by vote (not divided by the ranks)."""
    name = "signum"
    state_attrs = SignSGD.state_attrs + ("momentums",)

    def __init__(self, momentum=0.9, **common):
        super().__init__(**common)
        if not (is_number(momentum) and 0 <= momentum < 1):
            raise ConfigError(f"signum momentum must be in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.momentums = {}

    def encode(self, x, name):
        previous = self.momentums.get(name)
        m = (1 - self.momentum) * x if previous is None else torch.lerp(x, previous.to(x), self.momentum)
        is_finite = finite(x)
        if is_finite:   # an Inf or NaN would vote at every later step
            self.momentums[name] = m
        return vote(m, is_finite)
