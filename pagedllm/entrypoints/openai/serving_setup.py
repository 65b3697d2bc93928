"""Build the engine and the OpenAI request handlers without an HTTP server.

The same pieces :func:`pagedllm.entrypoints.openai.api_server.run_server` builds, for
commands that serve OpenAI requests in-process (``run-batch``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any

from pagedllm.core.argspec import refused_fields
from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.request_log import check_request_logging

if TYPE_CHECKING:
    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.engine_client import EngineClient
    from pagedllm.core.plugins import PluginManager
    from pagedllm.entrypoints.metrics import Metrics, ReplicaMetrics
    from pagedllm.entrypoints.openai.cli_args import FrontendArgs
    from pagedllm.entrypoints.openai.serving import OpenAIServing
    from pagedllm.entrypoints.tracing import RequestTracer


@dataclasses.dataclass(slots=True)
class ServingStack:
    config: PagedLLMConfig
    engine: EngineClient
    serving: OpenAIServing
    metrics: Metrics | ReplicaMetrics

    @property
    def model_names(self) -> list[str]:
        return list(self.serving.model_names)


def build_serving(
    engine_args: EngineArgs, options: FrontendArgs, pm: PluginManager
) -> ServingStack:
    """Load the model and start the engine loop; the caller calls ``engine.shutdown()``.
    The options are checked (and the chat template read) before the model loads."""
    return start_serving(engine_args, options, pm).finish()


def apply_log_config(path: str | None) -> dict[str, Any] | None:
    """``--log-config-file``: read and applied (uvicorn is given it too)."""
    if not path:
        return None
    import logging.config

    try:
        with open(path, encoding="utf-8") as f:
            log_config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--log-config-file {path}: {exc}") from exc
    logging.config.dictConfig(log_config)
    return log_config


def start_serving(
    engine_args: EngineArgs, options: FrontendArgs, pm: PluginManager
) -> PendingServing:
    """Check the options, read the chat template and start loading the model on the
    engine's thread (with ``--data-parallel-size`` N, in N replica processes);
    :meth:`PendingServing.finish` waits for it."""
    from pagedllm.core.args.checks import invalid_values
    from pagedllm.core.async_engine import AsyncLLMEngine
    from pagedllm.core.config import UsageContext
    from pagedllm.entrypoints.openai.chat_utils import load_chat_template

    problems = invalid_values(options)
    if problems:
        raise ConfigError("; ".join(problems))
    chat_template = load_chat_template(options.chat_template)
    config = engine_args.create_engine_config(pm, UsageContext.OPENAI_API_SERVER)
    tracer = None
    if config.observability_config.otlp_traces_endpoint:  # (checked before the model loads)
        from pagedllm.entrypoints.tracing import RequestTracer

        if config.parallel_config.data_parallel_size > 1:
            raise ConfigError(
                "--otlp-traces-endpoint with --data-parallel-size > 1 is not supported yet "
                "(the replicas' engines run in processes of their own)"
            )
        tracer = RequestTracer(
            config.observability_config, config.model_config.served_model_name[0]
        )
    engine: EngineClient
    if config.parallel_config.data_parallel_size > 1:
        from pagedllm.entrypoints.data_parallel.replica_client import DataParallelClient

        engine = DataParallelClient.start(config)
    else:
        engine = AsyncLLMEngine(config, pm, wait=False)
    return PendingServing(config, engine, options, pm, chat_template, tracer)


@dataclasses.dataclass
class PendingServing:
    """A model loading on the engine's thread (see :func:`start_serving`)."""

    config: PagedLLMConfig
    engine: EngineClient
    options: FrontendArgs
    pm: PluginManager
    chat_template: str | None
    # --otlp-traces-endpoint's span exporter.
    tracer: RequestTracer | None = None

    def finish(self) -> ServingStack:
        """Wait for the model, then build what serves it. A load that fails raises
        here; anything after it stops the engine (replica processes must not outlive
        a server that failed to start)."""
        self.engine.wait_built()  # (replicas that fail to start are stopped by then)
        try:
            return self._build()
        except BaseException:
            self.engine.shutdown()
            if self.tracer is not None:
                self.tracer.shutdown()
            raise

    def _build(self) -> ServingStack:
        from pagedllm.core.async_engine import AsyncLLMEngine
        from pagedllm.entrypoints.metrics import Metrics, ReplicaMetrics, metrics_label
        from pagedllm.entrypoints.openai.serving import OpenAIServing

        engine, options, pm, config = self.engine, self.options, self.pm, self.config
        names = config.model_config.served_model_name
        reasoning_parser = config.decoding_config.reasoning_parser
        serving = OpenAIServing(
            engine,
            options,
            model_names=names,
            chat_template=self.chat_template,
            tool_parser=(
                pm.load("tool_parsers", options.tool_call_parser)
                if options.tool_call_parser
                else None
            ),
            reasoning_parser=(
                pm.load("reasoning_parsers", reasoning_parser) if reasoning_parser else None
            ),
            tracer=self.tracer,
        )
        for name, path, base in parse_lora_modules(options.lora_modules or []):
            try:
                serving.add_lora(name, path, base)
            except OpenAIError as exc:
                raise ConfigError(f"--lora-modules {name}: {exc.message}") from None
        metrics: Metrics | ReplicaMetrics
        if isinstance(engine, AsyncLLMEngine):
            metrics = Metrics(
                metrics_label(names[0]), engine.engine.max_model_len, options.metrics_prefix
            )
            engine.step_listeners.append(metrics.on_step)
            engine.abort_listeners.append(metrics.on_aborted)
            if self.tracer is not None:
                engine.step_listeners.append(self.tracer.on_step)
                engine.abort_listeners.append(self.tracer.on_aborted)
        else:  # (each replica keeps its own; /metrics gathers them)
            metrics = ReplicaMetrics(engine, options.metrics_prefix)
        return ServingStack(config, engine, serving, metrics)


def parse_lora_modules(entries: list[str]) -> list[tuple[str, str, str | None]]:
    """``--lora-modules`` entries (``name=path``, or JSON with name, path and
    base_model_name; ``local_path`` is the older spelling of path) as ``(name, path, base
    model name)``."""
    modules = []
    for entry in entries:
        if entry.lstrip().startswith("{"):
            try:
                values = json.loads(entry)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--lora-modules {entry!r}: invalid JSON ({exc})") from None
            path = values.get("path")
            local_path = values.pop("local_path", None)
            if path is not None and local_path is not None and path != local_path:
                raise ConfigError(
                    f"--lora-modules {entry!r}: 'path' and 'local_path' (its older "
                    "spelling) differ; give one"
                )
            values["path"] = path if path is not None else local_path
            unknown = sorted(set(values) - {"name", "path", "base_model_name"})
            named = all(isinstance(values.get(k), str) and values[k] for k in ("name", "path"))
            if unknown or not named or not isinstance(values.get("base_model_name") or "", str):
                raise ConfigError(
                    f"--lora-modules {entry!r}: needs 'name' and 'path' (or 'local_path'), "
                    f"and optionally 'base_model_name'{f'; unknown {unknown}' if unknown else ''}"
                )
            modules.append((values["name"], values["path"], values.get("base_model_name")))
            continue
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules {entry!r}: use name=path or a JSON object")
        modules.append((name, path, None))
    return modules


def validate_frontend_args(frontend_args: FrontendArgs, pm: PluginManager) -> None:
    """The front end's options, checked before anything starts (``serve`` and each
    ``--api-server-count`` front end): refused ones, the request log, the tool parser
    (loaded now, so a broken one fails by name) and ``--lora-modules``."""
    problems = refused_fields(frontend_args)
    if problems:
        raise ConfigError("; ".join(problems))
    check_request_logging(frontend_args, logging.getLogger("pagedllm.server"))
    if frontend_args.tool_parser_plugin:
        pm.load_plugin_file(frontend_args.tool_parser_plugin)
    parser_name = frontend_args.tool_call_parser
    if parser_name is not None and parser_name not in pm.registry("tool_parsers"):
        raise ConfigError(
            f"--tool-call-parser: invalid choice {parser_name!r} (choose from "
            f"{', '.join(pm.choices('tool_parsers')) or 'none installed'}, or a name "
            f"registered by --tool-parser-plugin)"
        )
    if parser_name is not None:
        pm.load("tool_parsers", parser_name)  # (a broken or disputed one fails now, by name)
    if frontend_args.enable_auto_tool_choice and parser_name is None:
        raise ConfigError("--enable-auto-tool-choice requires --tool-call-parser")
    if frontend_args.lora_modules:
        parse_lora_modules(frontend_args.lora_modules)  # (malformed entries fail now)
