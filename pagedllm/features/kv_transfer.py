"""--kv-transfer-config as a step extension: a prefill engine (``kv_producer``) hands the
KV cache of its prompts' full blocks to a KV connector, and a decode engine
(``kv_consumer``) loads them instead of computing the prompt again (``kv_both``: both).

Keys: each full prompt block's sha256 chain hash (its tokens, everything before it, the
request's cache salt and multimodal keys; see :mod:`pagedllm.core.kv_cache.hashing`) and
the cache layout, so they are stable across processes and engines with other layouts never
match. Producer: the step that computes a prompt's last token saves its full blocks once
the forward pass wrote them (:meth:`KVTransferRunner.after_forward`). Consumer: a waiting
request's blocks after its local prefix-cache hits are looked up and loaded into host
memory while it is admitted (:meth:`KVTransferExtension.external_tokens`: a block the
connector cannot give ends them, and the rest is computed), then written into the slots
the scheduler allocated them, before the step's forward pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces.extension import RunnerExtension, StepExtension
from pagedllm.core.interfaces.kv_connector import KVBlockLayout, KVConnector
from pagedllm.core.kv_cache.hashing import get_hash_fn, hash_block_tokens, request_extra_keys

if TYPE_CHECKING:
    from pagedllm.core.configs.kv_transfer import KVTransferConfig
    from pagedllm.core.request import Request
    from pagedllm.core.step_data import SchedulerOutput

logger = logging.getLogger("pagedllm.kv_transfer")

_SHA256 = get_hash_fn("sha256")


@dataclasses.dataclass(slots=True)
class KVTransferState:
    """A request's transfers: its prompt blocks' keys (made when first needed), the
    blocks loaded for it from block ``first`` on (until its step writes them), and
    whether its prompt's blocks were saved."""

    keys: list[str] | None = None
    first: int = 0
    blocks: list[torch.Tensor] = dataclasses.field(default_factory=list)
    pending: bool = False
    saved: bool = False


@dataclasses.dataclass(slots=True)
class StepTransfers:
    """A step's transfers (``step.extras["kv_transfer"]``): blocks to write into the cache
    before the forward pass (block ids, their tensors) and blocks to save after it."""

    load_ids: list[int] = dataclasses.field(default_factory=list)
    load_blocks: list[torch.Tensor] = dataclasses.field(default_factory=list)
    save_ids: list[int] = dataclasses.field(default_factory=list)
    save_keys: list[str] = dataclasses.field(default_factory=list)


def prompt_block_keys(request: Request, block_size: int, tag: str) -> list[str]:
    """The connector keys of ``request``'s full prompt blocks."""
    keys = []
    parent = None
    tokens = request.prompt_token_ids
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = request_extra_keys(request, start, start + block_size)
        block = hash_block_tokens(_SHA256, parent, tokens[start : start + block_size], extra)
        parent = block.hash_value
        keys.append(hashlib.sha256(f"{tag}:{parent:x}".encode()).hexdigest())
    return keys


def _state_keys(state: KVTransferState, request: Request, layout: KVBlockLayout) -> list[str]:
    if state.keys is None:
        state.keys = prompt_block_keys(request, layout.shape[2], layout.tag)
    return state.keys


class KVTransferExtension(StepExtension):
    """Every request carries a :class:`KVTransferState`."""

    name = "kv_transfer"

    def __init__(
        self, config: KVTransferConfig, layout: KVBlockLayout, loader: KVConnector | None
    ) -> None:
        super().__init__()
        self.config = config
        self.layout = layout
        self.block_size = layout.shape[2]
        # The scheduler side's connector (a consuming role), which loads blocks.
        self.loader = loader
        # vLLM's external prefix cache: prompt tokens looked up, and found (loaded).
        self.stats = {"queries": 0, "hits": 0}

    @classmethod
    def from_engine(cls, engine: Any) -> KVTransferExtension | None:
        config = engine.config.kv_transfer_config
        if config is None:
            return None
        if engine.task != "generate":
            raise ConfigError(
                f"--kv-transfer-config moves generation's KV cache; this engine serves the "
                f"{engine.task} task (its prompts are pooled, not decoded)"
            )
        registry = engine.pm.registry("kv_connectors")
        if config.kv_connector not in registry.names():
            raise ConfigError(
                f"--kv-transfer-config: unknown kv_connector {config.kv_connector!r}; "
                f"choose one of {sorted(registry.names())}"
            )
        spec, _ = engine.executor.kv_cache_layout(engine.loaded)
        block_size = engine.config.cache_config.block_size
        layout = KVBlockLayout(
            (spec.num_layers, 2, block_size, spec.num_kv_heads, spec.head_dim), spec.dtype
        )
        connector_cls = registry.load(config.kv_connector)
        loader = connector_cls(config, layout, "scheduler") if config.is_consumer else None
        logger.info(
            "KV transfer: %s as %s (engine %s)",
            config.kv_connector,
            config.kv_role,
            config.engine_id or "-",
        )
        return cls(config, layout, loader)

    def runner_payload(self) -> Any:
        return self.config, self.layout

    @classmethod
    def make_runner_extension(cls, payload: Any, worker: Any) -> KVTransferRunner:
        config, layout = payload
        saver = None
        if config.is_producer:
            connector_cls = worker.pm.load("kv_connectors", config.kv_connector)
            saver = connector_cls(config, layout, "worker")
        return KVTransferRunner(worker, layout, saver)

    def shutdown(self) -> None:
        if self.loader is not None:
            self.loader.close()

    def new_request(self, request: Request) -> None:
        request.features[self.name] = KVTransferState()

    def external_tokens(self, request: Request, num_cached: int) -> int:
        state: KVTransferState = request.features[self.name]
        state.blocks, state.pending = [], False
        loader = self.loader
        if loader is None or num_cached % self.block_size:
            return 0
        if getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return 0  # (its prompt's logits are computed at every position)
        first = num_cached // self.block_size
        # Whole prompt blocks, leaving the last token to compute for its logits.
        last = min(request.num_prompt_tokens, request.num_tokens - 1) // self.block_size
        if last <= first:
            return 0
        keys = _state_keys(state, request, self.layout)[first:last]
        found = loader.lookup(keys)
        blocks = loader.load(keys[:found]) if found else []
        layout = self.layout
        blocks = [b for b in blocks if b.shape == layout.shape and b.dtype == layout.dtype]
        if len(blocks) < len(keys) and self.config.kv_role == "kv_consumer":
            logger.warning(
                "KV transfer: request %s: %d of its %d prompt blocks after its %d cached "
                "tokens came from %s; computing the rest",
                request.request_id,
                len(blocks),
                len(keys),
                num_cached,
                self.config.kv_connector,
            )
        state.first, state.blocks = first, blocks
        return len(blocks) * self.block_size

    def admitted(self, request: Request) -> None:
        if self.loader is None:
            return
        state: KVTransferState = request.features[self.name]
        self.stats["queries"] += request.num_tokens
        if state.blocks:
            state.pending = True
            self.stats["hits"] += len(state.blocks) * self.block_size


class KVTransferRunner(RunnerExtension):
    """Writes the loaded blocks into the cache; saves computed prompts' blocks."""

    name = "kv_transfer"

    def __init__(self, worker: Any, layout: KVBlockLayout, saver: KVConnector | None) -> None:
        self.worker = worker
        self.layout = layout
        self.saver = saver

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()

    def step_input(self, output: SchedulerOutput) -> StepTransfers | None:
        transfers = StepTransfers()
        for item in output.scheduled:
            request = item.request
            state: KVTransferState | None = request.features.get(self.name)
            if state is None:
                continue
            if state.pending:
                ids = item.block_ids[state.first : state.first + len(state.blocks)]
                transfers.load_ids.extend(ids)
                transfers.load_blocks.extend(state.blocks)
                state.blocks, state.pending = [], False
            end = item.num_computed_tokens + item.num_new_tokens
            if self.saver is not None and not state.saved and end >= request.num_prompt_tokens:
                state.saved = True
                keys = _state_keys(state, request, self.layout)
                transfers.save_keys.extend(keys)
                transfers.save_ids.extend(item.block_ids[: len(keys)])
        if not (transfers.load_ids or transfers.save_ids):
            return None
        return transfers

    def before_forward(self, step: Any, data: StepTransfers | None, built_here: bool) -> None:
        if data is None or not data.load_ids:
            return
        caches = self.worker.runner.kv_caches
        ids = torch.tensor(data.load_ids, device=caches[0].device)
        # [layers, 2, blocks, block_size, heads, dim]
        blocks = torch.stack(data.load_blocks, dim=2).to(caches[0].device)
        for layer, cache in enumerate(caches):
            cache[:, ids] = blocks[layer]

    def after_forward(self, step: Any, data: StepTransfers | None) -> None:
        if data is None or not data.save_ids or self.saver is None:
            return
        caches = self.worker.runner.kv_caches
        ids = torch.tensor(data.save_ids, device=caches[0].device)
        blocks = torch.stack([cache[:, ids] for cache in caches]).cpu()
        self.saver.save(data.save_keys, list(blocks.unbind(dim=2)))
