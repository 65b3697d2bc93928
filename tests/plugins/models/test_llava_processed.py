"""A multimodal prompt's processed form (``LLMEngine.prepare_prompt``: images preprocessed
off the engine thread, as the server does it) pickles, and the engine takes it for the same
greedy tokens as transformers'; the engine still checks it (``--limit-mm-per-prompt``, its
token ids, the raw keys beside it) and names what is wrong."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("PIL")

from tiny_llava import (
    IMAGE_SIZE,
    LlavaReference,
    encoder_runs,
    llava_llm,
    make_image,
)

from pagedllm import SamplingParams
from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.interfaces.multimodal import ProcessedPrompt
from pagedllm.features.multimodal import PROCESSED_KEY

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
ONE = "USER: <image>\nWhat is this? ASSISTANT:"
TWO = "USER: <image> and <image>\nHow do they differ? ASSISTANT:"


@pytest.fixture(scope="module")
def llm(llava_checkpoint):
    return llava_llm(
        llava_checkpoint, enable_prefix_caching=False, limit_mm_per_prompt={"image": 1}
    )


def tokens(llm, prompt):
    (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    return out.outputs[0].token_ids


def test_a_prepared_prompt_pickles_and_generates_transformers_tokens(llm, llava_checkpoint):
    image = make_image(1)
    engine = llm.llm_engine
    raw = {"prompt": ONE, "multi_modal_data": {"image": image}}
    assert engine.needs_preparing(raw)
    assert not engine.needs_preparing({"prompt": ONE})
    prepared = engine.prepare_prompt(raw, GREEDY)
    assert set(prepared) == {"prompt", "prompt_token_ids", PROCESSED_KEY}
    processed = prepared[PROCESSED_KEY]
    assert isinstance(processed, ProcessedPrompt)
    assert prepared["prompt_token_ids"] == processed.token_ids
    (item,) = processed.items
    assert tuple(item.inputs.shape[-2:]) == (IMAGE_SIZE, IMAGE_SIZE)  # its pixels
    # (what a data-parallel replica or another process would receive)
    restored = pickle.loads(pickle.dumps(prepared))
    encoded_before = encoder_runs(llm)[0]
    (out,) = llm.generate(restored, GREEDY, use_tqdm=False)
    assert encoder_runs(llm)[0] == encoded_before + 1
    assert out.prompt == ONE
    assert out.prompt_token_ids == processed.token_ids
    expected = LlavaReference(llava_checkpoint).greedy(ONE, [image], NEW_TOKENS)
    assert out.outputs[0].token_ids == expected
    assert tokens(llm, raw) == expected  # (the raw form, processed on this thread)


def test_the_engine_checks_a_processed_prompt(llm):
    images = [make_image(0), make_image(2)]
    engine = llm.llm_engine
    processor = engine.extensions["multimodal"].processor
    token_ids = engine.tokenizer.encode(TWO)
    two = processor.process(token_ids, {"image": images}, {})
    with pytest.raises(InvalidRequestError, match="--limit-mm-per-prompt") as info:
        llm.generate(
            {"prompt_token_ids": two.token_ids, PROCESSED_KEY: two}, GREEDY, use_tqdm=False
        )
    assert info.value.param == "multi_modal_data.image"
    # (the limit is checked before any processing where the images come raw)
    with pytest.raises(InvalidRequestError, match="--limit-mm-per-prompt"):
        engine.prepare_prompt({"prompt": TWO, "multi_modal_data": {"image": images}}, GREEDY)
    one = engine.prepare_prompt({"prompt": ONE, "multi_modal_data": {"image": images[0]}}, GREEDY)
    processed = one[PROCESSED_KEY]
    bad = [
        ({**one, "prompt_token_ids": processed.token_ids[1:]}, "prompt_token_ids"),
        ({**one, "multi_modal_data": {"image": images[0]}}, "multi_modal_data"),
        ({**one, PROCESSED_KEY: {"token_ids": []}}, PROCESSED_KEY),
    ]
    for prompt, param in bad:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(prompt, GREEDY, use_tqdm=False)
        assert info.value.param == param, info.value
    with pytest.raises(InvalidRequestError, match="cannot be cut"):
        llm.generate(one, SamplingParams(max_tokens=2, truncate_prompt_tokens=4), use_tqdm=False)
