"""``pagedllm run-batch``: run an OpenAI batch file through the engine."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.cli.common import HELP_TIP, add_config_arg
from pagedllm.entrypoints.cli.types import CLISubcommand

if TYPE_CHECKING:
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.plugins import PluginManager
    from pagedllm.entrypoints.cli.run_batch_args import RunBatchArgs

# The engine arguments and the batch options are imported when the parser is built or the
# command runs (``pagedllm --help`` imports this module for the one-line help only).

logger = logging.getLogger("pagedllm.run_batch")
STDIO = "-"


class RunBatchSubcommand(CLISubcommand):
    name = "run-batch"
    help = "Run batch prompts and write results to file."

    def add_parser(
        self, subparsers: argparse._SubParsersAction, pm: PluginManager
    ) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(
            self.name, help=self.help, description=self.help, epilog=HELP_TIP
        )
        from pagedllm.core.argspec import add_dataclass_args
        from pagedllm.core.engine_args import EngineArgs
        from pagedllm.entrypoints.cli.run_batch_args import RunBatchArgs

        add_config_arg(parser)
        add_dataclass_args(parser, RunBatchArgs, pm.choices)
        EngineArgs.add_cli_args(parser, pm)
        pm.hook.pagedllm_add_cli_args(parser=parser, subcommand=self.name)
        return parser

    def run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        from pagedllm.core.argspec import dataclass_kwargs
        from pagedllm.core.engine_args import EngineArgs
        from pagedllm.entrypoints.cli.run_batch_args import RunBatchArgs
        from pagedllm.entrypoints.openai.request_log import check_request_logging

        batch_args = RunBatchArgs(**dataclass_kwargs(RunBatchArgs, args))
        for option, value in (
            ("-i/--input-file", batch_args.input_file),
            ("-o/--output-file", batch_args.output_file),
        ):
            if not value:
                raise ConfigError(f"{option} is required")
            if value.startswith(("http://", "https://")):
                raise ConfigError(
                    f"{option} {value}: HTTP(S) URLs are not supported (pagedllm reads and "
                    f"writes local files only); download/upload the file and give its path"
                )
        check_output_path(batch_args)
        check_request_logging(batch_args.serving_options(), logger)
        engine_args = EngineArgs.from_cli_args(args)
        texts = read_input(batch_args.input_file)
        return run_batch_file(batch_args, engine_args, texts, pm)


def check_output_path(batch_args: RunBatchArgs) -> None:
    output = batch_args.output_file
    if output != STDIO and not Path(output).resolve().parent.is_dir():
        raise ConfigError(f"-o/--output-file {output}: its directory does not exist")
    tmp_dir = batch_args.output_tmp_dir
    if tmp_dir is not None and not Path(tmp_dir).is_dir():
        raise ConfigError(f"--output-tmp-dir {tmp_dir}: not a directory")


def read_input(path: str) -> list[tuple[int, str]]:
    """The non-blank lines of the input, with their 1-based line numbers."""
    try:
        if path == STDIO:
            text = sys.stdin.read()
        else:
            text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"-i/--input-file {path}: cannot read it: {exc}") from exc
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def run_batch_file(
    batch_args: RunBatchArgs,
    engine_args: EngineArgs,
    texts: list[tuple[int, str]],
    pm: PluginManager,
) -> int:
    from pagedllm.entrypoints.cli.batch_runner import parse_line
    from pagedllm.entrypoints.openai.serving_setup import build_serving

    lines = [parse_line(text, number) for number, text in texts]
    stack = build_serving(engine_args, batch_args.serving_options(), pm)
    try:
        with metrics_server(batch_args, stack.metrics.exported()):
            records = _run(lines, stack.serving, batch_args)
    finally:
        stack.engine.shutdown()
    write_output(batch_args, records)
    failed = sum(1 for r in records if r["error"] is not None)
    logger.info(
        "%d requests: %d succeeded, %d failed; results in %s",
        len(records),
        len(records) - failed,
        failed,
        "stdout" if batch_args.output_file == STDIO else batch_args.output_file,
    )
    return 0


def _run(lines: list[Any], serving: Any, batch_args: RunBatchArgs) -> list[dict[str, Any]]:
    import asyncio

    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from pagedllm.entrypoints.cli.batch_runner import run_batch

    with (
        logging_redirect_tqdm(),
        tqdm(total=len(lines), desc="Running batch", unit="req", file=sys.stderr) as bar,
    ):
        return asyncio.run(run_batch(lines, serving, on_done=lambda _: bar.update()))


@contextlib.contextmanager
def metrics_server(batch_args: RunBatchArgs, registry: Any) -> Iterator[None]:
    """``--enable-metrics``: Prometheus metrics on ``--url``:``--port`` while the batch
    runs."""
    if not batch_args.enable_metrics:
        yield
        return
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(batch_args.port, addr=batch_args.url, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"--enable-metrics: cannot listen on {batch_args.url}:{batch_args.port}: {exc}"
        ) from exc
    logger.info("Prometheus metrics at http://%s:%d/metrics", batch_args.url, batch_args.port)
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def write_output(batch_args: RunBatchArgs, records: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    output = batch_args.output_file
    if output == STDIO:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    # Written next to the output (or in --output-tmp-dir), then moved into place, so the
    # output is never half-written.
    directory = Path(batch_args.output_tmp_dir or Path(output).resolve().parent)
    tmp_path = directory / f".{Path(output).name}.{os.getpid()}.tmp"
    try:
        tmp_path.write_text(text, encoding="utf-8")
        shutil.move(tmp_path, output)
    except OSError as exc:
        tmp_path.unlink(missing_ok=True)
        raise ConfigError(f"-o/--output-file {output}: cannot write it: {exc}") from exc
