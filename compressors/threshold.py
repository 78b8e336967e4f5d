"""threshold: send the elements with |x| > tau, values + int32 indices; the count varies per step."""
import torch

from commlib.compressors.base import Compressor, check_ratio, index_dtype, is_number, register, scatter
from commlib.compressors.sidco import SIDCo
from commlib.errors import ConfigError


@register
class Threshold(Compressor):
    """Either tau, a fixed threshold on |x| (GRACE's threshold, default 0.01: depends on the
    gradient scale, so tune it per model), or ratio, the fraction to send, with tau estimated
    every step by SIDCo (estimator: exponential | gpareto | gamma; stages: "adaptive" or an int;
    first_ratio: per-stage fraction). The payload size varies and may be empty on some ranks;
    that is fine on omnireduce and allgather. Residual memory by default."""
    name = "threshold"
    payload = "sparse"
    default_memory = "residual"

    def __init__(self, tau=None, ratio=None, estimator="exponential", stages="adaptive", first_ratio=0.25, **common):
        super().__init__(**common)
        if tau is not None and ratio is not None:
            raise ConfigError("threshold takes tau (a fixed threshold) or ratio (SIDCo estimates tau), not both")
        if tau is None and ratio is None:
            tau = 0.01
        if tau is not None and not (is_number(tau) and tau >= 0):
            raise ConfigError(f"threshold tau must be >= 0, got {tau!r}")
        self.tau = None if tau is None else float(tau)
        self.ratio = None if ratio is None else check_ratio(ratio)
        self.estimator, self.stages, self.first_ratio = estimator, stages, first_ratio
        self.sidco = SIDCo(estimator, first_ratio, stages) if ratio is not None else None

    def encode(self, x, name):
        a = x.abs()
        tau = self.tau if self.sidco is None else self.sidco.threshold(a, self.ratio, name)
        indices = torch.nonzero(a > tau).squeeze(1)
        if self.sidco is not None:
            self.sidco.observe(name, indices.numel(), self.ratio, x.numel())
        return x[indices], indices.to(index_dtype(x.numel()))

    def decode(self, payload, ctx):
        values, indices = payload
        return scatter(values, indices, ctx)

    def state_dict(self):
        state = super().state_dict()
        return {**state, "sidco": self.sidco.state_dict()} if self.sidco else state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if self.sidco:
            self.sidco.load_state_dict(state.get("sidco", {}))
