"""Engine settings and prompts that several test files share."""

# The settings every greedy-parity check runs under (prefix caching on and off, chunked
# prefill with a small budget, a KV cache small enough to preempt).
SETTINGS = {
    "prefix_caching": dict(enable_prefix_caching=True),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "chunked_prefill_small_budget": dict(
        enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4
    ),
    "preemption": dict(num_gpu_blocks_override=14, block_size=8),
}

# Repetitive prompts (prompt lookup finds their n-grams) and one that is not.
SPECULATION_PROMPTS = [
    [1, 5, 9, 23, 42, 77, 30, 5, 9, 23, 42],
    [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4],
    [1, 7, 7, 7, 33, 100, 12, 64, 8, 19, 2],
    [6, 60, 61, 62, 63, 64, 65, 6, 60, 61] * 4,
]
