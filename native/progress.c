/* The record of where this rank's collectives stand (stc_progress, in collective.h), kept in a
 * small file its supervisor reads. When a collective waits long, the supervisor tells the driver
 * which collective this rank is in, and since when; the driver compares the ranks and names the
 * ones that have not arrived. Written only by the thread running a collective (one at a time), as
 * a seqlock: version is odd while the record changes. */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

int progress_open(stc_comm *c, const char *path, char *err, size_t errlen) {
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return fail(err, errlen, STC_E_SYS, "cannot open the progress file %s: %s", path, strerror(errno));
    void *p = MAP_FAILED;
    if (ftruncate(fd, sizeof(stc_progress)) == 0)
        p = mmap(NULL, sizeof(stc_progress), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int saved = errno;
    close(fd);
    if (p == MAP_FAILED)
        return fail(err, errlen, STC_E_SYS, "cannot map the progress file %s: %s", path, strerror(saved));
    c->progress = p;
    memset(c->progress, 0, sizeof *c->progress);
    c->progress->magic = STC_PROGRESS_MAGIC;
    return STC_OK;
}

static void write_start(stc_progress *p) {
    __atomic_store_n(&p->version, p->version + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void write_end(stc_progress *p) { __atomic_store_n(&p->version, p->version + 1, __ATOMIC_RELEASE); }

void progress_begin(stc_comm *c) {
    stc_progress *p = c->progress;
    if (!p) return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    write_start(p);
    p->begun++;
    p->active = 1;
    p->since_us = (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
    p->kind = c->desc.kind;
    p->dtype = c->desc.dtype;
    p->arg = c->desc.arg;
    p->ndim = c->desc.ndim;
    memcpy(p->dims, c->desc.dims, sizeof p->dims);
    write_end(p);
}

/* Every public collective returns through here, whatever path it took. */
int progress_end(stc_comm *c, int rc) {
    stc_progress *p = c ? c->progress : NULL;
    if (p && p->active) {
        write_start(p);
        p->active = 0;
        write_end(p);
    }
    return rc;
}

void progress_close(stc_comm *c) {
    if (c->progress) munmap(c->progress, sizeof *c->progress);
    c->progress = NULL;
}
