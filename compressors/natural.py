"""natural: stochastic rounding to a power of two, sign and exponent in one byte (Horvath et al.)."""
import torch

from commlib.compressors.base import Compressor, register

EMIN = -99                # codes 1..126 mean 2**EMIN .. 2**EMAX; code 0 is zero
EMAX = EMIN + 125         # 2**26: larger magnitudes are clamped, smaller than 2**EMIN flushed (biased)
INF, NAN = 127, 128       # code 127 (with the sign bit) is +-Inf; 128, a "negative zero", is NaN:
                          # non-finite gradients stay non-finite, so overflow checks (AMP) still see them


def encode_powers(x, generator):
    """float tensor -> uint8 codes: bit 7 the sign, bits 0-6 the exponent code. |x| in
    [2**e, 2**(e+1)) rounds up with probability |x|/2**e - 1: adding a uniform random 23-bit
    integer to the float's bits carries into the exponent with exactly that probability (the
    mantissa / 2**23). Unbiased for 2**EMIN <= |x| < 2**(EMAX+1); smaller values flush to zero."""
    bits = x.abs().float().view(torch.int32)
    noise = torch.randint(0, 1 << 23, bits.shape, generator=generator, device=bits.device, dtype=torch.int32)
    code = (((bits + noise) >> 23) - (126 + EMIN)).clamp(0, EMAX - EMIN + 1)
    code = torch.where(torch.isinf(x), INF, code)
    code = code | (((x < 0) & (code > 0)).int() << 7)      # zero is unsigned: 128 is free for NaN
    return torch.where(torch.isnan(x), NAN, code).to(torch.uint8)


def decode_powers(codes):
    """uint8 codes -> float32, built from the exponent bits directly."""
    c = (codes & 127).int()
    magnitude = ((c + (EMIN + 126)) << 23).view(torch.float32)
    magnitude = torch.where(c == INF, torch.inf, magnitude)
    value = torch.where(codes >= 128, -magnitude, magnitude)
    value = torch.where(c == 0, 0.0, value)
    return torch.where(codes == NAN, torch.nan, value)


@register
class Natural(Compressor):
    """8 bits per element (4x), unbiased with variance at most 1/8 of |x|^2 (for 2**-99 <=
    |x| <= 2**26): a cheap drop-in for fp32 with no hyperparameters and no memory. Inf and NaN
    are carried as such."""
    name = "natural"
    payload = "gather"

    def encode(self, x, name):
        return (encode_powers(x, self.generator(name, x.device)),)

    def decode(self, payload, ctx):
        return decode_powers(payload[0]).to(ctx.work)

    def expected_bytes(self, numel):
        return numel
