"""Reasoning parsers (deepseek_r1, qwen3, granite): recorded model-style outputs split into
reasoning and content, the same when streamed in any chunking; a template that pre-fills
the opening marker; output that never closes it; a guided constraint that applies only
after the reasoning, and a marker of several tokens written whole or not at all; and
``reasoning`` / ``reasoning_content`` through the server."""

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


# A prompt's end as the template leaves it (Qwen3's "<think>\n\n</think>\n\n" with
# thinking off): (opened, closed) for each parser's markers.
def _prompt_ends(cls) -> dict[str, tuple[bool, bool]]:
    return {
        "<|im_start|>assistant\n": (False, False),
        f"<|im_start|>assistant\n{cls.start_markers[0]}\n": (True, False),
        f"<|im_start|>assistant\n{cls.start_markers[0]}\n\n{cls.end_markers[0]}\n\n": (
            False,
            True,
        ),
    }


@pytest.mark.parametrize(
    "cls", [DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GraniteReasoningParser]
)
def test_empty_output_ends_the_reasoning_iff_the_prompt_closed_it(cls):
    """The contract of is_reasoning_end([]): True exactly when the prompt closed the
    reasoning, so guided decoding constrains the answer's first token."""
    for prompt, (opened, closed) in _prompt_ends(cls).items():
        parser = cls.for_prompt(CharTokenizer(), prompt)
        assert (parser.starts_in_reasoning, parser.starts_after_reasoning) == (opened, closed)
        assert parser.is_reasoning_end([]) is closed, prompt
        if closed:
            # The output is all answer, even one that looks like reasoning.
            text = f"{cls.start_markers[0]}x{cls.end_markers[0]}y"
            assert parser.is_reasoning_end([ord(c) for c in text])
            assert parser.extract_reasoning_content(text, None) == (None, text)
    assert not cls(CharTokenizer()).is_reasoning_end([])


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


# Qwen3's chat template, reduced to what decides the prompt's end: with thinking off
# it writes an empty, closed reasoning section after the generation prompt.
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_first_token_is_the_answer_or_opens_the_reasoning(tmp_path_factory):
    """qwen3 + guided decoding, the prompt neither opening nor closing the reasoning:
    the first token either opens it (``<think>``, one token) or begins the constrained
    answer; it is never free (it once escaped, and the answer began after it)."""
    import transformers
    from tiny_models import make_checkpoint

    directory = make_checkpoint(tmp_path_factory.mktemp("think"), "llama", vocab_size=520)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    tokenizer.save_pretrained(directory)
    think = tokenizer.convert_tokens_to_ids("<think>")
    llm = LLM(str(directory), reasoning_parser="qwen3", dtype="float32", disable_log_stats=True)
    prompt = llm.render_chat([{"role": "user", "content": "Pick."}], chat_template=QWEN3_TEMPLATE)
    assert prompt["prompt"].endswith("assistant\n")
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = free[0].outputs[0].token_ids[0]
    assert first != think and not "green".startswith(free[0].outputs[0].text)
    for backend in ("outlines", "xgrammar"):
        params = SamplingParams(
            temperature=0,
            max_tokens=10,
            guided_decoding=GuidedDecodingParams(choice=["green", "red"], backend=backend),
        )
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids[0] == think or out.text in ("green", "red"), (backend, out.text)
        # Either way the reasoning parser reads the output as the engine constrained it.
        if out.token_ids[0] != think:
            assert out.text in ("green", "red")


def test_a_marker_of_several_tokens_opens_the_reasoning_whole_or_not_at_all(tmp_path_factory):
    """qwen3 + guided decoding with a tokenizer that splits ``<think>`` into several tokens
    (as SmolLM2's does): the output either writes the whole marker and reasons, or begins
    the constrained answer at its first token. (The first token once escaped the
    constraint: '<<green', 'tgreen'.)"""
    llm = LLM(
        str(tiny_llama(tmp_path_factory)),
        reasoning_parser="qwen3",
        dtype="float32",
        disable_log_stats=True,
    )
    tokenizer = llm.get_tokenizer()
    marker = tokenizer.encode("<think>", add_special_tokens=False)
    assert len(marker) > 2
    prompt = llm.render_chat([{"role": "user", "content": "Pick."}], chat_template=QWEN3_TEMPLATE)
    assert prompt["prompt"].endswith("assistant\n")

    def generate(**kwargs):
        params = SamplingParams(max_tokens=12, guided_decoding=guided, **kwargs)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs

    for backend in ("outlines", "xgrammar"):
        guided = GuidedDecodingParams(choice=["green", "red"], backend=backend)
        # Pushed to the marker's first token, the model writes the marker whole.
        [out] = generate(temperature=0, logit_bias={marker[0]: 50.0})
        assert out.token_ids[: len(marker)] == marker, (backend, out.text)
        # Pushed to a later token of the marker, or to any other: the answer is the choice.
        for token in (marker[1], tokenizer.encode("x", add_special_tokens=False)[0]):
            [out] = generate(temperature=0, logit_bias={token: 50.0})
            assert out.text in ("green", "red"), (backend, token, out.text)
        for out in generate(temperature=1.0, n=8, seed=0):
            opened = out.token_ids[: len(marker)] == marker
            assert opened or out.text in ("green", "red"), (backend, out.text)


def test_thinking_off_constrains_the_first_answer_token(tmp_path_factory):
    """qwen3 + guided decoding with thinking off: the answer starts with the output, so
    its first token is constrained too (it once escaped: '\ufffdgreen')."""
    llm = LLM(
        str(tiny_llama(tmp_path_factory)),
        reasoning_parser="qwen3",
        dtype="float32",
        disable_log_stats=True,
    )
    messages = [{"role": "user", "content": "Pick a color."}]
    prompt = llm.render_chat(
        messages, chat_template=QWEN3_TEMPLATE, chat_template_kwargs={"enable_thinking": False}
    )
    assert prompt["prompt"].endswith("<think>\n\n</think>\n\n")
    # Unconstrained, this random model does not begin with a choice.
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert not free[0].outputs[0].text.startswith(("green", "red"))
    for backend in ("outlines", "xgrammar"):
        params = SamplingParams(
            temperature=0,
            max_tokens=10,
            guided_decoding=GuidedDecodingParams(choice=["green", "red"], backend=backend),
        )
        out = llm.chat(
            messages,
            params,
            use_tqdm=False,
            chat_template=QWEN3_TEMPLATE,
            chat_template_kwargs={"enable_thinking": False},
        )
        assert out[0].outputs[0].text in ("green", "red"), (backend, out[0].outputs[0].text)


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
    """The reasoning under vLLM's newer name ``reasoning`` and its older one
    ``reasoning_content``, the same text, in the reply and in each streamed delta."""
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
        thought = message.model_extra["reasoning"]
        assert thought and message.model_extra["reasoning_content"] == thought
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, **request):
            for choice in chunk.choices:
                extra = choice.delta.model_extra or {}
                assert extra.get("reasoning") == extra.get("reasoning_content"), extra
                reasoning += extra.get("reasoning") or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == (thought, "")


def test_a_parser_written_for_the_single_token_hook_keeps_working():
    """A third-party parser from before ``opening_token_sequences`` defines
    ``opening_token_ids``: its tokens still open the reasoning (as one-token markers)."""
    from pagedllm.core.interfaces import ReasoningParser

    class OldParser(ReasoningParser):
        def is_reasoning_end(self, token_ids):
            return 9 in token_ids

        def opening_token_ids(self):
            return frozenset({5, 3})

        def extract_reasoning_content(self, model_output, request):
            return None, model_output

        def extract_reasoning_content_streaming(self, *args):
            return None

    assert OldParser(None).opening_token_sequences() == ((3,), (5,))

    class Plain(OldParser):
        opening_token_ids = None

    assert Plain(None).opening_token_sequences() is None
