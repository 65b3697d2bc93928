"""The offline ``LLM`` class and ``LLMEngine`` on a tiny random llama checkpoint: prompt
forms, chat, stop conditions, n/best_of, seeds, logprobs, limits, abort, stats, and the
engine arguments that change the model. Parity with transformers is in test_parity.py."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from tiny_models import make_checkpoint

import pagedllm.core.stats
from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError, EngineDeadError

EOS = 1  # </s>
IM_START = 4  # <|im_start|>
PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time", "A paged attention"]


def build(path, **kwargs) -> LLM:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("disable_log_stats", True)
    # The default CPU KV cache (4 GiB) costs seconds to set up; 64 blocks hold 1024 tokens.
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return LLM(str(path), **kwargs)


def greedy(max_tokens=8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def run(llm, prompts, params) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def copy_checkpoint(src, dst, weights=True):
    dst.mkdir()
    for f in src.iterdir():
        if weights or not f.name.endswith((".safetensors", ".bin")):
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def llm(ckpt):
    return build(ckpt)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


# ---------------------------------------------------------------------------- generate


def test_prompt_forms_give_the_same_greedy_output(llm, tok):
    text = PROMPTS[0]
    ids = tok.encode(text)
    by_string = run(llm, text, greedy())
    assert len(by_string) == 1
    out = by_string[0]
    assert out.prompt == text
    assert out.prompt_token_ids == ids
    for prompt in (ids, {"prompt_token_ids": ids}, {"prompt": text}, [text]):
        (other,) = run(llm, prompt, greedy())
        assert other.prompt_token_ids == ids
        assert other.outputs[0].token_ids == out.outputs[0].token_ids
    assert run(llm, ids, greedy())[0].prompt is None
    assert run(llm, {"prompt": text}, greedy())[0].prompt == text


def test_batch_outputs_in_prompt_order_match_single_runs(llm, tok):
    params = greedy(max_tokens=20)
    batch = run(llm, PROMPTS, params)
    assert [o.prompt for o in batch] == PROMPTS
    assert len({o.request_id for o in batch}) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, batch, strict=True):
        assert tokens(run(llm, prompt, greedy(8))) == [out.outputs[0].token_ids[:8]]
        completion = out.outputs[0]
        assert completion.finish_reason == "length" and completion.stop_reason is None
        assert len(completion.token_ids) == 20
        assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
        assert out.finished and completion.index == 0


def test_per_prompt_sampling_params(llm):
    outs = run(llm, PROMPTS[:2], [greedy(max_tokens=3), greedy(max_tokens=7)])
    assert [len(t) for t in tokens(outs)] == [3, 7]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        run(llm, PROMPTS[:3], [greedy(), greedy()])
    assert not llm.llm_engine.has_unfinished_requests()


def test_use_tqdm(llm, capsys):
    outs = llm.generate(PROMPTS, greedy(max_tokens=4), use_tqdm=True)
    assert len(outs) == len(PROMPTS)
    assert "Processed prompts" in capsys.readouterr().err


# -------------------------------------------------------------------------------- chat


def chat_text(*turns, generation_prompt=True):
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def test_chat_renders_the_tokenizer_template(llm, tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world!"},
    ]
    (out,) = llm.chat(messages, greedy(max_tokens=4), use_tqdm=False)
    expected = chat_text(("system", "Be brief."), ("user", "Hello, world!"))
    assert out.prompt == expected
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert out.prompt_token_ids[0] == IM_START
    assert len(out.outputs[0].token_ids) == 4
    (same,) = run(llm, {"prompt_token_ids": out.prompt_token_ids}, greedy(max_tokens=4))
    assert same.outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_template_override_parts_and_batch(llm):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (out,) = llm.chat(
        [{"role": "user", "content": "Hi"}], greedy(2), use_tqdm=False, chat_template=template
    )
    assert out.prompt == "[user] Hi\n"
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    conversations = [
        [{"role": "user", "content": parts}],
        [{"role": "user", "content": "Second"}],
    ]
    outs = llm.chat(conversations, greedy(2), use_tqdm=False)
    assert [o.prompt for o in outs] == [
        chat_text(("user", "Hello\nthere")),
        chat_text(("user", "Second")),
    ]


def test_chat_generation_prompt_vs_continue_final_message(llm):
    messages = [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "The answer is"},
    ]
    (plain,) = llm.chat(messages, greedy(2), use_tqdm=False, add_generation_prompt=False)
    assert plain.prompt == chat_text(
        ("user", "What is two plus two?"), ("assistant", "The answer is"), generation_prompt=False
    )
    (cont,) = llm.chat(
        messages,
        greedy(2),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert cont.prompt.endswith("<|im_start|>assistant\nThe answer is")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(messages, greedy(2), use_tqdm=False, continue_final_message=True)


# ---------------------------------------------------------------------- stop conditions


def test_stop_strings(llm, tok):
    (full,) = run(llm, PROMPTS[1], greedy(max_tokens=20))
    text = full.outputs[0].text
    stop = text[3:7]
    cut = text.index(stop)
    (out,) = run(llm, PROMPTS[1], greedy(max_tokens=20, stop=[stop, "never appears"]))
    completion = out.outputs[0]
    assert completion.text == text[:cut]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert len(completion.token_ids) < 20
    (out,) = run(llm, PROMPTS[1], greedy(max_tokens=20, stop=stop, include_stop_str_in_output=True))
    assert out.outputs[0].text == text[: cut + len(stop)]
    assert out.outputs[0].stop_reason == stop


def test_stop_token_ids_eos_and_min_tokens(llm):
    (full,) = run(llm, PROMPTS[0], greedy(max_tokens=20, ignore_eos=True))
    ids = full.outputs[0].token_ids
    stop_id = next(t for t in ids if t != ids[0])
    (out,) = run(llm, PROMPTS[0], greedy(max_tokens=20, stop_token_ids=[stop_id]))
    completion = out.outputs[0]
    assert completion.token_ids == ids[: ids.index(stop_id) + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id

    # A strong bias makes eos the greedy choice at every step.
    eos_first = {"logit_bias": {EOS: 100.0}}
    (out,) = run(llm, PROMPTS[0], greedy(max_tokens=10, **eos_first))
    assert out.outputs[0].token_ids == [EOS]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None
    assert out.outputs[0].text == ""
    (out,) = run(llm, PROMPTS[0], greedy(max_tokens=10, min_tokens=4, **eos_first))
    assert out.outputs[0].token_ids == [*ids[:4], EOS]
    assert out.outputs[0].finish_reason == "stop"
    (out,) = run(llm, PROMPTS[0], greedy(max_tokens=3, ignore_eos=True, **eos_first))
    assert out.outputs[0].token_ids == [EOS] * 3 and out.outputs[0].finish_reason == "length"


def test_detokenize_and_special_tokens(llm):
    (out,) = run(llm, PROMPTS[0], greedy(max_tokens=5, detokenize=False))
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
    im_start = {"logit_bias": {IM_START: 100.0}}
    (hidden,) = run(llm, PROMPTS[0], greedy(max_tokens=3, **im_start))
    (shown,) = run(llm, PROMPTS[0], greedy(max_tokens=3, skip_special_tokens=False, **im_start))
    assert hidden.outputs[0].token_ids == shown.outputs[0].token_ids == [IM_START] * 3
    assert hidden.outputs[0].text == ""
    assert shown.outputs[0].text == "<|im_start|>" * 3


# ------------------------------------------------------------------- n, best_of, seeds


def test_n_samples_with_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12)
    (first,) = run(llm, PROMPTS[0], params)
    (second,) = run(llm, PROMPTS[0], params)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(samples)) == 3
    assert [tuple(c.token_ids) for c in second.outputs] == samples


def test_best_of_returns_the_n_most_likely(llm):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=10, logprobs=1)
    (out,) = run(llm, PROMPTS[0], params)
    assert [c.index for c in out.outputs] == [0, 1]
    scores = [c.cumulative_logprob for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    everything = SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=10, logprobs=1)
    (all5,) = run(llm, PROMPTS[0], everything)
    best = sorted(all5.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    for c in out.outputs:
        assert c.cumulative_logprob == pytest.approx(
            sum(p[t].logprob for p, t in zip(c.logprobs, c.token_ids, strict=True))
        )


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10)
    alone = tokens(run(llm, PROMPTS[2], seeded))[0]
    assert tokens(run(llm, PROMPTS[2], seeded))[0] == alone
    others = SamplingParams(temperature=1.0, max_tokens=12)
    batch = run(llm, [PROMPTS[0], PROMPTS[2], PROMPTS[3]], [others, seeded, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=10)
    assert tokens(run(llm, PROMPTS[2], other_seed))[0] != alone


def test_engine_seed_makes_unseeded_sampling_reproducible(ckpt):
    params = SamplingParams(temperature=1.0, max_tokens=16)
    a = tokens(run(build(ckpt, seed=5), PROMPTS, params))
    b = tokens(run(build(ckpt, seed=5), PROMPTS, params))
    assert a == b


# ----------------------------------------------------------------------------- logprobs


def test_sample_and_prompt_logprobs(llm, tok):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, logprobs=3, prompt_logprobs=2)
    (out,) = run(llm, PROMPTS[1], params)
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for position, token_id in zip(completion.logprobs, completion.token_ids, strict=True):
        assert token_id in position and len(position) in (3, 4)
        top = sorted((lp for t, lp in position.items() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert [lp.logprob for lp in top] == sorted((lp.logprob for lp in top), reverse=True)
        assert position[token_id].logprob <= top[0].logprob
        assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in position.values())
        assert position[token_id].decoded_token == tok.decode([token_id])
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids, strict=True))
    )
    prompt_lps = out.prompt_logprobs
    assert len(prompt_lps) == len(out.prompt_token_ids) and prompt_lps[0] is None
    for position, token_id in zip(prompt_lps[1:], out.prompt_token_ids[1:], strict=True):
        assert token_id in position and len(position) in (2, 3)
        ranks = sorted(lp.rank for t, lp in position.items() if lp.rank <= 2)
        assert ranks == [1, 2]

    (greedy_out,) = run(llm, PROMPTS[1], greedy(max_tokens=4, logprobs=3))
    completion = greedy_out.outputs[0]
    for position, token_id in zip(completion.logprobs, completion.token_ids, strict=True):
        assert position[token_id].rank == 1 and len(position) == 3


def test_max_logprobs_limit(ckpt):
    small = build(ckpt, max_logprobs=2)
    run(small, PROMPTS[0], greedy(max_tokens=2, logprobs=2))
    for params in (greedy(logprobs=3), greedy(prompt_logprobs=5)):
        with pytest.raises(ValueError, match="max-logprobs=2"):
            run(small, PROMPTS[0], params)
    assert not small.llm_engine.has_unfinished_requests()


# ------------------------------------------------------------------ limits, abort, stats


def test_max_model_len(ckpt, tok):
    short = build(ckpt, max_model_len=32)
    long_prompt = list(range(10, 50))
    with pytest.raises(ValueError, match="maximum model length of 32"):
        run(short, long_prompt, greedy())
    # A bad prompt in a batch aborts the ones already added.
    with pytest.raises(ValueError, match="40 tokens"):
        run(short, [[10, 11, 12], long_prompt], greedy())
    assert not short.llm_engine.has_unfinished_requests()
    assert short.llm_engine.kv_manager.num_free_blocks == 64
    (out,) = run(short, list(range(10, 30)), greedy(max_tokens=100, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 12
    assert out.outputs[0].finish_reason == "length"
    # max_tokens left unset fills the rest of the context.
    (out,) = run(short, list(range(10, 30)), SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 12


def test_abort_frees_kv_blocks(llm, tok):
    engine = llm.llm_engine
    initial = engine.kv_manager.num_free_blocks
    params = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True)
    engine.add_request("abort-a", "Once upon a time, there was a little robot", params)
    engine.add_request("abort-b", {"prompt_token_ids": list(range(10, 60))}, params.clone())
    for _ in range(4):
        engine.step()
    assert engine.kv_manager.num_free_blocks < initial
    assert engine.get_num_unfinished_requests() == 2
    engine.abort_request(["abort-a", "abort-b"])
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == initial
    assert tokens(run(llm, PROMPTS[0], greedy(4))) == tokens(run(llm, PROMPTS[0], greedy(4)))


def test_stats_log_line_and_prefix_cache_hits(ckpt, monkeypatch, caplog):
    monkeypatch.setattr(pagedllm.core.stats, "LOG_INTERVAL_SECONDS", 0)
    stats_llm = build(ckpt, disable_log_stats=False)
    shared = list(range(10, 58))  # three full blocks of 16
    with caplog.at_level(logging.INFO, logger="pagedllm.stats"):
        run(stats_llm, [*shared, 70, 71], greedy(4))
        (second,) = run(stats_llm, [*shared, 80, 81, 82], greedy(4))
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedllm.stats"]
    assert lines
    line = lines[-1]
    for words in ("throughput", "running", "waiting", "KV cache usage", "prefix cache hit rate"):
        assert words in line
    assert second.num_cached_tokens == 48
    snapshot = stats_llm.llm_engine.stat_logger.snapshot()
    assert snapshot.prefix_cache_hits >= 48 and snapshot.prefix_cache_hit_rate > 0
    assert snapshot.generation_tokens == 8


# -------------------------------------------------------------- engine args and loading


def test_hf_overrides_dict_and_callable(ckpt, llm):
    # Fewer layers than the checkpoint has: its extra weights are an error (as in vLLM),
    # so this one runs on dummy weights.
    one_layer = build(ckpt, hf_overrides={"num_hidden_layers": 1}, load_format="dummy")
    assert one_layer.llm_engine.loaded.hf_config.num_hidden_layers == 1
    assert len(one_layer.llm_engine.loaded.model.model.layers) == 1
    assert len(tokens(run(one_layer, PROMPTS[0], greedy(max_tokens=3)))[0]) == 3

    def override(config):
        config.rms_norm_eps = 0.5
        return config

    reference = tokens(run(llm, PROMPTS, greedy()))
    by_callable = build(ckpt, hf_overrides=override)
    assert by_callable.llm_engine.loaded.hf_config.rms_norm_eps == 0.5
    assert tokens(run(by_callable, PROMPTS, greedy())) != reference


def test_rope_scaling_and_theta(ckpt, llm):
    reference = tokens(run(llm, PROMPTS, greedy(max_tokens=12)))
    scaled = build(ckpt, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert scaled.llm_engine.max_model_len == 512
    assert tokens(run(scaled, PROMPTS, greedy(max_tokens=12))) != reference
    theta = build(ckpt, rope_theta=100.0)
    assert tokens(run(theta, PROMPTS, greedy(max_tokens=12))) != reference


def test_dtypes(ckpt, llm):
    reference = tokens(run(llm, PROMPTS, greedy(max_tokens=6)))
    bf16 = build(ckpt, dtype="bfloat16")
    assert bf16.llm_engine.loaded.dtype == torch.bfloat16
    got = tokens(run(bf16, PROMPTS, greedy(max_tokens=6)))
    pairs = zip([t for ts in reference for t in ts], [t for ts in got for t in ts], strict=True)
    agree = sum(a == b for a, b in pairs)
    assert agree >= 0.75 * sum(map(len, reference))
    # auto: bfloat16 for this float32 checkpoint where the CPU computes in that
    # (AVX512-BF16, AMX), else float16 where it computes in float16, else float32 (the
    # cpu device's rule).
    from pagedllm.plugins.devices.cpu import CpuDevice, native_arithmetic

    if native_arithmetic(torch.bfloat16):
        expected = torch.bfloat16
    elif native_arithmetic(torch.float16):
        expected = torch.float16
    else:
        expected = torch.float32
    bf16_expected = torch.bfloat16 if native_arithmetic(torch.bfloat16) else torch.float32
    assert CpuDevice().auto_dtype(torch.float16) == expected
    assert CpuDevice().auto_dtype(torch.bfloat16) == bf16_expected
    assert CpuDevice().auto_dtype(torch.float32) == torch.float32
    auto = build(ckpt, dtype="auto")
    assert auto.llm_engine.loaded.dtype == expected
    assert len(tokens(run(auto, PROMPTS[0], greedy(max_tokens=3)))[0]) == 3
    half = build(ckpt, dtype="half")  # an explicit choice is kept
    assert half.llm_engine.loaded.dtype == torch.float16


def test_torch_dtype_values(ckpt, llm):
    """``dtype=torch.bfloat16`` (seed 003's example) means ``"bfloat16"``."""
    bf16 = build(ckpt, dtype=torch.bfloat16)
    assert bf16.llm_engine.loaded.dtype == torch.bfloat16
    f32 = build(ckpt, dtype=torch.float32)
    assert f32.llm_engine.loaded.dtype == torch.float32
    expected = tokens(run(llm, PROMPTS, greedy(max_tokens=6)))
    assert tokens(run(f32, PROMPTS, greedy(max_tokens=6))) == expected
    with pytest.raises(ConfigError, match="--dtype: invalid choice 'int8'"):
        build(ckpt, dtype=torch.int8)


# vLLM's LLM parameters in the order seed 003 documents them.
VLLM_ORDER = [
    "model", "tokenizer", "tokenizer_mode", "skip_tokenizer_init", "trust_remote_code",
    "allowed_local_media_path", "tensor_parallel_size", "dtype", "quantization", "revision",
    "tokenizer_revision", "seed", "gpu_memory_utilization", "swap_space", "cpu_offload_gb",
    "enforce_eager", "max_seq_len_to_capture", "disable_custom_all_reduce",
    "disable_async_output_proc", "hf_overrides", "compilation_config",
]  # fmt: skip


def test_arguments_by_position_in_vllms_order(ckpt, llm):
    import inspect

    parameters = list(inspect.signature(LLM).parameters.values())
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == VLLM_ORDER
    # model, tokenizer, tokenizer_mode, skip_tokenizer_init, trust_remote_code,
    # allowed_local_media_path, tensor_parallel_size, dtype, quantization, revision,
    # tokenizer_revision, seed
    by_position = LLM(
        str(ckpt), str(ckpt), "auto", False, False, "", 1, "float32", None, None, None, 7,
        disable_log_stats=True, num_gpu_blocks_override=64,
    )  # fmt: skip
    engine = by_position.llm_engine
    assert engine.loaded.dtype == torch.float32
    assert engine.config.model_config.seed == 7
    expected = tokens(run(llm, PROMPTS, greedy(max_tokens=6)))
    assert tokens(run(by_position, PROMPTS, greedy(max_tokens=6))) == expected
    with pytest.raises(TypeError, match="multiple values for argument 'dtype'"):
        LLM(str(ckpt), None, "auto", False, False, "", 1, "float32", dtype="float16")


def test_load_formats(ckpt, llm, tmp_path):
    from safetensors.torch import load_file

    reference = tokens(run(llm, PROMPTS, greedy()))
    no_weights = copy_checkpoint(ckpt, tmp_path / "dummy", weights=False)
    dummy = build(no_weights, load_format="dummy")
    assert len(tokens(run(dummy, PROMPTS[0], greedy(max_tokens=4)))[0]) == 4

    pt_dir = copy_checkpoint(ckpt, tmp_path / "pt", weights=False)
    torch.save(load_file(ckpt / "model.safetensors"), pt_dir / "pytorch_model.bin")
    assert tokens(run(build(pt_dir, load_format="pt"), PROMPTS, greedy())) == reference
    assert tokens(run(build(pt_dir), PROMPTS, greedy())) == reference  # auto falls back to pt


def test_skip_tokenizer_init(ckpt, llm, tok):
    reference = tokens(run(llm, PROMPTS[0], greedy()))
    bare = build(ckpt, skip_tokenizer_init=True)
    assert bare.get_tokenizer() is None
    (out,) = run(bare, {"prompt_token_ids": tok.encode(PROMPTS[0])}, greedy())
    assert [out.outputs[0].token_ids] == reference
    assert not out.outputs[0].text
    with pytest.raises(ValueError, match="token ids"):
        run(bare, PROMPTS[0], greedy())
    assert not bare.llm_engine.has_unfinished_requests()


def test_bad_model_paths_and_architectures(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build(tmp_path / "missing")
    odd = copy_checkpoint(ckpt, tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["FooBarForCausalLM"]
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="FooBarForCausalLM") as info:
        build(odd)
    assert "LlamaForCausalLM" in str(info.value)


def test_generation_config_defaults(ckpt, llm, tmp_path):
    assert llm.get_default_sampling_params().temperature == 1.0
    tuned = copy_checkpoint(ckpt, tmp_path / "tuned")
    generation = json.loads((tuned / "generation_config.json").read_text())
    generation.update(temperature=0.6, top_p=0.9, do_sample=True)
    (tuned / "generation_config.json").write_text(json.dumps(generation))
    defaults = build(tuned).get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (0.6, 0.9)
    ignored = build(tuned, generation_config="vllm").get_default_sampling_params()
    assert (ignored.temperature, ignored.top_p) == (1.0, 1.0)


def test_generation_config_max_new_tokens_caps_every_request(ckpt, tmp_path):
    """max_new_tokens of --generation-config DIR, or of --override-generation-config, caps
    every request: the default params, a larger max_tokens, chat and beam search."""
    from pagedllm import BeamSearchParams

    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    asked = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for engine_args in (
        {"generation_config": str(folder)},
        {"override_generation_config": {"max_new_tokens": 3}},
    ):
        with build(ckpt, **engine_args) as llm:
            assert llm.get_default_sampling_params().max_tokens == 3
            assert [len(t) for t in tokens(run(llm, PROMPTS[:2], asked))] == [3, 3]
            assert len(tokens(run(llm, PROMPTS[0], greedy(max_tokens=2)))[0]) == 2
            (chat,) = llm.chat([{"role": "user", "content": "Hi"}], asked, use_tqdm=False)
            assert len(chat.outputs[0].token_ids) == 3
            beams = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
            (searched,) = llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], beams)
            assert {len(s.tokens) for s in searched.sequences} == {3 + 3}


def test_generation_config_layers_and_start_up_log(ckpt, tmp_path, caplog):
    """--override-generation-config goes over the model folder's generation_config.json,
    key by key; a key pagedllm does not read, or a value no request could take, is
    refused; the defaults in effect are logged once at start-up; an unreadable file of
    the model's own is skipped."""
    tuned = copy_checkpoint(ckpt, tmp_path / "tuned")
    generation = json.loads((tuned / "generation_config.json").read_text())
    generation.update(temperature=0.6, top_k=7, max_new_tokens=5)
    (tuned / "generation_config.json").write_text(json.dumps(generation))
    override = {"temperature": 0.3, "max_new_tokens": 4}
    with caplog.at_level(logging.INFO, logger="pagedllm.model"):
        llm = build(tuned, override_generation_config=override)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.3, 7, 4)
    lines = [r.getMessage() for r in caplog.records if "sampling defaults" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "temperature=0.3, top_k=7" in lines[0] and "at most 4" in lines[0], lines[0]
    assert "generation_config.json" in lines[0] and "--override-generation-config" in lines[0]
    llm.shutdown()
    with pytest.raises(ConfigError, match="temprature"):
        build(ckpt, override_generation_config={"temprature": 0.5})
    with pytest.raises(ConfigError, match="top_p"):
        build(ckpt, override_generation_config={"top_p": 0})
    with pytest.raises(ConfigError, match="no generation_config.json"):
        build(ckpt, generation_config=str(tmp_path / "nowhere"))
    # A model's own file that cannot be read is skipped (as vLLM), with a warning.
    (tuned / "generation_config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="pagedllm.model"), build(tuned) as broken:
        assert broken.get_default_sampling_params().temperature == 1.0
    assert any("sampling without it" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- shutdown


def _compile_workers() -> list:
    import psutil

    workers = []
    for process in psutil.Process().children():
        try:
            if "pagedllm.core.guided_worker" in " ".join(process.cmdline()):
                workers.append(process)
        except psutil.Error:  # an earlier test's worker, exited (a zombie until reaped)
            continue
    return workers


def test_shutdown_releases_the_engine(ckpt):
    import gc
    import weakref

    from pagedllm import GuidedDecodingParams

    llm = build(ckpt, guided_decoding_compile_workers=1)
    before = {p.pid for p in _compile_workers()}
    params = greedy(4, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert run(llm, "Hello", params)[0].outputs[0].text in ("yes", "no")
    workers = [p for p in _compile_workers() if p.pid not in before]
    assert workers  # a compile worker process serves this LLM
    engine = weakref.ref(llm.llm_engine)
    cache = weakref.ref(llm.llm_engine.runner.kv_caches[0])
    # What the engine built is kept out of the cyclic collector's walks while it runs.
    assert gc.get_freeze_count() > 0

    llm.shutdown()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert engine() is None and cache() is None  # the model and the KV cache are freed
    for worker in workers:
        worker.wait(timeout=10)
    with pytest.raises(EngineDeadError, match="shut down"):
        run(llm, "Hello", greedy())
    llm.shutdown()  # a second call does nothing


def test_llm_is_a_context_manager(ckpt):
    with build(ckpt) as llm:
        assert len(run(llm, "Hello", greedy(3))[0].outputs[0].token_ids) == 3
    with pytest.raises(EngineDeadError):
        llm.get_tokenizer()
