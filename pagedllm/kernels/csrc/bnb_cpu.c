/* bitsandbytes weights on the CPU: 4-bit codebook weights (NF4, FP4) and 8-bit row-scaled
 * weights (LLM.int8), decoded to float32 or bfloat16, and their product with a few
 * activation rows without a decoded copy of the weight.
 *
 * 4-bit: uint8 [n, k / 2], two weights a byte (the first in the high nibble), each an
 * index into a 16-entry float32 codebook; column kk of row j is
 * code[nibble] * absmax[j, kk / group_size] (bitsandbytes' blocks of `group_size`
 * consecutive weights, which the caller keeps inside rows).
 * 8-bit: int8 [n, k] with one float32 scale a row (SCB / 127).
 *
 * The decoded values are exactly bitsandbytes' (a table look-up, then one float32
 * product). Plain C where vectors do not apply, written so that the compiler vectorises
 * it for the CPU at hand (-O3 -march=native). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* float32 -> bfloat16, round to nearest even (torch's conversion; no NaNs reach here). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static inline int nibble(const uint8_t *row, int64_t kk) {
    const uint8_t b = row[kk >> 1];
    return (kk & 1) ? (b & 0x0F) : (b >> 4);
}

/* out[j, kk] = code[nibble(j, kk)] * absmax[j, kk / group_size], as float32 (out_bf16 = 0)
 * or bfloat16 (1). */
int pagedllm_bnb4_dequant(const uint8_t *w, const float *absmax, const float *code, int64_t n,
                          int64_t k, int64_t groups, int64_t group_size, void *out,
                          int out_bf16, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = w + j * (k / 2);
        const float *s = absmax + j * groups;
        for (int64_t kk = 0; kk < k; kk++) {
            const float v = code[nibble(row, kk)] * s[kk / group_size];
            if (out_bf16)
                ((uint16_t *)out)[j * k + kk] = f32_to_bf16(v);
            else
                ((float *)out)[j * k + kk] = v;
        }
    }
    return 0;
}

#define BNB_MAX_ROWS 8

#if defined(__AVX512F__)
#include <immintrin.h>
#define BNB_VEC 16
typedef __m512 vec_t;
typedef __m512 lut_t;
static inline lut_t lut_load(const float *code) { return _mm512_loadu_ps(code); }
/* 16 weights (8 bytes) -> their codebook values. */
static inline vec_t decode4(const uint8_t *p, lut_t lut) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(hi, lo));
    return _mm512_permutexvar_ps(idx, lut);
}
static inline vec_t decode8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#define VEC_ZERO() _mm512_setzero_ps()
#define VEC_LOAD(p) _mm512_loadu_ps(p)
#define VEC_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VEC_SUM(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BNB_VEC 8
typedef __m256 vec_t;
typedef struct {
    __m256 lo, hi;
} lut_t;
static inline lut_t lut_load(const float *code) {
    lut_t t = {_mm256_loadu_ps(code), _mm256_loadu_ps(code + 8)};
    return t;
}
/* 8 weights (4 bytes) -> their codebook values: two 8-entry look-ups, chosen by bit 3. */
static inline vec_t decode4(const uint8_t *p, lut_t lut) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    const __m128i b = _mm_cvtsi32_si128(v);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(hi, lo));
    const __m256 low = _mm256_permutevar8x32_ps(lut.lo, idx);
    const __m256 high = _mm256_permutevar8x32_ps(lut.hi, idx);
    return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
static inline vec_t decode8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define VEC_ZERO() _mm256_setzero_ps()
#define VEC_LOAD(p) _mm256_loadu_ps(p)
#define VEC_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VEC_SUM(v) hsum8(v)
#endif

/* One weight row against M activation rows: out[i] = sum_g s[g] * (x[i] . decoded row)
 * over each group's columns. Vector lanes are independent sums added up at the end of
 * each group; the columns past the last full vector go one by one. VDECODE(kk) and
 * SDECODE(kk) give the decoded weights at column kk (a vector of them, one). */
#ifdef BNB_VEC
#define VECTOR_PART(VDECODE)                                                              \
    vec_t acc[BNB_MAX_ROWS];                                                              \
    for (int i = 0; i < M; i++) acc[i] = VEC_ZERO();                                      \
    for (; kk + BNB_VEC <= k1; kk += BNB_VEC) {                                           \
        const vec_t wv = VDECODE(kk);                                                     \
        for (int i = 0; i < M; i++) acc[i] = VEC_FMA(VEC_LOAD(x + i * k + kk), wv, acc[i]); \
    }                                                                                     \
    for (int i = 0; i < M; i++) part[i] = VEC_SUM(acc[i]);
#else
#define VECTOR_PART(VDECODE)
#endif

#define ROW_BODY(VDECODE, SDECODE)                                                        \
    float total[BNB_MAX_ROWS] = {0};                                                      \
    for (int64_t g = 0; g < groups; g++) {                                                \
        const int64_t k0 = g * group_size;                                                \
        const int64_t k1 = k0 + group_size < k ? k0 + group_size : k;                     \
        float part[BNB_MAX_ROWS] = {0};                                                   \
        int64_t kk = k0;                                                                  \
        VECTOR_PART(VDECODE)                                                              \
        for (; kk < k1; kk++) {                                                           \
            const float wk = SDECODE(kk);                                                 \
            for (int i = 0; i < M; i++) part[i] += x[i * k + kk] * wk;                    \
        }                                                                                 \
        for (int i = 0; i < M; i++) total[i] += part[i] * s[g];                           \
    }                                                                                     \
    for (int i = 0; i < M; i++) out[i] = total[i];

static inline __attribute__((always_inline)) void row4(const float *x, int M, int64_t k,
                                                       const uint8_t *row, const float *s,
                                                       int64_t groups, int64_t group_size,
                                                       const float *code, float *out) {
#ifdef BNB_VEC
    const lut_t lut = lut_load(code);
#define V4(kk) decode4(row + (kk) / 2, lut)
#endif
#define S4(kk) code[nibble(row, kk)]
    ROW_BODY(V4, S4)
#undef S4
#undef V4
}

static inline __attribute__((always_inline)) void row8(const float *x, int M, int64_t k,
                                                       const int8_t *row, const float *s,
                                                       int64_t groups, int64_t group_size,
                                                       float *out) {
#define V8(kk) decode8(row + (kk))
#define S8(kk) ((float)row[kk])
    ROW_BODY(V8, S8)
#undef S8
#undef V8
}

/* A constant M in each case, so that the accumulators stay in registers. */
#define FOR_EACH_M(CALL)                                                                  \
    switch (m) {                                                                          \
    case 1: CALL(1); break;                                                               \
    case 2: CALL(2); break;                                                               \
    case 3: CALL(3); break;                                                               \
    case 4: CALL(4); break;                                                               \
    case 5: CALL(5); break;                                                               \
    case 6: CALL(6); break;                                                               \
    case 7: CALL(7); break;                                                               \
    case 8: CALL(8); break;                                                               \
    }

/* y[i, j] = sum_g absmax[j, g] * sum_{kk in g} x[i, kk] * code[nibble(j, kk)] for
 * 1 <= m <= 8 float32 activation rows (x: [m, k], y: [m, n], contiguous). Groups of a
 * multiple of 16 columns keep the vectors on whole bytes; -1 otherwise, or for m out of
 * range, or an odd k. */
int pagedllm_bnb4_gemv(const float *x, int64_t m, int64_t k, const uint8_t *w,
                       const float *absmax, const float *code, int64_t n, int64_t groups,
                       int64_t group_size, float *y, int nthreads) {
    if (m < 1 || m > BNB_MAX_ROWS || k % 2 || group_size % 16) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < n; j++) {
        float out[BNB_MAX_ROWS];
        const uint8_t *row = w + j * (k / 2);
        const float *s = absmax + j * groups;
#define CALL4(M) row4(x, M, k, row, s, groups, group_size, code, out)
        FOR_EACH_M(CALL4)
#undef CALL4
        for (int64_t i = 0; i < m; i++) y[i * n + j] = out[i];
    }
    return 0;
}

/* y[i, j] = scale[j] * sum_kk x[i, kk] * w[j, kk] for 1 <= m <= 8 float32 activation
 * rows and int8 weights [n, k]. -1 when m is out of range. */
int pagedllm_int8_gemv(const float *x, int64_t m, int64_t k, const int8_t *w,
                       const float *scale, int64_t n, float *y, int nthreads) {
    if (m < 1 || m > BNB_MAX_ROWS) return -1;
    const int64_t groups = 1, group_size = k;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < n; j++) {
        float out[BNB_MAX_ROWS];
        const int8_t *row = w + j * k;
        const float *s = scale + j;
#define CALL8(M) row8(x, M, k, row, s, groups, group_size, out)
        FOR_EACH_M(CALL8)
#undef CALL8
        for (int64_t i = 0; i < m; i++) y[i * n + j] = out[i];
    }
    return 0;
}
