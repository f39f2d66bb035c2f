/* Algorithms between hosts, run by each host's leader over the ring link (link.c).
 *
 * Allreduce is reduce-scatter then allgather as one stream: what a leader receives in one step
 * (reduced, in the first m-1; as it is, after) is what it sends in the next, passed on as it
 * arrives, so the steps do not wait for each other. Allgather passes each host's ranks' bytes
 * round the ring once: every leader receives every other host's bytes and nothing else.
 */
#include "engine.h"

#include <stdlib.h>
#include <string.h>

/* Every leader's verdict to every leader: m-1 steps, each passing on the record received in the
 * step before, so all leaders hold all records in host order and decide alike. The first host
 * whose own ranks disagree decides the message; otherwise the first host whose descriptor
 * differs from host 0's. */
int ring_verdict(stc_comm *c, verdict *mine, char *err, size_t errlen) {
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
        int rc = link_xfer(c, (const char *)&all[si], sizeof(verdict), (char *)&all[ri], sizeof(verdict), 0, err,
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
 * segment followed by the receive stream, less its last segment. by_host[i] is host i's segment
 * (whole elements): host i sends it first, so each of its elements is reduced starting from host
 * i's, then host i+1's added, and so on round the ring: the order depends only on which host's
 * segment an element is in. */
int ring_allreduce_pieces(stc_comm *c, const piece *by_host, int dtype, int op, char *err, size_t errlen) {
    int m = c->cfg.num_nodes, pos = c->cfg.node;
    piece *ps = malloc(sizeof(piece) * 4 * (size_t)m), *pr = ps ? ps + 2 * m : NULL;
    if (!ps) return fail(err, errlen, STC_E_SYS, "%s: out of memory", c->what);
#define SEG(i, red) ((piece){by_host[i].p, by_host[i].len, red, -1})
    for (int k = 0; k < m - 1; k++) pr[k] = SEG(((pos - k - 1) % m + m) % m, 1);
    for (int k = 0; k < m - 1; k++) pr[m - 1 + k] = SEG(((pos - k) % m + m) % m, 0);
    ps[0] = SEG(pos, 0);
#undef SEG
    for (int k = 0; k < 2 * m - 3; k++) {
        ps[k + 1] = pr[k];
        ps[k + 1].reduce = 0;
        ps[k + 1].from = k;
    }
    int rc = link_stream(c, ps, 2 * m - 2, pr, 2 * m - 2, dtype, op, err, errlen);
    free(ps);
    return rc;
}

/* Each of m hosts' part of count elements of esz bytes at buf, in by_host: host i's is the i-th
 * m-th (whole elements). */
void ring_parts(char *buf, size_t count, size_t esz, int m, piece *by_host) {
    for (int i = 0; i < m; i++) {
        size_t lo = count * (size_t)i / (size_t)m, hi = count * (size_t)(i + 1) / (size_t)m;
        by_host[i] = (piece){buf + lo * esz, (hi - lo) * esz, 0, -1};
    }
}

/* The whole buffer, in ring_parts' parts. */
int ring_allreduce(stc_comm *c, char *buf, size_t count, int dtype, int op, char *err, size_t errlen) {
    int m = c->cfg.num_nodes;
    piece *by_host = malloc(sizeof(piece) * (size_t)m);
    if (!by_host) return fail(err, errlen, STC_E_SYS, "%s: out of memory", c->what);
    ring_parts(buf, count, stc_dtype_size(dtype), m, by_host);
    int rc = ring_allreduce_pieces(c, by_host, dtype, op, err, errlen);
    free(by_host);
    return rc;
}

/* From the root host's leader along the ring; the leader before it only receives. */
int ring_broadcast(stc_comm *c, char *buf, size_t nbytes, int root_node, char *err, size_t errlen) {
    int m = c->cfg.num_nodes, pos = c->cfg.node;
    int last = (root_node + m - 1) % m;
    if (pos == root_node) return link_xfer(c, buf, nbytes, NULL, 0, 0, err, errlen);
    if (pos == last) return link_xfer(c, NULL, 0, buf, nbytes, 0, err, errlen);
    return link_xfer(c, buf, nbytes, buf, nbytes, 1, err, errlen);
}

/* Every rank's counts[rank] bytes, at offs[rank] in out, to every leader; this host's ranks' are
 * in place already. The receive stream is the hosts before this one, nearest first, each host's
 * ranks in rank order; the send stream is this host's, then what arrives, less the last host's
 * (the next leader's own). */
int ring_allgatherv(stc_comm *c, char *out, const uint64_t *offs, const uint64_t *counts, char *err, size_t errlen) {
    int m = c->cfg.num_nodes, pos = c->cfg.node, n = c->cfg.size;
    piece *ps = malloc(sizeof(piece) * 2 * (size_t)n), *pr = ps ? ps + n : NULL;
    if (!ps) return fail(err, errlen, STC_E_SYS, "%s: out of memory", c->what);
    int ns = 0, nr = 0;
    for (int r = 0; r < n; r++)
        if (c->rank_node[r] == pos) ps[ns++] = (piece){out + offs[r], counts[r], 0, -1};
    for (int d = 1; d < m; d++) {
        int h = (pos - d + m) % m;
        for (int r = 0; r < n; r++) {
            if (c->rank_node[r] != h) continue;
            pr[nr] = (piece){out + offs[r], counts[r], 0, -1};
            if (d < m - 1) ps[ns++] = (piece){out + offs[r], counts[r], 0, nr};
            nr++;
        }
    }
    int rc = link_stream(c, ps, ns, pr, nr, -1, 0, err, errlen);
    free(ps);
    return rc;
}
