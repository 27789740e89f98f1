// The recurrent layers' kernels (kernels/recurrent.py has their torch definitions, which these compute on CPU in
// float32): the causal depthwise convolution, Gated DeltaNet's delta rule and Mamba2's selective state update, each
// over the step's runs (state_runs_t: consecutive rows continuing one state slot), token after token.
//
// Batch invariance: a run's tokens go through the same arithmetic whatever else shares the call and wherever the
// scheduler split its prompt. Threads split the (run, head) pairs (the convolution: blocks of channels), never
// a reduction; inside a pair, tokens run in order and every sum has one fixed order per (token, head): the dk-long
// sums of GDN run row after row (i = 0 .. dk - 1) with the dv columns in vector lanes; the N-long dot of Mamba2 and
// the l2norm's sum of squares run in 8 lane-wise partial sums, added by hsum, then the tail in order; the taps run
// j = 0 .. K - 1, then the bias. The columns past the last full vector compute the same arithmetic as the lanes
// (fmaf is the lanes' FMA; the convolution's last channels are masked lanes), so a value's bits do not depend on
// where its column falls either.
//
// The decays exp(g) and exp(dt A) are libm's expf, once per (token, head), in every path; SiLU's e^-x is one vector
// function (exp8) for every channel.
//
// Threads: the pool (thread_pool.c) does not run these: its chunks may be computed twice (a late worker's, taken
// back), which in-place state updates cannot allow. A call of more than POOL_ROWS rows (a prefill chunk's) with
// enough work runs on OpenMP's threads; a decode step's runs on the caller's thread alone, as the other kernels' small
// calls did before the pool (an OpenMP thread preempted at the barrier holds the whole call: thread_pool.c).
#include <omp.h>

#include "common.h"

// multiply-adds per call from which it is split over threads (a call below this is a few microseconds of work)
#define PARALLEL_WORK 65536

// whether a call of these runs, `work` multiply-adds a row, is split over threads (above)
static inline int on_threads(const state_runs_t *r, int64_t work, int64_t units, int threads) {
    const int64_t rows = r->starts[r->runs] - r->starts[0];
    return threads > 1 && units > 1 && rows > POOL_ROWS && rows * work >= PARALLEL_WORK;
}
#define CONV_CHANNELS 64        // channels per unit of the convolution's work
#define CONV_MAX_TAPS 16
#define GDN_COLUMNS 32          // state columns (dv) per pass: 4 vectors of u and 4 of o stay in registers

// The runs' bounds, slots and snapshots, checked: 0 or 2 (not a batch of T rows over `slots` slots: a run out of
// order or outside the rows, a slot out of range, two runs or snapshots on one slot, snapshot rows not ascending).
// Every run and every snapshot writes its own slot, so the (run, head) pairs are independent.
static int check_runs(const state_runs_t *r, int64_t T) {
    if (r->runs < 0 || r->snapshots < 0 || r->slots < 0) return 2;
    if (r->runs == 0) return 0;
    if (r->starts[0] < 0 || r->starts[r->runs] > T) return 2;
    unsigned char *taken = calloc((size_t)r->slots + 1, 1);
    if (!taken) return 1;
    int bad = 0;
    for (int64_t i = 0; i < r->runs && !bad; i++) {
        const int64_t slot = r->run_slots[i];
        bad = r->starts[i + 1] < r->starts[i] || slot < 0 || slot >= r->slots || taken[slot];
        if (!bad) taken[slot] = 1;
    }
    for (int64_t i = 0; i < r->snapshots && !bad; i++) {
        const int64_t slot = r->snapshot_slots[i], row = r->snapshot_rows[i];
        bad = row < 0 || row >= T || (i && row < r->snapshot_rows[i - 1]) || slot < 0 || slot >= r->slots ||
              taken[slot];
        if (!bad) taken[slot] = 1;
    }
    free(taken);
    return bad ? 2 : 0;
}

// the first snapshot at or after row `a` (snapshot rows ascend)
static inline int64_t first_snapshot(const state_runs_t *r, int64_t a) {
    int64_t i = 0;
    while (i < r->snapshots && r->snapshot_rows[i] < a) i++;
    return i;
}

// sum of squares of n floats: 8 lane-wise partial sums, then hsum, then the tail in order
static inline float sum_squares(const float *x, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float s = hsum(acc);
    for (; i < n; i++) s = fmaf(x[i], x[i], s);
    return s;
}


// ---- causal depthwise convolution ----


// x / (1 + e^-x), 8 lanes (libm's expf per value took 60% of a one-row call)
static inline __m256 silu8(__m256 x) {
    const __m256 e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// Channels [c0, c1) of every run: y_t = sum_j w[j] x_{t-K+1+j} (+ bias, SiLU), each run reading its window from
// its slot (the K - 1 inputs before its first row) and then x. Every channel goes through the same vector
// arithmetic: the last group of fewer than 8 channels is read and written with masks.
static void conv_block(const float *x, int64_t C, const float *weight, int64_t K, const float *bias, float *state,
                       const state_runs_t *r, int64_t c0, int64_t c1, int silu_after, float *out) {
    const int64_t W = K - 1, width = c1 - c0;
    float wt[CONV_MAX_TAPS * CONV_CHANNELS];           // the block's weights, [K, CONV_CHANNELS], 0 past c1
    for (int64_t c = 0; c < width; c++)
        for (int64_t j = 0; j < K; j++) wt[j * CONV_CHANNELS + c] = weight[(c0 + c) * K + j];
    for (int64_t j = 0; j < K; j++)
        for (int64_t c = width; c < CONV_CHANNELS; c++) wt[j * CONV_CHANNELS + c] = 0.0f;
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(width % 8)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const float *in[CONV_MAX_TAPS];
    for (int64_t run = 0; run < r->runs; run++) {
        const int64_t a = r->starts[run], n = r->starts[run + 1] - a;
        float *own = state + r->run_slots[run] * W * C;
        // input i of the run's window (i = 0 .. W + n - 1): the state's row i, then x's row a + i - W
#define INPUT(i) ((i) < W ? own + (i) * C : x + (a + (i) - W) * C)
        int64_t snap = first_snapshot(r, a);
        for (int64_t t = 0; t < n; t++) {
            for (int64_t j = 0; j < K; j++) in[j] = INPUT(t + j);
            float *y = out + (a + t) * C;
            for (int64_t c = 0; c < width; c += 8) {
                const int full = c + 8 <= width;
                __m256 acc = _mm256_setzero_ps();
                for (int64_t j = 0; j < K; j++) {
                    const float *p = in[j] + c0 + c;
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(wt + j * CONV_CHANNELS + c),
                                          full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail), acc);
                }
                if (bias) {
                    const float *p = bias + c0 + c;
                    acc = _mm256_add_ps(acc, full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail));
                }
                if (silu_after) acc = silu8(acc);
                if (full) _mm256_storeu_ps(y + c0 + c, acc);
                else _mm256_maskstore_ps(y + c0 + c, tail, acc);
            }
            // after row a + t: the window's inputs t + 1 .. t + W to each snapshot slot listed there
            for (; snap < r->snapshots && r->snapshot_rows[snap] == a + t; snap++) {
                float *dst = state + r->snapshot_slots[snap] * W * C;
                for (int64_t i = 0; i < W; i++)
                    memcpy(dst + i * C + c0, INPUT(t + 1 + i) + c0, (size_t)width * sizeof(float));
            }
        }
        // the run's last W inputs, n .. n + W - 1: row i takes input n + i, which is x's or the state's row n + i > i
        // (not yet overwritten, rows going up)
        if (n > 0)
            for (int64_t i = 0; i < W; i++)
                memmove(own + i * C + c0, INPUT(n + i) + c0, (size_t)width * sizeof(float));
#undef INPUT
    }
}

// x [T, C], weight [C, K], bias [C] or NULL, state [slots, K - 1, C], out [T, C], all float32. 0 or 2 (the runs,
// check_runs; more than CONV_MAX_TAPS taps). Threads split the blocks of channels (each transposes its weights
// once and runs every run).
int kvflow_causal_conv1d(const float *x, int64_t T, int64_t C, const float *weight, int64_t K, const float *bias,
                         float *state, state_runs_t r, int silu_after, float *out, int threads) {
    if (K < 1 || K > CONV_MAX_TAPS || C < 0) return 2;
    const int bad = check_runs(&r, T);
    if (bad || r.runs == 0 || C == 0) return bad;
    const int64_t blocks = (C + CONV_CHANNELS - 1) / CONV_CHANNELS;
    const int parallel = on_threads(&r, C * K, blocks, threads);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t c0 = b * CONV_CHANNELS, c1 = c0 + CONV_CHANNELS < C ? c0 + CONV_CHANNELS : C;
        conv_block(x, C, weight, K, bias, state, &r, c0, c1, silu_after, out);
    }
    return 0;
}


// ---- Gated DeltaNet ----

// Columns [j0, j0 + 8 NV) of one token's update of one head's state S [dk, dv] (decayed by `decay`), its key kn
// and query qn (normalised), its value v, into its output o:
//   u = (decay S)^T k;  d = beta (v - u);  S = decay S + k d^T;  o = S^T q
// decay S is recomputed in the second pass rather than stored by the first: the same bits, one store fewer.
static inline __attribute__((always_inline)) void gdn_columns(float *S, int64_t dk, int64_t dv, int64_t j0, int NV,
                                                              const float *kn, const float *qn, const float *v,
                                                              float decay, float beta, float *o) {
    __m256 u[GDN_COLUMNS / 8], acc[GDN_COLUMNS / 8];
    const __m256 dec = _mm256_set1_ps(decay);
    for (int c = 0; c < NV; c++) u[c] = _mm256_setzero_ps(), acc[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dk; i++) {
        const float *row = S + i * dv + j0;
        const __m256 ki = _mm256_set1_ps(kn[i]);
        for (int c = 0; c < NV; c++) u[c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(row + 8 * c), dec), ki, u[c]);
    }
    const __m256 b = _mm256_set1_ps(beta);
    for (int c = 0; c < NV; c++) u[c] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + j0 + 8 * c), u[c]), b);
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv + j0;
        const __m256 ki = _mm256_set1_ps(kn[i]), qi = _mm256_set1_ps(qn[i]);
        for (int c = 0; c < NV; c++) {
            const __m256 s = _mm256_fmadd_ps(ki, u[c], _mm256_mul_ps(_mm256_loadu_ps(row + 8 * c), dec));
            _mm256_storeu_ps(row + 8 * c, s);
            acc[c] = _mm256_fmadd_ps(s, qi, acc[c]);
        }
    }
    for (int c = 0; c < NV; c++) _mm256_storeu_ps(o + j0 + 8 * c, acc[c]);
}

// the same for one column j past the last full vector, in the lanes' arithmetic
static inline void gdn_column(float *S, int64_t dk, int64_t dv, int64_t j, const float *kn, const float *qn,
                              const float *v, float decay, float beta, float *o) {
    float u = 0.0f, acc = 0.0f;
    for (int64_t i = 0; i < dk; i++) u = fmaf(S[i * dv + j] * decay, kn[i], u);
    const float d = (v[j] - u) * beta;
    for (int64_t i = 0; i < dk; i++) {
        const float s = fmaf(kn[i], d, S[i * dv + j] * decay);
        S[i * dv + j] = s;
        acc = fmaf(s, qn[i], acc);
    }
    o[j] = acc;
}

// The same for 16 lanes: columns [j0, j0 + 16 NV). Each column's arithmetic is the AVX2 lanes' (the sums run over
// rows, not lanes), so the two instruction sets give the same bits.
#define GDN_COLUMNS_512 64
__attribute__((target("avx512f"), always_inline)) static inline void gdn_columns16(
        float *S, int64_t dk, int64_t dv, int64_t j0, int NV, const float *kn, const float *qn, const float *v,
        float decay, float beta, float *o) {
    __m512 u[GDN_COLUMNS_512 / 16], acc[GDN_COLUMNS_512 / 16];
    const __m512 dec = _mm512_set1_ps(decay);
    for (int c = 0; c < NV; c++) u[c] = _mm512_setzero_ps(), acc[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dk; i++) {
        const float *row = S + i * dv + j0;
        const __m512 ki = _mm512_set1_ps(kn[i]);
        for (int c = 0; c < NV; c++)
            u[c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), dec), ki, u[c]);
    }
    const __m512 b = _mm512_set1_ps(beta);
    for (int c = 0; c < NV; c++) u[c] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + j0 + 16 * c), u[c]), b);
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv + j0;
        const __m512 ki = _mm512_set1_ps(kn[i]), qi = _mm512_set1_ps(qn[i]);
        for (int c = 0; c < NV; c++) {
            const __m512 s = _mm512_fmadd_ps(ki, u[c], _mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), dec));
            _mm512_storeu_ps(row + 16 * c, s);
            acc[c] = _mm512_fmadd_ps(s, qi, acc[c]);
        }
    }
    for (int c = 0; c < NV; c++) _mm512_storeu_ps(o + j0 + 16 * c, acc[c]);
}

// the columns from 0 that the AVX-512 passes take: blocks of 64, then of 16; the AVX2 ones take the rest
__attribute__((target("avx512f"))) static int64_t gdn_columns_avx512(float *S, int64_t dk, int64_t dv,
                                                                     const float *kn, const float *qn, const float *v,
                                                                     float decay, float beta, float *o) {
    int64_t j = 0;
    for (; j + GDN_COLUMNS_512 <= dv; j += GDN_COLUMNS_512)
        gdn_columns16(S, dk, dv, j, GDN_COLUMNS_512 / 16, kn, qn, v, decay, beta, o);
    for (; j + 16 <= dv; j += 16) gdn_columns16(S, dk, dv, j, 1, kn, qn, v, decay, beta, o);
    return j;
}

// AVX-512's passes where the CPU has them (kvflow_recurrent_use_avx512): the same bits, fewer instructions
static int gdn_avx512;
void kvflow_recurrent_use_avx512(int yes) { gdn_avx512 = yes && __builtin_cpu_supports("avx512f"); }

// x [dk] l2-normalised (eps 1e-6 inside the root), times `scale`: x / sqrt(sum x^2 + eps) * scale
static inline void l2norm(const float *x, int64_t n, float scale, float *y) {
    const float inv = 1.0f / sqrtf(sum_squares(x, n) + 1e-6f);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * inv * scale;
}

typedef struct {
    const float *q, *k, *v, *g, *beta;
    int64_t Hk, Hv, dk, dv;
    float scale;
    float *state, *out;
} gdn_job;

// v-head h of run `run`, its tokens in order; kq: 2 dk floats of scratch
static void gdn_unit(const gdn_job *J, const state_runs_t *r, int64_t run, int64_t h, float *kq) {
    const int64_t Hk = J->Hk, Hv = J->Hv, dk = J->dk, dv = J->dv, kh = h / (Hv / Hk), a = r->starts[run];
    float *S = J->state + (r->run_slots[run] * Hv + h) * dk * dv, *kn = kq, *qn = kq + dk;
    int64_t snap = first_snapshot(r, a);
    for (int64_t t = a; t < r->starts[run + 1]; t++) {
        l2norm(J->k + (t * Hk + kh) * dk, dk, 1.0f, kn);
        l2norm(J->q + (t * Hk + kh) * dk, dk, J->scale, qn);
        const float *v = J->v + (t * Hv + h) * dv;
        float *o = J->out + (t * Hv + h) * dv;
        const float decay = expf(J->g[t * Hv + h]), beta = J->beta[t * Hv + h];
        int64_t j = gdn_avx512 ? gdn_columns_avx512(S, dk, dv, kn, qn, v, decay, beta, o) : 0;
        for (; j + GDN_COLUMNS <= dv; j += GDN_COLUMNS)
            gdn_columns(S, dk, dv, j, GDN_COLUMNS / 8, kn, qn, v, decay, beta, o);
        for (; j + 8 <= dv; j += 8) gdn_columns(S, dk, dv, j, 1, kn, qn, v, decay, beta, o);
        for (; j < dv; j++) gdn_column(S, dk, dv, j, kn, qn, v, decay, beta, o);
        for (; snap < r->snapshots && r->snapshot_rows[snap] == t; snap++)
            memcpy(J->state + (r->snapshot_slots[snap] * Hv + h) * dk * dv, S, (size_t)(dk * dv) * sizeof(float));
    }
}

// q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], state [slots, Hv, dk, dv], out [T, Hv, dv], all float32; value
// head h reads q/k head h / (Hv / Hk). 0, 1 (out of memory) or 2 (Hv not a multiple of Hk; the runs, check_runs)
int kvflow_gated_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta,
                            int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, float *state, state_runs_t r,
                            float *out, int threads) {
    if (Hk < 1 || Hv < Hk || Hv % Hk || dk < 1 || dv < 1) return 2;
    const int bad = check_runs(&r, T);
    if (bad || r.runs == 0) return bad;
    // the scale as Python's dk ** -0.5, rounded to float32 as torch rounds a scalar factor
    const gdn_job J = {q, k, v, g, beta, Hk, Hv, dk, dv, (float)pow((double)dk, -0.5), state, out};
    const int64_t units = r.runs * Hv;
    const int parallel = on_threads(&r, Hv * dk * dv, units, threads);
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (parallel)
    {
        float *kq = malloc((size_t)(2 * dk) * sizeof(float));
        if (!kq) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++)
            if (kq) gdn_unit(&J, &r, u / Hv, u % Hv, kq);
        free(kq);
    }
    return failed;
}


// ---- Mamba2 selective state update ----

typedef struct {
    const float *x, *dt, *A, *B, *C, *D;
    int64_t H, P, G, N;
    float *state, *out;
} ssm_job;

// head h of run `run`, its tokens in order: per token S = exp(dt A) S + (dt x) B^T; y = S C + D x
static void ssm_unit(const ssm_job *J, const state_runs_t *r, int64_t run, int64_t h) {
    const int64_t H = J->H, P = J->P, G = J->G, N = J->N, gh = h / (H / G), a = r->starts[run];
    float *S = J->state + (r->run_slots[run] * H + h) * P * N;
    int64_t snap = first_snapshot(r, a);
    for (int64_t t = a; t < r->starts[run + 1]; t++) {
        const float dt = J->dt[t * H + h], dA = expf(dt * J->A[h]);
        const float *x = J->x + (t * H + h) * P, *B = J->B + (t * G + gh) * N, *C = J->C + (t * G + gh) * N;
        float *y = J->out + (t * H + h) * P;
        const __m256 dAv = _mm256_set1_ps(dA);
        for (int64_t p = 0; p < P; p++) {
            float *row = S + p * N;
            const float dtx = dt * x[p];
            const __m256 dtxv = _mm256_set1_ps(dtx);
            __m256 acc = _mm256_setzero_ps();
            int64_t n = 0;
            for (; n + 8 <= N; n += 8) {
                const __m256 s = _mm256_fmadd_ps(dtxv, _mm256_loadu_ps(B + n),
                                                 _mm256_mul_ps(_mm256_loadu_ps(row + n), dAv));
                _mm256_storeu_ps(row + n, s);
                acc = _mm256_fmadd_ps(s, _mm256_loadu_ps(C + n), acc);
            }
            float dot = hsum(acc);
            for (; n < N; n++) {
                const float s = fmaf(dtx, B[n], row[n] * dA);
                row[n] = s;
                dot = fmaf(s, C[n], dot);
            }
            y[p] = fmaf(J->D[h], x[p], dot);
        }
        for (; snap < r->snapshots && r->snapshot_rows[snap] == t; snap++)
            memcpy(J->state + (r->snapshot_slots[snap] * H + h) * P * N, S, (size_t)(P * N) * sizeof(float));
    }
}

// x [T, H, P], dt [T, H], A, D [H], B, C [T, G, N], state [slots, H, P, N], out [T, H, P], all float32; head h
// uses group h / (H / G). 0 or 2 (H not a multiple of G; the runs, check_runs)
int kvflow_ssm_scan(const float *x, const float *dt, const float *A, const float *B, const float *C, const float *D,
                    int64_t T, int64_t H, int64_t P, int64_t G, int64_t N, float *state, state_runs_t r, float *out,
                    int threads) {
    if (G < 1 || H < G || H % G || P < 1 || N < 1) return 2;
    const int bad = check_runs(&r, T);
    if (bad || r.runs == 0) return bad;
    const ssm_job J = {x, dt, A, B, C, D, H, P, G, N, state, out};
    const int64_t units = r.runs * H;
    const int parallel = on_threads(&r, H * P * N, units, threads);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
    for (int64_t u = 0; u < units; u++) ssm_unit(&J, &r, u / H, u % H);
    return 0;
}


// ---- the hybrids' gates and norms around the recurrences ----
// The module path (models/qwen3_5.py through kernels/recurrent.py) and the native step (decoder_step.c) both call
// these, so the two compute the same bits. Every value goes through 8-lane arithmetic (a tail of fewer than 8 is
// padded into one vector), so its bits depend on its own inputs alone, not on where it falls in a row.

// f over n floats of x (and y), 8 at a time, the tail through the same vector function
#define LANES_OVER(n, body)                                                                                    \
    do {                                                                                                       \
        int64_t i_ = 0;                                                                                        \
        for (; i_ + 8 <= (n); i_ += 8) body(i_, 8);                                                            \
        if (i_ < (n)) body(i_, (n) - i_);                                                                      \
    } while (0)

static inline __m256 load_n(const float *p, int64_t n) {
    if (n == 8) return _mm256_loadu_ps(p);
    float tmp[8] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(float));
    return _mm256_loadu_ps(tmp);
}

static inline void store_n(float *p, __m256 v, int64_t n) {
    if (n == 8) {
        _mm256_storeu_ps(p, v);
        return;
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    memcpy(p, tmp, (size_t)n * sizeof(float));
}

// 1 / (1 + e^-x), 8 lanes
static inline __m256 sigmoid8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)))));
}

// Gated attention's output gate (Qwen3.5): out[t, j D + i] = x[t, j D + i] * sigmoid(gate[t ldg + j hs + i]) for
// T rows of H heads of D (gate: head j's D values at hs apart within a row, rows ldg apart). out may be x.
void kvflow_sigmoid_mul(const float *x, int64_t T, int64_t H, int64_t D, const float *gate, int64_t ldg, int64_t hs,
                        float *out) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < H; j++) {
            const float *xs = x + (t * H + j) * D, *gs = gate + t * ldg + j * hs;
            float *ys = out + (t * H + j) * D;
#define GATE(i, n) store_n(ys + (i), _mm256_mul_ps(load_n(xs + (i), n), sigmoid8(load_n(gs + (i), n))), n)
            LANES_OVER(D, GATE);
#undef GATE
        }
}

// Gated DeltaNet's per-token gates (Qwen3.5): from each row's b (Hv values) and a (the next Hv), ld apart,
//   beta = sigmoid(b);  g = -e^A_log * softplus(a + dt_bias)   (softplus(x) = log1p(e^x), x past 20 as it is)
// [T, Hv] each. libm's expf and log1pf, once per (token, head).
void kvflow_gdn_gates(const float *ba, int64_t T, int64_t Hv, int64_t ld, const float *A_log, const float *dt_bias,
                      float *beta, float *g) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hv; h++) {
            const float b = ba[t * ld + h], a = ba[t * ld + Hv + h] + dt_bias[h];
            beta[t * Hv + h] = 1.0f / (1.0f + expf(-b));
            g[t * Hv + h] = -expf(A_log[h]) * (a > 20.0f ? a : log1pf(expf(a)));
        }
}

// Gated DeltaNet's output norm (Qwen3.5's RMSNormGated): per row t and value head h of dv values,
//   out = w * (o / sqrt(mean(o^2) + eps)) * silu(z)
// o, out [T, Hv, dv]; z's rows ldz apart (head h at h dv). Rows on OpenMP's threads past a prefill's worth.
void kvflow_gated_rms_norm(const float *o, int64_t T, int64_t Hv, int64_t dv, const float *z, int64_t ldz,
                           const float *w, float eps, float *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T > POOL_ROWS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hv; h++) {
            const float *x = o + (t * Hv + h) * dv, *zs = z + t * ldz + h * dv;
            float *y = out + (t * Hv + h) * dv;
            const __m256 r = _mm256_set1_ps(1.0f / sqrtf(sum_squares(x, dv) / (float)dv + eps));
#define NORM(i, n)                                                                                             \
    store_n(y + (i), _mm256_mul_ps(_mm256_mul_ps(load_n(w + (i), n), _mm256_mul_ps(load_n(x + (i), n), r)),  \
                                   silu8(load_n(zs + (i), n))), n)
            LANES_OVER(dv, NORM);
#undef NORM
        }
}

// Mamba2's time steps (Granite 4.0 H): from each row's H raw values (rows ld apart), dt = softplus(raw + dt_bias)
// (past 20 as it is) clamped to [low, high], [T, H]; and A = -e^A_log [H]. libm's expf and log1pf.
void kvflow_mamba2_gates(const float *raw, int64_t T, int64_t H, int64_t ld, const float *dt_bias, const float *A_log,
                         float low, float high, float *dt, float *A) {
    for (int64_t h = 0; h < H; h++) A[h] = -expf(A_log[h]);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const float a = raw[t * ld + h] + dt_bias[h];
            const float v = a > 20.0f ? a : log1pf(expf(a));
            dt[t * H + h] = fminf(fmaxf(v, low), high);
        }
}

// Mamba2's output norm (Granite 4.0 H's RMSNormGated, the gate first): per row t and group of `group` channels,
//   h = y * silu(z);  out = w * (h / sqrt(mean(h^2) + eps))
// y, out [T, n]; z's rows ldz apart. Rows on OpenMP's threads past a prefill's worth.
void kvflow_gated_group_rms_norm(const float *y, int64_t T, int64_t n, int64_t group, const float *z, int64_t ldz,
                                 const float *w, float eps, float *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T > POOL_ROWS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t g0 = 0; g0 < n; g0 += group) {
            const float *ys = y + t * n + g0, *zs = z + t * ldz + g0, *ws = w + g0;
            float *o = out + t * n + g0;
#define GATE(i, m) store_n(o + (i), _mm256_mul_ps(load_n(ys + (i), m), silu8(load_n(zs + (i), m))), m)
            LANES_OVER(group, GATE);
#undef GATE
            const __m256 r = _mm256_set1_ps(1.0f / sqrtf(sum_squares(o, group) / (float)group + eps));
#define NORM(i, m) store_n(o + (i), _mm256_mul_ps(load_n(ws + (i), m), _mm256_mul_ps(load_n(o + (i), m), r)), m)
            LANES_OVER(group, NORM);
#undef NORM
        }
}
