/* Batched UDP for the switch and the worker: sendmmsg with UDP GSO, recvmmsg with UDP GRO. */
#define _GNU_SOURCE
#include "switchml.h"
#include "switchml_common.h"

#include <errno.h>
#include <netinet/udp.h>
#include <stdlib.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

#define CTL_LEN CMSG_SPACE(sizeof(int))

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LANES __attribute__((target_clones("avx2", "default")))
#else
#define LANES
#endif

LANES void sml_be_load(int32_t *restrict dst, const uint8_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, src + 4 * i, 4);
        dst[i] = (int32_t)__builtin_bswap32(v);
    }
}

LANES void sml_be_add(int32_t *restrict dst, const uint8_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, src + 4 * i, 4);
        dst[i] = (int32_t)((uint32_t)dst[i] + __builtin_bswap32(v));
    }
}

LANES void sml_be_store(uint8_t *restrict dst, const int32_t *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t v = __builtin_bswap32((uint32_t)src[i]);
        memcpy(dst + 4 * i, &v, 4);
    }
}

int sml_txq_init(sml_txq *q, int fd, int connected, size_t cap, int gso) {
    memset(q, 0, sizeof *q);
    q->fd = fd;
    q->connected = connected;
    q->cap = cap;
    q->gso = gso;
    q->pkts = calloc(cap, sizeof *q->pkts);
    q->msgs = calloc(cap, sizeof *q->msgs);
    q->iov = calloc(cap, sizeof *q->iov);
    q->msg_of = calloc(cap, sizeof(uint32_t));
    q->seg = calloc(cap, sizeof(uint32_t));
    q->nsegs = calloc(cap, sizeof(uint32_t));
    q->bytes = calloc(cap, sizeof(uint32_t));
    q->first = calloc(cap, sizeof(uint32_t));
    q->cursor = calloc(cap, sizeof(uint32_t));
    q->closed = calloc(cap, 1);
    q->ctl = calloc(cap, CTL_LEN);
    if (!q->pkts || !q->msgs || !q->iov || !q->msg_of || !q->seg || !q->nsegs || !q->bytes || !q->first ||
        !q->cursor || !q->closed || !q->ctl) {
        sml_txq_free(q);
        return -1;
    }
    return 0;
}

void sml_txq_free(sml_txq *q) {
    free(q->pkts);
    free(q->msgs);
    free(q->iov);
    free(q->msg_of);
    free(q->seg);
    free(q->nsegs);
    free(q->bytes);
    free(q->first);
    free(q->cursor);
    free(q->closed);
    free(q->ctl);
    memset(q, 0, sizeof *q);
}

static int same_dest(const sml_txq *q, const sml_txpkt *a, const sml_txpkt *b) {
    return q->connected || (a->to.sin_addr.s_addr == b->to.sin_addr.s_addr && a->to.sin_port == b->to.sin_port);
}

/* One datagram at a time: the path after the kernel refused GSO. */
static int send_plain(sml_txq *q, struct msghdr *h) {
    for (size_t k = 0; k < h->msg_iovlen; k++) {
        ssize_t r = sendto(q->fd, h->msg_iov[k].iov_base, h->msg_iov[k].iov_len, 0, h->msg_name, h->msg_namelen);
        if (r < 0) {
            if (errno == ECONNREFUSED) return -ECONNREFUSED;
            q->errors++;
        } else {
            q->sent++;
        }
    }
    return 0;
}

int sml_txq_flush(sml_txq *q) {
    size_t n = q->n, nm = 0;
    q->n = 0;
    if (!n) return 0;
    /* 1. group packets into messages: per destination, consecutive runs of one segment size
     * (a shorter packet may end a run, as GSO allows) */
    enum { OPEN = 128 };
    uint32_t open_msg[OPEN];
    size_t nopen = 0;
    for (size_t i = 0; i < n; i++) {
        sml_txpkt *p = &q->pkts[i];
        size_t o = 0;
        while (o < nopen && !same_dest(q, &q->pkts[q->first[open_msg[o]]], p)) o++;
        if (o < nopen && q->gso) {
            uint32_t m = open_msg[o];
            if (!q->closed[m] && p->len <= q->seg[m] && q->nsegs[m] < SML_GSO_SEGS &&
                q->bytes[m] + p->len <= SML_GSO_BYTES) {
                q->msg_of[i] = m;
                q->nsegs[m]++;
                q->bytes[m] += p->len;
                if (p->len < q->seg[m]) q->closed[m] = 1;
                continue;
            }
        }
        uint32_t m = (uint32_t)nm++;
        q->msg_of[i] = m;
        q->seg[m] = p->len;
        q->nsegs[m] = 1;
        q->bytes[m] = p->len;
        q->first[m] = (uint32_t)i;
        q->closed[m] = 0;
        if (o < nopen) open_msg[o] = m;
        else if (nopen < OPEN) open_msg[nopen++] = m;
        else open_msg[(i % OPEN)] = m;   /* more destinations than slots: forget one (less batching) */
    }
    /* 2. lay out each message's iovecs contiguously, in packet order */
    uint32_t at = 0;
    for (size_t m = 0; m < nm; m++) {
        q->cursor[m] = at;
        at += q->nsegs[m];
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t m = q->msg_of[i];
        q->iov[q->cursor[m]].iov_base = q->pkts[i].buf;
        q->iov[q->cursor[m]].iov_len = q->pkts[i].len;
        q->cursor[m]++;
    }
    for (size_t m = 0; m < nm; m++) {
        struct msghdr *h = &q->msgs[m].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_iov = &q->iov[q->cursor[m] - q->nsegs[m]];
        h->msg_iovlen = q->nsegs[m];
        if (!q->connected) {
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
    while (done < nm) {
        size_t chunk = nm - done < 1024 ? nm - done : 1024;
        int r = sendmmsg(q->fd, q->msgs + done, (unsigned)chunk, 0);
        if (r > 0) {
            for (int k = 0; k < r; k++) {
                q->sent += q->msgs[done + k].msg_hdr.msg_iovlen;
                if (q->msgs[done + k].msg_hdr.msg_iovlen > 1) q->gso_msgs++;
            }
            done += (size_t)r;
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        int err = r < 0 ? errno : EIO;
        if (err == ECONNREFUSED) return -ECONNREFUSED;
        struct msghdr *h = &q->msgs[done].msg_hdr;
        if (h->msg_iovlen > 1 && (err == EINVAL || err == EIO || err == EOPNOTSUPP || err == ENOPROTOOPT ||
                                  err == EMSGSIZE)) {
            q->gso = 0;   /* the kernel or the path does not take GSO: one datagram per message from now */
            int rc = send_plain(q, h);
            if (rc) return rc;
        } else {
            q->errors += h->msg_iovlen;   /* buffer full or unreachable: like a loss */
        }
        done++;
    }
    return 0;
}

int sml_rxq_init(sml_rxq *q, int fd, size_t nbufs, int gro) {
    memset(q, 0, sizeof *q);
    q->fd = fd;
    q->nbufs = nbufs;
    if (gro) {
        int one = 1;
        gro = setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof one) == 0;
    }
    q->gro = gro;
    q->bufsize = gro ? SML_GRO_BUF : SML_PLAIN_BUF;
    q->bufs = malloc(nbufs * q->bufsize);
    q->msgs = calloc(nbufs, sizeof *q->msgs);
    q->iov = calloc(nbufs, sizeof *q->iov);
    q->from = calloc(nbufs, sizeof *q->from);
    q->ctl = calloc(nbufs, CTL_LEN);
    if (!q->bufs || !q->msgs || !q->iov || !q->from || !q->ctl) {
        sml_rxq_free(q);
        return -1;
    }
    for (size_t i = 0; i < nbufs; i++) {
        q->iov[i].iov_base = q->bufs + i * q->bufsize;
        q->iov[i].iov_len = q->bufsize;
        q->msgs[i].msg_hdr.msg_iov = &q->iov[i];
        q->msgs[i].msg_hdr.msg_iovlen = 1;
    }
    return 0;
}

void sml_rxq_free(sml_rxq *q) {
    if (q->gro) {
        int zero = 0;
        setsockopt(q->fd, SOL_UDP, UDP_GRO, &zero, sizeof zero);
    }
    free(q->bufs);
    free(q->msgs);
    free(q->iov);
    free(q->from);
    free(q->ctl);
    memset(q, 0, sizeof *q);
}

int sml_rxq_recv(sml_rxq *q) {
    for (size_t i = 0; i < q->nbufs; i++) {
        struct msghdr *h = &q->msgs[i].msg_hdr;
        h->msg_name = &q->from[i];
        h->msg_namelen = sizeof q->from[i];
        h->msg_control = q->ctl + i * CTL_LEN;
        h->msg_controllen = CTL_LEN;
        h->msg_flags = 0;
    }
    int r = recvmmsg(q->fd, q->msgs, (unsigned)q->nbufs, MSG_DONTWAIT, NULL);
    if (r >= 0) return r;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    return -errno;
}

size_t sml_rxq_seg(sml_rxq *q, int i) {
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
