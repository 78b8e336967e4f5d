/* Helpers shared by the switch and the worker data path (internal, not part of the interface);
 * sockets, clocks, byte order and checksum come from transport.h. */
#ifndef COMMLIB_SWITCHML_COMMON_H
#define COMMLIB_SWITCHML_COMMON_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"   /* the per-element work: big-endian lanes, quantization */
#include "switchml.h"
#include "transport.h"

/* Values in a packet of size code `code` of a job of `job_elems` values per packet. */
static inline uint32_t sml_size_elems(unsigned code, uint32_t job_elems) {
    return code == 1 ? 64u : code == 2 ? 256u : code == SML_SIZE_JOB ? job_elems : 0u;
}

/* The size code of a job's payloads: Tofino's codes for its sizes, else the job's. */
static inline unsigned sml_elems_code(uint32_t elems) { return elems == 64 ? 1u : elems == 256 ? 2u : SML_SIZE_JOB; }

/* The longest packet of a job of `elems` values per packet (flag region, stamp, seq and MAC included). */
static inline size_t sml_pkt_max(uint32_t elems) {
    return SML_HDR_LEN + 5 * (size_t)elems + SML_STAMP_LEN + SML_SEQ_LEN + SML_MAC_LEN;
}

/* ---- packet ids: 64-bit inside, the low bits of sml_id_mask on the wire (switchml.h) ---------- */
extern uint32_t sml_id_mask;

static inline uint32_t sml_id_wire(uint64_t id) { return (uint32_t)id & sml_id_mask; }

/* The id with these wire bits nearest to ref (the switch: ranks stream the same ids, close together). */
static inline uint64_t sml_id_near(uint32_t wire, uint64_t ref) {
    uint64_t span = (uint64_t)sml_id_mask + 1, ahead = (wire - ref) & sml_id_mask;
    return ahead < span / 2 ? ref + ahead : ref + ahead - span;
}

/* The id with these wire bits at or before newest (the worker: answers come for ids it sent). */
static inline uint64_t sml_id_upto(uint32_t wire, uint64_t newest) { return newest - ((newest - wire) & sml_id_mask); }

/* ---- the packet MAC (switchml.h): tp_mac over id64 || packet, the nonce by type ------------------- */
#define SML_MAC_LABEL "commlib switchml packets"

static inline void sml_nonce(uint8_t *nonce, uint8_t type, uint8_t rank, uint64_t counter) {
    nonce[0] = type;
    nonce[1] = rank;
    nonce[2] = nonce[3] = 0;
    tp_wr32(nonce + 4, (uint32_t)(counter >> 32));
    tp_wr32(nonce + 8, (uint32_t)counter);
}

/* The 64-bit packet id as the MAC's input starts with it (the wire carries its low 32 bits). */
static inline void sml_id_prefix(uint8_t prefix[8], uint64_t id) {
    tp_wr32(prefix, (uint32_t)(id >> 32));
    tp_wr32(prefix + 4, (uint32_t)id);
}

/* The MAC of a packet sent in three pieces (header, payload, trailer: a result sent from the slot's
 * memory), the same as sml_sign's of their concatenation; written to tag. */
static inline void sml_sign_parts(tp_mac *m, const uint8_t *hdr, size_t hlen, const uint8_t *payload, size_t plen,
                                  const uint8_t *trailer, size_t tlen, uint64_t id, const uint8_t *nonce, uint8_t *tag) {
    uint8_t prefix[8];
    sml_id_prefix(prefix, id);
    tp_part parts[4] = {{prefix, sizeof prefix}, {hdr, hlen}, {payload, plen}, {trailer, tlen}};
    tp_mac_tagv(m, nonce, parts, 4, tag);
}

/* Write the MAC of the packet's `len` bytes (SML_F_MAC set in its flags) after them. */
static inline void sml_sign(tp_mac *m, uint8_t *p, size_t len, uint64_t id, const uint8_t *nonce) {
    sml_sign_parts(m, p, len, NULL, 0, NULL, 0, id, nonce, p + len);
}

/* Whether the MAC at p + len is that of the packet's `len` bytes before it. */
static inline int sml_signed(tp_mac *m, const uint8_t *p, size_t len, uint64_t id, const uint8_t *nonce) {
    uint8_t prefix[8];
    sml_id_prefix(prefix, id);
    return tp_mac_check(m, nonce, prefix, sizeof prefix, p, len, p + len);
}

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


#endif
