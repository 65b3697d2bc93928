"""Attention over the paged KV cache: per-step metadata and the layer models call."""

from pagedllm.core.attention.layer import Attention
from pagedllm.core.attention.metadata import AttentionMetadata, build_attention_metadata

__all__ = ["Attention", "AttentionMetadata", "build_attention_metadata"]
