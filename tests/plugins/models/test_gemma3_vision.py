"""Gemma 3 with images (``Gemma3ForConditionalGeneration``) through ``LLM.generate``:
the prompt's token ids equal to transformers' ``Gemma3Processor``'s, greedy float32
tokens equal to transformers' ``generate`` on a tiny random checkpoint with real images
(one or two images a prompt, a batch with a text-only prompt, chunked prefill whose steps
never end inside an image, the prefix cache, preemption). An image's tokens attend to each
other both ways, as in transformers (these outputs differ where they attend causally)."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")

import torch
from tiny_gemma3_vision import (
    NUM_IMAGE_TOKENS,
    Gemma3Reference,
    StepRecordingScheduler,
    make_gemma3_vision,
    next_logprobs,
    split_items,
)
from tiny_llava import encoder_runs, llava_llm, make_image

from pagedllm import SamplingParams
from pagedllm.core.errors import ConfigError, InvalidRequestError

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
# As Gemma 3's chat template writes a user turn with an image: the processor's "\n\n"
# before the image joins the turn's "\n" (and after the second image, the prompt's "\n").
ONE = "<s><start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n<start_of_turn>model\n"
TWO = (
    "<s><start_of_turn>user\n<start_of_image> and <start_of_image>\nHow do they differ?"
    "<end_of_turn>\n<start_of_turn>model\n"
)
TEXT = "<s><start_of_turn>user\nWhat is a poem?<end_of_turn>\n<start_of_turn>model\n"
SYSTEM = "A chat between a curious human and an artificial intelligence assistant. "


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_gemma3_vision(tmp_path_factory.mktemp("gemma3_vision"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Gemma3Reference(checkpoint)


@pytest.fixture(scope="module")
def images():
    return [make_image(kind, 40 + kind, 36) for kind in range(4)]


def generate(llm, cases, params=GREEDY):
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": list(imgs)}} if imgs else text
        for text, imgs in cases
    ]
    return llm.generate(prompts, params, use_tqdm=False)


def check(reference, cases, outs, new_tokens=NEW_TOKENS):
    for (text, imgs), out in zip(cases, outs, strict=True):
        assert out.prompt_token_ids == reference.input_ids(text, imgs), text
        assert out.outputs[0].token_ids == reference.greedy(text, imgs, new_tokens), text


@pytest.fixture(scope="module")
def llm(checkpoint):
    return llava_llm(checkpoint, enable_prefix_caching=False)


def test_one_image_matches_transformers(llm, reference, images):
    cases = [(ONE, [images[0]])]
    (out,) = generate(llm, cases)
    check(reference, cases, [out])
    soft = reference.processor.tokenizer.image_token_id
    assert out.prompt_token_ids.count(soft) == NUM_IMAGE_TOKENS


def test_two_images_and_a_text_only_prompt_in_one_batch(llm, reference, images):
    cases = [(TWO, images[1:3]), (TEXT, []), (TWO, [images[2], images[1]]), (ONE, [images[3]])]
    check(reference, cases, generate(llm, cases))


def assert_attends_both_ways(llm, reference, prompt, image):
    """The next token's log-probabilities equal transformers' (an image's rows attending to
    the whole image), and differ from what causal image rows would give."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    (out,) = generate(llm, [(prompt, [image])], params)
    (given,) = out.outputs[0].logprobs
    both_ways = next_logprobs(reference, prompt, [image], causal=False)
    causal = next_logprobs(reference, prompt, [image], causal=True)
    ours = {token: logprob.logprob for token, logprob in given.items()}
    assert max(abs(lp - float(both_ways[t])) for t, lp in ours.items()) < 2e-4
    assert max(abs(lp - float(causal[t])) for t, lp in ours.items()) > 1e-3


def test_image_tokens_attend_to_each_other_both_ways(llm, reference, images):
    for image in images:
        assert_attends_both_ways(llm, reference, ONE, image)
        assert_attends_both_ways(llm, reference, SYSTEM + ONE, image)


def test_chunked_prefill_never_ends_a_step_inside_an_image(checkpoint, reference, images):
    # 24 tokens a step: an image (16 tokens, from position 19 of ONE) would straddle the
    # first step's end; the step ends before it instead and the next takes it whole.
    llm = llava_llm(
        checkpoint,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
        max_num_seqs=2,
        enable_prefix_caching=False,
        scheduler_cls=StepRecordingScheduler,
    )
    scheduler = llm.llm_engine.scheduler
    cases = [(ONE, [images[0]]), (TWO, images[1:3]), (SYSTEM + ONE, [images[3]])]
    items = {}
    for index, (text, imgs) in enumerate(cases):
        llm.llm_engine.add_request(
            str(index), {"prompt": text, "multi_modal_data": {"image": imgs}}, GREEDY
        )
        items[str(index)] = scheduler.requests[str(index)].features["multimodal"]
    outs = {}
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                outs[out.request_id] = out
    check(reference, cases, [outs[str(i)] for i in range(len(cases))])
    assert not split_items(scheduler.steps, items)
    # (the first step did stop short of the budget at the image)
    first = {rid: count for rid, start, count in scheduler.steps[0]}
    assert first["0"] == items["0"][0].offset < 24
    assert encoder_runs(llm)[0] == 4
    assert_attends_both_ways(llm, reference, SYSTEM + ONE, images[3])


def test_an_image_longer_than_a_step_is_refused(checkpoint, images):
    llm = llava_llm(checkpoint, enable_chunked_prefill=True, max_num_batched_tokens=12)
    with pytest.raises(InvalidRequestError) as refused:
        generate(llm, [(ONE, [images[0]])])
    assert "--max-num-batched-tokens" in refused.value.message
    assert refused.value.param == "multi_modal_data.image"


def test_prefix_cache_keys_image_blocks_by_the_image(checkpoint, reference, images):
    llm = llava_llm(checkpoint, enable_prefix_caching=True)
    prompt = SYSTEM + ONE
    (first,) = generate(llm, [(prompt, [images[0]])])
    soft = reference.processor.tokenizer.image_token_id
    offset = first.prompt_token_ids.index(soft)
    end = offset + NUM_IMAGE_TOKENS
    encoded = encoder_runs(llm)[0]
    # The same image (a second turn): its blocks come from the cache, a block boundary
    # inside the image included (the rest of the image attends to the cached part).
    (same,) = generate(llm, [(prompt, [images[0]])])
    assert same.num_cached_tokens >= end // 8 * 8 > offset
    # Another image behind the same placeholder tokens: only the text blocks before it.
    (other,) = generate(llm, [(prompt, [images[1]])])
    assert other.num_cached_tokens == offset // 8 * 8 > 0
    assert encoder_runs(llm)[0] == encoded + 1
    check(reference, [(prompt, [images[0]])] * 2 + [(prompt, [images[1]])], [first, same, other])
    # (the rows after the cached part of the image attended to it both ways)
    assert_attends_both_ways(llm, reference, prompt, images[0])


def test_preemption_recomputes_the_same_tokens(checkpoint, reference, images):
    llm = llava_llm(checkpoint, num_gpu_blocks_override=20, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
    cases = [(ONE, [images[i]]) for i in range(4)]
    outs = generate(llm, cases, params)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    check(reference, cases, outs, new_tokens=40)


def test_pan_and_scan_is_refused_by_name(llm, images):
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(
            {
                "prompt": ONE,
                "multi_modal_data": {"image": images[0]},
                "mm_processor_kwargs": {"do_pan_and_scan": True},
            },
            GREEDY,
            use_tqdm=False,
        )
    assert "do_pan_and_scan" in refused.value.message


def test_the_reference_attention_backend_attends_both_ways_too(
    checkpoint, reference, images, monkeypatch
):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "torch_sdpa")
    llm = llava_llm(checkpoint, enable_prefix_caching=True)
    assert llm.llm_engine.runner.attention_backend.name == "torch_sdpa"
    cases = [(TWO, images[:2]), (TEXT, []), (SYSTEM + ONE, [images[2]])]
    check(reference, cases, generate(llm, cases))
    assert_attends_both_ways(llm, reference, SYSTEM + ONE, images[2])  # (a prefix-cache hit)


def test_a_backend_without_bidirectional_spans_is_refused(checkpoint, monkeypatch):
    """The dummy plugin's attention backend (written from the contract): refused by name
    before the weights load (as the cuda device's Triton backend is)."""
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "dummy_attn")
    with pytest.raises(ConfigError, match="Gemma3ForConditionalGeneration attends.*dummy_attn"):
        llava_llm(checkpoint)


@pytest.mark.parametrize(
    "text",
    [
        "<start_of_image>",
        "<s>Look:<start_of_image><start_of_image>",
        "<s>a\n\n<start_of_image>\n\nb",
        "<s>\n<start_of_image>\n\n\n<start_of_image> two\n",
        " <start_of_image>x",
    ],
)
def test_the_processor_makes_transformers_token_ids(checkpoint, reference, images, text):
    import transformers

    from pagedllm.plugins.models.gemma3_processor import Gemma3Processor

    tokenizer = reference.processor.tokenizer
    processor = Gemma3Processor.from_model(
        str(checkpoint), transformers.AutoConfig.from_pretrained(checkpoint), tokenizer
    )
    count = text.count("<start_of_image>")
    given = tokenizer.encode(text, add_special_tokens=False)
    processed = processor.process(given, {"image": images[:count]}, {})
    expected = reference.processor(images=images[:count], text=text, add_special_tokens=False)
    assert processed.token_ids == expected["input_ids"][0]
    # Each item is its image's soft tokens (transformers' token_type_ids == 1).
    types = expected["token_type_ids"][0]
    assert [i for i, t in enumerate(types) if t == 1] == [
        p for item in processed.items for p in range(item.offset, item.offset + item.length)
    ]


def test_fp8_at_load_quantizes_the_text_model_only(checkpoint, images):
    # (the SigLIP tower and the projector stay float modules, as LLaVA's)
    llm = llava_llm(checkpoint, quantization="fp8")
    model = llm.llm_engine.loaded.model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    tower = ("vision_tower.", "multi_modal_projector.")
    floats = {p.dtype for name, p in model.named_parameters() if name.startswith(tower)}
    assert floats == {torch.float32}
    (out,) = generate(llm, [(ONE, [images[0]])])
    assert len(out.outputs[0].token_ids) == NEW_TOKENS
    llm.llm_engine.shutdown()
