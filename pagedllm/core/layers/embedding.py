"""A vocabulary embedding whose table a quantization method may keep packed, and which
splits its rows over tensor-parallel ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.core.layers.linear import mark_shard
from pagedllm.distributed.parallel_state import all_gather, all_reduce, tp_rank, tp_size
from pagedllm.kernels.batch_invariant import linear

if TYPE_CHECKING:
    from pagedllm.core.interfaces import QuantizationConfig


def padded_vocab_size(vocab_size: int, size: int | None = None) -> int:
    """``vocab_size`` rounded up to a multiple of the tensor-parallel size (``size``, by
    default this process's): the rows a vocabulary split over the ranks covers."""
    size = tp_size() if size is None else size
    return -(-vocab_size // size) * size


class VocabEmbedding(nn.Module):
    """Token embedding table ``weight`` ``[vocab, dim]``; :meth:`as_linear` is the product
    with it, which a tied vocabulary head uses. With a quantization config, the method
    its ``get_embedding_method`` returns stores the table and computes both.

    With more than one tensor-parallel rank (read when built) the table is split by rows:
    rank ``r`` holds rows ``[r * n, (r + 1) * n)``, ``n = ceil(vocab / ranks)``
    (``weight`` is ``[n, dim]``, its rows past the vocabulary zero); :meth:`forward` is
    the full lookup (each rank's rows for the ids it holds, summed over the ranks) and
    :meth:`as_linear` the full ``[..., vocab]`` logits (gathered). ``num_embeddings``
    stays the vocabulary size. A quantized table splits where its method's layout allows
    (``LinearMethod.shard_narrow``), else it is refused (``ConfigError``).
    """

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
        # This rank's first vocabulary row and number of rows (all of them on one rank).
        self.vocab_start, self.num_local = 0, num_embeddings
        self.vocab_parallel = tp_size() > 1
        narrow = None
        if self.vocab_parallel:
            self.num_local = padded_vocab_size(num_embeddings) // tp_size()
            self.vocab_start = tp_rank() * self.num_local
            narrow = (0, self.vocab_start, self.num_local)
            if self.method is not None:
                # (where the rows lie in the method's stored layout)
                narrow = self.method.shard_narrow(*narrow)
                if narrow is None:
                    raise ConfigError(
                        f"--quantization {quant_config.name}: embedding {prefix!r} cannot be "
                        f"split over {tp_size()} tensor-parallel ranks in its stored layout"
                    )
        if self.method is None:
            self.weight = nn.Parameter(
                torch.empty(self.num_local, embedding_dim), requires_grad=False
            )
        else:
            self.method.create_weights(
                self, embedding_dim, self.num_local, torch.get_default_dtype()
            )
        if narrow is not None:
            mark_shard(self.weight, *narrow, pad=True)

    # With --enable-lora: this table's adapter slots and their manager (pagedllm.lora).
    lora: Any = None
    lora_manager: Any = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_parallel:
            out = self._parallel_embedding(ids)
        elif self.method is None:
            out = F.embedding(ids, self.weight)
        else:
            out = self.method.embedding(self, ids)
        if self.lora is not None and self.lora_manager.batch is not None:
            out = self.lora.add_embedding(out, ids, self.lora_manager.batch)
        return out

    def _parallel_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids``: this rank's for the ids it holds, zeros for the others,
        summed over the ranks."""
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        local = local.masked_fill(outside, 0)
        if self.method is None:
            out = F.embedding(local, self.weight)
        else:
            out = self.method.embedding(self, local)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(out)

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T``: the logits of a head tied to this embedding (with several
        ranks, each rank's logits gathered and the padding rows' dropped)."""
        if self.vocab_parallel:
            local = linear(x, self.weight) if self.method is None else self.method.apply(self, x)
            logits = all_gather(local, dim=-1)
            if logits.shape[-1] != self.num_embeddings:
                logits = logits[..., : self.num_embeddings].contiguous()
            return logits
        if self.method is None:
            return linear(x, self.weight)
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        text = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.vocab_parallel:
            text += f", rows [{self.vocab_start}, {self.vocab_start + self.num_local})"
        return text
