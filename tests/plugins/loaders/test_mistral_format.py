"""``--load-format mistral`` / ``--config-format mistral``: a tiny Mistral model written in
Mistral's own layout (``consolidated.safetensors`` with its tensor names and rotary
layout, ``params.json``), as transformers' conversion script reads it, runs as
transformers runs the Hugging Face original: token for token."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import assert_matches_reference, load_reference, make_checkpoint

from pagedllm import LLM
from pagedllm.core.errors import ConfigError

PROMPTS = [[1, 5, 9, 23, 42, 77, 3, 18, 40, 2, 6, 30, 31, 32], [1, 7, 7, 7, 3, 100, 12]]
NEW_TOKENS = 10


def _to_mistral_layout(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' conversion ``permute`` undone: the model's rotary layout back to
    Mistral's (each head's dimensions interleaved in pairs)."""
    rows, cols = weight.shape
    return weight.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the Hugging Face original, the same model in Mistral's layout)."""
    root = tmp_path_factory.mktemp("mistral")
    hf = make_checkpoint(root / "hf", "mistral", seed=4)
    config = json.loads((hf / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    native = root / "native"
    native.mkdir()
    for file in hf.iterdir():  # the tokenizer files
        if file.name.startswith("tokenizer") or file.name == "special_tokens_map.json":
            (native / file.name).write_bytes(file.read_bytes())
    names = {
        "self_attn.q_proj": "attention.wq",
        "self_attn.k_proj": "attention.wk",
        "self_attn.v_proj": "attention.wv",
        "self_attn.o_proj": "attention.wo",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.down_proj": "feed_forward.w2",
        "mlp.up_proj": "feed_forward.w3",
    }
    out = {}
    for name, tensor in load_file(hf / "model.safetensors").items():
        if name == "model.embed_tokens.weight":
            out["tok_embeddings.weight"] = tensor
        elif name == "model.norm.weight":
            out["norm.weight"] = tensor
        elif name == "lm_head.weight":
            out["output.weight"] = tensor
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.removesuffix(".weight")
            if module == "self_attn.q_proj":
                tensor = _to_mistral_layout(tensor, heads)
            elif module == "self_attn.k_proj":
                tensor = _to_mistral_layout(tensor, kv_heads)
            out[f"layers.{layer}.{names[module]}.weight"] = tensor.contiguous()
    save_file(out, native / "consolidated.safetensors")
    params = {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "head_dim": config["hidden_size"] // heads,
        "hidden_dim": config["intermediate_size"],
        "n_heads": heads,
        "n_kv_heads": kv_heads,
        "norm_eps": config["rms_norm_eps"],
        "vocab_size": config["vocab_size"],
        "rope_theta": config.get("rope_theta")
        or config.get("rope_parameters", {}).get("rope_theta", 10000.0),
        "sliding_window": config["sliding_window"],
        "max_seq_len": config["max_position_embeddings"],
    }
    (native / "params.json").write_text(json.dumps(params))
    return hf, native


def test_mistral_layout_matches_transformers(checkpoints):
    hf, native = checkpoints
    llm = LLM(
        str(native),
        load_format="mistral",
        config_format="mistral",
        dtype="float32",
        disable_log_stats=True,
    )
    hf_config = llm.llm_engine.loaded.hf_config
    assert hf_config.architectures == ["MistralForCausalLM"] and hf_config.sliding_window == 12
    # (the second prompt is longer than the sliding window)
    assert_matches_reference(llm, load_reference(hf), PROMPTS, NEW_TOKENS, tolerance=1e-3)
    # --config-format auto reads params.json where there is no config.json.
    auto = LLM(str(native), load_format="mistral", dtype="float32", disable_log_stats=True)
    assert auto.llm_engine.loaded.hf_config.num_hidden_layers == hf_config.num_hidden_layers


def test_refusals(checkpoints, tmp_path):
    hf, native = checkpoints
    with pytest.raises(ConfigError, match="no consolidated"):
        LLM(str(hf), load_format="mistral", dtype="float32", disable_log_stats=True)
    moe = tmp_path / "moe"
    moe.mkdir()
    for file in native.iterdir():
        (moe / file.name).write_bytes(file.read_bytes())
    params = json.loads((native / "params.json").read_text())
    (moe / "params.json").write_text(json.dumps({**params, "moe": {"num_experts": 8}}))
    with pytest.raises(ConfigError, match=r"settings \['moe'\]"):
        LLM(str(moe), load_format="mistral", dtype="float32", disable_log_stats=True)
    # params.json is the mistral loader's to read (core names no checkpoint layout): with
    # another load format, --config-format mistral is refused by name.
    with pytest.raises(ConfigError, match="--config-format mistral: --load-format dummy"):
        LLM(str(native), load_format="dummy", config_format="mistral", disable_log_stats=True)
