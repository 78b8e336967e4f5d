"""cffi build script (out-of-line API mode) for commlib._kernels; kernels.h is the whole interface."""
import os
from pathlib import Path

from cffi import FFI

here = Path(__file__).resolve().parent
ffibuilder = FFI()
# cdef takes the header's declarations; constants as `...` so the compiler fills them in.
ffibuilder.cdef("""
#define CL_EXP_ZERO ...
#define CL_EXP_MIN ...
#define CL_EXP_MAX ...
void cl_sum_f32(float *dst, const float *src, size_t n);
void cl_sum_i32(int32_t *dst, const int32_t *src, size_t n);
long cl_block_exponents(const float *x, size_t n, size_t block, int8_t *exps);
void cl_quantize(const float *x, size_t n, size_t block, const int8_t *exps, int nworkers, int32_t *q);
void cl_dequantize(const int32_t *q, size_t n, size_t block, const int8_t *exps, int nworkers, float *out);
size_t cl_nonzero_blocks(const float *x, size_t n, size_t block, float threshold, uint8_t *nonzero);
""")
ffibuilder.set_source(
    "commlib._kernels",
    '#include "kernels.h"',
    sources=[os.path.relpath(here / "kernels.c")],  # setuptools wants relative paths
    include_dirs=[os.path.relpath(here)],
    extra_compile_args=["-O3", "-std=c11"],
    libraries=["m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
