"""Guided decoding in the step: a request waits while its constraint compiles and is
aborted if it fails to; the token mask of each step; each new token's acceptance (a
token that breaks the constraint stops the request)."""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import EngineDeadError, InvalidRequestError
from pagedllm.core.guided import GuidedDecodingManager
from pagedllm.core.interfaces.extension import StepExtension
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sampling.guided_params import as_guided_params

if TYPE_CHECKING:
    from concurrent.futures import Future

logger = logging.getLogger("pagedllm.scheduler")


class GuidedExtension(StepExtension):
    """Always on (it refuses constraints when the engine has no tokenizer). A request's
    state: the future of its
    compiled constraint (``SamplingParams.guided_decoding`` / ``structured_outputs``)."""

    name = "guided"
    # (Its state is each request's: a virtual engine's scheduler meets only its own. A
    # failure drained by another virtual engine's begin_step reaches the request at its
    # admission: admit raises it.)
    allows_steps_in_flight = True

    def __init__(self, manager: GuidedDecodingManager | None) -> None:
        super().__init__()
        # The constraints' compiles (cached) and matchers. (None in scheduler tests that
        # only compile: no mask, every token accepted.)
        self.manager = manager
        # Waiting requests whose constraint failed to compile (appended by the compile
        # future's callback, on whichever thread finished it; drained each step).
        self.failures: deque[Request] = deque()

    @classmethod
    def from_engine(cls, engine: Any) -> GuidedExtension:
        """Always on: without a tokenizer (--skip-tokenizer-init) it refuses constraints."""
        if engine.tokenizer is None:
            return cls(None)
        return cls(
            GuidedDecodingManager(
                engine.pm,
                engine.config.decoding_config,
                engine.tokenizer,
                engine.vocab_size,
                tuple(engine.loaded.eos_token_ids),
            )
        )

    def shutdown(self) -> None:
        """Stop the compiles (their worker processes and threads exit)."""
        if self.manager is not None:
            self.manager.shutdown()

    def check_params(self, params: Any) -> None:
        """Compile the request's constraint now (cached): ``ValueError`` names what is
        wrong with it."""
        _, future = self._submit(params)
        if future is not None:
            future.result()

    def request_state(self, params: Any, given: Any) -> Future[Any] | None:
        """The future of the request's compiled constraint, submitted now (a compile
        that already failed refuses the request); its params get the normalized form."""
        guided, future = self._submit(params)
        if future is None:
            return None
        if future.done():
            if future.cancelled():
                raise EngineDeadError("compiling the request's constraint was stopped")
            if future.exception() is not None:
                raise InvalidRequestError("guided_decoding", str(future.exception()))
        params.guided_decoding = guided
        return future

    def _submit(self, params: Any) -> tuple[Any, Future[Any] | None]:
        """The request's constraint in its normalized form and the future of its compile,
        or ``(None, None)`` when it has none."""
        guided = as_guided_params(getattr(params, "guided_decoding", None))
        if guided is None:
            return None, None
        if self.manager is None:
            raise self.not_enabled_error()
        return guided, self.manager.submit(guided)

    @classmethod
    def not_enabled_error(cls) -> InvalidRequestError:
        return InvalidRequestError(
            "guided_decoding", "guided decoding needs the tokenizer (--skip-tokenizer-init)"
        )

    def add_request(self, request: Request) -> None:
        def done(_: Any) -> None:
            if compile_error(request) is not None:
                self.failures.append(request)

        request.features[self.name].add_done_callback(done)

    def begin_step(self, running: list[Request]) -> list[tuple[Request, BaseException]]:
        failed = []
        while self.failures:
            request = self.failures.popleft()
            error = compile_error(request)
            assert error is not None
            failed.append((request, error))
        return failed

    def admit(self, request: Request) -> bool:
        if not request.features[self.name].done():
            return False  # still compiling its constraint
        error = compile_error(request)
        if error is not None:
            # Failed just now (its done-callback may not have run yet): never admit it.
            raise error
        return True

    def token_mask(self, requests: list[Request]) -> Any:
        return None if self.manager is None else self.manager.token_mask(requests)

    def check_token(self, request: Request, token: int) -> RequestStatus | None:
        if self.manager is not None and not self.manager.accept(request, token):
            # Only when a ban overrode the mask (e.g. min_tokens against a finished
            # constraint): end the output rather than leave the constraint.
            logger.warning(
                "request %s: token %d breaks its guided-decoding constraint; stopping it",
                request.request_id,
                token,
            )
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None


def compile_error(request: Request) -> BaseException | None:
    """Why the request's finished constraint compile failed, or None (no failure yet)."""
    future = request.features.get(GuidedExtension.name)
    if future is None or not future.done():
        return None
    if future.cancelled():
        return RuntimeError("compiling its constraint was stopped")
    return future.exception()
