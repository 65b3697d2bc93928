/* The batched LoRA product for few tokens per adapter (decode steps): each token t with
 * an adapter slot s = slots[t] >= 0 gets y[t] += scale[s] * (B[s] (A[s] x[t])), A[s]
 * [r, in] and B[s] [out, r] float32, x [T, in], y [T, out] float32 (Punica's BGMV). One
 * token's rank-r intermediate stays in registers; tokens are split across threads. Plain C
 * written for the compiler to vectorise (-O3 -march=native). */
#include <stdint.h>

#define LORA_MAX_RANK 256

int pagedllm_lora_bgmv(const float *x, const int64_t *slots, int64_t tokens, int64_t in,
                       int64_t out, int64_t rank, const float *a, const float *b,
                       const float *scale, float *y, int nthreads) {
    if (rank < 1 || rank > LORA_MAX_RANK) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        const float *xt = x + t * in;
        const float *as = a + s * rank * in;
        const float *bs = b + s * out * rank;
        float low[LORA_MAX_RANK];
        for (int64_t r = 0; r < rank; r++) {
            const float *row = as + r * in;
            float acc = 0.0f;
            for (int64_t k = 0; k < in; k++) acc += row[k] * xt[k];
            low[r] = acc * scale[s];
        }
        float *yt = y + t * out;
        for (int64_t o = 0; o < out; o++) {
            const float *row = bs + o * rank;
            float acc = 0.0f;
            for (int64_t r = 0; r < rank; r++) acc += row[r] * low[r];
            yt[o] += acc;
        }
    }
    return 0;
}
