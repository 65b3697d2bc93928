"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): the app is its middleware
(:mod:`.middleware`), error handlers (:mod:`.errors`) and routes (:mod:`.routes`)."""

from __future__ import annotations

import gc
import logging
import signal
import socket
import threading
from typing import Any

from fastapi import FastAPI

from pagedllm import __version__
from pagedllm.core.engine_client import EngineClient
from pagedllm.entrypoints.metrics import Metrics, ReplicaMetrics
from pagedllm.entrypoints.openai.cli_args import FrontendArgs
from pagedllm.entrypoints.openai.errors import add_exception_handlers, document_errors
from pagedllm.entrypoints.openai.middleware import OPEN_PATHS, add_middleware, api_key
from pagedllm.entrypoints.openai.routes import add_routes
from pagedllm.entrypoints.openai.serving import OpenAIServing
from pagedllm.entrypoints.openai.serving_setup import PendingServing

logger = logging.getLogger("pagedllm.server")


def build_app(
    args: FrontendArgs,
    engine: EngineClient,
    serving: OpenAIServing,
    metrics: Metrics | ReplicaMetrics,
    pm: Any,
    model_path: str,
) -> FastAPI:
    docs = not args.disable_fastapi_docs
    app = FastAPI(
        title="pagedllm OpenAI-compatible API",
        version=__version__,
        root_path=args.root_path or "",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.server_load = 0
    add_middleware(app, args)
    add_exception_handlers(app)
    add_routes(app, args, engine, serving, metrics, model_path)
    if engine.config.model_config.enable_sleep_mode:
        from pagedllm.entrypoints.openai.sleep_routes import add_sleep_routes
        from pagedllm.entrypoints.sleep_metrics import SleepStateGauge

        registry = getattr(metrics, "registry", None)
        gauge = None if registry is None else SleepStateGauge(registry, metrics.model)
        add_sleep_routes(app, engine, gauge)
    pm.hook.pagedllm_add_api_routes(app=app, engine=engine)
    generate_openapi = app.openapi
    key = api_key(args)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document_errors(
                generate_openapi(),
                lambda path: bool(key) and path not in OPEN_PATHS and path != "/docs",
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def run_server(
    pending: PendingServing,
    args: FrontendArgs,
    pm: Any,
    log_config: dict[str, Any] | None,
    sockets: list[socket.socket] | None = None,
) -> int:
    """Wait for the model that ``pending`` loads (see
    :func:`~pagedllm.entrypoints.openai.serving_setup.start_serving`), then serve until
    SIGINT/SIGTERM. ``log_config``: what ``--log-config-file`` gave, for uvicorn;
    ``sockets``: listen on these (a front end of ``--api-server-count``, sharing its
    parent's socket) rather than binding --host and --port."""
    import uvicorn

    stack = pending.finish()
    config, engine = stack.config, stack.engine
    names = stack.model_names
    app = build_app(args, engine, stack.serving, stack.metrics, pm, config.model_config.model)

    @app.on_event("startup")
    async def warm_up() -> None:
        gc.enable()  # (off while the server started: see ServeSubcommand.run)
        # Then what the start freed since the engine gave its own back (the app's
        # routes and schemas, the template's first render) goes back too.
        device = config.device_config.device
        warmed = stack.serving.prompts.warm_up()
        warmed.add_done_callback(lambda _: device.release_startup_memory())

    @app.on_event("shutdown")
    async def stop_engine() -> None:
        engine.shutdown()

    server_config = uvicorn.Config(
        app,
        host=args.host or "0.0.0.0",
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        log_config=log_config if log_config is not None else uvicorn.config.LOGGING_CONFIG,
        timeout_graceful_shutdown=10,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            # A stop signal also stops the guided-decoding compiles, so that requests
            # waiting on one end at once instead of holding up the shutdown. Not in the
            # handler itself: it may have interrupted a holder of a lock the work needs.
            threading.Thread(target=engine.stop_compiling, name="pagedllm-stop").start()

    server = Server(server_config)

    def exit_when_engine_dies() -> None:
        # A dead engine loop cannot recover: stop serving (and exit non-zero) so that a
        # supervisor restarts the server instead of it answering 503 forever.
        engine.dead.wait()
        logger.critical("the engine loop died; stopping the server")
        server.should_exit = True

    threading.Thread(target=exit_when_engine_dies, name="pagedllm-watchdog", daemon=True).start()
    logger.info(
        "serving %s as %s on %s:%d",
        config.model_config.model,
        ", ".join(names),
        server_config.host,
        args.port,
    )
    # uvicorn re-raises the signal that stopped it once it has shut down, which would kill
    # the process with that signal; a handler of our own receives it instead, so SIGTERM
    # and Ctrl+C end the process normally (exit code 0).
    stopped_by: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda number, _frame: stopped_by.append(number))
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.shutdown()
    if engine.dead.is_set():
        return 1
    if stopped_by:
        logger.info("stopped by %s", signal.Signals(stopped_by[0]).name)
    return 0
