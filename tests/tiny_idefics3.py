"""Tiny random Idefics3 and SmolVLM checkpoints (a SigLIP-like vision transformer, a
pixel-shuffle connector and a Llama language model) with their processor files, and
transformers' greedy output on them.

Images are resized to a longest edge of 32 pixels and split into 16-pixel crops (a 40x36
picture: 2x2 crops and the global image), each crop 4x4 patches of 4 pixels, pixel-shuffled
by 2 into 4 image tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizer_fixtures import TOKENIZER_VOCAB_SIZE, make_tokenizer

CROP, PATCH, SCALE = 16, 4, 2
IMAGE_SEQ_LEN = (CROP // PATCH) ** 2 // SCALE**2
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
ROW_COL = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
# SmolVLM's chat format (transformers' default template for it): an image part renders as
# ``<image>``.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
KINDS = {
    "idefics3": (
        transformers.Idefics3Config,
        transformers.Idefics3VisionConfig,
        transformers.Idefics3ForConditionalGeneration,
        transformers.Idefics3ImageProcessor,
    ),
    "smolvlm": (
        transformers.SmolVLMConfig,
        transformers.SmolVLMVisionConfig,
        transformers.SmolVLMForConditionalGeneration,
        transformers.SmolVLMImageProcessor,
    ),
}


def make_idefics3(
    directory: Path, kind: str = "idefics3", seed: int = 0, *, tied: bool = False
) -> Path:
    """Save a tiny random ``Idefics3ForConditionalGeneration`` (or, ``kind="smolvlm"``,
    ``SmolVLMForConditionalGeneration``), its image processor and the test tokenizer with
    the image tokens and the chat template. ``tied``: the head is the input embedding
    (the checkpoint saves no ``lm_head``)."""
    config_cls, vision_cls, model_cls, image_processor_cls = KINDS[kind]
    tokenizer = make_tokenizer(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.add_tokens(ROW_COL, special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    vision = vision_cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=CROP,
        patch_size=PATCH,
    )
    text = transformers.LlamaConfig(
        vocab_size=TOKENIZER_VOCAB_SIZE + 48,  # (room for the image tokens)
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = config_cls(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(directory)
    image_processor = image_processor_cls(
        size={"longest_edge": 2 * CROP}, max_image_size={"longest_edge": CROP}
    )
    image_processor.save_pretrained(directory)
    return directory


class Idefics3Reference:
    """transformers' model and processor of a checkpoint: greedy tokens for a prompt with
    images, as ``generate`` makes them in float32. (transformers' SmolVLMProcessor needs
    a video processor, hence torchvision, which is not installed; Idefics3Processor expands
    an image the same way.)"""

    def __init__(self, directory: Path, kind: str = "idefics3") -> None:
        _, _, model_cls, image_processor_cls = KINDS[kind]
        self.processor = transformers.Idefics3Processor(
            image_processor=image_processor_cls.from_pretrained(directory),
            tokenizer=transformers.AutoTokenizer.from_pretrained(directory),
            image_seq_len=IMAGE_SEQ_LEN,
            chat_template=CHAT_TEMPLATE,
        )
        self.model = model_cls.from_pretrained(directory, dtype=torch.float32).eval()

    def render(self, messages: list[dict[str, Any]]) -> str:
        """``messages`` (image parts as ``{"type": "image"}``) through the chat template."""
        return self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    def inputs(self, prompt: str, images: list[Any], **image_kwargs: Any) -> Any:
        return self.processor(
            images=images or None, text=prompt, return_tensors="pt", **image_kwargs
        )

    @torch.no_grad()
    def greedy(
        self, prompt: str, images: list[Any], max_new_tokens: int, **image_kwargs: Any
    ) -> list[int]:
        inputs = self.inputs(prompt, images, **image_kwargs)
        out = self.model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return out[0, inputs["input_ids"].shape[1] :].tolist()
