"""Engine arguments: every documented flag, its default and choices, and validation."""

from __future__ import annotations

import ast
import json
import logging

import pytest
from seed_reference import seed_flags

from pagedllm.core.config import UsageContext
from pagedllm.core.default_model import DEFAULT_MODEL
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.cli.main import build_parser


@pytest.fixture
def cli(pm):
    parser, _ = build_parser(pm)
    return parser


def parse(cli, *argv):
    return cli.parse_args(list(argv))


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").lower()


# Defaults the reference leaves blank or states in another form; each says why.
DEFAULT_EXCEPTIONS = {
    # The reference prints the expanded compilation config; its level is what we keep.
    "--compilation-config": lambda seed, ours: json.loads(seed)["level"] == ours == 0,
    # The reference gives no default; uvicorn's own is "info".
    "--uvicorn-log-level": lambda seed, ours: ours == "info",
    # The reference names vLLM's class; ours is pagedllm's scheduler.
    "--scheduler-cls": lambda seed, ours: ours == "pagedllm.core.scheduler.Scheduler",
    # The default model is the embedded SmolLM2 GGUF (issue 5), not a hub download.
    "--model": lambda seed, ours: seed == "facebook/opt-125m" and ours == DEFAULT_MODEL,
    # One value given as a list.
    "--CUDA-graph-sizes": lambda seed, ours: ours == [int(seed)],
}


def _matches(seed: str, ours: object) -> bool:
    text = seed.strip().rstrip(")")
    if text in ("None", "Unlimited"):
        return ours is None
    if text == "":
        return not ours
    if text in ("True", "False"):
        return ours is (text == "True")
    try:
        expected = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return ours == text
    if isinstance(expected, int | float) and not isinstance(expected, bool):
        return isinstance(ours, int | float) and float(ours) == float(expected)
    return ours == expected


def test_every_serve_flag_exists_with_its_documented_default(cli):
    documented = seed_flags("2.3")
    assert len(documented) > 150  # the whole serve reference was read
    namespace = parse(cli, "serve")
    defaults = vars(namespace)
    for flag, seed in documented.items():
        if flag in ("--config",):
            assert defaults["config"] is None
            continue
        dest = _dest(flag)
        assert dest in defaults, f"{flag} is missing"
        ours = defaults[dest]
        check = DEFAULT_EXCEPTIONS.get(flag)
        ok = check(seed.default, ours) if check else _matches(seed.default or "", ours)
        assert ok, f"{flag}: documented default {seed.default!r}, ours {ours!r}"


def test_every_run_batch_flag_exists_with_its_documented_default(cli):
    documented = seed_flags("2.6")
    assert {"--input-file", "--output-file", "--enable-metrics"} <= set(documented)
    defaults = vars(parse(cli, "run-batch"))
    for flag, seed in documented.items():
        ours = defaults[_dest(flag)]
        assert _matches(seed.default or "", ours), f"{flag}: {seed.default!r} vs {ours!r}"


REGISTRY_FLAGS = {
    "--device",
    "--load-format",
    "--quantization",
    "--tool-call-parser",
    "--reasoning-parser",
    "--guided-decoding-backend",
}


def test_documented_fixed_choices_are_accepted(cli):
    for flag, seed in seed_flags("2.3").items():
        if not seed.choices or flag in REGISTRY_FLAGS:
            continue
        for choice in seed.choices:
            if choice in ("None", "…", "..."):
                continue
            namespace = parse(cli, "serve", flag, choice)
            value = getattr(namespace, _dest(flag))
            value = value[0] if isinstance(value, list) else value
            assert str(value) == choice, flag


def test_registry_choices_include_plugins_and_refuse_unknown(cli, capsys):
    namespace = parse(
        cli,
        "serve",
        "--device",
        "dummydev",
        "--load-format",
        "dummyfmt",
        "--quantization",
        "dummyq",
    )
    assert (namespace.device, namespace.load_format, namespace.quantization) == (
        "dummydev",
        "dummyfmt",
        "dummyq",
    )
    with pytest.raises(SystemExit):
        parse(cli, "serve", "--load-format", "fastsafetensors")
    err = capsys.readouterr().err
    assert "invalid choice: 'fastsafetensors'" in err and "dummyfmt" in err and "safetensors" in err


def test_no_arguments_give_the_dataclass_defaults(cli):
    assert EngineArgs.from_cli_args(parse(cli, "serve")) == EngineArgs()


def test_human_readable_max_model_len(cli):
    for text, value in [("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("2048", 2048)]:
        assert parse(cli, "serve", "--max-model-len", text).max_model_len == value
    with pytest.raises(SystemExit):
        parse(cli, "serve", "--max-model-len", "lots")


def test_json_options_whole_and_by_key(cli):
    ns = parse(
        cli,
        "serve",
        "--hf-overrides",
        '{"a": 1, "b": {"c": 2}}',
        "--hf-overrides.b.d",
        "3",
        "--rope-scaling.rope_type=dynamic",
        "--rope-scaling.factor",
        "2.0",
    )
    assert ns.hf_overrides == {"a": 1, "b": {"c": 2, "d": 3}}
    assert ns.rope_scaling == {"rope_type": "dynamic", "factor": 2.0}


def test_underscored_flags_and_short_aliases(cli):
    ns = parse(cli, "serve", "--max_num_seqs", "3", "-tp", "1", "-O3", "-q", "dummyq")
    assert (ns.max_num_seqs, ns.tensor_parallel_size, ns.compilation_config) == (3, 1, 3)
    assert ns.quantization == "dummyq"


def test_yaml_config_file_and_command_line_precedence(cli, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: my/model\n"
        "max-num-seqs: 8\n"
        "max_num_batched_tokens: 512\n"
        "enable-prefix-caching: false\n"
        "served-model-name: [alpha, beta]\n"
        "hf-overrides: {num_hidden_layers: 2}\n"
        "disable-log-requests: true\n"
        "port: 9001\n"
    )
    ns = parse(cli, "serve", "--config", str(config), "--max-num-seqs", "4")
    assert ns.model == "my/model" and ns.model_tag is None
    assert ns.max_num_seqs == 4  # the command line wins
    assert ns.max_num_batched_tokens == 512
    assert ns.enable_prefix_caching is False
    assert ns.served_model_name == ["alpha", "beta"]
    assert ns.hf_overrides == {"num_hidden_layers": 2}
    assert ns.disable_log_requests is True and ns.port == 9001

    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-sequences: 8\n")
    with pytest.raises(SystemExit):
        parse(cli, "serve", "--config", str(bad))


def test_help_keyword_forms(cli, capsys):
    def help_for(keyword):
        with pytest.raises(SystemExit) as excinfo:
            parse(cli, "serve", f"--help={keyword}")
        assert excinfo.value.code == 0
        return capsys.readouterr().out

    groups = help_for("listgroup")
    for group in ("ModelConfig", "CacheConfig", "SchedulerConfig", "Frontend"):
        assert group in groups
    model_group = help_for("ModelConfig")
    assert "--max-model-len" in model_group and "--block-size" not in model_group
    one = help_for("max-num-seqs")
    assert "--max-num-seqs" in one and "--max-num-batched-tokens" not in one
    search = help_for("max")
    assert "--max-num-seqs" in search and "--max-model-len" in search
    assert "--block-size" not in search
    assert "No argument group or argument matches" in help_for("zzzqqq")


def test_config_choices_checked_for_python_callers(pm):
    with pytest.raises(ConfigError, match="--block-size: invalid choice 7"):
        EngineArgs(block_size=7).create_engine_config(pm)
    with pytest.raises(ConfigError, match="--load-format: invalid choice 'nope'"):
        EngineArgs(load_format="nope").create_engine_config(pm)


def test_unbuilt_features_are_refused_by_name(pm):
    with pytest.raises(ConfigError) as excinfo:
        EngineArgs(enable_prompt_embeds=True, fully_sharded_loras=True).create_engine_config(pm)
    message = str(excinfo.value)
    assert "--enable-prompt-embeds=True is not supported" in message
    assert "--fully-sharded-loras=True is not supported" in message
    # Set to their defaults, the same flags are fine.
    EngineArgs(enable_prompt_embeds=False, fully_sharded_loras=False).create_engine_config(pm)


def test_removed_and_deprecated_flags(pm, caplog):
    with pytest.raises(ConfigError, match="--worker-use-ray was removed: .*distributed"):
        EngineArgs(worker_use_ray=True).create_engine_config(pm)
    with pytest.raises(
        ConfigError, match="--speculative-model was removed: .*--speculative-config"
    ):
        EngineArgs(speculative_model="draft").create_engine_config(pm)
    with caplog.at_level(logging.WARNING):
        EngineArgs(use_v2_block_manager=False).create_engine_config(pm)
    assert "--use-v2-block-manager is deprecated" in caplog.text


def test_validation_explains_itself(pm):
    cases = [
        (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization=1.5 is invalid"),
        (dict(max_num_seqs=0), "--max-num-seqs=0 is invalid: must be at least 1"),
        (
            dict(max_num_partial_prefills=2, max_long_partial_prefills=3),
            "--max-long-partial-prefills=3 is invalid",
        ),
        (dict(seed=2**64), "--seed=.* is invalid: must fit in 64 bits"),
        (dict(swap_space=-1), "--swap-space=-1 is invalid"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            EngineArgs(**kwargs).create_engine_config(pm)


def test_config_objects(pm, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "1.5")
    config = EngineArgs(
        model="some/model",
        served_model_name=["a", "b"],
        max_num_seqs=7,
        enable_prefix_caching=False,
        block_size=32,
    ).create_engine_config(pm, UsageContext.LLM_CLASS)
    assert config.model_config.served_model_name == ["a", "b"]
    assert config.model_config.tokenizer == "some/model"
    assert config.scheduler_config.max_num_seqs == 7
    assert config.scheduler_config.max_num_batched_tokens == 8192
    assert config.cache_config.enable_prefix_caching is False
    assert config.cache_config.block_size == 32
    assert config.cache_config.cpu_kvcache_space_gib == 1.5
    assert config.device_config.name == "cpu"
    assert config.load_config.ignore_patterns == ["original/**/*"]

    # The server's budget: the cpu device's own (prompts in finer chunks), unless chunked
    # prefill is off or a budget is given.
    server = EngineArgs().create_engine_config(pm, UsageContext.OPENAI_API_SERVER)
    assert server.scheduler_config.max_num_batched_tokens == 512
    unchunked = EngineArgs(enable_chunked_prefill=False, max_model_len=2048)
    config = unchunked.create_engine_config(pm, UsageContext.OPENAI_API_SERVER)
    assert config.scheduler_config.max_num_batched_tokens == 2048
    given = EngineArgs(max_num_batched_tokens=4096)
    config = given.create_engine_config(pm, UsageContext.OPENAI_API_SERVER)
    assert config.scheduler_config.max_num_batched_tokens == 4096
    assert server.cache_config.enable_prefix_caching is True
    assert server.model_config.served_model_name == [DEFAULT_MODEL]

    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ConfigError, match="PAGEDLLM_CPU_KVCACHE_SPACE"):
        EngineArgs().create_engine_config(pm)


def test_update_config_hook_sees_the_config(pm):
    from types import SimpleNamespace

    from pagedllm import hookimpl
    from pagedllm.core.plugins import make_plugin_manager

    seen = []

    @hookimpl
    def pagedllm_update_config(config):
        seen.append(config.model_config.model)
        config.scheduler_config.max_num_seqs = 3

    pm = make_plugin_manager(
        env={},
        extra_plugins=[("tuner", SimpleNamespace(pagedllm_update_config=pagedllm_update_config))],
    )
    config = EngineArgs(model="m").create_engine_config(pm)
    assert seen == ["m"] and config.scheduler_config.max_num_seqs == 3
