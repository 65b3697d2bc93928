"""Chain hashes of full KV-cache blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its own token ids and extra keys (the request's
``cache_salt``), so equal hashes mean equal whole prefixes, not just equal blocks. Only
full blocks are hashed: a partial block's content is still changing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.core.request import Request

HashFn = Callable[[Any], int]

HASH_ALGOS = ("builtin", "sha256")

# The parent of every request's first block. Fixed (not random per process) so that
# sha256 hashes are reproducible across processes and runs.
ROOT_PARENT_HASH_VALUE = int.from_bytes(hashlib.sha256(b"pagedllm-kv-root").digest()[:8], "big")


@dataclasses.dataclass(frozen=True, slots=True)
class BlockHash:
    """The prefix-cache key of one full block.

    Equality compares the token ids and extra keys too, so two different blocks whose
    ``hash_value`` collide are still different keys (a collision costs a dict probe, never
    a wrong hit). ``hash_value`` alone is what children chain on.
    """

    hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None = None

    def __hash__(self) -> int:
        # The chain hash already mixes everything; rehashing the token tuple is waste.
        return hash(self.hash_value)


def _builtin_hash(obj: Any) -> int:
    return hash(obj)


def _sha256_hash(obj: Any) -> int:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


def get_hash_fn(algo: str) -> HashFn:
    """Return the hash function named ``algo`` ("builtin" or "sha256").

    "builtin" is Python's ``hash`` of a tuple: fast, 64-bit, and for string salts only
    stable within one process (which is all the prefix cache needs). "sha256" is
    collision-resistant and stable across processes.
    """
    if algo == "builtin":
        return _builtin_hash
    if algo == "sha256":
        return _sha256_hash
    raise ValueError(f"unknown prefix-cache hash algorithm {algo!r}; choose one of {HASH_ALGOS}")


def hash_block_tokens(
    hash_fn: HashFn,
    parent_hash_value: int | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash one full block chained on its parent (``None`` means the root)."""
    if parent_hash_value is None:
        parent_hash_value = ROOT_PARENT_HASH_VALUE
    tokens = tuple(token_ids)
    return BlockHash(hash_fn((parent_hash_value, tokens, extra_keys)), tokens, extra_keys)


def request_extra_keys(
    request: Request, start: int = 0, end: int | None = None
) -> tuple[Any, ...] | None:
    """Extra keys for the block of ``request``'s tokens ``start`` to ``end``: its salt, in
    every block (not only the first) so no block of a salted request can ever equal an
    unsalted one, then the keys of its ``range_keys`` that the block overlaps (so that
    equal placeholder tokens standing for different content never share a block)."""
    salt = request.cache_salt
    keys: tuple[Any, ...] = () if salt is None else (salt,)
    if request.range_keys:
        stop = request.num_tokens if end is None else end
        keys += tuple(
            key for first, last, key in request.range_keys if first < stop and last > start
        )
    return keys or None


def hash_request_tokens(
    hash_fn: HashFn,
    block_size: int,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> list[BlockHash]:
    """Chain hashes of all full blocks of ``token_ids`` (a trailing partial block is not
    hashed)."""
    hashes: list[BlockHash] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block_hash = hash_block_tokens(
            hash_fn, parent, token_ids[start : start + block_size], extra_keys
        )
        hashes.append(block_hash)
        parent = block_hash.hash_value
    return hashes


def update_request_block_hashes(request: Request, block_size: int, hash_fn: HashFn) -> None:
    """Extend ``request.block_hashes`` with the blocks that became full since the last call.

    Work is proportional to the new blocks only. The existing hashes stay valid because a
    request's tokens are only ever appended, never changed.
    """
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) >= num_full:
        return
    extra_keys = request_extra_keys(request)
    ranged = bool(request.range_keys)
    token_ids = request.all_token_ids
    parent = hashes[-1].hash_value if hashes else None
    for index in range(len(hashes), num_full):
        start = index * block_size
        if ranged:
            extra_keys = request_extra_keys(request, start, start + block_size)
        block_hash = hash_block_tokens(
            hash_fn, parent, token_ids[start : start + block_size], extra_keys
        )
        hashes.append(block_hash)
        parent = block_hash.hash_value
