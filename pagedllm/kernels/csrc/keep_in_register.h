/* KEEP_IN_REGISTER(v): a vector loaded once and kept in a register for the multiply-adds
 * that use it. A register tile that takes all sixteen AVX2 registers (the dense tiles of
 * dense_cpu.c, the attention's score tile in cpu_ops.c) leaves GCC folding its loads into
 * the multiply-adds instead, each vector read from the cache again at every use: 16 loads
 * for 12 multiply-adds in the dense tile, more than the two load ports keep up with (Zen
 * 3, SmolLM2's products at 64 rows: 54 -> 67 GFLOPS on one core). The empty asm
 * "changes" the value, so the compiler must keep it in a register; the arithmetic is the
 * same. */
#ifndef PAGEDLLM_KEEP_IN_REGISTER_H
#define PAGEDLLM_KEEP_IN_REGISTER_H
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#endif
