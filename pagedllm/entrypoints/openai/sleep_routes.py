"""Sleep mode's routes (vLLM's, registered only with ``--enable-sleep-mode``):
``POST /sleep?level=1|2&mode=abort|wait``, ``POST /wake_up[?tags=weights&tags=kv_cache]``
and ``GET /is_sleeping``. The engine sleeps and wakes on its own thread; these handlers
only wait for it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from pagedllm.entrypoints.openai.errors import OpenAIError

if TYPE_CHECKING:
    from pagedllm.core.engine_client import EngineClient

logger = logging.getLogger("pagedllm.server")

_MODES = ("abort", "wait")


def _level(raw: str | None) -> int:
    try:
        level = int(raw) if raw is not None else 1
    except ValueError:
        level = -1
    if level not in (1, 2):
        raise OpenAIError(400, f"level={raw}: the sleep levels are 1 and 2", param="level")
    return level


def add_sleep_routes(app: FastAPI, engine: EngineClient, gauge: Any = None) -> None:
    """``gauge``: the ``engine_sleep_state`` gauge
    (:class:`~pagedllm.entrypoints.sleep_metrics.SleepStateGauge`), or None."""

    @app.post("/sleep")
    async def sleep(request: Request) -> dict[str, Any]:
        level = _level(request.query_params.get("level"))
        mode = request.query_params.get("mode", "abort")
        if mode not in _MODES:
            raise OpenAIError(
                400, f"mode={mode}: the sleep modes are {', '.join(_MODES)}", param="mode"
            )
        await engine.sleep(level, mode)
        logger.info("the engine is asleep (level %d)", level)
        if gauge is not None:
            gauge.record(level)
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict[str, Any]:
        tags = request.query_params.getlist("tags") or None
        try:
            awake = await engine.wake_up(tags)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="tags") from None
        logger.info("woken up (tags %s): %s", tags, "awake" if awake else "still sleeping")
        if gauge is not None and awake:
            gauge.record(0)
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await engine.is_sleeping()}
