"""Write a tiny Hugging Face checkpoint as a GGUF file the way llama.cpp's
``convert_hf_to_gguf.py`` does: its metadata keys, the ``gguf`` package's own tensor-name
map, llama's Q/K row permutation and Gemma's ``1 + w`` norms. The weights go in as the
requested GGML type (F32, F16, BF16 or a type ``gguf.quants`` can quantize).

No tokenizer metadata is written: tests pass ``tokenizer=`` the checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(state: dict[str, torch.Tensor], config: Any, arch: str) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, transformed as llama.cpp's converter does."""
    names = gguf.get_tensor_name_map(_ARCH[arch], config.num_hidden_layers)
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = _llama_permute(data, config.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = _llama_permute(data, config.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, f"no GGUF name for {name}"
        out[target] = np.ascontiguousarray(data, dtype=np.float32)
    return out


def write_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    config: Any,
    arch: str,
    qtype: GGMLQuantizationType,
    metadata: dict[str, float | int] | None = None,
) -> Path:
    """``metadata``: further keys (``general.sampling.temp``: floats as float32, ints as
    uint32, as llama.cpp's converter writes them)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    params = config.rope_parameters
    if arch == "gemma3":
        params = params["full_attention"]
    writer.add_rope_freq_base(params["rope_theta"])
    if arch in ("qwen3", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if arch == "phi3":
        rotary = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(rotary)
        if config.sliding_window:
            writer.add_sliding_window(config.sliding_window)
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    for name, data in gguf_tensors(state, config, arch).items():
        # As llama.cpp: 1-D tensors (norms, biases) stay float32.
        kind = qtype if data.ndim == 2 else GGMLQuantizationType.F32
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        elif kind == GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def stored_weights(
    state: dict[str, torch.Tensor], config: Any, arch: str, qtype: GGMLQuantizationType
) -> dict[str, torch.Tensor]:
    """The HF state dict as the GGUF file holds it: each 2-D weight quantized and
    dequantized (row-local, so llama's row permutation does not change it), Gemma's norms
    through ``(w + 1) - 1``."""
    out = {}
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if data.ndim == 2 and qtype != GGMLQuantizationType.F32:
            if qtype == GGMLQuantizationType.F16:
                data = data.astype(np.float16).astype(np.float32)
            else:
                data = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = (data + np.float32(1)) - np.float32(1)
        out[name] = torch.from_numpy(np.asarray(data, dtype=np.float32).copy())
    return out


def gguf_checkpoint(
    root: Path, arch: str, qtype: GGMLQuantizationType, tiny: str | None = None, **overrides: Any
) -> tuple[Path, Path, Any]:
    """The tiny checkpoint ``tiny`` (``tiny_models``, by default ``arch``; config
    ``overrides``) under ``root``, written as ``root/<arch>.gguf`` with ``qtype`` 2-D
    weights: its directory (the tokenizer), the GGUF file, and transformers' model
    holding the weights as the file stores them (the reference)."""
    from tiny_models import load_reference, make_checkpoint

    tiny = tiny or arch
    directory = make_checkpoint(root / tiny, tiny, **overrides)
    model = load_reference(directory)
    state = model.state_dict()
    path = write_gguf(root / f"{arch}.gguf", state, model.config, arch, qtype)
    model.load_state_dict(stored_weights(state, model.config, arch, qtype))
    return directory, path, model
