"""LLaVA-1.5 with images through ``LLM.generate``: greedy float32 tokens equal to
transformers' ``generate`` on a tiny random checkpoint with real images, one or two
images a prompt, batches of different images, chunked prefill (an image's placeholders
split over steps), the prefix cache (the same image reuses its blocks, another does not)
and preemption; the vision encoder runs once per image."""

from __future__ import annotations

import types
from typing import ClassVar

import pytest

pytest.importorskip("PIL")

from tiny_llava import (
    NUM_IMAGE_TOKENS,
    encoder_runs,
    llava_llm,
    make_image,
)
from tiny_models import make_checkpoint

from pagedllm import LLM, SamplingParams, hookimpl
from pagedllm.core.beam_search import BeamSearchParams
from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.interfaces import content_hash
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.plugins.models.llava_processor import LlavaProcessor

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
ONE = "USER: <image>\nWhat is this? ASSISTANT:"
TWO = "USER: <image> and <image>\nHow do they differ? ASSISTANT:"
# A system line long enough to fill the first KV blocks with text alone.
SYSTEM = "A chat between a curious human and an artificial intelligence assistant. "


@pytest.fixture(scope="module")
def images():
    return [make_image(kind) for kind in range(4)]


build = llava_llm


def generate(llm, cases):
    prompts = [{"prompt": text, "multi_modal_data": {"image": list(imgs)}} for text, imgs in cases]
    return llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def llm(llava_checkpoint):
    return build(llava_checkpoint, enable_prefix_caching=False)


def test_one_image_matches_transformers(llm, llava_reference, images):
    (out,) = llm.generate(
        {"prompt": ONE, "multi_modal_data": {"image": images[0]}}, GREEDY, use_tqdm=False
    )
    assert out.outputs[0].token_ids == llava_reference.greedy(ONE, [images[0]], NEW_TOKENS)
    # The placeholder became the image's 25 feature tokens.
    image_token = llava_reference.processor.tokenizer.convert_tokens_to_ids("<image>")
    assert out.prompt_token_ids.count(image_token) == NUM_IMAGE_TOKENS
    assert (
        out.prompt_token_ids
        == llava_reference.processor(images=[images[0]], text=ONE, return_tensors="pt")[
            "input_ids"
        ][0].tolist()
    )


def test_two_images_in_one_prompt(llm, llava_reference, images):
    (out,) = generate(llm, [(TWO, images[1:3])])
    assert out.outputs[0].token_ids == llava_reference.greedy(TWO, images[1:3], NEW_TOKENS)
    (swapped,) = generate(llm, [(TWO, [images[2], images[1]])])
    assert swapped.outputs[0].token_ids == llava_reference.greedy(
        TWO, [images[2], images[1]], NEW_TOKENS
    )


def test_a_batch_of_different_images_encodes_each_once(llava_checkpoint, llava_reference, images):
    llm = build(llava_checkpoint, enable_prefix_caching=False)
    cases = [(ONE, [images[i]]) for i in range(4)] + [(ONE, [images[0]]), (TWO, images[:2])]
    outs = generate(llm, cases)
    for (text, imgs), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == llava_reference.greedy(text, imgs, NEW_TOKENS), text
    # Four distinct images: each encoded once, the repeats taken from the encoder cache.
    encoded, hits = encoder_runs(llm)
    assert encoded == 4 and hits >= 2
    # A text-only prompt runs beside them.
    (text_only,) = llm.generate("USER: hello ASSISTANT:", GREEDY, use_tqdm=False)
    assert text_only.outputs[0].token_ids == llava_reference.greedy(
        "USER: hello ASSISTANT:", [], NEW_TOKENS
    )


def test_chunked_prefill_splits_an_image_over_steps(llava_checkpoint, llava_reference, images):
    # 10 tokens a step: each image's 25 placeholders span three or four steps, each
    # taking its slice of the image's one encoder output.
    llm = build(
        llava_checkpoint,
        enable_chunked_prefill=True,
        max_num_batched_tokens=10,
        max_num_seqs=2,
        enable_prefix_caching=False,
    )
    cases = [(ONE, [images[0]]), (TWO, images[1:3]), (SYSTEM + ONE, [images[3]])]
    outs = generate(llm, cases)
    for (text, imgs), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == llava_reference.greedy(text, imgs, NEW_TOKENS), text
    encoded, hits = encoder_runs(llm)
    assert encoded == 4  # (once per image, not once per chunk)
    assert hits > 0  # (the later chunks' slices)


def test_prefix_cache_keys_image_blocks_by_the_image(llava_checkpoint, llava_reference, images):
    llm = build(llava_checkpoint, enable_prefix_caching=True)
    prompt = SYSTEM + ONE
    (first,) = generate(llm, [(prompt, [images[0]])])
    encoded, _ = encoder_runs(llm)
    offset = first.prompt_token_ids.index(
        llava_reference.processor.tokenizer.convert_tokens_to_ids("<image>")
    )
    end = offset + NUM_IMAGE_TOKENS
    # The same image: its blocks come from the cache (the image's every full block), and
    # it is not encoded again.
    (same,) = generate(llm, [(prompt, [images[0]])])
    assert same.num_cached_tokens >= end // 8 * 8 > offset
    assert encoder_runs(llm)[0] == encoded
    # Another image behind the same placeholder tokens: only the text blocks before the
    # image are shared.
    (other,) = generate(llm, [(prompt, [images[1]])])
    assert other.num_cached_tokens == offset // 8 * 8 > 0
    assert encoder_runs(llm)[0] == encoded + 1
    for out, image in ((first, images[0]), (same, images[0]), (other, images[1])):
        assert out.outputs[0].token_ids == llava_reference.greedy(prompt, [image], NEW_TOKENS)
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_preemption_recomputes_the_same_tokens(llava_checkpoint, llava_reference, images):
    llm = build(llava_checkpoint, num_gpu_blocks_override=16, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
    cases = [(ONE, [images[i]]) for i in range(4)]
    prompts = [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for (text, imgs), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == llava_reference.greedy(text, imgs, 40)


def _prompt(data, text=ONE, **extra):
    return lambda image: {"prompt": text, "multi_modal_data": data(image), **extra}


@pytest.mark.parametrize(
    ("make_prompt", "param", "words"),
    [
        (_prompt(lambda i: {"image": [i]}, text=TWO), "multi_modal_data.image", "1 image(s) for 2"),
        (_prompt(lambda i: {"image": b"png"}), "multi_modal_data.image[0]", "not bytes"),
        # A placeholder without its image (a dict, or a plain string).
        (_prompt(lambda i: None), "multi_modal_data.image", "0 image(s) for 1"),
        (lambda i: ONE, "multi_modal_data.image", "0 image(s) for 1"),
        (_prompt(lambda i: {"video": i}), "multi_modal_data.video", "takes image only"),
        (_prompt(lambda i: i), "multi_modal_data", "a dict"),
        (
            _prompt(lambda i: {"image": i}, mm_processor_kwargs={"no_such_option": 2}),
            "mm_processor_kwargs",
            "do not apply",
        ),
        (
            _prompt(lambda i: {"image": i}, multi_modal_uuids={"image": ["a", "b"]}),
            "multi_modal_uuids.image",
            "2 ids for 1 items",
        ),
    ],
)
def test_bad_multimodal_prompts_are_refused_by_name(llm, images, make_prompt, param, words):
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(make_prompt(images[0]), GREEDY, use_tqdm=False)
    assert refused.value.param == param and words in refused.value.message
    # The engine goes on.
    assert generate(llm, [(ONE, [images[0]])])[0].outputs[0].token_ids


def test_truncating_a_prompt_with_images_is_refused(llm, images):
    params = SamplingParams(max_tokens=2, truncate_prompt_tokens=5)
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate({"prompt": ONE, "multi_modal_data": {"image": images[0]}}, params)
    assert refused.value.param == "truncate_prompt_tokens"


def test_beam_search_refuses_images(llm, images):
    prompt = {"prompt": ONE, "multi_modal_data": {"image": images[0]}}
    with pytest.raises(InvalidRequestError) as refused:
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=2))
    assert refused.value.param == "multi_modal_data"


def test_a_text_model_refuses_images(tmp_path, images):
    llm = LLM(str(make_checkpoint(tmp_path, "llama")), dtype="float32", disable_log_stats=True)
    prompt = {"prompt": "hello", "multi_modal_data": {"image": images[0]}}
    with pytest.raises(InvalidRequestError, match="this model takes text only") as refused:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert refused.value.param == "multi_modal_data"


def test_given_uuids_are_the_images_identity(llava_checkpoint, images):
    # vLLM's multi_modal_uuids: the caller's id stands for the image (its encoder output
    # and its KV blocks), as a content hash the engine would compute otherwise.
    llm = build(llava_checkpoint, enable_prefix_caching=False)
    for image in images[:2]:
        prompt = {
            "prompt": ONE,
            "multi_modal_data": {"image": image},
            "multi_modal_uuids": {"image": ["photo-1"]},
        }
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert encoder_runs(llm)[0] == 1


def test_content_hash_is_the_pixels_mode_and_size(images):
    image = images[0]
    assert content_hash(image) == content_hash(image.copy())
    assert content_hash(image) != content_hash(images[1])
    assert content_hash(image) != content_hash(image.convert("RGBA"))
    assert content_hash(image) != content_hash(make_image(0, width=36, height=40))


class CountingProcessor(LlavaProcessor):
    prompts: ClassVar[list[int]] = []

    def process(self, token_ids, data, hashes):
        self.prompts.append(len(data["image"]))
        return super().process(token_ids, data, hashes)


def test_a_plugin_registers_the_multimodal_processor(llava_checkpoint, llava_reference, images):
    plugin = types.ModuleType("vision_plugin")

    @hookimpl
    def pagedllm_register_multimodal_processors(registry):
        registry.add("LlavaForConditionalGeneration", CountingProcessor, override=True)

    plugin.pagedllm_register_multimodal_processors = pagedllm_register_multimodal_processors
    pm = make_plugin_manager(extra_plugins=[("vision_plugin", plugin)])
    llm = build(llava_checkpoint, plugin_manager=pm)
    (out,) = generate(llm, [(TWO, images[:2])])
    assert CountingProcessor.prompts == [2]
    assert out.outputs[0].token_ids == llava_reference.greedy(TWO, images[:2], NEW_TOKENS)
