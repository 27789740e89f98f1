// kvflow's CPU kernels (AVX2, and AVX-512 VNNI where the CPU has it): 4-, 5-, 6- and 8-bit group-quantized weights
// times float32 activations; paged attention, RMSNorm and LoRA terms.
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
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear_kernels.h"
#include "thread_pool.h"

#define QK 32
#define X16 16          // weight rows per block of the layout ("x16", below)
#define ROW_BLOCK 64      // rows of activations per pass over the weights: their int8 copy stays in L2
// Calls of up to this many rows (a decode step's) run on kvflow's thread pool (thread_pool.c says why), bigger ones
// on OpenMP's threads; every kernel gives the same bits either way. runner/kernel_plan.py's SMALL_STEP_ROWS is the same number.
#define POOL_ROWS 8
// Weight bytes per pool chunk: CHUNKS_PER_THREAD chunks for each thread of a call, within [CHUNK_MIN_BYTES,
// CHUNK_MAX_BYTES]. Each chunk costs a claim on the shared counter, state changes whose cache lines move between the
// cores, and a fresh DRAM stream (~0.3 us in all): with a fixed 16 KiB (~1 us of DRAM reads for a thread), a batch-1
// step's 120 matmuls of the embedded model ran at ~20 GB/s on two threads, no faster than on one; at 4 chunks a
// thread, 26-30 GB/s, and the offline batch-1 token 7.0-7.6 -> 5.0-5.5 ms (Zen 4, 2 cores, 2026-12-06). 2 chunks a
// thread were as fast alone but slower beside a busy core (a preempted worker's chunk is a bigger share of the
// call: 7.2-8.4 against 6.8-7.3 ms).
#define CHUNK_MIN_BYTES 16384
#define CHUNK_MAX_BYTES 262144
#define CHUNKS_PER_THREAD 4

int kvflow_pool_rows(void) { return POOL_ROWS; }

// x [M, K] -> int8 codes q [M, K], scale d [M, G] and d * sum(codes) s [M, G] per group of 32, and (if qs is not
// NULL) the sums of the codes, qs [M, 2 G]: a row's G groups' sums, then the sums of their first 16 codes (the 6-bit
// kernel's multipliers are per 16 columns); group_sum / first_half_sum read them
static void quantize_activations(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s, int32_t *qs,
                                 int threads) {
    const int64_t groups = M * (K / QK);
    #pragma omp parallel for schedule(static) num_threads(threads) if (groups >= 1024)
    for (int64_t i = 0; i < groups; i++) {
        const float *xg = x + i * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {         // (not fmaxf: GCC calls libm's for it, one call a value)
            const float a = fabsf(xg[j]);
            amax = a > amax ? a : amax;
        }
        const float dg = amax / 127.0f, inv = dg > 0.0f ? 1.0f / dg : 0.0f;
        int half[2];
        for (int h = 0; h < 2; h++) {          // two plain loops of 16: each vectorizes (one indexed sum did not)
            int sum = 0;
            for (int j = h * QK / 2; j < (h + 1) * QK / 2; j++) {
                const int v = (int)nearbyintf(xg[j] * inv);
                q[i * QK + j] = (int8_t)v;
                sum += v;
            }
            half[h] = sum;
        }
        d[i] = dg;
        s[i] = dg * (float)(half[0] + half[1]);
        if (qs) {
            const int64_t row = i / (K / QK), g = i % (K / QK);
            qs[row * 2 * (K / QK) + g] = half[0] + half[1];
            qs[row * 2 * (K / QK) + K / QK + g] = half[0];
        }
    }
}

typedef struct {
    const void *p;              // float32, fp16, or the uint8 multipliers
    const uint16_t *super;      // form 2: the fp16 super-scales, after the N * G multipliers
    int form;
    int minus8;                 // a minimum of form 3: -8 times these scales (which are d's)
} scales_t;

static inline scales_t scales_of(const void *p, int form, int64_t N, int64_t G) {
    scales_t s = {p, form == 2 ? (const uint16_t *)((const uint8_t *)p + N * G) : NULL, form, 0};
    return s;
}

// A 4-bit matrix's minimums: stored in one of the scales' forms, or (form 3) not stored because every one is -8
// times its group's d (GGUF Q4_0: code * d - 8d): then read as d's, times -8. A power of two, so the same float32
// values as stored ones, and 2 bytes a group (10% of a Q4_0 matrix) less to stream.
static inline scales_t minimums_of(const void *p, int form, scales_t d, int64_t N, int64_t G) {
    if (form != 3) return scales_of(p, form, N, G);
    d.minus8 = 1;
    return d;
}

static inline float hsum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

static inline float hmax(__m256 v) {
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    r = _mm_max_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
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

// x [M, K] rounded as pool_activations does, into buffers of the caller's own (free_activations after); threads:
// OpenMP's, for big calls; 1: out of memory
static int own_activations(const float *x, int64_t M, int64_t K, int threads, int8_t **q, float **d, float **s,
                           int32_t **qs) {
    const int64_t G = K / QK;
    *q = malloc((size_t)(M * K));
    *d = malloc((size_t)(M * G) * sizeof(float));
    *s = malloc((size_t)(M * G) * sizeof(float));
    *qs = malloc((size_t)(2 * M * G) * sizeof(int32_t));
    if (!*q || !*d || !*s || !*qs) return 1;
    quantize_activations(x, M, K, *q, *d, *s, *qs, threads);
    return 0;
}

static void free_activations(int8_t *q, float *d, float *s, int32_t *qs) {
    free(q); free(d); free(s); free(qs);
}

// x [M, K] rounded to int8 codes per group of QK (quantize_activations) into the pool's buffers (a worker late from
// this call may still read them); 1: out of memory
static int pool_activations(const float *x, int64_t M, int64_t K, int8_t **q, float **d, float **s, int32_t **qs) {
    const int64_t G = K / QK;
    *q = pool_buffer(POOL_LINEAR_Q, M * K);
    *d = pool_buffer(POOL_LINEAR_D, M * G * (int64_t)sizeof(float));
    *s = pool_buffer(POOL_LINEAR_S, M * G * (int64_t)sizeof(float));
    *qs = pool_buffer(POOL_LINEAR_QS, 2 * M * G * (int64_t)sizeof(int32_t));
    if (!*q || !*d || !*s || !*qs) return 1;
    quantize_activations(x, M, K, *q, *d, *s, *qs, 1);
    return 0;
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

// e^x for x <= 0 (scores minus their maximum), 8 lanes: Cephes' expf polynomial, ~1 ulp; results below
// 2^-126 flush to 2^-126 (x is clamped at -87.3), which no softmax sum notices.
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Paged attention straight from the KV cache (no gathered copy of the context), in tiles (attend_tile, below):
//   q [T, Hq, D]; caches [blocks, block_size, Hkv, D]; query row t belongs to sequence row_seq[t], whose block
//   table is tables[row_seq[t], :width], and attends to keys 0..positions[t] (causal; its own key was stored
//   before the call); out [T, Hq, D]. Query heads h * G .. h * G + G - 1 share KV head h (G = Hq / Hkv).
// Each row's sums run over its own keys in one fixed order, whatever else is in the step, however its
// sequence was chunked, and on however many threads: the result of a row depends on that row's inputs only
// (batch invariance). D must be a multiple of 8 and at most 256. `window` > 0 (a sliding-window layer): the row
// attends to keys positions[t] - window + 1 .. positions[t] only (the cache still holds the older ones).
// The cache's element forms (native_kernels.py's _KV_FORMS): what a row of D values is in memory.
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_INT8 = 3, KV_FP8 = 4 };

// float8 e4m3fn's 256 values as floats (sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7f/0xff are NaN)
static float fp8_values[256];
static void fill_fp8_values(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        if (e == 15 && m == 7) v = NAN;
        fp8_values[b] = b & 128 ? -v : v;
    }
}

// a row's bytes: int8 rows are D codes and then their float32 scale (layers/kv_int8.py)
static inline int64_t kv_row_bytes(int form, int64_t D) {
    return form == KV_F32 ? 4 * D : form == KV_INT8 ? D + 4 : form == KV_FP8 ? D : 2 * D;
}

// 8 values at element d of a row as floats: float32; bfloat16 (its bits are the top half of a float32's); float16
// (F16C); int8 codes (the row's scale is applied by the caller, once per dot product); float8 e4m3 (by table)
static inline __m256 load8(const char *row, int64_t d, int form) {
    switch (form) {
    case KV_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d))), 16));
    case KV_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
    case KV_INT8:
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d))));
    case KV_FP8:
        return _mm256_i32gather_ps(fp8_values, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + d))), 4);
    default:
        return _mm256_loadu_ps((const float *)row + d);
    }
}

// the factor every value of a row is multiplied by: its scale for int8 rows, else 1
static inline float row_scale(const char *row, int64_t D, int form) {
    float s = 1.0f;
    if (form == KV_INT8) memcpy(&s, row + D, sizeof s);
    return s;
}

typedef struct {
    const float *q;
    int64_t T, Hq, Hkv, D;
    const void *k_cache, *v_cache;
    int64_t block_size;
    const int64_t *tables, *row_seq, *positions;
    int64_t width;
    float scale;
    int form;
    int64_t window;
} attention_job;

// Attention in tiles, flash-decoding style: a tile is up to TILE_ROWS consecutive query rows of one sequence and
// one KV head h, so R rows x G heads = n query vectors. Its keys go by in groups of KEYS positions aligned to
// multiples of KEYS (0..15, 16..31, ..): each group's K and V rows are converted to float32 once into the scratch
// and then read by every query vector of the tile, which keeps a running max m, sum l and output acc (online
// softmax). A long prefill chunk thus reads its context once per tile, not once per row and head.
// Batch invariance: a query vector's arithmetic depends only on its own q, its own key range and the cache: groups
// are aligned to absolute positions, each score is a fixed-order dot product, keys outside the vector's range are
// skipped, not masked. So a row gives the same bits alone (decode, a tile of 1) as in any tile of any step.
#define KEYS 64
#define TILE_ROWS 16

// the scratch a tile needs, in floats: K (transposed: [D][KEYS], and as staged: [KEYS][D]) and V ([KEYS][D]) of one
// group, the scores
// [n][KEYS], then per query vector acc [D], m, l
static inline int64_t tile_floats(int64_t G, int64_t D) {
    return 3 * KEYS * D + TILE_ROWS * G * KEYS + TILE_ROWS * G * (D + 2);
}

// row j of a cache as D floats into dst [D] (int8: code * the row's scale)
static inline void stage_row(const char *row, int64_t D, int form, float *dst) {
    const __m256 s = _mm256_set1_ps(row_scale(row, D, form));
    for (int64_t c = 0; c < D; c += 8)
        _mm256_storeu_ps(dst + c, form == KV_INT8 ? _mm256_mul_ps(load8(row, c, form), s) : load8(row, c, form));
}

// kt [D][KEYS] columns k0 .. k0 + 7 = rows k0 .. k0 + 7 of kf [KEYS][D], 8 x 8 floats at a time
static inline void transpose_keys(const float *kf, int64_t D, int64_t k0, float *kt) {
    for (int64_t c = 0; c < D; c += 8) {
        __m256 r[8], t[8];
        for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(kf + (k0 + i) * D + c);
        for (int i = 0; i < 8; i += 2) {
            t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
            t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
            r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
            r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
            r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
            r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
        }
        // r[0..3]: dims c+0, c+1, c+2, c+3 of keys 0..3 (low half) and dims c+4.. (high half); r[4..7]: keys 4..7
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_ps(kt + (c + i) * KEYS + k0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
            _mm256_storeu_ps(kt + (c + i + 4) * KEYS + k0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
        }
    }
}

// scores of M (<= 4) query vectors qs[0 .. M) against keys k0 .. k0 + 15 of the group, each score one lane summed
// over d = 0 .. D - 1 in order; always inlined with constant M and D, so the accumulators stay in registers
static inline __attribute__((always_inline)) void scores_4x16(const float *const *qs, int M, int64_t D,
                                                             const float *kt, int64_t k0, float scale,
                                                             float *const *out) {
    __m256 acc[4][2];
    for (int v = 0; v < M; v++) acc[v][0] = acc[v][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 a0 = _mm256_loadu_ps(kt + d * KEYS + k0), a1 = _mm256_loadu_ps(kt + d * KEYS + k0 + 8);
        for (int v = 0; v < M; v++) {
            const __m256 b = _mm256_broadcast_ss(qs[v] + d);
            acc[v][0] = _mm256_fmadd_ps(b, a0, acc[v][0]);
            acc[v][1] = _mm256_fmadd_ps(b, a1, acc[v][1]);
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int v = 0; v < M; v++) {
        _mm256_storeu_ps(out[v] + k0, _mm256_mul_ps(acc[v][0], sc));
        _mm256_storeu_ps(out[v] + k0 + 8, _mm256_mul_ps(acc[v][1], sc));
    }
}

// BODY(M, D) with M = m (1..4) and D each a compile-time constant where they are the common values (head dims 64
// and 128), so the always-inlined micro-kernels keep their accumulators in registers
#define WITH_CONSTANT_M_AND_D(BODY)                                                                          \
    do {                                                                                                     \
        if (D == 64) {                                                                                       \
            if (m == 4) BODY(4, 64); else if (m == 3) BODY(3, 64); else if (m == 2) BODY(2, 64); else BODY(1, 64); \
        } else if (D == 128) {                                                                               \
            if (m == 4) BODY(4, 128); else if (m == 3) BODY(3, 128); else if (m == 2) BODY(2, 128);          \
            else BODY(1, 128);                                                                               \
        } else {                                                                                             \
            if (m == 4) BODY(4, D); else if (m == 3) BODY(3, D); else if (m == 2) BODY(2, D); else BODY(1, D); \
        }                                                                                                    \
    } while (0)

#define SCORES_FOR(M, D) for (int64_t k0 = 0; k0 < keys; k0 += 16) scores_4x16(qs + v0, M, D, kt, k0, scale, out + v0)

// scores out[v][0 .. keys) = scale * qs[v] . k_j for n query vectors and the group's first `keys` keys
static void group_scores(const float *const *qs, int64_t n, int64_t D, const float *kt, int64_t keys, float scale,
                         float *const *out) {
    for (int64_t v0 = 0; v0 < n; v0 += 4) {
        const int64_t m = n - v0 < 4 ? n - v0 : 4;
        WITH_CONSTANT_M_AND_D(SCORES_FOR);
    }
}

// for M (<= 4) query vectors with one key range [from, to): acc_v [D] = acc_v * alpha_v + sum over j of
// p_v[j] * v[j], 16 dimensions at a time (V rows read once for the M vectors); each lane sums over j in order,
// whatever M is. Always inlined with constant M and D.
static inline __attribute__((always_inline)) void values_4x16(float *const *acc, const float *alpha,
                                                             const float *const *p, int M, int64_t D,
                                                             const float *vf, int64_t from, int64_t to) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        // 16 dimensions, or the last 8 where D is an odd multiple of 8 (each lane's arithmetic is the same either way)
        const int halves = d0 + 16 <= D ? 2 : 1;
        __m256 o[4][2];
        for (int v = 0; v < M; v++) {
            const __m256 r = _mm256_set1_ps(alpha[v]);
            for (int u = 0; u < halves; u++) o[v][u] = _mm256_mul_ps(_mm256_loadu_ps(acc[v] + d0 + 8 * u), r);
        }
        for (int64_t j = from; j < to; j++) {
            const __m256 a0 = _mm256_loadu_ps(vf + j * D + d0);
            const __m256 a1 = halves == 2 ? _mm256_loadu_ps(vf + j * D + d0 + 8) : a0;
            for (int v = 0; v < M; v++) {
                const __m256 w = _mm256_broadcast_ss(p[v] + j);
                o[v][0] = _mm256_fmadd_ps(w, a0, o[v][0]);
                if (halves == 2) o[v][1] = _mm256_fmadd_ps(w, a1, o[v][1]);
            }
        }
        for (int v = 0; v < M; v++)
            for (int u = 0; u < halves; u++) _mm256_storeu_ps(acc[v] + d0 + 8 * u, o[v][u]);
    }
}

#define VALUES_FOR(M, D) values_4x16(acc + v0, alpha + v0, p + v0, M, D, vf, from, to)

static void group_values(float *const *acc, const float *alpha, const float *const *p, int64_t n, int64_t D,
                         const float *vf, int64_t from, int64_t to) {
    for (int64_t v0 = 0; v0 < n; v0 += 4) {
        const int64_t m = n - v0 < 4 ? n - v0 : 4;
        WITH_CONSTANT_M_AND_D(VALUES_FOR);
    }
}

// rows t0 .. t0 + R - 1 (one sequence) with KV head h; their outputs at out + (t * Hq + h * G) * D
static void attend_tile(const attention_job *a, int64_t t0, int64_t R, int64_t h, float *scratch, float *out) {
    const int64_t G = a->Hq / a->Hkv, D = a->D, V = D / 8, Hkv = a->Hkv, bs = a->block_size, n = R * G;
    const int64_t *table = a->tables + a->row_seq[t0] * a->width, row_bytes = kv_row_bytes(a->form, D);
    float *kt = scratch, *kf = kt + KEYS * D, *vf = kf + KEYS * D, *scores = vf + KEYS * D;
    float *state = scores + TILE_ROWS * G * KEYS;
    int64_t first[TILE_ROWS], end[TILE_ROWS], lo = INT64_MAX, hi = 0;
    for (int64_t r = 0; r < R; r++) {
        end[r] = a->positions[t0 + r] + 1;
        first[r] = a->window > 0 && end[r] > a->window ? end[r] - a->window : 0;
        lo = first[r] < lo ? first[r] : lo;
        hi = end[r] > hi ? end[r] : hi;
    }
    for (int64_t v = 0; v < n; v++) {
        float *st = state + v * (D + 2);
        memset(st, 0, (size_t)D * sizeof(float));
        st[D] = -INFINITY, st[D + 1] = 0.0f;
    }
    // the tile's query vectors: row t's G heads of KV head h are consecutive in q, rows Hq * D apart
    const float *qs[TILE_ROWS * 32];
    float *outs[TILE_ROWS * 32];
    for (int64_t v = 0; v < n; v++) {
        qs[v] = a->q + ((t0 + v / G) * a->Hq + h * G + v % G) * D;
        outs[v] = scores + v * KEYS;
    }
    const char *keys = a->k_cache, *values = a->v_cache;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t g0 = lo / KEYS * KEYS; g0 < hi; g0 += KEYS) {
        const int64_t j0 = g0 > lo ? g0 : lo, j1 = g0 + KEYS < hi ? g0 + KEYS : hi;
        // outside [j0, j1): zeros (read into scores no query vector uses)
        if (j0 > g0) memset(kf, 0, (size_t)((j0 - g0) * D) * sizeof(float));
        if (j1 < g0 + KEYS) memset(kf + (j1 - g0) * D, 0, (size_t)((g0 + KEYS - j1) * D) * sizeof(float));
        for (int64_t j = j0; j < j1; j++) {
            const int64_t at = ((table[j / bs] * bs + j % bs) * Hkv + h) * row_bytes;
            stage_row(keys + at, D, a->form, kf + (j - g0) * D);
            stage_row(values + at, D, a->form, vf + (j - g0) * D);
        }
        for (int64_t k0 = (j0 - g0) / 8 * 8; k0 < j1 - g0; k0 += 8) transpose_keys(kf, D, k0, kt);
        group_scores(qs, n, D, kt, (j1 - g0 + 15) / 16 * 16, a->scale, outs);
        for (int64_t r = 0; r < R; r++) {
            const int64_t from = first[r] > g0 ? first[r] : g0, to = end[r] < g0 + KEYS ? end[r] : g0 + KEYS;
            if (from >= to) continue;
            float *accs[32], alphas[32];
            const float *probs[32];
            for (int64_t g = 0; g < G; g++) {
                float *st = state + (r * G + g) * (D + 2), *score = scores + (r * G + g) * KEYS;
                __m256 most = _mm256_set1_ps(st[D]);
                int64_t j = from;
                for (; j + 8 <= to; j += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(score + j - g0));
                float top = hmax(most);
                for (; j < to; j++) top = fmaxf(top, score[j - g0]);
                // exp(score - m_new) for the keys in [from, to), zero elsewhere; exp(m_old - m_new)
                __m256 sum = _mm256_setzero_ps();
                const __m256 m = _mm256_set1_ps(top);
                for (int64_t k0 = (from - g0) / 8 * 8; k0 < to - g0; k0 += 8) {
                    const __m256i k = _mm256_add_epi32(lane, _mm256_set1_epi32((int)(g0 + k0)));
                    const __m256 inside = _mm256_castsi256_ps(_mm256_and_si256(
                        _mm256_cmpgt_epi32(k, _mm256_set1_epi32((int)from - 1)),
                        _mm256_cmpgt_epi32(_mm256_set1_epi32((int)to), k)));
                    const __m256 x = _mm256_and_ps(_mm256_sub_ps(_mm256_loadu_ps(score + k0), m), inside);
                    const __m256 e = _mm256_and_ps(exp_nonpositive(x), inside);
                    _mm256_storeu_ps(score + k0, e);
                    sum = _mm256_add_ps(sum, e);
                }
                const float alpha = st[D] == -INFINITY ? 0.0f
                    : _mm256_cvtss_f32(exp_nonpositive(_mm256_set1_ps(st[D] - top)));
                st[D] = top;
                st[D + 1] = st[D + 1] * alpha + hsum(sum);
                accs[g] = st, alphas[g] = alpha, probs[g] = score;
            }
            // the row's G heads share its key range: their V sums together
            group_values(accs, alphas, probs, G, D, vf, from - g0, to - g0);
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *st = state + (r * G + g) * (D + 2);
            const __m256 inv = _mm256_set1_ps(1.0f / st[D + 1]);
            float *o = out + ((t0 + r) * a->Hq + h * G + g) * D;
            for (int64_t c = 0; c < V; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(st + 8 * c), inv));
        }
}

// on the pool: chunk i is (query row i / Hkv, KV head i % Hkv)
static pool_region attention_region(const void *ctx, int64_t i) {
    const attention_job *a = ctx;
    const int64_t G = a->Hq / a->Hkv;
    return (pool_region){((i / a->Hkv) * a->Hq + (i % a->Hkv) * G) * a->D, 1, G * a->D, G * a->D};
}

static int attention_chunk(const void *ctx, int64_t i, float *dst, int64_t ld) {
    (void)ld;
    const attention_job *a = ctx;
    const int64_t G = a->Hq / a->Hkv, t = i / a->Hkv, h = i % a->Hkv;
    float *scratch = malloc((size_t)tile_floats(G, a->D) * sizeof(float));
    if (!scratch) return 1;
    // the tile writes at out + (t * Hq + h * G) * D; dst is that place
    attend_tile(a, t, 1, h, scratch, dst - (t * a->Hq + h * G) * a->D);
    free(scratch);
    return 0;
}

// `form`: what the caches hold (KV_F32 ..); q and out stay float32, and every sum is the same float32 arithmetic
// whatever the form
int kvflow_paged_attention(const float *q, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                           const void *k_cache, const void *v_cache, int64_t block_size,
                           const int64_t *tables, int64_t width, const int64_t *row_seq,
                           const int64_t *positions, float scale, float *out, int threads, int form,
                           int64_t window) {
    const int64_t G = Hq / Hkv;
    if (G > 32 || D > 256 || D % 8) return 2;        // attention_supports() keeps such models off this kernel
    static pthread_once_t fp8_once = PTHREAD_ONCE_INIT;
    if (form == KV_FP8) pthread_once(&fp8_once, fill_fp8_values);
    attention_job a = {q, T, Hq, Hkv, D, k_cache, v_cache, block_size, tables, row_seq, positions, width, scale,
                       form, window};
    if (T <= POOL_ROWS && pool_acquire(threads)) {
        // the inputs a late worker may still read, copied into the pool's buffers (the caches outlive the call)
        int64_t sequences = 0;
        for (int64_t t = 0; t < T; t++) sequences = row_seq[t] + 1 > sequences ? row_seq[t] + 1 : sequences;
        float *qc = pool_buffer(POOL_ATTN_Q, T * Hq * D * (int64_t)sizeof(float));
        int64_t *tc = pool_buffer(POOL_ATTN_TABLES, sequences * width * (int64_t)sizeof(int64_t));
        int64_t *rc = pool_buffer(POOL_ATTN_ROWS, T * (int64_t)sizeof(int64_t));
        int64_t *pc = pool_buffer(POOL_ATTN_POSITIONS, T * (int64_t)sizeof(int64_t));
        int failed = !qc || !tc || !rc || !pc;
        if (!failed) {
            memcpy(qc, q, (size_t)(T * Hq * D) * sizeof(float));
            memcpy(tc, tables, (size_t)(sequences * width) * sizeof(int64_t));
            memcpy(rc, row_seq, (size_t)T * sizeof(int64_t));
            memcpy(pc, positions, (size_t)T * sizeof(int64_t));
            a.q = qc, a.tables = tc, a.row_seq = rc, a.positions = pc;
            failed = pool_run(attention_chunk, attention_region, &a, sizeof a, T * Hkv, out, threads);
        }
        pool_release();
        return failed;
    }
    // tiles: runs of up to TILE_ROWS consecutive rows of one sequence (a prefill chunk's rows; a decode row alone)
    int64_t *tile_start = malloc((size_t)(T + 1) * sizeof(int64_t)), tiles = 0;
    if (!tile_start) return 1;
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || row_seq[t] != row_seq[t - 1] || t - tile_start[tiles - 1] == TILE_ROWS) tile_start[tiles++] = t;
    tile_start[tiles] = T;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *scratch = malloc((size_t)tile_floats(G, D) * sizeof(float));
        if (!scratch) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tiles * Hkv; i++) {
            if (!scratch) continue;
            const int64_t tile = i / Hkv;
            attend_tile(&a, tile_start[tile], tile_start[tile + 1] - tile_start[tile], i % Hkv, scratch, out);
        }
        free(scratch);
    }
    free(tile_start);
    return failed;
}

// RMSNorm of rows x [M, H] float32: y = w * (x / sqrt(mean(x^2) + eps)). Inductor's fused reduction sums in
// another order than torch's eager kernel (and its order depends on the batch size), so a compiled step and an
// eager one gave different bits; this one op serves both, summing each row in one fixed order.
void kvflow_rms_norm(const float *x, int64_t M, int64_t H, const float *w, float eps, float *y, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (M * H >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * H;
        float *ym = y + m * H;
        __m256 acc = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= H; j += 8) {
            const __m256 v = _mm256_loadu_ps(xm + j);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float sum = hsum(acc);
        for (; j < H; j++) sum += xm[j] * xm[j];
        const float inv = 1.0f / sqrtf(sum / (float)H + eps);
        for (j = 0; j < H; j++) ym[j] = w[j] * (xm[j] * inv);
    }
}

// LoRA terms of a (possibly fused) projection of P pieces, added to its output y [M, N] (layers/lora.py has the
// layout): x [M, K]; a [K, P*S*R] (column block (p, s): piece p's A^T in slot s); b: piece p's [S*R, width] (scale *
// B^T per slot) at element pieces[p][2], to be added to y's columns pieces[p][0] .. + pieces[p][1] (pieces int64
// [P, 3], checked against b's size `b_len` and N); mask [M, S*R] (its value in the first column of a row's slot, 0
// in every slot for a row of no adapter). Each row reads only its own slot's R columns and R rows, in one fixed
// order, and its term is summed apart before it is added: a row's bits do not depend on the other rows or the
// thread count (batch invariant). Torch's way (every slot's columns for every row, masked; layers/lora.py) spent
// ~80 us a projection at one row in small matmuls padded to invariant tiles; this spends a few.
// xa[r] = sum over k of x[k] * a[k * cols + r], r < R: up to 32 columns (4 registers) a pass over k, the k's in
// 2 interleaved chains added at the end, in one fixed order (so every row's xa is the same bits whatever else is
// computed); a rank that is not a multiple of 8 leaves its last columns to a scalar loop
static void lora_down(const float *restrict x, int64_t K, const float *restrict a, int64_t cols, int64_t R,
                      float *restrict xa) {
    int64_t r = 0;
    while (r + 8 <= R) {
        const int nv = (R - r) / 8 >= 4 ? 4 : (int)((R - r) / 8);
        __m256 even[4], odd[4];
        for (int v = 0; v < 4; v++) even[v] = odd[v] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 2 <= K; k += 2) {
            const __m256 x0 = _mm256_set1_ps(x[k]), x1 = _mm256_set1_ps(x[k + 1]);
            const float *a0 = a + k * cols + r, *a1 = a0 + cols;
            for (int v = 0; v < nv; v++) {
                even[v] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(a0 + 8 * v), even[v]);
                odd[v] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(a1 + 8 * v), odd[v]);
            }
        }
        for (; k < K; k++)
            for (int v = 0; v < nv; v++)
                even[v] = _mm256_fmadd_ps(_mm256_set1_ps(x[k]), _mm256_loadu_ps(a + k * cols + r + 8 * v), even[v]);
        for (int v = 0; v < nv; v++) _mm256_storeu_ps(xa + r + 8 * v, _mm256_add_ps(even[v], odd[v]));
        r += 8 * nv;
    }
    for (; r < R; r++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) acc = fmaf(x[k], a[k * cols + r], acc);
        xa[r] = acc;
    }
}

// y[j] += sum over r of xa[r] * b[r * w + j], j < w: the sum over r in order, then one add to y
static void lora_up(const float *restrict xa, int64_t R, const float *restrict b, int64_t w, float *restrict y) {
    int64_t j = 0;
    for (; j + 8 <= w; j += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t r = 0; r < R; r++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(xa[r]), _mm256_loadu_ps(b + r * w + j), acc);
        _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_loadu_ps(y + j), acc));
    }
    for (; j < w; j++) {
        float acc = 0.0f;
        for (int64_t r = 0; r < R; r++) acc = fmaf(xa[r], b[r * w + j], acc);
        y[j] += acc;
    }
}

int kvflow_lora_add(const float *x, int64_t M, int64_t K, const float *a, const float *mask, int64_t S, int64_t R,
                    int64_t P, const float *b, int64_t b_len, const int64_t *pieces, float *y, int64_t N,
                    int threads) {
    for (int64_t p = 0; p < P; p++) {
        const int64_t *piece = pieces + 3 * p;
        if (piece[0] < 0 || piece[1] < 0 || piece[0] + piece[1] > N || piece[2] < 0
                || piece[2] + S * R * piece[1] > b_len)
            return 2;
    }
    const int64_t cols = P * S * R;
    // a small step's few rows on the calling thread: an OpenMP region there waits on every thread (thread_pool.c)
    const int parallel = M > POOL_ROWS;
    float *xa = malloc(sizeof(float) * R * (parallel ? (size_t)threads : 1));
    if (xa == NULL) return 1;
    #pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t m = 0; m < M; m++) {
        float *mine = xa + R * (parallel ? omp_get_thread_num() : 0);
        const float *mm = mask + m * S * R;
        int64_t s = 0;
        while (s < S && mm[s * R] == 0.0f) s++;
        if (s == S) continue;                                       // no adapter: the base output as it is
        for (int64_t p = 0; p < P; p++) {
            const int64_t *piece = pieces + 3 * p;
            lora_down(x + m * K, K, a + (p * S + s) * R, cols, R, mine);
            for (int64_t r = 0; r < R; r++) mine[r] *= mm[s * R];    // the mask's value (1.0) as torch's path has it
            lora_up(mine, R, b + piece[2] + s * R * piece[1], piece[1], y + m * N + piece[0]);
        }
    }
    free(xa);
    return 0;
}

// ---- Layout "x16": 16 weight rows interleaved, on AVX-512 VNNI (vpdpbusd) or AVX2 (vpmaddubsw) ---------------
//
// Layout "x16" (pack_q4 / pack_q8 / pack_q5 in native_kernels.py): weight rows in blocks of 16 (N padded to a
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
// the bytes of one block of 16 weight rows over G groups: 4, 5, 6.5 or 8 64-byte registers a group
#define Q6_GROUP_BYTES (6 * 64 + 2 * X16)
static inline int64_t block_bytes(int bits, int64_t G) {
    return G * (bits == 4 ? 4 * 64 : bits == 5 ? 5 * 64 : bits == 6 ? Q6_GROUP_BYTES : 8 * 64);
}

// the sum of the activation codes of group g of a row, and of its first 16 (quantize_activations' qs)
static inline int32_t group_sum(const int32_t *qs, int64_t row, int64_t g, int64_t G) { return qs[row * 2 * G + g]; }
static inline int32_t first_half_sum(const int32_t *qs, int64_t row, int64_t g, int64_t G) {
    return qs[row * 2 * G + G + g];
}

#define ROWS_X16 4          // activation rows per pass over a block's unpacked weights (registers: 8 + 3 * 4)

typedef void (*x16_block_fn)(int bits, int R, const uint8_t *w, scales_t wd, scales_t wm, int64_t at, int64_t G,
                             const int8_t *q, const float *d, const float *s, const int32_t *qs, int64_t K,
                             int64_t m, float *y, int64_t N, int64_t n0);

// the 16 rows' scales of group g in the block whose scales start at element `at` (= block * G * 16)
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __m512 load16(scales_t s, int64_t at, int64_t g) {
    const int64_t i = at + g * X16;
    __m512 v;
    if (s.form == 1) {
        v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s.p + i)));
    } else if (s.form == 2) {      // super-scales [N/16, G/8, 16]: this block's start at at / 8
        const __m512 mult = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)s.p + i))));
        const __m512 sup = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s.super + at / 8 + (g / 8) * X16)));
        v = _mm512_mul_ps(mult, sup);
    } else if (s.form == 3) {      // one per 8 groups [N/16, G/8, 16]
        v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s.p + at / 8 + (g / 8) * X16)));
    } else {
        v = _mm512_loadu_ps((const float *)s.p + i);
    }
    return s.minus8 ? _mm512_mul_ps(v, _mm512_set1_ps(-8.0f)) : v;
}

// (inlined with `bits` a constant: one kernel per code width, each with only its own registers' work)
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void x16_avx512_of(const int bits, int R, const uint8_t *w, scales_t wd, scales_t wm, int64_t at,
                                 int64_t G, const int8_t *q, const float *d, const float *s,
                                 const int32_t *qs, int64_t K, int64_t m, float *y, int64_t N, int64_t n0) {
    __m512 acc[ROWS_X16], bias[ROWS_X16];
    for (int r = 0; r < R; r++) acc[r] = bias[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    for (int64_t g = 0; g < G; g++) {
        __m512i wq[8], sc0 = _mm512_setzero_si512(), sc1 = sc0;
        const uint8_t *wg = w + g * block_bytes(bits, 1);
        if (bits == 8) {
            for (int c = 0; c < 8; c++) wq[c] = _mm512_loadu_si512((const void *)(wg + c * 64));
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(wg + c * 64));
                wq[c] = _mm512_and_si512(v, low);
                wq[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            if (bits == 5) {
                const __m512i high = _mm512_loadu_si512((const void *)(wg + 4 * 64));
                for (int c = 0; c < 8; c++)
                    wq[c] = _mm512_mask_add_epi8(wq[c], _mm512_test_epi8_mask(high, _mm512_set1_epi8((char)(1 << c))),
                                                 wq[c], _mm512_set1_epi8(16));
            } else if (bits == 6) {       // bits 4-5 of quad c (and c + 4) from bits 2c, 2c + 1 of registers 4 and 5
                for (int r = 0; r < 2; r++) {
                    const __m512i hi = _mm512_loadu_si512((const void *)(wg + (4 + r) * 64));
                    const __m512i moved[4] = {_mm512_slli_epi16(hi, 4), _mm512_slli_epi16(hi, 2), hi,
                                              _mm512_srli_epi16(hi, 2)};
                    for (int c = 0; c < 4; c++)
                        wq[4 * r + c] = _mm512_or_si512(wq[4 * r + c], _mm512_and_si512(moved[c], top));
                }
                sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wg + 6 * 64)));
                sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wg + 6 * 64 + X16)));
            }
        }
        const __m512 sd = load16(wd, at, g);
        const __m512 sm = bits == 4 ? load16(wm, at, g) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const int64_t row = m + r;
            const int32_t *a = (const int32_t *)(q + row * K + g * QK);
            // two independent chains (integer sums: any split gives the same bits), half the latency of one
            __m512i dot = _mm512_setzero_si512(), dot2 = _mm512_setzero_si512();
            if (bits == 6) {       // the two halves apart (their own multipliers): quads 0..3, then 4..7
                for (int c = 0; c < 4; c++) {
                    dot = _mm512_dpbusd_epi32(dot, wq[c], _mm512_set1_epi32(a[c]));
                    dot2 = _mm512_dpbusd_epi32(dot2, wq[c + 4], _mm512_set1_epi32(a[c + 4]));
                }
                const int32_t first = first_half_sum(qs, row, g, G), second = group_sum(qs, row, g, G) - first;
                dot = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_sub_epi32(dot, _mm512_set1_epi32(32 * first)), sc0),
                                       _mm512_mullo_epi32(_mm512_sub_epi32(dot2, _mm512_set1_epi32(32 * second)), sc1));
            } else {
                for (int c = 0; c < 8; c += 2) {
                    dot = _mm512_dpbusd_epi32(dot, wq[c], _mm512_set1_epi32(a[c]));
                    dot2 = _mm512_dpbusd_epi32(dot2, wq[c + 1], _mm512_set1_epi32(a[c + 1]));
                }
                dot = _mm512_add_epi32(dot, dot2);
            }
            if (bits == 8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * group_sum(qs, row, g, G)));
            if (bits == 5) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(16 * group_sum(qs, row, g, G)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sd, _mm512_set1_ps(d[row * G + g])),
                                     acc[r]);
            if (bits == 4) bias[r] = _mm512_fmadd_ps(sm, _mm512_set1_ps(s[row * G + g]), bias[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (m + r) * N + n0, _mm512_add_ps(acc[r], bias[r]));
}


// the 8 scales of rows 8h .. 8h + 7 of a block (h = 0, 1) for group g: load16's halves
__attribute__((target("avx2,fma,f16c")))
static inline __m256 load8_of16(scales_t s, int64_t at, int64_t g, int h) {
    const int64_t i = at + g * X16 + h * 8;
    __m256 v;
    if (s.form == 1) {
        v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s.p + i)));
    } else if (s.form == 2) {
        const __m128i m8 = _mm_loadl_epi64((const __m128i *)((const uint8_t *)s.p + i));
        const __m256 mult = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8));
        const __m256 sup = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s.super + at / 8 + (g / 8) * X16
                                                                             + h * 8)));
        v = _mm256_mul_ps(mult, sup);
    } else if (s.form == 3) {
        v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s.p + at / 8 + (g / 8) * X16
                                                              + h * 8)));
    } else {
        v = _mm256_loadu_ps((const float *)s.p + i);
    }
    return s.minus8 ? _mm256_mul_ps(v, _mm256_set1_ps(-8.0f)) : v;
}

// block_x16_avx512's arithmetic on AVX2, one half of the block (8 weight rows, the low or high 32 bytes of each
// 64-byte quad register) at a time. vpmaddubsw sums pairs of products into int16 with saturation, so the integer
// dot is built so that no sum can saturate: 4-bit codes (<= 15 * 127 * 2 a pair) summed over all 8 quads in int16
// (<= 30,480); 5-bit codes (<= 31 * 127 * 2) over 4 quads at a time (<= 31,496); 8-bit codes turned back to signed
// (x16 stores code + 128) and multiplied as |code| * (a * sign(code)) (<= 128 * 127 * 2 = 32,512), quad by quad;
// 6-bit codes (<= 63 * 127 * 2) over 2 quads at a time (<= 32,004), each half of the group apart (its multiplier).
// Each gives the exact integer dot, the same as vpdpbusd's, so the same floats follow.
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void x16_avx2_of(const int bits, int R, const uint8_t *w, scales_t wd, scales_t wm, int64_t at,
                               int64_t G, const int8_t *q, const float *d, const float *s, const int32_t *qs,
                               int64_t K, int64_t m, float *y, int64_t N, int64_t n0) {
    const int64_t group_bytes = block_bytes(bits, 1);
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256 acc[ROWS_X16], bias[ROWS_X16];
        for (int r = 0; r < R; r++) acc[r] = bias[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *wg = w + g * group_bytes + h * 32;
            __m256i wq[8], sc0 = _mm256_setzero_si256(), sc1 = sc0;
            if (bits == 8) {
                for (int c = 0; c < 8; c++)
                    wq[c] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wg + c * 64)),
                                             _mm256_set1_epi8((char)0x80));
            } else {
                for (int c = 0; c < 4; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + c * 64));
                    wq[c] = _mm256_and_si256(v, low);
                    wq[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                if (bits == 5) {
                    const __m256i high = _mm256_loadu_si256((const __m256i *)(wg + 4 * 64));
                    for (int c = 0; c < 8; c++) {
                        const __m256i bit = _mm256_set1_epi8((char)(1 << c));
                        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit);
                        wq[c] = _mm256_add_epi8(wq[c], _mm256_and_si256(set, _mm256_set1_epi8(16)));
                    }
                } else if (bits == 6) {
                    for (int r = 0; r < 2; r++) {
                        const __m256i hi = _mm256_loadu_si256((const __m256i *)(wg + (4 + r) * 64));
                        const __m256i moved[4] = {_mm256_slli_epi16(hi, 4), _mm256_slli_epi16(hi, 2), hi,
                                                  _mm256_srli_epi16(hi, 2)};
                        for (int c = 0; c < 4; c++)
                            wq[4 * r + c] = _mm256_or_si256(wq[4 * r + c], _mm256_and_si256(moved[c], top));
                    }
                    // this half's 8 rows' multipliers: bytes 8h .. 8h + 7 of each 16 (wg is 32h past the group)
                    const uint8_t *sc = wg - h * 32 + 6 * 64 + h * 8;
                    sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
                    sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + X16)));
                }
            }
            const __m256 sd = load8_of16(wd, at, g, h);
            const __m256 sm = bits == 4 ? load8_of16(wm, at, g, h) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                const int64_t row = m + r;
                const int32_t *a = (const int32_t *)(q + row * K + g * QK);
                __m256i dot;
                if (bits == 4) {
                    __m256i pairs = _mm256_maddubs_epi16(wq[0], _mm256_set1_epi32(a[0]));
                    for (int c = 1; c < 8; c++)
                        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wq[c], _mm256_set1_epi32(a[c])));
                    dot = _mm256_madd_epi16(pairs, ones);
                } else if (bits == 5) {
                    __m256i p0 = _mm256_maddubs_epi16(wq[0], _mm256_set1_epi32(a[0]));
                    __m256i p1 = _mm256_maddubs_epi16(wq[4], _mm256_set1_epi32(a[4]));
                    for (int c = 1; c < 4; c++) {
                        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(wq[c], _mm256_set1_epi32(a[c])));
                        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(wq[c + 4], _mm256_set1_epi32(a[c + 4])));
                    }
                    dot = _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
                    dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(16 * group_sum(qs, row, g, G)));
                } else if (bits == 6) {
                    const int32_t first = first_half_sum(qs, row, g, G);
                    const int32_t sums[2] = {first, group_sum(qs, row, g, G) - first};
                    __m256i half[2];
                    for (int k = 0; k < 2; k++) {
                        const __m256i *wk = wq + 4 * k;
                        const int32_t *ak = a + 4 * k;
                        const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(wk[0], _mm256_set1_epi32(ak[0])),
                                                            _mm256_maddubs_epi16(wk[1], _mm256_set1_epi32(ak[1])));
                        const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(wk[2], _mm256_set1_epi32(ak[2])),
                                                            _mm256_maddubs_epi16(wk[3], _mm256_set1_epi32(ak[3])));
                        half[k] = _mm256_sub_epi32(
                            _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)),
                            _mm256_set1_epi32(32 * sums[k]));
                    }
                    dot = _mm256_add_epi32(_mm256_mullo_epi32(half[0], sc0), _mm256_mullo_epi32(half[1], sc1));
                } else {
                    dot = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c++) {
                        const __m256i ac = _mm256_sign_epi8(_mm256_set1_epi32(a[c]), wq[c]);
                        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(
                            _mm256_maddubs_epi16(_mm256_sign_epi8(wq[c], wq[c]), ac), ones));
                    }
                }
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sd, _mm256_set1_ps(d[row * G + g])),
                                         acc[r]);
                if (bits == 4) bias[r] = _mm256_fmadd_ps(sm, _mm256_set1_ps(s[row * G + g]), bias[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (m + r) * N + n0 + h * 8, _mm256_add_ps(acc[r], bias[r]));
    }
}

// the block kernels as `x16_block` calls them: one specialization per code width
#define X16_BY_BITS(KERNEL)                                                                                  \
    switch (bits) {                                                                                          \
    case 4: KERNEL(4, R, w, wd, wm, at, G, q, d, s, qs, K, m, y, N, n0); break;                              \
    case 5: KERNEL(5, R, w, wd, wm, at, G, q, d, s, qs, K, m, y, N, n0); break;                              \
    case 6: KERNEL(6, R, w, wd, wm, at, G, q, d, s, qs, K, m, y, N, n0); break;                              \
    default: KERNEL(8, R, w, wd, wm, at, G, q, d, s, qs, K, m, y, N, n0);                                    \
    }

__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline))
static void block_x16_avx512(int bits, int R, const uint8_t *w, scales_t wd, scales_t wm, int64_t at, int64_t G,
                             const int8_t *q, const float *d, const float *s, const int32_t *qs, int64_t K,
                             int64_t m, float *y, int64_t N, int64_t n0) {
    X16_BY_BITS(x16_avx512_of)
}

__attribute__((target("avx2,fma,f16c"), noinline))
static void block_x16_avx2(int bits, int R, const uint8_t *w, scales_t wd, scales_t wm, int64_t at, int64_t G,
                           const int8_t *q, const float *d, const float *s, const int32_t *qs, int64_t K, int64_t m,
                           float *y, int64_t N, int64_t n0) {
    X16_BY_BITS(x16_avx2_of)
}

static x16_block_fn x16_block = block_x16_avx2;

// The x16 kernels' instruction set from now on: AVX-512 VNNI (nonzero) or AVX2 (0). native_kernels.isa() decides,
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

int kvflow_q4_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const void *d,
                     const void *m, int64_t N, float *y, int threads, int flags) {
    return kvflow_x16_linear(4, x, M, K, codes, d, m, N, y, threads, flags, 1);
}

int kvflow_q8_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const void *d, int64_t N,
                     float *y, int threads, int flags) {
    return kvflow_x16_linear(8, x, M, K, codes, d, NULL, N, y, threads, flags, 1);
}

int kvflow_q5_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const void *d, int64_t N,
                     float *y, int threads, int flags) {
    return kvflow_x16_linear(5, x, M, K, codes, d, NULL, N, y, threads, flags, 1);
}

int kvflow_q6_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const void *d, int64_t N,
                     float *y, int threads, int flags) {
    return kvflow_x16_linear(6, x, M, K, codes, d, NULL, N, y, threads, flags, 1);
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

_Static_assert(sizeof(linear_job) <= POOL_CTX_BYTES && sizeof(attention_job) <= POOL_CTX_BYTES
               && sizeof(grouped_job) <= POOL_CTX_BYTES, "a pool job's context must fit the pool's copy");
