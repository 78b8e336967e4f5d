/* commlib's UDP transport: the whole interface of the layer under both data planes (the SwitchML
 * switch and workers, the OmniReduce workers and aggregators).
 *
 *   - batched sends: a queue of packets, grouped per destination into UDP GSO messages and handed
 *     to sendmmsg() (each segment is still its own datagram on the wire);
 *   - batched receives: recvmmsg() with UDP GRO, split back into datagrams ("segments");
 *   - one retransmission timer: the RFC 6298 round-trip estimator (srtt + max(4 rttvar, srtt / 2), clamped; tp_rtt_answer takes samples from spurious resends);
 *   - one checksum: the word sum and the index-weighted word sum of the bytes (catches corrupted,
 *     swapped and truncated words; vectorizes);
 *   - the packet MAC (what an attacker cannot forge; the checksum is public): AES-256-GCM or
 *     ChaCha20-Poly1305 from OpenSSL, by the job (SwitchML and OmniReduce);
 *   - clocks and the simulator's random numbers.
 *
 * Python sees the part above TP_PYTHON_API_ONLY (through cffi, switch/csrc/build_native.py); the
 * queues below it are C only (they are built on the socket API). */
#ifndef COMMLIB_TRANSPORT_H
#define COMMLIB_TRANSPORT_H
#include <stddef.h>
#include <stdint.h>

#define TP_FLOAT32 0
#define TP_INT32 1

/* checksum of buf[0:len] (callers zero their checksum field first) */
uint32_t tp_checksum(const void *buf, size_t len);
#define TP_KEY_LEN 16   /* a job key */

/* The packet MAC, from a maintained library (OpenSSL's libcrypto, linked in statically): an AEAD used
 * as a nonce-based MAC, the message its associated data, the plaintext empty, the 16-byte tag the MAC.
 * Two algorithms, a job parameter (the same for every rank, switch and aggregator of a job; rank 0
 * chooses, switch/packet_mac.py):
 *   TP_MAC_AES_256_GCM         AES-256-GCM, i.e. GMAC (NIST SP 800-38D): for CPUs with AES-NI and
 *                              PCLMULQDQ (tp_mac_fast), where OpenSSL's GHASH is carry-less multiplies;
 *   TP_MAC_CHACHA20_POLY1305   ChaCha20-Poly1305 (RFC 8439): portable, and never slow.
 * Both cost about 0.11-0.13 ns per byte here (OpenSSL 3.0, an AVX-512 CPU); AES-GCM costs less per
 * call (1 KiB: about 470 against 620 ns), Poly1305 less per byte (32 KiB: 3.7 against 4.1 us), so
 * `auto` times both on the job's packet size (bench_kernels.py has the figures). The 32-byte key is
 * HKDF-SHA256 (RFC 5869) of a 16-byte job key with the info "<label>" for ChaCha20-Poly1305 (its
 * construction before AES-GCM came) and "<label> aes-256-gcm" for AES-256-GCM (no label ends so): the
 * packets' key is never the key of another use of the job key (its control requests), nor of the
 * other algorithm, so a packet MACed under one algorithm is refused by a job of the other (no
 * downgrade: the algorithm is agreed over the authenticated control path, and a wrong one derives a
 * wrong key).
 * The nonce rule: a (key, nonce) pair MACs one message only (the same bytes again are fine: same
 * tag). The caller's protocol says what makes its nonces unique (switchml.h, omnireduce.h): fresh
 * 64-bit counters or ids per sender, the sender in the nonce, separate keys per switch thread and
 * worker stream (switch/auth.py's stream_key). With GMAC this rule carries the whole key: two
 * messages under one nonce reveal GHASH's key H, hence forgeries under every nonce of that key (with
 * ChaCha20-Poly1305 only that nonce's one-time key). A tp_mac keeps one keyed OpenSSL context: a call
 * sets the nonce only (no allocation, no key schedule). A tp_mac is used by one thread at a time. */
#define TP_TAG_LEN 16
#define TP_NONCE_LEN 12
#define TP_MAC_CHACHA20_POLY1305 1
#define TP_MAC_AES_256_GCM 2
typedef struct tp_mac tp_mac;
/* 1 if this CPU has AES-NI and PCLMULQDQ (without them AES-256-GCM is slow: ChaCha20-Poly1305 then) */
int tp_mac_fast(void);
/* the algorithm's name ("aes-256-gcm", "chacha20-poly1305"), NULL if alg is none of TP_MAC_* */
const char *tp_mac_name(int alg);
/* NULL: out of memory, an unknown alg, or OpenSSL lacks it */
tp_mac *tp_mac_new(const uint8_t *key, const char *label, int alg);
void tp_mac_free(tp_mac *m);
/* tag = the MAC of a[0:alen] || b[0:blen] under nonce (TP_NONCE_LEN bytes); 0, or -1 if OpenSSL failed */
int tp_mac_tag(tp_mac *m, const uint8_t *nonce, const void *a, size_t alen, const void *b, size_t blen, uint8_t *tag);
/* 1 if tag (TP_TAG_LEN bytes) is that MAC (compared in constant time), else 0 */
int tp_mac_check(tp_mac *m, const uint8_t *nonce, const void *a, size_t alen, const void *b, size_t blen,
                 const uint8_t *tag);

#ifndef TP_PYTHON_API_ONLY
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "kernels.h"

/* The MAC of a message in pieces (a packet sent from several buffers): the same tag as tp_mac_tag of
 * their concatenation. 0, or -1 if OpenSSL failed. */
typedef struct { const void *p; size_t len; } tp_part;
int tp_mac_tagv(tp_mac *m, const uint8_t *nonce, const tp_part *parts, int nparts, uint8_t *tag);

/* ---- clocks, byte order, random numbers ---------------------------------------------------- */
static inline uint64_t tp_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint64_t tp_now_us(void) { return tp_now_ns() / 1000u; }

static inline uint64_t tp_wall_ns(void) {   /* the clock of the kernel's receive stamps */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint64_t tp_cpu_ns(void) {   /* CPU time of the calling thread */
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint32_t tp_rd32(const uint8_t *p) {   /* big-endian */
    uint32_t v;
    memcpy(&v, p, 4);
    return __builtin_bswap32(v);
}

static inline uint16_t tp_rd16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }

static inline void tp_wr32(uint8_t *p, uint32_t v) {
    v = __builtin_bswap32(v);
    memcpy(p, &v, 4);
}

static inline void tp_wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

/* xorshift64*, uniform in [0, 1): the loss/duplication simulators only */
static inline double tp_uniform(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return (double)((x * 0x2545F4914F6CDD1DULL) >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- checksum, incrementally (pieces of a multiple of 4 bytes, but the last) ----------------- */
typedef struct { uint32_t s1, s2, i, len; } tp_ck;

static inline void tp_ck_update(tp_ck *c, const void *p, size_t len) {
    const uint8_t *b = (const uint8_t *)p;
    uint32_t s1 = c->s1, s2 = c->s2, i = c->i;
    size_t words = len / 4;
    cl_checksum_words(b, words, i, &s1, &s2);   /* kernels.h: vectorized where the CPU can */
    i += (uint32_t)words;
    if (len % 4) {
        uint32_t w = 0;
        memcpy(&w, b + 4 * words, len % 4);
        s1 += w;
        s2 += w * (++i);
    }
    c->s1 = s1;
    c->s2 = s2;
    c->i = i;
    c->len += (uint32_t)len;
}

static inline uint32_t tp_ck_final(const tp_ck *c) { return c->s1 ^ ((c->s2 << 16) | (c->s2 >> 16)) ^ c->len; }

/* ---- little-endian 64-bit words (OmniReduce's nonce counters) ------------------------------- */
static inline void tp_wr64le(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i)); }

/* ---- retransmission timer (RFC 6298) --------------------------------------------------------
 * Samples in any unit (the caller's clock); only from packets sent once (Karn), or from a resent
 * packet whose answer came sooner after the resend than any round trip seen (`least`): it answers
 * the first transmission, so the resend was spurious and the first one's time is a true sample
 * (as Eifel/F-RTO detect). Without those, the samples would come only from the packets fast enough
 * to beat their timers, and a queue (a full window on a slow link, a TCP flow beside it) would fire
 * every other timer, round after round: switchml sent 2.5x its bytes on 100 Mbit links (this and
 * the margin and the backoff below, see there). `least` is the smallest
 * sample ever, a conservative bound: a smaller one detects fewer, never a wrong one.
 * rto is the timer of a new packet: srtt + max(4 rttvar, srtt / 2) within [min, max], min before the
 * first sample. The srtt / 2 floor: a full window's round trips are all alike, so rttvar falls
 * toward 0 and srtt + 4 rttvar toward srtt, where the next bump fires every timer at once (TCP's
 * 200 ms minimum guards the same way). After a timer fired (tp_rtt_backoff) rto is doubled and kept
 * until a packet sent after that answers (Karn's backoff; doubled again only when such a packet's
 * timer fires too): meanwhile the answers come from the packets that beat the short timer, whose
 * samples alone would pull rto down under the queue that made the others late. With all three,
 * switchml on 100 Mbit links sends within 5% of its bytes; the price is slower recovery from heavy
 * random loss (`make faults`: 5% loss, duplication, 25% reordering and jitter together, about 1.3x).
 * Samples come one per packet, a window of them per round trip, so each weighs 1/flight of RFC
 * 6298's gains (RFC 7323's rule for a sample per ACK): else the first answers of a window sent at
 * once, back before the queue it builds, pulled srtt to them within the round, and the packets
 * sent next, behind that queue, timed out: hot/cold's slab (a few windows) resent 20-40% of its
 * packets on 100 Mbit links, none with the weighting (the first two calls on a path excepted:
 * rto starts at min, and a sample moves srtt little). Omnireduce's one sample per round: flight 1. */
typedef struct { uint64_t srtt, rttvar, rto, min, max, least, backoff_at; } tp_rtt;

static inline void tp_rtt_init(tp_rtt *r, uint64_t min, uint64_t max) {
    r->srtt = r->rttvar = 0;
    r->min = min;
    r->max = max < min ? min : max;
    r->rto = min;
    r->least = r->backoff_at = 0;
}

static inline void tp_rtt_sample(tp_rtt *r, uint64_t sample, uint64_t flight) {
    if (!r->srtt) {
        r->srtt = sample ? sample : 1;
        r->rttvar = sample / 2;
    } else {   /* RFC 6298's gains (1/8, 1/4) per round trip, spread over its `flight` samples */
        int64_t d = (int64_t)sample - (int64_t)r->srtt, ad = d < 0 ? -d : d;
        int64_t n = flight ? (int64_t)flight : 1;
        r->rttvar = (uint64_t)((int64_t)r->rttvar + (ad - (int64_t)r->rttvar) / (4 * n));
        r->srtt = (uint64_t)((int64_t)r->srtt + d / (8 * n));
        if (!r->srtt) r->srtt = 1;
    }
    if (!r->least || sample < r->least) r->least = sample;
    uint64_t margin = 4 * r->rttvar > r->srtt / 2 ? 4 * r->rttvar : r->srtt / 2;
    uint64_t rto = r->srtt + margin;
    r->rto = rto < r->min ? r->min : rto > r->max ? r->max : rto;
}

/* Whether an answer at `now` to a packet sent once, or resent at `resent`, answers its first transmission:
 * never resent, or back sooner after the resend than any round trip seen (a spurious resend). */
static inline int tp_rtt_first(const tp_rtt *r, uint64_t resent, uint64_t now) {
    return !resent || (r->least && now - resent < r->least);
}

/* The answer at `now` to a packet first sent at `sent` and last resent at `resent` (0: never). */
static inline void tp_rtt_answer(tp_rtt *r, uint64_t sent, uint64_t resent, uint64_t now, uint64_t flight) {
    if (sent < r->backoff_at) return;   /* sent under the timer that fired: the backed-off rto stays */
    r->backoff_at = 0;
    if (tp_rtt_first(r, resent, now)) tp_rtt_sample(r, now - sent, flight);
}

/* The timer of a packet first sent at `sent` fired at `now`: back off once per timer found too
 * short (one sent before the last backoff had the shorter timer; its expiry says nothing new). */
static inline void tp_rtt_backoff(tp_rtt *r, uint64_t sent, uint64_t now) {
    if (r->backoff_at && sent < r->backoff_at) return;
    r->rto = r->rto * 2 < r->max ? r->rto * 2 : r->max;
    r->backoff_at = now;
}

/* ---- batched sends -------------------------------------------------------------------------
 * A packet is a header (copied into the queue, at most TP_MAX_HDR bytes) and a payload
 * (referenced; copied into the queue's arena with TP_COPY). tp_txq_flush() packs consecutive
 * packets of one size to one destination (a shorter one may end a run, as GSO allows) into one
 * UDP GSO message of at most TP_GSO_SEGS segments and TP_GSO_BYTES, and sends every message with
 * sendmmsg(). Where the kernel or the path refuses GSO the queue stops using it for good (one
 * datagram per message). A full socket buffer is waited for (briefly); other failures to send are
 * losses, which the protocols recover from. */
#define TP_MAX_HDR 64
#define TP_MAX_TRAILER 40   /* a result's stamp (omnireduce.h: 12 bytes) and its MAC (OMR_MAC_BYTES: 24) */
#define TP_GSO_SEGS 64
#define TP_GSO_BYTES 65000
#define TP_ARENA (1u << 20)

#define TP_CONNECTED 1   /* the socket is connected: destinations are ignored */
#define TP_GSO 2         /* try UDP GSO */
#define TP_COPY 4        /* copy payloads (the caller reuses its buffers before the flush) */

typedef struct {
    struct sockaddr_in to;
    uint32_t hlen, plen, tlen;
    const uint8_t *payload;
    uint8_t hdr[TP_MAX_HDR];
    uint8_t trailer[TP_MAX_TRAILER];
} tp_txpkt;

typedef struct {
    int fd, flags;
    size_t cap, n;
    tp_txpkt *pkts;
    uint8_t *arena;
    size_t arena_used;
    /* scratch of flush, cap entries each */
    struct mmsghdr *msgs;
    struct iovec *iov;
    uint32_t *msg_of, *seg, *nsegs, *bytes, *first, *cursor, *base;
    uint8_t *closed;
    char *ctl;
    uint64_t pkts_sent, bytes_sent, messages, gso_messages, errors;
} tp_txq;

int tp_txq_init(tp_txq *q, int fd, size_t cap, int flags);
void tp_txq_free(tp_txq *q);
/* Queue one packet (to: ignored with TP_CONNECTED); flushes first when the queue is full.
 * Returns what that flush returned (0 when none). */
int tp_txq_add(tp_txq *q, const struct sockaddr_in *to, const void *hdr, uint32_t hlen, const void *payload,
               uint32_t plen);
/* Give the packet just queued a trailer of len <= TP_MAX_TRAILER bytes (copied): its MAC, or a
 * result's stamp and MAC. */
void tp_txq_trailer(tp_txq *q, const uint8_t *trailer, uint32_t len);
/* Send everything queued: 0, or -ECONNREFUSED when the (connected) peer's port is closed. */
int tp_txq_flush(tp_txq *q);

/* ---- batched receives -----------------------------------------------------------------------
 * recvmmsg() into nmsgs buffers (64 KiB with GRO, else bufsize), each message split into its
 * datagrams: segments seg[0..nseg) of seg_len[i] bytes from tp_rxq_from(q, i). */
#define TP_GRO_BUF 65536
#define TP_GRO_SEGS 128   /* most datagrams the kernel coalesces into one message */

typedef struct {
    int fd, gro;
    size_t nmsgs, bufsize, maxseg;
    uint8_t *bufs;
    struct mmsghdr *msgs;
    struct iovec *iov;
    struct sockaddr_in *from;
    char *ctl;
    size_t want;                         /* messages per call, at most nmsgs (0: nmsgs): a caller may bound a
                                          * batch's bytes, which it then processes from cache */
    int nmsg, nseg;                      /* of the last call: messages, segments */
    const uint8_t **seg;
    uint32_t *seg_len;
    uint16_t *seg_msg;
    uint64_t *stamp;                     /* per message: the kernel's receive time (CLOCK_REALTIME ns), 0 if none */
    int stamps;                          /* tp_rxq_stamps() was called */
    uint64_t messages, truncated;
} tp_rxq;

int tp_rxq_init(tp_rxq *q, int fd, size_t nmsgs, size_t bufsize, int gro);
void tp_rxq_free(tp_rxq *q);
/* Take what is waiting: with timeout_ms > 0 after waiting up to that long for something (poll),
 * with 0 at once. Returns the number of segments (0: none), or -errno (ECONNREFUSED and co report
 * an ICMP error for an earlier send; callers decide whether that matters). */
int tp_rxq_recv(tp_rxq *q, int timeout_ms);
static inline const struct sockaddr_in *tp_rxq_from(const tp_rxq *q, int i) { return &q->from[q->seg_msg[i]]; }
/* Ask the kernel to stamp each datagram's arrival (SO_TIMESTAMPNS), so that a daemon can tell how
 * long a packet waited in its socket before it was processed: tp_wall_ns() - tp_rxq_stamp(q, i). */
int tp_rxq_stamps(tp_rxq *q);
static inline uint64_t tp_rxq_stamp(const tp_rxq *q, int i) { return q->stamp[q->seg_msg[i]]; }
/* How long segment i waited in the socket until now (ns; 0 without a stamp or when the clock stepped). */
static inline uint64_t tp_rxq_waited(const tp_rxq *q, int i) {
    uint64_t stamp = tp_rxq_stamp(q, i), wall = stamp ? tp_wall_ns() : 0;
    return wall > stamp ? wall - stamp : 0;
}
/* a + b, saturating at UINT32_MAX: the 32-bit ns fields of the results' stamps */
static inline uint32_t tp_add_sat32(uint32_t a, uint64_t b) { return b >= UINT32_MAX - a ? UINT32_MAX : a + (uint32_t)b; }
static inline int tp_icmp_error(int rc) { return rc == -ECONNREFUSED || rc == -EHOSTUNREACH || rc == -ENETUNREACH; }

#endif /* TP_PYTHON_API_ONLY */
#endif
