/* The per-element kernels of the data paths: SwitchML's block exponents and quantization, and
 * big-endian int32 lanes (the worker's packets, the switch's aggregation in wire order); OmniReduce's non-zero-block
 * scan and its aggregators' sums; the transport's checksum.
 *
 * Block quantization follows SwitchML: a block of floats with exponent e (max|x| < 2^e) is
 * scaled by f = INT32_MAX / (nworkers * 2^e), so the nworkers-way int32 sum cannot overflow.
 * An all-zero block gets CL_EXP_ZERO, below every real exponent, so it never wins the max
 * and stays exactly zero.
 *
 * Each kernel has a portable scalar version and an AVX2 one; the AVX2 ones run where the CPU has
 * AVX2 (chosen at load time, cl_simd), and both give the same bits: the quantization is in double
 * precision in both (round to nearest even, as lrint), the rest is integer work. */
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

/* One block with the agreed (max) exponent `exp`: be[4i..4i+3] = big-endian round(x[i] * f(exp)). */
void cl_quantize_be(const float *x, size_t n, int8_t exp, int nworkers, uint8_t *be);
/* out[i] = big-endian be[4i..4i+3] / f(exp). */
void cl_dequantize_be(const uint8_t *be, size_t n, int8_t exp, int nworkers, float *out);

/* Big-endian int32 lanes. */
void cl_be_load(int32_t *dst, const uint8_t *src, size_t n);    /* dst[i] = be32(src + 4i) */
void cl_be_store(uint8_t *dst, const int32_t *src, size_t n);   /* be32(dst + 4i) = src[i] */
/* be32(dst + 4i) += be32(src + 4i), wrapping: the switch keeps its sums in wire order, so a result's
 * payload is the slot's memory itself (sent from there, no conversion) */
void cl_be_add_be(uint8_t *dst, const uint8_t *src, size_t n);

/* OmniReduce: which blocks of `block` elements (the last one may be partial) have any |x| > threshold
 * (NaN counts; threshold 0: any bit but a float's sign bit, so -0.0 is zero): mask[b] = 0/1; returns
 * the number of non-zero blocks. int32: the elements are int32, else float32. */
size_t cl_block_mask(const void *x, size_t n, int int32, size_t block, double threshold, uint8_t *mask);

/* OmniReduce's aggregators: dst[i] += the i-th little-endian element at src (a packet's block, any
 * alignment); float32 adds in IEEE single precision (the same bits on both paths), int32 wraps. */
void cl_add_f32(float *dst, const uint8_t *src, size_t n);
void cl_add_i32(int32_t *dst, const uint8_t *src, size_t n);

/* The transport's checksum (transport.h's tp_ck_update) over whole little-endian 32-bit words: adds
 * sum w_k to *s1 and sum w_k * (i + k + 1) to *s2 (k = 0..words-1), wrapping. */
void cl_checksum_words(const uint8_t *p, size_t words, uint32_t i, uint32_t *s1, uint32_t *s2);

/* Which kernels run, for every thread: want 1 = the vector ones where the CPU has AVX2 (the
 * default), 0 = the portable scalar ones (tests compare the two). Returns 1 if the vector ones
 * run now. */
int cl_simd(int want);

#endif
