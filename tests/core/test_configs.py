"""The configuration objects: each owns its defaults (the engine arguments take theirs
from it) and checks its own values; the engine's configuration is frozen once validated;
a device checks and adjusts it through ``Device.check_and_update_config``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DUMMY_PLUGIN, clean_env

from pagedllm import hookimpl
from pagedllm.core.args.spec import field_default
from pagedllm.core.config import (
    CacheConfig,
    CompilationConfig,
    DecodingConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.plugins.devices.cpu import CpuDevice

CONFIGS = [
    ModelConfig,
    LoadConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    DecodingConfig,
    ObservabilityConfig,
    LoRAConfig,
    CompilationConfig,
]


def test_validated_config_is_frozen(pm):
    config = EngineArgs(max_num_seqs=8).create_engine_config(pm)
    with pytest.raises(dataclasses.FrozenInstanceError, match="SchedulerConfig.max_num_seqs"):
        config.scheduler_config.max_num_seqs = 3
    with pytest.raises(dataclasses.FrozenInstanceError, match="PagedLLMConfig.cache_config"):
        config.cache_config = CacheConfig()
    for part in dataclasses.fields(config):  # every field of every config
        value = getattr(config, part.name)
        for field in dataclasses.fields(value) if dataclasses.is_dataclass(value) else ():
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(value, field.name, getattr(value, field.name))
    assert config.scheduler_config.max_num_seqs == 8
    # A changed copy is validated, and frozen like its original; the original is unchanged.
    copy = config.replace(scheduler_config=config.scheduler_config.replace(max_num_seqs=4))
    assert copy.scheduler_config.max_num_seqs == 4 and config.scheduler_config.max_num_seqs == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.scheduler_config.max_num_seqs = 5
    with pytest.raises(ConfigError, match=r"^--max-loras=0 is invalid"):
        LoRAConfig().freeze().replace(max_loras=0)


def test_engine_args_take_their_defaults_from_the_configs():
    """Every engine argument that feeds a config field has that field's default, or is
    None (unset: the config's default, or a value computed from several options,
    applies), so the two cannot drift apart. (SpeculativeConfig's fields are keys of
    --speculative-config's JSON, not engine arguments.)"""
    args = {f.name: f for f in dataclasses.fields(EngineArgs)}
    shared = []
    for cls in CONFIGS:
        for name in cls.arg_names.values():
            assert name in args, f"{cls.__name__}.arg_names names no engine argument {name!r}"
        for field in dataclasses.fields(cls):
            name = cls.arg_names.get(field.name, field.name)
            if name not in args:
                continue
            ours = field_default(args[name])
            if ours is None and cls.default(field.name) is not None:
                continue
            assert ours == cls.default(field.name), (cls.__name__, field.name, ours)
            shared.append(name)
    assert len(shared) > 60, shared
    # (a config field whose argument is unset takes the config's default)
    built = SchedulerConfig.from_args(EngineArgs())
    assert built == SchedulerConfig()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LoRAConfig(max_loras=0), r"^--max-loras=0 is invalid: must be at least 1"),
        (
            lambda: LoRAConfig(max_loras=4, max_cpu_loras=2),
            r"^--max-cpu-loras=2 is invalid: must be at least --max-loras \(4\)",
        ),
        (lambda: ParallelConfig(tensor_parallel_size=0), r"^--tensor-parallel-size=0 is invalid"),
        (
            lambda: ParallelConfig(data_parallel_size=2, data_parallel_rpc_port=70000),
            r"^--data-parallel-rpc-port=70000 is invalid: must be a TCP port",
        ),
        (
            lambda: ParallelConfig(data_parallel_address="10.0.0.1"),
            r"^--data-parallel-address applies with --data-parallel-size above 1",
        ),
        (lambda: CacheConfig(calculate_kv_scales=True), r"^--calculate-kv-scales=True is invalid"),
        (lambda: ModelConfig(served_model_name=[]), r"^--served-model-name=\[\] is invalid"),
        (
            lambda: ModelConfig(override_generation_config={"no_such_key": 1}),
            r"^--override-generation-config: unknown key\(s\) no_such_key",
        ),
        (lambda: CompilationConfig(level=5), r"^--compilation-config: level 5 is not one of"),
        (
            lambda: SpeculativeConfig(method="ngram", num_speculative_tokens=0),
            r"^--speculative-config: num_speculative_tokens must be a positive integer",
        ),
    ],
)
def test_a_config_built_directly_validates_itself(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_configs_normalize_what_they_are_given():
    model = ModelConfig(model="m", served_model_name="name")
    assert (model.tokenizer, model.served_model_name) == ("m", ["name"])
    assert LoadConfig(ignore_patterns="*.bin").ignore_patterns == ["*.bin"]
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert SpeculativeConfig(model="draft", num_speculative_tokens=2).method == "draft_model"


# (config built directly, the same values as engine arguments, the message both give)
_OUT_OF_RANGE = [
    (
        lambda: CacheConfig(gpu_memory_utilization=5),
        dict(gpu_memory_utilization=5),
        r"^--gpu-memory-utilization=5 is invalid: must be in \(0, 1\]",
    ),
    (
        lambda: CacheConfig(prefix_caching_hash_algo="md5"),
        dict(prefix_caching_hash_algo="md5"),
        r"^--prefix-caching-hash-algo: invalid choice 'md5' \(choose from builtin, sha256\)",
    ),
    (
        lambda: CacheConfig(block_size=7),
        dict(block_size=7),
        r"^--block-size: invalid choice 7 \(choose from 1, 8, 16, 32, 64, 128\)",
    ),
    (
        lambda: CacheConfig(swap_space_gib=-1),
        dict(swap_space=-1),
        r"^--swap-space=-1 is invalid: must be >= 0 GiB",
    ),
    (
        lambda: SchedulerConfig(max_num_seqs=0),
        dict(max_num_seqs=0),
        r"^--max-num-seqs=0 is invalid: must be at least 1",
    ),
    (
        lambda: SchedulerConfig(max_num_partial_prefills=2, max_long_partial_prefills=3),
        dict(max_num_partial_prefills=2, max_long_partial_prefills=3),
        r"^--max-long-partial-prefills=3 is invalid: must be between 1 and "
        r"--max-num-partial-prefills \(2\)",
    ),
    (
        lambda: SchedulerConfig(policy="lifo"),
        dict(scheduling_policy="lifo"),
        r"^--scheduling-policy: invalid choice 'lifo' \(choose from fcfs, priority\)",
    ),
    (
        lambda: ParallelConfig(pipeline_parallel_size=0),
        dict(pipeline_parallel_size=0),
        r"^--pipeline-parallel-size=0 is invalid: must be at least 1",
    ),
    (
        lambda: ParallelConfig(data_parallel_size=2, data_parallel_rpc_port=0),
        dict(data_parallel_size=2, data_parallel_rpc_port=0),
        r"^--data-parallel-rpc-port=0 is invalid: must be a TCP port",
    ),
    (
        lambda: ModelConfig(dtype="float8"),
        dict(dtype="float8"),
        r"^--dtype: invalid choice 'float8' \(choose from auto, bfloat16, float, ",
    ),
    (
        lambda: ModelConfig(max_logprobs=-2),
        dict(max_logprobs=-2),
        r"^--max-logprobs=-2 is invalid: must be >= 0, or -1 for no limit",
    ),
    (
        lambda: ModelConfig(seed=2**64),
        dict(seed=2**64),
        r"^--seed=18446744073709551616 is invalid: must fit in 64 bits",
    ),
    (
        lambda: LoRAConfig(max_lora_rank=0),
        dict(enable_lora=True, max_lora_rank=0),
        r"^--max-lora-rank=0 is invalid: must be positive",
    ),
    (
        lambda: LoRAConfig(lora_dtype="float32"),
        dict(enable_lora=True, lora_dtype="float32"),
        r"^--lora-dtype: invalid choice 'float32' \(choose from auto, bfloat16, float16\)",
    ),
    (
        lambda: DecodingConfig(compile_timeout=0),
        dict(guided_decoding_compile_timeout=0),
        r"^--guided-decoding-compile-timeout=0 is invalid: it must be more than 0 seconds",
    ),
]


@pytest.mark.parametrize(("build", "args", "message"), _OUT_OF_RANGE)
def test_a_config_refuses_values_outside_its_declared_range_or_choices(pm, build, args, message):
    """The range and choices of a flag are declared once, on the config field: a config
    built directly refuses what the engine arguments refuse, with the same message."""
    with pytest.raises(ConfigError, match=message):
        build()
    with pytest.raises(ConfigError, match=message.lstrip("^")):
        EngineArgs(model="no/such-model", **args).create_engine_config(pm)


def test_the_command_line_takes_its_ranges_and_choices_from_the_configs(pm, capsys):
    """Every field's declared range and choices are the engine argument's (a bound
    naming a field named as the argument that feeds it), so argparse, ``--help`` and the
    engine arguments' checks enforce what the config does; ``arg`` refuses to restate
    them."""
    from pagedllm.core.args.spec import arg, field_meta
    from pagedllm.core.configs.base import VALID_KEY
    from pagedllm.entrypoints.cli.main import build_parser

    args = {f.name: f for f in dataclasses.fields(EngineArgs)}
    declared = []
    for cls in CONFIGS:
        for field in dataclasses.fields(cls):
            valid = field.metadata.get(VALID_KEY)
            if valid is None:
                continue
            name = cls.arg_names.get(field.name, field.name)
            meta = field_meta(args[name])
            bound = {k: cls.arg_names.get(k, k) for k in (valid.min, valid.max) if k}
            assert (meta.min, meta.max, meta.min_exclusive, meta.range_hint, meta.choices) == (
                bound.get(valid.min, valid.min),
                bound.get(valid.max, valid.max),
                valid.min_exclusive,
                valid.range_hint,
                valid.choices,
            ), name
            declared.append(name)
    assert len(declared) > 30, declared
    with pytest.raises(TypeError, match="declared on the config field, not restated"):
        arg(of=CacheConfig.option("block_size"), group="G", help="X.", choices=(16,))
    parser, _ = build_parser(pm)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prefix-caching-hash-algo", "md5"])
    err = capsys.readouterr().err
    assert "--prefix-caching-hash-algo: invalid choice: 'md5'" in err and "sha256" in err
    with pytest.raises(SystemExit) as excinfo:
        parser.parse_args(["serve", "--help=kv-cache-dtype"])
    assert excinfo.value.code == 0
    assert "{auto,fp8,fp8_e4m3,fp8_e5m2" in capsys.readouterr().out


def test_a_plugins_change_is_checked_against_the_declared_range():
    @hookimpl
    def pagedllm_update_config(config):
        config.cache_config.gpu_memory_utilization = 2.0

    plugin = type("P", (), {"pagedllm_update_config": staticmethod(pagedllm_update_config)})
    pm = make_plugin_manager(env={}, extra_plugins=[("badplugin", plugin)])
    with pytest.raises(ConfigError, match=r"^--gpu-memory-utilization=2.0 is invalid"):
        EngineArgs(device="cpu").create_engine_config(pm)


class _HookDevice(CpuDevice):
    """The cpu under another name, whose hook records the config it saw and adjusts it."""

    name = "hookdev"
    seen: list = []

    def check_and_update_config(self, config):
        self.seen.append(config.scheduler_config.max_num_seqs)
        config.scheduler_config.max_num_seqs = 5
        if config.lora_config is not None:
            raise ConfigError("--enable-lora: not on the hookdev device")


def test_the_device_checks_and_adjusts_the_config():
    @hookimpl
    def pagedllm_register_devices(registry):
        registry.add("hookdev", _HookDevice)

    @hookimpl
    def pagedllm_update_config(config):
        config.scheduler_config.max_num_seqs = 7  # (the device sees the plugins' change)

    plugin = type(
        "P",
        (),
        {
            "pagedllm_register_devices": staticmethod(pagedllm_register_devices),
            "pagedllm_update_config": staticmethod(pagedllm_update_config),
        },
    )
    pm = make_plugin_manager(env={}, extra_plugins=[("hookdev", plugin)])
    _HookDevice.seen = []
    config = EngineArgs(device="hookdev").create_engine_config(pm)
    assert _HookDevice.seen == [7] and config.scheduler_config.max_num_seqs == 5
    with pytest.raises(ConfigError, match="^--enable-lora: not on the hookdev device"):
        EngineArgs(device="hookdev", enable_lora=True).create_engine_config(pm)
    # The cpu device sets the KV cache's space from PAGEDLLM_CPU_KVCACHE_SPACE; others
    # keep the default.
    cpu = EngineArgs(device="cpu").create_engine_config(pm)
    assert cpu.cache_config.cpu_kvcache_space_gib == float(
        os.environ.get("PAGEDLLM_CPU_KVCACHE_SPACE") or 4.0
    )


def test_a_third_party_device_checks_the_config_through_device(tmp_path):
    """The dummy plugin's device refuses several ranks in its check_and_update_config,
    named by ``--device dummydev`` (its source on the path: the installed copy may be
    older)."""
    sources = str(DUMMY_PLUGIN)
    env = clean_env(PYTHONPATH=os.pathsep.join([sources, os.environ.get("PYTHONPATH", "")]))
    code = (
        "from pagedllm.core.engine_args import EngineArgs\n"
        "from pagedllm.core.plugins import make_plugin_manager\n"
        "import sys\n"
        "args = EngineArgs(model='no/such-model', device='dummydev', **eval(sys.argv[1]))\n"
        "print(args.create_engine_config(make_plugin_manager()).device_config.name)\n"
    )

    def run(kwargs: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, kwargs],
            capture_output=True,
            text=True,
            env=env,
            cwd=Path(__file__).parent,
            timeout=120,
        )

    one = run("{}")
    assert one.returncode == 0 and one.stdout.strip() == "dummydev", one.stderr
    two = run("{'tensor_parallel_size': 2}")
    assert two.returncode != 0
    assert "ConfigError: the dummydev device runs one rank" in two.stderr, two.stderr


def test_the_cuda_device_counts_the_gpus_a_config_needs(pm, monkeypatch):
    """(On this machine's count of GPUs, set to one: the configs are the cpu's.)"""
    import torch

    from pagedllm.core.config import UsageContext
    from pagedllm.plugins.devices.cuda import CudaDevice

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda = CudaDevice()
    cuda.check_and_update_config(EngineArgs().create_engine_config(pm))
    two_ranks = EngineArgs(tensor_parallel_size=2).create_engine_config(pm)
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size 2 needs 2 GPUs; 1 are visible"):
        cuda.check_and_update_config(two_ranks)
    replicas = EngineArgs(data_parallel_size=2).create_engine_config(
        pm, UsageContext.OPENAI_API_SERVER
    )
    with pytest.raises(ConfigError, match=r"^2 data-parallel replicas on this node .* need 2 GPUs"):
        cuda.check_and_update_config(replicas)
