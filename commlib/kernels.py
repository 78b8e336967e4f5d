"""numpy front of SwitchML's block exponents (commlib/csrc/kernels.h, in commlib._native): the
worker's C loop quantizes with them. Inputs must be C-contiguous."""
import numpy as np

from commlib._native import ffi, lib

EXP_ZERO, EXP_MIN, EXP_MAX = lib.CL_EXP_ZERO, lib.CL_EXP_MIN, lib.CL_EXP_MAX


def nblocks(n, block):
    return -(-n // block)


def block_exponents(x, block):
    """Per-block exponents (max|x| < 2^e; EXP_ZERO for zero blocks) and the first block that
    holds Inf/NaN/huge values, or -1."""
    exps = np.empty(nblocks(x.size, block), dtype=np.int8)
    bad = lib.cl_block_exponents(ffi.cast("float *", ffi.from_buffer(x)), x.size, block,
                                 ffi.cast("int8_t *", ffi.from_buffer(exps)))
    return exps, bad
