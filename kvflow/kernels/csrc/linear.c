// kvflow's linear kernels (AVX2, and AVX-512 VNNI where the CPU has it): 4-, 5-, 6- and 8-bit group-quantized weights
// times float32 activations, one matrix a call (kvflow_x16_linear) or many of one stacked kind (kvflow_grouped_linear).
// The block kernels they drive are linear_x16_avx512.c's and linear_x16_avx2.c's; the other operations have files of
// their own (attention.c, norm.c, lora.c, moe.c, decoder_step.c).
//
// Why hand-written: on a CPU without native bf16 (AVX2, no AVX-512-BF16/AMX), torch 2.13's int4 and int8
// weight-only kernels dequantize every weight to float for every row and run at ~7 GFLOP/s a core, so a 4-bit
// model decodes no faster than float32 and a batch of 32 runs slower than MKL over float32 weights
// (docs/performance.md). These kernels do what llama.cpp does on such CPUs: quantize each row of activations to
// int8 per group of 32 (one float scale per group) and multiply integer by integer (vpmaddubsw), applying the
// weight's and the activation's scales once per group.
//
// Weights are repacked at load into one layout, "x16" (16 weight rows interleaved; described with its kernels
// below), which has a kernel for AVX-512 VNNI (vpdpbusd) and one for AVX2 (vpmaddubsw) giving the same bits. The
// codes: 4-bit 0..15 with value = code * d[n, g] + m[n, g] (GGUF Q4_0 / Q4_1 / Q4_K), 8-bit -128..127 with value
// = code * d[n, g] (Q8_0, re-rounded Q5_K), 5-bit 0..31 with value = (code - 16) * d[n, g] (Q5_0), summed in
// integers as sum(code * a) - 16 * sum(a): the same sums, so the same bits, as the 8-bit kernel on codes - 16, from
// 5/8 of the bytes; 6-bit 0..63 with an int8 multiplier per 16 columns, value = (code - 32) * sc[n, k / 16] *
// d[n, g / 8] (GGUF Q6_K exactly, as the file holds it: 6.5625 bits a weight).
// Activations x [M, K] float32, row-major; y [M, N] float32. K must be a multiple of 32.
// Scales d and minimums m, each in one of three forms (`flags` bits 0-1: d's, bits 2-3: m's; shapes as logical
// [N, G], held in layout x16's order), all widened to the same float32 values as they are read, so every form gives
// the same bits:
//   0  float32 [N, G]
//   1  fp16 [N, G], as GGUF stores Q4_0 / Q4_1 / Q8_0's d and m
//   2  two levels, as Q4_K stores them: uint8 multipliers [N, G] then fp16 super-scales [N, G / 8] (one per 8
//      groups: a block of 256), value = super * multiplier (exact in float32: 11 x 6 mantissa bits)
//   3  (d of 6-bit codes only) fp16 [N, G / 8], one per 8 groups, as Q6_K's d; the multipliers are in the codes
#include "common.h"

int kvflow_pool_rows(void) { return POOL_ROWS; }

int64_t x16_group_bytes[X16_MAX_BITS + 1];

// A weight format's code width and its bytes of one block of 16 rows over one group (kernels/formats.py registers
// every row of its table at load). 0; 2: a width the block kernels have no specialization for
int kvflow_x16_set_format(int bits, int64_t group_bytes) {
    if (bits < 1 || bits > X16_MAX_BITS || group_bytes <= 0) return 2;
    x16_group_bytes[bits] = group_bytes;
    return 0;
}

// A linear call on the pool: the weight is N / 16 blocks of 16 output columns (layout x16, below) of unit_bytes
// each, and chunk c is blocks [c * per, (c + 1) * per) (chunk_units)
typedef struct {
    int bits;
    const uint8_t *codes;
    scales_t sd, sm;
    int64_t G, K, M, N, unit_bytes, per;
    const int8_t *q;
    const float *d, *s;
    const int32_t *qs;
} linear_job;

static inline int64_t job_units(const linear_job *j, int64_t c, int64_t *u0) {
    const int64_t units = j->N / X16;
    *u0 = c * j->per;
    return (*u0 + j->per < units ? *u0 + j->per : units) - *u0;
}

static pool_region linear_region(const void *ctx, int64_t c) {
    const linear_job *j = ctx;
    int64_t u0;
    const int64_t n = job_units(j, c, &u0);
    return (pool_region){u0 * X16, j->M, n * X16, j->N};
}

// units of unit_bytes per chunk for a call over `units` of them on `threads`
static inline int64_t chunk_units(int64_t units, int64_t unit_bytes, int threads) {
    int64_t bytes = units * unit_bytes / (threads * CHUNKS_PER_THREAD);
    bytes = bytes < CHUNK_MIN_BYTES ? CHUNK_MIN_BYTES : bytes > CHUNK_MAX_BYTES ? CHUNK_MAX_BYTES : bytes;
    return bytes / unit_bytes > 1 ? bytes / unit_bytes : 1;
}

// x's activations, then `chunk` over the weight's units, on the pool; the caller holds it (pool_acquire)
static int pool_linear(pool_chunk_fn chunk, int bits, const float *x, int64_t M, int64_t K, const uint8_t *codes,
                       const void *wd, const void *wm, int64_t N, float *y, int threads, int flags,
                       int64_t unit_bytes) {
    const int64_t G = K / QK;
    int8_t *q;
    float *d, *s;
    int32_t *qs;
    int failed = pool_activations(x, M, K, &q, &d, &s, &qs);
    if (!failed) {
        const int64_t units = N / X16, per = chunk_units(units, unit_bytes, threads);
        const scales_t sd = scales_of(wd, flags & 3, N, G);
        const linear_job job = {bits, codes, sd, minimums_of(wm, (flags >> 2) & 3, sd, N, G),
                                G, K, M, N, unit_bytes, per, q, d, s, qs};
        failed = pool_run(chunk, linear_region, &job, sizeof job, (units + per - 1) / per, y, threads);
    }
    pool_release();
    return failed;
}

// ---- Layout "x16": 16 weight rows interleaved, on AVX-512 VNNI (vpdpbusd) or AVX2 (vpmaddubsw) ---------------
//
// Layout "x16" (each weight format's `pack` in kernels/formats.py): weight rows in blocks of 16 (N padded to a
// multiple of 16); for block b and group g, 32 codes x 16 rows as 8 "quads" of 4 consecutive columns, each quad a
// 64-byte register of 16 rows x 4 bytes, which is what vpdpbusd multiplies by 4 activation bytes broadcast to
// every lane.
//   4-bit: [N/16, G, 4, 64] bytes; register c (0..3) holds quad c in its low nibbles and quad c + 4 in its high
//          ones; value = code * d + m
//   8-bit: [N/16, G, 8, 64] bytes holding code + 128 (vpdpbusd wants its weight operand unsigned); the extra
//          128 * sum(activation codes) is subtracted in integers, exactly
//   5-bit: [N/16, G, 5, 64] bytes: registers 0..3 the nibbles as 4-bit's, register 4 the fifth bits (bit c of
//          a byte: that row's and column's bit in quad c); code 0..31, value = (code - 16) * d, the extra 16 *
//          sum(activation codes) subtracted in integers (the 8-bit kernel's sums on codes - 16, exactly)
//   6-bit: [N/16, G, 416] bytes: registers 0..3 the low nibbles as 4-bit's, register 4 the top two bits of quads
//          0..3 (bits 2c, 2c + 1 of a byte: that row's and column's in quad c), register 5 those of quads 4..7,
//          then 32 int8 multipliers: the 16 rows' for columns 0..15 of the group, then for columns 16..31; the
//          integer dot of a group is sc0 * (sum over columns 0..15 of code * a - 32 * their sum(a)) + sc1 * (the
//          same over 16..31), exact in int32 (<= 2 x 128 x 16 x 32 x 127)
//   scales and minimums: [N/16, G, 16] float32 or fp16, or uint8 [N/16, G, 16] then fp16 [N/16, G/8, 16] (forms
//   as above); the 6-bit codes' d fp16 [N/16, G/8, 16]
// Each output is sum over groups, in order, of float(integer dot) * (d_w * d_x) by one FMA per group (+ the
// minimum's term), whatever the number of rows, their block, or the thread count: batch invariant. The integer dot
// of a group is exact on both instruction sets, so AVX2 gives AVX-512's bits: one block kernel per ISA
// (block_x16_avx512, block_x16_avx2), chosen once per process (kvflow_x16_use_avx512) and called through
// `x16_block`, so the drivers below hold no AVX-512 instruction and run on an AVX2-only CPU.
static x16_block_fn x16_block = block_x16_avx2;

// The x16 kernels' instruction set from now on: AVX-512 VNNI (nonzero) or AVX2 (0). kernels/build.py's isa() decides,
// once per process, before any call; both give the same bits.
void kvflow_x16_use_avx512(int yes) { x16_block = yes ? block_x16_avx512 : block_x16_avx2; }

// rows m0 .. m1 - 1 of the activations times one block of a weight (its codes at w, its scales from element `at`),
// ROWS_X16 rows a pass, into columns n0 .. n0 + 15 of y (row stride ld)
static void x16_rows(int bits, const uint8_t *w, scales_t sd, scales_t sm, int64_t at, int64_t G, const int8_t *q,
                     const float *d, const float *s, const int32_t *qs, int64_t K, int64_t m0, int64_t m1, float *y,
                     int64_t ld, int64_t n0) {
    int64_t m = m0;
    for (; m + ROWS_X16 <= m1; m += ROWS_X16) x16_block(bits, ROWS_X16, w, sd, sm, at, G, q, d, s, qs, K, m, y, ld, n0);
    if (m < m1) x16_block(bits, (int)(m1 - m), w, sd, sm, at, G, q, d, s, qs, K, m, y, ld, n0);
}

static int linear_x16_chunk(const void *ctx, int64_t c, float *dst, int64_t ld) {
    const linear_job *j = ctx;
    int64_t b0;
    const int64_t count = job_units(j, c, &b0);
    for (int64_t b = b0; b < b0 + count; b++)
        x16_rows(j->bits, j->codes + b * j->unit_bytes, j->sd, j->sm, b * j->G * X16, j->G, j->q, j->d, j->s, j->qs,
                 j->K, 0, j->M, dst, ld, (b - b0) * X16);
    return 0;
}

// `on_pool`: the call may run on kvflow's pool (calls of up to POOL_ROWS rows), else on OpenMP's threads whatever its
// rows. Where a step's other calls run on OpenMP's threads, so must its small ones: an OpenMP worker spins for a
// while after each region, and on 2 cores a pool worker beside it gets no core (a MoE step of 32 rows with its
// experts' small calls on the pool: 20% of its time in libgomp's spin, measured).
int kvflow_x16_linear(int bits, const float *x, int64_t M, int64_t K, const uint8_t *codes, const void *wd,
                      const void *wm, int64_t N, float *y, int threads, int flags, int on_pool) {
    if (bits < 1 || bits > X16_MAX_BITS || !x16_group_bytes[bits]) return 2;
    const int64_t G = K / QK, blocks = N / X16;
    const int64_t unit_bytes = block_bytes(bits, G);
    if (on_pool && M <= POOL_ROWS && pool_acquire(threads))
        return pool_linear(linear_x16_chunk, bits, x, M, K, codes, wd, wm, N, y, threads, flags, unit_bytes);
    int8_t *q = NULL;
    float *d = NULL, *s = NULL;
    int32_t *qs = NULL;
    if (own_activations(x, M, K, threads, &q, &d, &s, &qs)) {
        free_activations(q, d, s, qs);
        return 1;
    }
    const scales_t sd = scales_of(wd, flags & 3, N, G), sm = minimums_of(wm, (flags >> 2) & 3, sd, N, G);
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        const int64_t m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t b = 0; b < blocks; b++)
            x16_rows(bits, codes + b * unit_bytes, sd, sm, b * G * X16, G, q, d, s, qs, K, m0, m1, y, N, b * X16);
    }
    free_activations(q, d, s, qs);
    return 0;
}

// Matrices of one stacked kind (a mixture-of-experts layer's experts), each multiplying its own run of rows, in one
// pool job. A small step's experts are many small matmuls (at one row, 8 experts of 0.6 MB each, twice a layer), and
// one pool call each paid the hand-over and a split too fine to pay for it: ~40 us an expert on 2 threads, close to
// one thread's time. Group i multiplies rows row0_i .. row0_i + rows[i] - 1 of x [M, K] (row0_i: the rows of the
// groups before it) by matrix matrix[i] (its codes at codes + matrix[i] * codes_stride bytes, its scales and
// minimums likewise) into the same rows of y [M, N]. The activations are rounded and the blocks multiplied as
// linear_x16 does (per row, x16_block): the same bits as one call per group, whatever the grouping.
// The job's whole description is in its context (no table in a pool buffer that the next job could rewrite under
// a late worker): at most KVFLOW_GROUPED_MAX groups.

typedef struct {
    const uint8_t *codes, *d, *m;
    int64_t codes_stride, d_stride, m_stride;
    const int8_t *q;
    const float *qd, *qsum;
    const int32_t *qs;
    int32_t bits, flags, K, N, per, per_group, groups;
    uint16_t matrix[KVFLOW_GROUPED_MAX];
    uint8_t rows[KVFLOW_GROUPED_MAX];
} grouped_job;

// chunk c: group g's blocks [u0, u0 + units), its rows from row0
static void grouped_chunk_at(const grouped_job *j, int64_t c, int64_t *g, int64_t *row0, int64_t *u0,
                             int64_t *units) {
    *g = c / j->per_group;
    int64_t r = 0;
    for (int64_t i = 0; i < *g; i++) r += j->rows[i];
    *row0 = r;
    *u0 = (c % j->per_group) * j->per;
    const int64_t all = j->N / X16;
    *units = (*u0 + j->per < all ? *u0 + j->per : all) - *u0;
}

static pool_region grouped_region(const void *ctx, int64_t c) {
    const grouped_job *j = ctx;
    int64_t g, row0, u0, units;
    grouped_chunk_at(j, c, &g, &row0, &u0, &units);
    return (pool_region){row0 * j->N + u0 * X16, j->rows[g], units * X16, j->N};
}

static int grouped_chunk(const void *ctx, int64_t c, float *dst, int64_t ld) {
    const grouped_job *j = ctx;
    int64_t g, row0, u0, units;
    grouped_chunk_at(j, c, &g, &row0, &u0, &units);
    const int64_t K = j->K, N = j->N, G = K / QK, e = j->matrix[g], rows = j->rows[g];
    const int64_t unit_bytes = block_bytes(j->bits, G);
    const scales_t sd = scales_of(j->d + e * j->d_stride, j->flags & 3, N, G);
    const scales_t sm = minimums_of(j->m ? j->m + e * j->m_stride : NULL, (j->flags >> 2) & 3, sd, N, G);
    const int8_t *q = j->q + row0 * K;
    const float *qd = j->qd + row0 * G, *qsum = j->qsum + row0 * G;
    const int32_t *qs = j->qs + row0 * 2 * G;
    for (int64_t b = u0; b < u0 + units; b++)
        x16_rows(j->bits, j->codes + e * j->codes_stride + b * unit_bytes, sd, sm, b * G * X16, G, q, qd, qsum, qs, K,
                 0, rows, dst, ld, (b - u0) * X16);
    return 0;
}

// `on_pool`: on kvflow's pool, else on OpenMP's threads (kvflow_x16_linear says when each). 0; 1: out of memory;
// -1: not taken (more than KVFLOW_GROUPED_MAX groups, a group over 255 rows, one thread, or the pool held
// elsewhere): make one call per group
int kvflow_grouped_linear(int bits, const float *x, int64_t M, int64_t K, const int64_t *matrix, const int64_t *rows,
                          int64_t groups, const uint8_t *codes, int64_t codes_stride, const void *d, int64_t d_stride,
                          const void *m, int64_t m_stride, int flags, int64_t N, float *y, int threads, int on_pool) {
    if (bits < 1 || bits > X16_MAX_BITS || !x16_group_bytes[bits]) return 2;
    if (groups > KVFLOW_GROUPED_MAX || threads <= 1) return -1;
    for (int64_t i = 0; i < groups; i++)
        if (rows[i] > 255 || matrix[i] > 65535) return -1;
    if (on_pool && !pool_acquire(threads)) return -1;
    const int64_t G = K / QK;
    int8_t *q = NULL;
    float *qd = NULL, *qsum = NULL;
    int32_t *qs = NULL;
    int failed = on_pool ? pool_activations(x, M, K, &q, &qd, &qsum, &qs)
                         : own_activations(x, M, K, threads, &q, &qd, &qsum, &qs);
    if (!failed) {
        const int64_t unit_bytes = block_bytes(bits, G), units = N / X16;
        // the split of one call over all the groups' blocks, no chunk across two groups
        const int64_t per = chunk_units(units * groups, unit_bytes, threads), per_group = (units + per - 1) / per;
        grouped_job job = {codes, d, m, codes_stride, d_stride, m_stride, q, qd, qsum, qs,
                           bits, flags, (int32_t)K, (int32_t)N, (int32_t)per, (int32_t)per_group, (int32_t)groups,
                           {0}, {0}};
        for (int64_t i = 0; i < groups; i++) {
            job.matrix[i] = (uint16_t)matrix[i];
            job.rows[i] = (uint8_t)rows[i];
        }
        if (on_pool) {
            failed = pool_run(grouped_chunk, grouped_region, &job, sizeof job, groups * per_group, y, threads);
        } else {
            #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
            for (int64_t c = 0; c < groups * per_group; c++) {
                const pool_region r = grouped_region(&job, c);
                grouped_chunk(&job, c, y + r.offset, r.stride);
            }
        }
    }
    if (on_pool) {
        pool_release();
    } else {
        free_activations(q, qd, qsum, qs);
    }
    return failed;
}

_Static_assert(sizeof(linear_job) <= POOL_CTX_BYTES && sizeof(grouped_job) <= POOL_CTX_BYTES,
               "a pool job's context must fit the pool's copy");
