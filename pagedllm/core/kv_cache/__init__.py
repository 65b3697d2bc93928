"""Paged KV-cache bookkeeping: block pool, prefix-cache hashing and the manager.

Pure Python: importing this package never imports torch.
"""

from pagedllm.core.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagedllm.core.kv_cache.hashing import (
    HASH_ALGOS,
    ROOT_PARENT_HASH_VALUE,
    BlockHash,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    update_request_block_hashes,
)
from pagedllm.core.kv_cache.manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "HASH_ALGOS",
    "ROOT_PARENT_HASH_VALUE",
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "get_hash_fn",
    "hash_block_tokens",
    "hash_request_tokens",
    "update_request_block_hashes",
]
