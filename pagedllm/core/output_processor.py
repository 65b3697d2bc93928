"""Turns a step's results into ``RequestOutput``s: detokenization, stop strings,
logprobs and prompt logprobs, request metrics, and the fan-in of a request's ``n``
sequences. It holds the one map of live requests (by the user's request id)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from pagedllm.core.detokenizer import (
    IncrementalDetokenizer,
    check_stop_strings,
    convert_ids_to_tokens_for_logprobs,
)
from pagedllm.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.core.pooling import PoolingOutput, PoolingRequestOutput
from pagedllm.core.request import RequestStatus
from pagedllm.core.sampling import RequestOutputKind

if TYPE_CHECKING:
    from pagedllm.core.plugins import PluginManager
    from pagedllm.core.request import Request
    from pagedllm.core.sampling import SamplingParams
    from pagedllm.core.stats import StatLogger
    from pagedllm.core.step_data import RunnerOutput, SchedulerOutput

logger = logging.getLogger("pagedllm.engine")


@dataclasses.dataclass(slots=True)
class SequenceState:
    """One of a request's sequences (a child request of the engine)."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_chars: int = 0
    # Whether a DELTA output already carried this sequence's finish_reason.
    sent_finish: bool = False


@dataclasses.dataclass(slots=True)
class ParentRequest:
    """What the user asked for: one prompt, ``n`` (or ``best_of``) sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    # A pooling request's result, once its prompt has run.
    pooled: Any = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    @property
    def sequence_ids(self) -> list[str]:
        return [seq.request.request_id for seq in self.sequences]


@dataclasses.dataclass(slots=True)
class ProcessedStep:
    """What a step produced for the caller, and what the scheduler must finish."""

    outputs: list[RequestOutput] = dataclasses.field(default_factory=list)
    # Sequences that hit a stop string.
    stopped: list[str] = dataclasses.field(default_factory=list)
    # Sequences whose request failed or was aborted (siblings of the failed one).
    aborted: list[str] = dataclasses.field(default_factory=list)


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        pm: PluginManager | None = None,
        stat_logger: StatLogger | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.pm = pm
        self.stat_logger = stat_logger
        # The live requests: user request id -> its state (sequences included).
        self.requests: dict[str, ParentRequest] = {}
        # Requests that failed since the caller last took them: request id -> error.
        self.failed: dict[str, BaseException] = {}

    # ------------------------------------------------------------------ requests

    def add(self, parent: ParentRequest) -> None:
        self.requests[parent.request_id] = parent

    def pop(self, request_id: str) -> ParentRequest | None:
        return self.requests.pop(request_id, None)

    @staticmethod
    def aborted_output(parent: ParentRequest) -> RequestOutput:
        """The last output of an aborted request (finish reason "abort" for its unfinished
        sequences; no text or logprobs): its token counts and timestamps."""
        parent.metrics.finished_time = time.monotonic()
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=None,
            outputs=[
                CompletionOutput(
                    index=seq.index,
                    text="",
                    token_ids=list(seq.request.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=None,
                    finish_reason=seq.finish_reason or "abort",
                    stop_reason=seq.stop_reason,
                )
                for seq in parent.sequences
            ],
            finished=True,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics,
        )

    def abort_all(self) -> tuple[list[RequestOutput], list[str]]:
        """End every live request as aborted: their last outputs (finish reason
        ``abort``) and the sequence ids the scheduler must finish."""
        outputs, sequence_ids = [], []
        for parent in list(self.requests.values()):
            self.requests.pop(parent.request_id)
            for seq in parent.sequences:
                if seq.finish_reason is None:
                    self.finish(seq, "abort", None)
            sequence_ids.extend(parent.sequence_ids)
            output = self.make_output(parent)
            if output is not None:
                outputs.append(output)
        return outputs, sequence_ids

    def take_failures(self) -> dict[str, BaseException]:
        failed, self.failed = self.failed, {}
        return failed

    # ---------------------------------------------------------------------- step

    def process(
        self, scheduled: SchedulerOutput, updated: list[Request], result: RunnerOutput
    ) -> ProcessedStep:
        """The step's outputs: ``updated`` are the requests the scheduler's update
        touched (a new token, or failed)."""
        step = ProcessedStep()
        for request, error in scheduled.aborted:
            self._abort_uncompiled(request, error, step)
        timed: set[str] | None = None if result.model_forward_time is None else set()
        for item in scheduled.scheduled:
            parent = self.requests.get(item.request.parent_id)
            if parent is None:
                continue
            if parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = scheduled.scheduled_time
            if timed is not None and parent.request_id not in timed:
                timed.add(parent.request_id)  # (once per step for n sequences)
                self._add_step_times(parent.metrics, result)
            rows = result.prompt_logprobs.get(item.request.request_id)
            if rows:
                self._record_prompt_logprobs(parent, item.num_computed_tokens + 1, rows)
        touched: dict[str, ParentRequest] = {}
        failures: dict[int, tuple[BaseException, list[str]]] = {}
        now = time.monotonic()
        num_sampled = 0
        for request in updated:
            parent = self.requests.get(request.parent_id)
            if parent is None:  # a sibling sequence failed earlier in this step
                continue
            error = request.failure
            if error is None and not request.samples_tokens:
                parent.pooled = result.pooled[request.request_id]
                parent.metrics.first_token_time = parent.metrics.last_token_time = now
                self.finish(parent.sequences[0], "stop", None)
            elif error is None:
                num_sampled += max(request.num_new_output_tokens, 1)
                try:
                    self._on_new_token(request, parent, result, now, step)
                except Exception as exc:
                    error = exc
            if error is not None:
                touched.pop(parent.request_id, None)
                self._fail(parent, error, step, failures)
                continue
            touched[parent.request_id] = parent
        for parent in touched.values():
            try:
                output = self._make_output(parent)
            except Exception as exc:
                self._fail(parent, exc, step, failures)
                continue
            if output is not None:
                step.outputs.append(output)
        for exc, request_ids in failures.values():
            logger.error(
                "engine failure on request(s) %s; aborting them",
                ", ".join(request_ids),
                exc_info=exc,
            )
        if self.stat_logger is not None and not scheduled.is_empty:
            try:
                self.stat_logger.on_step(scheduled, num_sampled)
            except Exception:  # statistics must never cost a request
                logger.exception("the stat logger failed")
        return step

    @staticmethod
    def _add_step_times(metrics: RequestMetrics, result: RunnerOutput) -> None:
        """A timed step's times, added to those of each request it computed."""
        metrics.model_forward_time = (metrics.model_forward_time or 0.0) + (
            result.model_forward_time or 0.0
        )
        metrics.model_execute_time = (metrics.model_execute_time or 0.0) + (
            result.model_execute_time or 0.0
        )

    def _on_new_token(
        self,
        request: Request,
        parent: ParentRequest,
        result: RunnerOutput,
        now: float,
        step: ProcessedStep,
    ) -> None:
        seq = parent.sequences[request.sequence_index]
        # (several tokens when speculative decoding kept drafts; they have no logprobs)
        count = max(request.num_new_output_tokens, 1)
        stop = None
        for back in range(count - 1, 0, -1):
            stop = self.on_token(seq, request.output_token_ids[-back - 1], None)
            if stop is not None:  # a stop string: the tokens after it never happened
                del request.output_token_ids[-back:]
                del request.all_token_ids[-back:]
                break
        if stop is None:
            token = request.output_token_ids[-1]
            stop = self.on_token(seq, token, result.logprobs.get(request.request_id))
        metrics = parent.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            parent.num_cached_tokens = max(request.num_cached_tokens, 0)
        elif now != metrics.last_token_time and self.stat_logger is not None:
            # (once per request and step, whatever its number of sequences)
            self.stat_logger.record_inter_token_latency(now - metrics.last_token_time)
        metrics.last_token_time = now
        metrics.num_generation_tokens = max(
            metrics.num_generation_tokens, request.num_output_tokens
        )
        if stop is not None:
            self.finish(seq, "stop", stop)
            step.stopped.append(request.request_id)
        elif request.is_finished:
            self.finish(seq, request.status.finish_reason, request.stop_reason)

    def _make_output(self, parent: ParentRequest) -> RequestOutput | None:
        parent.metrics.num_preemptions = sum(s.request.num_preemptions for s in parent.sequences)
        output = self.make_output(parent)
        if parent.finished:
            self.requests.pop(parent.request_id, None)
            if self.pm is not None:
                try:
                    self.pm.hook.pagedllm_request_finished(request_output=output)
                except Exception:  # a plugin's bug must not cost the request its output
                    logger.exception("a pagedllm_request_finished hook failed")
        return output

    def _fail(
        self,
        parent: ParentRequest,
        exc: BaseException,
        step: ProcessedStep,
        failures: dict[int, tuple[BaseException, list[str]]],
    ) -> None:
        """Give up on ``parent`` after an unexpected error; the caller takes the error
        with :meth:`take_failures`, the scheduler aborts its sequences."""
        self.requests.pop(parent.request_id, None)
        self.failed[parent.request_id] = exc
        step.aborted.extend(parent.sequence_ids)
        failures.setdefault(id(exc), (exc, []))[1].append(parent.request_id)

    def _abort_uncompiled(
        self, request: Request, error: BaseException, step: ProcessedStep
    ) -> None:
        """The request's constraint failed to compile: it ends as aborted."""
        parent = self.requests.pop(request.parent_id, None)
        if parent is None:
            return
        logger.error("request %s: guided decoding failed: %s", parent.request_id, error)
        step.aborted.extend(parent.sequence_ids)
        for seq in parent.sequences:
            self.finish(seq, "abort", None)
        output = self.make_output(parent)
        if output is not None:
            step.outputs.append(output)

    def _record_prompt_logprobs(self, parent: ParentRequest, first: int, rows: list[Any]) -> None:
        """Rows for prompt positions ``first, first + 1, ...``; positions already recorded
        (a preempted request recomputes its prompt) are skipped."""
        recorded = parent.prompt_logprobs
        for position, row in enumerate(rows, start=first):
            if position == len(recorded):
                recorded.append(self.position_logprobs(row))

    # ------------------------------------------------------------ one sequence

    def new_sequence(self, request: Request, index: int) -> SequenceState:
        params = request.sampling_params
        detokenizer = None
        if self.tokenizer is not None and params.detokenize:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        wants_logprobs = params.logprobs is not None
        return SequenceState(
            request=request,
            index=index,
            detokenizer=detokenizer,
            logprobs=[] if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None,
        )

    def _decode(self, token_ids: list[int]) -> list[str] | list[None]:
        if self.tokenizer is None:
            return [None] * len(token_ids)
        return convert_ids_to_tokens_for_logprobs(self.tokenizer, token_ids)

    def position_logprobs(self, row: Any) -> dict[int, Logprob]:
        """The sampled token's logprob (with its rank) and the top-k, by token id."""
        ids = [row.sampled_token_id, *row.top_token_ids]
        texts = self._decode(ids)
        out = {row.sampled_token_id: Logprob(row.sampled_logprob, row.sampled_rank, texts[0])}
        for rank, (token_id, logprob, text) in enumerate(
            zip(row.top_token_ids, row.top_logprobs, texts[1:], strict=True), start=1
        ):
            out.setdefault(token_id, Logprob(logprob, rank, text))
        return out

    def on_token(self, state: SequenceState, token_id: int, logprobs_row: Any) -> str | None:
        """Record one sampled token; returns the stop string hit, if any."""
        if state.logprobs is not None and logprobs_row is not None:
            position = self.position_logprobs(logprobs_row)
            state.logprobs.append(position)
            state.cumulative_logprob += position[token_id].logprob
        if state.detokenizer is None:
            return None
        request = state.request
        params = request.sampling_params
        if (
            request.status == RequestStatus.FINISHED_STOPPED
            and token_id in params.all_stop_token_ids
            and not params.include_stop_str_in_output
        ):
            return None  # as vLLM: a stop token (EOS included) is not part of the text
        delta = state.detokenizer.decode_next([token_id])
        state.text += delta
        if not params.stop or not delta:
            return None
        hit = check_stop_strings(
            state.text, len(delta), params.stop, params.include_stop_str_in_output
        )
        if hit is None:
            return None
        stop, truncate_to = hit
        state.text = state.text[:truncate_to]
        return stop

    def finish(self, state: SequenceState, finish_reason: str, stop_reason: Any) -> None:
        state.finish_reason = finish_reason
        state.stop_reason = stop_reason
        # A stop string already truncated the text; otherwise emit what was held back.
        if state.detokenizer is not None and not isinstance(stop_reason, str):
            state.text += state.detokenizer.flush()

    def make_output(self, parent: ParentRequest) -> RequestOutput | None:
        """The output to emit now for ``parent`` (None when its kind says to wait)."""
        if parent.pooled is not None:
            parent.metrics.finished_time = time.monotonic()
            return PoolingRequestOutput(
                request_id=parent.request_id,
                outputs=PoolingOutput(parent.pooled),
                prompt_token_ids=parent.prompt_token_ids,
                prompt=parent.prompt,
                metrics=parent.metrics,
            )
        params = parent.params
        kind = params.output_kind
        finished = parent.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        sequences = parent.sequences
        if finished and params.best_of is not None and params.best_of > params.n:
            # Keep the n sequences with the highest cumulative logprob.
            sequences = sorted(sequences, key=lambda s: s.cumulative_logprob or 0.0, reverse=True)[
                : params.n
            ]
        completions = []
        for new_index, seq in enumerate(sequences):
            index = new_index if len(sequences) != len(parent.sequences) else seq.index
            token_ids = seq.request.output_token_ids
            text = seq.text
            if seq.finish_reason is None:
                # Hold back what may turn out to be the start of a stop string.
                text = text[: max(0, len(text) - params.output_text_buffer_length)]
            logprobs = seq.logprobs
            if kind is RequestOutputKind.DELTA:
                nothing_new = seq.sent_tokens == len(token_ids)
                if nothing_new and (seq.finish_reason is None or seq.sent_finish):
                    continue
                seq.sent_finish = seq.finish_reason is not None
                new_text = text[seq.sent_chars :]
                new_tokens = token_ids[seq.sent_tokens :]
                new_logprobs = logprobs[seq.sent_tokens :] if logprobs is not None else None
                seq.sent_chars, seq.sent_tokens = len(text), len(token_ids)
                text, token_ids, logprobs = new_text, new_tokens, new_logprobs
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(logprobs) if logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        if finished:
            parent.metrics.finished_time = time.monotonic()
        prompt_logprobs = parent.prompt_logprobs
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics,
        )
