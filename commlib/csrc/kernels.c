#include "kernels.h"

#include <math.h>

long cl_block_exponents(const float *x, size_t n, size_t block, int8_t *exps) {
    long bad = -1;
    for (size_t b = 0, start = 0; start < n; b++, start += block) {
        size_t end = start + block < n ? start + block : n;
        float amax = 0.0f;
        for (size_t i = start; i < end; i++) {
            float a = fabsf(x[i]);
            amax = a > amax ? a : amax;
            if (!(a <= 3.4028235e38f)) amax = INFINITY;  /* NaN compares false */
        }
        int e;
        if (amax == 0.0f) {
            exps[b] = CL_EXP_ZERO;
            continue;
        }
        frexpf(amax, &e);  /* amax = m * 2^e, 0.5 <= m < 1, so amax < 2^e */
        if (isinf(amax) || e > CL_EXP_MAX) {
            if (bad < 0) bad = (long)b;
            e = CL_EXP_MAX;
        }
        exps[b] = (int8_t)(e < CL_EXP_MIN ? CL_EXP_MIN : e);
    }
    return bad;
}

static inline double scale(int8_t e, int nworkers) {
    return ldexp(2147483647.0 / nworkers, -(int)e);
}

void cl_quantize(const float *x, size_t n, size_t block, const int8_t *exps, int nworkers, int32_t *q) {
    for (size_t b = 0, start = 0; start < n; b++, start += block) {
        size_t end = start + block < n ? start + block : n;
        double f = scale(exps[b], nworkers);
        for (size_t i = start; i < end; i++) q[i] = (int32_t)lrint((double)x[i] * f);
    }
}

void cl_dequantize(const int32_t *q, size_t n, size_t block, const int8_t *exps, int nworkers, float *out) {
    for (size_t b = 0, start = 0; start < n; b++, start += block) {
        size_t end = start + block < n ? start + block : n;
        double inv = 1.0 / scale(exps[b], nworkers);
        for (size_t i = start; i < end; i++) out[i] = (float)((double)q[i] * inv);
    }
}
