/* Products of bfloat16 activation rows with a dense bfloat16 weight on Intel AMX tiles
 * (pagedllm/kernels/dense_amx.py builds and loads this file), for the steps of tens to
 * hundreds of rows that a batch of decodes makes:
 *
 *   y[m, n] = x[m, k] . W[n, k]
 *
 * oneDNN's AMX GEMM behind F.linear re-lays the weight into the tiles' pair layout on
 * every call (the weight as it is stored, [n, k], is not that layout), which at these row
 * counts costs more than the product. Computed transposed, y^T = W . x^T, the weight is
 * the tiles' A operand exactly as stored: a tile is 16 weight rows of 32 consecutive
 * elements, read with the row stride. Only the activations are re-laid (into pairs of
 * consecutive elements, 16 rows a tile, the B operand), which is small. The weight is
 * streamed once per 32 activation rows, from cache after the first.
 *
 * Each 16 x 16 block of outputs is one tile accumulated in float32 over k in order
 * (32 elements a step), rounded once to bfloat16 (nearest even) or kept in float32.
 * Takes k a multiple of 32 and n a multiple of 16 (the caller checks; it returns -1
 * otherwise, and where the CPU or the kernel lacks AMX).
 *
 * Plain C, no torch headers: called through ctypes with raw pointers.
 */
#ifndef PAGEDLLM_DENSE_AMX_C /* (gguf_cpu.c includes this file too, and both go into cpu_layer.c) */
#define PAGEDLLM_DENSE_AMX_C
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#define DENSE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define AMX_TILE_ELEMS 512 /* bfloat16 elements of one 16 x 64-byte tile */

/* The fewest rows the tiles are given (dense_amx.AMX_ROWS starts here; the modules and the
 * native layer route by it). From memory the tiles stream the weight at the same speed for
 * 2 to 192 rows; the small-row kernel (dense_cpu) is faster for 1-3 rows and slower from 4
 * (SmolLM2-135M's products, 2 threads, Sapphire Rapids: 4 rows 15.0 against 15.5 ms, 8
 * rows 15.3 against 20.5 ms). */
#define PAGEDLLM_AMX_MIN_ROWS 4

int pagedllm_amx_min_rows(void) { return PAGEDLLM_AMX_MIN_ROWS; }

/* Whether the tiles can be used: compiled in, and the kernel grants this process the
 * tile state (Linux asks each process to request it once). */
int pagedllm_amx_available(void) {
#ifdef DENSE_AMX
    static int state = 0;
    if (state == 0) {
        /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
        state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    }
    return state == 1;
#else
    return 0;
#endif
}

#ifdef DENSE_AMX
typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles: 0-3 accumulators (weight half h, activation block b: tile 2h + b), 4-5 the two
 * weight halves (A), 6-7 the two activation blocks (B). */
static void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Index vectors of the 16 x 16 transpose below, built once when the library loads: at
 * stage s (block size b = 8 >> s) rows i and i + b swap their off-diagonal b x b blocks,
 * lo taking row i's kept elements and row i + b's moved ones, hi the other way. */
static int32_t amx_swap_idx[4][2][16];

__attribute__((constructor)) static void amx_build_swaps(void) {
    for (int s = 0; s < 4; s++) {
        const int b = 8 >> s;
        for (int j = 0; j < 16; j++) {
            amx_swap_idx[s][0][j] = (j & b) ? 16 + j - b : j;
            amx_swap_idx[s][1][j] = (j & b) ? 16 + j : j + b;
        }
    }
}

/* v[16] (16 x 16 float32, v[r] lane i) transposed in registers: v[i] lane r. Permutes, not
 * gathers (a gather of 16 is tens of cycles where the microcode mitigates GDS). */
static inline __attribute__((always_inline)) void amx_transpose16(__m512 v[16]) {
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
        const int b = 8 >> s;
        const __m512i lo = _mm512_loadu_si512(amx_swap_idx[s][0]);
        const __m512i hi = _mm512_loadu_si512(amx_swap_idx[s][1]);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            if (i & b) continue;
            const __m512 a = v[i], c = v[i + b];
            v[i] = _mm512_permutex2var_ps(a, lo, c);
            v[i + b] = _mm512_permutex2var_ps(a, hi, c);
        }
    }
}

/* Stores an accumulator tile's 16 x 16 block (weight rows n0.., activation rows m0..)
 * transposed into y, rows past m left out, rounded to bfloat16 (nearest even, NaN kept
 * quiet; as amx_to_bf16) or stored as is. */
static inline void amx_store(const float *c, void *y, int y_bf16, int64_t ldy, int64_t n0,
                             int64_t m0, int64_t m) {
    __m512 v[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) v[r] = _mm512_load_ps(c + 16 * r);
    amx_transpose16(v);
    for (int j = 0; j < 16 && m0 + j < m; j++) {
        const int64_t row = (m0 + j) * ldy + n0;
        if (y_bf16) {
            const __m512i u = _mm512_castps_si512(v[j]);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            __m512i r = _mm512_srli_epi32(
                _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
            const __mmask16 nan =
                _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                        _mm512_set1_epi32(0x7F800000));
            r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + row), _mm512_cvtepi32_epi16(r));
        } else {
            _mm512_storeu_ps((float *)y + row, v[j]);
        }
    }
}

/* Weight rows n0 .. n0 + 16 * halves against every activation block pair. */
static void amx_rows(const uint16_t *w, int64_t k, int halves, const uint16_t *xv,
                     int64_t blocks, int64_t m, void *y, int y_bf16, int64_t ldy, int64_t n0,
                     int64_t next_rows) {
    const int64_t kb_count = k / 32, stride = k * 2;
    const uint16_t *w0 = w + n0 * k, *w1 = w0 + 16 * k;
    /* The next group's weight rows, fetched into L2 while this one computes: as 32 short
     * strided streams they would get little from the hardware prefetchers. Each pass over
     * the activation block pairs fetches its share of the rows (every passes-th), so that
     * the memory keeps busy through the passes that read the weight from cache: with 64
     * rows, SmolLM2's products (2 threads, Sapphire Rapids) took 139 -> 111 us and 116 ->
     * 104 us; fetching into L1, or only during the first pass, left the memory idle
     * while the later passes computed. */
    const uint16_t *next = w + (n0 + 32) * k;
    const int64_t passes = blocks / 2;
    float c[4][256] __attribute__((aligned(64)));
    for (int64_t b = 0; b < blocks; b += 2) {
        const uint16_t *x0 = xv + b * kb_count * AMX_TILE_ELEMS;
        const uint16_t *x1 = x0 + kb_count * AMX_TILE_ELEMS;
        _tile_zero(0);
        _tile_zero(1);
        if (halves == 2) {
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < kb_count; kb++) {
                for (int64_t r = b / 2; r < next_rows; r += passes)
                    _mm_prefetch((const char *)(next + r * k + kb * 32), _MM_HINT_T1);
                _tile_loadd(4, w0 + kb * 32, stride);
                _tile_loadd(5, w1 + kb * 32, stride);
                _tile_loadd(6, x0 + kb * AMX_TILE_ELEMS, 64);
                _tile_loadd(7, x1 + kb * AMX_TILE_ELEMS, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
        } else {
            for (int64_t kb = 0; kb < kb_count; kb++) {
                _tile_loadd(4, w0 + kb * 32, stride);
                _tile_loadd(6, x0 + kb * AMX_TILE_ELEMS, 64);
                _tile_loadd(7, x1 + kb * AMX_TILE_ELEMS, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        for (int t = 0; t < 2 * halves; t++)
            amx_store(c[t], y, y_bf16, ldy, n0 + (t >> 1) * 16, (b + (t & 1)) * 16, m);
    }
}
#endif

/* y (m x n, row stride ldy; bfloat16 if y_bf16 else float32) = x (m x k bfloat16, row
 * stride x_stride) . W^T (W n x k bfloat16, contiguous). Returns 0, -1 where it does not
 * apply (no AMX, k % 32 or n % 16 not 0), -2 when out of memory. */
int pagedllm_dense_matmul_amx(const uint16_t *w, int64_t n, int64_t k, const uint16_t *x,
                              int64_t m, int64_t x_stride, void *y, int y_bf16, int64_t ldy,
                              int nthreads) {
#ifdef DENSE_AMX
    if (k % 32 || n % 16 || m <= 0 || !pagedllm_amx_available()) return -1;
    const int64_t kb_count = k / 32;
    const int64_t blocks = ((m + 31) / 32) * 2; /* 16-row activation blocks, paired */
    uint16_t *xv = aligned_alloc(64, (size_t)(blocks * kb_count * AMX_TILE_ELEMS * 2));
    if (xv == NULL) return -2;
    /* The B layout: per 16-row block and 32-element step, 16 pairs x 16 rows x 2. */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (blocks * k >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t kb = 0; kb < kb_count; kb++) {
            uint16_t *tile = xv + (b * kb_count + kb) * AMX_TILE_ELEMS;
            for (int r = 0; r < 16; r++) {
                const int64_t row = b * 16 + r;
                uint16_t *dst = tile + 2 * r;
                if (row < m) {
                    const uint16_t *src = x + row * x_stride + kb * 32;
                    for (int p = 0; p < 16; p++) memcpy(dst + p * 32, src + 2 * p, 4);
                } else {
                    for (int p = 0; p < 16; p++) memset(dst + p * 32, 0, 4);
                }
            }
        }
    }
    const int64_t groups = (n + 31) / 32;
    int threads = nthreads < 1 ? 1 : nthreads;
    if (threads > groups) threads = (int)groups;
#pragma omp parallel num_threads(threads)
    {
        amx_configure();
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int halves = (g * 32 + 32 <= n) ? 2 : 1;
            const int64_t next = n - (g * 32 + 32);
            amx_rows(w, k, halves, xv, blocks, m, y, y_bf16, ldy, g * 32,
                     next < 0 ? 0 : (next < 32 ? next : 32));
        }
        _tile_release();
    }
    free(xv);
    return 0;
#else
    (void)w, (void)n, (void)k, (void)x, (void)m, (void)x_stride, (void)y, (void)y_bf16;
    (void)ldy, (void)nthreads;
    return -1;
#endif
}
#endif /* PAGEDLLM_DENSE_AMX_C */
