"""none: the tensor itself. resolve("none") returns None so the core skips compression entirely;
this class is what GRACE's from_params({'compressor': 'none'}) builds, and the tests' baseline."""
from commlib.compressors.base import Compressor, register


@register
class NoCompression(Compressor):
    """Identity; exact; summable, so ring or switchml carry it."""
    name = "none"
    payload = "summable"

    def encode(self, x, name):
        return (x,)

    def decode(self, payload, ctx):
        return payload[0].to(ctx.work)

    def expected_bytes(self, numel):
        return 4 * numel
