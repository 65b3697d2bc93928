"""The ``gguf`` load format: a llama.cpp GGUF file, dequantized to the engine dtype.

The file carries its own config (``<arch>.*`` metadata) and tokenizer
(``tokenizer.ggml.*``), so no Hugging Face files are needed next to it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import ModelLoader
from pagedllm.core.model_files import resolve_model_path
from pagedllm.plugins.loaders.base import check_all_loaded
from pagedllm.plugins.loaders.gguf_file import GGUFFile, find_gguf_file

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import LoadConfig, ModelConfig

# GGUF tensor names -> Hugging Face parameter names (llama layout).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor (llama layout), or ``None`` if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def reverse_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a Q or K projection (``n_head`` is the
    number of KV heads for K): rows ``(n_head, 2, d/2)`` were stored as ``(n_head, d/2, 2)``."""
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def _llama_config(gguf: GGUFFile) -> Any:
    from transformers import LlamaConfig

    md = gguf.metadata
    arch = "llama"

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"{gguf.path}: GGUF metadata has no {arch}.{key}")
        return value

    tokens = md.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else get("vocab_size")
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    kwargs: dict[str, Any] = {}
    for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{key}" in md:
            kwargs[ours] = int(md[f"tokenizer.ggml.{key}"])
    if "tokenizer.ggml.padding_token_id" in md:
        kwargs["pad_token_id"] = int(md["tokenizer.ggml.padding_token_id"])
    rope_dim = md.get(f"{arch}.rope.dimension_count")
    head_dim = int(md.get(f"{arch}.attention.key_length", rope_dim or hidden // heads))
    config = LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        architectures=["LlamaForCausalLM"],
        **kwargs,
    )
    return config


# GGUF architecture -> (HF config builder, weight-name mapper). Only llama so far.
SUPPORTED_ARCHITECTURES: dict[str, tuple[Callable[[GGUFFile], Any], Callable]] = {
    "llama": (_llama_config, hf_name),
}


def gguf_path_of(model: str, download_dir: str | None = None) -> Path | None:
    """The GGUF file a ``--model`` value names (a ``.gguf`` path, or a directory holding
    exactly one), or ``None``."""
    try:
        path = resolve_model_path(model, download_dir=download_dir)
    except ConfigError:
        return None
    return find_gguf_file(path)


class GGUFLoader(ModelLoader):
    """Weights, config and tokenizer from one GGUF file; every tensor is dequantized
    to the engine dtype at load."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        if load_config.model_loader_extra_config:
            raise ConfigError(
                f"--model-loader-extra-config: unknown key(s) "
                f"{sorted(load_config.model_loader_extra_config)} for load format "
                f"'gguf' (accepted: none)"
            )
        self._files: dict[Path, GGUFFile] = {}

    def gguf_file(self, model_config: ModelConfig) -> GGUFFile:
        path = resolve_model_path(
            model_config.model,
            revision=model_config.revision,
            download_dir=self.load_config.download_dir,
        )
        file = find_gguf_file(path)
        if file is None:
            raise ConfigError(
                f"load format 'gguf': {model_config.model!r} is neither a .gguf file nor a "
                f"directory holding one"
            )
        if file not in self._files:
            gguf = GGUFFile(file)
            if gguf.architecture not in SUPPORTED_ARCHITECTURES:
                raise ConfigError(
                    f"{file.name}: GGUF architecture {gguf.architecture!r} is not supported; "
                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
                )
            self._files[file] = gguf
        return self._files[file]

    def download_model(self, model_config: ModelConfig) -> None:
        self.gguf_file(model_config)

    def hf_config(self, model_config: ModelConfig) -> Any:
        gguf = self.gguf_file(model_config)
        return SUPPORTED_ARCHITECTURES[gguf.architecture][0](gguf)

    def load_tokenizer(self, model_config: ModelConfig, **kwargs: Any) -> Any:
        gguf = self.gguf_file(model_config)
        try:
            # The class AutoTokenizer picks for a GGUF file, without the seconds its
            # full-metadata parse (to find the model type) costs.
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as cls
        except ImportError:  # older transformers
            from transformers import AutoTokenizer as cls
        kwargs.pop("use_fast", None)
        kwargs.pop("trust_remote_code", None)
        try:
            return cls.from_pretrained(gguf.path.parent, gguf_file=gguf.path.name, **kwargs)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot build the tokenizer of {gguf.path}: {exc}") from exc

    def iter_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, float32 tensor)`` pairs; the model casts them to its dtype."""
        gguf = self.gguf_file(model_config)
        mapper = SUPPORTED_ARCHITECTURES[gguf.architecture][1]
        config = getattr(self, "_config", None) or self.hf_config(model_config)
        names = list(gguf.tensors)
        if self.load_config.use_tqdm_on_load:
            from tqdm import tqdm

            names = tqdm(names, desc="Loading GGUF tensors", unit="tensor", leave=False)
        for name in names:
            target = mapper(name)
            if target is None:
                raise ConfigError(f"{gguf.path.name}: unknown GGUF tensor {name!r}")
            tensor = gguf.dequantized(name)
            if ".attn_q." in name:
                tensor = reverse_permute(tensor, config.num_attention_heads)
            elif ".attn_k." in name:
                tensor = reverse_permute(tensor, config.num_key_value_heads)
            yield target, tensor

    def load_weights(self, model: Any, model_config: ModelConfig) -> None:
        self._config = getattr(model, "config", None)
        loaded = model.load_weights(self.iter_weights(model_config))
        check_all_loaded(model, loaded)
