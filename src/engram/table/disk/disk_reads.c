/*
 * The disk tier's row reads: rows of a row file (engram.table.disk.row_file) by id, into a caller's buffer.
 *
 * A row file holds pages of page_bytes (4096) bytes from rows_offset on, rows_per_page rows of row_bytes
 * each, so row r lies at rows_offset + (r / rows_per_page) * page_bytes + (r % rows_per_page) * row_bytes
 * and never crosses a page. A read sorts the ids by page, reads each distinct page once (pread of the
 * whole page into a page-aligned bounce buffer, as O_DIRECT needs), and copies the rows on it out to
 * out[i * row_bytes] for every i whose id is on that page. The pages are shared among the threads of a
 * pool (engram_disk_pool_create), or read by the calling thread (pool NULL).
 *
 * Errors: every function that can fail returns -1 and fills an EngramDiskError: what failed (kind),
 * errno (0 for a short read), the file offset of the read, the row it was for and the bytes it returned.
 * A failed read stops the job's other threads at their next page; the call returns once every thread
 * has left the job (no thread waits on anything but the job's own end).
 *
 * Built into its own small library (_disk_reads<EXT_SUFFIX>) by engram.table.disk.reads_build.build_command,
 * which passes -DENGRAM_DISK_SOURCE_DIGEST (the loader refuses a library built from another source).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef ENGRAM_DISK_SOURCE_DIGEST
#error "build with -DENGRAM_DISK_SOURCE_DIGEST=<digest> (engram.table.disk.reads_build.build_command)"
#endif

enum { ERROR_READ = 1, ERROR_SHORT = 2, ERROR_ID = 3, ERROR_MEMORY = 4, ERROR_ARGUMENT = 5, ERROR_OPEN = 6 };

typedef struct {
    int64_t kind;          /* one of the ERROR_ values */
    int64_t error_number;  /* errno of the failed call, 0 for a short read */
    int64_t offset;        /* file offset of the read */
    int64_t row;           /* the row id it was for (the bad id for ERROR_ID) */
    int64_t got;           /* bytes the read returned, -1 when it failed */
} EngramDiskError;

int64_t engram_disk_source_digest(void) { return (int64_t)ENGRAM_DISK_SOURCE_DIGEST; }

int64_t engram_disk_error_bytes(void) { return (int64_t)sizeof(EngramDiskError); }

static void set_error(EngramDiskError *error, int64_t kind, int64_t number, int64_t offset, int64_t row,
                      int64_t got) {
    if (error == NULL) return;
    error->kind = kind;
    error->error_number = number;
    error->offset = offset;
    error->row = row;
    error->got = got;
}

/* pread of count bytes at offset, retried after EINTR and after a partial read; bytes read, or -1. */
static ssize_t read_fully(int fd, uint8_t *buffer, size_t count, off_t offset) {
    size_t done = 0;
    while (done < count) {
        ssize_t n = pread(fd, buffer + done, count - done, offset + (off_t)done);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (n == 0) break; /* end of file */
        done += (size_t)n;
    }
    return (ssize_t)done;
}

/*
 * Open path read-only. With want_direct, O_DIRECT first; where the file system refuses it (EINVAL from
 * open, or from an aligned read of the first page_bytes), the file is opened buffered instead.
 * *direct_out says which. Returns the descriptor, or -1 with *error (kind ERROR_OPEN).
 */
int engram_disk_open(const char *path, int want_direct, int64_t page_bytes, int *direct_out, EngramDiskError *error) {
    *direct_out = 0;
    if (page_bytes <= 0 || page_bytes % 4096 != 0) {
        set_error(error, ERROR_ARGUMENT, EINVAL, 0, -1, -1);
        return -1;
    }
    if (want_direct) {
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (fd >= 0) {
            void *probe = NULL;
            if (posix_memalign(&probe, (size_t)page_bytes, (size_t)page_bytes) != 0) {
                close(fd);
                set_error(error, ERROR_MEMORY, ENOMEM, 0, -1, -1);
                return -1;
            }
            ssize_t n = pread(fd, probe, (size_t)page_bytes, 0);
            int saved = errno;
            free(probe);
            if (n >= 0) {
                *direct_out = 1;
                return fd;
            }
            close(fd);
            if (saved != EINVAL) {
                set_error(error, ERROR_OPEN, saved, 0, -1, n);
                return -1;
            }
        } else if (errno != EINVAL) {
            set_error(error, ERROR_OPEN, errno, 0, -1, -1);
            return -1;
        }
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        set_error(error, ERROR_OPEN, errno, 0, -1, -1);
        return -1;
    }
    return fd;
}

int engram_disk_close(int fd) { return close(fd); }

/* ---- one read job ---------------------------------------------------------------------------------- */
typedef struct {
    int64_t page;
    int64_t index; /* position in ids / out */
} PageEntry;

typedef struct {
    int fd;
    int64_t rows_offset, page_bytes, rows_per_page, row_bytes;
    const int64_t *ids;
    const PageEntry *entries;  /* sorted by page */
    const int64_t *group_starts; /* num_groups + 1 starts into entries, one group per distinct page */
    int64_t num_groups;
    uint8_t *out;
    uint8_t *bounce;           /* page_bytes per worker, page-aligned */
    int64_t next_group;        /* atomic */
    int failed;                /* atomic */
    pthread_mutex_t error_lock;
    EngramDiskError error;
} Job;

static int compare_entries(const void *a, const void *b) {
    const PageEntry *x = a, *y = b;
    if (x->page != y->page) return (x->page > y->page) - (x->page < y->page);
    return (x->index > y->index) - (x->index < y->index);
}

static void run_job(Job *job, int worker) {
    uint8_t *bounce = job->bounce + (size_t)worker * (size_t)job->page_bytes;
    for (;;) {
        if (__atomic_load_n(&job->failed, __ATOMIC_ACQUIRE)) return;
        int64_t group = __atomic_fetch_add(&job->next_group, 1, __ATOMIC_RELAXED);
        if (group >= job->num_groups) return;
        const PageEntry *first = job->entries + job->group_starts[group];
        const PageEntry *end = job->entries + job->group_starts[group + 1];
        off_t offset = (off_t)(job->rows_offset + first->page * job->page_bytes);
        ssize_t n = read_fully(job->fd, bounce, (size_t)job->page_bytes, offset);
        if (n != (ssize_t)job->page_bytes) {
            int number = n < 0 ? errno : 0;
            pthread_mutex_lock(&job->error_lock);
            if (!job->failed) {
                set_error(&job->error, n < 0 ? ERROR_READ : ERROR_SHORT, number, (int64_t)offset,
                          job->ids[first->index], (int64_t)n);
                __atomic_store_n(&job->failed, 1, __ATOMIC_RELEASE);
            }
            pthread_mutex_unlock(&job->error_lock);
            return;
        }
        for (const PageEntry *entry = first; entry < end; entry++) {
            int64_t slot = job->ids[entry->index] % job->rows_per_page;
            memcpy(job->out + entry->index * job->row_bytes, bounce + slot * job->row_bytes, (size_t)job->row_bytes);
        }
    }
}

/* ---- the thread pool ------------------------------------------------------------------------------- */
typedef struct Pool Pool;
typedef struct {
    Pool *pool;
    int index;
} Worker;

struct Pool {
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    pthread_mutex_t call; /* one job at a time */
    int threads, remaining, quit;
    uint64_t generation;
    Job *job;
    pthread_t *ids;
    Worker *workers;
};

static void *worker_main(void *arg) {
    Worker *self = arg;
    Pool *pool = self->pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (!pool->quit && pool->generation == seen) pthread_cond_wait(&pool->wake, &pool->lock);
        if (pool->quit) break;
        seen = pool->generation;
        Job *job = pool->job;
        pthread_mutex_unlock(&pool->lock);
        run_job(job, self->index);
        pthread_mutex_lock(&pool->lock);
        if (--pool->remaining == 0) pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

static void stop_workers(Pool *pool, int started) {
    pthread_mutex_lock(&pool->lock);
    pool->quit = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < started; i++) pthread_join(pool->ids[i], NULL);
}

static void free_pool(Pool *pool) {
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->call);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    free(pool->ids);
    free(pool->workers);
    free(pool);
}

/* A pool of threads (1..1024) that read pages; NULL when threads is out of range or a thread cannot start. */
void *engram_disk_pool_create(int threads) {
    if (threads < 1 || threads > 1024) return NULL;
    Pool *pool = calloc(1, sizeof(Pool));
    if (pool == NULL) return NULL;
    pool->ids = calloc((size_t)threads, sizeof(pthread_t));
    pool->workers = calloc((size_t)threads, sizeof(Worker));
    pthread_mutex_init(&pool->lock, NULL);
    pthread_mutex_init(&pool->call, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    if (pool->ids == NULL || pool->workers == NULL) {
        free_pool(pool);
        return NULL;
    }
    pool->threads = threads;
    for (int i = 0; i < threads; i++) {
        pool->workers[i].pool = pool;
        pool->workers[i].index = i;
        if (pthread_create(&pool->ids[i], NULL, worker_main, &pool->workers[i]) != 0) {
            stop_workers(pool, i);
            free_pool(pool);
            return NULL;
        }
    }
    return pool;
}

void engram_disk_pool_destroy(void *handle) {
    Pool *pool = handle;
    if (pool == NULL) return;
    pthread_mutex_lock(&pool->call); /* after the job in flight, if any */
    stop_workers(pool, pool->threads);
    pthread_mutex_unlock(&pool->call);
    free_pool(pool);
}

int engram_disk_pool_threads(void *handle) { return handle == NULL ? 0 : ((Pool *)handle)->threads; }

/* ---- the read ------------------------------------------------------------------------------------- */
/*
 * out[i * row_bytes .. +row_bytes) = row ids[i] of the row file open at fd, for i < num_ids (ids in
 * [0, stored_rows)), each distinct page read once, by the threads of pool (NULL: this thread).
 * Returns the number of distinct pages read (>= 0), or -1 with *error filled (no row is trusted then).
 */
int64_t engram_disk_read_rows(void *handle, int fd, int64_t rows_offset, int64_t page_bytes, int64_t rows_per_page,
                              int64_t row_bytes, int64_t stored_rows, const int64_t *ids, int64_t num_ids,
                              uint8_t *out, EngramDiskError *error) {
    if (page_bytes <= 0 || page_bytes % 4096 != 0 || rows_offset < 0 || rows_offset % page_bytes != 0
        || rows_per_page < 1 || row_bytes < 1 || rows_per_page * row_bytes > page_bytes || stored_rows < 0
        || num_ids < 0 || (num_ids > 0 && (ids == NULL || out == NULL))) {
        set_error(error, ERROR_ARGUMENT, EINVAL, 0, -1, -1);
        return -1;
    }
    if (num_ids == 0) return 0;
    for (int64_t i = 0; i < num_ids; i++) {
        if (ids[i] < 0 || ids[i] >= stored_rows) {
            set_error(error, ERROR_ID, 0, 0, ids[i], i); /* got: the position of the bad id */
            return -1;
        }
    }
    Pool *pool = handle;
    int workers = pool == NULL ? 1 : pool->threads;
    PageEntry *entries = malloc((size_t)num_ids * sizeof(PageEntry));
    int64_t *starts = malloc((size_t)(num_ids + 1) * sizeof(int64_t));
    void *bounce = NULL;
    if (entries == NULL || starts == NULL
        || posix_memalign(&bounce, (size_t)page_bytes, (size_t)page_bytes * (size_t)workers) != 0) {
        free(entries);
        free(starts);
        set_error(error, ERROR_MEMORY, ENOMEM, 0, -1, -1);
        return -1;
    }
    for (int64_t i = 0; i < num_ids; i++) {
        entries[i].page = ids[i] / rows_per_page;
        entries[i].index = i;
    }
    qsort(entries, (size_t)num_ids, sizeof(PageEntry), compare_entries);
    int64_t groups = 0;
    for (int64_t i = 0; i < num_ids; i++)
        if (i == 0 || entries[i].page != entries[i - 1].page) starts[groups++] = i;
    starts[groups] = num_ids;

    Job job;
    memset(&job, 0, sizeof(job));
    job.fd = fd;
    job.rows_offset = rows_offset;
    job.page_bytes = page_bytes;
    job.rows_per_page = rows_per_page;
    job.row_bytes = row_bytes;
    job.ids = ids;
    job.entries = entries;
    job.group_starts = starts;
    job.num_groups = groups;
    job.out = out;
    job.bounce = bounce;
    pthread_mutex_init(&job.error_lock, NULL);

    if (pool == NULL || groups == 1) {
        run_job(&job, 0);
    } else {
        pthread_mutex_lock(&pool->call);
        pthread_mutex_lock(&pool->lock);
        pool->job = &job;
        pool->remaining = pool->threads;
        pool->generation++;
        pthread_cond_broadcast(&pool->wake);
        while (pool->remaining > 0) pthread_cond_wait(&pool->done, &pool->lock);
        pool->job = NULL;
        pthread_mutex_unlock(&pool->lock);
        pthread_mutex_unlock(&pool->call);
    }
    pthread_mutex_destroy(&job.error_lock);
    free(entries);
    free(starts);
    free(bounce);
    if (job.failed) {
        if (error != NULL) *error = job.error;
        return -1;
    }
    return groups;
}
