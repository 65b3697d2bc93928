"""LLaVA-1.5's multimodal settings do what they say: ``--limit-mm-per-prompt`` is enforced
by the engine, ``--mm-processor-kwargs`` (and a prompt's ``mm_processor_kwargs``) reach the
image processor, ``--disable-mm-preprocessor-cache`` stops one request reusing another's
encoder output; ``LLM.chat`` takes image parts (data URL, file, PIL image). Greedy float32
tokens equal to transformers' on the same processed prompt."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")

from image_fixtures import data_url, png_of
from tiny_llava import encoder_runs, llava_llm, make_image

from pagedllm import SamplingParams
from pagedllm.core.errors import InvalidRequestError

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
ONE = "USER: <image>\nWhat is this? ASSISTANT:"
TWO = "USER: <image> and <image>\nHow do they differ? ASSISTANT:"
RAW = {"do_normalize": False}


@pytest.fixture(scope="module")
def images():
    return [make_image(kind) for kind in range(3)]


def build(llava_checkpoint, **kwargs):
    kwargs.setdefault("enable_prefix_caching", False)
    return llava_llm(llava_checkpoint, **kwargs)


def tokens(llm, prompt):
    (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    return out.outputs[0].token_ids


@pytest.fixture(scope="module")
def llm(llava_checkpoint, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    return build(
        llava_checkpoint, allowed_local_media_path=str(media), limit_mm_per_prompt={"image": 1}
    )


def test_the_engine_enforces_limit_mm_per_prompt(llm, images):
    prompt = {"prompt": TWO, "multi_modal_data": {"image": images[:2]}}
    with pytest.raises(InvalidRequestError, match="--limit-mm-per-prompt"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    # (one image is within the limit)
    assert tokens(llm, {"prompt": ONE, "multi_modal_data": {"image": images[0]}})


def test_mm_processor_kwargs_reach_the_image_processor(
    llava_checkpoint, llm, llava_reference, images
):
    expected = llava_reference.greedy(ONE, [images[0]], NEW_TOKENS, **RAW)
    assert expected != llava_reference.greedy(
        ONE, [images[0]], NEW_TOKENS
    )  # (a test that can fail)
    # The prompt's options, then the engine's flag.
    prompt = {"prompt": ONE, "multi_modal_data": {"image": images[0]}}
    assert tokens(llm, {**prompt, "mm_processor_kwargs": RAW}) == expected
    # (other options make another encoder output: not the cached one of the default)
    assert tokens(llm, prompt) == llava_reference.greedy(ONE, [images[0]], NEW_TOKENS)
    flagged = build(llava_checkpoint, mm_processor_kwargs=RAW)
    assert tokens(flagged, prompt) == expected
    with pytest.raises(InvalidRequestError, match="mm_processor_kwargs"):
        tokens(flagged, {**prompt, "mm_processor_kwargs": {"no_such_option": 1}})
    with pytest.raises(InvalidRequestError, match="mm_processor_kwargs"):
        tokens(flagged, {**prompt, "mm_processor_kwargs": "do_normalize"})


def test_disable_mm_preprocessor_cache_encodes_each_request_again(llava_checkpoint, images):
    prompt = {"prompt": ONE, "multi_modal_data": {"image": images[1]}}
    shared = build(llava_checkpoint)
    tokens(shared, prompt)
    tokens(shared, prompt)
    assert encoder_runs(shared)[0] == 1
    # 10 tokens a step: the image's 25 placeholders span several steps, which still take
    # slices of the request's one encoder output.
    alone = build(
        llava_checkpoint,
        disable_mm_preprocessor_cache=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=10,
    )
    first = tokens(alone, prompt)
    assert encoder_runs(alone)[0] == 1 and encoder_runs(alone)[1] > 0
    assert tokens(alone, prompt) == first
    assert encoder_runs(alone)[0] == 2


def test_chat_takes_image_parts(llm, llava_reference, images, tmp_path):
    path = llm.llm_engine.config.model_config.allowed_local_media_path
    from pathlib import Path

    file = Path(path) / "picture.png"
    images[2].save(file)
    parts = [
        (images[0], {"type": "image_url", "image_url": {"url": data_url(png_of(images[0]))}}),
        (images[1], {"type": "image_pil", "image_pil": images[1]}),
        (images[2], {"type": "image_url", "image_url": {"url": file.as_uri()}}),
    ]
    for image, part in parts:
        messages = [{"role": "user", "content": [{"type": "text", "text": "What?"}, part]}]
        (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
        rendered = llava_reference.render(
            [{"role": "user", "content": [{"type": "text", "text": "What?"}, {"type": "image"}]}]
        )
        assert out.outputs[0].token_ids == llava_reference.greedy(rendered, [image], NEW_TOKENS), (
            part
        )
    outside = {"type": "image_url", "image_url": {"url": (tmp_path / "x.png").as_uri()}}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.image_url"):
        llm.chat([{"role": "user", "content": [outside]}], GREEDY, use_tqdm=False)
    two = [part for _, part in parts[:2]]
    with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
        llm.chat([{"role": "user", "content": two}], GREEDY, use_tqdm=False)
