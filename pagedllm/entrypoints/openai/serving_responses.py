"""``/v1/responses``: the Responses API, served on the chat path.

A response's request becomes a chat request (:mod:`.responses_protocol`); the chat
reply's deltas (reasoning, content, tool calls) become output items — a ``reasoning``
item, a ``message`` item, ``function_call`` items — through one :class:`OutputItems`,
which also writes the stream's events (``response.created``, ``...output_text.delta``,
..., ``response.completed``). A full reply is the same deltas with the events unsent.
Responses are kept in a bounded :class:`ResponseStore` (``store``, the default), which
``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}`` and background
responses (``background=true``, cancelled with ``POST .../cancel``) read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import OpenAIError, as_openai_error
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, output_messages
from pagedllm.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.serving_chat import ChatReply, start_chat

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.responses import Outputs
    from pagedllm.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger("pagedllm.server")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A response's output items, built from chat deltas; each step returns the stream
    events it makes (``sequence_number`` counts every event of the response)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open_text: dict[str, Any] | None = None  # the reasoning or message item
        self._open_calls: dict[int, dict[str, Any]] = {}  # by the chat delta's call index
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _position(self, item: dict[str, Any]) -> int:
        return next(i for i, other in enumerate(self.items) if other is item)

    def add(self, delta: dict[str, Any]) -> list[str]:
        """The events of one chat delta (its reasoning, then content, then tool calls)."""
        events: list[str] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def _text(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        item = self._open_text
        if item is None or item["type"] != kind:
            events += self._close_all()
            if kind == "reasoning":
                item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": []}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["status"] = "in_progress"
            self.items.append(item)
            self._open_text = item
            where = {"output_index": len(self.items) - 1}
            events.append(self.event("response.output_item.added", item=dict(item), **where))
            item["content"].append(part)
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    content_index=0,
                    part=dict(part),
                    **where,
                )
            )
        part = item["content"][0]
        part["text"] += text
        where = {"item_id": item["id"], "output_index": self._position(item), "content_index": 0}
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", delta=text, **where))
        else:
            events.append(
                self.event("response.output_text.delta", delta=text, logprobs=[], **where)
            )
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events: list[str] = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        item = self._open_calls.get(index)
        if item is None:
            events += self._close_all()
            item = {
                "id": _new_id("fc"),
                "type": "function_call",
                "call_id": call.get("id") or _new_id("call"),
                "name": function.get("name") or "",
                "arguments": "",
                "status": "in_progress",
            }
            self.items.append(item)
            self._open_calls[index] = item
            events.append(
                self.event(
                    "response.output_item.added", output_index=len(self.items) - 1, item=dict(item)
                )
            )
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self._position(item),
                    delta=arguments,
                )
            )
        return events

    def close(self, truncated: bool) -> list[str]:
        """The events that finish every open item (``truncated``: the output hit its
        token limit, and the last item is incomplete)."""
        return self._close_all("incomplete" if truncated else "completed")

    def _close_all(self, status: str = "completed") -> list[str]:
        events: list[str] = []
        item = self._open_text
        if item is not None:
            self._open_text = None
            where = {
                "item_id": item["id"],
                "output_index": self._position(item),
                "content_index": 0,
            }
            part = item["content"][0]
            if item["type"] == "reasoning":
                events.append(
                    self.event("response.reasoning_text.done", text=part["text"], **where)
                )
            else:
                events.append(
                    self.event("response.output_text.done", text=part["text"], logprobs=[], **where)
                )
            events.append(self.event("response.content_part.done", part=dict(part), **where))
            item["status"] = status
            events.append(self._item_done(item))
        for item in self._open_calls.values():
            where = {"item_id": item["id"], "output_index": self._position(item)}
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    arguments=item["arguments"],
                    name=item["name"],
                    **where,
                )
            )
            item["status"] = "completed"
            events.append(self._item_done(item))
        self._open_calls = {}
        return events

    def _item_done(self, item: dict[str, Any]) -> str:
        return self.event("response.output_item.done", output_index=self._position(item), item=item)


class ResponseRun:
    """One response's work: the chat reply it is built from, and the response object."""

    def __init__(
        self,
        responses: ResponsesServing,
        body: ResponsesRequest,
        reply: ChatReply,
        generator: Outputs,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.serving = responses.serving
        self.body = body
        self.reply = reply
        self.conversation = conversation
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.output = OutputItems()
        self.token_ids: list[int] = []
        self.generator = self._recorded(generator)
        self.finish_reason: str | None = None
        tool_choice = body.tool_choice
        if tool_choice is None:
            tool_choice = "auto" if reply.request.tool_choice == "auto" else "none"
        self.tool_choice = tool_choice

    async def _recorded(self, generator: Outputs) -> Outputs:
        """The engine's outputs, their token ids kept (for the reasoning token count)."""
        async for index, output in generator:
            for completion in output.outputs:
                if self.body.stream:
                    self.token_ids.extend(completion.token_ids)
                else:
                    self.token_ids = list(completion.token_ids)
            yield index, output

    def chunks(self, whole: bool) -> AsyncIterator[dict[str, Any]]:
        return self.reply.chunks(self.generator, whole)

    def take(self, choice: dict[str, Any]) -> list[str]:
        """The events of one chat chunk choice."""
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return self.output.add(choice["delta"])

    def finish(self) -> list[str]:
        return self.output.close(self.truncated)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def response(
        self, status: str | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The response object; its status from the finish reason unless given."""
        body = self.body
        if status is None:
            status = "incomplete" if self.truncated else "completed"
        done = status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if done else None,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "model": self.serving.model_name,
            "output": self.output.items,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": body.tools or [],
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": body.text_format()},
            "reasoning": {"effort": None, "summary": None},
            "previous_response_id": body.previous_response_id,
            "store": bool(body.store),
            "background": bool(body.background),
            "metadata": body.metadata or {},
            "user": body.user,
            "truncation": "disabled",
            "usage": self._usage() if done else None,
        }

    def _usage(self) -> dict[str, Any]:
        usage = self.reply.usage
        prompt, output = usage.prompt_tokens, usage.completion_tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
            "total_tokens": prompt + output,
        }

    def _reasoning_tokens(self) -> int:
        parser_cls = self.serving.reasoning_parser
        if parser_cls is None or not any(i["type"] == "reasoning" for i in self.output.items):
            return 0
        parser = parser_cls.for_prompt(self.serving.tokenizer, self.reply.prompt.text)
        return reasoning_length(parser.is_reasoning_end, self.token_ids)

    def stored_conversation(self) -> list[dict[str, Any]]:
        return [*self.conversation, *output_messages(self.output.items)]


def reasoning_length(is_end: Any, token_ids: Sequence[int]) -> int:
    """How many of ``token_ids`` are reasoning: the shortest prefix after which
    ``is_end`` says the reasoning is over (all of them if it never is). The end stays an
    end as tokens follow, so the prefix is found by bisection."""
    if not is_end(token_ids):
        return len(token_ids)
    low, high = 0, len(token_ids)  # is_end(token_ids[:high]) holds
    while low < high:
        middle = (low + high) // 2
        if is_end(token_ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return low


class ResponsesServing:
    """The Responses API's handlers, with their store."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store
        self._tasks: set[asyncio.Task[None]] = set()

    def _auto_tools(self) -> bool:
        return self.serving.tool_parser is not None and self.serving.options.enable_auto_tool_choice

    def _history(self, previous_id: str | None) -> list[dict[str, Any]]:
        if previous_id is None:
            return []
        entry = self.store.get(previous_id)
        if entry is None:
            raise OpenAIError(
                400,
                f"Previous response with id '{previous_id}' not found (it was not stored, "
                f"was deleted, or has left the server's bounded store)",
                param="previous_response_id",
            )
        if entry.response["status"] not in ("completed", "incomplete"):
            raise OpenAIError(
                400,
                f"Previous response '{previous_id}' is {entry.response['status']}; only a "
                f"finished response can be continued",
                param="previous_response_id",
            )
        return entry.conversation

    async def create(self, body: ResponsesRequest, request_id: str) -> Any:
        """``POST /v1/responses``: the response, an SSE stream of its events with
        ``stream``, or at once the in-progress response with ``background``."""
        history = self._history(body.previous_response_id)
        try:
            chat, conversation = body.chat_request(history, self._auto_tools())
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from exc
        reply, generator = await start_chat(self.serving, chat, request_id)
        run = ResponseRun(self, body, reply, generator, conversation)
        if body.background:
            self.store.put(run.response("in_progress"), conversation)
            task = asyncio.create_task(self._background(run))
            self._tasks.add(task)  # (a strong reference while it runs)
            task.add_done_callback(self._tasks.discard)
            entry = self.store.get(run.id)
            if entry is not None:
                entry.task = task
            return run.response("in_progress")
        if body.stream:
            return self._stream(run)
        async for choice in run.chunks(whole=True):
            run.take(choice)
        run.finish()
        return self._finished(run, run.response())

    def _finished(self, run: ResponseRun, response: dict[str, Any]) -> dict[str, Any]:
        if run.body.store:
            self.store.put(response, run.stored_conversation())
        return response

    async def _stream(self, run: ResponseRun) -> AsyncIterator[str]:
        chunks = run.chunks(whole=False)
        # The first chunk comes before any event, so a request the engine refuses still
        # gets its 4xx.
        first = await anext(chunks, None)
        yield run.output.event("response.created", response=run.response("in_progress"))
        yield run.output.event("response.in_progress", response=run.response("in_progress"))
        try:
            if first is not None:
                for event in run.take(first):
                    yield event
            async for choice in chunks:
                for event in run.take(choice):
                    yield event
        except Exception as exc:
            error = as_openai_error(exc)
            if error is None:
                raise
            failed = {"code": "server_error", "message": error.message}
            for event in run.finish():
                yield event
            response = self._finished(run, run.response("failed", failed))
            yield run.output.event("response.failed", response=response)
            return
        for event in run.finish():
            yield event
        response = self._finished(run, run.response())
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield run.output.event(kind, response=response)

    async def _background(self, run: ResponseRun) -> None:
        try:
            async for choice in run.chunks(whole=True):
                run.take(choice)
            run.finish()
            self.store.update(run.response(), run.stored_conversation())
        except asyncio.CancelledError:
            run.finish()
            self.store.update(run.response("cancelled"), run.conversation)
        except Exception as exc:  # (reported in the stored response, not raised)
            error = as_openai_error(exc)
            message = error.message if error is not None else f"{type(exc).__name__}: {exc}"
            if error is None:
                logger.exception("background response %s failed", run.id)
            run.finish()
            failed = {"code": "server_error", "message": message}
            self.store.update(run.response("failed", failed), run.conversation)

    def _stored(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise OpenAIError(
                404,
                f"Response with id '{response_id}' not found.",
                "NotFoundError",
                param="response_id",
            )
        return entry

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self._stored(response_id).response

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """``POST /v1/responses/{id}/cancel``: stop a background response (its engine
        requests are aborted, their KV blocks freed)."""
        entry = self._stored(response_id)
        if not entry.response["background"]:
            raise OpenAIError(
                400,
                "Only responses created with background=true can be cancelled.",
                param="response_id",
            )
        status = entry.response["status"]
        if status in ("completed", "incomplete", "failed"):
            raise OpenAIError(400, f"Cannot cancel a {status} response.", param="response_id")
        await self._stop(entry)
        return self._stored(response_id).response

    async def _stop(self, entry: StoredResponse) -> None:
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            await asyncio.gather(entry.task, return_exceptions=True)
        if not entry.finished:  # (cancelled before it started: no handler ran)
            entry.response = dict(entry.response, status="cancelled")

    async def delete(self, response_id: str) -> dict[str, Any]:
        await self._stop(self._stored(response_id))
        self.store.remove(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
