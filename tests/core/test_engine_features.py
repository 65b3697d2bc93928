"""Engine options that change how the engine is built: refusals of options that would
do nothing, --scheduler-cls, a plugin's attention backend, the local HF cache."""

from __future__ import annotations

import shutil

import pytest
from tiny_models import make_checkpoint

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.core.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
PROMPT = {"prompt_token_ids": [10, 20, 30, 40, 50, 60, 70]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def build(model, **kwargs):
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return LLM(str(model), dtype="float32", disable_log_stats=True, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(task="classify"), "--task classify: LlamaForCausalLM serves generate, embed"),
        (dict(task="transcription"), "--task transcription: not supported"),
        (dict(config_format="mistral"), "--config-format mistral: --load-format auto"),
        (dict(logits_processor_pattern=".*"), "--logits-processor-pattern"),
        (dict(swap_space=8), "--swap-space=8: pagedllm never swaps"),
        (dict(gpu_memory_utilization=0.5), "does not apply to the cpu device"),
        (dict(preemption_mode="swap"), "--preemption-mode swap is not supported"),
        (
            dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
            "--max-num-batched-tokens=64 is smaller than --max-model-len",
        ),
        (dict(scheduler_cls="no.such.Module"), "--scheduler-cls no.such.Module: cannot import"),
        (dict(scheduler_cls="collections.OrderedDict"), "not a subclass"),
        (dict(max_model_len=100000), "larger than the model's context length"),
    ],
)
def test_options_that_cannot_work_are_refused(checkpoint, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        build(checkpoint, **kwargs)


def test_guided_decoding_as_a_dict_and_without_backends(checkpoint):
    llm = build(checkpoint)
    params = SamplingParams(max_tokens=5, guided_decoding={"regex": "a{5}"})
    assert llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text == "aaaaa"
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['regexp'\]"):
        llm.generate(PROMPT, SamplingParams(guided_decoding={"regexp": "a"}), use_tqdm=False)
    # With every guided-decoding plugin disabled (ours and the dummy plugin's), its options
    # would do nothing: refused.
    pm = make_plugin_manager(env={"PAGEDLLM_DISABLED_PLUGINS": "pagedllm.guided,dummy"})
    with pytest.raises(ConfigError, match="--guided-decoding-disable-fallback: no guided"):
        build(checkpoint, plugin_manager=pm, guided_decoding_disable_fallback=True)


class CountingScheduler(Scheduler):
    """A user's scheduler: the default one, counting its steps."""

    steps = 0

    def schedule(self):
        type(self).steps += 1
        return super().schedule()


def test_scheduler_cls_loads_a_subclass(checkpoint):
    CountingScheduler.steps = 0
    llm = build(checkpoint, scheduler_cls=f"{__name__}.CountingScheduler")
    assert type(llm.llm_engine.scheduler) is CountingScheduler
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert CountingScheduler.steps >= 6
    # vLLM's default name means the built-in scheduler.
    default = build(checkpoint, scheduler_cls="vllm.core.scheduler.Scheduler")
    assert type(default.llm_engine.scheduler) is Scheduler


def test_scheduler_cls_takes_the_class(checkpoint):
    """vLLM's ``scheduler_cls`` "can be a class directly": used as is, also one that no
    dotted path reaches (defined in a function); a class that is no Scheduler is refused."""

    class LocalScheduler(CountingScheduler):
        pass

    LocalScheduler.steps = 0
    llm = build(checkpoint, scheduler_cls=LocalScheduler)
    assert type(llm.llm_engine.scheduler) is LocalScheduler
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert LocalScheduler.steps >= 6
    with pytest.raises(ConfigError, match=r"--scheduler-cls builtins.dict: not a subclass"):
        build(checkpoint, scheduler_cls=dict)


def test_device_plugin_brings_its_attention_backend(checkpoint):
    from pagedllm_dummy_plugin.attention import CountingBackend

    reference = build(checkpoint).generate(PROMPT, GREEDY, use_tqdm=False)
    CountingBackend.calls = 0
    llm = build(checkpoint, device="dummydev")
    assert type(llm.llm_engine.runner.attention_backend) is CountingBackend
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    # 2 layers x 6 steps went through the plugin's backend, with the same result.
    assert CountingBackend.calls == 12
    assert out[0].outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_hub_id_resolved_offline_from_the_local_cache(checkpoint, tmp_path):
    cache = tmp_path / "hub"
    commit = "0123abcd" * 5
    snapshot = cache / "models--someorg--tiny-llama" / "snapshots" / commit
    shutil.copytree(checkpoint, snapshot)
    (cache / "models--someorg--tiny-llama" / "refs").mkdir()
    (cache / "models--someorg--tiny-llama" / "refs" / "main").write_text(commit)
    expected = build(checkpoint).generate(PROMPT, GREEDY, use_tqdm=False)
    for revision in (None, "main", commit):
        llm = build("someorg/tiny-llama", download_dir=str(cache), revision=revision)
        out = llm.generate(PROMPT, GREEDY, use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    with pytest.raises(ConfigError, match="at revision v9.*does not download"):
        build("someorg/tiny-llama", download_dir=str(cache), revision="v9")
    with pytest.raises(ConfigError, match="neither a local path nor in"):
        build("someorg/other-model", download_dir=str(cache))


def test_disable_sliding_window_caps_the_context(tmp_path):
    mistral = make_checkpoint(tmp_path / "mistral", "mistral")
    llm = build(mistral, disable_sliding_window=True)
    # The tiny Mistral's window is 12 tokens: the context is capped to it.
    assert llm.llm_engine.max_model_len == 12
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 9
    assert out[0].outputs[0].finish_reason == "length"


def test_prompt_logprobs_survive_preemption(checkpoint):
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40, prompt_logprobs=2)
    calm = build(checkpoint).generate(prompts, params, use_tqdm=False)
    tight = build(checkpoint, num_gpu_blocks_override=12, block_size=8)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    for a, b in zip(calm, squeezed, strict=True):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids) == 30
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-5 for t in pa)
