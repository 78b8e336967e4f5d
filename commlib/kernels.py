"""numpy front of the kernels the Python side calls (commlib/csrc/kernels.h, in commlib._native):
SwitchML's block exponents (the worker's C loop quantizes with them) and OmniReduce's scan for
non-zero blocks. Inputs must be C-contiguous."""
import ctypes

import numpy as np

from commlib import _native
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


# cffi releases the GIL around every call. On a busy rank (the background thread, the controller's)
# taking it back costs tens of us, more than scanning a small tensor: `auto` scans every dense tensor
# at every step, so small scans go through ctypes.PyDLL, whose calls keep the GIL (the same library).
_HELD = ctypes.PyDLL(_native.__file__).cl_block_mask
_HELD.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t, ctypes.c_double, ctypes.c_void_p]
_HELD.restype = ctypes.c_size_t
HELD_MAX = 1 << 14   # values: a few us of scanning


def nonzero_blocks(x, block, threshold, int32):
    """(uint8 mask per block: any |x| > threshold, NaN counting; the number of such blocks). x: a
    C-contiguous float32 array, or int32 with int32 set."""
    if x.dtype != (np.int32 if int32 else np.float32) or not x.flags.c_contiguous or block < 1:
        raise ValueError(f"nonzero_blocks takes a C-contiguous {'int32' if int32 else 'float32'} array and "
                         f"block >= 1, not a {'' if x.flags.c_contiguous else 'strided '}{x.dtype} array, block {block}")
    mask = np.empty(nblocks(x.size, block), dtype=np.uint8)
    if x.size <= HELD_MAX:
        count = _HELD(x.ctypes.data, x.size, int32, block, threshold, mask.ctypes.data)
    else:
        count = lib.cl_block_mask(ffi.from_buffer(x), x.size, int32, block, threshold, ffi.from_buffer(mask))
    return mask, count
