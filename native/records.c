/* The ring's bytes as AES-256-GCM records, where the ring is encrypted (stc_config.ring_keys).
 *
 * Each direction of each ring connection has its own key and nonce base (derived by the caller
 * with HKDF from the run's secret, both ends' fresh nonces, the run, the attempt and the
 * direction), and numbers its records from 0. A record's nonce is the base XOR its number, and
 * its authenticated data is its number and length (crypto.c), so a record that is altered,
 * replayed, reordered, dropped, cut short or sealed under another key fails its tag.
 *
 * Sending: the send stream is cut into records of at most REC_PLAIN (256 KiB), sealed up to TX_SLOTS
 * ahead of the socket, so that the next record is sealed while the kernel still sends the one
 * before. Receiving: a record is read whole and opened, straight into where the stream wants it
 * (the stage a reduction reads, or the bytes' place) when it fits there, else into a buffer of its
 * own; the stream counts its bytes received, reduces them or passes them on only once its tag
 * checked out, so nothing forged is ever reduced or passed on. A record that fails fails the collective, naming the link's two hosts, and the
 * abort record (itself sealed, on the backward direction) tells every other rank.
 *
 * Without keys every call here is the plain socket call.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#define SLOT_BYTES (REC_OVERHEAD + REC_PLAIN)

int records_setup(stc_comm *c, const uint8_t *keys, char *err, size_t errlen) {
    link_sec *s = calloc(1, sizeof *s);
    if (!s) return fail(err, errlen, STC_E_SYS, "out of memory");
    c->sec = s;
    s->slots = malloc((size_t)TX_SLOTS * SLOT_BYTES);
    s->rxbuf = malloc(SLOT_BYTES);
    s->plain = malloc(REC_PLAIN);
    if (!s->slots || !s->rxbuf || !s->plain) {
        records_free(c);
        return fail(err, errlen, STC_E_SYS, "out of memory");
    }
    int rc = aead_dir_init(&s->tx, 1, keys, err, errlen);
    if (!rc) rc = aead_dir_init(&s->back_rx, 0, keys + AEAD_KEY_IV, err, errlen);
    if (!rc) rc = aead_dir_init(&s->rx, 0, keys + 2 * AEAD_KEY_IV, err, errlen);
    if (!rc) rc = aead_dir_init(&s->back_tx, 1, keys + 3 * AEAD_KEY_IV, err, errlen);
    if (rc) records_free(c); /* the ring's set-up fails: no record goes either way */
    return rc;
}

void records_free(stc_comm *c) {
    link_sec *s = c->sec;
    if (!s) return;
    aead_dir_free(&s->tx);
    aead_dir_free(&s->rx);
    aead_dir_free(&s->back_tx);
    aead_dir_free(&s->back_rx);
    free(s->slots);
    free(s->rxbuf);
    free(s->plain);
    free(s);
    c->sec = NULL;
}

int records_pending(const stc_comm *c) { return c->sec && c->sec->count; }

/* Sends what sealed records it can; sets *moved when bytes went. 0, or -1 with errno. */
static int flush(stc_comm *c, int *moved) {
    link_sec *s = c->sec;
    while (s->count) {
        char *slot = s->slots + (size_t)s->head * SLOT_BYTES;
        ssize_t n = send(c->cfg.next_fd, slot + s->head_off, s->slot_len[s->head] - s->head_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
        *moved = 1;
        s->head_off += (size_t)n;
        if (s->head_off == s->slot_len[s->head]) {
            s->head = (s->head + 1) % TX_SLOTS;
            s->count--;
            s->head_off = 0;
        }
    }
    return 0;
}

/* Takes up to can bytes of p into the send stream: how many it took (sealed, or sent in clear),
 * or -1 with errno where the socket failed. Sealed records not yet sent go with later calls
 * (records_pending). */
ssize_t records_send(stc_comm *c, const char *p, size_t can, int *moved) {
    if (!c->sec) {
        ssize_t n = send(c->cfg.next_fd, p, can, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) *moved = 1;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
        return n;
    }
    link_sec *s = c->sec;
    size_t taken = 0;
    for (;;) {
        if (flush(c, moved)) return -1;
        if (taken == can || s->count == TX_SLOTS) return (ssize_t)taken;
        uint32_t len = can - taken < REC_PLAIN ? (uint32_t)(can - taken) : REC_PLAIN;
        int slot = (s->head + s->count) % TX_SLOTS;
        if (aead_seal_record(&s->tx, p + taken, len, s->slots + (size_t)slot * SLOT_BYTES)) {
            errno = EPROTO;
            return -1;
        }
        s->slot_len[slot] = REC_OVERHEAD + len;
        s->count++;
        taken += len;
        *moved = 1;
    }
}

/* Up to room bytes of the receive stream into dst: >0 bytes, 0 the stream ended, -1 with errno
 * (EAGAIN: nothing yet), -2 a record failed authentication (or announced an impossible length). */
ssize_t records_recv(stc_comm *c, char *dst, size_t room) {
    link_sec *s = c->sec;
    if (!s) return recv(c->cfg.prev_fd, dst, room, MSG_DONTWAIT);
    for (;;) {
        if (s->plain_at < s->plain_len) {
            size_t n = s->plain_len - s->plain_at < room ? s->plain_len - s->plain_at : room;
            memcpy(dst, s->plain + s->plain_at, n);
            s->plain_at += n;
            return (ssize_t)n;
        }
        size_t want = 4;
        if (s->rx_have >= 4) {
            uint32_t len = aead_record_len(s->rxbuf);
            if (!len || len > REC_PLAIN) return -2;
            want = REC_OVERHEAD + len;
            if (s->rx_have == want) {
                /* Straight into dst where the record fits (dst is a stage to reduce from, or where the
                 * bytes land; either way nothing is reduced or passed on unless the tag checks out). */
                int direct = room >= len;
                s->rx_have = 0;
                if (aead_open_record(&s->rx, s->rxbuf, direct ? dst : s->plain)) return -2;
                if (direct) return (ssize_t)len;
                s->plain_at = 0;
                s->plain_len = len;
                continue;
            }
        }
        ssize_t n = recv(c->cfg.prev_fd, s->rxbuf + s->rx_have, want - s->rx_have, MSG_DONTWAIT);
        if (n <= 0) return n;
        s->rx_have += (size_t)n;
    }
}

/* A record from the previous leader failed: the collective fails naming the link. */
int records_failed(stc_comm *c, char *err, size_t errlen) {
    char why[WHY_BYTES];
    snprintf(why, sizeof why, "got a record that failed authentication on the ring link from %s (rank %d) to %s",
             c->prev_host, link_prev(c), c->host);
    blame(c, c->cfg.rank, STC_E_PEER, why);
    return fail(err, errlen, STC_E_PEER, "%s: record %llu on the ring link from %s (rank %d) to %s (rank %d) failed "
                "authentication: it was altered, replayed, reordered or sealed with another key; nothing of it was "
                "used", c->what, (unsigned long long)c->sec->rx.seq, c->prev_host, link_prev(c), c->host, c->cfg.rank);
}

/* The abort record, sealed on the backward direction; an upstream that is gone needs none. */
void records_send_back(stc_comm *c, const record *r) {
    char buf[REC_OVERHEAD + sizeof(record)];
    if (aead_seal_record(&c->sec->back_tx, (const char *)r, sizeof *r, buf)) return;
    ssize_t n = send(c->cfg.prev_fd, buf, sizeof buf, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)n;
}

/* Reads the next leader's sealed abort record: 1 a whole one in out, 0 nothing yet, -1 closed
 * without one, -2 bytes that are no record of it. */
int records_read_back(stc_comm *c, record *out) {
    link_sec *s = c->sec;
    while (s->back_have < sizeof s->backbuf) {
        ssize_t n = recv(c->cfg.next_fd, s->backbuf + s->back_have, sizeof s->backbuf - s->back_have, MSG_DONTWAIT);
        if (n > 0) {
            s->back_have += (size_t)n;
            if (s->back_have >= 4 && aead_record_len(s->backbuf) != sizeof(record)) return -2;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return 0;
        } else {
            return -1;
        }
    }
    return aead_open_record(&s->back_rx, s->backbuf, (char *)out) ? -2 : 1;
}
