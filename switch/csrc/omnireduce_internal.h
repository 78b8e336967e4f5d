/* Helpers shared by the OmniReduce worker and aggregator (not part of the Python interface):
 * clock, random numbers, checksum, and batched UDP send/receive queues. */
#ifndef COMMLIB_OMNIREDUCE_INTERNAL_H
#define COMMLIB_OMNIREDUCE_INTERNAL_H
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/udp.h>
#include <sys/socket.h>
#include <time.h>

#include "omnireduce.h"

_Static_assert(sizeof(omr_hdr) == OMR_HDR_BYTES, "omr_hdr must be packed to 40 bytes");

static inline uint64_t omr_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* xorshift64*: loss/duplication simulation only */
static inline double omr_uniform(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    *s = x;
    return (double)((x * 0x2545F4914F6CDD1DULL) >> 11) * (1.0 / 9007199254740992.0);
}

/* Checksum over header (csum = 0) then payload: the word sum and the index-weighted word sum
 * (catches corrupted, swapped and truncated words; vectorizes). */
typedef struct { uint32_t s1, s2, i, len; } omr_ck;

static inline void omr_ck_update(omr_ck *c, const void *p, size_t len) {
    const uint8_t *b = (const uint8_t *)p;
    uint32_t s1 = c->s1, s2 = c->s2, i = c->i;
    size_t words = len / 4;
    for (size_t k = 0; k < words; k++) {
        uint32_t w;
        memcpy(&w, b + 4 * k, 4);
        s1 += w;
        s2 += w * (i + (uint32_t)k + 1u);
    }
    i += (uint32_t)words;
    if (len % 4) {
        uint32_t w = 0;
        memcpy(&w, b + 4 * words, len % 4);
        s1 += w;
        s2 += w * (++i);
    }
    c->s1 = s1; c->s2 = s2; c->i = i; c->len += (uint32_t)len;
}

static inline uint32_t omr_ck_final(const omr_ck *c) {
    return c->s1 ^ ((c->s2 << 16) | (c->s2 >> 16)) ^ c->len;
}

static inline uint32_t omr_hdr_csum(const omr_hdr *h, const void *payload, size_t len) {
    omr_hdr copy = *h;
    copy.csum = 0;
    omr_ck c = {0, 0, 0, 0};
    omr_ck_update(&c, &copy, sizeof copy);
    if (len) omr_ck_update(&c, payload, len);
    return omr_ck_final(&c);
}

/* Batched sends. Packets are queued, then grouped per destination (order kept per destination)
 * into UDP GSO messages (UDP_SEGMENT: up to OMR_GSO_SEGS equal-sized datagrams in one buffer,
 * the last one may be shorter) sent with one sendmmsg: the kernel's per-datagram work is paid
 * per message. Payloads are referenced (worker: the input tensor) or copied (aggregator). */
#define OMR_SENDQ 256
#define OMR_GSO_SEGS 64
#define OMR_GSO_BYTES 65000
#define OMR_ARENA (1u << 20)

typedef struct {
    int fd, n, gso;                         /* gso: 1 while the kernel accepts UDP_SEGMENT */
    int copy;                               /* copy payloads into the arena */
    struct sockaddr_in addr[OMR_SENDQ];
    omr_hdr hdr[OMR_SENDQ];
    const uint8_t *payload[OMR_SENDQ];
    uint32_t len[OMR_SENDQ];
    uint8_t *arena;
    size_t arena_used;
    /* flush scratch */
    int order[OMR_SENDQ];
    uint8_t used[OMR_SENDQ];
    struct mmsghdr msgs[OMR_SENDQ];
    struct iovec iov[2 * OMR_SENDQ];
    uint32_t nsegs[OMR_SENDQ], nbytes[OMR_SENDQ];
    union { char buf[CMSG_SPACE(sizeof(uint16_t))]; struct cmsghdr align; } ctrl[OMR_SENDQ];
    uint64_t pkts, bytes, sim_dropped, sim_duplicated, messages;
    double loss, dup;                       /* simulation, set per push by the caller */
    uint64_t *rng;
} omr_sendq;

/* Batched receives with UDP GRO: a message may hold several datagrams of one sender, split
 * here into segments (the unit every caller sees). */
#define OMR_RECV_MSGS 64
#define OMR_RECV_BUF 65536
#define OMR_RECV_SEGS (OMR_RECV_MSGS * OMR_GSO_SEGS)

typedef struct {
    int fd, nseg, nmsg;                     /* nmsg: messages the last call took */
    struct mmsghdr msgs[OMR_RECV_MSGS];
    struct iovec iov[OMR_RECV_MSGS];
    struct sockaddr_in addr[OMR_RECV_MSGS];
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } ctrl[OMR_RECV_MSGS];
    uint8_t *bufs;
    const uint8_t *seg[OMR_RECV_SEGS];
    uint32_t seg_len[OMR_RECV_SEGS];
    uint16_t seg_msg[OMR_RECV_SEGS];
    uint64_t messages;
} omr_recvq;

int omr_sendq_init(omr_sendq *q, int fd, int copy, uint64_t *rng);
void omr_sendq_free(omr_sendq *q);
/* queue one packet (header csum is filled in here); applies the loss/duplication simulation */
void omr_sendq_push(omr_sendq *q, const struct sockaddr_in *to, const omr_hdr *h, const void *payload, size_t len);
/* same, with the checksum already in h (one result sent to many workers) */
void omr_sendq_push_ready(omr_sendq *q, const struct sockaddr_in *to, const omr_hdr *h, const void *payload, size_t len);
void omr_sendq_flush(omr_sendq *q);

/* enable UDP GRO on a socket (best effort) */
void omr_enable_gro(int fd);
int omr_recvq_init(omr_recvq *q, int fd);
void omr_recvq_free(omr_recvq *q);
/* wait up to timeout_ms, then take what is there: segments (0 on timeout), -errno on failure */
int omr_recvq_recv(omr_recvq *q, int timeout_ms);
static inline const struct sockaddr_in *omr_recvq_from(const omr_recvq *q, int i) { return &q->addr[q->seg_msg[i]]; }

/* validated header of segment i (NULL if short, truncated or corrupt); *payload_len gets the rest */
const omr_hdr *omr_recvq_get(omr_recvq *q, int i, omr_hdr *out, const uint8_t **payload, size_t *payload_len);

int omr_parse_addr(const char *ip, int port, struct sockaddr_in *out);

#endif
