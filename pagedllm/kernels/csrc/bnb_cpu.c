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
/* 32 weights (16 bytes) -> the codebook values of the first weight of each byte (the
 * high nibbles: weights 0, 2, ..., 30) and of the second (the low nibbles). vpermps reads
 * the low 4 bits of each index, so the low nibble needs no mask. */
static inline void decode4_pair(const uint8_t *p, lut_t lut, vec_t *first, vec_t *second) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *first = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
    *second = _mm512_permutexvar_ps(b, lut);
}
static inline vec_t decode8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#define VEC_ZERO() _mm512_setzero_ps()
#define VEC_SET1(a) _mm512_set1_ps(a)
#define VEC_MUL(a, b) _mm512_mul_ps(a, b)
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
/* 16 weights (8 bytes) -> the values of their high and low nibbles (weights 0, 2, ...,
 * 14 and 1, 3, ..., 15): vpermps reads the low 3 bits of each index, and the sign bit of
 * the blend mask is the index's bit 3. */
static inline void decode4_pair(const uint8_t *p, lut_t lut, vec_t *first, vec_t *second) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i hi = _mm256_srli_epi32(b, 4);
    *first = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut.lo, hi),
                              _mm256_permutevar8x32_ps(lut.hi, hi),
                              _mm256_castsi256_ps(_mm256_slli_epi32(b, 24)));
    *second = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut.lo, b),
                               _mm256_permutevar8x32_ps(lut.hi, b),
                               _mm256_castsi256_ps(_mm256_slli_epi32(b, 28)));
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
#define VEC_SET1(a) _mm256_set1_ps(a)
#define VEC_MUL(a, b) _mm256_mul_ps(a, b)
#define VEC_LOAD(p) _mm256_loadu_ps(p)
#define VEC_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VEC_SUM(v) hsum8(v)
#endif

#ifdef BNB_VEC
/* The BNB_VEC floats of v stored at p as float32 (out_bf16 = 0) or bfloat16 (1), rounded
 * as f32_to_bf16 rounds. */
static inline void store_out(void *out, int64_t at, vec_t v, int out_bf16) {
#if defined(__AVX512F__)
    if (!out_bf16) {
        _mm512_storeu_ps((float *)out + at, v);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
#else
    if (!out_bf16) {
        _mm256_storeu_ps((float *)out + at, v);
        return;
    }
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)out + at), _mm256_castsi256_si128(packed));
#endif
}
#endif

static inline void store_one(void *out, int64_t at, float v, int out_bf16) {
    if (out_bf16)
        ((uint16_t *)out)[at] = f32_to_bf16(v);
    else
        ((float *)out)[at] = v;
}

/* Decoded weights times each group's scale, as float32 (out_bf16 = 0) or bfloat16 (1):
 * VDECODE(kk) / SDECODE(kk) decode the weights at column kk (a vector of them, one). */
#ifdef BNB_VEC
#define DEQUANT_VECTORS(VDECODE)                                                          \
    for (; kk + BNB_VEC <= k1; kk += BNB_VEC)                                             \
        store_out(out, j * k + kk, VEC_MUL(VDECODE(kk), VEC_SET1(a)), out_bf16);
#else
#define DEQUANT_VECTORS(VDECODE)
#endif
#define DEQUANT_ROW(VDECODE, SDECODE)                                                     \
    for (int64_t g = 0; g < groups; g++) {                                                \
        const int64_t k0 = g * group_size;                                                \
        const int64_t k1 = k0 + group_size < k ? k0 + group_size : k;                     \
        const float a = s[g];                                                             \
        int64_t kk = k0;                                                                  \
        DEQUANT_VECTORS(VDECODE)                                                          \
        for (; kk < k1; kk++) store_one(out, j * k + kk, SDECODE(kk) * a, out_bf16);      \
    }

/* out[j, kk] = code[nibble(j, kk)] * absmax[j, kk / group_size]. Groups of a multiple of
 * 16 columns keep the vectors on whole bytes (-1 otherwise, or for an odd k). */
int pagedllm_bnb4_dequant(const uint8_t *w, const float *absmax, const float *code, int64_t n,
                          int64_t k, int64_t groups, int64_t group_size, void *out,
                          int out_bf16, int nthreads) {
    if (k % 2 || group_size % 16) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = w + j * (k / 2);
        const float *s = absmax + j * groups;
#ifdef BNB_VEC
        const lut_t lut = lut_load(code);
#define V4(kk) decode4(row + (kk) / 2, lut)
#endif
#define S4(kk) code[nibble(row, kk)]
        DEQUANT_ROW(V4, S4)
#undef S4
#undef V4
    }
    return 0;
}

/* out[j, kk] = w[j, kk] * scale[j] for int8 weights [n, k]. */
int pagedllm_int8_dequant(const int8_t *w, const float *scale, int64_t n, int64_t k, void *out,
                          int out_bf16, int nthreads) {
    const int64_t groups = 1, group_size = k;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < n; j++) {
        const int8_t *row = w + j * k;
        const float *s = scale + j;
#define V8(kk) decode8(row + (kk))
#define S8(kk) ((float)row[kk])
        DEQUANT_ROW(V8, S8)
#undef S8
#undef V8
    }
    return 0;
}

/* One weight row against M activation rows: out[i] = sum_g s[g] * (x[i] . decoded row)
 * over each group's columns. Vector lanes are independent sums added up at the end of
 * each group; the columns past the last full vector go one by one. VDECODE(kk) and
 * SDECODE(kk) give the decoded weights at column kk (a vector of them, one). */
#ifdef BNB_VEC
/* Two vectors a step with their own accumulators (two chains of dependent
 * multiply-adds, so one activation row does not wait on each one's latency). */
#define VECTOR_PART(VDECODE)                                                              \
    vec_t acc[BNB_MAX_ROWS], acc2[BNB_MAX_ROWS];                                          \
    for (int i = 0; i < M; i++) acc[i] = acc2[i] = VEC_ZERO();                            \
    for (; kk + 2 * BNB_VEC <= k1; kk += 2 * BNB_VEC) {                                   \
        const vec_t w0 = VDECODE(kk), w1 = VDECODE(kk + BNB_VEC);                         \
        for (int i = 0; i < M; i++) {                                                     \
            acc[i] = VEC_FMA(VEC_LOAD(x + i * k + kk), w0, acc[i]);                       \
            acc2[i] = VEC_FMA(VEC_LOAD(x + i * k + kk + BNB_VEC), w1, acc2[i]);           \
        }                                                                                 \
    }                                                                                     \
    for (; kk + BNB_VEC <= k1; kk += BNB_VEC) {                                           \
        const vec_t wv = VDECODE(kk);                                                     \
        for (int i = 0; i < M; i++) acc[i] = VEC_FMA(VEC_LOAD(x + i * k + kk), wv, acc[i]); \
    }                                                                                     \
    for (int i = 0; i < M; i++) part[i] = VEC_SUM(acc[i]) + VEC_SUM(acc2[i]);
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

/* Each group's runs of 2 * BNB_VEC columns, as the 4-bit product reads them: the column
 * offsets of the runs, in order, for k columns in groups of group_size. */
#define FOR_EACH_RUN(kk, BODY)                                                            \
    for (int64_t g_ = 0; g_ < groups; g_++) {                                             \
        const int64_t end_ = (g_ + 1) * group_size < k ? (g_ + 1) * group_size : k;       \
        for (int64_t kk = g_ * group_size; kk + 2 * BNB_VEC <= end_; kk += 2 * BNB_VEC)   \
            BODY                                                                          \
    }

/* The 4-bit product of one weight row: a run of 2 * BNB_VEC columns decodes into the
 * values of its even and its odd columns (decode4_pair), which meet the activations
 * rearranged the same way (xs: each run's even columns, then its odd ones); columns past
 * the last run of a group go one by one, from x. */
static inline __attribute__((always_inline)) void row4(const float *x, const float *xs, int M,
                                                       int64_t k, const uint8_t *row,
                                                       const float *s, int64_t groups,
                                                       int64_t group_size, const float *code,
                                                       float *out) {
    float total[BNB_MAX_ROWS] = {0};
#ifdef BNB_VEC
    const lut_t lut = lut_load(code);
#endif
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * group_size;
        const int64_t k1 = k0 + group_size < k ? k0 + group_size : k;
        float part[BNB_MAX_ROWS] = {0};
        int64_t kk = k0;
#ifdef BNB_VEC
        vec_t acc[BNB_MAX_ROWS], acc2[BNB_MAX_ROWS];
        for (int i = 0; i < M; i++) acc[i] = acc2[i] = VEC_ZERO();
        for (; kk + 2 * BNB_VEC <= k1; kk += 2 * BNB_VEC) {
            vec_t even, odd;
            decode4_pair(row + kk / 2, lut, &even, &odd);
            for (int i = 0; i < M; i++) {
                acc[i] = VEC_FMA(VEC_LOAD(xs + i * k + kk), even, acc[i]);
                acc2[i] = VEC_FMA(VEC_LOAD(xs + i * k + kk + BNB_VEC), odd, acc2[i]);
            }
        }
        for (int i = 0; i < M; i++) part[i] = VEC_SUM(acc[i]) + VEC_SUM(acc2[i]);
#endif
        for (; kk < k1; kk++) {
            const float wk = code[nibble(row, kk)];
            for (int i = 0; i < M; i++) part[i] += x[i * k + kk] * wk;
        }
        for (int i = 0; i < M; i++) total[i] += part[i] * s[g];
    }
    for (int i = 0; i < M; i++) out[i] = total[i];
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
    const float *xs = x;
#ifdef BNB_VEC
    float *shuffled = malloc(sizeof(float) * m * k);
    if (!shuffled) return -2;
    memcpy(shuffled, x, sizeof(float) * m * k);
    for (int64_t i = 0; i < m; i++) {
        const float *xi = x + i * k;
        float *si = shuffled + i * k;
        FOR_EACH_RUN(kk, {
            for (int t = 0; t < BNB_VEC; t++) {
                si[kk + t] = xi[kk + 2 * t];
                si[kk + BNB_VEC + t] = xi[kk + 2 * t + 1];
            }
        })
    }
    xs = shuffled;
#endif
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < n; j++) {
        float out[BNB_MAX_ROWS];
        const uint8_t *row = w + j * (k / 2);
        const float *s = absmax + j * groups;
#define CALL4(M) row4(x, xs, M, k, row, s, groups, group_size, code, out)
        FOR_EACH_M(CALL4)
#undef CALL4
        for (int64_t i = 0; i < m; i++) y[i * n + j] = out[i];
    }
#ifdef BNB_VEC
    free(shuffled);
#endif
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
