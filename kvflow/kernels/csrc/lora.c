#include <omp.h>

#include "common.h"

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
