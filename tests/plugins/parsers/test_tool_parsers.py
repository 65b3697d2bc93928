"""Every tool parser on recorded model-style outputs: complete, and streamed split at
every point (and character by character), including parallel calls, nested arguments,
prose around calls and malformed calls (content, never an exception)."""

# DeepSeek's markers use full-width bars on purpose.
# ruff: noqa: RUF001

from __future__ import annotations

import json

import pytest

from pagedllm.core.plugins import make_plugin_manager
from pagedllm.plugins.parsers import TOOL_PARSERS

W = {"city": "Paris", "unit": "c"}
N = {"filter": {"tags": ["a", "b"], "range": [1, 2.5]}, "note": 'quote " and }'}
DS_CALL = (
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
)


def ds(calls):
    body = "".join(DS_CALL.format(name=n, args=json.dumps(a)) for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def js(name, args, key="arguments"):
    return json.dumps({"name": name, key: args})


# parser -> [(model output, expected calls [(name, args)], expected content)]
CASES = {
    "hermes": [
        (
            f"Let me check.\n<tool_call>\n{js('get_weather', W)}\n</tool_call>",
            [("get_weather", W)],
            "Let me check.\n",
        ),
        (
            f"<tool_call>{js('a', W)}</tool_call>\n<tool_call>{js('b', N)}</tool_call>",
            [("a", W), ("b", N)],
            None,
        ),
        ("Plain answer with <b>markup</b>.", [], "Plain answer with <b>markup</b>."),
        (
            '<tool_call>{"name": "x", "arguments": {"y": </tool_call>',
            [],
            '<tool_call>{"name": "x", "arguments": {"y": </tool_call>',
        ),
    ],
    "mistral": [
        (
            f"[TOOL_CALLS][{js('get_weather', W)}, {js('n', N)}]",
            [("get_weather", W), ("n", N)],
            None,
        ),
        (
            f"Sure. [TOOL_CALLS]get_weather[ARGS]{json.dumps(W)}[TOOL_CALLS]n[ARGS]{json.dumps(N)}",
            [("get_weather", W), ("n", N)],
            "Sure. ",
        ),
        ("[TOOL_CALLS][{broken", [], "[TOOL_CALLS][{broken"),
    ],
    "llama3_json": [
        (js("get_weather", W, "parameters"), [("get_weather", W)], None),
        (
            f"<|python_tag|>{js('a', W, 'parameters')}; {js('b', N, 'parameters')}",
            [("a", W), ("b", N)],
            None,
        ),
        ("The weather is nice.", [], "The weather is nice."),
        ('{"name": "a", "parameters": {', [], '{"name": "a", "parameters": {'),
    ],
    "llama4_json": [
        (f"<|python_start|>{js('a', W, 'parameters')}<|python_end|>", [("a", W)], None),
    ],
    "pythonic": [
        (
            '[get_weather(city="Paris", unit="c"), '
            'n(filter={"tags": ["a", "b"], "range": [1, 2.5]}, note=\'quote " and }\')]',
            [("get_weather", W), ("n", N)],
            None,
        ),
        ("No calls, just [brackets] in prose.", [], "No calls, just [brackets] in prose."),
        ("[get_weather(city=Paris)]", [], "[get_weather(city=Paris)]"),
    ],
    "llama4_pythonic": [
        (
            '<|python_start|>[get_weather(city="Paris", unit="c")]<|python_end|>',
            [("get_weather", W)],
            None,
        ),
    ],
    "granite": [
        (
            f"<|tool_call|>[{js('get_weather', W)}, {js('n', N)}]",
            [("get_weather", W), ("n", N)],
            None,
        ),
        (f"<tool_call>[{js('a', W)}]", [("a", W)], None),
    ],
    "granite-20b-fc": [
        (
            f"<function_call> {js('get_weather', W)} <function_call> {js('n', N)}",
            [("get_weather", W), ("n", N)],
            None,
        ),
        ("<function_call> not json", [], "<function_call> not json"),
    ],
    "internlm": [
        (
            "Checking.<|action_start|><|plugin|>\n"
            f"{js('get_weather', W, 'parameters')}<|action_end|>",
            [("get_weather", W)],
            "Checking.",
        ),
    ],
    "jamba": [
        (
            f"<tool_calls>[{js('get_weather', W)}, {js('n', N)}]</tool_calls>",
            [("get_weather", W), ("n", N)],
            None,
        ),
    ],
    "deepseek_v3": [
        (
            "Let me look." + ds([("get_weather", W), ("n", N)]),
            [("get_weather", W), ("n", N)],
            "Let me look.",
        ),
        (
            "<｜tool▁calls▁begin｜>garbage<｜tool▁calls▁end｜>",
            [],
            "<｜tool▁calls▁begin｜>garbage<｜tool▁calls▁end｜>",
        ),
    ],
    "phi4_mini_json": [
        (f"functools[{js('get_weather', W)}, {js('n', N)}]", [("get_weather", W), ("n", N)], None),
    ],
}


def test_every_seed_parser_is_registered():
    pm = make_plugin_manager()
    assert set(CASES) == set(TOOL_PARSERS) <= set(pm.choices("tool_parsers"))


def _parser(name):
    return make_plugin_manager().load("tool_parsers", name)(None)


def _cases():
    for name, cases in CASES.items():
        for i, case in enumerate(cases):
            yield pytest.param(name, *case, id=f"{name}-{i}")


@pytest.mark.parametrize(("name", "text", "calls", "content"), list(_cases()))
def test_complete(name, text, calls, content):
    result = _parser(name).extract_tool_calls(text, None)
    got = [(c.name, json.loads(c.arguments)) for c in result.tool_calls]
    assert got == calls
    assert result.tools_called == bool(calls)
    assert result.content == content
    ids = [c.id for c in result.tool_calls]
    assert len(set(ids)) == len(ids)
    if name == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i in ids)


def _stream(name, chunks, final_text):
    parser = _parser(name)
    content, calls, so_far = "", {}, ""
    deltas = []
    for chunk in chunks:
        previous, so_far = so_far, so_far + chunk
        deltas.append(
            parser.extract_tool_calls_streaming(previous, so_far, chunk, [], [], [], None)
        )
    deltas.append(parser.flush_streaming(final_text))
    for delta in deltas:
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or call.id
            entry["name"] += call.name or ""
            entry["arguments"] += call.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(("name", "text", "calls", "content"), list(_cases()))
def test_streamed_in_every_chunking(name, text, calls, content):
    complete = _parser(name).extract_tool_calls(text, None)
    expected_content = complete.content or ""
    chunkings = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for chunks in chunkings:
        got_content, got_calls = _stream(name, chunks, text)
        assert got_content == expected_content, chunks
        assert [(c["name"], c["arguments"]) for c in got_calls] == [
            (c.name, c.arguments) for c in complete.tool_calls
        ], chunks
        assert all(c["id"] for c in got_calls)
