/* Fused elementwise kernels and paged attention for CPUs (pagedllm/kernels/cpu_ops.py
 * builds and loads this file on first use, with -march=native for the CPU it runs on, so
 * the loops below are vectorised for AVX-512 or AVX2, whichever this machine has).
 *
 * Float32, and bfloat16 for the elementwise ones (float32 inside, rounded where the torch
 * reference in bfloat16 rounds); each has a torch reference (kernels/norms.py, kernels/rotary.py,
 * kernels/attention.py) and a test against it. Built with -ffp-contract=off, so the
 * elementwise kernels round exactly like the reference, operation by operation (RoPE is
 * bit-exact); reductions (the RMS, attention's dot products and softmax) are summed in
 * another order than torch's and agree to float32 rounding.
 *
 * Plain C, no torch headers: called through ctypes with raw pointers; tensors are given
 * by a data pointer and a row ("token") stride in elements, the last dimension dense.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* exp(x) for float32 in plain branch-free C (so loops over it vectorise), within 2 ulp
 * of expf over the range softmax and SiLU use; underflows to 0 below -87.3, saturates
 * above 88.7. Cephes' polynomial on a Cody-Waite reduced argument. */
static inline float fast_expf(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (vectorises where floorf may not). */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_FAST_EXP8 1
/* fast_expf on 8 lanes, operation for operation (the same bits where the caller keeps
 * fp-contract off; a NaN stays NaN). */
static inline __attribute__((always_inline)) __m256 fast_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.7f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
    const __m256 big = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(
        _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), big), big);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
    __m256 q = _mm256_set1_ps(1.9875691500e-4f);
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(1.3981999507e-3f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(8.3334519073e-3f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(4.1665795894e-2f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(1.6666665459e-1f));
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(5.0000001201e-1f));
    q = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(q, r), r), r),
                      _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(q, _mm256_castsi256_ps(e));
}

#endif

/* float32 -> bfloat16 rounded to nearest even, as torch converts (NaN -> 0x7FC0). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* x rounded to bfloat16 and widened back: the value a bfloat16 tensor holds. */
static inline float round_bf16(float x) { return from_bf16(to_bf16(x)); }

/* ---- RMSNorm ------------------------------------------------------------------------- */

/* out = (offset + w) * (r / sqrt(mean(r^2) + eps)) per row, where r = x, or with a
 * residual r = residual + x, which is also stored in sum (the decoder's "add, then
 * norm"; sum may be residual itself). The mean of squares is summed in double and
 * rounded once to float32. Rows of residual and sum are dense (stride h).
 *
 * One body for rows of type T read by LOAD and written by STORE; ROUND is where the torch
 * reference rounds in T before its last product (kernels/norms.py: w * hidden.to(dtype)).
 * bfloat16 rows (bfloat16 models) thus round as torch's bfloat16 ops do: the residual sum
 * once, then w * round(r / rms), or with an offset round(r / rms * (offset + w)). */
#define RMS_NORM(name, T, LOAD, STORE, ROUND)                                                  \
    void name(const T *x, int64_t x_stride, const T *residual, T *sum, const T *w, float offset, \
              float eps, T *out, int64_t o_stride, int64_t rows, int64_t h, int nthreads) {    \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (rows >= 16)")     \
        for (int64_t r = 0; r < rows; r++) {                                                   \
            const T *src = x + r * x_stride;                                                   \
            if (residual != NULL) {                                                            \
                const T *res = residual + r * h;                                               \
                T *total = sum + r * h;                                                        \
                for (int64_t i = 0; i < h; i++) total[i] = STORE(LOAD(res[i]) + LOAD(src[i]));  \
                src = total;                                                                   \
            }                                                                                  \
            double ss = 0.0;                                                                   \
            _Pragma("omp simd reduction(+ : ss)")                                              \
            for (int64_t i = 0; i < h; i++) {                                                  \
                const float v = LOAD(src[i]);                                                  \
                ss += (double)(v * v);                                                         \
            }                                                                                  \
            const float var = (float)(ss / (double)h);                                         \
            const float inv = 1.0f / sqrtf(var + eps);                                         \
            T *dst = out + r * o_stride;                                                       \
            if (offset != 0.0f) {                                                              \
                for (int64_t i = 0; i < h; i++)                                                \
                    dst[i] = STORE((LOAD(src[i]) * inv) * (offset + LOAD(w[i])));              \
            } else {                                                                           \
                for (int64_t i = 0; i < h; i++)                                                \
                    dst[i] = STORE(LOAD(w[i]) * ROUND(LOAD(src[i]) * inv));                    \
            }                                                                                  \
        }                                                                                      \
    }

static inline float same_f32(float v) { return v; }

RMS_NORM(pagedllm_rms_norm, float, same_f32, same_f32, same_f32)
RMS_NORM(pagedllm_rms_norm_bf16, uint16_t, from_bf16, to_bf16, round_bf16)

/* ---- Rotary embedding (NeoX layout), in place ---------------------------------------- */

/* Rotates heads of q [T, nq, head_dim] and k [T, nk, head_dim] (token strides q_ts, k_ts)
 * by the rows pos[t] of the cos/sin tables [*, rot_dim] (row stride table_stride): the
 * two halves of the first rot_dim dims are paired, the rest pass through. The same
 * operations as x * cos + rotate_half(x) * sin, so the same rounding. */
static inline void rotate_head(float *x, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] + (-x2) * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
}

/* The rotary kernel for heads of type T rotated by ROTATE (float32 tables either way). */
#define ROTARY_NEOX(name, T, ROTATE)                                                          \
    void name(T *q, int64_t q_ts, int64_t nq, T *k, int64_t k_ts, int64_t nk, int64_t head_dim, \
              const int64_t *pos, int64_t tokens, const float *cos_table,                    \
              const float *sin_table, int64_t table_stride, int64_t rot_dim, int nthreads) {  \
        const int64_t half = rot_dim / 2;                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (tokens >= 16)")   \
        for (int64_t t = 0; t < tokens; t++) {                                                \
            const float *c = cos_table + pos[t] * table_stride;                               \
            const float *s = sin_table + pos[t] * table_stride;                               \
            for (int64_t h = 0; h < nq; h++) ROTATE(q + t * q_ts + h * head_dim, c, s, half); \
            for (int64_t h = 0; h < nk; h++) ROTATE(k + t * k_ts + h * head_dim, c, s, half); \
        }                                                                                     \
    }

ROTARY_NEOX(pagedllm_rotary_neox, float, rotate_head)

/* bfloat16 heads, rounded as the torch reference in bfloat16 rounds: the table rows
 * rounded to bfloat16, each product and the sum rounded (bit-exact with it). */
static inline void rotate_head_bf16(uint16_t *x, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = from_bf16(x[i]), x2 = from_bf16(x[i + half]);
        const float a = round_bf16(x1 * round_bf16(c[i])), b = round_bf16(-x2 * round_bf16(s[i]));
        const float a2 = round_bf16(x2 * round_bf16(c[i + half]));
        const float b2 = round_bf16(x1 * round_bf16(s[i + half]));
        x[i] = to_bf16(a + b);
        x[i + half] = to_bf16(a2 + b2);
    }
}

ROTARY_NEOX(pagedllm_rotary_neox_bf16, uint16_t, rotate_head_bf16)

/* ---- act(gate) * up: SiLU, or GELU's tanh form ------------------------------------------ */

static inline float silu(float v) { return v / (1.0f + fast_expf(-v)); }

/* GELU's tanh approximation (transformers' gelu_pytorch_tanh, Gemma's activation) as
 * x * sigmoid(2u), u = sqrt(2/pi) * (x + 0.044715 x^3): the same function as
 * 0.5 x (1 + tanh(u)), on fast_expf as SiLU is (within a few ulp of torch's, which
 * computes the tanh; more exact where 1 + tanh(u) cancels). */
static inline float gelu_tanh(float v) {
    const float inner = v + 0.044715f * (v * v * v);
    return v / (1.0f + fast_expf(-1.5957691216057308f * inner));
}

#ifdef HAVE_FAST_EXP8
/* silu and gelu_tanh on eight lanes, operation for operation (the same bits). */
static inline __attribute__((always_inline)) __m256 silu8(__m256 v) {
    const __m256 e = fast_exp8(_mm256_xor_ps(v, _mm256_set1_ps(-0.0f)));
    return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

static inline __attribute__((always_inline)) __m256 gelu_tanh8(__m256 v) {
    const __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
    const __m256 inner = _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(0.044715f), v3));
    const __m256 e = fast_exp8(_mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f), inner));
    return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
#endif

/* One body for both activations (gelu: GELU's tanh form, else SiLU; a constant at each
 * call, so each exported kernel compiles to its own loop). */
static inline __attribute__((always_inline)) void gated_mul_row(
    int gelu, const float *restrict g, const float *restrict u, float *restrict o, int64_t n) {
    int64_t i = 0;
#ifdef HAVE_FAST_EXP8
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(g + i);
        const __m256 a = gelu ? gelu_tanh8(v) : silu8(v);
        _mm256_storeu_ps(o + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) o[i] = (gelu ? gelu_tanh(g[i]) : silu(g[i])) * u[i];
}

static inline __attribute__((always_inline)) void gated_mul(
    int gelu, const float *gate, int64_t g_ts, const float *up, int64_t u_ts, float *out,
    int64_t o_ts, int64_t tokens, int64_t n, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (tokens >= 4)
    for (int64_t t = 0; t < tokens; t++)
        gated_mul_row(gelu, gate + t * g_ts, up + t * u_ts, out + t * o_ts, n);
}

/* bfloat16 rows: the activation rounded to bfloat16, then the product rounded, as torch's
 * act(gate) * up rounds in bfloat16. */
static inline __attribute__((always_inline)) void gated_mul_bf16(
    int gelu, const uint16_t *gate, int64_t g_ts, const uint16_t *up, int64_t u_ts,
    uint16_t *out, int64_t o_ts, int64_t tokens, int64_t n, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (tokens >= 4)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *g = gate + t * g_ts, *u = up + t * u_ts;
        uint16_t *o = out + t * o_ts;
        for (int64_t i = 0; i < n; i++) {
            const float v = from_bf16(g[i]);
            o[i] = to_bf16(round_bf16(gelu ? gelu_tanh(v) : silu(v)) * from_bf16(u[i]));
        }
    }
}

void pagedllm_silu_mul(const float *gate, int64_t g_ts, const float *up, int64_t u_ts,
                       float *out, int64_t o_ts, int64_t tokens, int64_t n, int nthreads) {
    gated_mul(0, gate, g_ts, up, u_ts, out, o_ts, tokens, n, nthreads);
}

void pagedllm_silu_mul_bf16(const uint16_t *gate, int64_t g_ts, const uint16_t *up, int64_t u_ts,
                            uint16_t *out, int64_t o_ts, int64_t tokens, int64_t n,
                            int nthreads) {
    gated_mul_bf16(0, gate, g_ts, up, u_ts, out, o_ts, tokens, n, nthreads);
}

void pagedllm_gelu_tanh_mul(const float *gate, int64_t g_ts, const float *up, int64_t u_ts,
                            float *out, int64_t o_ts, int64_t tokens, int64_t n, int nthreads) {
    gated_mul(1, gate, g_ts, up, u_ts, out, o_ts, tokens, n, nthreads);
}

void pagedllm_gelu_tanh_mul_bf16(const uint16_t *gate, int64_t g_ts, const uint16_t *up,
                                 int64_t u_ts, uint16_t *out, int64_t o_ts, int64_t tokens,
                                 int64_t n, int nthreads) {
    gated_mul_bf16(1, gate, g_ts, up, u_ts, out, o_ts, tokens, n, nthreads);
}

/* ---- Paged attention ------------------------------------------------------------------- */

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
static inline void axpy_f32(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}
#pragma GCC pop_options

#define CHUNK 64
#define MAX_HEAD_DIM 512
#define MAX_GROUP 16

/* q . k for four keys at once: four independent sums, so the vector multiply-adds do not
 * wait on each other. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
static inline void dot4_f32(const float *q, const float *k0, const float *k1, const float *k2,
                            const float *k3, int64_t n, float *out) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < n; i++) {
        s0 += q[i] * k0[i];
        s1 += q[i] * k1[i];
        s2 += q[i] * k2[i];
        s3 += q[i] * k3[i];
    }
    out[0] = s0; out[1] = s1; out[2] = s2; out[3] = s3;
}
#pragma GCC pop_options

/* The same two over a bfloat16 cache (keys and values widened exactly): the loop the
 * AVX2 build reads a bfloat16 cache with. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
static inline void axpy_bf16(float *y, float a, const uint16_t *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * from_bf16(x[i]);
}

static inline void dot4_bf16(const float *q, const uint16_t *k0, const uint16_t *k1,
                             const uint16_t *k2, const uint16_t *k3, int64_t n, float *out) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < n; i++) {
        s0 += q[i] * from_bf16(k0[i]);
        s1 += q[i] * from_bf16(k1[i]);
        s2 += q[i] * from_bf16(k2[i]);
        s3 += q[i] * from_bf16(k3[i]);
    }
    out[0] = s0; out[1] = s1; out[2] = s2; out[3] = s3;
}
#pragma GCC pop_options

/* Where keys [j0, j0 + n) of a sequence start in the cache, walking its block table (no
 * division per key): rows[c] = slot * row + off, in elements (row: a slot's nk * head_dim
 * values; off: a KV head's place in it). */
static inline void chunk_rows(const int32_t *table, int64_t block_size, int64_t row, int64_t off,
                              int64_t j0, int64_t n, int64_t *rows) {
    int64_t bi = j0 / block_size, in_block = j0 % block_size;
    for (int64_t c = 0; c < n; c++) {
        rows[c] = ((int64_t)table[bi] * block_size + in_block) * row + off;
        if (++in_block == block_size) {
            in_block = 0;
            bi++;
        }
    }
}

/* Soft-capped scores (Gemma 2's attention): cap * tanh(score * scale / cap) in place, as the
 * torch reference caps them; the softmax then takes them as they are (scale 1). */
static void cap_scores(float *sc, int64_t n, float scale, float cap) {
    for (int64_t c = 0; c < n; c++) sc[c] = tanhf((sc[c] * scale) / cap) * cap;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_VALUES_AVX2 1
#ifndef VALUES_AHEAD
#define VALUES_AHEAD 8
#endif
/* The value pass of one chunk for the generic loop (AVX2): acc[g] += sum over keys c of
 * sc[g][c] * v_c, for GT heads x DV vectors of 8 dimensions at a time held in registers
 * across the chunk's keys (each value row loaded once for the GT heads), the keys added in
 * order with fused multiply-adds: the very sums of axpy_f32 / axpy_bf16 key by key. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
static inline __attribute__((always_inline)) __m256 value8(const void *base, int64_t index,
                                                           const int BF) {
    if (BF) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + index);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The generic loop's online softmax over one head's chunk (n <= CHUNK scores), eight
 * lanes at a time: the scores scaled, their maximum (a NaN passed over, as the
 * comparison does), the running maximum m and sum l updated (the head's accumulators
 * acc[0..head_dim) scaled to the new maximum where it grew), sc[c] = exp(sc[c] - m). The
 * sum's order depends on n only, so a sequence's result is the same in any batch. */
static inline void softmax_chunk8(float *sc, int64_t n, float scale, float cap, float *m,
                                  float *l, float *acc, int64_t head_dim) {
    if (cap > 0.0f) { /* (soft-capped scores: capped, then taken as they are) */
        cap_scores(sc, n, scale, cap);
        scale = 1.0f;
    }
    const int64_t full = n - n % 8;
    const __m256 vs = _mm256_set1_ps(scale);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t c = 0; c < full; c += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(sc + c), vs);
        _mm256_storeu_ps(sc + c, v);
        vmax = _mm256_max_ps(v, vmax);
    }
    float cmax = hmax8(vmax);
    for (int64_t c = full; c < n; c++) {
        sc[c] *= scale;
        cmax = sc[c] > cmax ? sc[c] : cmax;
    }
    if (cmax > *m) {
        const float corr = fast_expf(*m - cmax); /* m = -inf: exp -> 0 */
        *l *= corr;
        for (int64_t d = 0; d < head_dim; d++) acc[d] *= corr;
        *m = cmax;
    }
    const __m256 vm = _mm256_set1_ps(*m);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t c = 0; c < full; c += 8) {
        const __m256 e = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + c), vm));
        _mm256_storeu_ps(sc + c, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    for (int64_t c = full; c < n; c++) {
        sc[c] = fast_expf(sc[c] - *m);
        sum += sc[c];
    }
    *l += sum;
}

/* Rows at slots[0..count) (offsets in elements of elem bytes), row_bytes each, requested
 * into L1. */
static inline __attribute__((always_inline)) void prefetch_rows(const void *cache, int64_t elem,
                                                                const int64_t *slots,
                                                                int64_t count, int64_t row_bytes) {
    for (int64_t c = 0; c < count; c++)
        for (int64_t o = 0; o < row_bytes; o += 64)
            _mm_prefetch((const char *)cache + slots[c] * elem + o, _MM_HINT_T0);
}

/* Lines [from, to) of the rows at rows[] (row_bytes each, lines counted row after row),
 * requested into L1. */
static inline __attribute__((always_inline)) void prefetch_lines(const void *cache, int64_t elem,
                                                                 const int64_t *rows,
                                                                 int64_t row_bytes, int64_t from,
                                                                 int64_t to) {
    const int64_t per_row = (row_bytes + 63) / 64;
    for (int64_t i = from; i < to; i++)
        _mm_prefetch((const char *)cache + rows[i / per_row] * elem + 64 * (i % per_row),
                     _MM_HINT_T0);
}

static inline __attribute__((always_inline)) void values_tile(
    const int GT, const int DV, const int BF, float *acc, int64_t acc_stride, const float *sc,
    int64_t sc_stride, const void *v_cache, const int64_t *slots, int64_t n, int64_t d0,
    int64_t row_bytes) {
    __m256 a[3][4];
    for (int g = 0; g < GT; g++)
        for (int j = 0; j < DV; j++) a[g][j] = _mm256_loadu_ps(acc + g * acc_stride + d0 + 8 * j);
    for (int64_t c = 0; c < n; c++) {
        /* (the rows lie in blocks anywhere in the cache: one row asked for ahead, on the
         * first pass over them) */
        if (d0 == 0 && c + VALUES_AHEAD < n)
            prefetch_rows(v_cache, BF ? 2 : 4, slots + c + VALUES_AHEAD, 1, row_bytes);
        __m256 v[4];
        for (int j = 0; j < DV; j++) v[j] = value8(v_cache, slots[c] + d0 + 8 * j, BF);
        for (int g = 0; g < GT; g++) {
            const __m256 pw = _mm256_broadcast_ss(sc + g * sc_stride + c);
            for (int j = 0; j < DV; j++) a[g][j] = _mm256_fmadd_ps(pw, v[j], a[g][j]);
        }
    }
    for (int g = 0; g < GT; g++)
        for (int j = 0; j < DV; j++) _mm256_storeu_ps(acc + g * acc_stride + d0 + 8 * j, a[g][j]);
}
#pragma GCC pop_options

/* (12 accumulators, the 3 query vectors and the key's take the sixteen registers: without
 * KEEP_IN_REGISTER each float32 key vector was read from the cache once per head) */
#include "keep_in_register.h"

/* The score pass of four keys (rows at slots[0..3]) for GT query heads (q, stride
 * head_dim) sharing their KV head, head_dim a multiple of 8: GT x 4 accumulators across
 * the dimensions (each key row loaded once for the GT heads), lane l the fused
 * multiply-adds of dimensions l, l + 8, ... in order, then the four sums of a head at once
 * (pairs, then halves). sc[g * sc_stride + 0..3] = the raw scores. */
static inline __attribute__((always_inline)) void scores_tile(
    const int GT, const int BF, const float *q, int64_t head_dim, const void *k_cache,
    const int64_t *slots, float *sc, int64_t sc_stride) {
    __m256 a[3][4], qv[3];
    for (int g = 0; g < GT; g++)
        for (int j = 0; j < 4; j++) a[g][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        for (int g = 0; g < GT; g++) {
            qv[g] = _mm256_loadu_ps(q + g * head_dim + d);
            KEEP_IN_REGISTER(qv[g]);
        }
        for (int j = 0; j < 4; j++) {
            __m256 k = value8(k_cache, slots[j] + d, BF);
            KEEP_IN_REGISTER(k);
            for (int g = 0; g < GT; g++) a[g][j] = _mm256_fmadd_ps(qv[g], k, a[g][j]);
        }
    }
    for (int g = 0; g < GT; g++) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]),
                                        _mm256_hadd_ps(a[g][2], a[g][3]));
        _mm_storeu_ps(sc + g * sc_stride,
                      _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
}

/* The raw scores of a chunk's n keys for query heads [0, group) (qt, stride head_dim, a
 * multiple of 8) into sc[g * sc_stride + c]: four keys at a time (a last partial four
 * repeats its last key), heads three at a time. A score's sums depend on the key and the
 * head only. */
static inline __attribute__((always_inline)) void scores_chunk(
    const int BF, int64_t group, int64_t head_dim, const float *qt, const void *k_cache,
    const int64_t *slots, int64_t n, float *sc, int64_t sc_stride) {
    const int64_t elem = BF ? 2 : 4;
    for (int64_t c = 0; c < n; c += 4) {
        if (c + 4 + VALUES_AHEAD <= n)
            prefetch_rows(k_cache, elem, slots + c + VALUES_AHEAD, 4, head_dim * elem);
        int64_t four[4];
        float part[3 * 4];
        const int whole = c + 4 <= n;
        for (int j = 0; j < 4; j++) four[j] = slots[c + j < n ? c + j : n - 1];
        for (int64_t g0 = 0; g0 < group; g0 += 3) {
            const int64_t gt = group - g0 < 3 ? group - g0 : 3;
            const float *qg = qt + g0 * head_dim;
            float *dst = whole ? sc + g0 * sc_stride + c : part;
            const int64_t ds = whole ? sc_stride : 4;
            if (gt == 3) scores_tile(3, BF, qg, head_dim, k_cache, four, dst, ds);
            else if (gt == 2) scores_tile(2, BF, qg, head_dim, k_cache, four, dst, ds);
            else scores_tile(1, BF, qg, head_dim, k_cache, four, dst, ds);
            if (!whole)
                for (int64_t g = 0; g < gt; g++)
                    for (int64_t j = 0; c + j < n; j++)
                        sc[(g0 + g) * sc_stride + c + j] = part[g * 4 + j];
        }
    }
}

/* Heads [0, group) x head_dim (a multiple of 8) of the chunk's value pass. */
static inline __attribute__((always_inline)) void values_chunk(
    const int BF, int64_t group, int64_t head_dim, float *acc, int64_t acc_stride,
    const float *sc, int64_t sc_stride, const void *v_cache, const int64_t *slots, int64_t n) {
    for (int64_t g0 = 0; g0 < group; g0 += 3) {
        const int64_t gt = group - g0 < 3 ? group - g0 : 3;
        float *ag = acc + g0 * acc_stride;
        const float *sg = sc + g0 * sc_stride;
        /* (GT x DV accumulators, DV value vectors and the weight: 3 x 3 or 2 x 4 in the
         * sixteen registers) */
        const int64_t width = gt == 3 ? 3 : 4;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 8 * width) {
            const int64_t dv = (head_dim - d0) / 8 < width ? (head_dim - d0) / 8 : width;
#define VALUES(GT, DV)                                                                     \
    if (gt == GT && dv == DV) {                                                            \
        values_tile(GT, DV, BF, ag, acc_stride, sg, sc_stride, v_cache, slots, n, d0,      \
                    head_dim * (BF ? 2 : 4));                                             \
        continue;                                                                          \
    }
            VALUES(3, 3) VALUES(3, 2) VALUES(3, 1)
            VALUES(2, 4) VALUES(2, 3) VALUES(2, 2) VALUES(2, 1)
            VALUES(1, 4) VALUES(1, 3) VALUES(1, 2) VALUES(1, 1)
#undef VALUES
        }
    }
}

/* Keys a sweep takes at a time (8, 16 and 32 measure alike on Zen 3; a whole chunk of
 * rows no longer stays in L1). */
#define SWEEP 16

/* One query token against its context, all its KV heads (nk), in the generic loop's
 * chunks of CHUNK keys: the scores of every head, then each head's online softmax, then
 * every head's value pass. The head-by-head loop reads a slot row a KV head's part at a
 * time, each part a pass over the chunk: a strided walk of the cache (on Zen 3, reading
 * alone, 8.5 GB/s where whole rows in order give 13). Here each pass takes SWEEP keys for
 * all the heads, so the rows are read whole and in order, and stay in L1 while the heads
 * take their parts; the next sweep's rows are fetched meanwhile, a share of their lines
 * before each four keys of a head (fetched at once, they filled the miss buffers and
 * stalled the arithmetic behind them: SmolLM2's 30 layers, 64 tokens of 192 keys, 75 ->
 * 46 ms). Every score, softmax and multiply-add is the head-by-head loop's, in the same
 * order per head (a value pass split in sweeps keeps its accumulators in memory between
 * them, the same values): the same bits as the loop, so a sequence's result does not
 * depend on how many tokens share the step. m, l: nq floats; acc: nq * head_dim;
 * scores: nq * CHUNK. */
static inline __attribute__((always_inline)) void attend_token_rows(
    const int BF, int64_t nk, int64_t group, int64_t head_dim, const float *qt,
    const void *k_cache, const void *v_cache, const int32_t *table, int64_t block_size,
    int64_t row, int64_t lo, int64_t p, float scale, float cap, float *o, float *m, float *l,
    float *acc, float *scores) {
    const int64_t nq = nk * group, elem = BF ? 2 : 4, row_bytes = row * elem;
    int64_t base[CHUNK], slots[4], next[SWEEP];
    for (int64_t h = 0; h < nq; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(nq * head_dim));
    for (int64_t j0 = lo; j0 <= p; j0 += CHUNK) {
        const int64_t n = (p + 1 - j0) < CHUNK ? (p + 1 - j0) : CHUNK;
        chunk_rows(table, block_size, row, 0, j0, n, base);
        if (j0 == lo) prefetch_rows(k_cache, elem, base, n < SWEEP ? n : SWEEP, row_bytes);
        int64_t next_n = 0;
        if (j0 + CHUNK <= p) {
            next_n = (p + 1 - j0 - CHUNK) < SWEEP ? (p + 1 - j0 - CHUNK) : SWEEP;
            chunk_rows(table, block_size, row, 0, j0 + CHUNK, next_n, next);
        }
        for (int phase = 0; phase < 2; phase++) {
            const void *cache = phase ? v_cache : k_cache;
            if (phase == 1)
                for (int64_t h = 0; h < nq; h++)
                    softmax_chunk8(scores + h * CHUNK, n, scale, cap, &m[h], &l[h],
                                   acc + h * head_dim, head_dim);
            for (int64_t s0 = 0; s0 < n; s0 += SWEEP) {
                /* The next sweep's rows, whole, a share before each four keys of a head:
                 * this phase's next keys, else the values' first (phase 0) or the next
                 * chunk's keys (phase 1). */
                const void *pf_cache = cache;
                const int64_t *pf = base + s0 + SWEEP;
                int64_t pf_n = n - s0 - SWEEP < SWEEP ? n - s0 - SWEEP : SWEEP;
                if (pf_n <= 0) {
                    pf_cache = phase ? k_cache : v_cache;
                    pf = phase ? next : base;
                    pf_n = phase ? next_n : (n < SWEEP ? n : SWEEP);
                }
                const int64_t pf_lines = pf_n * ((row_bytes + 63) / 64);
                const int64_t sn = n - s0 < SWEEP ? n - s0 : SWEEP;
                const int64_t parts = nk * ((sn + 3) / 4);
                int64_t part = 0;
                for (int64_t kh = 0; kh < nk; kh++)
                    for (int64_t c0 = s0; c0 < s0 + sn; c0 += 4, part++) {
                        const int64_t cn = n - c0 < 4 ? n - c0 : 4;
                        prefetch_lines(pf_cache, elem, pf, row_bytes, pf_lines * part / parts,
                                       pf_lines * (part + 1) / parts);
                        for (int64_t c = 0; c < cn; c++) slots[c] = base[c0 + c] + kh * head_dim;
                        float *sc = scores + kh * group * CHUNK + c0;
                        if (phase == 0)
                            scores_chunk(BF, group, head_dim, qt + kh * group * head_dim, k_cache,
                                         slots, cn, sc, CHUNK);
                        else
                            values_chunk(BF, group, head_dim, acc + kh * group * head_dim,
                                         head_dim, sc, CHUNK, v_cache, slots, cn);
                    }
            }
        }
    }
    for (int64_t h = 0; h < nq; h++) {
        const float inv = 1.0f / l[h];
        for (int64_t d = 0; d < head_dim; d++) o[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
}
#endif

#ifdef __AVX512F__
#include <immintrin.h>
#define PREFETCH_KEYS 8
/* One query token's GT heads (sharing a KV head) against its context, for head sizes of
 * 16 * V: the queries and the output accumulators (GT x V vectors each) stay in
 * registers, each key and value row is loaded once for the GT heads. GT and V are
 * constants once inlined (ATTEND_TILE below instantiates the combinations with
 * GT * V <= 16). The same online softmax as the generic loop. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
static inline __attribute__((always_inline)) __m512 load_row16(const void *base, int64_t index,
                                                                 const int BF) {
    if (BF) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + index);
}

static inline __attribute__((always_inline)) void prefetch_row(const void *base, int64_t index,
                                                               const int BF, const int hint) {
    const char *p = BF ? (const char *)((const uint16_t *)base + index)
                       : (const char *)((const float *)base + index);
    if (hint) _mm_prefetch(p, _MM_HINT_T1); else _mm_prefetch(p, _MM_HINT_T0);
}

/* The 16 horizontal sums of v[0..15] as one vector (lane i: the sum of v[i]'s lanes):
 * pairs within 128-bit lanes, then halves, then across the four 128-bit lanes. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; j++)
        b[j] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                    _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                    _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xdd));
}

/* The query heads g in [0, group) sharing a KV head, in tiles of up to 16 / V heads (4 at
 * most: the register tiles of 16 x V accumulators); CALL(GT, V) runs one tile of GT heads
 * from head g (GT a constant, 1 where 16 / V is smaller). */
#define HEAD_TILES(V, CALL)                                                                  \
    for (int64_t g = 0; g < group;) {                                                        \
        const int64_t rem = group - g, gt = rem < 16 / (V) ? rem : 16 / (V);                 \
        switch (gt > 4 ? 4 : gt) {                                                           \
        case 4: CALL(4 > 16 / (V) ? 1 : 4, V); break;                                        \
        case 3: CALL(3 > 16 / (V) ? 1 : 3, V); break;                                        \
        case 2: CALL(2 > 16 / (V) ? 1 : 2, V); break;                                        \
        default: CALL(1, V); break;                                                          \
        }                                                                                    \
        g += gt > 4 ? 4 : gt;                                                                \
    }

/* Scores of the cn keys whose lane products are lanes[0..cn): the 16 horizontal sums at
 * once, scaled, into out[0..cn). */
static inline __attribute__((always_inline)) void store_scores(__m512 lanes[16], int cn,
                                                               float scale, float *out) {
    for (int c = cn; c < 16; c++) lanes[c] = _mm512_setzero_ps();
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << cn) - 1u),
                          _mm512_mul_ps(hsum16(lanes), _mm512_set1_ps(scale)));
}

/* One chunk of the online softmax: sc[c] becomes exp(sc[c] - m) for the running maximum
 * m, and l gains their sum; returns the factor the sums so far are to be scaled by (1
 * where the maximum did not grow). */
static inline float softmax_chunk(float *sc, int64_t n, float *m, float *l) {
    /* The maximum and the sum sixteen lanes at a time (scalar loops were a third of a
     * batched decode's attention, each a chain of dependent operations). A NaN score is
     * passed over by the maximum, as the comparison did. The sum's order depends on n
     * only: a sequence's chunks are the same in any batch. */
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) vmax = _mm512_max_ps(_mm512_loadu_ps(sc + c), vmax);
    const __mmask16 tail = (__mmask16)((1u << (n - c)) - 1u);
    if (tail)
        vmax = _mm512_mask_max_ps(vmax, tail, _mm512_maskz_loadu_ps(tail, sc + c), vmax);
    const float cmax = _mm512_reduce_max_ps(vmax);
    float corr = 1.0f;
    if (cmax > *m) {
        corr = fast_expf(*m - cmax); /* m = -inf: exp -> 0 */
        *l *= corr;
        *m = cmax;
    }
    const float mg = *m;
#pragma omp simd
    for (c = 0; c < n; c++) sc[c] = fast_expf(sc[c] - mg);
    __m512 vsum = _mm512_setzero_ps();
    for (c = 0; c + 16 <= n; c += 16) vsum = _mm512_add_ps(vsum, _mm512_loadu_ps(sc + c));
    if (tail) vsum = _mm512_add_ps(vsum, _mm512_maskz_loadu_ps(tail, sc + c));
    *l += _mm512_reduce_add_ps(vsum);
    return corr;
}

static inline __attribute__((always_inline)) void attend_tile(
    const int GT, const int V, const int BF, const float *qt, const void *k_cache,
    const void *v_cache, const int32_t *table, int64_t block_size, int64_t row,
    int64_t head_off, int64_t lo, int64_t p, float scale, float *o) {
    __m512 qv[4][16], acc[4][16];
    float m[4], l[4];
    float scores[4][CHUNK];
    int64_t krow[CHUNK]; /* element index of each key's (and value's) row */
    /* (a line of 64 bytes: 16 float32 or 32 bfloat16 values) */
    const int lines = BF ? (V + 1) / 2 : V, line = BF ? 32 : 16;
    for (int g = 0; g < GT; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int v = 0; v < V; v++) {
            qv[g][v] = _mm512_loadu_ps(qt + g * 16 * V + 16 * v);
            acc[g][v] = _mm512_setzero_ps();
        }
    }
    for (int64_t j0 = lo; j0 <= p; j0 += CHUNK) {
        const int64_t n = (p + 1 - j0) < CHUNK ? (p + 1 - j0) : CHUNK;
        chunk_rows(table, block_size, row, head_off, j0, n, krow);
        /* The rows are scattered over the cache (blocks, and KV heads within a slot):
         * fetch a few keys ahead, a 64-byte line per 16 values. */
        for (int64_t c = 0; c < n && c < PREFETCH_KEYS; c++)
            for (int v = 0; v < lines; v++) prefetch_row(k_cache, krow[c] + line * v, BF, 0);
        /* Scores 16 keys at a time: each key's lane products per head, then the 16
         * horizontal sums at once (hsum16), a vector of 16 scores. */
        for (int64_t c0 = 0; c0 < n; c0 += 16) {
            const int cn = (int)(n - c0 < 16 ? n - c0 : 16);
            __m512 lanes[4][16];
            for (int c = 0; c < cn; c++) {
                const int64_t kr = krow[c0 + c];
                if (c0 + c + PREFETCH_KEYS < n)
                    for (int v = 0; v < lines; v++) {
                        prefetch_row(k_cache, krow[c0 + c + PREFETCH_KEYS] + line * v, BF, 0);
                        prefetch_row(v_cache, kr + line * v, BF, 1);
                    }
                __m512 s[4];
                const __m512 k0 = load_row16(k_cache, kr, BF);
                for (int g = 0; g < GT; g++) s[g] = _mm512_mul_ps(qv[g][0], k0);
                for (int v = 1; v < V; v++) {
                    const __m512 kv = load_row16(k_cache, kr + 16 * v, BF);
                    for (int g = 0; g < GT; g++) s[g] = _mm512_fmadd_ps(qv[g][v], kv, s[g]);
                }
                for (int g = 0; g < GT; g++) lanes[g][c] = s[g];
            }
            for (int g = 0; g < GT; g++) store_scores(lanes[g], cn, scale, scores[g] + c0);
        }
        for (int g = 0; g < GT; g++) {
            const float corr = softmax_chunk(scores[g], n, &m[g], &l[g]);
            if (corr != 1.0f)
                for (int v = 0; v < V; v++) acc[g][v] = _mm512_mul_ps(acc[g][v], _mm512_set1_ps(corr));
        }
        for (int64_t c = 0; c < n && c < PREFETCH_KEYS; c++)
            for (int v = 0; v < lines; v++) prefetch_row(v_cache, krow[c] + line * v, BF, 0);
        for (int64_t c = 0; c < n; c++) {
            const int64_t vr = krow[c];
            if (c + PREFETCH_KEYS < n)
                for (int v = 0; v < lines; v++)
                    prefetch_row(v_cache, krow[c + PREFETCH_KEYS] + line * v, BF, 0);
            for (int v = 0; v < V; v++) {
                const __m512 vv = load_row16(v_cache, vr + 16 * v, BF);
                for (int g = 0; g < GT; g++)
                    acc[g][v] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g][c]), vv, acc[g][v]);
            }
        }
    }
    for (int g = 0; g < GT; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[g]);
        for (int v = 0; v < V; v++) _mm512_storeu_ps(o + g * 16 * V + 16 * v, _mm512_mul_ps(acc[g][v], inv));
    }
}
#pragma GCC pop_options

#if defined(__AVX512BF16__)
#define HAVE_ATTEND_DP 1
/* Index vectors that put the accumulators of the bfloat16 value products back in head
 * order (see attend_chunk_dp), built once when the library loads. */
static int32_t dp_order[2][16];

__attribute__((constructor)) static void dp_build_order(void) {
    /* An accumulator pair (lo, hi) covers 32 dimensions: 128-bit lane L of lo holds
     * dimensions 8L..8L+3, of hi 8L+4..8L+7. Output h holds dimensions 16h..16h+15. */
    for (int h = 0; h < 2; h++)
        for (int e = 0; e < 16; e++) {
            const int L = 2 * h + e / 8, i = e % 8;
            dp_order[h][e] = i < 4 ? 4 * L + i : 16 + 4 * L + (i - 4);
        }
}

/* One chunk of n keys for GT query heads sharing a KV head, over a bfloat16 cache with the
 * bfloat16 dot-product instruction (AVX512-BF16), head sizes of 32 * (V / 2): the arithmetic
 * of torch's bfloat16 attention on CPUs. Queries are rounded to bfloat16 (exact for a
 * bfloat16 model, whose queries are bfloat16 values) and multiply the keys in pairs summed
 * in float32; the softmax is float32, its probabilities rounded to bfloat16 weight the
 * values (float32 sums) while the normaliser sums them unrounded. Values are taken two keys
 * at a time, interleaved so that each 32-bit lane holds one dimension of both keys.
 *
 * Key c's row (and its value's) starts at element krow[c] + head_off; krow[n] repeats the
 * last (the partner of an odd last key, weighted by 0). Meanwhile cache lines
 * [pf_lo, pf_hi) of the slot rows pf[0..pf_n) (the next chunk's) are fetched into L2, one
 * key's beside each key's scores: all KV heads' passes over a chunk between them fetch
 * the next one, so the memory keeps busy while they compute. The online softmax's state is
 * kept in memory between chunks: m[GT], l[GT] and acc[GT * 16 * V] (in the interleaved
 * order; attend_finish_dp puts it in head order). */
static inline __attribute__((always_inline)) void attend_chunk_dp(
    const int GT, const int V, const float *qt, const uint16_t *k_cache,
    const uint16_t *v_cache, const int64_t *krow, int64_t n, const int64_t *pf, int64_t pf_n,
    int64_t pf_lo, int64_t pf_hi, int64_t head_off, float scale, float *m, float *l,
    float *acc_mem) {
    const int W = V / 2; /* 64-byte lines (32 values) per row */
    __m512bh qb[4][8];
    __m512 acc[4][16];
    float scores[4][CHUNK];
    uint16_t probs[4][CHUNK + 16];
    for (int g = 0; g < GT; g++)
        for (int w = 0; w < W; w++) {
            const float *src = qt + g * 16 * V + 32 * w;
            qb[g][w] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        }
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
        const int cn = (int)(n - c0 < 16 ? n - c0 : 16);
        __m512 lanes[4][16];
        for (int c = 0; c < cn; c++) {
            const uint16_t *kr = k_cache + krow[c0 + c] + head_off;
            if (c0 + c < pf_n)
                for (int64_t i = pf_lo; i < pf_hi; i++) {
                    _mm_prefetch((const char *)(k_cache + pf[c0 + c]) + 64 * i, _MM_HINT_T1);
                    _mm_prefetch((const char *)(v_cache + pf[c0 + c]) + 64 * i, _MM_HINT_T1);
                }
            __m512 s[4];
            for (int g = 0; g < GT; g++) s[g] = _mm512_setzero_ps();
            for (int w = 0; w < W; w++) {
                const __m512bh kw = (__m512bh)_mm512_loadu_si512(kr + 32 * w);
                for (int g = 0; g < GT; g++) s[g] = _mm512_dpbf16_ps(s[g], qb[g][w], kw);
            }
            for (int g = 0; g < GT; g++) lanes[g][c] = s[g];
        }
        for (int g = 0; g < GT; g++) store_scores(lanes[g], cn, scale, scores[g] + c0);
    }
    for (int g = 0; g < GT; g++) {
        for (int v = 0; v < V; v++) acc[g][v] = _mm512_loadu_ps(acc_mem + g * 16 * V + 16 * v);
        float *sc = scores[g];
        const float corr = softmax_chunk(sc, n, &m[g], &l[g]);
        if (corr != 1.0f)
            for (int v = 0; v < V; v++) acc[g][v] = _mm512_mul_ps(acc[g][v], _mm512_set1_ps(corr));
        for (int64_t c0 = 0; c0 < n; c0 += 16) {
            const __mmask16 keep = (__mmask16)(n - c0 >= 16 ? 0xFFFFu : (1u << (n - c0)) - 1u);
            /* (probabilities past n are 0) */
            _mm256_storeu_si256((__m256i *)(probs[g] + c0),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, sc + c0)));
        }
    }
    for (int64_t c = 0; c < n; c += 2) {
        const uint16_t *r0 = v_cache + krow[c] + head_off, *r1 = v_cache + krow[c + 1] + head_off;
        __m512bh pair[4];
        for (int g = 0; g < GT; g++) {
            int32_t two;
            memcpy(&two, probs[g] + c, sizeof(two));
            pair[g] = (__m512bh)_mm512_set1_epi32(two);
        }
        for (int w = 0; w < W; w++) {
            const __m512i a = _mm512_loadu_si512(r0 + 32 * w), b = _mm512_loadu_si512(r1 + 32 * w);
            const __m512bh lo16 = (__m512bh)_mm512_unpacklo_epi16(a, b);
            const __m512bh hi16 = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int g = 0; g < GT; g++) {
                acc[g][2 * w] = _mm512_dpbf16_ps(acc[g][2 * w], lo16, pair[g]);
                acc[g][2 * w + 1] = _mm512_dpbf16_ps(acc[g][2 * w + 1], hi16, pair[g]);
            }
        }
    }
    for (int g = 0; g < GT; g++)
        for (int v = 0; v < V; v++) _mm512_storeu_ps(acc_mem + g * 16 * V + 16 * v, acc[g][v]);
}

/* The output rows of `heads` heads of size head_dim from their dp state. */
static void attend_finish_dp(int64_t heads, int64_t head_dim, const float *l, const float *acc,
                             float *o) {
    const __m512i order0 = _mm512_loadu_si512(dp_order[0]), order1 = _mm512_loadu_si512(dp_order[1]);
    for (int64_t h = 0; h < heads; h++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[h]);
        for (int64_t d = 0; d < head_dim; d += 32) {
            const __m512 a = _mm512_loadu_ps(acc + h * head_dim + d);
            const __m512 b = _mm512_loadu_ps(acc + h * head_dim + d + 16);
            _mm512_storeu_ps(o + h * head_dim + d, _mm512_mul_ps(_mm512_permutex2var_ps(a, order0, b), inv));
            _mm512_storeu_ps(o + h * head_dim + d + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a, order1, b), inv));
        }
    }
}

/* One query token against its context (KV heads [kh0, kh1)), chunk by chunk: each chunk's
 * keys are read for every KV head in turn, so that a sequence's cache is swept in address
 * order, whole slot rows at a time, and the next chunk (this token's, else the first of
 * the next work item the thread takes, next_table/next_lo/next_p; next_table NULL: none)
 * is fetched while one computes. Head sizes 32, 64, 128 and 256 (the caller's check). */
static void attend_token_dp(int64_t kh0, int64_t kh1, int64_t group, int64_t head_dim,
                           const float *qt, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int32_t *table, int64_t block_size, int64_t row, int64_t lo,
                           int64_t p, const int32_t *next_table, int64_t next_lo,
                           int64_t next_p, float scale, float *o, float *m, float *l,
                           float *acc) {
    const int64_t heads = (kh1 - kh0) * group;
    /* (q, o, m, l and acc from head kh0 * group on) */
    int64_t krow[CHUNK + 1], pf[CHUNK];
    for (int64_t h = kh0 * group; h < kh1 * group; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc + kh0 * group * head_dim, 0, sizeof(float) * (size_t)(heads * head_dim));
    /* The lines of a slot row this token reads (its KV heads'), shared out over the passes. */
    const int64_t line0 = kh0 * head_dim * 2 / 64, line1 = (kh1 * head_dim * 2 + 63) / 64;
    const int64_t passes = kh1 - kh0;
    int64_t n = (p + 1 - lo) < CHUNK ? (p + 1 - lo) : CHUNK;
    chunk_rows(table, block_size, row, 0, lo, n, krow);
    for (int64_t j0 = lo; j0 <= p; j0 += CHUNK) {
        int64_t pf_n = 0;
        if (j0 + CHUNK <= p) {
            pf_n = (p + 1 - j0 - CHUNK) < CHUNK ? (p + 1 - j0 - CHUNK) : CHUNK;
            chunk_rows(table, block_size, row, 0, j0 + CHUNK, pf_n, pf);
        } else if (next_table != NULL) {
            pf_n = (next_p + 1 - next_lo) < CHUNK ? (next_p + 1 - next_lo) : CHUNK;
            chunk_rows(next_table, block_size, row, 0, next_lo, pf_n, pf);
        }
        krow[n] = krow[n - 1];
        for (int64_t kh = kh0; kh < kh1; kh++) {
            const int64_t pass = kh - kh0;
            const int64_t pf_lo = line0 + (line1 - line0) * pass / passes;
            const int64_t pf_hi = line0 + (line1 - line0) * (pass + 1) / passes;
#define CHUNK_DP(GT, V)                                                                      \
    attend_chunk_dp(GT, V, qt + (kh * group + g) * head_dim, k_cache, v_cache, krow, n, pf,  \
                    g == 0 ? pf_n : 0, pf_lo, pf_hi, kh * head_dim, scale, m + kh * group + g, \
                    l + kh * group + g, acc + (kh * group + g) * head_dim)
            switch (head_dim) {
            case 32: HEAD_TILES(2, CHUNK_DP) break;
            case 64: HEAD_TILES(4, CHUNK_DP) break;
            case 128: HEAD_TILES(8, CHUNK_DP) break;
            default: HEAD_TILES(16, CHUNK_DP) break;
            }
#undef CHUNK_DP
        }
        if (j0 + CHUNK <= p) {
            n = pf_n;
            memcpy(krow, pf, sizeof(int64_t) * (size_t)n);
        }
    }
    attend_finish_dp(heads, head_dim, l + kh0 * group, acc + kh0 * group * head_dim,
                     o + kh0 * group * head_dim);
}
#endif

/* Heads [0, group) of one item in tiles (HEAD_TILES); 0 where the head size is not 16,
 * 32, 64, 128 or 256 (the generic loop then runs). */
static inline __attribute__((always_inline)) int attend_item(
    const int BF, int64_t group, int64_t head_dim, const float *qt, const void *k_cache,
    const void *v_cache, const int32_t *table, int64_t block_size, int64_t row,
    int64_t head_off, int64_t lo, int64_t p, float scale, float *o) {
#define ATTEND(GT, V) attend_tile(GT, V, BF, qt + g * head_dim, k_cache, v_cache, table,       \
                                  block_size, row, head_off, lo, p, scale, o + g * head_dim)
    switch (head_dim) {
    case 16: HEAD_TILES(1, ATTEND) return 1;
    case 32: HEAD_TILES(2, ATTEND) return 1;
    case 64: HEAD_TILES(4, ATTEND) return 1;
    case 128: HEAD_TILES(8, ATTEND) return 1;
    case 256: HEAD_TILES(16, ATTEND) return 1;
    default: return 0;
    }
#undef ATTEND
}
#endif

/* Work item `item`'s query: its sequence (searched from `seq`, the thread's last one, in
 * the prefix sums `first` of the sequences' items), token t, KV head kh (per_token items a
 * token: nk, or 1 for whole tokens), position p and first key lo (within the window). */
typedef struct {
    int64_t seq, t, kh, p, lo;
} query_item;

static inline query_item locate_item(int64_t item, int64_t seq, const int64_t *first,
                                     int64_t per_token, const int64_t *q_start,
                                     const int64_t *q_end, const int64_t *ctx_len,
                                     int64_t window) {
    while (first[seq + 1] <= item) seq++;
    while (first[seq] > item) seq--;
    const int64_t local = item - first[seq];
    query_item w;
    w.seq = seq;
    w.t = q_start[seq] + local / per_token;
    w.kh = local % per_token;
    w.p = ctx_len[seq] - (q_end[seq] - w.t);
    w.lo = (window > 0 && w.p - window + 1 > 0) ? w.p - window + 1 : 0;
    return w;
}

/* The step's keys and values go into the cache [2, num_slots, nk, head_dim] at their
 * slots; then every query token of the listed sequences attends to its sequence's context
 * read through the block table, with an online softmax over chunks of keys. The query
 * heads sharing a KV head are read together, so each key and value row is read once for
 * all of them.
 *
 * Sequence i owns flat-batch tokens [q_start[i], q_end[i]) and has ctx_len[i] tokens of
 * context once this step's are in: its token t sits at position ctx_len - (q_end - t) and
 * sees positions [max(0, p - window + 1), p] (window <= 0: no window). Block table rows
 * are int32 with row stride bt_stride. soft_cap > 0: the scores are soft-capped (Gemma 2),
 * cap * tanh(score / cap), in the loops (not the AVX-512 tiles nor the bfloat16
 * dot-product path, which such layers skip). Returns 0; -1 for a head size over 512 or more
 * than 16 query heads per KV head (the caller then uses its reference). */

#define PAGED_ATTENTION_ARGS                                                                  \
    const float *q, int64_t q_ts, const float *k, int64_t k_ts, const float *v, int64_t v_ts,  \
        void *cache, int64_t num_slots, int64_t block_size, const int64_t *slot_mapping,        \
        int64_t tokens, int64_t nq, int64_t nk, int64_t head_dim, int64_t num_seqs,             \
        const int64_t *q_start, const int64_t *q_end, const int64_t *ctx_len,                   \
        const int32_t *block_tables, int64_t bt_stride, float scale, int64_t window,            \
        float *out, int64_t o_ts, int nthreads, float soft_cap

/* BF: the cache holds bfloat16 (written rounded to nearest even, read widened to float32;
 * queries, scores and outputs stay float32), head sizes 16, 32, 64, 128 and 256 only. */
static inline __attribute__((always_inline)) int paged_attention(const int BF,
                                                                 PAGED_ATTENTION_ARGS) {
    const int64_t group = nq / nk;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP) return -1;
    if (BF && head_dim != 16 && head_dim != 32 && head_dim != 64 && head_dim != 128 &&
        head_dim != 256)
        return -1;
    const int64_t row = nk * head_dim;
    const size_t elem = BF ? 2 : 4;
    void *k_cache = cache, *v_cache = (char *)cache + (size_t)(num_slots * row) * elem;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (BF) {
            uint16_t *kd = (uint16_t *)k_cache + slot * row, *vd = (uint16_t *)v_cache + slot * row;
            for (int64_t i = 0; i < row; i++) {
                kd[i] = to_bf16(k[t * k_ts + i]);
                vd[i] = to_bf16(v[t * v_ts + i]);
            }
        } else {
            memcpy((float *)k_cache + slot * row, k + t * k_ts, sizeof(float) * (size_t)row);
            memcpy((float *)v_cache + slot * row, v + t * v_ts, sizeof(float) * (size_t)row);
        }
    }
    /* Work items: (sequence, query token, KV head), or (sequence, query token) for the
     * bfloat16 dot-product path once there are tokens enough to share out; a prefix sum
     * finds an item's sequence. */
    int64_t queries = 0;
    for (int64_t i = 0; i < num_seqs; i++) queries += q_end[i] - q_start[i];
#ifdef HAVE_ATTEND_DP
    /* (soft-capped scores: the loops below; the dot-product path has no cap) */
    const int dp = BF && soft_cap <= 0.0f &&
                   (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256);
#else
    const int dp = 0;
#endif
    /* Whole query tokens (all KV heads) are the work items where there are tokens enough:
     * a token's KV heads lie side by side in the cache rows, so one thread reads its
     * context's lines once (with one item per head, two threads would stream the same rows,
     * each fetching the lines next to its own). */
    const int64_t per_token = queries >= 4 * (int64_t)nthreads ? 1 : nk;
    int64_t total = 0;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (first == NULL) return -2;
    for (int64_t i = 0; i < num_seqs; i++) {
        first[i] = total;
        total += (q_end[i] - q_start[i]) * per_token;
    }
    first[num_seqs] = total;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (total > 1)
    {
        /* The dp path's state: acc [nq * head_dim], m [nq], l [nq]. */
        float *dp_state = dp ? (float *)malloc(sizeof(float) * (size_t)(nq * (head_dim + 2))) : NULL;
        if (dp && dp_state == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#ifdef HAVE_VALUES_AVX2
        /* attend_token_rows' state (whole decode tokens): acc [nq * head_dim], m [nq], l
         * [nq], scores [nq * CHUNK]. */
        const int rows_path = per_token == 1 && head_dim % 8 == 0;
        float *rows_state =
            rows_path ? (float *)malloc(sizeof(float) * (size_t)(nq * (head_dim + 2 + CHUNK)))
                      : NULL;
        if (rows_path && rows_state == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#endif
        float scores[MAX_GROUP][CHUNK];
        float acc[MAX_GROUP][MAX_HEAD_DIM];
        float m[MAX_GROUP], l[MAX_GROUP];
        int64_t slots[CHUNK];
        int64_t seq = 0;
#ifdef HAVE_ATTEND_DP
        if (dp) {
            /* Items dealt round robin (thread i takes i, i + T, ...): a thread knows its next
             * item, whose first chunk it fetches during its current one's last. */
#ifdef _OPENMP
            const int64_t T = omp_get_num_threads(), me = omp_get_thread_num();
#else
            const int64_t T = 1, me = 0;
#endif
            for (int64_t item = me; item < total && dp_state != NULL; item += T) {
                const query_item w = locate_item(item, seq, first, per_token, q_start, q_end,
                                                 ctx_len, window);
                seq = w.seq;
                const int has_next = item + T < total;
                query_item next = {0, 0, 0, 0, 0};
                if (has_next)
                    next = locate_item(item + T, seq, first, per_token, q_start, q_end, ctx_len,
                                       window);
                const int64_t kh0 = per_token == 1 ? 0 : w.kh;
                const int64_t kh1 = per_token == 1 ? nk : w.kh + 1;
                attend_token_dp(kh0, kh1, group, head_dim, q + w.t * q_ts,
                                (const uint16_t *)k_cache, (const uint16_t *)v_cache,
                                block_tables + seq * bt_stride, block_size, row, w.lo, w.p,
                                has_next ? block_tables + next.seq * bt_stride : NULL, next.lo,
                                next.p, scale, out + w.t * o_ts, dp_state + nq * head_dim,
                                dp_state + nq * head_dim + nq, dp_state);
            }
        } else
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < total; item++) {
            const query_item w = locate_item(item, seq, first, per_token, q_start, q_end,
                                             ctx_len, window);
            seq = w.seq;
            const int64_t t = w.t, p = w.p, lo = w.lo;
#ifdef HAVE_VALUES_AVX2
            /* A decode token (its sequence's only query): its context comes from memory,
             * read whole rows at a time (attend_token_rows); a prefill's tokens find theirs
             * in the cache, where the head-by-head loop's register tiles are faster. */
            if (rows_state != NULL && q_end[seq] - q_start[seq] == 1) {
                attend_token_rows(BF, nk, group, head_dim, q + t * q_ts, k_cache, v_cache,
                                  block_tables + seq * bt_stride, block_size, row, lo, p, scale,
                                  soft_cap, out + t * o_ts, rows_state + nq * head_dim,
                                  rows_state + nq * (head_dim + 1), rows_state,
                                  rows_state + nq * (head_dim + 2));
                continue;
            }
#endif
            const int64_t kh_end = per_token == 1 ? nk : w.kh + 1;
            for (int64_t kh = per_token == 1 ? 0 : w.kh; kh < kh_end; kh++) {
                const float *qt = q + t * q_ts + kh * group * head_dim;
                const int32_t *table = block_tables + seq * bt_stride;
#ifdef __AVX512F__
                float *ot = out + t * o_ts + kh * group * head_dim;
                /* (its tiles have no soft cap: capped scores take the loop below) */
                if (soft_cap <= 0.0f &&
                    attend_item(BF, group, head_dim, qt, k_cache, v_cache, table, block_size,
                                row, kh * head_dim, lo, p, scale, ot))
                    continue;
#endif
                const float *fk = (const float *)k_cache, *fv = (const float *)v_cache;
                const uint16_t *hk = (const uint16_t *)k_cache, *hv = (const uint16_t *)v_cache;
                for (int64_t g = 0; g < group; g++) {
                    m[g] = -INFINITY;
                    l[g] = 0.0f;
                    for (int64_t d = 0; d < head_dim; d++) acc[g][d] = 0.0f;
                }
                for (int64_t j0 = lo; j0 <= p; j0 += CHUNK) {
                    const int64_t n = (p + 1 - j0) < CHUNK ? (p + 1 - j0) : CHUNK;
                    chunk_rows(table, block_size, row, kh * head_dim, j0, n, slots);
#ifdef HAVE_VALUES_AVX2
                    if (head_dim % 8 == 0) {
                        scores_chunk(BF, group, head_dim, qt, k_cache, slots, n, &scores[0][0],
                                     CHUNK);
                        for (int64_t g = 0; g < group; g++)
                            softmax_chunk8(scores[g], n, scale, soft_cap, &m[g], &l[g], acc[g],
                                           head_dim);
                        values_chunk(BF, group, head_dim, &acc[0][0], MAX_HEAD_DIM, &scores[0][0],
                                     CHUNK, BF ? (const void *)hv : (const void *)fv, slots, n);
                        continue;
                    }
#endif
                    for (int64_t g = 0; g < group; g++) {
                        const float *qh = qt + g * head_dim;
                        float *sc = scores[g];
                        int64_t c = 0;
                        for (; c + 4 <= n; c += 4) {
#ifdef HAVE_VALUES_AVX2
                            if (g == 0 && c + 4 + VALUES_AHEAD <= n)
                                prefetch_rows(k_cache, (int64_t)elem, slots + c + VALUES_AHEAD, 4,
                                              head_dim * (int64_t)elem);
#endif
                            if (BF)
                                dot4_bf16(qh, hk + slots[c], hk + slots[c + 1], hk + slots[c + 2],
                                          hk + slots[c + 3], head_dim, sc + c);
                            else
                                dot4_f32(qh, fk + slots[c], fk + slots[c + 1], fk + slots[c + 2],
                                         fk + slots[c + 3], head_dim, sc + c);
                        }
                        for (; c < n; c++) {
                            float four[4];
                            if (BF) {
                                const uint16_t *kc = hk + slots[c];
                                dot4_bf16(qh, kc, kc, kc, kc, head_dim, four);
                            } else {
                                const float *kc = fk + slots[c];
                                dot4_f32(qh, kc, kc, kc, kc, head_dim, four);
                            }
                            sc[c] = four[0];
                        }
#ifdef HAVE_VALUES_AVX2
                        softmax_chunk8(sc, n, scale, soft_cap, &m[g], &l[g], acc[g], head_dim);
                        continue;
#endif
                        float cmax = -INFINITY, sc_scale = scale;
                        if (soft_cap > 0.0f) {
                            cap_scores(sc, n, scale, soft_cap);
                            sc_scale = 1.0f;
                        }
                        for (c = 0; c < n; c++) {
                            sc[c] *= sc_scale;
                            cmax = sc[c] > cmax ? sc[c] : cmax;
                        }
                        if (cmax > m[g]) {
                            const float corr = fast_expf(m[g] - cmax); /* m = -inf: exp -> 0 */
                            l[g] *= corr;
                            for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= corr;
                            m[g] = cmax;
                        }
                        const float mg = m[g];
#pragma omp simd
                        for (c = 0; c < n; c++) sc[c] = fast_expf(sc[c] - mg);
                        for (c = 0; c < n; c++) l[g] += sc[c];
                    }
                    for (int64_t c = 0; c < n; c++) {
                        for (int64_t g = 0; g < group; g++) {
                            if (BF)
                                axpy_bf16(acc[g], scores[g][c], hv + slots[c], head_dim);
                            else
                                axpy_f32(acc[g], scores[g][c], fv + slots[c], head_dim);
                        }
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    float *o = out + t * o_ts + (kh * group + g) * head_dim;
                    const float inv = 1.0f / l[g];
                    for (int64_t d = 0; d < head_dim; d++) o[d] = acc[g][d] * inv;
                }
            }
        }
        free(dp_state);
#ifdef HAVE_VALUES_AVX2
        free(rows_state);
#endif
    }
    free(first);
    return failed ? -2 : 0;
}

/* Whether this build's paged attention reads a bfloat16 cache (AVX-512: its tiles; else the
 * loop, keys and values widened). */
int pagedllm_attention_bf16_cache(void) { return 1; }

/* Whether this build's float32 SiLU-and-product and GELU-and-product run eight lanes at a
 * time (AVX2 without AVX-512; elsewhere the plain loops, which GCC does not vectorise). */
int pagedllm_silu_vector(void) {
#ifdef HAVE_FAST_EXP8
    return 1;
#else
    return 0;
#endif
}

/* Whether its bfloat16 cache is read with bfloat16 products (AVX512-BF16) for head sizes
 * 32, 64, 128 and 256 (attend_chunk_dp: queries and probabilities rounded to bfloat16). */
int pagedllm_attention_bf16_products(void) {
#ifdef HAVE_ATTEND_DP
    return 1;
#else
    return 0;
#endif
}

int pagedllm_paged_attention(PAGED_ATTENTION_ARGS) {
    return paged_attention(0, q, q_ts, k, k_ts, v, v_ts, cache, num_slots, block_size,
                           slot_mapping, tokens, nq, nk, head_dim, num_seqs, q_start, q_end,
                           ctx_len, block_tables, bt_stride, scale, window, out, o_ts, nthreads,
                           soft_cap);
}

int pagedllm_paged_attention_bf16(PAGED_ATTENTION_ARGS) {
    return paged_attention(1, q, q_ts, k, k_ts, v, v_ts, cache, num_slots, block_size,
                           slot_mapping, tokens, nq, nk, head_dim, num_seqs, q_start, q_end,
                           ctx_len, block_tables, bt_stride, scale, window, out, o_ts, nthreads,
                           soft_cap);
}

/* ---- Sampling: the inverse CDF of softmax(logits) ---------------------------------------
 *
 * For each row, the first token whose running sum of exp(x - max) reaches u times the
 * row's total, with u in (0, 1]: softmax, cumulative sum and the search of the torch
 * reference (core/sampling/sampler.py) in one pass over the row plus one block. The sums
 * are kept in double per block of SAMPLE_BLOCK tokens; a token more than 87 below the
 * row's maximum (a masked -inf among them) has probability exactly 0, so it is never the
 * first to reach the target. A row with no finite logit gives the last token, as the
 * reference's search of a NaN distribution does. */
#define SAMPLE_BLOCK 64

static inline float sample_exp(float d) {
    const float e = fast_expf(d); /* (computed either way: the select vectorises) */
    return d < -87.0f ? 0.0f : e;
}

/* The sum of sample_exp(x[i] - mx) over [lo, hi) in float32: eight lanes at a time on
 * AVX2, where GCC leaves fast_expf's clamps as branches and the loop one token at a time
 * (64 rows of SmolLM2's 49152 logits: 14.5 -> 3.0 ms); elsewhere the loop (which GCC
 * vectorises for AVX-512, the select after the exp). */
static inline float sample_block_sum(const float *x, int64_t lo, int64_t hi, float mx) {
    float s = 0.0f;
    int64_t from = lo;
#ifdef HAVE_VALUES_AVX2
    const __m256 vm = _mm256_set1_ps(mx), floor = _mm256_set1_ps(-87.0f);
    __m256 acc = _mm256_setzero_ps();
    for (; from + 8 <= hi; from += 8) {
        const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + from), vm);
        /* (d < -87: 0; a NaN kept, as sample_exp keeps it) */
        const __m256 keep = _mm256_cmp_ps(d, floor, _CMP_NLT_UQ);
        acc = _mm256_add_ps(acc, _mm256_and_ps(fast_exp8(d), keep));
    }
    s = hsum8(acc);
#endif
#pragma omp simd reduction(+ : s)
    for (int64_t i = from; i < hi; i++) s += sample_exp(x[i] - mx);
    return s;
}

static int64_t sample_row(const float *x, int64_t n, double u, double *block_sums) {
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    if (!isfinite(mx)) return n - 1; /* no finite logit (or +inf) */
    const int64_t nblocks = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t lo = b * SAMPLE_BLOCK, hi = lo + SAMPLE_BLOCK < n ? lo + SAMPLE_BLOCK : n;
        const float s = sample_block_sum(x, lo, hi, mx);
        block_sums[b] = (double)s;
        total += (double)s;
    }
    const double target = u * total;
    double acc = 0.0;
    int64_t last = n - 1;
    for (int64_t b = 0; b < nblocks; b++) {
        if (block_sums[b] > 0.0) last = b;
        if (acc + block_sums[b] < target || block_sums[b] == 0.0) {
            acc += block_sums[b];
            continue;
        }
        const int64_t lo = b * SAMPLE_BLOCK, hi = lo + SAMPLE_BLOCK < n ? lo + SAMPLE_BLOCK : n;
        double run = acc;
        for (int64_t i = lo; i < hi; i++) {
            const float e = sample_exp(x[i] - mx);
            run += (double)e;
            if (e > 0.0f && run >= target) return i;
        }
        acc += block_sums[b]; /* rounding left it short: the next token with mass */
    }
    /* Not reached (rounding of the last block): the last token with mass. */
    const int64_t lo = last * SAMPLE_BLOCK, hi = lo + SAMPLE_BLOCK < n ? lo + SAMPLE_BLOCK : n;
    for (int64_t i = hi - 1; i >= lo; i--)
        if (sample_exp(x[i] - mx) > 0.0f) return i;
    return n - 1;
}

/* out[r] for rows r of logits (row stride `stride`), uniform[r] in (0, 1]. 0, or -2 when
 * the scratch of block sums cannot be allocated. */
int pagedllm_sample_inverse_cdf(const float *logits, int64_t rows, int64_t n, int64_t stride,
                                const float *uniform, int64_t *out, int nthreads) {
    const int64_t nblocks = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        double *block_sums = (double *)malloc(sizeof(double) * (size_t)(nblocks > 0 ? nblocks : 1));
        if (block_sums == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            if (block_sums != NULL)
                out[r] = sample_row(logits + r * stride, n, (double)uniform[r], block_sums);
        free(block_sums);
    }
    return failed ? -2 : 0;
}
