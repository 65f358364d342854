/*
 * The host gather ceiling: what the host's memory gives a row gather (272-byte rows, T = 8192 x 24)
 *
 * Plain C, pthreads, no Python: the ceiling of the host gather on this machine, apart from the
 * library's thread pool and ctypes calls. A table of GIB GiB (anonymous memory, 2 MiB pages
 * asked for with MADV_HUGEPAGE, every page written first); 196,608 distinct-ish row ids drawn
 * uniformly, sorted ascending (as the library's dedup leaves them), a fresh id set for every
 * timed gather so no row is in the host's caches; each thread copies a contiguous share of the
 * ids' rows into a staging buffer, prefetching the rows `distance` ids ahead.
 *
 * Prints, per (threads, distance): median ms of 5 gathers and GB/s of row bytes; also one
 * thread's dependent-load latency over the table (ns per hop) and the sequential read rate.
 *
 *   cc -O3 -pthread -o /tmp/host_gather_ceiling benchmarks/host/host_gather_ceiling.c
 *   /tmp/host_gather_ceiling 32 1,2,4,8,12,14,16 0,16,32 [1g]
 * (1g: the table on 1 GiB hugetlb pages, reserved beforehand as root.)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define ROW_BYTES 272
#define GATHER_ROWS 196608
#define ID_SETS 40
#define REPEATS 5
#define MAX_THREADS 64

static uint8_t *table;
static int64_t table_rows;
static uint8_t *staging;
static int32_t *id_sets[ID_SETS];

typedef struct {
    pthread_barrier_t start, done;
    int threads, distance, set, mode, quit;  /* mode 0 gather, 1 sequential read, 2 fill */
    int64_t fill_bytes;
    uint64_t sink[MAX_THREADS * 8];
} Job;
static Job job;
static volatile uint64_t zero_mask = 0;  /* unknown to the compiler: keeps the chase's loads dependent */

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

static int compare_ids(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static void gather_share(int worker) {
    const int32_t *ids = id_sets[job.set];
    int64_t begin = (int64_t)GATHER_ROWS * worker / job.threads;
    int64_t end = (int64_t)GATHER_ROWS * (worker + 1) / job.threads;
    int distance = job.distance;
    for (int64_t i = begin; i < end; i++) {
        if (distance > 0 && i + distance < end) {
            const uint8_t *ahead = table + (int64_t)ids[i + distance] * ROW_BYTES;
            uintptr_t line = (uintptr_t)ahead & ~(uintptr_t)63;
            for (; line < (uintptr_t)ahead + ROW_BYTES; line += 64) __builtin_prefetch((const void *)line, 0, 2);
        }
        memcpy(staging + i * ROW_BYTES, table + (int64_t)ids[i] * ROW_BYTES, ROW_BYTES);
    }
}

static void read_share(int worker) {
    int64_t bytes = job.fill_bytes;
    int64_t begin = bytes * worker / job.threads / 8, end = bytes * (worker + 1) / job.threads / 8;
    const uint64_t *words = (const uint64_t *)table;
    uint64_t sum = 0;
    for (int64_t i = begin; i < end; i++) sum += words[i];
    job.sink[worker * 8] = sum;
}

static void fill_share(int worker) {
    int64_t bytes = job.fill_bytes;
    int64_t begin = bytes * worker / job.threads, end = bytes * (worker + 1) / job.threads;
    for (int64_t i = begin; i < end; i += 4096) table[i] = (uint8_t)(i >> 12);
}

static void *worker_main(void *arg) {
    int worker = (int)(intptr_t)arg;
    for (;;) {
        pthread_barrier_wait(&job.start);
        if (job.quit) return NULL;
        if (worker < job.threads) {
            if (job.mode == 0) gather_share(worker);
            else if (job.mode == 1) read_share(worker);
            else fill_share(worker);
        }
        pthread_barrier_wait(&job.done);
    }
}

static double run_job(void) {
    double t0 = now_s();
    pthread_barrier_wait(&job.start);
    pthread_barrier_wait(&job.done);
    return now_s() - t0;
}

static int compare_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int parse_list(const char *text, int *out, int most) {
    int count = 0;
    char *copy = strdup(text), *save = NULL;
    for (char *item = strtok_r(copy, ",", &save); item && count < most; item = strtok_r(NULL, ",", &save))
        out[count++] = atoi(item);
    free(copy);
    return count;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s GIB THREADS,... DISTANCES,...\n", argv[0]);
        return 2;
    }
    int64_t bytes = (int64_t)atoi(argv[1]) << 30;
    int thread_counts[16], distances[16];
    int n_threads = parse_list(argv[2], thread_counts, 16), n_distances = parse_list(argv[3], distances, 16);
    int most_threads = 1;
    for (int i = 0; i < n_threads; i++) most_threads = thread_counts[i] > most_threads ? thread_counts[i] : most_threads;
    if (most_threads > MAX_THREADS) most_threads = MAX_THREADS;
    int fill_threads = most_threads;

    table_rows = bytes / ROW_BYTES;
    int one_gib_pages = argc > 4 && !strcmp(argv[4], "1g");
    int advised = -1;
    if (one_gib_pages) { /* hugetlbfs pages of 1 GiB (reserved first: /sys/kernel/mm/hugepages/hugepages-1048576kB) */
        table = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | (30 << 26), -1, 0);
        if (table == MAP_FAILED) { perror("mmap of 1 GiB pages"); return 1; }
    } else {
        table = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (table == MAP_FAILED) { perror("mmap"); return 1; }
        advised = madvise(table, bytes, MADV_HUGEPAGE);
    }
    staging = aligned_alloc(4096, (size_t)GATHER_ROWS * ROW_BYTES);
    memset(staging, 0, (size_t)GATHER_ROWS * ROW_BYTES);

    pthread_barrier_init(&job.start, NULL, most_threads + 1);
    pthread_barrier_init(&job.done, NULL, most_threads + 1);
    pthread_t workers[MAX_THREADS];
    for (int i = 0; i < most_threads; i++) pthread_create(&workers[i], NULL, worker_main, (void *)(intptr_t)i);

    job.mode = 2; job.threads = fill_threads; job.fill_bytes = bytes;
    double fill_s = run_job();
    printf("table %lld GiB, %lld rows of %d B, %s; first write %.1f s (%.2f GB/s, %d threads)\n",
           (long long)(bytes >> 30), (long long)table_rows, ROW_BYTES,
           one_gib_pages ? "1 GiB hugetlb pages" : advised == 0 ? "MADV_HUGEPAGE ok" : "MADV_HUGEPAGE refused",
           fill_s, bytes / fill_s / 1e9, fill_threads);
    FILE *meminfo = fopen("/proc/meminfo", "r");
    char line[256];
    while (meminfo && fgets(line, sizeof line, meminfo))
        if (!strncmp(line, "AnonHugePages", 13) || !strncmp(line, "MemTotal", 8) || !strncmp(line, "Hugepagesize", 12))
            printf("  %s", line);
    if (meminfo) fclose(meminfo);

    uint64_t state = 0x9E3779B97F4A7C15ULL;
    for (int s = 0; s < ID_SETS; s++) {
        id_sets[s] = malloc(sizeof(int32_t) * GATHER_ROWS);
        for (int i = 0; i < GATHER_ROWS; i++) id_sets[s][i] = (int32_t)(next_random(&state) % (uint64_t)table_rows);
        qsort(id_sets[s], GATHER_ROWS, sizeof(int32_t), compare_ids);
    }

    /* Dependent loads: one thread, one hop per random row (the latency of a miss, page walk included). */
    {
        int64_t hops = 2000000;
        uint64_t position = 0, chase = 12345, mask = zero_mask;
        double t0 = now_s();
        for (int64_t h = 0; h < hops; h++) {
            uint64_t word = *(volatile uint64_t *)(table + (position % (uint64_t)table_rows) * ROW_BYTES);
            position = next_random(&chase) ^ (word & mask);  /* the next address waits for this load */
        }
        double elapsed = now_s() - t0;
        printf("dependent random loads, 1 thread: %.1f ns per hop\n", elapsed / hops * 1e9);
    }
    for (int t = 0; t < n_threads; t++) {
        job.mode = 1; job.threads = thread_counts[t]; job.fill_bytes = bytes < (8LL << 30) ? bytes : (8LL << 30);
        double seconds = run_job();
        printf("sequential read of %lld GiB, %2d threads: %.1f GB/s\n", (long long)(job.fill_bytes >> 30),
               thread_counts[t], job.fill_bytes / seconds / 1e9);
    }

    printf("\n%8s %9s %9s %9s %9s\n", "threads", "distance", "ms", "min ms", "GB/s");
    int set = 0;
    for (int d = 0; d < n_distances; d++) {
        for (int t = 0; t < n_threads; t++) {
            double times[REPEATS];
            for (int r = 0; r < REPEATS; r++) {
                job.mode = 0; job.threads = thread_counts[t]; job.distance = distances[d]; job.set = set;
                set = (set + 1) % ID_SETS;
                times[r] = run_job();
            }
            qsort(times, REPEATS, sizeof(double), compare_double);
            double median = times[REPEATS / 2];
            printf("%8d %9d %9.3f %9.3f %9.1f\n", thread_counts[t], distances[d], median * 1e3, times[0] * 1e3,
                   (double)GATHER_ROWS * ROW_BYTES / median / 1e9);
            fflush(stdout);
        }
    }
    job.quit = 1;
    pthread_barrier_wait(&job.start);
    for (int i = 0; i < most_threads; i++) pthread_join(workers[i], NULL);
    return 0;
}
