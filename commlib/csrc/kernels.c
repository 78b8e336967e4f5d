/* The per-element kernels (kernels.h): each written once as an inline body, built twice, plain
 * and for AVX2 (target attribute), and picked per call by the CPU's features. Quantization uses
 * explicit AVX2 intrinsics (double precision, as the scalar lrint); the other bodies are plain
 * loops the compiler vectorizes for each target. */
#include "kernels.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CL_X86 1
#define AVX2 __attribute__((target("avx2")))
#else
#define CL_X86 0
#endif
#define BODY static inline __attribute__((always_inline))

static int vec;   /* the AVX2 kernels run */

static int cpu_has_avx2(void) {
#if CL_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

__attribute__((constructor)) static void pick(void) { vec = cpu_has_avx2(); }

int cl_simd(int want) {
    vec = want && cpu_has_avx2();
    return vec;
}

static inline double scale(int8_t e, int nworkers) { return ldexp(2147483647.0 / nworkers, -(int)e); }

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return __builtin_bswap32(v);
}

static inline void wr32(uint8_t *p, uint32_t v) {
    v = __builtin_bswap32(v);
    memcpy(p, &v, 4);
}

/* ---- bodies --------------------------------------------------------------------------------- */
/* max |x| as float bits: for non-negative floats the bit order is the value order, and Inf/NaN
 * are above every finite bit pattern */
BODY uint32_t absmax_bits(const float *x, size_t n) {
    uint32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        u &= 0x7fffffffu;
        m = u > m ? u : m;
    }
    return m;
}

BODY void be_load(int32_t *restrict dst, const uint8_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = (int32_t)rd32(src + 4 * i);
}

BODY void be_store(uint8_t *restrict dst, const int32_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) wr32(dst + 4 * i, (uint32_t)src[i]);
}

BODY void be_add_be(uint8_t *restrict dst, const uint8_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) wr32(dst + 4 * i, rd32(dst + 4 * i) + rd32(src + 4 * i));
}

/* OmniReduce's scan, per block: whether any element is non-zero (bits & keep: 0x7fffffff ignores a
 * float's sign) or, with a threshold, above it; no early exit, so the loops vectorize */
BODY int any_bits(const uint8_t *x, size_t n, uint32_t keep) {
    uint32_t acc = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + 4 * i, 4);
        acc |= u & keep;
    }
    return acc != 0;
}

BODY int any_above_f32(const float *x, size_t n, float t) {
    int acc = 0;
    for (size_t i = 0; i < n; i++) acc |= !(fabsf(x[i]) <= t);   /* NaN is above */
    return acc;
}

BODY int any_above_i32(const int32_t *x, size_t n, double t) {
    int acc = 0;
    for (size_t i = 0; i < n; i++) acc |= fabs((double)x[i]) > t;
    return acc;
}

BODY void add_f32(float *restrict dst, const uint8_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float v;
        memcpy(&v, src + 4 * i, 4);
        dst[i] += v;
    }
}

BODY void add_i32(int32_t *restrict dst, const uint8_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, src + 4 * i, 4);
        dst[i] = (int32_t)((uint32_t)dst[i] + v);
    }
}

BODY void checksum_words(const uint8_t *p, size_t words, uint32_t i, uint32_t *s1, uint32_t *s2) {
    uint32_t a = 0, b = 0;
    for (size_t k = 0; k < words; k++) {
        uint32_t w;
        memcpy(&w, p + 4 * k, 4);
        a += w;
        b += w * (i + (uint32_t)k + 1u);
    }
    *s1 += a;
    *s2 += b;
}

BODY void quantize_tail(const float *x, size_t from, size_t n, double f, uint8_t *be) {
    for (size_t i = from; i < n; i++) wr32(be + 4 * i, (uint32_t)(int32_t)lrint((double)x[i] * f));
}

BODY void dequantize_tail(const uint8_t *be, size_t from, size_t n, double inv, float *out) {
    for (size_t i = from; i < n; i++) out[i] = (float)((double)(int32_t)rd32(be + 4 * i) * inv);
}

/* ---- the two builds ------------------------------------------------------------------------- */
static uint32_t absmax_scalar(const float *x, size_t n) { return absmax_bits(x, n); }
static void be_load_scalar(int32_t *d, const uint8_t *s, size_t n) { be_load(d, s, n); }
static void be_store_scalar(uint8_t *d, const int32_t *s, size_t n) { be_store(d, s, n); }
static void be_add_be_scalar(uint8_t *d, const uint8_t *s, size_t n) { be_add_be(d, s, n); }
static int any_bits_scalar(const uint8_t *x, size_t n, uint32_t keep) { return any_bits(x, n, keep); }
static int any_above_f32_scalar(const float *x, size_t n, float t) { return any_above_f32(x, n, t); }
static int any_above_i32_scalar(const int32_t *x, size_t n, double t) { return any_above_i32(x, n, t); }
static void add_f32_scalar(float *d, const uint8_t *s, size_t n) { add_f32(d, s, n); }
static void add_i32_scalar(int32_t *d, const uint8_t *s, size_t n) { add_i32(d, s, n); }
static void checksum_words_scalar(const uint8_t *p, size_t w, uint32_t i, uint32_t *s1, uint32_t *s2) {
    checksum_words(p, w, i, s1, s2);
}

#if CL_X86
AVX2 static uint32_t absmax_avx2(const float *x, size_t n) { return absmax_bits(x, n); }
AVX2 static void be_load_avx2(int32_t *d, const uint8_t *s, size_t n) { be_load(d, s, n); }
AVX2 static void be_store_avx2(uint8_t *d, const int32_t *s, size_t n) { be_store(d, s, n); }
AVX2 static void be_add_be_avx2(uint8_t *d, const uint8_t *s, size_t n) { be_add_be(d, s, n); }
AVX2 static int any_bits_avx2(const uint8_t *x, size_t n, uint32_t keep) { return any_bits(x, n, keep); }
AVX2 static int any_above_f32_avx2(const float *x, size_t n, float t) { return any_above_f32(x, n, t); }
AVX2 static int any_above_i32_avx2(const int32_t *x, size_t n, double t) { return any_above_i32(x, n, t); }
AVX2 static void add_f32_avx2(float *d, const uint8_t *s, size_t n) { add_f32(d, s, n); }
AVX2 static void add_i32_avx2(int32_t *d, const uint8_t *s, size_t n) { add_i32(d, s, n); }
AVX2 static void checksum_words_avx2(const uint8_t *p, size_t w, uint32_t i, uint32_t *s1, uint32_t *s2) {
    checksum_words(p, w, i, s1, s2);
}

AVX2 static inline __m256i bswap_mask(void) {
    return _mm256_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12,
                            3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12);
}

#define PREFETCH_AHEAD 2048   /* bytes: the tensor streams from memory, a packet's block at a time */

AVX2 static void quantize_avx2(const float *x, size_t n, double f, uint8_t *be) {
    __m256d fv = _mm256_set1_pd(f);
    __m256i swap = bswap_mask();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {   /* cvtpd_epi32 rounds to nearest even, as lrint does */
        _mm_prefetch((const char *)(x + i) + PREFETCH_AHEAD, _MM_HINT_T0);
        __m256 v = _mm256_loadu_ps(x + i);
        __m128i lo = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), fv));
        __m128i hi = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), fv));
        __m256i q = _mm256_shuffle_epi8(_mm256_set_m128i(hi, lo), swap);
        _mm256_storeu_si256((__m256i *)(be + 4 * i), q);
    }
    quantize_tail(x, i, n, f, be);
}

AVX2 static void dequantize_avx2(const uint8_t *be, size_t n, double inv, float *out) {
    __m256d iv = _mm256_set1_pd(inv);
    __m256i swap = bswap_mask();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm_prefetch((const char *)(out + i) + PREFETCH_AHEAD, _MM_HINT_T0);
        __m256i q = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(be + 4 * i)), swap);
        __m128 lo = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(q)), iv));
        __m128 hi = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(q, 1)), iv));
        _mm256_storeu_ps(out + i, _mm256_set_m128(hi, lo));
    }
    dequantize_tail(be, i, n, inv, out);
}
#define PICK(name, ...) (vec ? name##_avx2(__VA_ARGS__) : name##_scalar(__VA_ARGS__))
#else
#define PICK(name, ...) name##_scalar(__VA_ARGS__)
#endif

static void quantize_scalar(const float *x, size_t n, double f, uint8_t *be) { quantize_tail(x, 0, n, f, be); }
static void dequantize_scalar(const uint8_t *be, size_t n, double inv, float *out) { dequantize_tail(be, 0, n, inv, out); }

/* ---- the interface -------------------------------------------------------------------------- */
long cl_block_exponents(const float *x, size_t n, size_t block, int8_t *exps) {
    long bad = -1;
    for (size_t b = 0, start = 0; start < n; b++, start += block) {
        size_t cnt = n - start < block ? n - start : block;
        uint32_t bits = PICK(absmax, x + start, cnt);
        if (bits == 0) {
            exps[b] = CL_EXP_ZERO;
            continue;
        }
        int e = CL_EXP_MAX + 1;          /* Inf/NaN: above every exponent */
        if (bits <= 0x7f7fffffu) {
            float amax;
            memcpy(&amax, &bits, 4);
            frexpf(amax, &e);            /* amax = m * 2^e, 0.5 <= m < 1, so amax < 2^e */
        }
        if (e > CL_EXP_MAX) {
            if (bad < 0) bad = (long)b;
            e = CL_EXP_MAX;
        }
        exps[b] = (int8_t)(e < CL_EXP_MIN ? CL_EXP_MIN : e);
    }
    return bad;
}

void cl_quantize_be(const float *x, size_t n, int8_t exp, int nworkers, uint8_t *be) {
    PICK(quantize, x, n, scale(exp, nworkers), be);
}

void cl_dequantize_be(const uint8_t *be, size_t n, int8_t exp, int nworkers, float *out) {
    PICK(dequantize, be, n, 1.0 / scale(exp, nworkers), out);
}

void cl_be_load(int32_t *dst, const uint8_t *src, size_t n) { PICK(be_load, dst, src, n); }
void cl_be_store(uint8_t *dst, const int32_t *src, size_t n) { PICK(be_store, dst, src, n); }
void cl_be_add_be(uint8_t *dst, const uint8_t *src, size_t n) { PICK(be_add_be, dst, src, n); }

size_t cl_block_mask(const void *x, size_t n, int int32, size_t block, double threshold, uint8_t *mask) {
    size_t count = 0;
    if (block == 0) return 0;
    const uint8_t *bytes = (const uint8_t *)x;
    for (size_t b = 0, start = 0; start < n; b++, start += block) {
        size_t cnt = n - start < block ? n - start : block;
        int nz;
        if (int32)
            nz = threshold < 0.5 ? PICK(any_bits, bytes + 4 * start, cnt, 0xffffffffu)   /* exact: any non-zero */
                                 : PICK(any_above_i32, (const int32_t *)x + start, cnt, threshold);
        else
            nz = (float)threshold == 0.0f ? PICK(any_bits, bytes + 4 * start, cnt, 0x7fffffffu)
                                          : PICK(any_above_f32, (const float *)x + start, cnt, (float)threshold);
        mask[b] = (uint8_t)nz;
        count += (size_t)nz;
    }
    return count;
}

void cl_add_f32(float *dst, const uint8_t *src, size_t n) { PICK(add_f32, dst, src, n); }
void cl_add_i32(int32_t *dst, const uint8_t *src, size_t n) { PICK(add_i32, dst, src, n); }

void cl_checksum_words(const uint8_t *p, size_t words, uint32_t i, uint32_t *s1, uint32_t *s2) {
    PICK(checksum_words, p, words, i, s1, s2);
}
