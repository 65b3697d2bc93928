"""A tiny random LLaVA-1.5 checkpoint (CLIP vision tower, Llama language model) with its
processor, real images made with numpy, and transformers' greedy output on them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizer_fixtures import TOKENIZER_VOCAB_SIZE, make_tokenizer

IMAGE_TOKEN = "<image>"
# The vision tower sees 30x30 pixels in 6x6 patches: 25 image tokens per image.
IMAGE_SIZE, PATCH_SIZE = 30, 6
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
# LLaVA-1.5's chat format; an image content part (``{"type": "image"}``, as Hugging Face
# processors' templates take it) renders as ``<image>``.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image>\n{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %} {% else %}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def make_llava(directory: Path, seed: int = 0) -> Path:
    """Save a tiny random ``LlavaForConditionalGeneration`` and its ``LlavaProcessor``
    (a ``CLIPImageProcessor`` and the test tokenizer with an ``<image>`` token)."""
    tokenizer = make_tokenizer(directory)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=32,
    )
    text = transformers.LlamaConfig(
        vocab_size=TOKENIZER_VOCAB_SIZE + 8,  # (room for the image token)
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=NUM_IMAGE_TOKENS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(directory)
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(directory)
    return directory


def make_image(kind: int, width: int = 40, height: int = 36) -> Image.Image:
    """A deterministic RGB picture: gradients, stripes or a checkerboard by ``kind``."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    if kind % 3 == 0:
        channels = [x / width * 255, y / height * 255, np.full_like(x, 40.0 * kind % 255)]
    elif kind % 3 == 1:
        stripes = ((x + kind * y) // 4 % 2) * 200 + 30
        channels = [stripes, 255 - stripes, (x * y) % 256]
    else:
        checks = ((x // 5 + y // 5) % 2) * 180 + kind * 7 % 60
        channels = [checks, np.full_like(x, 120.0), 255 - checks]
    return Image.fromarray(np.stack(channels, -1).clip(0, 255).astype(np.uint8), "RGB")


class LlavaReference:
    """transformers' model and processor of a checkpoint: greedy tokens for a prompt with
    images, as the model's ``generate`` makes them in float32."""

    def __init__(self, directory: Path) -> None:
        self.processor = transformers.AutoProcessor.from_pretrained(directory)
        self.model = transformers.LlavaForConditionalGeneration.from_pretrained(
            directory, dtype=torch.float32
        ).eval()

    def render(self, messages: list[dict[str, Any]]) -> str:
        """``messages`` (image parts as ``{"type": "image"}``) through the chat template."""
        return self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    @torch.no_grad()
    def greedy(
        self, prompt: str, images: list[Any], max_new_tokens: int, **image_kwargs: Any
    ) -> list[int]:
        """(``image_kwargs``: the image processor's options, e.g. ``do_normalize``)"""
        inputs = self.processor(
            images=images or None, text=prompt, return_tensors="pt", **image_kwargs
        )
        out = self.model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return out[0, inputs["input_ids"].shape[1] :].tolist()


def llava_llm(checkpoint: Path, **kwargs: Any) -> Any:
    """An ``LLM`` of the tiny checkpoint in float32, with a small KV cache of 8-token blocks
    unless ``kwargs`` say otherwise."""
    from pagedllm import LLM

    kwargs.setdefault("num_gpu_blocks_override", 128)
    kwargs.setdefault("block_size", 8)
    return LLM(str(checkpoint), dtype="float32", disable_log_stats=True, **kwargs)


def encoder_runs(llm: Any) -> tuple[int, int]:
    """(images encoded, image slices taken from the encoder cache) of ``llm`` so far."""
    (runner,) = [e for e in llm.llm_engine.runner.extensions if e.name == "multimodal"]
    return runner.num_encoded, runner.num_cache_hits
