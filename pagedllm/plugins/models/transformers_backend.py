"""``--model-impl transformers``: any transformers causal LM on pagedllm's paged KV cache.

transformers' models compute attention through a function looked up by name
(``config._attn_implementation`` in its ``AttentionInterface``). This backend registers
pagedllm's under the name ``pagedllm`` and builds the transformers model with it: every
other module (embeddings, norms, rotary embeddings, MLPs, the head) is transformers' own,
and attention is an :class:`~pagedllm.core.attention.Attention` per layer, which reads and
writes the paged cache through the device's attention backend, as the native models'
layers do. A step's tokens (every request's, flattened) go through the model as one
sequence of ``[1, tokens]`` with their own positions; attention keeps the requests apart
through the step's metadata, so prefix caching, chunked prefill and preemption work
as for the native models. transformers builds no mask and no cache for it.

It takes models whose attention goes through that interface (most of transformers'
decoder-only models); attention logit soft-capping (Gemma 2) is the attention layer's.
Attention sinks and quantization methods are refused by name. The vocabulary head's
output is scaled as the model's own forward scales it where its config says so
(``final_logit_softcapping``, ``logit_scale``, ``logits_scaling``).
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.core.attention import Attention
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import ModelArchitecture
from pagedllm.plugins.models.common import layer_sliding_windows

IMPLEMENTATION = "pagedllm"
# The step being computed: its attention metadata and the model's attention layers.
_STEP: contextvars.ContextVar[tuple[Any, nn.ModuleList]] = contextvars.ContextVar("step")


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over pagedllm's paged attention:
    ``query`` ``[1, heads, tokens, d]``, ``key``/``value`` ``[1, kv_heads, tokens, d]``;
    returns ``[1, tokens, heads, d]``."""
    for name in ("s_aux", "sinks"):  # (models with sinks are refused at load; a guard)
        if kwargs.get(name) is not None:
            raise ValueError(f"the transformers backend has no attention {name}")
    metadata, layers = _STEP.get()
    layer = layers[module.layer_idx]
    if scaling is not None:
        layer.scale = scaling
    layer.logits_soft_cap = kwargs.get("softcap")
    _, heads, tokens, head_dim = query.shape
    out = layer(
        query[0].transpose(0, 1).reshape(tokens, heads * head_dim),
        key[0].transpose(0, 1).reshape(tokens, -1),
        value[0].transpose(0, 1).reshape(tokens, -1),
        metadata,
    )
    return out.view(1, tokens, heads, head_dim), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask transformers would build: none (the step's metadata holds the causal
    structure of every request)."""
    return None


def register_attention() -> None:
    """Make ``attn_implementation="pagedllm"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(IMPLEMENTATION, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, _no_mask)


class TransformersForCausalLM(nn.Module, ModelArchitecture):
    """A transformers ``AutoModelForCausalLM`` built from the config, with pagedllm's
    attention. Its parameters keep transformers' names (under ``hf.``), which are the
    checkpoint's."""

    def __init__(
        self,
        config: Any,
        quant_config: Any = None,
        *,
        max_positions: int | None = None,
        disable_sliding_window: bool = False,
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise ConfigError(
                f"--model-impl transformers runs unquantized weights; --quantization "
                f"{quant_config.name} needs a native implementation"
            )
        import transformers
        from transformers.initialization import no_init_weights

        register_attention()
        # The config's own class (what transformers' from_pretrained builds), else the
        # causal LM of its config type.
        named = [getattr(transformers, a, None) for a in config.architectures or []]
        model_class = next((c for c in named if isinstance(c, type)), None)
        if model_class is None:
            mapping = transformers.AutoModelForCausalLM._model_mapping
            model_class = mapping[type(config)]
        unsupported = ConfigError(
            f"{config.architectures or config.model_type} does not compute attention through "
            "transformers' attention interface, which --model-impl transformers needs"
        )
        try:
            with no_init_weights():
                self.hf = model_class._from_config(
                    config, attn_implementation=IMPLEMENTATION, dtype=torch.get_default_dtype()
                )
        except (KeyError, ValueError) as exc:  # (a model with its own attention classes)
            raise unsupported from exc
        if self.hf.config._attn_implementation != IMPLEMENTATION:
            raise unsupported
        if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in self.hf.modules()):
            raise ConfigError(
                "--model-impl transformers: attention sinks (gpt-oss and the like) are not "
                "supported"
            )
        self.hf.tie_weights()
        self.config = config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        windows = layer_sliding_windows(config, disable_sliding_window)
        # (The soft-cap is what the model passes at each call; set here too, so that the
        # engine refuses an attention backend that cannot compute it before the start.)
        cap = getattr(config, "attn_logit_softcapping", None) or None
        self.attn = nn.ModuleList(
            Attention(heads, head_dim, head_dim**-0.5, kv_heads, i, windows[i], cap)
            for i in range(config.num_hidden_layers)
        )
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        ignored = getattr(self.hf, "_keys_to_ignore_on_load_unexpected", None) or []
        self._ignored = [re.compile(pattern) for pattern in ignored]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        token = _STEP.set((attn_metadata, self.attn))
        try:
            out = self.hf.base_model(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            )
        finally:
            _STEP.reset(token)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(hidden_states).float()
        config = self.config
        if getattr(config, "logit_scale", None) is not None:
            logits = logits * config.logit_scale
        if getattr(config, "logits_scaling", None) is not None:
            logits = logits / config.logits_scaling
        cap = getattr(config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _parameter(self, name: str) -> str | None:
        if name == "lm_head.weight" and self.tied:
            return None  # (the embedding is the head)
        if any(pattern.search(name) for pattern in self._ignored):
            return None
        return f"hf.{name}"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from pagedllm.plugins.models.common import copy_weights

        return copy_weights(self, weights, rename=self._parameter)
