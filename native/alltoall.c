/* The alltoall: every rank's part for every rank, moved only where it is going.
 *
 * Within one host (alltoall_local), every local rank streams its send buffer through its slot,
 * and each rank copies out of every slot the part addressed to it.
 *
 * Across hosts (alltoall_hosts), three phases:
 *  1. Within each host, as above; the leader also takes the parts addressed to other hosts, into
 *     tx, one block per destination host (the block of host s for host g: the parts of s's ranks,
 *     in rank order, for g's ranks, in rank order).
 *  2. Between the leaders, a ring alltoall: each block travels from its host to its destination,
 *     a hop per step, passed on as it arrives. In step k a leader receives the blocks of the host
 *     k before it that go to it and beyond, keeps the one for its host, and passes the rest on.
 *  3. Within each host, the leader publishes the blocks for its host; each rank copies its parts.
 * So a byte crosses only the ring links between its source host and its destination host, and a
 * leader holds only what passes through it.
 */
#include "engine.h"

#include <stdlib.h>
#include <string.h>

typedef struct plan {
    const uint64_t *sends; /* n * n: sends[i * n + j], the bytes rank i sends rank j */
    int n, me, pos;
    char *out;
    char *tx;          /* the leader's: this host's blocks for the others, nearest host first */
    uint64_t *tx_at;   /* local_size * n: where local rank l's part for rank j lies in tx */
    uint64_t *out_at;  /* n: where rank i's part for this rank goes in out */
    uint64_t *self_at; /* n: where rank i's part for this rank lies in the stream of blocks for this host */
} plan;

static uint64_t part(const plan *pl, int i, int j) { return pl->sends[(size_t)i * pl->n + j]; }

static uint64_t row(const plan *pl, int i) {
    uint64_t t = 0;
    for (int j = 0; j < pl->n; j++) t += part(pl, i, j);
    return t;
}

/* Copies the overlap of [at, at + len) and the window [off, off + wlen) at p to dst + (its offset
 * from at). */
static void overlap(char *dst, uint64_t at, uint64_t len, size_t off, const char *p, size_t wlen) {
    uint64_t a = at > off ? at : off, b = at + len < off + wlen ? at + len : off + wlen;
    if (a < b) memcpy(dst + (a - at), p + (a - off), b - a);
}

/* Phase 1's sink: a window of local rank src's send buffer. The part for this rank goes to out;
 * on a leader, parts for other hosts go to tx. */
static void route_sends(stc_comm *c, void *ctx, int src, size_t off, const char *p, size_t len) {
    plan *pl = ctx;
    int i = c->local_global[src];
    uint64_t at = 0;
    for (int j = 0; j < pl->n && at < off + len; j++) {
        uint64_t m = part(pl, i, j);
        if (j == pl->me) overlap(pl->out + pl->out_at[i], at, m, off, p, len);
        else if (pl->tx && c->rank_node[j] != pl->pos)
            overlap(pl->tx + pl->tx_at[(size_t)src * pl->n + j], at, m, off, p, len);
        at += m;
    }
}

/* Phase 3's sink: a window of the stream of blocks for this host; this rank's parts go to out. */
static void route_arrivals(stc_comm *c, void *ctx, int src, size_t off, const char *p, size_t len) {
    (void)src;
    plan *pl = ctx;
    for (int i = 0; i < pl->n; i++)
        if (c->rank_node[i] != pl->pos)
            overlap(pl->out + pl->out_at[i], pl->self_at[i], part(pl, i, pl->me), off, p, len);
}

/* Phase 1, on its own where every rank is on this host: the first step compares descriptors. */
static int exchange(stc_comm *c, plan *pl, const char *in, int checked, char *err, size_t errlen) {
    if (c->cfg.local_size == 1) {
        route_sends(c, pl, 0, 0, in, row(pl, pl->me));
        return STC_OK;
    }
    size_t lens[64];
    for (int l = 0; l < c->cfg.local_size; l++) lens[l] = row(pl, c->local_global[l]);
    return local_exchange(c, in, lens, checked, route_sends, pl, err, errlen);
}

static int outs(plan *pl, const uint64_t *sends, int n, int me, char *out) {
    pl->sends = sends;
    pl->n = n;
    pl->me = me;
    pl->out = out;
    pl->out_at = calloc((size_t)n, sizeof(uint64_t));
    if (!pl->out_at) return -1;
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        pl->out_at[i] = at;
        at += part(pl, i, me);
    }
    return 0;
}

int alltoall_local(stc_comm *c, const char *in, char *out, const uint64_t *sends, char *err, size_t errlen) {
    plan pl = {0};
    if (outs(&pl, sends, c->cfg.size, c->cfg.rank, out))
        return fail(err, errlen, STC_E_SYS, "%s: out of memory", c->what);
    pl.pos = c->cfg.node;
    int rc = exchange(c, &pl, in, 1, err, errlen);
    free(pl.out_at);
    return rc;
}

/* The ring phase's pieces, and the blocks for this host (phase 3's stream), which every local
 * rank lays out alike; only the leader's point at bytes (rx). */
typedef struct ring_plan {
    piece *ps, *pr, *mine;
    int ns, nr;
    char *rx;
} ring_plan;

static int plan_ring(stc_comm *c, plan *pl, const uint64_t *bs, ring_plan *rp) {
    int m = c->cfg.num_nodes, pos = pl->pos, n = pl->n, leader = c->cfg.local_rank == 0;
    rp->mine = calloc((size_t)m, sizeof(piece));
    pl->self_at = calloc((size_t)n, sizeof(uint64_t));
    if (!rp->mine || !pl->self_at) return -1;
    uint64_t at = 0;
    for (int k = 1; k < m; k++) { /* the blocks for this host, from the host k before it */
        int s = (pos - k + m) % m;
        rp->mine[k - 1].len = bs[(size_t)s * m + pos];
        for (int i = 0; i < n; i++)
            if (c->rank_node[i] == s)
                for (int j = 0; j < n; j++)
                    if (c->rank_node[j] == pos) {
                        if (j == pl->me) pl->self_at[i] = at;
                        at += part(pl, i, j);
                    }
    }
    if (!leader) return 0;
    size_t tx_bytes = 0, rx_bytes = 0, pieces = (size_t)m * (size_t)m;
    for (int d = 1; d < m; d++) tx_bytes += bs[(size_t)pos * m + (pos + d) % m];
    for (int k = 1; k < m; k++)
        for (int e = 0; e < m - k; e++) rx_bytes += bs[(size_t)((pos - k + m) % m) * m + (pos + e) % m];
    pl->tx = malloc(tx_bytes ? tx_bytes : 1);
    rp->rx = malloc(rx_bytes ? rx_bytes : 1);
    pl->tx_at = calloc((size_t)c->cfg.local_size * n, sizeof(uint64_t));
    rp->ps = calloc(pieces, sizeof(piece));
    rp->pr = calloc(pieces, sizeof(piece));
    if (!pl->tx || !rp->rx || !pl->tx_at || !rp->ps || !rp->pr) return -1;
    at = 0;
    for (int d = 1; d < m; d++) { /* step 1 sends this host's blocks, nearest destination first */
        int g = (pos + d) % m;
        rp->ps[rp->ns++] = (piece){pl->tx + at, bs[(size_t)pos * m + g], 0, -1};
        for (int i = 0; i < n; i++)
            if (c->rank_node[i] == pos)
                for (int j = 0; j < n; j++)
                    if (c->rank_node[j] == g) {
                        pl->tx_at[(size_t)c->rank_local[i] * n + j] = at;
                        at += part(pl, i, j);
                    }
    }
    at = 0;
    for (int k = 1; k < m; k++) { /* step k receives host s's blocks for this host and beyond */
        int s = (pos - k + m) % m;
        for (int e = 0; e < m - k; e++) {
            uint64_t len = bs[(size_t)s * m + (pos + e) % m];
            rp->pr[rp->nr] = (piece){rp->rx + at, len, 0, -1};
            if (e == 0) rp->mine[k - 1].p = rp->rx + at;
            else if (k < m - 1) rp->ps[rp->ns++] = (piece){rp->rx + at, len, 0, rp->nr}; /* on, in step k+1 */
            rp->nr++;
            at += len;
        }
    }
    return 0;
}

/* The caller has begun the collective and the ranks have agreed on it (negotiate). */
int alltoall_hosts(stc_comm *c, const char *in, char *out, const uint64_t *sends, char *err, size_t errlen) {
    int m = c->cfg.num_nodes, n = c->cfg.size, leader = c->cfg.local_rank == 0, rc;
    plan pl = {0};
    ring_plan rp = {0};
    uint64_t *bs = calloc((size_t)m * m, sizeof(uint64_t)); /* bs[s * m + g]: the block of host s for host g */
    pl.pos = c->cfg.node;
    if (!bs || outs(&pl, sends, n, c->cfg.rank, out)) {
        rc = fail(err, errlen, STC_E_SYS, "%s: out of memory", c->what);
        goto done;
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) bs[(size_t)c->rank_node[i] * m + c->rank_node[j]] += part(&pl, i, j);
    if (plan_ring(c, &pl, bs, &rp)) {
        rc = fail(err, errlen, STC_E_SYS, "%s: out of memory for the ring's blocks", c->what);
        goto done;
    }
    rc = exchange(c, &pl, in, 0, err, errlen);
    if (!rc && leader) rc = link_stream(c, rp.ps, rp.ns, rp.pr, rp.nr, -1, 0, err, errlen);
    if (!rc && c->cfg.local_size > 1) rc = local_publish(c, 0, rp.mine, m - 1, 0, route_arrivals, &pl, err, errlen);
    if (!rc && leader) {
        size_t off = 0;
        for (int k = 0; k < m - 1; k++) {
            route_arrivals(c, &pl, 0, off, rp.mine[k].p, rp.mine[k].len);
            off += rp.mine[k].len;
        }
    }
done:
    free(bs);
    free(pl.out_at);
    free(pl.self_at);
    free(pl.tx);
    free(pl.tx_at);
    free(rp.ps);
    free(rp.pr);
    free(rp.mine);
    free(rp.rx);
    return rc;
}
