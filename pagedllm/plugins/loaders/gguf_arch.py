"""GGUF architectures pagedllm maps onto its models: the Hugging Face config each one's
metadata describes, and its tensor names.

The names and hyper-parameters follow llama.cpp's ``convert_hf_to_gguf.py`` (and the
``gguf`` package's tensor-name map), read backwards.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from pagedllm.core.errors import ConfigError
from pagedllm.plugins.loaders.gguf_file import GGUFFile

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_LLAMA_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GEMMA3_LAYER = {
    **_LLAMA_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


class _Metadata:
    """``<arch>.<key>`` look-ups with clear errors for what a config needs."""

    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf = gguf
        self.md = gguf.metadata
        self.arch = gguf.architecture

    def get(self, key: str, default: Any = ConfigError) -> Any:
        value = self.md.get(f"{self.arch}.{key}")
        if value is None:
            if default is ConfigError:
                raise ConfigError(f"{self.gguf.path.name}: GGUF metadata has no {self.arch}.{key}")
            return default
        return value

    def common(self) -> dict[str, Any]:
        """The fields every decoder config shares."""
        tokens = self.md.get("tokenizer.ggml.tokens")
        heads = int(self.get("attention.head_count"))
        kwargs: dict[str, Any] = {
            "vocab_size": int(len(tokens) if tokens is not None else self.get("vocab_size")),
            "hidden_size": int(self.get("embedding_length")),
            "intermediate_size": int(self.get("feed_forward_length")),
            "num_hidden_layers": int(self.get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.get("attention.head_count_kv", heads)),
            "max_position_embeddings": int(self.get("context_length")),
            "rms_norm_eps": float(self.get("attention.layer_norm_rms_epsilon")),
            "tie_word_embeddings": "output.weight" not in self.gguf.tensors,
        }
        for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
            value = self.md.get(f"tokenizer.ggml.{key}")
            if value is not None:
                kwargs[key.replace("padding", "pad")] = int(value)
        return kwargs

    def head_dim(self, hidden: int, heads: int) -> int:
        return int(self.get("attention.key_length", hidden // heads))

    def rope_theta(self, default: float = 10000.0) -> float:
        return float(self.get("rope.freq_base", default))

    def rope_scaling(self) -> dict[str, Any] | None:
        kind = self.get("rope.scaling.type", None)
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self.get("rope.scaling.factor"))}
        if kind == "yarn":
            return {
                "rope_type": "yarn",
                "factor": float(self.get("rope.scaling.factor")),
                "original_max_position_embeddings": int(
                    self.get("rope.scaling.original_context_length")
                ),
            }
        raise ConfigError(f"{self.gguf.path.name}: GGUF RoPE scaling {kind!r} is not supported")


def _with_rope(params: dict[str, Any] | None, theta: float) -> dict[str, Any]:
    return {"rope_type": "default", **(params or {}), "rope_theta": theta}


# LlamaConfig's fields and defaults (transformers 5), so that the default model's config
# needs no transformers import (about 0.6 s and 25 MB at start-up; LlamaConfig itself
# pulls in activations, hub kernels and torch._dynamo, 2 s more).
# tests/plugins/loaders/test_gguf_model.py checks the result against LlamaConfig itself.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pretraining_tp": 1,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
}


class PlainConfig:
    """A model config as plain attributes (what pagedllm's models read of a Hugging
    Face config), for architectures whose config needs no transformers class."""

    def __init__(self, model_type: str, **fields: Any) -> None:
        self.model_type = model_type
        self.__dict__.update(fields)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def get_text_config(self, *args: Any, **kwargs: Any) -> PlainConfig:
        return self

    def __repr__(self) -> str:
        return f"PlainConfig({self.to_dict()!r})"


def _llama_config(gguf: GGUFFile) -> Any:
    md = _Metadata(gguf)
    kwargs = {**_LLAMA_DEFAULTS, **md.common()}
    return PlainConfig(
        "llama",
        head_dim=md.head_dim(kwargs["hidden_size"], kwargs["num_attention_heads"]),
        rope_parameters=_with_rope(md.rope_scaling(), md.rope_theta()),
        architectures=["LlamaForCausalLM"],
        **kwargs,
    )


def _qwen2_config(gguf: GGUFFile) -> Any:
    from transformers import Qwen2Config

    md = _Metadata(gguf)
    return Qwen2Config(
        rope_parameters=_with_rope(md.rope_scaling(), md.rope_theta()),
        architectures=["Qwen2ForCausalLM"],
        **md.common(),
    )


def _qwen3_config(gguf: GGUFFile) -> Any:
    from transformers import Qwen3Config

    md = _Metadata(gguf)
    kwargs = md.common()
    return Qwen3Config(
        head_dim=md.head_dim(kwargs["hidden_size"], kwargs["num_attention_heads"]),
        rope_parameters=_with_rope(md.rope_scaling(), md.rope_theta()),
        architectures=["Qwen3ForCausalLM"],
        **kwargs,
    )


# llama.cpp's fixed Gemma 3 settings: every 6th layer global, local RoPE base 10000.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _gemma3_config(gguf: GGUFFile) -> Any:
    from transformers import Gemma3TextConfig

    md = _Metadata(gguf)
    kwargs = md.common()
    head_dim = md.head_dim(kwargs["hidden_size"], kwargs["num_attention_heads"])
    layers = kwargs["num_hidden_layers"]
    layer_types = [
        "full_attention" if (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
        for i in range(layers)
    ]
    return Gemma3TextConfig(
        head_dim=head_dim,
        # llama.cpp scales queries by head_dim**-0.5 (all sizes but 27B, which is not
        # told apart by its metadata: its hidden/heads ratio is used there).
        query_pre_attn_scalar=(
            kwargs["hidden_size"] // kwargs["num_attention_heads"]
            if kwargs["hidden_size"] == 5376
            else head_dim
        ),
        sliding_window=int(md.get("attention.sliding_window")),
        layer_types=layer_types,
        rope_parameters={
            "full_attention": _with_rope(md.rope_scaling(), md.rope_theta(1_000_000.0)),
            "sliding_attention": _with_rope(None, GEMMA3_LOCAL_ROPE_THETA),
        },
        hidden_activation="gelu_pytorch_tanh",
        architectures=["Gemma3ForCausalLM"],
        **kwargs,
    )


def _phi3_config(gguf: GGUFFile) -> Any:
    from transformers import Phi3Config

    md = _Metadata(gguf)
    if "rope_factors_long.weight" in gguf.tensors:
        raise ConfigError(
            f"{gguf.path.name}: phi3 with LongRoPE factors (the long-context variants) is "
            f"not supported; the 4k-context Phi-3 models are"
        )
    kwargs = md.common()
    heads, hidden = kwargs["num_attention_heads"], kwargs["hidden_size"]
    head_dim = hidden // heads
    rope_dim = int(md.get("rope.dimension_count", head_dim))
    window = md.get("attention.sliding_window", None)
    return Phi3Config(
        rope_parameters=_with_rope(md.rope_scaling(), md.rope_theta()),
        partial_rotary_factor=rope_dim / head_dim,
        sliding_window=int(window) if window else None,
        original_max_position_embeddings=int(
            md.get("rope.scaling.original_context_length", kwargs["max_position_embeddings"])
        ),
        architectures=["Phi3ForCausalLM"],
        **kwargs,
    )


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF architecture becomes a pagedllm model."""

    config: Callable[[GGUFFile], Any]
    layer_names: dict[str, str]
    # llama.cpp permutes the rows of Q and K for its rotary layout (llama only).
    permute_qk: bool = False
    # Gemma stores norm weights as 1 + w; the HF model adds the 1 back itself.
    norm_minus_one: bool = False

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF parameter name of a GGUF tensor, or ``None`` if unknown."""
        if gguf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_name]
        m = _LAYER_RE.fullmatch(gguf_name)
        if m and m.group(2) in self.layer_names:
            return f"model.layers.{m.group(1)}.{self.layer_names[m.group(2)]}.{m.group(3)}"
        return None


ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture(_llama_config, _LLAMA_LAYER, permute_qk=True),
    "qwen2": GGUFArchitecture(_qwen2_config, _LLAMA_LAYER),
    "qwen3": GGUFArchitecture(_qwen3_config, _LLAMA_LAYER),
    "gemma3": GGUFArchitecture(_gemma3_config, _GEMMA3_LAYER, norm_minus_one=True),
    "phi3": GGUFArchitecture(_phi3_config, _PHI3_LAYER),
}
