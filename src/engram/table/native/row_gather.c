/*
 * Row gather for host tables: out[i] = table[ids[i]] for i in [begin, end), with
 * software prefetch of the rows `prefetch_distance` ids ahead.
 *
 * Why: a gather of ~200k distinct rows of 272 B, spread over a table of tens of GiB, is
 * bound by DRAM (and page-walk) latency, not bandwidth. A plain copy loop (torch's
 * index_select) has about one row in flight per thread; prefetching every cache line
 * of the rows `prefetch_distance` ahead keeps many misses in flight per thread.
 *
 * Built by engram/table/native_gather.py (cc -O3 -shared -fPIC), called through ctypes,
 * one call per thread and chunk: single-threaded, no OpenMP (torch's libgomp owns that).
 *
 * Layout: `table` is uint8 [table_rows, row_bytes] (row i at table + i * row_bytes),
 * `out` is uint8 [>= end, row_bytes], `ids` holds int32 or int64 row ids (`id_bytes` 4 or
 * 8). All offsets are computed in int64.
 *
 * `prefetch_locality` picks the prefetch instruction (see prefetch_line), `options` holds
 * ENGRAM_STREAMING_STORES or 0.
 *
 * Returns -1 when every row was copied, or the position of the first id outside
 * [0, table_rows): that row and the rest of the chunk are not copied (the caller raises).
 */

#include <stdint.h>
#include <string.h>

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

int64_t engram_gather_rows(const uint8_t *table, int64_t table_rows, int64_t row_bytes,
                           const void *ids, int id_bytes, uint8_t *out,
                           int64_t begin, int64_t end, int64_t prefetch_distance,
                           int prefetch_locality, int options) {
    if (prefetch_distance < 0) {
        prefetch_distance = 0;
    }
    int streaming = 0;
#if defined(__SSE2__)
    streaming = (options & ENGRAM_STREAMING_STORES) && row_bytes % 16 == 0
                && ((uintptr_t)out % 16) == 0;
#else
    (void)options;
#endif
    /* The first `prefetch_distance` rows, then one row ahead per row copied. */
    int64_t warm_end = begin + prefetch_distance < end ? begin + prefetch_distance : end;
    for (int64_t i = begin; i < warm_end; ++i) {
        int64_t id = load_id(ids, id_bytes, i);
        if ((uint64_t)id < (uint64_t)table_rows) {
            prefetch_row(table + id * row_bytes, row_bytes, prefetch_locality);
        }
    }
    int64_t failed = -1;
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
            failed = i;
            break;
        }
        const uint8_t *src = table + id * row_bytes;
        uint8_t *dst = out + i * row_bytes;
#if defined(__SSE2__)
        if (streaming) {
            stream_row(dst, src, row_bytes);
            continue;
        }
#endif
        memcpy(dst, src, (size_t)row_bytes);
    }
#if defined(__SSE2__)
    if (streaming) {
        _mm_sfence(); /* the streamed rows are visible before the caller signals completion */
    }
#endif
    return failed;
}
