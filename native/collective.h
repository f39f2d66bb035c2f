/* The C ABI of sparktrain's CPU collective engine.
 *
 * One communicator per rank. Every call takes the handle, returns 0 or a negative STC_E* code,
 * and on failure writes a message (naming the peer where one is at fault) into err. The library
 * keeps no global state but one pointer (the process's current communicator, below), never prints
 * and never exits: policy (timeouts, secrets, which engine runs) belongs to the caller. The caller
 * authenticates the TCP connections and hands over their file descriptors; the library never
 * accepts a connection itself. native/engine.h draws how the files behind this header are layered.
 */
#ifndef SPARKTRAIN_COLLECTIVE_H
#define SPARKTRAIN_COLLECTIVE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2: every collective carries its dtype and shape (so a disagreement names both and leaves the
 * communicator usable); min, max and product; int8, int16, uint16 and bool; reduce-scatter and
 * alltoall. 3: the process's current communicator (stc_set_current, stc_current_acquire),
 * stc_comm_rank and stc_comm_size. 4: stc_config.spin_s. 5: stc_comm_traffic. 6: stc_config.progress_path
 * and the progress record (stc_progress). 7: the encrypted ring (stc_config.ring_keys, host names) and
 * the cryptography's entry points (stc_crypto_available, stc_hkdf_sha256, stc_aead_seal/open). */
#define STC_ABI_VERSION 7

enum stc_dtype {
    STC_FLOAT16 = 0,
    STC_BFLOAT16 = 1,
    STC_FLOAT32 = 2,
    STC_FLOAT64 = 3,
    STC_INT32 = 4,
    STC_INT64 = 5,
    STC_UINT8 = 6,
    STC_INT8 = 7,
    STC_INT16 = 8,
    STC_UINT16 = 9,
    STC_BOOL = 10 /* one byte, 0 or 1 */
};
/* Elements of k bytes (1 <= k <= STC_OPAQUE_MAX) that are moved but never reduced (broadcast,
 * allgather): dtype STC_OPAQUE + k. */
#define STC_OPAQUE 256
#define STC_OPAQUE_MAX 1024

/* Every op reduces in one fixed order (rank order), so every rank gets the same bits. STC_AVERAGE
 * is the sum divided by the number of ranks (integers truncate toward zero; bool is refused).
 * For bool, STC_SUM and STC_MAX are a logical or, STC_MIN and STC_PRODUCT a logical and. */
enum stc_op { STC_SUM = 0, STC_AVERAGE = 1, STC_MIN = 2, STC_MAX = 3, STC_PRODUCT = 4 };

enum stc_status {
    STC_OK = 0,
    STC_E_ARG = -1,      /* a bad argument */
    STC_E_TIMEOUT = -2,  /* a wait passed its deadline */
    STC_E_PEER = -3,     /* a peer died or closed its connection */
    STC_E_MISMATCH = -4, /* ranks called different collectives, dtypes, shapes, ops or roots; every
                            rank gets it and the communicator stays usable */
    STC_E_SYS = -5,      /* a system call failed */
    STC_E_BROKEN = -6    /* an earlier failure (not a mismatch) left the communicator unusable */
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
    double spin_s;              /* a wait on a local peer spins this long before it sleeps; 0: only
                                   briefly (for ranks that outnumber their host's cores) */
    const char *progress_path;  /* NULL, or a file the communicator keeps an stc_progress record in, for
                                   another process to read (the rank's supervisor, to report stalls) */
    const uint8_t *ring_keys;   /* leaders with num_nodes > 1: NULL, the ring in clear; else 4 x 44 bytes
                                   (an AES-256 key, then a 12-byte nonce base, from HKDF), one per
                                   direction: to the next leader, from it (abort records), from the
                                   previous leader, to it (abort records). Every byte between hosts
                                   then travels in AES-256-GCM records. Copied; not kept */
    const char *host, *next_host, *prev_host; /* names for messages: this host, the next and previous
                                   hosts of the ring; NULL: none */
} stc_config;

/* Where a rank's collectives stand: the file at stc_config.progress_path holds one record, kept
 * up to date at the start and end of every collective. A reader copies it and keeps the copy only
 * when version is even and the same before and after (it is odd while the record changes). */
#define STC_PROGRESS_MAGIC 0x31475250434e5453ull /* "STCNPRG1" */
typedef struct stc_progress {
    uint64_t magic;
    uint64_t version;
    uint64_t begun;    /* collectives begun on this communicator */
    uint64_t active;   /* 1 while collective number `begun` runs, else 0 */
    int64_t since_us;  /* when it began: CLOCK_REALTIME, microseconds */
    uint32_t kind;     /* 1 allreduce, 2 broadcast, 3 allgather, 4 barrier, 5 reducescatter, 6 alltoall */
    uint32_t dtype;    /* an stc_dtype, or STC_OPAQUE + the element size */
    int32_t arg;       /* the op, or the root of a broadcast */
    uint32_t ndim;     /* the shape's true number of dims; up to 8 are in dims */
    int64_t dims[8];
} stc_progress;

typedef struct stc_comm stc_comm;

int stc_abi_version(void);

/* Maps (or creates) the host's segment; waits for the local peers up to timeout_s. */
int stc_create(const stc_config *cfg, stc_comm **out, char *err, size_t errlen);
/* Unmaps, unlinks if still linked, closes the sockets. Safe on NULL. */
void stc_destroy(stc_comm *comm);

/* Every collective takes the caller's tensor as dtype plus shape (ndim dims; any ndim, the
 * shape is compared exactly up to 8 dims and through a hash beyond). Before any data moves the
 * ranks compare them; where they disagree every rank returns STC_E_MISMATCH, with the same
 * message naming two ranks and what differs, and the communicator stays usable. */

/* buf (the shape's elements) is reduced in place over every rank. */
int stc_allreduce(stc_comm *comm, void *buf, int dtype, int op, int ndim, const int64_t *dims, char *err,
                  size_t errlen);
/* buf (the same shape on every rank, ndim >= 1) is reduced over every rank, and out receives this
 * rank's rows of it: rows split as evenly as possible, the first rows % size ranks one more. buf
 * is scratch: its contents are unspecified afterwards. */
int stc_reducescatter(stc_comm *comm, void *buf, void *out, int dtype, int op, int ndim, const int64_t *dims,
                      char *err, size_t errlen);
/* buf (the shape's elements) from root to every rank. */
int stc_broadcast(stc_comm *comm, void *buf, int dtype, int ndim, const int64_t *dims, int root, char *err,
                  size_t errlen);
/* out receives every rank's bytes in rank order; counts[r] is rank r's byte count, the same array
 * on every rank; in holds counts[rank] bytes, this rank's tensor of the given shape. Only the
 * first dimension may differ between ranks. */
int stc_allgatherv(stc_comm *comm, const void *in, void *out, const uint64_t *counts, int dtype, int ndim,
                   const int64_t *dims, char *err, size_t errlen);
/* sends[i * size + j] is how many bytes rank i sends rank j: the same matrix on every rank. in
 * holds this rank's sends in rank order of their destinations (this rank's tensor of the given
 * shape); out receives what every rank sent this one, in rank order. Only the first dimension
 * may differ between ranks. */
int stc_alltoallv(stc_comm *comm, const void *in, void *out, const uint64_t *sends, int dtype, int ndim,
                  const int64_t *dims, char *err, size_t errlen);
int stc_barrier(stc_comm *comm, char *err, size_t errlen);

/* This communicator's global rank, and how many ranks it has. */
int stc_comm_rank(const stc_comm *comm);
int stc_comm_size(const stc_comm *comm);
/* The bytes this rank has sent and received over its ring connections since it was created (0 on
 * a rank that is not its host's leader, or where there is one host). */
void stc_comm_traffic(const stc_comm *comm, uint64_t *sent, uint64_t *received);

/* The process's current communicator: one pointer, for code that finds the communicator at run
 * time (the TensorFlow kernels) rather than being handed it. The owner sets it once the
 * communicator is up and clears it (NULL) before stc_destroy. stc_current_acquire returns it
 * (NULL when none) and holds a process-wide lock until stc_current_release, so the communicator
 * neither changes nor is destroyed meanwhile, and holders run their collectives one at a time;
 * stc_set_current waits for the holder. Collectives on the current communicator made through
 * other handles must not overlap with a holder's. */
void stc_set_current(stc_comm *comm);
stc_comm *stc_current_acquire(void);
void stc_current_release(void);

/* The cryptography the encrypted ring uses: OpenSSL's libcrypto, loaded at first use. 0 and its
 * file name in name, or STC_E_SYS and why encryption is unavailable. */
int stc_crypto_available(char *name, size_t namelen);
/* HKDF-SHA256 (RFC 5869): outlen bytes of key material (info up to 1024 bytes). */
int stc_hkdf_sha256(const uint8_t *salt, size_t saltlen, const uint8_t *ikm, size_t ikmlen, const uint8_t *info,
                    size_t infolen, uint8_t *out, size_t outlen, char *err, size_t errlen);
/* AES-256-GCM of one buffer: a 32-byte key, a 12-byte nonce (ivlen 12), a 16-byte tag. Open
 * returns STC_E_PEER where the tag does not check out (out is then unspecified). */
int stc_aead_seal(const uint8_t *key, const uint8_t *iv, size_t ivlen, const uint8_t *aad, size_t aadlen,
                  const uint8_t *in, size_t len, uint8_t *out, uint8_t *tag, char *err, size_t errlen);
int stc_aead_open(const uint8_t *key, const uint8_t *iv, size_t ivlen, const uint8_t *aad, size_t aadlen,
                  const uint8_t *in, size_t len, uint8_t *out, const uint8_t *tag, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
