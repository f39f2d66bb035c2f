/* The engine's insides, shared by its files; not part of the ABI (collective.h is).
 *
 * The layers, as Gloo lays them out:
 *   comm.c         the ABI: a communicator made from its config, and ended
 *   collective.c   the ABI: checks a call, agrees on it (negotiate), composes the algorithms
 *   local.c        algorithms within one host, written against the shared-memory transport
 *   ring.c         algorithms between hosts, written against the ring link
 *   alltoall.c     the alltoall across hosts: local, ring and local again
 *   pipeline.c     the large allreduce across hosts: local phases and the ring, overlapped in segments
 *   shm.c          transport: a host's segment, its steps, waits and liveness checks
 *   link.c         transport: the TCP ring connections of a host's leader, streams and abort records
 *   records.c      transport: the ring's bytes as AES-256-GCM records, where the ring is encrypted
 *   crypto.c       libcrypto, loaded at run time: HKDF-SHA256 and AES-256-GCM
 *   describe.c     what a call is (descriptors, verdicts) and the messages that name it
 *   progress.c     the record of where this rank's collectives stand, for its supervisor
 *   reduce.c       the element-wise kernels
 */
#ifndef SPARKTRAIN_ENGINE_H
#define SPARKTRAIN_ENGINE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "collective.h"
#include "reduce.h"

#define DEFAULT_CHUNK (256u << 10) /* measured: slots that stay in cache beat larger ones */
#define SMALL_BYTES (32u << 10)
#define CACHELINE 128
#define MSG_BYTES 1024

enum kind { K_ALLREDUCE = 1, K_BROADCAST = 2, K_ALLGATHER = 3, K_BARRIER = 4, K_REDUCESCATTER = 5, K_ALLTOALL = 6 };

/* What a rank passed to a collective: compared between ranks before any data moves. */
#define DESC_DIMS 8
typedef struct desc {
    uint32_t kind, dtype;
    int32_t arg;    /* the op, the root, or 0 */
    uint32_t ndim;  /* the true number of dims; those from DESC_DIMS-1 on are folded into the last entry */
    uint64_t count; /* elements; for allgather and alltoall the bytes of every rank together */
    int64_t dims[DESC_DIMS];
} desc;

/* A host's verdict on its local ranks' descriptors: a, the lowest local rank's; when they
 * disagree, b, the first one that differs from it. Leaders pass these around the ring. */
typedef struct verdict {
    int32_t disagree, rank_a, rank_b, pad;
    desc a, b;
} verdict;

/* The abort record: the only bytes that ever travel backwards on a ring connection. */
#define RECORD_MAGIC 0x53544341u /* "STCA" */
#define WHY_BYTES 232
typedef struct record {
    uint32_t magic;
    int32_t culprit;   /* the rank that failed */
    int32_t code;      /* the STC_E* code its failure gave; 0: closed in good order */
    int32_t pad;
    uint64_t received; /* bytes the sender ever received from upstream: a close is in good order for the
                          upstream leader only once all it sent was received */
    char why[WHY_BYTES]; /* what happened to it, a phrase: "died", ... */
} record;

/* Encryption (crypto.c, records.c). A record on the wire: its plaintext length (4 bytes, big
 * endian, 1 to REC_PLAIN), the ciphertext, the tag. */
#define AEAD_KEY 32
#define AEAD_IV 12
#define AEAD_TAG 16
#define AEAD_KEY_IV (AEAD_KEY + AEAD_IV) /* a direction's key material, from HKDF */
#define REC_PLAIN (256u << 10) /* measured: 256 KiB records took 30% less CPU than 64 KiB ones */
#define REC_OVERHEAD (4 + AEAD_TAG)
#define TX_SLOTS 4 /* records sealed ahead of the socket */

typedef struct aead_dir {
    void *ctx;           /* libcrypto's cipher context, its key set */
    uint8_t iv[AEAD_IV]; /* the nonce base: a record's nonce is this XOR its sequence number */
    uint64_t seq;        /* the next record's sequence number */
    int enc;
} aead_dir;

typedef struct link_sec {
    aead_dir tx, rx, back_tx, back_rx; /* to next, from prev; abort records to prev, from next */
    char *slots;                       /* TX_SLOTS sealed records waiting for the next leader's socket */
    size_t slot_len[TX_SLOTS];
    int head, count;
    size_t head_off; /* bytes of the head slot already sent */
    char *rxbuf;     /* the record being read from the previous leader */
    size_t rx_have;
    char *plain; /* its opened bytes, from plain_at on not yet taken */
    size_t plain_at, plain_len;
    char backbuf[REC_OVERHEAD + sizeof(record)]; /* an abort record being read from the next leader */
    size_t back_have;
} link_sec;

typedef struct rank_state {
    _Atomic uint32_t seq;     /* the last step this rank published (wraps; compared as a difference) */
    _Atomic uint32_t waiters; /* ranks asleep on seq (futex), so a publisher knows to wake them */
    _Atomic uint64_t heartbeat_ms;
    _Atomic int32_t pid;
    int32_t rank;
    desc desc[2]; /* per buffer set, written before the first step of a collective */
} rank_state;

typedef struct header {
    _Alignas(CACHELINE) _Atomic uint64_t magic;
    uint64_t local_size, chunk, seg_bytes;
    _Atomic uint32_t attached;
    _Atomic int32_t failed; /* 1 + the global rank of a rank whose collective failed */
    /* What happened, from the first rank that noted a failure with a reason: failed_why says it
     * of rank why_of - 1 (a ring link's hosts, say), so the host's other ranks say it too. */
    _Atomic int32_t why_claimed, why_of;
    char failed_why[WHY_BYTES];
    /* Shares of large chunks, per buffer set: ranks claim them in turn, so ranks that have a core
     * do the work of one that does not; each share is still reduced in rank order. */
    _Alignas(CACHELINE) _Atomic uint32_t claimed[2];
    _Alignas(CACHELINE) _Atomic uint32_t done[2];
    _Atomic uint32_t done_waiters[2];
    /* The ring's verdict, per buffer set, from the leader to its local ranks: 0 or STC_E_MISMATCH,
     * and the message every rank returns. */
    int32_t verdict_rc[2];
    char verdict_msg[2][MSG_BYTES];
} header;

struct stc_comm {
    stc_config cfg;
    int *rank_node, *rank_local, *leader_of;
    int *local_global; /* local_size entries: each local rank's global rank */
    int most_local;    /* the most ranks any host has */
    /* the shared-memory transport */
    char shm_name[256];
    int unlinked;
    void *base;
    size_t seg_bytes;
    header *hdr;
    char *data;
    uint64_t seq;
    uint32_t claimed_base[2], done_base[2]; /* where this set's counters stood before the current chunk */
    pthread_t hb_thread;
    int hb_started;
    _Atomic int hb_stop;
    /* the collective in progress */
    stc_progress *progress; /* the mapped record (stc_config.progress_path), or NULL */
    int broken;
    double deadline;
    const char *what; /* its name, for messages */
    desc desc;
    /* the ring link */
    char *tmp;
    size_t tmp_bytes;
    char *stage;
    record rec_in; /* a record being read from downstream */
    size_t rec_got;
    int record_sent;
    int down; /* downstream's word: 0 none yet, 1 a whole record in rec_in, -1 closed without one */
    uint64_t sent_bytes, received_bytes; /* over the ring connections, ever (plaintext) */
    link_sec *sec; /* NULL: the ring is in clear; shared with pipeline views */
    char host[64], next_host[64], prev_host[64]; /* names of this host and its ring neighbours */
    const _Atomic int *cancel; /* NULL, or a flag that calls the ring's stream off (set: it returns) */
    /* the failure: who is to blame and why (for the abort record and the local ranks) */
    int culprit;
    int blame_code;
    char why[WHY_BYTES];
};

/* A run of bytes in a stream. On the ring (link_stream), a received piece with reduce set is
 * reduced into p as it arrives; a sent piece with from >= 0 is the received piece of that index,
 * passed on as its bytes arrive (and are reduced); from < 0: its bytes are ready at the start. */
typedef struct piece {
    char *p;
    size_t len;
    int reduce;
    int from;
} piece;

/* Where a local phase hands what arrived: len bytes at p, from offset off of local rank src's
 * stream. */
typedef void (*stc_sink)(stc_comm *c, void *ctx, int src, size_t off, const char *p, size_t len);

/* describe.c */
double now_s(void);
uint64_t now_ms(void);
int fail(char *err, size_t errlen, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
void blame(stc_comm *c, int rank, int code, const char *why);
const char *kind_name(uint64_t k);
void dtype_text(char *out, size_t n, uint64_t d);
void set_desc(desc *d, uint32_t kind, int dtype, int32_t arg, int ndim, const int64_t *dims, uint64_t count);
const char *desc_differs(const desc *a, const desc *b);
int mismatch(char *err, size_t errlen, const verdict *v);
void verdict_of(verdict *v, int rank, const desc *d);

/* progress.c */
int progress_open(stc_comm *c, const char *path, char *err, size_t errlen);
void progress_begin(stc_comm *c);
int progress_end(stc_comm *c, int rc);
void progress_close(stc_comm *c);

/* shm.c */
int shm_attach(stc_comm *c, char *err, size_t errlen);
void shm_detach(stc_comm *c);
char *shm_slot(stc_comm *c, uint64_t step, int lr);
char *shm_result_area(stc_comm *c, uint64_t step);
int shm_await(stc_comm *c, _Atomic uint32_t *ctr, _Atomic uint32_t *waiters, uint32_t target, int peer, char *err,
              size_t errlen);
void shm_wake(_Atomic uint32_t *addr);
int shm_step(stc_comm *c, char *err, size_t errlen);
int shm_step_checked(stc_comm *c, char *err, size_t errlen);
int shm_step_described(stc_comm *c, verdict *v, char *err, size_t errlen);
void shm_note_failure(stc_comm *c);

/* link.c */
void link_adopt(stc_comm *c, int next_fd, int prev_fd);
void link_close(stc_comm *c);
void link_send_record(stc_comm *c, int code);
int link_next(stc_comm *c);
int link_prev(stc_comm *c);
int link_stream(stc_comm *c, const piece *sends, int ns, const piece *recvs, int nr, int dtype, int op, char *err,
                size_t errlen);
int link_xfer(stc_comm *c, const char *sp, size_t sl, char *rp, size_t rl, int forward, char *err, size_t errlen);
void link_take_state(stc_comm *c, const stc_comm *view);

/* crypto.c */
int crypto_ready(char *err, size_t errlen);
int aead_dir_init(aead_dir *d, int enc, const uint8_t *key_iv, char *err, size_t errlen);
void aead_dir_free(aead_dir *d);
int aead_seal_record(aead_dir *d, const char *in, uint32_t len, char *out);
uint32_t aead_record_len(const char *hdr);
int aead_open_record(aead_dir *d, const char *rec, char *out);

/* records.c */
int records_setup(stc_comm *c, const uint8_t *keys, char *err, size_t errlen);
void records_free(stc_comm *c);
ssize_t records_send(stc_comm *c, const char *p, size_t can, int *moved);
int records_pending(const stc_comm *c);
ssize_t records_recv(stc_comm *c, char *dst, size_t room);
void records_send_back(stc_comm *c, const record *r);
int records_read_back(stc_comm *c, record *out);
int records_failed(stc_comm *c, char *err, size_t errlen);

/* local.c */
int local_allreduce(stc_comm *c, char *buf, size_t count, int dtype, int op, int to, int checked, char *err,
                    size_t errlen);
int local_reducescatter(stc_comm *c, const char *buf, size_t count, int dtype, int op, char *out, size_t lo,
                        size_t hi, char *err, size_t errlen);
int local_exchange(stc_comm *c, const char *mine, const size_t *lens, int checked, stc_sink sink, void *ctx,
                   char *err, size_t errlen);
int local_publish(stc_comm *c, int root, const piece *ps, int np, int checked, stc_sink sink, void *ctx, char *err,
                  size_t errlen);
int local_broadcast(stc_comm *c, char *buf, size_t nbytes, int root, int checked, char *err, size_t errlen);
int local_copy_pieces(stc_comm *c, const piece *ps, int np, int root, char *err, size_t errlen);
int local_allgatherv(stc_comm *c, const char *in, char *out, const uint64_t *offs, const uint64_t *counts,
                     int checked, char *err, size_t errlen);

/* ring.c */
int ring_verdict(stc_comm *c, verdict *mine, char *err, size_t errlen);
int ring_allreduce(stc_comm *c, char *buf, size_t count, int dtype, int op, char *err, size_t errlen);
int ring_allreduce_pieces(stc_comm *c, const piece *by_host, int dtype, int op, char *err, size_t errlen);
void ring_parts(char *buf, size_t count, size_t esz, int m, piece *by_host);
int ring_broadcast(stc_comm *c, char *buf, size_t nbytes, int root_node, char *err, size_t errlen);
int ring_allgatherv(stc_comm *c, char *out, const uint64_t *offs, const uint64_t *counts, char *err, size_t errlen);

/* pipeline.c */
int pipe_wanted(const stc_comm *c, size_t nbytes);
int pipe_allreduce(stc_comm *c, char *buf, size_t count, int dtype, int op, char *err, size_t errlen);

/* alltoall.c */
int alltoall_local(stc_comm *c, const char *in, char *out, const uint64_t *sends, char *err, size_t errlen);
int alltoall_hosts(stc_comm *c, const char *in, char *out, const uint64_t *sends, char *err, size_t errlen);

#endif
