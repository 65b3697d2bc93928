"""Pooling (``--task embed/classify/score/reward``) as a step extension: the engine's pooler
configs, a pooling request's validation and state (its ``PoolingParams``), its prompt run
once and whole, its result read from the hidden states (with an encoder's token types),
and the request done when its pooled result comes out."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.interfaces.extension import RunnerExtension, StepExtension, StepOutcome
from pagedllm.core.model_files import resolve_model_path
from pagedllm.core.pooling import (
    POOLING_TASKS,
    PoolerConfig,
    PoolingParams,
    activate,
    select_rows,
    sentence_transformers_pooler,
)
from pagedllm.core.sampling import SamplingParams
from pagedllm.core.transfer import host_tensor

if TYPE_CHECKING:
    from collections.abc import Callable

    from pagedllm.core.step_data import RunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger("pagedllm.engine")

_DONE = StepOutcome([], finished=True)


class PoolingExtension(StepExtension):
    """On when the engine serves a pooling task. A request's state: its ``PoolingParams``."""

    name = "pooling"
    params_type = PoolingParams
    allows_decode_graphs = False

    def __init__(
        self, task: str, pooler_configs: dict[str, PoolerConfig], max_model_len: int
    ) -> None:
        super().__init__()
        self.task = task
        self.max_model_len = max_model_len
        # The pooler of each task the model serves (its defaults under
        # --override-pooler-config).
        self.pooler_configs = pooler_configs
        self.tasks = tuple(pooler_configs)

    @classmethod
    def from_engine(cls, engine: Any) -> PoolingExtension | None:
        if engine.task not in POOLING_TASKS:
            return None
        configs = pooler_configs(engine.config, engine.loaded.model)
        return cls(engine.task, configs, engine.max_model_len)

    @classmethod
    def not_enabled_error(cls) -> InvalidRequestError:
        return InvalidRequestError(
            "task",
            "pooling requests (embeddings, classification, scores, rewards) need an engine "
            f"started with --task {'/'.join(POOLING_TASKS)}",
        )

    def adjust_config(self, config: Any) -> Any:
        """Pooling prompts run whole: no chunked prefill and no prefix cache (a prompt's
        pooled rows need every token's hidden state)."""
        sched = config.scheduler_config
        if config.cache_config.enable_prefix_caching or sched.enable_chunked_prefill:
            logger.info("--task %s: prompts run whole (no prefix caching or chunks)", self.task)
        return config.replace(
            cache_config=config.cache_config.replace(enable_prefix_caching=False),
            scheduler_config=sched.replace(
                enable_chunked_prefill=False,
                max_num_batched_tokens=max(sched.max_num_batched_tokens, self.max_model_len),
            ),
        )

    def runner_payload(self) -> Any:
        return self.pooler_configs

    @classmethod
    def make_runner_extension(cls, payload: Any, worker: Any) -> PoolingRunner:
        return PoolingRunner(worker.loaded.model, payload, worker.config.device_config.torch_device)

    def new_parent(self, engine: Any, new: Any) -> Any:
        """Every request of a pooling engine: validated, its prompt runs once, whole."""
        params = new.params
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(
                "task",
                f"this model serves --task {self.task} (pooling), not text generation",
            )
        params = params.clone()
        params.task = params.task or self.task
        if params.task not in self.pooler_configs:
            raise InvalidRequestError(
                "task",
                f"this model serves {', '.join(self.pooler_configs)}, not {params.task}",
            )
        try:
            params.verify(params.task, engine.loaded.hf_config)
        except ValueError as exc:
            raise InvalidRequestError("pooling_params", str(exc)) from None
        text, token_ids = engine.prompt_tokens(new, params.truncate_prompt_tokens)
        if params.truncate_prompt_tokens is not None and params.token_type_ids is not None:
            params.token_type_ids = params.token_type_ids[-params.truncate_prompt_tokens :]
        if len(token_ids) > engine.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt ({len(token_ids)} tokens) is longer than the maximum model length "
                f"of {engine.max_model_len} tokens",
            )
        if params.token_type_ids is not None and len(params.token_type_ids) != len(token_ids):
            raise InvalidRequestError("token_type_ids", "one token type per prompt token")
        placeholder = SamplingParams(max_tokens=1, detokenize=False)
        return engine.build_parent(
            new, text, token_ids, placeholder, {self.name: params}, samples_tokens=False
        )

    def read_outputs(self, output: SchedulerOutput, result: RunnerOutput) -> dict[str, StepOutcome]:
        return dict.fromkeys(result.pooled, _DONE) if result.pooled else {}


def pooler_configs(config: Any, model: Any) -> dict[str, PoolerConfig]:
    """The pooler of each task ``model`` serves: its defaults, a sentence-transformers
    checkpoint's pooling settings (embeddings), then ``--override-pooler-config``."""
    mc = config.model_config
    override = PoolerConfig.from_dict(dict(mc.override_pooler_config or {}))
    directory = resolve_model_path(
        mc.model, revision=mc.revision, download_dir=config.load_config.download_dir
    )
    sentence = sentence_transformers_pooler(directory if directory.is_dir() else directory.parent)
    configs = {}
    for task in model.pooling_tasks:
        defaults = model.default_pooler_config(task)
        if task == "embed" and sentence is not None:
            defaults = defaults.merged(sentence)
        configs[task] = defaults.merged(override)
    return configs


class PoolingRunner(RunnerExtension):
    """The runner's side: an encoder's token types in, each finished prompt's pooled
    result out."""

    name = "pooling"

    def __init__(self, model: Any, configs: dict[str, PoolerConfig], device: Any) -> None:
        self.model = model
        self.device = device
        self.configs = configs
        self.encoder = bool(getattr(model, "is_encoder", False))

    def step_input(self, output: SchedulerOutput) -> Any:
        """An encoder's token types (segment ids), in the order of the step's tokens: each
        request's own where it has them, else zeros; None when no request has any."""
        if not self.encoder:
            return None
        types: list[int] = []
        given_any = False
        for item in output.scheduled:
            params = item.request.features.get(self.name)
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            given = params.token_type_ids if params is not None else None
            if given:
                given_any = True
                types.extend(given[start:end])
            else:
                types.extend([0] * (end - start))
        return types if given_any else None

    def before_forward(self, step: Any, data: Any, built_here: bool) -> None:
        if self.encoder:
            types = None if data is None else host_tensor(data, torch.long, self.device)
            self.model.token_type_ids = types

    def split(self, data: Any, requests: slice, tokens: slice, first: bool) -> Any:
        return data[tokens]

    def claim(
        self, item: ScheduledRequest, offset: int, add_rows: Callable[[int, int], int]
    ) -> Any:
        if self.name in item.request.features and item.reaches_end:
            if item.num_computed_tokens != 0:
                raise RuntimeError("a pooling prompt must be computed in one step")
            return offset
        return None

    def finish(
        self,
        claims: list[tuple[ScheduledRequest, Any]],
        hidden: torch.Tensor,
        logits_of: Callable[[int], torch.Tensor],
        result: RunnerOutput,
    ) -> None:
        for item, start in claims:
            request = item.request
            params = request.features[self.name]
            config = self.configs[params.task]
            rows = select_rows(
                hidden[start : start + item.num_new_tokens], request.prompt_token_ids, config
            )
            scores = self.model.pooling_head(rows, params.task)
            result.pooled[request.request_id] = activate(scores, params.task, config, params).cpu()
