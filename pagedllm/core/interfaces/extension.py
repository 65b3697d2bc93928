"""What a feature adds to an engine step, beside the scheduler's loop: the step extension.

LoRA, speculative decoding, pooling and guided decoding are step extensions; a plugin adds
one with the ``pagedllm_register_step_extensions`` hook. The engine builds them once from
its configuration (:meth:`StepExtension.from_engine`) and hands them to the scheduler,
which calls each hook only where it is overridden, and a per-request hook only for the
requests that carry the extension's state (``request.features[extension.name]``): with no
extension on, a step does no extra work.

Lifecycle of one request, with the hooks in call order:

1. the engine makes the ``Request``: :meth:`new_request` (validate, attach state);
2. the scheduler queues it: :meth:`add_request`;
3. each step, before scheduling: :meth:`begin_step` (may abort waiting requests);
   while admitting it: :meth:`admit`, then :meth:`admitted`; while it decodes:
   :meth:`extra_tokens` and :meth:`propose` (draft tokens to verify);
4. before the model runs: :meth:`token_mask`;
5. after: :meth:`read_outputs` (what the step produced for it), :meth:`check_token` for
   each new token;
6. it finishes (stopped, capped, aborted, pooled): :meth:`request_finished`.

The model-runner side (inputs, what is read from the hidden states or logits) is not
declared here yet: the runner still reads the request's feature state itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from pagedllm.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from pagedllm.core.request import Request, RequestStatus
    from pagedllm.core.step_data import RunnerOutput, ScheduledRequest, SchedulerOutput


class StepOutcome(NamedTuple):
    """What a step produced for one request, as an extension reads it from the output."""

    # The tokens to append, in order (each goes through the stop conditions).
    tokens: list[int]
    # Tokens past the scheduled known ones whose KV the step made valid (kept drafts).
    computed: int = 0
    # The request is done now, without appending (e.g. its prompt was pooled).
    finished: bool = False


class StepExtension(ABC):
    """Base of the step extensions: every hook but :meth:`from_engine` is optional (a no-op
    by default)."""

    #: The registered name; also the key of the extension's state in ``request.features``.
    name: ClassVar[str] = ""
    #: Counters the stat logger reports as ``<name>_<counter>``.
    stats: dict[str, int]

    def __init__(self) -> None:
        self.stats = {}

    # ----------------------------------------------------------------- construction

    @classmethod
    @abstractmethod
    def from_engine(cls, engine: Any) -> StepExtension | None:
        """The extension for this engine's configuration (``engine.config``), or None when
        the configuration does not turn it on. Called once, after the model and the KV
        cache are set up. pagedllm's own extensions turn on from their own options
        (``--enable-lora``, ``--speculative-config``, ``--task``, a tokenizer); a plugin's
        is built only when ``--step-extensions`` names it, and must then return one (or
        raise :class:`~pagedllm.core.errors.ConfigError` saying why it cannot)."""

    @classmethod
    def not_enabled_error(cls) -> InvalidRequestError:
        """The error for a request that carries this extension's state when it is off."""
        return InvalidRequestError(cls.name, f"this engine does not run {cls.name}")

    # ------------------------------------------------------------ request lifecycle

    def new_request(self, request: Request) -> None:
        """A new request, before it is queued (every request, when overridden): validate it
        (raise :class:`~pagedllm.core.errors.InvalidRequestError` to refuse it), attach state
        under ``request.features[self.name]``, set its ``cache_salt``."""
        return

    def add_request(self, request: Request) -> None:
        """The scheduler queued a request carrying this extension's state."""
        return

    def request_finished(self, request: Request) -> None:
        """A request carrying this extension's state finished (any way)."""
        return

    # -------------------------------------------------------- admission and budget

    def begin_step(self, running: list[Request]) -> list[tuple[Request, BaseException]]:
        """Once per step, before scheduling. Returns the requests to abort now (waiting
        ones this extension can never run), with the error each fails with."""
        return []

    def admit(self, request: Request) -> bool:
        """Whether a waiting request carrying this extension's state may start now; False
        holds it back (the requests behind it go first). Raise to abort it (the error is
        its failure)."""
        return True

    def admitted(self, request: Request) -> None:
        """A request carrying this extension's state was admitted this step."""
        return

    # ----------------------------------------------------- extra tokens to verify

    def extra_tokens(self, request: Request, budget: int) -> int:
        """How many draft tokens a decoding request (one known token) may get after its
        known one, within ``budget``. At most one extension gives extra tokens."""
        return 0

    def propose(self, items: list[tuple[ScheduledRequest, int]]) -> int:
        """Fill ``draft_token_ids`` of the scheduled items, at most their room each (their
        KV slots are allocated) and lower their ``num_new_tokens`` by what is left unused.
        Returns the budget given back."""
        return 0

    # ------------------------------------------------------------- sampling inputs

    def token_mask(self, requests: list[Request]) -> Any:
        """Allowed tokens for the step's sampling rows (bool ``[rows, vocab]``), or None."""
        return None

    # --------------------------------------------------------- outputs and update

    def read_outputs(self, output: SchedulerOutput, result: RunnerOutput) -> dict[str, StepOutcome]:
        """Once per step, what the step produced for the requests this extension handles,
        by request id (the others take their sampled token)."""
        return {}

    def check_token(self, request: Request, token: int) -> RequestStatus | None:
        """After each new token of a request carrying this extension's state (and after the
        built-in stop conditions let it go on): a finished status stops it (set its
        ``stop_reason``), None lets it go on. An exception fails that request only."""
        return None
