/* OmniReduce worker: one call per tensor (GIL released) runs every column's chain to its end.
 *
 * Per column: `count` results received so far (they arrive in round order; a gap makes us pull),
 * `expect` the block of the next result, `own` the worker's own next non-zero block (what it
 * last announced), and what it last sent (for the retransmission timer). */
#include "omnireduce_internal.h"

#include <stdio.h>

#define OMR_RTO_MAX 1000000u          /* us: the longest a column waits before resending */

struct omr_worker {
    int fd, rank, nworkers, ncols, naggs, block, retransmit_us;
    double loss, dup;
    uint64_t rng;
    tp_rtt rtt;                           /* round-trip estimate over data packets (us), kept across tensors */
    struct sockaddr_in *agg_addr;
    uint32_t *job, *key;
    uint8_t *agg_set;
    tp_mac **mac;                         /* per aggregator: the MAC under its job key, or NULL (no MACs) */
    uint64_t counter;                     /* the next MAC's nonce counter (omnireduce.h) */
    omr_sendq sq;
    tp_rxq rq;
};

typedef struct {
    uint32_t count, expect, own, sent_block, sent_next;
    uint8_t contributed, done, ackwait, backoff;
    int32_t wait_rank;
    uint32_t nwaiting;
    uint64_t last_act, last_pull, sent_at;    /* sent_at: 0 once resent (Karn: no RTT sample) */
    uint64_t round_start;                     /* the previous result (or the bootstrap send), us */
} omr_col;

omr_worker *omr_worker_new(int fd, int rank, int nworkers, int ncols, int naggs, int block,
                           int retransmit_us, double loss, double dup, uint64_t seed) {
    if (nworkers < 1 || nworkers > OMR_MAX_WORKERS || rank < 0 || rank >= nworkers || ncols < 1 || naggs < 1 ||
        block < 1 || block > OMR_MAX_BLOCK || retransmit_us < 100)
        return NULL;
    omr_worker *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->fd = fd; w->rank = rank; w->nworkers = nworkers; w->ncols = ncols; w->naggs = naggs;
    w->block = block; w->retransmit_us = retransmit_us; w->loss = loss; w->dup = dup;
    w->rng = seed ? seed : 0x9E3779B97F4A7C15ULL;
    /* the timer: srtt + max(4 rttvar, srtt / 2), at least the configured one, so that a worker slowed down by its
     * host does not flood the aggregators with resends */
    tp_rtt_init(&w->rtt, (uint64_t)retransmit_us, OMR_RTO_MAX);
    w->agg_addr = calloc((size_t)naggs, sizeof *w->agg_addr);
    w->job = calloc((size_t)naggs, sizeof *w->job);
    w->key = calloc((size_t)naggs, sizeof *w->key);
    w->agg_set = calloc((size_t)naggs, 1);
    w->mac = calloc((size_t)naggs, sizeof *w->mac);
    if (!w->agg_addr || !w->job || !w->key || !w->agg_set || !w->mac || omr_random64(&w->counter) ||
        omr_sendq_init(&w->sq, fd, 0, &w->rng) || omr_recvq_init(&w->rq, fd)) {
        omr_worker_free(w);
        return NULL;
    }
    w->sq.loss = loss;
    w->sq.dup = dup;
    return w;
}

int omr_worker_set_agg(omr_worker *w, int index, const char *ip, int port, uint32_t job, uint32_t key,
                       const uint8_t *mac_key, int mac_alg) {
    if (index < 0 || index >= w->naggs || omr_parse_addr(ip, port, &w->agg_addr[index])) return -1;
    tp_mac *mac = mac_key ? tp_mac_new(mac_key, OMR_MAC_LABEL, mac_alg) : NULL;
    if (mac_key && !mac) return -1;
    tp_mac_free(w->mac[index]);
    w->mac[index] = mac;
    w->job[index] = job;
    w->key[index] = key;
    w->agg_set[index] = 1;
    return 0;
}

void omr_worker_free(omr_worker *w) {
    if (!w) return;
    omr_sendq_free(&w->sq);
    tp_rxq_free(&w->rq);
    for (int a = 0; w->mac && a < w->naggs; a++) tp_mac_free(w->mac[a]);
    free(w->agg_addr); free(w->job); free(w->key); free(w->agg_set); free(w->mac);
    free(w);
}

/* the worker's next non-zero block after b in b's column, or OMR_INF */
static inline uint32_t next_nonzero(const uint8_t *mask, size_t nb, size_t b, size_t ncols) {
    for (b += ncols; b < nb; b += ncols)
        if (mask[b]) return (uint32_t)b;
    return OMR_INF;
}

typedef struct {
    omr_worker *w;
    uint32_t seq;
    const uint8_t *in;
    size_t n, nb, ncols, block;           /* block: this tensor's elements per block (<= the job's) */
    int dtype;
    omr_wstats *st;
} omr_call;

/* payload bytes of block b (the last one may be short) */
static inline size_t block_bytes(const omr_call *c, size_t b) {
    size_t start = b * c->block;
    return (c->n - start < c->block ? c->n - start : c->block) * 4;
}

static void send_data(omr_call *c, uint32_t col, uint32_t round, uint32_t block, uint32_t next, int zero, int resend) {
    omr_worker *w = c->w;
    int a = (int)(col % (uint32_t)w->naggs);
    size_t start = (size_t)block * c->block;
    size_t len = zero ? 0 : block_bytes(c, block);
    omr_hdr h = {OMR_DATA, (uint8_t)((c->dtype == OMR_INT32 ? OMR_F_INT32 : 0) | (zero ? OMR_F_ZERO : 0) |
                                     (resend ? OMR_F_RESEND : 0)),
                 (uint16_t)w->rank, w->job[a], w->key[a], c->seq, col, round, block, next, round, 0};
    omr_sendq_push(&w->sq, &w->agg_addr[a], &h, c->in + start * 4, len, w->mac[a], &w->counter);
    c->st->data_sent++;
}

static void send_header(omr_call *c, int type, uint32_t col, uint32_t ack) {
    omr_worker *w = c->w;
    int a = (int)(col % (uint32_t)w->naggs);
    omr_hdr h = {(uint8_t)type, 0, (uint16_t)w->rank, w->job[a], w->key[a], c->seq, col, ack, 0, 0, ack, 0};
    omr_sendq_push(&w->sq, &w->agg_addr[a], &h, NULL, 0, w->mac[a], &w->counter);
    if (type == OMR_ACK) c->st->acks_sent++;
    else c->st->pulls_sent++;
}

int omr_worker_allreduce(omr_worker *w, uint32_t seq, const void *in, void *out, size_t n, int dtype, int block,
                         const uint8_t *mask, double timeout_s, omr_wstats *st) {
    uint64_t cpu0 = tp_cpu_ns();
    memset(st, 0, sizeof *st);
    st->err_agg = st->err_rank = st->err_col = -1;
    if (block == 0) block = w->block;
    if (block < 1 || block > w->block) return OMR_EARG;    /* the aggregators' slots hold the job's block */
    if (n == 0) return OMR_OK;
    size_t nb = (n + (size_t)block - 1) / (size_t)block;
    if (nb >= OMR_INF || (dtype != OMR_FLOAT32 && dtype != OMR_INT32)) return OMR_EARG;
    for (int a = 0; a < w->naggs; a++)
        if (!w->agg_set[a]) return OMR_EARG;
    size_t ncols = nb < (size_t)w->ncols ? nb : (size_t)w->ncols;
    omr_col *cols = calloc(ncols, sizeof *cols);
    uint64_t *heard = calloc((size_t)w->naggs, sizeof *heard);
    if (!cols || !heard) {
        free(cols); free(heard);
        return OMR_ENOMEM;
    }
    omr_call c = {w, seq, (const uint8_t *)in, n, nb, ncols, (size_t)block, dtype, st};
    uint8_t *outb = (uint8_t *)out;
    const uint64_t timeout_us = (uint64_t)(timeout_s * 1e6);
    const uint64_t scan_us = w->retransmit_us / 4 > 1000 ? (uint64_t)w->retransmit_us / 4 : 1000u;
    const uint8_t want_flags = dtype == OMR_INT32 ? OMR_F_INT32 : 0;
    uint64_t sent0 = w->sq.q.pkts_sent, bytes0 = w->sq.q.bytes_sent, drop0 = w->sq.sim_dropped, dupl0 = w->sq.sim_duplicated;
    uint64_t now = tp_now_us(), last_progress = now, next_scan = now + scan_us, last_resend_scan = now;
    size_t cols_left = ncols;
    int rc = OMR_OK;
    int unsigned_error = 0, unsigned_agg = -1;   /* an ERROR without a MAC: see below */
    int32_t unsigned_col = -1, unsigned_code = 0;

    st->nblocks = nb;
    st->ncols = ncols;
    for (size_t b = 0; b < nb; b++) st->own_blocks += mask[b];
    for (int a = 0; a < w->naggs; a++) heard[a] = now;

    /* bootstrap: every column's first block (header only when zero) with our next non-zero block */
    for (size_t j = 0; j < ncols; j++) {
        omr_col *col = &cols[j];
        col->own = next_nonzero(mask, nb, j, ncols);
        col->sent_block = (uint32_t)j;
        col->sent_next = col->own;
        col->contributed = 1;
        col->wait_rank = -1;
        col->last_act = col->sent_at = col->round_start = now;
        col->backoff = 1;
        send_data(&c, (uint32_t)j, 0, (uint32_t)j, col->own, !mask[j], 0);
    }

    while (cols_left > 0) {
        omr_sendq_flush(&w->sq);
        now = tp_now_us();
        int wait_ms = next_scan > now ? (int)((next_scan - now + 999) / 1000) : 0;
        int k = omr_recvq_recv(&w->rq, wait_ms);
        if (k < 0) {
            st->err_code = -k;
            rc = OMR_ESYS;
            break;
        }
        now = tp_now_us();
        for (int i = 0; i < k; i++) {
            omr_hdr hb;
            const uint8_t *payload;
            size_t plen;
            const omr_hdr *h = omr_recvq_get(&w->rq, i, &hb, &payload, &plen);
            st->pkts_recv++;
            st->bytes_recv += w->rq.seg_len[i];
            int a = h ? (int)(h->col % (uint32_t)w->naggs) : 0;
            if (!h || (h->type != OMR_RESULT && h->type != OMR_STATUS && h->type != OMR_ERROR) ||
                h->job != w->job[a] || h->key != w->key[a]) {
                st->bad_recv++;                   /* corrupt, foreign, or a late registration reply */
                st->extra_recv_bytes += w->rq.seg_len[i];
                continue;
            }
            if (w->mac[a] && !omr_signed(w->mac[a], h, payload, plen)) {
                st->bad_mac++;
                st->extra_recv_bytes += w->rq.seg_len[i];
                if (h->type == OMR_ERROR && h->seq == seq && h->col < ncols) {
                    /* an ERROR without a MAC: the aggregator lost the job (or anyone forged it);
                     * told only if nothing else happens before the timeout */
                    unsigned_error = 1;
                    unsigned_agg = a;
                    unsigned_col = (int32_t)h->col;
                    unsigned_code = (int32_t)h->next;
                }
                continue;
            }
            if (h->seq != seq || h->col >= ncols) {
                st->dup_recv++;               /* late packets of an earlier tensor */
                st->extra_recv_bytes += w->rq.seg_len[i];
                continue;
            }
            heard[a] = now;
            omr_col *col = &cols[h->col];
            if (h->type == OMR_ERROR) {
                st->err_agg = a;
                st->err_col = (int32_t)h->col;
                st->err_code = (int32_t)h->next;
                rc = OMR_EREFUSED;
                goto finish;
            }
            if (h->type == OMR_STATUS) {
                st->status_recv++;
                st->extra_recv_bytes += w->rq.seg_len[i];
                col->wait_rank = (int32_t)h->ack;
                col->nwaiting = h->next;
                col->ackwait = (h->flags & OMR_F_ACKWAIT) != 0;
                continue;
            }
            /* a result: its stamp (the aggregator's share of the round) trails the block */
            uint32_t stamp[3] = {0, 0, 0};
            if (h->type == OMR_RESULT && (h->flags & OMR_F_STAMP)) {
                if (plen < OMR_STAMP_BYTES) {
                    st->bad_recv++;
                    st->extra_recv_bytes += w->rq.seg_len[i];
                    continue;
                }
                plen -= OMR_STAMP_BYTES;
                memcpy(stamp, payload + plen, OMR_STAMP_BYTES);   /* little-endian hosts */
            }
            if (col->done || h->round < col->count) {
                st->dup_recv++;
                st->extra_recv_bytes += w->rq.seg_len[i];
                continue;
            }
            if (h->round > col->count) {          /* we missed one: ask for it now (rate-limited) */
                st->ooo_recv++;
                st->extra_recv_bytes += w->rq.seg_len[i];
                if (now - col->last_pull >= w->rtt.rto / 4) {
                    col->last_pull = now;
                    send_header(&c, OMR_PULL, h->col, col->count);
                    st->resend_bytes += sizeof(omr_hdr);
                }
                continue;
            }
            uint32_t expect = col->count == 0 ? h->col : col->expect;
            size_t start = (size_t)h->block * c.block;
            size_t blen = h->block < nb ? block_bytes(&c, h->block) : 0;
            int zero = (h->flags & OMR_F_ZERO) != 0;
            if (h->block != expect || (h->flags & OMR_F_INT32) != want_flags || (!zero && plen != blen) ||
                (zero && plen != 0) || (h->next != OMR_INF && h->next > col->own)) {
                st->bad_recv++;
                st->err_agg = a;
                st->err_col = (int32_t)h->col;
                rc = OMR_EPROTO;
                goto finish;
            }
            if (!zero) {
                memcpy(outb + start * 4, payload, blen);
                st->union_blocks++;
            }
            if (col->contributed && col->sent_at && col->count > 0) tp_rtt_sample(&w->rtt, now - col->sent_at, 1);  /* round 0 also waits for the slowest rank to start */
            st->results_recv++;
            st->server_packets += stamp[0];
            st->server_queue_ns += stamp[1];
            st->server_proc_ns += stamp[2];
            st->round_ns += (now - col->round_start) * 1000u;
            col->round_start = now;
            col->count++;
            col->contributed = 0;
            col->wait_rank = -1;
            col->backoff = 1;
            col->last_act = now;
            last_progress = now;
            unsigned_error = 0;
            if (h->next == OMR_INF) {
                col->done = 1;
                cols_left--;
                continue;
            }
            col->expect = h->next;
            if (h->next == col->own) {             /* our block is the next one: send it */
                uint32_t b = col->own;
                col->own = next_nonzero(mask, nb, b, ncols);
                col->sent_block = b;
                col->sent_next = col->own;
                col->contributed = 1;
                col->sent_at = now;
                send_data(&c, h->col, col->count, b, col->own, 0, 0);
            } else if (col->count % (OMR_SETS / 2) == 0) {
                send_header(&c, OMR_ACK, h->col, col->count);   /* silent: free the aggregator's sets */
            }
        }
        if (now < next_scan) continue;
        next_scan = now + scan_us;
        if (now - last_progress > timeout_us) {
            rc = OMR_ETIMEOUT;
            break;
        }
        /* timers only once we have read what is waiting (a backlog is not a loss) */
        if (w->rq.nmsg == OMR_RECV_MSGS && now - last_resend_scan < 1000000u) continue;
        last_resend_scan = now;
        uint64_t rto = w->rtt.rto;
        for (size_t j = 0; j < ncols; j++) {
            omr_col *col = &cols[j];
            uint64_t timer = rto * col->backoff < OMR_RTO_MAX ? rto * col->backoff : OMR_RTO_MAX;
            if (col->done || now - col->last_act < timer) continue;
            if (col->contributed) {
                int zero = !mask[col->sent_block];
                send_data(&c, (uint32_t)j, col->count, col->sent_block, col->sent_next, zero, 1);
                st->data_sent--;
                st->resend_bytes += sizeof(omr_hdr) + (zero ? 0 : block_bytes(&c, col->sent_block));
                col->sent_at = 0;
            } else {
                send_header(&c, OMR_PULL, (uint32_t)j, col->count);
                st->resend_bytes += sizeof(omr_hdr);
            }
            st->resends++;
            col->last_act = now;
            if (col->backoff < 32) col->backoff *= 2;
        }
    }

finish:
    omr_sendq_flush(&w->sq);
    st->cols_left = (uint32_t)cols_left;
    if (rc == OMR_ETIMEOUT && unsigned_error) {
        st->err_agg = unsigned_agg;
        st->err_col = unsigned_col;
        st->err_code = unsigned_code;
        rc = OMR_EREFUSED;
    }
    if (rc == OMR_ETIMEOUT) {
        /* explain: an aggregator that went silent, else the rank an aggregator waits for */
        now = tp_now_us();
        for (size_t j = 0; j < ncols && st->err_agg < 0; j++) {
            int a = (int)(j % (size_t)w->naggs);
            if (!cols[j].done && now - heard[a] > timeout_us / 2) {
                st->err_agg = a;
                st->err_col = (int32_t)j;
                st->agg_silent_s = (double)(now - heard[a]) / 1e6;
            }
        }
        for (size_t j = 0; j < ncols && st->err_agg < 0; j++) {
            if (!cols[j].done && cols[j].wait_rank >= 0) {
                st->err_agg = (int32_t)(j % (size_t)w->naggs);
                st->err_col = (int32_t)j;
                st->err_rank = cols[j].wait_rank;
                st->err_nwaiting = cols[j].nwaiting;
                st->err_code = cols[j].ackwait;
            }
        }
        for (size_t j = 0; j < ncols && st->err_col < 0; j++)
            if (!cols[j].done) st->err_col = (int32_t)j;
    }
    st->srtt_us = (double)w->rtt.srtt;
    st->rto_us = (double)w->rtt.rto;
    st->pkts_sent = w->sq.q.pkts_sent - sent0;
    st->bytes_sent = w->sq.q.bytes_sent - bytes0;
    st->sim_dropped = w->sq.sim_dropped - drop0;
    st->sim_duplicated = w->sq.sim_duplicated - dupl0;
    free(cols);
    free(heard);
    st->cpu_ns = tp_cpu_ns() - cpu0;
    return rc;
}
