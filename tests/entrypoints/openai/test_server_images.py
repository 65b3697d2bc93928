"""Image parts of chat requests through a real ``pagedllm serve``: each hostile input gets
an OpenAI-style 400 naming the part (``messages[0].content[1].image_url``), and the
server keeps serving.

The tiny model takes no images, so a valid image gets the 400 "does not accept image
inputs", but only after it was loaded and checked: that answer shows the part passed.
The server runs with ``--allowed-local-media-path``, ``--limit-mm-per-prompt image=2``, a
1 s fetch timeout and a 50 KiB size limit; http images come from a loopback server.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import clean_env
from image_fixtures import SLOW_SECONDS, bomb_png, data_url, image_server, png_bytes
from openai_server import RemoteServer, assert_openai_error, start_servers, tiny_llama

MODEL = "tiny"
NOT_ACCEPTED = f"model '{MODEL}' does not accept image inputs"
PART = "messages[0].content[1].image_url"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("images")
    root = base / "allowed"
    root.mkdir()
    (root / "cat.png").write_bytes(png_bytes())
    (base / "secret.png").write_bytes(png_bytes(color=(1, 2, 3)))
    (root / "escape.png").symlink_to(base / "secret.png")
    return root


@pytest.fixture(scope="module")
def base_url():
    with image_server() as url:
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, media_dir: Path):
    remote = RemoteServer(
        tiny_llama(tmp_path_factory),
        "--served-model-name",
        MODEL,
        "--allowed-local-media-path",
        str(media_dir),
        "--limit-mm-per-prompt",
        "image=2",
        log_path=tmp_path_factory.mktemp("images_log") / "server.log",
        env=clean_env(PAGEDLLM_IMAGE_FETCH_TIMEOUT="1", PAGEDLLM_MAX_IMAGE_MB="0.05"),
    )
    start_servers(remote)
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def http(server: RemoteServer):
    with server.http() as client:
        yield client


def chat(http: httpx.Client, *parts: dict[str, Any]) -> httpx.Response:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2},
    )


def image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def refused(response: httpx.Response, contains: str, param: str = PART) -> dict:
    error = assert_openai_error(response, 400, contains)
    assert error["param"] == param, error
    return error


def test_valid_images_pass_every_check(http, media_dir, base_url):
    for url in (
        data_url(png_bytes()),
        f"file://{media_dir / 'cat.png'}",
        f"{base_url}/image.png",
    ):
        refused(chat(http, image(url)), NOT_ACCEPTED)
    refused(chat(http, image(data_url(png_bytes()), detail="auto")), NOT_ACCEPTED)


def test_bytes_that_are_not_an_image(http, base_url):
    refused(chat(http, image(data_url(b"\x89PNG\r\n\x1a\n but no more"))), f"{PART}: the data")
    refused(chat(http, image(f"{base_url}/text")), "is not an image")
    refused(chat(http, image("ftp://host/a.png")), "scheme 'ftp' is not supported")


def test_a_decompression_bomb(http):
    started = time.monotonic()
    refused(chat(http, image(data_url(bomb_png()))), "more pixels")
    refused(chat(http, image(data_url(bomb_png(10_000, 9_000)))), "(10000x9000)")
    assert time.monotonic() - started < 30


def test_more_images_than_the_limit(http, base_url):
    # (counted before any is fetched: three slow URLs are refused at once)
    started = time.monotonic()
    slow = image(f"{base_url}/slow")
    refused(chat(http, slow, slow, slow), "at most 2 per prompt", param="messages")
    assert time.monotonic() - started < SLOW_SECONDS
    refused(chat(http, image(data_url(png_bytes())), image(data_url(png_bytes()))), NOT_ACCEPTED)


def test_urls_past_the_time_and_size_limits(http, base_url):
    for route in ("slow", "drip"):
        refused(chat(http, image(f"{base_url}/{route}")), "took longer than 1 s")
    for route in ("large", "large-chunked"):
        refused(chat(http, image(f"{base_url}/{route}")), "larger than 0.05 MiB")
    big = data_url(png_bytes() + b"\0" * 60_000)
    refused(chat(http, image(big)), "larger than 0.05 MiB")


def test_files_outside_the_allowed_folder(http, media_dir):
    for path in (
        media_dir.parent / "secret.png",
        f"{media_dir}/../secret.png",
        media_dir / "escape.png",  # (a symbolic link inside, to a file outside)
    ):
        refused(chat(http, image(f"file://{path}")), "outside --allowed-local-media-path")


def test_malformed_image_parts(http):
    refused(chat(http, {"type": "image_url", "image_url": "data:x"}), 'must be an object {"url"')
    refused(chat(http, image("data:x", size=3)), "unknown keys ['size']")
    refused(chat(http, image("data:x", detail="high")), "detail 'high'", param=f"{PART}.detail")
    later = [
        {"role": "user", "content": "Hello"},
        {"role": "user", "content": [image(data_url(b"not an image"))]},
    ]
    body = {"model": MODEL, "messages": later, "max_tokens": 2}
    refused(
        http.post("/v1/chat/completions", json=body),
        "not an image",
        "messages[1].content[0].image_url",
    )


def test_tokenize_checks_images_too(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [image("data:x")]}]}
    refused(
        http.post("/tokenize", json=body),
        "data:image/<type>;base64",
        "messages[0].content[0].image_url",
    )


def test_the_openai_client_gets_the_error_and_the_server_keeps_serving(server, http):
    client = server.client()
    messages: Any = [{"role": "user", "content": [image(data_url(bomb_png()))]}]
    with pytest.raises(openai.BadRequestError, match="more pixels") as excinfo:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert excinfo.value.body["param"] == "messages[0].content[0].image_url"
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=3
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert http.get("/health").status_code == 200


# ------------------------------------------- without a server: what a model that takes
# images will get (the prompt's images and hashes, and its parts for the template)


def test_parts_become_images_for_the_engine_prompt():
    from PIL import Image

    from pagedllm.entrypoints.media import MediaConnector
    from pagedllm.entrypoints.openai.chat_images import image_parts, load_images
    from pagedllm.entrypoints.openai.chat_utils import normalise_messages
    from pagedllm.entrypoints.openai.errors import OpenAIError
    from pagedllm.entrypoints.openai.prompts import PreparedPrompt

    pil = Image.new("RGB", (3, 2), (9, 9, 9))
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                image(data_url(png_bytes())),
                {"type": "image_pil", "image_pil": pil},
            ],
        },
    ]
    parts = image_parts(messages)
    assert [p.param for p in parts] == [
        "messages[1].content[1].image_url",
        "messages[1].content[2].image_pil",
    ]
    media = MediaConnector()
    loaded = asyncio.run(load_images(parts, media, keep=True))
    assert [item.image.size for item in loaded] == [(5, 4), (3, 2)]
    assert asyncio.run(load_images(parts, media, keep=False)) == []
    prompt = PreparedPrompt("text", [1, 2], loaded).engine_prompt()
    assert prompt["multi_modal_data"] == {"image": [item.image for item in loaded]}
    assert prompt["multi_modal_uuids"] == {"image": [item.hash for item in loaded]}
    assert set(PreparedPrompt("text", [1, 2]).engine_prompt()) == {"prompt", "prompt_token_ids"}
    # (a chat template that loops over parts gets {"type": "image"}, as HF processors' do)
    rendered = normalise_messages(messages, "openai")[1]["content"]
    assert rendered == [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]
    with pytest.raises(ValueError, match=r"messages\[1\].content\[1\]: an image part needs"):
        normalise_messages(messages, "string")
    # (a data URL is not text a template prints: it does not count against the prompt size)
    from pagedllm.entrypoints.openai.prompts import _text_size

    large = [{"role": "user", "content": [image("data:image/png;base64," + "A" * 10_000)]}]
    assert _text_size(large) < 100
    bad = [{"role": "user", "content": [{"type": "image_pil", "image_pil": "not PIL"}]}]
    with pytest.raises(OpenAIError, match="image_pil: expected a PIL image, got str"):
        asyncio.run(load_images(image_parts(bad), media, keep=False))
