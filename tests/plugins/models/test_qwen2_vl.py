"""Qwen2-VL and Qwen2.5-VL with images through ``LLM.generate``: greedy float32 tokens
equal to transformers' ``generate`` on tiny random checkpoints with real images of
different sizes (dynamic resolution: each image its own number of tokens) and M-RoPE
positions (an image's tokens placed by its grid, the text after it shifted), one or two
images a prompt, a batch beside a text-only prompt, chunked prefill (an image split over
steps), the prefix cache (the same image reuses its blocks, another does not) and
preemption."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")

import torch
import transformers
from tiny_llava import make_image
from tiny_qwen2_vl import IMAGE, Qwen2VLReference, make_qwen2_vl

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.plugins.models.qwen2_vl import span_positions
from pagedllm.plugins.models.qwen2_vl_processor import Qwen2VLProcessor

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
ONE = f"<|im_start|>user\n{IMAGE}What is this?<|im_end|>\n<|im_start|>assistant\n"
TWO = (
    f"<|im_start|>user\n{IMAGE} and {IMAGE}\nHow do they differ?<|im_end|>\n<|im_start|>assistant\n"
)
# A system line long enough to fill the first KV blocks with text alone.
SYSTEM = (
    "<|im_start|>system\nA chat between a curious human and an artificial intelligence.<|im_end|>\n"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Qwen2VLReference(checkpoint)


@pytest.fixture(scope="module")
def images():
    # Different sizes: 20, 21, 16 and 30 tokens (grids 4x5, 3x7, 4x4, 5x6).
    sizes = [(40, 36), (56, 24), (30, 30), (48, 40)]
    return [make_image(kind, width=w, height=h) for kind, (w, h) in enumerate(sizes)]


def build(checkpoint, **kwargs):
    kwargs.setdefault("num_gpu_blocks_override", 128)
    kwargs.setdefault("block_size", 8)
    return LLM(str(checkpoint), dtype="float32", disable_log_stats=True, **kwargs)


def encoder_runs(llm):
    (runner,) = [e for e in llm.llm_engine.runner.extensions if e.name == "multimodal"]
    return runner.num_encoded, runner.num_cache_hits


def generate(llm, cases, params=GREEDY):
    prompts = [{"prompt": text, "multi_modal_data": {"image": list(imgs)}} for text, imgs in cases]
    return llm.generate(prompts, params, use_tqdm=False)


def check(reference, cases, outs, new_tokens=NEW_TOKENS):
    for (text, imgs), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == reference.greedy(text, imgs, new_tokens), text


@pytest.fixture(scope="module")
def llm(checkpoint):
    return build(checkpoint, enable_prefix_caching=False)


def test_one_image_matches_transformers(llm, reference, images):
    (out,) = llm.generate(
        {"prompt": ONE, "multi_modal_data": {"image": images[0]}}, GREEDY, use_tqdm=False
    )
    assert out.outputs[0].token_ids == reference.greedy(ONE, [images[0]], NEW_TOKENS)
    # The placeholder became the image's tokens: its 8x10 patches merged 2x2.
    expected = reference.inputs(ONE, [images[0]])["input_ids"][0].tolist()
    assert out.prompt_token_ids == expected
    assert expected.count(reference.image_token_id) == 20


def test_two_images_of_different_sizes(llm, reference, images):
    cases = [(TWO, images[:2]), (TWO, [images[1], images[0]]), (TWO, images[2:])]
    check(reference, cases, generate(llm, cases))


def test_a_batch_beside_a_text_only_prompt(checkpoint, reference, images):
    llm = build(checkpoint, enable_prefix_caching=False)
    cases = [(ONE, [images[i]]) for i in range(4)] + [(TWO, images[1:3]), (ONE, [images[0]])]
    text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases] + [text],
        GREEDY,
        use_tqdm=False,
    )
    check(reference, cases, outs[:-1])
    assert outs[-1].outputs[0].token_ids == reference.greedy(text, [], NEW_TOKENS)
    encoded, hits = encoder_runs(llm)
    assert encoded == 4 and hits >= 2


def test_chunked_prefill_splits_an_image_over_steps(checkpoint, reference, images):
    # 7 tokens a step: an image's placeholders span three to five steps, each taking its
    # slice of the image's one encoder output and its rows' 3-D positions.
    llm = build(
        checkpoint,
        enable_chunked_prefill=True,
        max_num_batched_tokens=7,
        max_num_seqs=2,
        enable_prefix_caching=False,
    )
    cases = [(ONE, [images[0]]), (TWO, images[1:3]), (SYSTEM + ONE, [images[3]])]
    check(reference, cases, generate(llm, cases))
    encoded, hits = encoder_runs(llm)
    assert encoded == 4 and hits > 0


def test_prefix_cache_keys_image_blocks_by_the_image(checkpoint, reference, images):
    llm = build(checkpoint, enable_prefix_caching=True)
    prompt = SYSTEM + ONE
    (first,) = generate(llm, [(prompt, [images[0]])])
    encoded, _ = encoder_runs(llm)
    offset = first.prompt_token_ids.index(reference.image_token_id)
    end = offset + 20
    # The same image: its blocks (and the text's after it, whose positions the image
    # shifted) come from the cache, and it is not encoded again.
    (same,) = generate(llm, [(prompt, [images[0]])])
    assert same.num_cached_tokens >= end // 8 * 8 > offset
    assert encoder_runs(llm)[0] == encoded
    # Another image of the same size behind the same tokens: only the text blocks before
    # the image are shared.
    other_image = make_image(5, width=40, height=36)
    (other,) = generate(llm, [(prompt, [other_image])])
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens == offset // 8 * 8 > 0
    assert encoder_runs(llm)[0] == encoded + 1
    for out, image in ((first, images[0]), (same, images[0]), (other, other_image)):
        assert out.outputs[0].token_ids == reference.greedy(prompt, [image], NEW_TOKENS)
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_preemption_recomputes_the_same_tokens(checkpoint, reference, images):
    llm = build(checkpoint, num_gpu_blocks_override=14, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    cases = [(ONE, [images[i]]) for i in range(4)]
    outs = generate(llm, cases, params)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    check(reference, cases, outs, 32)


def test_placeholders_must_match_the_images(llm, images):
    with pytest.raises(InvalidRequestError) as refused:
        generate(llm, [(TWO, images[:1])])
    assert refused.value.param == "multi_modal_data.image"
    assert "1 image(s) for 2" in refused.value.message
    assert generate(llm, [(ONE, images[:1])])[0].outputs[0].token_ids


def test_span_positions_are_transformers_rope_index(reference, images):
    # Two images and text around them, every chunking of the prompt: the positions
    # transformers' get_rope_index gives.
    inputs = reference.inputs(TWO, images[:2])
    expected, delta = reference.model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    ids = inputs["input_ids"][0].tolist()
    grids = [(int(t), int(h) // 2, int(w) // 2) for t, h, w in inputs["image_grid_thw"]]
    items, start = [], 0
    for grid in grids:
        offset = ids.index(reference.image_token_id, start)
        length = grid[0] * grid[1] * grid[2]
        items.append((offset, length, grid))
        start = offset + length
    items = tuple(items)
    total = len(ids)
    assert torch.equal(span_positions(0, total, items), expected[:, 0])
    for cut in (1, 7, items[0][0] + 3, items[1][0] + 1, total - 1):
        head, tail = span_positions(0, cut, items), span_positions(cut, total - cut, items)
        assert torch.equal(torch.cat([head, tail], dim=1), expected[:, 0])
    # Past the prompt (decoding): the 1-D position plus the delta, in all three.
    assert span_positions(total + 4, 1, items)[:, 0].tolist() == [total + 4 + int(delta)] * 3


@pytest.fixture(scope="module")
def checkpoint_2_5(tmp_path_factory):
    return make_qwen2_vl(tmp_path_factory.mktemp("qwen2_5_vl"), kind="qwen2_5_vl")


def test_qwen2_5_vl_matches_transformers(checkpoint_2_5, images):
    # Its vision tower's windows (2x2 merged tokens) and full-attention block; chunked.
    reference = Qwen2VLReference(checkpoint_2_5, kind="qwen2_5_vl")
    llm = build(checkpoint_2_5, enable_chunked_prefill=True, max_num_batched_tokens=16)
    cases = [(ONE, [images[0]]), (TWO, images[1:3]), (TWO, [images[3], images[0]])]
    check(reference, cases, generate(llm, cases))


def test_an_image_processor_of_another_patch_grid_is_refused(checkpoint):
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    config.vision_config.spatial_merge_size = 4
    with pytest.raises(ConfigError, match="merge size and patch size"):
        Qwen2VLProcessor.from_model(str(checkpoint), config, None)
