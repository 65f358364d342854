/*
 * The host gather's worker in native code: row copies that wait on nothing a Python thread or a CUDA
 * call can hold.
 *
 * A job copies `staging[i] = table[ids[i]]` for the job's distinct rows. The GPU writes its inputs
 * (the ids, their count at ids[num_ids], then the `ids_ready` flag, all into pinned memory); the
 * worker polls that flag and its team of threads copies the rows in chunks of CHUNK_ROWS, taken in
 * order across the whole job with no barrier between waves: the thread that finishes a wave's last
 * chunk stores `waves_done` (for every wave complete in order), which the GPU's copy stream waits on
 * (cuStreamWaitValue32) before moving that wave to the device. No thread here takes the GIL or calls
 * CUDA, so a stream waiting on a wave is released whatever the process's other threads hold (a module
 * load, a synchronizing call).
 *
 * The protocol, once: docs/design.md, "The host-gather protocol"; its constants and job record:
 * gather_protocol.py.
 *
 * Jobs run one at a time in the order submitted: the order their GPU inputs were enqueued in, so
 * a job never waits on work enqueued after it. Flags are uint32, compared wrap-aware as the GPU does.
 * Ids are clamped into the table (anything outside reads the last row, the table's zero row) and
 * the count into [1, num_ids]: malformed inputs give wrong rows, never an access outside the buffers.
 *
 * H200 host (16 vCPUs), 196,608 random rows of 272 B from a 26 GiB table (benchmarks/NOTES.md
 * "The served decoder step"): memcpy per row on 14 threads, each prefetching the rows 16 ids
 * ahead, 1.71 ms (31 GB/s), against 2.4 ms without the prefetch and torch's index_select 2.2 ms.
 * A barrier per wave (every thread idle until the wave's slowest chunk of 512 rows is in) cost about
 * 60 us a wave there ("Host path, stage by stage").
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* The constants this file shares with Python come from gather_protocol.py (compile_definitions), which
 * the build passes as -D flags; the protocol itself is described in docs/design.md. */
#if !defined(ENGRAM_MAX_WAVES) || !defined(ENGRAM_MAX_THREADS) || !defined(ENGRAM_TIMED_WAVES) \
    || !defined(ENGRAM_TIMELINE_WORDS) || !defined(ENGRAM_CHUNK_ROWS) || !defined(ENGRAM_PREFETCH_DISTANCE) \
    || !defined(ENGRAM_MAX_REPLAYED) || !defined(ENGRAM_SOURCE_DIGEST)
#error "build with gather_protocol.compile_definitions(): the constants shared with Python are missing"
#endif
#define MAX_THREADS ENGRAM_MAX_THREADS
#define MAX_WAVES ENGRAM_MAX_WAVES
#define CHUNK_ROWS ENGRAM_CHUNK_ROWS
#define PREFETCH_DISTANCE ENGRAM_PREFETCH_DISTANCE
#define TIMED_WAVES ENGRAM_TIMED_WAVES
#define MAX_REPLAYED ENGRAM_MAX_REPLAYED

/* The last finished job's timeline (CLOCK_MONOTONIC ns, the clock of Python's time.monotonic_ns):
 * its job_done value, ids seen ready, staging seen free, the end of each of its first TIMED_WAVES
 * waves, the job's end, then the chunks its leader copied and the chunks in all. */
enum { T_JOB, T_IDS_READY, T_STAGING_FREE, T_WAVES, T_DONE = T_WAVES + TIMED_WAVES, T_LEADER_CHUNKS,
       T_CHUNKS, TIMELINE_WORDS };
_Static_assert(TIMELINE_WORDS == ENGRAM_TIMELINE_WORDS, "the timeline's words differ from gather_protocol.py's");

/* One job's record: gather_protocol.JobRecord, field for field (engram_gather_record_layout reports the
 * layout, which a test compares). A queued Job begins with the same fields. */
#define JOB_RECORD_FIELDS \
    const uint8_t *table; \
    int64_t table_rows;            /* rows including the zero row, which is the last */ \
    int64_t row_bytes; \
    const int32_t *ids;            /* [num_ids + 1]: distinct rows in [:count], count at [num_ids] */ \
    int64_t num_ids; \
    uint8_t *staging;              /* [num_ids, row_bytes] */ \
    const volatile uint32_t *ids_ready; \
    uint32_t ids_ready_value; \
    const volatile uint32_t *staging_free;  /* the previous copies of this staging have run */ \
    uint32_t staging_free_value; \
    volatile uint32_t *waves_done; \
    uint32_t waves_base; \
    int32_t num_waves; \
    volatile uint32_t *job_done; \
    uint32_t job_done_value; \
    int64_t wave_ends[MAX_WAVES];  /* wave k covers staging rows [wave_ends[k-1] (0 for k = 0), wave_ends[k]) */

typedef struct JobRecord {
    JOB_RECORD_FIELDS
} JobRecord;

typedef struct Job {
    JOB_RECORD_FIELDS
    struct Job *next;
} Job;


/* A replayed job: one captured gather, run once per replay of its CUDA graph. The graph writes `ids_ready` =
 * POSTED after its ids; whoever moves it from POSTED to 0 (compare-and-swap) answers that replay: the worker,
 * by copying the rows and storing waves_done = k + 1 after wave k, or the watchdog, by storing waves_done =
 * num_waves with the staging left as it was. Either then adds 1 to job_done. The graph's copy stream waits for
 * waves_done >= k + 1 before wave k's copy and writes waves_done = 0 after the last one. */
#define POSTED 1u
typedef struct Replayed {
    Job job;
    int64_t bound_ns;              /* the watchdog answers a replay left POSTED this long */
    uint32_t seen_done;            /* watchdog: job_done when it first saw the current POSTED */
    int64_t seen_ns;               /* watchdog: when (0: not POSTED at its last look) */
} Replayed;

typedef struct Service {
    pthread_mutex_t lock;
    pthread_cond_t wake;           /* a job was queued, a wave was posted, or stop */
    Job *head, *tail;
    int threads, started, stop;
    pthread_t tids[MAX_THREADS];
    /* the job being copied: the leader posts it once, every team thread takes chunks of it; chunks never
     * straddle a wave, and the thread finishing a wave's last chunk publishes it (in wave order) */
    const Job *post_job;
    uint64_t post_generation;
    int post_open;                 /* helpers may join the posted job (under lock) */
    int32_t post_waves;
    int64_t wave_begin[MAX_WAVES], wave_end[MAX_WAVES], wave_first_chunk[MAX_WAVES + 1];
    int64_t wave_chunks_done[MAX_WAVES];  /* atomics */
    int wave_complete[MAX_WAVES];  /* under publish_lock */
    int32_t waves_published;       /* under publish_lock */
    int64_t wave_published_ns[TIMED_WAVES];  /* under publish_lock */
    pthread_mutex_t publish_lock;
    int64_t next_chunk, chunks, chunks_done, active;  /* atomics; active: helpers inside the job */
    /* test hook: the next job holds after its ids are ready until *hold_latch != 0 or the timeout */
    const volatile uint32_t *hold_latch;
    int64_t hold_timeout_ns;
    int64_t stats[4];              /* jobs done, holds released, holds timed out, polls that slept */
    int64_t timeline[TIMELINE_WORDS];  /* the last finished job's (written by the leader only) */
    /* replayed jobs: added under lock, never removed (a captured graph may replay at any time) */
    Replayed *replayed[MAX_REPLAYED];
    int replayed_count;            /* atomic reads outside the lock */
    int replays_paused;            /* test hook: the worker leaves replays to the watchdog */
    int team_gone;                 /* stop() ran: the watchdog answers every replay at once */
    pthread_t watchdog;
    int watchdog_started;
    int64_t replay_stats[2];       /* replays copied, replays the watchdog answered */
} Service;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void pause_briefly(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void sleep_ns(long ns) {
    struct timespec t = {0, ns};
    nanosleep(&t, NULL);
}

static int reached(uint32_t value, uint32_t target) { return (int32_t)(value - target) >= 0; }

static int stopping(Service *s) { return __atomic_load_n(&s->stop, __ATOMIC_ACQUIRE); }

static int serve_replays(Service *s);

/* Wait until *flag has reached target (wrap-aware); 0, or -1 when the service stops first. Spins
 * ~50 us (the GPU's write usually follows within microseconds), then polls every 20 us. Replays posted
 * meanwhile are served (a graph replayed before this job's ids are written must not wait for them). */
static int wait_flag(Service *s, const volatile uint32_t *flag, uint32_t target) {
    int64_t spin_until = now_ns() + 50000;
    int slept = 0;
    while (!reached(__atomic_load_n(flag, __ATOMIC_ACQUIRE), target)) {
        if (stopping(s)) return -1;
        if (serve_replays(s)) continue;
        if (now_ns() < spin_until) {
            for (int i = 0; i < 64; i++) pause_briefly();
        } else {
            slept = 1;
            sleep_ns(20000);
        }
    }
    if (slept) __atomic_fetch_add(&s->stats[3], 1, __ATOMIC_RELAXED);
    return 0;
}

static const uint8_t *row_of(const Job *job, int64_t i) {
    uint64_t last = (uint64_t)job->table_rows - 1, row = (uint32_t)job->ids[i];
    return job->table + (int64_t)(row > last ? last : row) * job->row_bytes;
}

static void prefetch_row(const Job *job, int64_t i) {
    const uint8_t *row = row_of(job, i);
    for (int64_t line = 0; line < job->row_bytes; line += 64) __builtin_prefetch(row + line, 0, 2);
}

/* One row: non-temporal 16-byte stores where both ends are 16-byte aligned (rows of 272 B in buffers
 * from the allocator are), else memcpy. Streaming stores skip the read-for-ownership of each staging
 * line and leave no dirty staging lines in the CPU caches for the copy engine's reads to snoop. */
static void copy_row(uint8_t *target, const uint8_t *source, int64_t row_bytes) {
#if defined(__SSE2__)
    if (((uintptr_t)target | (uintptr_t)source | (uintptr_t)row_bytes) % 16 == 0) {
        for (int64_t offset = 0; offset < row_bytes; offset += 16)
            _mm_stream_si128((__m128i *)(target + offset), _mm_load_si128((const __m128i *)(source + offset)));
        return;
    }
#endif
    if (row_bytes == 272) memcpy(target, source, 272);  /* D = 256: a fixed size the compiler inlines */
    else memcpy(target, source, (size_t)row_bytes);
}

/* staging[i] = table[ids[i]] for i in [begin, end), the rows PREFETCH_DISTANCE ids ahead prefetched; the
 * stores are visible to other threads and the copy engine once this returns (the fence). */
static void copy_rows(const Job *job, int64_t begin, int64_t end) {
    uint8_t *staging = job->staging;
    int64_t row_bytes = job->row_bytes;
    for (int64_t i = begin; i < end && i < begin + PREFETCH_DISTANCE; i++) prefetch_row(job, i);
    for (int64_t i = begin; i < end; i++) {
        if (i + PREFETCH_DISTANCE < end) prefetch_row(job, i + PREFETCH_DISTANCE);
        copy_row(staging + i * row_bytes, row_of(job, i), row_bytes);
    }
#if defined(__SSE2__)
    _mm_sfence();  /* streaming stores are weakly ordered: drain them before the chunk is counted */
#endif
}

/* Store waves_done for every wave complete in order from the first unpublished one. */
static void publish_waves(Service *s, const Job *job, int32_t wave) {
    pthread_mutex_lock(&s->publish_lock);
    s->wave_complete[wave] = 1;
    while (s->waves_published < s->post_waves && s->wave_complete[s->waves_published]) {
        s->waves_published++;
        __atomic_store_n(job->waves_done, job->waves_base + (uint32_t)s->waves_published, __ATOMIC_RELEASE);
        if (s->waves_published <= TIMED_WAVES) s->wave_published_ns[s->waves_published - 1] = now_ns();
    }
    pthread_mutex_unlock(&s->publish_lock);
}

/* Take chunks of the posted job until none is left; returns how many this thread copied. */
static int64_t copy_chunks(Service *s, const Job *job, int64_t chunks) {
    int32_t wave = 0;
    for (int64_t copied = 0;; copied++) {
        int64_t chunk = __atomic_fetch_add(&s->next_chunk, 1, __ATOMIC_RELAXED);
        if (chunk >= chunks) return copied;
        while (chunk >= s->wave_first_chunk[wave + 1]) wave++;  /* chunks are taken in increasing order */
        int64_t a = s->wave_begin[wave] + (chunk - s->wave_first_chunk[wave]) * CHUNK_ROWS;
        int64_t b = a + CHUNK_ROWS < s->wave_end[wave] ? a + CHUNK_ROWS : s->wave_end[wave];
        copy_rows(job, a, b);
        int64_t wave_chunks = s->wave_first_chunk[wave + 1] - s->wave_first_chunk[wave];
        if (__atomic_add_fetch(&s->wave_chunks_done[wave], 1, __ATOMIC_ACQ_REL) == wave_chunks)
            publish_waves(s, job, wave);
        __atomic_fetch_add(&s->chunks_done, 1, __ATOMIC_RELEASE);
    }
}

/* Leader: cut the job's rows [0, count) into its waves and chunks, post it to the team, copy beside it,
 * return once every chunk is in and every helper has left (only then may the next job reuse the state). */
static void copy_job(Service *s, const Job *job, int64_t count, int64_t *timeline) {
    int32_t waves = job->num_waves;
    int64_t chunks = 0;
    for (int32_t wave = 0; wave < waves; wave++) {
        int64_t begin = wave ? job->wave_ends[wave - 1] : 0, end = job->wave_ends[wave];
        begin = begin < count ? begin : count;  /* rows past the count are not needed (nor written) */
        end = end < count ? end : count;
        s->wave_begin[wave] = begin;
        s->wave_end[wave] = end;
        s->wave_first_chunk[wave] = chunks;
        s->wave_chunks_done[wave] = 0;
        s->wave_complete[wave] = end <= begin;  /* empty waves (past the count) publish with the one before */
        chunks += (end - begin + CHUNK_ROWS - 1) / CHUNK_ROWS;
    }
    s->wave_first_chunk[waves] = chunks;
    s->waves_published = 0;
    s->post_waves = waves;
    pthread_mutex_lock(&s->lock);
    s->post_job = job;
    __atomic_store_n(&s->chunks, chunks, __ATOMIC_RELAXED);
    __atomic_store_n(&s->chunks_done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->next_chunk, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->post_generation, s->post_generation + 1, __ATOMIC_RELEASE);
    s->post_open = 1;
    pthread_cond_broadcast(&s->wake);
    pthread_mutex_unlock(&s->lock);
    timeline[T_LEADER_CHUNKS] = copy_chunks(s, job, chunks);
    timeline[T_CHUNKS] = chunks;
    /* every chunk taken; wait for the ones other threads are still copying (microseconds each) */
    while (__atomic_load_n(&s->chunks_done, __ATOMIC_ACQUIRE) < chunks) pause_briefly();
    pthread_mutex_lock(&s->lock);
    s->post_open = 0;
    pthread_mutex_unlock(&s->lock);
    while (__atomic_load_n(&s->active, __ATOMIC_ACQUIRE) > 0) pause_briefly();
}

static void hold_if_asked(Service *s) {
    const volatile uint32_t *latch = __atomic_exchange_n(&s->hold_latch, NULL, __ATOMIC_ACQ_REL);
    if (latch == NULL) return;
    int64_t deadline = now_ns() + __atomic_load_n(&s->hold_timeout_ns, __ATOMIC_RELAXED);
    while (__atomic_load_n(latch, __ATOMIC_ACQUIRE) == 0) {
        if (stopping(s)) return;
        if (now_ns() > deadline) {
            __atomic_fetch_add(&s->stats[2], 1, __ATOMIC_RELAXED);
            return;
        }
        sleep_ns(100000);
    }
    __atomic_fetch_add(&s->stats[1], 1, __ATOMIC_RELAXED);
}

/* A job the service will not copy (it stops first): write its words anyway, so no stream waits on them
 * forever. Its staging rows are whatever the staging held; the consumer's per-row id check reads every row
 * whose staged copy is not its own from the table itself. */
static void release_job(const Job *job) {
    __atomic_store_n(job->waves_done, job->waves_base + (uint32_t)job->num_waves, __ATOMIC_RELEASE);
    __atomic_store_n(job->job_done, job->job_done_value, __ATOMIC_RELEASE);
}

static void run_job(Service *s, Job *job) {
    int64_t timeline[TIMELINE_WORDS] = {0};
    timeline[T_JOB] = job->job_done_value;
    if (wait_flag(s, job->ids_ready, job->ids_ready_value)) {
        release_job(job);
        return;
    }
    timeline[T_IDS_READY] = now_ns();
    if (wait_flag(s, job->staging_free, job->staging_free_value)) {
        release_job(job);
        return;
    }
    timeline[T_STAGING_FREE] = now_ns();
    hold_if_asked(s);
    int64_t count = job->ids[job->num_ids];
    count = count < 1 ? 1 : count > job->num_ids ? job->num_ids : count;
    copy_job(s, job, count, timeline);
    timeline[T_DONE] = now_ns();
    for (int32_t wave = 0; wave < job->num_waves && wave < TIMED_WAVES; wave++)
        timeline[T_WAVES + wave] = s->wave_published_ns[wave];
    for (int i = 0; i < TIMELINE_WORDS; i++) __atomic_store_n(&s->timeline[i], timeline[i], __ATOMIC_RELAXED);
    __atomic_store_n(job->job_done, job->job_done_value, __ATOMIC_RELEASE);
    __atomic_fetch_add(&s->stats[0], 1, __ATOMIC_RELAXED);
}

/* Take replay `r`'s current POSTED (worker or watchdog): 1 when this caller now answers it. */
static int claim_replay(Replayed *r) {
    uint32_t expected = POSTED;
    return __atomic_compare_exchange_n((uint32_t *)r->job.ids_ready, &expected, 0u, 0, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE);
}

static void answered(Replayed *r) { __atomic_fetch_add((uint32_t *)r->job.job_done, 1u, __ATOMIC_RELEASE); }

/* Leader: copy every posted replay it can claim; returns how many it served. */
static int serve_replays(Service *s) {
    int served = 0, count = __atomic_load_n(&s->replayed_count, __ATOMIC_ACQUIRE);
    if (count == 0 || __atomic_load_n(&s->replays_paused, __ATOMIC_ACQUIRE)) return 0;
    for (int i = 0; i < count; i++) {
        Replayed *r = s->replayed[i];
        if (__atomic_load_n(r->job.ids_ready, __ATOMIC_ACQUIRE) != POSTED || !claim_replay(r)) continue;
        int64_t timeline[TIMELINE_WORDS] = {0};
        int64_t num = r->job.ids[r->job.num_ids];
        num = num < 1 ? 1 : num > r->job.num_ids ? r->job.num_ids : num;
        copy_job(s, &r->job, num, timeline);
        answered(r);
        __atomic_fetch_add(&s->replay_stats[0], 1, __ATOMIC_RELAXED);
        served++;
    }
    return served;
}

/* Watchdog (its own thread, from the first replayed job to the end of the process): a replay left POSTED
 * past its bound (the worker held up or paused), or any replay once the team is gone, gets its waves_done
 * from here, its staging unwritten; the consumer's per-row id check reads those rows from the table itself.
 * It looks every 1 ms, every 20 us once the team is gone. */
static void *watchdog_main(void *arg) {
    Service *s = arg;
    for (;;) {
        int gone = __atomic_load_n(&s->team_gone, __ATOMIC_ACQUIRE);
        int count = __atomic_load_n(&s->replayed_count, __ATOMIC_ACQUIRE);
        int64_t now = now_ns();
        for (int i = 0; i < count; i++) {
            Replayed *r = s->replayed[i];
            uint32_t done = __atomic_load_n(r->job.job_done, __ATOMIC_ACQUIRE);
            if (__atomic_load_n(r->job.ids_ready, __ATOMIC_ACQUIRE) != POSTED) {
                r->seen_ns = 0;
                continue;
            }
            if (!gone && (r->seen_ns == 0 || r->seen_done != done)) {  /* a replay posted since the last look */
                r->seen_ns = now;
                r->seen_done = done;
                continue;
            }
            if ((gone || now - r->seen_ns >= r->bound_ns) && claim_replay(r)) {
                __atomic_store_n(r->job.waves_done, (uint32_t)r->job.num_waves, __ATOMIC_RELEASE);
                answered(r);
                __atomic_fetch_add(&s->replay_stats[1], 1, __ATOMIC_RELAXED);
                r->seen_ns = 0;
            }
        }
        sleep_ns(gone ? 20000 : 1000000);
    }
    return NULL;
}

/* Leader, no job queued but replays registered: serve them, spinning ~50 us after the last one, then
 * polling every 20 us; returns at once when a job is queued or the service stops. */
static void poll_replays(Service *s) {
    int64_t spin_until = now_ns() + 50000;
    for (;;) {
        if (stopping(s) || __atomic_load_n(&s->head, __ATOMIC_ACQUIRE) != NULL) return;
        if (serve_replays(s)) {
            spin_until = now_ns() + 50000;
        } else if (now_ns() < spin_until) {
            for (int i = 0; i < 64; i++) pause_briefly();
        } else {
            sleep_ns(20000);
        }
    }
}

static void *leader_main(void *arg) {
    Service *s = arg;
#ifdef PR_SET_TIMERSLACK
    prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);  /* 1 us: a 20 us poll sleeps ~20 us, not the default ~70 */
#endif
    for (;;) {
        pthread_mutex_lock(&s->lock);
        while (s->head == NULL && !s->stop && __atomic_load_n(&s->replayed_count, __ATOMIC_ACQUIRE) == 0)
            pthread_cond_wait(&s->wake, &s->lock);
        if (s->stop) {
            pthread_mutex_unlock(&s->lock);
            return NULL;
        }
        if (s->head == NULL) {
            pthread_mutex_unlock(&s->lock);
            poll_replays(s);
            continue;
        }
        Job *job = s->head;
        s->head = job->next;
        if (s->head == NULL) s->tail = NULL;
        pthread_mutex_unlock(&s->lock);
        run_job(s, job);
        free(job);
    }
}

static void *helper_main(void *arg) {
    Service *s = arg;
    uint64_t seen = 0;
    for (;;) {
        /* spin ~20 us for the next job (jobs of one step's tables follow each other closely), then sleep */
        int64_t spin_until = now_ns() + 20000;
        while (__atomic_load_n(&s->post_generation, __ATOMIC_ACQUIRE) == seen && !stopping(s)
               && now_ns() < spin_until)
            pause_briefly();
        pthread_mutex_lock(&s->lock);
        while (!(s->post_open && s->post_generation != seen) && !s->stop) pthread_cond_wait(&s->wake, &s->lock);
        if (s->stop) {
            pthread_mutex_unlock(&s->lock);
            return NULL;
        }
        seen = s->post_generation;
        const Job *job = s->post_job;
        int64_t chunks = s->chunks;
        __atomic_fetch_add(&s->active, 1, __ATOMIC_RELAXED);  /* joined under the lock, while open */
        pthread_mutex_unlock(&s->lock);
        copy_chunks(s, job, chunks);
        __atomic_fetch_sub(&s->active, 1, __ATOMIC_RELEASE);
    }
}

void engram_gather_stop(Service *s);

/* A service of `threads` copying threads (the leader and threads - 1 helpers); NULL on failure. */
Service *engram_gather_create(int threads) {
    if (threads < 1 || threads > MAX_THREADS) return NULL;
    Service *s = calloc(1, sizeof(Service));
    if (s == NULL) return NULL;
    pthread_mutex_init(&s->lock, NULL);
    pthread_mutex_init(&s->publish_lock, NULL);
    pthread_cond_init(&s->wake, NULL);
    s->threads = threads;
    for (int i = 0; i < threads; i++) {
        if (pthread_create(&s->tids[i], NULL, i == 0 ? leader_main : helper_main, s) != 0) {
            engram_gather_stop(s);
            return NULL;
        }
        s->started = i + 1;
    }
    return s;
}

/* Queue one job (its record copied); 0, or -1 when out of memory or the record is malformed (wave ends must
 * increase and end at num_ids). */
/* Whether record `r` is well formed: its buffers and words set, 1..MAX_WAVES waves (at most one per id) whose
 * ends increase and end at num_ids. */
static int record_valid(const JobRecord *r) {
    if (r == NULL || r->table == NULL || r->table_rows < 1 || r->row_bytes < 1 || r->ids == NULL || r->num_ids < 1
        || r->staging == NULL || r->ids_ready == NULL || r->waves_done == NULL || r->job_done == NULL
        || r->num_waves < 1 || r->num_waves > MAX_WAVES || r->num_waves > r->num_ids)
        return 0;
    for (int32_t wave = 0; wave < r->num_waves; wave++)
        if (r->wave_ends[wave] <= (wave ? r->wave_ends[wave - 1] : 0)) return 0;
    return r->wave_ends[r->num_waves - 1] == r->num_ids;
}

int engram_gather_submit(Service *s, const JobRecord *record) {
    if (s == NULL || !record_valid(record) || record->staging_free == NULL) return -1;
    const JobRecord *r = record;
    Job *job = calloc(1, sizeof(Job));
    if (job == NULL) return -1;
    memcpy(job, r, sizeof(JobRecord));  /* a Job begins with the record's fields */
    job->next = NULL;
    pthread_mutex_lock(&s->lock);
    if (s->tail) s->tail->next = job;
    else s->head = job;
    s->tail = job;
    pthread_cond_broadcast(&s->wake);
    pthread_mutex_unlock(&s->lock);
    return 0;
}

/* Register a replayed job (the record copied; see Replayed): ids_ready is its POSTED word, waves_base 0,
 * job_done the count of replays answered; staging_free is not used. Returns its index, or -1 when the record
 * is malformed, MAX_REPLAYED are registered, the service is stopping or the watchdog cannot start. */
int engram_gather_add_replayed(Service *s, const JobRecord *record, int64_t bound_ns) {
    if (s == NULL || bound_ns < 1 || !record_valid(record) || record->waves_base != 0) return -1;
    const JobRecord *r = record;
    Replayed *replayed = calloc(1, sizeof(Replayed));
    if (replayed == NULL) return -1;
    memcpy(&replayed->job, r, sizeof(JobRecord));
    replayed->bound_ns = bound_ns;
    pthread_mutex_lock(&s->lock);
    int index = -1;
    if (!s->stop && s->replayed_count < MAX_REPLAYED
        && (s->watchdog_started || pthread_create(&s->watchdog, NULL, watchdog_main, s) == 0)) {
        s->watchdog_started = 1;
        index = s->replayed_count;
        s->replayed[index] = replayed;
        __atomic_store_n(&s->replayed_count, index + 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&s->wake);  /* the leader starts polling */
    }
    pthread_mutex_unlock(&s->lock);
    if (index < 0) free(replayed);
    return index;
}

/* Test hook: with paused != 0 the worker leaves every replay to the watchdog (a worker held up). */
void engram_gather_pause_replays(Service *s, int paused) {
    __atomic_store_n(&s->replays_paused, paused != 0, __ATOMIC_RELEASE);
}

/* out[0..2]: replayed jobs registered, replays copied, replays the watchdog answered. */
void engram_gather_replay_stats(Service *s, int64_t *out) {
    out[0] = __atomic_load_n(&s->replayed_count, __ATOMIC_ACQUIRE);
    out[1] = __atomic_load_n(&s->replay_stats[0], __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&s->replay_stats[1], __ATOMIC_RELAXED);
}

/* The record's layout for the protocol test: out[0] = sizeof(JobRecord), then each field's offset in
 * declaration order; returns the words written (at most `words`). */
int engram_gather_record_layout(int64_t *out, int words) {
    int64_t layout[] = {sizeof(JobRecord), offsetof(JobRecord, table), offsetof(JobRecord, table_rows),
                        offsetof(JobRecord, row_bytes), offsetof(JobRecord, ids), offsetof(JobRecord, num_ids),
                        offsetof(JobRecord, staging), offsetof(JobRecord, ids_ready),
                        offsetof(JobRecord, ids_ready_value), offsetof(JobRecord, staging_free),
                        offsetof(JobRecord, staging_free_value), offsetof(JobRecord, waves_done),
                        offsetof(JobRecord, waves_base), offsetof(JobRecord, num_waves), offsetof(JobRecord, job_done),
                        offsetof(JobRecord, job_done_value), offsetof(JobRecord, wave_ends)};
    int count = (int)(sizeof(layout) / sizeof(layout[0]));
    for (int i = 0; i < count && i < words; i++) out[i] = layout[i];
    return count < words ? count : words;
}

/* What this library was built with, which the loader compares before using it: the constants of
 * gather_protocol.SHARED_CONSTANTS in its order, then the digest of this source; returns the words written. */
int engram_gather_protocol(int64_t *out, int words) {
    int64_t identity[] = {ENGRAM_MAX_WAVES, ENGRAM_MAX_THREADS, ENGRAM_TIMED_WAVES, ENGRAM_TIMELINE_WORDS,
                          ENGRAM_CHUNK_ROWS, ENGRAM_PREFETCH_DISTANCE, ENGRAM_MAX_REPLAYED, ENGRAM_SOURCE_DIGEST};
    int count = (int)(sizeof(identity) / sizeof(identity[0]));
    for (int i = 0; i < count && i < words; i++) out[i] = identity[i];
    return count < words ? count : words;
}

/* Test hook: the next job to start waits after its ids are ready until *latch != 0 (or timeout_ms). */
void engram_gather_hold_next(Service *s, const volatile uint32_t *latch, int64_t timeout_ms) {
    __atomic_store_n(&s->hold_timeout_ns, timeout_ms * 1000000, __ATOMIC_RELAXED);
    __atomic_store_n(&s->hold_latch, latch, __ATOMIC_RELEASE);
}

/* stats[0..3]: jobs done, holds released, holds timed out, flag waits that slept. */
void engram_gather_stats(Service *s, int64_t *out) {
    for (int i = 0; i < 4; i++) out[i] = __atomic_load_n(&s->stats[i], __ATOMIC_RELAXED);
}

/* The last finished job's timeline (see TIMELINE_WORDS) into out[0..words); returns TIMELINE_WORDS. */
int engram_gather_last_job(Service *s, int64_t *out, int words) {
    for (int i = 0; i < words && i < TIMELINE_WORDS; i++) out[i] = __atomic_load_n(&s->timeline[i], __ATOMIC_RELAXED);
    return TIMELINE_WORDS;
}

int engram_gather_threads(Service *s) { return s->threads; }

/* Stop every thread and free the service. Jobs not yet done are dropped, their words written (release_job):
 * a stream waiting on one of them goes on, and teardown's device synchronization cannot hang. With replayed
 * jobs registered the service is not freed: its watchdog answers every later replay until the process ends. */
void engram_gather_stop(Service *s) {
    if (s == NULL) return;
    pthread_mutex_lock(&s->lock);
    __atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&s->wake);
    pthread_mutex_unlock(&s->lock);
    for (int i = 0; i < s->started; i++) pthread_join(s->tids[i], NULL);
    for (Job *job = s->head; job != NULL;) {
        Job *next = job->next;
        release_job(job);
        free(job);
        job = next;
    }
    s->head = s->tail = NULL;
    pthread_mutex_lock(&s->lock);
    int keep = s->watchdog_started;
    pthread_mutex_unlock(&s->lock);
    if (keep) {
        __atomic_store_n(&s->team_gone, 1, __ATOMIC_RELEASE);
        return;
    }
    pthread_cond_destroy(&s->wake);
    pthread_mutex_destroy(&s->publish_lock);
    pthread_mutex_destroy(&s->lock);
    free(s);
}
