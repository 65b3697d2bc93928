"""Prompts with images (or other media): the multimodal processor a plugin registers per
architecture, and what a model that takes them implements.

A :class:`MultiModalProcessor` is registered with ``pagedllm_register_multimodal_processors``
under the Hugging Face architecture name of the models whose prompts it processes
(``LlavaForConditionalGeneration``). When the loaded model's architecture has one, the
engine turns multimodal prompts on: a prompt dict's ``multi_modal_data`` (``{"image":
image or [images]}``) goes to :meth:`MultiModalProcessor.process`, which expands each
placeholder to the tokens the model fills with that item's embeddings and makes the
encoder's inputs (e.g. pixel tensors). The model (a :class:`SupportsMultiModal`) encodes
each item once (the outputs are cached by the item's content hash, so the same image in
another request, or in the next chunk of the same prompt, is not encoded again) and takes
the encoder's output as its input embeddings at the placeholder positions. The prefix
cache keys the blocks that cover an item's placeholders by its content hash.

Lifecycle: :meth:`MultiModalProcessor.from_model` once per engine, after the model is
loaded; :meth:`MultiModalProcessor.process` once per request (the server calls it on worker
threads, several at once, off its event loop and the engine thread: keep no per-call state
on the processor); the model's :meth:`SupportsMultiModal.encode` for each item whose
placeholders a step computes and whose output is not cached, then
:meth:`SupportsMultiModal.set_input_embeddings` before that step's forward pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(slots=True, eq=False)
class MultiModalItem:
    """One image (or other item) of a prompt, processed: its placeholder tokens are
    ``offset`` to ``offset + length`` of the expanded prompt, which the model fills with
    the ``length`` rows its encoder makes of ``inputs``."""

    modality: str
    # The item's identity (e.g. :func:`content_hash` of its pixels): equal hashes mean
    # equal encoder outputs.
    content_hash: str
    # What the model's encoder takes for this item (tensors, picklable).
    inputs: Any
    offset: int
    length: int
    # For a model whose rotary positions are 3-D (M-RoPE: Qwen2-VL), the (t, h, w) grid of
    # the item's placeholder tokens (t * h * w == length), which places them; None: they
    # take positions as text does. (Small: it goes with each step of its request.)
    grid: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"bad placeholder range ({self.offset}, {self.length})")
        if self.grid is not None and self.grid[0] * self.grid[1] * self.grid[2] != self.length:
            raise ValueError(f"a grid {self.grid} of other than {self.length} tokens")


@dataclasses.dataclass(slots=True)
class ProcessedPrompt:
    """A prompt as the model takes it: its token ids, placeholders expanded, and its
    items in prompt order (their ranges do not overlap)."""

    token_ids: list[int]
    items: list[MultiModalItem]


class MultiModalProcessor(ABC):
    """Per-model input processing of multimodal prompts (registered under the
    architecture names it serves)."""

    #: The keys of ``multi_modal_data`` it takes (others are refused by name).
    modalities: ClassVar[tuple[str, ...]] = ("image",)
    #: Whether :meth:`process` takes ``options`` (``--mm-processor-kwargs``, a prompt's
    #: ``mm_processor_kwargs``); they are refused by name where not.
    takes_processor_kwargs: ClassVar[bool] = False
    #: Whether the model takes each item's tokens in one step (its items' tokens attend to
    #: each other both ways): the engine then never splits an item across steps, as
    #: ``--disable-chunked-mm-input`` asks.
    needs_whole_items: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_model(cls, model_path: str, hf_config: Any, tokenizer: Any) -> MultiModalProcessor:
        """The processor of the model in ``model_path`` (a local directory: its
        preprocessor files), whose Hugging Face config and tokenizer are given. Raise
        :class:`~pagedllm.core.errors.ConfigError` naming what is missing."""

    @abstractmethod
    def process(
        self,
        token_ids: list[int],
        data: dict[str, list[Any]],
        hashes: dict[str, list[str]],
        options: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        """``token_ids`` (the tokenized prompt, one placeholder per item) with each
        item's placeholder expanded, and the items of ``data`` (modality -> items, in
        prompt order) processed. ``hashes``: each item's content hash where the caller
        gives it (same shape as ``data``); compute the others (:func:`content_hash`).
        Raise :class:`~pagedllm.core.errors.InvalidRequestError` naming what is wrong (a
        count of placeholders that does not match the items, an item that is not an
        image). ``options`` (given only where :attr:`takes_processor_kwargs`): the
        processor call's keyword arguments."""

    def largest_item(self, options: dict[str, Any]) -> MultiModalItem | None:
        """An item of the largest size this processor makes with ``options`` (the
        server's ``--mm-processor-kwargs``): the engine encodes it once in the step it
        profiles to size the KV cache. None (the default): not profiled."""
        return None


class SupportsMultiModal(ABC):
    """A model that takes multimodal items: mixed into its :class:`ModelArchitecture`
    class."""

    @abstractmethod
    def encode(self, modality: str, inputs: Any) -> torch.Tensor:
        """The embeddings of one item (``[length, hidden]``, the length its processor gave
        it), from its ``inputs`` (:attr:`MultiModalItem.inputs`)."""

    @abstractmethod
    def set_input_embeddings(self, rows: torch.Tensor, embeddings: torch.Tensor) -> None:
        """The next forward pass takes ``embeddings`` (``[len(rows), hidden]``) as its
        input embeddings at ``rows`` of its flat batch, instead of the token ids' (once:
        the pass after it embeds its tokens again)."""

    #: Its rotary positions follow its items' grids (:attr:`MultiModalItem.grid`): each
    #: step gives it those of its requests (:meth:`set_item_grids`).
    uses_item_grids: ClassVar[bool] = False

    def set_item_grids(self, spans: list[tuple[int, int, int, tuple[Any, ...]]]) -> None:
        """The next forward pass's requests that have items with grids: for each, ``(first
        row in the flat batch, its position, number of rows, items)``, its rows taking the
        consecutive positions from there, and ``items`` its ``(offset, length, grid)`` in
        prompt order (once, as :meth:`set_input_embeddings`). Called only where
        ``uses_item_grids``."""
        raise NotImplementedError

    #: Its items' tokens attend to each other both ways (the rest causally): each step
    #: gives it the ranges of its requests' items (:meth:`set_bidirectional_items`), and it
    #: refuses attention backends without bidirectional spans.
    attends_items_bidirectionally: ClassVar[bool] = False

    def set_bidirectional_items(self, spans: dict[int, tuple[tuple[int, int], ...]]) -> None:
        """The next forward pass's requests whose items it computes: each one's first row
        in the flat batch -> its items' ``[offset, offset + length)`` ranges, in prompt
        positions (once, as :meth:`set_input_embeddings`); for
        ``AttentionBackend.with_bidirectional_spans``. Called only where
        ``attends_items_bidirectionally``."""
        raise NotImplementedError


def content_hash(item: Any) -> str:
    """A hash of what an item is: an image's mode, size and pixels (anything with
    ``mode``, ``size`` and ``tobytes()``, as a PIL image), an array's dtype, shape and
    bytes."""
    digest = hashlib.sha256()
    if hasattr(item, "mode") and hasattr(item, "size") and hasattr(item, "tobytes"):
        digest.update(f"image:{item.mode}:{tuple(item.size)}:".encode())
        digest.update(item.tobytes())
    elif hasattr(item, "dtype") and hasattr(item, "shape"):
        array = item.detach().cpu().contiguous() if hasattr(item, "detach") else item
        digest.update(f"array:{array.dtype}:{tuple(array.shape)}:".encode())
        digest.update(array.numpy().tobytes() if hasattr(array, "numpy") else array.tobytes())
    else:
        raise TypeError(f"cannot hash a {type(item).__name__}: not an image or an array")
    return digest.hexdigest()
