"""sketch: quantile bins of the values; send each element's bin index and one mean per bin."""
import torch

from commlib.compressors import packing
from commlib.compressors.base import Compressor, is_int, register
from commlib.errors import ConfigError


def quantile_bins(x, bins, generator, sample=256):
    """-> (bin index per element, mean of the elements in each bin). The bin edges are quantiles
    of a random sample of sample*bins elements (the whole tensor when smaller)."""
    n = x.numel()
    m = min(n, sample * bins)
    pool = x if m == n else x[torch.randint(n, (m,), generator=generator, device=x.device)]
    edges = pool.sort().values[(torch.arange(1, bins, device=x.device) * m) // bins]
    index = torch.bucketize(x, edges)
    sums = torch.zeros(bins, dtype=x.dtype, device=x.device).index_add_(0, index, x)
    counts = torch.bincount(index, minlength=bins).clamp_min(1)
    return index, sums / counts


@register
class Sketch(Compressor):
    """bins: 64 -> 6 bits per element (bit-packed) plus 4 bytes per bin; each element becomes its
    bin's mean (biased, deterministic given the sample). More bins, less error, more bits."""
    name = "sketch"
    payload = "gather"

    def __init__(self, bins=64, **common):
        super().__init__(**common)
        if not (is_int(bins) and 2 <= bins <= 256):
            raise ConfigError(f"sketch bins must be an int in [2, 256] (a code is one byte at most), got {bins!r}")
        self.bins = bins
        self.bits = packing.bits_for(bins)

    def encode(self, x, name):
        index, means = quantile_bins(x, self.bins, self.generator(name, x.device))
        return packing.pack_bits(index.to(torch.uint8), self.bits), means

    def decode(self, payload, ctx):
        packed, means = payload
        return means.to(ctx.work)[packing.unpack_bits(packed, self.bits, ctx.numel).long()]

    def expected_bytes(self, numel):
        return packing.packed_nbytes(numel, self.bits) + 4 * self.bins
