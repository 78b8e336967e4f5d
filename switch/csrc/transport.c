/* commlib's UDP transport (transport.h): checksum, packet MAC, batched send/receive queues. */
#define _GNU_SOURCE
#include "transport.h"

#include <netinet/udp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

#define CTL_LEN CMSG_SPACE(sizeof(int))
#define RX_CTL_LEN (CMSG_SPACE(sizeof(int)) + CMSG_SPACE(sizeof(struct timespec)))   /* GRO size, stamp */

uint32_t tp_checksum(const void *buf, size_t len) {
    tp_ck c = {0, 0, 0, 0};
    tp_ck_update(&c, buf, len);
    return tp_ck_final(&c);
}

/* ---- the packet MAC: AES-256-GCM or ChaCha20-Poly1305 through OpenSSL (transport.h) ---------- */
struct tp_mac {
    EVP_CIPHER_CTX *ctx;   /* keyed once; each call sets the nonce only */
};

int tp_mac_fast(void) {
#if defined(__x86_64__) || defined(__i386__)
    return __builtin_cpu_supports("aes") && __builtin_cpu_supports("pclmul");
#else
    return 0;
#endif
}

const char *tp_mac_name(int alg) {
    return alg == TP_MAC_AES_256_GCM ? "aes-256-gcm" : alg == TP_MAC_CHACHA20_POLY1305 ? "chacha20-poly1305" : NULL;
}

tp_mac *tp_mac_new(const uint8_t *key, const char *label, int alg) {
    const char *name = tp_mac_name(alg);
    if (!name) return NULL;
    char info[256];   /* the key is bound to its use and its algorithm (transport.h) */
    int ilen = alg == TP_MAC_CHACHA20_POLY1305 ? snprintf(info, sizeof info, "%s", label)
                                               : snprintf(info, sizeof info, "%s %s", label, name);
    if (ilen < 0 || (size_t)ilen >= sizeof info) return NULL;
    uint8_t k[32];
    size_t klen = sizeof k;
    tp_mac *m = calloc(1, sizeof *m);
    EVP_PKEY_CTX *kdf = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, NULL);
    int ok = m && kdf && EVP_PKEY_derive_init(kdf) > 0 && EVP_PKEY_CTX_set_hkdf_md(kdf, EVP_sha256()) > 0 &&
             EVP_PKEY_CTX_set1_hkdf_key(kdf, key, TP_KEY_LEN) > 0 &&
             EVP_PKEY_CTX_add1_hkdf_info(kdf, (const unsigned char *)info, ilen) > 0 &&
             EVP_PKEY_derive(kdf, k, &klen) > 0 && klen == sizeof k;
    EVP_PKEY_CTX_free(kdf);
    if (ok) {
        const EVP_CIPHER *cipher = alg == TP_MAC_AES_256_GCM ? EVP_aes_256_gcm() : EVP_chacha20_poly1305();
        m->ctx = EVP_CIPHER_CTX_new();
        ok = m->ctx && EVP_EncryptInit_ex(m->ctx, cipher, NULL, k, NULL) > 0 &&
             EVP_CIPHER_CTX_ctrl(m->ctx, EVP_CTRL_AEAD_SET_IVLEN, TP_NONCE_LEN, NULL) > 0;
    }
    OPENSSL_cleanse(k, sizeof k);
    if (!ok) {
        tp_mac_free(m);
        return NULL;
    }
    return m;
}

void tp_mac_free(tp_mac *m) {
    if (!m) return;
    EVP_CIPHER_CTX_free(m->ctx);
    free(m);
}

int tp_mac_tagv(tp_mac *m, const uint8_t *nonce, const tp_part *parts, int nparts, uint8_t *tag) {
    int out, ok = EVP_EncryptInit_ex(m->ctx, NULL, NULL, NULL, nonce) > 0;
    for (int i = 0; ok && i < nparts; i++)   /* out NULL: associated data */
        ok = !parts[i].len || EVP_EncryptUpdate(m->ctx, NULL, &out, parts[i].p, (int)parts[i].len) > 0;
    if (!ok || EVP_EncryptFinal_ex(m->ctx, tag, &out) <= 0 ||
        EVP_CIPHER_CTX_ctrl(m->ctx, EVP_CTRL_AEAD_GET_TAG, TP_TAG_LEN, tag) <= 0) {
        memset(tag, 0, TP_TAG_LEN);
        return -1;
    }
    return 0;
}

int tp_mac_tag(tp_mac *m, const uint8_t *nonce, const void *a, size_t alen, const void *b, size_t blen, uint8_t *tag) {
    tp_part parts[2] = {{a, alen}, {b, blen}};
    return tp_mac_tagv(m, nonce, parts, 2, tag);
}

int tp_mac_check(tp_mac *m, const uint8_t *nonce, const void *a, size_t alen, const void *b, size_t blen,
                 const uint8_t *tag) {
    uint8_t want[TP_TAG_LEN];
    return tp_mac_tag(m, nonce, a, alen, b, blen, want) == 0 && CRYPTO_memcmp(want, tag, TP_TAG_LEN) == 0;
}

/* ---- sends ---------------------------------------------------------------------------------- */
int tp_txq_init(tp_txq *q, int fd, size_t cap, int flags) {
    memset(q, 0, sizeof *q);
    q->fd = fd;
    q->flags = flags;
    q->cap = cap;
    q->pkts = calloc(cap, sizeof *q->pkts);
    q->msgs = calloc(cap, sizeof *q->msgs);
    q->iov = calloc(3 * cap, sizeof *q->iov);
    q->msg_of = calloc(cap, sizeof(uint32_t));
    q->seg = calloc(cap, sizeof(uint32_t));
    q->nsegs = calloc(cap, sizeof(uint32_t));
    q->bytes = calloc(cap, sizeof(uint32_t));
    q->first = calloc(cap, sizeof(uint32_t));
    q->cursor = calloc(cap, sizeof(uint32_t));
    q->base = calloc(cap, sizeof(uint32_t));
    q->closed = calloc(cap, 1);
    q->ctl = calloc(cap, CTL_LEN);
    if (flags & TP_COPY) q->arena = malloc(TP_ARENA);
    if (!q->pkts || !q->msgs || !q->iov || !q->msg_of || !q->seg || !q->nsegs || !q->bytes || !q->first ||
        !q->cursor || !q->base || !q->closed || !q->ctl || ((flags & TP_COPY) && !q->arena)) {
        tp_txq_free(q);
        return -1;
    }
    return 0;
}

void tp_txq_free(tp_txq *q) {
    free(q->pkts);
    free(q->arena);
    free(q->msgs);
    free(q->iov);
    free(q->msg_of);
    free(q->seg);
    free(q->nsegs);
    free(q->bytes);
    free(q->first);
    free(q->cursor);
    free(q->base);
    free(q->closed);
    free(q->ctl);
    memset(q, 0, sizeof *q);
}

int tp_txq_add(tp_txq *q, const struct sockaddr_in *to, const void *hdr, uint32_t hlen, const void *payload,
               uint32_t plen) {
    int rc = 0;
    if (q->n == q->cap || (q->arena && q->arena_used + plen > TP_ARENA)) rc = tp_txq_flush(q);
    tp_txpkt *p = &q->pkts[q->n++];
    if (to) p->to = *to;
    p->hlen = hlen;
    if (hlen) memcpy(p->hdr, hdr, hlen);
    if (plen && q->arena) {
        memcpy(q->arena + q->arena_used, payload, plen);
        payload = q->arena + q->arena_used;
        q->arena_used += plen;
    }
    p->payload = (const uint8_t *)payload;
    p->plen = plen;
    p->tlen = 0;
    return rc;
}

void tp_txq_trailer(tp_txq *q, const uint8_t *trailer, uint32_t len) {
    tp_txpkt *p = &q->pkts[q->n - 1];
    if (len > TP_MAX_TRAILER) len = TP_MAX_TRAILER;
    memcpy(p->trailer, trailer, len);
    p->tlen = len;
}

static int same_dest(const tp_txq *q, const tp_txpkt *a, const tp_txpkt *b) {
    return (q->flags & TP_CONNECTED) ||
           (a->to.sin_addr.s_addr == b->to.sin_addr.s_addr && a->to.sin_port == b->to.sin_port);
}

static int wait_for_room(tp_txq *q, int *stalls) {   /* a full socket buffer: wait, a little */
    if ((*stalls)++ >= 100) return 0;
    struct pollfd p = {q->fd, POLLOUT, 0};
    poll(&p, 1, 10);
    return 1;
}

static int send_one(tp_txq *q, const tp_txpkt *p) {
    struct iovec v[3];
    int k = 0;
    if (p->hlen) v[k++] = (struct iovec){(void *)p->hdr, p->hlen};
    if (p->plen) v[k++] = (struct iovec){(void *)p->payload, p->plen};
    if (p->tlen) v[k++] = (struct iovec){(void *)p->trailer, p->tlen};
    struct msghdr m = {.msg_iov = v, .msg_iovlen = (size_t)k};
    if (!(q->flags & TP_CONNECTED)) {
        m.msg_name = (void *)&p->to;
        m.msg_namelen = sizeof p->to;
    }
    ssize_t r = sendmsg(q->fd, &m, 0);
    if (r < 0) {
        q->errors++;
        return errno == ECONNREFUSED ? -ECONNREFUSED : 0;
    }
    q->pkts_sent++;
    q->bytes_sent += (uint64_t)r;
    return 0;
}

/* The packets of message m one datagram at a time: the path after the kernel refused GSO. */
static int send_plain(tp_txq *q, size_t n, uint32_t m) {
    int rc = 0;
    for (size_t i = 0; i < n; i++)
        if (q->msg_of[i] == m && send_one(q, &q->pkts[i])) rc = -ECONNREFUSED;
    q->messages++;
    return rc;
}

int tp_txq_flush(tp_txq *q) {
    size_t n = q->n, nm = 0;
    q->n = 0;
    q->arena_used = 0;   /* the payloads stay valid until this call returns */
    if (!n) return 0;
    int gso = (q->flags & TP_GSO) != 0;
    /* 1. group packets into messages: per destination, consecutive runs of one segment size
     * (a shorter packet may end a run, as GSO allows) */
    enum { OPEN = 128 };
    uint32_t open_msg[OPEN];
    size_t nopen = 0;
    for (size_t i = 0; i < n; i++) {
        tp_txpkt *p = &q->pkts[i];
        uint32_t len = p->hlen + p->plen + p->tlen;
        size_t o = 0;
        while (o < nopen && !same_dest(q, &q->pkts[q->first[open_msg[o]]], p)) o++;
        if (o < nopen && gso) {
            uint32_t m = open_msg[o];
            if (!q->closed[m] && len <= q->seg[m] && q->nsegs[m] < TP_GSO_SEGS && q->bytes[m] + len <= TP_GSO_BYTES) {
                q->msg_of[i] = m;
                q->nsegs[m]++;
                q->bytes[m] += len;
                if (len < q->seg[m]) q->closed[m] = 1;
                continue;
            }
        }
        uint32_t m = (uint32_t)nm++;
        q->msg_of[i] = m;
        q->seg[m] = len;
        q->nsegs[m] = 1;
        q->bytes[m] = len;
        q->first[m] = (uint32_t)i;
        q->closed[m] = 0;
        if (o < nopen) open_msg[o] = m;
        else if (nopen < OPEN) open_msg[nopen++] = m;
        else open_msg[(i % OPEN)] = m;   /* more destinations than slots: forget one (less batching) */
    }
    /* 2. lay out each message's iovecs contiguously, in packet order (header, payload, trailer) */
    uint32_t at = 0;
    for (size_t m = 0; m < nm; m++) {
        q->base[m] = q->cursor[m] = at;
        at += 3 * q->nsegs[m];
    }
    for (size_t i = 0; i < n; i++) {
        tp_txpkt *p = &q->pkts[i];
        uint32_t *c = &q->cursor[q->msg_of[i]];
        if (p->hlen) q->iov[(*c)++] = (struct iovec){p->hdr, p->hlen};
        if (p->plen) q->iov[(*c)++] = (struct iovec){(void *)p->payload, p->plen};
        if (p->tlen) q->iov[(*c)++] = (struct iovec){p->trailer, p->tlen};
    }
    for (size_t m = 0; m < nm; m++) {
        struct msghdr *h = &q->msgs[m].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_iov = &q->iov[q->base[m]];
        h->msg_iovlen = q->cursor[m] - q->base[m];
        if (!(q->flags & TP_CONNECTED)) {
            h->msg_name = &q->pkts[q->first[m]].to;
            h->msg_namelen = sizeof(struct sockaddr_in);
        }
        if (q->nsegs[m] > 1) {
            char *c = q->ctl + m * CTL_LEN;
            memset(c, 0, CTL_LEN);
            h->msg_control = c;
            h->msg_controllen = CMSG_SPACE(sizeof(uint16_t));
            struct cmsghdr *cm = CMSG_FIRSTHDR(h);
            cm->cmsg_level = SOL_UDP;
            cm->cmsg_type = UDP_SEGMENT;
            cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t seg = (uint16_t)q->seg[m];
            memcpy(CMSG_DATA(cm), &seg, sizeof seg);
        }
    }
    /* 3. send */
    size_t done = 0;
    int refused = 0, stalls = 0;
    while (done < nm) {
        size_t chunk = nm - done < 1024 ? nm - done : 1024;
        int r = sendmmsg(q->fd, q->msgs + done, (unsigned)chunk, 0);
        if (r > 0) {
            for (int k = 0; k < r; k++) {
                struct mmsghdr *mm = &q->msgs[done + k];
                q->pkts_sent += q->nsegs[done + k];
                q->bytes_sent += mm->msg_len;
                q->messages++;
                if (q->nsegs[done + k] > 1) q->gso_messages++;
            }
            done += (size_t)r;
            continue;
        }
        int err = r < 0 ? errno : EIO;
        if (err == EINTR) continue;
        if ((err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS) && wait_for_room(q, &stalls)) continue;
        if (err == ECONNREFUSED) refused = 1;
        if (q->nsegs[done] > 1 && (err == EINVAL || err == EIO || err == EOPNOTSUPP || err == ENOPROTOOPT ||
                                   err == EMSGSIZE)) {
            q->flags &= ~TP_GSO;   /* the kernel or the path does not take GSO: one datagram per message from now */
            if (send_plain(q, n, (uint32_t)done)) refused = 1;
        } else {
            q->errors += q->nsegs[done];   /* buffer full, unreachable or refused: like a loss */
        }
        done++;
    }
    return refused ? -ECONNREFUSED : 0;
}

/* ---- receives ------------------------------------------------------------------------------- */
int tp_rxq_init(tp_rxq *q, int fd, size_t nmsgs, size_t bufsize, int gro) {
    memset(q, 0, sizeof *q);
    q->fd = fd;
    q->nmsgs = nmsgs;
    if (gro) {
        int one = 1;
        gro = setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof one) == 0;
    }
    q->gro = gro;
    q->bufsize = gro && bufsize < TP_GRO_BUF ? TP_GRO_BUF : bufsize;
    q->maxseg = nmsgs * (gro ? TP_GRO_SEGS : 1);
    q->bufs = malloc(nmsgs * q->bufsize);
    q->msgs = calloc(nmsgs, sizeof *q->msgs);
    q->iov = calloc(nmsgs, sizeof *q->iov);
    q->from = calloc(nmsgs, sizeof *q->from);
    q->ctl = calloc(nmsgs, RX_CTL_LEN);
    q->stamp = calloc(nmsgs, sizeof *q->stamp);
    q->seg = calloc(q->maxseg, sizeof *q->seg);
    q->seg_len = calloc(q->maxseg, sizeof *q->seg_len);
    q->seg_msg = calloc(q->maxseg, sizeof *q->seg_msg);
    if (!q->bufs || !q->msgs || !q->iov || !q->from || !q->ctl || !q->stamp || !q->seg || !q->seg_len || !q->seg_msg) {
        tp_rxq_free(q);
        return -1;
    }
    for (size_t i = 0; i < nmsgs; i++) {
        q->iov[i].iov_base = q->bufs + i * q->bufsize;
        q->iov[i].iov_len = q->bufsize;
        q->msgs[i].msg_hdr.msg_iov = &q->iov[i];
        q->msgs[i].msg_hdr.msg_iovlen = 1;
    }
    return 0;
}

void tp_rxq_free(tp_rxq *q) {
    if (q->gro) {
        int zero = 0;
        setsockopt(q->fd, SOL_UDP, UDP_GRO, &zero, sizeof zero);
    }
    free(q->bufs);
    free(q->msgs);
    free(q->iov);
    free(q->from);
    free(q->ctl);
    free(q->stamp);
    free(q->seg);
    free(q->seg_len);
    free(q->seg_msg);
    memset(q, 0, sizeof *q);
}

int tp_rxq_stamps(tp_rxq *q) {
    int one = 1;
    q->stamps = setsockopt(q->fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one) == 0;
    return q->stamps ? 0 : -errno;
}

/* the kernel's receive stamp of message i, 0 if it has none */
static uint64_t rx_stamp(tp_rxq *q, int i) {
    struct msghdr *h = &q->msgs[i].msg_hdr;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(h); cm; cm = CMSG_NXTHDR(h, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_TIMESTAMPNS) {
            struct timespec ts;
            memcpy(&ts, CMSG_DATA(cm), sizeof ts);
            return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
        }
    }
    return 0;
}

/* segment size of message i (its whole length without GRO); 0 if it was truncated */
static size_t seg_size(tp_rxq *q, int i) {
    struct msghdr *h = &q->msgs[i].msg_hdr;
    size_t len = q->msgs[i].msg_len;
    if (h->msg_flags & MSG_TRUNC) return 0;
    if (q->gro && h->msg_controllen) {
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(h); cm; cm = CMSG_NXTHDR(h, cm)) {
            if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO) {
                int seg;
                memcpy(&seg, CMSG_DATA(cm), sizeof seg);
                if (seg > 0 && (size_t)seg < len) return (size_t)seg;
            }
        }
    }
    return len;
}

int tp_rxq_recv(tp_rxq *q, int timeout_ms) {
    q->nmsg = q->nseg = 0;
    if (timeout_ms > 0) {   /* wait first: a caller that may wait usually finds nothing yet */
        struct pollfd p = {q->fd, POLLIN, 0};
        int pr = poll(&p, 1, timeout_ms);
        if (pr < 0) return errno == EINTR ? 0 : -errno;
        if (pr == 0) return 0;
    }
    int r;
    size_t vlen = q->want && q->want < q->nmsgs ? q->want : q->nmsgs;
    for (;;) {
        for (size_t i = 0; i < vlen; i++) {
            struct msghdr *h = &q->msgs[i].msg_hdr;
            h->msg_name = &q->from[i];
            h->msg_namelen = sizeof q->from[i];
            h->msg_control = q->ctl + i * RX_CTL_LEN;
            h->msg_controllen = RX_CTL_LEN;
            h->msg_flags = 0;
        }
        r = recvmmsg(q->fd, q->msgs, (unsigned)vlen, MSG_DONTWAIT, NULL);
        if (r >= 0) break;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        return -errno;
    }
    q->messages += (uint64_t)r;
    q->nmsg = r;
    for (int i = 0; i < r; i++) {
        q->stamp[i] = q->stamps ? rx_stamp(q, i) : 0;
        size_t len = q->msgs[i].msg_len, seg = seg_size(q, i);
        if (!seg) {
            q->truncated++;   /* larger than any packet of ours */
            continue;
        }
        const uint8_t *base = q->bufs + (size_t)i * q->bufsize;
        for (size_t off = 0; off < len; off += seg) {
            if ((size_t)q->nseg == q->maxseg) {
                q->truncated++;
                break;
            }
            q->seg[q->nseg] = base + off;
            q->seg_len[q->nseg] = (uint32_t)(len - off < seg ? len - off : seg);
            q->seg_msg[q->nseg] = (uint16_t)i;
            q->nseg++;
        }
    }
    return q->nseg;
}
