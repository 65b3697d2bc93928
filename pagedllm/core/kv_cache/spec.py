"""The layout of the paged KV cache on a rank: its element type, the KV heads and layers
it holds, one block's bytes."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # The layers whose caches this rank holds (a pipeline stage's); None: every layer.
    layers: range | None = None

    @property
    def num_held_layers(self) -> int:
        return self.num_layers if self.layers is None else len(self.layers)

    def bytes_per_block(self, block_size: int) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_held_layers * block_size * self.num_kv_heads * self.head_dim * element

    def allocate(
        self, num_blocks: int, block_size: int, device: torch.device
    ) -> list[torch.Tensor]:
        """One cache per layer, ``[2, num_blocks, block_size, kv heads, head dim]``; an
        empty tensor for a layer another pipeline stage holds. Not zero-filled: memory is
        committed only as blocks are written, and attention never reads a slot before it
        is written (padding repeats a written slot)."""
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        held = range(self.num_layers) if self.layers is None else self.layers
        return [
            torch.empty(shape if i in held else (0,), dtype=self.dtype, device=device)
            for i in range(self.num_layers)
        ]


_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(cache_config: Any, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for ``--kv-cache-dtype`` (``auto``: the model's)."""
    return _KV_CACHE_DTYPES.get(cache_config.kv_cache_dtype, model_dtype)


def kv_cache_spec(
    hf_config: Any,
    dtype: torch.dtype,
    tp: int = 1,
    layers: range | None = None,
    model: Any = None,
) -> KVCacheSpec:
    """The KV cache of one rank of ``tp`` tensor-parallel ranks: its share of the KV
    heads, or one head where there are fewer KV heads than ranks (each replicated);
    ``layers``: a pipeline stage's (None: all). The model's own shape where it gives one
    (``ModelArchitecture.kv_cache_shape``)."""
    shape = getattr(model, "kv_cache_shape", lambda: None)()
    if shape is not None:
        return KVCacheSpec(*shape, dtype, layers)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    kv_heads = max(1, kv_heads // tp)
    return KVCacheSpec(hf_config.num_hidden_layers, kv_heads, head_dim, dtype, layers)
