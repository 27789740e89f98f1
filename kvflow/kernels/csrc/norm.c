#include "common.h"

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
