"""``--model-impl transformers``: transformers' own models on pagedllm's paged attention.

Tiny random checkpoints of several architectures (made with transformers) keep
transformers' greedy tokens, top logprobs within 1e-4 in float32, with prefix caching (a
second pass hits), chunked prefill with a small budget, and a KV cache small enough to
preempt. ``--model-impl auto`` picks the backend for those pagedllm has no native
implementation of; the others (and a Llama) run through it when asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_parity import NEW_TOKENS, NUM_LOGPROBS, PROMPTS, SETTINGS, check_greedy_parity
from tiny_models import load_reference, make_checkpoint, reference_greedy
from tokenizer_fixtures import TOKENIZER_VOCAB_SIZE, make_tokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError
from pagedllm.plugins.models.transformers_backend import TransformersForCausalLM

_SMALL = dict(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

# name -> (config class, config kwargs): what each one exercises beyond a Llama.
OTHER_ARCHITECTURES: dict[str, tuple[Any, dict[str, Any]]] = {
    # parallel attention and MLP, partial rotary, Q/K/V biases, LayerNorm
    "stablelm": (
        transformers.StableLmConfig,
        dict(
            num_key_value_heads=2,
            partial_rotary_factor=0.5,
            use_qkv_bias=True,
            use_parallel_residual=True,
        ),
    ),
    # Q/K norms after the projections, GQA
    "olmo2": (transformers.Olmo2Config, dict(num_key_value_heads=2)),
    # embedding/residual/attention multipliers and a head divided by logits_scaling
    "granite": (
        transformers.GraniteConfig,
        dict(
            num_key_value_heads=2,
            logits_scaling=4.0,
            residual_multiplier=0.5,
            embedding_multiplier=2.0,
            attention_multiplier=0.3,
        ),
    ),
    # Gemma 2: sliding-window layers, attention and final logit soft-capping (a cap low
    # enough to matter), scaled queries
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=12,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=1,
        ),
    ),
    # multi-query attention, learned positions (GPT-2 style, n_* names)
    "gpt_bigcode": (
        transformers.GPTBigCodeConfig,
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, multi_query=True),
    ),
}


# Architectures pagedllm also implements natively (auto would pick that one, which
# tests/plugins/models/test_parity.py checks): run with --model-impl transformers.
NATIVE = {"gemma2", "stablelm"}


def _make(directory: Path, name: str) -> Path:
    config_cls, kwargs = OTHER_ARCHITECTURES[name]
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    config = config_cls(
        **{**_SMALL, **kwargs},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # (wider logits: clear-cut greedy choices, as tiny_models does)
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(3.0)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=list(OTHER_ARCHITECTURES))
def reference(request, tmp_path_factory):
    name = request.param
    directory = _make(tmp_path_factory.mktemp(name), name)
    model = load_reference(directory)
    expected = [reference_greedy(model, p, NEW_TOKENS, NUM_LOGPROBS) for p in PROMPTS]
    return name, directory, expected


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_parity(reference, setting):
    _name, directory, expected = reference
    llm = check_greedy_parity(directory, setting, expected, model_impl="transformers")
    assert isinstance(llm.llm_engine.loaded.model, TransformersForCausalLM)


def test_auto_takes_the_backend_without_a_native_implementation(tmp_path):
    directory = _make(tmp_path / "olmo2", "olmo2")
    llm = LLM(str(directory), dtype="float32", disable_log_stats=True)
    assert isinstance(llm.llm_engine.loaded.model, TransformersForCausalLM)


def test_a_native_architecture_through_the_backend(tmp_path):
    """``--model-impl transformers`` on a Llama (which has a native implementation)
    runs transformers' modules, with the same tokens; ``--model-impl pagedllm`` (or
    vLLM's ``vllm``) insists on a native one."""
    directory = make_checkpoint(tmp_path / "qwen2", "qwen2", seed=1)
    expected = [reference_greedy(load_reference(directory), p, 8, 1)[0] for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    for impl in ("transformers", "pagedllm", "vllm", "auto"):
        llm = LLM(str(directory), dtype="float32", model_impl=impl, disable_log_stats=True)
        model = llm.llm_engine.loaded.model
        assert isinstance(model, TransformersForCausalLM) == (impl == "transformers")
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False
        )
        assert [o.outputs[0].token_ids for o in outputs] == expected


def test_refusals(tmp_path):
    directory = _make(tmp_path / "olmo2", "olmo2")
    with pytest.raises(ConfigError, match="no native implementation"):
        LLM(str(directory), model_impl="pagedllm")
    with pytest.raises(ConfigError, match="--quantization fp8"):
        LLM(str(directory), quantization="fp8")
    # A model with its own attention classes (not transformers' interface; pagedllm's
    # own Falcon is what auto picks).
    falcon = tmp_path / "falcon"
    tokenizer = make_tokenizer(falcon)
    config = transformers.FalconConfig(
        vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(falcon)
    with pytest.raises(ConfigError, match="attention interface"):
        LLM(str(falcon), model_impl="transformers")


def _assert_greedy_parity(directory: Path) -> LLM:
    """``--model-impl transformers`` keeps the greedy tokens of transformers'
    ``from_pretrained`` of ``directory``."""
    reference = load_reference(directory)
    expected = [reference_greedy(reference, p, 8, 1)[0] for p in PROMPTS[:3]]
    llm = LLM(str(directory), dtype="float32", model_impl="transformers", disable_log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    return llm


def test_checkpoint_names_are_the_models_own(tmp_path):
    """A GPT-NeoX checkpoint names its head ``embed_out``, which transformers' model calls
    ``lm_head`` (its loading renames it): loaded by transformers' own rules."""
    directory = make_checkpoint(tmp_path / "gpt_neox", "gpt_neox")
    with safe_open(directory / "model.safetensors", "pt") as f:
        assert "embed_out.weight" in f.keys()
    _assert_greedy_parity(directory)


@pytest.mark.parametrize("case", ["head_only", "both_differ"])
def test_tied_weights_as_transformers_ties_them(tmp_path, case):
    """A head tied to the embedding by the config: a checkpoint holding the head alone
    fills both; one holding both, different, unties them (as ``from_pretrained``)."""
    directory = make_checkpoint(tmp_path / "llama", "llama")  # (tie_word_embeddings)
    path = directory / "model.safetensors"
    weights = load_file(path)
    embedding = weights.pop("model.embed_tokens.weight")
    if case == "both_differ":
        weights["model.embed_tokens.weight"] = embedding
        embedding = embedding.flip(0)  # (the rows of other tokens)
    weights["lm_head.weight"] = embedding.contiguous()
    save_file(weights, path, metadata={"format": "pt"})
    _assert_greedy_parity(directory)
