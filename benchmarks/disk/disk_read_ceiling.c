/*
 * The disk read ceiling: random 4 KiB O_DIRECT reads of a file, the rate the disk tier's page reads are judged by
 *
 * Plain C, pthreads, no Python: T threads, each in a loop of pread(4096 bytes) at a uniformly random
 * 4 KiB-aligned offset of [start, file end), into its own page-aligned buffer, for SECONDS seconds;
 * one synchronous read in flight per thread (queue depth T), as the disk tier's reader issues them.
 * O_DIRECT where the file system takes it (else buffered, said in the output: page-cache reads are not
 * the disk's rate).
 *
 * Prints one JSON object per thread count, one line each:
 *   {"threads": T, "direct": 1, "reads": N, "seconds": s, "reads_per_s": r, "GBps": g, "errors": e}
 *
 *   cc -O2 -pthread -o /tmp/disk_read_ceiling benchmarks/disk_read_ceiling.c
 *   /tmp/disk_read_ceiling FILE SECONDS 1,8,32,128 [START_OFFSET]
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096
#define MAX_THREADS 1024

typedef struct {
    int fd;
    int64_t first_page, pages;
    double deadline;
    uint64_t seed;
    int64_t reads, errors;
} Worker;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t next_random(uint64_t *state) { /* xorshift64* */
    uint64_t x = *state;
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    *state = x;
    return x * 2685821657736338717ULL;
}

static void *worker_main(void *arg) {
    Worker *w = arg;
    void *buffer = NULL;
    if (posix_memalign(&buffer, PAGE, PAGE) != 0) {
        w->errors = -1;
        return NULL;
    }
    while (now_s() < w->deadline) {
        for (int k = 0; k < 16; k++) { /* the clock read every 16 reads */
            int64_t page = w->first_page + (int64_t)(next_random(&w->seed) % (uint64_t)w->pages);
            ssize_t n = pread(w->fd, buffer, PAGE, (off_t)page * PAGE);
            if (n == PAGE) w->reads++;
            else w->errors++;
        }
    }
    free(buffer);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s FILE SECONDS THREADS[,THREADS...] [START_OFFSET]\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    double seconds = atof(argv[2]);
    int64_t start = argc > 4 ? atoll(argv[4]) : 0;
    int direct = 1;
    int fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0 && errno == EINVAL) {
        direct = 0;
        fd = open(path, O_RDONLY);
    }
    if (fd < 0) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        return 1;
    }
    struct stat info;
    if (fstat(fd, &info) != 0 || seconds <= 0) {
        fprintf(stderr, "%s: cannot stat, or SECONDS <= 0\n", path);
        return 2;
    }
    int64_t first_page = (start + PAGE - 1) / PAGE, pages = info.st_size / PAGE - first_page;
    if (pages < 1) {
        fprintf(stderr, "%s: no whole 4 KiB page after offset %lld\n", path, (long long)start);
        return 2;
    }
    char *list = strdup(argv[3]);
    for (char *item = strtok(list, ","); item != NULL; item = strtok(NULL, ",")) {
        int threads = atoi(item);
        if (threads < 1 || threads > MAX_THREADS) {
            fprintf(stderr, "threads: expected 1..%d, found %s\n", MAX_THREADS, item);
            return 2;
        }
        Worker *workers = calloc((size_t)threads, sizeof(Worker));
        pthread_t *ids = calloc((size_t)threads, sizeof(pthread_t));
        double begin = now_s();
        for (int i = 0; i < threads; i++) {
            workers[i] = (Worker){fd, first_page, pages, begin + seconds, 0x9E3779B97F4A7C15ULL * (uint64_t)(i + 1), 0, 0};
            pthread_create(&ids[i], NULL, worker_main, &workers[i]);
        }
        int64_t reads = 0, errors = 0;
        for (int i = 0; i < threads; i++) {
            pthread_join(ids[i], NULL);
            reads += workers[i].reads;
            errors += workers[i].errors;
        }
        double elapsed = now_s() - begin;
        printf("{\"threads\": %d, \"direct\": %d, \"reads\": %lld, \"seconds\": %.3f, \"reads_per_s\": %.1f, "
               "\"GBps\": %.4f, \"errors\": %lld}\n", threads, direct, (long long)reads, elapsed, reads / elapsed,
               reads * (double)PAGE / elapsed / 1e9, (long long)errors);
        fflush(stdout);
        free(workers);
        free(ids);
    }
    free(list);
    close(fd);
    return 0;
}
