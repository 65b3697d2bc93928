"""``--disable-chunked-mm-input`` on LLaVA (a causal model, whose images may be split):
a step never computes part of an image (TTTTIIIII|IIIII becomes TTTT, then IIIIIIIIII),
checked on the steps a real engine schedules, with transformers' greedy tokens; an image
longer than a step is refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")

from tiny_gemma3_vision import StepRecordingScheduler, split_items
from tiny_llava import LlavaReference, llava_llm, make_image, make_llava

from pagedllm import SamplingParams
from pagedllm.core.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
ONE = "USER: <image>\nWhat is this? ASSISTANT:"
TWO = "USER: <image> and <image>\nHow do they differ? ASSISTANT:"
SYSTEM = "A chat between a curious human and an artificial intelligence assistant. "


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return LlavaReference(checkpoint)


def run(llm, cases):
    """Outputs of ``cases`` (text, images) run together, and their requests' items."""
    engine = llm.llm_engine
    items = {}
    for index, (text, images) in enumerate(cases):
        engine.add_request(
            str(index), {"prompt": text, "multi_modal_data": {"image": images}}, GREEDY
        )
        items[str(index)] = engine.scheduler.requests[str(index)].features["multimodal"]
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return [outs[str(i)] for i in range(len(cases))], items


@pytest.mark.parametrize("whole", [False, True])
def test_steps_end_before_an_image_that_does_not_fit(checkpoint, reference, whole):
    images = [make_image(kind) for kind in range(4)]
    llm = llava_llm(
        checkpoint,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        max_num_seqs=2,
        enable_prefix_caching=False,
        disable_chunked_mm_input=whole,
        scheduler_cls=StepRecordingScheduler,
    )
    cases = [(SYSTEM + ONE, [images[0]]), (TWO, images[1:3]), (ONE, [images[3]])]
    outs, items = run(llm, cases)
    for (text, imgs), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == reference.greedy(text, imgs, 6), text
    split = split_items(llm.llm_engine.scheduler.steps, items)
    # (without the flag the same prompts do split images: the check can fail)
    assert bool(split) is not whole, split
    if whole:
        # A step of the first prompt ended at its image, with room left in the step.
        offset = items["0"][0].offset
        assert any(
            rid == "0" and start + count == offset and count < 32
            for step in llm.llm_engine.scheduler.steps
            for rid, start, count in step
        )


def test_an_image_longer_than_a_step_is_refused(checkpoint):
    llm = llava_llm(
        checkpoint,
        enable_chunked_prefill=True,
        max_num_batched_tokens=20,
        disable_chunked_mm_input=True,
    )
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate({"prompt": ONE, "multi_modal_data": {"image": make_image(0)}}, GREEDY)
    assert "--disable-chunked-mm-input" in refused.value.message
    # The engine goes on with prompts that fit.
    assert llm.generate("USER: hello ASSISTANT:", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
