"""``AsyncLLMEngine``: the engine loop in a background thread, per-request output streams
for asyncio callers.

The model runs on a dedicated thread (its work is blocking CPU/GPU work); everything
that touches the engine's state happens there, so no locks guard it. Callers submit
commands through a queue and receive outputs on an ``asyncio.Queue`` per request. A
caller that stops listening (a client disconnect cancels its task) aborts the request,
which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from pagedllm.core.engine import LLMEngine
from pagedllm.core.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.plugins import PluginManager
    from pagedllm.core.sampling import SamplingParams
    from pagedllm.inputs import PromptType

logger = logging.getLogger("pagedllm.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed while computing this request (the engine itself goes on)."""


@dataclasses.dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    def __init__(self, config: PagedLLMConfig, pm: PluginManager) -> None:
        self.engine = LLMEngine(config, pm)
        self.config = config
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self.dead_error: BaseException | None = None
        # Called on the engine thread after each step with its outputs (metrics).
        self.step_listeners: list[Callable[[LLMEngine, list[RequestOutput]], None]] = []
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._run_commands()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    self._fail_running(exc)
                    continue
                for listener in self.step_listeners:
                    listener(self.engine, outputs)
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream.put(output)
                        if output.finished:
                            self._streams.pop(output.request_id, None)
        except BaseException as exc:  # the loop itself broke: every request fails
            self.dead_error = exc
            logger.exception("the engine loop died")
            for stream in self._streams.values():
                stream.put(EngineDeadError(f"the engine stopped: {exc}"))
            self._streams.clear()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _fail_running(self, exc: Exception) -> None:
        """A step raised: fail the requests it was computing, keep serving the rest."""
        logger.error("engine step failed; aborting its requests:\n%s", traceback.format_exc())
        ids = list(self.engine.parents)
        for request_id in ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(RequestFailedError(f"the engine failed on this request: {exc}"))
        self.engine.abort_request(ids)

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        if self.dead_error is not None or self._stopped:
            raise EngineDeadError("the engine is not running")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._commands.put(command)
        self._wakeup.set()
        return future

    # ------------------------------------------------------------------ callers

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread, between steps."""
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come. Invalid requests raise ``ValueError``
        before the first output; leaving the iteration early aborts the request."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        # Compile a guided-decoding constraint off the engine thread first: a bad schema
        # is refused before the request exists, and the engine finds it compiled.
        await asyncio.to_thread(self.engine.check_guided, params)

        def add() -> None:
            self.engine.add_request(request_id, prompt, params, priority=priority)
            self._streams[request_id] = stream

        await asyncio.wrap_future(self._submit(add))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request (from any thread); its KV blocks are freed."""

        def command() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

        if self.dead_error is None and not self._stopped:
            self._commands.put(command)
            self._wakeup.set()

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and not self._stopped and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; waiting requests fail with EngineDeadError."""
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout)
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError("the server is shutting down"))
        self._streams.clear()
