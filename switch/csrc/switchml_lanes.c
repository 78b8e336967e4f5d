/* Big-endian int32 lanes of the switch and the worker (the batched UDP is transport.c's). */
#define _GNU_SOURCE
#include "switchml.h"
#include "switchml_common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LANES __attribute__((target_clones("avx2", "default")))
#else
#define LANES
#endif

LANES void sml_be_load(int32_t *restrict dst, const uint8_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, src + 4 * i, 4);
        dst[i] = (int32_t)__builtin_bswap32(v);
    }
}

LANES void sml_be_add(int32_t *restrict dst, const uint8_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, src + 4 * i, 4);
        dst[i] = (int32_t)((uint32_t)dst[i] + __builtin_bswap32(v));
    }
}

LANES void sml_be_store(uint8_t *restrict dst, const int32_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t v = __builtin_bswap32((uint32_t)src[i]);
        memcpy(dst + 4 * i, &v, 4);
    }
}
