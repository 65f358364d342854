/*
 * Row gather for host tables: out[i] = table[ids[i]], with software prefetch of the rows
 * `prefetch_distance` ids ahead.
 *
 * Why: a gather of ~200k distinct rows of 272 B, spread over a table of tens of GiB, is
 * bound by DRAM (and page-walk) latency, not bandwidth. A plain copy loop (torch's
 * index_select) has about one row in flight per thread; prefetching every cache line
 * of the rows `prefetch_distance` ahead keeps many misses in flight per thread.
 *
 * Built by engram/table/native_gather.py (cc -O3 -shared -fPIC), called through ctypes
 * (which releases the GIL). No OpenMP (torch's libgomp owns that) and no threads of its
 * own: the callers are Python pool threads.
 *
 * - engram_gather_rows: rows [begin, end) on the calling thread.
 * - engram_gather_blocks: called by several threads at once for one gather; each claims
 *   the next block of rows of a shared plan (an atomic counter, so a thread that starts
 *   late takes fewer blocks) and adds the block's rows to its wave's counter when done.
 * - engram_wait_rows: block until a wave's counter reaches its row count (a futex on
 *   Linux, short sleeps elsewhere), or a timeout.
 *
 * Layout: `table` is uint8 [table_rows, row_bytes] (row i at table + i * row_bytes),
 * `out` is uint8 [rows, row_bytes] (row i of the gather at out + i * row_bytes), `ids` holds
 * int32 or int64 row ids (`id_bytes` 4 or 8). All offsets are int64. An id outside
 * [0, table_rows) is not read: its row and the rest of its range are skipped and its
 * position reported (the caller raises).
 */

#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define CACHE_LINE_BYTES 64

/* Bit flags of `options`. */
#define ENGRAM_STREAMING_STORES 1 /* non-temporal 16-byte stores into `out` (x86 SSE2) */

static inline int64_t load_id(const void *ids, int id_bytes, int64_t i) {
    return id_bytes == 4 ? (int64_t)((const int32_t *)ids)[i] : ((const int64_t *)ids)[i];
}

/* `locality` as __builtin_prefetch's: 3 into every cache level (x86 prefetcht0), 2 and 1
 * into L2 and beyond (prefetcht1 / prefetcht2), 0 non-temporal (prefetchnta). */
static inline void prefetch_line(const void *line, int locality) {
    switch (locality) {
    case 0: __builtin_prefetch(line, 0, 0); break;
    case 1: __builtin_prefetch(line, 0, 1); break;
    case 2: __builtin_prefetch(line, 0, 2); break;
    default: __builtin_prefetch(line, 0, 3); break;
    }
}

/* Every cache line the row touches (a 272-byte row spans 5 or 6 lines). */
static inline void prefetch_row(const uint8_t *row, int64_t row_bytes, int locality) {
    uintptr_t line = (uintptr_t)row & ~(uintptr_t)(CACHE_LINE_BYTES - 1);
    uintptr_t last = (uintptr_t)row + (uintptr_t)row_bytes - 1;
    for (; line <= last; line += CACHE_LINE_BYTES) {
        prefetch_line((const void *)line, locality);
    }
}

#if defined(__SSE2__)
/* The row bypasses the caches on its way to `dst` (16-byte aligned, row_bytes % 16 == 0):
 * no read-for-ownership of the destination, which the copy engine reads next anyway. */
static inline void stream_row(uint8_t *dst, const uint8_t *src, int64_t row_bytes) {
    for (int64_t k = 0; k < row_bytes; k += 16) {
        __m128i chunk = _mm_loadu_si128((const __m128i *)(src + k));
        _mm_stream_si128((__m128i *)(dst + k), chunk);
    }
}
#endif

/* Rows [begin, end); -1, or the position of the first id outside the table. */
static int64_t gather_range(const uint8_t *table, int64_t table_rows, int64_t row_bytes,
                            const void *ids, int id_bytes, uint8_t *out, int64_t begin, int64_t end,
                            int64_t prefetch_distance, int prefetch_locality, int streaming) {
    /* The first `prefetch_distance` rows, then one row ahead per row copied. */
    int64_t warm_end = begin + prefetch_distance < end ? begin + prefetch_distance : end;
    for (int64_t i = begin; i < warm_end; ++i) {
        int64_t id = load_id(ids, id_bytes, i);
        if ((uint64_t)id < (uint64_t)table_rows) {
            prefetch_row(table + id * row_bytes, row_bytes, prefetch_locality);
        }
    }
    for (int64_t i = begin; i < end; ++i) {
        int64_t ahead = i + prefetch_distance;
        if (prefetch_distance > 0 && ahead < end) {
            int64_t next = load_id(ids, id_bytes, ahead);
            if ((uint64_t)next < (uint64_t)table_rows) {
                prefetch_row(table + next * row_bytes, row_bytes, prefetch_locality);
            }
        }
        int64_t id = load_id(ids, id_bytes, i);
        if ((uint64_t)id >= (uint64_t)table_rows) {
            return i;
        }
        const uint8_t *src = table + id * row_bytes;
        uint8_t *dst = out + i * row_bytes;
#if defined(__SSE2__)
        if (streaming) {
            stream_row(dst, src, row_bytes);
            continue;
        }
#else
        (void)streaming;
#endif
        memcpy(dst, src, (size_t)row_bytes);
    }
    return -1;
}

static int use_streaming(int options, int64_t row_bytes, const uint8_t *out) {
#if defined(__SSE2__)
    return (options & ENGRAM_STREAMING_STORES) && row_bytes % 16 == 0 && ((uintptr_t)out % 16) == 0;
#else
    (void)options, (void)row_bytes, (void)out;
    return 0;
#endif
}

/* Streamed rows are visible to other threads (and the copy engine) before what follows. */
static void store_fence(int streaming) {
#if defined(__SSE2__)
    if (streaming) {
        _mm_sfence();
    }
#else
    (void)streaming;
#endif
}

int64_t engram_gather_rows(const uint8_t *table, int64_t table_rows, int64_t row_bytes,
                           const void *ids, int id_bytes, uint8_t *out,
                           int64_t begin, int64_t end, int64_t prefetch_distance,
                           int prefetch_locality, int options) {
    int streaming = use_streaming(options, row_bytes, out);
    int64_t failed = gather_range(table, table_rows, row_bytes, ids, id_bytes, out, begin, end,
                                  prefetch_distance < 0 ? 0 : prefetch_distance, prefetch_locality, streaming);
    store_fence(streaming);
    return failed;
}

/* Shared state of one engram_gather_blocks gather, int64 words zeroed by the caller except
 * STATE_FIRST_FAILURE (INT64_MAX): */
#define STATE_NEXT_BLOCK 0    /* the next block to claim */
#define STATE_FIRST_FAILURE 1 /* the smallest position of an id outside the table */
#define STATE_WAVE_ROWS 2     /* then one word per wave: rows copied (or skipped) so far */

static void wake_waiters(int64_t *counter) {
#if defined(__linux__)
    /* The futex is the counter's low 32 bits (x86 and arm64 are little-endian). */
    syscall(SYS_futex, (uint32_t *)counter, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
#else
    (void)counter;
#endif
}

static void record_failure(int64_t *state, int64_t position) {
    int64_t seen = __atomic_load_n(&state[STATE_FIRST_FAILURE], __ATOMIC_RELAXED);
    while (position < seen
           && !__atomic_compare_exchange_n(&state[STATE_FIRST_FAILURE], &seen, position, 1, __ATOMIC_RELAXED,
                                           __ATOMIC_RELAXED)) {
    }
}

/*
 * One of several threads gathering the blocks of `plan` (int64 [num_blocks, 3]: begin, end,
 * wave of each block, ascending) into `out`. Returns when no block is left to claim.
 */
void engram_gather_blocks(const uint8_t *table, int64_t table_rows, int64_t row_bytes,
                          const void *ids, int id_bytes, uint8_t *out,
                          const int64_t *plan, int64_t num_blocks, int64_t *state,
                          int64_t prefetch_distance, int prefetch_locality, int options) {
    int streaming = use_streaming(options, row_bytes, out);
    if (prefetch_distance < 0) {
        prefetch_distance = 0;
    }
    for (;;) {
        int64_t block = __atomic_fetch_add(&state[STATE_NEXT_BLOCK], 1, __ATOMIC_RELAXED);
        if (block >= num_blocks) {
            return;
        }
        int64_t begin = plan[3 * block], end = plan[3 * block + 1], wave = plan[3 * block + 2];
        int64_t failed = gather_range(table, table_rows, row_bytes, ids, id_bytes, out, begin, end,
                                      prefetch_distance, prefetch_locality, streaming);
        if (failed >= 0) {
            record_failure(state, failed);
        }
        store_fence(streaming);
        /* Release: a waiter that sees the count sees the rows. */
        __atomic_fetch_add(&state[STATE_WAVE_ROWS + wave], end - begin, __ATOMIC_RELEASE);
        wake_waiters(&state[STATE_WAVE_ROWS + wave]);
    }
}

/* Block until *counter >= target (a wave's rows) or `timeout_ns` have passed: 1 when the
 * target was reached, 0 on timeout (the caller checks its threads are alive, then waits again). */
int engram_wait_rows(int64_t *counter, int64_t target, int64_t timeout_ns) {
    for (int spin = 0; spin < 64; ++spin) {
        if (__atomic_load_n(counter, __ATOMIC_ACQUIRE) >= target) {
            return 1;
        }
    }
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t deadline = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec + timeout_ns;
    for (;;) {
        int64_t seen = __atomic_load_n(counter, __ATOMIC_ACQUIRE);
        if (seen >= target) {
            return 1;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((int64_t)now.tv_sec * 1000000000 + now.tv_nsec >= deadline) {
            return 0;
        }
#if defined(__linux__)
        /* Sleeps only while the low 32 bits still equal `seen`; the timeout bounds a missed wake. */
        struct timespec pause = {0, 1000000};
        syscall(SYS_futex, (uint32_t *)counter, FUTEX_WAIT_PRIVATE, (uint32_t)seen, &pause, NULL, 0);
#else
        struct timespec pause = {0, 20000};
        nanosleep(&pause, NULL);
#endif
    }
}
