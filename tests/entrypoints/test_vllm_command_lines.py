"""vLLM command lines and config files from the seeds, run unchanged: the value forms of
older vLLM versions (``--quantization None``, ``--enable-chunked-prefill False``,
``image=16,video=2``), deprecated and no-op switches, and refusal messages that lead
somewhere (issue 34)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from pathlib import Path

import pytest
from conftest import run_cli
from openai_server import RemoteServer
from repo_paths import TESTS
from tiny_models import make_checkpoint

from pagedllm.core.args.refusals import NO_OP, SPEC_KEYS_REFUSED, DeprecatedArgs
from pagedllm.core.argspec import field_meta, option_name
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.core.spec_decode import SpeculativeConfig
from pagedllm.entrypoints.cli.main import build_parser
from pagedllm.entrypoints.openai.cli_args import FrontendArgs
from pagedllm.entrypoints.openai.serving_setup import validate_frontend_args

# The model configuration template of seed 000 (vLLM's deployment guide), verbatim.
SEED_000_TEMPLATE = TESTS / "data" / "seed000_deployment_template.yaml"
README = TESTS.parent / "README.md"


@pytest.fixture
def cli(pm):
    parser, _ = build_parser(pm)
    return parser


def serve_args(cli, *argv: str) -> argparse.Namespace:
    return cli.parse_args(["serve", *argv])


def engine_args(cli, *argv: str) -> EngineArgs:
    return EngineArgs.from_cli_args(serve_args(cli, *argv))


def _serve_actions(cli) -> dict[str, argparse.Action]:
    serve = next(a for a in cli._actions if isinstance(a, argparse._SubParsersAction)).choices[
        "serve"
    ]
    return {o: a for a in serve._actions for o in a.option_strings}


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory):
    # The template asks for max_model_len 8192.
    return make_checkpoint(
        tmp_path_factory.mktemp("llama8k"), "llama", max_position_embeddings=8192
    )


def _template_with(tmp_path: Path, model: Path) -> Path:
    config = tmp_path / "my_model.yaml"
    text = SEED_000_TEMPLATE.read_text(encoding="utf-8")
    assert "quantization: None" in text
    config.write_text(text.replace("my-model-name-or-path", str(model)), encoding="utf-8")
    return config


# --------------------------------------------------------- None unsets an optional option


@pytest.mark.parametrize(
    "flag", ["--quantization", "-q", "--preemption-mode", "--distributed-executor-backend"]
)
def test_none_unsets_an_optional_option_with_choices(cli, pm, flag):
    args = engine_args(cli, flag, "None")
    dest = {"-q": "quantization"}.get(flag, flag[2:].replace("-", "_"))
    assert getattr(args, dest) is None
    args.create_engine_config(pm)


def test_none_is_listed_among_the_choices_as_the_seeds_list_it(cli, capsys):
    with pytest.raises(SystemExit):
        serve_args(cli, "--help=quantization")
    assert re.search(r"--quantization \{auto,[^}]*,None\}", capsys.readouterr().out)


def test_seed_000_template_parses_into_engine_args(cli, pm, tmp_path, long_context_llama):
    config = _template_with(tmp_path, long_context_llama)
    namespace = serve_args(cli, "--config", str(config))
    args = EngineArgs.from_cli_args(namespace)
    assert args.model == str(long_context_llama) and args.quantization is None
    assert (args.max_model_len, args.max_num_batched_tokens, args.max_num_seqs) == (8192,) * 2 + (
        256,
    )
    assert (args.block_size, args.tensor_parallel_size, args.dtype) == (16, 1, "auto")
    built = args.create_engine_config(pm)
    assert built.cache_config.block_size == 16


def test_a_config_section_beside_other_options_is_refused(cli, tmp_path, capsys):
    config = tmp_path / "mixed.yaml"
    config.write_text("vllm:\n  max_num_seqs: 4\nmax_model_len: 64\n")
    with pytest.raises(SystemExit):
        serve_args(cli, "--config", str(config))
    assert "both in its 'vllm' section and outside it (max_model_len)" in capsys.readouterr().err


def test_seed_000_template_serves_and_no_op_switches_are_logged_once(tmp_path, long_context_llama):
    config = _template_with(tmp_path, long_context_llama)
    no_op_flags = [option_name(name) for name in NO_OP]
    server = RemoteServer(
        None,
        "--config",
        str(config),
        *no_op_flags,
        log_path=tmp_path / "serve.log",
        base_args=("--disable-log-stats",),
    )
    server.start()
    try:
        server.wait_ready()
        with server.http() as http:
            models = http.get("/v1/models").json()["data"]
            assert [m["max_model_len"] for m in models] == [8192]
            answer = http.post(
                "/v1/completions",
                json={"model": str(long_context_llama), "prompt": "Hello", "max_tokens": 3},
            )
            assert answer.status_code == 200, answer.text
    finally:
        server.stop()
    log = server.log_text()
    assert "the other sections (docker) are for other tools" in log
    for flag in no_op_flags:
        assert log.count(f"{flag} changes nothing in pagedllm") == 1, log


# ------------------------------------------------------------------- on/off values


def _switches(cli) -> dict[str, argparse.Action]:
    """Each on/off option of ``serve`` by its main name."""
    switches = {}
    for action in set(_serve_actions(cli).values()):
        if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
            switches[action.option_strings[0]] = action
    return switches


def test_every_on_off_option_takes_a_value(cli):
    switches = _switches(cli)
    assert {"--enable-chunked-prefill", "--enforce-eager", "--disable-log-requests"} <= set(
        switches
    )
    for flag, action in switches.items():
        for given, value in [("true", True), ("False", False), ("1", True), ("0", False)]:
            for argv in ([flag, given], [f"{flag}={given}"]):
                namespace = serve_args(cli, *argv)
                assert getattr(namespace, action.dest) is value, argv
                assert namespace.model_tag is None, argv
        assert getattr(serve_args(cli, flag), action.dest) is True
        # A value that is not a switch value is the positional model.
        namespace = serve_args(cli, flag, "my/model")
        assert getattr(namespace, action.dest) is True and namespace.model_tag == "my/model"
        if isinstance(action, argparse.BooleanOptionalAction):
            assert getattr(serve_args(cli, "--no-" + flag[2:]), action.dest) is False


def test_the_value_forms_of_the_seeds(cli):
    # Seeds 002/003: "by setting --enable-chunked-prefill=False".
    for argv in (["--enable-chunked-prefill", "False"], ["--enable-chunked-prefill=False"]):
        namespace = serve_args(cli, *argv)
        assert namespace.enable_chunked_prefill is False and namespace.model_tag is None
    # The last one wins, whatever its form.
    namespace = serve_args(cli, "--disable-log-requests", "--disable-log-requests=false")
    assert namespace.disable_log_requests is False
    namespace = serve_args(cli, "--enable_prefix_caching=0", "--enable-prefix-caching")
    assert namespace.enable_prefix_caching is True


def test_a_bad_switch_value_names_the_option(cli, capsys):
    with pytest.raises(SystemExit):
        serve_args(cli, "--enforce-eager=maybe")
    assert "argument --enforce-eager: expected true or false (or 1 or 0), got 'maybe'" in (
        capsys.readouterr().err
    )


def test_switch_values_in_a_config_file(cli, tmp_path):
    config = tmp_path / "switches.yaml"
    config.write_text(
        "enable-chunked-prefill: 'False'\nenforce_eager: true\ndisable-log-requests: 'true'\n"
    )
    namespace = serve_args(cli, "--config", str(config))
    assert namespace.enable_chunked_prefill is False
    assert namespace.enforce_eager is True and namespace.disable_log_requests is True
    # The command line wins.
    namespace = serve_args(cli, "--config", str(config), "--disable-log-requests", "false")
    assert namespace.disable_log_requests is False


# ------------------------------------------------------------------ --enable-reasoning


def test_enable_reasoning_is_accepted_with_a_deprecation_warning(cli, pm, caplog):
    args = engine_args(cli, "--enable-reasoning", "--reasoning-parser", "deepseek_r1")
    with caplog.at_level(logging.WARNING):
        config = args.create_engine_config(pm)
    assert "--enable-reasoning is deprecated" in caplog.text
    assert config.decoding_config.reasoning_parser == "deepseek_r1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--enable-reasoning"], "--enable-reasoning needs --reasoning-parser NAME"),
        (
            ["--enable-reasoning", "false", "--reasoning-parser", "deepseek_r1"],
            "--enable-reasoning=False cannot turn reasoning output off",
        ),
    ],
)
def test_enable_reasoning_that_would_change_nothing_is_refused(cli, pm, argv, message):
    with pytest.raises(ConfigError, match=message):
        engine_args(cli, *argv).create_engine_config(pm)


# ------------------------------------------------------------------- no-op switches


@pytest.mark.parametrize("name", sorted(NO_OP))
def test_switches_off_for_what_pagedllm_never_does_are_accepted_and_logged(cli, pm, caplog, name):
    flag = option_name(name)
    with caplog.at_level(logging.INFO, logger="pagedllm.config"):
        engine_args(cli, flag).create_engine_config(pm)
    assert f"{flag} changes nothing in pagedllm: {NO_OP[name]}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedllm.config"):
        engine_args(cli).create_engine_config(pm)
    assert "changes nothing" not in caplog.text


def test_readme_names_the_accepted_no_op_switches():
    section = README.read_text(encoding="utf-8").split("## The command line", 1)[1]
    section = section.split("\n## ", 1)[0]
    for name in NO_OP:
        assert f"`{option_name(name)}`" in section, name


# ------------------------------------- older value forms reach the flag's own refusal


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--limit-mm-per-prompt", "image=16,video=2"],
            r'--limit-mm-per-prompt=\{"image": 16, "video": 2\}: video: pagedllm takes '
            r"images only; video/audio are not supported",
        ),
        (
            ["--collect-detailed-traces", "model,worker"],
            r"--collect-detailed-traces needs --otlp-traces-endpoint",
        ),
    ],
)
def test_older_value_forms_get_the_flags_own_refusal(cli, pm, argv, message):
    with pytest.raises(ConfigError, match=message):
        engine_args(cli, *argv).create_engine_config(pm)


def test_the_list_of_trace_modules_in_both_forms(cli):
    for argv in (["model,worker"], ["model", "worker"]):
        namespace = serve_args(cli, "--collect-detailed-traces", *argv)
        assert namespace.collect_detailed_traces == ["model", "worker"]
    assert serve_args(cli, "--collect-detailed-traces", "None").collect_detailed_traces is None


# ------------------------------------------------------------------ refusal messages


def _refusal_texts() -> dict[str, str]:
    """Every declared refusal or guidance text of ``serve``'s options, by option."""
    texts = {}
    for cls in (EngineArgs, FrontendArgs):
        for field in dataclasses.fields(cls):
            meta = field_meta(field)
            if meta is None:
                continue
            for kind in ("unbuilt", "removed", "deprecated", "unsupported", "no_op"):
                text = getattr(meta, kind)
                if text:
                    texts[f"{option_name(field.name)} ({kind})"] = text
    return texts


def _always_refused() -> set[str]:
    refused = set()
    for cls in (EngineArgs, FrontendArgs):
        for field in dataclasses.fields(cls):
            meta = field_meta(field)
            if meta is not None and (meta.unbuilt or meta.removed):
                refused.add(option_name(field.name))
    return refused


def test_no_refusal_sends_the_user_to_a_refused_or_missing_flag(cli):
    texts = _refusal_texts()
    assert len(texts) > 60
    options = set(_serve_actions(cli))
    refused = _always_refused()
    assert "--enable-prompt-embeds" in refused
    assert "--enable-sleep-mode" not in refused  # (built: sleep mode)
    # (the old image flags point to --mm-processor-kwargs, an option pagedllm honours)
    assert "--mm-processor-kwargs" in texts["--image-processor (removed)"]
    for source, text in texts.items():
        for flag in re.findall(r"--[a-z][a-z0-9-]*[a-z0-9]", text):
            assert flag in options, f"{source} names {flag}, which is not an option"
            assert flag not in refused, f"{source} sends the user to {flag}, refused too"


def test_engine_use_ray_describes_how_the_engine_runs():
    text = field_meta(DeprecatedArgs.__dataclass_fields__["engine_use_ray"]).removed
    # The server runs the engine on a thread (pagedllm.core.async_engine).
    assert "on a thread of the API server's process" in text and "own process" not in text


_NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


# A value of each key, for a draft model (some apply to a draft model only).
_SPEC_VALUES = {
    "model": "draft",
    "num_speculative_tokens": 2,
    "draft_tensor_parallel_size": 1,
    "max_model_len": 64,
    "disable_by_batch_size": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def test_speculative_config_keys_named_by_refusals_are_accepted():
    named = set()
    for field in dataclasses.fields(DeprecatedArgs):
        removed = field_meta(field).removed or ""
        named.update(re.findall(r"--speculative-config '\{\"(\w+)\"", removed))
    assert named == set(_SPEC_VALUES)
    for key, value in _SPEC_VALUES.items():
        values = {"model": "draft", "num_speculative_tokens": 2, key: value}
        if key.startswith("prompt_lookup"):
            values = {**_NGRAM, key: value}
        SpeculativeConfig.from_dict(values)


# --speculative-config key -> (the older flag that set it, a value pagedllm refuses)
SPEC_KEY_FLAGS = {
    "quantization": ("speculative_model_quantization", "fp8"),
    "disable_logprobs": ("disable_logprobs_during_spec_decoding", True),
    "disable_mqa_scorer": ("speculative_disable_mqa_scorer", True),
    "posterior_threshold": ("typical_acceptance_sampler_posterior_threshold", 0.3),
    "posterior_alpha": ("typical_acceptance_sampler_posterior_alpha", 0.5),
}


@pytest.mark.parametrize("key", sorted(SPEC_KEYS_REFUSED))
def test_refused_speculative_keys_say_why_as_their_old_flags_do(pm, key):
    reason = SPEC_KEYS_REFUSED[key]
    name, value = SPEC_KEY_FLAGS[key]
    with pytest.raises(ConfigError) as excinfo:
        SpeculativeConfig.from_dict({**_NGRAM, key: value})
    assert str(excinfo.value).endswith(f"{key}={value!r} is not supported: {reason}")
    # Unset (or false, as vLLM writes them by default) they are fine.
    SpeculativeConfig.from_dict({**_NGRAM, key: None})
    SpeculativeConfig.from_dict({**_NGRAM, key: False})
    with pytest.raises(ConfigError) as excinfo:
        EngineArgs(**{name: value}).create_engine_config(pm)
    assert str(excinfo.value) == f"{option_name(name)} was removed: {reason}"


def test_enable_ssl_refresh_help_and_refusal(cli, pm, capsys):
    with pytest.raises(SystemExit):
        serve_args(cli, "--help=enable-ssl-refresh")
    assert "[not supported by pagedllm yet]" in capsys.readouterr().out
    frontend = FrontendArgs(enable_ssl_refresh=True)
    with pytest.raises(ConfigError, match="--enable-ssl-refresh=True is not supported"):
        validate_frontend_args(frontend, pm)


def test_serve_refuses_enable_ssl_refresh_by_name():
    result = run_cli("serve", "no/such-model", "--enable-ssl-refresh")
    assert result.returncode == 2, result.stderr
    assert "--enable-ssl-refresh=True is not supported by pagedllm yet" in result.stderr
