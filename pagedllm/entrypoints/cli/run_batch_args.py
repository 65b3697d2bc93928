"""Options of ``pagedllm run-batch`` that are not engine arguments.

Each field is one ``--flag`` (see :mod:`pagedllm.core.argspec`) in the group "RunBatch";
the engine's own options come from :class:`pagedllm.core.engine_args.EngineArgs`.
"""

import dataclasses

from pagedllm.core.argspec import arg


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
    response_role: str = arg(
        "assistant",
        group="RunBatch",
        help="Role name returned when a request sets add_generation_prompt=true.",
    )
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
    max_log_len: int | None = arg(
        None,
        group="RunBatch",
        help="Largest number of prompt characters or token ids written to the log. Unlimited "
        "by default.",
    )
    enable_prompt_tokens_details: bool = arg(
        False,
        group="RunBatch",
        bool_style="store_true",
        help="Report prompt_tokens_details in the usage part of responses.",
    )
    disable_log_requests: bool = arg(
        False,
        group="RunBatch",
        bool_style="store_true",
        help="Do not log incoming requests.",
    )
