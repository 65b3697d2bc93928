"""A tiny LLaVA-1.5 served by a real ``pagedllm serve``: ``/tokenize`` of a chat with image
parts counts the tokens the engine prefills (each image's placeholder expanded, as
transformers' ``LlavaProcessor`` and the chat's ``usage`` count them), and checks the
images as chat does; a streamed image request the client leaves frees its KV blocks, and
the server goes on answering."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("PIL")

from image_fixtures import data_url, png_of
from openai_server import RemoteServer, assert_openai_error, start_servers
from tiny_llava import NUM_IMAGE_TOKENS, make_image

MODEL = "llava"
# Tokens a request would generate if not stopped (its prompt leaves room for them).
LONG = 180


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, llava_checkpoint: Path):
    remote = RemoteServer(
        llava_checkpoint,
        "--served-model-name",
        MODEL,
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--block-size",
        "8",
        log_path=tmp_path_factory.mktemp("llava_log") / "server.log",
    )
    start_servers(remote)
    yield remote
    remote.stop()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]


def tokenize(server: RemoteServer, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    with server.http() as http:
        return http.post("/tokenize", json={"model": MODEL, "messages": messages, **extra})


def test_tokenize_counts_each_images_expanded_tokens(server, llava_reference):
    images = [make_image(0), make_image(4, width=50, height=20)]
    messages = chat(*(image_part(data_url(png_of(image))) for image in images))
    response = tokenize(server, messages)
    assert response.status_code == 200, response.text
    body = response.json()
    template_messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}] + [
            {"type": "image"} for _ in images
        ]}
    ]  # fmt: skip
    prompt = llava_reference.render(template_messages)
    expected = llava_reference.processor(text=prompt, images=images)["input_ids"][0]
    assert body["tokens"] == expected
    assert body["count"] == len(expected)
    image_token = llava_reference.processor.tokenizer.convert_tokens_to_ids("<image>")
    assert body["tokens"].count(image_token) == 2 * NUM_IMAGE_TOKENS
    # The count is what the engine prefills: the chat's usage.
    reply = server.client().chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
        temperature=0.0,
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == body["count"]


def test_tokenize_checks_images_as_chat_does(server):
    response = tokenize(server, chat(image_part(data_url(b"not an image"))))
    assert_openai_error(response, 400, "messages[0].content[1].image_url")
    good = image_part(data_url(png_of(make_image(1))))
    response = tokenize(server, chat(good, good, good))
    assert_openai_error(response, 400, "--limit-mm-per-prompt")
    response = tokenize(server, chat(good), mm_processor_kwargs={"no_such_option": 1})
    assert_openai_error(response, 400, "mm_processor_kwargs")
    # (and the server goes on serving)
    assert tokenize(server, chat(good)).status_code == 200


def test_a_cancelled_image_stream_frees_its_blocks_and_the_server_goes_on(server, llava_reference):
    client = server.client()
    generated = server.metric("pagedllm:generation_tokens_total")
    image = make_image(5)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=chat(image_part(data_url(png_of(image)))),  # type: ignore[arg-type]
        max_tokens=LONG,
        temperature=0.0,
        stream=True,
        extra_body={"min_tokens": LONG},
    )
    for _ in stream:  # (the first chunk: the request runs)
        break
    stream.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (
            server.metric("pagedllm:kv_cache_usage_perc") == 0
            and server.metric("pagedllm:num_requests_running") == 0
        ):
            break
        time.sleep(0.2)
    assert server.metric("pagedllm:kv_cache_usage_perc") == 0
    assert server.metric("pagedllm:num_requests_running") == 0
    # It was stopped, not run to its end.
    assert server.metric("pagedllm:generation_tokens_total") - generated < LONG
    # The next image request is answered as transformers answers it.
    other = make_image(6)
    messages = chat(image_part(data_url(png_of(other))))
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0.0,
        logprobs=True,
        extra_body={"min_tokens": 8, "return_tokens_as_token_ids": True},
    )
    tokens = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
    template = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}]}
    ]
    assert tokens == llava_reference.greedy(llava_reference.render(template), [other], 8)


def test_the_output_budget_counts_the_images_expanded_tokens(server):
    """An image's placeholder is one token of the rendered chat but NUM_IMAGE_TOKENS of the
    prompt: max_tokens that fit the rendered chat but not the expanded prompt are refused
    as a text prompt's are, and no max_tokens leaves what the expanded prompt leaves."""
    messages = chat(image_part(data_url(png_of(make_image(2)))))
    count = tokenize(server, messages).json()["count"]
    max_model_len = 256  # (tiny_llava's max_position_embeddings)
    with server.http() as http:
        too_many = max_model_len - count + 1
        response = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": too_many},
        )
        assert_openai_error(response, 400, "maximum context length is 256 tokens")
        assert response.json()["error"]["param"] == "max_tokens"
        reply = http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": messages,
                "ignore_eos": True,
                "temperature": 0.0,
            },
        ).json()
    assert reply["usage"]["prompt_tokens"] == count
    assert reply["usage"]["completion_tokens"] == max_model_len - count
    assert reply["choices"][0]["finish_reason"] == "length"
