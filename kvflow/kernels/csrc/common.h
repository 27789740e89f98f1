// What kvflow's kernel files share: the layout's constants, the scales' forms, the activations' int8 rounding,
// the x16 block kernels' signature and the table of code widths they multiply (linear.c). Included by every .c file
// here; kernels.h is the entry points' declarations.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "thread_pool.h"

#define QK 32
#define X16 16          // weight rows per block of the layout ("x16", below)
#define ROW_BLOCK 64      // rows of activations per pass over the weights: their int8 copy stays in L2
// Calls of up to this many rows (a decode step's) run on kvflow's thread pool (thread_pool.c says why), bigger ones
// on OpenMP's threads; every kernel gives the same bits either way. kernels/plan.py's SMALL_STEP_ROWS is the same number.
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


// x [M, K] rounded to int8 per group of QK (activations.c): into buffers of the caller's own (own_activations, then
// free_activations; threads: OpenMP's, for big calls) or into the pool's (pool_activations: a worker late from this
// call may still read them). 1: out of memory
int own_activations(const float *x, int64_t M, int64_t K, int threads, int8_t **q, float **d, float **s,
                    int32_t **qs);
void free_activations(int8_t *q, float *d, float *s, int32_t *qs);
int pool_activations(const float *x, int64_t M, int64_t K, int8_t **q, float **d, float **s, int32_t **qs);

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

// e^x, 8 lanes, x clamped to [-87.3, 88] (e^x then within float32's normal range): Cephes' expf polynomial, ~1 ulp.
// Attention's softmax (x <= 0, where the upper clamp changes nothing) and the recurrent layers' SiLU share it.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f));
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

// The bytes of one block of 16 weight rows over one group of 32 columns, by code width: the table of weight formats
// (kernels/formats.py) registers each row's at load (kvflow_x16_set_format); 0 for a width no format holds
#define X16_MAX_BITS 8
extern int64_t x16_group_bytes[X16_MAX_BITS + 1];
static inline int64_t block_bytes(int bits, int64_t G) { return G * x16_group_bytes[bits]; }

// the sum of the activation codes of group g of a row, and of its first 16 (quantize_activations' qs)
static inline int32_t group_sum(const int32_t *qs, int64_t row, int64_t g, int64_t G) { return qs[row * 2 * G + g]; }
static inline int32_t first_half_sum(const int32_t *qs, int64_t row, int64_t g, int64_t G) {
    return qs[row * 2 * G + G + g];
}

#define ROWS_X16 4          // activation rows per pass over a block's unpacked weights (registers: 8 + 3 * 4)

typedef void (*x16_block_fn)(int bits, int R, const uint8_t *w, scales_t wd, scales_t wm, int64_t at, int64_t G,
                             const int8_t *q, const float *d, const float *s, const int32_t *qs, int64_t K,
                             int64_t m, float *y, int64_t N, int64_t n0);

// the block kernels, one per instruction set (linear_x16_avx512.c, linear_x16_avx2.c): each specialized per code width
void block_x16_avx512(int bits, int R, const uint8_t *w, scales_t wd, scales_t wm, int64_t at, int64_t G,
                      const int8_t *q, const float *d, const float *s, const int32_t *qs, int64_t K, int64_t m,
                      float *y, int64_t N, int64_t n0);
void block_x16_avx2(int bits, int R, const uint8_t *w, scales_t wd, scales_t wm, int64_t at, int64_t G,
                    const int8_t *q, const float *d, const float *s, const int32_t *qs, int64_t K, int64_t m,
                    float *y, int64_t N, int64_t n0);
