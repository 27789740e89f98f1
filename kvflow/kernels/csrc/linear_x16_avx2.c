// The x16 block kernel on AVX2 (vpmaddubsw), the same bits as linear_x16_avx512.c's: linear.c describes the layout.
// One specialization per code width; a new weight format adds its case here and in linear_x16_avx512.c.
#include "common.h"

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
    case 8: KERNEL(8, R, w, wd, wm, at, G, q, d, s, qs, K, m, y, N, n0); break;                              \
    }

__attribute__((target("avx2,fma,f16c"), noinline))
void block_x16_avx2(int bits, int R, const uint8_t *w, scales_t wd, scales_t wm, int64_t at, int64_t G,
                           const int8_t *q, const float *d, const float *s, const int32_t *qs, int64_t K, int64_t m,
                           float *y, int64_t N, int64_t n0) {
    X16_BY_BITS(x16_avx2_of)
}
