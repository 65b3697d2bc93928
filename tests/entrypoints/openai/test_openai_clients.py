"""Today's OpenAI clients work unchanged: the official ``openai`` client against
``pagedllm serve``, sending the fields agent frameworks send routinely.

One server serves the module (a tiny Llama named ``org/tiny`` and ``tiny``).
"""

from __future__ import annotations

import json

import openai
import pytest
from openai_server import RemoteServer, assert_openai_error, start_servers, tiny_llama

HEADER = "x-pagedllm-ignored-fields"
USER = [{"role": "user", "content": "Hello"}]
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}}
# OpenAI fields pagedllm does not serve, as clients and agent frameworks send them.
UNSERVED = {
    "store": False,
    "metadata": {"a": "b"},
    "reasoning_effort": "low",
    "service_tier": "auto",
    "prediction": {"type": "content", "content": "Hi"},
    "modalities": ["text"],
    "verbosity": "low",
    "web_search_options": {},
    "prompt_cache_key": "k",
    "safety_identifier": "s",
    "include_reasoning": True,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RemoteServer:
    logs = tmp_path_factory.mktemp("clients")
    remote = RemoteServer(
        tiny_llama(tmp_path_factory),
        "--served-model-name",
        "org/tiny",
        "tiny",
        log_path=logs / "server.log",
    )
    start_servers(remote)
    yield remote
    remote.stop()


def _warnings(server: RemoteServer, name: str) -> int:
    """How many warning lines of the server's log name ``name`` as an ignored field."""
    return sum(
        1
        for line in server.log_text().splitlines()
        if "ignored request fields" in line and f" {name}" in line.split(":", 1)[-1]
    )


def test_unknown_fields_are_ignored_warned_once_and_named(server: RemoteServer) -> None:
    with server.client() as client:
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=USER, max_tokens=3, extra_body=dict(UNSERVED)
            )
            assert raw.headers[HEADER].split(",") == sorted(UNSERVED)
            assert raw.parse().choices[0].message.content is not None
        # Through the SDK's own parameters too (store, metadata, ...).
        reply = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=3, store=False, metadata={"a": "b"}
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt="Hi", max_tokens=2, extra_body={"store": False}
        )
        assert raw.headers[HEADER] == "store"
        # Beam search, which checks the fields it is given, ignores them as well.
        beams = {"use_beam_search": True, "best_of": 2, "store": False}
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt="Hi", max_tokens=2, extra_body=beams
        )
        assert raw.headers[HEADER] == "store" and raw.parse().choices
        # Streamed responses carry the header as well.
        with client.chat.completions.with_streaming_response.create(
            model="tiny", messages=USER, max_tokens=2, stream=True, service_tier="auto"
        ) as streamed:
            assert streamed.headers[HEADER] == "service_tier"
            assert list(streamed.iter_lines())
        plain = client.chat.completions.with_raw_response.create(
            model="tiny", messages=USER, max_tokens=2
        )
        assert HEADER not in plain.headers
    with server.http() as h:
        tokenized = h.post("/tokenize", json={"prompt": "Hi", "store": True})
        assert tokenized.status_code == 200 and tokenized.headers[HEADER] == "store"
    for name in UNSERVED:
        assert _warnings(server, name) == 1, (name, server.log_text()[-3000:])
    assert "reasoning_effort (pagedllm has no reasoning budget)" in server.log_text()


def test_known_fields_keep_their_validation(server: RemoteServer) -> None:
    with server.client() as client:
        for bad in (
            {"max_completion_tokens": 0},
            {"temperature": "hot"},
            {"n": "two"},
            {"stream_options": {"include_usage": True, "nope": 1}},
            {"functions": "get_time"},
            {"functions": [{"name": "get_time"}], "tools": []},
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(
                    model="tiny", messages=USER, max_tokens=2, extra_body=bad
                )
            assert caught.value.status_code == 400, bad
    with server.http() as h:
        body = {"prompt": "Hi", "max_tokens": "many", "store": False}
        assert_openai_error(h.post("/v1/completions", json=body), 400, "max_tokens")


def test_legacy_functions_reply_with_function_call(server: RemoteServer) -> None:
    """The deprecated functions/function_call are served as tools, and answered as OpenAI
    answers them: ``message.function_call`` (``delta.function_call`` streamed), not
    ``tool_calls``; a reply that sends the call and its ``function`` result back works."""
    functions = [{"name": "get_time", "description": "The time", "parameters": TIME}]
    request = dict(
        model="tiny",
        messages=USER,
        max_tokens=40,
        temperature=0,
        functions=functions,
        function_call={"name": "get_time"},
    )
    with server.client() as client:
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        call = choice.message.function_call
        assert call is not None and call.name == "get_time", choice
        assert isinstance(json.loads(call.arguments), dict)
        assert not choice.message.tool_calls and choice.message.content is None
        # A forced call ends as OpenAI's forced calls do ("stop"), never as "tool_calls".
        assert choice.finish_reason == "stop"
        name = arguments = ""
        finish = None
        for chunk in client.chat.completions.create(stream=True, **request):
            for streamed in chunk.choices:
                assert not streamed.delta.tool_calls
                if streamed.delta.function_call is not None:
                    name += streamed.delta.function_call.name or ""
                    arguments += streamed.delta.function_call.arguments or ""
                finish = streamed.finish_reason or finish
        assert (name, arguments, finish) == ("get_time", call.arguments, "stop")
        # The client's next turn: its call and the function's result, the old way.
        follow_up = [
            *USER,
            {"role": "assistant", "content": None, "function_call": call.model_dump()},
            {"role": "function", "name": "get_time", "content": "12:00"},
        ]
        reply = client.chat.completions.create(
            model="tiny", messages=follow_up, max_tokens=3, functions=functions
        )
        assert reply.choices[0].message.function_call is None
        none = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=3, functions=functions, function_call="none"
        )
        assert none.choices[0].message.function_call is None
        assert none.choices[0].message.tool_calls in (None, [])
        # One call per turn: the reply has room for one function_call.
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="tiny",
                messages=USER,
                max_tokens=3,
                functions=functions,
                extra_body={"parallel_tool_calls": True},
            )
        assert "parallel_tool_calls" in str(caught.value)


def test_max_completion_tokens_is_honoured(server: RemoteServer) -> None:
    with server.client() as client:
        reply = client.chat.completions.create(
            model="tiny",
            messages=USER,
            max_completion_tokens=3,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage.completion_tokens == 3


def test_models_retrieve(server: RemoteServer) -> None:
    with server.client() as client:
        listed = {card.id: card for card in client.models.list().data}
        assert set(listed) == {"org/tiny", "tiny"}
        for name, card in listed.items():
            retrieved = client.models.retrieve(name)
            assert retrieved.id == name and retrieved.object == "model"
            assert retrieved.model_dump(exclude={"created"}) == card.model_dump(exclude={"created"})
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve("no-such-model")
        assert "no-such-model" in str(caught.value)
    with server.http() as h:
        error = assert_openai_error(h.get("/v1/models/no-such-model"), 404, "does not exist")
        assert error["type"] == "NotFoundError"


def test_every_response_has_a_request_id(server: RemoteServer) -> None:
    # Without --enable-request-id-headers, as vLLM does.
    with server.client() as client:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=USER, max_tokens=2
        )
        assert len(raw.headers["x-request-id"]) >= 16
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": "mine-1"}
        )
        assert raw.headers["x-request-id"] == "mine-1"
        assert raw.parse().id == "cmpl-mine-1"


def test_langchain_chat_openai_with_metadata_and_store(server: RemoteServer) -> None:
    """LangChain's ChatOpenAI as agent code configures it: ``store`` and OpenAI
    ``metadata`` reach the server, which ignores and names them, and the reply is real."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        model="tiny",
        max_tokens=5,
        max_retries=0,
        store=False,
        metadata={"run": "test"},  # LangChain's own run metadata: not sent
        extra_body={"metadata": {"team": "a"}, "ignore_eos": True},
        include_response_headers=True,
    )
    message = chat.invoke("Hello")
    assert isinstance(message.content, str) and message.content
    assert message.usage_metadata["output_tokens"] == 5
    assert message.response_metadata["finish_reason"] == "length"
    assert message.response_metadata["headers"][HEADER] == "metadata,store"
    assert _warnings(server, "store") == 1 and _warnings(server, "metadata") == 1
