/* GGUF dequantization and matmul for CPUs (pagedllm/kernels/gguf_cpu.py builds and loads
 * this file on first use).
 *
 * Dequantization follows gguf.quants operation by operation (fp16 scales widened to
 * float32 first, the same products and sums in the same order) and is built with
 * -ffp-contract=off, so its float32 results are bit-exact with the torch reference in
 * gguf_dequant.py. The matmul decodes the weight a few rows at a time into a
 * thread-local buffer (for Q4_0/Q4_1/Q8_0 panels of 32 rows on AVX-512, 16 on AVX2, or,
 * for a few activation rows on AVX-512, one block at a time in registers; single rows
 * otherwise) and multiplies them with every activation row, so the weight is read packed
 * and never exists in float form as a whole.
 *
 * Plain C, no torch headers: called through ctypes with raw pointers.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30
};

#ifdef __F16C__
#include <immintrin.h>
static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2); /* GGUF is little-endian, as is every x86 CPU */
    return _cvtsh_ss(h);
}
#else
static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F;
    uint32_t man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* One block of each type -> 32 or 256 floats. */

static inline void blk_q4_0(const uint8_t *b, float *y) {
    const float d = f16_to_f32(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * ((float)(qs[j] & 0x0F) - 8.0f);
        y[j + 16] = d * ((float)(qs[j] >> 4) - 8.0f);
    }
}

static inline void blk_q4_1(const uint8_t *b, float *y) {
    const float d = f16_to_f32(b), m = f16_to_f32(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (d * (float)(qs[j] & 0x0F)) + m;
        y[j + 16] = (d * (float)(qs[j] >> 4)) + m;
    }
}

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline void blk_q5_0(const uint8_t *b, float *y) {
    const float d = f16_to_f32(b);
    const uint32_t qh = le32(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = d * ((float)lo - 16.0f);
        y[j + 16] = d * ((float)hi - 16.0f);
    }
}

static inline void blk_q5_1(const uint8_t *b, float *y) {
    const float d = f16_to_f32(b), m = f16_to_f32(b + 2);
    const uint32_t qh = le32(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = (d * (float)lo) + m;
        y[j + 16] = (d * (float)hi) + m;
    }
}

static inline void blk_q8_0(const uint8_t *b, float *y) {
    const float d = f16_to_f32(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

static void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static inline void blk_q4_k(const uint8_t *b, float *y) {
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    const uint8_t *scales = b + 4, *qs = b + 16;
    for (int j = 0; j < 4; j++) {
        int sc0, m0, sc1, m1;
        scale_min_k4(scales, 2 * j, &sc0, &m0);
        scale_min_k4(scales, 2 * j + 1, &sc1, &m1);
        const float d0 = d * (float)sc0, mm0 = dmin * (float)m0;
        const float d1 = d * (float)sc1, mm1 = dmin * (float)m1;
        const uint8_t *q = qs + 32 * j;
        float *out = y + 64 * j;
        for (int l = 0; l < 32; l++) {
            out[l] = d0 * (float)(q[l] & 0x0F) - mm0;
            out[l + 32] = d1 * (float)(q[l] >> 4) - mm1;
        }
    }
}

static inline void blk_q5_k(const uint8_t *b, float *y) {
    const float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 4; j++) {
        int sc0, m0, sc1, m1;
        scale_min_k4(scales, 2 * j, &sc0, &m0);
        scale_min_k4(scales, 2 * j + 1, &sc1, &m1);
        const float d0 = d * (float)sc0, mm0 = dmin * (float)m0;
        const float d1 = d * (float)sc1, mm1 = dmin * (float)m1;
        const uint8_t *q = qs + 32 * j;
        float *out = y + 64 * j;
        for (int l = 0; l < 32; l++) {
            int lo = (q[l] & 0x0F) | (((qh[l] >> (2 * j)) & 1) << 4);
            int hi = (q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4);
            out[l] = d0 * (float)lo - mm0;
            out[l + 32] = d1 * (float)hi - mm1;
        }
    }
}

static inline void blk_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = f16_to_f32(b + 208);
    float dl[16];
    for (int i = 0; i < 16; i++) dl[i] = d * (float)scales[i];
    for (int r = 0; r < 2; r++) {          /* two halves of 128 values */
        for (int l = 0; l < 32; l++) {
            for (int f = 0; f < 4; f++) {  /* value 128r + 32f + l */
                int v = 128 * r + 32 * f + l;
                /* low nibbles of a 64-byte run are values 0..63 of its half, high
                 * nibbles values 64..127 */
                const uint8_t byte = ql[64 * r + 32 * (f & 1) + l];
                int low = f >= 2 ? (byte >> 4) : (byte & 0x0F);
                int high = (qh[32 * r + l] >> (2 * f)) & 3;
                y[v] = dl[v / 16] * ((float)(low | (high << 4)) - 32.0f);
            }
        }
    }
}

static inline void blk_q2_k(const uint8_t *b, float *y) {
    const uint8_t *scales = b, *qs = b + 16;
    const float d = f16_to_f32(b + 80), dmin = f16_to_f32(b + 82);
    for (int v = 0; v < 256; v++) {
        const int r = v / 128, f = (v % 128) / 32, i = v % 32, s = v / 16;
        const float dl = d * (float)(scales[s] & 0x0F), ml = dmin * (float)(scales[s] >> 4);
        y[v] = dl * (float)((qs[32 * r + i] >> (2 * f)) & 3) - ml;
    }
}

static inline void blk_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hmask = b, *qs = b + 32, *packed = b + 96;
    const float d = f16_to_f32(b + 108);
    float dl[16];
    for (int j = 0; j < 16; j++) {
        int low = j < 8 ? (packed[j] & 0x0F) : (packed[j - 8] >> 4);
        int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        dl[j] = d * ((float)(low | (high << 4)) - 32.0f);
    }
    for (int v = 0; v < 256; v++) {
        const int r = v / 128, f = (v % 128) / 32, i = v % 32;
        const int ql = (qs[32 * r + i] >> (2 * f)) & 3;
        const int qh = (((hmask[v % 32] >> (v / 32)) & 1) ^ 1) << 2;
        y[v] = dl[v / 16] * ((float)ql - (float)qh);
    }
}

static inline void blk_f16(const uint8_t *b, float *y) { y[0] = f16_to_f32(b); }

static inline void blk_bf16(const uint8_t *b, float *y) {
    uint32_t bits = ((uint32_t)b[0] | ((uint32_t)b[1] << 8)) << 16;
    memcpy(y, &bits, 4);
}

static inline void blk_f32(const uint8_t *b, float *y) { memcpy(y, b, 4); }

/* One row function per type, so each block decoder is inlined into its loop. */
typedef void (*row_fn)(const uint8_t *, int64_t, float *);

#define ROW_FN(name, blk, values, bytes)                                         \
    static void name(const uint8_t *row, int64_t nblocks, float *out) {          \
        for (int64_t i = 0; i < nblocks; i++) blk(row + i * (bytes), out + i * (values)); \
    }

ROW_FN(row_q4_0, blk_q4_0, 32, 18)
ROW_FN(row_q4_1, blk_q4_1, 32, 20)
ROW_FN(row_q5_0, blk_q5_0, 32, 22)
ROW_FN(row_q5_1, blk_q5_1, 32, 24)
ROW_FN(row_q8_0, blk_q8_0, 32, 34)
ROW_FN(row_q2_k, blk_q2_k, 256, 84)
ROW_FN(row_q3_k, blk_q3_k, 256, 110)
ROW_FN(row_q4_k, blk_q4_k, 256, 144)
ROW_FN(row_q5_k, blk_q5_k, 256, 176)
ROW_FN(row_q6_k, blk_q6_k, 256, 210)
ROW_FN(row_f16, blk_f16, 1, 2)
ROW_FN(row_bf16, blk_bf16, 1, 2)
ROW_FN(row_f32, blk_f32, 1, 4)

static int type_info(int qtype, row_fn *fn, int *block_values) {
    switch (qtype) {
    case T_Q4_0: *fn = row_q4_0; *block_values = 32; return 0;
    case T_Q4_1: *fn = row_q4_1; *block_values = 32; return 0;
    case T_Q5_0: *fn = row_q5_0; *block_values = 32; return 0;
    case T_Q5_1: *fn = row_q5_1; *block_values = 32; return 0;
    case T_Q8_0: *fn = row_q8_0; *block_values = 32; return 0;
    case T_Q2_K: *fn = row_q2_k; *block_values = 256; return 0;
    case T_Q3_K: *fn = row_q3_k; *block_values = 256; return 0;
    case T_Q4_K: *fn = row_q4_k; *block_values = 256; return 0;
    case T_Q5_K: *fn = row_q5_k; *block_values = 256; return 0;
    case T_Q6_K: *fn = row_q6_k; *block_values = 256; return 0;
    case T_F16: *fn = row_f16; *block_values = 1; return 0;
    case T_BF16: *fn = row_bf16; *block_values = 1; return 0;
    case T_F32: *fn = row_f32; *block_values = 1; return 0;
    default: return -1;
    }
}

/* Row kernels (one activation row: decode) stream each weight row from memory once; the
 * hardware prefetchers alone left them waiting on every row's first loads (an
 * AVX512-FP16 Xeon: batch-1 decode 15% faster with the row ROW_AHEAD rows ahead fetched). */
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#define ROW_AHEAD 4
static inline void prefetch_row_ahead(const uint8_t *raw, int64_t j, int64_t n,
                                      int64_t row_bytes) {
    if (j + ROW_AHEAD >= n) return;
    const uint8_t *ahead = raw + (j + ROW_AHEAD) * row_bytes;
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char *)(ahead + o), _MM_HINT_T0);
}
#endif

/* What this build has: bit 0 the panel product of many rows for Q4_0/Q4_1/Q8_0 (AVX-512,
 * or AVX2 with FMA), bit 1 the bfloat16 product (AVX512-BF16). */
int pagedllm_gguf_features(void) {
    int features = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    features |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    features |= 2;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    features |= 4; /* the 8-bit products in panels */
#endif
    return features;
}

/* Block layout of the types with fused kernels: bytes per block, offset of the packed
 * values, whether a min follows the scale. -1 for any other type. */
static inline int fused_layout(int qtype, int *block_bytes, int *qs_off, int *has_min) {
    switch (qtype) {
    case T_Q4_0: *block_bytes = 18; *qs_off = 2; *has_min = 0; return 0;
    case T_Q4_1: *block_bytes = 20; *qs_off = 4; *has_min = 1; return 0;
    case T_Q8_0: *block_bytes = 34; *qs_off = 2; *has_min = 0; return 0;
    default: return -1;
    }
}

int pagedllm_gguf_supported(int qtype) {
    row_fn fn;
    int bv;
    return type_info(qtype, &fn, &bv) == 0;
}

/* ---- Panels: the GEMM micro-kernel's driver (AVX-512 and AVX2 kernels below) -------------
 *
 * Each thread decodes a panel of weight rows, k-major, into its buffer; tiles of
 * activation rows meet it with vector accumulators held in registers. Rows are taken in
 * blocks of PANEL_MBLOCK so that a block of activations stays in the cache while every
 * panel meets it (the panel is decoded again per block: a few % of the work). */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PANEL_MBLOCK 240

typedef void (*panel_decode_fn)(int qtype, int block_bytes, const uint8_t *raw,
                                int64_t row_bytes, int64_t k, int rows, void *P);
typedef void (*panel_rows_fn)(int mr, const void *P, int64_t k, const void *x, int64_t xs,
                              void *y, int64_t ys, int cols, int out16);

/* y[m, n] = x[m, k] . W[n, k]: panels of `panel` weight rows decoded by decode into a
 * p_bytes buffer, tiles of up to mr_max activation rows (elements of x_elem bytes)
 * multiplied with them by rows, in blocks of PANEL_MBLOCK rows (see above). 0, or -2 when
 * a buffer cannot be allocated. */
static int panel_matmul(int qtype, int block_bytes, const uint8_t *raw, int64_t n,
                        int64_t row_bytes, int64_t k, const void *x, size_t x_elem, int64_t m,
                        int64_t x_stride, void *y, size_t y_elem, int64_t y_stride,
                        int nthreads, size_t p_bytes, panel_decode_fn decode,
                        panel_rows_fn rows, int panel, int mr_max) {
    const int64_t panels = (n + panel - 1) / panel;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        void *P = aligned_alloc(64, (p_bytes + 63) / 64 * 64);
        if (P == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t r0 = 0; r0 < m; r0 += PANEL_MBLOCK) {
            const int64_t mb = m - r0 < PANEL_MBLOCK ? m - r0 : PANEL_MBLOCK;
            const int64_t tiles = (mb + mr_max - 1) / mr_max;
#pragma omp for schedule(static)
            for (int64_t pi = 0; pi < panels; pi++) {
                if (P == NULL) continue;
                const int64_t j0 = pi * panel;
                const int cols = (int)(n - j0 < panel ? n - j0 : panel);
                decode(qtype, block_bytes, raw + j0 * row_bytes, row_bytes, k, cols, P);
                int64_t i0 = r0;
                for (int64_t t = 0; t < tiles; t++) { /* tiles of near-equal size */
                    const int64_t mr = (r0 + mb - i0) / (tiles - t);
                    rows((int)mr, P, k, (const char *)x + x_elem * (size_t)(i0 * x_stride),
                         x_stride, (char *)y + y_elem * (size_t)(i0 * y_stride + j0), y_stride,
                         cols, y_elem == sizeof(uint16_t));
                    i0 += mr;
                }
            }
        }
        free(P);
    }
    return failed ? -2 : 0;
}
#endif

#ifdef __AVX512F__
static inline void q4_values(const uint8_t *qs, __m512 *lo, __m512 *hi) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0F);
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
}

/* One block of a common 32-value type, vectorised and bit-exact with the scalar decoders
 * (each IEEE multiply and add rounds the same in a vector lane; built without
 * contraction): w = d * q + c exactly as dequantization gives it, in two registers. */
static inline __attribute__((always_inline)) void decode_regs(int qtype, const uint8_t *blk,
                                                              __m512 *lo, __m512 *hi) {
    const __m512 d = _mm512_set1_ps(f16_to_f32(blk));
    if (qtype == T_Q8_0) {
        const __m128i r0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i r1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(r0)), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(r1)), d);
    } else if (qtype == T_Q4_1) {
        q4_values(blk + 4, lo, hi);
        const __m512 m = _mm512_set1_ps(f16_to_f32(blk + 2));
        *lo = _mm512_add_ps(_mm512_mul_ps(d, *lo), m);
        *hi = _mm512_add_ps(_mm512_mul_ps(d, *hi), m);
    } else { /* Q4_0 */
        const __m512 eight = _mm512_set1_ps(8.0f);
        q4_values(blk + 2, lo, hi);
        *lo = _mm512_mul_ps(d, _mm512_sub_ps(*lo, eight));
        *hi = _mm512_mul_ps(d, _mm512_sub_ps(*hi, eight));
    }
}

/* The same, stored. */
static inline void decoded_block(int qtype, const uint8_t *blk, float *out) {
    __m512 lo, hi;
    decode_regs(qtype, blk, &lo, &hi);
    _mm512_storeu_ps(out, lo);
    _mm512_storeu_ps(out + 16, hi);
}

/* Whole rows of them (the block decoder inlined with its type a constant). */
#define ROW_AVX512(name, qtype, bytes)                                                        \
    static void name(const uint8_t *row, int64_t nblocks, float *out) {                     \
        for (int64_t i = 0; i < nblocks; i++) decoded_block(qtype, row + i * (bytes), out + 32 * i); \
    }

ROW_AVX512(row_q4_0_avx512, T_Q4_0, 18)
ROW_AVX512(row_q4_1_avx512, T_Q4_1, 20)
ROW_AVX512(row_q8_0_avx512, T_Q8_0, 34)
#endif

/* rows x k values from rows x row_bytes packed bytes. */
int pagedllm_gguf_dequant(int qtype, const uint8_t *raw, int64_t rows, int64_t row_bytes,
                          int64_t k, float *out, int nthreads) {
    row_fn fn;
    int bv;
    if (type_info(qtype, &fn, &bv) != 0) return -1;
#ifdef __AVX512F__
    if (qtype == T_Q4_0) fn = row_q4_0_avx512;
    if (qtype == T_Q4_1) fn = row_q4_1_avx512;
    if (qtype == T_Q8_0) fn = row_q8_0_avx512;
#endif
    const int64_t nblocks = k / bv;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++)
        fn(raw + r * row_bytes, nblocks, out + r * k);
    return 0;
}

/* 32 independent lanes, so the compiler vectorises without reassociating any sum; fused
 * multiply-adds are fine here (only the dequantization must round like the reference). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
static float dot(const float *a, const float *b, int64_t k) {
    float acc[32] = {0};
    int64_t i = 0;
    for (; i + 32 <= k; i += 32)
        for (int l = 0; l < 32; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (; i < k; i++) s += a[i] * b[i];
    for (int l = 0; l < 32; l++) s += acc[l];
    return s;
}
#pragma GCC pop_options

#ifdef __AVX512F__
/* Fused decode-and-dot for the 32-value types with one scale (and min) per block:
 * sum_i w_i x_i = d * sum_i q_i x_i + c * sum_i x_i, where c is the block's offset
 * (Q4_1/Q5_1: m; Q4_0: -8d; Q8_0: 0). The block sums of x are computed once per call.
 * Rounds differently from decode-then-dot, within float32 matmul tolerance. */

/* One block's 32 weights as two vectors of 16 (w = d * q + c, c the block's offset). */
static inline void fused_block(int qtype, const uint8_t *blk, int qs_off, int has_min, __m512 *lo,
                               __m512 *hi, float *d, float *c) {
    *d = f16_to_f32(blk);
    if (qtype == T_Q8_0) {
        const __m128i r0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i r1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(r0));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(r1));
        *c = 0.0f;
    } else {
        q4_values(blk + qs_off, lo, hi);
        *c = has_min ? f16_to_f32(blk + 2) : -8.0f * *d;
    }
}

/* One activation row (decode at batch 1): four independent accumulators over
 * consecutive blocks, so the multiply-add chains overlap instead of waiting on each
 * other's latency. */
static inline float fused_row_dot1(int qtype, const uint8_t *row, int block_bytes, int qs_off,
                                   int has_min, const float *x, const float *xsum, int64_t nb) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    float off[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        for (int u = 0; u < 4; u++) {
            __m512 lo, hi;
            float d, c;
            fused_block(qtype, row + (b + u) * block_bytes, qs_off, has_min, &lo, &hi, &d, &c);
            const float *xb = x + (b + u) * 32;
            __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xb));
            t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), t);
            acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(d), t, acc[u]);
            off[u] += c * xsum[b + u];
        }
    }
    for (; b < nb; b++) {
        __m512 lo, hi;
        float d, c;
        fused_block(qtype, row + b * block_bytes, qs_off, has_min, &lo, &hi, &d, &c);
        const float *xb = x + b * 32;
        __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xb));
        t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), t);
        acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(d), t, acc[0]);
        off[0] += c * xsum[b];
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    return _mm512_reduce_add_ps(sum) + ((off[0] + off[1]) + (off[2] + off[3]));
}

/* A few activation rows (up to SMALL_MAX_ROWS: decode steps of a few sequences), where
 * reading and decoding the weights is most of the work and the panels' transposes do not
 * pay: each thread takes whole weight rows; every block of 32 weights is decoded in
 * registers, exactly as dequantization gives it (for bfloat16 rows then rounded to
 * bfloat16 as .to() rounds it), and meets every activation row at once: two accumulators
 * per row (alternate halves or blocks), summed across lanes at the end. No buffer, no
 * store and reload of the decoded weights. The row count and the type are constants in
 * each instance, so the loops unroll and the type's branch goes away. */
#define SMALL_MAX_ROWS 8

/* y[i * ys] = w . x[i] for MR float32 rows, w one packed weight row of nb blocks. */
static inline __attribute__((always_inline)) void rows_dot_f32(const int MR, const int QT,
                                                               const uint8_t *w, int block_bytes,
                                                               int64_t nb, const float *x,
                                                               int64_t xs, float *y, int64_t ys) {
    __m512 a[SMALL_MAX_ROWS][2];
    for (int i = 0; i < MR; i++) { a[i][0] = _mm512_setzero_ps(); a[i][1] = _mm512_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        __m512 lo, hi;
        decode_regs(QT, w + b * block_bytes, &lo, &hi);
        for (int i = 0; i < MR; i++) {
            const float *xb = x + i * xs + b * 32;
            a[i][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), a[i][0]);
            a[i][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), a[i][1]);
        }
    }
    for (int i = 0; i < MR; i++) y[i * ys] = _mm512_reduce_add_ps(_mm512_add_ps(a[i][0], a[i][1]));
}

/* One instance per (type, row count): a function of run-time ones. */
#define SMALL_ROWS_FN(name, DOT, T)                                                          \
    static void name(int qtype, int mr, const uint8_t *w, int block_bytes, int64_t nb,      \
                     const void *xv, int64_t xs, float *y, int64_t ys) {                     \
        const T *x = (const T *)xv;                                                          \
        switch (qtype * 16 + mr) {                                                           \
        SMALL_CASES(DOT, T_Q4_0) SMALL_CASES(DOT, T_Q4_1) SMALL_CASES(DOT, T_Q8_0)           \
        default: break;                                                                      \
        }                                                                                    \
    }
#define SMALL_CASE(DOT, QT, MR)                                                              \
    case QT * 16 + MR: DOT(MR, QT, w, block_bytes, nb, x, xs, y, ys); break;
#define SMALL_CASES(DOT, QT)                                                                 \
    SMALL_CASE(DOT, QT, 1) SMALL_CASE(DOT, QT, 2) SMALL_CASE(DOT, QT, 3)                     \
    SMALL_CASE(DOT, QT, 4) SMALL_CASE(DOT, QT, 5) SMALL_CASE(DOT, QT, 6)                     \
    SMALL_CASE(DOT, QT, 7) SMALL_CASE(DOT, QT, 8)

SMALL_ROWS_FN(small_rows_f32, rows_dot_f32, float)

typedef void (*small_rows_fn)(int qtype, int mr, const uint8_t *w, int block_bytes, int64_t nb,
                              const void *x, int64_t xs, float *y, int64_t ys);

/* y[m, n] = x[m, k] . W[n, k] for m <= SMALL_MAX_ROWS rows. */
static void small_rows(int qtype, int block_bytes, const uint8_t *raw, int64_t n,
                       int64_t row_bytes, int64_t k, const void *x, int64_t m, int64_t x_stride,
                       float *y, int64_t y_stride, int nthreads, small_rows_fn rows) {
    const int64_t nb = k / 32;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < n; j++)
        rows(qtype, (int)m, raw + j * row_bytes, block_bytes, nb, x, x_stride, y + j, y_stride);
}

/* Several activation rows: a GEMM micro-kernel over panels of 32 weight rows. Each
 * thread decodes a panel exactly as dequantization gives it (w = d * q + c, rounded as the
 * reference rounds it) into a buffer laid out k-major, P[c][32] (16 x 16 transposes of
 * decoded blocks), and every tile of up to 12 activation rows meets it with 24 vector
 * accumulators that stay in registers: per k, two weight loads, one broadcast per row, two
 * multiply-adds per row. No horizontal sums; each output is one multiply-add chain over k
 * in order, so on this path a row's result does not depend on the rows beside it. */
#define PANEL 32
#define PANEL_MR 12

/* In-register transpose of 16 x 16 32-bit elements. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int h = 0; h < 16; h += 8) {
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0x88);
            t[h + 4 + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0xdd);
        }
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    }
}

/* Block b of the panel's rows 16 * half .. 16 * half + 15 (rows past `rows` are zeros):
 * lo[i], hi[i] the two halves of row i's 32 decoded weights. */
static inline void panel_blocks(int qtype, int block_bytes, const uint8_t *raw,
                                int64_t row_bytes, int64_t b, int half, int rows, __m512 lo[16],
                                __m512 hi[16]) {
    float tmp[32];
    for (int i = 0; i < 16; i++) {
        const int row = 16 * half + i;
        if (row < rows) {
            decoded_block(qtype, raw + row * row_bytes + b * block_bytes, tmp);
            lo[i] = _mm512_loadu_ps(tmp);
            hi[i] = _mm512_loadu_ps(tmp + 16);
        } else {
            lo[i] = hi[i] = _mm512_setzero_ps();
        }
    }
}

/* float32 panel: P[c * 32 + j] = w[j][c]. */
static void panel_decode_f32(int qtype, int block_bytes, const uint8_t *raw, int64_t row_bytes,
                             int64_t k, int rows, void *out) {
    float *P = (float *)out;
    for (int half = 0; half < 2; half++) {
        for (int64_t b = 0; b < k / 32; b++) {
            __m512 lo[16], hi[16];
            panel_blocks(qtype, block_bytes, raw, row_bytes, b, half, rows, lo, hi);
            transpose16(lo);
            transpose16(hi);
            for (int c = 0; c < 16; c++) {
                _mm512_storeu_ps(P + (b * 32 + c) * PANEL + 16 * half, lo[c]);
                _mm512_storeu_ps(P + (b * 32 + 16 + c) * PANEL + 16 * half, hi[c]);
            }
        }
    }
}

/* Masks of the valid outputs in the panel's two halves. */
static inline void panel_masks(int cols, __mmask16 *m0, __mmask16 *m1) {
    *m0 = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    *m1 = cols >= 32 ? (__mmask16)0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
/* y[i][0..cols) = P . x[i] for MR (a constant once inlined) rows. */
static inline __attribute__((always_inline)) void panel_tile_f32(const int MR, const void *Pv,
                                                                 int64_t k, const void *xv,
                                                                 int64_t xs, void *yv,
                                                                 int64_t ys, int cols,
                                                                 int out16) {
    const float *P = (const float *)Pv, *x = (const float *)xv;
    float *y = (float *)yv;
    (void)out16; /* float32 out only */
    __m512 a0[PANEL_MR], a1[PANEL_MR];
    for (int i = 0; i < MR; i++) { a0[i] = _mm512_setzero_ps(); a1[i] = _mm512_setzero_ps(); }
    for (int64_t c = 0; c < k; c++) {
        const __m512 w0 = _mm512_loadu_ps(P + c * PANEL), w1 = _mm512_loadu_ps(P + c * PANEL + 16);
        for (int i = 0; i < MR; i++) {
            const __m512 xb = _mm512_set1_ps(x[i * xs + c]);
            a0[i] = _mm512_fmadd_ps(w0, xb, a0[i]);
            a1[i] = _mm512_fmadd_ps(w1, xb, a1[i]);
        }
    }
    __mmask16 m0, m1;
    panel_masks(cols, &m0, &m1);
    for (int i = 0; i < MR; i++) {
        _mm512_mask_storeu_ps(y + i * ys, m0, a0[i]);
        _mm512_mask_storeu_ps(y + i * ys + 16, m1, a1[i]);
    }
}
#pragma GCC pop_options

/* The tile function for a row count known only at run time: each count its own instance
 * of TILE (an always-inline function of a constant MR). */
#define PANEL_ROWS_FN(name, TILE)                                                            \
    static void name(int mr, const void *P, int64_t k, const void *x, int64_t xs, void *y,   \
                     int64_t ys, int cols, int out16) {                                      \
        switch (mr) {                                                                        \
        case 1: TILE(1, P, k, x, xs, y, ys, cols, out16); break;                             \
        case 2: TILE(2, P, k, x, xs, y, ys, cols, out16); break;                             \
        case 3: TILE(3, P, k, x, xs, y, ys, cols, out16); break;                             \
        case 4: TILE(4, P, k, x, xs, y, ys, cols, out16); break;                             \
        case 5: TILE(5, P, k, x, xs, y, ys, cols, out16); break;                             \
        case 6: TILE(6, P, k, x, xs, y, ys, cols, out16); break;                             \
        case 7: TILE(7, P, k, x, xs, y, ys, cols, out16); break;                             \
        case 8: TILE(8, P, k, x, xs, y, ys, cols, out16); break;                             \
        case 9: TILE(9, P, k, x, xs, y, ys, cols, out16); break;                             \
        case 10: TILE(10, P, k, x, xs, y, ys, cols, out16); break;                           \
        case 11: TILE(11, P, k, x, xs, y, ys, cols, out16); break;                           \
        default: TILE(12, P, k, x, xs, y, ys, cols, out16); break;                           \
        }                                                                                    \
    }

PANEL_ROWS_FN(panel_rows_f32, panel_tile_f32)

/* y[n] = W[n, k] . x for one float32 activation row (decode at batch 1): the factored
 * dot products of fused_row_dot1, for the block layout fused_layout gave (k a multiple of
 * 32). 0, or -2 when a buffer cannot be allocated. */
static int fused_gemv(int qtype, int block_bytes, int qs_off, int has_min, const uint8_t *raw,
                      int64_t n, int64_t row_bytes, int64_t k, const float *x, float *y,
                      int nthreads) {
    const int64_t nb = k / 32;
    float *xsum = (float *)malloc(sizeof(float) * (size_t)nb);
    if (xsum == NULL) return -2;
    for (int64_t b = 0; b < nb; b++) {
        float s = 0.0f;
        for (int l = 0; l < 32; l++) s += x[b * 32 + l];
        xsum[b] = s;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < n; j++) {
        prefetch_row_ahead(raw, j, n, row_bytes);
        y[j] = fused_row_dot1(qtype, raw + j * row_bytes, block_bytes, qs_off, has_min, x, xsum,
                              nb);
    }
    free(xsum);
    return 0;
}

static int fused_matmul(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes, int64_t k,
                        const float *x, int64_t m, int64_t x_stride, float *y, int64_t y_stride,
                        int nthreads) {
    int block_bytes, qs_off, has_min;
    if (fused_layout(qtype, &block_bytes, &qs_off, &has_min) != 0 || k % 32) return -1;
    if (m == 1)
        return fused_gemv(qtype, block_bytes, qs_off, has_min, raw, n, row_bytes, k, x, y,
                          nthreads);
    if (m <= SMALL_MAX_ROWS) {
        small_rows(qtype, block_bytes, raw, n, row_bytes, k, x, m, x_stride, y, y_stride, nthreads,
                   small_rows_f32);
        return 0;
    }
    return panel_matmul(qtype, block_bytes, raw, n, row_bytes, k, x, sizeof(float), m, x_stride,
                        y, sizeof(float), y_stride, nthreads, sizeof(float) * (size_t)(k * PANEL),
                        panel_decode_f32, panel_rows_f32, PANEL, PANEL_MR);
}
#endif

/* ---- AVX2 panels (CPUs without AVX-512) ---------------------------------------------------
 *
 * The same micro-kernel in 256-bit registers: panels of 16 weight rows (decoded by the
 * scalar, bit-exact block decoders, stored k-major), tiles of up to 6 activation rows,
 * 12 accumulators. For Q4_0/Q4_1/Q8_0 from PANEL2_MIN_ROWS rows. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define PANEL2 16
#define PANEL2_MR 6
#define PANEL2_MIN_ROWS 2

static void panel2_decode(int qtype, int block_bytes, const uint8_t *raw, int64_t row_bytes,
                          int64_t k, int rows, void *out) {
    float *P = (float *)out, tmp[PANEL2][32];
    row_fn fn = row_q4_0;
    int bv = 32;
    type_info(qtype, &fn, &bv); /* a fused type (checked by the caller): 32-value blocks */
    for (int64_t b = 0; b < k / 32; b++) {
        for (int r = 0; r < PANEL2; r++) {
            if (r < rows)
                fn(raw + r * row_bytes + b * block_bytes, 1, tmp[r]);
            else
                memset(tmp[r], 0, sizeof(tmp[r]));
        }
        /* k-major: one 64-byte line of P per k */
        for (int l = 0; l < 32; l++)
            for (int r = 0; r < PANEL2; r++) P[(b * 32 + l) * PANEL2 + r] = tmp[r][l];
    }
}

/* (Named accumulators, not arrays: GCC keeps arrays of 256-bit vectors in memory here.) */
#define PANEL2_STEP(i, A0, A1)                                                               \
    if (MR > i) {                                                                            \
        const __m256 xb = _mm256_broadcast_ss(x + i * xs + c);                              \
        A0 = _mm256_fmadd_ps(w0, xb, A0);                                                    \
        A1 = _mm256_fmadd_ps(w1, xb, A1);                                                    \
    }
#define PANEL2_STORE(i, A0, A1)                                                              \
    if (MR > i) {                                                                            \
        _mm256_maskstore_ps(y + i * ys, m0, A0);                                             \
        _mm256_maskstore_ps(y + i * ys + 8, m1, A1);                                         \
    }

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
static inline __attribute__((always_inline)) void panel2_tile(const int MR, const void *Pv,
                                                              int64_t k, const void *xv,
                                                              int64_t xs, void *yv, int64_t ys,
                                                              int cols, int out16) {
    const float *P = (const float *)Pv, *x = (const float *)xv;
    float *y = (float *)yv;
    (void)out16; /* float32 out only */
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    for (int64_t c = 0; c < k; c++) {
        const __m256 w0 = _mm256_loadu_ps(P + c * PANEL2), w1 = _mm256_loadu_ps(P + c * PANEL2 + 8);
        PANEL2_STEP(0, a00, a01)
        PANEL2_STEP(1, a10, a11)
        PANEL2_STEP(2, a20, a21)
        PANEL2_STEP(3, a30, a31)
        PANEL2_STEP(4, a40, a41)
        PANEL2_STEP(5, a50, a51)
    }
    /* lanes below cols: mask lanes whose index is less than cols (sign bit set) */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
    PANEL2_STORE(0, a00, a01)
    PANEL2_STORE(1, a10, a11)
    PANEL2_STORE(2, a20, a21)
    PANEL2_STORE(3, a30, a31)
    PANEL2_STORE(4, a40, a41)
    PANEL2_STORE(5, a50, a51)
}
#pragma GCC pop_options

static void panel2_rows(int mr, const void *P, int64_t k, const void *x, int64_t xs, void *y,
                        int64_t ys, int cols, int out16) {
    switch (mr) {
    case 1: panel2_tile(1, P, k, x, xs, y, ys, cols, out16); break;
    case 2: panel2_tile(2, P, k, x, xs, y, ys, cols, out16); break;
    case 3: panel2_tile(3, P, k, x, xs, y, ys, cols, out16); break;
    case 4: panel2_tile(4, P, k, x, xs, y, ys, cols, out16); break;
    case 5: panel2_tile(5, P, k, x, xs, y, ys, cols, out16); break;
    default: panel2_tile(6, P, k, x, xs, y, ys, cols, out16); break;
    }
}

static int fused_matmul(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes, int64_t k,
                        const float *x, int64_t m, int64_t x_stride, float *y, int64_t y_stride,
                        int nthreads) {
    int block_bytes, qs_off, has_min;
    if (fused_layout(qtype, &block_bytes, &qs_off, &has_min) != 0 || k % 32) return -1;
    if (m < PANEL2_MIN_ROWS) return -1;
    return panel_matmul(qtype, block_bytes, raw, n, row_bytes, k, x, sizeof(float), m, x_stride,
                        y, sizeof(float), y_stride, nthreads, sizeof(float) * (size_t)(k * PANEL2),
                        panel2_decode, panel2_rows, PANEL2, PANEL2_MR);
}
#define HAVE_FUSED_MATMUL 1
#endif

/* ---- bfloat16 activations (bfloat16 models) ----------------------------------------------
 *
 * y[m, n] (float32) = x[m, k] (bfloat16) . W[n, k] for Q4_0/Q4_1/Q8_0 weights, on CPUs
 * with AVX512-BF16: panels of 32 weight rows are decoded as dequantization gives them and
 * rounded to bfloat16 (nearest even, as .to(torch.bfloat16) rounds), and tiles of up to
 * 12 activation rows meet them with dpbf16ps (pairs of bfloat16 products, exact in
 * float32, summed into float32 lanes): the product a bfloat16 GEMM of the dequantized
 * weight computes, up to the order of the float32 sums (2 to 8 rows: the small-row
 * product, the same rounding); y in float32, or (y_bf16) rounded to bfloat16 as
 * .to(torch.bfloat16) rounds. One row (decode at batch 1) takes the float32 row kernel on
 * its exact widening instead: unrounded weights, and 20% faster than the bfloat16 form.
 * -1: another type, k not a multiple of 32, or no AVX512-BF16. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* Block b of the weight row rounded to bfloat16 (nearest even, as .to(torch.bfloat16)
 * rounds) and multiplied in pairs with block b of each of MR rows into acc[i][u]. */
static inline __attribute__((always_inline)) void block_dot_bf16(
    const int MR, const int QT, const uint8_t *w, int block_bytes, int64_t b, const uint16_t *x,
    int64_t xs, __m512 acc[][2], const int u) {
    __m512 lo, hi;
    decode_regs(QT, w + b * block_bytes, &lo, &hi);
    const __m512bh wv = _mm512_cvtne2ps_pbh(hi, lo);
    for (int i = 0; i < MR; i++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i * xs + b * 32));
        acc[i][u] = _mm512_dpbf16_ps(acc[i][u], wv, xv);
    }
}

/* The small-row product of bfloat16 rows: even and odd blocks into their own sums. */
static inline __attribute__((always_inline)) void rows_dot_bf16(const int MR, const int QT,
                                                                const uint8_t *w, int block_bytes,
                                                                int64_t nb, const uint16_t *x,
                                                                int64_t xs, float *y, int64_t ys) {
    __m512 a[SMALL_MAX_ROWS][2];
    for (int i = 0; i < MR; i++) { a[i][0] = _mm512_setzero_ps(); a[i][1] = _mm512_setzero_ps(); }
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        block_dot_bf16(MR, QT, w, block_bytes, b, x, xs, a, 0);
        block_dot_bf16(MR, QT, w, block_bytes, b + 1, x, xs, a, 1);
    }
    if (b < nb) block_dot_bf16(MR, QT, w, block_bytes, b, x, xs, a, 0);
    for (int i = 0; i < MR; i++) y[i * ys] = _mm512_reduce_add_ps(_mm512_add_ps(a[i][0], a[i][1]));
}

SMALL_ROWS_FN(small_rows_bf16, rows_dot_bf16, uint16_t)

/* bfloat16 panel: pairs of k, P[(c / 2) * 32 + j] = (w[j][c], w[j][c + 1]) as one 32-bit
 * element, the layout dpbf16ps multiplies with a broadcast pair of activations. */
static void panel_decode_bf16(int qtype, int block_bytes, const uint8_t *raw, int64_t row_bytes,
                              int64_t k, int rows, void *out) {
    float *P = (float *)out; /* 32-bit elements, each a pair of bfloat16 */
    for (int half = 0; half < 2; half++) {
        for (int64_t b = 0; b < k / 32; b++) {
            __m512 lo[16], hi[16];
            panel_blocks(qtype, block_bytes, raw, row_bytes, b, half, rows, lo, hi);
            for (int i = 0; i < 16; i++) lo[i] = (__m512)_mm512_cvtne2ps_pbh(hi[i], lo[i]);
            transpose16(lo);
            for (int p = 0; p < 16; p++)
                _mm512_storeu_ps(P + (b * 16 + p) * PANEL + 16 * half, lo[p]);
        }
    }
}

static inline __attribute__((always_inline)) void panel_tile_bf16(const int MR, const void *Pv,
                                                                  int64_t k, const void *xv,
                                                                  int64_t xs, void *y,
                                                                  int64_t ys, int cols,
                                                                  int out16) {
    const float *P = (const float *)Pv;
    const uint16_t *x = (const uint16_t *)xv;
    __m512 a0[PANEL_MR], a1[PANEL_MR];
    for (int i = 0; i < MR; i++) { a0[i] = _mm512_setzero_ps(); a1[i] = _mm512_setzero_ps(); }
    for (int64_t p = 0; p < k / 2; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_ps(P + p * PANEL);
        const __m512bh w1 = (__m512bh)_mm512_loadu_ps(P + p * PANEL + 16);
        for (int i = 0; i < MR; i++) {
            int32_t pair;
            memcpy(&pair, x + i * xs + 2 * p, sizeof(pair));
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            a0[i] = _mm512_dpbf16_ps(a0[i], w0, xb);
            a1[i] = _mm512_dpbf16_ps(a1[i], w1, xb);
        }
    }
    __mmask16 m0, m1;
    panel_masks(cols, &m0, &m1);
    if (out16) { /* rounded to bfloat16, nearest even (as .to(torch.bfloat16)) */
        uint16_t *yh = (uint16_t *)y;
        for (int i = 0; i < MR; i++) {
            _mm256_mask_storeu_epi16(yh + i * ys, m0, (__m256i)_mm512_cvtneps_pbh(a0[i]));
            _mm256_mask_storeu_epi16(yh + i * ys + 16, m1, (__m256i)_mm512_cvtneps_pbh(a1[i]));
        }
    } else {
        float *yf = (float *)y;
        for (int i = 0; i < MR; i++) {
            _mm512_mask_storeu_ps(yf + i * ys, m0, a0[i]);
            _mm512_mask_storeu_ps(yf + i * ys + 16, m1, a1[i]);
        }
    }
}

PANEL_ROWS_FN(panel_rows_bf16, panel_tile_bf16)

int pagedllm_gguf_matmul_bf16(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes,
                              int64_t k, const uint16_t *x, int64_t m, int64_t x_stride,
                              void *y, int64_t y_stride, int nthreads, int y_bf16) {
    int block_bytes, qs_off, has_min;
    if (fused_layout(qtype, &block_bytes, &qs_off, &has_min) != 0 || k % 32) return -1;
    if (m <= SMALL_MAX_ROWS) { /* small_rows writes float32: bfloat16 out goes through a buffer */
        float *out = y_bf16 ? (float *)malloc(sizeof(float) * (size_t)(m * n)) : (float *)y;
        if (out == NULL) return -2;
        const int64_t out_stride = y_bf16 ? n : y_stride;
        int status = 0;
        if (m == 1) { /* batch 1: the float32 row kernel on the exact widening */
            float *xf = (float *)malloc(sizeof(float) * (size_t)k);
            status = xf == NULL ? -2 : 0;
            if (xf != NULL) {
                row_bf16((const uint8_t *)x, k, xf);
                status = fused_gemv(qtype, block_bytes, qs_off, has_min, raw, n, row_bytes, k, xf,
                                    out, nthreads);
                free(xf);
            }
        } else {
            small_rows(qtype, block_bytes, raw, n, row_bytes, k, x, m, x_stride, out, out_stride,
                       nthreads, small_rows_bf16);
        }
        if (y_bf16 && status == 0) {
            uint16_t *yh = (uint16_t *)y;
            for (int64_t i = 0; i < m; i++) {
                int64_t j = 0;
                for (; j + 16 <= n; j += 16)
                    _mm256_storeu_si256((__m256i *)(yh + i * y_stride + j),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(out + i * n + j)));
                if (j < n) {
                    const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
                    const __m512 v = _mm512_maskz_loadu_ps(tail, out + i * n + j);
                    _mm256_mask_storeu_epi16(yh + i * y_stride + j, tail, (__m256i)_mm512_cvtneps_pbh(v));
                }
            }
        }
        if (y_bf16) free(out);
        return status;
    }
    return panel_matmul(qtype, block_bytes, raw, n, row_bytes, k, x, sizeof(uint16_t), m,
                        x_stride, y, y_bf16 ? sizeof(uint16_t) : sizeof(float), y_stride,
                        nthreads, sizeof(uint16_t) * (size_t)(k * PANEL), panel_decode_bf16,
                        panel_rows_bf16, PANEL, PANEL_MR);
}
#else
int pagedllm_gguf_matmul_bf16(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes,
                              int64_t k, const uint16_t *x, int64_t m, int64_t x_stride,
                              void *y, int64_t y_stride, int nthreads, int y_bf16) {
    (void)qtype; (void)raw; (void)n; (void)row_bytes; (void)k; (void)x; (void)m;
    (void)x_stride; (void)y; (void)y_stride; (void)nthreads; (void)y_bf16;
    return -1;
}
#endif

/* ---- Panels at every row count (batch-invariant mode) ------------------------------------
 *
 * The panel products above take a call's rows from a few on; fewer rows go to row kernels
 * that sum in other orders (fused_gemv, small_rows), as do the BLAS GEMMs of dense weights,
 * whose kernels change with the row count. Here the panels take every row count, one row
 * included: each output is one chain of multiply-adds over k in order (bfloat16: of pair
 * products), whatever rows share the call, so a row's result does not depend on the rest
 * of the batch (pagedllm/kernels/batch_invariant.py). Dense weights (unquantized layers,
 * and chunks of other GGUF types dequantized) are copied into the same panels: float32, or
 * bfloat16 widened exactly, or with bfloat16 activations on AVX512-BF16 in bfloat16 pairs.
 * -1 where this build has no panels, for another type or k not a multiple of 32 (packed
 * weights), or an odd k (bfloat16 pairs). */
#if defined(__AVX512F__)
#define HAVE_PANELS 1
#define PANEL_WIDTH PANEL
#define PANEL_TILE_ROWS PANEL_MR
#define PANEL_DECODE_F32 panel_decode_f32
#define PANEL_ROWS_F32 panel_rows_f32
#elif defined(HAVE_FUSED_MATMUL)
#define HAVE_PANELS 1
#define PANEL_WIDTH PANEL2
#define PANEL_TILE_ROWS PANEL2_MR
#define PANEL_DECODE_F32 panel2_decode
#define PANEL_ROWS_F32 panel2_rows
#endif

#ifdef HAVE_PANELS
/* Rows of a dense weight into a float32 panel, k-major: P[c * PANEL_WIDTH + j] = w[j][c]
 * (rows past `rows` zeros). `qtype` is 1 for bfloat16 elements (widened), 0 for float32;
 * row_bytes the weight's row stride in bytes. */
static void dense_decode_f32(int qtype, int block_bytes, const uint8_t *raw, int64_t row_bytes,
                             int64_t k, int rows, void *out) {
    float *P = (float *)out;
    (void)block_bytes;
    for (int j = 0; j < PANEL_WIDTH; j++) {
        const uint8_t *row = raw + j * row_bytes;
        for (int64_t c = 0; c < k; c++) {
            float v = 0.0f;
            if (j < rows && qtype) {
                const uint32_t u = (uint32_t)((const uint16_t *)row)[c] << 16;
                memcpy(&v, &u, sizeof(v));
            } else if (j < rows) {
                v = ((const float *)row)[c];
            }
            P[c * PANEL_WIDTH + j] = v;
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* Rows of a dense bfloat16 weight into the bfloat16 panel: P[p * PANEL + j] = (w[j][2p],
 * w[j][2p + 1]) as one 32-bit element, the layout of panel_decode_bf16 (k even). */
static void dense_decode_bf16(int qtype, int block_bytes, const uint8_t *raw, int64_t row_bytes,
                              int64_t k, int rows, void *out) {
    uint32_t *P = (uint32_t *)out;
    (void)qtype;
    (void)block_bytes;
    for (int j = 0; j < PANEL; j++) {
        const uint16_t *row = (const uint16_t *)(raw + j * row_bytes);
        for (int64_t p = 0; p < k / 2; p++)
            P[p * PANEL + j] =
                j < rows ? (uint32_t)row[2 * p] | ((uint32_t)row[2 * p + 1] << 16) : 0u;
    }
}
#endif
#endif

/* y[m, n] = x[m, k] . W[n, k] for packed Q4_0/Q4_1/Q8_0 W: the float32 panels (x float32,
 * y float32), or with x_bfloat16 the bfloat16 ones (AVX512-BF16; y bfloat16 where y_bf16). */
int pagedllm_gguf_matmul_panels(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes,
                                int64_t k, const void *x, int64_t m, int64_t x_stride, void *y,
                                int64_t y_stride, int nthreads, int x_bf16, int y_bf16) {
#ifdef HAVE_PANELS
    int block_bytes, qs_off, has_min;
    if (fused_layout(qtype, &block_bytes, &qs_off, &has_min) != 0 || k % 32) return -1;
    if (x_bf16) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        return panel_matmul(qtype, block_bytes, raw, n, row_bytes, k, x, sizeof(uint16_t), m,
                            x_stride, y, y_bf16 ? sizeof(uint16_t) : sizeof(float), y_stride,
                            nthreads, sizeof(uint16_t) * (size_t)(k * PANEL), panel_decode_bf16,
                            panel_rows_bf16, PANEL, PANEL_MR);
#else
        return -1;
#endif
    }
    if (y_bf16) return -1;
    return panel_matmul(qtype, block_bytes, raw, n, row_bytes, k, x, sizeof(float), m, x_stride,
                        y, sizeof(float), y_stride, nthreads,
                        sizeof(float) * (size_t)(k * PANEL_WIDTH), PANEL_DECODE_F32,
                        PANEL_ROWS_F32, PANEL_WIDTH, PANEL_TILE_ROWS);
#else
    (void)qtype; (void)raw; (void)n; (void)row_bytes; (void)k; (void)x; (void)m;
    (void)x_stride; (void)y; (void)y_stride; (void)nthreads; (void)x_bf16; (void)y_bf16;
    return -1;
#endif
}

/* y[m, n] = x[m, k] . W[n, k] for a dense W (contiguous rows; bfloat16 where w_bf16, else
 * float32): x float32 into float32 y, or with x_bf16 (and a bfloat16 W, k even, on
 * AVX512-BF16) in bfloat16 pairs, y bfloat16 where y_bf16. */
int pagedllm_dense_matmul_panels(const void *w, int w_bf16, int64_t n, int64_t k, const void *x,
                                 int64_t m, int64_t x_stride, void *y, int64_t y_stride,
                                 int nthreads, int x_bf16, int y_bf16) {
#ifdef HAVE_PANELS
    const int64_t row_bytes = k * (w_bf16 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float));
    if (x_bf16) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if (!w_bf16 || k % 2) return -1;
        return panel_matmul(1, 0, (const uint8_t *)w, n, row_bytes, k, x, sizeof(uint16_t), m,
                            x_stride, y, y_bf16 ? sizeof(uint16_t) : sizeof(float), y_stride,
                            nthreads, sizeof(uint16_t) * (size_t)(k * PANEL), dense_decode_bf16,
                            panel_rows_bf16, PANEL, PANEL_MR);
#else
        return -1;
#endif
    }
    if (y_bf16) return -1;
    return panel_matmul(w_bf16 ? 1 : 0, 0, (const uint8_t *)w, n, row_bytes, k, x, sizeof(float), m,
                        x_stride, y, sizeof(float), y_stride, nthreads,
                        sizeof(float) * (size_t)(k * PANEL_WIDTH), dense_decode_f32, PANEL_ROWS_F32,
                        PANEL_WIDTH, PANEL_TILE_ROWS);
#else
    (void)w; (void)w_bf16; (void)n; (void)k; (void)x; (void)m; (void)x_stride; (void)y;
    (void)y_stride; (void)nthreads; (void)x_bf16; (void)y_bf16;
    return -1;
#endif
}

/* y[m, n] = sum_k x[m, k] * W[n, k] for the n x k weight W given packed, m activation
 * rows (row strides in elements). Each thread decodes whole weight rows into its own
 * buffer. */
int pagedllm_gguf_matmul(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes,
                         int64_t k, const float *x, int64_t m, int64_t x_stride, float *y,
                         int64_t y_stride, int nthreads) {
    row_fn fn;
    int bv;
    if (type_info(qtype, &fn, &bv) != 0) return -1;
#if defined(__AVX512F__) || defined(HAVE_FUSED_MATMUL)
    const int fused = fused_matmul(qtype, raw, n, row_bytes, k, x, m, x_stride, y, y_stride,
                                   nthreads);
    if (fused != -1) return fused;
#endif
    const int64_t nblocks = k / bv;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *row = (float *)malloc(sizeof(float) * (size_t)k);
        if (row == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            if (row == NULL) continue;
            fn(raw + j * row_bytes, nblocks, row);
            for (int64_t i = 0; i < m; i++) y[i * y_stride + j] = dot(row, x + i * x_stride, k);
        }
        free(row);
    }
    return failed ? -2 : 0;
}

/* ---- 8-bit activations and integer dot products ----------------------------------------
 *
 * As llama.cpp (and vLLM's GGUF kernels) do: each block of 32 activations is quantized to
 * int8 with one float scale dx = max|x| / 127 (q = round-half-even(x / dx)), and a weight
 * block (w = d * q_w + c) meets it as
 *     sum_i w_i x_i ~= d * dx * sum_i q_w,i q_x,i + c * dx * sum_i q_x,i
 * where the first sum is an integer dot product of unsigned nibbles (or signed bytes)
 * with signed bytes: VNNI's dpbusd on CPUs that have it, maddubs + madd on AVX2. Exact
 * integer sums; the activation rounding is what differs from the float product (about
 * 0.4% of a block's largest value per element). */
#if defined(__AVX2__)
#include <immintrin.h>
#define HAVE_Q8_DOT 1

static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* x [m, k] (row stride x_stride) -> qx [m, k] int8, dx [m, k/32], sx [m, k/32] = dx * sum q. */
static void quantize_rows_q8(const float *x, int64_t m, int64_t x_stride, int64_t k, int8_t *qx,
                             float *dx, float *sx) {
    const int64_t nb = k / 32;
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + i * x_stride + b * 32;
            float amax = 0.0f;
            for (int l = 0; l < 32; l++) {
                const float a = fabsf(v[l]);
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            int8_t *q = qx + i * k + b * 32;
            for (int l = 0; l < 32; l++) {
                const int r = (int)nearbyintf(v[l] * id);
                q[l] = (int8_t)r;
                sum += r;
            }
            dx[i * nb + b] = d;
            sx[i * nb + b] = d * (float)sum;
        }
}

/* A weight block as 32 bytes for dot_u8_s8: nibbles 0..15 (Q4_0/Q4_1), or |q| (Q8_0, whose
 * signs move onto the activations: sign_mask holds q). */
static inline __m256i q4_bytes(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight blocks' dot products (8 int32 lanes each) summed per block, in block order. */
static inline __m256i hsum8_epi32(__m256i p0, __m256i p1, __m256i p2, __m256i p3, __m256i p4,
                                  __m256i p5, __m256i p6, __m256i p7) {
    const __m256i s0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    const __m256i s4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(p4, p5), _mm256_hadd_epi32(p6, p7));
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                            _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

#define Q8_TILE 32
/* From this many rows the panel form below (AVX512-VNNI) takes the product. */
#define Q8_PANEL_MIN_ROWS 4

int pagedllm_gguf_matmul_q8p(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes,
                             int64_t k, const void *x, int64_t m, int64_t x_stride, void *y,
                             int64_t y_stride, int nthreads, int x_bf16, int y_bf16);
static int q8_rows(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes, int64_t k,
                   const float *x, int64_t m, int64_t x_stride, float *y, int64_t y_stride,
                   int nthreads);

/* y[m, n] for Q4_0/Q4_1/Q8_0 weights; -1: another type (or k not a multiple of 32).
 * Each weight row is unpacked once into bytes and per-block scales (d, c), then meets
 * every activation row eight blocks at a time: eight integer dot products, summed per
 * block, scaled by d * dx as one vector. */
int pagedllm_gguf_matmul_q8(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes,
                            int64_t k, const float *x, int64_t m, int64_t x_stride, float *y,
                            int64_t y_stride, int nthreads) {
    int block_bytes, qs_off, has_min;
    if (fused_layout(qtype, &block_bytes, &qs_off, &has_min) != 0 || k % 32) return -1;
    if (m >= Q8_PANEL_MIN_ROWS) {
        const int status = pagedllm_gguf_matmul_q8p(qtype, raw, n, row_bytes, k, x, m, x_stride, y,
                                                    y_stride, nthreads, 0, 0);
        if (status != -1) return status;
    } else { /* (AVX512-VNNI: in registers, below) */
        const int status = q8_rows(qtype, raw, n, row_bytes, k, x, m, x_stride, y, y_stride,
                                   nthreads);
        if (status != -1) return status;
    }
    const int64_t nb = k / 32, nb8 = nb - nb % 8;
    int8_t *qx = (int8_t *)malloc((size_t)(m * k));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(m * nb));
    float *sx = (float *)malloc(sizeof(float) * (size_t)(m * nb));
    int failed = 0;
    if (qx == NULL || dx == NULL || sx == NULL) {
        free(qx); free(dx); free(sx);
        return -2;
    }
    quantize_rows_q8(x, m, x_stride, k, qx, dx, sx);
    const int is_q8 = qtype == T_Q8_0;
#pragma omp parallel num_threads(nthreads)
    {
        /* One weight row: |q| bytes (Q8_0: the signed bytes too), d and c per block. */
        uint8_t *wq = (uint8_t *)malloc((size_t)(2 * k));
        float *dw = (float *)malloc(sizeof(float) * (size_t)(2 * nb));
        if (wq == NULL || dw == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        float *cw = dw == NULL ? NULL : dw + nb;
        int8_t *ws = (int8_t *)(wq == NULL ? NULL : wq + k);
        /* Activation rows in tiles that stay in cache while every weight row meets them
         * (a weight row is unpacked once per tile). */
        for (int64_t i0 = 0; i0 < m; i0 += Q8_TILE) {
        const int64_t i1 = i0 + Q8_TILE < m ? i0 + Q8_TILE : m;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            if (wq == NULL || dw == NULL) continue;
            const uint8_t *row = raw + j * row_bytes;
            if (i0 == 0) prefetch_row_ahead(raw, j, n, row_bytes);
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * block_bytes;
                const float d = f16_to_f32(blk);
                dw[b] = d;
                if (is_q8) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
                    _mm256_storeu_si256((__m256i *)(ws + b * 32), w);
                    _mm256_storeu_si256((__m256i *)(wq + b * 32), _mm256_sign_epi8(w, w));
                    cw[b] = 0.0f;
                } else {
                    _mm256_storeu_si256((__m256i *)(wq + b * 32), q4_bytes(blk + qs_off));
                    cw[b] = qtype == T_Q4_1 ? f16_to_f32(blk + 2) : -8.0f * d;
                }
            }
            for (int64_t i = i0; i < i1; i++) {
                const int8_t *xi = qx + i * k;
                const float *dxi = dx + i * nb, *sxi = sx + i * nb;
                __m256 acc = _mm256_setzero_ps(), offacc = _mm256_setzero_ps();
                int64_t b = 0;
                for (; b < nb8; b += 8) {
                    __m256i p[8];
                    for (int u = 0; u < 8; u++) {
                        const int64_t o = (b + u) * 32;
                        __m256i xs = _mm256_loadu_si256((const __m256i *)(xi + o));
                        if (is_q8) xs = _mm256_sign_epi8(xs, _mm256_loadu_si256((const __m256i *)(ws + o)));
                        p[u] = dot_u8_s8(_mm256_loadu_si256((const __m256i *)(wq + o)), xs);
                    }
                    const __m256 sums = _mm256_cvtepi32_ps(hsum8_epi32(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]));
                    const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(dw + b), _mm256_loadu_ps(dxi + b));
                    acc = _mm256_fmadd_ps(sums, scale, acc);
                    offacc = _mm256_fmadd_ps(_mm256_loadu_ps(cw + b), _mm256_loadu_ps(sxi + b), offacc);
                }
                float rest = 0.0f;
                for (; b < nb; b++) {
                    const int64_t o = b * 32;
                    __m256i xs = _mm256_loadu_si256((const __m256i *)(xi + o));
                    if (is_q8) xs = _mm256_sign_epi8(xs, _mm256_loadu_si256((const __m256i *)(ws + o)));
                    const int dot = hsum_epi32(dot_u8_s8(_mm256_loadu_si256((const __m256i *)(wq + o)), xs));
                    rest += (float)dot * (dw[b] * dxi[b]) + cw[b] * sxi[b];
                }
                y[i * y_stride + j] = hsum256(_mm256_add_ps(acc, offacc)) + rest;
            }
        }
        }
        free(wq);
        free(dw);
    }
    free(qx); free(dx); free(sx);
    return failed ? -2 : 0;
}
#else
int pagedllm_gguf_matmul_q8(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes,
                            int64_t k, const float *x, int64_t m, int64_t x_stride, float *y,
                            int64_t y_stride, int nthreads) {
    (void)qtype; (void)raw; (void)n; (void)row_bytes; (void)k; (void)x; (void)m;
    (void)x_stride; (void)y; (void)y_stride; (void)nthreads;
    return -1; /* no AVX2: the float kernels */
}
#endif

/* ---- 8-bit activations in panels (AVX512-VNNI) -------------------------------------------
 *
 * The product above (same quantization of the activations, same integer sums), tiled as
 * the float panels are: each thread decodes a panel of 16 weight rows into unsigned bytes,
 * four consecutive k of one row per 32-bit lane (Q4_0/Q4_1: the nibbles; Q8_0: q + 128),
 * with each block's scale d and offset c per row (Q4_0: c = -8d, Q4_1: the min, Q8_0:
 * -128d). A tile of up to Q8P_MR activation rows meets it block by block: eight dpbusd of a
 * weight vector with a broadcast quad of activations into integer sums, which are then
 * added in float32, block after block, as (d * dx) * sum + c * sx. Each row's result is the
 * same whatever rows share its call. Activations are float32 or bfloat16 (widened exactly),
 * results float32 or bfloat16 (rounded as .to() rounds). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8P_COLS 16
#define Q8P_MR 8
#define Q8P_BLOCK_BYTES (256 * 1024)

/* Index vectors of the 16 x 8 -> 8 x 16 transpose of 32-bit elements (three stages of
 * two-source permutes), built once when the library loads. */
static int32_t q8p_idx[3][2][16];

__attribute__((constructor)) static void q8p_build_indices(void) {
    /* Stage s takes vectors whose element e holds label (row, quad); each output element
     * names its position in the concatenation of the two inputs. */
    for (int e = 0; e < 16; e++) {
        for (int h = 0; h < 2; h++) {
            /* stage 1: inputs rows (2j, 2j+1) x quads 0..7, output h: 4 rows x quads 4h..4h+3
             * at (quad - 4h) * 4 + row. Input element of (r, p): (r % 2) * 8 + p, second
             * input for rows 2, 3. */
            int p = 4 * h + e / 4, r = e % 4;
            q8p_idx[0][h][e] = (r / 2) * 16 + (r % 2) * 8 + p;
            /* stage 2: inputs 4 rows x quads 4h'..4h'+3 (rows 0..3, then 4..7), output h:
             * 8 rows x quads (2h, 2h+1) of that group at (quad - 2h) * 8 + row */
            p = 2 * h + e / 8;
            r = e % 8;
            q8p_idx[1][h][e] = (r / 4) * 16 + p * 4 + r % 4;
            /* stage 3: inputs 8 rows x 2 quads (rows 0..7, then 8..15), output h: quad h of
             * all 16 rows at row */
            q8p_idx[2][h][e] = (e / 8) * 16 + h * 8 + e % 8;
        }
    }
}

/* One row's block as 32 unsigned bytes in element order (Q4_0/Q4_1: the nibbles; Q8_0:
 * q + 128), with its scale d at dc[0] and offset c at dc[16] (Q4_0: -8d, Q4_1: the min,
 * Q8_0: -128d): w = d * byte + c. */
static inline __m256i q8p_block(int qtype, const uint8_t *blk, int qs_off, float *dc) {
    const float d = f16_to_f32(blk);
    dc[0] = d;
    if (qtype == T_Q8_0) {
        dc[16] = -128.0f * d;
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + qs_off)),
                                _mm256_set1_epi8((char)0x80));
    }
    dc[16] = qtype == T_Q4_1 ? f16_to_f32(blk + 2) : -8.0f * d;
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + qs_off));
    const __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

/* Rows j0..j0+15 of the weight (rows past `rows` as zeros) into the panel: for block b and
 * quad p, P[(b * 8 + p) * 16 + r] = bytes 4p..4p+3 of row r's block; dc[b * 32 + r] = d,
 * dc[b * 32 + 16 + r] = c. */
static void q8p_decode(int qtype, int block_bytes, int qs_off, const uint8_t *raw,
                       int64_t row_bytes, int64_t nb, int rows, int32_t *P, float *dc,
                       const uint8_t *next, int64_t next_bytes) {
    const __m512i i0a = _mm512_loadu_si512(q8p_idx[0][0]), i0b = _mm512_loadu_si512(q8p_idx[0][1]);
    const __m512i i1a = _mm512_loadu_si512(q8p_idx[1][0]), i1b = _mm512_loadu_si512(q8p_idx[1][1]);
    const __m512i i2a = _mm512_loadu_si512(q8p_idx[2][0]), i2b = _mm512_loadu_si512(q8p_idx[2][1]);
    /* The 16 rows are 16 concurrent streams, more than the hardware prefetchers follow
     * from memory: the next panel (contiguous, next_bytes) is fetched in step, a slice of
     * it per block. */
    const int64_t slice = next_bytes / nb + 64;
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t off = b * slice; off < (b + 1) * slice && off < next_bytes; off += 64)
            _mm_prefetch((const char *)next + off, _MM_HINT_T0);
        __m256i v[16];
        for (int r = 0; r < 16; r++) {
            if (r >= rows) {
                v[r] = _mm256_setzero_si256();
                dc[b * 32 + r] = 0.0f;
                dc[b * 32 + 16 + r] = 0.0f;
                continue;
            }
            v[r] = q8p_block(qtype, raw + r * row_bytes + b * block_bytes, qs_off,
                             dc + b * 32 + r);
        }
        __m512i z[8], s1[8], s2[8];
        for (int j = 0; j < 8; j++)
            z[j] = _mm512_inserti64x4(_mm512_castsi256_si512(v[2 * j]), v[2 * j + 1], 1);
        for (int j = 0; j < 4; j++) { /* rows 4j..4j+3 */
            s1[2 * j] = _mm512_permutex2var_epi32(z[2 * j], i0a, z[2 * j + 1]);
            s1[2 * j + 1] = _mm512_permutex2var_epi32(z[2 * j], i0b, z[2 * j + 1]);
        }
        for (int g = 0; g < 2; g++) /* rows 8g..8g+7; s1 of quads 0..3 then 4..7 */
            for (int h = 0; h < 2; h++) {
                s2[g * 4 + h * 2] = _mm512_permutex2var_epi32(s1[4 * g + h], i1a, s1[4 * g + 2 + h]);
                s2[g * 4 + h * 2 + 1] = _mm512_permutex2var_epi32(s1[4 * g + h], i1b, s1[4 * g + 2 + h]);
            }
        int32_t *out = P + b * 8 * 16;
        for (int q = 0; q < 4; q++) { /* quads 2q, 2q+1 of rows 0..7 (s2[q]) and 8..15 */
            _mm512_storeu_si512(out + (2 * q) * 16, _mm512_permutex2var_epi32(s2[q], i2a, s2[4 + q]));
            _mm512_storeu_si512(out + (2 * q + 1) * 16, _mm512_permutex2var_epi32(s2[q], i2b, s2[4 + q]));
        }
    }
}

/* One row's blocks of 32 activations (float32, or bfloat16 widened) into int8 with the
 * scale dx = max|x| / 127 (q = x * (1 / dx) rounded half to even) and sx = dx * sum q. */
static void q8p_quantize_row(const void *xv, int x_bf16, int64_t nb, int8_t *q, float *dx,
                             float *sx) {
    for (int64_t b = 0; b < nb; b++) {
        __m512 v0, v1;
        if (x_bf16) {
            const uint16_t *x = (const uint16_t *)xv + b * 32;
            v0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
            v1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + 16))), 16));
        } else {
            const float *x = (const float *)xv + b * 32;
            v0 = _mm512_loadu_ps(x);
            v1 = _mm512_loadu_ps(x + 16);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        /* (the rounding mode is the default, nearest even) */
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
        _mm_storeu_si128((__m128i *)(q + b * 32), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + b * 32 + 16), _mm512_cvtepi32_epi8(q1));
        dx[b] = d;
        sx[b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* ---- A few rows (decode steps of 1-3 sequences) with 8-bit activations ------------------
 *
 * Below Q8_PANEL_MIN_ROWS there is no panel worth decoding: each weight row is read once
 * and decoded in registers two blocks per 512-bit vector (lanes 0-7 block b, 8-15 block
 * b + 1; Q4_0/Q4_1 the nibbles, Q8_0 q + 128), and every activation row meets it with one
 * dpbusd. Per lane, the block's scale and offset are applied in float32 as
 *     acc += d * (dx * dot + (c / d) * sx / 8)    (Q4_0: c / d = -8, Q8_0: -128)
 *     acc += (d * dx) * dot + c * (sx / 8)         (Q4_1: c the min)
 * (sx / 8 per lane: the 8 lanes of a block add up to sx), the lanes summed at the row's
 * end. The same quantization and integer sums as the row loop above; only the float sums'
 * order differs. Rows of an odd block count end on a pair whose second block has zero
 * activations (and scale), so it adds nothing. Each thread reads one contiguous stream of
 * weight rows, fetched Q8R_AHEAD bytes ahead of its loads: measured on a 2-core Xeon VM
 * (AVX512-VNNI), the 1B Llama shape's 16 layers + 128256-row head in Q4_0 at one row, CPU
 * time of one thread: 62 ms, against 72 with the next row fetched whole (ROW_AHEAD 1), 85
 * with ROW_AHEAD 4 and 121 with the hardware prefetchers alone (512 bytes ahead: 77). */
#define Q8R_MAX_ROWS 3
#define Q8R_AHEAD 2048

static const int32_t q8r_pair_idx[2][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
};

static inline __attribute__((always_inline)) void q8r_row(
    const int MR, const int QT, const uint8_t *row, int block_bytes, int qs_off, int64_t np,
    int64_t nb, const int8_t *qx, int64_t kp, const float *dxl, const float *osl, float *y,
    int64_t ys) {
    const __m512i pick_d = _mm512_loadu_si512(q8r_pair_idx[0]);
    const __m512i pick_m = _mm512_loadu_si512(q8r_pair_idx[1]);
    const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[Q8R_MAX_ROWS];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        const uint8_t *b0 = row + 2 * p * block_bytes;
        _mm_prefetch((const char *)b0 + Q8R_AHEAD, _MM_HINT_T0); /* (past the end: harmless) */
        const uint8_t *b1 = 2 * p + 1 < nb ? b0 + block_bytes : b0; /* (zero activations) */
        __m512i w;
        if (QT == T_Q8_0) {
            w = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + qs_off))),
                _mm256_loadu_si256((const __m256i *)(b1 + qs_off)), 1);
            w = _mm512_xor_si512(w, flip);
        } else {
            const __m256i q = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(b1 + qs_off)),
                                               _mm_loadu_si128((const __m128i *)(b0 + qs_off)));
            /* [q0, q0, q1, q1], the second of each pair shifted to its high nibbles */
            w = _mm512_shuffle_i64x2(_mm512_castsi256_si512(q), _mm512_castsi256_si512(q),
                                     _MM_SHUFFLE(1, 1, 0, 0));
            w = _mm512_and_si512(_mm512_mask_srli_epi16(w, 0xFF00FF00u, w, 4), low4);
        }
        uint16_t h[4];
        memcpy(&h[0], b0, 2);
        memcpy(&h[1], b1, 2);
        if (QT == T_Q4_1) {
            memcpy(&h[2], b0 + 2, 2);
            memcpy(&h[3], b1 + 2, 2);
        } else {
            h[2] = h[3] = 0;
        }
        uint64_t hv;
        memcpy(&hv, h, 8);
        const __m512 dm = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128((long long)hv)));
        const __m512 d = _mm512_permutexvar_ps(pick_d, dm);
        for (int i = 0; i < MR; i++) {
            const __m512i a = _mm512_loadu_si512(qx + i * kp + p * 64);
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a));
            const __m512 dx = _mm512_loadu_ps(dxl + (i * np + p) * 16);
            const __m512 os = _mm512_loadu_ps(osl + (i * np + p) * 16);
            if (QT == T_Q4_1) {
                const __m512 mn = _mm512_permutexvar_ps(pick_m, dm);
                acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), dot, acc[i]);
                acc[i] = _mm512_fmadd_ps(mn, os, acc[i]);
            } else {
                acc[i] = _mm512_fmadd_ps(d, _mm512_fmadd_ps(dx, dot, os), acc[i]);
            }
        }
    }
    for (int i = 0; i < MR; i++) y[i * ys] = _mm512_reduce_add_ps(acc[i]);
}

/* y[m, n] for m <= Q8R_MAX_ROWS float32 rows (see above); -1 where it does not apply. */
static int q8_rows(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes, int64_t k,
                   const float *x, int64_t m, int64_t x_stride, float *y, int64_t y_stride,
                   int nthreads) {
    int block_bytes, qs_off, has_min;
    if (m > Q8R_MAX_ROWS || fused_layout(qtype, &block_bytes, &qs_off, &has_min) != 0 || k % 32)
        return -1;
    const int64_t nb = k / 32, np = (nb + 1) / 2, kp = np * 64;
    int8_t *qx = (int8_t *)calloc((size_t)(m * kp), 1);
    float *dxl = (float *)calloc((size_t)(2 * m * np * 16 + 2 * m * nb), sizeof(float));
    if (qx == NULL || dxl == NULL) {
        free(qx); free(dxl);
        return -2;
    }
    float *osl = dxl + m * np * 16, *dx = osl + m * np * 16, *sx = dx + m * nb;
    /* (Q4_0 and Q8_0: the offset c / d times sx / 8, folded per lane) */
    const float fold = qtype == T_Q4_0 ? -1.0f : qtype == T_Q8_0 ? -16.0f : 0.125f;
    for (int64_t i = 0; i < m; i++) {
        q8p_quantize_row(x + i * x_stride, 0, nb, qx + i * kp, dx + i * nb, sx + i * nb);
        for (int64_t b = 0; b < nb; b++)
            for (int l = 0; l < 8; l++) {
                dxl[(i * np + b / 2) * 16 + (b % 2) * 8 + l] = dx[i * nb + b];
                osl[(i * np + b / 2) * 16 + (b % 2) * 8 + l] = sx[i * nb + b] * fold;
            }
    }
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < nthreads; t++) {
            /* (contiguous shares: one weight stream per thread) */
            const int64_t j0 = n * t / nthreads, j1 = n * (t + 1) / nthreads;
            const uint8_t *w = raw + j0 * row_bytes;
            float *yt = y + j0;
            const int64_t rows = j1 - j0;
            switch (qtype * 4 + (int)m) {
#define Q8R_AT(QT, MR)                                                                      \
    case QT * 4 + MR:                                                                       \
        for (int64_t j = 0; j < rows; j++) {                                                \
            q8r_row(MR, QT, w + j * row_bytes, block_bytes, qs_off, np, nb, qx, kp, dxl,    \
                    osl, yt + j, y_stride);                                                 \
        }                                                                                   \
        break;
            Q8R_AT(T_Q4_0, 1) Q8R_AT(T_Q4_0, 2) Q8R_AT(T_Q4_0, 3)
            Q8R_AT(T_Q4_1, 1) Q8R_AT(T_Q4_1, 2) Q8R_AT(T_Q4_1, 3)
            Q8R_AT(T_Q8_0, 1) Q8R_AT(T_Q8_0, 2) Q8R_AT(T_Q8_0, 3)
#undef Q8R_AT
            default: break;
            }
        }
    }
    free(qx);
    free(dxl);
    return 0;
}

/* 16 float32 values rounded to bfloat16 (nearest even, NaN -> 0x7FC0, as torch converts):
 * the conversion instruction where the CPU has AVX512-BF16, else in integers (the VNNI
 * CPUs without it: Cascade Lake, Ice Lake). */
static inline __m256i q8p_to_bf16(__m512 f) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(f);
#else
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7FC00000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

static inline __attribute__((always_inline)) void q8p_tile(const int MR, const int32_t *P,
                                                           const float *dc, int64_t nb,
                                                           const int8_t *qx, const float *dx,
                                                           const float *sx, int64_t k, void *y,
                                                           int64_t ys, int cols, int y_bf16) {
    __m512 f[Q8P_MR];
    for (int i = 0; i < MR; i++) f[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i a[Q8P_MR];
        for (int i = 0; i < MR; i++) a[i] = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) {
            const __m512i w = _mm512_loadu_si512(P + (b * 8 + p) * 16);
            for (int i = 0; i < MR; i++) {
                int32_t quad;
                memcpy(&quad, qx + i * k + b * 32 + 4 * p, sizeof(quad));
                a[i] = _mm512_dpbusd_epi32(a[i], w, _mm512_set1_epi32(quad));
            }
        }
        const __m512 d = _mm512_loadu_ps(dc + b * 32), c = _mm512_loadu_ps(dc + b * 32 + 16);
        for (int i = 0; i < MR; i++) {
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[i * nb + b]));
            const __m512 off = _mm512_fmadd_ps(c, _mm512_set1_ps(sx[i * nb + b]), f[i]);
            f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i]), scale, off);
        }
    }
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
    for (int i = 0; i < MR; i++) {
        if (y_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + i * ys, mask, q8p_to_bf16(f[i]));
        else
            _mm512_mask_storeu_ps((float *)y + i * ys, mask, f[i]);
    }
}

static void q8p_rows(int mr, const int32_t *P, const float *dc, int64_t nb, const int8_t *qx,
                     const float *dx, const float *sx, int64_t k, void *y, int64_t ys, int cols,
                     int y_bf16) {
    switch (mr) {
    case 1: q8p_tile(1, P, dc, nb, qx, dx, sx, k, y, ys, cols, y_bf16); break;
    case 2: q8p_tile(2, P, dc, nb, qx, dx, sx, k, y, ys, cols, y_bf16); break;
    case 3: q8p_tile(3, P, dc, nb, qx, dx, sx, k, y, ys, cols, y_bf16); break;
    case 4: q8p_tile(4, P, dc, nb, qx, dx, sx, k, y, ys, cols, y_bf16); break;
    case 5: q8p_tile(5, P, dc, nb, qx, dx, sx, k, y, ys, cols, y_bf16); break;
    case 6: q8p_tile(6, P, dc, nb, qx, dx, sx, k, y, ys, cols, y_bf16); break;
    case 7: q8p_tile(7, P, dc, nb, qx, dx, sx, k, y, ys, cols, y_bf16); break;
    default: q8p_tile(8, P, dc, nb, qx, dx, sx, k, y, ys, cols, y_bf16); break;
    }
}

/* ---- The same product on AMX tiles (Sapphire Rapids and later) ---------------------------
 *
 * The tiles' integer product (tdpbusd: unsigned bytes times signed bytes, exact int32 sums)
 * takes one block of 32 values at a time: a tile of 16 weight rows x 32 bytes (the block's
 * unsigned weight bytes, as the panel above holds them) against one of 8 quads x 16
 * activation rows, giving the 16 x 16 integer sums the eight dpbusd above give. They are
 * then scaled and added in float32 exactly as q8p_tile does (the same operations in the
 * same order, block after block), so the results are bit-identical to the panel product's
 * at every row count: rows from Q8A_MIN_ROWS on take this path, and a row's result still
 * does not depend on the rows that share its call. Two accumulator tiles take consecutive
 * blocks, so that one block's product runs while the previous one is scaled. The scaling
 * (four vector operations per weight row and block) bounds it: Sapphire Rapids, one
 * thread, a 1B Llama layer's products (Q4_0), 190 GMAC/s against the panels' 120-148 at
 * 128-512 rows (1.3-1.6x), 1.1x at 16-32 rows, slower below. */
#include "dense_amx.c" /* (pagedllm_amx_available: the tile state asked of Linux once) */
#if defined(DENSE_AMX) && defined(__AMX_INT8__)
#define Q8A 1
#define Q8A_MIN_ROWS 16

/* Whether the tiles are used (tests turn them off to compare with the panels). */
static int q8a_enabled = 1;

/* Tiles 0-1: int32 sums (16 weight rows x 16 activation rows); 2-3: weight blocks (16 rows
 * x 32 bytes); 4-5: activation blocks (8 quads x 16 rows x 4 bytes). */
static void q8a_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 6; t++) {
        cfg.rows[t] = t < 4 ? 16 : 8;
        cfg.colsb[t] = t == 2 || t == 3 ? 32 : 64;
    }
    _tile_loadconfig(&cfg);
}

/* Rows j0..j0+rows-1 of the weight into A[b * 512 + r * 32 + e] = unsigned byte of element
 * e of row r's block b (rows past `rows` zeros), with dc as q8p_decode gives it; the next
 * panel (next_bytes from next) fetched in step, as q8p_decode does. */
static void q8a_decode(int qtype, int block_bytes, int qs_off, const uint8_t *raw,
                       int64_t row_bytes, int64_t nb, int rows, uint8_t *A, float *dc,
                       const uint8_t *next, int64_t next_bytes) {
    const int64_t slice = next_bytes / nb + 64;
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t off = b * slice; off < (b + 1) * slice && off < next_bytes; off += 64)
            _mm_prefetch((const char *)next + off, _MM_HINT_T0);
        for (int r = 0; r < 16; r++) {
            uint8_t *dst = A + b * 512 + r * 32;
            if (r >= rows) {
                memset(dst, 0, 32);
                dc[b * 32 + r] = 0.0f;
                dc[b * 32 + 16 + r] = 0.0f;
                continue;
            }
            _mm256_storeu_si256((__m256i *)dst,
                                q8p_block(qtype, raw + r * row_bytes + b * block_bytes, qs_off,
                                          dc + b * 32 + r));
        }
    }
}

/* One block's sums (c: 16 weight rows x 16 activation rows) into the float accumulators
 * f[r] (lanes: activation rows), as q8p_tile adds them. */
static inline __attribute__((always_inline)) void q8a_scale(__m512 f[16], const int32_t *c,
                                                            const float *dc, __m512 dxv,
                                                            __m512 sxv) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(dc[r]), dxv);
        const __m512 off = _mm512_fmadd_ps(_mm512_set1_ps(dc[16 + r]), sxv, f[r]);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)), scale, off);
    }
}

/* The panel A (see q8a_decode) against one tile of 16 activation rows (xb: per block 8
 * quads x 16 rows x 4 bytes; dxt, sxt: per block the 16 rows' scales), stored into y
 * (its first `valid` rows, `cols` columns). */
static void q8a_tile(const uint8_t *A, const float *dc, int64_t nb, const int8_t *xb,
                     const float *dxt, const float *sxt, void *y, int64_t ys, int valid,
                     int cols, int y_bf16) {
    int32_t c[2][256] __attribute__((aligned(64)));
    __m512 f[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) f[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb;
        _tile_zero(0);
        _tile_loadd(2, A + b * 512, 32);
        _tile_loadd(4, xb + b * 512, 64);
        _tile_dpbusd(0, 2, 4);
        if (two) {
            _tile_zero(1);
            _tile_loadd(3, A + (b + 1) * 512, 32);
            _tile_loadd(5, xb + (b + 1) * 512, 64);
            _tile_dpbusd(1, 3, 5);
        }
        _tile_stored(0, c[0], 64);
        q8a_scale(f, c[0], dc + b * 32, _mm512_load_ps(dxt + b * 16), _mm512_load_ps(sxt + b * 16));
        if (two) {
            _tile_stored(1, c[1], 64);
            q8a_scale(f, c[1], dc + (b + 1) * 32, _mm512_load_ps(dxt + (b + 1) * 16),
                      _mm512_load_ps(sxt + (b + 1) * 16));
        }
    }
    /* f[r] lane i is y[i][r]: transposed through memory. */
    float t[256] __attribute__((aligned(64)));
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) _mm512_store_ps(t + 16 * r, f[r]);
    const __m512i column = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
    for (int i = 0; i < valid; i++) {
        const __m512 v = _mm512_i32gather_ps(column, t + i, 4);
        if (y_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + i * ys, mask, q8p_to_bf16(v));
        else
            _mm512_mask_storeu_ps((float *)y + i * ys, mask, v);
    }
}

/* pagedllm_gguf_matmul_q8p's product (the same arguments and quantized activations qx, dx,
 * sx, row-major) on the tiles, which the caller checked can be used (q8a_usable); 0, or
 * -2: no memory. */
/* Whether the tiles take a product: turned on, built in and granted by the kernel. */
static inline int q8a_usable(void) { return q8a_enabled && pagedllm_amx_available(); }

static int q8a_matmul(int qtype, int block_bytes, int qs_off, const uint8_t *raw, int64_t n,
                      int64_t row_bytes, int64_t k, const int8_t *qx, const float *dx,
                      const float *sx, int64_t m, void *y, int64_t y_stride, int nthreads,
                      int y_bf16) {
    const int64_t nb = k / 32, panels = (n + 15) / 16, tiles = (m + 15) / 16;
    /* The activations re-laid for the B operand, with their scales per tile and block. */
    int8_t *xb = (int8_t *)aligned_alloc(64, (size_t)(tiles * nb * 512));
    float *scales = (float *)aligned_alloc(64, sizeof(float) * (size_t)(2 * tiles * nb * 16));
    if (xb == NULL || scales == NULL) {
        free(xb); free(scales);
        return -2;
    }
    float *dxt = scales, *sxt = scales + tiles * nb * 16;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (m * k >= 65536)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < nb; b++) {
            int8_t *dst = xb + (t * nb + b) * 512;
            for (int i = 0; i < 16; i++) {
                const int64_t row = t * 16 + i;
                const int ok = row < m;
                for (int p = 0; p < 8; p++) {
                    if (ok) memcpy(dst + p * 64 + 4 * i, qx + row * k + b * 32 + 4 * p, 4);
                    else memset(dst + p * 64 + 4 * i, 0, 4);
                }
                dxt[(t * nb + b) * 16 + i] = ok ? dx[row * nb + b] : 0.0f;
                sxt[(t * nb + b) * 16 + i] = ok ? sx[row * nb + b] : 0.0f;
            }
        }
    /* Tiles of activations in groups of about Q8P_BLOCK_BYTES, which stay in the cache
     * while every panel meets them (each panel decoded once per group). */
    const int64_t tgroup = Q8P_BLOCK_BYTES / (16 * k) < 1 ? 1 : Q8P_BLOCK_BYTES / (16 * k);
    const size_t y_elem = y_bf16 ? sizeof(uint16_t) : sizeof(float);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *A = (uint8_t *)aligned_alloc(64, (size_t)(nb * 512));
        float *dc = (float *)aligned_alloc(64, sizeof(float) * (size_t)(nb * 32));
        if (A == NULL || dc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        q8a_configure();
        for (int64_t t0 = 0; t0 < tiles; t0 += tgroup) {
            const int64_t t1 = t0 + tgroup < tiles ? t0 + tgroup : tiles;
#pragma omp for schedule(static)
            for (int64_t pi = 0; pi < panels; pi++) {
                if (A == NULL || dc == NULL) continue;
                const int64_t j0 = pi * 16;
                const int cols = (int)(n - j0 < 16 ? n - j0 : 16);
                /* (the thread's next panel, in its static share; none after the last) */
                const int64_t jn = j0 + 16;
                const int64_t next_rows = jn >= n ? 0 : (n - jn < 16 ? n - jn : 16);
                q8a_decode(qtype, block_bytes, qs_off, raw + j0 * row_bytes, row_bytes, nb, cols,
                           A, dc, raw + jn * row_bytes, next_rows * row_bytes);
                for (int64_t t = t0; t < t1; t++) {
                    const int valid = (int)(m - t * 16 < 16 ? m - t * 16 : 16);
                    q8a_tile(A, dc, nb, xb + t * nb * 512, dxt + t * nb * 16, sxt + t * nb * 16,
                             (char *)y + y_elem * (size_t)(t * 16 * y_stride + j0), y_stride,
                             valid, cols, y_bf16);
                }
            }
        }
        _tile_release();
        free(A);
        free(dc);
    }
    free(xb);
    free(scales);
    return failed ? -2 : 0;
}
#endif

/* y[m, n] = x[m, k] . W[n, k] with 8-bit activations, in panels (see above); x bfloat16
 * where x_bf16, y where y_bf16. -1: another type or k not a multiple of 32; -2: no memory. */
int pagedllm_gguf_matmul_q8p(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes,
                             int64_t k, const void *x, int64_t m, int64_t x_stride, void *y,
                             int64_t y_stride, int nthreads, int x_bf16, int y_bf16) {
    int block_bytes, qs_off, has_min;
    if (fused_layout(qtype, &block_bytes, &qs_off, &has_min) != 0 || k % 32) return -1;
    const int64_t nb = k / 32, panels = (n + Q8P_COLS - 1) / Q8P_COLS;
    const size_t x_elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t y_elem = y_bf16 ? sizeof(uint16_t) : sizeof(float);
    int8_t *qx = (int8_t *)malloc((size_t)(m * k));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(2 * m * nb));
    if (qx == NULL || dx == NULL) {
        free(qx); free(dx);
        return -2;
    }
    float *sx = dx + m * nb;
#ifdef Q8A
    if (m >= Q8A_MIN_ROWS && q8a_usable()) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t i = 0; i < m; i++)
            q8p_quantize_row((const char *)x + x_elem * (size_t)(i * x_stride), x_bf16, nb,
                             qx + i * k, dx + i * nb, sx + i * nb);
        const int status = q8a_matmul(qtype, block_bytes, qs_off, raw, n, row_bytes, k, qx, dx,
                                      sx, m, y, y_stride, nthreads, y_bf16);
        free(qx);
        free(dx);
        return status;
    }
#endif
    /* Rows in blocks of about Q8P_BLOCK_BYTES of quantized activations, which stay in the
     * cache while every panel meets them (each panel is decoded once per block). */
    const int64_t mblock = Q8P_BLOCK_BYTES / k < Q8P_MR ? Q8P_MR : Q8P_BLOCK_BYTES / k;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        int32_t *P = (int32_t *)aligned_alloc(64, (size_t)(k * Q8P_COLS));
        float *dc = (float *)aligned_alloc(64, sizeof(float) * (size_t)(nb * 32));
        if (P == NULL || dc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++)
            q8p_quantize_row((const char *)x + x_elem * (size_t)(i * x_stride), x_bf16, nb,
                             qx + i * k, dx + i * nb, sx + i * nb);
        for (int64_t r0 = 0; r0 < m; r0 += mblock) {
            const int64_t mb = m - r0 < mblock ? m - r0 : mblock;
            const int64_t tiles = (mb + Q8P_MR - 1) / Q8P_MR;
#pragma omp for schedule(static)
            for (int64_t pi = 0; pi < panels; pi++) {
                if (P == NULL || dc == NULL) continue;
                const int64_t j0 = pi * Q8P_COLS;
                const int cols = (int)(n - j0 < Q8P_COLS ? n - j0 : Q8P_COLS);
                /* (the thread's next panel, in its static share; none after the last) */
                const int64_t jn = j0 + Q8P_COLS;
                const int64_t next_rows = jn >= n ? 0 : (n - jn < Q8P_COLS ? n - jn : Q8P_COLS);
                q8p_decode(qtype, block_bytes, qs_off, raw + j0 * row_bytes, row_bytes, nb, cols,
                           P, dc, raw + jn * row_bytes, next_rows * row_bytes);
                int64_t i0 = r0;
                for (int64_t t = 0; t < tiles; t++) { /* tiles of near-equal size */
                    const int64_t mr = (r0 + mb - i0) / (tiles - t);
                    q8p_rows((int)mr, P, dc, nb, qx + i0 * k, dx + i0 * nb, sx + i0 * nb, k,
                             (char *)y + y_elem * (size_t)(i0 * y_stride + j0), y_stride, cols,
                             y_bf16);
                    i0 += mr;
                }
            }
        }
        free(P);
        free(dc);
    }
    free(qx);
    free(dx);
    return failed ? -2 : 0;
}
#else
int pagedllm_gguf_matmul_q8p(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes,
                             int64_t k, const void *x, int64_t m, int64_t x_stride, void *y,
                             int64_t y_stride, int nthreads, int x_bf16, int y_bf16) {
    (void)qtype; (void)raw; (void)n; (void)row_bytes; (void)k; (void)x; (void)x_bf16; (void)m;
    (void)x_stride; (void)y; (void)y_bf16; (void)y_stride; (void)nthreads;
    return -1; /* no AVX512-VNNI: the untiled 8-bit product or the float kernels */
}

static int q8_rows(int qtype, const uint8_t *raw, int64_t n, int64_t row_bytes, int64_t k,
                   const float *x, int64_t m, int64_t x_stride, float *y, int64_t y_stride,
                   int nthreads) {
    (void)qtype; (void)raw; (void)n; (void)row_bytes; (void)k; (void)x; (void)m;
    (void)x_stride; (void)y; (void)y_stride; (void)nthreads;
    return -1; /* no AVX512-VNNI: the row loop */
}
#endif

/* Turns the AMX tiles of the 8-bit product on or off; returns whether they are on (and
 * can be used: built in, and granted). */
int pagedllm_gguf_q8_tiles(int on) {
#ifdef Q8A
    q8a_enabled = on;
    return q8a_usable();
#else
    (void)on;
    return 0;
#endif
}
