"""Options of the OpenAI-compatible server that are not engine arguments.

Each field is one ``--flag`` of ``pagedllm serve`` (see :mod:`pagedllm.core.argspec`), in
the group "Frontend"; the engine's own options come from
:class:`pagedllm.core.engine_args.EngineArgs`.
"""

import dataclasses

from pagedllm.core.argspec import arg


@dataclasses.dataclass
class FrontendArgs:
    """Arguments for the HTTP server in front of the engine."""

    host: str | None = arg(
        None,
        group="Frontend",
        help="Host name or address to listen on. By default all interfaces.",
    )
    port: int = arg(
        8000,
        group="Frontend",
        help="Port to listen on.",
    )
    uvicorn_log_level: str = arg(
        "info",
        group="Frontend",
        choices=("debug", "info", "warning", "error", "critical", "trace"),
        help="Log level of the uvicorn web server.",
    )
    disable_uvicorn_access_log: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="Do not write uvicorn's access log.",
    )
    allow_credentials: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="Allow credentials in cross-origin (CORS) requests.",
    )
    allowed_origins: list[str] = arg(
        ["*"],
        group="Frontend",
        help="Origins allowed to make cross-origin (CORS) requests.",
    )
    allowed_methods: list[str] = arg(
        ["*"],
        group="Frontend",
        help="HTTP methods allowed in cross-origin (CORS) requests.",
    )
    allowed_headers: list[str] = arg(
        ["*"],
        group="Frontend",
        help="HTTP headers allowed in cross-origin (CORS) requests.",
    )
    api_key: str | None = arg(
        None,
        group="Frontend",
        help="If set, every request must present this key in its Authorization header.",
    )
    lora_modules: list[str] | None = arg(
        None,
        group="Frontend",
        help="LoRA adapters to serve (with --enable-lora), each as name=path or as JSON "
        '{"name": ..., "path": ..., "base_model_name": ...} ("local_path", the older '
        'spelling of "path", is accepted); a request names one as its model.',
    )
    prompt_adapters: list[str] | None = arg(
        None,
        group="Frontend",
        help="Prompt adapters to serve, each as name=path.",
        unbuilt="pagedllm does not support prompt adapters; leave this flag out",
    )
    chat_template: str | None = arg(
        None,
        group="Frontend",
        help="Chat template to use, as a file path or an inline single-line template. "
        "Defaults to the model's own.",
    )
    chat_template_content_format: str = arg(
        "auto",
        group="Frontend",
        choices=("auto", "string", "openai"),
        help="How message content is passed to the chat template: 'string' as plain text, "
        '\'openai\' as a list of parts like [{"type": "text", "text": ...}], or \'auto\' '
        "(detected from the template).",
    )
    response_role: str = arg(
        "assistant",
        group="Frontend",
        help="Role name returned when a request sets add_generation_prompt=true.",
    )
    ssl_keyfile: str | None = arg(
        None,
        group="Frontend",
        help="Path to the SSL private key file.",
    )
    ssl_certfile: str | None = arg(
        None,
        group="Frontend",
        help="Path to the SSL certificate file.",
    )
    ssl_ca_certs: str | None = arg(
        None,
        group="Frontend",
        help="Path to the CA certificates file.",
    )
    ssl_cert_reqs: int = arg(
        0,
        group="Frontend",
        help="Whether a client certificate is required, as a value of Python's "
        "ssl.VerifyMode (0 none, 1 optional, 2 required).",
    )
    enable_ssl_refresh: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="Reload the SSL context when the certificate files change.",
        unbuilt="pagedllm reads the certificate files once, at start-up; leave this flag out",
    )
    root_path: str | None = arg(
        None,
        group="Frontend",
        help="FastAPI root_path, for serving behind a path-based routing proxy.",
    )
    middleware: list[str] = arg(
        [],
        group="Frontend",
        append=True,
        help="Import paths of extra ASGI middleware. A function is added with "
        "@app.middleware('http'), a class with app.add_middleware().",
    )
    return_tokens_as_token_ids: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="In logprobs, write each token as 'token_id:{id}' so that tokens that are not "
        "valid JSON strings can still be identified.",
    )
    disable_frontend_multiprocessing: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="Run the API server in the same process as the engine. With one replica it "
        "always does (the engine runs on a thread of the server's process), so this changes "
        "nothing; refused with --data-parallel-size above 1 or --api-server-count above 1, "
        "whose engines or API servers are processes of their own.",
    )
    enable_request_id_headers: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="Accepted for compatibility: responses now always carry an X-Request-Id header "
        "(the request's own, else a new one).",
    )
    enable_auto_tool_choice: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="Let the model decide when to call tools (tool_choice='auto'); needs "
        "--tool-call-parser.",
    )
    tool_call_parser: str | None = arg(
        None,
        group="Frontend",
        registry="tool_parsers",
        validate_after_parse=True,
        help="Parser that turns the model's tool calls into OpenAI API tool calls; pick the one "
        "matching the model. Names registered by --tool-parser-plugin are accepted too.",
    )
    tool_parser_plugin: str = arg(
        "",
        group="Frontend",
        help="Python file defining extra tool parsers, whose names can then be used with "
        "--tool-call-parser.",
    )
    log_config_file: str | None = arg(
        None,
        group="Frontend",
        help="Path to a JSON logging config for both pagedllm and uvicorn.",
    )
    max_log_len: int | None = arg(
        None,
        group="Frontend",
        min=0,
        help="Largest number of prompt characters or token ids written to the log for each "
        "request --enable-log-requests logs. Unlimited by default.",
    )
    disable_fastapi_docs: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="Do not serve the OpenAPI schema, Swagger UI or ReDoc pages.",
    )
    enable_prompt_tokens_details: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="Report prompt_tokens_details in the usage part of responses.",
    )
    max_sequences_per_request: int = arg(
        256,
        group="Frontend",
        min=1,
        help="Largest number of sequences one request may ask for: its prompts times n (or "
        "best_of). Larger requests are refused with a 400.",
    )
    max_response_mb: float = arg(
        64.0,
        group="Frontend",
        min=0,
        range_hint="it must be 0 MiB or more",
        help="Largest non-streaming response body, in MiB (0: no limit). A completions, chat "
        "or responses request whose response would be larger is refused with a 400 that "
        "suggests stream=true: before generating when even its smallest response is, else "
        "once it grows past the limit (its generation stopped).",
    )
    metrics_prefix: str = arg(
        "pagedllm",
        group="Frontend",
        choices=("pagedllm", "vllm"),
        help="The names /metrics exports: pagedllm:... (the default), or vllm:... with vLLM's "
        "labels (model_name and engine), so that dashboards, alerts and autoscalers written "
        "for vLLM read pagedllm unchanged. Metrics vLLM does not have keep their pagedllm: "
        "name.",
    )
    enable_server_load_tracking: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="Track the number of requests in flight (server_load_metrics) in the app state.",
    )
    api_server_count: int = arg(
        1,
        group="Frontend",
        aliases=("-asc",),
        min=1,
        help="Number of API server (front-end) processes, all on the one --host/--port, "
        "each sending requests to every engine replica (--data-parallel-size).",
    )
    headless: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="Run data-parallel replicas without an API server, as a secondary node: they "
        "register with the head node (--data-parallel-address, --data-parallel-rpc-port), "
        "whose front end sends them requests.",
    )
    data_parallel_start_rank: int = arg(
        0,
        group="Frontend",
        aliases=("-dpr",),
        min=0,
        help="Index of the first data-parallel replica of a --headless node.",
    )
    enable_log_requests: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        help="Log each request the engine accepts: its prompt and token ids (capped by "
        "--max-log-len) and its sampling parameters, at INFO. Off by default: request "
        "contents are user data. A refused request's body is never logged.",
    )
    disable_log_requests: bool = arg(
        False,
        group="Frontend",
        bool_style="store_true",
        deprecated="requests are logged only with --enable-log-requests",
        help="Do not log incoming requests.",
    )
