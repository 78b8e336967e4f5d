"""Bit packing and the byte layout of a payload on the wire.

Sub-byte codes travel as bit planes: plane b holds bit b of every code, packed 8 codes per byte
(most significant bit first, like numpy.packbits), so `bits`-bit codes of n elements take
bits * ceil(n/8) bytes. CPU tensors go through numpy.packbits/unpackbits (zero copy, C speed);
other devices use the same layout built from vectorized torch ops.

A payload (a tuple of 1-D tensors) becomes one uint8 array for allgather:
    int64 header [nparts, (dtype code, numel) per part], then each part's bytes padded to 8.
The header makes variable and per-rank different sizes (0 included) self-describing.
"""
import math

import numpy as np
import torch

_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
           torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


def bits_for(levels):
    """The number of bits that holds `levels` distinct codes."""
    return max(1, math.ceil(math.log2(levels)))


def packed_nbytes(numel, bits):
    return numel if bits == 8 else bits * -(-numel // 8)


def pack_bits(codes, bits):
    """Codes (1-D bool or uint8 tensor, values < 2**bits, bits <= 8) -> uint8 tensor of
    packed_nbytes(n, bits) bytes on the same device."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    if bits == 1:
        planes = codes.unsqueeze(0)
    else:
        shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device).unsqueeze(1)
        planes = (codes.unsqueeze(0) >> shifts) & 1
    if codes.device.type == "cpu":
        return torch.from_numpy(np.packbits(planes.numpy(), axis=1).reshape(-1))
    pad = -codes.numel() % 8
    planes = torch.nn.functional.pad(planes, (0, pad)).view(bits, -1, 8)
    return (planes * _WEIGHTS.to(codes.device)).sum(-1, dtype=torch.uint8).view(-1)


def unpack_bits(packed, bits, numel):
    """Inverse of pack_bits: uint8 codes of length numel (bool for bits == 1)."""
    if bits == 8:
        return packed[:numel]
    if packed.device.type == "cpu":
        planes = torch.from_numpy(np.unpackbits(packed.numpy().reshape(bits, -1), axis=1, count=numel))
    else:
        planes = (packed.view(bits, -1, 1) & _WEIGHTS.to(packed.device)).ne(0).view(bits, -1)[:, :numel]
    if bits == 1:
        return planes[0].bool()
    shifts = torch.arange(bits, dtype=torch.uint8, device=packed.device).unsqueeze(1)
    return (planes.to(torch.uint8) << shifts).sum(0, dtype=torch.uint8)


def nbytes(payload):
    """Bytes of data a payload puts on the wire (the allgather header not counted)."""
    return sum(part.numel() * part.element_size() for part in payload)


def to_bytes(payload):
    """Payload (tuple of 1-D tensors, any device) -> one contiguous uint8 numpy array."""
    parts = [part.detach().reshape(-1).contiguous().cpu() for part in payload]
    header = [len(parts)] + [x for part in parts for x in (_CODE[part.dtype], part.numel())]
    chunks = [np.asarray(header, dtype=np.int64).view(np.uint8)]
    for part in parts:
        raw = part.view(torch.uint8).numpy() if part.numel() else np.empty(0, np.uint8)
        chunks += [raw, np.zeros(-raw.size % 8, np.uint8)]
    return np.concatenate(chunks)


def from_bytes(buf, device):
    """Inverse of to_bytes: a tuple of 1-D tensors on `device`."""
    buf = np.asarray(buf, dtype=np.uint8)
    if not buf.flags.writeable or buf.ctypes.data % 8:
        buf = buf.copy()
    nparts = int(buf[:8].view(np.int64)[0])
    header = buf[8:8 + 16 * nparts].view(np.int64).reshape(nparts, 2)
    offset, parts = 8 + 16 * nparts, []
    for code, numel in header.tolist():
        dtype = _DTYPES[code]
        size = numel * torch.empty(0, dtype=dtype).element_size()
        raw = torch.from_numpy(buf[offset:offset + size])
        parts.append(raw.view(dtype).to(device))
        offset += size + (-size % 8)
    return tuple(parts)
