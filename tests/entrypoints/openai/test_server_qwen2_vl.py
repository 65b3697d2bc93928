"""A tiny Qwen2-VL served by a real ``pagedllm serve`` (dynamic resolution, M-RoPE), asked
through the official openai client with image parts of two sizes (a data URL, a file under
``--allowed-local-media-path``): greedy float32 tokens equal to transformers' ``generate``
on the same prompt."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

pytest.importorskip("PIL")

from image_fixtures import data_url, png_of
from openai_server import RemoteServer, start_servers
from tiny_llava import make_image
from tiny_qwen2_vl import IMAGE, Qwen2VLReference, make_qwen2_vl

MODEL = "qwen2-vl"
NEW_TOKENS = 8
# Qwen2-VL's chat format, an image part written as its vision tokens (the tiny checkpoint
# has no template of its own).
TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'text' %}{{ p.text }}{% else %}" + IMAGE + "{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "wide.png").write_bytes(png_of(make_image(1, width=56, height=24)))
    (root / "template.jinja").write_text(TEMPLATE)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path, media_dir: Path):
    remote = RemoteServer(
        checkpoint,
        "--served-model-name",
        MODEL,
        "--allowed-local-media-path",
        str(media_dir),
        "--chat-template",
        str(media_dir / "template.jinja"),
        log_path=tmp_path_factory.mktemp("qwen2_vl_log") / "server.log",
    )
    start_servers(remote)
    yield remote
    remote.stop()


@pytest.mark.parametrize("source", ["data", "file"])
def test_chat_with_an_image_matches_transformers(server, checkpoint, media_dir, source):
    if source == "data":
        image = make_image(0, width=40, height=36)
        url = data_url(png_of(image))
    else:
        image, url = make_image(1, width=56, height=24), (media_dir / "wide.png").as_uri()
    reply = server.client().chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        logprobs=True,
        extra_body={"min_tokens": NEW_TOKENS, "return_tokens_as_token_ids": True},
    )
    tokens = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
    prompt = f"<|im_start|>user\nWhat is this?{IMAGE}<|im_end|>\n<|im_start|>assistant\n"
    reference = Qwen2VLReference(checkpoint)
    assert reply.usage.prompt_tokens == reference.inputs(prompt, [image])["input_ids"].shape[1]
    assert tokens == reference.greedy(prompt, [image], NEW_TOKENS)


def test_a_text_only_request_still_works(server):
    reply = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="image"):
        server.client().chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                    ],
                }
            ],
            max_tokens=4,
        )
