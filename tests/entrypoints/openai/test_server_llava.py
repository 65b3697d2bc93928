"""A tiny LLaVA-1.5 served by a real ``pagedllm serve``, asked through the official openai
client with image parts (a data URL, a file under ``--allowed-local-media-path``): greedy
float32 tokens equal to transformers' ``generate`` on the same rendered prompt; a second
turn about the same image hits the prefix cache over the image's tokens (``/metrics``);
the id the server sends for an image is the hash the engine computes of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

pytest.importorskip("PIL")

from image_fixtures import data_url, png_of
from openai_server import RemoteServer, start_servers
from tiny_llava import NUM_IMAGE_TOKENS, make_image

from pagedllm.core.interfaces.multimodal import content_hash
from pagedllm.entrypoints.media import MediaConnector

MODEL = "llava"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "stripes.png").write_bytes(png_of(make_image(1)))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, llava_checkpoint: Path, media_dir: Path):
    remote = RemoteServer(
        llava_checkpoint,
        "--served-model-name",
        MODEL,
        "--allowed-local-media-path",
        str(media_dir),
        "--enable-prefix-caching",
        "--block-size",
        "8",
        log_path=tmp_path_factory.mktemp("llava_log") / "server.log",
    )
    start_servers(remote)
    yield remote
    remote.stop()


def ask(
    client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any
) -> tuple[list[int], Any]:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        logprobs=True,
        extra_body={"min_tokens": NEW_TOKENS, "return_tokens_as_token_ids": True, **extra},
    )
    tokens = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    return [int(t.token.removeprefix("token_id:")) for t in tokens], reply


def as_template_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers' processor template takes them."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [p if p["type"] == "text" else {"type": "image"} for p in content]
        out.append({"role": message["role"], "content": content})
    return out


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("source", ["data", "file"])
def test_chat_with_an_image_matches_transformers(server, llava_reference, media_dir, source):
    if source == "data":
        image, url = make_image(0), data_url(png_of(make_image(0)))
    else:
        image, url = make_image(1), (media_dir / "stripes.png").as_uri()
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(url)]}
    ]
    tokens, reply = ask(server.client(), messages)
    prompt = llava_reference.render(as_template_parts(messages))
    assert tokens == llava_reference.greedy(prompt, [image], NEW_TOKENS)
    assert reply.usage.prompt_tokens == len(
        llava_reference.processor(text=prompt, images=[image])["input_ids"][0]
    )


def test_a_second_turn_about_the_same_image_hits_the_prefix_cache(server, llava_reference):
    client = server.client()
    image = make_image(2)
    first = [
        {
            "role": "user",
            "content": [image_part(data_url(png_of(image))), {"type": "text", "text": "Describe."}],
        }
    ]
    tokens, reply = ask(client, first)
    hits = server.metric("pagedllm:prefix_cache_hits_total")
    second = [
        *first,
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "And the colours?"},
    ]
    tokens, reply = ask(client, second)
    # The image's placeholder tokens (from the prompt's start) come from the cache.
    cached = server.metric("pagedllm:prefix_cache_hits_total") - hits
    assert cached >= NUM_IMAGE_TOKENS
    prompt = llava_reference.render(as_template_parts(second))
    assert tokens == llava_reference.greedy(prompt, [image], NEW_TOKENS)


def test_a_requests_mm_processor_kwargs_reach_the_image_processor(server, llava_reference):
    client = server.client()
    image = make_image(3)
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What?"}, image_part(data_url(png_of(image)))],
        }
    ]
    prompt = llava_reference.render(as_template_parts(messages))
    raw, _ = ask(client, messages, mm_processor_kwargs={"do_normalize": False})
    assert raw == llava_reference.greedy(prompt, [image], NEW_TOKENS, do_normalize=False)
    assert raw != llava_reference.greedy(prompt, [image], NEW_TOKENS)
    with pytest.raises(openai.BadRequestError, match="mm_processor_kwargs"):
        ask(client, messages, mm_processor_kwargs={"no_such_option": 1})


def test_the_servers_image_id_is_the_engines_hash(llava_checkpoint):
    # The server sends each image's hash as multi_modal_uuids; the engine keys its
    # encoder cache and prefix-cache blocks by the hash it computes of an image itself.
    from pagedllm.plugins.models.llava_processor import LlavaProcessor

    image = make_image(3)
    loaded = MediaConnector().load_image(data_url(png_of(image)))
    assert loaded.hash == content_hash(image)
    import transformers

    config = transformers.AutoConfig.from_pretrained(llava_checkpoint)
    tokenizer = transformers.AutoTokenizer.from_pretrained(llava_checkpoint)
    processor = LlavaProcessor.from_model(str(llava_checkpoint), config, tokenizer)
    token_ids = [5, config.image_token_index, 6]
    (item,) = processor.process(token_ids, {"image": [image]}, {}).items
    assert item.content_hash == loaded.hash
