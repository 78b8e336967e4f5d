/* The software switch: SwitchML's data plane over UDP (see switchml.h for the packet and the
 * per-packet rules). One thread runs sml_switch_run(); control calls (jobs, counters, the drop
 * simulator) come from other threads and take the same mutex. The data-plane thread holds it
 * while it processes a received batch and sends the batch's results (sendmmsg in
 * tp_txq_flush, which can wait for room in the socket's send buffer), so a control call may
 * wait for one batch; it never holds it while waiting for packets (poll, recvmmsg). A control
 * call holds it only to copy: a job's memory is allocated before and freed after, so the data
 * plane never waits for an allocator. A switch of several threads is several sml_switch, one
 * per thread and socket, sharing nothing (switch/switchml.py): no lock is shared between them.
 * A leaf job (switchml.h: hierarchy) also sends its complete sets to its parent from this socket,
 * takes the parent's results on it and resends on the timers of its waiting sets (next_up). */
#define _GNU_SOURCE
#include "switchml.h"
#include "switchml_common.h"

#include <errno.h>
#include <netinet/in.h>
#include <openssl/rand.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>

#define RX_BATCH 32
#define RX_BATCH_BYTES (256u << 10)   /* a batch's bytes, about: small packets come 32 per call, a job's large
                                       * ones fewer, so that what the kernel copied in is still in cache when
                                       * it is processed (32 packets of 32 KiB cost the switch 10% more CPU) */
#define RX_BUF TP_GRO_BUF  /* without GRO too: any datagram (jobs choose their packet sizes) */
#define TX_CAP 8192
#define ARENA (4u << 20)    /* bytes of result packets waiting to be sent */
_Static_assert(ARENA >= 16 * SML_MAX_PKT, "a full arena is sent, so it needs room for a few results only");
_Static_assert(sizeof ((sml_counters *)0)->ranks_per_ms / sizeof (uint64_t) == SML_MAX_WORKERS + 1, "a count per rank number");

typedef struct {
    uint64_t bitmap;     /* ranks that contributed */
    uint32_t countdown;  /* ranks still missing; 0 = complete */
    uint64_t pkt_id;     /* packet id of the first contribution (every rank streams the same ids) */
    int8_t exp;          /* max block exponent */
    uint8_t size;        /* size code of the contributions */
    uint8_t nf;          /* the nonfinite region holds flags */
    uint32_t queue_ns, proc_ns;   /* the round's share of the switch, summed over its contributions (the stamp) */
    uint8_t up;          /* a leaf's set: UP_WAIT from completion until the parent's result (switchml.h) */
    uint32_t up_tries;   /* its resends so far */
    uint64_t up_deadline, up_rto;   /* its resend time and timer, ns */
    uint64_t up_sent, up_resent;    /* its first send and last resend (0: none), ns: the parent's round trip */
    uint32_t tx_gen;     /* = the switch's tx_gen while a queued result is sent from its sums (settle) */
} slot_set;

#define UP_WAIT 1
#define UP_ABANDONED 2   /* resent `tries` times unanswered: no result; its workers time out */

/* A leaf job's parent (switchml.h: hierarchy). */
typedef struct {
    int active;
    struct sockaddr_in addr;
    uint8_t job, rank;
    uint32_t token;
    tp_mac *mac;         /* under the parent job's key; NULL: its packets carry no MAC */
    tp_rtt rtt;          /* the parent's round trip, as a worker's (transport.h): rtt.rto, within [rto, rto_max],
                          * is a new set's timer, so a spine waiting for a slower leaf or a queue on the link
                          * fires no resend */
    uint32_t tries;      /* resends of a set before it is abandoned */
    uint32_t waiting;    /* sets waiting for its result: the samples of one round trip */
} parent_t;

typedef struct {
    int active;
    uint32_t token;
    tp_mac *mac;         /* the packet MAC under the job key (switchml.h); NULL: packets without MACs */
    uint64_t newest;     /* the newest packet id accepted: the wire's 32 bits are extended near it */
    uint64_t seq;        /* the next result's number (its MAC's nonce) */
    int nworkers;
    uint32_t nslots, elems, ngroups;
    struct sockaddr_in addrs[SML_MAX_WORKERS];
    uint64_t addr_mask;  /* ranks whose address is registered */
    slot_set *sets;      /* [slot * 2 + set] */
    uint8_t *values;     /* [(slot * 2 + set) * 4 * elems]: the sums, big-endian int32 (wire order), so that a
                          * result's payload is sent from here, neither converted nor copied */
    uint8_t *nfreg;      /* [(slot * 2 + set) * elems] */
    sml_counters c;
    sml_counters *groups;
    uint64_t ms_now, ms_ranks;   /* the millisecond of the last accepted packet, the ranks seen in it */
    parent_t up;
    uint64_t up_next;    /* no later than the earliest resend time of its waiting sets, ns (UINT64_MAX: none) */
} job_t;

struct sml_switch {
    int fd;
    pthread_mutex_t mu;
    uint32_t max_slots, used_slots, group_slots;
    double p_in, p_out, p_dup;
    uint64_t rng;
    sml_global g;
    job_t jobs[SML_MAX_JOBS];
    /* batch state (owned by the thread in sml_switch_run) */
    tp_rxq rx;
    tp_txq tx;
    uint8_t *arena;      /* ARENA bytes of result packets, referenced by tx until it is flushed */
    size_t arena_used;
    uint64_t next_up;    /* no later than the earliest resend time of a leaf's waiting set, ns */
    uint32_t tx_gen;     /* bumped by every send of the queue (send_queued) */
    uint64_t cpu_mark;   /* the thread's CPU time when g.cpu_ns was last brought up to date */
};

uint32_t sml_id_mask = UINT32_MAX;

void sml_testing_id_bits(int bits) { sml_id_mask = bits >= 1 && bits < 32 ? (1u << bits) - 1 : UINT32_MAX; }

static double rnd(sml_switch *sw) { return tp_uniform(&sw->rng); }

sml_switch *sml_switch_new(int fd, uint32_t max_slots, uint32_t group_slots, int offload) {
    sml_switch *sw = calloc(1, sizeof *sw);
    if (!sw) return NULL;
    sw->arena = malloc(ARENA);
    if (!sw->arena || tp_rxq_init(&sw->rx, fd, RX_BATCH, RX_BUF, offload) || tp_txq_init(&sw->tx, fd, TX_CAP, offload ? TP_GSO : 0)) {
        free(sw->arena);
        tp_rxq_free(&sw->rx);
        tp_txq_free(&sw->tx);
        free(sw);
        return NULL;
    }
    sw->fd = fd;
    tp_rxq_stamps(&sw->rx);   /* for queue_ns; without stamps it stays 0 */
    sw->max_slots = max_slots;
    sw->group_slots = group_slots ? group_slots : 64;
    sw->rng = 0x9e3779b97f4a7c15ull;
    sw->next_up = UINT64_MAX;
    sw->tx_gen = 1;   /* sets start at 0: none is referenced */
    pthread_mutex_init(&sw->mu, NULL);
    return sw;
}

static void job_release(job_t *j) {
    tp_mac_free(j->mac);
    tp_mac_free(j->up.mac);
    free(j->sets);
    free(j->values);
    free(j->nfreg);
    free(j->groups);
    memset(j, 0, sizeof *j);
}

void sml_switch_free(sml_switch *sw) {
    if (!sw) return;
    for (int i = 0; i < SML_MAX_JOBS; i++) job_release(&sw->jobs[i]);
    tp_rxq_free(&sw->rx);
    tp_txq_free(&sw->tx);
    free(sw->arena);
    pthread_mutex_destroy(&sw->mu);
    free(sw);
}

int sml_switch_add_job(sml_switch *sw, int job, uint32_t token, int nworkers, uint32_t nslots, uint32_t elems,
                       const uint8_t *key, int mac) {
    if (job < 0 || job >= SML_MAX_JOBS || nworkers < 1 || nworkers > SML_MAX_WORKERS || nslots < 1 ||
        nslots > SML_MAX_SLOTS || elems < 1 || elems > SML_MAX_ELEMS || (uint64_t)nslots * elems > SML_MAX_POOL_VALUES)
        return SML_ADD_ARG;
    job_t *j = calloc(1, sizeof *j);   /* built outside the lock, installed by a copy under it */
    if (!j) return SML_ADD_NOMEM;
    j->ngroups = (nslots + sw->group_slots - 1) / sw->group_slots;
    j->sets = calloc((size_t)nslots * 2, sizeof *j->sets);
    j->values = calloc((size_t)nslots * 2 * elems, 4);
    j->nfreg = calloc((size_t)nslots * 2 * elems, 1);
    j->groups = calloc(j->ngroups, sizeof *j->groups);
    if (key) j->mac = tp_mac_new(key, SML_MAC_LABEL, mac);
    if (!j->sets || !j->values || !j->nfreg || !j->groups || (key && !j->mac) ||
        RAND_bytes((unsigned char *)&j->seq, sizeof j->seq) != 1) {
        job_release(j);
        free(j);
        return SML_ADD_NOMEM;
    }
    j->token = token;
    j->nworkers = nworkers;
    j->nslots = nslots;
    j->elems = elems;
    j->active = 1;
    int rc = 0;
    pthread_mutex_lock(&sw->mu);
    if (sw->jobs[job].active) {
        rc = SML_ADD_IN_USE;
    } else if (sw->used_slots + nslots > sw->max_slots) {
        rc = SML_ADD_NO_SLOTS;
    } else {
        sw->jobs[job] = *j;
        sw->used_slots += nslots;
        memset(j, 0, sizeof *j);   /* the switch owns its buffers now */
    }
    pthread_mutex_unlock(&sw->mu);
    job_release(j);
    free(j);
    return rc;
}

int sml_switch_set_addr(sml_switch *sw, int job, int rank, uint32_t ipv4, uint16_t port) {
    int rc = -1;
    pthread_mutex_lock(&sw->mu);
    if (job >= 0 && job < SML_MAX_JOBS && sw->jobs[job].active && rank >= 0 && rank < sw->jobs[job].nworkers) {
        job_t *j = &sw->jobs[job];
        memset(&j->addrs[rank], 0, sizeof j->addrs[rank]);
        j->addrs[rank].sin_family = AF_INET;
        j->addrs[rank].sin_addr.s_addr = htonl(ipv4);
        j->addrs[rank].sin_port = htons(port);
        j->addr_mask |= 1ull << rank;
        rc = 0;
    }
    pthread_mutex_unlock(&sw->mu);
    return rc;
}

int sml_switch_set_parent(sml_switch *sw, int job, uint32_t ipv4, uint16_t port, int parent_job, int rank,
                          uint32_t token, const uint8_t *key, int mac_alg, double rto_ms, double rto_max_ms,
                          uint32_t tries) {
    /* written so that NaN fails every bound: a timer of 0 (or an infinite one, converted to anything) would
     * resend every waiting set on every pass of the data-plane loop */
    if (job < 0 || job >= SML_MAX_JOBS || parent_job < 0 || parent_job >= SML_MAX_JOBS || rank < 0 ||
        rank >= SML_MAX_WORKERS || !(rto_ms * 1000 >= SML_UP_RTO_MIN_US && rto_ms <= rto_max_ms &&
        rto_max_ms * 1000 >= SML_UP_RTO_FLOOR_US && rto_max_ms * 1000 <= SML_UP_RTO_MAX_US) || tries < 1 ||
        tries > SML_UP_MAX_TRIES)
        return -1;
    tp_mac *mac = key ? tp_mac_new(key, SML_MAC_LABEL, mac_alg) : NULL;
    if (key && !mac) return -1;
    int rc = -1;
    pthread_mutex_lock(&sw->mu);
    job_t *j = &sw->jobs[job];
    if (j->active && !j->up.active) {
        parent_t *up = &j->up;
        up->addr.sin_family = AF_INET;
        up->addr.sin_addr.s_addr = htonl(ipv4);
        up->addr.sin_port = htons(port);
        up->job = (uint8_t)parent_job;
        up->rank = (uint8_t)rank;
        up->token = token;
        up->mac = mac;
        tp_rtt_init(&up->rtt, (uint64_t)(rto_ms * 1e6), (uint64_t)(rto_max_ms * 1e6));
        up->tries = tries;
        up->waiting = 0;
        j->up_next = UINT64_MAX;
        up->active = 1;
        mac = NULL;
        rc = 0;
    }
    pthread_mutex_unlock(&sw->mu);
    tp_mac_free(mac);
    return rc;
}

int sml_switch_remove_job(sml_switch *sw, int job) {
    if (job < 0 || job >= SML_MAX_JOBS) return -1;
    job_t *j = malloc(sizeof *j);   /* taken out under the lock, freed outside it */
    if (!j) return -1;
    int rc = -1;
    pthread_mutex_lock(&sw->mu);
    if (sw->jobs[job].active) {
        sw->used_slots -= sw->jobs[job].nslots;
        *j = sw->jobs[job];
        memset(&sw->jobs[job], 0, sizeof sw->jobs[job]);
        rc = 0;
    }
    pthread_mutex_unlock(&sw->mu);
    if (rc == 0) job_release(j);
    free(j);
    return rc;
}

uint32_t sml_switch_free_slots(sml_switch *sw) {
    pthread_mutex_lock(&sw->mu);
    uint32_t n = sw->max_slots - sw->used_slots;
    pthread_mutex_unlock(&sw->mu);
    return n;
}

void sml_switch_set_sim(sml_switch *sw, double ingress, double egress, double duplicate, uint64_t seed) {
    pthread_mutex_lock(&sw->mu);
    sw->p_in = ingress;
    sw->p_out = egress;
    sw->p_dup = duplicate;
    sw->rng = seed ? seed : 0x9e3779b97f4a7c15ull;
    pthread_mutex_unlock(&sw->mu);
}

int sml_switch_job_counters(sml_switch *sw, int job, sml_counters *out) {
    int rc = -1;
    pthread_mutex_lock(&sw->mu);
    if (job >= 0 && job < SML_MAX_JOBS && sw->jobs[job].active) {
        *out = sw->jobs[job].c;
        rc = 0;
    }
    pthread_mutex_unlock(&sw->mu);
    return rc;
}

int sml_switch_group_counters(sml_switch *sw, int job, uint32_t group, sml_counters *out) {
    int rc = -1;
    pthread_mutex_lock(&sw->mu);
    if (job >= 0 && job < SML_MAX_JOBS && sw->jobs[job].active && group < sw->jobs[job].ngroups) {
        *out = sw->jobs[job].groups[group];
        rc = 0;
    }
    pthread_mutex_unlock(&sw->mu);
    return rc;
}

uint32_t sml_switch_groups(sml_switch *sw, int job) {
    pthread_mutex_lock(&sw->mu);
    uint32_t n = (job >= 0 && job < SML_MAX_JOBS && sw->jobs[job].active) ? sw->jobs[job].ngroups : 0;
    pthread_mutex_unlock(&sw->mu);
    return n;
}

void sml_switch_global_counters(sml_switch *sw, sml_global *out) {
    pthread_mutex_lock(&sw->mu);
    *out = sw->g;
    pthread_mutex_unlock(&sw->mu);
}

/* ---- the data plane ------------------------------------------------------------------------ */

/* Send what is queued (the end of a batch, or a full queue). Queued results are sent from their sets'
 * sums (build_result), so until then a set's sums must not change: settle(). */
static void send_queued(sml_switch *sw) {
    tp_txq_flush(&sw->tx);
    sw->arena_used = 0;
    sw->tx_gen++;
}

/* Before a set's sums change: the queued results sent from them go first (a new round of a set whose
 * result is still queued: only a rank out of step, or a test, can send one within a batch). */
static void settle(sml_switch *sw, const slot_set *s) {
    if (s->tx_gen == sw->tx_gen) send_queued(sw);
}

/* Room for a packet and its copies in the send queue, and len bytes of it in the arena; sends what is
 * queued when the batch state is full. */
static void make_room(sml_switch *sw, size_t len) {
    len = (len + 63) & ~(size_t)63;
    if (sw->arena_used + len > ARENA || sw->tx.cap - sw->tx.n < 2 * (SML_MAX_WORKERS + 1)) send_queued(sw);
}

/* len bytes of the arena, for a packet built by the switch (make_room first when it is queued with others). */
static uint8_t *take_buffer(sml_switch *sw, size_t len) {
    make_room(sw, len);
    uint8_t *p = sw->arena + sw->arena_used;
    sw->arena_used += (len + 63) & ~(size_t)63;
    return p;
}

/* How many copies of a packet go out: the drop simulator's egress losses (0) and duplicates (2). */
static int egress_copies(sml_switch *sw, sml_counters *jc, sml_counters *gc) {
    if (sw->p_out > 0 && rnd(sw) < sw->p_out) {
        jc->drop_sim_egress++;
        gc->drop_sim_egress++;
        return 0;
    }
    if (sw->p_dup > 0 && rnd(sw) < sw->p_dup) {
        jc->dup_sim++;
        gc->dup_sim++;
        return 2;
    }
    return 1;
}

/* A packet to send in three pieces: header and trailer copied into the queue, the payload referenced
 * (valid until the queue is sent). */
typedef struct {
    uint8_t hdr[SML_HDR_LEN];
    const uint8_t *payload;
    size_t plen, tlen;
    uint8_t trailer[SML_STAMP_LEN + SML_SEQ_LEN + SML_MAC_LEN];
} pkt_t;

static void emit_pkt(sml_switch *sw, const pkt_t *pk, const struct sockaddr_in *to, sml_counters *jc,
                     sml_counters *gc) {
    for (int k = egress_copies(sw, jc, gc); k > 0; k--) {
        tp_txq_add(&sw->tx, to, pk->hdr, SML_HDR_LEN, pk->payload, (uint32_t)pk->plen);
        tp_txq_trailer(&sw->tx, pk->trailer, (uint32_t)pk->tlen);
    }
}

/* A packet built whole in the arena. */
static void emit(sml_switch *sw, uint8_t *buf, size_t len, const struct sockaddr_in *to, sml_counters *jc,
                 sml_counters *gc) {
    for (int k = egress_copies(sw, jc, gc); k > 0; k--) tp_txq_add(&sw->tx, to, NULL, 0, buf, (uint32_t)len);
}

/* A sealed header (switchml.h) of a packet about (slot, set)'s round. */
static void header(uint8_t *h, uint8_t type, uint8_t flags, uint8_t job, uint8_t rank, const slot_set *s,
                   uint32_t slot, uint32_t set, uint32_t token) {
    h[0] = type;
    h[1] = flags;
    h[2] = job;
    h[3] = rank;
    tp_wr32(h + 4, sml_id_wire(s->pkt_id));
    tp_wr16(h + 8, (uint16_t)(slot | set << 15));
    h[10] = (uint8_t)s->exp;
    h[11] = 0;
    tp_wr32(h + 12, token);
    sml_seal(h);
}

/* A leaf's complete set goes up: the parent's DATA packet of rank up.rank, rebuilt from the set's state,
 * which does not change while it waits, so a resend is the identical packet (one nonce, one message). */
static void send_up(sml_switch *sw, job_t *j, const slot_set *s, uint32_t slot, uint32_t set) {
    const parent_t *up = &j->up;
    uint32_t elems = sml_size_elems(s->size, j->elems);
    size_t idx = (size_t)slot * 2 + set;
    uint8_t *p = take_buffer(sw, sml_pkt_max(j->elems));
    header(p, SML_DATA, (uint8_t)(s->size | (s->nf ? SML_F_NONFINITE : 0) | (up->mac ? SML_F_MAC : 0)), up->job,
           up->rank, s, slot, set, up->token);
    memcpy(p + SML_HDR_LEN, j->values + idx * 4 * j->elems, 4 * (size_t)elems);
    size_t len = SML_HDR_LEN + 4 * (size_t)elems;
    if (s->nf) {
        memcpy(p + len, j->nfreg + idx * j->elems, elems);
        len += elems;
    }
    if (up->mac) {
        uint8_t nonce[TP_NONCE_LEN];
        sml_nonce(nonce, SML_DATA, up->rank, s->pkt_id);
        sml_sign(up->mac, p, len, s->pkt_id, nonce);
        len += SML_MAC_LEN;
    }
    j->c.up_sent++;
    emit(sw, p, len, &up->addr, &j->c, &j->groups[slot / sw->group_slots]);
}

/* The result of (slot, set) in answer to the packet `in`: sent from the set's sums (they stay as they are until
 * the queue is sent: settle), or, with a flag region, from a copy of both (rare). make_room first. */
static void build_result(sml_switch *sw, job_t *j, slot_set *s, const uint8_t *vals, const uint8_t *nfr,
                         const uint8_t *in, pkt_t *pk) {
    uint32_t elems = sml_size_elems(s->size, j->elems);
    uint8_t *h = pk->hdr;
    memcpy(h, in, SML_HDR_LEN);   /* job, rank, packet id, pool index and token are echoed */
    h[0] = SML_RESULT;
    h[1] = (uint8_t)(s->size | (s->nf ? SML_F_NONFINITE : 0) | SML_F_STAMP | (j->mac ? SML_F_MAC : 0));
    h[10] = (uint8_t)s->exp;
    h[11] = 0;
    sml_seal(h);
    pk->plen = 4 * (size_t)elems;
    if (s->nf) {
        uint8_t *p = take_buffer(sw, pk->plen + elems);
        memcpy(p, vals, pk->plen);
        memcpy(p + pk->plen, nfr, elems);
        pk->payload = p;
        pk->plen += elems;
    } else {
        pk->payload = vals;
        s->tx_gen = sw->tx_gen;
    }
    uint8_t *t = pk->trailer;
    tp_wr32(t, s->queue_ns);
    tp_wr32(t + 4, s->proc_ns);
    pk->tlen = SML_STAMP_LEN;
    if (j->mac) {   /* a fresh seq per result built: its nonce (switchml.h) */
        uint8_t nonce[TP_NONCE_LEN];
        uint64_t seq = j->seq++;
        sml_nonce(nonce, SML_RESULT, 0, seq);
        tp_wr32(t + pk->tlen, (uint32_t)(seq >> 32));
        tp_wr32(t + pk->tlen + 4, (uint32_t)seq);
        pk->tlen += SML_SEQ_LEN;
        sml_sign_parts(j->mac, h, SML_HDR_LEN, pk->payload, pk->plen, t, pk->tlen, s->pkt_id, nonce, t + pk->tlen);
        pk->tlen += SML_MAC_LEN;
    }
}

/* A complete set's result to every worker of the job (software multicast), in answer to `in`. */
static void multicast(sml_switch *sw, job_t *j, slot_set *s, const uint8_t *vals, const uint8_t *nfr,
                      const uint8_t *in, sml_counters *gc) {
    pkt_t pk;
    make_room(sw, sml_pkt_max(j->elems));
    build_result(sw, j, s, vals, nfr, in, &pk);
    for (int r = 0; r < j->nworkers; r++) {
        j->c.results++;
        gc->results++;
        emit_pkt(sw, &pk, &j->addrs[r], &j->c, gc);
    }
}

static int parent_result(sml_switch *sw, job_t *j, const uint8_t *p, size_t len);

/* A leaf's set leaves UP_WAIT (its result, abandoned, or reused by a new round) for `to`. */
static void up_leave(job_t *j, slot_set *s, uint8_t to) {
    if (s->up == UP_WAIT && j->up.waiting) j->up.waiting--;
    s->up = to;
}

/* A RESULT from a leaf job's parent: offered to each job whose parent it comes from until one takes it
 * (a job registered with another's parent must not make the other's results its drops). */
static void from_parent(sml_switch *sw, const uint8_t *p, size_t len, const struct sockaddr_in *from) {
    int found = 0;
    for (int k = 0; k < SML_MAX_JOBS; k++) {
        job_t *j = &sw->jobs[k];
        if (j->active && j->up.active && j->up.job == p[2] && j->up.addr.sin_addr.s_addr == from->sin_addr.s_addr &&
            j->up.addr.sin_port == from->sin_port) {
            found = 1;
            if (parent_result(sw, j, p, len)) return;
        }
    }
    if (!found) sw->g.drop_type++;
}

/* Checked as a worker checks a result (switchml.h), it completes the waiting set with the job's sum,
 * which goes to the leaf's workers. 1: taken (or dropped by the simulator), 0: not this job's (counted). */
static int parent_result(sml_switch *sw, job_t *j, const uint8_t *p, size_t len) {
    parent_t *up = &j->up;
    unsigned flags = p[1], code = flags & SML_F_SIZE;
    uint32_t elems = sml_size_elems(code, j->elems);
    size_t body = SML_HDR_LEN + 4 * (size_t)elems + ((flags & SML_F_NONFINITE) ? elems : 0) + SML_STAMP_LEN;
    uint16_t pool = tp_rd16(p + 8);
    uint32_t slot = pool & 0x7fffu, set = pool >> 15;
    sml_counters *gc = &j->groups[(slot < j->nslots ? slot : 0) / sw->group_slots];
    if (!(flags & SML_F_STAMP) || len != body + (up->mac ? SML_SEQ_LEN + SML_MAC_LEN : 0) || (elems && elems != j->elems)) {
        j->c.drop_malformed++;
        gc->drop_malformed++;
        return 0;
    }
    uint64_t id = sml_id_near(tp_rd32(p + 4), j->newest);   /* the MAC covers all 64 bits */
    if (up->mac) {
        uint8_t nonce[TP_NONCE_LEN];
        sml_nonce(nonce, SML_RESULT, 0, (uint64_t)tp_rd32(p + body) << 32 | tp_rd32(p + body + 4));
        if (!(flags & SML_F_MAC) || !sml_signed(up->mac, p, body + SML_SEQ_LEN, id, nonce)) {
            j->c.drop_bad_mac++;
            gc->drop_bad_mac++;
            return 0;
        }
    }
    /* no rank check: a multicast result names the rank that completed the round, not this leaf */
    if (tp_rd32(p + 12) != up->token) { j->c.drop_token++; gc->drop_token++; return 0; }
    if (slot >= j->nslots) { j->c.drop_malformed++; gc->drop_malformed++; return 0; }
    if (sw->p_in > 0 && rnd(sw) < sw->p_in) { j->c.drop_sim_ingress++; gc->drop_sim_ingress++; return 1; }
    size_t idx = (size_t)slot * 2 + set;
    slot_set *s = &j->sets[idx];
    if (s->up != UP_WAIT || s->pkt_id != id || code != s->size) {   /* a duplicate, or of a round gone */
        j->c.drop_late++;
        gc->drop_late++;
        return 0;
    }
    uint8_t *vals = j->values + idx * 4 * j->elems;
    uint8_t *nfr = j->nfreg + idx * j->elems;
    settle(sw, s);
    memcpy(vals, p + SML_HDR_LEN, 4 * (size_t)elems);
    s->exp = (int8_t)p[10];
    s->nf = (flags & SML_F_NONFINITE) != 0;
    if (s->nf) memcpy(nfr, p + SML_HDR_LEN + 4 * (size_t)elems, elems);
    s->queue_ns = tp_add_sat32(s->queue_ns, tp_rd32(p + body - SML_STAMP_LEN));   /* the parent's share too */
    s->proc_ns = tp_add_sat32(s->proc_ns, tp_rd32(p + body - 4));
    tp_rtt_answer(&up->rtt, s->up_sent, s->up_resent, tp_now_ns(), up->waiting);
    up_leave(j, s, 0);
    j->c.up_results++;
    uint8_t in[SML_HDR_LEN];   /* what the leaf's result echoes: its own job, token and round */
    header(in, SML_DATA, 0, (uint8_t)(j - sw->jobs), 0, s, slot, set, j->token);
    multicast(sw, j, s, vals, nfr, in, gc);
    return 1;
}

#define UP_SCAN_NS 1000000   /* a job's waiting sets are scanned at most once per ms (a scan is 2 x its slots) */

/* Resend the partial sums whose parent's result is overdue (identical packets), each on a doubled timer,
 * `tries` times at most: then the set is abandoned (its workers time out, naming the parent). Only the
 * jobs with a set due are scanned. */
static void resend_up(sml_switch *sw, uint64_t now) {
    uint64_t next_up = UINT64_MAX;
    for (int k = 0; k < SML_MAX_JOBS; k++) {
        job_t *j = &sw->jobs[k];
        if (!j->active || !j->up.active) continue;
        if (j->up_next <= now) {
            uint64_t next = UINT64_MAX;
            for (uint32_t i = 0; i < 2 * j->nslots; i++) {
                slot_set *s = &j->sets[i];
                if (s->up != UP_WAIT) continue;
                if (s->up_deadline <= now) {
                    if (s->up_tries >= j->up.tries) {
                        up_leave(j, s, UP_ABANDONED);
                        j->c.up_abandoned++;
                        continue;
                    }
                    s->up_tries++;
                    s->up_rto = s->up_rto < j->up.rtt.max / 2 ? s->up_rto * 2 : j->up.rtt.max;
                    tp_rtt_backoff(&j->up.rtt, s->up_sent, now);
                    s->up_resent = now;
                    s->up_deadline = now + s->up_rto;
                    j->c.up_resends++;
                    send_up(sw, j, s, i / 2, i % 2);
                }
                if (s->up_deadline < next) next = s->up_deadline;
            }
            j->up_next = next == UINT64_MAX ? next : next > now + UP_SCAN_NS ? next : now + UP_SCAN_NS;
        }
        if (j->up_next < next_up) next_up = j->up_next;
    }
    sw->next_up = next_up;
}

static void nack(sml_switch *sw, const uint8_t *in, const struct sockaddr_in *from) {
    static sml_counters sink_j, sink_g;  /* NACKs belong to no job; the simulator still applies */
    uint8_t *p = take_buffer(sw, SML_HDR_LEN);
    memcpy(p, in, SML_HDR_LEN);
    p[0] = SML_NACK;
    p[1] = 0;
    p[11] = SML_NACK_UNKNOWN_JOB;
    sml_seal(p);
    sw->g.nacks++;
    emit(sw, p, SML_HDR_LEN, from, &sink_j, &sink_g);
}

/* queue_ns: how long the packet waited (kernel arrival -> now), t_in: its processing's start
 * (tp_now_ns), both for the stamp of its round. */
static void process(sml_switch *sw, const uint8_t *p, size_t len, const struct sockaddr_in *from, uint64_t queue_ns,
                    uint64_t t_in) {
    sml_global *g = &sw->g;
    if (len < SML_HDR_LEN) { g->drop_short++; return; }
    if (!sml_sealed(p)) { g->drop_checksum++; return; }
    if (p[0] == SML_RESULT) { from_parent(sw, p, len, from); return; }
    if (p[0] != SML_DATA) { g->drop_type++; return; }
    unsigned flags = p[1], code = flags & SML_F_SIZE;
    int has_nf = (flags & SML_F_NONFINITE) != 0, has_mac = (flags & SML_F_MAC) != 0;
    job_t *j = &sw->jobs[p[2]];
    uint32_t elems = sml_size_elems(code, j->elems);   /* an unknown job's size is unknown: NACKed below */
    size_t body = SML_HDR_LEN + (size_t)elems * (has_nf ? 5 : 4);
    if ((flags & ~15u) || ((j->active || code != SML_SIZE_JOB) && len != body + (has_mac ? SML_MAC_LEN : 0))) {
        g->drop_short++;
        return;
    }
    if (!j->active) {
        g->drop_unknown_job++;
        nack(sw, p, from);
        return;
    }
    unsigned rank = p[3];
    uint16_t pool = tp_rd16(p + 8);
    uint32_t slot = pool & 0x7fffu, set = pool >> 15;
    sml_counters *gc = &j->groups[(slot < j->nslots ? slot : 0) / sw->group_slots];
    /* first the MAC: nothing of an unauthenticated packet is believed, not even its rank */
    uint64_t pkt_id = sml_id_near(tp_rd32(p + 4), j->newest);   /* the MAC covers all 64 bits */
    if (j->mac) {
        uint8_t nonce[TP_NONCE_LEN];
        sml_nonce(nonce, SML_DATA, (uint8_t)rank, pkt_id);
        if (!has_mac || !sml_signed(j->mac, p, body, pkt_id, nonce)) {
            j->c.drop_bad_mac++;
            gc->drop_bad_mac++;
            return;
        }
    }
    if (tp_rd32(p + 12) != j->token) { j->c.drop_token++; gc->drop_token++; return; }
    if (rank >= (unsigned)j->nworkers || !(j->addr_mask >> rank & 1) ||
        j->addrs[rank].sin_addr.s_addr != from->sin_addr.s_addr || j->addrs[rank].sin_port != from->sin_port) {
        j->c.drop_sender++;
        gc->drop_sender++;
        return;
    }
    if (slot >= j->nslots || (elems && elems != j->elems)) { j->c.drop_malformed++; gc->drop_malformed++; return; }
    if (sw->p_in > 0 && rnd(sw) < sw->p_in) { j->c.drop_sim_ingress++; gc->drop_sim_ingress++; return; }
    j->c.pkts_recv++;
    gc->pkts_recv++;
    if ((int64_t)(pkt_id - j->newest) > 0) j->newest = pkt_id;
    uint64_t ms = (t_in - queue_ns) / 1000000;   /* arrival, on the processing clock */
    if (ms != j->ms_now) {
        if (j->ms_ranks) j->c.ranks_per_ms[__builtin_popcountll(j->ms_ranks)]++;
        j->ms_now = ms;
        j->ms_ranks = 0;
    }
    j->ms_ranks |= 1ull << rank;

    size_t idx = (size_t)slot * 2 + set;
    slot_set *s = &j->sets[idx];
    uint8_t *vals = j->values + idx * 4 * j->elems;
    uint8_t *nfr = j->nfreg + idx * j->elems;
    uint64_t bit = 1ull << rank, before = s->bitmap;
    const uint8_t *pl = p + SML_HDR_LEN;
    int8_t exp = (int8_t)p[10];

    /* which round of (slot, set) this packet belongs to: packet ids grow along a rank's stream and
     * every rank streams the same ids, so the id is the slot's version (SwitchML's set bit tells
     * only two rounds apart; a packet delayed past a whole round needs more) */
    int64_t age = (int64_t)(pkt_id - s->pkt_id);
    int fresh, first;
    if (before == 0 || (age > 0 && s->countdown == 0 && s->up != UP_WAIT)) {
        fresh = first = 1;              /* the set's first use, or the next round once it is done */
    } else if (age == 0) {
        fresh = !(before & bit);
        first = 0;
        if (fresh && code != s->size) {
            j->c.drop_malformed++;
            gc->drop_malformed++;
            return;
        }
    } else if (age < 0) {
        /* a late packet of an earlier round (reordered, or a retransmission overtaken by the
         * result): its round is over; never aggregated, never answered */
        j->c.drop_late++;
        gc->drop_late++;
        return;
    } else {
        /* a later round while this one is incomplete: ranks streaming different sequences */
        j->c.drop_malformed++;
        gc->drop_malformed++;
        return;
    }
    s->bitmap = (first ? 0 : before) | bit;
    if (fresh) {
        settle(sw, s);
        if (first) {  /* first contribution: overwrite (lazy clearing) */
            memcpy(vals, pl, 4 * (size_t)elems);
            s->exp = exp;
            s->size = (uint8_t)code;
            s->pkt_id = pkt_id;
            s->nf = (uint8_t)has_nf;
            if (has_nf) memcpy(nfr, pl + 4 * elems, elems);
            s->countdown = (uint32_t)j->nworkers - 1;
            s->queue_ns = s->proc_ns = 0;
            up_leave(j, s, 0);
        } else {  /* later contribution: int32 sum (wrapping), max exponent, OR of the flags */
            cl_be_add_be(vals, pl, elems);
            if (exp > s->exp) s->exp = exp;
            if (has_nf) {
                const uint8_t *r = pl + 4 * elems;
                if (!s->nf) memcpy(nfr, r, elems);
                else for (uint32_t i = 0; i < elems; i++) nfr[i] |= r[i];
                s->nf = 1;
            }
            s->countdown--;
        }
        j->c.aggregated++;
        gc->aggregated++;
        s->queue_ns = tp_add_sat32(s->queue_ns, queue_ns);
        s->proc_ns = tp_add_sat32(s->proc_ns, tp_now_ns() - t_in);
        if (s->countdown == 0 && j->up.active) {   /* a leaf's partial sum: up to the parent, then wait */
            s->up = UP_WAIT;
            j->up.waiting++;
            s->up_tries = 0;
            s->up_rto = j->up.rtt.rto;
            s->up_sent = t_in;
            s->up_resent = 0;
            s->up_deadline = t_in + s->up_rto;
            if (s->up_deadline < j->up_next) j->up_next = s->up_deadline;
            if (s->up_deadline < sw->next_up) sw->next_up = s->up_deadline;
            send_up(sw, j, s, slot, set);
        } else if (s->countdown == 0) {
            multicast(sw, j, s, vals, nfr, p, gc);
        }
    } else if (s->countdown == 0 && s->up == 0) {  /* retransmission to a complete slot: unicast replay */
        pkt_t pk;
        make_room(sw, sml_pkt_max(j->elems));
        build_result(sw, j, s, vals, nfr, p, &pk);
        j->c.replays++;
        gc->replays++;
        emit_pkt(sw, &pk, from, &j->c, gc);
    } else {  /* retransmission to an incomplete slot: its result comes on completion */
        j->c.drop_incomplete++;
        gc->drop_incomplete++;
    }
}

static long serve(sml_switch *sw, int max_ms);

/* Charges the CPU time since the last charge to the counters (under mu): at every idle moment as well
 * as at the end of a run, so a counters call sees a burst of work as soon as it is served, not
 * only when the run call that served it returns. */
static void charge_cpu(sml_switch *sw) {
    uint64_t now = tp_cpu_ns();
    sw->g.cpu_ns += now - sw->cpu_mark;
    sw->cpu_mark = now;
}

long sml_switch_run(sml_switch *sw, int max_ms) {
    uint64_t t0 = tp_now_ns();
    sw->cpu_mark = tp_cpu_ns();
    long handled = serve(sw, max_ms);
    uint64_t t1 = tp_now_ns();
    pthread_mutex_lock(&sw->mu);
    charge_cpu(sw);
    sw->g.run_ns += t1 - t0;
    pthread_mutex_unlock(&sw->mu);
    return handled;
}

static long serve(sml_switch *sw, int max_ms) {
    uint64_t deadline = tp_now_ns() + (uint64_t)(max_ms > 0 ? max_ms : 0) * 1000000u;
    long handled = 0;
    for (;;) {
        uint64_t t0 = tp_now_ns();
        int n = tp_rxq_recv(&sw->rx, 0);
        if (n < 0) {
            if (tp_icmp_error(n)) continue;  /* ICMP noise */
            return n;
        }
        if (n == 0 && sw->rx.nmsg == 0) {
            if (t0 >= sw->next_up) {   /* a leaf's partial sums whose parent's result is overdue */
                pthread_mutex_lock(&sw->mu);
                resend_up(sw, t0);
                send_queued(sw);
                pthread_mutex_unlock(&sw->mu);
                if (t0 >= deadline) return handled;   /* due timers never keep the caller from stopping it */
                continue;
            }
            if (t0 >= deadline) return handled;
            uint64_t until = deadline < sw->next_up ? deadline : sw->next_up;
            pthread_mutex_lock(&sw->mu);
            charge_cpu(sw);
            pthread_mutex_unlock(&sw->mu);
            struct pollfd pfd = {.fd = sw->fd, .events = POLLIN};
            int r = poll(&pfd, 1, (int)((until - t0 + 999999) / 1000000));
            uint64_t t1 = tp_now_ns();
            pthread_mutex_lock(&sw->mu);
            sw->g.idle_ns += t1 - t0;
            pthread_mutex_unlock(&sw->mu);
            if (r < 0 && errno != EINTR) return -errno;
            if (r <= 0 && t1 < sw->next_up) return handled;  /* timeout (or a signal): let the caller look around */
            continue;
        }
        size_t bytes = 0;
        for (int i = 0; i < n; i++) bytes += sw->rx.seg_len[i];
        size_t per_msg = sw->rx.nmsg ? bytes / (size_t)sw->rx.nmsg : 0;
        sw->rx.want = per_msg ? RX_BATCH_BYTES / per_msg : RX_BATCH;   /* the next call's, by this one's */
        if (sw->rx.want < 2) sw->rx.want = 2;
        pthread_mutex_lock(&sw->mu);
        sw->g.batches++;
        sw->g.pkts_recv += sw->rx.truncated;   /* larger than any packet */
        sw->g.drop_short += sw->rx.truncated;
        sw->rx.truncated = 0;
        for (int i = 0; i < n; i++) {
            const uint8_t *buf = sw->rx.seg[i];
            size_t l = sw->rx.seg_len[i];
            const struct sockaddr_in *from = tp_rxq_from(&sw->rx, i);
            sw->g.pkts_recv++;
            if (from->sin_family != AF_INET) {
                sw->g.drop_short++;
                continue;
            }
            handled++;
            job_t *j = l >= SML_HDR_LEN ? &sw->jobs[buf[2]] : NULL;
            uint64_t accepted = j && j->active ? j->c.pkts_recv : 0;
            uint64_t queued = tp_rxq_waited(&sw->rx, i), t_in = tp_now_ns();
            process(sw, buf, l, from, queued, t_in);
            if (j && j->active && j->c.pkts_recv > accepted) {   /* counted for its job: charge it the time */
                j->c.proc_ns += tp_now_ns() - t_in;
                j->c.queue_ns += queued;
            }
            if (sw->p_dup > 0 && rnd(sw) < sw->p_dup) {  /* the simulator's duplicate */
                if (l >= SML_HDR_LEN && sw->jobs[buf[2]].active) sw->jobs[buf[2]].c.dup_sim++;
                process(sw, buf, l, from, 0, tp_now_ns());
            }
        }
        if (tp_now_ns() >= sw->next_up) resend_up(sw, tp_now_ns());
        send_queued(sw);
        sw->g.pkts_sent = sw->tx.pkts_sent;
        sw->g.send_errors = sw->tx.errors;
        sw->g.gso_messages = sw->tx.gso_messages;
        uint64_t t1 = tp_now_ns();
        sw->g.busy_ns += t1 - t0;
        pthread_mutex_unlock(&sw->mu);
        if (t1 >= deadline) return handled;
    }
}
