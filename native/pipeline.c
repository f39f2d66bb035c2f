/* A large allreduce across hosts, pipelined: the buffer goes in segments, so that a host's local
 * phases (its ranks' buffers reduced into the leader's before the ring, the ring's result handed
 * to them after) run while the ring between the leaders carries another segment. The link, the
 * slowest part, need not wait for local work.
 *
 * The segments. The ring gives each host a part of the buffer (host i's: its i-th m-th), whose
 * elements it reduces first, the next host adding its own and so on round the ring
 * (ring_allreduce_pieces). Segment k is the k-th of K slices of every host's part, so each
 * segment's ring reduces every element in the same order as one ring over the whole buffer:
 * the results are those of the unpipelined path, bit for bit. Whether a call is pipelined and
 * how it is cut depend only on what every rank knows alike (the size, the hosts, the most ranks
 * a host has), so every leader's ring cuts it the same way.
 *
 * The schedule. Every local rank makes the same shared-memory steps: reduce segment 0 (into the
 * leader's buffer alone); then, for each k, reduce segment k+1 and hand segment k out once the
 * ring is done with it. The leader runs the ring on a thread of its own, one segment after
 * another as the local reduction finishes them, on a view of the communicator (a copy of it
 * whose link state the thread owns until it is joined), while its main thread makes the steps
 * with its host's other ranks. Where the thread cannot start, and on a host of one rank, the
 * leader runs each segment's ring itself when the schedule needs it: the same bytes, no overlap.
 *
 * Failures. The collective's failure is the first one: the ring's, which the main thread meets
 * at its next wait for the ring, or a step's, which calls the ring off (it looks every few ms
 * while idle). Either way the thread is joined before the collective returns, so the leader's
 * abort record goes upstream (collective.c, finish) only once nothing else uses the sockets.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>

/* Pipelined from this many bytes, in segments of at most PIPE_SEG_BYTES. Measured with every host's
 * link at 1 Gbit/s and one core for its two ranks, in the ring's limit: serial, 0.96 at 2 MiB,
 * 0.90-0.93 at 4 MiB, 0.90-0.92 from 8 MiB; pipelined in 1 MiB segments 0.95-0.96 from 4 MiB
 * (2 MiB and 4 MiB segments: the same at 64 MiB, 0.91-0.95 at 4 MiB). */
#define PIPE_MIN_BYTES (4u << 20)
#define PIPE_SEG_BYTES (1u << 20)

typedef struct pipeline {
    stc_comm view; /* the ring thread's communicator */
    const piece *segs; /* segment k's part of host i: segs[k * m + i] */
    int nseg, m, dtype, op;
    int threaded;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int reduced, ringed; /* segments ready for the ring, and done by it (under mu) */
    int over;            /* the main thread is done with the ring: it stops (under mu) */
    int rc;              /* the ring's failure, or 0 (under mu) */
    _Atomic int cancel;  /* the view's stc_comm.cancel */
    char err[MSG_BYTES];
} pipeline;

int pipe_wanted(const stc_comm *c, size_t nbytes) {
    return c->cfg.num_nodes > 1 && c->most_local > 1 && nbytes >= PIPE_MIN_BYTES;
}

static void *ring_main(void *arg) {
    pipeline *p = arg;
    for (int k = 0; k < p->nseg; k++) {
        pthread_mutex_lock(&p->mu);
        while (p->reduced <= k && !p->over) pthread_cond_wait(&p->cv, &p->mu);
        int over = p->over;
        pthread_mutex_unlock(&p->mu);
        if (over) break;
        int rc = ring_allreduce_pieces(&p->view, p->segs + (size_t)k * p->m, p->dtype, p->op, p->err, sizeof p->err);
        pthread_mutex_lock(&p->mu);
        if (rc && !p->over) p->rc = rc; /* once called off, its failure is no one's news */
        if (!rc) p->ringed = k + 1;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        if (rc) break;
    }
    return NULL;
}

/* The leader's ring thread, on a view of c; its signals stay the main thread's. 0: not started. */
static int start_ring(stc_comm *c, pipeline *p) {
    p->view = *c;
    p->view.cancel = &p->cancel;
    if (pthread_mutex_init(&p->mu, NULL)) return 0;
    if (pthread_cond_init(&p->cv, NULL)) {
        pthread_mutex_destroy(&p->mu);
        return 0;
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&p->thread, NULL, ring_main, p);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc) {
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->mu);
        return 0;
    }
    return 1;
}

/* Ends the ring thread: called off unless it is done, joined, its link state taken back. The
 * collective's outcome is the ring's failure if that came first, else rc (the steps'). */
static int join_ring(stc_comm *c, pipeline *p, int rc, char *err, size_t errlen) {
    if (!p->threaded) return rc;
    pthread_mutex_lock(&p->mu);
    int ring_rc = p->rc;
    p->over = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    atomic_store(&p->cancel, 1);
    pthread_join(p->thread, NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    p->threaded = 0;
    link_take_state(c, &p->view);
    if (!ring_rc) return rc;
    blame(c, p->view.culprit, p->view.blame_code, p->view.why);
    return fail(err, errlen, ring_rc, "%s", p->err);
}

/* Segment k's local reduction into the leader's buffer; then it is the ring's. */
static int reduce_segment(stc_comm *c, pipeline *p, int k, char *err, size_t errlen) {
    size_t esz = stc_dtype_size(p->dtype);
    for (int i = 0; i < p->m; i++) {
        const piece *q = &p->segs[(size_t)k * p->m + i];
        if (!q->len) continue;
        int rc = local_allreduce(c, q->p, q->len / esz, p->dtype, p->op, 0, 0, err, errlen);
        if (rc) return rc;
    }
    if (p->threaded) {
        pthread_mutex_lock(&p->mu);
        p->reduced = k + 1;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    return STC_OK;
}

/* The leader waits until the ring is done with segment k (or runs it, without a thread). */
static int ring_segment(stc_comm *c, pipeline *p, int k, char *err, size_t errlen) {
    if (!p->threaded) return ring_allreduce_pieces(c, p->segs + (size_t)k * p->m, p->dtype, p->op, err, errlen);
    pthread_mutex_lock(&p->mu);
    while (p->ringed <= k && !p->rc) pthread_cond_wait(&p->cv, &p->mu);
    int rc = p->rc;
    pthread_mutex_unlock(&p->mu);
    return rc; /* a failure's message and culprit are taken from the view once it is joined */
}

static int schedule(stc_comm *c, pipeline *p, char *err, size_t errlen) {
    int L = c->cfg.local_size, leader = c->cfg.local_rank == 0, rc;
    size_t esz = stc_dtype_size(p->dtype);
    if (L > 1 && (rc = reduce_segment(c, p, 0, err, errlen))) return rc;
    for (int k = 0; k < p->nseg; k++) {
        const piece *seg = p->segs + (size_t)k * p->m;
        if (L > 1 && k + 1 < p->nseg && (rc = reduce_segment(c, p, k + 1, err, errlen))) return rc;
        if (leader && (rc = ring_segment(c, p, k, err, errlen))) return rc;
        if (L > 1 && (rc = local_copy_pieces(c, seg, p->m, 0, err, errlen))) return rc;
        if (p->op == STC_AVERAGE)
            for (int i = 0; i < p->m; i++) stc_divide(seg[i].p, seg[i].len / esz, p->dtype, c->cfg.size);
    }
    return STC_OK;
}

/* buf reduced over every rank (divided, for an average), on every rank; the ranks have agreed. */
int pipe_allreduce(stc_comm *c, char *buf, size_t count, int dtype, int op, char *err, size_t errlen) {
    int m = c->cfg.num_nodes;
    size_t esz = stc_dtype_size(dtype), nseg = (count * esz + PIPE_SEG_BYTES - 1) / PIPE_SEG_BYTES;
    pipeline *p = calloc(1, sizeof *p);
    piece *segs = malloc(sizeof(piece) * nseg * (size_t)m), *parts = malloc(sizeof(piece) * (size_t)m);
    if (!p || !segs || !parts) {
        free(p);
        free(segs);
        free(parts);
        return fail(err, errlen, STC_E_SYS, "%s: out of memory", c->what);
    }
    ring_parts(buf, count, esz, m, parts); /* each host's part, cut into nseg slices */
    for (int i = 0; i < m; i++) {
        size_t n = parts[i].len / esz;
        for (size_t k = 0; k < nseg; k++) {
            size_t a = n * k / nseg, b = n * (k + 1) / nseg;
            segs[k * (size_t)m + i] = (piece){parts[i].p + a * esz, (b - a) * esz, 0, -1};
        }
    }
    free(parts);
    p->segs = segs;
    p->nseg = (int)nseg;
    p->m = m;
    p->dtype = dtype;
    p->op = op;
    if (c->cfg.local_rank == 0 && c->cfg.local_size > 1) p->threaded = start_ring(c, p);
    int rc = join_ring(c, p, schedule(c, p, err, errlen), err, errlen);
    free(segs);
    free(p);
    return rc;
}
