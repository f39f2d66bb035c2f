/* What a collective call is, and the words for it: the descriptors ranks compare before any data
 * moves, a host's verdict on them, and the messages every rank of a disagreement returns. */
#define _GNU_SOURCE
#include "engine.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

uint64_t now_ms(void) { return (uint64_t)(now_s() * 1000.0); }

int fail(char *err, size_t errlen, int code, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* Who a failure is to blame on, and a phrase saying what happened to it. */
void blame(stc_comm *c, int rank, int code, const char *why) {
    c->culprit = rank;
    c->blame_code = code;
    snprintf(c->why, sizeof c->why, "%s", why);
}

const char *kind_name(uint64_t k) {
    static const char *names[] = {"?", "allreduce", "broadcast", "allgather", "barrier", "reducescatter", "alltoall"};
    return k < sizeof names / sizeof *names ? names[k] : "?";
}

static const char *op_name(int64_t op) {
    static const char *names[] = {"sum", "average", "min", "max", "product"};
    return op >= 0 && op < (int64_t)(sizeof names / sizeof *names) ? names[op] : "?";
}

void dtype_text(char *out, size_t n, uint64_t d) {
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

void set_desc(desc *d, uint32_t kind, int dtype, int32_t arg, int ndim, const int64_t *dims, uint64_t count) {
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
const char *desc_differs(const desc *a, const desc *b) {
    if (a->kind != b->kind) return "collectives";
    if (a->dtype != b->dtype) return "dtypes";
    if (a->ndim != b->ndim || a->count != b->count) return "shapes";
    for (uint32_t i = a->kind == K_ALLGATHER || a->kind == K_ALLTOALL ? 1 : 0; i < a->ndim && i < DESC_DIMS; i++)
        if (a->dims[i] != b->dims[i]) return "shapes";
    if (a->arg != b->arg) return a->kind == K_BROADCAST ? "roots" : "ops";
    return NULL;
}

/* The message every rank of a disagreement returns: the same text on all of them. */
int mismatch(char *err, size_t errlen, const verdict *v) {
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

/* The verdict of one rank alone: it agrees with itself. */
void verdict_of(verdict *v, int rank, const desc *d) {
    memset(v, 0, sizeof *v);
    v->rank_a = v->rank_b = rank;
    v->a = v->b = *d;
}
