"""Options of ``pagedllm run-batch`` that are not engine arguments.

Each field is one ``--flag`` (see :mod:`pagedllm.core.argspec`) in the group "RunBatch";
the engine's own options come from :class:`pagedllm.core.engine_args.EngineArgs`. The
options that shape responses are the server's own (:class:`FrontendArgs`), declared once
there and listed here under "RunBatch".
"""

import dataclasses
from typing import Any

from pagedllm.core.argspec import META_KEY, arg, field_meta
from pagedllm.entrypoints.openai.cli_args import FrontendArgs

# The server options that run-batch offers too.
SERVER_OPTIONS = (
    "response_role",
    "max_log_len",
    "enable_prompt_tokens_details",
    "enable_log_requests",
    "disable_log_requests",
    "metrics_prefix",
)


def _server_option(name: str) -> Any:
    """The :class:`FrontendArgs` field ``name`` (its flag, default and help), in the
    group "RunBatch"."""
    field = FrontendArgs.__dataclass_fields__[name]
    meta = field_meta(field)
    assert meta is not None and name in SERVER_OPTIONS
    return dataclasses.field(
        default=field.default, metadata={META_KEY: dataclasses.replace(meta, group="RunBatch")}
    )


@dataclasses.dataclass
class RunBatchArgs:
    """Arguments for running an OpenAI batch file through the engine."""

    input_file: str | None = arg(
        None,
        group="RunBatch",
        aliases=("-i",),
        help="Path or URL of the input batch file (JSON lines). A URL is fetched with HTTP GET.",
    )
    output_file: str | None = arg(
        None,
        group="RunBatch",
        aliases=("-o",),
        help="Path or URL of the output file. A URL is written with HTTP PUT.",
    )
    output_tmp_dir: str | None = arg(
        None,
        group="RunBatch",
        help="Directory where the output file is written before it is uploaded to the output URL.",
    )
    response_role: str = _server_option("response_role")
    enable_metrics: bool = arg(
        False,
        group="RunBatch",
        bool_style="store_true",
        help="Serve Prometheus metrics while the batch runs.",
    )
    url: str = arg(
        "0.0.0.0",
        group="RunBatch",
        help="Address of the Prometheus metrics server; used with --enable-metrics.",
    )
    port: int = arg(
        8000,
        group="RunBatch",
        help="Port of the Prometheus metrics server; used with --enable-metrics.",
    )
    max_log_len: int | None = _server_option("max_log_len")
    enable_prompt_tokens_details: bool = _server_option("enable_prompt_tokens_details")
    enable_log_requests: bool = _server_option("enable_log_requests")
    disable_log_requests: bool = _server_option("disable_log_requests")
    metrics_prefix: str = _server_option("metrics_prefix")

    def serving_options(self) -> FrontendArgs:
        """The server options the batch's requests are served with. (No
        --max-response-mb: a batch cannot stream, the refusal's remedy.)"""
        options = {name: getattr(self, name) for name in SERVER_OPTIONS}
        return FrontendArgs(max_response_mb=0, **options)
