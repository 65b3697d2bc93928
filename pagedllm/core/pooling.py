"""Pooling tasks (``--task embed|classify|score|reward``): their parameters, the poolers
that turn a prompt's hidden states into one result, and the outputs.

A pooling request runs its prompt once (no token is generated) and returns, instead of a
completion, a tensor made from the model's hidden states of its tokens:

- the **pooler** picks rows: ``CLS`` (the first token), ``LAST``, ``MEAN`` (the average
  over the prompt), ``ALL`` (every token) or ``STEP`` (the tokens equal to
  ``step_tag_id``);
- the model's **head** maps them (a classifier's ``score`` layer; none for embeddings);
- the task's **activation**: ``normalize`` (L2, embeddings), ``softmax`` (classification;
  a sigmoid for a single-label score), and for ``STEP`` the ``returned_token_ids``
  columns.

vLLM's defaults: embeddings are normalized, classification probabilities softmaxed,
reward models return every token's raw scores (``ALL``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from pagedllm.core.errors import ConfigError

POOLING_TASKS = ("embed", "classify", "score", "reward")
POOLING_TYPES = ("CLS", "LAST", "MEAN", "ALL", "STEP")
# vLLM's older spelling of a task.
TASK_ALIASES = {"embedding": "embed"}


@dataclasses.dataclass
class PoolerConfig:
    """How a model pools (``--override-pooler-config``, over the model's defaults)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    softmax: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PoolerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"--override-pooler-config: unknown key(s) {unknown} (known: {sorted(known)})"
            )
        config = cls(**values)
        if config.pooling_type is not None:
            config.pooling_type = str(config.pooling_type).upper()
            if config.pooling_type not in POOLING_TYPES:
                raise ConfigError(
                    f"--override-pooler-config: pooling_type {values['pooling_type']!r} is not "
                    f"one of {list(POOLING_TYPES)}"
                )
        return config

    def merged(self, override: PoolerConfig) -> PoolerConfig:
        """This config with ``override``'s settings where it has them."""
        values = {
            f.name: getattr(override, f.name)
            if getattr(override, f.name) is not None
            else getattr(self, f.name)
            for f in dataclasses.fields(self)
        }
        return PoolerConfig(**values)


@dataclasses.dataclass
class PoolingParams:
    """Per-request settings of a pooling request (vLLM's ``PoolingParams``).

    ``dimensions`` keeps the first that many dimensions of an embedding (models trained
    for it, Matryoshka); ``normalize`` overrides the pooler's normalization of an
    embedding; ``activation`` overrides whether classification scores go through their
    softmax (or sigmoid). ``task`` is set by the entry point that makes the request."""

    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None
    # The segment of each prompt token (a sentence pair for a cross-encoder: 0 for the
    # first, 1 for the second); set by the entry points for models that read them.
    token_type_ids: list[int] | None = None

    def clone(self) -> PoolingParams:
        return dataclasses.replace(self)

    def verify(self, task: str, hf_config: Any) -> None:
        """Refuse settings that do not apply to ``task`` on this model (ValueError).
        ``dimensions`` needs a Matryoshka model: its config says ``is_matryoshka`` (or
        lists ``matryoshka_dimensions``), as vLLM reads it."""
        if self.dimensions is not None:
            if task != "embed":
                raise ValueError("dimensions applies to embeddings only")
            allowed = getattr(hf_config, "matryoshka_dimensions", None)
            if not (getattr(hf_config, "is_matryoshka", False) or allowed):
                raise ValueError(
                    "this model does not support matryoshka representations: it cannot "
                    "return fewer dimensions"
                )
            size = hf_config.hidden_size
            if not 1 <= self.dimensions <= size or (allowed and self.dimensions not in allowed):
                raise ValueError(
                    f"dimensions {self.dimensions} is not one the model supports "
                    f"({allowed or f'1 to {size}'})"
                )
        if self.normalize is not None and task != "embed":
            raise ValueError("normalize applies to embeddings only")
        if self.activation is not None and task not in ("classify", "score"):
            raise ValueError("activation applies to classification and scores only")


def sentence_transformers_pooler(directory: Path) -> PoolerConfig | None:
    """The pooling of a sentence-transformers model directory (``modules.json``: its
    ``Pooling`` module's mode, and whether a ``Normalize`` module follows), or None when
    it is not one. Modules pagedllm does not run (``Dense`` projections, max pooling)
    are refused by name."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unknown:
        raise ConfigError(f"sentence-transformers modules {unknown} are not supported")
    config = PoolerConfig(normalize="Normalize" in kinds)
    for module, kind in zip(modules, kinds, strict=True):
        if kind != "Pooling":
            continue
        settings = json.loads(
            (directory / module.get("path", "") / "config.json").read_text(encoding="utf-8")
        )
        for mode in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens"):
            if settings.get(mode):
                raise ConfigError(f"sentence-transformers pooling {mode} is not supported")
        modes = {
            "pooling_mode_cls_token": "CLS",
            "pooling_mode_mean_tokens": "MEAN",
            "pooling_mode_lasttoken": "LAST",
        }
        chosen = [kind for key, kind in modes.items() if settings.get(key)]
        if len(chosen) > 1:
            raise ConfigError(f"sentence-transformers pooling with several modes {chosen}")
        config.pooling_type = chosen[0] if chosen else None
    return config


# ------------------------------------------------------------------------ outputs


@dataclasses.dataclass
class PoolingOutput:
    data: torch.Tensor


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class PoolingRequestOutput:
    """One pooling request's result (``outputs.data``: the pooled tensor)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0
    metrics: Any = None

    def _as(self, cls: type, outputs: Any) -> Any:
        return cls(
            request_id=self.request_id,
            outputs=outputs,
            prompt_token_ids=self.prompt_token_ids,
            finished=self.finished,
            prompt=self.prompt,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )


class EmbeddingRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = output.outputs.data
        return output._as(cls, EmbeddingOutput(data.reshape(-1).tolist()))


class ClassificationRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return output._as(cls, ClassificationOutput(output.outputs.data.reshape(-1).tolist()))


class ScoringRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_score(cls, output: PoolingRequestOutput, score: float) -> ScoringRequestOutput:
        return output._as(cls, ScoringOutput(float(score)))


# ----------------------------------------------------------------------- poolers


def select_rows(hidden: torch.Tensor, token_ids: list[int], config: PoolerConfig) -> torch.Tensor:
    """The pooler's choice of ``hidden`` (one request's ``[tokens, size]``): a vector
    (CLS, LAST, MEAN) or rows (ALL, STEP)."""
    kind = config.pooling_type
    if kind == "CLS":
        return hidden[0]
    if kind == "LAST":
        return hidden[-1]
    if kind == "MEAN":
        return hidden.float().mean(dim=0).to(hidden.dtype)
    if kind == "ALL":
        return hidden
    if kind == "STEP":
        if config.step_tag_id is None:
            return hidden
        mask = torch.tensor(token_ids, device=hidden.device) == config.step_tag_id
        return hidden[mask]
    raise ValueError(f"unknown pooling type {kind!r}")


def activate(
    scores: torch.Tensor, task: str, config: PoolerConfig, params: PoolingParams
) -> torch.Tensor:
    """The task's activation of the pooled (and head-mapped) ``scores``, in float32."""
    scores = scores.float()
    if config.pooling_type == "STEP" and config.returned_token_ids:
        scores = scores[..., config.returned_token_ids]
    if task == "embed":
        normalize = config.normalize if params.normalize is None else params.normalize
        if params.dimensions is not None:
            scores = scores[..., : params.dimensions]
        if normalize:
            scores = torch.nn.functional.normalize(scores, p=2, dim=-1)
        return scores
    if task in ("classify", "score"):
        active = config.softmax if params.activation is None else params.activation
        if active:
            if scores.shape[-1] == 1:
                return torch.sigmoid(scores)
            return torch.softmax(scores, dim=-1)
        return scores
    if config.softmax:  # reward (and STEP's returned ids): as configured
        return torch.softmax(scores, dim=-1)
    return scores
