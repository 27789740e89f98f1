// The entry points that kvflow's kernel files call across files (the linear kernels, attention and norms from moe.c
// and decoder_step.c; moe.c's from decoder_step.c): one declaration each, here. linear.c documents the weights'
// layout, forms and flags; moe.c the experts' and the router's.
#pragma once
#include <stdint.h>

int kvflow_x16_set_format(int bits, int64_t group_bytes);
int kvflow_x16_linear(int bits, const float *x, int64_t M, int64_t K, const uint8_t *codes, const void *wd,
                      const void *wm, int64_t N, float *y, int threads, int flags, int on_pool);
int kvflow_pool_rows(void);
#define KVFLOW_GROUPED_MAX 64      // the most groups (matrices) one kvflow_grouped_linear call takes
int kvflow_grouped_linear(int bits, const float *x, int64_t M, int64_t K, const int64_t *matrix, const int64_t *rows,
                          int64_t groups, const uint8_t *codes, int64_t codes_stride, const void *d, int64_t d_stride,
                          const void *m, int64_t m_stride, int flags, int64_t N, float *y, int threads, int on_pool);
int kvflow_paged_attention(const float *q, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const void *k_cache,
                           const void *v_cache, int64_t block_size, const int64_t *tables, int64_t width,
                           const int64_t *row_seq, const int64_t *positions, float scale, float *out, int threads,
                           int form, int64_t window);
void kvflow_rms_norm(const float *x, int64_t M, int64_t H, const float *w, float eps, float *y, int threads);

// One kind of matrix of every expert of a mixture-of-experts layer (moe.c): [E] matrices, stacked
typedef struct {
    const uint8_t *codes, *scale, *minimum;
    int64_t codes_stride, scale_stride, minimum_stride;   // bytes from one expert's to the next's
    int bits, flags;                                      // the codes' width (a weight format's); the scales' forms (linear.c)
} experts_t;
enum { ROUTE_SOFTMAX_TOPK = 0, ROUTE_SOFTMAX_TOPK_RENORMALIZED = 1, ROUTE_TOPK_SOFTMAX = 2 };   // layers/moe.py's ROUTERS
int kvflow_moe_route(const float *x, int64_t T, int64_t H, const float *router, int64_t E, int64_t k, int rule,
                     int norm_topk_prob, int64_t *ids, float *weights, int threads);
int kvflow_moe_experts(const float *x, int64_t T, int64_t H, const int64_t *ids, const float *weights, int64_t k,
                       int64_t E, int64_t I, experts_t gate_up, int64_t gu_rows, experts_t down, int64_t dn_rows,
                       float *y, int threads);

// A step's runs of rows that continue one state slot each (kernels/recurrent.py's StateBatch; recurrent.c): run i is
// rows starts[i] .. starts[i + 1] - 1 and updates slot run_slots[i]; after row snapshot_rows[i] (ascending), a copy
// of its run's state goes to slot snapshot_slots[i]. `slots`: the state tensors' slot count.
typedef struct {
    const int64_t *starts, *run_slots;
    int64_t runs;
    const int64_t *snapshot_rows, *snapshot_slots;
    int64_t snapshots, slots;
} state_runs_t;
int kvflow_causal_conv1d(const float *x, int64_t T, int64_t C, const float *weight, int64_t K, const float *bias,
                         float *state, state_runs_t runs, int silu_after, float *out, int threads);
int kvflow_gated_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta,
                            int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, float *state,
                            state_runs_t runs, float *out, int threads);
void kvflow_recurrent_use_avx512(int yes);
int kvflow_ssm_scan(const float *x, const float *dt, const float *A, const float *B, const float *C, const float *D,
                    int64_t T, int64_t H, int64_t P, int64_t G, int64_t N, float *state, state_runs_t runs,
                    float *out, int threads);
void kvflow_sigmoid_mul(const float *x, int64_t T, int64_t H, int64_t D, const float *gate, int64_t ldg, int64_t hs,
                        float *out);
void kvflow_gdn_gates(const float *ba, int64_t T, int64_t Hv, int64_t ld, const float *A_log, const float *dt_bias,
                      float *beta, float *g);
void kvflow_gated_rms_norm(const float *o, int64_t T, int64_t Hv, int64_t dv, const float *z, int64_t ldz,
                           const float *w, float eps, float *out, int threads);
void kvflow_mamba2_gates(const float *raw, int64_t T, int64_t H, int64_t ld, const float *dt_bias, const float *A_log,
                         float low, float high, float *dt, float *A);
void kvflow_gated_group_rms_norm(const float *y, int64_t T, int64_t n, int64_t group, const float *z, int64_t ldz,
                                 const float *w, float eps, float *out, int threads);
