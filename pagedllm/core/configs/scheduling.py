"""How requests are scheduled, what the engine reports, and how the model is compiled."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pagedllm.core.configs.base import Config, setting
from pagedllm.core.errors import ConfigError


@dataclasses.dataclass
class SchedulerConfig(Config):
    # --max-num-batched-tokens depends on the entry point when unset (see
    # pagedllm.core.config.default_step_tokens); this is the engine's.
    max_num_batched_tokens: int = setting(2048, min=1)
    max_num_seqs: int = setting(256, min=1)
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = setting(1, min=1)
    max_long_partial_prefills: int = setting(1, min=1, max="max_num_partial_prefills")
    long_prefill_token_threshold: int = setting(0, min=0, range_hint="must be >= 0")
    policy: str = setting("fcfs", choices=("fcfs", "priority"))
    # (pagedllm preempts by recomputation: the engine arguments refuse "swap")
    preemption_mode: str = setting("recompute", choices=("recompute", "swap"))
    delay_factor: float = setting(0.0, min=0, range_hint="must be >= 0")
    # A registered scheduler's name, a SchedulerInterface class, or the dotted path to one.
    scheduler_cls: str | type = "pagedllm.core.scheduler.Scheduler"
    # --disable-chunked-mm-input: a step never computes part of a multimodal item (the
    # extension of items asks the scheduler through StepExtension.schedulable_tokens).
    disable_chunked_mm_input: bool = False
    # --step-extensions: plugins' step extensions to turn on, by registered name.
    step_extensions: list[str] = dataclasses.field(default_factory=list)

    arg_names: ClassVar[dict[str, str]] = {
        "policy": "scheduling_policy",
        "delay_factor": "scheduler_delay_factor",
    }


@dataclasses.dataclass
class ObservabilityConfig(Config):
    disable_log_stats: bool = False
    # --otlp-traces-endpoint: where the serving layer exports one span per request.
    otlp_traces_endpoint: str | None = None
    # --collect-detailed-traces: "model" times each step's forward pass, "worker" the
    # runner's whole step, "all" both (summed per request over its steps).
    collect_detailed_traces: list[str] | None = None

    def check(self) -> None:
        if not self.collect_detailed_traces:
            self.collect_detailed_traces = None
            return
        unknown = sorted(set(self.collect_detailed_traces) - {"all", "model", "worker"})
        if unknown:
            raise ConfigError(
                f"--collect-detailed-traces: invalid choice(s) {unknown} (choose from "
                "all, model, worker)"
            )
        if not self.otlp_traces_endpoint:
            raise ConfigError(
                "--collect-detailed-traces needs --otlp-traces-endpoint (the traces it adds "
                "to are exported there)"
            )

    @property
    def collect_model_forward_time(self) -> bool:
        modules = self.collect_detailed_traces or ()
        return "model" in modules or "all" in modules

    @property
    def collect_model_execute_time(self) -> bool:
        modules = self.collect_detailed_traces or ()
        return "worker" in modules or "all" in modules


@dataclasses.dataclass
class CompilationConfig(Config):
    """-O, --cuda-graph-sizes, --max-seq-len-to-capture, --enforce-eager (see
    :mod:`pagedllm.core.compilation`)."""

    level: int = 0
    # Decode batch sizes captured as graphs, ascending; empty: no graphs.
    capture_sizes: list[int] = dataclasses.field(default_factory=list)
    # Decode steps with a longer context than this run eagerly.
    max_seq_len_to_capture: int = 8192

    def check(self) -> None:
        if self.level not in (0, 1, 2, 3):
            raise ConfigError(
                f"--compilation-config: level {self.level!r} is not one of 0, 1, 2, 3"
            )
        if any(n < 1 for n in self.capture_sizes) or self.max_seq_len_to_capture < 1:
            raise ConfigError(
                "CUDA graph sizes (--cuda-graph-sizes, cudagraph_capture_sizes) and "
                "--max-seq-len-to-capture must be positive"
            )
