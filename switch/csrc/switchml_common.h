/* Helpers shared by the switch and the worker data path (internal, not part of the interface);
 * sockets, clocks, byte order and checksum come from transport.h. */
#ifndef COMMLIB_SWITCHML_COMMON_H
#define COMMLIB_SWITCHML_COMMON_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "switchml.h"
#include "transport.h"

static inline uint32_t sml_size_elems(unsigned code) { return code == 1 ? 64u : code == 2 ? 256u : 0u; }

static inline unsigned sml_elems_code(uint32_t elems) { return elems == 64 ? 1u : elems == 256 ? 2u : 0u; }

/* The header checksum (transport.h's, over the 20 header bytes with the checksum field zero). */
static inline uint32_t sml_header_checksum(const uint8_t *hdr) {
    uint8_t h[SML_HDR_LEN];
    memcpy(h, hdr, SML_CSUM_OFF);
    memset(h + SML_CSUM_OFF, 0, SML_HDR_LEN - SML_CSUM_OFF);
    tp_ck c = {0, 0, 0, 0};
    tp_ck_update(&c, h, SML_HDR_LEN);
    return tp_ck_final(&c);
}

static inline void sml_seal(uint8_t *hdr) { tp_wr32(hdr + SML_CSUM_OFF, sml_header_checksum(hdr)); }

static inline int sml_sealed(const uint8_t *hdr) { return tp_rd32(hdr + SML_CSUM_OFF) == sml_header_checksum(hdr); }

/* The MAC of a packet of `len` bytes (SML_F_MAC set in its flags) written after it. */
static inline void sml_sign(uint8_t *p, size_t len, const uint8_t *key) { tp_wr64le(p + len, tp_siphash(key, p, len)); }

/* Whether the MAC at p + len matches the packet's `len` bytes before it. */
static inline int sml_signed(const uint8_t *p, size_t len, const uint8_t *key) {
    return tp_rd64le(p + len) == tp_siphash(key, p, len);
}

/* ---- big-endian int32 lanes (switchml_lanes.c): the per-element work of the switch and the
 * worker, built for AVX2 and for the baseline, picked at load time. */
void sml_be_load(int32_t *dst, const uint8_t *src, size_t n);       /* dst[i] = be32(src + 4i) */
void sml_be_add(int32_t *dst, const uint8_t *src, size_t n);        /* dst[i] += be32(src + 4i), wrapping */
void sml_be_store(uint8_t *dst, const int32_t *src, size_t n);      /* be32(dst + 4i) = src[i] */

#endif
