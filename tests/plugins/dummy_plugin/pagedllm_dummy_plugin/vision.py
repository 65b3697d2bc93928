"""A model that takes images, of the plugin's own: ``DummyVisionNeoXForCausalLM`` is the
plugin's GPT-NeoX whose image placeholders (the config's ``image_token_id``) are each
replaced by two rows, the embeddings of two tokens the image's colours pick
(:class:`ColourTokensProcessor`). So transformers' GPT-NeoX on the prompt with those two
tokens in the placeholder's place is its reference."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.core.interfaces.multimodal import (
    MultiModalItem,
    MultiModalProcessor,
    ProcessedPrompt,
    SupportsMultiModal,
    content_hash,
)
from pagedllm_dummy_plugin.model import DummyNeoXForCausalLM


# [docs:multimodal]
def colour_tokens(image: Any, vocab_size: int) -> list[int]:
    """The two tokens an image stands for: its red and green sums, modulo the vocabulary."""
    pixels = torch.tensor(list(image.convert("RGB").getdata()), dtype=torch.long)
    return [int(pixels[:, 0].sum()) % vocab_size, int(pixels[:, 1].sum()) % vocab_size]


class ColourTokensProcessor(MultiModalProcessor):
    modalities = ("image",)

    def __init__(self, image_token_id: int, vocab_size: int) -> None:
        self.image_token_id = image_token_id
        self.vocab_size = vocab_size

    @classmethod
    def from_model(cls, model_path, hf_config, tokenizer):
        token = getattr(hf_config, "image_token_id", None)
        if token is None:
            raise ConfigError(f"{model_path}: the config names no image_token_id")
        return cls(int(token), int(hf_config.vocab_size))

    def process(self, token_ids, data, hashes, options=None):
        images = data.get("image", [])
        given = hashes.get("image") or [None] * len(images)
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(positions) != len(images):
            raise InvalidRequestError(
                "multi_modal_data.image",
                f"{len(images)} image(s) for {len(positions)} placeholder(s)",
            )
        expanded, items, last = [], [], 0
        for index, position in enumerate(positions):
            image = images[index]
            expanded.extend(token_ids[last:position])
            inputs = torch.tensor(colour_tokens(image, self.vocab_size))
            key = given[index] or content_hash(image)
            items.append(MultiModalItem("image", key, inputs, len(expanded), 2))
            expanded.extend([self.image_token_id] * 2)
            last = position + 1
        expanded.extend(token_ids[last:])
        return ProcessedPrompt(expanded, items)


class DummyVisionNeoXForCausalLM(DummyNeoXForCausalLM, SupportsMultiModal):
    def __init__(self, config, quant_config=None, **kwargs):
        super().__init__(config, quant_config, **kwargs)
        self._given: tuple[torch.Tensor, torch.Tensor] | None = None
        # (counted by the tests: the engine called the encoder)
        self.num_encoded = 0

    def encode(self, modality, inputs):
        self.num_encoded += 1
        return self.gpt_neox.embed_in(inputs.to(self.gpt_neox.embed_in.weight.device))

    def set_input_embeddings(self, rows, embeddings):
        self._given = (rows, embeddings)

    def forward(self, input_ids, positions, attn_metadata):
        hidden = self.gpt_neox.embed_in(input_ids)
        if self._given is not None:
            rows, embeddings = self._given
            self._given = None
            hidden = hidden.index_copy(0, rows, embeddings.to(hidden.dtype))
        for layer in self.gpt_neox.layers:
            hidden = layer(positions, hidden, attn_metadata)
        return self.gpt_neox.final_layer_norm(hidden)


# [/docs:multimodal]
