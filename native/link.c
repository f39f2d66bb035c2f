/* The ring link: a host leader's two TCP connections, to the next host's leader (downstream) and
 * from the previous one (upstream). Data flows only downstream. link_stream moves a send stream
 * and a receive stream at once, and reduces received bytes as they arrive.
 *
 * Naming the failed rank on every host. The backward direction of a connection carries one
 * thing: an abort record ("rank X died"), sent upstream by a leader whose collective failed,
 * before it closes its sockets. Every leader reads its downstream socket whenever it waits on the
 * ring. A record read there fails the collective naming X, and is passed on upstream, so it goes
 * round the ring backwards. A downstream connection that closes with no record means the
 * downstream leader died (a live one would have sent one): its upstream names it and starts the
 * record. A leader whose upstream closed cannot tell a death from a failure further up, so it
 * waits a bounded while for the record to come round before naming its upstream neighbour. A
 * communicator closed in good order sends a record too (code 0, with how many bytes it
 * received), so that only a death closes a connection without one.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* How long a leader whose upstream closed waits for the abort record to come round the ring
 * before it names that neighbour: the record needs only a hop per leader, each as soon as that
 * leader next polls. */
#define RECORD_WAIT_S 5.0
/* Received bytes that are to be reduced land here first, a ring small enough to stay in cache. */
#define STAGE_BYTES (512u << 10)
/* How often a stream that may be called off (stc_comm.cancel) looks whether it is, while idle. */
#define CANCEL_POLL_MS 10

int link_next(stc_comm *c) { return c->leader_of[(c->cfg.node + 1) % c->cfg.num_nodes]; }
int link_prev(stc_comm *c) { return c->leader_of[(c->cfg.node + c->cfg.num_nodes - 1) % c->cfg.num_nodes]; }

/* Takes over a leader's connections, non-blocking from now on. */
void link_adopt(stc_comm *c, int next_fd, int prev_fd) {
    fcntl(next_fd, F_SETFL, fcntl(next_fd, F_GETFL) | O_NONBLOCK);
    fcntl(prev_fd, F_SETFL, fcntl(prev_fd, F_GETFL) | O_NONBLOCK);
    c->cfg.next_fd = next_fd;
    c->cfg.prev_fd = prev_fd;
}

void link_close(stc_comm *c) {
    if (!c->broken && c->cfg.next_fd >= 0) link_send_record(c, 0); /* closed in good order */
    if (c->cfg.next_fd >= 0) close(c->cfg.next_fd);
    if (c->cfg.prev_fd >= 0 && c->cfg.prev_fd != c->cfg.next_fd) close(c->cfg.prev_fd);
    c->cfg.next_fd = c->cfg.prev_fd = -1;
}

/* Upstream, once per communicator: a failure's record (code < 0), or, from a communicator
 * closed in good order, a record with code 0, so that a connection closing without any record
 * means its process died. The backward direction is otherwise idle: the record fits in its empty
 * send buffer and never blocks. */
void link_send_record(stc_comm *c, int code) {
    if (c->record_sent || c->cfg.num_nodes < 2 || c->cfg.local_rank != 0 || c->cfg.prev_fd < 0) return;
    c->record_sent = 1;
    record r;
    memset(&r, 0, sizeof r);
    r.magic = RECORD_MAGIC;
    r.culprit = c->culprit >= 0 && code ? c->culprit : c->cfg.rank;
    r.code = code;
    r.received = c->received_bytes;
    snprintf(r.why, sizeof r.why, "%s", !code ? "closed its communicator" : c->why[0] ? c->why : "failed");
    if (c->sec) {
        records_send_back(c, &r);
        return;
    }
    ssize_t n = send(c->cfg.prev_fd, &r, sizeof r, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)n; /* an upstream that is gone needs no record */
}

/* Downstream sent back something that is no abort record of it: never taken for data, nor believed. */
static void not_a_record(stc_comm *c, const char *what) {
    record *r = &c->rec_in;
    r->culprit = link_next(c);
    r->code = STC_E_PEER;
    snprintf(r->why, sizeof r->why, "%s", what);
    c->down = 1;
}

/* Reads what the downstream leader sent back: only ever one record. 1: a whole record; 0:
 * nothing yet; -1: downstream closed without one, so it died. Once known, the answer stays. */
static int read_record(stc_comm *c) {
    if (c->sec && !c->down) {
        int how = records_read_back(c, &c->rec_in);
        if (how == 1) {
            record *r = &c->rec_in;
            r->why[WHY_BYTES - 1] = 0;
            c->down = 1;
            if (r->magic != RECORD_MAGIC || r->culprit < 0 || r->culprit >= c->cfg.size || r->code > 0)
                not_a_record(c, "sent back bytes that are no abort record");
        } else if (how == -2) {
            char why[WHY_BYTES];
            snprintf(why, sizeof why, "sent back a record that failed authentication on the ring link from %s to %s",
                     c->next_host, c->host);
            not_a_record(c, why);
        } else if (how < 0) {
            c->down = -1;
        }
    }
    while (!c->down) {
        ssize_t n = recv(c->cfg.next_fd, (char *)&c->rec_in + c->rec_got, sizeof(record) - c->rec_got, MSG_DONTWAIT);
        if (n > 0) {
            c->rec_got += (size_t)n;
            if (c->rec_got < sizeof(record)) continue;
            record *r = &c->rec_in;
            r->why[WHY_BYTES - 1] = 0;
            c->down = 1;
            if (r->magic != RECORD_MAGIC || r->culprit < 0 || r->culprit >= c->cfg.size || r->code > 0)
                not_a_record(c, "sent back bytes that are no abort record");
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
        blame(c, link_next(c), STC_E_PEER, "died");
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
    blame(c, link_prev(c), STC_E_PEER, "closed its ring connection: it died or failed");
    return fail(err, errlen, STC_E_PEER, "%s: rank %d closed its connection (%s): it died or failed", c->what,
                link_prev(c), cause);
}

/* How much of send piece s may go: all of it when it is ready from the start or the received
 * piece it passes on is complete; as much of it as has arrived (and is reduced) while that piece
 * is the one being received (ri, done bytes of it); nothing before. */
static size_t ready_of(const piece *s, int ri, size_t done) {
    if (s->from < 0 || s->from < ri) return s->len;
    return s->from == ri ? done : 0;
}

/* A run of the ring: the send stream (sends, in order) to the next leader while the receive
 * stream (recvs) comes from the previous one. A received piece with reduce set is added into
 * its place (through the stage, element by element as they arrive); otherwise it lands there.
 * A sent piece that passes a received one on goes as its bytes arrive, so the steps of an
 * algorithm need not wait for each other: the ring streams. */
int link_stream(stc_comm *c, const piece *sends, int ns, const piece *recvs, int nr, int dtype, int op, char *err,
                size_t errlen) {
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
    while (si < ns || ri < nr || records_pending(c)) {
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
            ssize_t n = records_recv(c, dst, room);
            if (n == -2) return records_failed(c, err, errlen);
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
        size_t can = 0;
        const piece *s = si < ns ? &sends[si] : NULL;
        if (s) {
            size_t ready = ready_of(s, ri, done);
            can = ready > sent ? ready - sent : 0;
        }
        if (can || records_pending(c)) {
            {
                ssize_t n = records_send(c, s ? s->p + sent : NULL, can, &moved);
                if (n < 0) {
                    int rc = downstream_fatal(c, 1, err, errlen);
                    if (rc) return rc;
                    blame(c, link_next(c), STC_E_PEER, "died");
                    return fail(err, errlen, STC_E_PEER, "%s: sending to rank %d failed (%s): it died",
                                c->what, c->culprit, strerror(errno));
                }
                if (n > 0) {
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
        if (c->cancel && atomic_load(c->cancel)) return fail(err, errlen, STC_E_BROKEN, "%s: called off", c->what);
        double left = c->deadline - now_s();
        if (left <= 0) {
            blame(c, c->cfg.rank, STC_E_TIMEOUT, "timed out on the ring");
            return fail(err, errlen, STC_E_TIMEOUT,
                        "%s: timed out after %.0f s on the ring (sent %zu bytes to rank %d, received %zu from rank "
                        "%d)", c->what, c->cfg.timeout_s, sent_total, link_next(c), done_total + got - done,
                        link_prev(c));
        }
        struct pollfd fds[2];
        int nf = 0;
        fds[nf].fd = c->cfg.next_fd;
        fds[nf].events = c->down ? 0 : POLLIN; /* downstream's record, or its death */
        if (can || records_pending(c)) fds[nf].events |= POLLOUT;
        if (fds[nf].events) nf++; /* a closed socket would wake poll for ever */
        if (ri < nr) {
            fds[nf].fd = c->cfg.prev_fd;
            fds[nf].events = POLLIN;
            nf++;
        }
        int ms = (int)(left * 1000) + 1;
        if (c->cancel && ms > CANCEL_POLL_MS) ms = CANCEL_POLL_MS; /* a call that may be called off looks often */
        int pr = poll(fds, (nfds_t)nf, ms);
        if (pr < 0 && errno != EINTR) return fail(err, errlen, STC_E_SYS, "%s: poll: %s", c->what, strerror(errno));
    }
    return STC_OK;
}

/* The link's state as another thread's view of the communicator (a copy of c that ran the ring
 * meanwhile) left it: the stage it may have made, downstream's word, the byte counts. */
void link_take_state(stc_comm *c, const stc_comm *view) {
    c->stage = view->stage;
    c->rec_in = view->rec_in;
    c->rec_got = view->rec_got;
    c->down = view->down;
    c->sent_bytes = view->sent_bytes;
    c->received_bytes = view->received_bytes;
}

/* Send sl bytes to the next leader while receiving rl bytes from the previous one. With forward
 * set, what is sent is what is received, passed on as it arrives (sp and rp are one buffer). */
int link_xfer(stc_comm *c, const char *sp, size_t sl, char *rp, size_t rl, int forward, char *err, size_t errlen) {
    piece s = {(char *)sp, sl, 0, forward ? 0 : -1}, r = {rp, rl, 0, -1};
    return link_stream(c, &s, 1, &r, 1, -1, 0, err, errlen);
}
