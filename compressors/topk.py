"""topk: the k = max(1, floor(ratio*n)) largest |x|, sent as values + int32 indices (Aji & Heafield)."""
import math

import torch

from commlib.compressors.base import Compressor, check_ratio, index_dtype, register, scatter, top_count

PREFILTER_FROM = 1 << 16   # below this, torch.topk on the whole tensor is as fast


def largest(a, k, generator=None):
    """Indices of the k largest entries of the non-negative 1-D tensor a: exactly torch.topk's set
    (up to ties), but for large tensors a random sample first estimates the k-th value so that
    torch.topk runs on a small candidate set (one pass over a instead of a partial sort)."""
    n = a.numel()
    if generator is None or n < PREFILTER_FROM or 16 * k > n:
        return torch.topk(a, k, sorted=False).indices
    m = max(4096, n // 64)
    sample = a[torch.randint(n, (m,), generator=generator, device=a.device)]
    expected = k * m / n                                  # sampled elements above the k-th value
    rank = min(m, math.ceil(1.25 * expected + 4 * math.sqrt(expected) + 1))
    cut = torch.topk(sample, rank, sorted=False).values.min()
    candidates = torch.nonzero(a >= cut).squeeze(1)
    if candidates.numel() < k:                            # the sample overshot (rare): exact path
        return torch.topk(a, k, sorted=False).indices
    return candidates[torch.topk(a[candidates], k, sorted=False).indices]


@register
class TopK(Compressor):
    """ratio: fraction of elements sent (commlib's 0.01; GRACE used 0.3). Sends 8 bytes per kept
    element (fp32 value + int32 index), so ratio 0.01 is 50x smaller than fp32. Biased: keep the
    residual memory (default) or it forgets 99% of every gradient. ratio=1 is exact."""
    name = "topk"
    payload = "sparse"
    default_memory = "residual"

    def __init__(self, ratio=0.01, **common):
        super().__init__(**common)
        self.ratio = check_ratio(ratio)

    def encode(self, x, name):
        k = top_count(self.ratio, x.numel())
        indices = largest(x.abs(), k, self.generator(name, x.device))
        return x[indices], indices.to(index_dtype(x.numel()))

    def decode(self, payload, ctx):
        values, indices = payload
        return scatter(values, indices, ctx)

    def expected_bytes(self, numel):
        return 8 * top_count(self.ratio, numel)
