"""``pagedllm serve``: the OpenAI-compatible API server."""

from __future__ import annotations

import argparse
import gc
from typing import TYPE_CHECKING

from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.cli.common import HELP_TIP, add_config_arg
from pagedllm.entrypoints.cli.types import CLISubcommand

if TYPE_CHECKING:
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.plugins import PluginManager
    from pagedllm.entrypoints.openai.cli_args import FrontendArgs

# The engine arguments and the front end's options are imported when a parser is built or
# a command runs, not with this module: ``pagedllm --help`` imports every subcommand's
# module for its one-line help.


class ServeSubcommand(CLISubcommand):
    name = "serve"
    help = "Start the OpenAI-compatible API server."

    def add_parser(
        self, subparsers: argparse._SubParsersAction, pm: PluginManager
    ) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(
            self.name,
            help=self.help,
            description=self.help,
            usage="pagedllm serve [model_tag] [options]",
            epilog=HELP_TIP,
        )
        parser.add_argument(
            "model_tag",
            nargs="?",
            default=None,
            help="The model to serve: a local directory or file, or a Hugging Face id "
            "already in the local cache. Optional if given in --config or with --model.",
        )
        from pagedllm.core.argspec import add_dataclass_args
        from pagedllm.core.engine_args import EngineArgs
        from pagedllm.entrypoints.openai.cli_args import FrontendArgs

        add_config_arg(parser)
        add_dataclass_args(parser, FrontendArgs, pm.choices)
        EngineArgs.add_cli_args(parser, pm)
        pm.hook.pagedllm_add_cli_args(parser=parser, subcommand=self.name)
        return parser

    def run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        # Start-up makes objects that live as long as the server (modules, the model, the
        # app): collecting garbage among them finds next to none and took 0.1 s of a
        # 1.6 s start. Collection resumes once the server is up (run_server's startup),
        # before anything else this runs, or when it fails.
        gc.disable()
        try:
            return self._run(args, pm)
        finally:
            gc.enable()

    def _run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        from pagedllm.core.argspec import dataclass_kwargs
        from pagedllm.entrypoints.openai.cli_args import FrontendArgs
        from pagedllm.entrypoints.openai.serving_setup import (
            apply_log_config,
            start_serving,
            validate_frontend_args,
        )

        engine_args = engine_args_from_serve(args)
        frontend_args = FrontendArgs(**dataclass_kwargs(FrontendArgs, args))
        validate_frontend_args(frontend_args, pm)
        if frontend_args.lora_modules and not engine_args.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        if frontend_args.disable_frontend_multiprocessing:
            check_one_process(engine_args, frontend_args)
        check_traced_layout(engine_args, frontend_args)
        log_config = apply_log_config(frontend_args.log_config_file)
        if frontend_args.headless or frontend_args.api_server_count > 1:
            gc.enable()  # (these serve from here on)
        if frontend_args.headless:
            from pagedllm.entrypoints.data_parallel.headless import serve_headless

            return serve_headless(engine_args, frontend_args, pm)
        if frontend_args.data_parallel_start_rank:
            raise ConfigError(
                "--data-parallel-start-rank applies to --headless nodes (the head node runs "
                "the replicas from 0)"
            )
        if frontend_args.api_server_count > 1:
            from pagedllm.entrypoints.openai.front_ends import serve_front_ends

            return serve_front_ends(engine_args, frontend_args, pm, log_config)
        # The model loads on the engine's thread while this one imports the HTTP server
        # (FastAPI, uvicorn, the routes): about 0.2 s of the start.
        pending = start_serving(engine_args, frontend_args, pm)
        from pagedllm.entrypoints.openai.api_server import run_server

        return run_server(pending, frontend_args, pm, log_config)


def engine_args_from_serve(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs with the positional model (which must agree with ``--model``)."""
    from pagedllm.core.engine_args import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    default_model = EngineArgs().model
    if args.model_tag is not None:
        if engine_args.model not in (default_model, args.model_tag):
            raise ConfigError(
                f"the model is given twice: positional {args.model_tag!r} and "
                f"--model {engine_args.model!r}; give it once"
            )
        engine_args.model = args.model_tag
    return engine_args


def check_traced_layout(engine_args: EngineArgs, frontend_args: FrontendArgs) -> None:
    """``--otlp-traces-endpoint``: spans are made by the engine in the API server's
    process; layouts whose engines run in processes of their own are refused by name."""
    if not engine_args.otlp_traces_endpoint:
        return
    dp, count = engine_args.data_parallel_size, frontend_args.api_server_count
    if dp > 1 or count > 1 or frontend_args.headless:
        raise ConfigError(
            "--otlp-traces-endpoint: traces are exported by an engine running in the API "
            "server's process; with --data-parallel-size > 1, --api-server-count > 1 or "
            f"--headless (here {dp}, {count}, {frontend_args.headless}) the engines run in "
            "processes of their own, which do not export traces yet"
        )


def check_one_process(engine_args: EngineArgs, frontend_args: FrontendArgs) -> None:
    """``--disable-frontend-multiprocessing``: one engine already runs on a thread of the
    API server's process; the layouts whose engines or front ends are processes of their
    own are refused by name (running them in one process is not implemented)."""
    flag = "--disable-frontend-multiprocessing"
    dp = engine_args.data_parallel_size
    if frontend_args.headless:
        raise ConfigError(f"{flag}: a --headless node runs no API server")
    if dp > 1:
        raise ConfigError(
            f"{flag}: with --data-parallel-size {dp} each replica's engine runs in a "
            "process of its own, which the API server reaches over a connection; running "
            "the replicas in the API server's process is not implemented (drop the flag, "
            "or serve one replica)"
        )
    if frontend_args.api_server_count > 1:
        raise ConfigError(
            f"{flag}: --api-server-count {frontend_args.api_server_count} runs that many "
            "API server processes in front of an engine process of its own; they cannot "
            "share one process (drop one of the flags)"
        )
