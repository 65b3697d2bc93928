"""Today's OpenAI clients work unchanged: the official ``openai`` client against
``pagedllm serve``, sending the fields agent frameworks send routinely.

One server serves the module (a tiny Llama named ``org/tiny`` and ``tiny``).
"""

from __future__ import annotations

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


def test_legacy_functions_are_tools(server: RemoteServer) -> None:
    functions = [{"name": "get_time", "description": "The time", "parameters": TIME}]
    with server.client() as client:
        reply = client.chat.completions.create(
            model="tiny",
            messages=USER,
            max_tokens=40,
            functions=functions,
            function_call={"name": "get_time"},
        )
        calls = reply.choices[0].message.tool_calls
        assert calls and {call.function.name for call in calls} == {"get_time"}
        none = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=3, functions=functions, function_call="none"
        )
        assert none.choices[0].message.tool_calls in (None, [])


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
