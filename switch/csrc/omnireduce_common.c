/* OmniReduce: block bitmap, checksum and the batched UDP queues shared by worker and aggregator. */
#include "omnireduce_internal.h"

#include <math.h>
#include <stdio.h>

size_t omr_block_mask(const void *x, size_t n, int dtype, size_t block, double threshold, uint8_t *mask) {
    size_t count = 0;
    if (block == 0) return 0;
    for (size_t b = 0, start = 0; start < n; b++, start += block) {
        size_t end = start + block < n ? start + block : n;
        uint8_t nz = 0;
        if (dtype == OMR_INT32) {
            const int32_t *v = (const int32_t *)x;
            if (threshold < 0.5) {                 /* exact: any non-zero integer */
                int32_t acc = 0;
                for (size_t i = start; i < end; i++) acc |= v[i];
                nz = acc != 0;
            } else {
                for (size_t i = start; i < end && !nz; i++) nz = fabs((double)v[i]) > threshold;
            }
        } else {
            const float *v = (const float *)x;
            float t = (float)threshold;
            if (t == 0.0f) {                       /* exact: any bit but the sign bit (NaN counts) */
                const uint32_t *u = (const uint32_t *)x;
                uint32_t acc = 0;
                for (size_t i = start; i < end; i++) acc |= u[i] & 0x7fffffffu;
                nz = acc != 0;
            } else {
                for (size_t i = start; i < end && !nz; i++) nz = !(fabsf(v[i]) <= t);   /* NaN is non-zero */
            }
        }
        mask[b] = nz;
        count += nz;
    }
    return count;
}

uint32_t omr_checksum(const void *buf, size_t len) {
    omr_ck c = {0, 0, 0, 0};
    omr_ck_update(&c, buf, len);
    return omr_ck_final(&c);
}

int omr_parse_addr(const char *ip, int port, struct sockaddr_in *out) {
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    out->sin_port = htons((uint16_t)port);
    return inet_pton(AF_INET, ip, &out->sin_addr) == 1 ? 0 : -1;
}

int omr_sendq_init(omr_sendq *q, int fd, int copy, uint64_t *rng) {
    memset(q, 0, sizeof *q);
    q->fd = fd;
    q->copy = copy;
    q->rng = rng;
    q->gso = 1;
    if (copy && !(q->arena = malloc(OMR_ARENA))) return -1;
    return 0;
}

void omr_sendq_free(omr_sendq *q) {
    free(q->arena);
    q->arena = NULL;
}

static void push_one(omr_sendq *q, const struct sockaddr_in *to, const omr_hdr *h, const void *payload, size_t len) {
    if (q->n == OMR_SENDQ || (q->copy && q->arena_used + len > OMR_ARENA)) omr_sendq_flush(q);
    int i = q->n++;
    q->addr[i] = *to;
    q->hdr[i] = *h;
    if (len && q->copy) {
        memcpy(q->arena + q->arena_used, payload, len);
        payload = q->arena + q->arena_used;
        q->arena_used += len;
    }
    q->payload[i] = (const uint8_t *)payload;
    q->len[i] = (uint32_t)len;
}

void omr_sendq_push_ready(omr_sendq *q, const struct sockaddr_in *to, const omr_hdr *h, const void *payload, size_t len) {
    if (q->loss > 0 && omr_uniform(q->rng) < q->loss) {
        q->sim_dropped++;
        return;
    }
    push_one(q, to, h, payload, len);
    if (q->dup > 0 && omr_uniform(q->rng) < q->dup) {
        q->sim_duplicated++;
        push_one(q, to, h, payload, len);
    }
}

void omr_sendq_push(omr_sendq *q, const struct sockaddr_in *to, const omr_hdr *h, const void *payload, size_t len) {
    omr_hdr copy = *h;
    copy.csum = omr_hdr_csum(&copy, payload, len);
    omr_sendq_push_ready(q, to, &copy, payload, len);
}

static inline int same_addr(const struct sockaddr_in *a, const struct sockaddr_in *b) {
    return a->sin_addr.s_addr == b->sin_addr.s_addr && a->sin_port == b->sin_port;
}

/* group the queue per destination (stable), then cut GSO messages: equal-sized segments, the
 * last one possibly shorter, at most OMR_GSO_SEGS and OMR_GSO_BYTES each */
static int build_messages(omr_sendq *q) {
    int m = 0, k = 0;
    memset(q->used, 0, (size_t)q->n);
    for (int i = 0; i < q->n; i++) {
        if (q->used[i]) continue;
        for (int j = i; j < q->n; j++)
            if (!q->used[j] && same_addr(&q->addr[j], &q->addr[i])) {
                q->order[k++] = j;
                q->used[j] = 1;
            }
    }
    int iov = 0;
    for (int p = 0; p < q->n;) {
        int first = q->order[p];
        uint32_t seg = (uint32_t)sizeof(omr_hdr) + q->len[first], bytes = 0, count = 0;
        struct msghdr *h = &q->msgs[m].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_name = &q->addr[first];
        h->msg_namelen = sizeof(struct sockaddr_in);
        h->msg_iov = &q->iov[iov];
        while (p < q->n) {
            int i = q->order[p];
            uint32_t size = (uint32_t)sizeof(omr_hdr) + q->len[i];
            if (count > 0 && (!q->gso || !same_addr(&q->addr[i], &q->addr[first]) || size > seg ||
                              count == OMR_GSO_SEGS || bytes + size > OMR_GSO_BYTES))
                break;
            q->iov[iov].iov_base = &q->hdr[i];
            q->iov[iov++].iov_len = sizeof(omr_hdr);
            if (q->len[i]) {
                q->iov[iov].iov_base = (void *)q->payload[i];
                q->iov[iov++].iov_len = q->len[i];
            }
            bytes += size;
            count++;
            p++;
            if (size < seg) break;                  /* a shorter segment ends the message */
        }
        h->msg_iovlen = (size_t)(&q->iov[iov] - h->msg_iov);
        if (count > 1) {
            h->msg_control = q->ctrl[m].buf;
            h->msg_controllen = CMSG_SPACE(sizeof(uint16_t));
            struct cmsghdr *c = CMSG_FIRSTHDR(h);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t gso = (uint16_t)seg;
            memcpy(CMSG_DATA(c), &gso, sizeof gso);
        }
        q->nsegs[m] = count;
        q->nbytes[m] = bytes;
        m++;
    }
    return m;
}

void omr_sendq_flush(omr_sendq *q) {
    if (q->n == 0) return;
    int m = build_messages(q), done = 0, stalls = 0;
    while (done < m) {
        int r = sendmmsg(q->fd, q->msgs + done, (unsigned)(m - done), 0);
        if (r > 0) {
            for (int i = done; i < done + r; i++) {
                q->pkts += q->nsegs[i];
                q->bytes += q->nbytes[i];
                q->messages++;
            }
            done += r;
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) && stalls++ < 100) {
            struct pollfd p = {q->fd, POLLOUT, 0};
            poll(&p, 1, 10);
            continue;
        }
        if (r < 0 && q->gso && q->nsegs[done] > 1 && (errno == EINVAL || errno == EIO || errno == ENOPROTOOPT ||
                                                      errno == EOPNOTSUPP || errno == EMSGSIZE)) {
            q->gso = 0;                             /* no UDP GSO here: one datagram per message from now on */
            int n = 0;                              /* requeue what was not sent, in order */
            int keep[OMR_SENDQ];
            for (int i = 0, p = 0; i < m; i++)
                for (uint32_t s = 0; s < q->nsegs[i]; s++, p++)
                    if (i >= done) keep[n++] = q->order[p];
            omr_hdr hdr[OMR_SENDQ];
            struct sockaddr_in addr[OMR_SENDQ];
            const uint8_t *payload[OMR_SENDQ];
            uint32_t len[OMR_SENDQ];
            for (int i = 0; i < n; i++) {
                hdr[i] = q->hdr[keep[i]]; addr[i] = q->addr[keep[i]];
                payload[i] = q->payload[keep[i]]; len[i] = q->len[keep[i]];
            }
            memcpy(q->hdr, hdr, sizeof hdr[0] * (size_t)n);
            memcpy(q->addr, addr, sizeof addr[0] * (size_t)n);
            memcpy(q->payload, payload, sizeof payload[0] * (size_t)n);
            memcpy(q->len, len, sizeof len[0] * (size_t)n);
            q->n = n;
            m = build_messages(q);
            done = 0;
            continue;
        }
        /* a dead or unreachable peer (ECONNREFUSED from an earlier ICMP, EHOSTUNREACH, ...):
         * that message is lost, which the protocol recovers from (or reports as a timeout) */
        done++;
    }
    q->n = 0;
    q->arena_used = 0;
}

void omr_enable_gro(int fd) {
    int one = 1;
    setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof one);
}

int omr_recvq_init(omr_recvq *q, int fd) {
    memset(q, 0, sizeof *q);
    q->fd = fd;
    if (!(q->bufs = malloc((size_t)OMR_RECV_BUF * OMR_RECV_MSGS))) return -1;
    for (int i = 0; i < OMR_RECV_MSGS; i++) {
        q->iov[i].iov_base = q->bufs + (size_t)i * OMR_RECV_BUF;
        q->iov[i].iov_len = OMR_RECV_BUF;
    }
    omr_enable_gro(fd);
    return 0;
}

void omr_recvq_free(omr_recvq *q) {
    free(q->bufs);
    q->bufs = NULL;
}

int omr_recvq_recv(omr_recvq *q, int timeout_ms) {
    q->nseg = q->nmsg = 0;
    struct pollfd p = {q->fd, POLLIN, 0};
    int r = poll(&p, 1, timeout_ms < 0 ? 0 : timeout_ms);
    if (r < 0) return errno == EINTR ? 0 : -errno;
    if (r == 0) return 0;
    for (int i = 0; i < OMR_RECV_MSGS; i++) {
        struct msghdr *m = &q->msgs[i].msg_hdr;
        memset(m, 0, sizeof *m);
        m->msg_name = &q->addr[i];
        m->msg_namelen = sizeof(struct sockaddr_in);
        m->msg_iov = &q->iov[i];
        m->msg_iovlen = 1;
        m->msg_control = q->ctrl[i].buf;
        m->msg_controllen = sizeof q->ctrl[i].buf;
    }
    for (int tries = 0; tries < 4; tries++) {
        r = recvmmsg(q->fd, q->msgs, OMR_RECV_MSGS, MSG_DONTWAIT, NULL);
        if (r >= 0) break;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        /* ECONNREFUSED & co report an earlier send to a dead port: not our receive's fault */
        if (errno != EINTR && errno != ECONNREFUSED && errno != EHOSTUNREACH && errno != ENETUNREACH)
            return -errno;
    }
    if (r < 0) return 0;
    q->messages += (uint64_t)r;
    q->nmsg = r;
    for (int i = 0; i < r; i++) {
        struct msghdr *m = &q->msgs[i].msg_hdr;
        uint32_t len = q->msgs[i].msg_len, gso = len;
        if (m->msg_flags & MSG_TRUNC) continue;     /* cannot happen with 64 KiB buffers */
        for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c))
            if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
                int v;
                memcpy(&v, CMSG_DATA(c), sizeof v);
                if (v > 0) gso = (uint32_t)v;
            }
        const uint8_t *base = q->bufs + (size_t)i * OMR_RECV_BUF;
        for (uint32_t off = 0; off < len && q->nseg < OMR_RECV_SEGS; off += gso) {
            q->seg[q->nseg] = base + off;
            q->seg_len[q->nseg] = len - off < gso ? len - off : gso;
            q->seg_msg[q->nseg] = (uint16_t)i;
            q->nseg++;
        }
    }
    return q->nseg;
}

const omr_hdr *omr_recvq_get(omr_recvq *q, int i, omr_hdr *out, const uint8_t **payload, size_t *payload_len) {
    size_t len = q->seg_len[i];
    if (len < sizeof(omr_hdr)) return NULL;
    const uint8_t *buf = q->seg[i];
    memcpy(out, buf, sizeof *out);
    *payload = buf + sizeof(omr_hdr);
    *payload_len = len - sizeof(omr_hdr);
    if (omr_hdr_csum(out, *payload, *payload_len) != out->csum) return NULL;
    return out;
}
