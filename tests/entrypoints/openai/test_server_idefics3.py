"""A tiny SmolVLM served by a real ``pagedllm serve``, asked through the official openai
client with a data-URL image: its chat template puts the image token where transformers'
``apply_chat_template`` does, and the greedy float32 tokens equal transformers' ``generate``
on the same rendered prompt (the image split into 2x2 crops and the global image)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("PIL")

from image_fixtures import data_url, png_of
from openai_server import RemoteServer, start_servers
from test_server_llava import as_template_parts, image_part
from tiny_idefics3 import Idefics3Reference, make_idefics3
from tiny_llava import make_image

MODEL = "smolvlm"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_idefics3(tmp_path_factory.mktemp("smolvlm"), "smolvlm")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path):
    remote = RemoteServer(
        checkpoint,
        "--served-model-name",
        MODEL,
        "--block-size",
        "8",
        log_path=tmp_path_factory.mktemp("smolvlm_log") / "server.log",
    )
    start_servers(remote)
    yield remote
    remote.stop()


def test_chat_with_a_data_url_image_matches_transformers(server, checkpoint):
    reference = Idefics3Reference(checkpoint, "smolvlm")
    image = make_image(0)
    messages = [
        {
            "role": "user",
            "content": [
                image_part(data_url(png_of(image))),
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]
    reply = server.client().chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        logprobs=True,
        extra_body={"min_tokens": NEW_TOKENS, "return_tokens_as_token_ids": True},
    )
    tokens = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
    prompt = reference.render(as_template_parts(messages))
    assert prompt.startswith("<|im_start|>User:<image>What is this?")
    expected = reference.inputs(prompt, [image])["input_ids"][0]
    assert reply.usage.prompt_tokens == len(expected)
    assert tokens == reference.greedy(prompt, [image], NEW_TOKENS)
