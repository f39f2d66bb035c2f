/* sparktrain's CPU collective engine: shared memory within a host, a TCP ring between hosts.
 *
 * Shared memory. Each host's ranks map one segment: a header with every local rank's state
 * (step counter, heartbeat, pid, the descriptor of the collective it is in) and two sets of
 * buffers, one slot per rank plus one result area each. A collective is a series of steps; in
 * step s a rank writes into set s%2, publishes s, waits until every local rank has published s,
 * then reads. Every rank waits for all at every step, so a buffer written for step s is not
 * overwritten before step s+2, by which time every reader is done with it (double buffering).
 * Small chunks are reduced by every rank from all slots (copy-in plus reduce); large ones are
 * reduce-scattered into the result area and then copied out (two steps). Each element is
 * reduced by one rule, in rank order, so every rank gets the same bits.
 *
 * Between hosts, the leaders (local rank 0) run a ring: reduce-scatter then allgather, sending
 * to the next leader while receiving from the previous one. What one step receives is what the
 * next sends, so the steps run as one stream: each byte is reduced as it arrives and passed on
 * as soon as it is, with no wait between steps.
 *
 * Before any data moves, the ranks compare what each passed (a descriptor: kind, dtype, shape,
 * op or root). Within a host every rank publishes its descriptor with the collective's first
 * step and reads everyone's; across hosts each leader adds its host's verdict, the leaders pass
 * the verdicts around the ring, and each tells its local ranks the outcome in one more step. So
 * a disagreement is found by every rank at the same step, with the same message, and leaves the
 * communicator usable (STC_E_MISMATCH).
 *
 * Every wait has the collective's deadline. A waiting rank checks the ranks it waits for: a
 * local peer whose process is gone or whose heartbeat stopped, or a socket that closed, fails
 * the collective with the peer's rank in the message, and ends the communicator.
 *
 * Naming the failed rank on every host. Data only flows forwards on a ring connection, so its
 * backward direction carries one thing: an abort record ("rank X died"), sent upstream by a
 * leader whose collective failed, before it closes its sockets. Every leader reads its
 * downstream socket whenever it waits on the ring (ring_run). A record read there fails the collective naming X,
 * and is passed on upstream, so it goes round the ring backwards. A downstream connection that
 * closes with no record means the downstream leader died (a live one would have sent one): its
 * upstream names it and starts the record. A leader whose upstream closed cannot tell a death
 * from a failure further up, so it waits a bounded while for the record to come round before
 * naming its upstream neighbour. A communicator closed in good order sends a record too (code 0,
 * with how many bytes it received), so that only a death closes a connection without one.
 * Leaders pass the culprit to their local ranks through the segment's failed word.
 */
#define _GNU_SOURCE
#include "collective.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "reduce.h"

#define MAGIC 0x5350524b434f4c31ull /* "SPRKCOL1" */
#define DEFAULT_CHUNK (256u << 10) /* measured: slots that stay in cache beat larger ones */
#define SMALL_BYTES (32u << 10)
#define CACHELINE 128

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

#define MSG_BYTES 1024

/* The abort record: the only bytes that ever travel backwards on a ring connection. */
#define RECORD_MAGIC 0x53544341u /* "STCA" */
#define WHY_BYTES 104
typedef struct record {
    uint32_t magic;
    int32_t culprit;   /* the rank that failed */
    int32_t code;      /* the STC_E* code its failure gave; 0: closed in good order */
    int32_t pad;
    uint64_t received; /* bytes the sender ever received from upstream: a close is in good order for the
                          upstream leader only once all it sent was received */
    char why[WHY_BYTES]; /* what happened to it, a phrase: "died", ... */
} record;

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

#define STATE_BYTES ((sizeof(rank_state) + CACHELINE - 1) / CACHELINE * CACHELINE)

struct stc_comm {
    stc_config cfg;
    int *rank_node, *rank_local, *leader_of;
    char shm_name[256];
    int unlinked;
    void *base;
    size_t seg_bytes;
    header *hdr;
    char *data;
    uint64_t seq;
    uint32_t claimed_base[2], done_base[2]; /* where this set's counters stood before the current chunk */
    int broken;
    double deadline;      /* of the collective in progress */
    const char *what;     /* its name, for messages */
    desc desc;
    /* the ring */
    char *tmp;
    size_t tmp_bytes;
    char *stage;
    /* the failure: who is to blame and why (for the abort record and the local ranks) */
    int culprit;
    int blame_code;
    char why[WHY_BYTES];
    int record_sent;
    record rec_in; /* a record being read from downstream */
    size_t rec_got;
    uint64_t sent_bytes, received_bytes; /* over the ring connections, ever */
    int down; /* downstream's word: 0 none yet, 1 a whole record in rec_in, -1 closed without one */
    /* heartbeat */
    pthread_t hb_thread;
    int hb_started;
    _Atomic int hb_stop;
};

/* ---------------------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t now_ms(void) { return (uint64_t)(now_s() * 1000.0); }

static int fail(char *err, size_t errlen, int code, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

static rank_state *state_of(stc_comm *c, int lr) {
    return (rank_state *)((char *)c->base + sizeof(header) + (size_t)lr * STATE_BYTES);
}

static char *slot(stc_comm *c, uint64_t step, int lr) {
    size_t per_set = (size_t)(c->cfg.local_size + 1) * c->cfg.chunk_bytes;
    return c->data + (step % 2) * per_set + (size_t)lr * c->cfg.chunk_bytes;
}

static char *result_area(stc_comm *c, uint64_t step) { return slot(c, step, c->cfg.local_size); }

static int pid_alive(pid_t pid) {
    if (pid <= 0) return 1;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return errno == ENOENT ? 0 : 1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 1;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the state follows the command name */
    if (p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X')) return 0;
    return 1;
}

static void *heartbeat_main(void *arg) {
    stc_comm *c = arg;
    rank_state *me = state_of(c, c->cfg.local_rank);
    struct timespec ts = {0, 50 * 1000 * 1000};
    while (!atomic_load(&c->hb_stop)) {
        atomic_store(&me->heartbeat_ms, now_ms());
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* Who a failure is to blame on, and a phrase saying what happened to it. */
static void blame(stc_comm *c, int rank, int code, const char *why) {
    c->culprit = rank;
    c->blame_code = code;
    snprintf(c->why, sizeof c->why, "%s", why);
}

/* Upstream, once per communicator: a failure's record (code < 0), or, from a communicator
 * closed in good order, a record with code 0, so that a connection closing without any record
 * means its process died. The backward direction is otherwise idle: the record fits in its empty
 * send buffer and never blocks. */
static void send_record(stc_comm *c, int code) {
    if (c->record_sent || c->cfg.num_nodes < 2 || c->cfg.local_rank != 0 || c->cfg.prev_fd < 0) return;
    c->record_sent = 1;
    record r;
    memset(&r, 0, sizeof r);
    r.magic = RECORD_MAGIC;
    r.culprit = c->culprit >= 0 && code ? c->culprit : c->cfg.rank;
    r.code = code;
    r.received = c->received_bytes;
    snprintf(r.why, sizeof r.why, "%s", !code ? "closed its communicator" : c->why[0] ? c->why : "failed");
    ssize_t n = send(c->cfg.prev_fd, &r, sizeof r, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)n; /* an upstream that is gone needs no record */
}

static void mark_failed(stc_comm *c) {
    c->broken = 1;
    if (c->hdr) {
        int32_t expected = 0;
        atomic_compare_exchange_strong(&c->hdr->failed, &expected, (c->culprit >= 0 ? c->culprit : c->cfg.rank) + 1);
    }
    send_record(c, c->blame_code ? c->blame_code : STC_E_PEER);
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected, long ns) {
    struct timespec ts = {0, ns};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr) { syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0); }

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Spin briefly, then yield, then sleep with a growing pause: ranks may outnumber cores. Used
 * where there is no futex to sleep on (set-up). */
static void backoff(unsigned *spins) {
    unsigned s = (*spins)++;
    if (s < 64) {
        cpu_relax();
    } else if (s < 256) {
        sched_yield();
    } else {
        struct timespec ts = {0, s < 1024 ? 20000 : 200000};
        nanosleep(&ts, NULL);
    }
}

static int nms_stale(stc_comm *c, rank_state *st) {
    uint64_t hb = atomic_load(&st->heartbeat_ms), nms = now_ms();
    return nms > hb && (double)(nms - hb) / 1000.0 > c->cfg.heartbeat_s;
}

static const char *kind_name(uint64_t k) {
    static const char *names[] = {"?", "allreduce", "broadcast", "allgather", "barrier", "reducescatter", "alltoall"};
    return k < sizeof names / sizeof *names ? names[k] : "?";
}

static const char *op_name(int64_t op) {
    static const char *names[] = {"sum", "average", "min", "max", "product"};
    return op >= 0 && op < (int64_t)(sizeof names / sizeof *names) ? names[op] : "?";
}

static void dtype_text(char *out, size_t n, uint64_t d) {
    static const char *names[] = {"float16", "bfloat16", "float32", "float64", "int32", "int64",
                                  "uint8",   "int8",     "int16",   "uint16",  "bool"};
    if (d < sizeof names / sizeof *names) snprintf(out, n, "%s", names[d]);
    else if (d > STC_OPAQUE) snprintf(out, n, "opaque%llu", (unsigned long long)(d - STC_OPAQUE) * 8);
    else snprintf(out, n, "dtype%llu", (unsigned long long)d);
}

static uint64_t fold_dims(const int64_t *dims, int n) { /* FNV-1a over the dims beyond what a desc holds */
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) {
        uint64_t v = (uint64_t)dims[i];
        for (int b = 0; b < 8; b++, v >>= 8) h = (h ^ (v & 0xff)) * 1099511628211ull;
    }
    return h;
}

static void set_desc(desc *d, uint32_t kind, int dtype, int32_t arg, int ndim, const int64_t *dims, uint64_t count) {
    memset(d, 0, sizeof *d);
    d->kind = kind;
    d->dtype = (uint32_t)dtype;
    d->arg = arg;
    d->ndim = ndim > 0 ? (uint32_t)ndim : 0;
    d->count = count;
    for (int i = 0; i < ndim && i < DESC_DIMS; i++) d->dims[i] = dims[i];
    if (ndim > DESC_DIMS) d->dims[DESC_DIMS - 1] = (int64_t)fold_dims(dims + DESC_DIMS - 1, ndim - DESC_DIMS + 1);
}

/* "float32[3,4] (op sum)": what a rank passed, for messages. */
static void desc_text(char *out, size_t n, const desc *d) {
    char dt[32];
    size_t k = 0;
    if (d->kind == K_BARRIER) { out[0] = 0; return; }
    dtype_text(dt, sizeof dt, d->dtype);
    k += (size_t)snprintf(out + k, n - k, "%s[", dt);
    for (uint32_t i = 0; i < d->ndim && k < n; i++) {
        if (i == DESC_DIMS - 1 && d->ndim > DESC_DIMS) {
            k += (size_t)snprintf(out + k, n - k, ",... (%u more dims)", d->ndim - i);
            break;
        }
        k += (size_t)snprintf(out + k, n - k, "%s%lld", i ? "," : "", (long long)d->dims[i]);
    }
    if (k < n) k += (size_t)snprintf(out + k, n - k, "]");
    if (k >= n) return;
    if (d->kind == K_ALLREDUCE || d->kind == K_REDUCESCATTER) snprintf(out + k, n - k, " (op %s)", op_name(d->arg));
    else if (d->kind == K_BROADCAST) snprintf(out + k, n - k, " (root %d)", d->arg);
}

/* What differs between two ranks' descriptors ("shapes", ...), or NULL when they may go on.
 * Allgather's and alltoall's first dimension may differ (their total, in count, may not). */
static const char *desc_differs(const desc *a, const desc *b) {
    if (a->kind != b->kind) return "collectives";
    if (a->dtype != b->dtype) return "dtypes";
    if (a->ndim != b->ndim || a->count != b->count) return "shapes";
    for (uint32_t i = a->kind == K_ALLGATHER || a->kind == K_ALLTOALL ? 1 : 0; i < a->ndim && i < DESC_DIMS; i++)
        if (a->dims[i] != b->dims[i]) return "shapes";
    if (a->arg != b->arg) return a->kind == K_BROADCAST ? "roots" : "ops";
    return NULL;
}

/* The message every rank of a disagreement returns: the same text on all of them. */
static int mismatch(char *err, size_t errlen, const verdict *v) {
    char ta[256], tb[256];
    const char *what = desc_differs(&v->a, &v->b);
    desc_text(ta, sizeof ta, &v->a);
    desc_text(tb, sizeof tb, &v->b);
    if (v->a.kind != v->b.kind)
        return fail(err, errlen, STC_E_MISMATCH,
                    "%s: rank %d called %s%s%s but rank %d called %s%s%s: the collectives differ (every rank "
                    "must make the same collective calls in the same order)",
                    kind_name(v->a.kind), v->rank_a, kind_name(v->a.kind), ta[0] ? " of " : "", ta, v->rank_b,
                    kind_name(v->b.kind), tb[0] ? " of " : "", tb);
    return fail(err, errlen, STC_E_MISMATCH, "%s: rank %d passed %s but rank %d passed %s: the %s differ",
                kind_name(v->a.kind), v->rank_a, ta, v->rank_b, tb, what ? what : "descriptors");
}

/* Fails when waiting for st can no longer succeed: a rank failed, st is dead or frozen, or the
 * deadline passed. */
static int check_peer(stc_comm *c, rank_state *st, double t, char *err, size_t errlen) {
    int32_t failed = atomic_load(&c->hdr->failed);
    if (failed) {
        blame(c, failed - 1, STC_E_PEER, "died, failed or timed out");
        return fail(err, errlen, STC_E_PEER,
                    "%s: rank %d died, failed or timed out in this collective (another rank on this host saw it first)",
                    c->what, failed - 1);
    }
    int32_t pid = atomic_load(&st->pid);
    int32_t culprit = st->rank + 1, none = 0;
    int alive = pid_alive(pid);
    if (!alive || nms_stale(c, st) || t > c->deadline)
        atomic_compare_exchange_strong(&c->hdr->failed, &none, culprit); /* the others name it too */
    if (!alive) {
        blame(c, st->rank, STC_E_PEER, "died");
        return fail(err, errlen, STC_E_PEER, "%s: rank %d (pid %d, on this host) died during the collective",
                    c->what, st->rank, pid);
    }
    uint64_t hb = atomic_load(&st->heartbeat_ms), nms = now_ms();
    if (nms > hb && (double)(nms - hb) / 1000.0 > c->cfg.heartbeat_s) {
        blame(c, st->rank, STC_E_PEER, "stopped its heartbeat: it is frozen or dead");
        return fail(err, errlen, STC_E_PEER,
                    "%s: rank %d (pid %d, on this host) stopped its heartbeat %.1f s ago: it is frozen or dead",
                    c->what, st->rank, pid, (double)(nms - hb) / 1000.0);
    }
    if (t > c->deadline) {
        blame(c, st->rank, STC_E_TIMEOUT, "never reached the collective in time");
        return fail(err, errlen, STC_E_TIMEOUT,
                    "%s: timed out after %.0f s waiting for rank %d (pid %d, on this host); "
                    "every rank must make the same collective calls in the same order "
                    "(raise the collective timeout if a rank is just slow)",
                    c->what, c->cfg.timeout_s, st->rank, pid);
    }
    return STC_OK;
}

static int reached(uint32_t seq, uint32_t target) { return (int32_t)(seq - target) >= 0; }

/* Wait until *ctr reaches target, moved by local rank `peer` (or by any local rank: peer < 0).
 *
 * First, where the ranks have cores of their own (cfg.spin_s > 0), spin on it for up to spin_s:
 * a sleeper's wake-up goes through the scheduler and, in a virtual machine, the hypervisor's
 * wake-up of an idle vCPU (a 4 KiB allreduce in a step: 68 us sleeping, 19 us spinning). Then
 * spin briefly, yield a little, and sleep on the counter (a futex), waking every few milliseconds
 * to check the deadline and that the peers live. Sleeping, not spinning, leaves the cores to the
 * ranks that still compute when ranks outnumber cores. */
static int await_count(stc_comm *c, _Atomic uint32_t *ctr, _Atomic uint32_t *waiters, uint32_t target, int peer,
                       char *err, size_t errlen) {
    if (reached(atomic_load(ctr), target)) return STC_OK;
    if (c->cfg.spin_s > 0) {
        double end = now_s() + c->cfg.spin_s;
        for (unsigned i = 1;; i++) {
            cpu_relax();
            if (reached(atomic_load(ctr), target)) return STC_OK;
            if (i % 64 == 0 && now_s() > end) break;
        }
    }
    unsigned spins = 0;
    double last_check = now_s();
    uint32_t v;
    while (!reached(v = atomic_load(ctr), target)) {
        if (++spins < 128) {
            cpu_relax();
            continue;
        }
        if (spins < 160) {
            sched_yield();
            continue;
        }
        atomic_fetch_add(waiters, 1);
        if (!reached(v = atomic_load(ctr), target)) futex_wait(ctr, v, 5 * 1000 * 1000);
        atomic_fetch_sub(waiters, 1);
        double t = now_s();
        if (t - last_check < 0.005) continue;
        last_check = t;
        int lo = peer < 0 ? 0 : peer, hi = peer < 0 ? c->cfg.local_size : peer + 1;
        for (int r = lo; r < hi; r++) { /* whoever could move it: check each */
            int rc = check_peer(c, state_of(c, r), t, err, errlen);
            if (rc) return rc;
        }
    }
    return STC_OK;
}

/* Publish step seq+1 and wait until every local rank has published it. */
static int shm_step(stc_comm *c, char *err, size_t errlen) {
    uint32_t target = (uint32_t)++c->seq;
    rank_state *me = state_of(c, c->cfg.local_rank);
    atomic_store(&me->seq, target);
    if (atomic_load(&me->waiters)) futex_wake(&me->seq);
    for (int r = 0; r < c->cfg.local_size; r++) {
        rank_state *st = state_of(c, r);
        int rc = await_count(c, &st->seq, &st->waiters, target, r, err, errlen);
        if (rc) return rc;
    }
    return STC_OK;
}

/* This host's verdict on the descriptors its ranks published for step s. Every local rank reads
 * the same descriptors in the same order, so every one reaches the same verdict. */
static void local_verdict(stc_comm *c, uint64_t s, verdict *v) {
    memset(v, 0, sizeof *v);
    rank_state *first = state_of(c, 0);
    v->rank_a = v->rank_b = first->rank;
    v->a = v->b = first->desc[s % 2];
    for (int r = 1; r < c->cfg.local_size; r++) {
        rank_state *st = state_of(c, r);
        if (desc_differs(&v->a, &st->desc[s % 2])) {
            v->disagree = 1;
            v->rank_b = st->rank;
            v->b = st->desc[s % 2];
            return;
        }
    }
}

/* The first step of a collective on one host: every local rank publishes its descriptor with the
 * step (beside whatever data the step carries) and checks everyone's. On a disagreement every
 * local rank returns STC_E_MISMATCH before using any data, having made the same one step. */
static int shm_step_checked(stc_comm *c, char *err, size_t errlen) {
    rank_state *me = state_of(c, c->cfg.local_rank);
    uint64_t s = c->seq + 1;
    me->desc[s % 2] = c->desc;
    int rc = shm_step(c, err, errlen);
    if (rc) return rc;
    verdict v;
    local_verdict(c, s, &v);
    return v.disagree ? mismatch(err, errlen, &v) : STC_OK;
}

/* Reduce-scatter of one large chunk into the result area: every rank claims shares until none is
 * left, then waits until all are done. Every rank runs this for every large chunk and leaves the
 * claim loop with exactly one claim past the end, so the counters' next bases are known to all. */
static int reduce_shares(stc_comm *c, uint64_t s, size_t m, int dtype, int op, char *err, size_t errlen) {
    int L = c->cfg.local_size, p = (int)(s % 2);
    size_t esz = stc_dtype_size(dtype);
    uint32_t ns = (uint32_t)(m * esz / SMALL_BYTES);
    if (ns < (uint32_t)L) ns = (uint32_t)L;
    if (ns > 64) ns = 64;
    const void *srcs[64];
    for (;;) {
        uint32_t i = atomic_fetch_add(&c->hdr->claimed[p], 1) - c->claimed_base[p];
        if (i >= ns) break;
        size_t lo = m * i / ns, hi = m * (i + 1) / ns;
        for (int r = 0; r < L; r++) srcs[r] = slot(c, s, r) + lo * esz;
        stc_reduce(result_area(c, s) + lo * esz, srcs, L, hi - lo, dtype, op);
        atomic_fetch_add(&c->hdr->done[p], 1);
        if (atomic_load(&c->hdr->done_waiters[p])) futex_wake(&c->hdr->done[p]);
    }
    c->claimed_base[p] += ns + (uint32_t)L;
    uint32_t target = c->done_base[p] += ns;
    return await_count(c, &c->hdr->done[p], &c->hdr->done_waiters[p], target, -1, err, errlen);
}

/* checked: the first step is the collective's first (shm_step_checked); otherwise the ranks have
 * already agreed (negotiate). */
static int shm_allreduce(stc_comm *c, char *buf, size_t count, int dtype, int op, int checked, char *err,
                         size_t errlen) {
    size_t esz = stc_dtype_size(dtype), chunk_elems = c->cfg.chunk_bytes / esz;
    int L = c->cfg.local_size, lr = c->cfg.local_rank, first = checked;
    size_t off = 0;
    do {
        size_t m = count - off < chunk_elems ? count - off : chunk_elems;
        uint64_t s = c->seq + 1;
        if (m) memcpy(slot(c, s, lr), buf + off * esz, m * esz); /* buf may be NULL when m is 0 */
        int rc = first ? shm_step_checked(c, err, errlen) : shm_step(c, err, errlen);
        if (rc) return rc;
        first = 0;
        const void *srcs[64];
        if (m * esz <= SMALL_BYTES) {
            for (int r = 0; r < L; r++) srcs[r] = slot(c, s, r);
            stc_reduce(buf + off * esz, srcs, L, m, dtype, op);
        } else {
            rc = reduce_shares(c, s, m, dtype, op, err, errlen);
            if (rc) return rc;
            memcpy(buf + off * esz, result_area(c, s), m * esz);
        }
        off += m;
    } while (off < count);
    return STC_OK;
}

static int shm_broadcast(stc_comm *c, char *buf, size_t nbytes, int root_lr, int checked, char *err,
                         size_t errlen) {
    size_t off = 0;
    int first = checked;
    do {
        size_t m = nbytes - off < c->cfg.chunk_bytes ? nbytes - off : c->cfg.chunk_bytes;
        uint64_t s = c->seq + 1;
        if (m && c->cfg.local_rank == root_lr) memcpy(slot(c, s, root_lr), buf + off, m);
        int rc = first ? shm_step_checked(c, err, errlen) : shm_step(c, err, errlen);
        if (rc) return rc;
        first = 0;
        if (m && c->cfg.local_rank != root_lr) memcpy(buf + off, slot(c, s, root_lr), m);
        off += m;
    } while (off < nbytes);
    return STC_OK;
}

/* A reduce-scatter within one host: as shm_allreduce, except that each rank reduces (small
 * chunks) or copies out (large ones, reduced in shares by all) only the elements [lo, hi) it
 * keeps, into out. The collective's first step; buf is only read. */
static int shm_reducescatter(stc_comm *c, const char *buf, size_t count, int dtype, int op, char *out, size_t lo,
                             size_t hi, char *err, size_t errlen) {
    size_t esz = stc_dtype_size(dtype), chunk_elems = c->cfg.chunk_bytes / esz;
    int L = c->cfg.local_size, lr = c->cfg.local_rank, first = 1;
    size_t off = 0;
    do {
        size_t m = count - off < chunk_elems ? count - off : chunk_elems;
        uint64_t s = c->seq + 1;
        if (m) memcpy(slot(c, s, lr), buf + off * esz, m * esz);
        int rc = first ? shm_step_checked(c, err, errlen) : shm_step(c, err, errlen);
        if (rc) return rc;
        first = 0;
        size_t a = lo > off ? lo : off, b = hi < off + m ? hi : off + m; /* this rank's part of the chunk */
        if (m * esz <= SMALL_BYTES) {
            if (a < b) {
                const void *srcs[64];
                for (int r = 0; r < L; r++) srcs[r] = slot(c, s, r) + (a - off) * esz;
                stc_reduce(out + (a - lo) * esz, srcs, L, b - a, dtype, op);
            }
        } else {
            rc = reduce_shares(c, s, m, dtype, op, err, errlen);
            if (rc) return rc;
            if (a < b) memcpy(out + (a - lo) * esz, result_area(c, s) + (a - off) * esz, (b - a) * esz);
        }
        off += m;
    } while (off < count);
    return STC_OK;
}

/* An alltoall within one host. sends[i * size + j] is how many bytes rank i sends rank j (the
 * same matrix on every rank). In each step every rank copies the next chunk of its whole send
 * buffer into its slot, and each reads from every slot what of it is addressed to it: one copy
 * in, one copy out. The collective's first step. */
static int shm_alltoallv(stc_comm *c, const char *in, char *out, const uint64_t *sends, char *err, size_t errlen) {
    int n = c->cfg.size, me = c->cfg.rank;
    size_t chunk = c->cfg.chunk_bytes, longest = 0, mine = 0;
    for (int i = 0; i < n; i++) {
        size_t total = 0;
        for (int j = 0; j < n; j++) total += sends[(size_t)i * n + j];
        if (total > longest) longest = total;
        if (i == me) mine = total;
    }
    size_t steps = longest ? (longest + chunk - 1) / chunk : 1;
    for (size_t k = 0; k < steps; k++) {
        size_t base = k * chunk;
        uint64_t s = c->seq + 1;
        if (mine > base) memcpy(slot(c, s, c->cfg.local_rank), in + base, mine - base < chunk ? mine - base : chunk);
        int rc = k == 0 ? shm_step_checked(c, err, errlen) : shm_step(c, err, errlen);
        if (rc) return rc;
        size_t dst = 0;
        for (int i = 0; i < n; i++) {
            size_t src = 0, len = sends[(size_t)i * n + me];
            for (int j = 0; j < me; j++) src += sends[(size_t)i * n + j]; /* where rank i's part for me starts */
            size_t a = src > base ? src : base, b = src + len < base + chunk ? src + len : base + chunk;
            if (a < b) memcpy(out + dst + (a - src), slot(c, s, c->rank_local[i]) + (a - base), b - a);
            dst += len;
        }
    }
    return STC_OK;
}

/* ------------------------------------------------------------------------------- the ring */

static int next_node_rank(stc_comm *c) { return c->leader_of[(c->cfg.node + 1) % c->cfg.num_nodes]; }
static int prev_node_rank(stc_comm *c) {
    return c->leader_of[(c->cfg.node + c->cfg.num_nodes - 1) % c->cfg.num_nodes];
}

/* How long a leader whose upstream closed waits for the abort record to come round the ring
 * before it names that neighbour: the record needs only a hop per leader, each as soon as that
 * leader next polls. */
#define RECORD_WAIT_S 5.0
/* Received bytes that are to be reduced land here first, a ring small enough to stay in cache. */
#define STAGE_BYTES (512u << 10)

/* Reads what the downstream leader sent back: only ever one record. 1: a whole record; 0:
 * nothing yet; -1: downstream closed without one, so it died. Once known, the answer stays. */
static int read_record(stc_comm *c) {
    while (!c->down) {
        ssize_t n = recv(c->cfg.next_fd, (char *)&c->rec_in + c->rec_got, sizeof(record) - c->rec_got, MSG_DONTWAIT);
        if (n > 0) {
            c->rec_got += (size_t)n;
            if (c->rec_got < sizeof(record)) continue;
            record *r = &c->rec_in;
            r->why[WHY_BYTES - 1] = 0;
            if (r->magic != RECORD_MAGIC || r->culprit < 0 || r->culprit >= c->cfg.size || r->code > 0) {
                r->culprit = next_node_rank(c); /* never taken for data, nor believed */
                r->code = STC_E_PEER;
                snprintf(r->why, sizeof r->why, "sent back bytes that are no abort record");
            }
            c->down = 1;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return 0;
        } else {
            c->down = -1;
        }
    }
    return c->down;
}

/* Whether downstream's word ends the collective: any failure's record, a death, or a close in
 * good order while this rank still has bytes for it (a close after it got them all is the end
 * of the run). Blames the culprit and writes the error. */
static int downstream_fatal(stc_comm *c, int more_to_send, char *err, size_t errlen) {
    int how = read_record(c);
    if (!how) return STC_OK;
    if (how < 0) {
        blame(c, next_node_rank(c), STC_E_PEER, "died");
        return fail(err, errlen, STC_E_PEER, "%s: rank %d died: its ring connection closed without a word",
                    c->what, c->culprit);
    }
    record *r = &c->rec_in;
    if (r->code == 0) {
        if (!more_to_send && c->sent_bytes <= r->received) return STC_OK; /* it finished this collective too */
        blame(c, r->culprit, STC_E_PEER, r->why);
        return fail(err, errlen, STC_E_PEER, "%s: rank %d closed its communicator while this rank was still in a "
                    "collective (every rank must make the same collective calls)", c->what, r->culprit);
    }
    blame(c, r->culprit, r->code == STC_E_TIMEOUT ? STC_E_TIMEOUT : STC_E_PEER, r->why);
    return fail(err, errlen, c->blame_code, "%s: rank %d %s (word of it came round the ring)", c->what, r->culprit,
                r->why);
}

/* The upstream leader closed its connection (cause: "end of stream" or the error). It may have
 * died, or failed after something further up did (its record went the other way): wait a
 * bounded while for that record to come round the ring before naming the neighbour. */
static int upstream_closed(stc_comm *c, const char *cause, char *err, size_t errlen) {
    double end = now_s() + RECORD_WAIT_S;
    if (end > c->deadline) end = c->deadline;
    for (;;) {
        int rc = downstream_fatal(c, 1, err, errlen);
        if (rc) {
            if (c->down > 0 && c->rec_in.code == 0) break; /* downstream closed early: no record can come */
            return rc;
        }
        double left = end - now_s();
        if (left <= 0) break;
        struct pollfd pf = {c->cfg.next_fd, POLLIN, 0};
        if (poll(&pf, 1, (int)(left * 1000) + 1) < 0 && errno != EINTR) break;
    }
    blame(c, prev_node_rank(c), STC_E_PEER, "closed its ring connection: it died or failed");
    return fail(err, errlen, STC_E_PEER, "%s: rank %d closed its connection (%s): it died or failed", c->what,
                prev_node_rank(c), cause);
}

/* A run of the ring: the send stream (sends, in order) to the next leader while the receive
 * stream (recvs) comes from the previous one. A received piece with reduce set is added into
 * its place (through the stage, element by element as they arrive); otherwise it lands there.
 * Only the first lead bytes of the send stream are ready at the start; each further byte is
 * ready once as many bytes of the receive stream are in place (a chain: what arrives is passed
 * on). So steps need not wait for each other: the ring streams. */
typedef struct piece {
    char *p;
    size_t len;
    int reduce;
} piece;

static int ring_run(stc_comm *c, const piece *sends, int ns, const piece *recvs, int nr, size_t lead, int dtype,
                    int op, char *err, size_t errlen) {
    size_t esz = dtype >= 0 ? stc_dtype_size(dtype) : 1;
    size_t sent = 0, sent_total = 0, got = 0, done = 0, done_total = 0; /* sent, got, done: in the current piece */
    int si = 0, ri = 0;
    for (int i = 0; i < nr; i++)
        if (recvs[i].reduce && !c->stage) {
            c->stage = malloc(STAGE_BYTES);
            if (!c->stage) return fail(err, errlen, STC_E_SYS, "%s: out of memory for the ring's stage", c->what);
        }
    while (si < ns && !sends[si].len) si++;
    while (ri < nr && !recvs[ri].len) ri++;
    while (si < ns || ri < nr) {
        int moved = 0;
        if (ri < nr) {
            const piece *r = &recvs[ri];
            char *dst;
            size_t room;
            if (r->reduce) {
                size_t at = got % STAGE_BYTES;
                dst = c->stage + at;
                room = STAGE_BYTES - at;
                if (room > r->len - got) room = r->len - got;
            } else {
                dst = r->p + got;
                room = r->len - got;
            }
            ssize_t n = recv(c->cfg.prev_fd, dst, room, MSG_DONTWAIT);
            if (n == 0) return upstream_closed(c, "end of stream", err, errlen);
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                return upstream_closed(c, strerror(errno), err, errlen);
            if (n > 0) {
                moved = 1;
                got += (size_t)n;
                c->received_bytes += (uint64_t)n;
                if (r->reduce) { /* whole elements, up to the stage's end */
                    while (got - done >= esz) {
                        size_t at = done % STAGE_BYTES, upto = got / esz * esz;
                        if (upto - done > STAGE_BYTES - at) upto = done + STAGE_BYTES - at;
                        stc_accumulate(r->p + done, c->stage + at, (upto - done) / esz, dtype, op);
                        done_total += upto - done;
                        done = upto;
                    }
                } else {
                    done_total += (size_t)n;
                    done = got;
                }
                if (done == r->len) {
                    got = done = 0;
                    do ri++; while (ri < nr && !recvs[ri].len);
                }
            }
        }
        if (si < ns) {
            size_t ready = lead + done_total; /* how much of the send stream may go */
            const piece *s = &sends[si];
            size_t can = s->len - sent;
            if (ready <= sent_total) can = 0;
            else if (can > ready - sent_total) can = ready - sent_total;
            if (can) {
                ssize_t n = send(c->cfg.next_fd, s->p + sent, can, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                    int rc = downstream_fatal(c, 1, err, errlen);
                    if (rc) return rc;
                    blame(c, next_node_rank(c), STC_E_PEER, "died");
                    return fail(err, errlen, STC_E_PEER, "%s: sending to rank %d failed (%s): it died",
                                c->what, c->culprit, strerror(errno));
                }
                if (n > 0) {
                    moved = 1;
                    c->sent_bytes += (uint64_t)n;
                    sent += (size_t)n;
                    sent_total += (size_t)n;
                    if (sent == s->len) {
                        sent = 0;
                        do si++; while (si < ns && !sends[si].len);
                    }
                }
            }
        }
        if (moved) continue;
        /* Nothing moved: sleep until something can, watching downstream for a record. */
        int rc = downstream_fatal(c, si < ns, err, errlen);
        if (rc) return rc;
        double left = c->deadline - now_s();
        if (left <= 0) {
            blame(c, c->cfg.rank, STC_E_TIMEOUT, "timed out on the ring");
            return fail(err, errlen, STC_E_TIMEOUT,
                        "%s: timed out after %.0f s on the ring (sent %zu bytes to rank %d, received %zu from rank "
                        "%d)", c->what, c->cfg.timeout_s, sent_total, next_node_rank(c), done_total + got - done,
                        prev_node_rank(c));
        }
        struct pollfd fds[2];
        int nf = 0;
        fds[nf].fd = c->cfg.next_fd;
        fds[nf].events = c->down ? 0 : POLLIN; /* downstream's record, or its death */
        if (si < ns && lead + done_total > sent_total) fds[nf].events |= POLLOUT;
        if (fds[nf].events) nf++; /* a closed socket would wake poll for ever */
        if (ri < nr) {
            fds[nf].fd = c->cfg.prev_fd;
            fds[nf].events = POLLIN;
            nf++;
        }
        int pr = poll(fds, (nfds_t)nf, (int)(left * 1000) + 1);
        if (pr < 0 && errno != EINTR) return fail(err, errlen, STC_E_SYS, "%s: poll: %s", c->what, strerror(errno));
    }
    return STC_OK;
}

/* Send sl bytes to the next leader while receiving rl bytes from the previous one. With forward
 * set, only bytes already received are sent (a chain). */
static int ring_xfer(stc_comm *c, const char *sp, size_t sl, char *rp, size_t rl, int forward, char *err,
                     size_t errlen) {
    piece s = {(char *)sp, sl, 0}, r = {rp, rl, 0};
    return ring_run(c, &s, 1, &r, 1, forward ? 0 : sl, -1, 0, err, errlen);
}

/* Every leader's verdict to every leader: m-1 steps, each passing on the record received in the
 * step before, so all leaders hold all records in host order and decide alike. The first host
 * whose own ranks disagree decides the message; otherwise the first host whose descriptor
 * differs from host 0's. */
static int ring_verdict(stc_comm *c, verdict *mine, char *err, size_t errlen) {
    int m = c->cfg.num_nodes, pos = c->cfg.node;
    if ((size_t)m * sizeof(verdict) > c->tmp_bytes) {
        free(c->tmp);
        c->tmp = malloc((size_t)m * sizeof(verdict));
        c->tmp_bytes = c->tmp ? (size_t)m * sizeof(verdict) : 0;
        if (!c->tmp) return fail(err, errlen, STC_E_SYS, "%s: out of memory", c->what);
    }
    verdict *all = (verdict *)c->tmp;
    all[pos] = *mine;
    for (int k = 0; k < m - 1; k++) {
        int si = ((pos - k) % m + m) % m, ri = ((pos - k - 1) % m + m) % m;
        int rc = ring_xfer(c, (const char *)&all[si], sizeof(verdict), (char *)&all[ri], sizeof(verdict), 0, err,
                           errlen);
        if (rc) return rc;
    }
    for (int h = 0; h < m; h++)
        if (all[h].disagree) { *mine = all[h]; return STC_OK; }
    *mine = all[0];
    for (int h = 1; h < m; h++) {
        if (desc_differs(&all[0].a, &all[h].a)) {
            mine->disagree = 1;
            mine->rank_b = all[h].rank_a;
            mine->b = all[h].a;
            break;
        }
    }
    return STC_OK;
}

/* Reduce-scatter then allgather as one stream: what is received in one step (reduced, in the
 * first m-1; as it is, after) is what is sent in the next, so the send stream is this host's own
 * segment followed by the receive stream, less its last segment. */
static int ring_allreduce(stc_comm *c, char *buf, size_t count, int dtype, int op, char *err, size_t errlen) {
    int m = c->cfg.num_nodes, pos = c->cfg.node;
    size_t esz = stc_dtype_size(dtype);
    piece sends[2 * 64], recvs[2 * 64], *ps = sends, *pr = recvs;
    piece *heap = NULL;
    if (m > 64) {
        heap = malloc(sizeof(piece) * 4 * (size_t)m);
        if (!heap) return fail(err, errlen, STC_E_SYS, "%s: out of memory", c->what);
        ps = heap;
        pr = heap + 2 * m;
    }
#define SEG_LO(i) (count * (size_t)(i) / (size_t)m)
#define SEG(i, red) ((piece){buf + SEG_LO(i) * esz, (SEG_LO((i) + 1) - SEG_LO(i)) * esz, red})
    for (int k = 0; k < m - 1; k++) pr[k] = SEG(((pos - k - 1) % m + m) % m, 1);
    for (int k = 0; k < m - 1; k++) pr[m - 1 + k] = SEG(((pos - k) % m + m) % m, 0);
    ps[0] = SEG(pos, 0);
    for (int k = 0; k < 2 * m - 3; k++) ps[k + 1] = pr[k];
#undef SEG
#undef SEG_LO
    int rc = ring_run(c, ps, 2 * m - 2, pr, 2 * m - 2, ps[0].len, dtype, op, err, errlen);
    free(heap);
    return rc;
}

/* From the root host's leader along the ring; the leader before it only receives. */
static int ring_broadcast(stc_comm *c, char *buf, size_t nbytes, int root_node, char *err, size_t errlen) {
    int m = c->cfg.num_nodes, pos = c->cfg.node;
    int last = (root_node + m - 1) % m;
    if (pos == root_node) return ring_xfer(c, buf, nbytes, NULL, 0, 0, err, errlen);
    if (pos == last) return ring_xfer(c, NULL, 0, buf, nbytes, 0, err, errlen);
    return ring_xfer(c, buf, nbytes, buf, nbytes, 1, err, errlen);
}

/* ------------------------------------------------------------------------------ the ABI */

int stc_abi_version(void) { return STC_ABI_VERSION; }

int stc_comm_rank(const stc_comm *c) { return c ? c->cfg.rank : -1; }
int stc_comm_size(const stc_comm *c) { return c ? c->cfg.size : 0; }

/* The one piece of global state (see collective.h). */
static pthread_mutex_t current_lock = PTHREAD_MUTEX_INITIALIZER;
static stc_comm *current;

void stc_set_current(stc_comm *c) {
    pthread_mutex_lock(&current_lock);
    current = c;
    pthread_mutex_unlock(&current_lock);
}

stc_comm *stc_current_acquire(void) {
    pthread_mutex_lock(&current_lock);
    return current;
}

void stc_current_release(void) { pthread_mutex_unlock(&current_lock); }

static int begin(stc_comm *c, uint32_t kind, int dtype, int32_t arg, int ndim, const int64_t *dims, uint64_t count,
                 char *err, size_t errlen) {
    const char *what = kind_name(kind);
    if (!c) return fail(err, errlen, STC_E_ARG, "%s: no communicator", what);
    if (c->broken)
        return fail(err, errlen, STC_E_BROKEN,
                    "%s: an earlier collective failed on this rank, so its communicator cannot be used again", what);
    if (ndim < 0 || (ndim > 0 && !dims)) return fail(err, errlen, STC_E_ARG, "%s: bad shape (ndim %d)", what, ndim);
    c->what = what;
    c->deadline = now_s() + c->cfg.timeout_s;
    set_desc(&c->desc, kind, dtype, arg, ndim, dims, count);
    return STC_OK;
}

/* A disagreement leaves the communicator as it was (every rank made the same steps); anything
 * else may have left peers mid-collective, so the communicator is done. */
static int finish(stc_comm *c, int rc) {
    if (rc && rc != STC_E_MISMATCH) mark_failed(c);
    return rc;
}

/* Where the ring is involved, the ranks agree before any data moves: each host's ranks compare
 * descriptors in one shared-memory step, the leaders pass their hosts' verdicts around the ring,
 * and each leader hands the ring's verdict to its local ranks in one more step. Every rank of
 * every host then returns the same STC_E_MISMATCH, or all go on. (Over shared memory alone the
 * check rides on the collective's first step instead: shm_step_checked.) */
static int negotiate(stc_comm *c, char *err, size_t errlen) {
    verdict v;
    int L = c->cfg.local_size, rc;
    if (L > 1) {
        uint64_t s = c->seq + 1;
        state_of(c, c->cfg.local_rank)->desc[s % 2] = c->desc;
        rc = shm_step(c, err, errlen);
        if (rc) return rc;
        local_verdict(c, s, &v);
    } else {
        memset(&v, 0, sizeof v);
        v.rank_a = v.rank_b = c->cfg.rank;
        v.a = v.b = c->desc;
    }
    if (c->cfg.local_rank == 0) {
        rc = ring_verdict(c, &v, err, errlen);
        if (rc) return rc;
    }
    if (L > 1) {
        uint64_t s = c->seq + 1;
        if (c->cfg.local_rank == 0) {
            c->hdr->verdict_rc[s % 2] = v.disagree ? STC_E_MISMATCH : STC_OK;
            if (v.disagree) mismatch(c->hdr->verdict_msg[s % 2], MSG_BYTES, &v);
        }
        rc = shm_step(c, err, errlen);
        if (rc) return rc;
        rc = c->hdr->verdict_rc[s % 2];
        if (rc) return fail(err, errlen, rc, "%s", c->hdr->verdict_msg[s % 2]);
        return STC_OK;
    }
    return v.disagree ? mismatch(err, errlen, &v) : STC_OK;
}

static uint64_t elements(int ndim, const int64_t *dims) {
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= dims[i] > 0 ? (uint64_t)dims[i] : 0;
    return n;
}

/* The reduction of every rank's buf into buf; the caller has begun the collective. */
static int reduce_all(stc_comm *c, char *buf, size_t count, int dtype, int op, char *err, size_t errlen) {
    int rc, multi = c->cfg.num_nodes > 1;
    if (multi) {
        rc = negotiate(c, err, errlen);
        if (rc) return rc;
    }
    if (c->cfg.local_size > 1) {
        rc = shm_allreduce(c, buf, count, dtype, op, !multi, err, errlen);
        if (rc) return rc;
    }
    if (multi) {
        if (c->cfg.local_rank == 0) {
            rc = ring_allreduce(c, buf, count, dtype, op, err, errlen);
            if (rc) return rc;
        }
        if (c->cfg.local_size > 1) {
            rc = shm_broadcast(c, buf, count * stc_dtype_size(dtype), 0, 0, err, errlen);
            if (rc) return rc;
        }
    }
    if (op == STC_AVERAGE) stc_divide(buf, count, dtype, c->cfg.size);
    return STC_OK;
}

static int check_reduction(stc_comm *c, size_t count, const void *buf, int dtype, int op, char *err, size_t errlen) {
    char dt[32];
    dtype_text(dt, sizeof dt, (uint64_t)dtype);
    if (!stc_dtype_reducible(dtype)) return fail(err, errlen, STC_E_ARG, "%s: cannot reduce dtype %s", c->what, dt);
    if (op < STC_SUM || op > STC_PRODUCT) return fail(err, errlen, STC_E_ARG, "%s: no op %d", c->what, op);
    if (dtype == STC_BOOL && op == STC_AVERAGE)
        return fail(err, errlen, STC_E_ARG, "%s: bool has no average: use sum (or), min (and), max or product",
                    c->what);
    if (count && !buf) return fail(err, errlen, STC_E_ARG, "%s: no buffer", c->what);
    return STC_OK;
}

int stc_allreduce(stc_comm *c, void *buf, int dtype, int op, int ndim, const int64_t *dims, char *err, size_t errlen) {
    uint64_t count = ndim >= 0 && (ndim == 0 || dims) ? elements(ndim, dims) : 0;
    int rc = begin(c, K_ALLREDUCE, dtype, op, ndim, dims, count, err, errlen);
    if (!rc) rc = check_reduction(c, count, buf, dtype, op, err, errlen);
    if (rc) return rc;
    return finish(c, reduce_all(c, buf, count, dtype, op, err, errlen));
}

int stc_reducescatter(stc_comm *c, void *buf, void *out, int dtype, int op, int ndim, const int64_t *dims, char *err,
                      size_t errlen) {
    uint64_t count = ndim >= 0 && (ndim == 0 || dims) ? elements(ndim, dims) : 0;
    int rc = begin(c, K_REDUCESCATTER, dtype, op, ndim, dims, count, err, errlen);
    if (!rc) rc = check_reduction(c, count, buf, dtype, op, err, errlen);
    if (rc) return rc;
    if (ndim < 1) { /* refused after the ranks have compared, so that all refuse it together */
        rc = reduce_all(c, buf, count, dtype, op, err, errlen);
        if (rc) return finish(c, rc);
        return fail(err, errlen, STC_E_ARG, "reducescatter: a scalar has no rows to scatter; pass an array of at "
                    "least one dimension");
    }
    /* Horovod's split: rows / size each, one more for the first rows % size ranks. */
    uint64_t rows = (uint64_t)(dims[0] > 0 ? dims[0] : 0), size = (uint64_t)c->cfg.size, r = (uint64_t)c->cfg.rank;
    uint64_t row_elems = rows ? count / rows : 0, extra = rows % size;
    uint64_t first = r * (rows / size) + (r < extra ? r : extra), mine = rows / size + (r < extra ? 1 : 0);
    if (mine && !out) return fail(err, errlen, STC_E_ARG, "reducescatter: no output buffer");
    size_t esz = stc_dtype_size(dtype);
    if (c->cfg.num_nodes == 1 && c->cfg.local_size > 1) {
        rc = shm_reducescatter(c, buf, count, dtype, op, out, first * row_elems, (first + mine) * row_elems, err,
                               errlen);
        if (rc) return finish(c, rc);
        if (op == STC_AVERAGE) stc_divide(out, mine * row_elems, dtype, c->cfg.size);
        return STC_OK;
    }
    /* Across hosts (and for one rank): the whole reduction, then this rank's rows. */
    rc = reduce_all(c, buf, count, dtype, op, err, errlen);
    if (rc) return finish(c, rc);
    if (mine) memcpy(out, (char *)buf + first * row_elems * esz, mine * row_elems * esz);
    return STC_OK;
}

int stc_broadcast(stc_comm *c, void *buf, int dtype, int ndim, const int64_t *dims, int root, char *err,
                  size_t errlen) {
    uint64_t count = ndim >= 0 && (ndim == 0 || dims) ? elements(ndim, dims) : 0;
    int rc = begin(c, K_BROADCAST, dtype, root, ndim, dims, count, err, errlen);
    if (rc) return rc;
    size_t nbytes = count * stc_dtype_size(dtype);
    if (stc_dtype_size(dtype) == 0) return fail(err, errlen, STC_E_ARG, "broadcast: bad dtype %d", dtype);
    if (root < 0 || root >= c->cfg.size) return fail(err, errlen, STC_E_ARG, "broadcast: root %d is not a rank", root);
    if (nbytes && !buf) return fail(err, errlen, STC_E_ARG, "broadcast: no buffer");
    int root_node = c->rank_node[root], multi = c->cfg.num_nodes > 1;
    if (multi) {
        rc = negotiate(c, err, errlen);
        if (rc) return finish(c, rc);
    }
    if (c->cfg.local_size > 1 && c->cfg.node == root_node) {
        rc = shm_broadcast(c, buf, nbytes, c->rank_local[root], !multi, err, errlen);
        if (rc) return finish(c, rc);
    }
    if (multi) {
        if (c->cfg.local_rank == 0) {
            rc = ring_broadcast(c, buf, nbytes, root_node, err, errlen);
            if (rc) return finish(c, rc);
        }
        if (c->cfg.local_size > 1 && c->cfg.node != root_node) {
            rc = shm_broadcast(c, buf, nbytes, 0, 0, err, errlen);
            if (rc) return finish(c, rc);
        }
    }
    return STC_OK;
}

int stc_allgatherv(stc_comm *c, const void *in, void *out, const uint64_t *counts, int dtype, int ndim,
                   const int64_t *dims, char *err, size_t errlen) {
    if (!c || !counts) return fail(err, errlen, STC_E_ARG, "allgather: no communicator or counts");
    uint64_t total = 0, mine = 0;
    for (int r = 0; r < c->cfg.size; r++) {
        if (r == c->cfg.rank) mine = total;
        total += counts[r];
    }
    int rc = begin(c, K_ALLGATHER, dtype, 0, ndim, dims, total, err, errlen);
    if (rc) return rc;
    if (stc_dtype_size(dtype) == 0) return fail(err, errlen, STC_E_ARG, "allgather: bad dtype %d", dtype);
    if ((total && !out) || (counts[c->cfg.rank] && !in))
        return fail(err, errlen, STC_E_ARG, "allgather: missing buffer");
    /* Every byte has exactly one contributor, so a byte-wise sum with zeros elsewhere is exact. */
    if (total) memset(out, 0, total);
    if (counts[c->cfg.rank]) memcpy((char *)out + mine, in, counts[c->cfg.rank]);
    return finish(c, reduce_all(c, out, total, STC_UINT8, STC_SUM, err, errlen));
}

int stc_alltoallv(stc_comm *c, const void *in, void *out, const uint64_t *sends, int dtype, int ndim,
                  const int64_t *dims, char *err, size_t errlen) {
    if (!c || !sends) return fail(err, errlen, STC_E_ARG, "alltoall: no communicator or sends");
    int n = c->cfg.size, me = c->cfg.rank;
    uint64_t total = 0, mine = 0, got = 0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            total += sends[(size_t)i * n + j];
            if (i == me) mine += sends[(size_t)i * n + j];
            if (j == me) got += sends[(size_t)i * n + j];
        }
    int rc = begin(c, K_ALLTOALL, dtype, 0, ndim, dims, total, err, errlen);
    if (rc) return rc;
    if (stc_dtype_size(dtype) == 0) return fail(err, errlen, STC_E_ARG, "alltoall: bad dtype %d", dtype);
    if ((mine && !in) || (got && !out)) return fail(err, errlen, STC_E_ARG, "alltoall: missing buffer");
    if (c->cfg.num_nodes == 1 && c->cfg.local_size > 1) return finish(c, shm_alltoallv(c, in, out, sends, err, errlen));
    if (n == 1) {
        if (mine) memcpy(out, in, mine);
        return STC_OK;
    }
    /* Across hosts: every rank's whole send buffer to every rank (a byte-wise sum over zeros, as
     * allgather), of which each keeps its parts. Simple, at n times the traffic of a true alltoall. */
    char *all = total ? malloc(total) : NULL;
    if (total && !all) return fail(err, errlen, STC_E_SYS, "alltoall: out of memory for %llu bytes",
                                   (unsigned long long)total);
    uint64_t at = 0;
    for (int i = 0; i < me; i++)
        for (int j = 0; j < n; j++) at += sends[(size_t)i * n + j];
    if (total) memset(all, 0, total);
    if (mine) memcpy(all + at, in, mine);
    rc = reduce_all(c, all, total, STC_UINT8, STC_SUM, err, errlen);
    if (!rc) {
        uint64_t start = 0, dst = 0;
        for (int i = 0; i < n; i++) {
            uint64_t src = start, len = sends[(size_t)i * n + me];
            for (int j = 0; j < me; j++) src += sends[(size_t)i * n + j];
            if (len) memcpy((char *)out + dst, all + src, len);
            dst += len;
            for (int j = 0; j < n; j++) start += sends[(size_t)i * n + j];
        }
    }
    free(all);
    return finish(c, rc);
}

int stc_barrier(stc_comm *c, char *err, size_t errlen) {
    int rc = begin(c, K_BARRIER, STC_UINT8, 0, 0, NULL, 0, err, errlen);
    if (rc) return rc;
    return finish(c, reduce_all(c, NULL, 0, STC_UINT8, STC_SUM, err, errlen));
}

/* --------------------------------------------------------------------------- set up */

static int attach_segment(stc_comm *c, char *err, size_t errlen) {
    int L = c->cfg.local_size, lr = c->cfg.local_rank;
    size_t hdr_bytes = sizeof(header) + (size_t)L * STATE_BYTES;
    hdr_bytes = (hdr_bytes + 4095) & ~(size_t)4095;
    c->seg_bytes = hdr_bytes + 2 * (size_t)(L + 1) * c->cfg.chunk_bytes;
    double deadline = now_s() + c->cfg.timeout_s;
    int fd = -1;
    unsigned spins = 0;
    if (lr == 0) {
        fd = shm_open(c->shm_name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0 && errno == EEXIST) { /* left by a killed run with the same name: it is ours to replace */
            shm_unlink(c->shm_name);
            fd = shm_open(c->shm_name, O_CREAT | O_EXCL | O_RDWR, 0600);
        }
        if (fd < 0) return fail(err, errlen, STC_E_SYS, "shm_open(%s): %s", c->shm_name, strerror(errno));
        if (ftruncate(fd, (off_t)c->seg_bytes) != 0) {
            int e = errno;
            close(fd);
            shm_unlink(c->shm_name);
            return fail(err, errlen, STC_E_SYS, "sizing shared memory %s to %zu bytes: %s (is /dev/shm big enough?)",
                        c->shm_name, c->seg_bytes, strerror(e));
        }
    } else {
        for (;;) {
            fd = shm_open(c->shm_name, O_RDWR, 0600);
            if (fd >= 0) {
                struct stat st;
                if (fstat(fd, &st) == 0 && (size_t)st.st_size >= c->seg_bytes) break;
                close(fd);
                fd = -1;
            } else if (errno != ENOENT) {
                return fail(err, errlen, STC_E_SYS, "shm_open(%s): %s", c->shm_name, strerror(errno));
            }
            if (now_s() > deadline)
                return fail(err, errlen, STC_E_TIMEOUT,
                            "timed out after %.0f s waiting for local rank 0 to create shared memory %s",
                            c->cfg.timeout_s, c->shm_name);
            backoff(&spins);
        }
    }
    c->base = mmap(NULL, c->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (c->base == MAP_FAILED) {
        c->base = NULL;
        if (lr == 0) shm_unlink(c->shm_name);
        return fail(err, errlen, STC_E_SYS, "mmap of %zu bytes: %s", c->seg_bytes, strerror(errno));
    }
    c->hdr = (header *)c->base;
    c->data = (char *)c->base + hdr_bytes;
    if (lr == 0) {
        c->hdr->local_size = (uint64_t)L;
        c->hdr->chunk = c->cfg.chunk_bytes;
        c->hdr->seg_bytes = c->seg_bytes;
        atomic_store(&c->hdr->magic, MAGIC);
    } else {
        spins = 0;
        while (atomic_load(&c->hdr->magic) != MAGIC) {
            if (now_s() > deadline)
                return fail(err, errlen, STC_E_TIMEOUT, "shared memory %s was never initialised", c->shm_name);
            backoff(&spins);
        }
        if (c->hdr->local_size != (uint64_t)L || c->hdr->chunk != c->cfg.chunk_bytes)
            return fail(err, errlen, STC_E_MISMATCH, "shared memory %s: ranks disagree on the local size or chunk",
                        c->shm_name);
    }
    rank_state *me = state_of(c, lr);
    me->rank = c->cfg.rank;
    atomic_store(&me->heartbeat_ms, now_ms());
    atomic_store(&me->pid, (int32_t)getpid());
    atomic_store(&me->seq, 0);
    atomic_store(&me->waiters, 0);
    if (atomic_fetch_add(&c->hdr->attached, 1) + 1 == (uint32_t)L) {
        shm_unlink(c->shm_name); /* every rank has it mapped: nothing outlives the ranks now */
        c->unlinked = 1;
    }
    if (pthread_create(&c->hb_thread, NULL, heartbeat_main, c) != 0)
        return fail(err, errlen, STC_E_SYS, "cannot start the heartbeat thread");
    c->hb_started = 1;
    spins = 0;
    while (atomic_load(&c->hdr->attached) < (uint32_t)L) {
        if (now_s() > deadline)
            return fail(err, errlen, STC_E_TIMEOUT,
                        "timed out after %.0f s: only %u of %d ranks on this host attached to shared memory",
                        c->cfg.timeout_s, atomic_load(&c->hdr->attached), L);
        backoff(&spins);
    }
    c->unlinked = 1;
    return STC_OK;
}

int stc_create(const stc_config *cfg, stc_comm **out, char *err, size_t errlen) {
    if (!cfg || !out) return fail(err, errlen, STC_E_ARG, "no config");
    *out = NULL;
    if (cfg->size < 1 || cfg->rank < 0 || cfg->rank >= cfg->size || cfg->local_size < 1 || cfg->local_size > 64 ||
        cfg->local_rank < 0 || cfg->local_rank >= cfg->local_size || cfg->num_nodes < 1 || cfg->node < 0 ||
        cfg->node >= cfg->num_nodes || cfg->timeout_s <= 0)
        return fail(err, errlen, STC_E_ARG, "bad topology: rank %d of %d, local %d of %d, host %d of %d", cfg->rank,
                    cfg->size, cfg->local_rank, cfg->local_size, cfg->node, cfg->num_nodes);
    if (!(cfg->spin_s >= 0 && cfg->spin_s <= cfg->timeout_s))
        return fail(err, errlen, STC_E_ARG, "spin_s %g: must be from 0 to the timeout (%g s)", cfg->spin_s,
                    cfg->timeout_s);
    if (cfg->num_nodes > 1 && cfg->local_rank == 0 && (cfg->next_fd < 0 || cfg->prev_fd < 0))
        return fail(err, errlen, STC_E_ARG, "a host's leader needs its ring connections");
    stc_comm *c = calloc(1, sizeof *c);
    if (!c) return fail(err, errlen, STC_E_SYS, "out of memory");
    c->cfg = *cfg;
    c->cfg.next_fd = c->cfg.prev_fd = -1; /* owned only once create succeeds */
    c->culprit = -1;
    if (!c->cfg.chunk_bytes) c->cfg.chunk_bytes = DEFAULT_CHUNK;
    c->cfg.chunk_bytes = (c->cfg.chunk_bytes + 63) & ~(size_t)63;
    if (c->cfg.heartbeat_s <= 0) c->cfg.heartbeat_s = 30;
    c->rank_node = calloc((size_t)cfg->size, sizeof(int));
    c->rank_local = calloc((size_t)cfg->size, sizeof(int));
    c->leader_of = calloc((size_t)cfg->num_nodes, sizeof(int));
    if (!c->rank_node || !c->rank_local || !c->leader_of) {
        stc_destroy(c);
        return fail(err, errlen, STC_E_SYS, "out of memory");
    }
    c->cfg.shm_name = NULL;
    c->cfg.rank_node = c->cfg.rank_local = NULL;
    for (int i = 0; i < cfg->num_nodes; i++) c->leader_of[i] = -1;
    for (int r = 0; cfg->rank_node && cfg->rank_local && r < cfg->size; r++) {
        if (cfg->rank_node[r] < 0 || cfg->rank_node[r] >= cfg->num_nodes) break;
        c->rank_node[r] = cfg->rank_node[r];
        c->rank_local[r] = cfg->rank_local[r];
        if (cfg->rank_local[r] == 0) c->leader_of[cfg->rank_node[r]] = r;
    }
    for (int i = 0; i < cfg->num_nodes; i++) {
        if (c->leader_of[i] < 0 || !cfg->rank_node || cfg->rank_node[cfg->rank] != cfg->node) {
            stc_destroy(c);
            return fail(err, errlen, STC_E_ARG, "bad host map: every host needs a local rank 0, and rank %d must be on "
                        "host %d", cfg->rank, cfg->node);
        }
    }
    snprintf(c->shm_name, sizeof c->shm_name, "%s", cfg->shm_name ? cfg->shm_name : "");
    c->unlinked = 1;
    if (cfg->local_size > 1) {
        if (c->shm_name[0] != '/') {
            stc_destroy(c);
            return fail(err, errlen, STC_E_ARG, "shm_name must start with '/'");
        }
        c->unlinked = 0;
        int rc = attach_segment(c, err, errlen);
        if (rc) {
            if (!c->unlinked) shm_unlink(c->shm_name);
            c->unlinked = 1;
            stc_destroy(c);
            return rc;
        }
    }
    if (cfg->num_nodes > 1 && cfg->local_rank == 0) {
        fcntl(cfg->next_fd, F_SETFL, fcntl(cfg->next_fd, F_GETFL) | O_NONBLOCK);
        fcntl(cfg->prev_fd, F_SETFL, fcntl(cfg->prev_fd, F_GETFL) | O_NONBLOCK);
        c->cfg.next_fd = cfg->next_fd;
        c->cfg.prev_fd = cfg->prev_fd;
    }
    *out = c;
    return STC_OK;
}

void stc_destroy(stc_comm *c) {
    if (!c) return;
    if (!c->broken && c->cfg.next_fd >= 0) send_record(c, 0); /* closed in good order */
    if (c->hb_started) {
        atomic_store(&c->hb_stop, 1);
        pthread_join(c->hb_thread, NULL);
    }
    if (c->base) munmap(c->base, c->seg_bytes);
    if (!c->unlinked && c->shm_name[0]) shm_unlink(c->shm_name);
    if (c->cfg.next_fd >= 0) close(c->cfg.next_fd);
    if (c->cfg.prev_fd >= 0 && c->cfg.prev_fd != c->cfg.next_fd) close(c->cfg.prev_fd);
    free(c->tmp);
    free(c->stage);
    free(c->rank_node);
    free(c->rank_local);
    free(c->leader_of);
    free(c);
}
