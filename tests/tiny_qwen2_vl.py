"""A tiny random Qwen2-VL (and Qwen2.5-VL) checkpoint with its processor (the checkpoint's
own ``Qwen2VLImageProcessor``: dynamic resolution, few pixels), and transformers' greedy
output on real images (``tiny_llava.make_image``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizer_fixtures import TOKENIZER_VOCAB_SIZE, make_tokenizer

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
# One image in a prompt, as Qwen2-VL's chat template writes it.
IMAGE = f"{VISION_START}{IMAGE_PAD}{VISION_END}"
# 4x4 patches merged 2x2: images are resized to multiples of 8 pixels, between 16x16 and
# 64x64 in area (a 40x36 image: a 10x8 grid of patches, 20 tokens).
PATCH_SIZE, MERGE_SIZE = 4, 2
MIN_PIXELS, MAX_PIXELS = 16 * 16, 64 * 64

ARCHITECTURES = {
    "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (
        transformers.Qwen2_5_VLConfig,
        transformers.Qwen2_5_VLForConditionalGeneration,
    ),
}


def make_qwen2_vl(directory: Path, kind: str = "qwen2_vl", seed: int = 0) -> Path:
    """Save a tiny random ``Qwen2VLForConditionalGeneration`` (or, with ``kind``
    ``qwen2_5_vl``, ``Qwen2_5_VLForConditionalGeneration``) with tied embeddings, and its
    ``Qwen2VLProcessor`` (the test tokenizer with Qwen's vision tokens)."""
    config_cls, model_cls = ARCHITECTURES[kind]
    tokenizer = make_tokenizer(directory)
    tokenizer.add_tokens([VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD], special_tokens=True)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD)}
    text = {
        "vocab_size": TOKENIZER_VOCAB_SIZE + 8,  # (room for the vision tokens)
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        # Head size 16: 8 rotary frequencies, 2 for time, 3 for height, 3 for width.
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        # (wider than the default 0.02: greedy tokens that vary with the image)
        "initializer_range": 0.2,
    }
    vision: dict[str, Any] = {
        "depth": 2,
        "hidden_size": 64 if kind == "qwen2_vl" else 32,
        "num_heads": 4,
        "in_channels": 3,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
        "initializer_range": 0.2,
    }
    if kind == "qwen2_vl":
        vision.update(embed_dim=32, mlp_ratio=2)
    else:
        # Windows of 16x16 pixels (2x2 merged tokens, padded at the edges of a grid
        # of odd size); the second block attends in full.
        vision.update(
            intermediate_size=48, out_hidden_size=64, window_size=16, fullatt_block_indexes=[1]
        )
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=tokenizer.convert_tokens_to_ids(VIDEO_PAD),
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(directory)
    # (the PIL backend: torchvision's needs torchvision)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )
    image_processor.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


class Qwen2VLReference:
    """transformers' model, image processor and tokenizer of a checkpoint: greedy tokens
    for a prompt with images, as the model's ``generate`` makes them in float32.

    The prompt's inputs are made as transformers' ``Qwen2VLProcessor`` makes them (each
    image's ``<|image_pad|>`` repeated ``t * h * w / merge_size**2`` times, token types 1
    on them); that class itself needs a video processor, which needs torchvision."""

    def __init__(self, directory: Path, kind: str = "qwen2_vl") -> None:
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(directory)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.model = ARCHITECTURES[kind][1].from_pretrained(directory, dtype=torch.float32).eval()

    def inputs(self, prompt: str, images: list[Any]) -> dict[str, torch.Tensor]:
        ids = self.tokenizer(prompt)["input_ids"]
        inputs: dict[str, torch.Tensor] = {}
        counts: list[int] = []
        if images:
            inputs.update(self.image_processor(images=images, return_tensors="pt"))
            merge = self.image_processor.merge_size**2
            counts = [int(grid.prod()) // merge for grid in inputs["image_grid_thw"]]
        expanded: list[int] = []
        for token in ids:
            if token == self.image_token_id:
                expanded.extend([token] * counts.pop(0))
            else:
                expanded.append(token)
        assert not counts, "more images than placeholders"
        input_ids = torch.tensor([expanded])
        inputs["input_ids"] = input_ids
        inputs["attention_mask"] = torch.ones_like(input_ids)
        inputs["mm_token_type_ids"] = (input_ids == self.image_token_id).int()
        return inputs

    @torch.no_grad()
    def greedy(self, prompt: str, images: list[Any], max_new_tokens: int) -> list[int]:
        inputs = self.inputs(prompt, images)
        out = self.model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return out[0, inputs["input_ids"].shape[1] :].tolist()
