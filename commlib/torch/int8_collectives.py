"""Reduce-scatter and all-gather in int8 with a float32 scale per block (ZeRO++'s qgZ and qwZ), for
commlib's torch.distributed backend when `COMMLIB_C10D_INT8` names them.

reduce_scatter: each rank quantizes its input, sends rank r the r-th chunk in one all-to-all, and sums
what it received in float32 (one hop, as qgZ: no re-quantization on the way, so the error does not
grow with hops). all_gather: each rank quantizes its shard once, and every rank dequantizes the
gathered int8 (qwZ). Bytes on the wire: 1 + 4/BLOCK per element instead of 4 (about 0.26x).

Error, per element (round to nearest, scale = max |x| of the block / 127):
  all_gather:     |x - x~| <= scale / 2 = max|block| / 254
  reduce_scatter: |sum - sum~| <= sum over ranks of max|block_r| / 254   (the Avg: that, / ranks)
tests/test_c10d.py checks both bounds against Gloo's exact result.
"""
import torch

BLOCK = 256   # elements per scale: 1.6% overhead, and one outlier spoils only its own block


def quantize(x):
    """(int8 values, float32 scale per BLOCK elements) of a 1-D float tensor."""
    flat = x.reshape(-1).float()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)
    scale = padded.abs().amax(dim=1) / 127
    values = torch.round(padded / torch.where(scale > 0, scale, 1)[:, None]).to(torch.int8)
    return values.view(-1)[:flat.numel()], scale


def dequantize(values, scale):
    padded = torch.nn.functional.pad(values.float(), (0, -values.numel() % BLOCK)).view(-1, BLOCK)
    return (padded * scale[:, None]).view(-1)[:values.numel()]


def blocks(n):
    return -(-n // BLOCK)


def reduce_scatter(group, output, input, average):
    """output <- the sum (or mean) over ranks of their input's chunk for this rank, through `group`
    (a Gloo backend object); input: size x output.numel() elements, chunk r for rank r."""
    size, n = group.size(), output.numel()
    chunks = input.reshape(size, n)
    values, scales = zip(*(quantize(chunk) for chunk in chunks))   # per destination, blocks per chunk
    got_values, got_scales = torch.empty(size * n, dtype=torch.int8), torch.empty(size * blocks(n))
    group.alltoall_base(got_values, torch.cat(values), [], []).wait()
    group.alltoall_base(got_scales, torch.cat(scales), [], []).wait()
    total = sum(dequantize(v, s) for v, s in zip(got_values.view(size, n), got_scales.view(size, -1)))
    output.copy_((total / size if average else total).view_as(output))


def all_gather(group, output, input):
    """output <- every rank's input, back to back, through `group` (a Gloo backend object)."""
    size, n = group.size(), input.numel()
    values, scale = quantize(input)
    got_values, got_scales = torch.empty(size * n, dtype=torch.int8), torch.empty(size * blocks(n))
    group._allgather_base(got_values, values).wait()
    group._allgather_base(got_scales, scale).wait()
    parts = [dequantize(v, s) for v, s in zip(got_values.view(size, n), got_scales.view(size, -1))]
    output.copy_(torch.cat(parts).view_as(output))
