"""qsgd: stochastic quantization to `levels` levels per sign, one norm per bucket (Alistarh et al.)."""
import torch
import torch.nn.functional as F

from commlib.compressors import packing
from commlib.compressors.base import Compressor, is_int, register
from commlib.errors import ConfigError


def _rows(x, bucket):
    """x as (buckets, bucket) rows, zero-padded (a copy only when n is not a multiple)."""
    pad = -x.numel() % bucket
    return (F.pad(x, (0, pad)) if pad else x).view(-1, bucket)


def quantize(x, levels, bucket, generator):
    """x (flat) -> (signed integer levels in [-levels, levels] as floats, one L2 norm per bucket).
    Unbiased: |x|*levels/norm rounds up with probability equal to its fractional part."""
    rows = _rows(x, bucket)
    norms = rows.norm(dim=1)
    scaled = rows.abs().mul_((levels / norms.clamp_min(torch.finfo(x.dtype).tiny)).unsqueeze(1))
    low = scaled.floor()
    up = torch.rand(scaled.shape, generator=generator, device=x.device, dtype=x.dtype) < scaled.sub_(low)
    return torch.copysign(low.add_(up), rows).view(-1)[:x.numel()], norms


def dequantize(signed_levels, norms, levels, bucket):
    rows = _rows(signed_levels, bucket)
    return rows.mul((norms / levels).unsqueeze(1)).view(-1)[:signed_levels.numel()]


@register
class QSGD(Compressor):
    """levels (s, GRACE's quantum_num): 127 sends 8 bits per element (2s+1 codes, bit-packed:
    s=7 -> 4 bits, s=1 -> 2 bits); fewer levels, more variance. bucket: elements per norm
    (128 adds 4/128 bytes per element and bounds the variance by the bucket's, not the whole
    tensor's, norm). Unbiased, so no memory by default."""
    name = "qsgd"
    payload = "gather"

    def __init__(self, levels=127, bucket=128, **common):
        super().__init__(**common)
        if not (is_int(levels) and 1 <= levels <= 32767):
            raise ConfigError(f"qsgd levels must be an int in [1, 32767] (codes fit int16), got {levels!r}")
        if not (is_int(bucket) and bucket >= 1):
            raise ConfigError(f"qsgd bucket must be a positive int (elements per norm), got {bucket!r}")
        self.levels, self.bucket = levels, bucket
        self.bits = packing.bits_for(2 * levels + 1)

    def encode(self, x, name):
        signed, norms = quantize(x, self.levels, self.bucket, self.generator(name, x.device))
        if self.bits > 8:
            return signed.to(torch.int16), norms
        return packing.pack_bits(signed.add_(self.levels).to(torch.uint8), self.bits), norms

    def decode(self, payload, ctx):
        codes, norms = payload
        if self.bits > 8:
            signed = codes.to(ctx.work)
        else:
            signed = packing.unpack_bits(codes, self.bits, ctx.numel).to(ctx.work).sub_(self.levels)
        return dequantize(signed, norms.to(ctx.work), self.levels, self.bucket)

    def expected_bytes(self, numel):
        codes = 2 * numel if self.bits > 8 else packing.packed_nbytes(numel, self.bits)
        return codes + 4 * -(-numel // self.bucket)
