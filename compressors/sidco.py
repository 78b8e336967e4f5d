"""SIDCo threshold estimators (Abdelmoniem et al., MLSys'21): fit a sparsity-inducing distribution
to |g| and read off the threshold whose tail holds the wanted ratio, in one or more stages.

Each fit is scale-equivariant, so fitting |g| is fitting |g|/||g|| and scaling back. Zeros (dead
units, padding) are left out of the fit and the ratio is rescaled to the non-zero count.
"""
import math

import torch

from commlib.compressors.base import Stateful, is_int, is_number
from commlib.errors import ConfigError


def exponential(a, ratio):
    """|g| ~ Exp(mean) (g double exponential): P(|g| > t) = exp(-t/mean) -> t = -mean * ln(ratio)."""
    return -a.mean().item() * math.log(ratio)


def gpareto(a, ratio):
    """Generalized Pareto by moments: xi = (1 - mean^2/var)/2, beta = mean (mean^2/var + 1)/2;
    P(|g| > t) = (1 + xi t / beta)^(-1/xi) -> t = beta/xi (ratio^-xi - 1)."""
    mean, var = a.mean().item(), a.var(correction=0).item()
    if var <= 0:
        return mean
    xi, beta = 0.5 * (1 - mean * mean / var), 0.5 * mean * (mean * mean / var + 1)
    if abs(xi) < 1e-6:
        return -beta * math.log(ratio)
    return beta / xi * (ratio ** -xi - 1)


def gamma(a, ratio):
    """Gamma by the approximate maximum likelihood (Minka); t solves Q(alpha, t/theta) = ratio
    with a vectorized grid search on torch.special.gammaincc (three refinements)."""
    mean = a.mean().item()
    s = math.log(mean) - torch.log(a).mean().item()
    if s <= 1e-9:   # (nearly) constant: no spread to fit
        return mean
    alpha = (3 - s + math.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
    lo, hi = 0.0, max(1.0, alpha)
    alpha_t = torch.tensor(alpha, dtype=torch.float64)
    while torch.special.gammaincc(alpha_t, torch.tensor(hi, dtype=torch.float64)) > ratio and hi < 1e6:
        lo, hi = hi, 2 * hi
    for _ in range(3):
        grid = torch.linspace(lo, hi, 257, dtype=torch.float64)
        above = torch.special.gammaincc(alpha_t, grid) > ratio
        i = int(torch.count_nonzero(above))                # Q decreases: grid[:i] are above the ratio
        lo, hi = grid[max(i - 1, 0)].item(), grid[min(i, 256)].item()
    return (mean / alpha) * hi


FITS = {"exponential": (exponential, exponential), "gpareto": (gpareto, gpareto), "gamma": (gamma, gpareto)}


def fit(first_stage, a, ratio):
    """The fitted threshold on the non-zero entries of a (0.0 when they all fit in the ratio)."""
    nonzero = torch.count_nonzero(a).item()
    wanted = ratio * a.numel()
    if wanted >= nonzero:
        return 0.0
    if nonzero < a.numel():
        a, ratio = a[a > 0], wanted / nonzero
    return max(0.0, first_stage(a, ratio))


class SIDCo(Stateful):
    """Multi-stage threshold estimation, per tensor name.

    distribution: "exponential" (SIDCo-E, cheapest), "gpareto" (SIDCo-GP) or "gamma" (first
    stage gamma, then generalized Pareto on the exceedances: peaks over a threshold are GPD).
    first_ratio: each stage keeps this fraction (0.25) of what the previous stage kept; the last
    stage aims at the target exactly, using the actual count left.
    stages: an int, or "adaptive": start at 1 stage; add one when the selected count misses the
    target by more than `tolerance`, drop one after `patience` good steps (stages cost passes).
    """
    state_attrs = ("stages", "streaks")

    def __init__(self, distribution="exponential", first_ratio=0.25, stages="adaptive", tolerance=0.2, patience=20):
        if distribution not in FITS:
            raise ConfigError(f"unknown SIDCo distribution {distribution!r}; known: {sorted(FITS)}")
        if not (is_number(first_ratio) and 0 < first_ratio < 1):
            raise ConfigError(f"SIDCo first_ratio must be in (0, 1), got {first_ratio!r}")
        if stages != "adaptive" and not (is_int(stages) and stages >= 1):
            raise ConfigError(f"SIDCo stages must be 'adaptive' or an int >= 1, got {stages!r}")
        self.distribution, self.first_ratio, self.fixed = distribution, first_ratio, stages
        self.tolerance, self.patience = tolerance, patience
        self.stages, self.streaks = {}, {}

    def threshold(self, a, ratio, name):
        """Threshold t such that about ratio * a.numel() entries of a (non-negative) exceed it."""
        first, tail = FITS[self.distribution]
        wanted = ratio * a.numel()
        stages = self.fixed if self.fixed != "adaptive" else self.stages.setdefault(name, 1)
        values, t = a, 0.0
        for stage in range(stages):
            r = wanted / max(values.numel(), 1)
            if r >= 1:
                break
            last = stage == stages - 1 or r >= self.first_ratio
            step = fit(first if stage == 0 else tail, values, r if last else self.first_ratio)
            t += step
            if last:
                break
            values = values[values > step] - step     # exceedances: the next stage fits the tail
        return t

    def observe(self, name, selected, ratio, numel):
        """Adapt the number of stages from the count the threshold really selected."""
        if self.fixed != "adaptive":
            return
        wanted = max(ratio * numel, 1.0)
        stages = self.stages.get(name, 1)
        useful = max(1, math.ceil(math.log(ratio) / math.log(self.first_ratio)))   # more would not split further
        if abs(selected / wanted - 1) > self.tolerance:
            self.stages[name], self.streaks[name] = min(stages + 1, useful), 0
        else:
            self.streaks[name] = self.streaks.get(name, 0) + 1
            if self.streaks[name] >= self.patience and stages > 1:
                self.stages[name], self.streaks[name] = stages - 1, 0
