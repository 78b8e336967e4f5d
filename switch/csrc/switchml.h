/* commlib SwitchML data path: its part of the interface of commlib._native (switch/csrc/build_native.py).
 *
 * Packet (all fields big-endian; SML_HDR_LEN = 20 bytes of header, then the payload):
 *
 *   off len field
 *    0   1  type       SML_DATA (worker -> switch), SML_RESULT (switch -> worker),
 *                      SML_NACK (switch -> worker: the job is unknown to this switch)
 *    1   1  flags      bits 0-1 size code: 0 no payload (exponent only), 1 = 64, 2 = 256 int32 (Tofino's
 *                      sizes), 3 = the job's packet size (values per packet agreed at registration,
 *                      1..SML_MAX_ELEMS: a software switch sizes packets by the path, not by registers);
 *                      a payload is always the job's size;
 *                      bit 2 SML_F_NONFINITE: a region of one flag byte per payload element
 *                      follows the payload (SML_NF_* bits, OR-ed by the switch);
 *                      bit 3 SML_F_MAC: the packet ends with its MAC;
 *                      bit 4 SML_F_STAMP (RESULT only): the stamp follows the payload and region
 *    2   1  job        job number the switch assigned at registration
 *    3   1  rank       sender's rank in the job (RESULT: the rank whose packet it answers)
 *    4   4  packet id  the low 32 bits of the worker-local 64-bit packet id, echoed by the switch
 *                      (the high bits are implied and authenticated: see the MAC)
 *    8   2  pool index bit 15 = set, bits 0-14 = slot within the job's pool
 *   10   1  exponent   int8 block exponent (max|x| < 2^e); DATA: the sender's, RESULT: the
 *                      max over workers; SML_EXP_NONE (-128): zero block / no exponent
 *   11   1  code       NACK reason (SML_NACK_*), else 0
 *   12   4  token      job token check: first 4 bytes of sha256(job token)
 *   16   4  checksum   tp_checksum (transport.h) of bytes 0-19, this field 0 when summing
 *   20  4k  payload    k = 0 or the job's values per packet, big-endian int32 (the partial last block
 *                      zero-padded)
 *   ..   k  nf region  only with SML_F_NONFINITE
 *   ..   8  stamp      only with SML_F_STAMP (every RESULT has it, DATA never): the switch's share of
 *                      the round, big-endian uint32 nanoseconds summed over the round's nworkers
 *                      contributions: queue (kernel arrival -> processing starts), then processing
 *                      (until the completing packet's result is built; the result's MAC and send
 *                      are not in it, the MAC covers the stamp). Per packet round, not per slot
 *                      window: a round's contributions meet in one slot anyway, so the sums cost two
 *                      adds per packet and no state beyond the slot; saturating at 2^32-1
 *   ..   8  seq        RESULT with SML_F_MAC only: the switch's result number, its MAC's nonce
 *   ..  16  mac        only with SML_F_MAC: the MAC (below) of every byte before it, so a packet cannot
 *                      be forged or altered without the key, and a replayed one carries an old
 *                      packet id (see the version rule below). A job registered with a key (the
 *                      authenticated default) takes only DATA with a valid MAC and sends only RESULTs
 *                      with one; drops are counted (drop_bad_mac). NACKs carry none (the switch has
 *                      no key for a job it does not know): an authenticated worker treats one as a
 *                      hint it reports only if no result comes before its timeout.
 *
 * The MAC: tp_mac (transport.h), the job's algorithm (AES-256-GCM or ChaCha20-Poly1305 from OpenSSL,
 * agreed at registration) as a nonce-based MAC under HKDF-SHA256(job key, "commlib switchml packets"
 * and, for AES-256-GCM, " aes-256-gcm"), over id64 || packet, where id64 is the full
 * 64-bit packet id, big-endian (of the packet for DATA, of the round answered for a RESULT), then
 * the packet's bytes before the MAC. Nonce (12 bytes): type (SML_DATA or SML_RESULT), then for
 * DATA the sender's rank, two zero bytes and id64; for a RESULT three zero bytes and its seq.
 * Why every nonce MACs one message only:
 *   - job keys are per registration (the job nonce is fresh), so nonces never meet another job's;
 *     a job's streams (one per data-plane thread of a switch, switch/switchml.py) each have their own
 *     key (switch/auth.py's stream_key of the job key), their ids and ranks coinciding;
 *   - DATA: a rank builds each packet id once (ids grow by a tensor's packets after every call,
 *     a failed one included, and never wrap in 64 bits); a retransmission resends the same bytes
 *     (same nonce, same message, same MAC: nothing new to an observer); ranks and types differ;
 *   - RESULT: the switch numbers every result it builds (seq, per job, from a random 64-bit
 *     start), a multicast's copies are one build; so a switch restarted with a replayed
 *     registration (same job key) starts elsewhere in 2^64 too.
 * Replays: a valid MAC is not enough, the packet id is each slot set's version (below) and the
 * worker takes a result only for its outstanding packet. Both sides carry 32 bits of the id and
 * extend them to 64 bits (the switch: the id nearest the job's newest accepted id; the worker:
 * its newest sent id or before) and the MAC covers those 64 bits: a packet replayed 2^32 ids
 * later extends to an id its MAC was not made for and is dropped (drop_bad_mac), where an id
 * inside the MAC only would have wrapped back into a live round. sml_testing_id_bits shrinks
 * the 32 bits on the wire, so tests can wrap them.
 *
 * Switch semantics per DATA packet from rank w with packet id i to (slot s, set X), as in
 * SwitchML, with the packet id as the set's version (every rank streams the same ids, growing):
 *   the set's first use, or i newer than the set's round and that round complete: a new round,
 *   overwrite values/exponent (lazy clearing), bitmap = {w};
 *   i = the set's round, bit w clear: add (int32, wrapping), max exponent, countdown--; the
 *   completing packet is sent to every worker of the job (software multicast), the others are
 *   consumed; bit w set (a retransmission): complete -> unicast replay of the stored result to
 *   the sender, incomplete -> dropped;
 *   i older than the set's round: a late packet (reordered, or a retransmission that the result
 *   overtook) of a round already finished and reused: dropped (drop_late), never aggregated;
 *   i newer while the set's round is incomplete: ranks out of step, dropped (drop_malformed).
 * SwitchML's one set bit tells the current round from the previous one only; a packet delayed
 * past a whole round reached a set just reused and became its first contribution.
 *
 * Hierarchy (jobs of more than SML_MAX_WORKERS ranks): a job on a leaf switch may have a parent, a
 * spine switch on which the leaf is rank `rank` of the parent's job (sml_switch_set_parent). Once a
 * set of the leaf is complete, its partial sum (values, max exponent, flags) goes up as that rank's
 * DATA packet, with the round's packet id, slot and set (every leaf streams the ids its workers do),
 * MACed under the parent job's key with the DATA nonce of the leaf's rank: a worker packet in all but
 * its sender. The set then waits: its workers' retransmissions are dropped (drop_incomplete; never
 * added twice), and the leaf resends the identical packet on its own timer (up_rto, doubling up to
 * up_rto_max) until the parent's RESULT for that id comes back (at most `tries` times: a set whose parent never answers
 * is abandoned, so a parent address is never flooded for the job's life); it then holds the job's sum, which
 * the leaf sends to every worker of its own job (and replays to retransmissions, as on one switch).
 * The parent's RESULT is checked as a worker checks one (MAC under the parent key, its id the set's
 * round), so a replayed or forged one is dropped (drop_bad_mac, drop_late). Workers quantize for the
 * whole job's ranks (sml_worker_new's nworkers), so the two-level int32 sum cannot overflow and
 * equals one switch's bit for bit. */
#ifndef COMMLIB_SWITCHML_H
#define COMMLIB_SWITCHML_H
#include <stddef.h>
#include <stdint.h>

#define SML_HDR_LEN 20
#define SML_CSUM_OFF 16
#define SML_MAX_ELEMS 8192   /* values per packet: a packet with its flag region stays under 64 KiB */
#define SML_MAX_POOL_VALUES (32768 * 256)   /* slots x values per packet of one job (its memory on the switch) */
#define SML_MAC_LEN 16
#define SML_SEQ_LEN 8
#define SML_STAMP_LEN 8
#define SML_MAX_PKT (SML_HDR_LEN + SML_MAX_ELEMS * 5 + SML_STAMP_LEN + SML_SEQ_LEN + SML_MAC_LEN)
#define SML_MAX_WORKERS 64
#define SML_MAX_JOBS 256
#define SML_MAX_SLOTS 32768
#define SML_EXP_NONE (-128)
/* A leaf's upward resend timer (sml_switch_set_parent): bounds that keep the timer a timer. */
#define SML_UP_RTO_MIN_US 50            /* the first resend's timer, at least */
#define SML_UP_RTO_FLOOR_US 10000        /* the doubled timer's cap, at least */
#define SML_UP_RTO_MAX_US 60000000       /* either, at most */
#define SML_UP_MAX_TRIES 100000

#define SML_DATA 1
#define SML_RESULT 2
#define SML_NACK 3

#define SML_F_SIZE 3
#define SML_SIZE_JOB 3      /* size code: the job's values per packet */
#define SML_F_NONFINITE 4
#define SML_F_MAC 8
#define SML_F_STAMP 16
#define SML_KEY_LEN 16

#define SML_NACK_UNKNOWN_JOB 1

/* per-element flag bits of the nonfinite region */
#define SML_NF_NAN 1
#define SML_NF_POSINF 2
#define SML_NF_NEGINF 4
#define SML_NF_RANGE 8      /* finite but |x| >= 2^127: cannot be quantized */

/* ---- switch ------------------------------------------------------------------------------ */

typedef struct sml_counters {
    uint64_t pkts_recv;         /* packets accepted for the job (after validation and the simulator) */
    uint64_t aggregated;        /* new contributions (overwrite or add) */
    uint64_t results;           /* result packets sent on completion (one per worker) */
    uint64_t replays;           /* retransmissions answered by a unicast replay */
    uint64_t drop_incomplete;   /* retransmissions to an incomplete slot */
    uint64_t drop_late;         /* packets of a round the slot has finished and reused (reordered, late) */
    uint64_t drop_token;        /* wrong job token */
    uint64_t drop_bad_mac;      /* no MAC, or a wrong one, on a job registered with a key */
    uint64_t drop_sender;       /* rank not in the job, or source address not the rank's */
    uint64_t drop_malformed;    /* bad slot index, size or packet id mismatch within a slot */
    uint64_t drop_sim_ingress;  /* drop simulator */
    uint64_t drop_sim_egress;
    uint64_t dup_sim;           /* packets duplicated by the simulator */
    /* the switch's own share of an accepted packet's round trip (per job; 0 in slot groups):
     * queue: kernel arrival -> processing starts (socket and batch); processing: until its result
     * (if it completed the slot) is queued for sending */
    uint64_t queue_ns, proc_ns;
    /* a leaf's upward stream (0 without a parent): partial sums sent to the parent, resent on the
     * leaf's timer, and the parent's results taken */
    uint64_t up_sent, up_resends, up_results, up_abandoned;
    /* concurrency (the IMC'20 study's Figure 7b; per job, 0 in slot groups): ranks_per_ms[k] = the
     * milliseconds (by packet arrival) in which the switch got accepted packets of exactly k ranks;
     * a millisecond is counted once a packet of a later one arrives */
    uint64_t ranks_per_ms[65];   /* SML_MAX_WORKERS + 1 (cffi reads plain numbers) */
} sml_counters;

typedef struct sml_global {
    uint64_t pkts_recv;         /* every datagram received */
    uint64_t pkts_sent;         /* every datagram sent */
    uint64_t drop_short;        /* shorter than a header or wrong length for its size code */
    uint64_t drop_checksum;
    uint64_t drop_type;
    uint64_t drop_unknown_job;  /* stale or unregistered job number (answered by a NACK) */
    uint64_t nacks;
    uint64_t batches;           /* recvmmsg calls that returned packets */
    uint64_t busy_ns;           /* time in recvmmsg/processing/sendmmsg with packets */
    uint64_t idle_ns;           /* time waiting in poll() */
    uint64_t send_errors;
    uint64_t gso_messages;      /* sendmmsg messages that carried several datagrams */
    uint64_t cpu_ns;            /* CPU time of the data-plane thread (user + system) */
    uint64_t run_ns;            /* wall time spent in sml_switch_run */
} sml_global;

/* One sml_switch is one data-plane thread's: its socket, its jobs' slots, its counters. A switch of
 * K threads is K of them sharing nothing (each job registered on each with its share of the slots,
 * switch/switchml.py), so no lock is shared on the packet path. */
typedef struct sml_switch sml_switch;

/* fd: a bound UDP socket (IPv4). offload: use UDP GSO/GRO where the kernel has them (several
 * datagrams per system call; each is still its own packet on the wire). Thread-safe calls; a
 * control call holds the switch's lock only to copy (it allocates and frees outside it). */
sml_switch *sml_switch_new(int fd, uint32_t max_slots, uint32_t group_slots, int offload);
void sml_switch_free(sml_switch *sw);
/* Register job `job` (0..255) with nworkers ranks and a pool of nslots slots of elems values per
 * packet (1..SML_MAX_ELEMS; nslots * elems <= SML_MAX_POOL_VALUES); key: the job key (SML_KEY_LEN bytes) its packets are authenticated with, or NULL (a
 * trusted fabric: no MAC); mac: the job's MAC algorithm (TP_MAC_*, transport.h; ignored without a key).
 * Returns 0 or an SML_ADD_* error. */
#define SML_ADD_IN_USE (-1)
#define SML_ADD_ARG (-2)
#define SML_ADD_NO_SLOTS (-3)
#define SML_ADD_NOMEM (-4)
int sml_switch_add_job(sml_switch *sw, int job, uint32_t token, int nworkers, uint32_t nslots, uint32_t elems,
                       const uint8_t *key, int mac);
/* Address of a rank (IPv4 address and port in host order). */
int sml_switch_set_addr(sml_switch *sw, int job, int rank, uint32_t ipv4, uint16_t port);
int sml_switch_remove_job(sml_switch *sw, int job);
/* Make job `job` a leaf: its complete sets go to the parent switch at ipv4:port (host order) as rank
 * `rank` of the parent's job `parent_job` with `token` (the parent's token check), MACed under key (the
 * parent job's stream key, SML_KEY_LEN bytes, or NULL when the parent's job has none; mac: the parent job's
 * MAC algorithm, TP_MAC_*); resent on a timer
 * that follows the parent's measured round trip (transport.h's tp_rtt, as a worker's: its results, which
 * include the spine's wait for the other leaves) within [rto_ms, rto_max_ms], doubling on each resend of a
 * set (SML_UP_RTO_MIN_US <= 1000 rto_ms <= 1000 rto_max_ms, SML_UP_RTO_FLOOR_US
 * <= 1000 rto_max_ms <= SML_UP_RTO_MAX_US; NaN refused), at most `tries` times (1..SML_UP_MAX_TRIES): then the set is
 * abandoned (up_abandoned) and its workers time out. Before the job's first packet. 0, or -1 for a bad
 * argument or a job that is not active or has a parent already. A RESULT from a parent is offered to
 * each leaf job of that parent job until one takes it. */
int sml_switch_set_parent(sml_switch *sw, int job, uint32_t ipv4, uint16_t port, int parent_job, int rank,
                          uint32_t token, const uint8_t *key, int mac, double rto_ms, double rto_max_ms,
                          uint32_t tries);
uint32_t sml_switch_free_slots(sml_switch *sw);
/* Drop simulator: probabilities of dropping a packet on ingress / a result on egress, and of
 * duplicating a packet (on ingress and on egress). */
void sml_switch_set_sim(sml_switch *sw, double ingress, double egress, double duplicate, uint64_t seed);
/* Copy counters out: job totals, one slot group of a job, the switch-wide ones. 0 or -1. */
int sml_switch_job_counters(sml_switch *sw, int job, sml_counters *out);
int sml_switch_group_counters(sml_switch *sw, int job, uint32_t group, sml_counters *out);
uint32_t sml_switch_groups(sml_switch *sw, int job);
void sml_switch_global_counters(sml_switch *sw, sml_global *out);
/* Serve packets for up to max_ms milliseconds, then return (so the caller can stop it).
 * Call from one thread at a time. Returns packets handled, or -errno on a socket error. */
long sml_switch_run(sml_switch *sw, int max_ms);

/* ---- worker ------------------------------------------------------------------------------ */

typedef struct sml_worker_counters {
    uint64_t sent;              /* packets sent, resends included */
    uint64_t received;          /* results accepted */
    uint64_t duplicates;        /* results for packets already answered (or of an earlier tensor) */
    uint64_t resends;           /* packets resent on a timer's expiry */
    uint64_t held;              /* expiries of late packets (nothing sent later answered yet): not resent, a probe went */
    uint64_t ignored;           /* malformed, foreign or unexpected packets */
    uint64_t bad_mac;           /* results without a valid MAC (authenticated workers) */
    uint64_t nacks;             /* NACKs received (fatal at once only without a key) */
    uint64_t tensors;
    uint64_t elements;
    uint64_t wait_ns;           /* time blocked in poll() */
    uint64_t busy_ns;           /* time quantizing, sending, receiving */
    uint64_t cpu_ns;            /* CPU time of the calling thread in sml_worker_allreduce */
    uint64_t srtt_ns;           /* smoothed round trip of a packet (RFC 6298) */
    uint64_t rto_ns;            /* timer of a new packet: srtt + max(4 rttvar, srtt/2), within [rto_ms, rto_max_ms] */
    /* the latency breakdown, over the results accepted (one per round): the switch's share its
     * RESULTs piggyback (sums over the rounds' contributions, server_packets of them) and this
     * worker's round time (first send of its packet -> its result, resends included) */
    uint64_t server_queue_ns, server_proc_ns, server_packets;
    uint64_t round_ns;
} sml_worker_counters;

typedef struct sml_worker sml_worker;

/* fd: a UDP socket connected to the switch. window = the job's pool size (slots). offload: as for
 * the switch (UDP GSO/GRO). key: the job key (SML_KEY_LEN bytes), or NULL as the job registered; mac: the
 * job's MAC algorithm (TP_MAC_*). */
sml_worker *sml_worker_new(int fd, int job, int rank, uint32_t token, int nworkers, uint32_t window,
                           uint32_t elems, double rto_ms, double rto_max_ms, int offload, const uint8_t *key,
                           int mac);
void sml_worker_free(sml_worker *w);
void sml_worker_counters_get(sml_worker *w, sml_worker_counters *out);

/* At most `chains` packets in flight (1..window; 0: the whole window) from the next tensor on, as a
 * tensor of fewer blocks than the window streams (autotune's switch_inflight_share). Every rank must
 * set the same before the same tensor: it decides which slot each packet takes. */
void sml_worker_set_inflight(sml_worker *w, uint32_t chains);

/* Results of sml_worker_allreduce: >= 0 success, SML_R_* bits say what the result holds. */
#define SML_R_NONFINITE 1       /* Inf/NaN from some rank, propagated into `out` */
#define SML_R_RANGE 2           /* some rank had finite |x| >= 2^127 (elements set to NaN) */
#define SML_E_TIMEOUT (-1)      /* no progress for timeout_ms */
#define SML_E_REFUSED (-2)      /* the switch's port is closed (ICMP port unreachable) */
#define SML_E_NACK (-3)         /* the switch does not know this job (with a key: and no result came) */
#define SML_E_SOCKET (-4)       /* another socket error; errno in sml_worker_errno */
#define SML_E_NOMEM (-5)

/* Sum `n` elements across the job through the switch.
 * int32 (is_int = 1): x, out are int32_t, exact (wrapping) sum; exps/nf/mexp unused.
 * float32: exps[b] = this rank's exponent of block b (commlib.kernels.block_exponents over
 * finite values), nf[b] = 1 where block b holds non-finite or out-of-range values, mexp = scratch
 * of nblocks int8 (receives the agreed exponents). One block = one packet of `elems`.
 * Exponents travel one window ahead. out may alias nothing; x is not modified. */
int sml_worker_allreduce(sml_worker *w, int is_int, const void *x, void *out, size_t n, const int8_t *exps,
                         const uint8_t *nf, int8_t *mexp, int timeout_ms);
int sml_worker_errno(sml_worker *w);

/* Testing only: carry `bits` (1..32) bits of the packet id on the wire instead of 32, so that a
 * test wraps them within a few hundred packets (the ids stay 64-bit, and authenticated, inside).
 * For every switch and worker of this process; set it before any streams. */
void sml_testing_id_bits(int bits);

#endif
