/* Helpers shared by the switch and the worker data path (internal, not part of the interface). */
#ifndef COMMLIB_SWITCHML_COMMON_H
#define COMMLIB_SWITCHML_COMMON_H
#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

static inline uint32_t sml_rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return __builtin_bswap32(v);
}

static inline uint16_t sml_rd16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }

static inline void sml_wr32(uint8_t *p, uint32_t v) {
    v = __builtin_bswap32(v);
    memcpy(p, &v, 4);
}

static inline void sml_wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

static inline uint64_t sml_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint64_t sml_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint32_t sml_size_elems(unsigned code) { return code == 1 ? 64u : code == 2 ? 256u : 0u; }

static inline unsigned sml_elems_code(uint32_t elems) { return elems == 64 ? 1u : elems == 256 ? 2u : 0u; }

static inline void sml_seal(uint8_t *hdr) {
    hdr[18] = hdr[19] = 0;
    sml_wr16(hdr + 18, sml_checksum(hdr));
}

/* ---- big-endian int32 lanes (switchml_udp.c): the per-element work of the switch and the
 * worker, built for AVX2 and for the baseline, picked at load time. */
void sml_be_load(int32_t *dst, const uint8_t *src, size_t n);       /* dst[i] = be32(src + 4i) */
void sml_be_add(int32_t *dst, const uint8_t *src, size_t n);        /* dst[i] += be32(src + 4i), wrapping */
void sml_be_store(uint8_t *dst, const int32_t *src, size_t n);      /* be32(dst + 4i) = src[i] */

/* ---- batched UDP with GSO/GRO (switchml_udp.c) ----------------------------------------------
 * Sends go through a queue: sml_txq_flush() packs consecutive packets of equal length to one
 * destination into one UDP GSO message (up to SML_GSO_SEGS segments; every segment is still its
 * own datagram on the wire) and hands every message to sendmmsg(). Receives with UDP GRO give
 * several datagrams per buffer; sml_rxq_seg() tells the segment size. Both fall back to one
 * datagram per message where the kernel or the path refuses. */
#define SML_GSO_SEGS 64
#define SML_GSO_BYTES 65000
#define SML_GRO_BUF 65536
#define SML_PLAIN_BUF 2048

typedef struct {
    uint8_t *buf;
    uint32_t len;
    struct sockaddr_in to;   /* ignored on a connected socket */
} sml_txpkt;

typedef struct {
    int fd, connected, gso;
    size_t cap, n;
    sml_txpkt *pkts;
    /* scratch of flush, cap entries each */
    struct mmsghdr *msgs;
    struct iovec *iov;
    uint32_t *msg_of, *seg, *nsegs, *bytes, *first, *cursor;
    uint8_t *closed;
    char *ctl;
    uint64_t sent, errors, gso_msgs;
} sml_txq;

int sml_txq_init(sml_txq *q, int fd, int connected, size_t cap, int gso);
void sml_txq_free(sml_txq *q);
static inline void sml_txq_add(sml_txq *q, uint8_t *buf, uint32_t len, const struct sockaddr_in *to) {
    sml_txpkt *p = &q->pkts[q->n++];
    p->buf = buf;
    p->len = len;
    if (to) p->to = *to;
}
/* Send everything queued. 0, or -errno for an error the caller must see (ECONNREFUSED). */
int sml_txq_flush(sml_txq *q);

typedef struct {
    int fd, gro;
    size_t nbufs, bufsize;
    uint8_t *bufs;
    struct mmsghdr *msgs;
    struct iovec *iov;
    struct sockaddr_in *from;
    char *ctl;
} sml_rxq;

int sml_rxq_init(sml_rxq *q, int fd, size_t nbufs, int gro);
void sml_rxq_free(sml_rxq *q);
/* recvmmsg without blocking: messages received, 0 when none, -errno on an error. */
int sml_rxq_recv(sml_rxq *q);
static inline uint8_t *sml_rxq_buf(sml_rxq *q, int i) { return q->bufs + (size_t)i * q->bufsize; }
/* Segment size of message i (its whole length without GRO); 0 if it was truncated. */
size_t sml_rxq_seg(sml_rxq *q, int i);

#endif
