/* The shared-memory transport: one segment per host, mapped by each of its ranks.
 *
 * The segment holds a header, every local rank's state (step counter, heartbeat, pid, the
 * descriptor of the collective it is in) and two sets of buffers, one slot per rank plus one
 * result area each. A collective is a series of steps; in step s a rank writes into set s%2,
 * publishes s, waits until every local rank has published s, then reads. Every rank waits for
 * all at every step, so a buffer written for step s is not overwritten before step s+2, by which
 * time every reader is done with it (double buffering).
 *
 * Every wait has the collective's deadline. A waiting rank checks the ranks it waits for: a local
 * peer whose process is gone or whose heartbeat stopped fails the collective with the peer's rank
 * in the message. The first failure is written into the header, so every local rank names the
 * same culprit.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAGIC 0x5350524b434f4c31ull /* "SPRKCOL1" */
#define STATE_BYTES ((sizeof(rank_state) + CACHELINE - 1) / CACHELINE * CACHELINE)

static rank_state *state_of(stc_comm *c, int lr) {
    return (rank_state *)((char *)c->base + sizeof(header) + (size_t)lr * STATE_BYTES);
}

char *shm_slot(stc_comm *c, uint64_t step, int lr) {
    size_t per_set = (size_t)(c->cfg.local_size + 1) * c->cfg.chunk_bytes;
    return c->data + (step % 2) * per_set + (size_t)lr * c->cfg.chunk_bytes;
}

char *shm_result_area(stc_comm *c, uint64_t step) { return shm_slot(c, step, c->cfg.local_size); }

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

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected, long ns) {
    struct timespec ts = {0, ns};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, expected, &ts, NULL, 0);
}

void shm_wake(_Atomic uint32_t *addr) { syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0); }

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

/* Fails when waiting for st can no longer succeed: a rank failed, st is dead or frozen, or the
 * deadline passed. */
static int check_peer(stc_comm *c, rank_state *st, double t, char *err, size_t errlen) {
    int32_t failed = atomic_load(&c->hdr->failed);
    if (failed) {
        if (atomic_load(&c->hdr->why_of) == failed) { /* its reason came with it */
            blame(c, failed - 1, STC_E_PEER, c->hdr->failed_why);
            return fail(err, errlen, STC_E_PEER, "%s: rank %d %s (another rank on this host saw it first)", c->what,
                        failed - 1, c->hdr->failed_why);
        }
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
int shm_await(stc_comm *c, _Atomic uint32_t *ctr, _Atomic uint32_t *waiters, uint32_t target, int peer,
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
        /* Reached while this rank slept: a peer that moved it and then exited is no failure. */
        if (reached(atomic_load(ctr), target)) break;
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
int shm_step(stc_comm *c, char *err, size_t errlen) {
    uint32_t target = (uint32_t)++c->seq;
    rank_state *me = state_of(c, c->cfg.local_rank);
    atomic_store(&me->seq, target);
    if (atomic_load(&me->waiters)) shm_wake(&me->seq);
    for (int r = 0; r < c->cfg.local_size; r++) {
        rank_state *st = state_of(c, r);
        int rc = shm_await(c, &st->seq, &st->waiters, target, r, err, errlen);
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
int shm_step_checked(stc_comm *c, char *err, size_t errlen) {
    verdict v;
    int rc = shm_step_described(c, &v, err, errlen);
    if (rc) return rc;
    return v.disagree ? mismatch(err, errlen, &v) : STC_OK;
}

/* A step that also publishes this rank's descriptor of the collective; v receives the host's
 * verdict on them. */
int shm_step_described(stc_comm *c, verdict *v, char *err, size_t errlen) {
    uint64_t s = c->seq + 1;
    state_of(c, c->cfg.local_rank)->desc[s % 2] = c->desc;
    int rc = shm_step(c, err, errlen);
    if (rc) return rc;
    local_verdict(c, s, v);
    return STC_OK;
}


/* Maps the host's segment: local rank 0 creates it, the others wait for it; every rank then
 * waits until all have attached, and the last to attach unlinks it, so nothing outlives them. */
int shm_attach(stc_comm *c, char *err, size_t errlen) {
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

/* The first failure on this host, for the local peers to name: 1 + the culprit's rank. */
void shm_note_failure(stc_comm *c) {
    if (!c->hdr) return;
    int32_t expected = 0, who = (c->culprit >= 0 ? c->culprit : c->cfg.rank) + 1;
    if (c->why[0] && atomic_compare_exchange_strong(&c->hdr->why_claimed, &expected, 1)) {
        snprintf(c->hdr->failed_why, sizeof c->hdr->failed_why, "%s", c->why);
        atomic_store(&c->hdr->why_of, who); /* before failed: a rank that sees failed sees the reason */
    }
    expected = 0;
    atomic_compare_exchange_strong(&c->hdr->failed, &expected, who);
}

/* Stops the heartbeat, unmaps the segment, and unlinks it if some rank never attached. */
void shm_detach(stc_comm *c) {
    if (c->hb_started) {
        atomic_store(&c->hb_stop, 1);
        pthread_join(c->hb_thread, NULL);
        c->hb_started = 0;
    }
    if (c->base) munmap(c->base, c->seg_bytes);
    c->base = NULL;
    c->hdr = NULL;
    if (!c->unlinked && c->shm_name[0]) shm_unlink(c->shm_name);
    c->unlinked = 1;
}
