"""``--load-format mistral`` and ``--config-format mistral``: checkpoints in Mistral's own
layout, as ``mistral-inference`` reads them: ``consolidated*.safetensors`` with Mistral's
tensor names, and ``params.json`` for the model's settings.

The tensors are renamed to the Hugging Face names of ``MistralForCausalLM`` and the query
and key projections are permuted from Mistral's rotary layout (each head's dimensions
interleaved in pairs) to the one the model computes with (first halves, then second
halves), as transformers' conversion script does. The tokenizer is the directory's
Hugging Face tokenizer files (``tekken.json`` / ``tokenizer.model.v3`` alone need
``mistral_common``, which pagedllm does not read).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.model_files import resolve_model_path
from pagedllm.plugins.loaders.base import check_all_loaded
from pagedllm.plugins.loaders.default import SafetensorsLoader

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import ModelConfig

# params.json key -> MistralConfig field.
_PARAMS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "head_dim": "head_dim",
    "hidden_dim": "intermediate_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "norm_eps": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "rope_theta": "rope_theta",
    "sliding_window": "sliding_window",
    "max_seq_len": "max_position_embeddings",
    "max_position_embeddings": "max_position_embeddings",
}
# Keys that change nothing this layout's dense decoder computes.
_INERT = {"tied_embeddings", "model_type", "torch_dtype"}

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def mistral_hf_config(directory: Path) -> Any:
    """The ``MistralConfig`` that ``directory/params.json`` describes."""
    from transformers import MistralConfig

    file = directory / "params.json"
    try:
        params = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the Mistral config {file}: {exc}") from exc
    unknown = sorted(set(params) - set(_PARAMS) - _INERT)
    if unknown:
        raise ConfigError(
            f"{file}: settings {unknown} describe a model the mistral format reader does "
            "not build (a dense decoder: dim, n_layers, head_dim, hidden_dim, n_heads, "
            "n_kv_heads, norm_eps, vocab_size, rope_theta, sliding_window, max_seq_len)"
        )
    if params.get("tied_embeddings"):
        raise ConfigError(f"{file}: tied embeddings are not part of this layout")
    fields = {_PARAMS[key]: value for key, value in params.items() if key in _PARAMS}
    fields.setdefault("rope_theta", 10000.0)
    fields.setdefault("max_position_embeddings", 32768)
    rope_theta = fields.pop("rope_theta")
    config = MistralConfig(**fields, tie_word_embeddings=False)
    config.rope_parameters = {"rope_type": "default", "rope_theta": float(rope_theta)}
    config.architectures = ["MistralForCausalLM"]
    return config


def mistral_to_hf_layout(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query or key projection from Mistral's rotary layout to the model's."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


class MistralLoader(SafetensorsLoader):
    patterns = ("consolidated*.safetensors",)
    index_name = "consolidated.safetensors.index.json"

    def hf_config(self, model_config: ModelConfig) -> Any:
        """``params.json`` with ``--config-format mistral``, and with ``auto`` where the
        directory has no ``config.json`` (else None: ``config.json``, read as usual)."""
        path = resolve_model_path(
            model_config.model,
            revision=model_config.revision,
            download_dir=self.load_config.download_dir,
        )
        fmt = model_config.config_format
        if fmt == "auto" and path.is_dir() and not (path / "config.json").exists():
            fmt = "mistral" if (path / "params.json").exists() else "hf"
        return mistral_hf_config(path) if fmt == "mistral" else None

    def load_weights(self, model: Any, model_config: ModelConfig) -> None:
        config = model.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.iter_weights(model_config):
                target = _TOP_NAMES.get(name)
                match = _LAYER.fullmatch(name)
                if target is None and match and match.group(2) in _LAYER_NAMES:
                    target = f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
                    if name.endswith("attention.wq.weight"):
                        tensor = mistral_to_hf_layout(tensor, heads)
                    elif name.endswith("attention.wk.weight"):
                        tensor = mistral_to_hf_layout(tensor, kv_heads)
                if target is None:
                    raise ConfigError(
                        f"the mistral checkpoint has a tensor {name!r} this reader does not know"
                    )
                yield target, tensor

        check_all_loaded(model, model.load_weights(renamed()))
