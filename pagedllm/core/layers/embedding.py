"""A vocabulary embedding whose table a quantization method may keep packed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedllm.core.interfaces import QuantizationConfig


class VocabEmbedding(nn.Module):
    """Token embedding table ``weight`` ``[vocab, dim]``; :meth:`as_linear` is the product
    with it, which a tied vocabulary head uses. With a quantization config, the method
    its ``get_embedding_method`` returns stores the table and computes both."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.method = (
            quant_config.get_embedding_method(self, prefix) if quant_config is not None else None
        )
        if self.method is None:
            self.weight = nn.Parameter(
                torch.empty(num_embeddings, embedding_dim), requires_grad=False
            )
        else:
            self.method.create_weights(
                self, embedding_dim, num_embeddings, torch.get_default_dtype()
            )

    # With --enable-lora: this table's adapter slots and their manager (pagedllm.lora).
    lora: Any = None
    lora_manager: Any = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.method is None:
            out = F.embedding(ids, self.weight)
        else:
            out = self.method.embedding(self, ids)
        if self.lora is not None and self.lora_manager.batch is not None:
            out = self.lora.add_embedding(out, ids, self.lora_manager.batch)
        return out

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T``: the logits of a head tied to this embedding."""
        if self.method is None:
            return F.linear(x, self.weight)
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
