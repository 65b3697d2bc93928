"""A tiny random Gemma 3 with images (``Gemma3ForConditionalGeneration``: SigLIP vision
tower, pooling projector, Gemma 3 text model with sliding-window layers) with its
processor, and transformers' greedy output on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizer_fixtures import TOKENIZER_VOCAB_SIZE, make_tokenizer

from pagedllm.core.scheduler import Scheduler

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# SigLIP sees 32x32 pixels in 4x4 patches (8x8), pooled 2x2: 16 tokens per image.
IMAGE_SIZE, PATCH_SIZE, NUM_IMAGE_TOKENS = 32, 4, 16
# Gemma 3's turns; an image part renders as its <start_of_image> token.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def make_gemma3_vision(directory: Path, seed: int = 0, sliding_window: int = 12) -> Path:
    """Save a tiny random ``Gemma3ForConditionalGeneration`` and its ``Gemma3Processor``.
    The tokenizer has Gemma's newline-run tokens ("\\n\\n", "\\n\\n\\n"), so that the
    processor's "\\n\\n" around an image merges with a prompt's newlines as Gemma's does;
    the sliding window (12) is shorter than an image's tokens plus its markers."""
    tokenizer = make_tokenizer(directory)
    tokenizer.add_tokens(["\n\n", "\n\n\n", "\n\n\n\n"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    # (Gemma3Processor reads them as the tokenizer's boi_token, eoi_token, image_token)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        directory, extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE}
    )
    tokenizer.save_pretrained(directory)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in (BOI, EOI, IMAGE)}
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    text = transformers.Gemma3TextConfig(
        vocab_size=TOKENIZER_VOCAB_SIZE + 16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=NUM_IMAGE_TOKENS,
        boi_token_index=ids[BOI],
        eoi_token_index=ids[EOI],
        image_token_index=ids[IMAGE],
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # (random, not zero: the image tokens' embeddings matter)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    model.save_pretrained(directory)
    image_processor = transformers.Gemma3ImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=NUM_IMAGE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(directory)
    return directory


class Gemma3Reference:
    """transformers' model and processor of a checkpoint: greedy tokens for a prompt with
    images, as ``generate`` makes them in float32."""

    def __init__(self, directory: Path) -> None:
        self.processor = transformers.AutoProcessor.from_pretrained(directory)
        self.model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
            directory, dtype=torch.float32
        ).eval()

    def render(self, messages: list[dict[str, Any]]) -> str:
        return self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    def input_ids(self, prompt: str, images: list[Any]) -> list[int]:
        inputs = self.processor(images=images or None, text=prompt, return_tensors="pt")
        return inputs["input_ids"][0].tolist()

    @torch.no_grad()
    def greedy(self, prompt: str, images: list[Any], max_new_tokens: int) -> list[int]:
        inputs = self.processor(images=images or None, text=prompt, return_tensors="pt")
        out = self.model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return out[0, inputs["input_ids"].shape[1] :].tolist()


class StepRecordingScheduler(Scheduler):
    """The built-in scheduler, keeping what each step computed: ``(request id, first
    position, tokens)`` per scheduled request (``--scheduler-cls`` takes the class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[list[tuple[str, int, int]]] = []

    def schedule(self) -> Any:
        output = super().schedule()
        self.steps.append(
            [
                (s.request.request_id, s.num_computed_tokens, s.num_new_tokens)
                for s in output.scheduled
            ]
        )
        return output


def split_items(steps: list[list[tuple[str, int, int]]], items: dict[str, list[Any]]) -> list:
    """The steps (as :class:`StepRecordingScheduler` kept them) that end strictly inside an
    item of their request (``items``: request id -> its items)."""
    split = []
    for step in steps:
        for request_id, start, count in step:
            end = start + count
            for item in items.get(request_id, ()):
                if item.offset < end < item.offset + item.length:
                    split.append((request_id, start, count, item.offset, item.length))
    return split


def next_logprobs(reference: Gemma3Reference, prompt: str, images: list[Any], causal: bool):
    """transformers' log-probabilities of the token after ``prompt`` (``[vocab]``), with
    an image's tokens attending to each other both ways as transformers' generate does,
    or (``causal``) with every token attending causally: what they would be were the
    image's rows computed causally."""
    inputs = reference.processor(images=images or None, text=prompt, return_tensors="pt")
    if causal:
        inputs.pop("token_type_ids")
    with torch.no_grad():
        return reference.model(**inputs).logits[0, -1].log_softmax(-1)
