"""numpy front of the C kernels (commlib/csrc/kernels.h). Inputs must be C-contiguous."""
import numpy as np

from commlib._kernels import ffi, lib

EXP_ZERO, EXP_MIN, EXP_MAX = lib.CL_EXP_ZERO, lib.CL_EXP_MIN, lib.CL_EXP_MAX


def _ptr(array, ctype):
    return ffi.cast(ctype, ffi.from_buffer(array, require_writable=False))


def nblocks(n, block):
    return -(-n // block)


def sum_into(dst, src):
    """dst += src for float32 or int32 (int32 wraps, like the switch)."""
    if dst.dtype != src.dtype or dst.size != src.size:
        raise ValueError(f"sum_into needs equal dtype and size, got {dst.dtype}[{dst.size}] and {src.dtype}[{src.size}]")
    if dst.dtype == np.float32:
        lib.cl_sum_f32(_ptr(dst, "float *"), _ptr(src, "float *"), dst.size)
    elif dst.dtype == np.int32:
        lib.cl_sum_i32(_ptr(dst, "int32_t *"), _ptr(src, "int32_t *"), dst.size)
    else:
        raise TypeError(f"sum_into supports float32 and int32, not {dst.dtype}")
    return dst


def block_exponents(x, block):
    """Per-block exponents (max|x| < 2^e; EXP_ZERO for zero blocks) and the first block that
    holds Inf/NaN/huge values, or -1."""
    exps = np.empty(nblocks(x.size, block), dtype=np.int8)
    bad = lib.cl_block_exponents(_ptr(x, "float *"), x.size, block, _ptr(exps, "int8_t *"))
    return exps, bad


def quantize(x, exps, block, nworkers, out=None):
    q = np.empty(x.size, dtype=np.int32) if out is None else out
    lib.cl_quantize(_ptr(x, "float *"), x.size, block, _ptr(exps, "int8_t *"), nworkers, _ptr(q, "int32_t *"))
    return q


def dequantize(q, exps, block, nworkers, out=None):
    x = np.empty(q.size, dtype=np.float32) if out is None else out
    lib.cl_dequantize(_ptr(q, "int32_t *"), q.size, block, _ptr(exps, "int8_t *"), nworkers, _ptr(x, "float *"))
    return x


def nonzero_blocks(x, block, threshold=0.0):
    """uint8 mask of the blocks with any |x| > threshold (NaN counts as non-zero)."""
    mask = np.empty(nblocks(x.size, block), dtype=np.uint8)
    lib.cl_nonzero_blocks(_ptr(x, "float *"), x.size, block, threshold, _ptr(mask, "uint8_t *"))
    return mask
