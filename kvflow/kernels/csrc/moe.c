// A mixture-of-experts layer's experts in one call (layers/moe.py's SparseMoE over kvflow's kernels): the step's
// (row, choice) pairs grouped by expert (a stable counting sort: rows in step order within an expert), each expert
// that any row chose multiplying its rows with the linear kernels of linear.c (gate/up fused, SiLU(gate) *
// up, down), and each row's k outputs summed in its own top-k order. Experts no row chose are not read.
//
// Why one call: at batch 1 a layer runs k experts of two matrices each, and through Python every one of them cost
// its module calls and op dispatches (~0.5 ms a layer measured on a 24-layer, top-8 model), more than the matmuls.
//
// Batch invariance: the linear kernels compute each row alone, whatever the rows beside it; SiLU and the weighted
// sum are per element, in a fixed order. So a row's bits depend on that row alone, at every step size.
//
// Weights: every expert's matrix of one kind in one stacked buffer, expert e at e * stride bytes (codes, scales
// and minimums each), in the kernels' layout (x16; `bits`: the weight format's code width).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

// experts_t (kernels.h): one kind of matrix of every expert, [E] matrices of N (padded: `rows`) x K

// The router: each row's logits x @ router.T, each a dot product in one fixed order (ROUTE_LANES partial sums over
// the row, then added in lane order), so a row's choices do not depend on the rows beside it, the machine's vector
// width or the thread count; then layers/moe.py's rules (ROUTERS), as transformers states them:
//   ROUTE_SOFTMAX_TOPK              softmax over all experts, the top k; divided by their sum when norm_topk_prob
//   ROUTE_SOFTMAX_TOPK_RENORMALIZED the same, always divided by their sum (Mixtral)
//   ROUTE_TOPK_SOFTMAX              the top k logits, then a softmax over those k (GraniteMoE)
// The top k highest first; of equal values the lower expert id first. The module path (layers/moe.py, where the
// experts are on kvflow's kernels) and the native step (decoder_step.c) both call this: the same choices and bits.
#define ROUTE_LANES 16
static float router_dot(const float *x, const float *w, int64_t H) {
    float acc[ROUTE_LANES] = {0};
    int64_t h = 0;
    for (; h + ROUTE_LANES <= H; h += ROUTE_LANES)
        for (int j = 0; j < ROUTE_LANES; j++) acc[j] += x[h + j] * w[h + j];
    for (int j = 0; h < H; h++, j++) acc[j] += x[h] * w[h];
    float sum = 0.0f;
    for (int j = 0; j < ROUTE_LANES; j++) sum += acc[j];
    return sum;
}

static void route_row(const float *x, int64_t H, const float *router, int64_t E, int64_t k, int rule, int norm,
                      float *logits, int64_t *ids, float *weights) {
    float top = -INFINITY;
    for (int64_t e = 0; e < E; e++) {
        logits[e] = router_dot(x, router + e * H, H);
        top = logits[e] > top ? logits[e] : top;
    }
    if (rule != ROUTE_TOPK_SOFTMAX) {        // the probabilities over every expert, in place of the logits
        float sum = 0.0f;
        for (int64_t e = 0; e < E; e++) sum += logits[e] = expf(logits[e] - top);
        for (int64_t e = 0; e < E; e++) logits[e] /= sum;
    }
    for (int64_t j = 0; j < k; j++) {        // selection: k is small (<= 8 in every family here)
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j && !taken; i++) taken = ids[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        ids[j] = best;
        weights[j] = logits[best];
    }
    if (rule == ROUTE_TOPK_SOFTMAX) {        // a softmax over the k chosen logits (weights[0] is their largest)
        const float most = weights[0];
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += weights[j] = expf(weights[j] - most);
        for (int64_t j = 0; j < k; j++) weights[j] /= sum;
    } else if (rule == ROUTE_SOFTMAX_TOPK_RENORMALIZED || norm) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += weights[j];
        for (int64_t j = 0; j < k; j++) weights[j] /= sum;
    }
}

// x [T, H], router [E, H] float32 -> ids [T, k] int64, weights [T, k] float32. Returns 0, 1 (out of memory), 2 (k
// not in 1..E or an unknown rule).
int kvflow_moe_route(const float *x, int64_t T, int64_t H, const float *router, int64_t E, int64_t k, int rule,
                     int norm_topk_prob, int64_t *ids, float *weights, int threads) {
    if (k < 1 || k > E || rule < ROUTE_SOFTMAX_TOPK || rule > ROUTE_TOPK_SOFTMAX) return 2;
    int err = 0;
    // rows apart on OpenMP's threads where the step's other kernels run there (steps of more than the pool's rows)
#pragma omp parallel num_threads(threads) if (T > kvflow_pool_rows() && threads > 1) reduction(| : err)
    {
        float *logits = malloc((size_t)E * sizeof(float));
        if (!logits) err = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            if (logits)
                route_row(x + t * H, H, router, E, k, rule, norm_topk_prob, logits, ids + t * k, weights + t * k);
        free(logits);
    }
    return err;
}

// a [n, I] = SiLU(gate) * up of h's n rows [gate (I) | up (I) | ...], `ld` floats apart; rows apart on OpenMP's
// threads unless the step runs on the pool (each value alone: the same bits either way)
static void silu_mul_rows(const float *h, int64_t ld, int64_t n, int64_t I, float *a, int threads, int on_pool) {
#pragma omp parallel for schedule(static) num_threads(threads) if (!on_pool && threads > 1)
    for (int64_t i = 0; i < n; i++) {
        const float *g = h + i * ld, *u = g + I;
        float *ai = a + i * I;
        for (int64_t c = 0; c < I; c++) ai[c] = g[c] / (1.0f + expf(-g[c])) * u[c];
    }
}

// `on_pool`: the step's other kernels run on kvflow's pool (a step of up to its rows), so these may too; else
// OpenMP's threads, whatever the expert's rows (kvflow_x16_linear says why)
static int expert_linear(const experts_t *w, int64_t e, const float *x, int64_t M, int64_t K, int64_t N, float *y,
                         int threads, int on_pool) {
    const uint8_t *c = w->codes + e * w->codes_stride, *d = w->scale + e * w->scale_stride;
    const uint8_t *m = w->minimum ? w->minimum + e * w->minimum_stride : NULL;
    return kvflow_x16_linear(w->bits, x, M, K, c, d, m, N, y, threads, w->flags, on_pool);
}

// The experts of a step of at most GROUPED_PAIRS (row, choice) pairs: the pairs' rows gathered in expert order, then
// each kind of matrix of every chosen expert in one pool job (kvflow_grouped_linear) instead of one call per expert,
// whose hand-overs cost as much as the matmuls at a few rows an expert. out [P, H] by pair. -1: the pool did not
// take the gate/up job, or the step has more groups than one job holds (nothing done: run the per-expert calls);
// 0; 1: out of memory. Larger steps (long prefill chunks) keep the per-expert calls, whose buffers hold one
// expert's rows at a time, not the whole step's.
#define GROUPED_PAIRS 1024
static int grouped_experts(const float *x, int64_t H, int64_t k, int64_t E, int64_t I, const experts_t *gu,
                           int64_t gu_rows, const experts_t *dn, int64_t dn_rows, const int64_t *count,
                           const int64_t *order, int64_t P, float *out, int threads, int on_pool) {
    int64_t matrix[KVFLOW_GROUPED_MAX], rows[KVFLOW_GROUPED_MAX], groups = 0;
    for (int64_t e = 0; e < E; e++) {
        if (count[e + 1] == count[e]) continue;
        if (groups == KVFLOW_GROUPED_MAX) return -1;
        matrix[groups] = e;
        rows[groups++] = count[e + 1] - count[e];
    }
    float *xs = malloc((size_t)P * (size_t)H * sizeof(float));
    float *h = malloc((size_t)P * (size_t)gu_rows * sizeof(float));
    float *a = malloc((size_t)P * (size_t)I * sizeof(float));
    float *o = malloc((size_t)P * (size_t)dn_rows * sizeof(float));
    int err = !xs || !h || !a || !o;
    if (!err) {
        for (int64_t i = 0; i < P; i++) memcpy(xs + i * H, x + (order[i] / k) * H, (size_t)H * sizeof(float));
        err = kvflow_grouped_linear(gu->bits, xs, P, H, matrix, rows, groups, gu->codes, gu->codes_stride,
                                    gu->scale, gu->scale_stride, gu->minimum, gu->minimum_stride, gu->flags, gu_rows,
                                    h, threads, on_pool);
    }
    if (!err) {
        silu_mul_rows(h, gu_rows, P, I, a, threads, on_pool);
        err = kvflow_grouped_linear(dn->bits, a, P, I, matrix, rows, groups, dn->codes, dn->codes_stride,
                                    dn->scale, dn->scale_stride, dn->minimum, dn->minimum_stride, dn->flags, dn_rows,
                                    o, threads, on_pool);
        // the pool taken by another thread between the two jobs: the down matrices one call per expert
        for (int64_t i = 0, row = 0; err == -1 && i < groups; row += rows[i++])
            if ((err = expert_linear(dn, matrix[i], a + row * I, rows[i], I, dn_rows, o + row * dn_rows, threads,
                                     on_pool)))
                break;
        if (err == -1) err = 0;
    }
    if (!err)
        for (int64_t i = 0; i < P; i++) memcpy(out + order[i] * H, o + i * dn_rows, (size_t)H * sizeof(float));
    free(xs); free(h); free(a); free(o);
    return err;
}

// x [T, H]; ids [T, k] int64 (each 0..E-1), weights [T, k] float32, each row's choices highest weight first;
// gate_up: [E] of [gu_rows >= 2I, H] (gate rows 0..I-1, up rows I..2I-1), down: [E] of [dn_rows >= H, I];
// y [T, H] = sum_j weights[t, j] * down(SiLU(gate(x_t)) * up(x_t)) of expert ids[t, j], added in j order.
// Returns 0, 1 (out of memory), 2 (an expert id out of range or an unknown kind).
int kvflow_moe_experts(const float *x, int64_t T, int64_t H, const int64_t *ids, const float *weights, int64_t k,
                       int64_t E, int64_t I, experts_t gate_up, int64_t gu_rows, experts_t down, int64_t dn_rows,
                       float *y, int threads) {
    const int64_t P = T * k;
    const int on_pool = T <= kvflow_pool_rows();
    int64_t *count = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *order = malloc((size_t)(P ? P : 1) * sizeof(int64_t));
    float *out = malloc((size_t)(P ? P : 1) * (size_t)H * sizeof(float));
    int err = !count || !order || !out;
    for (int64_t p = 0; !err && p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) err = 2;
    if (!err) {
        for (int64_t p = 0; p < P; p++) count[ids[p] + 1]++;
        for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];          // count[e]: where expert e's pairs start
        int64_t *next = malloc((size_t)E * sizeof(int64_t));
        int64_t most = 0;
        if (!next) err = 1;
        else {
            memcpy(next, count, (size_t)E * sizeof(int64_t));
            for (int64_t p = 0; p < P; p++) order[next[ids[p]]++] = p;      // stable: pairs in step order
            for (int64_t e = 0; e < E; e++)
                if (count[e + 1] - count[e] > most) most = count[e + 1] - count[e];
            free(next);
        }
        if (!err && P <= GROUPED_PAIRS) {
            err = grouped_experts(x, H, k, E, I, &gate_up, gu_rows, &down, dn_rows, count, order, P, out, threads,
                                  on_pool);
            if (err != -1) most = 0;          // done (or failed): the loop below has nothing to do
            else err = 0;
        }
        float *xs = err || !most ? NULL : malloc((size_t)most * (size_t)H * sizeof(float));
        float *h = err || !most ? NULL : malloc((size_t)most * (size_t)gu_rows * sizeof(float));
        float *a = err || !most ? NULL : malloc((size_t)most * (size_t)I * sizeof(float));
        float *o = err || !most ? NULL : malloc((size_t)most * (size_t)dn_rows * sizeof(float));
        if (!err && most && (!xs || !h || !a || !o)) err = 1;
        for (int64_t e = 0; !err && most && e < E; e++) {
            const int64_t n = count[e + 1] - count[e], *pairs = order + count[e];
            if (!n) continue;
            for (int64_t i = 0; i < n; i++) memcpy(xs + i * H, x + (pairs[i] / k) * H, (size_t)H * sizeof(float));
            err = expert_linear(&gate_up, e, xs, n, H, gu_rows, h, threads, on_pool);
            if (err) break;
            silu_mul_rows(h, gu_rows, n, I, a, threads, on_pool);
            err = expert_linear(&down, e, a, n, I, dn_rows, o, threads, on_pool);
            for (int64_t i = 0; !err && i < n; i++)
                memcpy(out + pairs[i] * H, o + i * dn_rows, (size_t)H * sizeof(float));
        }
        free(xs); free(h); free(a); free(o);
    }
    for (int64_t t = 0; !err && t < T; t++) {
        float *yt = y + t * H;
        const float *o0 = out + t * k * H, w0 = weights[t * k];
        for (int64_t c = 0; c < H; c++) yt[c] = o0[c] * w0;
        for (int64_t j = 1; j < k; j++) {
            const float *oj = out + (t * k + j) * H, wj = weights[t * k + j];
            for (int64_t c = 0; c < H; c++) yt[c] += oj[c] * wj;
        }
    }
    free(count); free(order); free(out);
    return err;
}
