// The entry points of native_kernels.c that the other native files (moe_kernels.c, decoder_step.c) call: one
// declaration each, here. native_kernels.c documents their layouts, forms and flags.
#pragma once
#include <stdint.h>

int kvflow_q4_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const void *d,
                     const void *m, int64_t N, float *y, int threads, int flags);
int kvflow_q8_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const void *d, int64_t N,
                     float *y, int threads, int flags);
int kvflow_q5_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const void *d, int64_t N,
                     float *y, int threads, int flags);
#define KVFLOW_GROUPED_MAX 64      // the most groups (matrices) one kvflow_grouped_linear call takes
int kvflow_grouped_linear(int bits, const float *x, int64_t M, int64_t K, const int64_t *matrix, const int64_t *rows,
                          int64_t groups, const uint8_t *codes, int64_t codes_stride, const void *d, int64_t d_stride,
                          const void *m, int64_t m_stride, int flags, int64_t N, float *y, int threads);
int kvflow_paged_attention(const float *q, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const void *k_cache,
                           const void *v_cache, int64_t block_size, const int64_t *tables, int64_t width,
                           const int64_t *row_seq, const int64_t *positions, float scale, float *out, int threads,
                           int form, int64_t window);
void kvflow_rms_norm(const float *x, int64_t M, int64_t H, const float *w, float eps, float *y, int threads);
