"""fp16: cast to half precision and back (Horovod's Compression.fp16, PyTorch's fp16_compress_hook)."""
import torch

from commlib.compressors.base import Compressor, register


@register
class FP16(Compressor):
    """Halves the bytes; summable in half precision, so ring/switchml carry it.

    Tuning: exact for values representable in fp16; relative error 2**-11 otherwise. Like
    PyTorch's hook, average=True divides each rank's tensor by the world size *before* the sum so
    the fp16 sum of N ranks stays below 65504; gradients beyond 65504 (unscaled AMP grads) become
    inf: scale such tensors down first, or pick another method.
    """
    name = "fp16"
    payload = "summable"
    divide_before_sum = True

    def encode(self, x, name):
        return (x.to(torch.float16),)

    def decode(self, payload, ctx):
        return payload[0].to(ctx.work)

    def expected_bytes(self, numel):
        return 2 * numel
