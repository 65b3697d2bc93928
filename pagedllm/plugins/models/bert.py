"""BERT encoders for pooling tasks: ``BertModel`` (embeddings, e.g. sentence-transformers'
all-MiniLM-L6-v2) and ``BertForSequenceClassification`` (classifiers and cross-encoders).
Module names mirror transformers' (``bert.`` prefixed in the classifier's checkpoints).

An encoder attends both ways within a prompt and keeps no KV cache: each prompt of a step
(the engine runs pooling prompts whole) is one sequence of the step's flat tokens, as
the runner tells it. Token types come from the request (``token_type_ids`` of a
sentence pair), zeros otherwise. Absolute positions are the prompt's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import ModelArchitecture
from pagedllm.core.layers.linear import Linear
from pagedllm.core.layers.weights import copy_weights
from pagedllm.core.pooling import PoolerConfig
from pagedllm.distributed.parallel_state import tp_size
from pagedllm.plugins.models.common import activation


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor
    ) -> torch.Tensor:
        embedded = self.word_embeddings(input_ids) + self.token_type_embeddings(token_types)
        return self.LayerNorm(embedded + self.position_embeddings(positions + self.offset))

    # RoBERTa numbers positions from its padding id + 1 (0 for BERT).
    offset = 0


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, quant: Any, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        # This rank's heads (all of them on one rank).
        self.heads = config.num_attention_heads // tp_size()

        def column(name: str) -> Linear:
            return Linear(hidden, hidden, True, quant, f"{prefix}.{name}", parallel="column")

        self.query, self.key, self.value = column("query"), column("key"), column("value")

    def forward(self, hidden: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        tokens = hidden.shape[0]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(tokens, self.heads, self.head_dim).transpose(0, 1)

        q, k, v = heads(self.query(hidden)), heads(self.key(hidden)), heads(self.value(hidden))
        out = torch.empty_like(q)
        for start, end in ranges:  # both ways, within each prompt
            out[:, start:end] = F.scaled_dot_product_attention(
                q[:, start:end], k[:, start:end], v[:, start:end]
            )
        return out.transpose(0, 1).reshape(tokens, -1)


class BertOutput(nn.Module):
    """A dense layer, then LayerNorm over it plus the residual (both BERT sublayers end so)."""

    def __init__(self, config: Any, in_size: int, quant: Any, prefix: str) -> None:
        super().__init__()
        self.dense = Linear(
            in_size, config.hidden_size, True, quant, f"{prefix}.dense", parallel="row"
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, quant: Any, prefix: str) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, quant, f"{prefix}.self")
        self.output = BertOutput(config, config.hidden_size, quant, f"{prefix}.output")

    def forward(self, hidden: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        return self.output(self.self(hidden, ranges), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, quant: Any, prefix: str) -> None:
        super().__init__()
        self.dense = Linear(
            config.hidden_size,
            config.intermediate_size,
            True,
            quant,
            f"{prefix}.dense",
            parallel="column",
        )
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any, quant: Any, prefix: str) -> None:
        super().__init__()
        self.attention = BertAttention(config, quant, f"{prefix}.attention")
        self.intermediate = BertIntermediate(config, quant, f"{prefix}.intermediate")
        self.output = BertOutput(config, config.intermediate_size, quant, f"{prefix}.output")

    def forward(self, hidden: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        attended = self.attention(hidden, ranges)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, quant: Any, prefix: str) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(config, quant, f"{prefix}.layer.{i}") for i in range(config.num_hidden_layers)
        )


class BertPooler(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first))


class _BertBase(nn.Module, ModelArchitecture):
    """With tensor parallelism each rank holds its share of the attention heads and of
    the intermediate rows (Megatron-style: an all-reduce after each sublayer's output
    dense); the embeddings, the pooler and the task heads are whole on every rank."""

    supports_generation = False
    # The encoder's name prefix in checkpoints of the task models (and of pretraining
    # checkpoints loaded as the bare encoder).
    prefix = "bert"
    # (the runner sets token_type_ids and step_ranges, each prompt's tokens, per step)
    is_encoder = True

    def __init__(
        self,
        config: Any,
        quant_config: Any = None,
        *,
        max_positions: int | None = None,
        disable_sliding_window: bool = False,
    ) -> None:
        super().__init__()
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ConfigError(f"BERT with {kind!r} position embeddings is not supported")
        if getattr(config, "is_decoder", False):
            raise ConfigError("BERT configured as a decoder is not supported")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        if self.positions_after_padding:
            self.embeddings.offset = config.pad_token_id + 1
        self.encoder = BertEncoder(config, quant_config, "encoder")
        self.pooler = BertPooler(config) if self.has_pooler else None
        # The step's token types and each prompt's (start, end) among its tokens, set by
        # the runner before each forward.
        self.token_type_ids: torch.Tensor | None = None
        self.step_ranges: list[tuple[int, int]] = []

    has_pooler = False
    positions_after_padding = False

    @classmethod
    def check_tensor_parallel(cls, config: Any, size: int, *, experts: bool = False) -> None:
        """As ``ModelArchitecture``'s, and the heads and the intermediate size divide."""
        super().check_tensor_parallel(config, size)
        heads, inter = config.num_attention_heads, config.intermediate_size
        if heads % size or inter % size:
            raise ConfigError(
                f"{cls.__name__} cannot be split over --tensor-parallel-size {size}: its "
                f"{heads} attention heads and intermediate size {inter} must divide by it"
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any):
        types = self.token_type_ids
        if types is None or types.shape != input_ids.shape:
            types = torch.zeros_like(input_ids)
        hidden = self.embeddings(input_ids, positions, types)
        for layer in self.encoder.layer:
            hidden = layer(hidden, self.step_ranges)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} is an encoder; it does not generate")

    def _rename(self, name: str) -> str | None:
        if name.endswith("embeddings.position_ids") or name.startswith(("cls.", "lm_head.")):
            return None  # (a buffer older checkpoints saved; pretraining heads)
        if name.startswith(f"{self.prefix}."):
            return name[len(self.prefix) + 1 :]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(self, weights, rename=self._rename)


class BertModel(_BertBase):
    """Embeddings: the pooled final hidden states (CLS and normalized by default; a
    sentence-transformers model's own pooling where its files give one)."""

    supports_tensor_parallel = True

    pooling_tasks = ("embed",)
    # (its pooler layer is in the checkpoint; embeddings do not use it)
    has_pooler = True

    def default_pooler_config(self, task: str) -> PoolerConfig:
        return PoolerConfig(pooling_type="CLS", normalize=True, softmax=False)


class BertForSequenceClassification(_BertBase):
    """A classifier (``classify``) or cross-encoder (``score``, one label): the CLS
    state through BERT's pooler (dense, tanh) and the ``classifier`` layer."""

    supports_tensor_parallel = True

    pooling_tasks = ("classify", "score")
    has_pooler = True

    def __init__(self, config: Any, quant_config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, quant_config, **kwargs)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def default_pooler_config(self, task: str) -> PoolerConfig:
        return PoolerConfig(pooling_type="CLS", normalize=False, softmax=True)

    def pooling_head(self, rows: torch.Tensor, task: str) -> torch.Tensor:
        return self.classifier(self.pooler(rows))


class RobertaModel(BertModel):
    """RoBERTa / XLM-RoBERTa encoders (embedding models such as e5, bge-m3): BERT's
    layers with positions counted from the padding id + 1."""

    supports_tensor_parallel = True

    prefix = "roberta"
    positions_after_padding = True


class RobertaClassificationHead(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class RobertaForSequenceClassification(_BertBase):
    """RoBERTa / XLM-RoBERTa classifiers and cross-encoders (e.g. bge-reranker): the
    first token's state through the classification head (dense, tanh, out_proj)."""

    supports_tensor_parallel = True

    pooling_tasks = ("classify", "score")
    prefix = "roberta"
    positions_after_padding = True

    def __init__(self, config: Any, quant_config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, quant_config, **kwargs)
        self.classifier = RobertaClassificationHead(config)

    def default_pooler_config(self, task: str) -> PoolerConfig:
        return PoolerConfig(pooling_type="CLS", normalize=False, softmax=True)

    def pooling_head(self, rows: torch.Tensor, task: str) -> torch.Tensor:
        return self.classifier(rows)
