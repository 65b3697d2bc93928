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

With tensor parallelism the model's own plan (its config's ``base_model_tp_plan``, which
transformers' models declare) says which linear layers split by output rows
(``colwise``) and which by input columns (``rowwise``): those become pagedllm's
:class:`~pagedllm.core.layers.linear.Linear` layers split so (one all-reduce after each
row-parallel one), each rank then holding its share of the attention heads (transformers'
attention reshapes by the head size) and of the MLP rows; everything else (embeddings,
norms, the head) is whole on every rank. A model without a plan, or whose plan splits
anything otherwise (packed or MoE experts, gathered outputs), is refused by name.
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
from pagedllm.distributed.parallel_state import tp_size
from pagedllm.plugins.models.common import layer_sliding_windows

IMPLEMENTATION = "pagedllm"
# transformers' tensor-parallel styles of linear layers, as pagedllm's Linear splits them,
# and those that leave a module whole (on every rank; a vocabulary-parallel embedding too).
_SPLIT_STYLES = {"colwise": "column", "rowwise": "row"}
_WHOLE_STYLES = frozenset({"replicate", "replicated_with_grad_allreduce", "embedding_rowwise"})
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


def _tp_plan(config: Any) -> dict[str, str]:
    return dict(getattr(config, "base_model_tp_plan", None) or {})


class TransformersForCausalLM(nn.Module, ModelArchitecture):
    """A transformers ``AutoModelForCausalLM`` built from the config, with pagedllm's
    attention. Its parameters keep transformers' names (under ``hf.``), which are the
    checkpoint's."""

    supports_tensor_parallel = True

    @classmethod
    def check_tensor_parallel(cls, config: Any, size: int, *, experts: bool = False) -> None:
        """Its config's plan splits only linear layers, by rows or columns, and the
        heads, the KV heads and the intermediate size divide by ``size``."""
        super().check_tensor_parallel(config, size)
        if size == 1:
            return
        name = f"--model-impl transformers with --tensor-parallel-size {size}"
        plan = _tp_plan(config)
        if not plan:
            raise ConfigError(
                f"{name}: {config.model_type} declares no tensor-parallel plan "
                "(base_model_tp_plan); use its native implementation or one rank"
            )
        odd = sorted(
            {s for s in plan.values() if s not in _SPLIT_STYLES and s not in _WHOLE_STYLES}
        )
        if odd:
            raise ConfigError(
                f"{name}: its plan splits layers as {odd}, which pagedllm does not (it "
                f"splits linear layers {sorted(_SPLIT_STYLES)})"
            )
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        sizes = {"attention heads": heads, "KV heads": kv_heads}
        sizes["intermediate size"] = getattr(config, "intermediate_size", None) or 0
        problems = [
            f"its {what} {n} do not divide by {size}" for what, n in sizes.items() if n % size
        ]
        if problems:
            raise ConfigError(f"{name}: " + "; ".join(problems))

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
        if tp_size() > 1:
            self._split_by_plan(config)
            heads, kv_heads = heads // tp_size(), kv_heads // tp_size()
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

    def _split_by_plan(self, config: Any) -> None:
        """Replace the linear layers the config's plan splits with pagedllm's, split so
        over the tensor-parallel ranks (their parameters keep the names)."""
        from pagedllm.core.layers.linear import Linear

        base = self.hf.base_model
        prefix = self.hf.base_model_prefix
        rules = [
            (re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$"), style)
            for pattern, style in _tp_plan(config).items()
        ]
        for name, module in list(base.named_modules()):
            style = next((style for rule, style in rules if rule.match(name)), None)
            if style is None or style in _WHOLE_STYLES:
                continue
            if type(module) is not nn.Linear:
                raise ConfigError(
                    f"--model-impl transformers: {name} ({type(module).__name__}) is split "
                    f"{style!r} by the model's plan; pagedllm splits linear layers only"
                )
            parent, _, attr = name.rpartition(".")
            layer = Linear(
                module.in_features,
                module.out_features,
                module.bias is not None,
                None,
                f"{prefix}.{name}" if prefix else name,
                parallel=_SPLIT_STYLES[style],
            )
            setattr(base.get_submodule(parent) if parent else base, attr, layer)

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
