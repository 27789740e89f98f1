// Activations rounded to int8 per group of 32, as every linear kernel reads them (llama.cpp's Q8 activations).
#include "common.h"

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

// x [M, K] rounded as pool_activations does, into buffers of the caller's own (free_activations after); threads:
// OpenMP's, for big calls; 1: out of memory
int own_activations(const float *x, int64_t M, int64_t K, int threads, int8_t **q, float **d, float **s,
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

void free_activations(int8_t *q, float *d, float *s, int32_t *qs) {
    free(q); free(d); free(s); free(qs);
}

// x [M, K] rounded to int8 codes per group of QK (quantize_activations) into the pool's buffers (a worker late from
// this call may still read them); 1: out of memory
int pool_activations(const float *x, int64_t M, int64_t K, int8_t **q, float **d, float **s, int32_t **qs) {
    const int64_t G = K / QK;
    *q = pool_buffer(POOL_LINEAR_Q, M * K);
    *d = pool_buffer(POOL_LINEAR_D, M * G * (int64_t)sizeof(float));
    *s = pool_buffer(POOL_LINEAR_S, M * G * (int64_t)sizeof(float));
    *qs = pool_buffer(POOL_LINEAR_QS, 2 * M * G * (int64_t)sizeof(int32_t));
    if (!*q || !*d || !*s || !*qs) return 1;
    quantize_activations(x, M, K, *q, *d, *s, *qs, 1);
    return 0;
}
