// A whole step of a Llama-family decoder in one native call: for every layer RMSNorm, the fused QKV projection
// (+ bias), the per-head Q/K norms where the model has them (Qwen3, Gemma 3), rotary embedding (each layer its own
// tables: Gemma 3's local layers have their own base), the K/V written into the paged cache, paged attention, the
// output projection (normed again on Gemma 3's "sandwich") and the residual, RMSNorm, gate/up, SiLU(gate) * up or
// tanh-GELU(gate) * up, down (normed again on Gemma 3) and the residual; then the final RMSNorm. A mixture-of-experts
// layer (Qwen3-MoE, OLMoE, GraniteMoE, Mixtral) has the router and its experts in place of the MLP (moe.c's
// calls, which the module path makes too), OLMoE's Q/K norms span the whole projection, and Granite scales each
// block's output before its residual add. A hybrid's recurrent layers take attention's place: LFM2's short
// convolution (in_proj, B * x through the causal convolution over the request's state slot, C times it, out_proj)
// and Qwen3.5's Gated DeltaNet (in_proj_qkvz and in_proj_ba, the convolution with SiLU, the gates, the delta rule
// over the slot's state, the gated norm, out_proj) and Granite 4.0 H's Mamba2 (in_proj, the convolution with SiLU,
// the time steps, the selective scan over the slot's state, the gated norm, out_proj), on recurrent.c's kernels as
// the module path calls them; Qwen3.5's attention gates its output (attention * sigmoid(gate)), Granite 4.0 H's
// rotates nothing (NoPE).
//
// Why: driven from Python, a batch-1 step of the embedded model is ~210 operator calls, each with Python, the
// dispatcher and ctypes around a kernel of a few microseconds, and that came to as much time as the matmuls
// (docs/performance.md, "Where a decode step's time goes"). Here Python hands over the step's tensors once.
//
// The kernels are linear.c's, attention.c's and norm.c's, called as the layers call them, so the matmuls, attention
// and norms are the same bits as the module path's; the elementwise work is written as torch's eager ops compute it (each product
// and sum rounded on its own: no contraction into FMAs, below; SiLU with torch's own vector exp, passed in), so
// the whole step is the same bits too. Every row is computed alone, in one fixed order (batch invariance holds).
// What the caller checks (runner/native_step.py): the model is one this step computes, and the cache holds
// float32, bfloat16 or float16.
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };          // attention.c's forms that this step writes

typedef struct {
    const void *codes, *scale, *minimum;   // minimum: 4-bit codes only
    const float *bias;                     // NULL: none
    int64_t rows, width;                   // output features, and the kernel's output width (padded to 16)
    int bits, flags;                       // the codes' width (kernels/formats.py); the scales' forms (linear.c)
} step_linear;

typedef struct {
    const float *weight;                   // NULL: the layer has no such norm
    float eps;
} step_norm;

// A mixture-of-experts layer's router and experts (moe.c)
typedef struct {
    const float *router;                   // [experts, hidden] float32; NULL: the layer's MLP is dense
    int64_t experts, top_k, intermediate, gu_rows, dn_rows;
    int rule, norm_topk_prob;              // ROUTE_* (kernels.h)
    experts_t gate_up, down;
} step_moe;

enum { MIX_ATTENTION = 0, MIX_SHORT_CONV = 1, MIX_GATED_DELTA_NET = 2, MIX_MAMBA2 = 3 };

// A hybrid's recurrent mixer in attention's place (its in_proj / in_proj_qkvz is the layer's qkv, its out_proj the
// layer's o)
typedef struct {
    int kind;                              // MIX_*
    step_linear in_ba;                     // Gated DeltaNet's [b; a] projection
    const float *conv_weight, *conv_bias;  // [channels, K], [channels] or NULL
    int64_t channels, K;
    // [slots, K - 1, channels]; [slots, Hv, dk, dv] (Gated DeltaNet) or [slots, H, P, N] (Mamba2)
    float *conv_state, *state;
    const float *A_log, *dt_bias, *D;      // [heads]; D: Mamba2's skip
    step_norm norm;                        // the gated output norm: dv wide (Gated DeltaNet), H P (Mamba2)
    // Gated DeltaNet: Hk, Hv, dk, dv. Mamba2: the B/C groups G, the heads H, the state size N, the head size P
    int64_t key_heads, value_heads, key_dim, value_dim;
    int64_t norm_group;                    // Mamba2: the output norm's group of channels
    float dt_low, dt_high;                 // Mamba2: the time step's clamp
    const int64_t *out_order;              // the value columns out_proj reads, in its order; NULL: as they are
} step_recurrent;

typedef struct {
    // input: before attention; mlp_in: before the MLP (Llama's post_attention_layernorm); attn_out / mlp_out: on
    // the attention's and the MLP's outputs before each residual add (Gemma 3's post-attention and
    // post-feedforward norms); q / k: over each head of q and of k before rotary (Qwen3, Gemma 3)
    step_norm input, mlp_in, attn_out, mlp_out, q, k;
    float scale;                           // the attention's softmax scale
    int64_t window;                        // sliding window (0: none)
    const float *cos, *sin_signed;         // [positions, rotary_dim] (layers/rotary.py: the sign in the table)
    void *k_cache, *v_cache;               // [blocks, block_size, kv_heads, head_dim]
    step_linear qkv, o, gate_up, down;     // gate_up / down: a dense MLP's (unused where moe.router is set)
    int qk_whole;                          // q / k: one norm over the whole projection (OLMoE), not per head
    float residual_scale;                  // each block's output times this before its residual add (1: none)
    step_moe moe;
    int gated;                             // q's rows: per head D query then D gate values; attention * sigmoid(gate)
    step_recurrent rec;                    // kind MIX_ATTENTION: the layer is attention
} step_layer;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {
    int64_t layers, T, hidden, heads, kv_heads, head_dim, rotary_dim, intermediate, block_size, table_width;
    int kv_form, threads, act;
    const int64_t *positions, *slots, *tables, *row_seq;
    const float *final_norm;
    float final_eps;
    const void *exp_vec, *tanh_vec;        // torch's vector exp and tanh (Sleef's, exp_lanes wide); NULL: libm's only
    int exp_lanes;
    state_runs_t runs;                     // the rows' runs over the recurrent layers' state slots (hybrids)
} step_shape;

static int linear(const step_linear *w, const float *x, int64_t M, int64_t K, float *y, int threads) {
    const int err = kvflow_x16_linear(w->bits, x, M, K, w->codes, w->scale, w->minimum, w->width, y, threads,
                                      w->flags, 1);
    if (!err && w->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < w->rows; n++) y[m * w->width + n] += w->bias[n];
    return err;
}

// one head's rotation, as RotaryEmbedding.rotate: x * cos + swap_halves(x) * sin_signed over the first R dims
static void rotate(const float *x, const float *cos, const float *sin, int64_t D, int64_t R, float *out) {
    const int64_t half = R / 2;
    for (int64_t i = 0; i < R; i++) out[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
    for (int64_t i = R; i < D; i++) out[i] = x[i];
}

// float32 -> the cache's element type, as torch's `_store` converts (float16: clamped to its range first)
static void store(const float *x, int64_t n, void *dst, int form) {
    if (form == KV_F32) {
        memcpy(dst, x, (size_t)n * sizeof(float));
    } else if (form == KV_F16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) {
            const float v = x[i] < -65504.0f ? -65504.0f : x[i] > 65504.0f ? 65504.0f : x[i];
            d[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
        }
    } else {                                // bfloat16, round to nearest even (torch's conversion)
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &x[i], 4);
            d[i] = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
        }
    }
}

// out = SiLU(gate) * up as torch's eager ops compute it (ATen's silu kernel: x / (1 + exp(-x)) over vectors of its
// CPU capability, two at a time with Sleef's exp, the rest one by one with libm's; then the product)
typedef __m256 (*exp8_fn)(__m256);
typedef __m512 (*exp16_fn)(__m512);

__attribute__((target("avx512f"))) static int64_t silu_mul16(const float *gate, const float *up, int64_t n,
                                                             float *out, exp16_fn exp16) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32)
        for (int64_t v = j; v < j + 32; v += 16) {
            const __m512 x = _mm512_loadu_ps(gate + v);
            const __m512 e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign)));
            _mm512_storeu_ps(out + v, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(up + v)));
        }
    return j;
}

static void silu_mul(const float *gate, const float *up, int64_t n, float *out, const step_shape *s) {
    int64_t j = 0;
    if (s->exp_vec && s->exp_lanes == 8) {
        const exp8_fn torch_exp8 = (exp8_fn)s->exp_vec;     // torch's own (Sleef), not common.h's
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; j + 16 <= n; j += 16)
            for (int64_t v = j; v < j + 16; v += 8) {
                const __m256 x = _mm256_loadu_ps(gate + v);
                const __m256 e = torch_exp8(_mm256_xor_ps(x, sign));
                _mm256_storeu_ps(out + v, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)),
                                                        _mm256_loadu_ps(up + v)));
            }
    } else if (s->exp_vec && s->exp_lanes == 16) {
        j = silu_mul16(gate, up, n, out, (exp16_fn)s->exp_vec);
    }
    for (; j < n; j++) out[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
}

// out = GELU_tanh(gate) * up as torch's eager ops compute it (ATen's GeluKernel, approximate="tanh": 0.5 * x *
// (1 + tanh(kBeta * (x + kKappa * x^3))) over vectors of its CPU capability, two at a time with Sleef's tanh, the
// rest one by one with libm's; then the product). ATen's AVX2 and AVX512 builds contract x + kKappa * x^3 into
// one FMA (GCC's default), in the vectors and in the tail alike; its scalar-only build does not.
#define GELU_BETA ((float)(1.41421356237309504880 * 1.12837916709551257390 * 0.5))   // M_SQRT2 * M_2_SQRTPI / 2
#define GELU_KAPPA 0.044715f

__attribute__((target("avx512f"))) static int64_t gelu_mul16(const float *gate, const float *up, int64_t n,
                                                             float *out, exp16_fn tanh16) {
    const __m512 beta = _mm512_set1_ps(GELU_BETA), kappa = _mm512_set1_ps(GELU_KAPPA);
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32)
        for (int64_t v = j; v < j + 32; v += 16) {
            const __m512 x = _mm512_loadu_ps(gate + v);
            const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
            const __m512 inner = _mm512_mul_ps(beta, _mm512_fmadd_ps(kappa, cube, x));
            const __m512 g = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, tanh16(inner)));
            _mm512_storeu_ps(out + v, _mm512_mul_ps(g, _mm512_loadu_ps(up + v)));
        }
    return j;
}

static void gelu_mul(const float *gate, const float *up, int64_t n, float *out, const step_shape *s) {
    int64_t j = 0;
    if (s->tanh_vec && s->exp_lanes == 8) {
        const exp8_fn tanh8 = (exp8_fn)s->tanh_vec;
        const __m256 beta = _mm256_set1_ps(GELU_BETA), kappa = _mm256_set1_ps(GELU_KAPPA);
        const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
        for (; j + 16 <= n; j += 16)
            for (int64_t v = j; v < j + 16; v += 8) {
                const __m256 x = _mm256_loadu_ps(gate + v);
                const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
                const __m256 inner = _mm256_mul_ps(beta, _mm256_fmadd_ps(kappa, cube, x));
                const __m256 g = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh8(inner)));
                _mm256_storeu_ps(out + v, _mm256_mul_ps(g, _mm256_loadu_ps(up + v)));
            }
    } else if (s->tanh_vec && s->exp_lanes == 16) {
        j = gelu_mul16(gate, up, n, out, (exp16_fn)s->tanh_vec);
    }
    for (; j < n; j++) {
        const float x = gate[j], cube = x * x * x;
        const float inner = GELU_BETA * (s->tanh_vec ? fmaf(GELU_KAPPA, cube, x) : x + GELU_KAPPA * cube);
        out[j] = 0.5f * x * (1.0f + tanhf(inner)) * up[j];
    }
}

// h += y's rows, each times `scale` first unless it is 1 (as torch computes h + y * scale: the product rounded)
static void add_rows(float *h, const float *y, int64_t M, int64_t H, int64_t ld, float scale) {
    for (int64_t m = 0; m < M; m++)
        if (scale == 1.0f)
            for (int64_t j = 0; j < H; j++) h[m * H + j] += y[m * ld + j];
        else
            for (int64_t j = 0; j < H; j++) h[m * H + j] += y[m * ld + j] * scale;
}

// out [M, H] = the norm of x's M rows of H, x's rows `ld` apart (a projection's output, padded to its width)
static void norm_rows(const float *x, int64_t M, int64_t H, int64_t ld, const step_norm *n, float *out, int threads) {
    if (ld == H) {
        kvflow_rms_norm(x, M, H, n->weight, n->eps, out, threads);
        return;
    }
    for (int64_t m = 0; m < M; m++) kvflow_rms_norm(x + m * ld, 1, H, n->weight, n->eps, out + m * H, threads);
}

// h += y's rows, or their norm first where the layer norms its block's output (Gemma 3), times the layer's
// residual scale (Granite)
static void add_block_output(float *h, const float *y, int64_t M, int64_t H, int64_t ld, const step_layer *L,
                             const step_norm *n, float *tmp, int threads) {
    if (n->weight) {
        norm_rows(y, M, H, ld, n, tmp, threads);
        add_rows(h, tmp, M, H, H, L->residual_scale);
    } else {
        add_rows(h, y, M, H, ld, L->residual_scale);
    }
}

// out [T, H] = the layer's experts over its T normed rows: each row's top k by the router, then their weighted sum
static int moe_block(const step_moe *m, const float *x, int64_t T, int64_t H, float *out, int threads) {
    int64_t *ids = malloc((size_t)(T * m->top_k) * sizeof(int64_t));
    float *weights = malloc((size_t)(T * m->top_k) * sizeof(float));
    int err = !ids || !weights;
    if (!err)
        err = kvflow_moe_route(x, T, H, m->router, m->experts, m->top_k, m->rule, m->norm_topk_prob, ids, weights,
                               threads);
    if (!err)
        err = kvflow_moe_experts(x, T, H, ids, weights, m->top_k, m->experts, m->intermediate, m->gate_up,
                                 m->gu_rows, m->down, m->dn_rows, out, threads);
    free(ids);
    free(weights);
    return err;
}

// The scratch a step of T rows works in, in floats: the normed rows, the widest projection's output, q and the
// attention's output, the MLP's activations, a recurrent mixer's rows, and one row's gathered, normed and rotated
// heads. The caller owns it (runner/native_step.py keeps one that grows), so a dense step allocates nothing (a MoE
// layer's router and experts allocate their own working buffers, as they do on the module path).
static int64_t widest_projection(const step_shape *s, const step_layer *layers) {
    int64_t widest = 0;
    for (int64_t l = 0; l < s->layers; l++) {
        const step_layer *L = &layers[l];
        const int64_t w[4] = {L->qkv.width, L->o.width, L->gate_up.width, L->down.width};
        for (int i = 0; i < 4; i++) widest = w[i] > widest ? w[i] : widest;
    }
    return widest;
}

// a recurrent mixer's floats per row (short convolution: B * x, the convolution's output, C times it; Gated
// DeltaNet: [b; a], the convolution's input and output, the gates, the delta rule's output, its norm, reordered)
static int64_t recurrent_row(const step_recurrent *r) {
    if (r->kind == MIX_SHORT_CONV) return 3 * r->channels;
    if (r->kind == MIX_GATED_DELTA_NET)
        return r->in_ba.width + 2 * r->channels + 2 * r->value_heads + 3 * r->value_heads * r->value_dim;
    if (r->kind == MIX_MAMBA2) return 2 * r->channels + 2 * r->value_heads + 2 * r->value_heads * r->value_dim;
    return 0;
}

static int64_t widest_recurrent_row(const step_shape *s, const step_layer *layers) {
    int64_t widest = 0;
    for (int64_t l = 0; l < s->layers; l++) {
        const int64_t w = recurrent_row(&layers[l].rec);
        widest = w > widest ? w : widest;
    }
    return widest;
}

// (a layer with experts beside a dense MLP, Granite 4.0 H's shared one, keeps the experts' sum in one more
// [T, hidden] while the MLP runs)
int64_t kvflow_decoder_step_scratch(const step_shape *s, const step_layer *layers, int64_t T) {
    return T * (2 * s->hidden + widest_projection(s, layers) + 2 * s->heads * s->head_dim + s->intermediate
                + widest_recurrent_row(s, layers))
           + (2 * s->heads + 2 * s->kv_heads) * s->head_dim;
}

// LFM2's short convolution over the T normed rows x: proj = in_proj(x) (rows B, C, x'), then out_proj(C * conv(B *
// x')) into proj (rows L->o.width apart), as models/lfm2.py's ShortConv computes it
static int short_conv(const step_shape *s, const step_layer *L, const float *x, float *proj, float *work) {
    const step_recurrent *r = &L->rec;
    const int64_t T = s->T, C = r->channels, W = L->qkv.width;
    float *bx = work, *y = bx + T * C, *cy = y + T * C;
    int err = linear(&L->qkv, x, T, s->hidden, proj, s->threads);
    if (err) return err;
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < C; c++) bx[t * C + c] = proj[t * W + c] * proj[t * W + 2 * C + c];
    if ((err = kvflow_causal_conv1d(bx, T, C, r->conv_weight, r->K, NULL, r->conv_state, s->runs, 0, y, s->threads)))
        return err;
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < C; c++) cy[t * C + c] = proj[t * W + C + c] * y[t * C + c];
    return linear(&L->o, cy, T, C, proj, s->threads);
}

// Qwen3.5's Gated DeltaNet over the T normed rows x, its out_proj's output into proj (rows L->o.width apart), as
// models/qwen3_5.py's GatedDeltaNet computes it
static int gated_delta_net(const step_shape *s, const step_layer *L, const float *x, float *proj, float *work) {
    const step_recurrent *r = &L->rec;
    const int64_t T = s->T, C = r->channels, W = L->qkv.width, Wba = r->in_ba.width;
    const int64_t Hk = r->key_heads, Hv = r->value_heads, dk = r->key_dim, dv = r->value_dim;
    const int64_t kd = Hk * dk, vd = Hv * dv;
    float *ba = work, *conv_in = ba + T * Wba, *conv_out = conv_in + T * C, *beta = conv_out + T * C;
    float *g = beta + T * Hv, *o = g + T * Hv, *normed = o + T * vd, *ordered = normed + T * vd;
    int err = linear(&L->qkv, x, T, s->hidden, proj, s->threads);
    if (!err) err = linear(&r->in_ba, x, T, s->hidden, ba, s->threads);
    if (err) return err;
    for (int64_t t = 0; t < T; t++) memcpy(conv_in + t * C, proj + t * W, (size_t)C * sizeof(float));
    if ((err = kvflow_causal_conv1d(conv_in, T, C, r->conv_weight, r->K, NULL, r->conv_state, s->runs, 1, conv_out,
                                    s->threads)))
        return err;
    float *q = conv_in, *k = q + T * kd, *v = k + T * kd;      // the convolution's input is spent: q, k, v apart
    for (int64_t t = 0; t < T; t++) {
        memcpy(q + t * kd, conv_out + t * C, (size_t)kd * sizeof(float));
        memcpy(k + t * kd, conv_out + t * C + kd, (size_t)kd * sizeof(float));
        memcpy(v + t * vd, conv_out + t * C + 2 * kd, (size_t)vd * sizeof(float));
    }
    kvflow_gdn_gates(ba, T, Hv, Wba, r->A_log, r->dt_bias, beta, g);
    if ((err = kvflow_gated_delta_rule(q, k, v, g, beta, T, Hk, Hv, dk, dv, r->state, s->runs, o, s->threads)))
        return err;
    kvflow_gated_rms_norm(o, T, Hv, dv, proj + C, W, r->norm.weight, r->norm.eps, normed, s->threads);
    if (r->out_order) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t c = 0; c < vd; c++) ordered[t * vd + c] = normed[t * vd + r->out_order[c]];
        normed = ordered;
    }
    return linear(&L->o, normed, T, vd, proj, s->threads);
}

// Granite 4.0 H's Mamba2 mixer over the T normed rows x, its out_proj's output into proj (rows L->o.width apart), as
// models/granite_hybrid.py's Mamba2Mixer computes it: in_proj's rows z, then x B C (the convolution's channels),
// then dt; the convolution with SiLU, the time steps, the selective scan over the slot's state, the gated norm
static int mamba2(const step_shape *s, const step_layer *L, const float *x, float *proj, float *work) {
    const step_recurrent *r = &L->rec;
    const int64_t T = s->T, C = r->channels, W = L->qkv.width;
    const int64_t G = r->key_heads, H = r->value_heads, N = r->key_dim, P = r->value_dim, inner = H * P;
    float *conv_in = work, *conv_out = conv_in + T * C, *dt = conv_out + T * C, *A = dt + T * H;
    float *y = A + T * H, *normed = y + T * inner;
    int err = linear(&L->qkv, x, T, s->hidden, proj, s->threads);
    if (err) return err;
    for (int64_t t = 0; t < T; t++) memcpy(conv_in + t * C, proj + t * W + inner, (size_t)C * sizeof(float));
    if ((err = kvflow_causal_conv1d(conv_in, T, C, r->conv_weight, r->K, r->conv_bias, r->conv_state, s->runs, 1,
                                    conv_out, s->threads)))
        return err;
    float *xs = conv_in, *B = xs + T * inner, *Cm = B + T * G * N;     // the convolution's input is spent
    for (int64_t t = 0; t < T; t++) {
        memcpy(xs + t * inner, conv_out + t * C, (size_t)inner * sizeof(float));
        memcpy(B + t * G * N, conv_out + t * C + inner, (size_t)(G * N) * sizeof(float));
        memcpy(Cm + t * G * N, conv_out + t * C + inner + G * N, (size_t)(G * N) * sizeof(float));
    }
    kvflow_mamba2_gates(proj + inner + C, T, H, W, r->dt_bias, r->A_log, r->dt_low, r->dt_high, dt, A);
    if ((err = kvflow_ssm_scan(xs, dt, A, B, Cm, r->D, T, H, P, G, N, r->state, s->runs, y, s->threads))) return err;
    kvflow_gated_group_rms_norm(y, T, inner, r->norm_group, proj, W, r->norm.weight, r->norm.eps, normed, s->threads);
    return linear(&L->o, normed, T, inner, proj, s->threads);
}

// The attention block over the T normed rows x, its output projection into proj (rows L->o.width apart): the
// fused QKV projection, per row the Q/K norms, rotary embedding and the K/V written into the paged cache, paged
// attention (gated on Qwen3.5), the output projection. q, attn: [T, Hq D] each; heads, k, query: one row's.
static int attention_block(const step_shape *s, const step_layer *L, const float *x, float *proj, float *q,
                           float *attn, float *heads, float *k, float *query) {
    const int64_t T = s->T, H = s->hidden, Hq = s->heads, Hkv = s->kv_heads, D = s->head_dim;
    const int64_t row_bytes = Hkv * D * (s->kv_form == KV_F32 ? 4 : 2);
    const int threads = s->threads;
    int err = linear(&L->qkv, x, T, H, proj, threads);
    if (err) return err;
    // a gated attention's q rows hold each head's D query values then its D gate values
    const int64_t q_stride = L->gated ? 2 * D : D;
    for (int64_t t = 0; t < T; t++) {
        const float *row = proj + t * L->qkv.width, *qs = row, *ks = row + Hq * q_stride;
        const int64_t p = s->positions[t], slot = s->slots[t];
        const float *cos = L->cos ? L->cos + p * s->rotary_dim : NULL;
        const float *sin = L->cos ? L->sin_signed + p * s->rotary_dim : NULL;
        if (L->gated) {
            for (int64_t j = 0; j < Hq; j++) memcpy(query + j * D, row + j * 2 * D, (size_t)D * sizeof(float));
            qs = query;
        }
        if (L->q.weight && L->qk_whole) {      // the whole q and k projections normed, then rotated (OLMoE)
            kvflow_rms_norm(qs, 1, Hq * D, L->q.weight, L->q.eps, heads, 1);
            kvflow_rms_norm(ks, 1, Hkv * D, L->k.weight, L->k.eps, heads + Hq * D, 1);
            qs = heads, ks = heads + Hq * D;
        } else if (L->q.weight) {      // each head normed alone, then rotated (as the layer does)
            kvflow_rms_norm(qs, Hq, D, L->q.weight, L->q.eps, heads, 1);
            kvflow_rms_norm(ks, Hkv, D, L->k.weight, L->k.eps, heads + Hq * D, 1);
            qs = heads, ks = heads + Hq * D;
        }
        if (L->cos) {
            for (int64_t j = 0; j < Hq; j++) rotate(qs + j * D, cos, sin, D, s->rotary_dim, q + (t * Hq + j) * D);
            for (int64_t j = 0; j < Hkv; j++) rotate(ks + j * D, cos, sin, D, s->rotary_dim, k + j * D);
        } else {                       // no position embedding on this layer (NoPE: Granite 4.0 H's attention)
            memcpy(q + t * Hq * D, qs, (size_t)(Hq * D) * sizeof(float));
            memcpy(k, ks, (size_t)(Hkv * D) * sizeof(float));
        }
        store(k, Hkv * D, (char *)L->k_cache + slot * row_bytes, s->kv_form);
        store(row + Hq * q_stride + Hkv * D, Hkv * D, (char *)L->v_cache + slot * row_bytes, s->kv_form);
    }
    err = kvflow_paged_attention(q, T, Hq, Hkv, D, L->k_cache, L->v_cache, s->block_size, s->tables, s->table_width,
                                 s->row_seq, s->positions, L->scale, attn, threads, s->kv_form, L->window);
    if (err) return err;
    if (L->gated) kvflow_sigmoid_mul(attn, T, Hq, D, proj + D, L->qkv.width, 2 * D, attn);
    return linear(&L->o, attn, T, Hq * D, proj, threads);
}

// h [T, hidden]: the embedded tokens in, the residual stream after the last layer out (overwritten); out [T, hidden]:
// the final norm of it; scratch: kvflow_decoder_step_scratch(s, layers, T) floats. Nonzero: a kernel ran out of
// memory (1) or refused the shapes (2).
int kvflow_decoder_step(const step_shape *s, const step_layer *layers, float *h, float *out, float *scratch) {
    const int64_t T = s->T, H = s->hidden, Hq = s->heads, Hkv = s->kv_heads, D = s->head_dim, I = s->intermediate;
    const int threads = s->threads;
    if (T == 0) return 0;
    const int64_t widest = widest_projection(s, layers);
    float *normed = scratch, *proj = normed + T * H, *q = proj + T * widest, *attn = q + T * Hq * D;
    float *act = attn + T * Hq * D, *work = act + T * I, *heads = work + T * widest_recurrent_row(s, layers);
    float *k = heads + (Hq + Hkv) * D, *query = k + Hkv * D, *experts = query + Hq * D;
    int err = 0;
    for (int64_t l = 0; l < s->layers && !err; l++) {
        const step_layer *L = &layers[l];
        kvflow_rms_norm(h, T, H, L->input.weight, L->input.eps, normed, threads);
        err = L->rec.kind == MIX_SHORT_CONV        ? short_conv(s, L, normed, proj, work)
              : L->rec.kind == MIX_GATED_DELTA_NET ? gated_delta_net(s, L, normed, proj, work)
              : L->rec.kind == MIX_MAMBA2          ? mamba2(s, L, normed, proj, work)
                                                   : attention_block(s, L, normed, proj, q, attn, heads, k, query);
        if (err) break;
        add_block_output(h, proj, T, H, L->o.width, L, &L->attn_out, normed, threads);
        kvflow_rms_norm(h, T, H, L->mlp_in.weight, L->mlp_in.eps, normed, threads);
        if (L->moe.router && !L->gate_up.codes) {
            if ((err = moe_block(&L->moe, normed, T, H, proj, threads))) break;
            add_block_output(h, proj, T, H, H, L, &L->mlp_out, normed, threads);
            continue;
        }
        if (L->moe.router && (err = moe_block(&L->moe, normed, T, H, experts, threads))) break;
        if ((err = linear(&L->gate_up, normed, T, H, proj, threads))) break;
        for (int64_t t = 0; t < T; t++) {
            const float *gate = proj + t * L->gate_up.width;
            if (s->act == ACT_GELU_TANH)
                gelu_mul(gate, gate + I, I, act + t * I, s);
            else
                silu_mul(gate, gate + I, I, act + t * I, s);
        }
        if ((err = linear(&L->down, act, T, I, proj, threads))) break;
        if (L->moe.router)           // the experts' sum plus the shared MLP's output (as the module adds them)
            for (int64_t t = 0; t < T; t++) {
                float *y = proj + t * L->down.width;
                for (int64_t j = 0; j < H; j++) y[j] = experts[t * H + j] + y[j];
            }
        add_block_output(h, proj, T, H, L->down.width, L, &L->mlp_out, normed, threads);
    }
    if (!err) kvflow_rms_norm(h, T, H, s->final_norm, s->final_eps, out, threads);
    return err;
}
