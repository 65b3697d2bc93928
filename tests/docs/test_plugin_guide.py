"""The plugin author's guide (``docs/plugins.md``) and the dummy plugin it is written from.

The guide's code is the dummy plugin's code (checked region by region), and every one of
the nine extension kinds is exercised here the way a user reaches it: the installed
entry point, selected by its engine argument or CLI flag.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from conftest import DUMMY_PLUGIN, env_with_site, pip_install_target, run_cli
from openai_server import BASE_ARGS, RemoteServer, start_servers, tiny_llama
from repo_paths import ROOT
from tiny_models import load_reference, reference_greedy
from tokenizer_fixtures import TOKENIZER_VOCAB_SIZE, make_tokenizer

from pagedllm import LLM, GuidedDecodingParams, SamplingParams
from pagedllm.core.errors import ConfigError
from pagedllm.core.hookspecs import REGISTRATION_HOOKS

GUIDE = ROOT / "docs" / "plugins.md"
README = ROOT / "README.md"
PLUGIN_SOURCES = DUMMY_PLUGIN / "pagedllm_dummy_plugin"
KINDS = {
    # guide section -> (registry kind, name the dummy plugin registers)
    "Device and attention backend": ("devices", "dummydev"),
    "Load format": ("load_formats", "dummyfmt"),
    "Quantization method": ("quantization_methods", "dummyq"),
    "Model architecture": ("models", "DummyNeoXForCausalLM"),
    "Tool parser": ("tool_parsers", "dummy_tool"),
    "Reasoning parser": ("reasoning_parsers", "dummy_reasoning"),
    "Guided-decoding backend": ("guided_backends", "dummy_choice"),
    "CLI subcommand": ("cli_subcommands", "dummy-hello"),
    "Executor": ("executors", "dummy_exec"),
    "Step extension": ("step_extensions", "dummy_cap"),
}
_REGION = re.compile(r"^[ \t]*# \[docs:(\w+)\]\n(.*?)^[ \t]*# \[/docs:\1\]\n", re.M | re.S)
_SNIPPET = re.compile(r"<!-- snippet: (\w+) -->\n```python\n(.*?)```\n", re.S)


def plugin_regions() -> dict[str, str]:
    regions: dict[str, str] = {}
    for source in sorted(PLUGIN_SOURCES.glob("*.py")):
        for name, body in _REGION.findall(source.read_text()):
            assert name not in regions, f"region {name!r} is marked twice"
            regions[name] = body
    return regions


# ------------------------------------------------------------------ the guide itself


def test_guide_snippets_are_the_dummy_plugins_code():
    guide = GUIDE.read_text()
    snippets = _SNIPPET.findall(guide)
    regions = plugin_regions()
    shown = [name for name, _ in snippets]
    assert sorted(shown) == sorted(regions), "every marked region is shown exactly once"
    for name, code in snippets:
        assert code == regions[name], f"docs/plugins.md snippet {name!r} drifted from the plugin"


def test_guide_covers_every_extension_kind_and_hook():
    guide = GUIDE.read_text()
    headings = re.findall(r"^## (?:\d+\. )?(.+)$", guide, re.M)
    for section in KINDS:
        assert section in headings, section
    for kind, hook in REGISTRATION_HOOKS.items():
        if kind in {registry for registry, _ in KINDS.values()} | {"attention_backends"}:
            assert f"`{hook}`" in guide, hook
    assert "docs/plugins.md" in README.read_text()


def test_every_kind_comes_from_the_installed_entry_point(pm):
    assert pm.info("dummy").distribution == "pagedllm-dummy-plugin"
    for kind, name in [*KINDS.values(), ("attention_backends", "dummy_attn")]:
        entry = pm.registry(kind).entry(name)
        assert entry.source == "dummy", kind
        assert isinstance(entry.target, str), kind  # lazy until used
        pm.load(kind, name)  # importable and a subclass of the kind's ABC


# ------------------------------------------------------------------ models


def make_neox(directory: Path, seed: int = 0, architecture: str = "DummyNeoXForCausalLM") -> Path:
    """A tiny random GPT-NeoX checkpoint, written by ``transformers``, whose config names
    ``architecture``: the dummy plugin's by default (pagedllm's own is
    ``GPTNeoXForCausalLM``, what transformers writes)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    config = transformers.GPTNeoXConfig(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.GPTNeoXForCausalLM(config)
    with torch.no_grad():  # widen the logits so that greedy choices are clear-cut
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(3.0)
    model.save_pretrained(directory, safe_serialization=True)
    config_file = directory / "config.json"
    saved = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**saved, "architectures": [architecture]}, indent=2))
    return directory


@pytest.fixture(scope="module")
def neox(tmp_path_factory) -> Path:
    return make_neox(tmp_path_factory.mktemp("neox"))


PROMPTS = ["The quick brown fox", "Hello, world! How are", "def add(a, b):"]


def greedy(llm: LLM, prompt_ids: list[int], max_tokens: int = 12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=3)
    return llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs[0]


def test_model_architecture_from_a_plugin_matches_transformers(neox):
    reference = load_reference(neox)
    tokenizer = make_tokenizer(neox)
    llm = LLM(str(neox), dtype="float32", disable_log_stats=True)
    assert llm.llm_engine.loaded.architecture == "DummyNeoXForCausalLM"
    assert type(llm.llm_engine.loaded.model).__module__ == "pagedllm_dummy_plugin.model"
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        expected, top = reference_greedy(reference, ids, 12, num_logprobs=3)
        out = greedy(llm, ids)
        assert list(out.token_ids) == expected, prompt
        for step, logprobs in zip(top, out.logprobs, strict=True):
            for token, value in step.items():
                assert logprobs[token].logprob == pytest.approx(value, abs=1e-4)


def test_a_plugin_architecture_beside_the_built_in_one(neox, tmp_path, pm):
    """The same weights under transformers' architecture name run pagedllm's own
    GPT-NeoX, the plugin's staying registered under its name; both match transformers."""
    builtin = make_neox(tmp_path / "builtin", architecture="GPTNeoXForCausalLM")
    llm = LLM(str(builtin), dtype="float32", disable_log_stats=True)
    assert llm.llm_engine.loaded.architecture == "GPTNeoXForCausalLM"
    assert type(llm.llm_engine.loaded.model).__module__ == "pagedllm.plugins.models.gpt_neox"
    registry = pm.registry("models")
    assert registry.entry("GPTNeoXForCausalLM").source != "dummy"
    assert registry.entry("DummyNeoXForCausalLM").source == "dummy"
    ids = make_tokenizer(builtin)(PROMPTS[1]).input_ids
    ours = greedy(LLM(str(neox), dtype="float32", disable_log_stats=True), ids)
    assert greedy(llm, ids).token_ids == ours.token_ids
    assert ours.token_ids == reference_greedy(load_reference(builtin), ids, 12)[0]


def test_device_and_attention_backend_from_a_plugin(neox):
    from pagedllm_dummy_plugin.attention import CountingBackend

    tokenizer = make_tokenizer(neox)
    reference = load_reference(neox)
    CountingBackend.calls = 0
    llm = LLM(str(neox), device="dummydev", dtype="float32", disable_log_stats=True)
    config = llm.llm_engine.config
    assert config.device_config.name == "dummydev"
    assert config.cache_config.block_size == 32  # the device's default_block_size
    assert type(llm.llm_engine.runner.attention_backend) is CountingBackend
    # Several requests in one batch, one of them long enough to span blocks.
    prompts = [tokenizer(p).input_ids for p in [*PROMPTS, " ".join(PROMPTS * 4)]]
    params = SamplingParams(temperature=0, max_tokens=10)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == reference_greedy(reference, ids, 10)[0]
    assert CountingBackend.calls >= 2 * 10  # two layers, at least ten steps


def test_load_format_from_a_plugin(neox, tmp_path):
    from safetensors.torch import load_file

    directory = tmp_path / "json_checkpoint"
    directory.mkdir()
    for file in neox.iterdir():
        if file.suffix != ".safetensors":
            (directory / file.name).write_bytes(file.read_bytes())
    weights = load_file(neox / "model.safetensors")
    (directory / "weights.json").write_text(json.dumps({k: v.tolist() for k, v in weights.items()}))
    ids = make_tokenizer(neox)(PROMPTS[0]).input_ids
    expected = greedy(LLM(str(neox), dtype="float32", disable_log_stats=True), ids)
    llm = LLM(str(directory), load_format="dummyfmt", dtype="float32", disable_log_stats=True)
    assert greedy(llm, ids).token_ids == expected.token_ids
    with pytest.raises((ConfigError, ValueError), match="dummyfmt does not understand.*speed"):
        LLM(str(directory), load_format="dummyfmt", model_loader_extra_config={"speed": 1})
    with pytest.raises((ConfigError, FileNotFoundError), match="weights.json"):
        LLM(str(neox), load_format="dummyfmt", dtype="float32")


@pytest.mark.parametrize("model", ["neox", "llama"])
def test_quantization_method_from_a_plugin(model, neox, tmp_path_factory):
    path = neox if model == "neox" else tiny_llama(tmp_path_factory)
    ids = make_tokenizer(path)(PROMPTS[0]).input_ids
    plain = greedy(LLM(str(path), dtype="float32", disable_log_stats=True), ids)
    llm = LLM(str(path), quantization="dummyq", dtype="float32", disable_log_stats=True)
    linears = [m for m in llm.llm_engine.loaded.model.modules() if hasattr(m, "qweight")]
    assert linears, "no layer was quantized"
    for layer in linears:
        # process_weights_after_loading replaced the float weight with int8 rows.
        assert layer.qweight.dtype == torch.int8 and "weight" not in dict(layer.named_parameters())
    out = greedy(llm, ids)
    assert out.token_ids == plain.token_ids
    chosen = [
        (quant[token].logprob, reference[token].logprob)
        for token, quant, reference in zip(out.token_ids, out.logprobs, plain.logprobs, strict=True)
    ]
    assert any(q != r for q, r in chosen)  # the int8 weights really were used
    for quant, reference in chosen:
        assert quant == pytest.approx(reference, abs=0.05)


# ------------------------------------------------------------------ guided decoding


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory)


CHOICES = ["yes", "no", "maybe so"]


def test_guided_backend_from_a_plugin_and_fallback(tiny):
    strict = LLM(
        str(tiny),
        guided_decoding_backend="dummy_choice",
        guided_decoding_disable_fallback=True,
        dtype="float32",
        disable_log_stats=True,
    )
    for prompt in ("Answer:", "x", "The capital of France is"):
        params = SamplingParams(
            temperature=0, max_tokens=10, guided_decoding=GuidedDecodingParams(choice=CHOICES)
        )
        out = strict.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.text in CHOICES and out.finish_reason == "stop", out.text
    # n > 1 sampled sequences: each has its own matcher.
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=1,
        max_tokens=10,
        guided_decoding=GuidedDecodingParams(choice=CHOICES),
    )
    for completion in strict.generate("x", params, use_tqdm=False)[0].outputs:
        assert completion.text in CHOICES
    regex = SamplingParams(
        temperature=0, max_tokens=10, guided_decoding=GuidedDecodingParams(regex="[0-9]{3}")
    )
    with pytest.raises(ValueError, match="dummy_choice compiles choice constraints only"):
        strict.llm_engine.check_params(regex)
    # Without --guided-decoding-disable-fallback the regex goes to the next backend.
    falling_back = LLM(
        str(tiny), guided_decoding_backend="dummy_choice", dtype="float32", disable_log_stats=True
    )
    out = falling_back.generate("x", regex, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{3}", out.text), out.text


def test_reasoning_parser_holds_the_constraint_until_the_answer(tiny):
    llm = LLM(
        str(tiny),
        reasoning_parser="dummy_reasoning",
        guided_decoding_backend="dummy_choice",
        dtype="float32",
        disable_log_stats=True,
    )
    guided = SamplingParams(
        temperature=0, max_tokens=6, guided_decoding=GuidedDecodingParams(choice=CHOICES)
    )
    free = SamplingParams(temperature=0, max_tokens=6)
    # The prompt opens [THINK] and the tiny model never closes it: all reasoning, so
    # the constraint never starts and the output is the model's own greedy choice.
    thinking = "Question: yes or no? [THINK]"
    out = llm.generate(thinking, guided, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == llm.generate(thinking, free, use_tqdm=False)[0].outputs[0].token_ids
    assert "[/THINK]" not in out.text
    # Without [THINK] the answer starts at once, constrained.
    out = llm.generate("Question: yes or no?", guided, use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES


# ------------------------------------------------------------------ through the server


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    remote = RemoteServer(
        str(tiny),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "dummy_tool",
        "--reasoning-parser",
        "dummy_reasoning",
        "--guided-decoding-backend",
        "dummy_choice",
        log_path=tmp_path_factory.mktemp("guide_server") / "server.log",
    )
    start_servers(remote)
    yield remote
    remote.stop()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _stream(client, request) -> tuple[str, str, list[dict]]:
    reasoning = content = ""
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return reasoning, content, [calls[i] for i in sorted(calls)]


def test_tool_parser_from_a_plugin_through_the_server(server):
    # The tiny model writes the call syntax because a regex says so; the regex falls back
    # from dummy_choice (choices only) to the next backend.
    regex = r'Checking\.\nCALL get_weather \{"city": "Paris"\}\nCALL get_weather \{"city": "Oslo"\}'
    with server.client() as client:
        model = client.models.list().data[0].id
        request = dict(
            model=model,
            messages=[{"role": "user", "content": "Weather in Paris and Oslo?"}],
            tools=TOOLS,
            max_tokens=200,
            temperature=0,
            extra_body={"guided_regex": regex},
        )
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content == "Checking."
        calls = [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ]
        assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
        reasoning, content, streamed = _stream(client, request)
        assert (reasoning, content) == ("", "Checking.")
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls


def test_reasoning_parser_from_a_plugin_through_the_server(server, tiny):
    with server.client() as client:
        model = client.models.list().data[0].id
        # The assistant turn is continued after [THINK]: the output is reasoning.
        messages = [
            {"role": "user", "content": "Think."},
            {"role": "assistant", "content": "[THINK]"},
        ]
        request = dict(
            model=model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"add_generation_prompt": False, "continue_final_message": True},
        )
        reply = client.chat.completions.create(**request)
        thought = reply.choices[0].message.model_extra["reasoning_content"]
        assert thought and reply.choices[0].message.content is None
        # The same prompt, completed without chat parsing: the same text, unsplit.
        prompt = make_tokenizer(tiny).apply_chat_template(
            messages, tokenize=False, continue_final_message=True
        )
        raw = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert thought == raw.choices[0].text
        assert _stream(client, request)[:2] == (thought, "")
        # A prompt that does not open [THINK]: all answer, and a choice constraint (the
        # plugin's backend) applies from the first token.
        answer = (
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Yes or no?"}],
                max_tokens=12,
                temperature=0,
                extra_body={"guided_choice": CHOICES},
            )
            .choices[0]
            .message
        )
        assert answer.content in CHOICES and not answer.model_extra.get("reasoning_content")


# ------------------------------------------------------------------ parsers, unit level


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize(
    "text",
    [
        "plain answer",
        "a\nCALL f {}\nb\n",
        'CALL f {"x": [1, 2]}\nCALL g\n',
        "\n\nCALL bad {not json\nend",
        "x\nCALL f {}",
    ],
)
def test_tool_parser_streaming_equals_the_complete_result(pm, text):
    parser_cls = pm.load("tool_parsers", "dummy_tool")
    complete = parser_cls(None).extract_tool_calls(text, None)
    for step in (1, 3, 7):
        parser, content, calls, sent = parser_cls(None), "", [], ""
        for end in range(step, len(text) + step, step):
            current = text[:end]
            delta = parser.extract_tool_calls_streaming(
                sent, current, current[len(sent) :], [], [], [], None
            )
            sent = current
            for message in (delta, parser.flush_streaming(text) if end >= len(text) else None):
                if message is not None:
                    content += message.content or ""
                    calls += [(c.name, c.arguments) for c in message.tool_calls]
        assert (content or None) == complete.content, step
        assert calls == [(c.name, c.arguments) for c in complete.tool_calls], step


@pytest.mark.parametrize("text", ["", "abc", "ab[/THI", "ab[/THINK]cd", "[/THINK]", "a[/THINK]"])
@pytest.mark.parametrize("opened", [True, False])
def test_reasoning_parser_streaming_equals_the_complete_result(pm, text, opened):
    parser_cls = pm.load("reasoning_parsers", "dummy_reasoning")
    prompt = "user: hi\nassistant: [THINK]" if opened else "user: hi\nassistant:"
    complete = parser_cls.for_prompt(_Tokenizer(), prompt).extract_reasoning_content(text, None)
    parser = parser_cls.for_prompt(_Tokenizer(), prompt)
    reasoning = content = ""
    for end in range(1, len(text) + 1):
        delta = parser.extract_reasoning_content_streaming(
            text[: end - 1], text[:end], text[end - 1 : end], [], [], []
        )
        for message in (delta, parser.flush_streaming(text) if end == len(text) else None):
            if message is not None:
                reasoning += message.reasoning_content or ""
                content += message.content or ""
    assert (reasoning or None, content or None) == complete
    ids = [ord(c) for c in text]
    assert parser.is_reasoning_end(ids) == (not opened or "[/THINK]" in text)


# ------------------------------------------------------------------ CLI subcommand


def test_cli_subcommand_from_a_plugin():
    result = run_cli("dummy-hello", "--who", "plugin author")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hello, plugin author\n"
    listing = run_cli("--help")
    assert "dummy-hello" in listing.stdout


# ------------------------------------------------------------------ executor


@pytest.fixture(scope="module")
def dummy_site(tmp_path_factory) -> Path:
    """The dummy plugin as this tree has it, installed into a site of its own (the
    environment's copy may predate its executor; CI reinstalls it from the tree)."""
    return pip_install_target(tmp_path_factory.mktemp("dummy-site"), DUMMY_PLUGIN)


def _run_batch(model: Path, tmp_path: Path, site: Path, backend: str):
    """``pagedllm run-batch --distributed-executor-backend BACKEND`` of one completion
    with the dummy plugin installed: the process and the completion's text (None when
    it failed)."""
    source = tmp_path / "in.jsonl"
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body}
    source.write_text(json.dumps(line) + "\n")
    output = tmp_path / "out.jsonl"
    output.unlink(missing_ok=True)
    result = run_cli(
        "run-batch", "-i", str(source), "-o", str(output), "--model", str(model), *BASE_ARGS,
        "--distributed-executor-backend", backend, env=env_with_site(site), timeout=300,
    )  # fmt: skip
    text = None
    if result.returncode == 0:
        text = json.loads(output.read_text())["response"]["body"]["choices"][0]["text"]
    return result, text


_STEPS = re.compile(r"dummy executor: step (\d+), 1 requests")


def test_executor_plugin_runs_the_steps(tiny, tmp_path, dummy_site):
    guide = GUIDE.read_text()
    assert "## 9. Executor" in guide and "`pagedllm_register_executors`" in guide
    help_text = run_cli("serve", "--help", env=env_with_site(dummy_site)).stdout
    assert re.search(r"--distributed-executor-backend \{[^}]*dummy_exec", help_text)
    plain, expected = _run_batch(tiny, tmp_path, dummy_site, "uni")
    assert plain.returncode == 0, plain.stderr
    assert not _STEPS.search(plain.stderr)
    result, text = _run_batch(tiny, tmp_path, dummy_site, "dummy_exec")
    assert result.returncode == 0, result.stderr
    # The plugin's executor ran every step (a prompt, then a decode per further token)
    # and computed what the built-in one does.
    assert [int(n) for n in _STEPS.findall(result.stderr)] == [1, 2, 3, 4], result.stderr
    assert text == expected


def test_executor_by_class_path(tiny, tmp_path, dummy_site):
    for path in (
        "pagedllm_dummy_plugin.executor.CountingExecutor",
        "pagedllm_dummy_plugin.executor:CountingExecutor",
    ):
        result, text = _run_batch(tiny, tmp_path, dummy_site, path)
        assert result.returncode == 0, result.stderr
        assert text and _STEPS.search(result.stderr), result.stderr
    result, _ = _run_batch(tiny, tmp_path, dummy_site, "json.JSONDecoder")
    assert result.returncode != 0
    assert "json.JSONDecoder" in result.stderr and "not a subclass of" in result.stderr
    result, _ = _run_batch(tiny, tmp_path, dummy_site, "pagedllm_dummy_plugin.executor.Nope")
    assert result.returncode != 0 and "cannot import the executor class" in result.stderr


# ------------------------------------------------------------------ multimodal processor

_GENERATE_WITH_IMAGES = """
import json, sys
from PIL import Image
from pagedllm import LLM, SamplingParams

path, prompt_ids = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(path, dtype="float32", disable_log_stats=True, num_gpu_blocks_override=64)
images = [Image.new("RGB", (7, 5), (10, 200, 30)), Image.new("RGB", (4, 4), (99, 3, 250))]
params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
prompts = [{"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": i}} for i in images]
outs = llm.generate(prompts + prompts[:1], params, use_tqdm=False)
(runner,) = [e for e in llm.llm_engine.runner.extensions if e.name == "multimodal"]
print(json.dumps({
    "architecture": llm.llm_engine.loaded.architecture,
    "prompts": [o.prompt_token_ids for o in outs],
    "tokens": [o.outputs[0].token_ids for o in outs],
    "encoded": runner.num_encoded,
}))
"""


def test_a_pip_installed_plugins_multimodal_processor_is_used(tmp_path, dummy_site):
    """The dummy plugin, pip-installed, registers ``DummyVisionNeoXForCausalLM`` (a model
    and its multimodal processor): the engine expands each image's placeholder to two
    rows the model takes from its encoder (the embeddings of two tokens the image's
    colours pick), so its greedy tokens equal transformers' GPT-NeoX with those tokens
    in the placeholder's place."""
    import subprocess
    import sys

    model = make_neox(tmp_path / "vision", architecture="DummyVisionNeoXForCausalLM")
    image_token = 5
    config_file = model / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "image_token_id": image_token}))
    prompt = [10, 11, image_token, 12, 13]
    result = subprocess.run(
        [sys.executable, "-c", _GENERATE_WITH_IMAGES, str(model), json.dumps(prompt)],
        capture_output=True,
        text=True,
        env=env_with_site(dummy_site),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["architecture"] == "DummyVisionNeoXForCausalLM"
    assert out["prompts"][0] == [10, 11, image_token, image_token, 12, 13]
    assert out["encoded"] == 2  # (the repeated image came from the encoder cache)
    reference = transformers.GPTNeoXForCausalLM.from_pretrained(model, dtype=torch.float32)
    colours = [(7 * 5 * 10, 7 * 5 * 200), (16 * 99, 16 * 3)]
    expected = []
    for red, green in colours:
        ids = torch.tensor(
            [[10, 11, red % TOKENIZER_VOCAB_SIZE, green % TOKENIZER_VOCAB_SIZE, 12, 13]]
        )
        with torch.no_grad():
            generated = reference.generate(
                ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
            )
        expected.append(generated[0, ids.shape[1] :].tolist())
    assert out["tokens"] == [expected[0], expected[1], expected[0]]
    assert expected[0] != expected[1]
