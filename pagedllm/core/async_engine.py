"""``AsyncLLMEngine``: the engine loop in a background thread, per-request output streams
for asyncio callers.

The model runs on a dedicated thread (its work is blocking CPU/GPU work); everything
that touches the engine's state happens there, so no locks guard it. Callers submit
commands through a queue and receive outputs on an ``asyncio.Queue`` per call. A caller
that stops listening (a client disconnect cancels its task) aborts its requests, which
frees their KV blocks.

Per-prompt work that grows with the request runs before a request reaches the engine
thread, off the caller's event loop too: guided-decoding constraints compile in the
background, and prompts that a step extension prepares (a multimodal prompt's images
preprocessed into the model's inputs: ``LLMEngine.prepare_prompt``) are prepared on a pool
of :data:`PREPARE_THREADS_VARIABLE` threads; the engine thread then takes the prepared
form at little cost, so that one large image does not hold up every running request's
next step.

The loop is the one thing that must not die: a command whose caller is gone is skipped,
an output for a request that is gone is dropped, and a step that fails fails only the
requests it was computing. Should the loop itself break, ``is_healthy`` turns false and
``dead`` is set, so that a server can exit and be restarted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.core.engine import LLMEngine, NewRequest
from pagedllm.core.env import env_number
from pagedllm.core.errors import EngineDeadError, RequestFailedError
from pagedllm.core.guided_compile import CompileCancelled
from pagedllm.core.outputs import RequestOutput
from pagedllm.core.sampling.guided_params import as_guided_params

if TYPE_CHECKING:
    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.plugins import PluginManager
    from pagedllm.core.sampling import SamplingParams
    from pagedllm.inputs import PromptType
    from pagedllm.lora.request import LoRARequest

__all__ = ["AsyncLLMEngine", "EngineDeadError", "NewRequest", "RequestFailedError"]

logger = logging.getLogger("pagedllm.async_engine")

# The threads that prepare prompts (LLMEngine.prepare_prompt: images preprocessed), per
# engine; the variable overrides the default.
PREPARE_THREADS_VARIABLE = "PAGEDLLM_MM_PREPROCESS_THREADS"
DEFAULT_PREPARE_THREADS = 4


def prepare_threads() -> int:
    return env_number(
        PREPARE_THREADS_VARIABLE,
        DEFAULT_PREPARE_THREADS,
        "a number of threads (1 or more)",
        parse=int,
        minimum=1,
    )


@dataclasses.dataclass(slots=True)
class _Stream:
    """Where one request's outputs go: ``(index, output or error)`` on its caller's
    queue, from the engine thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]]
    index: int

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass


class AsyncLLMEngine:
    def __init__(self, config: PagedLLMConfig, pm: PluginManager, wait: bool = True) -> None:
        """Build the engine on its thread; with ``wait=False`` return while it loads
        (the caller does other start-up work meanwhile) and call :meth:`wait_built`
        before using it."""
        self.config = config
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        # Sleeps waiting for the running requests to finish (mode "wait"): (level, future).
        self._pending_sleeps: list[tuple[int, concurrent.futures.Future[Any]]] = []
        self.dead_error: BaseException | None = None
        # Set when the loop has died (not on a normal shutdown).
        self.dead = threading.Event()
        # Called on the engine thread after each step with its outputs (metrics).
        self.step_listeners: list[Callable[[LLMEngine, list[RequestOutput]], None]] = []
        # Called on the engine thread with the last outputs of aborted requests (traces).
        self.abort_listeners: list[Callable[[list[RequestOutput]], None]] = []
        # The engine is built on its own thread, which then steps it: every OpenMP
        # parallel region (loading and every step's kernels) has that one thread as its
        # master. With a second master (the main thread, had it loaded the model), libgomp
        # counts more threads than cores and its idle workers sleep instead of spinning,
        # which measured as 1.7-2x slower decoding on 2 cores.
        self.engine: LLMEngine
        self._built = threading.Event()
        self._failed: list[BaseException] = []
        # The device's process settings (the allocator's) before the engine's threads
        # exist: a thread takes its heap with its first allocation (model_setup's own call
        # then finds them made).
        config.device_config.device.prepare_process()
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=prepare_threads(), thread_name_prefix="pagedllm-prepare"
        )
        self._thread = threading.Thread(
            target=self._main,
            args=(pm, self._built, self._failed),
            name="pagedllm-engine",
            daemon=True,
        )
        self._thread.start()
        if wait:
            self.wait_built()

    def wait_built(self) -> None:
        """Wait until the engine is built; raise what building it raised."""
        self._built.wait()
        if self._failed:
            raise self._failed[0]

    # ------------------------------------------------------------- engine thread

    def _main(self, pm: PluginManager, built: threading.Event, failed: list) -> None:
        try:
            self.engine = LLMEngine(self.config, pm)
        except BaseException as exc:  # raised again by __init__, on the caller's thread
            failed.append(exc)
            return
        finally:
            built.set()
        self._run()

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._run_commands()
                if self._pending_sleeps and not self.engine.has_unfinished_requests():
                    self._sleep_now()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except EngineDeadError:  # (a tensor-parallel worker died: the loop ends)
                    raise
                except Exception as exc:  # outside any request's computation
                    self._fail_all(exc)
                    continue
                self._deliver(outputs)
        except BaseException as exc:  # the loop itself broke: every request fails
            self.dead_error = exc
            logger.critical("the engine loop died", exc_info=exc)
            for stream in self._streams.values():
                stream.put(EngineDeadError(f"the engine stopped: {exc!r}"))
            self._streams.clear()
            self.dead.set()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for request_id, exc in self.engine.take_failures().items():
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(RequestFailedError(f"the engine failed on this request: {exc}"))
        for listener in self.step_listeners:
            try:
                listener(self.engine, outputs)
            except Exception:  # metrics must never cost a request
                logger.exception("a step listener failed")
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
                if output.finished:
                    del self._streams[output.request_id]

    def _fail_all(self, exc: Exception) -> None:
        """A step raised before it knew its requests: fail every request, keep serving."""
        logger.error("engine step failed; aborting every request", exc_info=exc)
        ids = self.engine.unfinished_request_ids()
        for request_id in ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(RequestFailedError(f"the engine failed on this request: {exc}"))
        self._aborted(self.engine.abort_request(ids))

    def _aborted(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        for listener in self.abort_listeners:
            try:
                listener(outputs)
            except Exception:  # traces must never cost a request
                logger.exception("an abort listener failed")

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the engine thread, between steps. A caller that gave up before it
        ran (the future is cancelled) is skipped."""
        if self.dead_error is not None or self._stopped:
            raise EngineDeadError("the engine is not running")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

        self._commands.put(command)
        self._wakeup.set()
        return future

    def _sleep_now(self) -> None:
        """The running requests have finished: the waiting sleeps happen now."""
        pending, self._pending_sleeps = self._pending_sleeps, []
        for level, future in pending:
            try:
                self._deliver(self.engine.sleep(level))
            except Exception as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)

    # ------------------------------------------------------------------ callers

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Put the engine to sleep (``--enable-sleep-mode``) between steps. ``mode``
        ``abort``: the running requests end now (finish reason ``abort``); ``wait``: new
        requests are refused at once, and it sleeps once the running ones finish."""
        from pagedllm.core.sleep import check_sleep_level

        check_sleep_level(level)
        if mode not in ("abort", "wait"):
            raise ValueError(f"sleep mode {mode!r} is not supported: abort or wait")
        if mode == "abort":

            def now() -> None:
                self._deliver(self.engine.sleep(level))

            await asyncio.wrap_future(self._submit(now))
            return
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def later() -> None:
            self.engine.refuse_requests()
            self._pending_sleeps.append((level, done))

        await asyncio.wrap_future(self._submit(later))
        await asyncio.wrap_future(done)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back what ``tags`` name (None: everything); whether fully awake. A sleep
        still waiting for its requests is called off."""

        def wake() -> bool:
            awake = self.engine.wake_up(tags)
            if awake:
                pending, self._pending_sleeps = self._pending_sleeps, []
                for _, future in pending:
                    future.set_exception(RuntimeError("woken up before it fell asleep"))
            return awake

        return await asyncio.wrap_future(self._submit(wake))

    async def is_sleeping(self) -> bool:
        return await asyncio.wrap_future(self._submit(lambda: self.engine.is_sleeping))

    async def reset_prefix_cache(self) -> bool:
        """:meth:`LLMEngine.reset_prefix_cache` on the engine thread, between steps."""
        return await self.call(lambda engine: engine.reset_prefix_cache())

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread, between steps."""
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

    def load_lora(self, request: LoRARequest) -> concurrent.futures.Future[None]:
        """Load the adapter on the engine thread, between steps (``InvalidRequestError``
        when it cannot be); a future, so that start-up can wait for it without a loop."""
        return self._submit(lambda: self.engine.extensions["lora"].manager.adapter(request))

    def unload_lora(self, lora_int_id: int) -> concurrent.futures.Future[None]:
        return self._submit(lambda: self.engine.extensions["lora"].manager.remove(lora_int_id))

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
        async for _, output in self.generate_many(
            [NewRequest(request_id, prompt, params, priority)]
        ):
            yield output

    async def generate_many(
        self, requests: Sequence[NewRequest]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several requests, interleaved as they come, tagged with the index
        of their request. They are validated together and queued together: one invalid
        request (``ValueError``) queues none. Leaving early aborts those not finished."""
        # Compile guided-decoding constraints off the engine thread first: a bad schema
        # is refused before any request exists, and the engine finds them compiled.
        for request in requests:
            await self.compile_guided(request.params)
        requests = await self.prepare_prompts(requests)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        streams = {r.request_id: _Stream(loop, outputs, i) for i, r in enumerate(requests)}

        def add() -> None:
            self.engine.add_requests(requests)
            self._streams.update(streams)

        try:
            await asyncio.wrap_future(self._submit(add))
        except asyncio.CancelledError:
            self.abort(list(streams))  # in case they were added before the cancel landed
            raise
        unfinished = set(streams)
        try:
            while unfinished:
                index, item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                yield index, item
        finally:
            if unfinished:
                self.abort(list(unfinished))

    async def prepare_prompts(self, requests: Sequence[NewRequest]) -> Sequence[NewRequest]:
        """``requests`` with their prompts prepared (``LLMEngine.prepare_prompt``) on the
        prepare threads, together; ``ValueError`` (a 400) as ``add_requests`` would."""
        engine = self.engine
        todo = [i for i, r in enumerate(requests) if engine.needs_preparing(r.prompt)]
        if not todo:
            return requests
        if self.dead_error is not None or self._stopped:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        prompts = await asyncio.gather(
            *(
                loop.run_in_executor(
                    self._prepare_pool,
                    engine.prepare_prompt,
                    requests[i].prompt,
                    requests[i].params,
                )
                for i in todo
            )
        )
        prepared = list(requests)
        for i, prompt in zip(todo, prompts, strict=True):
            prepared[i] = dataclasses.replace(prepared[i], prompt=prompt)
        return prepared

    async def compile_guided(self, params: SamplingParams) -> None:
        """Compile ``params``' guided-decoding constraint (cached) without blocking the
        event loop; ``ValueError`` says what is wrong with it. A caller that is cancelled
        (its client went away) stops the compile unless another request waits on it."""
        # (pooling requests have no constraint)
        guided = as_guided_params(getattr(params, "guided_decoding", None))
        if guided is None:
            return
        manager = self._guided_manager()
        if manager is None:
            raise ValueError("guided decoding needs the tokenizer (--skip-tokenizer-init)")
        key, future = manager.acquire(guided)
        try:
            await asyncio.shield(asyncio.wrap_future(future))
        except CompileCancelled:  # stopped for everyone: the engine is shutting down
            raise EngineDeadError("the server is shutting down") from None
        except asyncio.CancelledError:
            if future.cancelled():
                raise EngineDeadError("the server is shutting down") from None
            raise
        finally:
            manager.release(key)

    def _guided_manager(self) -> Any:
        """The guided-decoding step extension's compiles, or None (no tokenizer)."""
        extension = self.engine.extensions.get("guided")
        return None if extension is None else extension.manager

    def abort(self, request_ids: str | list[str]) -> None:
        """Stop requests (from any thread); their KV blocks are freed."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)

        def command() -> None:
            for request_id in ids:
                self._streams.pop(request_id, None)
            self._aborted(self.engine.abort_request(ids))

        if self.dead_error is None and not self._stopped:
            self._commands.put(command)
            self._wakeup.set()

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and not self._stopped and self._thread.is_alive()

    def stop_compiling(self) -> None:
        """Stop every guided-decoding compile now (from any thread): requests waiting on
        one fail with EngineDeadError."""
        manager = self._guided_manager()
        if manager is not None:
            manager.shutdown()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; waiting requests fail with EngineDeadError."""
        self.stop_compiling()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout)
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError("the server is shutting down"))
        self._streams.clear()
