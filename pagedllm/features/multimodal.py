"""Multimodal prompts as a step extension: on when the loaded model's architecture has a
registered multimodal processor (see :mod:`pagedllm.core.interfaces.multimodal`).

A prompt dict's ``multi_modal_data`` goes through the processor (placeholders expanded,
items made into encoder inputs and hashed); the request carries its items and keys the
prefix-cache blocks over each item's placeholders by the item's content hash.

The processing runs before the request reaches the engine thread where the server adds
it (:meth:`MultiModalExtension.prepare_prompt`, on the async engine's prepare threads):
the prompt then comes in its processed form, ``{"prompt_token_ids": <placeholders
expanded>, "multi_modal_processed": ProcessedPrompt}`` (:data:`PROCESSED_KEY`; picklable,
and what ``LLMEngine.prepare_prompt`` returns), which the engine thread only checks (the
items' modalities, ``--limit-mm-per-prompt``, their ranges). ``LLM.generate`` processes
on its caller's thread.

In the runner, each step's placeholder rows take the item's encoder output, computed once
per item and kept in an encoder cache by content hash: a later chunk of the same prompt
takes its slice of the cached output, and the same image in another request (or after a
preemption) is not encoded again.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.env import env_number
from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.core.interfaces.extension import RunnerExtension, StepExtension
from pagedllm.core.interfaces.multimodal import (
    MultiModalItem,
    MultiModalProcessor,
    ProcessedPrompt,
)
from pagedllm.core.model_files import resolve_model_path

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.step_data import SchedulerOutput

# Encoder-output rows the cache keeps by default (per rank): a few dozen LLaVA images;
# PAGEDLLM_ENCODER_CACHE_ROWS sets it (never below --max-num-batched-tokens, which bounds
# vLLM's encoder cache: a step's images must fit). The KV cache is sized without the
# memory they take.
DEFAULT_CACHE_ROWS = 16384
# The prompt key of a processed prompt (a ProcessedPrompt; see the module's docstring).
PROCESSED_KEY = "multi_modal_processed"
ENV_ENCODER_CACHE_ROWS = "PAGEDLLM_ENCODER_CACHE_ROWS"


class MultiModalExtension(StepExtension):
    """A request's state: its processed items (:class:`MultiModalItem`), in prompt
    order."""

    name = "multimodal"
    prompt_keys = ("multi_modal_data", "multi_modal_uuids", "mm_processor_kwargs", PROCESSED_KEY)
    # (a decode step replayed from a graph would not take the items' embeddings)
    allows_decode_graphs = False

    def __init__(
        self,
        processor: MultiModalProcessor,
        cache_rows: int,
        *,
        max_images: int | None = None,
        processor_kwargs: dict[str, Any] | None = None,
        reuse_across_requests: bool = True,
        row_bytes: int = 0,
        whole_items: bool = False,
        max_step_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.processor = processor
        self.cache_rows = cache_rows
        # The bytes of one row of encoder output (the model's hidden size and dtype).
        self.row_bytes = row_bytes
        # --limit-mm-per-prompt, --mm-processor-kwargs, --disable-mm-preprocessor-cache
        self.max_images = max_images
        self.processor_kwargs = dict(processor_kwargs or {})
        self.reuse_across_requests = reuse_across_requests
        # --disable-chunked-mm-input (or the model's own need): no step computes part of an
        # item; then no item may be longer than a step can compute (max_step_tokens).
        self.whole_items = whole_items
        self.max_step_tokens = max_step_tokens

    @classmethod
    def from_engine(cls, engine: Any) -> MultiModalExtension | None:
        architecture = engine.loaded.architecture
        hf_config = engine.loaded.hf_config
        extension = cls.for_model(
            engine.pm,
            engine.config,
            architecture,
            hf_config,
            engine.tokenizer,
            row_bytes=hf_config.get_text_config().hidden_size * engine.loaded.dtype.itemsize,
        )
        if extension is not None and engine.config.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError(
                f"{architecture} with images does not support --pipeline-parallel-size > 1"
            )
        return extension

    @classmethod
    def for_model(
        cls,
        pm: Any,
        config: Any,
        architecture: str,
        hf_config: Any,
        tokenizer: Any,
        row_bytes: int = 0,
    ) -> MultiModalExtension | None:
        """The extension for a model of ``architecture`` served with ``config`` (None: no
        multimodal processor is registered for it); also what a server front end
        processes prompts with outside the engine (``/tokenize``). ``row_bytes``: the
        bytes of one row of the model's encoder output."""
        registry = pm.registry("multimodal_processors")
        if architecture not in registry.names():
            return None
        mc = config.model_config
        path = resolve_model_path(
            mc.model, revision=mc.revision, download_dir=config.load_config.download_dir
        )
        processor = registry.load(architecture).from_model(str(path), hf_config, tokenizer)
        sched = config.scheduler_config
        mm = config.multimodal_config
        if mm.mm_processor_kwargs and not processor.takes_processor_kwargs:
            raise ConfigError(
                f"--mm-processor-kwargs: the {architecture} processor takes no options"
            )
        step_tokens = sched.max_num_batched_tokens
        if sched.long_prefill_token_threshold > 0:
            step_tokens = min(step_tokens, sched.long_prefill_token_threshold)
        return cls(
            processor,
            max(encoder_cache_rows(), sched.max_num_batched_tokens),
            max_images=mm.max_images,
            processor_kwargs=mm.mm_processor_kwargs,
            reuse_across_requests=not mm.disable_mm_preprocessor_cache,
            row_bytes=row_bytes,
            whole_items=sched.disable_chunked_mm_input or processor.needs_whole_items,
            max_step_tokens=step_tokens,
        )

    @classmethod
    def not_enabled_error(cls) -> InvalidRequestError:
        return InvalidRequestError(
            "multi_modal_data",
            "this model takes text only (no multimodal processor is registered for its "
            "architecture)",
        )

    def reserved_bytes(self) -> int:
        """The encoder cache, full (each rank keeps its own)."""
        return self.cache_rows * self.row_bytes

    def profile_payload(self) -> Any:
        """An item of the largest size the processor makes, for each rank to encode in
        the profiled step (as vLLM profiles its encoder with dummy inputs)."""
        item = self.processor.largest_item(self.processor_kwargs)
        return None if item is None else (item.modality, item.inputs)

    @classmethod
    def profile_on_rank(cls, payload: Any, worker: Any) -> Any:
        modality, inputs = payload
        return worker.loaded.model.encode(modality, inputs)

    def runner_payload(self) -> Any:
        return self.cache_rows, self.reuse_across_requests

    @classmethod
    def make_runner_extension(cls, payload: Any, worker: Any) -> MultiModalRunner:
        cache_rows, reuse = payload
        return MultiModalRunner(
            worker.loaded.model, cache_rows, worker.config.device_config.torch_device, reuse
        )

    def prepare_prompt(
        self, prompt: dict[str, Any], token_ids: list[int], params: Any
    ) -> dict[str, Any] | None:
        """The prompt's items processed (off the engine thread): its processed form."""
        if not prompt.get("multi_modal_data") or prompt.get(PROCESSED_KEY) is not None:
            return None  # (nothing heavy to do; process_prompt checks it)
        processed = self._process(prompt, token_ids, params)
        assert processed is not None
        raw = ("multi_modal_data", "multi_modal_uuids", "mm_processor_kwargs")
        kept = {k: v for k, v in prompt.items() if k not in raw}
        return {**kept, "prompt_token_ids": processed.token_ids, PROCESSED_KEY: processed}

    def process_prompt(
        self, prompt: dict[str, Any], token_ids: list[int], params: Any
    ) -> tuple[list[int], Any] | None:
        if prompt.get(PROCESSED_KEY) is not None:
            processed = self._checked(prompt, token_ids, params)
        else:
            processed = self._process(prompt, token_ids, params)
        if processed is None:
            return None
        return processed.token_ids, tuple(processed.items)

    def _checked(
        self, prompt: dict[str, Any], token_ids: list[int], params: Any
    ) -> ProcessedPrompt:
        """A prompt's processed form, checked against this engine's limits."""
        processed = prompt[PROCESSED_KEY]
        if not isinstance(processed, ProcessedPrompt) or not all(
            isinstance(item, MultiModalItem) for item in processed.items
        ):
            raise InvalidRequestError(
                PROCESSED_KEY,
                f"a ProcessedPrompt of MultiModalItems (LLMEngine.prepare_prompt's), not "
                f"{type(processed).__name__}",
            )
        raw = [k for k in self.prompt_keys if k != PROCESSED_KEY and prompt.get(k)]
        if raw:
            raise InvalidRequestError(raw[0], f"given with {PROCESSED_KEY} (processed already)")
        if params.truncate_prompt_tokens is not None:
            raise InvalidRequestError(
                "truncate_prompt_tokens", "a prompt with multimodal items cannot be cut"
            )
        if token_ids != processed.token_ids:
            raise InvalidRequestError(
                "prompt_token_ids",
                f"a prompt with {PROCESSED_KEY} has its token ids as prompt_token_ids",
            )
        modalities = self.processor.modalities
        for item in processed.items:
            if item.modality not in modalities:
                raise InvalidRequestError(
                    f"multi_modal_data.{item.modality}",
                    f"this model takes {', '.join(modalities)} only",
                )
        self._check_limit(sum(item.modality == "image" for item in processed.items))
        try:
            _check_ranges(processed.items, len(processed.token_ids))
        except AssertionError as exc:
            raise InvalidRequestError(PROCESSED_KEY, str(exc)) from None
        return processed

    def _check_limit(self, num_images: int) -> None:
        if self.max_images is not None and num_images > self.max_images:
            raise InvalidRequestError(
                "multi_modal_data.image",
                f"{num_images} images; at most {self.max_images} per prompt are "
                "allowed (--limit-mm-per-prompt)",
            )

    def _process(
        self, prompt: dict[str, Any], token_ids: list[int], params: Any
    ) -> ProcessedPrompt | None:
        """The prompt's raw items (``multi_modal_data``) processed; None: it has none."""
        options = self._options(prompt.get("mm_processor_kwargs"))
        data, uuids = prompt.get("multi_modal_data"), prompt.get("multi_modal_uuids")
        if not data:
            if uuids:
                raise InvalidRequestError("multi_modal_uuids", "given without multi_modal_data")
            # (a placeholder without its image is refused by the processor)
            self.processor.process(token_ids, {}, {})
            return None
        if not isinstance(data, dict):
            raise InvalidRequestError(
                "multi_modal_data", f"a dict of modality -> items, not {type(data).__name__}"
            )
        modalities = self.processor.modalities
        for modality in data:
            if modality not in modalities:
                raise InvalidRequestError(
                    f"multi_modal_data.{modality}",
                    f"this model takes {', '.join(modalities)} only",
                )
        if params.truncate_prompt_tokens is not None:
            raise InvalidRequestError(
                "truncate_prompt_tokens", "a prompt with multimodal items cannot be cut"
            )
        items = {m: _as_list(v) for m, v in data.items()}
        self._check_limit(len(items.get("image", ())))
        hashes = _given_hashes(uuids, items)
        if options:
            processed = self.processor.process(token_ids, items, hashes, options=options)
            # (other options make other encoder inputs: other cache keys)
            suffix = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()
            for item in processed.items:
                item.content_hash = f"{item.content_hash}:{suffix[:16]}"
        else:
            processed = self.processor.process(token_ids, items, hashes)
        _check_ranges(processed.items, len(processed.token_ids))
        return processed

    def _options(self, given: Any) -> dict[str, Any]:
        """The processor's options: ``--mm-processor-kwargs`` updated by the prompt's
        ``mm_processor_kwargs``."""
        if given is None or given == {}:
            return self.processor_kwargs
        if not isinstance(given, dict):
            raise InvalidRequestError(
                "mm_processor_kwargs",
                f"mm_processor_kwargs must be a dict of options, not {type(given).__name__}",
            )
        if not self.processor.takes_processor_kwargs:
            raise InvalidRequestError(
                "mm_processor_kwargs",
                "mm_processor_kwargs: this model's multimodal processor takes no options",
            )
        return {**self.processor_kwargs, **given}

    def new_request(self, request: Request) -> None:
        items = request.features.get(self.name)
        if items and self.whole_items and self.max_step_tokens is not None:
            for index, item in enumerate(items):
                if item.length > self.max_step_tokens:
                    raise InvalidRequestError(
                        f"multi_modal_data.{item.modality}",
                        f"{item.modality} {index} takes {item.length} tokens, more than one "
                        f"step computes ({self.max_step_tokens}: --max-num-batched-tokens, "
                        "--long-prefill-token-threshold), and its tokens are computed in one "
                        "step (--disable-chunked-mm-input, or a model that takes each item "
                        "whole): raise --max-num-batched-tokens",
                    )
        if items:
            request.range_keys = tuple(
                (item.offset, item.offset + item.length, item.content_hash) for item in items
            )

    def schedulable_tokens(self, request: Request, start: int, num_tokens: int) -> int:
        if not self.whole_items:
            return num_tokens
        end = start + num_tokens
        for item in request.features.get(self.name) or ():
            item_end = item.offset + item.length
            if item.offset < end < item_end:
                # (the step ends before the item; one that began in cached blocks waits
                # for a step with room for its rest)
                return max(0, item.offset - start) if item.offset >= start else 0
        return num_tokens


def encoder_cache_rows() -> int:
    """``PAGEDLLM_ENCODER_CACHE_ROWS``, else :data:`DEFAULT_CACHE_ROWS`."""
    return env_number(
        ENV_ENCODER_CACHE_ROWS,
        DEFAULT_CACHE_ROWS,
        "a number of rows (1 or more)",
        parse=int,
        minimum=1,
    )


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _given_hashes(uuids: Any, items: dict[str, list[Any]]) -> dict[str, list[str]]:
    """``multi_modal_uuids`` (vLLM's: modality -> one id per item, or None for one to
    compute) checked against the items."""
    if not uuids:
        return {}
    if not isinstance(uuids, dict):
        raise InvalidRequestError("multi_modal_uuids", "a dict of modality -> ids")
    hashes: dict[str, list[str]] = {}
    for modality, given in uuids.items():
        ids = _as_list(given)
        if len(ids) != len(items.get(modality, ())):
            raise InvalidRequestError(
                f"multi_modal_uuids.{modality}",
                f"{len(ids)} ids for {len(items.get(modality, ()))} items",
            )
        hashes[modality] = ids
    return hashes


def _check_ranges(items: Sequence[MultiModalItem], num_tokens: int) -> None:
    end = 0
    for item in sorted(items, key=lambda i: i.offset):
        if item.offset < end or item.offset + item.length > num_tokens:
            raise AssertionError("a multimodal processor gave overlapping or outside ranges")
        end = item.offset + item.length


@dataclasses.dataclass(slots=True)
class EncoderCache:
    """Encoder outputs by content hash, the least recently used evicted first once they
    hold more than ``max_rows`` rows (an output larger than that is kept alone)."""

    max_rows: int
    entries: collections.OrderedDict[str, torch.Tensor] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    rows: int = 0

    def get(self, key: str) -> torch.Tensor | None:
        output = self.entries.get(key)
        if output is not None:
            self.entries.move_to_end(key)
        return output

    def put(self, key: str, output: torch.Tensor) -> None:
        self.entries[key] = output
        self.rows += output.shape[0]
        while self.rows > self.max_rows and len(self.entries) > 1:
            _, evicted = self.entries.popitem(last=False)
            self.rows -= evicted.shape[0]


class MultiModalRunner(RunnerExtension):
    """The runner's side: the step's placeholder rows and their items (rank 0), their
    embeddings from the encoder cache or the encoder (every rank) into the model."""

    name = "multimodal"

    def __init__(
        self, model: Any, cache_rows: int, device: torch.device, reuse: bool = True
    ) -> None:
        self.model = model
        self.device = device
        self.cache = EncoderCache(cache_rows)
        # (a model placing its items' tokens by their grids gets each step's: M-RoPE)
        self.grids = bool(getattr(model, "uses_item_grids", False))
        # (a model whose items' tokens attend to each other both ways gets their ranges)
        self.spans = bool(getattr(model, "attends_items_bidirectionally", False))
        # False (--disable-mm-preprocessor-cache): outputs are kept for the chunks of the
        # request that made them only.
        self.reuse = reuse
        # Items encoded, and item slices taken from the cache instead.
        self.num_encoded = 0
        self.num_cache_hits = 0

    def step_input(self, output: SchedulerOutput) -> Any:
        """``(pieces, grids, spans)``: ``(first row in the step, first row of the item's
        output, rows, item, cache key)`` for each item whose placeholders this step computes
        (all or part of them), and where the model uses them, its requests' item grids
        (:meth:`SupportsMultiModal.set_item_grids`) and the ranges of the items a step's
        request computes (:meth:`SupportsMultiModal.set_bidirectional_items`); None:
        none."""
        pieces = []
        grids = []
        spans: dict[int, tuple[tuple[int, int], ...]] = {}
        offset = 0
        for scheduled in output.scheduled:
            items = scheduled.request.features.get(self.name)
            if items:
                start = scheduled.num_computed_tokens
                end = start + scheduled.num_known_tokens
                scope = "" if self.reuse else f"@{scheduled.request.request_id}"
                for item in items:
                    first = max(start, item.offset)
                    last = min(end, item.offset + item.length)
                    if first < last:
                        pieces.append(
                            (
                                offset + first - start,
                                first - item.offset,
                                last - first,
                                item,
                                f"{item.modality}:{item.content_hash}{scope}",
                            )
                        )
                if self.spans:
                    ranges = tuple(
                        (item.offset, item.offset + item.length)
                        for item in items
                        if item.offset < end and item.offset + item.length > start + 1
                    )
                    if ranges:
                        spans[offset] = ranges
                if self.grids:
                    layout = tuple((i.offset, i.length, i.grid) for i in items if i.grid)
                    if layout:
                        grids.append((offset, start, scheduled.num_new_tokens, layout))
            offset += scheduled.num_new_tokens
        return (pieces, grids, spans) if pieces or grids or spans else None

    def before_forward(self, step: Any, data: Any, built_here: bool) -> None:
        if data is None:
            return
        data, grids, spans = data
        if grids:
            self.model.set_item_grids(grids)
        if spans:
            self.model.set_bidirectional_items(spans)
        if not data:
            return
        rows: list[int] = []
        embeddings = []
        for row, first, count, item, key in data:
            output = self._encoded(item, key)
            rows.extend(range(row, row + count))
            embeddings.append(output[first : first + count])
        self.model.set_input_embeddings(
            torch.tensor(rows, dtype=torch.long, device=self.device), torch.cat(embeddings)
        )

    def _encoded(self, item: MultiModalItem, key: str) -> torch.Tensor:
        output = self.cache.get(key)
        if output is not None:
            self.num_cache_hits += 1
            return output
        output = self.model.encode(item.modality, item.inputs)
        if output.shape[0] != item.length:
            raise RuntimeError(
                f"the encoder made {output.shape[0]} rows of a {item.modality} whose "
                f"placeholder has {item.length} tokens"
            )
        self.num_encoded += 1
        self.cache.put(key, output)
        return output
