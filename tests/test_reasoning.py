"""Reasoning parsers (deepseek_r1, qwen3, granite): recorded model-style outputs split into
reasoning and content, the same when streamed in any chunking; a template that pre-fills
the opening marker; output that never closes it; a guided constraint that applies only
after the reasoning; and ``reasoning_content`` through the server."""

from __future__ import annotations

import re
import types

import pytest
from openai_server import RemoteServer, start_servers, tiny_llama

from pagedllm import LLM, GuidedDecodingParams, SamplingParams
from pagedllm.core.hookspecs import hookimpl
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.plugins.parsers.reasoning.markers import (
    DeepSeekR1ReasoningParser,
    GraniteReasoningParser,
    MarkerReasoningParser,
    Qwen3ReasoningParser,
)


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


# (parser, template opened the reasoning, model output, expected (reasoning, content))
CASES = [
    (
        Qwen3ReasoningParser,
        False,
        "<think>\nLet me add.\n</think>\n\n2 + 2 = 4.",
        ("\nLet me add.\n", "\n\n2 + 2 = 4."),
    ),
    (Qwen3ReasoningParser, False, "No thinking today: 4.", (None, "No thinking today: 4.")),
    (Qwen3ReasoningParser, False, "<think>It never closes", ("It never closes", None)),
    (Qwen3ReasoningParser, True, "pre-filled</think>The answer.", ("pre-filled", "The answer.")),
    (
        Qwen3ReasoningParser,
        True,
        "pre-filled and never closed",
        ("pre-filled and never closed", None),
    ),
    (
        Qwen3ReasoningParser,
        False,
        "<b>bold</b> is not a marker",
        (None, "<b>bold</b> is not a marker"),
    ),
    (
        DeepSeekR1ReasoningParser,
        False,
        "Hmm, 2 and 2.</think>It is 4.",
        ("Hmm, 2 and 2.", "It is 4."),
    ),
    (DeepSeekR1ReasoningParser, False, "<think>x</think>y", ("x", "y")),
    (
        DeepSeekR1ReasoningParser,
        False,
        "all reasoning, no marker",
        ("all reasoning, no marker", None),
    ),
    (
        DeepSeekR1ReasoningParser,
        False,
        "ends on a partial </thi",
        ("ends on a partial </thi", None),
    ),
    (
        GraniteReasoningParser,
        False,
        "Here is my thought process: add them. Here is my response: 4",
        (" add them. ", " 4"),
    ),
    (
        GraniteReasoningParser,
        False,
        "Here's my thought process: hm. Here's my response: ok",
        (" hm. ", " ok"),
    ),
    (GraniteReasoningParser, False, "Just 4.", (None, "Just 4.")),
]


def _parser(cls, opened: bool) -> MarkerReasoningParser:
    parser = cls(CharTokenizer())
    parser.starts_in_reasoning = opened
    return parser


@pytest.mark.parametrize(("cls", "opened", "text", "expected"), CASES)
def test_complete_output(cls, opened, text, expected):
    assert _parser(cls, opened).extract_reasoning_content(text, None) == expected


@pytest.mark.parametrize(("cls", "opened", "text", "expected"), CASES)
def test_streamed_in_every_two_chunk_split_and_char_by_char(cls, opened, text, expected):
    chunkings = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    chunkings.append(list(text))
    for chunks in chunkings:
        parser = _parser(cls, opened)
        reasoning = content = ""
        so_far = ""
        for chunk in chunks:
            previous, so_far = so_far, so_far + chunk
            delta = parser.extract_reasoning_content_streaming(previous, so_far, chunk, [], [], [])
            if delta is not None:
                reasoning += delta.reasoning_content or ""
                content += delta.content or ""
        delta = parser.flush_streaming(text)
        if delta is not None:
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
        assert (reasoning or None, content or None) == expected, chunks


def test_prompt_opening_and_reasoning_end():
    parser = Qwen3ReasoningParser(CharTokenizer())
    assert parser.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not parser.prompt_opens_reasoning("<|im_start|>assistant\n")
    ids = [ord(c) for c in "<think>a</think>b"]
    assert not parser.is_reasoning_end(ids[:10])
    assert parser.is_reasoning_end(ids[:16])
    # Thinking off: the answer starts as soon as the output is clearly not a marker.
    assert not parser.is_reasoning_end([ord("<")])
    assert parser.is_reasoning_end([ord("A")])
    r1 = DeepSeekR1ReasoningParser(CharTokenizer())
    assert not r1.is_reasoning_end([ord("A")])


# ------------------------------------------------------------------ with the engine


class FirstTokensReasoning(MarkerReasoningParser):
    """A stand-in model convention: the first three output tokens are reasoning."""

    def is_reasoning_end(self, token_ids):
        return len(token_ids) >= 3


def test_constraint_applies_after_the_reasoning(tmp_path_factory):
    @hookimpl
    def pagedllm_register_reasoning_parsers(registry):
        registry.add("first3", FirstTokensReasoning)

    pm = make_plugin_manager(
        extra_plugins=[
            (
                "first3",
                types.SimpleNamespace(
                    pagedllm_register_reasoning_parsers=pagedllm_register_reasoning_parsers
                ),
            )
        ]
    )
    llm = LLM(
        str(tiny_llama(tmp_path_factory)),
        plugin_manager=pm,
        reasoning_parser="first3",
        dtype="float32",
        disable_log_stats=True,
    )
    tokenizer = llm.get_tokenizer()
    for backend in ("outlines", "xgrammar"):
        params = SamplingParams(
            temperature=0,
            max_tokens=20,
            guided_decoding=GuidedDecodingParams(regex="[0-9]{4}", backend=backend),
        )
        out = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
        answer = tokenizer.decode(out.token_ids[3:], skip_special_tokens=True)
        assert re.fullmatch("[0-9]{4}", answer), out.text
        # The free part is the model's own (greedy) choice, not digits.
        free = llm.generate("x", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert out.token_ids[:3] == free[0].outputs[0].token_ids


# ------------------------------------------------------------------ through the server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The tiny model never writes </think>: with deepseek_r1 all of it is reasoning.
    remote = RemoteServer(
        str(tiny_llama(tmp_path_factory)),
        "--reasoning-parser",
        "deepseek_r1",
        log_path=tmp_path_factory.mktemp("reasoning") / "server.log",
    )
    start_servers(remote)
    yield remote
    remote.stop()


def test_server_reasoning_content(server):
    with server.client() as client:
        model = client.models.list().data[0].id
        request = dict(
            model=model,
            messages=[{"role": "user", "content": "Think."}],
            max_tokens=12,
            temperature=0,
        )
        reply = client.chat.completions.create(**request)
        message = reply.choices[0].message
        assert message.content is None
        thought = message.model_extra["reasoning_content"]
        assert thought
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, **request):
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == (thought, "")
