/* Products of a few activation rows with a dense float32 or bfloat16 weight, for decode
 * steps on the CPU (pagedllm/kernels/dense_cpu.py builds and loads this file; the native
 * decoder layer, cpu_layer.c, includes it).
 *
 *   y[m, n] = x[m, k] . W[n, k]      m small (a decode step's rows), W read once
 *
 * A decode step reads every weight once from memory for a handful of rows: the product
 * is bound by memory bandwidth, and the BLAS GEMMs behind F.linear lose to a kernel that
 * streams each weight row once and meets every activation row with it in registers
 * (tiles of DENSE_NR weight rows x DENSE_MR activation rows). With AVX2 and many rows (a
 * decode step of many sequences) the weight is laid out in packed panels first, for an
 * outer-product kernel with the same sums (dense_pk_matmul).
 *
 * Each output is one fixed chain of operations over k, whatever the rows, tiles or
 * threads of the call (threads split the output features), so one row's result does not
 * depend on the others of the step, and the native decoder layer and the modules' calls
 * agree bit for bit:
 *   - AVX512-BF16, bfloat16 rows and weights: 16 float32 lanes, lane l summing the pair
 *     products of elements 32t + 2l, 32t + 2l + 1 (dpbf16ps), then one fixed add tree;
 *   - AVX-512F (or AVX2 with FMA): 16 (8) float32 lanes, lane l the fused multiply-adds
 *     of elements l, l + 16, ... (bfloat16 widened exactly), then a fixed add tree;
 *   - otherwise, or with `portable`: the same in plain C on 8 lanes, multiply then add
 *     (built with -ffp-contract=off).
 * Outputs in bfloat16 are rounded once, to nearest even (as torch's .to() rounds).
 *
 * Plain C, no torch headers: called through ctypes with raw pointers.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define DENSE_NR 8 /* weight rows per tile (8 chains in flight at one row) */
#define DENSE_MR 2 /* activation rows per tile */
#define DENSE_AHEAD 2 /* tiles prefetched ahead */
/* Below this many weight elements a product runs on one thread (the fork costs more). */
#define DENSE_MIN_PARALLEL (1 << 16)

static inline uint16_t dense_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float dense_from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void dense_store(void *y, int y_bf16, int64_t at, float v) {
    if (y_bf16)
        ((uint16_t *)y)[at] = dense_to_bf16(v);
    else
        ((float *)y)[at] = v;
}

static inline float dense_elem(const void *p, int bf16, int64_t c) {
    return bf16 ? dense_from_bf16(((const uint16_t *)p)[c]) : ((const float *)p)[c];
}

/* The body of a tile function: MR activation rows (at most DENSE_MR) x DENSE_NR weight
 * rows of accumulators (named, so that they stay in registers), VEC elements per step,
 * whole steps unmasked then the tail (DENSE_W / DENSE_X load weight row r / activation
 * row i from element c up to END, zeros past it; DENSE_OP accumulates), each accumulator
 * reduced by RED. */
#define DENSE_ROW(i, XT)                                                                   \
    if (MR > i) {                                                                          \
        const XT xv = DENSE_X(i, END);                                                     \
        DENSE_OP(a##i##0, xv, w0);                                                         \
        DENSE_OP(a##i##1, xv, w1);                                                         \
        DENSE_OP(a##i##2, xv, w2);                                                         \
        DENSE_OP(a##i##3, xv, w3);                                                         \
        DENSE_OP(a##i##4, xv, w4);                                                         \
        DENSE_OP(a##i##5, xv, w5);                                                         \
        DENSE_OP(a##i##6, xv, w6);                                                         \
        DENSE_OP(a##i##7, xv, w7);                                                         \
    }
#define DENSE_STEP(XT)                                                                     \
    do {                                                                                   \
        const XT w0 = DENSE_W(0, END), w1 = DENSE_W(1, END);                               \
        const XT w2 = DENSE_W(2, END), w3 = DENSE_W(3, END);                               \
        const XT w4 = DENSE_W(4, END), w5 = DENSE_W(5, END);                               \
        const XT w6 = DENSE_W(6, END), w7 = DENSE_W(7, END);                               \
        DENSE_ROW(0, XT) DENSE_ROW(1, XT)                                                  \
    } while (0)
#define DENSE_OUT(i, RED)                                                                  \
    if (MR > i) {                                                                          \
        out[i][0] = RED(a##i##0);                                                          \
        out[i][1] = RED(a##i##1);                                                          \
        out[i][2] = RED(a##i##2);                                                          \
        out[i][3] = RED(a##i##3);                                                          \
        out[i][4] = RED(a##i##4);                                                          \
        out[i][5] = RED(a##i##5);                                                          \
        out[i][6] = RED(a##i##6);                                                          \
        out[i][7] = RED(a##i##7);                                                          \
    }
#define DENSE_TILE(AT, XT, ZERO, VEC, RED)                                                 \
    do {                                                                                   \
        AT a00 = ZERO, a01 = ZERO, a02 = ZERO, a03 = ZERO, a04 = ZERO, a05 = ZERO;         \
        AT a06 = ZERO, a07 = ZERO, a10 = ZERO, a11 = ZERO, a12 = ZERO, a13 = ZERO;         \
        AT a14 = ZERO, a15 = ZERO, a16 = ZERO, a17 = ZERO;                                 \
        const int64_t full = k - k % (VEC);                                                \
        int64_t c = 0;                                                                     \
        for (; c < full; c += (VEC)) {                                                     \
            const int64_t END = c + (VEC);                                                 \
            DENSE_STEP(XT);                                                                \
        }                                                                                  \
        if (c < k) {                                                                       \
            const int64_t END = k;                                                         \
            DENSE_STEP(XT);                                                                \
        }                                                                                  \
        DENSE_OUT(0, RED) DENSE_OUT(1, RED)                                                \
    } while (0)

/* ---- portable: 8 lanes, lane l summing elements l, l + 8, ... ------------------------ */

#define DENSE_LANES 8
static void dense_tile_portable(int mr, const void *const w[DENSE_NR], int w_bf16, int64_t k,
                                const void *x, int x_bf16, int64_t xs, float out[DENSE_MR][DENSE_NR]) {
    for (int i = 0; i < mr; i++) {
        const void *xr = x_bf16 ? (const void *)((const uint16_t *)x + i * xs)
                                : (const void *)((const float *)x + i * xs);
        for (int r = 0; r < DENSE_NR; r++) {
            float acc[DENSE_LANES] = {0};
            for (int64_t c0 = 0; c0 < k; c0 += DENSE_LANES)
                for (int l = 0; l < DENSE_LANES; l++) {
                    const int64_t c = c0 + l;
                    if (c < k) {
                        const float p = dense_elem(xr, x_bf16, c) * dense_elem(w[r], w_bf16, c);
                        acc[l] = acc[l] + p;
                    }
                }
            out[i][r] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) +
                        ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        }
    }
}

/* ---- AVX-512 ------------------------------------------------------------------------- */

#ifdef __AVX512F__
/* 16 elements from c as float32 (bfloat16 widened exactly), zeros past k. */
static inline __m512 dense_load16(const void *p, int bf16, int64_t c, int64_t k) {
    const __mmask16 mask = k - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - c)) - 1u);
    if (bf16) {
        const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + c);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)p + c);
}

static inline __attribute__((always_inline)) void dense_tile_f32(
    const int MR, const void *const w[DENSE_NR], int w_bf16, int64_t k, const void *x,
    int x_bf16, int64_t xs, float out[DENSE_MR][DENSE_NR]) {
    const size_t xe = x_bf16 ? sizeof(uint16_t) : sizeof(float);
#define DENSE_W(r, END) dense_load16(w[r], w_bf16, c, END)
#define DENSE_X(i, END) dense_load16((const char *)x + (i) * xs * xe, x_bf16, c, END)
#define DENSE_OP(a, xv, wv) a = _mm512_fmadd_ps(xv, wv, a)
    DENSE_TILE(__m512, __m512, _mm512_setzero_ps(), 16, _mm512_reduce_add_ps);
#undef DENSE_W
#undef DENSE_X
#undef DENSE_OP
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
/* bfloat16 rows with a bfloat16 weight: 32 elements (16 pairs) per step. */
static inline __m512bh dense_load32_bf16(const uint16_t *p, int64_t c, int64_t k) {
    const __mmask32 mask =
        k - c >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (k - c)) - 1u);
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p + c);
}

static inline __attribute__((always_inline)) void dense_tile_bf16(
    const int MR, const void *const w[DENSE_NR], int64_t k, const uint16_t *x, int64_t xs,
    float out[DENSE_MR][DENSE_NR]) {
#define DENSE_W(r, END) dense_load32_bf16((const uint16_t *)w[r], c, END)
#define DENSE_X(i, END) dense_load32_bf16(x + (i) * xs, c, END)
#define DENSE_OP(a, xv, wv) a = _mm512_dpbf16_ps(a, xv, wv)
    DENSE_TILE(__m512, __m512bh, _mm512_setzero_ps(), 32, _mm512_reduce_add_ps);
#undef DENSE_W
#undef DENSE_X
#undef DENSE_OP
}
#define DENSE_HAVE_BF16 1
#endif

/* ---- AVX2 with FMA (no AVX-512) ------------------------------------------------------
 *
 * Sixteen vector registers: a tile of DENSE2_NR weight rows x DENSE2_MR activation rows
 * (12 accumulators, the 3 weight vectors of a step and one activation vector), so nothing
 * spills, for any number of rows. The activations are first made float32 rows of k
 * rounded up to 8, zeros past k (bfloat16 widened exactly), DENSE2_BLOCK bytes of them at
 * a time, which the tiles then read from the cache: a block's rows meet every weight tile
 * before the next block, DENSE2_MR rows (from L1) at a time against a group of tiles
 * (from L2). Each output is still
 * lane l's fused multiply-adds of elements l, l + 8, ... in order, then dense_hsum8. */

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include "keep_in_register.h"
#define DENSE_AVX2 1
#define DENSE2_NR 3
#define DENSE2_MR 4
#ifndef DENSE2_AHEAD
#define DENSE2_AHEAD 2 /* tiles prefetched ahead */
#endif
#define DENSE2_BLOCK (192 * 1024)
#ifndef DENSE2_GROUP
#define DENSE2_GROUP (96 * 1024)
#endif

static inline float dense_hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* 8 elements of a weight row from c as float32 (bfloat16 widened exactly), zeros past k. */
static inline __attribute__((always_inline)) __m256 dense2_w8(const void *p, const int bf16,
                                                              int64_t c, int64_t k) {
    if (k - c >= 8) {
        if (bf16) {
            const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + c));
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        return _mm256_loadu_ps((const float *)p + c);
    }
    float tmp[8] = {0};
    for (int64_t l = 0; l < k - c; l++) tmp[l] = dense_elem(p, bf16, c + l);
    return _mm256_loadu_ps(tmp);
}

#define DENSE2_ROW(i)                                                                      \
    if (MR > i) {                                                                          \
        __m256 xv = _mm256_loadu_ps(x + (i) * xs + c);                                     \
        KEEP_IN_REGISTER(xv);                                                              \
        a##i##0 = _mm256_fmadd_ps(xv, w0, a##i##0);                                        \
        a##i##1 = _mm256_fmadd_ps(xv, w1, a##i##1);                                        \
        a##i##2 = _mm256_fmadd_ps(xv, w2, a##i##2);                                        \
    }
#define DENSE2_STEP(END)                                                                   \
    do {                                                                                   \
        if (PREFETCH) {                                                                    \
            _mm_prefetch(ahead, _MM_HINT_T0);                                              \
            _mm_prefetch(ahead + 64, _MM_HINT_T0);                                         \
            ahead += ahead_step;                                                           \
        }                                                                                  \
        __m256 w0 = dense2_w8(w[0], BF, c, END), w1 = dense2_w8(w[1], BF, c, END);        \
        __m256 w2 = dense2_w8(w[2], BF, c, END);                                           \
        KEEP_IN_REGISTER(w0);                                                              \
        KEEP_IN_REGISTER(w1);                                                              \
        KEEP_IN_REGISTER(w2);                                                              \
        DENSE2_ROW(0) DENSE2_ROW(1) DENSE2_ROW(2) DENSE2_ROW(3)                            \
    } while (0)
#define DENSE2_OUT(i)                                                                      \
    if (MR > i) {                                                                          \
        out[i][0] = dense_hsum8(a##i##0);                                                  \
        out[i][1] = dense_hsum8(a##i##1);                                                  \
        out[i][2] = dense_hsum8(a##i##2);                                                  \
    }

/* Weight rows w[0..2] (bfloat16 where BF) against MR float32 rows of x (stride xs, k
 * rounded up to 8 with zeros). With PREFETCH, each step also fetches two cache lines from
 * `ahead` on, then moves it on by ahead_step bytes (a share of a tile ahead): spread over
 * the multiply-adds, the memory's requests stay in flight without a burst of them filling
 * the core's miss buffers before the tile starts (1 and 8 rows from memory: 10-20% faster
 * than prefetching each tile whole before the one before it). */
static inline __attribute__((always_inline)) void dense2_tile(const int MR, const int BF,
                                                              const int PREFETCH,
                                                              const void *const w[DENSE2_NR],
                                                              int64_t k, const float *x,
                                                              int64_t xs,
                                                              float out[DENSE2_MR][DENSE2_NR],
                                                              const char *ahead,
                                                              const int64_t ahead_step) {
    const __m256 z = _mm256_setzero_ps();
    __m256 a00 = z, a01 = z, a02 = z, a10 = z, a11 = z, a12 = z;
    __m256 a20 = z, a21 = z, a22 = z, a30 = z, a31 = z, a32 = z;
    const int64_t full = k - k % 8;
    int64_t c = 0;
    for (; c < full; c += 8) DENSE2_STEP(c + 8);
    if (c < k) DENSE2_STEP(k);
    DENSE2_OUT(0) DENSE2_OUT(1) DENSE2_OUT(2) DENSE2_OUT(3)
}
#undef DENSE2_ROW
#undef DENSE2_STEP
#undef DENSE2_OUT

/* dense2_tile for mr rows, bf, and prefetching `ahead` unless it is NULL (prefetches do
 * not fault: past the weight's end they are dropped). */
static void dense2_tile_any(int mr, int bf, const void *const w[DENSE2_NR], int64_t k,
                            const float *x, int64_t xs, float out[DENSE2_MR][DENSE2_NR],
                            const char *ahead, int64_t ahead_step) {
#define DENSE2_CASE(MR, BF)                                                                \
    if (ahead != NULL)                                                                     \
        dense2_tile(MR, BF, 1, w, k, x, xs, out, ahead, ahead_step);                       \
    else                                                                                   \
        dense2_tile(MR, BF, 0, w, k, x, xs, out, NULL, 0);                                 \
    return;
    if (bf) {
        switch (mr) {
        case 1: DENSE2_CASE(1, 1)
        case 2: DENSE2_CASE(2, 1)
        case 3: DENSE2_CASE(3, 1)
        default: DENSE2_CASE(4, 1)
        }
    }
    switch (mr) {
    case 1: DENSE2_CASE(1, 0)
    case 2: DENSE2_CASE(2, 0)
    case 3: DENSE2_CASE(3, 0)
    default: DENSE2_CASE(4, 0)
    }
#undef DENSE2_CASE
}

/* Rows [i0, i0 + rows) of x as float32 rows of stride kp (zeros from k to kp). */
static inline void dense2_rows_f32(const void *x, int x_bf16, int64_t xs, int64_t k, int64_t kp,
                                   int64_t i0, int64_t rows, float *xb) {
    for (int64_t i = 0; i < rows; i++) {
        float *d = xb + i * kp;
        if (x_bf16) {
            const uint16_t *s = (const uint16_t *)x + (i0 + i) * xs;
            int64_t c = 0;
            for (; c + 8 <= k; c += 8) {
                const __m128i h = _mm_loadu_si128((const __m128i *)(s + c));
                _mm256_storeu_ps(d + c, _mm256_castsi256_ps(
                                            _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
            }
            for (; c < k; c++) d[c] = dense_from_bf16(s[c]);
        } else {
            memcpy(d, (const float *)x + (i0 + i) * xs, sizeof(float) * (size_t)k);
        }
        for (int64_t c = k; c < kp; c++) d[c] = 0.0f;
    }
}

/* Products of DENSE_PK_MIN_ROWS rows or more (a decode step of many sequences): packed
 * panels. The tiles above read 3 weight vectors and 4 activation vectors for 12
 * multiply-adds, and a tile's rows come from L2 at every weight tile (64 rows of SmolLM2:
 * 147 KB): that traffic, not the memory, holds them near 100 GFLOPS on two Zen 3 cores.
 * Here 16 weight rows at a time are first laid out transposed, P[l][s][c] = w[j + c][8s + l]
 * (a panel: 8x8 transposes, bfloat16 widened), and the rows likewise,
 * X[l][tile][s][i] = x[6 tile + i][8s + l]; then each lane l of the tiles' chains is one pass
 * of a 6 x 16 outer-product kernel: two weight vectors from L1 and six broadcast activations
 * for 12 multiply-adds. Every output is still lane l's fused multiply-adds of elements
 * l, l + 8, ... in order, then dense_hsum8's tree ((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
 * (l3 + l7)): bit-equal to the tiles, so a row's result does not depend on how many rows
 * share the call. The next panel's weight rows are fetched a share per kernel call. Zen 3,
 * 2 cores, SmolLM2-135M's 120 products of a step from memory, ms (medians of 9 alternating
 * runs, three runs): float32 64 rows 130-140 -> 114-122, bfloat16 weights 64 rows 149 ->
 * 123, 128 rows 365 -> 282; at 40 rows and fewer the packing costs what it saves. */
#define DENSE_PK_NB 16 /* weight rows (outputs) per panel */
#define DENSE_PK_MR 6  /* activation rows per kernel call */
#define DENSE_PK_RB 96 /* rows a panel meets before the next lane (their X in L1/L2) */
#define DENSE_PK_KB 2048 /* k per pass: a lane's panel slice (16 x 256 floats) stays in L1 */
#define DENSE_PK_CHUNK 1024 /* rows packed at once */
#ifndef DENSE_PK_MIN_ROWS
#define DENSE_PK_MIN_ROWS 48
#endif

/* t[l] = (v[0][l], ..., v[7][l]) */
#define DENSE_PK_T8(v, t)                                                                  \
    do {                                                                                   \
        const __m256 a0 = _mm256_unpacklo_ps(v[0], v[1]), a1 = _mm256_unpackhi_ps(v[0], v[1]); \
        const __m256 a2 = _mm256_unpacklo_ps(v[2], v[3]), a3 = _mm256_unpackhi_ps(v[2], v[3]); \
        const __m256 a4 = _mm256_unpacklo_ps(v[4], v[5]), a5 = _mm256_unpackhi_ps(v[4], v[5]); \
        const __m256 a6 = _mm256_unpacklo_ps(v[6], v[7]), a7 = _mm256_unpackhi_ps(v[6], v[7]); \
        const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE); \
        const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE); \
        const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE); \
        const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE); \
        t[0] = _mm256_permute2f128_ps(b0, b4, 0x20);                                       \
        t[4] = _mm256_permute2f128_ps(b0, b4, 0x31);                                       \
        t[1] = _mm256_permute2f128_ps(b1, b5, 0x20);                                       \
        t[5] = _mm256_permute2f128_ps(b1, b5, 0x31);                                       \
        t[2] = _mm256_permute2f128_ps(b2, b6, 0x20);                                       \
        t[6] = _mm256_permute2f128_ps(b2, b6, 0x31);                                       \
        t[3] = _mm256_permute2f128_ps(b3, b7, 0x20);                                       \
        t[7] = _mm256_permute2f128_ps(b3, b7, 0x31);                                       \
    } while (0)

/* Step s of eight weight rows (v[r]: elements 8s.. of row r) into a panel's half Ph:
 * Ph[l][s][r] = v[r][l]. */
static inline __attribute__((always_inline)) void dense_pk_put(const __m256 v[8], float *Ph,
                                                               int64_t S, int64_t s) {
    __m256 t[8];
    DENSE_PK_T8(v, t);
    for (int l = 0; l < 8; l++)
        _mm256_store_ps(Ph + ((size_t)l * (size_t)S + (size_t)s) * DENSE_PK_NB, t[l]);
}

/* The panel of weight rows j..j+15 over k0..k0+8S: P[l][s][c] = w[j + c][k0 + 8s + l],
 * zeros past n and past k. */
static void dense_pk_pack_w(const void *w, int bf16, int64_t n, int64_t k, int64_t j, int64_t k0,
                            int64_t S, float *P) {
    const size_t we = bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t whole = (k - k0) / 8 < S ? (k - k0) / 8 : S; /* steps of 8 inside k */
    for (int h = 0; h < 2; h++) {
        const int64_t j0 = j + 8 * h;
        float *Ph = P + 8 * h;
        int64_t s = 0;
        if (j0 + 8 <= n && bf16) {
            const uint16_t *r0 = (const uint16_t *)w + (size_t)j0 * (size_t)k + (size_t)k0;
            for (; s < whole; s++) {
                __m256 v[8];
                for (int r = 0; r < 8; r++) {
                    const __m128i q = _mm_loadu_si128(
                        (const __m128i *)(r0 + (size_t)r * (size_t)k + (size_t)(8 * s)));
                    v[r] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(q), 16));
                }
                dense_pk_put(v, Ph, S, s);
            }
        } else if (j0 + 8 <= n) {
            const float *r0 = (const float *)w + (size_t)j0 * (size_t)k + (size_t)k0;
            for (; s < whole; s++) {
                __m256 v[8];
                for (int r = 0; r < 8; r++)
                    v[r] = _mm256_loadu_ps(r0 + (size_t)r * (size_t)k + (size_t)(8 * s));
                dense_pk_put(v, Ph, S, s);
            }
        }
        for (; s < S; s++) { /* the last rows and k's tail */
            __m256 v[8];
            for (int r = 0; r < 8; r++)
                v[r] = j0 + r < n ? dense2_w8((const char *)w + (size_t)(j0 + r) * (size_t)k * we,
                                              bf16, k0 + 8 * s, k)
                                  : _mm256_setzero_ps();
            dense_pk_put(v, Ph, S, s);
        }
    }
}

/* Row tile t (rows i0 + 6t.., of `rows`) over k0..k0+8S into X (lane l's slice at
 * X + l * rows * S, the tile's at 6t * S of it, [s][i]); bfloat16 widened, zeros past k. */
static void dense_pk_pack_x(const void *x, int x_bf16, int64_t xs, int64_t k, int64_t i0,
                            int64_t rows, int64_t t, int64_t k0, int64_t S, float *X) {
    const int mr = (int)(rows - t * DENSE_PK_MR < DENSE_PK_MR ? rows - t * DENSE_PK_MR : DENSE_PK_MR);
    const size_t xe = x_bf16 ? sizeof(uint16_t) : sizeof(float);
    const void *src[8];
    for (int i = 0; i < 8; i++)
        src[i] = i < mr ? (const char *)x + (size_t)((i0 + t * DENSE_PK_MR + i) * xs) * xe : NULL;
    const __m256i keep =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(mr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    float *d = X + (size_t)(t * DENSE_PK_MR) * (size_t)S;
    const size_t lane = (size_t)rows * (size_t)S;
    for (int64_t s = 0; s < S; s++) {
        __m256 v[8], tr[8];
        for (int i = 0; i < 8; i++)
            v[i] = src[i] ? dense2_w8(src[i], x_bf16, k0 + 8 * s, k) : _mm256_setzero_ps();
        DENSE_PK_T8(v, tr);
        for (int l = 0; l < 8; l++) _mm256_maskstore_ps(d + l * lane + s * mr, keep, tr[l]);
    }
}

#define DENSE_PK_INIT(i)                                                                   \
    if (MR > i) {                                                                          \
        c##i##0 = first ? z : _mm256_load_ps(r + (i) * DENSE_PK_NB);                       \
        c##i##1 = first ? z : _mm256_load_ps(r + (i) * DENSE_PK_NB + 8);                   \
    }
#define DENSE_PK_ROW(i)                                                                    \
    if (MR > i) {                                                                          \
        const __m256 b = _mm256_broadcast_ss(xp + s * MR + i);                             \
        c##i##0 = _mm256_fmadd_ps(b, w0, c##i##0);                                         \
        c##i##1 = _mm256_fmadd_ps(b, w1, c##i##1);                                         \
    }
#define DENSE_PK_SAVE(i)                                                                   \
    if (MR > i) {                                                                          \
        _mm256_store_ps(r + (i) * DENSE_PK_NB, c##i##0);                                   \
        _mm256_store_ps(r + (i) * DENSE_PK_NB + 8, c##i##1);                               \
    }
/* One lane's chains for MR rows x 16 outputs over S steps: r[i][c] (from zero when
 * `first`, else continued from r: a later k block) += xp[s][i] * wp[s][c] in order of s. */
static inline __attribute__((always_inline)) void dense_pk_kernel(const int MR, const float *xp,
                                                                  const float *wp, int64_t S,
                                                                  float *r, int first) {
    const __m256 z = _mm256_setzero_ps();
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    DENSE_PK_INIT(0) DENSE_PK_INIT(1) DENSE_PK_INIT(2) DENSE_PK_INIT(3) DENSE_PK_INIT(4)
    DENSE_PK_INIT(5)
    for (int64_t s = 0; s < S; s++) {
        __m256 w0 = _mm256_load_ps(wp + s * DENSE_PK_NB), w1 = _mm256_load_ps(wp + s * DENSE_PK_NB + 8);
        KEEP_IN_REGISTER(w0);
        KEEP_IN_REGISTER(w1);
        DENSE_PK_ROW(0) DENSE_PK_ROW(1) DENSE_PK_ROW(2) DENSE_PK_ROW(3) DENSE_PK_ROW(4)
        DENSE_PK_ROW(5)
    }
    DENSE_PK_SAVE(0) DENSE_PK_SAVE(1) DENSE_PK_SAVE(2) DENSE_PK_SAVE(3) DENSE_PK_SAVE(4)
    DENSE_PK_SAVE(5)
}
#undef DENSE_PK_INIT
#undef DENSE_PK_ROW
#undef DENSE_PK_SAVE

static void dense_pk_kernel_any(int mr, const float *xp, const float *wp, int64_t S, float *r,
                                int first) {
    switch (mr) {
    case 1: dense_pk_kernel(1, xp, wp, S, r, first); return;
    case 2: dense_pk_kernel(2, xp, wp, S, r, first); return;
    case 3: dense_pk_kernel(3, xp, wp, S, r, first); return;
    case 4: dense_pk_kernel(4, xp, wp, S, r, first); return;
    case 5: dense_pk_kernel(5, xp, wp, S, r, first); return;
    default: dense_pk_kernel(6, xp, wp, S, r, first); return;
    }
}

static void *dense_pk_alloc(size_t floats) {
    return aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
}

/* Rows i0..i0+rows of the product (see dense2_matmul for the arguments) by packed panels;
 * threads split the panels. Returns 0, or -2 when the buffers cannot be allocated. */
static int dense_pk_matmul(const void *w, int w_bf16, int64_t n, int64_t k, const void *x,
                           int x_bf16, int64_t xs, int64_t i0, int64_t rows, void *y, int y_bf16,
                           int64_t ys, int threads) {
    const int64_t kp = (k + 7) / 8 * 8;
    const int64_t kb = kp < DENSE_PK_KB ? kp : DENSE_PK_KB;
    const int64_t panels = (n + DENSE_PK_NB - 1) / DENSE_PK_NB;
    const int64_t tiles = (rows + DENSE_PK_MR - 1) / DENSE_PK_MR;
    const int64_t kblocks = (kp + kb - 1) / kb;
    const size_t we = w_bf16 ? sizeof(uint16_t) : sizeof(float);
    /* One allocation by the calling thread: the packed rows X, then each thread's panel P
     * and lane sums R ([l][row][c]); sizes in floats, multiples of 16 (64 bytes). */
    const size_t x_size = (size_t)(rows * kp + 15) / 16 * 16;
    const size_t p_size = (size_t)(DENSE_PK_NB * kb), r_size = (size_t)(8 * rows * DENSE_PK_NB);
    float *X = (float *)dense_pk_alloc(x_size + (size_t)threads * (p_size + r_size));
    if (X == NULL) return -2;
#pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num();
        float *P = X + x_size + (size_t)me * (p_size + r_size);
        float *R = P + p_size;
        /* (k block b of X at X + rows * b * kb) */
#pragma omp for schedule(static)
        for (int64_t q = 0; q < tiles * kblocks; q++) {
            const int64_t k0 = q / tiles * kb, S = (kp - k0 < kb ? kp - k0 : kb) / 8;
            dense_pk_pack_x(x, x_bf16, xs, k, i0, rows, q % tiles, k0, S, X + rows * k0);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t j = p * DENSE_PK_NB;
            for (int64_t k0 = 0; k0 < kp; k0 += kb) {
                const int64_t S = (kp - k0 < kb ? kp - k0 : kb) / 8;
                dense_pk_pack_w(w, w_bf16, n, k, j, k0, S, P);
                /* The next panel's rows (contiguous), a share before each kernel call. */
                const int64_t jn = j + DENSE_PK_NB;
                const int fetch = jn < n && k0 + kb >= kp;
                const size_t next_bytes =
                    fetch ? (size_t)((n - jn < DENSE_PK_NB ? n - jn : DENSE_PK_NB) * k) * we : 0;
                const char *next = (const char *)w + (size_t)jn * (size_t)k * we;
                const size_t calls = (size_t)(8 * tiles);
                size_t call = 0;
                for (int64_t r0 = 0; r0 < rows; r0 += DENSE_PK_RB) {
                    const int64_t rb = rows - r0 < DENSE_PK_RB ? rows - r0 : DENSE_PK_RB;
                    const int64_t rb_tiles = (rb + DENSE_PK_MR - 1) / DENSE_PK_MR;
                    for (int l = 0; l < 8; l++) {
                        const float *Xl = X + rows * k0 + ((size_t)l * (size_t)rows + (size_t)r0) * (size_t)S;
                        const float *Pl = P + (size_t)l * (size_t)S * DENSE_PK_NB;
                        for (int64_t t = 0; t < rb_tiles; t++, call++) {
                            if (fetch) {
                                const size_t a = next_bytes * call / calls / 64 * 64;
                                const size_t b = next_bytes * (call + 1) / calls;
                                for (size_t o = a; o < b; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
                            }
                            const int64_t t_rows = rb - t * DENSE_PK_MR;
                            dense_pk_kernel_any(
                                (int)(t_rows < DENSE_PK_MR ? t_rows : DENSE_PK_MR),
                                Xl + t * DENSE_PK_MR * S, Pl, S,
                                R + ((size_t)l * (size_t)rows + (size_t)(r0 + t * DENSE_PK_MR)) * DENSE_PK_NB,
                                k0 == 0);
                        }
                    }
                }
            }
            /* dense_hsum8's tree over the lanes, 8 outputs at a time */
            const size_t L = (size_t)rows * DENSE_PK_NB;
            for (int64_t i = 0; i < rows; i++) {
                float o[DENSE_PK_NB];
                for (int h = 0; h < 2; h++) {
                    const float *b = R + (size_t)i * DENSE_PK_NB + 8 * h;
                    const __m256 s04 = _mm256_add_ps(_mm256_load_ps(b), _mm256_load_ps(b + 4 * L));
                    const __m256 s26 = _mm256_add_ps(_mm256_load_ps(b + 2 * L), _mm256_load_ps(b + 6 * L));
                    const __m256 s15 = _mm256_add_ps(_mm256_load_ps(b + L), _mm256_load_ps(b + 5 * L));
                    const __m256 s37 = _mm256_add_ps(_mm256_load_ps(b + 3 * L), _mm256_load_ps(b + 7 * L));
                    const __m256 sum = _mm256_add_ps(_mm256_add_ps(s04, s26), _mm256_add_ps(s15, s37));
                    if (!y_bf16 && j + 8 * h + 8 <= n)
                        _mm256_storeu_ps((float *)y + (i0 + i) * ys + j + 8 * h, sum);
                    else
                        _mm256_storeu_ps(o + 8 * h, sum);
                }
                for (int64_t c = y_bf16 ? 0 : (n - j) / 8 * 8; c < DENSE_PK_NB && j + c < n; c++)
                    dense_store(y, y_bf16, (i0 + i) * ys + j + c, o[c]);
            }
        }
    }
    free(X);
    return 0;
}

static int dense2_matmul(const void *w, int w_bf16, int64_t n, int64_t k, const void *x,
                         int x_bf16, int64_t m, int64_t xs, void *y, int y_bf16, int64_t ys,
                         int nthreads) {
    const int64_t kp = (k + 7) / 8 * 8;
    const int threads = n * k >= DENSE_MIN_PARALLEL ? nthreads : 1;
    if (m >= DENSE_PK_MIN_ROWS) {
        for (int64_t i0 = 0; i0 < m; i0 += DENSE_PK_CHUNK) {
            const int64_t rows = m - i0 < DENSE_PK_CHUNK ? m - i0 : DENSE_PK_CHUNK;
            const int status =
                dense_pk_matmul(w, w_bf16, n, k, x, x_bf16, xs, i0, rows, y, y_bf16, ys, threads);
            if (status != 0) return status;
        }
        return 0;
    }
    /* Rows of a block: DENSE2_BLOCK bytes of float32 rows, whole tiles of rows. */
    int64_t block = DENSE2_BLOCK / (int64_t)(sizeof(float) * (size_t)kp);
    block = block < DENSE2_MR ? DENSE2_MR : block / DENSE2_MR * DENSE2_MR;
    if (block > m) block = m;
    /* float32 rows of k a multiple of 8 are read where they are. */
    const int direct = !x_bf16 && kp == k;
    float *xb = direct ? NULL : (float *)malloc(sizeof(float) * (size_t)(block * kp));
    if (!direct && xb == NULL) return -2;
    const int64_t tiles = (n + DENSE2_NR - 1) / DENSE2_NR;
    const size_t we = w_bf16 ? sizeof(uint16_t) : sizeof(float);
    /* Each thread takes groups of DENSE2_GROUP bytes of weight tiles; each tile, once in
     * L1, meets the block's rows, DENSE2_MR at a time. The tile DENSE2_AHEAD tiles on (one
     * contiguous run of the weight) is fetched meanwhile on the weight's first pass, a share
     * of it by each row tile: memory stays busy while the later rows compute (8 rows from
     * memory: 44 -> 35 ms against all the rows' first tiles, then the others, from L2). */
    const size_t tile_bytes = (size_t)(DENSE2_NR * k) * we;
    int64_t group = DENSE2_GROUP / (int64_t)tile_bytes;
    group = group < 1 ? 1 : group;
    for (int64_t i0 = 0; i0 < m; i0 += block) {
        const int64_t rows = m - i0 < block ? m - i0 : block;
        const float *xr = direct ? (const float *)x + i0 * xs : xb;
        const int64_t xrs = direct ? xs : kp;
        const int64_t shares = (rows + DENSE2_MR - 1) / DENSE2_MR;
        const int64_t ahead_step = (int64_t)(8 * DENSE2_NR * we) / shares;
        if (!direct) dense2_rows_f32(x, x_bf16, xs, k, kp, i0, rows, xb);
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t t0 = 0; t0 < tiles; t0 += group) {
            const int64_t t1 = t0 + group < tiles ? t0 + group : tiles;
            for (int64_t t = t0; t < t1; t++) {
                const int64_t j = t * DENSE2_NR;
                const void *wr[DENSE2_NR];
                for (int r = 0; r < DENSE2_NR; r++)
                    wr[r] = (const char *)w + (size_t)(j + r < n ? j + r : n - 1) *
                                                  (size_t)k * we;
                const int fetch = DENSE2_AHEAD > 0 && i0 == 0 && t + DENSE2_AHEAD < tiles;
                for (int64_t i = 0; i < rows; i += DENSE2_MR) {
                    const int mr = (int)(rows - i < DENSE2_MR ? rows - i : DENSE2_MR);
                    const char *ahead =
                        fetch ? (const char *)w + tile_bytes * (size_t)(t + DENSE2_AHEAD) +
                                    tile_bytes * (size_t)(i / DENSE2_MR) / (size_t)shares
                              : NULL;
                    float out[DENSE2_MR][DENSE2_NR];
                    dense2_tile_any(mr, w_bf16, wr, k, xr + i * xrs, xrs, out, ahead,
                                    ahead_step);
                    for (int a = 0; a < mr; a++)
                        for (int r = 0; r < DENSE2_NR && j + r < n; r++)
                            dense_store(y, y_bf16, (i0 + i + a) * ys + j + r, out[a][r]);
                }
            }
        }
    }
    free(xb);
    return 0;
}
#define DENSE_HAVE_SIMD 1
#endif
#ifdef __AVX512F__
#define DENSE_HAVE_SIMD 1
#endif

/* What this build takes: bit 0 vector float32 products (AVX-512F, or AVX2 with FMA), bit
 * 1 bfloat16 pairs (AVX512-BF16), bit 2 the AVX2 tiles (blocked for any number of rows). */
int pagedllm_dense_features(void) {
    int features = 0;
#ifdef DENSE_HAVE_SIMD
    features |= 1;
#endif
#ifdef DENSE_HAVE_BF16
    features |= 2;
#endif
#ifdef DENSE_AVX2
    features |= 4;
#endif
    return features;
}

/* One tile: weight rows j..j+DENSE_NR (rows past n repeat row n - 1 and are not stored)
 * against activation rows i0..i0+mr. */
static inline void dense_tile(int path, const void *w, int w_bf16, int64_t n, int64_t k,
                              int64_t j, const void *x, int x_bf16, int64_t xs, int mr,
                              float out[DENSE_MR][DENSE_NR]) {
    const size_t we = w_bf16 ? sizeof(uint16_t) : sizeof(float);
    const void *rows[DENSE_NR];
    for (int r = 0; r < DENSE_NR; r++)
        rows[r] = (const char *)w + (size_t)(j + r < n ? j + r : n - 1) * (size_t)k * we;
    switch (path) {
#ifdef DENSE_HAVE_BF16
    case 2:
        switch (mr) {
        case 1: dense_tile_bf16(1, rows, k, (const uint16_t *)x, xs, out); return;
        default: dense_tile_bf16(2, rows, k, (const uint16_t *)x, xs, out); return;
        }
#endif
#if defined(DENSE_HAVE_SIMD) && !defined(DENSE_AVX2) /* (AVX2: dense2_matmul) */
    case 1:
        switch (mr) {
        case 1: dense_tile_f32(1, rows, w_bf16, k, x, x_bf16, xs, out); return;
        default: dense_tile_f32(2, rows, w_bf16, k, x, x_bf16, xs, out); return;
        }
#endif
    default:
        dense_tile_portable(mr, rows, w_bf16, k, x, x_bf16, xs, out);
    }
}

/* y[m, n] = x[m, k] . W[n, k] for a dense W (contiguous rows, bfloat16 where w_bf16 else
 * float32) and x rows of stride x_stride elements (bfloat16 where x_bf16), into y (row
 * stride y_stride; bfloat16 where y_bf16). `portable` forces the plain C path. Returns 0
 * (every combination of dtypes is taken; bfloat16 pairs only for bfloat16 rows and weights). */
int pagedllm_dense_matmul_small(const void *w, int w_bf16, int64_t n, int64_t k, const void *x,
                                int x_bf16, int64_t m, int64_t x_stride, void *y, int y_bf16,
                                int64_t y_stride, int nthreads, int portable) {
    int path = 0;
#ifdef DENSE_HAVE_SIMD
    path = 1;
#endif
#ifdef DENSE_HAVE_BF16
    if (w_bf16 && x_bf16) path = 2;
#endif
    if (portable) path = 0;
    if (n <= 0 || m <= 0) return 0;
#ifdef DENSE_AVX2
    if (path == 1)
        return dense2_matmul(w, w_bf16, n, k, x, x_bf16, m, x_stride, y, y_bf16, y_stride,
                             nthreads);
#endif
    const int64_t tiles = (n + DENSE_NR - 1) / DENSE_NR;
    const size_t xe = x_bf16 ? sizeof(uint16_t) : sizeof(float);
    const int threads = n * k >= DENSE_MIN_PARALLEL ? nthreads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t j = t * DENSE_NR;
#if defined(__AVX2__) || defined(__AVX512F__)
        /* The tile DENSE_AHEAD tiles on (one contiguous run of the weight) fetched while
         * this one is multiplied: the prefetchers alone left a bfloat16 product of one row
         * at two thirds of the memory bandwidth a float32 one reaches (which the extra
         * instructions slow down: float32 weights go without). */
        if (w_bf16 && t + DENSE_AHEAD < tiles) {
            const size_t we = sizeof(uint16_t);
            const char *ahead = (const char *)w + (size_t)((j + DENSE_AHEAD * DENSE_NR) * k) * we;
            const int64_t rows_ahead = n - (j + DENSE_AHEAD * DENSE_NR);
            const size_t bytes = (size_t)((rows_ahead < DENSE_NR ? rows_ahead : DENSE_NR) * k) * we;
            for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
        }
#endif
        for (int64_t i0 = 0; i0 < m; i0 += DENSE_MR) {
            const int mr = (int)(m - i0 < DENSE_MR ? m - i0 : DENSE_MR);
            float out[DENSE_MR][DENSE_NR];
            dense_tile(path, w, w_bf16, n, k, j, (const char *)x + (size_t)(i0 * x_stride) * xe,
                       x_bf16, x_stride, mr, out);
            for (int i = 0; i < mr; i++)
                for (int r = 0; r < DENSE_NR && j + r < n; r++)
                    dense_store(y, y_bf16, (i0 + i) * y_stride + j + r, out[i][r]);
        }
    }
    return 0;
}
