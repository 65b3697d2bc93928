"""Attention over the paged KV cache: the layer models call, per-step metadata, and the
reference torch backend."""

from pagedllm.core.attention.layer import Attention
from pagedllm.core.attention.metadata import AttentionMetadata, build_attention_metadata

__all__ = ["Attention", "AttentionMetadata", "build_attention_metadata"]
