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

/* The MAC of a packet (header as sent, payload, then `extra`: a result's stamp): SipHash-2-4
 * under the job key, little-endian. */
static inline void omr_mac2(const uint8_t *key, const omr_hdr *h, const void *payload, size_t len, const void *extra,
                            size_t elen, uint8_t *out) {
    tp_sip s;
    tp_sip_init(&s, key);
    tp_sip_update(&s, h, sizeof *h);
    if (len) tp_sip_update(&s, payload, len);
    if (elen) tp_sip_update(&s, extra, elen);
    tp_wr64le(out, tp_sip_final(&s));
}
static inline void omr_mac(const uint8_t *key, const omr_hdr *h, const void *payload, size_t len, uint8_t *out) {
    omr_mac2(key, h, payload, len, NULL, 0, out);
}

/* Whether a received packet (payload as omr_recvq_get gives it) carries a valid MAC under key. */
static inline int omr_signed(const uint8_t *key, const omr_hdr *h, const uint8_t *payload, size_t len) {
    if (!(h->flags & OMR_F_MAC)) return 0;
    uint8_t mac[TP_MAC_LEN];
    omr_mac(key, h, payload, len, mac);
    return memcmp(mac, payload + len, TP_MAC_LEN) == 0;
}

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
/* queue one packet (header csum and, with a key, OMR_F_MAC and the MAC are filled in here);
 * applies the loss/duplication simulation */
void omr_sendq_push(omr_sendq *q, const struct sockaddr_in *to, const omr_hdr *h, const void *payload, size_t len,
                    const uint8_t *key);
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
        if (*payload_len < TP_MAC_LEN) return NULL;
        *payload_len -= TP_MAC_LEN;
    }
    if (omr_hdr_csum(out, *payload, *payload_len) != out->csum) return NULL;
    return out;
}

int omr_parse_addr(const char *ip, int port, struct sockaddr_in *out);

#endif
