/* sparktrain's CPU collective engine: its C ABI (collective.h), composed of algorithms within a
 * host over shared memory (local.c, over shm.c) and between hosts over a TCP ring of the hosts'
 * leaders (ring.c and alltoall.c, over link.c). engine.h draws the layers.
 *
 * A collective on one host runs over shared memory alone. Across hosts, each host's ranks first
 * combine what they hold (reduce, gather), the leaders (local rank 0) run the ring, and each
 * leader hands the outcome to its local ranks; a large allreduce does the three in segments, the
 * local phases of some while the ring carries another (pipeline.c).
 *
 * Before any data moves, the ranks compare what each passed (a descriptor: kind, dtype, shape,
 * op or root). Within a host every rank publishes its descriptor with the collective's first
 * step and reads everyone's; across hosts each leader adds its host's verdict, the leaders pass
 * the verdicts around the ring, and each tells its local ranks the outcome in one more step. So
 * a disagreement is found by every rank at the same step, with the same message, and leaves the
 * communicator usable (STC_E_MISMATCH). Any other failure ends the communicator: the first one
 * is written into the host's segment and sent round the ring, so every rank names the same
 * culprit.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void mark_failed(stc_comm *c) {
    c->broken = 1;
    shm_note_failure(c);
    link_send_record(c, c->blame_code ? c->blame_code : STC_E_PEER);
}


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
    progress_begin(c);
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
        rc = shm_step_described(c, &v, err, errlen);
        if (rc) return rc;
    } else {
        verdict_of(&v, c->cfg.rank, &c->desc);
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
        if (pipe_wanted(c, count * stc_dtype_size(dtype)))
            return pipe_allreduce(c, buf, count, dtype, op, err, errlen); /* the three phases at once */
    }
    if (c->cfg.local_size > 1) { /* across hosts, into the leader's buf alone: the ring's input */
        rc = local_allreduce(c, buf, count, dtype, op, multi ? 0 : -1, !multi, err, errlen);
        if (rc) return rc;
    }
    if (multi) {
        if (c->cfg.local_rank == 0) {
            rc = ring_allreduce(c, buf, count, dtype, op, err, errlen);
            if (rc) return rc;
        }
        if (c->cfg.local_size > 1) {
            rc = local_broadcast(c, buf, count * stc_dtype_size(dtype), 0, 0, err, errlen);
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

static int allreduce_call(stc_comm *c, void *buf, int dtype, int op, int ndim, const int64_t *dims, char *err, size_t errlen) {
    uint64_t count = ndim >= 0 && (ndim == 0 || dims) ? elements(ndim, dims) : 0;
    int rc = begin(c, K_ALLREDUCE, dtype, op, ndim, dims, count, err, errlen);
    if (!rc) rc = check_reduction(c, count, buf, dtype, op, err, errlen);
    if (rc) return rc;
    return finish(c, reduce_all(c, buf, count, dtype, op, err, errlen));
}

static int reducescatter_call(stc_comm *c, void *buf, void *out, int dtype, int op, int ndim, const int64_t *dims, char *err,
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
        rc = local_reducescatter(c, buf, count, dtype, op, out, first * row_elems, (first + mine) * row_elems, err,
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

static int broadcast_call(stc_comm *c, void *buf, int dtype, int ndim, const int64_t *dims, int root, char *err,
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
        rc = local_broadcast(c, buf, nbytes, c->rank_local[root], !multi, err, errlen);
        if (rc) return finish(c, rc);
    }
    if (multi) {
        if (c->cfg.local_rank == 0) {
            rc = ring_broadcast(c, buf, nbytes, root_node, err, errlen);
            if (rc) return finish(c, rc);
        }
        if (c->cfg.local_size > 1 && c->cfg.node != root_node) {
            rc = local_broadcast(c, buf, nbytes, 0, 0, err, errlen);
            if (rc) return finish(c, rc);
        }
    }
    return STC_OK;
}

/* Every rank's counts[rank] bytes to out at offs[rank], on every rank: within the host over
 * shared memory, then the leaders pass each host's bytes round the ring, and each leader hands
 * the other hosts' bytes to its local ranks. */
static int allgather(stc_comm *c, const char *in, char *out, const uint64_t *offs, const uint64_t *counts,
                     char *err, size_t errlen) {
    int rc, multi = c->cfg.num_nodes > 1, me = c->cfg.rank;
    if (c->cfg.local_size == 1 && counts[me]) memcpy(out + offs[me], in, counts[me]);
    if (multi) {
        rc = negotiate(c, err, errlen);
        if (rc) return rc;
    }
    if (c->cfg.local_size > 1) {
        rc = local_allgatherv(c, in, out, offs, counts, !multi, err, errlen);
        if (rc) return rc;
    }
    if (!multi) return STC_OK;
    if (c->cfg.local_rank == 0) {
        rc = ring_allgatherv(c, out, offs, counts, err, errlen);
        if (rc) return rc;
    }
    if (c->cfg.local_size == 1) return STC_OK;
    int n = 0;
    piece *ps = malloc(sizeof(piece) * (size_t)c->cfg.size);
    if (!ps) return fail(err, errlen, STC_E_SYS, "%s: out of memory", c->what);
    for (int r = 0; r < c->cfg.size; r++)
        if (c->rank_node[r] != c->cfg.node) ps[n++] = (piece){out + offs[r], counts[r], 0, -1};
    rc = local_copy_pieces(c, ps, n, 0, err, errlen);
    free(ps);
    return rc;
}

static int allgatherv_call(stc_comm *c, const void *in, void *out, const uint64_t *counts, int dtype, int ndim,
                   const int64_t *dims, char *err, size_t errlen) {
    if (!c || !counts) return fail(err, errlen, STC_E_ARG, "allgather: no communicator or counts");
    uint64_t total = 0;
    for (int r = 0; r < c->cfg.size; r++) total += counts[r];
    int rc = begin(c, K_ALLGATHER, dtype, 0, ndim, dims, total, err, errlen);
    if (rc) return rc;
    if (stc_dtype_size(dtype) == 0) return fail(err, errlen, STC_E_ARG, "allgather: bad dtype %d", dtype);
    if ((total && !out) || (counts[c->cfg.rank] && !in))
        return fail(err, errlen, STC_E_ARG, "allgather: missing buffer");
    uint64_t *offs = malloc(sizeof(uint64_t) * (size_t)c->cfg.size);
    if (!offs) return fail(err, errlen, STC_E_SYS, "allgather: out of memory");
    for (int r = 0; r < c->cfg.size; r++) offs[r] = r ? offs[r - 1] + counts[r - 1] : 0;
    rc = allgather(c, in, out, offs, counts, err, errlen);
    free(offs);
    return finish(c, rc);
}

static int alltoallv_call(stc_comm *c, const void *in, void *out, const uint64_t *sends, int dtype, int ndim,
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
    if (n == 1) {
        if (mine) memcpy(out, in, mine);
        return STC_OK;
    }
    if (c->cfg.num_nodes == 1) return finish(c, alltoall_local(c, in, out, sends, err, errlen));
    rc = negotiate(c, err, errlen);
    if (!rc) rc = alltoall_hosts(c, in, out, sends, err, errlen);
    return finish(c, rc);
}

static int barrier_call(stc_comm *c, char *err, size_t errlen) {
    int rc = begin(c, K_BARRIER, STC_UINT8, 0, 0, NULL, 0, err, errlen);
    if (rc) return rc;
    return finish(c, reduce_all(c, NULL, 0, STC_UINT8, STC_SUM, err, errlen));
}


/* The ABI's collectives: each returns through progress_end, whichever way it ended. */
int stc_allreduce(stc_comm *c, void *buf, int dtype, int op, int ndim, const int64_t *dims, char *err, size_t errlen) {
    return progress_end(c, allreduce_call(c, buf, dtype, op, ndim, dims, err, errlen));
}

int stc_reducescatter(stc_comm *c, void *buf, void *out, int dtype, int op, int ndim, const int64_t *dims, char *err,
                      size_t errlen) {
    return progress_end(c, reducescatter_call(c, buf, out, dtype, op, ndim, dims, err, errlen));
}

int stc_broadcast(stc_comm *c, void *buf, int dtype, int ndim, const int64_t *dims, int root, char *err,
                  size_t errlen) {
    return progress_end(c, broadcast_call(c, buf, dtype, ndim, dims, root, err, errlen));
}

int stc_allgatherv(stc_comm *c, const void *in, void *out, const uint64_t *counts, int dtype, int ndim,
                   const int64_t *dims, char *err, size_t errlen) {
    return progress_end(c, allgatherv_call(c, in, out, counts, dtype, ndim, dims, err, errlen));
}

int stc_alltoallv(stc_comm *c, const void *in, void *out, const uint64_t *sends, int dtype, int ndim,
                  const int64_t *dims, char *err, size_t errlen) {
    return progress_end(c, alltoallv_call(c, in, out, sends, dtype, ndim, dims, err, errlen));
}

int stc_barrier(stc_comm *c, char *err, size_t errlen) {
    return progress_end(c, barrier_call(c, err, errlen));
}
