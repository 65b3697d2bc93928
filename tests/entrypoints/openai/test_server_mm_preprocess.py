"""Image preprocessing runs off the engine thread and off the event loop: while a request's
images are held in the multimodal processor (a plugin's LLaVA processor that waits at a
gate, two named pipes the test holds), a text request on the same ``pagedllm serve``
completes; the held request then gets transformers' greedy tokens. With
``--data-parallel-size 2`` an image request gets the same tokens as well.

No timing assumption: the test knows the processor is inside ``process`` because the
processor opened the first pipe, and lets it go by opening the second."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("PIL")

from conftest import clean_env, make_distribution
from image_fixtures import data_url, png_of
from openai_server import RemoteServer, start_servers
from tiny_llava import LlavaReference, make_image

MODEL = "llava"
NEW_TOKENS = 8
# How long a step of the test may wait (the held request, the text request).
WAIT_S = 120.0

GATED_PROCESSOR = '''
import os
import threading

from pagedllm import hookimpl
from pagedllm.plugins.models.llava_processor import LlavaProcessor


class GatedLlavaProcessor(LlavaProcessor):
    """LLaVA's processor, which for a prompt with images first writes its thread's name to
    the pipe $GATE_DIR/entered, then waits until the pipe $GATE_DIR/release is opened."""

    def process(self, token_ids, data, hashes, options=None):
        if data.get("image"):
            gate = os.environ["GATE_DIR"]
            with open(os.path.join(gate, "entered"), "w") as pipe:
                pipe.write(threading.current_thread().name)
            with open(os.path.join(gate, "release")) as pipe:
                pipe.read()
        return super().process(token_ids, data, hashes, options)


@hookimpl
def pagedllm_register_multimodal_processors(registry):
    registry.add(
        "LlavaForConditionalGeneration",
        "pagedllm_gated_llava:GatedLlavaProcessor",
        override=True,
    )
'''


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gate")
    os.mkfifo(root / "entered")
    os.mkfifo(root / "release")
    return root


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, llava_checkpoint: Path, gate: Path):
    work = tmp_path_factory.mktemp("mm_preprocess")
    site = make_distribution(
        work / "site",
        "pagedllm-gated-llava",
        {"gated_llava": "pagedllm_gated_llava"},
        {"pagedllm_gated_llava": GATED_PROCESSOR},
    )
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    gated = RemoteServer(
        llava_checkpoint,
        "--served-model-name",
        MODEL,
        log_path=work / "gated.log",
        env=clean_env(PYTHONPATH=pythonpath, GATE_DIR=str(gate)),
    )
    parallel = RemoteServer(
        llava_checkpoint,
        "--served-model-name",
        MODEL,
        "--data-parallel-size",
        "2",
        log_path=work / "dp.log",
    )
    start_servers(gated, parallel)
    yield gated, parallel
    gated.stop()
    parallel.stop()


def within(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` on a thread, failing the test if it takes more than ``WAIT_S``."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert result, f"{what} did not happen within {WAIT_S} s"
    return result[0]


def chat(server: RemoteServer, content: Any) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW_TOKENS,
        "min_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "logprobs": True,
        "return_tokens_as_token_ids": True,
    }
    with server.http(timeout=WAIT_S) as http:
        return http.post("/v1/chat/completions", json=body)


def token_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    return [int(t["token"].removeprefix("token_id:")) for t in content]


def image_content(image: Any) -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": data_url(png_of(image))}},
    ]


def expected_tokens(llava_reference: LlavaReference, image: Any) -> list[int]:
    prompt = llava_reference.render(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}],
            }
        ]
    )
    return llava_reference.greedy(prompt, [image], NEW_TOKENS)


def test_a_text_request_completes_while_an_image_is_preprocessed(servers, gate, llava_reference):
    gated, _ = servers
    image = make_image(0)
    held: list[httpx.Response] = []
    holder = threading.Thread(
        target=lambda: held.append(chat(gated, image_content(image))), daemon=True
    )
    holder.start()
    released = False
    try:
        thread_name = within(lambda: (gate / "entered").read_text(), "the image's preprocessing")
        # The processor is inside process() now, and stays there until released.
        text = within(lambda: chat(gated, "Say something."), "the text request")
        assert text.status_code == 200, text.text
        assert text.json()["usage"]["completion_tokens"] == NEW_TOKENS
        assert holder.is_alive() and not held  # (still held: it did not go round the gate)
        assert thread_name.startswith("pagedllm-prepare"), thread_name
        within(lambda: (gate / "release").write_text("go"), "the release")
        released = True
        holder.join(WAIT_S)
        assert held, "the image request did not finish once released"
        assert token_ids(held[0]) == expected_tokens(llava_reference, image)
    finally:
        if not released:  # (let the server go on: its processor waits for this)
            threading.Thread(
                target=lambda: (gate / "release").write_text("go"), daemon=True
            ).start()


def test_data_parallel_replicas_preprocess_images_too(servers, llava_reference):
    _, parallel = servers
    image = make_image(1)
    expected = expected_tokens(llava_reference, image)
    # (two requests: the replicas take turns, so each one serves one)
    for _ in range(2):
        assert token_ids(chat(parallel, image_content(image))) == expected
