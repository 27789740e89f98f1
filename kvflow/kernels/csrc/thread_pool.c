// kvflow's own thread pool, for the kernels of small steps (a decode step's few rows).
//
// Why not OpenMP there: a step of a few rows is ~200 kernel calls of a few to a few hundred microseconds each.
// OpenMP's static split gives each thread its share and waits at a barrier, so a thread that the OS preempts (for
// the HTTP frontend, or another process) holds every call for a time slice: measured on 2-core Zen 5, embedded
// model in Q4_0, one stream, TPOT 13.0 ms on one thread, 12.3-85 ms on two, 375 ms on two beside a busy process.
// Small steps therefore ran on one thread.
//
// Here a call's work is cut into many small chunks taken from a shared counter, and the caller works too. Once
// the counter is spent, the caller takes back (computes itself) any chunk that a worker claimed and has not
// finished within a few chunk-times: a preempted worker delays nobody by more than that. Workers compute into
// their own scratch and commit it with one compare-and-swap, which fails when the chunk was taken back, so each
// output is written by exactly one thread; and a chunk is computed the same way whoever computes it, so the
// result is the same bits on any number of threads (batch invariance holds as it did).
//
// A worker late from an earlier job (preempted mid-chunk) reads only memory that outlives the call: the job's
// context is copied into the pool, its inputs sit in pool_buffer()s, weights and the KV cache live as long as the
// model (kvflow_pool_quiesce(), which the runner calls after every step, waits for such a worker before anything
// of a step can be freed); its commit fails, as chunk states and the claim counter carry the job's number.
// Idle workers spin a while (a step's next kernel comes within microseconds), then sleep on a futex.
#define _GNU_SOURCE
#include "thread_pool.h"

#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 63
enum { PENDING = 0, COMMITTING = 1, DONE = 2, TAKEN_BACK = 3 };

static struct {
    pthread_mutex_t lock;              // one caller at a time; a second one runs its call alone
    _Atomic uint32_t gen;              // 2 * job once job `job` is published; odd while it is written
    _Atomic uint64_t next;             // (job << 32) | the next unclaimed chunk
    _Atomic int sleepers;              // workers asleep on `gen`'s futex
    _Atomic int busy;                  // workers inside a job (kvflow_pool_quiesce waits for 0)
    // the published job, read by workers under `gen` (a seqlock: a copy made while gen changed is dropped)
    pool_chunk_fn fn;
    pool_region_fn region;
    float *out;
    int64_t chunks;
    int participants;
    _Atomic uint64_t *state;           // per chunk: (job << 2) | PENDING / COMMITTING / DONE / TAKEN_BACK
    int64_t state_cap;
    unsigned char ctx[POOL_CTX_BYTES];
    int workers;
    uint32_t job;
    int64_t spin_ns;
    _Atomic int stall_us;              // tests: a worker sleeps this long before committing each chunk
    void *buffers[POOL_SLOTS];
    int64_t buffer_bytes[POOL_SLOTS];
} P = {.lock = PTHREAD_MUTEX_INITIALIZER};

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline uint64_t state_of(uint32_t job, int st) { return ((uint64_t)job << 2) | (uint64_t)st; }

static void copy_region(float *out, pool_region r, const float *from) {
    for (int64_t i = 0; i < r.rows; i++)
        memcpy(out + r.offset + i * r.stride, from + i * r.width, (size_t)r.width * sizeof(float));
}

// the next published job after `seen`: spin for spin_ns, then sleep until the caller wakes us
static uint32_t wait_for_job(uint32_t seen) {
    int64_t since = now_ns();
    for (unsigned i = 1;; i++) {
        const uint32_t g = atomic_load_explicit(&P.gen, memory_order_acquire);
        if (g != seen && !(g & 1)) return g;
        _mm_pause();
        if ((i & 255) == 0 && !(g & 1) && now_ns() - since > P.spin_ns) {
            atomic_fetch_add(&P.sleepers, 1);
            if (atomic_load(&P.gen) == seen)
                syscall(SYS_futex, (uint32_t *)&P.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&P.sleepers, 1);
            since = now_ns();
        }
    }
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;             // 1 .. workers; the caller is 0
    float *scratch = NULL;
    int64_t scratch_cap = 0;
    unsigned char ctx[POOL_CTX_BYTES];
    uint32_t seen = 0;
    for (;;) {
        const uint32_t g = wait_for_job(seen);
        seen = g;
        atomic_fetch_add(&P.busy, 1);
        const pool_chunk_fn fn = P.fn;
        const pool_region_fn region = P.region;
        float *const out = P.out;
        const int64_t chunks = P.chunks;
        const int participants = P.participants;
        _Atomic uint64_t *const state = P.state;
        memcpy(ctx, P.ctx, sizeof ctx);
        atomic_thread_fence(memory_order_acquire);
        const uint32_t job = g >> 1;
        if (atomic_load_explicit(&P.gen, memory_order_relaxed) == g && id < participants) {
            for (;;) {
                uint64_t v = atomic_load_explicit(&P.next, memory_order_relaxed);
                if ((uint32_t)(v >> 32) != job || (int64_t)(v & 0xffffffffu) >= chunks) break;
                if (!atomic_compare_exchange_weak(&P.next, &v, v + 1)) continue;
                const int64_t c = (int64_t)(v & 0xffffffffu);
                const pool_region r = region(ctx, c);
                if (r.rows * r.width > scratch_cap) {
                    free(scratch);
                    scratch_cap = r.rows * r.width;
                    scratch = malloc((size_t)scratch_cap * sizeof(float));
                    if (!scratch) { scratch_cap = 0; continue; }    // left pending: the caller takes it back
                }
                if (fn(ctx, c, scratch, r.width)) continue;
                const int stall = atomic_load_explicit(&P.stall_us, memory_order_relaxed);
                if (stall) usleep((useconds_t)stall);
                uint64_t expect = state_of(job, PENDING);
                if (atomic_compare_exchange_strong(&state[c], &expect, state_of(job, COMMITTING))) {
                    copy_region(out, r, scratch);
                    atomic_store_explicit(&state[c], state_of(job, DONE), memory_order_release);
                }
            }
        }
        atomic_fetch_sub(&P.busy, 1);
    }
    return NULL;
}

static int ensure_workers(int n) {
    if (n > MAX_WORKERS) n = MAX_WORKERS;
    if (P.spin_ns == 0) {
        const char *spin = getenv("KVFLOW_POOL_SPIN_US");
        P.spin_ns = (spin ? atol(spin) : 100) * 1000;
        if (P.spin_ns <= 0) P.spin_ns = 1;
    }
    while (P.workers < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(P.workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        P.workers++;
    }
    return P.workers;
}

int pool_acquire(int threads) {
    return threads > 1 && pthread_mutex_trylock(&P.lock) == 0;
}

void pool_release(void) { pthread_mutex_unlock(&P.lock); }

void *pool_buffer(int slot, int64_t bytes) {
    if (bytes > P.buffer_bytes[slot]) {
        const int64_t want = bytes > 2 * P.buffer_bytes[slot] ? bytes : 2 * P.buffer_bytes[slot];
        void *p = malloc((size_t)want);
        if (!p) return NULL;
        P.buffers[slot] = p;            // the old buffer is kept: a late worker may still read it
        P.buffer_bytes[slot] = want;
    }
    return P.buffers[slot];
}

int pool_run(pool_chunk_fn fn, pool_region_fn region, const void *ctx, int64_t ctx_bytes, int64_t chunks,
             float *out, int threads) {
    const int participants = 1 + ensure_workers(threads - 1);
    if (chunks > P.state_cap) {
        const int64_t cap = chunks > 2 * P.state_cap ? chunks : 2 * P.state_cap;
        _Atomic uint64_t *grown = calloc((size_t)cap, sizeof(uint64_t));
        if (!grown) return 1;
        P.state = grown;                // the old array is kept, for the same reason as pool_buffer's
        P.state_cap = cap;
    }
    const uint32_t job = ++P.job & 0x7fffffffu;
    atomic_store(&P.gen, 2 * job - 1);                      // writing: workers wait
    atomic_thread_fence(memory_order_release);
    P.fn = fn;
    P.region = region;
    P.out = out;
    P.chunks = chunks;
    P.participants = participants;
    memcpy(P.ctx, ctx, (size_t)ctx_bytes);
    for (int64_t c = 0; c < chunks; c++) atomic_store_explicit(&P.state[c], state_of(job, PENDING),
                                                              memory_order_relaxed);
    atomic_store(&P.next, (uint64_t)job << 32);
    atomic_store(&P.gen, 2 * job);
    if (atomic_load(&P.sleepers) > 0) syscall(SYS_futex, (uint32_t *)&P.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL,
                                              NULL, 0);
    // the caller's share, straight into `out`
    int64_t mine = 0, spent = 0;
    int failed = 0;
    for (;;) {
        uint64_t v = atomic_load_explicit(&P.next, memory_order_relaxed);
        if ((int64_t)(v & 0xffffffffu) >= chunks) break;
        if (!atomic_compare_exchange_weak(&P.next, &v, v + 1)) continue;
        const int64_t c = (int64_t)(v & 0xffffffffu), t0 = now_ns();
        const pool_region r = region(ctx, c);
        failed |= fn(ctx, c, out + r.offset, r.stride);
        atomic_store_explicit(&P.state[c], state_of(job, DONE), memory_order_release);
        spent += now_ns() - t0;
        mine++;
    }
    // the workers' chunks: wait a few chunk-times for each, then take it back
    const int64_t patience = mine ? (3 * spent / mine > 5000 ? 3 * spent / mine : 5000) : 20000;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t since = now_ns();
        for (unsigned i = 0;; i++) {
            const uint64_t s = atomic_load_explicit(&P.state[c], memory_order_acquire);
            if ((s & 3) == DONE) break;
            if ((s & 3) == PENDING && (i & 15) == 15 && now_ns() - since > patience) {
                uint64_t expect = s;
                if (atomic_compare_exchange_strong(&P.state[c], &expect, state_of(job, TAKEN_BACK))) {
                    const pool_region r = region(ctx, c);
                    failed |= fn(ctx, c, out + r.offset, r.stride);
                    break;
                }
            }
            _mm_pause();
        }
    }
    return failed;
}

// Waits until no worker is inside a job: after it, nothing a finished call read can be read again.
void kvflow_pool_quiesce(void) {
    while (atomic_load(&P.busy) > 0) _mm_pause();
}

// Tests: workers sleep `us` microseconds before each commit, so the caller takes their chunks back.
void kvflow_pool_set_stall(int us) { atomic_store(&P.stall_us, us); }

int kvflow_pool_workers(void) { return P.workers; }
