/* OmniReduce aggregator: a purely reactive loop (no timers: workers drive recovery).
 *
 * Jobs are registered from Python (which also answers the control packets this loop hands
 * up); each job has nslots = its share of the columns, and every slot two tensor states
 * (sequence parity). A state accumulates its current round, then publishes it into one of
 * OMR_SETS shadow sets, which it may only overwrite once every worker acknowledged the round
 * held there; duplicates of published rounds are answered by replaying the missing results. */
#include "omnireduce_internal.h"

#include "kernels.h"

#include <stdio.h>

typedef struct {
    uint32_t round, block, next, len;     /* len: payload bytes, 0 for a zero block */
    uint32_t stamp[3];                    /* the round's contributions, queue ns, handling ns (omnireduce.h) */
    uint8_t flags, valid;
} omr_set;

typedef struct {
    uint32_t seq, round, block, published, min_next, acc_len;
    uint8_t used, finished, pending, acc_has, acc_flags;
    int expected, arrived;
    uint32_t queue_ns, proc_ns;           /* the current round's share of the aggregator (its stamp) */
    uint32_t *next, *ack;                 /* per worker */
    uint8_t *seen;
    uint64_t *asked;                      /* per worker: its last recovery request answered (answered_once) */
    uint8_t *acc, *data;                  /* accumulator, OMR_SETS finished results */
    omr_set sets[OMR_SETS];
} omr_state;

typedef struct {
    int used;
    uint32_t key;
    tp_mac *mac;                          /* the packets' MAC under the job key; NULL: none (a trusted fabric) */
    uint64_t counter;                     /* the next MAC's nonce counter (omnireduce.h) */
    int nworkers, ncols, naggs, index, block, nslots;
    size_t bbytes;
    double loss, dup;
    struct sockaddr_in *addr;
    uint8_t *has_addr;
    omr_state *states;                    /* nslots * 2 */
    uint32_t *nexts, *acks;
    uint8_t *seens, *accs, *datas;
    uint64_t *alive;                      /* per worker: when it last sent a valid packet (us) */
    uint64_t *askeds;                     /* states' `asked`s */
} omr_job;

#define OMR_CTRL_QUEUE 32
#define OMR_CTRL_MAX 4096

typedef struct {
    int len, port;
    char ip[64];
    uint8_t buf[OMR_CTRL_MAX];
} omr_ctrl;

/* a token bucket per control source (hashed address and port; sources that collide share one) */
#define OMR_CTRL_SOURCES 1024
typedef struct {
    uint32_t addr;
    uint16_t port;
    uint16_t tokens;
    uint64_t at;                          /* us of the last refill */
} omr_bucket;

struct omr_agg {
    int fd;
    uint64_t rng;
    omr_job jobs[OMR_MAX_JOBS];
    omr_sendq sq;
    tp_rxq rq;
    omr_ctrl ctrl[OMR_CTRL_QUEUE];
    int nctrl, ctrl_head;
    omr_bucket buckets[OMR_CTRL_SOURCES], all;   /* per source; all sources together */
    omr_astats st;
};

omr_agg *omr_agg_new(int fd, uint64_t seed) {
    omr_agg *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->fd = fd;
    a->rng = seed ? seed : 0xD1B54A32D192ED03ULL;
    if (omr_sendq_init(&a->sq, fd, 1, &a->rng) || omr_recvq_init(&a->rq, fd)) {
        omr_agg_free(a);
        return NULL;
    }
    tp_rxq_stamps(&a->rq);   /* for queue_ns; without stamps it stays 0 */
    return a;
}

static void free_job(omr_job *j) {
    tp_mac_free(j->mac);
    free(j->addr); free(j->has_addr); free(j->states);
    free(j->nexts); free(j->acks); free(j->seens); free(j->accs); free(j->datas); free(j->alive);
    free(j->askeds);
    memset(j, 0, sizeof *j);
}

void omr_agg_free(omr_agg *a) {
    if (!a) return;
    for (int i = 0; i < OMR_MAX_JOBS; i++)
        if (a->jobs[i].used) free_job(&a->jobs[i]);
    omr_sendq_free(&a->sq);
    tp_rxq_free(&a->rq);
    free(a);
}

/* this aggregator's slots of a job's columns (every naggs-th from agg_index) */
static size_t slots_of(int ncols, int naggs, int agg_index) {
    return agg_index < ncols ? ((size_t)ncols - agg_index + naggs - 1) / naggs : 0;
}

size_t omr_agg_job_bytes(int nworkers, int ncols, int naggs, int agg_index, int block) {
    size_t nst = slots_of(ncols, naggs, agg_index) * 2, nw = (size_t)nworkers, bbytes = (size_t)block * 4;
    return nw * (sizeof(struct sockaddr_in) + 1 + sizeof(uint64_t))             /* addr, has_addr, alive */
         + (nst ? nst : 1) * sizeof(omr_state)
         + (nst * nw + 1) * (sizeof(uint64_t) + 2 * sizeof(uint32_t) + 1)     /* askeds, nexts, acks, seens */
         + (nst * bbytes + 1) + (nst * OMR_SETS * bbytes + 1);                 /* accs, datas */
}

int omr_agg_add_job(omr_agg *a, uint32_t key, int nworkers, int ncols, int naggs, int agg_index, int block,
                    double loss, double dup, const uint8_t *mac_key, int mac) {
    if (nworkers < 1 || nworkers > OMR_MAX_WORKERS || ncols < 1 || naggs < 1 || agg_index < 0 ||
        agg_index >= naggs || block < 1 || block > OMR_MAX_BLOCK)
        return -1;
    int id = -1;
    for (int i = 0; i < OMR_MAX_JOBS && id < 0; i++)
        if (!a->jobs[i].used) id = i;
    if (id < 0) return -1;
    omr_job *j = &a->jobs[id];
    memset(j, 0, sizeof *j);
    j->key = key; j->nworkers = nworkers; j->ncols = ncols; j->naggs = naggs; j->index = agg_index;
    if (mac_key && (!(j->mac = tp_mac_new(mac_key, OMR_MAC_LABEL, mac)) || omr_random64(&j->counter))) {
        free_job(j);
        return -1;
    }
    j->block = block; j->bbytes = (size_t)block * 4; j->loss = loss; j->dup = dup;
    j->nslots = (int)slots_of(ncols, naggs, agg_index);
    size_t nst = (size_t)j->nslots * 2, nw = (size_t)nworkers;
    /* what omr_agg_job_bytes counts: a change here changes it too */
    j->addr = calloc(nw, sizeof *j->addr);
    j->has_addr = calloc(nw, 1);
    j->alive = calloc(nw, sizeof *j->alive);
    j->askeds = calloc(nst * nw + 1, sizeof *j->askeds);
    j->states = calloc(nst ? nst : 1, sizeof *j->states);
    j->nexts = calloc(nst * nw + 1, 4);
    j->acks = calloc(nst * nw + 1, 4);
    j->seens = calloc(nst * nw + 1, 1);
    j->accs = calloc(nst * j->bbytes + 1, 1);                  /* calloc: pages arrive on first use */
    j->datas = calloc(nst * OMR_SETS * j->bbytes + 1, 1);
    if (!j->addr || !j->has_addr || !j->alive || !j->askeds || !j->states || !j->nexts || !j->acks || !j->seens || !j->accs || !j->datas) {
        free_job(j);
        return -1;
    }
    for (size_t s = 0; s < nst; s++) {
        omr_state *S = &j->states[s];
        S->next = j->nexts + s * nw;
        S->ack = j->acks + s * nw;
        S->seen = j->seens + s * nw;
        S->asked = j->askeds + s * nw;
        S->acc = j->accs + s * j->bbytes;
        S->data = j->datas + s * OMR_SETS * j->bbytes;
    }
    j->used = 1;
    return id;
}

int omr_agg_set_worker(omr_agg *a, int job, int rank, const char *ip, int port) {
    if (job < 0 || job >= OMR_MAX_JOBS || !a->jobs[job].used || rank < 0 || rank >= a->jobs[job].nworkers) return -1;
    omr_job *j = &a->jobs[job];
    if (omr_parse_addr(ip, port, &j->addr[rank])) return -1;
    j->has_addr[rank] = 1;
    j->alive[rank] = tp_now_us();
    return 0;
}

void omr_agg_remove_job(omr_agg *a, int job) {
    if (job >= 0 && job < OMR_MAX_JOBS && a->jobs[job].used) free_job(&a->jobs[job]);
}

double omr_agg_job_idle_s(omr_agg *a, int job) {
    if (job < 0 || job >= OMR_MAX_JOBS || !a->jobs[job].used) return -1.0;
    omr_job *j = &a->jobs[job];
    uint64_t now = tp_now_us(), oldest = now;
    for (int w = 0; w < j->nworkers; w++)
        if (j->has_addr[w] && j->alive[w] < oldest) oldest = j->alive[w];
    return (double)(now - oldest) / 1e6;
}

void omr_agg_stats(omr_agg *a, omr_astats *st) {
    *st = a->st;
    st->pkts_sent = a->sq.q.pkts_sent;
    st->bytes_sent = a->sq.q.bytes_sent;
    st->sim_dropped = a->sq.sim_dropped;
    st->sim_duplicated = a->sq.sim_duplicated;
}

int omr_agg_pop_ctrl(omr_agg *a, uint8_t *buf, int cap, char *ip, int *port) {
    if (a->nctrl == 0) return -1;
    omr_ctrl *c = &a->ctrl[a->ctrl_head];
    a->ctrl_head = (a->ctrl_head + 1) % OMR_CTRL_QUEUE;
    a->nctrl--;
    int len = c->len < cap ? c->len : cap;
    memcpy(buf, c->buf, (size_t)len);
    memcpy(ip, c->ip, sizeof c->ip);
    *port = c->port;
    return len;
}

/* ---- the data path ---------------------------------------------------------------------- */

static void reset_state(omr_job *j, omr_state *S, uint32_t seq, uint32_t col) {
    size_t nw = (size_t)j->nworkers;
    memset(S->ack, 0, nw * 4);
    memset(S->seen, 0, nw);
    memset(S->asked, 0, nw * sizeof *S->asked);
    memset(S->sets, 0, sizeof S->sets);
    S->seq = seq;
    S->used = 1;
    S->round = 0;
    S->block = col;                       /* round 0: every worker sends the column's first block */
    S->published = 0;
    S->finished = S->pending = S->acc_has = 0;
    S->acc_len = 0;
    S->expected = j->nworkers;
    S->arrived = 0;
    S->queue_ns = S->proc_ns = 0;
}

/* trailer: what follows the payload (made once for a result every worker gets): the MAC, or a
 * result's stamp and MAC; tlen 0 for none */
static void send_to(omr_agg *a, omr_job *j, int rank, const omr_hdr *h, const void *payload, size_t len,
                    const uint8_t *trailer, uint32_t tlen) {
    if (!j->has_addr[rank]) return;
    a->sq.loss = j->loss;
    a->sq.dup = j->dup;
    omr_sendq_push_ready(&a->sq, &j->addr[rank], h, payload, len, trailer, tlen);
}

#define RESULT_TRAILER (OMR_STAMP_BYTES + OMR_MAC_BYTES)
_Static_assert(RESULT_TRAILER <= TP_MAX_TRAILER, "a result's stamp and MAC fit a send queue's trailer");

/* A finished round's header, checksummed; its stamp and (with a key) MAC in trailer, *tlen long. */
static omr_hdr result_hdr(int job_id, omr_job *j, omr_state *S, uint32_t col, uint32_t r, uint8_t *trailer,
                          uint32_t *tlen) {
    omr_set *set = &S->sets[r % OMR_SETS];
    const uint8_t *data = S->data + (size_t)(r % OMR_SETS) * j->bbytes;
    omr_hdr h = {OMR_RESULT, (uint8_t)(set->flags | OMR_F_STAMP | (j->mac ? OMR_F_MAC : 0)), (uint16_t)j->index,
                 (uint32_t)job_id, j->key, S->seq, col, r, set->block, set->next, 0, 0};
    for (int k = 0; k < 3; k++) memcpy(trailer + 4 * k, &set->stamp[k], 4);   /* little-endian hosts */
    h.csum = omr_csum2(&h, data, set->len, trailer, OMR_STAMP_BYTES);
    if (j->mac) omr_sign(j->mac, j->counter++, &h, data, set->len, trailer, OMR_STAMP_BYTES, trailer + OMR_STAMP_BYTES);
    *tlen = OMR_STAMP_BYTES + (j->mac ? OMR_MAC_BYTES : 0);
    return h;
}

/* Whether to answer worker w's recovery request for the column and tensor of state S (a PULL or a
 * resent DATA: results replayed, or a STATUS): on an authenticated job only one that is newer, by the
 * nonce counter it carries (omnireduce.h: a worker counts every packet it MACs), than the last one of
 * that worker answered there. A replayed (or network-duplicated) request then gets no answer, so a
 * sniffed PULL cannot make the aggregator send up to OMR_SETS results at a worker over and over; one
 * overtaken by a newer request of the same column is not answered either, and its worker asks again
 * at its next timeout. */
static int answered_once(const omr_job *j, omr_state *S, int w, const uint8_t *payload, size_t plen) {
    if (!j->mac) return 1;                /* no MACs (a trusted fabric): anyone may ask anyway */
    uint64_t counter;
    memcpy(&counter, payload + plen, sizeof counter);   /* little-endian hosts, as the MAC check reads it */
    /* kept as counter + 1, 0 for none yet: a counter of 2^64 - 1 (one start in 2^64) counts as none */
    if (S->asked[w] && (int64_t)(counter + 1 - S->asked[w]) <= 0) return 0;
    S->asked[w] = counter + 1;
    return 1;
}

/* unicast the published rounds [from, published) that `rank` lacks */
static void replay(omr_agg *a, int job_id, omr_job *j, omr_state *S, uint32_t col, int rank, uint32_t from) {
    uint32_t lo = S->published > OMR_SETS ? S->published - OMR_SETS : 0;
    if (from < lo) from = lo;             /* cannot happen: a set is only reused once everyone acked it */
    for (uint32_t r = from; r < S->published; r++) {
        omr_set *set = &S->sets[r % OMR_SETS];
        if (!set->valid || set->round != r) continue;
        uint8_t trailer[RESULT_TRAILER];
        uint32_t tlen;
        omr_hdr h = result_hdr(job_id, j, S, col, r, trailer, &tlen);
        send_to(a, j, rank, &h, S->data + (size_t)(r % OMR_SETS) * j->bbytes, set->len, trailer, tlen);
        a->st.replays++;
    }
}

static void send_status(omr_agg *a, int job_id, omr_job *j, omr_state *S, uint32_t col, int rank) {
    uint32_t first = OMR_INF, count = 0;
    uint8_t flags = 0;
    if (S->pending) {                     /* waiting for acknowledgements to free a set */
        flags = OMR_F_ACKWAIT;
        uint32_t need = S->round + 1 - OMR_SETS;
        for (int w = 0; w < j->nworkers; w++)
            if (S->ack[w] < need) { if (first == OMR_INF) first = (uint32_t)w; count++; }
    } else if (!S->finished) {            /* waiting for blocks */
        for (int w = 0; w < j->nworkers; w++) {
            int expected = S->round == 0 || S->next[w] == S->block;
            if (expected && !S->seen[w]) { if (first == OMR_INF) first = (uint32_t)w; count++; }
        }
    }
    omr_hdr h = {OMR_STATUS, (uint8_t)(flags | (j->mac ? OMR_F_MAC : 0)), (uint16_t)j->index, (uint32_t)job_id,
                 j->key, S->seq, col, S->round, S->block, count, first, 0};
    uint8_t mac[OMR_MAC_BYTES];
    h.csum = omr_hdr_csum(&h, NULL, 0);
    if (j->mac) omr_sign(j->mac, j->counter++, &h, NULL, 0, NULL, 0, mac);
    send_to(a, j, rank, &h, NULL, 0, mac, j->mac ? OMR_MAC_BYTES : 0);
    a->st.status_sent++;
}

static void try_publish(omr_agg *a, int job_id, omr_job *j, omr_state *S, uint32_t col) {
    uint32_t q = S->round;
    if (q >= OMR_SETS) {                  /* the set holds round q - OMR_SETS: has everyone got it? */
        uint32_t need = q + 1 - OMR_SETS;
        for (int w = 0; w < j->nworkers; w++)
            if (S->ack[w] < need) return;
    }
    omr_set *set = &S->sets[q % OMR_SETS];
    set->round = q;
    set->block = S->block;
    set->next = S->min_next;
    set->len = S->acc_has ? S->acc_len : 0;
    set->flags = (uint8_t)(S->acc_flags | (S->acc_has ? 0 : OMR_F_ZERO));
    set->valid = 1;
    set->stamp[0] = (uint32_t)S->arrived;
    set->stamp[1] = S->queue_ns;
    set->stamp[2] = S->proc_ns;
    uint8_t *data = S->data + (size_t)(q % OMR_SETS) * j->bbytes;
    if (set->len) memcpy(data, S->acc, set->len);
    uint8_t trailer[RESULT_TRAILER];
    uint32_t tlen;
    omr_hdr h = result_hdr(job_id, j, S, col, q, trailer, &tlen);
    for (int w = 0; w < j->nworkers; w++) send_to(a, j, w, &h, data, set->len, trailer, tlen);
    a->st.results_sent += (uint64_t)j->nworkers;
    a->st.rounds++;
    S->published = q + 1;
    S->pending = 0;
    if (S->min_next == OMR_INF) {
        S->finished = 1;
        return;
    }
    /* the next round: only the workers whose next is the minimum will send */
    S->round = q + 1;
    S->block = S->min_next;
    S->expected = 0;
    for (int w = 0; w < j->nworkers; w++) S->expected += S->next[w] == S->min_next;
    S->arrived = 0;
    S->queue_ns = S->proc_ns = 0;
    memset(S->seen, 0, (size_t)j->nworkers);
    S->acc_has = 0;
    S->acc_len = 0;
}

static void accumulate(omr_state *S, const uint8_t *payload, size_t len, int int32) {
    if (!S->acc_has) {
        memcpy(S->acc, payload, len);
        S->acc_has = 1;
        S->acc_len = (uint32_t)len;
        return;
    }
    if (int32) cl_add_i32((int32_t *)S->acc, payload, len / 4);   /* wraps like the switch's int32 adders */
    else cl_add_f32((float *)S->acc, payload, len / 4);
}

/* j: the job when it is known (the ERROR is then MAC'd if the job is keyed), else NULL */
static void refuse(omr_agg *a, const struct sockaddr_in *to, const omr_hdr *in, uint32_t code, omr_job *j) {
    omr_hdr h = {OMR_ERROR, 0, (uint16_t)(j ? j->index : 0), in->job, in->key, in->seq, in->col, in->round, in->block,
                 code, 0, 0};
    a->sq.loss = a->sq.dup = 0;
    omr_sendq_push(&a->sq, to, &h, NULL, 0, j ? j->mac : NULL, j ? &j->counter : NULL);
    a->st.refused++;
}

/* a token from b, refilled at `rate` a second up to `burst` */
static int take(omr_bucket *b, uint64_t now, uint64_t rate, uint16_t burst) {
    uint64_t earned = (now - b->at) * rate / 1000000u;
    if (earned || b->at == 0) {
        b->tokens = (uint16_t)(b->at == 0 || b->tokens + earned > burst ? burst : b->tokens + earned);
        b->at = now;
    }
    if (b->tokens == 0) return 0;
    b->tokens--;
    return 1;
}

/* Whether a control datagram may go to Python: it may be a JSON object, and its source has a token
 * (OMR_CTRL_RATE a second, bursts of OMR_CTRL_BURST), and so do all sources together (OMR_CTRL_ALL_RATE:
 * many ports). Nothing else of it is read here. */
static int ctrl_admit(omr_agg *a, const uint8_t *p, size_t len, const struct sockaddr_in *from, uint64_t now) {
    size_t end = len;
    while (end > 1 && (p[end - 1] == '\n' || p[end - 1] == '\r' || p[end - 1] == ' ')) end--;
    if (len > OMR_CTRL_MAX || end < 2 || p[end - 1] != '}') return 0;
    uint32_t addr = from->sin_addr.s_addr;
    uint16_t port = from->sin_port;
    uint64_t h = ((uint64_t)addr << 16 | port) * 0x9E3779B97F4A7C15ULL;
    omr_bucket *b = &a->buckets[h >> 54];   /* the top 10 bits: OMR_CTRL_SOURCES buckets */
    if (b->at == 0 || b->addr != addr || b->port != port) {
        b->addr = addr; b->port = port; b->tokens = OMR_CTRL_BURST; b->at = now;
    }
    return take(b, now, OMR_CTRL_RATE, OMR_CTRL_BURST) && take(&a->all, now, OMR_CTRL_ALL_RATE, OMR_CTRL_ALL_BURST);
}

/* A keepalive: the rank lives, if it is one of the job's (key and MAC as its data packets) and
 * recent (a replayed one holds a dead job for OMR_KEEPALIVE_WINDOW_S at most). No reply. */
static void keepalive(omr_agg *a, const omr_hdr *h, const uint8_t *payload, size_t plen, uint64_t now) {
    omr_job *j = h->job < OMR_MAX_JOBS ? &a->jobs[h->job] : NULL;
    int32_t age = (int32_t)((uint32_t)(tp_wall_ns() / 1000000000u) - h->seq);
    if (!j || !j->used || h->key != j->key || h->rank >= j->nworkers || plen != 0 ||
        age > OMR_KEEPALIVE_WINDOW_S || age < -OMR_KEEPALIVE_WINDOW_S) {
        a->st.bad_recv++;
        return;
    }
    if (j->mac && !omr_signed(j->mac, h, payload, plen)) {
        a->st.bad_mac++;
        return;
    }
    j->alive[h->rank] = now;
    a->st.keepalives_recv++;
}

/* queue_ns: how long packet i waited (kernel arrival -> now); t_in: its handling's start
 * (tp_now_ns); both go into its round's stamp if it contributes */
static void handle(omr_agg *a, int i, uint64_t now, uint64_t queue_ns, uint64_t t_in) {
    omr_hdr hb;
    const uint8_t *payload;
    size_t plen;
    a->st.pkts_recv++;
    a->st.bytes_recv += a->rq.seg_len[i];
    if (a->rq.seg_len[i] > 0 && a->rq.seg[i][0] == OMR_CONTROL) {   /* control: Python answers it */
        a->st.ctrl_recv++;
        if (a->nctrl == OMR_CTRL_QUEUE || !ctrl_admit(a, a->rq.seg[i], a->rq.seg_len[i], tp_rxq_from(&a->rq, i), now)) {
            a->st.ctrl_dropped++;         /* the sender retries */
            return;
        }
        omr_ctrl *c = &a->ctrl[(a->ctrl_head + a->nctrl) % OMR_CTRL_QUEUE];
        c->len = (int)a->rq.seg_len[i];
        memcpy(c->buf, a->rq.seg[i], (size_t)c->len);
        inet_ntop(AF_INET, &tp_rxq_from(&a->rq, i)->sin_addr, c->ip, sizeof c->ip);
        c->port = ntohs(tp_rxq_from(&a->rq, i)->sin_port);
        a->nctrl++;
        return;
    }
    const omr_hdr *h = omr_recvq_get(&a->rq, i, &hb, &payload, &plen);
    if (!h) {
        a->st.bad_recv++;
        return;
    }
    if (h->type == OMR_KEEPALIVE) return keepalive(a, h, payload, plen, now);
    if (h->type != OMR_DATA && h->type != OMR_ACK && h->type != OMR_PULL) {
        a->st.bad_recv++;
        return;
    }
    const struct sockaddr_in *from = tp_rxq_from(&a->rq, i);
    if (h->job >= OMR_MAX_JOBS || !a->jobs[h->job].used) return refuse(a, from, h, OMR_ERR_JOB, NULL);
    int job_id = (int)h->job;
    omr_job *j = &a->jobs[job_id];
    /* first the MAC: nothing of an unauthenticated packet is believed, and it gets no answer */
    if (j->mac && !omr_signed(j->mac, h, payload, plen)) {
        a->st.bad_mac++;
        return;
    }
    if (h->key != j->key) return refuse(a, from, h, OMR_ERR_KEY, j);
    uint32_t col = h->col, slot = col / (uint32_t)j->naggs;
    int w = h->rank;
    if (w >= j->nworkers || col % (uint32_t)j->naggs != (uint32_t)j->index || slot >= (uint32_t)j->nslots)
        return refuse(a, from, h, OMR_ERR_SLOT, j);
    j->alive[w] = now;
    omr_state *S = &j->states[slot * 2 + (h->seq & 1)];
    if (!S->used || S->seq != h->seq) {
        /* a tensor this state never saw: only a bootstrap data packet may start it, and only when
         * the state holds tensor seq-2 or older (a packet of seq proves everyone finished seq-2) */
        if (h->type != OMR_DATA || h->round != 0 || (S->used && (int32_t)(h->seq - S->seq) < 0)) {
            a->st.stale_recv++;
            return;
        }
        reset_state(j, S, h->seq, col);
    }
    if (h->ack > S->ack[w] && h->ack <= S->published) S->ack[w] = h->ack;

    if (h->type == OMR_DATA) {
        a->st.data_recv++;
        uint32_t q = h->round;
        int resent = (h->flags & OMR_F_RESEND) != 0;   /* network duplicates get no answer */
        if (q < S->published) {           /* it lacks round q (or is a duplicate): replay */
            a->st.dup_recv++;
            if (resent && answered_once(j, S, w, payload, plen)) replay(a, job_id, j, S, col, w, h->ack < q ? h->ack : q);
        } else if (q == S->round && !S->finished && !S->pending) {
            int expected = q == 0 || S->next[w] == S->block;
            int zero = (h->flags & OMR_F_ZERO) != 0, int32 = (h->flags & OMR_F_INT32) != 0;
            if (S->seen[w]) {
                a->st.dup_recv++;
                if (resent && answered_once(j, S, w, payload, plen)) send_status(a, job_id, j, S, col, w);
            } else if (!expected || h->block != S->block ||
                       (h->next != OMR_INF && (h->next <= h->block || (h->next - col) % (uint32_t)j->ncols)) ||
                       (zero ? plen != 0 : (plen == 0 || plen > j->bbytes || plen % 4 ||
                                            (S->acc_has && (plen != S->acc_len ||
                                                            (S->acc_flags & OMR_F_INT32) != (h->flags & OMR_F_INT32)))))) {
                a->st.bad_recv++;
            } else {
                if (!zero) {
                    if (!S->acc_has) S->acc_flags = (uint8_t)(h->flags & OMR_F_INT32);
                    accumulate(S, payload, plen, int32);
                } else if (!S->acc_has) {
                    S->acc_flags = (uint8_t)(h->flags & OMR_F_INT32);
                }
                S->next[w] = h->next;
                S->seen[w] = 1;
                S->queue_ns = tp_add_sat32(S->queue_ns, queue_ns);
                S->proc_ns = tp_add_sat32(S->proc_ns, tp_now_ns() - t_in);
                if (++S->arrived == S->expected) {
                    uint32_t m = OMR_INF;
                    for (int v = 0; v < j->nworkers; v++) m = S->next[v] < m ? S->next[v] : m;
                    S->min_next = m;
                    S->pending = 1;
                }
            }
        } else if (q == S->round && S->pending) {
            a->st.dup_recv++;
            if (resent && answered_once(j, S, w, payload, plen)) send_status(a, job_id, j, S, col, w);
        } else {
            a->st.stale_recv++;
        }
    } else if (h->type == OMR_PULL) {
        a->st.pulls_recv++;
        if (!answered_once(j, S, w, payload, plen)) a->st.dup_recv++;
        else if (h->ack < S->published) replay(a, job_id, j, S, col, w, h->ack);
        else send_status(a, job_id, j, S, col, w);
    } else {
        a->st.acks_recv++;
    }
    if (S->pending) try_publish(a, job_id, j, S, col);
}

static int serve(omr_agg *a, int timeout_ms) {
    uint64_t deadline = tp_now_us() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000u;
    for (;;) {
        omr_sendq_flush(&a->sq);
        if (a->nctrl > 0) return a->nctrl;
        uint64_t now = tp_now_us();
        if (now >= deadline) return 0;
        int k = omr_recvq_recv(&a->rq, (int)((deadline - now + 999) / 1000));
        if (k < 0) return k;
        now = tp_now_us();
        for (int i = 0; i < k; i++) {   /* its share of each packet's round, for the latency breakdown */
            uint64_t queued = tp_rxq_waited(&a->rq, i), t = tp_now_ns();
            handle(a, i, now, queued, t);
            a->st.proc_ns += tp_now_ns() - t;
            a->st.queue_ns += queued;
        }
    }
}

int omr_agg_run(omr_agg *a, int timeout_ms) {
    uint64_t cpu0 = tp_cpu_ns();
    int rc = serve(a, timeout_ms);
    a->st.cpu_ns += tp_cpu_ns() - cpu0;
    return rc;
}
