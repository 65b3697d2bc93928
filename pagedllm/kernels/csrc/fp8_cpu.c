/* float8_e4m3fn weights on the CPU: decode to float32 or bfloat16, and the product with
 * a few activation rows without a decoded copy of the weight.
 *
 * A weight is uint8 [n, k] (the e4m3fn bits) with float32 scales [n, groups]: column
 * kk of row j is scaled by scale[j, kk / group_size] (one group: per-row or per-tensor
 * scales; several: the column blocks of block-wise checkpoints).
 *
 * e4m3fn -> float32 is exact by moving its bits: sign to bit 31, exponent and mantissa
 * (7 bits) to bits 20..26, then a product with 2^120 rebiases the exponent (7 -> 127)
 * and turns the subnormals into normal floats. (0x7F/0xFF, the format's NaN, come out
 * as 480: a checkpoint's weights hold none.) Plain C written so that the compiler
 * vectorises it for the CPU at hand (-O3 -march=native). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float fp8_e4m3_to_f32(uint8_t b) {
    uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7F) << 20);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f * 0x1p120f;
}

/* float32 -> bfloat16, round to nearest even (what torch's conversion does; no NaNs
 * reach here). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* out[j, kk] = decode(w[j, kk]) * scale[j, kk / group_size], as float32 (out_bf16 = 0)
 * or bfloat16 (1). */
int pagedllm_fp8_dequant(const uint8_t *w, const float *scale, int64_t n, int64_t k,
                         int64_t groups, int64_t group_size, void *out, int out_bf16,
                         int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = w + j * k;
        const float *s = scale + j * groups;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t k0 = g * group_size;
            const int64_t k1 = k0 + group_size < k ? k0 + group_size : k;
            const float sg = s[g];
            if (out_bf16) {
                uint16_t *o = (uint16_t *)out + j * k;
                for (int64_t kk = k0; kk < k1; kk++)
                    o[kk] = f32_to_bf16(fp8_e4m3_to_f32(row[kk]) * sg);
            } else {
                float *o = (float *)out + j * k;
                for (int64_t kk = k0; kk < k1; kk++) o[kk] = fp8_e4m3_to_f32(row[kk]) * sg;
            }
        }
    }
    return 0;
}

#define FP8_MAX_ROWS 8

#if defined(__AVX512F__)
#include <immintrin.h>
#define FP8_VEC 16
/* 16 e4m3fn bytes -> 16 floats (the bit move of fp8_e4m3_to_f32, by lanes). */
static inline __m512 fp8_decode16(const uint8_t *p) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    const __m512i rest = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), 20);
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(sign, rest)),
                         _mm512_set1_ps(0x1p120f));
}
#define VEC_T __m512
#define VEC_ZERO() _mm512_setzero_ps()
#define VEC_DECODE(p) fp8_decode16(p)
#define VEC_LOAD(p) _mm512_loadu_ps(p)
#define VEC_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VEC_SUM(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FP8_VEC 8
static inline __m256 fp8_decode8(const uint8_t *p) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    const __m256i rest = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(sign, rest)),
                         _mm256_set1_ps(0x1p120f));
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define VEC_T __m256
#define VEC_ZERO() _mm256_setzero_ps()
#define VEC_DECODE(p) fp8_decode8(p)
#define VEC_LOAD(p) _mm256_loadu_ps(p)
#define VEC_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VEC_SUM(v) hsum8(v)
#endif

/* One weight row against M activation rows: out[i] = sum_g s[g] * (x[i] . row) over the
 * group's columns. Vector lanes (where the CPU has them) are independent sums added up
 * at the end of each group; the columns past the last full vector go one by one. */
static inline __attribute__((always_inline)) void fp8_row(const float *x, int M, int64_t k,
                                                          const uint8_t *row, const float *s,
                                                          int64_t groups, int64_t group_size,
                                                          float *out) {
    float total[FP8_MAX_ROWS] = {0};
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * group_size;
        const int64_t k1 = k0 + group_size < k ? k0 + group_size : k;
        float part[FP8_MAX_ROWS] = {0};
        int64_t kk = k0;
#ifdef FP8_VEC
        VEC_T acc[FP8_MAX_ROWS];
        for (int i = 0; i < M; i++) acc[i] = VEC_ZERO();
        for (; kk + FP8_VEC <= k1; kk += FP8_VEC) {
            const VEC_T w = VEC_DECODE(row + kk);
            for (int i = 0; i < M; i++) acc[i] = VEC_FMA(VEC_LOAD(x + i * k + kk), w, acc[i]);
        }
        for (int i = 0; i < M; i++) part[i] = VEC_SUM(acc[i]);
#endif
        for (; kk < k1; kk++) {
            const float wk = fp8_e4m3_to_f32(row[kk]);
            for (int i = 0; i < M; i++) part[i] += x[i * k + kk] * wk;
        }
        for (int i = 0; i < M; i++) total[i] += part[i] * s[g];
    }
    for (int i = 0; i < M; i++) out[i] = total[i];
}

/* y[i, j] = sum_g scale[j, g] * sum_{kk in g} x[i, kk] * decode(w[j, kk]) for m <= 8
 * float32 activation rows (x: [m, k], y: [m, n], both contiguous): each weight row is
 * decoded once and meets every activation row. -1 when m is out of range. */
int pagedllm_fp8_gemv(const float *x, int64_t m, int64_t k, const uint8_t *w,
                      const float *scale, int64_t n, int64_t groups, int64_t group_size,
                      float *y, int nthreads) {
    if (m < 1 || m > FP8_MAX_ROWS) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < n; j++) {
        float out[FP8_MAX_ROWS];
        const uint8_t *row = w + j * k;
        const float *s = scale + j * groups;
        switch (m) { /* (a constant M each: the accumulators stay in registers) */
#define FP8_CASE(M) \
    case M: fp8_row(x, M, k, row, s, groups, group_size, out); break;
            FP8_CASE(1) FP8_CASE(2) FP8_CASE(3) FP8_CASE(4)
            FP8_CASE(5) FP8_CASE(6) FP8_CASE(7) FP8_CASE(8)
#undef FP8_CASE
        }
        for (int64_t i = 0; i < m; i++) y[i * n + j] = out[i];
    }
    return 0;
}
