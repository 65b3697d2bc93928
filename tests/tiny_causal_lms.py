"""A tiny random model of any causal LM transformers ships, from its config class alone.

:func:`causal_lm_types` lists the model types of transformers' causal-LM auto mapping
whose model class computes attention through transformers' attention interface (what
``--model-impl transformers`` swaps); :func:`tiny_config` shrinks a type's default config
by setting whichever of the common size attributes it has (hidden size, layers, heads,
experts, ...; in its sub-configs too), giving it one layer of each kind its full-size
default has (``layer_types``), plus the few per-type settings in :data:`TWEAKS` that its
validation or its modules need.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizer_fixtures import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    TOKENIZER_VOCAB_SIZE,
    make_tokenizer,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# Attribute -> tiny value, set where a config has the attribute (or an alias of it).
SIZES: dict[str, Any] = dict(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    hidden_size=64,
    d_model=64,
    intermediate_size=128,
    ffn_hidden_size=128,
    dff=128,
    num_hidden_layers=2,
    num_layers=2,
    n_layers=2,
    num_attention_heads=4,
    n_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rotary_dim=8,
    max_position_embeddings=256,
    sliding_window=12,
    # mixtures of experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    expert_ffn_hidden_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    # multi-head latent attention
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,  # (narrower than queries and keys, as in DeepSeek V3)
    # sparse attention's indexer (DeepSeek V3.2)
    index_n_heads=2,
    index_head_dim=16,
    # per-layer inputs (Gemma 3n/4), pronunciation and glyph embeddings (RoCBert)
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=TOKENIZER_VOCAB_SIZE,
    pronunciation_embed_dim=16,
    pronunciation_vocab_size=64,
    shape_embed_dim=16,
    shape_vocab_size=64,
)

# model type -> settings its tiny config needs beyond SIZES (a sub-config's under its
# attribute name).
TWEAKS: dict[str, dict[str, Any]] = {
    "longcat_flash": dict(head_dim=8),  # (the rotary part of latent attention's heads)
    # (defaults its modules cannot be built with)
    "cohere_compass_text": dict(
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    ),
    "dbrx": dict(
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=128, hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
    # (the last two layers reuse the keys and values of the last two before them)
    "gemma3n_text": dict(
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_hidden_layers=4,
        num_kv_shared_layers=2,
        activation_sparsity_pattern=[0.0] * 4,
    ),
    "gemma4_assistant": dict(
        text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    ),
    "gemma4_unified": dict(
        vision_config=dict(mm_embed_dim=64, mm_posemb_size=16, output_proj_dims=64)
    ),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "xmod": dict(default_language="en_XX"),
    "zaya": dict(num_experts_per_tok=1),
}


def causal_lm_types() -> dict[str, type]:
    """Model type -> causal-LM class, for those whose attention goes through the
    attention interface (``_supports_attention_backend``)."""
    found = {}
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        model_class = getattr(transformers, class_name, None)
        if getattr(model_class, "_supports_attention_backend", False):
            found[model_type] = model_class
    return found


def _field_names(config_class: type) -> set[str]:
    return {f.name for f in dataclasses.fields(config_class)}


def _shrunk(config_class: type, default: Any, tweaks: dict[str, Any]) -> Any:
    names = _field_names(config_class)
    aliases = getattr(config_class, "attribute_map", None) or {}
    kwargs: dict[str, Any] = {}
    for name, value in SIZES.items():
        name = name if name in names else aliases.get(name, "")
        if name in names:
            kwargs[name] = value
    if "kv_lora_rank" in names and "num_attention_heads" in kwargs:
        # (latent attention expands its keys and values to every head)
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    # One layer of each kind the full-size model has.
    kinds = list(dict.fromkeys(getattr(default, "layer_types", None) or ()))
    if len(kinds) > 1 and "layer_types" in names:
        kwargs["layer_types"] = kinds
        if "num_hidden_layers" in names:
            kwargs["num_hidden_layers"] = len(kinds)
    if "is_decoder" in names:  # (what the encoders' causal-LM heads are for)
        kwargs["is_decoder"] = True
    for token, value in (
        ("bos_token_id", BOS_TOKEN_ID),
        ("eos_token_id", EOS_TOKEN_ID),
        ("pad_token_id", PAD_TOKEN_ID),
    ):
        if token in names:
            kwargs[token] = value
    subs = getattr(config_class, "sub_configs", None) or {}
    for name, sub_class in subs.items():
        sub = getattr(default, name, None)
        if sub is None and dataclasses.is_dataclass(sub_class):  # (made from its defaults)
            sub = sub_class()
        if isinstance(sub, transformers.PretrainedConfig) and dataclasses.is_dataclass(sub):
            kwargs[name] = _shrunk(type(sub), sub, tweaks.get(name, {}))
    kwargs.update({k: v for k, v in tweaks.items() if k not in subs})
    return config_class(**kwargs)


def tiny_config(model_type: str) -> Any:
    config_class = causal_lm_types()[model_type].config_class
    tweaks = TWEAKS.get(model_type, {})
    try:
        default = config_class()
    except Exception:  # (a default its class's own validation refuses)
        default = config_class(**tweaks)
    return _shrunk(config_class, default, tweaks)


def make_tiny_causal_lm(directory: Path, model_type: str, max_parameters: int = 12_000_000) -> Any:
    """Save a tiny random ``model_type`` causal LM (float32 safetensors) and the test
    tokenizer into ``directory``; return the model (eval mode)."""
    model_class = causal_lm_types()[model_type]
    config = tiny_config(model_type)
    with torch.device("meta"):
        count = sum(p.numel() for p in model_class(config).parameters())
    if count > max_parameters:
        raise ValueError(f"the tiny {model_type} still has {count} parameters")
    torch.manual_seed(0)
    model = model_class(config).eval()
    # Random init leaves logits nearly flat; widen them so greedy choices are clear-cut.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(3.0)
    directory.mkdir(parents=True, exist_ok=True)
    make_tokenizer(directory)
    model.save_pretrained(directory)
    return model
