// kvflow's thread pool for the small steps' kernels (thread_pool.c says why and how).
#pragma once
#include <stdint.h>

#define POOL_CTX_BYTES 512      // a job's context, copied into the pool: no worker ever reads the caller's stack

// Computes chunk `chunk` of a job whose context is `ctx`, writing its output to `dst` (row stride `ld` floats);
// nonzero: it could not (out of memory)
typedef int (*pool_chunk_fn)(const void *ctx, int64_t chunk, float *dst, int64_t ld);

// Where chunk `chunk`'s output lies in the job's output: `rows` rows of `width` floats, `stride` floats apart,
// starting `offset` floats from the output's start.
typedef struct {
    int64_t offset, rows, width, stride;
} pool_region;
typedef pool_region (*pool_region_fn)(const void *ctx, int64_t chunk);

// The pool for this call, if `threads` > 1 and no other thread holds it (then pool_release() after pool_run);
// 0: run the call alone
int pool_acquire(int threads);
void pool_release(void);

// Runs chunks 0 .. chunks - 1 of `fn` on `threads` threads (the caller's one of them) into `out`, and returns once
// every chunk's output is in place; no worker touches `out` after that. Every chunk is computed by one thread
// alone, so the result is the same bits whatever the thread count, the chunks' order, or who computed which.
// Nonzero: a chunk failed.
int pool_run(pool_chunk_fn fn, pool_region_fn region, const void *ctx, int64_t ctx_bytes, int64_t chunks,
              float *out, int threads);

// Memory a job may read that outlives any call (a worker late from an earlier job may still read it): grow-only,
// one buffer per `slot`; what it held before is kept, never freed, when it grows.
void *pool_buffer(int slot, int64_t bytes);
enum { POOL_LINEAR_Q, POOL_LINEAR_D, POOL_LINEAR_S, POOL_LINEAR_QS, POOL_ATTN_Q, POOL_ATTN_TABLES, POOL_ATTN_ROWS,
       POOL_ATTN_POSITIONS, POOL_SLOTS };
