/* One Llama-family (or Gemma 2 / 3) decoder layer in a single call, for decode steps on the CPU
 * with GGUF or dense float32 / bfloat16 weights (pagedllm/kernels/cpu_layer.py builds and
 * loads this file). It runs the same kernels the layer's modules call one by one from Python
 * (gguf_cpu.c, dense_cpu.c, cpu_ops.c, compiled into this library), in the same order on
 * the same buffers, so its results are
 * bit-identical to that path; what it saves is the Python between them (about 10 calls
 * and their tensors per layer).
 *
 *   normed = rms_norm(x, ln1)          qkv = normed @ Wqkv.T (+ bias)
 *   (q, k = rms_norm of each head, Qwen3's)                             rope(q, k)
 *   attn = paged_attention(q, k, v)    o = attn @ Wo.T
 *   s = x + o, normed = rms_norm(s, ln2)
 *   gu = normed @ Wgate_up.T           y = s + (silu(gate) * up) @ Wdown.T
 *
 * Gemma's form: every norm scales by (1 + w) (norm_offset), GELU's tanh form in place of
 * SiLU, and the attention's and the MLP's outputs each normed before their residual add
 * (post_attn, post_mlp): s = x + rms_norm(o, post_attn), y = s + rms_norm(down, post_mlp);
 * Gemma 2's attention soft-caps its scores (soft_cap), Gemma 3's norms each head.
 */
#include "gguf_cpu.c"
#include "dense_cpu.c"
#include "dense_amx.c"
#include "cpu_ops.c"

/* The "types" of dense weights (GGML types are not negative): float32 or bfloat16 rows,
 * row_bytes their stride. */
#define DENSE_F32 (-1)
#define DENSE_BF16 (-2)

typedef struct {
    int64_t tokens;
    const int64_t *positions;
    const int64_t *slot_mapping;
    int64_t num_seqs;
    const int64_t *q_start, *q_end, *ctx_len;
    const int32_t *block_tables;
    int64_t bt_stride;
    int64_t int8; /* 8-bit activations for GGUF products of this many rows or more (0: never) */
    int64_t nthreads;
    /* Batch-invariant mode: every product in panels, one row included (the modules'
     * choice then, gguf_matmul.gguf_linear), so a row's result ignores the batch. */
    int64_t invariant;
} step_args;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    const void *ln1, *ln2; /* float32, or bfloat16 for the bfloat16 layer */
    const uint8_t *qkv, *o, *gate_up, *down;
    int64_t qkv_type, o_type, gate_up_type, down_type; /* GGML types, or DENSE_F32/_BF16 */
    int64_t qkv_row_bytes, o_row_bytes, gate_up_row_bytes, down_row_bytes;
    const float *cos_table, *sin_table;
    int64_t table_stride, rot_dim;
    void *cache; /* float32, or bfloat16 for the bfloat16 layer */
    int64_t num_slots, block_size, window;
    float eps1, eps2, scale, pad;
    /* The Q/K/V products' bias (Qwen2's), float32 or bfloat16 (qkv_bias_bf16); NULL: none. */
    const void *qkv_bias;
    int64_t qkv_bias_bf16;
    /* The RMSNorms of each query and each key head (Qwen3's; weights of head_dim, of the
     * layer's type), before the rotary embedding; NULL: none. */
    const void *q_norm, *k_norm;
    float eps_q, eps_k;
    /* Added to every norm's weights (Gemma's 1; else 0), and the norms of the attention's
     * and the MLP's outputs before their residual adds (Gemma 3's; NULL: none). */
    float norm_offset, eps_post_attn, eps_post_mlp, pad2;
    const void *post_attn, *post_mlp;
    /* The MLP's activation: ACT_SILU or ACT_GELU_TANH (cpu_ops.py's GATED_KERNELS). */
    int64_t activation;
    /* The attention scores' soft cap (Gemma 2's; 0: none). */
    float soft_cap, pad3;
} layer_args;

#define ACT_SILU 0
#define ACT_GELU_TANH 1

/* The bias added to T rows of n outputs as the modules add it, out += bias.to(out.dtype):
 * the float32 layer's sums widen a bfloat16 bias exactly; the bfloat16 layer's round the
 * bias to bfloat16 first, then each sum once. */
static float bias_at(const layer_args *L, int64_t j) {
    return L->qkv_bias_bf16 ? from_bf16(((const uint16_t *)L->qkv_bias)[j])
                            : ((const float *)L->qkv_bias)[j];
}

static void add_bias(const layer_args *L, float *y, int64_t T, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        const float b = bias_at(L, j);
        for (int64_t t = 0; t < T; t++) y[t * n + j] += b;
    }
}

static void add_bias_bf16(const layer_args *L, uint16_t *y, int64_t T, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        const float b = from_bf16(to_bf16(bias_at(L, j)));
        for (int64_t t = 0; t < T; t++) y[t * n + j] = to_bf16(from_bf16(y[t * n + j]) + b);
    }
}

/* Each token's query and key heads normed in place, as the modules norm them: one call a
 * token (a token's heads are adjacent rows, the next token's are not), each row's result
 * its own whatever the rows beside it or the threads. */
static void qk_norms(const layer_args *L, float *qkv, int64_t T, int64_t nqkv) {
    const int64_t D = L->head_dim, nq = L->heads * D;
    const float off = L->norm_offset;
    for (int64_t t = 0; t < T; t++) {
        float *q = qkv + t * nqkv;
        pagedllm_rms_norm(q, D, NULL, NULL, (const float *)L->q_norm, off, L->eps_q, q, D,
                          L->heads, D, 1);
        pagedllm_rms_norm(q + nq, D, NULL, NULL, (const float *)L->k_norm, off, L->eps_k,
                          q + nq, D, L->kv_heads, D, 1);
    }
}

static void qk_norms_bf16(const layer_args *L, uint16_t *qkv, int64_t T, int64_t nqkv) {
    const int64_t D = L->head_dim, nq = L->heads * D;
    const float off = L->norm_offset;
    for (int64_t t = 0; t < T; t++) {
        uint16_t *q = qkv + t * nqkv;
        pagedllm_rms_norm_bf16(q, D, NULL, NULL, (const uint16_t *)L->q_norm, off, L->eps_q, q,
                               D, L->heads, D, 1);
        pagedllm_rms_norm_bf16(q + nq, D, NULL, NULL, (const uint16_t *)L->k_norm, off,
                               L->eps_k, q + nq, D, L->kv_heads, D, 1);
    }
}

/* A dense weight's product, as the modules' (batch_invariant.linear): the panels in
 * batch-invariant mode, else for PAGEDLLM_AMX_MIN_ROWS or more bfloat16 rows the AMX kernel
 * where the CPU has it, else the small-row kernel (the layer then takes no more rows than
 * it does; cpu_layer.py checks). */
static int dense_product(const step_args *S, int64_t qtype, const uint8_t *w, int64_t n,
                         int64_t k, const void *x, int x_bf16, int64_t m, void *y) {
    const int w_bf16 = qtype == DENSE_BF16;
    if (S->invariant)
        return pagedllm_dense_matmul_panels(w, w_bf16, n, k, x, m, k, y, n, (int)S->nthreads,
                                            x_bf16, x_bf16);
    if (w_bf16 && x_bf16 && m >= PAGEDLLM_AMX_MIN_ROWS) {
        const int status = pagedllm_dense_matmul_amx((const uint16_t *)w, n, k, x, m, k, y, 1,
                                                     n, (int)S->nthreads);
        if (status != -1) return status;
    }
    return pagedllm_dense_matmul_small(w, w_bf16, n, k, x, x_bf16, m, k, y, x_bf16, n,
                                       (int)S->nthreads, 0);
}

static int product(const step_args *S, int64_t qtype, const uint8_t *raw, int64_t n,
                   int64_t row_bytes, int64_t k, const float *x, int64_t m, float *y) {
    if (qtype < 0) return dense_product(S, qtype, raw, n, k, x, 0, m, y);
    if (S->invariant) { /* (without 8-bit panels, the 8-bit row loop at every count) */
        int status = -1;
        if (S->int8 > 0)
            status = pagedllm_gguf_matmul_q8p((int)qtype, raw, n, row_bytes, k, x, m, k, y, n,
                                              (int)S->nthreads, 0, 0);
        if (status == -1 && S->int8 > 0)
            status = pagedllm_gguf_matmul_q8((int)qtype, raw, n, row_bytes, k, x, m, k, y, n,
                                             (int)S->nthreads);
        if (status == -1)
            status = pagedllm_gguf_matmul_panels((int)qtype, raw, n, row_bytes, k, x, m, k, y, n,
                                                 (int)S->nthreads, 0, 0);
        return status;
    }
    if (S->int8 > 0 && m >= S->int8) {
        const int status = pagedllm_gguf_matmul_q8((int)qtype, raw, n, row_bytes, k, x, m, k, y,
                                                   n, (int)S->nthreads);
        if (status != -1) return status;
    }
    return pagedllm_gguf_matmul((int)qtype, raw, n, row_bytes, k, x, m, k, y, n, (int)S->nthreads);
}

/* The bfloat16 layer's products: bfloat16 rows in and out; 8-bit activations from S->int8
 * rows, one row by the row kernel on its exact widening (rounded once; Q8_0 weights, whose
 * row kernel is slower than the bfloat16 one, keep that), more in panels (the modules'
 * choice, gguf_matmul.gguf_linear). */
static int product_bf16(const step_args *S, int64_t qtype, const uint8_t *raw, int64_t n,
                        int64_t row_bytes, int64_t k, const uint16_t *x, int64_t m,
                        uint16_t *y) {
    if (qtype < 0) return dense_product(S, qtype, raw, n, k, x, 1, m, y);
    if (S->invariant)
        return S->int8 > 0 ? pagedllm_gguf_matmul_q8p((int)qtype, raw, n, row_bytes, k, x, m, k, y,
                                                      n, (int)S->nthreads, 1, 1)
                           : pagedllm_gguf_matmul_panels((int)qtype, raw, n, row_bytes, k, x, m,
                                                         k, y, n, (int)S->nthreads, 1, 1);
    if (S->int8 > 0 && m >= S->int8 && m > 1) {
        const int status = pagedllm_gguf_matmul_q8p((int)qtype, raw, n, row_bytes, k, x, m, k, y,
                                                    n, (int)S->nthreads, 1, 1);
        if (status != -1) return status;
    } else if (S->int8 > 0 && m >= S->int8 && qtype != T_Q8_0) {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(k + n));
        if (buf == NULL) return -2;
        for (int64_t i = 0; i < k; i++) buf[i] = from_bf16(x[i]);
        const int status = pagedllm_gguf_matmul_q8((int)qtype, raw, n, row_bytes, k, buf, 1, k,
                                                   buf + k, n, (int)S->nthreads);
        if (status == 0)
            for (int64_t j = 0; j < n; j++) y[j] = to_bf16(buf[k + j]);
        free(buf);
        if (status != -1) return status;
    }
    return pagedllm_gguf_matmul_bf16((int)qtype, raw, n, row_bytes, k, x, m, k, y, n,
                                     (int)S->nthreads, 1);
}

/* 0 on success; -1/-2 as the kernels it calls (unsupported shape or type, no memory). */
int pagedllm_llama_layer(const layer_args *L, const step_args *S, const float *x, float *y) {
    const int64_t T = S->tokens, H = L->hidden, D = L->head_dim;
    const int64_t nq = L->heads * D, nkv = L->kv_heads * D, nqkv = nq + 2 * nkv, I = L->inter;
    const int nt = (int)S->nthreads;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(T * (H + nqkv + nq + H + H + H + 2 * I + I)));
    if (buf == NULL) return -2;
    float *normed = buf, *qkv = normed + T * H, *attn = qkv + T * nqkv, *o = attn + T * nq;
    float *sum = o + T * H, *normed2 = sum + T * H, *gu = normed2 + T * H, *act = gu + T * 2 * I;
    float *down = y; /* the down projection lands in y, then the residual is added */
    int status;
    const float off = L->norm_offset;
    pagedllm_rms_norm(x, H, NULL, NULL, (const float *)L->ln1, off, L->eps1, normed, H, T, H, nt);
    status = product(S, L->qkv_type, L->qkv, nqkv, L->qkv_row_bytes, H, normed, T, qkv);
    if (status != 0) goto done;
    if (L->qkv_bias != NULL) add_bias(L, qkv, T, nqkv);
    if (L->q_norm != NULL) qk_norms(L, qkv, T, nqkv);
    pagedllm_rotary_neox(qkv, nqkv, L->heads, qkv + nq, nqkv, L->kv_heads, D, S->positions, T,
                         L->cos_table, L->sin_table, L->table_stride, L->rot_dim, nt);
    status = pagedllm_paged_attention(qkv, nqkv, qkv + nq, nqkv, qkv + nq + nkv, nqkv, L->cache,
                                      L->num_slots, L->block_size, S->slot_mapping, T, L->heads,
                                      L->kv_heads, D, S->num_seqs, S->q_start, S->q_end,
                                      S->ctx_len, S->block_tables, S->bt_stride, L->scale,
                                      L->window, attn, nq, nt, L->soft_cap);
    if (status != 0) goto done;
    status = product(S, L->o_type, L->o, H, L->o_row_bytes, nq, attn, T, o);
    if (status != 0) goto done;
    if (L->post_attn != NULL) { /* s = x + rms_norm(o), then its norm (the modules' order) */
        pagedllm_rms_norm(o, H, NULL, NULL, (const float *)L->post_attn, off, L->eps_post_attn,
                          o, H, T, H, nt);
        for (int64_t i = 0; i < T * H; i++) sum[i] = x[i] + o[i];
        pagedllm_rms_norm(sum, H, NULL, NULL, (const float *)L->ln2, off, L->eps2, normed2, H, T,
                          H, nt);
    } else {
        pagedllm_rms_norm(o, H, x, sum, (const float *)L->ln2, off, L->eps2, normed2, H, T, H, nt);
    }
    status = product(S, L->gate_up_type, L->gate_up, 2 * I, L->gate_up_row_bytes, H, normed2, T, gu);
    if (status != 0) goto done;
    if (L->activation == ACT_GELU_TANH)
        pagedllm_gelu_tanh_mul(gu, 2 * I, gu + I, 2 * I, act, I, T, I, nt);
    else
        pagedllm_silu_mul(gu, 2 * I, gu + I, 2 * I, act, I, T, I, nt);
    status = product(S, L->down_type, L->down, H, L->down_row_bytes, I, act, T, down);
    if (status != 0) goto done;
    if (L->post_mlp != NULL)
        pagedllm_rms_norm(down, H, NULL, NULL, (const float *)L->post_mlp, off, L->eps_post_mlp,
                          down, H, T, H, nt);
    for (int64_t i = 0; i < T * H; i++) y[i] = sum[i] + down[i];
done:
    free(buf);
    return status;
}

/* The same layer for bfloat16 models (hidden states, weights' products, norms and the KV
 * cache in bfloat16; AVX512-BF16): the bfloat16 kernels the modules call one by one, in
 * the same order, rounding where they round: norms, products, RoPE and SiLU-mul in
 * bfloat16; attention on the queries, keys and values widened to float32 (as the cpu
 * backend widens them), its output rounded; the closing residual add rounded once. */
int pagedllm_llama_layer_bf16(const layer_args *L, const step_args *S, const uint16_t *x,
                              uint16_t *y) {
    const int64_t T = S->tokens, H = L->hidden, D = L->head_dim;
    const int64_t nq = L->heads * D, nkv = L->kv_heads * D, nqkv = nq + 2 * nkv, I = L->inter;
    const int nt = (int)S->nthreads;
    const uint16_t *ln1 = (const uint16_t *)L->ln1, *ln2 = (const uint16_t *)L->ln2;
    const float off = L->norm_offset;
    /* bfloat16 buffers, then the float32 ones of the attention */
    const size_t halves = (size_t)(T * (H + nqkv + nq + H + H + H + 2 * I + I + H));
    const size_t floats = (size_t)(T * (nqkv + nq));
    uint16_t *hbuf = (uint16_t *)malloc(sizeof(uint16_t) * halves);
    float *fbuf = (float *)malloc(sizeof(float) * floats);
    int status = -2;
    if (hbuf == NULL || fbuf == NULL) goto done;
    uint16_t *normed = hbuf, *qkv = normed + T * H, *attn = qkv + T * nqkv, *o = attn + T * nq;
    uint16_t *sum = o + T * H, *normed2 = sum + T * H, *gu = normed2 + T * H, *act = gu + T * 2 * I;
    uint16_t *down = act + T * I;
    float *qkv32 = fbuf, *attn32 = qkv32 + T * nqkv;
    pagedllm_rms_norm_bf16(x, H, NULL, NULL, ln1, off, L->eps1, normed, H, T, H, nt);
    status = product_bf16(S, L->qkv_type, L->qkv, nqkv, L->qkv_row_bytes, H, normed, T, qkv);
    if (status != 0) goto done;
    if (L->qkv_bias != NULL) add_bias_bf16(L, qkv, T, nqkv);
    if (L->q_norm != NULL) qk_norms_bf16(L, qkv, T, nqkv);
    pagedllm_rotary_neox_bf16(qkv, nqkv, L->heads, qkv + nq, nqkv, L->kv_heads, D, S->positions, T,
                              L->cos_table, L->sin_table, L->table_stride, L->rot_dim, nt);
    for (int64_t i = 0; i < T * nqkv; i++) qkv32[i] = from_bf16(qkv[i]);
    status = pagedllm_paged_attention_bf16(qkv32, nqkv, qkv32 + nq, nqkv, qkv32 + nq + nkv, nqkv,
                                           L->cache, L->num_slots, L->block_size, S->slot_mapping,
                                           T, L->heads, L->kv_heads, D, S->num_seqs, S->q_start,
                                           S->q_end, S->ctx_len, S->block_tables, S->bt_stride,
                                           L->scale, L->window, attn32, nq, nt, L->soft_cap);
    if (status != 0) goto done;
    for (int64_t i = 0; i < T * nq; i++) attn[i] = to_bf16(attn32[i]);
    status = product_bf16(S, L->o_type, L->o, H, L->o_row_bytes, nq, attn, T, o);
    if (status != 0) goto done;
    if (L->post_attn != NULL) {
        pagedllm_rms_norm_bf16(o, H, NULL, NULL, (const uint16_t *)L->post_attn, off,
                               L->eps_post_attn, o, H, T, H, nt);
        for (int64_t i = 0; i < T * H; i++) sum[i] = to_bf16(from_bf16(x[i]) + from_bf16(o[i]));
        pagedllm_rms_norm_bf16(sum, H, NULL, NULL, ln2, off, L->eps2, normed2, H, T, H, nt);
    } else {
        pagedllm_rms_norm_bf16(o, H, x, sum, ln2, off, L->eps2, normed2, H, T, H, nt);
    }
    status = product_bf16(S, L->gate_up_type, L->gate_up, 2 * I, L->gate_up_row_bytes, H, normed2,
                          T, gu);
    if (status != 0) goto done;
    if (L->activation == ACT_GELU_TANH)
        pagedllm_gelu_tanh_mul_bf16(gu, 2 * I, gu + I, 2 * I, act, I, T, I, nt);
    else
        pagedllm_silu_mul_bf16(gu, 2 * I, gu + I, 2 * I, act, I, T, I, nt);
    status = product_bf16(S, L->down_type, L->down, H, L->down_row_bytes, I, act, T, down);
    if (status != 0) goto done;
    if (L->post_mlp != NULL)
        pagedllm_rms_norm_bf16(down, H, NULL, NULL, (const uint16_t *)L->post_mlp, off,
                               L->eps_post_mlp, down, H, T, H, nt);
    for (int64_t i = 0; i < T * H; i++) y[i] = to_bf16(from_bf16(sum[i]) + from_bf16(down[i]));
done:
    free(hbuf);
    free(fbuf);
    return status;
}
