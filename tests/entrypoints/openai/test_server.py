"""The OpenAI-compatible server, driven over HTTP with the official ``openai`` client.

One server (a subprocess on a free port, tiny random Llama) serves the whole module; the
server flags themselves (auth, CORS, TLS, ...) are tested in ``test_server_options.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections import defaultdict
from typing import Any

import httpx
import openai
import pytest
from openai_server import RemoteServer, assert_openai_error, start_servers, tiny_llama

import pagedllm

MODEL = "tiny"
ALIAS = "tiny-alias"
MAX_LOGPROBS = 5
MAX_MODEL_LEN = 256  # the tiny checkpoint's max_position_embeddings
USER = [{"role": "user", "content": "Hello, how are you?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = tiny_llama(tmp_path_factory)
    remote = RemoteServer(
        model,
        "--served-model-name",
        MODEL,
        ALIAS,
        "--max-logprobs",
        str(MAX_LOGPROBS),
        "--scheduling-policy",
        "priority",
        "--enable-prompt-tokens-details",
        log_path=tmp_path_factory.mktemp("server") / "server.log",
    )
    start_servers(remote)
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def http(server: RemoteServer):
    with server.http() as h:
        yield h


def count_tokens(http: httpx.Client, **body: Any) -> int:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["count"]


def stream_completion(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], dict[int, str]]:
    """The chunks of a streamed completion and the text of each choice, checking that a
    choice's finish_reason comes on its last chunk only."""
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    texts: dict[int, str] = defaultdict(str)
    finished: dict[int, str] = {}
    for chunk in chunks:
        assert chunk.object == "text_completion"
        for choice in chunk.choices:
            assert choice.index not in finished, f"a chunk after choice {choice.index} finished"
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == set(texts), (finished, texts)
    return chunks, dict(texts)


def stream_chat(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], dict[int, str]]:
    """Like ``stream_completion`` for chat; the role comes in each choice's first delta."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            assert choice.index not in finished, f"a chunk after choice {choice.index} finished"
            if choice.index not in texts:
                assert choice.delta.role == "assistant"
                texts[choice.index] = ""
            else:
                assert choice.delta.role is None
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == set(texts), (finished, texts)
    return chunks, texts


# ---------------------------------------------------------------- plain routes


def test_health_ping_version(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/ping").status_code == 200
    assert http.post("/ping").status_code == 200
    assert http.get("/version").json() == {"version": pagedllm.__version__}


def test_models_lists_every_served_name_first_reported(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, ALIAS]
    assert all(m.owned_by == "pagedllm" for m in models.data)
    for name in (MODEL, ALIAS):
        out = client.completions.create(model=name, prompt="Hi", max_tokens=2)
        assert out.model == MODEL
    out = client.chat.completions.create(model=ALIAS, messages=USER, max_tokens=2)
    assert out.model == MODEL


def test_unknown_model_is_404(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER, max_tokens=2)
    error = assert_openai_error(
        http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "nope"
    )
    assert error["type"] == "NotFoundError"
    assert error["param"] == "model"
    assert_openai_error(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_openapi_docs_served_by_default(http: httpx.Client) -> None:
    schema = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"):
        assert path in schema["paths"]
    assert http.get("/docs").status_code == 200
    assert http.get("/redoc").status_code == 200


# ----------------------------------------------------------------- completions


def test_completion_usage_is_exact(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "The quick brown fox"
    prompt_tokens = count_tokens(http, prompt=prompt)
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion"
    assert out.id.startswith("cmpl-")
    [choice] = out.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == prompt_tokens + 7
    # --enable-prompt-tokens-details
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="Hi", temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 16


def test_prompt_forms(client: openai.OpenAI, http: httpx.Client) -> None:
    text = "Once upon a time"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    greedy = dict(model=MODEL, max_tokens=6, temperature=0)
    from_text = client.completions.create(prompt=text, **greedy)
    from_ids = client.completions.create(prompt=ids, **greedy)
    assert from_ids.choices[0].text == from_text.choices[0].text
    assert from_ids.usage.prompt_tokens == len(ids)

    several = client.completions.create(prompt=[text, "Hello"], **greedy)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text == from_text.choices[0].text
    hello = client.completions.create(prompt="Hello", **greedy)
    assert several.choices[1].text == hello.choices[0].text
    assert several.usage.prompt_tokens == len(ids) + count_tokens(http, prompt="Hello")

    id_lists = client.completions.create(prompt=[ids, ids[:2]], **greedy)
    assert [c.index for c in id_lists.choices] == [0, 1]
    assert id_lists.choices[0].text == from_text.choices[0].text
    assert id_lists.usage.prompt_tokens == len(ids) + 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0),
        dict(temperature=1.0, seed=1234),
        dict(temperature=0, logprobs=2, echo=True),
    ],
    ids=["greedy", "seeded", "logprobs-echo"],
)
def test_completion_stream_equals_non_stream(client: openai.OpenAI, kwargs: dict) -> None:
    common = dict(prompt="Hello world", max_tokens=12, **kwargs)
    full = client.completions.create(model=MODEL, **common)
    chunks, texts = stream_completion(client, **common)
    assert texts == {0: full.choices[0].text}
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.id == chunks[0].id for c in chunks)
    if "logprobs" in kwargs:
        assert full.choices[0].text.startswith("Hello world")
        merged: dict[str, list] = defaultdict(list)
        for chunk in chunks:
            for field in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
                merged[field] += getattr(chunk.choices[0].logprobs, field)
        lp = full.choices[0].logprobs
        assert merged["tokens"] == lp.tokens
        assert merged["text_offset"] == lp.text_offset
        assert merged["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-4)
        assert [None if t is None else sorted(t) for t in merged["top_logprobs"]] == [
            None if t is None else sorted(t) for t in lp.top_logprobs
        ]


def test_completion_logprobs_and_echo(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "Hello there"
    prompt_ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    common = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3, echo=True)
    out = client.completions.create(**common)
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n = len(prompt_ids) + 4
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens[: len(prompt_ids)]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[len(prompt_ids)] == len(prompt)

    # as token ids, no two tokens share a key in top_logprobs
    by_id = client.completions.create(
        **common, extra_body={"return_tokens_as_token_ids": True}
    ).choices[0]
    lp = by_id.logprobs
    assert lp.tokens[: len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]
    for token, value, top in zip(
        lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True
    ):
        assert value <= 0
        assert token in top and top[token] == pytest.approx(value)
        assert 3 <= len(top) <= 4  # the top 3 plus the chosen token
    # greedy: every generated token is the most likely one
    for value, top in zip(
        lp.token_logprobs[len(prompt_ids) :], lp.top_logprobs[len(prompt_ids) :], strict=True
    ):
        assert value == pytest.approx(max(top.values()))

    plain = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, logprobs=0, extra_body={"ignore_eos": True}
    )
    assert len(plain.choices[0].logprobs.tokens) == 4
    assert all(len(top) == 1 for top in plain.choices[0].logprobs.top_logprobs)

    with pytest.raises(openai.BadRequestError, match="max-logprobs"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=6)


def test_echo_with_max_tokens_0_scores_the_prompt(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    """lm-eval's loglikelihood request: the prompt's logprobs, nothing generated."""
    prompt = "The capital of France is Paris."
    prompt_ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    common = dict(prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    out = client.completions.create(model=MODEL, **common)
    choice = out.choices[0]
    assert choice.text == prompt
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    assert "".join(choice.logprobs.tokens) == prompt
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 0
    chunks, texts = stream_completion(client, stream_options={"include_usage": True}, **common)
    assert texts == {0: prompt}
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_prompt_logprobs(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "A paged attention engine"
    prompt_tokens = count_tokens(http, prompt=prompt)
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    positions = out.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == prompt_tokens
    assert positions[0] is None
    for position in positions[1:]:
        assert 2 <= len(position) <= 3
        assert all(entry["logprob"] <= 0 for entry in position.values())
    with pytest.raises(openai.BadRequestError, match="max-logprobs"):
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 6}
        )
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_stop_strings(client: openai.OpenAI) -> None:
    common = dict(model=MODEL, prompt="Hello world", temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(max_tokens=16, **common).choices[0].text
    assert len(text) >= 7
    stop = text[4:7]
    out = client.completions.create(max_tokens=16, stop=[stop, "@@@never@@@"], **common)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop
    # a single string works too, and the streamed text stops at the same place
    _, streamed = stream_completion(
        client,
        prompt="Hello world",
        temperature=0,
        max_tokens=16,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    assert streamed == {0: choice.text}


def test_seed_reproducible_and_user_accepted(client: openai.OpenAI) -> None:
    common = dict(
        model=MODEL,
        prompt="Seeds",
        max_tokens=10,
        temperature=1.0,
        user="alice",
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(seed=7, **common).choices[0].text
    b = client.completions.create(seed=7, **common).choices[0].text
    c = client.completions.create(seed=8, **common).choices[0].text
    assert a == b
    assert a != c


def test_vllm_extra_sampling_fields(client: openai.OpenAI) -> None:
    common = dict(model=MODEL, prompt="The weather today", max_tokens=8)
    greedy = client.completions.create(temperature=0, **common).choices[0].text
    top_k_1 = client.completions.create(
        temperature=1.0, seed=3, extra_body={"top_k": 1}, **common
    ).choices[0]
    assert top_k_1.text == greedy
    min_p_1 = client.completions.create(
        temperature=1.0, seed=3, extra_body={"min_p": 1.0}, **common
    ).choices[0]
    assert min_p_1.text == greedy
    penalised = client.completions.create(
        temperature=0, extra_body={"repetition_penalty": 1.5, "ignore_eos": True}, **common
    )
    assert penalised.usage.completion_tokens == 8
    assert (
        client.completions.create(temperature=0, extra_body={"priority": 5}, **common)
        .choices[0]
        .text
        == greedy
    )

    # min_tokens holds back a stop token until that many tokens were generated
    first = client.completions.create(
        temperature=0, logprobs=0, extra_body={"return_tokens_as_token_ids": True}, **common
    )
    first_id = int(first.choices[0].logprobs.tokens[0].removeprefix("token_id:"))
    stopped = client.completions.create(
        temperature=0, extra_body={"stop_token_ids": [first_id]}, **common
    )
    assert stopped.usage.completion_tokens == 1
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == first_id
    held = client.completions.create(
        temperature=0, extra_body={"stop_token_ids": [first_id], "min_tokens": 4}, **common
    )
    assert held.usage.completion_tokens >= 4


def test_priority_accepted_with_priority_policy(client: openai.OpenAI) -> None:
    # This server runs --scheduling-policy priority: any priority is accepted (the
    # refusal under fcfs is tested in test_server_options.py).
    for priority in (-3, 0, 10):
        out = client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": priority}
        )
        assert out.usage.completion_tokens == 2


# ------------------------------------------------------------------ streaming


def test_stream_options_usage(client: openai.OpenAI) -> None:
    common = dict(prompt="Hello", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(model=MODEL, **common)

    chunks, texts = stream_completion(client, stream_options={"include_usage": True}, **common)
    assert texts == {0: full.choices[0].text}
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.completion_tokens == full.usage.completion_tokens == 6
    assert last.usage.total_tokens == full.usage.total_tokens
    assert all(chunk.usage is None for chunk in body)

    chunks, _ = stream_completion(
        client, stream_options={"include_usage": True, "continuous_usage_stats": True}, **common
    )
    assert all(chunk.usage is not None for chunk in chunks)
    generated = [chunk.usage.completion_tokens for chunk in chunks]
    assert generated == sorted(generated) and generated[-1] == 6
    assert all(chunk.usage.prompt_tokens == full.usage.prompt_tokens for chunk in chunks)

    chunks, _ = stream_completion(client, **common)
    assert all(chunk.usage is None for chunk in chunks)

    # (run once first: both requests below then find the prompt in the prefix cache, so
    # their usage, cached tokens included, is the same whatever ran before this test)
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, temperature=0)
    chat_full = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, temperature=0
    )
    chunks, texts = stream_chat(
        client,
        messages=USER,
        max_tokens=5,
        temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    assert texts == {0: chat_full.choices[0].message.content}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == chat_full.usage.model_dump()


def test_stream_options_without_stream_is_400(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, stream_options={"include_usage": True}
        )
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2, stream_options={"include_usage": True}
        )
    body = {"prompt": "Hi", "stream": False, "stream_options": {"include_usage": True}}
    assert_openai_error(http.post("/v1/completions", json=body), 400, "stream_options")


@pytest.mark.parametrize("kwargs", [dict(temperature=0), dict(temperature=0.8, seed=99)])
def test_chat_stream_equals_non_stream(client: openai.OpenAI, kwargs: dict) -> None:
    common = dict(messages=USER, max_tokens=10, **kwargs)
    full = client.chat.completions.create(model=MODEL, **common)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    chunks, texts = stream_chat(client, **common)
    assert texts == {0: full.choices[0].message.content}
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_without_and_with_streaming(client: openai.OpenAI) -> None:
    common = dict(
        prompt="Tell me",
        max_tokens=8,
        temperature=1.0,
        seed=5,
        n=3,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(model=MODEL, **common)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.text for c in full.choices]
    assert len(set(texts)) == 3, texts
    assert full.usage.completion_tokens == 3 * 8
    _, streamed = stream_completion(client, **common)
    assert streamed == dict(enumerate(texts))

    # several prompts times n: prompt i's samples are choices i*n .. i*n+n-1
    many = client.completions.create(
        model=MODEL, prompt=["Tell me", "Other"], max_tokens=8, temperature=1.0, seed=5, n=3
    )
    assert [c.index for c in many.choices] == list(range(6))
    assert [c.text for c in many.choices[:3]] == texts
    _, streamed = stream_completion(
        client, prompt=["Tell me", "Other"], max_tokens=8, temperature=1.0, seed=5, n=3
    )
    assert streamed == {c.index: c.text for c in many.choices}

    chat = dict(messages=USER, max_tokens=8, temperature=1.0, seed=5, n=2)
    full_chat = client.chat.completions.create(model=MODEL, **chat)
    assert [c.index for c in full_chat.choices] == [0, 1]
    chat_texts = [c.message.content for c in full_chat.choices]
    assert chat_texts[0] != chat_texts[1]
    _, streamed = stream_chat(client, **chat)
    assert streamed == dict(enumerate(chat_texts))


def test_n_with_greedy_sampling_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="greedy"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0, n=2)


def test_concurrent_streams_match_sequential(server: RemoteServer, client: openai.OpenAI) -> None:
    prompts = [f"Request number {i} says" for i in range(8)]
    expected = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def all_at_once() -> list[str]:
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(all_at_once()) == expected


# ------------------------------------------------------------------------ chat


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 4
    assert "".join(item.token for item in content) == out.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 3
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.logprob == pytest.approx(values[0])  # greedy picks the top token
        assert item.bytes == list(item.token.encode())

    no_top = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, logprobs=True)
    assert all(item.top_logprobs == [] for item in no_top.choices[0].logprobs.content)
    assert (
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices[0].logprobs
        is None
    )

    chunks, _ = stream_chat(
        client,
        messages=USER,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        item.token
        for chunk in chunks
        for c in chunk.choices
        if c.logprobs
        for item in c.logprobs.content
    ]
    assert streamed == [item.token for item in content]

    with pytest.raises(openai.BadRequestError, match="max-logprobs"):
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2, logprobs=True, top_logprobs=6
        )
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, top_logprobs=2)


def test_chat_max_tokens_and_max_completion_tokens(client: openai.OpenAI) -> None:
    common = dict(model=MODEL, messages=USER, extra_body={"ignore_eos": True})
    assert client.chat.completions.create(max_tokens=4, **common).usage.completion_tokens == 4
    out = client.chat.completions.create(max_completion_tokens=3, **common)
    assert out.usage.completion_tokens == 3
    assert out.choices[0].finish_reason == "length"
    # with no limit the answer may fill the context
    unlimited = client.chat.completions.create(**common)
    assert unlimited.usage.total_tokens == MAX_MODEL_LEN


def test_chat_uses_the_tokenizer_template(client: openai.OpenAI, http: httpx.Client) -> None:
    rendered = http.post("/tokenize", json={"messages": USER}).json()
    text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n"
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    assert out.usage.prompt_tokens == rendered["count"]

    no_prompt = http.post(
        "/tokenize", json={"messages": USER, "add_generation_prompt": False}
    ).json()
    text = http.post("/detokenize", json={"tokens": no_prompt["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>user\nHello, how are you?<|im_end|>\n"
    out = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=1, extra_body={"add_generation_prompt": False}
    )
    assert out.usage.prompt_tokens == no_prompt["count"]


def test_chat_list_of_parts_content(client: openai.OpenAI, http: httpx.Client) -> None:
    parts = [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "how are you?"}]
    joined = [{"role": "user", "content": "Hello,\nhow are you?"}]
    as_parts = [{"role": "user", "content": parts}]
    assert (
        http.post("/tokenize", json={"messages": as_parts}).json()
        == http.post("/tokenize", json={"messages": joined}).json()
    )
    a = client.chat.completions.create(model=MODEL, messages=as_parts, max_tokens=5, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=joined, max_tokens=5, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model=MODEL, messages=image, max_tokens=2)
    # Without --allowed-local-media-path no file is read.
    image[0]["content"][0]["image_url"]["url"] = f"file://{os.path.abspath(__file__)}"
    with pytest.raises(openai.BadRequestError, match="not started with --allowed-local-media"):
        client.chat.completions.create(model=MODEL, messages=image, max_tokens=2)


def test_chat_continue_final_message_and_echo(client: openai.OpenAI, http: httpx.Client) -> None:
    messages = [*USER, {"role": "assistant", "content": "I am"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    rendered = http.post("/tokenize", json={"messages": messages, **extra}).json()
    text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nI am")
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body=extra
    )
    assert plain.usage.prompt_tokens == rendered["count"]
    echoed = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={**extra, "echo": True},
    )
    assert echoed.choices[0].message.content == "I am" + plain.choices[0].message.content
    _, streamed = stream_chat(
        client, messages=messages, max_tokens=4, temperature=0, extra_body={**extra, "echo": True}
    )
    assert streamed == {0: echoed.choices[0].message.content}

    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            extra_body={"continue_final_message": True},
        )
    assert_openai_error(
        http.post("/tokenize", json={"messages": messages, "continue_final_message": True}),
        400,
        "continue_final_message",
    )


def test_chat_template_in_request_with_kwargs(client: openai.OpenAI, http: httpx.Client) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}|{{ tone }}]{% endfor %}"
    body = {"chat_template": template, "chat_template_kwargs": {"tone": "calm"}}
    rendered = http.post("/tokenize", json={"messages": USER, **body}).json()
    text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert text == "[user:Hello, how are you?|calm]"
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body=body)
    assert out.usage.prompt_tokens == rendered["count"]
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"messages": []}},
        )


def test_chat_content_format_auto_detects_a_template_over_parts(http: httpx.Client) -> None:
    # this template loops over each message's content: 'auto' passes OpenAI-style parts,
    # so a plain string content still renders
    template = (
        "{% for m in messages %}{{ m['role'] }}={% for p in m['content'] %}"
        "({{ p['text'] }}){% endfor %};{% endfor %}"
    )
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    for messages, expected in [(USER, "user=(Hello, how are you?);"), (parts, "user=(a)(b);")]:
        rendered = http.post("/tokenize", json={"messages": messages, "chat_template": template})
        tokens = rendered.json()["tokens"]
        assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == expected


def test_chat_bad_messages(http: httpx.Client) -> None:
    for messages, needle in [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "role"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": 5}], "content"),
        ("hello", "messages"),
    ]:
        response = http.post("/v1/chat/completions", json={"messages": messages})
        assert_openai_error(response, 400, needle)


# ------------------------------------------------------- tokenize, invocations


def test_tokenize_detokenize(http: httpx.Client) -> None:
    text = "Hello, world! Ça va?"
    out = http.post("/tokenize", json={"model": ALIAS, "prompt": text, "return_token_strs": True})
    body = out.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    back = http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": text}
    assert_openai_error(http.post("/detokenize", json={"tokens": [1, 512]}), 400, "512")
    assert_openai_error(http.post("/detokenize", json={"tokens": [2**70]}), 400)
    assert_openai_error(http.post("/tokenize", json={}), 400)
    assert_openai_error(http.post("/tokenize", json={"prompt": "a", "messages": USER}), 400)


def test_invocations_routes_to_chat_or_completions(http: httpx.Client) -> None:
    completion = http.post("/invocations", json={"prompt": "Hi", "max_tokens": 3}).json()
    assert completion["object"] == "text_completion"
    assert completion["usage"]["completion_tokens"] <= 3
    chat = http.post("/invocations", json={"messages": USER, "max_tokens": 3}).json()
    assert chat["object"] == "chat.completion"
    assert_openai_error(http.post("/invocations", json={"neither": 1}), 400, "messages")
    assert_openai_error(http.post("/invocations", json={"prompt": "Hi", "n": "x"}), 400, "n")
    assert_openai_error(
        http.post(
            "/invocations", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
        "json",
    )


# --------------------------------------------------------------------- metrics


def test_metrics_count_requests_tokens_and_latencies(
    server: RemoteServer, client: openai.OpenAI, http: httpx.Client
) -> None:
    m = server.metric
    histograms = (
        "pagedllm:time_to_first_token_seconds_count",
        "pagedllm:request_time_per_output_token_seconds_count",
        "pagedllm:e2e_request_latency_seconds_count",
        "pagedllm:request_queue_time_seconds_count",
    )
    gaps = "pagedllm:inter_token_latency_seconds_count"
    gaps_before = m(gaps) if _has(server, gaps) else 0
    before = {name: m(name) for name in histograms} if _has(server, histograms[0]) else None
    success = _value_or_zero(server, "pagedllm:request_success_total", finished_reason="length")
    generated = m("pagedllm:generation_tokens_total")
    prompt_tokens = m("pagedllm:prompt_tokens_total")

    # a prompt no earlier test sent, so no prefix-cache hit hides prompt tokens
    prompt = "Metrics probe: zebra quartz 9173"
    n_prompt = count_tokens(http, prompt=prompt)
    client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert m("pagedllm:generation_tokens_total") - generated == 7
    assert m("pagedllm:prompt_tokens_total") - prompt_tokens == n_prompt
    assert m("pagedllm:request_success_total", finished_reason="length") - success == 1
    for name in histograms:
        assert m(name) - (before[name] if before else 0) == 1, name
    # one observation per gap between two of the request's tokens
    assert m(gaps) - gaps_before == 6
    assert m("pagedllm:num_requests_running") == 0
    assert m("pagedllm:num_requests_waiting") == 0
    assert m("pagedllm:kv_cache_usage_perc") == 0
    text = http.get("/metrics").text
    for name in (
        "pagedllm:time_to_first_token_seconds_bucket",
        "pagedllm:inter_token_latency_seconds_bucket",
        "pagedllm:e2e_request_latency_seconds_bucket",
        "pagedllm:request_queue_time_seconds_bucket",
        "pagedllm:prefix_cache_hit_rate",
    ):
        assert name in text
    assert f'model_name="{MODEL}"' in text


def test_metrics_prefix_cache_hits(server: RemoteServer, client: openai.OpenAI) -> None:
    # 40+ tokens: at least two full 16-token blocks are cached and found again
    prompt = "Prefix caching: " + " ".join(f"w{i}" for i in range(30))
    hits = server.metric("pagedllm:prefix_cache_hits_total")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens > 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0
    assert server.metric("pagedllm:prefix_cache_hits_total") - hits >= 32
    assert 0 < server.metric("pagedllm:prefix_cache_hit_rate") <= 1


def _has(server: RemoteServer, name: str) -> bool:
    return any(key.split("{")[0] == name for key in server.metrics())


def _value_or_zero(server: RemoteServer, name: str, **labels: str) -> float:
    try:
        return server.metric(name, **labels)
    except AssertionError:
        return 0.0


def _wait_idle(server: RemoteServer, timeout: float = 20) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        running = server.metric("pagedllm:num_requests_running")
        usage = server.metric("pagedllm:kv_cache_usage_perc")
        if (running == 0 and usage == 0) or time.monotonic() > deadline:
            return running, usage
        time.sleep(0.05)


def test_stream_disconnect_frees_kv_blocks(server: RemoteServer) -> None:
    assert _wait_idle(server) == (0, 0)
    generated = server.metric("pagedllm:generation_tokens_total")
    max_tokens = MAX_MODEL_LEN - 8
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "stream": True}
    body["ignore_eos"] = True
    with server.http() as h, h.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.metric("pagedllm:num_requests_running") == 1
        assert server.metric("pagedllm:kv_cache_usage_perc") > 0
    # closed after one chunk: the request is aborted and its blocks freed
    assert _wait_idle(server) == (0, 0)
    assert server.metric("pagedllm:generation_tokens_total") - generated < max_tokens


def test_non_stream_disconnect_frees_kv_blocks(server: RemoteServer) -> None:
    assert _wait_idle(server) == (0, 0)
    generated = server.metric("pagedllm:generation_tokens_total")
    max_tokens = MAX_MODEL_LEN - 8
    body = json.dumps(
        {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request + body)
        deadline = time.monotonic() + 10
        while server.metric("pagedllm:num_requests_running") != 1:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
    # the connection closed before the answer: the request is aborted, its blocks freed
    assert _wait_idle(server) == (0, 0)
    assert server.metric("pagedllm:generation_tokens_total") - generated < max_tokens


# ---------------------------------------------------------------------- errors

# (body, status, a word of the message)
BAD_COMPLETIONS: list[tuple[bytes, int, str]] = [
    (b'{"prompt": "Hi", ', 400, "json"),
    (b"[1, 2]", 400, ""),
    (b'"just a string"', 400, ""),
    (b"", 400, ""),
    (b'{"prompt": 5}', 400, "prompt"),
    (b'{"prompt": []}', 400, "prompt"),
    (b'{"prompt": [[]]}', 400, "empty"),
    (b'{"prompt": "Hi", "max_tokens": "many"}', 400, "max_tokens"),
    (b'{"prompt": "Hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "Hi", "max_tokens": 1000000000000}', 400, "context length"),
    (b'{"prompt": "Hi", "n": 1000000}', 400, "n"),
    (b'{"prompt": "Hi", "n": 0}', 400, "n"),
    (b'{"prompt": "Hi", "seed": 9223372036854775808}', 400, "seed"),
    (b'{"prompt": "Hi", "seed": -9223372036854775809}', 400, "seed"),
    (b'{"prompt": "Hi", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "Hi", "top_p": 2}', 400, "top_p"),
    (b'{"prompt": "Hi", "top_k": -5}', 400, "top_k"),
    (b'{"prompt": "Hi", "stream": "sometimes"}', 400, "stream"),
    (b'{"prompt": "Hi", "stop": [1, 2]}', 400, "stop"),
    (b'{"prompt": "Hi", "logprobs": 1000000000000}', 400, "logprobs"),
    (b'{"prompt": "Hi", "min_tokens": 1000000000000}', 400, "min_tokens"),
    (b'{"prompt": "Hi", "truncate_prompt_tokens": 1000000000000}', 400, "truncate"),
    (b'{"prompt": "Hi", "logit_bias": {"99999": 1}}', 400, "logit_bias"),
    # (an unknown field is ignored; the known ones are still checked)
    (b'{"prompt": "Hi", "no_such_field": 1, "max_tokens": "many"}', 400, "max_tokens"),
    (b'{"prompt": [99999999999999999999999]}', 400, "vocabulary"),
    (b'{"prompt": [-1]}', 400, "vocabulary"),
    (b'{"prompt": [[5, 600]]}', 400, "vocabulary"),
    (b'{"prompt": "Hi", "suffix": "x"}', 400, "suffix"),
    (b'{"prompt": "Hi", "use_beam_search": true, "stream": true}', 400, "beam"),
    (b'{"prompt": "Hi", "guided_regex": "a(b"}', 400, "invalid regex"),
    (('{"prompt": "' + "word " * 300 + '"}').encode(), 400, "maximum context length"),
]


@pytest.mark.parametrize(("body", "status", "needle"), BAD_COMPLETIONS)
def test_bad_completion_requests(http: httpx.Client, body: bytes, status: int, needle: str) -> None:
    response = http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, status, needle)


def test_bad_chat_requests(http: httpx.Client) -> None:
    for extra, needle in [
        ({"max_tokens": 10**12}, "context length"),
        ({"max_completion_tokens": 10**12}, "context length"),
        ({"n": 10**6}, "n"),
        ({"seed": 2**64}, "seed"),
        ({"logprobs": True, "top_logprobs": 10**12}, "logprobs"),
        ({"messages": [{"role": "user", "content": "word " * 300}]}, "maximum context length"),
        ({"tools": [{"type": "function"}], "tool_choice": "auto"}, "tool"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_json": {"type": "nope"}}, "invalid JSON schema"),
    ]:
        body = {"messages": USER, **extra}
        assert_openai_error(http.post("/v1/chat/completions", json=body), 400, needle)


def test_invalid_sampling_values_name_their_field(http: httpx.Client) -> None:
    """SamplingParams checks the values once; the 400 names the field as ``param``."""
    for extra, param in [
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"seed": 2**64}, "seed"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ]:
        body = {"prompt": "Hi", "max_tokens": 2, **extra}
        error = assert_openai_error(http.post("/v1/completions", json=body), 400, param)
        assert error["param"] == param, error
    chat = {"messages": USER, "max_tokens": 0}
    error = assert_openai_error(http.post("/v1/chat/completions", json=chat), 400, "max_tokens")
    assert error["param"] == "max_tokens"


def test_prompt_too_long_names_the_limit(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=str(MAX_MODEL_LEN)) as info:
        client.completions.create(model=MODEL, prompt=list(range(6, 6 + MAX_MODEL_LEN)))
    assert info.value.body["type"] == "BadRequestError"
    # truncate_prompt_tokens keeps the prompt's end, which then fits
    out = client.completions.create(
        model=MODEL,
        prompt=list(range(6, 6 + MAX_MODEL_LEN)),
        max_tokens=3,
        extra_body={"truncate_prompt_tokens": 20},
    )
    assert out.usage.prompt_tokens == 20


def test_oversized_body_is_413(http: httpx.Client) -> None:
    big = b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}'
    response = http.post(
        "/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 413)

    def chunked():  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(33):
            yield b"a" * 2**20
        yield b'"}'

    response = http.post(
        "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 413)
    assert http.get("/health").status_code == 200


def test_bad_requests_do_not_disturb_a_good_stream(server: RemoteServer) -> None:
    """Malformed, wrongly typed and absurd requests (and an oversized body), fired while a
    good streaming request runs: each gets its error and the good one completes."""
    good_body = dict(
        model=MODEL,
        prompt="A good request",
        max_tokens=240,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    started = threading.Event()
    result: dict[str, Any] = {}

    def good() -> None:
        try:
            with server.client() as c:
                stream = c.completions.create(
                    stream=True, stream_options={"include_usage": True}, **good_body
                )
                text = ""
                for chunk in stream:
                    started.set()
                    text += "".join(choice.text for choice in chunk.choices)
                    result["last"] = chunk
                result["text"] = text
        finally:
            started.set()

    thread = threading.Thread(target=good)
    thread.start()
    assert started.wait(30)
    still_running = None
    with server.http() as h:
        for body, status, needle in BAD_COMPLETIONS:
            response = h.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
            assert_openai_error(response, status, needle)
            if still_running is None:  # (the tiny model's 240 tokens take a fraction of a second)
                still_running = server.metric("pagedllm:num_requests_running") == 1
        big = b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}'
        response = h.post(
            "/v1/completions", content=big, headers={"content-type": "application/json"}
        )
        assert_openai_error(response, 413)
    thread.join(60)
    assert not thread.is_alive()
    assert still_running, "the good request ended before a bad one was answered"
    assert result["last"].usage.completion_tokens == 240
    with server.client() as c:
        alone = c.completions.create(**good_body)
    assert result["text"] == alone.choices[0].text


# --------------------------------------------------------------------- logging


def test_access_but_no_request_contents_are_logged_by_default(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    """Request contents are user data: without --enable-log-requests no prompt (or message)
    reaches the log; the access line does."""
    prompt = "Do not log me: " + "x" * 50
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    chat = [{"role": "user", "content": "Nor this message"}]
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1)
    deadline = time.monotonic() + 5
    while "POST /v1/chat/completions" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.log_text()
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log
    assert "Uvicorn running on" in log
    assert "Do not log me" not in log and "Nor this message" not in log
    assert "received request" not in log


def test_reset_prefix_cache_forgets_cached_prompts(client: openai.OpenAI, http: httpx.Client):
    prompt = "Reset probe: " + " ".join(f"r{i}" for i in range(30))
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    response = http.post("/reset_prefix_cache")
    assert response.status_code == 200 and response.json() == {"success": True}
    after = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert after.usage.prompt_tokens_details.cached_tokens == 0
    for name in ("reset_running_requests", "reset_external"):
        refused = http.post(f"/reset_prefix_cache?{name}=true")
        assert_openai_error(refused, 400, name)
