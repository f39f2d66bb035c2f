/* Algorithms within one host, over the shared-memory transport (shm.c).
 *
 * Reductions: small chunks are reduced by every rank from all slots (copy in, then reduce); large
 * ones are reduced in shares into the result area and then copied out (two steps). Each element
 * is reduced by one rule, in rank order, so every rank gets the same bits.
 *
 * Moves: in local_exchange every local rank streams its bytes through its slot and every rank
 * reads what it needs of every slot; in local_publish one rank streams and the others read. What
 * a reader takes of each chunk is up to its sink, so allgather, broadcast and alltoall copy only
 * the bytes they need.
 *
 * checked: a collective's first step is also where the local ranks compare their descriptors
 * (shm_step_checked); it is unchecked where the ranks have already agreed (negotiate).
 */
#include "engine.h"

#include <string.h>

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
        for (int r = 0; r < L; r++) srcs[r] = shm_slot(c, s, r) + lo * esz;
        stc_reduce(shm_result_area(c, s) + lo * esz, srcs, L, hi - lo, dtype, op);
        atomic_fetch_add(&c->hdr->done[p], 1);
        if (atomic_load(&c->hdr->done_waiters[p])) shm_wake(&c->hdr->done[p]);
    }
    c->claimed_base[p] += ns + (uint32_t)L;
    uint32_t target = c->done_base[p] += ns;
    return shm_await(c, &c->hdr->done[p], &c->hdr->done_waiters[p], target, -1, err, errlen);
}

/* The reduction of every local rank's buf, into buf on local rank `to`, or on every local rank
 * (to < 0); a rank that does not receive it only lends its slot and its share of the work.
 * checked: the first step is the collective's first (shm_step_checked); otherwise the ranks have
 * already agreed (negotiate). */
int local_allreduce(stc_comm *c, char *buf, size_t count, int dtype, int op, int to, int checked, char *err,
                    size_t errlen) {
    size_t esz = stc_dtype_size(dtype), chunk_elems = c->cfg.chunk_bytes / esz;
    int L = c->cfg.local_size, lr = c->cfg.local_rank, first = checked;
    size_t off = 0;
    do {
        size_t m = count - off < chunk_elems ? count - off : chunk_elems;
        uint64_t s = c->seq + 1;
        if (m) memcpy(shm_slot(c, s, lr), buf + off * esz, m * esz); /* buf may be NULL when m is 0 */
        int rc = first ? shm_step_checked(c, err, errlen) : shm_step(c, err, errlen);
        if (rc) return rc;
        first = 0;
        const void *srcs[64];
        int mine = to < 0 || to == lr;
        if (m * esz <= SMALL_BYTES) {
            if (mine) {
                for (int r = 0; r < L; r++) srcs[r] = shm_slot(c, s, r);
                stc_reduce(buf + off * esz, srcs, L, m, dtype, op);
            }
        } else {
            rc = reduce_shares(c, s, m, dtype, op, err, errlen);
            if (rc) return rc;
            if (mine) memcpy(buf + off * esz, shm_result_area(c, s), m * esz);
        }
        off += m;
    } while (off < count);
    return STC_OK;
}

/* A reduce-scatter within one host: as local_allreduce, except that each rank reduces (small
 * chunks) or copies out (large ones, reduced in shares by all) only the elements [lo, hi) it
 * keeps, into out. The collective's first step; buf is only read. */
int local_reducescatter(stc_comm *c, const char *buf, size_t count, int dtype, int op, char *out, size_t lo,
                        size_t hi, char *err, size_t errlen) {
    size_t esz = stc_dtype_size(dtype), chunk_elems = c->cfg.chunk_bytes / esz;
    int L = c->cfg.local_size, lr = c->cfg.local_rank, first = 1;
    size_t off = 0;
    do {
        size_t m = count - off < chunk_elems ? count - off : chunk_elems;
        uint64_t s = c->seq + 1;
        if (m) memcpy(shm_slot(c, s, lr), buf + off * esz, m * esz);
        int rc = first ? shm_step_checked(c, err, errlen) : shm_step(c, err, errlen);
        if (rc) return rc;
        first = 0;
        size_t a = lo > off ? lo : off, b = hi < off + m ? hi : off + m; /* this rank's part of the chunk */
        if (m * esz <= SMALL_BYTES) {
            if (a < b) {
                const void *srcs[64];
                for (int r = 0; r < L; r++) srcs[r] = shm_slot(c, s, r) + (a - off) * esz;
                stc_reduce(out + (a - lo) * esz, srcs, L, b - a, dtype, op);
            }
        } else {
            rc = reduce_shares(c, s, m, dtype, op, err, errlen);
            if (rc) return rc;
            if (a < b) memcpy(out + (a - lo) * esz, shm_result_area(c, s) + (a - off) * esz, (b - a) * esz);
        }
        off += m;
    } while (off < count);
    return STC_OK;
}

/* Copies len bytes between the stream that the pieces make, end to end, from offset off, and
 * flat: into the pieces, or out of them. */
static void stream_copy(const piece *ps, int np, size_t off, char *flat, size_t len, int into_pieces) {
    for (int i = 0; i < np && len; i++) {
        if (off >= ps[i].len) {
            off -= ps[i].len;
            continue;
        }
        size_t n = ps[i].len - off < len ? ps[i].len - off : len;
        if (into_pieces) memcpy(ps[i].p + off, flat, n);
        else memcpy(flat, ps[i].p + off, n);
        flat += n;
        len -= n;
        off = 0;
    }
}

/* Every local rank streams its lens[local rank] bytes (mine, on this rank) through its slot, a
 * chunk per step; in each step every rank hands every local rank's chunk to sink. */
int local_exchange(stc_comm *c, const char *mine, const size_t *lens, int checked, stc_sink sink, void *ctx,
                   char *err, size_t errlen) {
    int L = c->cfg.local_size, lr = c->cfg.local_rank;
    size_t chunk = c->cfg.chunk_bytes, longest = 0;
    for (int r = 0; r < L; r++)
        if (lens[r] > longest) longest = lens[r];
    size_t steps = longest ? (longest + chunk - 1) / chunk : 1;
    for (size_t k = 0; k < steps; k++) {
        size_t base = k * chunk;
        uint64_t s = c->seq + 1;
        size_t own = lens[lr] > base ? lens[lr] - base : 0;
        if (own) memcpy(shm_slot(c, s, lr), mine + base, own < chunk ? own : chunk);
        int rc = k == 0 && checked ? shm_step_checked(c, err, errlen) : shm_step(c, err, errlen);
        if (rc) return rc;
        for (int r = 0; r < L; r++)
            if (lens[r] > base) {
                size_t m = lens[r] - base;
                sink(c, ctx, r, base, shm_slot(c, s, r), m < chunk ? m : chunk);
            }
    }
    return STC_OK;
}

/* Local rank root streams the pieces, end to end, through its slot, a chunk per step; every other
 * local rank hands each chunk to sink, with its offset in the stream. */
int local_publish(stc_comm *c, int root, const piece *ps, int np, int checked, stc_sink sink, void *ctx, char *err,
                  size_t errlen) {
    size_t chunk = c->cfg.chunk_bytes, total = 0;
    for (int i = 0; i < np; i++) total += ps[i].len;
    size_t steps = total ? (total + chunk - 1) / chunk : 1;
    int me = c->cfg.local_rank == root;
    for (size_t k = 0; k < steps; k++) {
        size_t base = k * chunk, m = total - base < chunk ? total - base : chunk;
        uint64_t s = c->seq + 1;
        if (me && m) stream_copy(ps, np, base, shm_slot(c, s, root), m, 0);
        int rc = k == 0 && checked ? shm_step_checked(c, err, errlen) : shm_step(c, err, errlen);
        if (rc) return rc;
        if (!me && m) sink(c, ctx, root, base, shm_slot(c, s, root), m);
    }
    return STC_OK;
}

typedef struct pieces {
    const piece *ps;
    int np;
} pieces;

/* The reader's copy of a published stream lands in its own pieces, which lie where the root's do. */
static void into_pieces(stc_comm *c, void *ctx, int src, size_t off, const char *p, size_t len) {
    (void)c, (void)src;
    pieces *to = ctx;
    stream_copy(to->ps, to->np, off, (char *)p, len, 1);
}

/* The pieces, from local rank root to every local rank, where they lie on each. */
int local_copy_pieces(stc_comm *c, const piece *ps, int np, int root, char *err, size_t errlen) {
    pieces to = {ps, np};
    return local_publish(c, root, ps, np, 0, into_pieces, &to, err, errlen);
}

int local_broadcast(stc_comm *c, char *buf, size_t nbytes, int root, int checked, char *err, size_t errlen) {
    piece p = {buf, nbytes, 0, -1};
    pieces to = {&p, 1};
    return local_publish(c, root, &p, 1, checked, into_pieces, &to, err, errlen);
}

typedef struct gather {
    char *out;
    const uint64_t *offs; /* each global rank's place in out */
} gather;

static void into_place(stc_comm *c, void *ctx, int src, size_t off, const char *p, size_t len) {
    gather *g = ctx;
    memcpy(g->out + g->offs[c->local_global[src]] + off, p, len);
}

/* Every local rank's counts[rank] bytes (in, on this rank) into out at offs[rank], on every local
 * rank: each byte is copied in once and out once per reader. */
int local_allgatherv(stc_comm *c, const char *in, char *out, const uint64_t *offs, const uint64_t *counts,
                     int checked, char *err, size_t errlen) {
    size_t lens[64];
    for (int r = 0; r < c->cfg.local_size; r++) lens[r] = counts[c->local_global[r]];
    gather g = {out, offs};
    return local_exchange(c, in, lens, checked, into_place, &g, err, errlen);
}
