"""What a feature adds to an engine step, beside the scheduler's loop: the step extension.

LoRA, speculative decoding, pooling and guided decoding are step extensions; a plugin adds
one with the ``pagedllm_register_step_extensions`` hook. The engine builds them once from
its configuration (:meth:`StepExtension.from_engine`) and hands them to the scheduler,
which calls each hook only where it is overridden, and a per-request hook only for the
requests that carry the extension's state (``request.features[extension.name]``): with no
extension on, a step does no extra work.

Lifecycle of an engine, with the engine-side hooks in call order:

1. the model is loaded: :meth:`StepExtension.from_engine` (the extension, or None when the
   configuration leaves it off), then :meth:`adjust_config` (e.g. pooling runs prompts
   whole: no chunks, no prefix cache);
2. the KV cache is sized: :meth:`kv_bytes_per_block` (memory the extension keeps per block,
   e.g. a draft model's own cache), :meth:`reserved_bytes` (memory it will hold beside
   the KV cache), :meth:`profile_payload` (its part of the profiled step, run on each rank
   by :meth:`profile_on_rank`) and :attr:`allows_decode_graphs`;
3. each rank builds its runner with the extension's runner side
   (:meth:`runner_payload`, sent to every rank, and :meth:`make_runner_extension` there);
4. the cache is allocated: :meth:`kv_cache_ready`;
5. the engine stops: :meth:`shutdown`.

Lifecycle of one request, with the hooks in call order:

1. the engine validates it: :meth:`check_params` (up front, from entry points),
   :meth:`new_parent` (an extension that builds the whole request, e.g. pooling's),
   :meth:`process_prompt` (the prompt as the model takes it, from the prompt dict's keys
   the extension reads, its :attr:`prompt_keys`; the server runs the heavy part of it
   before, on a worker thread: :meth:`prepare_prompt`),
   :meth:`request_state` (the state the request carries, from its parameters and the
   ``add_request`` keyword named :attr:`request_arg`); each ``Request`` made:
   :meth:`new_request` (validate, attach state);
2. the scheduler queues it: :meth:`add_request`;
3. each step, before scheduling: :meth:`begin_step` (may abort waiting requests);
   while admitting it: :meth:`admit`, :meth:`external_tokens` (prompt tokens whose KV
   the extension loads instead of computing them), then :meth:`admitted`; while its prompt
   is computed: :meth:`schedulable_tokens`; while it decodes:
   :meth:`extra_tokens` and :meth:`propose` (extra tokens to verify);
4. before the model runs: :meth:`token_mask`; in the model runner, the extension's
   :class:`RunnerExtension` (its step inputs, the rows it reads instead of sampling);
5. after: :meth:`read_outputs` (what the step produced for it), :meth:`check_token` for
   each new token;
6. it finishes (stopped, capped, aborted, pooled): :meth:`request_finished`.

After each step (and after the engine changed its KV cache between steps):
:meth:`step_done`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from pagedllm.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

    from pagedllm.core.request import Request, RequestStatus
    from pagedllm.core.step_data import RunnerOutput, ScheduledRequest, SchedulerOutput


def overriding(extensions: Any, base: type, hook: str) -> list[Any]:
    """The ``extensions`` whose class overrides ``base``'s ``hook``: the only ones the loop
    calls for it (the others would do nothing), so that an unused hook costs nothing."""
    default = getattr(base, hook)
    return [e for e in extensions if getattr(type(e), hook) is not default]


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
    #: The keyword of ``LLMEngine.add_request`` (and of the entry points that pass it on)
    #: whose value is the state a request carries for this extension (LoRA's
    #: ``lora_request``); None: no keyword.
    request_arg: ClassVar[str | None] = None
    #: The keys of a prompt dict (beside ``prompt`` and ``prompt_token_ids``) that this
    #: extension reads in :meth:`process_prompt` (multimodal prompts' ``multi_modal_data``);
    #: a prompt with one of them is refused where the extension is off.
    prompt_keys: ClassVar[tuple[str, ...]] = ()
    #: The request parameters this extension serves instead of ``SamplingParams`` (pooling's
    #: ``PoolingParams``); such a request goes to :meth:`new_parent`.
    params_type: ClassVar[type | None] = None
    #: The request tasks the extension serves beside generation (pooling's ``embed``,
    #: ``score``, …): the engine's ``served_tasks``.
    tasks: tuple[str, ...] = ()
    #: False: decode steps are not replayed from a device's graphs while it is on (its
    #: runner side changes what a step computes).
    allows_decode_graphs: ClassVar[bool] = True
    #: True: the engine may keep several steps in flight while it is on (pipeline
    #: stages, see ``Executor.steps_in_flight``). Then each scheduler hook runs for one
    #: of several schedulers (virtual engines) that share the KV cache manager, each
    #: with its own requests; a step's results come back after the next steps of the
    #: other virtual engines were scheduled, and its runner side's ``before_forward``
    #: may have run for those steps before ``after_micro_batches`` runs again for it,
    #: before its logits. False (the default) keeps one step at a time.
    allows_steps_in_flight: ClassVar[bool] = False
    #: Counters the stat logger reports as ``<name>_<counter>``.
    stats: dict[str, int]

    def __init__(self) -> None:
        self.stats = {}

    # ----------------------------------------------------------------- construction

    @classmethod
    @abstractmethod
    def from_engine(cls, engine: Any) -> StepExtension | None:
        """The extension for this engine's configuration (``engine.config``), or None when
        the configuration does not turn it on. Called once, after the model is loaded and
        before the KV cache is sized (``engine.loaded``, ``tokenizer``, ``max_model_len``,
        ``vocab_size``, ``task`` and ``executor`` are set). pagedllm's own extensions turn
        on from their own options (``--enable-lora``, ``--speculative-config``, ``--task``;
        guided decoding is always on); a plugin's is built only when ``--step-extensions``
        names it, and must then return one (or raise
        :class:`~pagedllm.core.errors.ConfigError` saying why it cannot)."""

    @classmethod
    def not_enabled_error(cls) -> InvalidRequestError:
        """The error for a request that carries this extension's state when it is off."""
        return InvalidRequestError(cls.name, f"this engine does not run {cls.name}")

    # ------------------------------------------------------------ engine lifecycle

    def adjust_config(self, config: Any) -> Any:
        """The engine's configuration as this extension needs it (a changed copy: the
        validated configuration is frozen), before the KV cache is sized."""
        return config

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Memory the extension keeps per KV-cache block (beside the model's)."""
        return 0

    def reserved_bytes(self) -> int:
        """Device memory the extension will hold on each rank beside the KV cache, beyond
        what it holds now and what the profiled step takes (e.g. a cache of its own that
        fills while serving): the KV cache's budget is lowered by it."""
        return 0

    def profile_payload(self) -> Any:
        """What each rank computes for this extension in the profiled step (picklable;
        asked only where the device measures that step's memory peak), or None:
        nothing. See :meth:`profile_on_rank`."""
        return None

    @classmethod
    def profile_on_rank(cls, payload: Any, worker: Any) -> Any:
        """On each rank, before the profiled step: compute the most the extension's
        runner side computes for one step (e.g. encode an item of the largest size) from
        :meth:`profile_payload`; what it returns is held until the step is done, so that
        the measured peak counts it."""
        return None

    def runner_payload(self) -> Any:
        """What every rank's model runner needs of this extension (picklable), or None when
        the extension has no runner side."""
        return None

    @classmethod
    def make_runner_extension(cls, payload: Any, worker: Any) -> RunnerExtension:
        """On each rank: the runner side from :meth:`runner_payload` and the rank's
        ``worker`` (its model, its adapters' slots)."""
        raise NotImplementedError(f"step extension {cls.name!r} has no runner side")

    def kv_cache_ready(self, engine: Any, num_blocks: int) -> None:
        """The KV cache has ``num_blocks`` blocks (per rank), allocated."""
        return

    def shutdown(self) -> None:
        """The engine stops: release what the extension holds (threads, processes)."""
        return

    # ------------------------------------------------------------ request lifecycle

    def check_params(self, params: Any) -> None:
        """Entry points call it before adding a request (the server in a worker thread),
        to refuse it up front (e.g. compile its constraint now); raises ``ValueError`` or
        :class:`~pagedllm.core.errors.InvalidRequestError` naming what is wrong."""
        return

    def new_parent(self, engine: Any, new: Any) -> Any:
        """The whole request (a ``ParentRequest``, built with the engine's helpers) when
        it is this extension's to build, else None (the engine builds it as generation).
        ``new``: the engine's ``NewRequest``."""
        return None

    def process_prompt(
        self, prompt: dict[str, Any], token_ids: list[int], params: Any
    ) -> tuple[list[int], Any] | None:
        """Every prompt (its dict; ``{}`` for a string or a token list), when overridden:
        the prompt's token ids as the model takes them (``token_ids``: as tokenized), from
        the prompt's :attr:`prompt_keys`, and the state its request carries under
        ``request.features[self.name]``; None leaves the prompt as it is.
        ``params``: its ``SamplingParams``. Raise
        :class:`~pagedllm.core.errors.InvalidRequestError` to refuse it."""
        return None

    def prepare_prompt(
        self, prompt: dict[str, Any], token_ids: list[int], params: Any
    ) -> dict[str, Any] | None:
        """A prompt dict with one of the :attr:`prompt_keys` set, when overridden, before
        its request reaches the engine thread (``LLMEngine.prepare_prompt``: the server
        calls it on a worker thread, so that heavy per-prompt work, such as preprocessing
        images, holds up neither the event loop nor the running requests' steps): the
        prompt in a form :meth:`process_prompt` then takes at little cost, or None to leave
        it as it is. It runs beside the engine's steps: it may read only what does not
        change after :meth:`from_engine`. ``token_ids``: the prompt's, as tokenized (and
        truncated); errors as :meth:`process_prompt`'s. The form returned must pickle (a
        prompt may be prepared in one process and added in another); its
        ``prompt_token_ids``, where it sets them, are the prompt's tokens from then on."""
        return None

    def request_state(self, params: Any, given: Any) -> Any:
        """The state a new user request carries under ``request.features[self.name]`` (None:
        none), from its ``SamplingParams`` (the engine's copy: may be changed) and
        ``given``, the value of the :attr:`request_arg` keyword. Called once per user
        request, before its sequences are made; raise
        :class:`~pagedllm.core.errors.InvalidRequestError` to refuse it."""
        return given

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

    def external_tokens(self, request: Request, num_cached: int) -> int:
        """How many of a waiting request's tokens after its ``num_cached`` prefix-cache
        hits this extension loads into the cache instead of computing them (whole blocks
        from the block at ``num_cached``, which must start one; at least the last token
        left to compute, for its logits). They get slots with the step's tokens and count
        as computed; the extension writes their KV before the step's forward pass (its
        runner side's :meth:`RunnerExtension.before_forward`), from the block ids of the
        request's scheduled item. May be asked again when the request cannot start this
        step. At most one extension per request loads tokens."""
        return 0

    def admitted(self, request: Request) -> None:
        """A request carrying this extension's state was admitted this step."""
        return

    def schedulable_tokens(self, request: Request, start: int, num_tokens: int) -> int:
        """How many of the ``num_tokens`` prompt tokens from position ``start`` of a request
        carrying this extension's state this step may compute (at most ``num_tokens``; 0:
        none this step, e.g. a step must not end inside a piece that the model takes
        whole). Asked for running and waiting requests alike, after the budget's cut."""
        return num_tokens

    # ----------------------------------------------------- extra tokens to verify

    def extra_tokens(self, request: Request, budget: int) -> int:
        """How many draft tokens a decoding request (one known token) may get after its
        known one, within ``budget``. At most one extension gives extra tokens."""
        return 0

    def propose(self, items: list[tuple[ScheduledRequest, int]]) -> int:
        """Fill ``extra_token_ids`` of the scheduled items, at most their room each (their
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

    def step_done(self) -> None:
        """Once per step, after its outputs are made, and after the engine changed its KV
        cache between steps (``LLMEngine.reset_prefix_cache``): e.g. publish the KV
        cache's events (``engine.kv_manager.take_events()``). Must not block."""
        return

    def check_token(self, request: Request, token: int) -> RequestStatus | None:
        """After each new token of a request carrying this extension's state (and after the
        built-in stop conditions let it go on): a finished status stops it (set its
        ``stop_reason``), None lets it go on. An exception fails that request only."""
        return None


class RunnerExtension:
    """The model runner's side of a step extension, on every rank (rank 0 builds the
    step and reads the outputs; the others follow). Every hook is optional; the runner
    calls each only when overridden.

    A step, with the hooks in call order: rank 0 builds it (:meth:`step_input`, whose
    value goes to every rank with the step under ``step.extras[name]``, and :meth:`claim`
    for each scheduled request that does not sample); every rank computes the hidden
    states (:meth:`before_forward`; with pipeline stages :meth:`split` per micro-batch and
    :meth:`after_micro_batches`; :meth:`after_forward` once the step's KV is in the cache)
    and the logits of its row blocks (:meth:`logits_rows`); rank 0 finishes it
    (:meth:`finish`)."""

    name: ClassVar[str] = ""

    def step_input(self, output: SchedulerOutput) -> Any:
        """Rank 0: what every rank needs for this step (picklable), or None."""
        return None

    def claim(
        self, item: ScheduledRequest, offset: int, add_rows: Callable[[int, int], int]
    ) -> Any:
        """Rank 0: take a scheduled request that does not sample (it has extra tokens, or
        its request does not sample tokens): its rows start at ``offset`` of the step's
        hidden states; ``add_rows(first, count)`` asks for the logits of rows ``first`` to
        ``first + count`` (returns the block's index). The claim (any value but None) goes
        to :meth:`finish`; None leaves the request to another extension."""
        return None

    def before_forward(self, step: Any, data: Any, built_here: bool) -> None:
        """Every rank, before the model computes ``step`` (its ``StepInput``; ``data``: its
        :meth:`step_input`). ``built_here``: rank 0 built this very step (else it came from
        rank 0, or it is a pipeline's micro-batch)."""
        return

    def after_forward(self, step: Any, data: Any) -> None:
        """Every rank, once the model computed ``step`` (its KV is in the cache)."""
        return

    def close(self) -> None:
        """Every rank, when the engine stops: release what the runner side holds
        (threads, sockets)."""
        return

    def split(self, data: Any, requests: slice, tokens: slice, first: bool) -> Any:
        """A pipeline micro-batch's share of the step input ``data``: its requests and
        tokens; ``first``: the first micro-batch."""
        return data

    def after_micro_batches(self, step: Any, data: Any) -> None:
        """A pipeline's stage 0 ranks, after the micro-batches, before the logits of the
        whole step."""
        return

    def logits_rows(self, rows: torch.Tensor) -> AbstractContextManager[None]:
        """Within: the logits of ``rows`` of the step's hidden states are computed."""
        raise NotImplementedError

    def finish(
        self,
        claims: list[tuple[ScheduledRequest, Any]],
        hidden: torch.Tensor,
        logits_of: Callable[[int], torch.Tensor],
        result: RunnerOutput,
    ) -> None:
        """Rank 0, every step: the claimed requests' results (``claims``, in step order;
        often empty) into ``result`` (pagedllm's own into their fields; a plugin's under
        ``result.extras[name]``, which its :meth:`StepExtension.read_outputs` reads), from
        the step's hidden states and ``logits_of(i)``, the logits of row block ``i``."""
        return
