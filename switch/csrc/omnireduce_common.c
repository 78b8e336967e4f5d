/* OmniReduce: addresses and the send queue behind the loss/duplication simulator (transport.h
 * does the batching). */
#include "omnireduce_internal.h"

#include <openssl/rand.h>

int omr_parse_addr(const char *ip, int port, struct sockaddr_in *out) {
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    out->sin_port = htons((uint16_t)port);
    return inet_pton(AF_INET, ip, &out->sin_addr) == 1 ? 0 : -1;
}

int omr_sendq_init(omr_sendq *q, int fd, int copy, uint64_t *rng) {
    memset(q, 0, sizeof *q);
    q->rng = rng;
    return tp_txq_init(&q->q, fd, OMR_SENDQ, TP_GSO | (copy ? TP_COPY : 0));
}

void omr_sendq_free(omr_sendq *q) { tp_txq_free(&q->q); }

void omr_sendq_push_ready(omr_sendq *q, const struct sockaddr_in *to, const omr_hdr *h, const void *payload, size_t len,
                          const uint8_t *trailer, uint32_t tlen) {
    if (q->loss > 0 && tp_uniform(q->rng) < q->loss) {
        q->sim_dropped++;
        return;
    }
    int copies = 1;
    if (q->dup > 0 && tp_uniform(q->rng) < q->dup) {
        q->sim_duplicated++;
        copies = 2;
    }
    for (int k = 0; k < copies; k++) {
        tp_txq_add(&q->q, to, h, sizeof *h, payload, (uint32_t)len);
        if (tlen) tp_txq_trailer(&q->q, trailer, tlen);
    }
}

void omr_sendq_push(omr_sendq *q, const struct sockaddr_in *to, const omr_hdr *h, const void *payload, size_t len,
                    tp_mac *mac, uint64_t *counter) {
    omr_hdr copy = *h;
    uint8_t trailer[OMR_MAC_BYTES];
    if (mac) copy.flags |= OMR_F_MAC;
    copy.csum = omr_hdr_csum(&copy, payload, len);
    if (mac) omr_sign(mac, (*counter)++, &copy, payload, len, NULL, 0, trailer);
    omr_sendq_push_ready(q, to, &copy, payload, len, trailer, mac ? OMR_MAC_BYTES : 0);
}

int omr_random64(uint64_t *out) { return RAND_bytes((unsigned char *)out, sizeof *out) == 1 ? 0 : -1; }

int omr_keepalive_packet(uint8_t *buf, uint32_t job, uint32_t key, int rank, const uint8_t *mac_key, int mac) {
    omr_hdr h = {OMR_KEEPALIVE, (uint8_t)(mac_key ? OMR_F_MAC : 0), (uint16_t)rank, job, key,
                 (uint32_t)(tp_wall_ns() / 1000000000u), 0, 0, 0, 0, 0, 0};
    h.csum = omr_hdr_csum(&h, NULL, 0);
    memcpy(buf, &h, sizeof h);
    if (!mac_key) return (int)sizeof h;
    tp_mac *m = tp_mac_new(mac_key, OMR_MAC_LABEL, mac);
    uint64_t counter;
    if (!m || omr_random64(&counter)) {   /* no MAC: the aggregator drops it, the job's idle timer says why */
        tp_mac_free(m);
        return -1;
    }
    omr_sign(m, counter, &h, NULL, 0, NULL, 0, buf + sizeof h);
    tp_mac_free(m);
    return (int)sizeof h + OMR_MAC_BYTES;
}
