/* A communicator's life: its creation from a config (the host's segment, the ring connections, the
 * progress record) and its end, plus the few calls that only read it, and the process's current
 * communicator. The collectives themselves are in collective.c. */
#define _GNU_SOURCE
#include "engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int stc_abi_version(void) { return STC_ABI_VERSION; }

int stc_comm_rank(const stc_comm *c) { return c ? c->cfg.rank : -1; }
int stc_comm_size(const stc_comm *c) { return c ? c->cfg.size : 0; }

void stc_comm_traffic(const stc_comm *c, uint64_t *sent, uint64_t *received) {
    if (sent) *sent = c ? c->sent_bytes : 0;
    if (received) *received = c ? c->received_bytes : 0;
}

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

/* A leader's ring connections, and their records where the ring is encrypted; the hosts' names. */
static int adopt_ring(stc_comm *c, const stc_config *cfg, char *err, size_t errlen) {
    snprintf(c->host, sizeof c->host, "%s", cfg->host ? cfg->host : "this host");
    snprintf(c->next_host, sizeof c->next_host, "%s", cfg->next_host ? cfg->next_host : "the next host");
    snprintf(c->prev_host, sizeof c->prev_host, "%s", cfg->prev_host ? cfg->prev_host : "the previous host");
    c->cfg.host = c->cfg.next_host = c->cfg.prev_host = NULL;
    c->cfg.ring_keys = NULL;
    if (cfg->num_nodes < 2 || cfg->local_rank != 0) return STC_OK;
    link_adopt(c, cfg->next_fd, cfg->prev_fd);
    return cfg->ring_keys ? records_setup(c, cfg->ring_keys, err, errlen) : STC_OK;
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
    c->local_global = calloc((size_t)cfg->local_size, sizeof(int));
    if (!c->rank_node || !c->rank_local || !c->leader_of || !c->local_global) {
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
        if (cfg->rank_local[r] >= c->most_local) c->most_local = cfg->rank_local[r] + 1;
        if (cfg->rank_node[r] == cfg->node && cfg->rank_local[r] >= 0 && cfg->rank_local[r] < cfg->local_size)
            c->local_global[cfg->rank_local[r]] = r;
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
        int rc = shm_attach(c, err, errlen);
        if (rc) {
            stc_destroy(c); /* unlinks the segment if some rank never attached */
            return rc;
        }
    }
    int rc = adopt_ring(c, cfg, err, errlen);
    if (rc) {
        stc_destroy(c);
        return rc;
    }
    if (cfg->progress_path) {
        rc = progress_open(c, cfg->progress_path, err, errlen);
        if (rc) {
            stc_destroy(c);
            return rc;
        }
    }
    c->cfg.progress_path = NULL;
    *out = c;
    return STC_OK;
}

void stc_destroy(stc_comm *c) {
    if (!c) return;
    link_close(c);
    records_free(c);
    shm_detach(c);
    progress_close(c);
    free(c->tmp);
    free(c->stage);
    free(c->rank_node);
    free(c->rank_local);
    free(c->leader_of);
    free(c->local_global);
    free(c);
}
