/* The worker's streaming loop: one call per tensor, the GIL released (cffi API mode).
 *
 * A tensor of B blocks (one block = one packet of `elems` values) is streamed over
 * wc = min(inflight, B) chains (inflight: the window unless set lower, sml_worker_set_inflight);
 * chain c owns slot (shift + c) mod window and carries packets c, c + wc, c + 2wc, ... : every
 * received result sends exactly one new packet, the next of its chain, into the same slot with the
 * set flipped (self-clocking), so a rank never has two packets in flight in one slot and each reuse
 * of a slot flips its set. For a tensor of at least `window` blocks, all in flight, this is SwitchML's
 * mapping, packet p -> slot (p + shift) mod W; a per-slot parity bit keeps the set alternation exact
 * across tensors that use fewer slots. The chain's outstanding packet index plays the role of
 * SwitchML's received-id bitmap.
 *
 * float32: exponents travel one window ahead. Packets 0..wc-1 carry only the exponent of blocks
 * 0..wc-1; packet p >= wc carries the data of block p - wc, quantized with the agreed (max)
 * exponent the result of packet p - wc brought back, and the exponent of block p. Total packets
 * B + wc. int32: packet p carries block p unchanged; total B.
 *
 * The pool shift, the per-slot set parity and the packet id carry over to the next tensor, so
 * every rank must stream the same sequence of tensor sizes (the core's negotiation does that).
 * Loss: each outstanding packet has a timer (rto, doubling up to rto_max on each expiry); on
 * expiry the identical packet is resent if a packet first sent after it was answered (RACK's test,
 * RFC 8985: the path delivers, this one was lost). Otherwise it may be late, not lost: queued behind
 * its window on a slow link (a host that did not run this process or the switch for a while makes
 * that queue longer than the timer), or held by the switch for the slowest rank (one that starts the
 * tensor late, a paused process). Resending the window then only adds its bytes to this rank's link
 * at every expiry, so one packet goes as a probe and the others wait, held: resent at once when a
 * later packet's answer shows them lost, or at their next expiry if results came meanwhile (a lost
 * tail: nothing later to answer); while none came, the stream is stalled and they wait on. The
 * price: a lost packet that nothing later shows is resent a round trip or a timer later (`make
 * faults`, 5% loss: about 1.25x the time); without faults the spurious resends of a job fell from
 * 40-130 to 0-20, and a slow link's window under a busy host's stalls resends none (test_netns).
 * A result for a packet that is not its chain's outstanding one is a duplicate and ignored. */
#define _GNU_SOURCE
#include "switchml.h"
#include "switchml_common.h"
#include "kernels.h"
#include "transport.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>

#define RX_BATCH 16      /* GRO buffers of 64 KiB: up to ~60 results of 256 values each */
#define TX_CAP 512

typedef struct {
    int64_t p;           /* outstanding packet of this chain, -1 when the chain is done */
    uint64_t sent;       /* first transmission, ns */
    uint64_t deadline;   /* resend time, ns */
    uint64_t rto;        /* current timeout, ns */
    uint32_t len;
    uint64_t resent_at;  /* its last resend, ns (0: sent once); tp_rtt_answer */
    uint32_t resent;     /* resends of this packet */
    int held;            /* expired, but nothing sent after it was answered yet: not resent */
} chain_t;

struct sml_worker {
    int fd, job, rank, nworkers, err;
    int nack;            /* a NACK's code, reported on timeout */
    tp_mac *mac;         /* the packet MAC under the job key (switchml.h); NULL: packets without MACs */
    uint32_t token, window, elems;
    uint32_t inflight;   /* packets in flight at most (sml_worker_set_inflight), <= window */
    size_t stride;       /* bytes of a chain's packet buffer: sml_pkt_max(elems), rounded up to 64 */
    tp_rtt rtt;          /* RFC 6298 estimate (ns); rtt.rto = the timer of a new packet */
    uint32_t shift;
    uint64_t pkt_base;   /* the 64-bit id of the next tensor's packet 0 */
    uint8_t *parity;     /* per slot: the set of the slot's next use */
    chain_t *ch;
    uint8_t *bufs;       /* window * stride: the packet in flight of each chain */
    float *clean;        /* elems: a block with its non-finite values zeroed */
    tp_rxq rx;
    tp_txq tx;
    sml_worker_counters c;
};

/* state of the tensor being streamed */
typedef struct {
    int is_int;
    const void *x;
    void *out;
    size_t n;
    uint64_t B, wc, P;
    const int8_t *exps;
    const uint8_t *nf;
    int8_t *mexp;
    int status;
    uint64_t newest;      /* the highest packet sent */
    uint64_t answered;    /* the last result, ns */
    uint64_t delivered;   /* the latest first transmission a result answered, ns (RACK's xmit_ts) */
    uint64_t oldest_held; /* the earliest first transmission of a held packet, ns (UINT64_MAX: none) */
    uint64_t next_timer;  /* no later than the earliest deadline of an outstanding packet, ns */
} tensor_t;

static void free_buffers(sml_worker *w) {
    tp_mac_free(w->mac);
    free(w->parity);
    free(w->ch);
    free(w->clean);
    free(w->bufs);
    free(w);
}

sml_worker *sml_worker_new(int fd, int job, int rank, uint32_t token, int nworkers, uint32_t window,
                           uint32_t elems, double rto_ms, double rto_max_ms, int offload, const uint8_t *key,
                           int mac) {
    if (window < 1 || window > SML_MAX_SLOTS || elems < 1 || elems > SML_MAX_ELEMS || nworkers < 1) return NULL;
    sml_worker *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->stride = (sml_pkt_max(elems) + 63) & ~(size_t)63;
    w->parity = calloc(window, 1);
    w->ch = calloc(window, sizeof *w->ch);
    w->clean = malloc(elems * sizeof *w->clean);
    if (posix_memalign((void **)&w->bufs, 64, (size_t)window * w->stride)) w->bufs = NULL;
    int rx_ok = tp_rxq_init(&w->rx, fd, RX_BATCH, sml_pkt_max(elems), offload) == 0;
    int tx_ok = tp_txq_init(&w->tx, fd, TX_CAP, TP_CONNECTED | (offload ? TP_GSO : 0)) == 0;
    if (key) w->mac = tp_mac_new(key, SML_MAC_LABEL, mac);
    if (!w->parity || !w->ch || !w->clean || !w->bufs || !rx_ok || !tx_ok || (key && !w->mac)) {
        if (rx_ok) tp_rxq_free(&w->rx);
        if (tx_ok) tp_txq_free(&w->tx);
        free_buffers(w);
        return NULL;
    }
    w->fd = fd;
    w->job = job;
    w->rank = rank;
    w->token = token;
    w->nworkers = nworkers;
    w->window = w->inflight = window;
    w->elems = elems;
    uint64_t rto0 = (uint64_t)(rto_ms * 1e6);
    tp_rtt_init(&w->rtt, rto0 < 10000 ? 10000 : rto0, (uint64_t)(rto_max_ms * 1e6));
    return w;
}

void sml_worker_free(sml_worker *w) {
    if (!w) return;
    tp_rxq_free(&w->rx);
    tp_txq_free(&w->tx);
    free_buffers(w);
}

void sml_worker_counters_get(sml_worker *w, sml_worker_counters *out) {
    *out = w->c;
    out->srtt_ns = w->rtt.srtt;
    out->rto_ns = w->rtt.rto;
}
int sml_worker_errno(sml_worker *w) { return w->err; }

static int flush(sml_worker *w) {
    uint64_t before = w->tx.pkts_sent;
    int rc = tp_txq_flush(&w->tx);
    w->c.sent += w->tx.pkts_sent - before;
    if (rc < 0) {
        w->err = -rc;
        return rc == -ECONNREFUSED ? SML_E_REFUSED : SML_E_SOCKET;
    }
    return 0;
}

static int queue(sml_worker *w, uint8_t *buf, uint32_t len) {
    if (w->tx.n == w->tx.cap) {
        int rc = flush(w);
        if (rc) return rc;
    }
    tp_txq_add(&w->tx, NULL, NULL, 0, buf, len);
    return 0;
}

/* Quantize one block for the wire: non-finite / out-of-range elements become 0 in the payload
 * and are described by the flag region. Returns the payload + region length. */
static uint32_t put_f32_block(sml_worker *w, const tensor_t *t, uint64_t b, uint8_t *pl, uint8_t *flags) {
    const float *x = (const float *)t->x + b * w->elems;
    size_t cnt = t->n - b * w->elems;
    if (cnt > w->elems) cnt = w->elems;
    uint32_t len = 4 * w->elems;
    if (t->nf[b]) {
        float *clean = w->clean;
        uint8_t *r = pl + 4 * w->elems;
        memset(r, 0, w->elems);
        for (size_t i = 0; i < cnt; i++) {
            float v = x[i];
            clean[i] = v;
            if (isnan(v)) r[i] = SML_NF_NAN;
            else if (isinf(v)) r[i] = v > 0 ? SML_NF_POSINF : SML_NF_NEGINF;
            else if (fabsf(v) >= 0x1p127f) r[i] = SML_NF_RANGE;
            if (r[i]) clean[i] = 0.0f;
        }
        x = clean;
        *flags |= SML_F_NONFINITE;
        len += w->elems;
    }
    cl_quantize_be(x, cnt, t->mexp[b], w->nworkers, pl);
    memset(pl + 4 * cnt, 0, 4 * (w->elems - cnt));  /* the partial last block */
    return len;
}

/* Build packet p of the tensor into its chain's buffer. */
static uint32_t build(sml_worker *w, tensor_t *t, uint64_t p, uint64_t c) {
    uint8_t *h = w->bufs + c * w->stride, *pl = h + SML_HDR_LEN;
    uint32_t slot = (uint32_t)((w->shift + c) % w->window);
    uint32_t set = w->parity[slot] ^ (uint32_t)((p / t->wc) & 1);
    uint8_t flags = 0;
    int8_t exp = SML_EXP_NONE;
    uint32_t len = 0;
    if (t->is_int) {
        const int32_t *x = (const int32_t *)t->x + p * w->elems;
        size_t cnt = t->n - p * w->elems;
        if (cnt > w->elems) cnt = w->elems;
        cl_be_store(pl, x, cnt);
        memset(pl + 4 * cnt, 0, 4 * (w->elems - cnt));
        flags = (uint8_t)sml_elems_code(w->elems);
        len = 4 * w->elems;
    } else {
        if (p < t->B) exp = t->exps[p];
        if (p >= t->wc) {
            flags = (uint8_t)sml_elems_code(w->elems);
            len = put_f32_block(w, t, p - t->wc, pl, &flags);
        }
    }
    h[0] = SML_DATA;
    h[1] = flags;
    h[2] = (uint8_t)w->job;
    h[3] = (uint8_t)w->rank;
    uint64_t id = w->pkt_base + p;
    tp_wr32(h + 4, sml_id_wire(id));
    tp_wr16(h + 8, (uint16_t)(slot | set << 15));
    h[10] = (uint8_t)exp;
    h[11] = 0;
    tp_wr32(h + 12, w->token);
    if (w->mac) h[1] |= SML_F_MAC;
    sml_seal(h);
    if (w->mac) {
        uint8_t nonce[TP_NONCE_LEN];
        sml_nonce(nonce, SML_DATA, (uint8_t)w->rank, id);
        sml_sign(w->mac, h, SML_HDR_LEN + len, id, nonce);
        len += SML_MAC_LEN;
    }
    return SML_HDR_LEN + len;
}

static int send_packet(sml_worker *w, tensor_t *t, uint64_t p, uint64_t c, uint64_t now) {
    chain_t *ch = &w->ch[c];
    ch->p = (int64_t)p;
    if (p > t->newest) t->newest = p;
    ch->len = build(w, t, p, c);
    ch->rto = w->rtt.rto;
    ch->sent = now;
    ch->resent = 0;
    ch->resent_at = 0;
    ch->held = 0;
    ch->deadline = now + ch->rto;
    if (ch->deadline < t->next_timer) t->next_timer = ch->deadline;  /* its rto may be the smallest */
    return queue(w, w->bufs + c * w->stride, ch->len);
}

/* Write back the valid elements of a result. */
static void take_result(sml_worker *w, tensor_t *t, uint64_t p, const uint8_t *h) {
    const uint8_t *pl = h + SML_HDR_LEN;
    if (t->is_int) {
        int32_t *out = (int32_t *)t->out + p * w->elems;
        size_t cnt = t->n - p * w->elems;
        if (cnt > w->elems) cnt = w->elems;
        cl_be_load(out, pl, cnt);
        return;
    }
    if (p < t->B) t->mexp[p] = (int8_t)h[10];
    if (p < t->wc) return;
    uint64_t b = p - t->wc;
    float *out = (float *)t->out + b * w->elems;
    size_t cnt = t->n - b * w->elems;
    if (cnt > w->elems) cnt = w->elems;
    cl_dequantize_be(pl, cnt, t->mexp[b], w->nworkers, out);
    if (h[1] & SML_F_NONFINITE) {
        const uint8_t *r = pl + 4 * w->elems;
        for (size_t i = 0; i < cnt; i++) {
            uint8_t f = r[i];
            if (!f) continue;
            if (f & SML_NF_RANGE) {
                out[i] = NAN;
                t->status |= SML_R_RANGE;
            } else {
                int both = (f & SML_NF_POSINF) && (f & SML_NF_NEGINF);
                out[i] = (f & SML_NF_NAN) || both ? NAN : (f & SML_NF_POSINF) ? INFINITY : -INFINITY;
                t->status |= SML_R_NONFINITE;
            }
        }
    }
}

/* One received datagram. Returns 1 if it advanced the tensor, 0 if ignored, < 0 on a fatal NACK. */
static int on_packet(sml_worker *w, tensor_t *t, const uint8_t *h, size_t len, uint64_t now, uint64_t *active) {
    if (len < SML_HDR_LEN || !sml_sealed(h) || h[2] != (uint8_t)w->job ||
        tp_rd32(h + 12) != w->token) {
        w->c.ignored++;
        return 0;
    }
    if (h[0] == SML_NACK) {
        w->c.nacks++;
        if (w->mac) {   /* anyone can forge a NACK: believed only if no result comes before the timeout */
            w->nack = h[11] ? h[11] : 1;
            return 0;
        }
        w->err = h[11];
        return SML_E_NACK;
    }
    uint32_t code = h[1] & SML_F_SIZE, elems = sml_size_elems(code, w->elems);
    size_t body = SML_HDR_LEN + 4 * (size_t)elems + ((h[1] & SML_F_NONFINITE) ? elems : 0) +
                  ((h[1] & SML_F_STAMP) ? SML_STAMP_LEN : 0);
    if (h[0] != SML_RESULT || len < body) {
        w->c.ignored++;
        return 0;
    }
    uint64_t id = sml_id_upto(tp_rd32(h + 4), w->pkt_base + t->newest);   /* the MAC covers all 64 bits */
    if (w->mac) {
        uint8_t nonce[TP_NONCE_LEN];
        int ok = (h[1] & SML_F_MAC) && len == body + SML_SEQ_LEN + SML_MAC_LEN;
        if (ok) {
            sml_nonce(nonce, SML_RESULT, 0, (uint64_t)tp_rd32(h + body) << 32 | tp_rd32(h + body + 4));
            ok = sml_signed(w->mac, h, body + SML_SEQ_LEN, id, nonce);
        }
        if (!ok) {
            w->c.bad_mac++;
            return 0;
        }
    }
    uint64_t p = id - w->pkt_base;
    if (p >= t->P) {  /* a late duplicate of an earlier tensor */
        w->c.duplicates++;
        return 0;
    }
    uint64_t c = p % t->wc;
    chain_t *ch = &w->ch[c];
    if (ch->p != (int64_t)p) {
        w->c.duplicates++;
        return 0;
    }
    uint32_t slot = (uint32_t)((w->shift + c) % w->window);
    uint32_t set = w->parity[slot] ^ (uint32_t)((p / t->wc) & 1);
    uint32_t want = t->is_int || p >= t->wc ? sml_elems_code(w->elems) : 0;
    if (tp_rd16(h + 8) != (slot | set << 15) || code != want) {
        w->c.ignored++;
        return 0;
    }
    w->c.received++;
    t->answered = now;
    /* The transmission it answers: surely the first one (tp_rtt_first), else maybe the resend, maybe the
     * first one late in a queue; a resend counts only in the tail, where no later first transmission can
     * show what was lost (RFC 8985). 0: neither counts. */
    uint64_t at = ch->sent;
    if (!tp_rtt_first(&w->rtt, ch->resent_at, now)) at = t->newest + 1 == t->P ? ch->resent_at : 0;
    if (at > t->delivered) {
        t->delivered = at;
        if (at > t->oldest_held) t->next_timer = now;   /* held packets older than it were lost: resend them */
    }
    tp_rtt_answer(&w->rtt, ch->sent, ch->resent_at, now, *active);  /* includes waiting for the slowest rank */
    if (h[1] & SML_F_STAMP) {   /* the switch's share of this round, for the breakdown */
        w->c.server_queue_ns += tp_rd32(h + body - SML_STAMP_LEN);
        w->c.server_proc_ns += tp_rd32(h + body - 4);
        w->c.server_packets += (uint64_t)w->nworkers;
        w->c.round_ns += now - ch->sent;
    }
    take_result(w, t, p, h);
    uint64_t next = p + t->wc;
    if (next < t->P) {
        int rc = send_packet(w, t, next, c, now);
        if (rc) return rc;
    } else {
        ch->p = -1;
        (*active)--;
    }
    return 1;
}

void sml_worker_set_inflight(sml_worker *w, uint32_t chains) {
    w->inflight = chains >= 1 && chains <= w->window ? chains : w->window;
}

int sml_worker_allreduce(sml_worker *w, int is_int, const void *x, void *out, size_t n, const int8_t *exps,
                         const uint8_t *nf, int8_t *mexp, int timeout_ms) {
    if (n == 0) return 0;
    uint64_t t_start = tp_now_ns(), wait_ns = 0, cpu0 = tp_cpu_ns();
    tensor_t t = {.is_int = is_int, .x = x, .out = out, .n = n, .exps = exps, .nf = nf, .mexp = mexp,
                  .next_timer = UINT64_MAX, .oldest_held = UINT64_MAX};
    t.B = (n + w->elems - 1) / w->elems;
    t.wc = t.B < w->inflight ? t.B : w->inflight;
    t.P = is_int ? t.B : t.B + t.wc;
    uint64_t timeout = (uint64_t)(timeout_ms > 0 ? timeout_ms : 1) * 1000000u;
    uint64_t now = tp_now_ns(), progress = now, active = t.wc;
    int rc = 0;
    w->tx.n = 0;
    for (uint64_t c = 0; c < t.wc && !rc; c++) rc = send_packet(w, &t, c, c, now);
    if (!rc) rc = flush(w);
    while (!rc && active > 0) {
        int got = tp_rxq_recv(&w->rx, 0);
        now = tp_now_ns();
        if (got > 0 || w->rx.nmsg > 0) {
            w->c.ignored += w->rx.truncated;
            w->rx.truncated = 0;
            for (int i = 0; i < got && rc >= 0; i++) {  /* one segment = one datagram */
                int r = on_packet(w, &t, w->rx.seg[i], w->rx.seg_len[i], now, &active);
                if (r < 0) rc = r;
                else if (r > 0) progress = now, w->nack = 0;
            }
            if (rc >= 0) rc = flush(w);
            if (rc) break;
            /* timers only once the socket is drained: results waiting in it are not losses; the
             * timeout always (a flood would keep every batch full) */
            if ((w->rx.nmsg == RX_BATCH || now < t.next_timer) && now - progress < timeout) continue;
        } else if (got < 0) {
            w->err = -got;
            rc = got == -ECONNREFUSED ? SML_E_REFUSED : SML_E_SOCKET;
            break;
        }
        if (active == 0) break;
        if (now - progress >= timeout) {
            rc = w->nack ? SML_E_NACK : SML_E_TIMEOUT;
            if (w->nack) w->err = w->nack;
            break;
        }
        if (now >= t.next_timer) {  /* resend lost packets, identical, to the same slot */
            t.next_timer = t.oldest_held = UINT64_MAX;
            int probed = 0;
            for (uint64_t c = 0; c < t.wc && !rc; c++) {
                chain_t *ch = &w->ch[c];
                if (ch->p < 0) continue;
                /* lost: a packet sent after it came through, or held and late again while results came */
                int expired = ch->deadline <= now, stalled = t.answered <= ch->sent;
                int lost = ch->sent < t.delivered || (expired && ch->held && !stalled);
                if (expired || (ch->held && lost)) {
                    if (expired) {
                        ch->rto = ch->rto * 2 < w->rtt.max ? ch->rto * 2 : w->rtt.max;
                        tp_rtt_backoff(&w->rtt, ch->sent, now);
                    }
                    ch->deadline = now + ch->rto;
                    ch->held = !lost && probed++;   /* late, and this scan's probe went */
                    if (ch->held) {
                        w->c.held++;
                    } else {
                        ch->resent++;
                        ch->resent_at = now;
                        w->c.resends++;
                        rc = queue(w, w->bufs + c * w->stride, ch->len);
                    }
                }
                if (ch->held && ch->sent < t.oldest_held) t.oldest_held = ch->sent;
                if (ch->deadline < t.next_timer) t.next_timer = ch->deadline;
            }
            if (!rc) rc = flush(w);
            if (rc) break;
        }
        if (w->rx.nmsg > 0) continue;
        uint64_t until = t.next_timer < progress + timeout ? t.next_timer : progress + timeout;
        int ms = until > now ? (int)((until - now + 999999) / 1000000) : 0;
        struct pollfd pfd = {.fd = w->fd, .events = POLLIN};
        uint64_t t0 = tp_now_ns();
        poll(&pfd, 1, ms);
        wait_ns += tp_now_ns() - t0;
    }
    uint64_t t_end = tp_now_ns();
    w->c.wait_ns += wait_ns;
    w->c.busy_ns += (t_end - t_start) - wait_ns;
    w->c.cpu_ns += tp_cpu_ns() - cpu0;
    if (rc) {
        w->pkt_base += t.P;   /* the ids of a failed call are never reused (they are its MACs' nonces) */
        return rc;
    }
    /* carry the stream over: per-slot set parity, pool shift, packet ids */
    for (uint64_t c = 0; c < t.wc; c++) {
        uint64_t uses = (t.P - c + t.wc - 1) / t.wc;
        w->parity[(w->shift + c) % w->window] ^= (uint8_t)(uses & 1);
    }
    w->shift = (uint32_t)((w->shift + t.P) % w->window);
    w->pkt_base += t.P;
    w->c.tensors++;
    w->c.elements += n;
    return t.status;
}
