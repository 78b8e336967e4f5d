/* Helpers shared by the OmniReduce worker and aggregator (not part of the Python interface); the
 * sockets, clocks, checksum and random numbers are transport.h's. */
#ifndef COMMLIB_OMNIREDUCE_INTERNAL_H
#define COMMLIB_OMNIREDUCE_INTERNAL_H
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "omnireduce.h"
#include "transport.h"

_Static_assert(sizeof(omr_hdr) == OMR_HDR_BYTES, "omr_hdr must be packed to 40 bytes");

/* Header checksum: transport.h's, over the header (csum = 0), the payload, then `extra` (a
 * result's stamp; the payload is a multiple of 4 bytes, so it sums as if contiguous). */
static inline uint32_t omr_csum2(const omr_hdr *h, const void *payload, size_t len, const void *extra, size_t elen) {
    omr_hdr copy = *h;
    copy.csum = 0;
    tp_ck c = {0, 0, 0, 0};
    tp_ck_update(&c, &copy, sizeof copy);
    if (len) tp_ck_update(&c, payload, len);
    if (elen) tp_ck_update(&c, extra, elen);
    return tp_ck_final(&c);
}
static inline uint32_t omr_hdr_csum(const omr_hdr *h, const void *payload, size_t len) {
    return omr_csum2(h, payload, len, NULL, 0);
}

/* The packets' MAC (omnireduce.h): tp_mac under the job key's subkey, over header || stamp || payload,
 * the nonce (type, 0, rank field, counter) */
#define OMR_MAC_LABEL "commlib omnireduce packets"
_Static_assert(OMR_MAC_BYTES == OMR_NONCE_BYTES + TP_TAG_LEN, "a MAC is its nonce counter and its tag");

static inline void omr_nonce(uint8_t *nonce, const omr_hdr *h, const uint8_t *counter) {
    nonce[0] = h->type;
    nonce[1] = 0;
    nonce[2] = (uint8_t)h->rank;
    nonce[3] = (uint8_t)(h->rank >> 8);
    memcpy(nonce + 4, counter, OMR_NONCE_BYTES);
}

/* out (OMR_MAC_BYTES) = counter, then the tag of h (as sent), stamp[0:slen], payload[0:len] */
static inline void omr_sign(tp_mac *m, uint64_t counter, const omr_hdr *h, const void *payload, size_t len,
                            const void *stamp, size_t slen, uint8_t *out) {
    uint8_t head[OMR_HDR_BYTES + OMR_STAMP_BYTES], nonce[TP_NONCE_LEN];
    memcpy(head, h, OMR_HDR_BYTES);
    if (slen) memcpy(head + OMR_HDR_BYTES, stamp, slen);
    tp_wr64le(out, counter);
    omr_nonce(nonce, h, out);
    tp_mac_tag(m, nonce, head, OMR_HDR_BYTES + slen, payload, len, out + OMR_NONCE_BYTES);
}

/* Whether a received packet (payload as omr_recvq_get gives it: a result's stamp at its end, the
 * MAC right after) carries a valid MAC under m. */
static inline int omr_signed(tp_mac *m, const omr_hdr *h, const uint8_t *payload, size_t len) {
    if (!(h->flags & OMR_F_MAC)) return 0;
    size_t slen = (h->flags & OMR_F_STAMP) && len >= OMR_STAMP_BYTES ? OMR_STAMP_BYTES : 0;
    uint8_t head[OMR_HDR_BYTES + OMR_STAMP_BYTES], nonce[TP_NONCE_LEN];
    memcpy(head, h, OMR_HDR_BYTES);
    memcpy(head + OMR_HDR_BYTES, payload + len - slen, slen);
    omr_nonce(nonce, h, payload + len);
    return tp_mac_check(m, nonce, head, OMR_HDR_BYTES + slen, payload, len - slen, payload + len + OMR_NONCE_BYTES);
}

/* A fresh random 64-bit start for a sender's nonce counter (omnireduce.h); 0 or -1. */
int omr_random64(uint64_t *out);

/* Sends: transport.h's queue (per-destination UDP GSO batches, one sendmmsg), behind the loss and
 * duplication simulator. Payloads are referenced (worker: the input tensor) or copied (aggregator). */
#define OMR_SENDQ 256

typedef struct {
    tp_txq q;
    double loss, dup;                       /* simulation, set per push by the caller */
    uint64_t *rng;
    uint64_t sim_dropped, sim_duplicated;
} omr_sendq;

int omr_sendq_init(omr_sendq *q, int fd, int copy, uint64_t *rng);
void omr_sendq_free(omr_sendq *q);
/* queue one packet (header csum and, with a MAC, OMR_F_MAC and the MAC under nonce counter
 * (*counter)++ are filled in here); applies the loss/duplication simulation */
void omr_sendq_push(omr_sendq *q, const struct sockaddr_in *to, const omr_hdr *h, const void *payload, size_t len,
                    tp_mac *mac, uint64_t *counter);
/* same, with the checksum already in h and the trailer made: the MAC, or a result's stamp and MAC
 * (tlen bytes, at most TP_MAX_TRAILER; one result sent to many workers) */
void omr_sendq_push_ready(omr_sendq *q, const struct sockaddr_in *to, const omr_hdr *h, const void *payload, size_t len,
                          const uint8_t *trailer, uint32_t tlen);
static inline void omr_sendq_flush(omr_sendq *q) { tp_txq_flush(&q->q); }   /* losses are recovered */

/* Receives: transport.h's queue with UDP GRO; every caller sees segments (datagrams). */
#define OMR_RECV_MSGS 64

static inline int omr_recvq_init(tp_rxq *q, int fd) { return tp_rxq_init(q, fd, OMR_RECV_MSGS, TP_GRO_BUF, 1); }
/* wait up to timeout_ms, then take what is there: segments (0 on timeout), -errno on failure;
 * ICMP errors report an earlier send to a dead port: not our receive's fault */
static inline int omr_recvq_recv(tp_rxq *q, int timeout_ms) {
    int k = tp_rxq_recv(q, timeout_ms < 0 ? 0 : timeout_ms);
    return tp_icmp_error(k) ? 0 : k;
}

/* validated header of segment i (NULL if short, truncated or corrupt); *payload_len gets the rest */
static inline const omr_hdr *omr_recvq_get(tp_rxq *q, int i, omr_hdr *out, const uint8_t **payload,
                                           size_t *payload_len) {
    size_t len = q->seg_len[i];
    if (len < sizeof(omr_hdr)) return NULL;
    const uint8_t *buf = q->seg[i];
    memcpy(out, buf, sizeof *out);
    *payload = buf + sizeof(omr_hdr);
    *payload_len = len - sizeof(omr_hdr);
    if (out->flags & OMR_F_MAC) {          /* the MAC trails the payload; the receiver checks it */
        if (*payload_len < OMR_MAC_BYTES) return NULL;
        *payload_len -= OMR_MAC_BYTES;
    }
    if (omr_hdr_csum(out, *payload, *payload_len) != out->csum) return NULL;
    return out;
}

int omr_parse_addr(const char *ip, int port, struct sockaddr_in *out);

#endif
