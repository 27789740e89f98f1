// The x16 block kernel on AVX-512 VNNI (vpdpbusd): linear.c describes the layout and calls it through x16_block.
// One specialization per code width; a new weight format adds its case here and in linear_x16_avx2.c.
#include "common.h"

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


// the block kernels as `x16_block` calls them: one specialization per code width
#define X16_BY_BITS(KERNEL)                                                                                  \
    switch (bits) {                                                                                          \
    case 4: KERNEL(4, R, w, wd, wm, at, G, q, d, s, qs, K, m, y, N, n0); break;                              \
    case 5: KERNEL(5, R, w, wd, wm, at, G, q, d, s, qs, K, m, y, N, n0); break;                              \
    case 6: KERNEL(6, R, w, wd, wm, at, G, q, d, s, qs, K, m, y, N, n0); break;                              \
    case 8: KERNEL(8, R, w, wd, wm, at, G, q, d, s, qs, K, m, y, N, n0); break;                              \
    }

__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline))
void block_x16_avx512(int bits, int R, const uint8_t *w, scales_t wd, scales_t wm, int64_t at, int64_t G,
                      const int8_t *q, const float *d, const float *s, const int32_t *qs, int64_t K,
                      int64_t m, float *y, int64_t N, int64_t n0) {
    X16_BY_BITS(x16_avx512_of)
}
