"""Engine options for scheduling, observability and compilation."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pagedllm.core.args.parsers import json_dict
from pagedllm.core.args.refusals import NO_OP, UNSUPPORTED
from pagedllm.core.args.spec import arg
from pagedllm.core.configs.scheduling import ObservabilityConfig, SchedulerConfig

_COMPILATION_LEVELS = ("0", "1", "2", "3")

_PREEMPTION_SWAP_REFUSED = (
    "{option} {value} is not supported: pagedllm preempts by recomputation (on the cpu the "
    "KV cache already lives in host memory, so swapping would only copy it); leave {option} "
    "unset or use {supported}"
)


def compilation_config(text: str) -> int | dict[str, Any]:
    """``-O`` takes an optimization level (0-3) or a JSON compilation config.

    A JSON object holding only a level is reduced to that level, so ``-O0`` and
    ``'{"level": 0}'`` mean the same (the default).
    """
    text = text.strip()
    if text in _COMPILATION_LEVELS:
        return int(text)
    try:
        value = json_dict(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected an optimization level (0, 1, 2 or 3) or a JSON object, got {text!r}"
        ) from None
    if set(value) == {"level"} and str(value["level"]) in _COMPILATION_LEVELS:
        return int(value["level"])
    return value


@dataclasses.dataclass
class SchedulingArgs:
    """How requests are scheduled, what the engine reports, and how it compiles."""

    # ---------------------------------------------------------- ObservabilityConfig
    disable_log_stats: bool = arg(
        ObservabilityConfig.disable_log_stats,
        group="ObservabilityConfig",
        bool_style="store_true",
        help="Do not log engine statistics periodically.",
    )
    show_hidden_metrics_for_version: str | None = arg(
        None,
        group="ObservabilityConfig",
        help="Bring back Prometheus metrics hidden since this version (e.g. 0.7) while you "
        "migrate away from them.",
        unbuilt=UNSUPPORTED["show_hidden_metrics_for_version"],
    )
    otlp_traces_endpoint: str | None = arg(
        None,
        group="ObservabilityConfig",
        help="URL to export a span per request to (OTLP; the protocol is "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL's, grpc or http/protobuf, grpc when unset as in "
        "vLLM). Needs the otel extra: pip install 'pagedllm[otel]'.",
    )
    collect_detailed_traces: list[str] | None = arg(
        None,
        group="ObservabilityConfig",
        choices=("all", "model", "worker"),
        nargs="+",
        help="Add model timings to each request's span, summed over its steps: 'model' "
        "the forward passes (gen_ai.latency.time_in_model_forward), 'worker' the runner's "
        "whole steps (time_in_model_execute), 'all' both. Costs a device synchronization "
        "per step; needs --otlp-traces-endpoint.",
    )

    # -------------------------------------------------------------- SchedulerConfig
    max_num_batched_tokens: int | None = arg(
        None,
        of=SchedulerConfig.option("max_num_batched_tokens"),
        group="SchedulerConfig",
        help="Largest number of tokens processed in one step. If unset, pagedllm picks one "
        "for the entry point (8192 for the LLM class, 2048 for the server; 512 for a server "
        "on the cpu device, which chunks prompts finer for a sooner first token).",
    )
    max_num_seqs: int | None = arg(
        None,
        of=SchedulerConfig.option("max_num_seqs"),
        group="SchedulerConfig",
        help="Largest number of requests processed in one step. If unset, pagedllm picks one "
        "for the entry point.",
    )
    enable_chunked_prefill: bool | None = arg(
        None,
        group="SchedulerConfig",
        help="Let prompts be prefilled in chunks that fit the remaining "
        "--max-num-batched-tokens. If unset, pagedllm decides.",
    )
    max_num_partial_prefills: int = arg(
        of=SchedulerConfig.option("max_num_partial_prefills"),
        group="SchedulerConfig",
        help="With chunked prefill, the largest number of requests partially prefilled at once.",
    )
    max_long_partial_prefills: int = arg(
        of=SchedulerConfig.option("max_long_partial_prefills"),
        group="SchedulerConfig",
        help="With chunked prefill, the largest number of long prompts prefilled at once; a "
        "value below --max-num-partial-prefills lets short prompts overtake long ones.",
    )
    long_prefill_token_threshold: int = arg(
        of=SchedulerConfig.option("long_prefill_token_threshold"),
        group="SchedulerConfig",
        help="With chunked prefill, prompts longer than this many tokens count as long.",
    )
    scheduling_policy: str = arg(
        of=SchedulerConfig.option("policy"),
        group="SchedulerConfig",
        help="'fcfs' serves requests in arrival order; 'priority' by their priority (lower "
        "first), then arrival.",
    )
    preemption_mode: str | None = arg(
        None,
        of=SchedulerConfig.option("preemption_mode"),
        group="SchedulerConfig",
        supported=("recompute",),
        unsupported=_PREEMPTION_SWAP_REFUSED,
        help="How to preempt a request when the KV cache is full: 'recompute' its KV cache "
        "later or 'swap' it to CPU memory. If unset, recompute.",
    )
    scheduler_delay_factor: float = arg(
        of=SchedulerConfig.option("delay_factor"),
        group="SchedulerConfig",
        help="Wait this multiple of the previous prompt's latency before scheduling the next "
        "prompt.",
    )
    scheduler_cls: str | type = arg(
        SchedulerConfig.scheduler_cls,
        group="SchedulerConfig",
        help="The scheduler class to use: a registered name ('default', or a plugin's) or an "
        "import path 'module.Class' (from Python, the class itself too) of a class that "
        "implements pagedllm.core.interfaces.SchedulerInterface.",
    )
    step_extensions: list[str] = arg(
        SchedulerConfig.default("step_extensions"),
        group="SchedulerConfig",
        nargs="+",
        help="Plugins' step extensions to turn on, by registered name (pagedllm's own, "
        "LoRA, speculative decoding, pooling and guided decoding, turn on with their "
        "own options).",
    )
    cuda_graph_sizes: list[int] = arg(
        [512],
        group="SchedulerConfig",
        help="CUDA graph capture sizes: one value N captures 1, 2, 4 and multiples of 8 up to "
        "N; several values are captured as given (sizes past --max-num-seqs are left out).",
    )
    num_scheduler_steps: int = arg(
        1,
        group="SchedulerConfig",
        help="Number of forward steps per scheduler call.",
        unbuilt=UNSUPPORTED["num_scheduler_steps"],
    )
    multi_step_stream_outputs: bool = arg(
        True,
        group="SchedulerConfig",
        help="With multi-step scheduling, stream outputs after each step rather than at the end.",
        unbuilt=UNSUPPORTED["multi_step_stream_outputs"],
    )
    num_lookahead_slots: int = arg(
        0,
        group="SchedulerConfig",
        help="Extra KV-cache slots per request per step, for speculative tokens.",
        unbuilt=UNSUPPORTED["num_lookahead_slots"],
    )
    disable_chunked_mm_input: bool = arg(
        False,
        group="SchedulerConfig",
        help="With chunked prefill, never split one multi-modal item across steps: a step "
        "ends before an image that does not fit in it whole (on by itself for models that "
        "attend within an image both ways, Gemma 3).",
    )
    disable_hybrid_kv_cache_manager: bool = arg(
        False,
        group="SchedulerConfig",
        help="Give every attention layer the same KV-cache size, even when full and "
        "sliding-window attention layers are mixed.",
        no_op=NO_OP["disable_hybrid_kv_cache_manager"],
    )

    # --------------------------------------------------------------- PagedLLMConfig
    compilation_config: int | dict[str, Any] | None = arg(
        0,
        group="PagedLLMConfig",
        aliases=("-O",),
        parse=compilation_config,
        metavar="LEVEL_OR_JSON",
        help="torch.compile settings: an optimization level 0-3 (-O3 is the same as -O 3) or "
        "a JSON config with 'level', 'cudagraph_capture_sizes' and 'use_cudagraph'. Level 0: "
        "no compilation; 1: TorchDynamo graphs run as traced; 2 and 3: TorchInductor.",
    )
    kv_transfer_config: dict[str, Any] | None = arg(
        None,
        group="PagedLLMConfig",
        help="JSON settings for transferring prompts' KV cache between instances (prefill/"
        "decode disaggregation), with vLLM's keys: 'kv_connector' (ExampleConnector: a "
        "shared folder; TCPConnector: pulled from the producer), 'kv_role' (kv_producer, "
        "kv_consumer or kv_both) and 'kv_connector_extra_config' (ExampleConnector: "
        "'shared_storage_path'; TCPConnector: the producer's 'listen_port', the consumer's "
        "'peer' and 'timeout_s').",
    )
    kv_events_config: dict[str, Any] | None = arg(
        None,
        group="PagedLLMConfig",
        help="JSON settings for publishing KV-cache events over ZeroMQ, with vLLM's keys and "
        'wire format, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}\' '
        "(needs pyzmq and msgspec: pip install pagedllm[kv-events]).",
    )
    additional_config: dict[str, Any] = arg(
        {},
        group="PagedLLMConfig",
        help="JSON object of platform-specific settings.",
        unbuilt=UNSUPPORTED["additional_config"],
    )
