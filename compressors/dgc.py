"""dgc: Deep Gradient Compression (Lin et al.): a sampled top-ratio threshold, momentum correction."""
import torch

from commlib.compressors.base import Compressor, check_ratio, index_dtype, register, scatter, top_count


def sampled_selection(a, k, sample_ratio, generator, band=(0.7, 1.3)):
    """Indices of about k large entries of a: the threshold is the k-th value of a random sample
    (one pass to select); when the count leaves the band, the exact top-k of the candidates (too
    many) or of everything (too few) replaces it, so the count always lies in the band."""
    n = a.numel()
    m = min(n, max(1000, int(n * sample_ratio)))
    sample = a if m == n else a[torch.randint(n, (m,), generator=generator, device=a.device)]
    rank = min(m, max(1, round(k * m / n)))
    cut = torch.topk(sample, rank, sorted=False).values.min()
    selected = torch.nonzero(a >= cut).squeeze(1)
    count = selected.numel()
    if band[0] * k <= count <= band[1] * k:
        return selected
    if count > k:
        return selected[torch.topk(a[selected], k, sorted=False).indices]
    return torch.topk(a, k, sorted=False).indices


@register
class DGC(Compressor):
    """ratio: target fraction (0.01); sample_ratio: fraction sampled to estimate the threshold
    (DGC's 0.1%-1%; at least 1000 elements). The count varies within [0.7, 1.3] * ratio * n.
    The dgc memory (default) adds momentum correction and factor masking; pass
    momentum=... for it."""
    name = "dgc"
    payload = "sparse"
    default_memory = "dgc"

    def __init__(self, ratio=0.01, sample_ratio=0.01, **common):
        super().__init__(**common)
        self.ratio = check_ratio(ratio)
        self.sample_ratio = check_ratio(sample_ratio, "sample_ratio")

    def encode(self, x, name):
        k = top_count(self.ratio, x.numel())
        indices = sampled_selection(x.abs(), k, self.sample_ratio, self.generator(name, x.device))
        return x[indices], indices.to(index_dtype(x.numel()))

    def decode(self, payload, ctx):
        values, indices = payload
        return scatter(values, indices, ctx)
