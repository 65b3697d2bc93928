"""Tiny random checkpoints made with ``transformers`` (fixed seed, safetensors), one per
supported architecture, each with the test tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizer_fixtures import TOKENIZER_VOCAB_SIZE, make_tokenizer

COMMON = dict(vocab_size=TOKENIZER_VOCAB_SIZE)

# name -> (config class, model class, config kwargs)
ARCHITECTURES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        ),
    ),
    "llama3_rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 500000.0,
            },
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            sliding_window=12,
        ),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        ),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            max_position_embeddings=256,
        ),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            max_position_embeddings=256,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            tie_word_embeddings=False,
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            max_position_embeddings=256,
            sliding_window=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
            final_logit_softcapping=30.0,
        ),
    ),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            # Scores large and a cap low enough that capping them changes the greedy
            # tokens (Gemma 2's own cap is 50).
            query_pre_attn_scalar=1,
            attn_logit_softcapping=1.0,
            max_position_embeddings=256,
            sliding_window=12,
            final_logit_softcapping=30.0,
            tie_word_embeddings=False,
        ),
    ),
    "phi": (
        transformers.PhiConfig,
        transformers.PhiForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            partial_rotary_factor=0.5,
            qk_layernorm=True,
        ),
    ),
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            original_max_position_embeddings=256,
            partial_rotary_factor=0.5,
            sliding_window=20,
        ),
    ),
    "stablelm": (
        transformers.StableLmConfig,
        transformers.StableLmForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            partial_rotary_factor=0.5,
            use_qkv_bias=True,
            qk_layernorm=True,
            use_parallel_residual=True,
        ),
    ),
    "starcoder2": (
        transformers.Starcoder2Config,
        transformers.Starcoder2ForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            sliding_window=12,
            tie_word_embeddings=False,
        ),
    ),
    "opt": (
        transformers.OPTConfig,
        transformers.OPTForCausalLM,
        dict(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
        ),
    ),
    "falcon": (
        transformers.FalconConfig,
        transformers.FalconForCausalLM,
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            new_decoder_architecture=True,
            num_kv_heads=2,
            tie_word_embeddings=False,
        ),
    ),
    "falcon_mqa": (
        transformers.FalconConfig,
        transformers.FalconForCausalLM,
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            multi_query=True,
            parallel_attn=True,
            bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "gpt_neox": (
        transformers.GPTNeoXConfig,
        transformers.GPTNeoXForCausalLM,
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            partial_rotary_factor=0.5,
        ),
    ),
    "gpt2": (
        transformers.GPT2Config,
        transformers.GPT2LMHeadModel,
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    ),
}


# Architectures whose one-dimensional parameters (norm weights, biases: ones and zeros as
# transformers initialises them) are randomised too, so that loading them is checked.
RANDOM_1D = frozenset(
    {"gemma2", "phi", "stablelm", "gpt_neox", "falcon", "falcon_mqa", "starcoder2", "gpt2", "opt"}
    | {"mixtral", "qwen2_moe", "qwen3_moe"}
)


def make_checkpoint(directory: Path, name: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random ``name`` model (config kwargs updated by ``overrides``) and the
    test tokenizer into ``directory``."""
    config_cls, model_cls, kwargs = ARCHITECTURES[name]
    kwargs = {**kwargs, **overrides}
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    config = config_cls(
        **{**COMMON, **kwargs},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    # Random init leaves logits nearly flat; widen them so greedy choices are clear-cut.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(3.0)
            elif name in RANDOM_1D:
                param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def make_classifier(directory: Path) -> Any:
    """Save a tiny random Qwen2 sequence classifier (3 labels) and the test tokenizer
    into ``directory``; return the transformers model."""
    tokenizer = make_tokenizer(directory)
    config = transformers.Qwen2Config(
        vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_labels=3,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    return model


def load_reference(directory: Path) -> Any:
    kwargs: dict[str, Any] = {}
    if getattr(transformers.AutoConfig.from_pretrained(directory), "attn_logit_softcapping", None):
        # Eager attention: transformers releases before 5.2x ran Gemma 2 with sdpa, which
        # drops the soft cap (5.17, on the GPU machine).
        kwargs["attn_implementation"] = "eager"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, **kwargs
    )
    return model.eval()


@torch.no_grad()
def reference_greedy(
    model: Any, prompt: list[int], max_new_tokens: int, num_logprobs: int = 5
) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy tokens from ``transformers.generate`` and the top logprobs at each step."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    top = []
    for step_logits in out.logits:
        logprobs = torch.log_softmax(step_logits[0].float(), dim=-1)
        values, ids = logprobs.topk(num_logprobs)
        top.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
    return tokens, top


def assert_matches_reference(
    llm: Any, model: Any, prompts: list[list[int]], new_tokens: int, tolerance: float
) -> None:
    """``llm``'s greedy tokens are ``model``'s (:func:`reference_greedy`) and their
    logprobs within ``tolerance``."""
    from pagedllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, logprobs=1
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, top = reference_greedy(model, prompt, new_tokens, num_logprobs=1)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        for step, token in enumerate(tokens):
            assert abs(completion.logprobs[step][token].logprob - top[step][token]) < tolerance


def randomize_weights(checkpoint: Path, suffixes: tuple[str, ...], seed: int, base: float) -> None:
    """Give the checkpoint's tensors whose names end in one of ``suffixes`` random values
    (``base`` + standard normal): transformers starts biases at zero and norms at one,
    which a kernel that dropped them, or swapped them, would not show."""
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in weights.items():
        if name.endswith(suffixes):
            noise = torch.randn(tensor.shape, generator=generator)
            weights[name] = (base + noise).to(tensor.dtype)
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})


def assert_native_layers_match(llm: Any, prompts: list, params: Any, min_steps: int = 7) -> None:
    """Generate ``prompts``, then the first alone (decode steps of one row), with the native
    decoder layers (pagedllm.kernels.cpu_layer), each of which must have run at least
    ``min_steps`` steps; then again op by op: the same tokens and logprobs, bit for bit."""
    layers = llm.llm_engine.runner.model.model.layers
    native = generate_with_first_alone(llm, prompts, params)
    assert all(layer._native and layer._native.steps >= min_steps for layer in layers)
    for layer in layers:
        layer._native = False
    assert_same_outputs(native, generate_with_first_alone(llm, prompts, params))


def generate_with_first_alone(llm: Any, prompts: list, params: Any) -> list:
    """``llm``'s outputs for ``prompts``, then for the first prompt alone (decode steps of
    one row)."""
    out = llm.generate(prompts, params, use_tqdm=False)
    return out + llm.generate(prompts[:1], params, use_tqdm=False)


def assert_same_outputs(first: list, second: list) -> None:
    """The same tokens and logprobs in both lists of outputs, bit for bit."""
    for a, b in zip(first, second, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in s.items()} for s in a.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in s.items()} for s in b.outputs[0].logprobs
        ]
