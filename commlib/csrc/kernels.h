/* SwitchML's block quantization (the worker's data path, and the exponents Python computes).
 *
 * Block quantization follows SwitchML: a block of floats with exponent e (max|x| < 2^e) is
 * scaled by f = INT32_MAX / (nworkers * 2^e), so the nworkers-way int32 sum cannot overflow.
 * An all-zero block gets CL_EXP_ZERO, below every real exponent, so it never wins the max
 * and stays exactly zero. */
#ifndef COMMLIB_KERNELS_H
#define COMMLIB_KERNELS_H
#include <stddef.h>
#include <stdint.h>

#define CL_EXP_ZERO (-128)   /* exponent of an all-zero block */
#define CL_EXP_MIN (-127)    /* exponents of non-zero blocks are clamped to [CL_EXP_MIN, CL_EXP_MAX] */
#define CL_EXP_MAX 127

/* Exponent of each block of `block` elements (the last one may be partial).
 * Returns the index of the first block holding Inf/NaN or |x| >= 2^127, or -1 if none. */
long cl_block_exponents(const float *x, size_t n, size_t block, int8_t *exps);

/* q = round(x * f(e)) per block; exps are the agreed (max) exponents. */
void cl_quantize(const float *x, size_t n, size_t block, const int8_t *exps, int nworkers, int32_t *q);
/* out = q / f(e) per block. */
void cl_dequantize(const int32_t *q, size_t n, size_t block, const int8_t *exps, int nworkers, float *out);

#endif
