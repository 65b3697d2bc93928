"""Idefics3 and SmolVLM with images through ``LLM.generate``: greedy float32 tokens equal to
transformers' ``generate`` on tiny random checkpoints with real images split into 2x2 crops
and the global image; the prompt (the crops' row/column tokens) and the pixels equal
transformers' processor's; two images a prompt, a batch with a text-only prompt, chunked
prefill (chunk boundaries inside crops), the prefix cache (the same image reuses its
blocks, another does not), preemption, and an image processor option."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")

import torch
import transformers
from tiny_idefics3 import IMAGE_SEQ_LEN, Idefics3Reference, make_idefics3
from tiny_llava import encoder_runs, llava_llm, make_image

from pagedllm import SamplingParams
from pagedllm.core.errors import InvalidRequestError
from pagedllm.plugins.models.idefics3_processor import Idefics3Processor
from pagedllm.plugins.models.idefics3_vision import Idefics3VisionTransformer

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
ONE = "User:<image>What is this?<end_of_utterance>\nAssistant:"
TWO = "User:<image> and <image>How do they differ?<end_of_utterance>\nAssistant:"
SYSTEM = "A chat between a curious human and an artificial intelligence assistant. "
# 40x36 pixels: 2x2 crops and the global image (5 x 4 image tokens).
CROPS = 5


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, kind):
    return make_idefics3(tmp_path_factory.mktemp(kind), kind, seed={"idefics3": 0}.get(kind, 1))


@pytest.fixture(scope="module")
def reference(checkpoint, kind):
    return Idefics3Reference(checkpoint, kind)


@pytest.fixture(scope="module")
def images():
    return [make_image(kind) for kind in range(4)]


def build(checkpoint, **kwargs):
    kwargs.setdefault("enable_prefix_caching", False)
    return llava_llm(checkpoint, **kwargs)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return build(checkpoint)


def generate(llm, cases, params=GREEDY):
    prompts = [{"prompt": text, "multi_modal_data": {"image": list(imgs)}} for text, imgs in cases]
    return llm.generate(prompts, params, use_tqdm=False)


def test_the_prompt_and_pixels_are_transformers(checkpoint, reference, images):
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    processor = Idefics3Processor.from_model(str(checkpoint), config, tokenizer)
    token_ids = tokenizer.encode(TWO)
    pair = [images[0], make_image(1, width=60, height=20)]  # (2x2 and 1x2 crops)
    processed = processor.process(token_ids, {"image": pair}, {})
    expected = reference.inputs(TWO, pair)
    assert processed.token_ids == expected["input_ids"][0].tolist()
    assert len(processed.items) == CROPS + 3
    pixels = torch.cat([item.inputs[0] for item in processed.items])
    masks = torch.cat([item.inputs[1] for item in processed.items])
    assert torch.equal(pixels, expected["pixel_values"][0])
    assert torch.equal(masks, expected["pixel_attention_mask"][0].bool())
    for item in processed.items:
        run = processed.token_ids[item.offset : item.offset + item.length]
        assert run == [config.image_token_id] * IMAGE_SEQ_LEN


def test_one_image_matches_transformers(llm, reference, images):
    (out,) = generate(llm, [(ONE, [images[0]])])
    assert out.outputs[0].token_ids == reference.greedy(ONE, [images[0]], NEW_TOKENS)
    assert out.prompt_token_ids == reference.inputs(ONE, [images[0]])["input_ids"][0].tolist()


def test_two_images_in_one_prompt(llm, reference, images):
    (out,) = generate(llm, [(TWO, images[1:3])])
    assert out.outputs[0].token_ids == reference.greedy(TWO, images[1:3], NEW_TOKENS)
    (swapped,) = generate(llm, [(TWO, [images[2], images[1]])])
    assert swapped.outputs[0].token_ids == reference.greedy(TWO, [images[2], images[1]], NEW_TOKENS)


def test_a_batch_with_a_text_only_prompt(checkpoint, reference, images):
    llm = build(checkpoint)
    wide = make_image(3, width=60, height=20)
    cases = [(ONE, [images[0]]), (ONE, [wide]), (TWO, images[:2]), (ONE, [images[0]])]
    prompts = [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases]
    prompts.insert(1, "User: hello<end_of_utterance>\nAssistant:")
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    text_only = outs.pop(1)
    for (text, imgs), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == reference.greedy(text, imgs, NEW_TOKENS), text
    assert text_only.outputs[0].token_ids == reference.greedy(
        "User: hello<end_of_utterance>\nAssistant:", [], NEW_TOKENS
    )
    # Each distinct crop encoded once: images[0] (5 crops), the wide one (3), images[1].
    assert encoder_runs(llm)[0] == CROPS + 3 + CROPS


def test_chunked_prefill_splits_crops_over_steps(checkpoint, reference, images):
    # 6 tokens a step: boundaries fall inside the crops' 4-token runs.
    llm = build(checkpoint, enable_chunked_prefill=True, max_num_batched_tokens=6, max_num_seqs=2)
    cases = [(ONE, [images[0]]), (TWO, images[1:3]), (SYSTEM + ONE, [images[3]])]
    outs = generate(llm, cases)
    for (text, imgs), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == reference.greedy(text, imgs, NEW_TOKENS), text
    encoded, hits = encoder_runs(llm)
    assert encoded == 4 * CROPS  # (once per crop, not once per chunk)
    assert hits > 0


def test_prefix_cache_keys_image_blocks_by_the_image(checkpoint, reference, images):
    llm = build(checkpoint, enable_prefix_caching=True)
    prompt = SYSTEM + ONE
    (first,) = generate(llm, [(prompt, [images[0]])])
    encoded, _ = encoder_runs(llm)
    image_token = reference.processor.tokenizer.convert_tokens_to_ids("<image>")
    ids = first.prompt_token_ids
    offset = ids.index(image_token)
    end = len(ids) - ids[::-1].index(image_token)
    (same,) = generate(llm, [(prompt, [images[0]])])
    assert same.num_cached_tokens >= end // 8 * 8 > offset
    assert encoder_runs(llm)[0] == encoded
    # Another image behind the same tokens: only the text blocks before its first crop.
    (other,) = generate(llm, [(prompt, [images[1]])])
    assert other.num_cached_tokens == offset // 8 * 8 > 0
    assert encoder_runs(llm)[0] == encoded + CROPS
    for out, image in ((first, images[0]), (same, images[0]), (other, images[1])):
        assert out.outputs[0].token_ids == reference.greedy(prompt, [image], NEW_TOKENS)
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_preemption_recomputes_the_same_tokens(checkpoint, reference, images):
    llm = build(checkpoint, num_gpu_blocks_override=24)
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
    cases = [(ONE, [images[i]]) for i in range(4)]
    outs = generate(llm, cases, params)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for (text, imgs), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == reference.greedy(text, imgs, 40)


def test_a_tied_head_is_the_input_embedding(tmp_path, images):
    checkpoint = make_idefics3(tmp_path, "smolvlm", seed=2, tied=True)
    reference = Idefics3Reference(checkpoint, "smolvlm")
    model = reference.model
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    (out,) = generate(build(checkpoint), [(ONE, [images[0]])])
    assert out.outputs[0].token_ids == reference.greedy(ONE, [images[0]], NEW_TOKENS)


@pytest.mark.parametrize(
    "options", [{"do_image_splitting": False}, {"size": {"longest_edge": 48}}], ids=str
)
def test_mm_processor_kwargs_equal_transformers_with_them(llm, reference, images, options):
    prompt = {"prompt": ONE, "multi_modal_data": {"image": images[0]}}
    (out,) = llm.generate({**prompt, "mm_processor_kwargs": options}, GREEDY, use_tqdm=False)
    expected = reference.inputs(ONE, [images[0]], **options)["input_ids"][0].tolist()
    assert out.prompt_token_ids == expected
    assert len(expected) != len(reference.inputs(ONE, [images[0]])["input_ids"][0])
    assert out.outputs[0].token_ids == reference.greedy(ONE, [images[0]], NEW_TOKENS, **options)


def test_crops_the_encoder_does_not_take_are_refused(llm, images):
    prompt = {
        "prompt": ONE,
        "multi_modal_data": {"image": images[0]},
        "mm_processor_kwargs": {"max_image_size": {"longest_edge": 8}},
    }
    with pytest.raises(InvalidRequestError, match="takes 16x16") as refused:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert refused.value.param == "mm_processor_kwargs"


def test_padded_patches_are_masked_as_transformers(reference):
    # (the processor pads no crop of one image; a padded one: bottom rows and right
    # columns of the pixel mask off)
    theirs = reference.model.model.vision_model
    ours = Idefics3VisionTransformer(theirs.config)
    ours.load_state_dict(theirs.state_dict())
    torch.manual_seed(0)
    pixels = torch.randn(2, 3, 16, 16)
    mask = torch.ones(2, 16, 16, dtype=torch.bool)
    mask[1, 12:] = False
    mask[1, :, 8:] = False
    patch_mask = mask.unfold(1, 4, 4).unfold(2, 4, 4).sum(dim=(-1, -2)) > 0
    with torch.no_grad():
        expected = theirs(pixels, patch_attention_mask=patch_mask).last_hidden_state
        got = ours(pixels, mask)
    valid = patch_mask.reshape(2, -1)
    torch.testing.assert_close(got[valid], expected[valid])


def test_fp8_at_load_quantizes_the_text_model_only(checkpoint, images):
    llm = build(checkpoint, quantization="fp8")
    model = llm.llm_engine.loaded.model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    floats = {
        p.dtype for name, p in model.named_parameters() if name.startswith(("vision_", "conn"))
    }
    assert floats == {torch.float32}
    (out,) = generate(llm, [(ONE, [images[0]])])
    assert len(out.outputs[0].token_ids) == NEW_TOKENS
    llm.llm_engine.shutdown()


def test_the_largest_item_is_one_crop_the_encoder_takes(llm):
    # (what the KV-cache sizing encodes, on a device that profiles a step)
    processor = llm.llm_engine.extensions["multimodal"].processor
    item = processor.largest_item({})
    model = llm.llm_engine.loaded.model
    with torch.no_grad():
        features = model.encode("image", item.inputs)
    assert item.length == IMAGE_SEQ_LEN
    assert tuple(features.shape) == (IMAGE_SEQ_LEN, model.config.hidden_size)
