"""A tiny Gemma 3 with images served by a real ``pagedllm serve``, asked through the
official openai client with a data-URL image: greedy float32 tokens equal to
transformers' ``generate`` on the same rendered prompt (its processor expanding the
image, its image tokens attending to each other both ways); a second turn about the same
image hits the prefix cache over the image's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

pytest.importorskip("PIL")

from image_fixtures import data_url, png_of
from openai_server import RemoteServer, start_servers
from tiny_gemma3_vision import NUM_IMAGE_TOKENS, Gemma3Reference, make_gemma3_vision
from tiny_llava import make_image

MODEL = "gemma3"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gemma3_vision(tmp_path_factory.mktemp("gemma3_vision"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Gemma3Reference:
    return Gemma3Reference(checkpoint)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path):
    remote = RemoteServer(
        checkpoint,
        "--served-model-name",
        MODEL,
        "--enable-prefix-caching",
        "--block-size",
        "8",
        log_path=tmp_path_factory.mktemp("gemma3_log") / "server.log",
    )
    start_servers(remote)
    yield remote
    remote.stop()


def ask(client: openai.OpenAI, messages: list[dict[str, Any]]) -> tuple[list[int], Any]:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        logprobs=True,
        extra_body={"min_tokens": NEW_TOKENS, "return_tokens_as_token_ids": True},
    )
    tokens = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    return [int(t.token.removeprefix("token_id:")) for t in tokens], reply


def as_template_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers' processor template takes them."""
    return [
        {
            "role": m["role"],
            "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in messages
    ]


def test_chat_with_a_data_url_image_matches_transformers(server, reference):
    image = make_image(0)
    url = data_url(png_of(image))
    first = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]
    tokens, reply = ask(server.client(), first)
    prompt = reference.render(as_template_parts(first))
    assert tokens == reference.greedy(prompt, [image], NEW_TOKENS)
    assert reply.usage.prompt_tokens == len(reference.input_ids(prompt, [image]))
    # A second turn about the same image: its tokens come from the prefix cache.
    hits = server.metric("pagedllm:prefix_cache_hits_total")
    second = [
        *first,
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "And the colours?"},
    ]
    tokens, _ = ask(server.client(), second)
    assert server.metric("pagedllm:prefix_cache_hits_total") - hits >= NUM_IMAGE_TOKENS
    prompt = reference.render(as_template_parts(second))
    assert tokens == reference.greedy(prompt, [image], NEW_TOKENS)
