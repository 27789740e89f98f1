// Paged attention straight from the KV cache, on kvflow's pool or OpenMP's threads.
#include <omp.h>
#include <pthread.h>

#include "common.h"


// Paged attention straight from the KV cache (no gathered copy of the context), in tiles (attend_tile, below):
//   q [T, Hq, D]; caches [blocks, block_size, Hkv, D]; query row t belongs to sequence row_seq[t], whose block
//   table is tables[row_seq[t], :width], and attends to keys 0..positions[t] (causal; its own key was stored
//   before the call); out [T, Hq, D]. Query heads h * G .. h * G + G - 1 share KV head h (G = Hq / Hkv).
// Each row's sums run over its own keys in one fixed order, whatever else is in the step, however its
// sequence was chunked, and on however many threads: the result of a row depends on that row's inputs only
// (batch invariance). D must be a multiple of 8 and at most 256. `window` > 0 (a sliding-window layer): the row
// attends to keys positions[t] - window + 1 .. positions[t] only (the cache still holds the older ones).
// The cache's element forms (kernels/ops.py's KV_FORMS): what a row of D values is in memory.
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
                    const __m256 e = _mm256_and_ps(exp8(x), inside);
                    _mm256_storeu_ps(score + k0, e);
                    sum = _mm256_add_ps(sum, e);
                }
                const float alpha = st[D] == -INFINITY ? 0.0f
                    : _mm256_cvtss_f32(exp8(_mm256_set1_ps(st[D] - top)));
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

_Static_assert(sizeof(attention_job) <= POOL_CTX_BYTES, "a pool job's context must fit the pool's copy");
