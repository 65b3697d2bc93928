"""The Responses API (``/v1/responses``) through the official ``openai`` client's own
``responses`` methods: text, instructions, conversation state, structured output,
function tools, streaming events, background work, the store, and bad input.

Served on the chat path, a greedy response must say exactly what the chat completion of
the same messages says: most tests compare the two.
"""

from __future__ import annotations

import json
import time
from typing import Literal

import jsonschema
import openai
import pytest
from openai_server import RemoteServer, assert_openai_error, start_servers, tiny_llama
from pydantic import BaseModel

from pagedllm.entrypoints.openai.responses_store import ResponseStore
from pagedllm.entrypoints.openai.serving_responses import OutputItems, reasoning_length

GREEDY = {"temperature": 0}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 5}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_time", "description": "The time", "parameters": ZONE},
    {"type": "function", "name": "ping"},  # (no parameters: takes none)
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
]


class Answer(BaseModel):
    # (bounded: a sampled answer always completes within the tokens given)
    colour: Literal["red", "green", "blue"]
    sure: bool


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> tuple[RemoteServer, RemoteServer]:
    logs = tmp_path_factory.mktemp("responses")
    model = tiny_llama(tmp_path_factory)
    plain = RemoteServer(model, log_path=logs / "plain.log")
    # The tiny model never writes </think>: under deepseek_r1 all its output is reasoning.
    reasoning = RemoteServer(
        model, "--reasoning-parser", "deepseek_r1", log_path=logs / "reasoning.log"
    )
    start_servers(plain, reasoning)
    yield plain, reasoning
    plain.stop()
    reasoning.stop()


@pytest.fixture(scope="module")
def server(servers) -> RemoteServer:
    return servers[0]


@pytest.fixture(scope="module")
def model(server: RemoteServer) -> str:
    with server.client() as client:
        return client.models.list().data[0].id


def _chat(client: openai.OpenAI, model: str, messages: list, tokens: int, **extra) -> str:
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=tokens, **GREEDY, **extra
    )
    return reply.choices[0].message.content or ""


def test_text_response_equals_the_chat_reply_and_is_stored(server: RemoteServer, model) -> None:
    with server.client() as client:
        response = client.responses.create(
            model=model, input="Say hi", max_output_tokens=6, metadata={"k": "v"}, **GREEDY
        )
        expected = _chat(client, model, [{"role": "user", "content": "Say hi"}], 6)
        assert response.output_text == expected and expected
        assert response.object == "response" and response.id.startswith("resp_")
        assert response.status in ("completed", "incomplete")
        if response.status == "incomplete":
            assert response.incomplete_details.reason == "max_output_tokens"
        assert [item.type for item in response.output] == ["message"]
        assert response.output[0].role == "assistant"
        assert response.metadata == {"k": "v"} and response.max_output_tokens == 6
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, **GREEDY
        )
        usage = response.usage
        assert usage.input_tokens == chat.usage.prompt_tokens
        assert usage.output_tokens == chat.usage.completion_tokens
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        assert usage.output_tokens_details.reasoning_tokens == 0
        # Stored (the default): retrieved whole.
        again = client.responses.retrieve(response.id)
        assert again.model_dump() == response.model_dump()
        # Not stored: not found.
        unstored = client.responses.create(
            model=model, input="Hi", max_output_tokens=2, store=False
        )
        with pytest.raises(openai.NotFoundError, match="not found"):
            client.responses.retrieve(unstored.id)


def test_input_items_and_instructions_are_the_chat_messages(server: RemoteServer, model) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hi"}],
        },
        {"role": "user", "content": "How are you?"},
    ]
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "How are you?"},
    ]
    with server.client() as client:
        response = client.responses.create(
            model=model, input=items, instructions="Be terse.", max_output_tokens=8, **GREEDY
        )
        assert response.output_text == _chat(client, model, messages, 8)
        assert response.instructions == "Be terse."


def test_previous_response_id_continues_the_conversation(server: RemoteServer, model) -> None:
    with server.client() as client:
        first = client.responses.create(
            model=model, input="Hello", instructions="Be terse.", max_output_tokens=5, **GREEDY
        )
        second = client.responses.create(
            model=model,
            input="And then?",
            previous_response_id=first.id,
            max_output_tokens=5,
            **GREEDY,
        )
        assert second.previous_response_id == first.id
        # The earlier turns, without the earlier instructions (they apply to one response).
        history = [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ]
        assert second.output_text == _chat(client, model, history, 5)
        third = client.responses.create(
            model=model, input="More", previous_response_id=second.id, max_output_tokens=5, **GREEDY
        )
        history += [
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "More"},
        ]
        assert third.output_text == _chat(client, model, history, 5)
        with pytest.raises(openai.BadRequestError, match="resp_nope' not found"):
            client.responses.create(model=model, input="x", previous_response_id="resp_nope")


def test_text_format_json_schema_parses(server: RemoteServer, model) -> None:
    with server.client() as client:
        for seed in range(3):
            parsed = client.responses.parse(
                model=model,
                input=f"A colour, please ({seed})",
                text_format=Answer,
                max_output_tokens=80,
                temperature=1.0,
                extra_body={"seed": seed},
            )
            assert parsed.status == "completed"
            assert isinstance(parsed.output_parsed, Answer), parsed.output_text
        as_object = client.responses.create(
            model=model,
            input="JSON",
            text={"format": {"type": "json_object"}},
            max_output_tokens=60,
            **GREEDY,
        )
        if as_object.status == "completed":
            assert isinstance(json.loads(as_object.output_text), dict)
        assert as_object.text.format.type == "json_object"


def test_function_tools_calls_and_outputs(server: RemoteServer, model) -> None:
    with server.client() as client:
        response = client.responses.create(
            model=model,
            input="What time is it?",
            tools=TOOLS,
            tool_choice="required",
            max_output_tokens=150,
            **GREEDY,
        )
        assert response.status == "completed", response.output
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and all(call.name in ("get_time", "ping") for call in calls)
        for call in calls:
            arguments = json.loads(call.arguments)
            schema = ZONE if call.name == "get_time" else {"type": "object", "maxProperties": 0}
            jsonschema.validate(arguments, schema)
            assert call.call_id and call.id.startswith("fc_")
        # A named function, without parameters: called with none.
        named = client.responses.create(
            model=model,
            input="Ping",
            tools=TOOLS,
            tool_choice={"type": "function", "name": "ping"},
            max_output_tokens=20,
            **GREEDY,
        )
        [ping] = named.output
        assert (ping.type, ping.name, json.loads(ping.arguments)) == ("function_call", "ping", {})
        # The tool's output, continuing the conversation: as chat's tool messages.
        call = calls[0]
        after = client.responses.create(
            model=model,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}],
            previous_response_id=response.id,
            max_output_tokens=6,
            tools=TOOLS,
            **GREEDY,
        )
        messages = [
            {"role": "user", "content": "What time is it?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": c.call_id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in calls
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"},
        ]
        expected = _chat(client, model, messages, 6, tools=CHAT_TOOLS)
        assert after.output_text == expected
        # The same conversation given whole as input items.
        whole = client.responses.create(
            model=model,
            input=[
                {"role": "user", "content": "What time is it?"},
                *[
                    {
                        "type": "function_call",
                        "call_id": c.call_id,
                        "name": c.name,
                        "arguments": c.arguments,
                    }
                    for c in calls
                ],
                {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"},
            ],
            max_output_tokens=6,
            tools=TOOLS,
            **GREEDY,
        )
        assert whole.output_text == expected


def _events(client: openai.OpenAI, **request) -> list:
    return list(client.responses.create(stream=True, **request))


def test_streamed_events_add_up_to_the_response(server: RemoteServer, model) -> None:
    request = {"model": model, "input": "Tell me", "max_output_tokens": 8, **GREEDY}
    with server.client() as client:
        full = client.responses.create(**request)
        events = _events(client, **request)
    kinds = [event.type for event in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    last = "response.incomplete" if full.status == "incomplete" else "response.completed"
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text
    done = events[-1].response
    assert done.output_text == text and done.status == full.status
    assert done.usage.output_tokens == full.usage.output_tokens
    assert events[0].response.status == "in_progress" and not events[0].response.output
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {done.output[0].id}


def test_the_sdk_stream_helper_builds_the_final_response(server: RemoteServer, model) -> None:
    with server.client() as client:
        with client.responses.stream(
            model=model, input="A colour", text_format=Answer, max_output_tokens=80
        ) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert isinstance(final.output_parsed, Answer) and "".join(deltas) == final.output_text
        with client.responses.stream(
            model=model,
            input="Time?",
            tools=TOOLS,
            tool_choice={"type": "function", "name": "get_time"},
            max_output_tokens=60,
        ) as stream:
            arguments = "".join(
                e.delta for e in stream if e.type == "response.function_call_arguments.delta"
            )
            final = stream.get_final_response()
        [call] = final.output
        assert call.type == "function_call" and call.arguments == arguments
        jsonschema.validate(json.loads(arguments), ZONE)
        assert client.responses.retrieve(final.id).output[0].arguments == arguments


def test_background_responses_finish_or_are_cancelled(server: RemoteServer, model) -> None:
    with server.client() as client:
        request = {"model": model, "input": "Go on", "max_output_tokens": 6, **GREEDY}
        foreground = client.responses.create(**request)
        queued = client.responses.create(background=True, **request)
        assert queued.status == "in_progress" and queued.background
        deadline = time.monotonic() + 120
        while (done := client.responses.retrieve(queued.id)).status == "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert done.output_text == foreground.output_text and done.usage is not None
        with pytest.raises(openai.BadRequestError, match="Cannot cancel a"):
            client.responses.cancel(queued.id)
        with pytest.raises(openai.BadRequestError, match="background=true"):
            client.responses.cancel(foreground.id)
        # A long one, cancelled: it stops, and its KV blocks are freed.
        generated = server.metric("pagedllm:generation_tokens_total")
        long = client.responses.create(
            model=model, input="Go on", max_output_tokens=200, background=True
        )
        cancelled = client.responses.cancel(long.id)
        assert cancelled.status == "cancelled"
        assert client.responses.retrieve(long.id).status == "cancelled"
        assert client.responses.cancel(long.id).status == "cancelled"  # (again: the same)
        deadline = time.monotonic() + 60
        while server.metric("pagedllm:num_requests_running") or server.metric(
            "pagedllm:kv_cache_usage_perc"
        ):
            assert time.monotonic() < deadline, "the cancelled request still runs"
            time.sleep(0.05)
        assert server.metric("pagedllm:generation_tokens_total") - generated < 200
        with pytest.raises(openai.BadRequestError, match="is cancelled"):
            client.responses.create(model=model, input="x", previous_response_id=long.id)
        # Deleted: gone.
        client.responses.delete(queued.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(queued.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(queued.id)


def test_reasoning_items(servers, model) -> None:
    server = servers[1]
    request = {"model": model, "input": "Think.", "max_output_tokens": 10, **GREEDY}
    with server.client() as client:
        response = client.responses.create(**request)
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Think."}], max_tokens=10, **GREEDY
        )
        events = _events(client, **request)
    [item] = response.output
    assert item.type == "reasoning" and item.id.startswith("rs_")
    [part] = item.content
    assert part.type == "reasoning_text"
    assert part.text == chat.choices[0].message.model_extra["reasoning_content"]
    assert response.output_text == ""
    # It never closed its reasoning: every output token was reasoning.
    details = response.usage.output_tokens_details
    assert details.reasoning_tokens == response.usage.output_tokens == 10
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == part.text
    assert "response.reasoning_text.done" in [e.type for e in events]


def test_unknown_fields_are_ignored_and_named(server: RemoteServer, model) -> None:
    with server.client() as client:
        raw = client.responses.with_raw_response.create(
            model=model,
            input="Hi",
            max_output_tokens=2,
            reasoning={"effort": "low"},
            service_tier="auto",
            text={"verbosity": "low"},
        )
        assert raw.headers["x-pagedllm-ignored-fields"] == "reasoning,service_tier,text.verbosity"
        assert raw.parse().output_text is not None
    log = server.log_text()
    assert "reasoning" in log and "ignored request fields" in log


BAD_RESPONSES = [
    ({"input": []}, "input must not be empty"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tool type 'web_search'"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "'input_image' is not supported",
    ),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "item type 'item_reference'"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id is missing"),
    ({"input": "x", "truncation": "auto"}, 'truncation="auto"'),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "background": True, "stream": True}, "background"),
    ({"input": "x", "background": True, "store": False}, "store=true"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "16"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "'yaml' is not supported"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "schema"),
    ({"input": "x", "tool_choice": "required"}, "needs tools"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "nope"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 100000}, "maximum context length"),
    ({"input": "x", "model": "other"}, "does not exist"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "not found"),
]


@pytest.mark.parametrize(("body", "needle"), BAD_RESPONSES)
def test_bad_input_is_an_openai_400(server: RemoteServer, body: dict, needle: str) -> None:
    with server.http() as h:
        status = 404 if needle == "does not exist" else 400
        assert_openai_error(h.post("/v1/responses", json=body), status, needle)


def test_unknown_response_ids_are_404(server: RemoteServer) -> None:
    with server.http() as h:
        assert_openai_error(h.get("/v1/responses/resp_nope"), 404, "not found")
        assert_openai_error(h.post("/v1/responses/resp_nope/cancel"), 404, "not found")
        assert_openai_error(h.delete("/v1/responses/resp_nope"), 404, "not found")
        assert_openai_error(h.get("/v1/responses/resp_nope?stream=true"), 400, "stream")


# ------------------------------------------------------------ the parts, alone


def test_the_store_is_bounded_by_bytes_dropping_the_oldest_finished() -> None:
    store = ResponseStore(limit_bytes=2000)

    def response(i: int, status: str = "completed") -> dict:
        return {"id": f"resp_{i}", "status": status, "text": "x" * 400}

    store.put(response(0, "in_progress"), [])
    for i in range(1, 5):
        store.put(response(i), [{"role": "user", "content": "y"}])
    assert store.bytes <= 2000
    # The running one stays; the oldest finished ones went first.
    assert store.get("resp_0") is not None and store.get("resp_4") is not None
    assert store.get("resp_1") is None
    store.get("resp_2")  # (now the most recently used)
    store.put(response(5), [])
    assert store.get("resp_2") is not None and store.get("resp_3") is None
    # One too big alone is not stored (and drops nothing).
    before = len(store)
    store.put({"id": "resp_big", "status": "completed", "text": "z" * 5000}, [])
    assert store.get("resp_big") is None and len(store) == before


def test_reasoning_length_finds_the_end_by_bisection() -> None:
    end = 7

    def is_end(ids) -> bool:
        return end in ids

    assert reasoning_length(is_end, [1, 2, 3, 7, 4, 5]) == 4
    assert reasoning_length(is_end, [7, 1]) == 1
    assert reasoning_length(is_end, [1, 2, 3]) == 3  # (never ended: all reasoning)


def test_output_items_switch_between_reasoning_text_and_calls() -> None:
    items = OutputItems()
    events = items.add({"reasoning_content": "hmm"})
    events += items.add({"reasoning_content": " ok", "content": "Hi"})
    events += items.add({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f"}}]})
    events += items.add({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})
    events += items.close(truncated=False)
    kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in events]
    assert [i["type"] for i in items.items] == ["reasoning", "message", "function_call"]
    assert items.items[0]["content"][0]["text"] == "hmm ok"
    assert items.items[1]["content"][0]["text"] == "Hi"
    assert items.items[2]["arguments"] == "{}" and items.items[2]["call_id"] == "call_1"
    assert all(i["status"] == "completed" for i in items.items)
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]


def test_the_store_bound_comes_from_the_environment(monkeypatch) -> None:
    from pagedllm.core.errors import ConfigError
    from pagedllm.entrypoints.openai.responses_store import store_limit_bytes

    monkeypatch.delenv("PAGEDLLM_RESPONSES_STORE_MB", raising=False)
    assert store_limit_bytes() == 64 << 20
    monkeypatch.setenv("PAGEDLLM_RESPONSES_STORE_MB", "0.5")
    assert store_limit_bytes() == 1 << 19
    monkeypatch.setenv("PAGEDLLM_RESPONSES_STORE_MB", "lots")
    with pytest.raises(ConfigError, match="PAGEDLLM_RESPONSES_STORE_MB='lots'"):
        store_limit_bytes()
