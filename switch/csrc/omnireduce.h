/* OmniReduce over UDP: its part of the interface of commlib._native (switch/csrc/build_native.py).
 *
 * A tensor is cut into blocks of `block` elements (per tensor, at most the job's block, which
 * sizes the aggregators' slots: a row-sparse tensor's block is whole rows, so one touched row
 * costs one row; the aggregator sums whatever length the round's first block has, and every
 * other block of the round must have that length); block b belongs to column b mod C. Each
 * column is an independent lock-step chain of rounds served by aggregator (column mod A) in
 * its slot (column / A). Round 0 is the bootstrap: every worker sends block `column` (as a
 * header-only ZERO packet when it is all zero) with `next` = its own next non-zero block in
 * the column (or OMR_INF). The aggregator adds what it gets and records each worker's `next`;
 * a round is complete when every worker whose `next` named its block has contributed, i.e.
 * min over workers of next > block. It then sends the sum to all workers with
 * next = min(next); the workers whose next equals it send that block in the next round, the
 * others stay silent. OMR_INF ends the column.
 *
 * Loss recovery (every packet is idempotent): workers resend their data packet, or a PULL
 * carrying how many results they hold, when a column is silent for `retransmit`; the
 * aggregator keeps the last OMR_SETS finished results of every slot (the shadow sets; the
 * paper keeps two) and replays the missing ones by unicast. A result may only overwrite a set
 * once every worker has acknowledged it: workers acknowledge in their data packets, and a
 * silent worker sends a header-only ACK every OMR_SETS/2 rounds, so uploads stay at the
 * worker's own non-zero blocks. Each slot keeps two tensor states (by sequence parity): a
 * packet of tensor t+1 proves that every worker finished tensor t-1.
 *
 * Packets are little-endian (hosts, not network order): a 40-byte omr_hdr, then the block
 * (absent with OMR_F_ZERO), then on a RESULT (OMR_F_STAMP, every RESULT has it) the aggregator's
 * share of the round, OMR_STAMP_BYTES: three uint32, the round's contributions (data packets
 * summed), their queue nanoseconds (kernel arrival -> handling) and their handling nanoseconds
 * (the completing packet's until its round is complete: not publishing nor the MAC, which covers
 * the stamp), each summed over the contributions, saturating at 2^32-1. Per round, not per slot
 * window: a column's rounds are lock-step, so a round is the aggregator's unit of work; the sums
 * cost two adds per data packet. csum (transport.h's tp_checksum) covers header (csum = 0),
 * payload and stamp.
 *
 * Authentication (a job registered with a job key, the default): every packet of the job, both
 * ways, has OMR_F_MAC set and ends with OMR_MAC_BYTES: an 8-byte nonce counter (little-endian),
 * then the 16-byte tag of tp_mac (transport.h: the job's algorithm, AES-256-GCM or ChaCha20-Poly1305
 * from OpenSSL, as a nonce-based MAC under HKDF-SHA256(job key, "commlib omnireduce packets" and, for
 * AES-256-GCM, " aes-256-gcm"), as switchml.h's) over the header as sent
 * (csum included), then a result's stamp, then the block (the stamp first: it and the header are
 * one small piece, the block the other). Nonce (12 bytes): the packet's type, a zero byte, its
 * `rank` field (little-endian 16 bits: the sender's rank for DATA/ACK/PULL/KEEPALIVE, the
 * aggregator's index for RESULT/STATUS/ERROR), the counter. Why a (key, nonce) pair MACs one
 * message only:
 *   - job keys are per registration (a fresh job nonce), so nonces never meet another job's;
 *   - the types of the two directions differ, and so do the senders of one direction (ranks;
 *     aggregator indexes);
 *   - a worker counts every packet it MACs (one counter per worker, across its aggregators), an
 *     aggregator every packet of a job it MACs (one result sent to every worker is one MAC), each
 *     from a random 64-bit start (RAND_bytes): a resent packet is MAC'd again under the next
 *     counter, never the same counter over other bytes;
 *   - a keepalive (made without the worker's state) takes a random counter.
 * Replays are the protocol's business: (seq, col, round) are inside the MAC, so a replayed packet is
 * one the protocol already treats as a duplicate. Only what a duplicate is answered with needs the
 * counter: the aggregator answers a worker's recovery request (a PULL, a resent DATA) for a column
 * only when its counter is past the last one it answered there, so a replayed request costs it no
 * results sent again (omnireduce_aggregator.c, answered_once).
 * Packets without a valid MAC are dropped and counted (bad_mac). ERRORs about a job the aggregator
 * does not know carry no MAC (it has no key for it): an authenticated worker reports one only if
 * no progress follows before its timeout, so a forged ERROR cannot end a job. */
#ifndef COMMLIB_OMNIREDUCE_H
#define COMMLIB_OMNIREDUCE_H
#include <stddef.h>
#include <stdint.h>

#define OMR_INF 0xFFFFFFFFu       /* `next` of a column with nothing left */
#define OMR_SETS 8                /* finished results kept per slot (even): bounds how far a slot runs ahead of a silent worker */
#define OMR_ACK_EVERY (OMR_SETS / 2)   /* a silent worker acknowledges every this many rounds */
#define OMR_HDR_BYTES 40
#define OMR_NONCE_BYTES 8         /* a MAC'd packet's nonce counter */
#define OMR_MAC_BYTES 24          /* what the MAC adds to a packet: the nonce counter and the 16-byte tag */
#define OMR_MAX_BLOCK 16000       /* elements: a block and its header fit in one datagram */
#define OMR_MAX_WORKERS 4096
#define OMR_MAX_JOBS 256          /* per aggregator */

/* message types: data path (C) */
#define OMR_DATA 1                /* worker -> aggregator: a block of a round */
#define OMR_RESULT 2              /* aggregator -> worker: a finished round */
#define OMR_ACK 3                 /* worker -> aggregator: `ack` results received (no reply) */
#define OMR_PULL 4                /* worker -> aggregator: ack, replay what I miss, or say whom you wait for */
#define OMR_STATUS 5              /* aggregator -> worker: waiting for rank `ack` (`next` ranks in all) */
#define OMR_ERROR 6               /* aggregator -> worker: packet refused; `next` = OMR_ERR_* */
#define OMR_KEEPALIVE 7           /* worker -> aggregator: rank `rank` of the job lives (no reply); seq: the
                                   * sender's wall clock in s, accepted within OMR_KEEPALIVE_WINDOW_S */
#define OMR_KEEPALIVE_WINDOW_S 30
/* control messages (register, unregister, counters) share the aggregator's port: a datagram whose
 * first byte is OMR_CONTROL ('{') is one, in switch/control.py's format, handled in Python. The C
 * loop hands Python only what may be one (a JSON object: '{' ... '}'), at most OMR_CTRL_RATE a
 * second from one source (address and port; a burst of OMR_CTRL_BURST) and OMR_CTRL_ALL_RATE from
 * all, and drops the rest (ctrl_dropped): a flood costs the aggregator what it costs the switch, a
 * receive and a look; running jobs need no control message (keepalives are OMR_KEEPALIVE). */
#define OMR_CONTROL 0x7B
#define OMR_CTRL_RATE 50
#define OMR_CTRL_BURST 16
#define OMR_CTRL_ALL_RATE 400
#define OMR_CTRL_ALL_BURST 64

#define OMR_F_ZERO 1              /* the block is all zero: no payload */
#define OMR_F_INT32 2             /* payload is int32 (else float32) */
#define OMR_F_ACKWAIT 4           /* STATUS: waiting for acknowledgements, not for blocks */
#define OMR_F_RESEND 8            /* DATA sent again by the timer: answer with a replay or a STATUS */
#define OMR_F_MAC 16              /* the packet ends with its MAC (OMR_MAC_BYTES) */
#define OMR_F_STAMP 32            /* RESULT: the stamp (OMR_STAMP_BYTES) follows the block */
#define OMR_STAMP_BYTES 12
#define OMR_KEY_LEN 16

#define OMR_FLOAT32 0             /* = TP_FLOAT32, TP_INT32 (transport.h) */
#define OMR_INT32 1

#define OMR_ERR_JOB 1             /* unknown job (aggregator restarted or job closed) */
#define OMR_ERR_KEY 2             /* wrong key for the job */
#define OMR_ERR_SLOT 3            /* column not served here or rank out of range */

/* return codes of omr_worker_allreduce */
#define OMR_OK 0
#define OMR_ETIMEOUT (-1)         /* no progress for timeout_s: see err_* in the stats */
#define OMR_EREFUSED (-2)         /* an aggregator refused our packets (err_agg, err_code) */
#define OMR_EPROTO (-3)           /* inconsistent result (err_agg, err_col) */
#define OMR_ESYS (-4)             /* socket error (err_code = errno) */
#define OMR_EARG (-5)
#define OMR_ENOMEM (-6)           /* out of memory for the call's per-column state (nothing was sent) */

typedef struct {
    uint8_t type, flags;
    uint16_t rank;
    uint32_t job, key, seq, col, round, block, next, ack, csum;
} omr_hdr;

typedef struct {
    uint64_t pkts_sent, bytes_sent, pkts_recv, bytes_recv;      /* UDP payload bytes */
    uint64_t data_sent, acks_sent, pulls_sent, resends, resend_bytes;     /* resend_bytes: all recovery uploads */
    uint64_t extra_recv_bytes;                                  /* duplicates, replays out of order, STATUS */
    uint64_t results_recv, status_recv, dup_recv, ooo_recv, bad_recv, bad_mac;
    uint64_t sim_dropped, sim_duplicated;
    uint64_t nblocks, ncols, own_blocks, union_blocks;          /* union: results with a payload */
    /* the latency breakdown, over the results accepted (results_recv rounds): the aggregators' share
     * their stamps carry (sums over server_packets contributions) and this worker's round times (a
     * column's previous result, or its bootstrap send, -> this result) */
    uint64_t server_queue_ns, server_proc_ns, server_packets, round_ns;
    int32_t err_agg, err_rank, err_col, err_code;               /* why it failed */
    uint32_t cols_left, err_nwaiting;
    double agg_silent_s;                                        /* how long err_agg has been silent */
    double srtt_us, rto_us;                                     /* round-trip estimate, timer */
    uint64_t cpu_ns;                                            /* the call's CPU time (its thread) */
} omr_wstats;

typedef struct {
    uint64_t pkts_recv, bytes_recv, pkts_sent, bytes_sent;
    uint64_t data_recv, results_sent, replays, status_sent, acks_recv, pulls_recv;
    uint64_t dup_recv, stale_recv, bad_recv, bad_mac, refused, ctrl_recv, rounds, sim_dropped, sim_duplicated;
    uint64_t ctrl_dropped, keepalives_recv;   /* control datagrams the C loop dropped; keepalives accepted */
    uint64_t queue_ns, proc_ns;   /* over every packet received: kernel arrival -> handling; handling */
    uint64_t cpu_ns;              /* CPU time of the thread(s) in omr_agg_run: receives, handling, sends */
} omr_astats;

/* worker: fd is a bound UDP socket owned by the caller */
typedef struct omr_worker omr_worker;
omr_worker *omr_worker_new(int fd, int rank, int nworkers, int ncols, int naggs, int block,
                           int retransmit_us, double loss, double dup, uint64_t seed);
/* mac_key: the job key (OMR_KEY_LEN bytes) the job registered with, or NULL (no MACs); mac: the job's MAC
 * algorithm (TP_MAC_*, transport.h) */
int omr_worker_set_agg(omr_worker *w, int index, const char *ip, int port, uint32_t job, uint32_t key,
                       const uint8_t *mac_key, int mac);
/* out must be zeroed; block: this tensor's elements per block, 1..the job's block (0: the job's),
 * the same on every rank; mask from cl_block_mask (kernels.h) with that block. One call per
 * tensor, GIL released. */
int omr_worker_allreduce(omr_worker *w, uint32_t seq, const void *in, void *out, size_t n, int dtype, int block,
                         const uint8_t *mask, double timeout_s, omr_wstats *st);
void omr_worker_free(omr_worker *w);
/* a keepalive of rank `rank` for job (job, key) of an aggregator, into buf (at least 64 bytes), MAC'd
 * under mac_key with algorithm mac (NULL: none): its length. The caller sends it from the rank's socket. */
int omr_keepalive_packet(uint8_t *buf, uint32_t job, uint32_t key, int rank, const uint8_t *mac_key, int mac);

/* aggregator: fd is a bound UDP socket owned by the caller */
typedef struct omr_agg omr_agg;
omr_agg *omr_agg_new(int fd, uint64_t seed);
/* returns the job id, or -1 (table full, out of memory, bad arguments); mac_key: the job key
 * (OMR_KEY_LEN bytes) its packets are authenticated with, or NULL (a trusted fabric); mac: its MAC algorithm
 * (TP_MAC_*, transport.h) */
int omr_agg_add_job(omr_agg *a, uint32_t key, int nworkers, int ncols, int naggs, int agg_index, int block,
                    double loss, double dup, const uint8_t *mac_key, int mac);
/* the bytes omr_agg_add_job allocates for a job of these arguments (valid ones): what a registration's
 * memory limit is checked against */
size_t omr_agg_job_bytes(int nworkers, int ncols, int naggs, int agg_index, int block);
int omr_agg_set_worker(omr_agg *a, int job, int rank, const char *ip, int port);
void omr_agg_remove_job(omr_agg *a, int job);
/* how long the job's most silent registered rank sent nothing valid (data, keepalive), in s */
double omr_agg_job_idle_s(omr_agg *a, int job);
/* serve for up to timeout_ms; returns the number of control packets waiting (>0: return early), <0 on error */
int omr_agg_run(omr_agg *a, int timeout_ms);
/* the oldest waiting control packet: its length (-1 if none); ip gets at least 64 bytes */
int omr_agg_pop_ctrl(omr_agg *a, uint8_t *buf, int cap, char *ip, int *port);
void omr_agg_stats(omr_agg *a, omr_astats *st);
void omr_agg_free(omr_agg *a);

#endif
