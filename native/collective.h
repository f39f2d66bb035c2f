/* The C ABI of sparktrain's CPU collective engine.
 *
 * One communicator per rank. Every call takes the handle, returns 0 or a negative STC_E* code,
 * and on failure writes a message (naming the peer where one is at fault) into err. The library
 * keeps no global state, never prints and never exits: policy (timeouts, secrets, which engine
 * runs) belongs to the caller. The caller authenticates the TCP connections and hands over
 * their file descriptors; the library never accepts a connection itself.
 */
#ifndef SPARKTRAIN_COLLECTIVE_H
#define SPARKTRAIN_COLLECTIVE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STC_ABI_VERSION 1

enum stc_dtype {
    STC_FLOAT16 = 0,
    STC_BFLOAT16 = 1,
    STC_FLOAT32 = 2,
    STC_FLOAT64 = 3,
    STC_INT32 = 4,
    STC_INT64 = 5,
    STC_UINT8 = 6
};

enum stc_op { STC_SUM = 0, STC_AVERAGE = 1 };

enum stc_status {
    STC_OK = 0,
    STC_E_ARG = -1,      /* a bad argument */
    STC_E_TIMEOUT = -2,  /* a wait passed its deadline */
    STC_E_PEER = -3,     /* a peer died or closed its connection */
    STC_E_MISMATCH = -4, /* ranks called different collectives, dtypes or sizes */
    STC_E_SYS = -5,      /* a system call failed */
    STC_E_BROKEN = -6    /* an earlier failure left the communicator unusable */
};

typedef struct stc_config {
    int rank, size;             /* global */
    int local_rank, local_size; /* among the ranks sharing this host's memory segment */
    int node, num_nodes;        /* this host's index, and how many hosts; leaders are local rank 0 */
    const char *shm_name;       /* POSIX shm name, "/..." unique to the run, host and attempt */
    size_t chunk_bytes;         /* per-rank slot size in the segment; 0: the default */
    double timeout_s;           /* deadline of every collective */
    double heartbeat_s;         /* a local peer whose heartbeat is older than this is dead */
    int next_fd, prev_fd;       /* leaders with num_nodes > 1: connected, authenticated sockets to the
                                   next and previous host's leader; the communicator owns them */
    const int32_t *rank_node;   /* size entries: each rank's host index */
    const int32_t *rank_local;  /* size entries: each rank's local rank */
} stc_config;

typedef struct stc_comm stc_comm;

int stc_abi_version(void);

/* Maps (or creates) the host's segment; waits for the local peers up to timeout_s. */
int stc_create(const stc_config *cfg, stc_comm **out, char *err, size_t errlen);
/* Unmaps, unlinks if still linked, closes the sockets. Safe on NULL. */
void stc_destroy(stc_comm *comm);

/* buf is reduced in place; count elements of dtype. */
int stc_allreduce(stc_comm *comm, void *buf, size_t count, int dtype, int op, char *err, size_t errlen);
/* nbytes of buf from root to every rank. */
int stc_broadcast(stc_comm *comm, void *buf, size_t nbytes, int root, char *err, size_t errlen);
/* out receives every rank's bytes in rank order; counts[r] is rank r's byte count, the same
 * array on every rank; in holds counts[rank] bytes. */
int stc_allgatherv(stc_comm *comm, const void *in, void *out, const uint64_t *counts, char *err, size_t errlen);
int stc_barrier(stc_comm *comm, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
