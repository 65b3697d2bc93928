"""Device plugins: cheap to import, honest about availability, chosen by --device."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from pagedllm import hookimpl
from pagedllm.core.config import DeviceConfig, resolve_device
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import Device, KVCacheMemory
from pagedllm.core.model_setup import num_kv_blocks
from pagedllm.core.plugins import make_plugin_manager


def test_device_modules_import_no_vendor_library():
    code = (
        "import sys\n"
        "import pagedllm.plugins.devices.cpu, pagedllm.plugins.devices.cuda\n"
        "import pagedllm.plugins.devices.xpu, pagedllm.plugins.devices.tpu\n"
        "import pagedllm.plugins.devices.neuron\n"
        "heavy = [m for m in ('torch', 'torch_xla', 'torch_neuronx') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_every_builtin_device_answers_availability(pm):
    registry = pm.registry("devices")
    for name in ("cpu", "cuda", "xpu", "neuron", "tpu"):
        cls = registry.load(name)
        assert issubclass(cls, Device) and cls.name == name
        reason = cls.unavailable_reason()
        assert reason is None or (isinstance(reason, str) and reason)
    assert registry.load("cpu").is_available()


def test_auto_picks_the_best_available_device_that_runs_models(pm):
    device = resolve_device("auto", pm)
    # This machine has no accelerator pagedllm can run on; the dummy device has a lower
    # priority than the cpu.
    assert device.name == "cpu"
    free, total = device.memory_info()
    assert 0 < free <= total
    assert str(device.torch_device()) == "cpu"


def test_auto_prefers_a_higher_priority_device():
    class FastDevice(Device):
        name = "fast"
        priority = 1000
        runs_models = True

        @classmethod
        def unavailable_reason(cls):
            return None

        def torch_device(self):
            import torch

            return torch.device("cpu")

        def memory_info(self):
            return 1, 2

    @hookimpl
    def pagedllm_register_devices(registry):
        registry.add("fast", FastDevice)

    pm = make_plugin_manager(
        env={},
        extra_plugins=[
            ("fastdev", types.SimpleNamespace(pagedllm_register_devices=pagedllm_register_devices))
        ],
    )
    assert resolve_device("auto", pm).name == "fast"
    assert resolve_device("cpu", pm).name == "cpu"
    assert resolve_device("dummydev", pm).name == "dummydev"


def test_unavailable_or_runnerless_devices_are_refused(pm):
    for name in ("cuda", "xpu", "tpu", "neuron"):
        with pytest.raises(ConfigError, match=f"--device {name}: "):
            resolve_device(name, pm)
    neuron = pm.load("devices", "neuron")
    if not neuron.is_available():
        with pytest.raises(ConfigError, match="not available on this machine: .*Available"):
            resolve_device("neuron", pm)


def test_device_selects_block_size_default(pm):
    from pagedllm.core.engine_args import EngineArgs

    assert EngineArgs(device="dummydev").create_engine_config(pm).cache_config.block_size == 32
    assert EngineArgs(device="cpu").create_engine_config(pm).cache_config.block_size == 16


# ------------------------------------------- the device sizes the KV cache and threads


class _Accelerator(Device):
    name = "accel"
    runs_models = True

    @classmethod
    def unavailable_reason(cls):
        return None

    def torch_device(self):
        import torch

        return torch.device("cpu")

    def memory_info(self):
        return 3 * 2**30, 8 * 2**30


class _OneThreadDevice(_Accelerator):
    """Not named "cpu", runs on the host: its own KV-cache rule and thread count."""

    name = "onethread"
    uses_gpu_memory_utilization = False

    def kv_cache_memory(self, cache_config):
        return KVCacheMemory(40 * 2**20, "one-thread rule")

    def num_threads(self):
        return 1


def _config(pm, device: Device, **cache):
    from pagedllm.core.engine_args import EngineArgs

    config = EngineArgs(device="cpu").create_engine_config(pm)
    return config.replace(
        cache_config=config.cache_config.replace(**cache),
        device_config=DeviceConfig(name=device.name, device=device),
    )


def test_cpu_kv_cache_is_a_fixed_space_and_threads_fit_the_affinity(pm):
    cpu = resolve_device("cpu", pm)
    config = _config(pm, cpu, cpu_kvcache_space_gib=1.5)
    assert cpu.kv_cache_memory(config.cache_config) == KVCacheMemory(
        int(1.5 * 2**30), "PAGEDLLM_CPU_KVCACHE_SPACE=1.5 GiB"
    )
    assert not cpu.uses_gpu_memory_utilization
    assert 1 <= cpu.num_threads() <= len(os.sched_getaffinity(0))


def test_accelerator_kv_cache_is_a_share_of_its_memory(pm):
    device = _Accelerator()
    assert device.uses_gpu_memory_utilization
    cache = _config(pm, device, gpu_memory_utilization=0.25).cache_config
    assert device.kv_cache_memory(cache) == (2 * 2**30, "--gpu-memory-utilization=0.25")
    # Never more than is free.
    cache = cache.replace(gpu_memory_utilization=0.9)
    assert device.kv_cache_memory(cache).num_bytes == 3 * 2**30


def test_engine_sizes_the_kv_cache_by_asking_the_device(pm):
    config = _config(pm, _OneThreadDevice(), block_size=16)
    config = config.replace(scheduler_config=config.scheduler_config.replace(max_num_seqs=1000))
    # 40 MiB of 1 MiB blocks.
    assert num_kv_blocks(config, 2**20, max_model_len=64) == 40
    with pytest.raises(ConfigError, match=r"the KV cache \(one-thread rule\) holds 640 tokens"):
        num_kv_blocks(config, 2**20, max_model_len=1024)


def test_model_runs_with_the_devices_thread_count(tmp_path):
    import torch
    from tiny_models import make_checkpoint

    from pagedllm import LLM, SamplingParams

    @hookimpl
    def pagedllm_register_devices(registry):
        registry.add("onethread", _OneThreadDevice)

    pm = make_plugin_manager(
        env={},
        extra_plugins=[
            (
                "onethread",
                types.SimpleNamespace(pagedllm_register_devices=pagedllm_register_devices),
            )
        ],
    )
    before = torch.get_num_threads()
    try:
        with LLM(
            str(make_checkpoint(tmp_path / "llama", "llama")),
            plugin_manager=pm,
            device="onethread",
            dtype="float32",
            disable_log_stats=True,
        ) as llm:
            assert torch.get_num_threads() == 1
            out = llm.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("flags", "float16_becomes"),
    [
        ("avx2 fma", "float32"),  # no 16-bit arithmetic: float32
        ("avx2 avx512f avx512_bf16", "bfloat16"),  # AVX512-BF16: bfloat16, as vLLM-CPU
        ("avx512f amx_bf16 amx_tile", "bfloat16"),
        # Both: bfloat16, which pagedllm's CPU kernels compute in.
        ("avx512f avx512_bf16 avx512_fp16", "bfloat16"),
        ("avx512f avx512_fp16", "float16"),  # float16 arithmetic alone: kept
    ],
)
def test_cpu_auto_dtype_follows_the_cpu_arithmetic(monkeypatch, flags, float16_becomes):
    """--dtype auto's float16 (float32 and float16 checkpoints) becomes bfloat16 where
    the CPU computes in it (pagedllm's CPU kernels do), else float16 where it computes
    in that, else float32; a bfloat16 checkpoint stays bfloat16 where the CPU computes
    in it."""
    import torch

    from pagedllm.plugins.devices import cpu

    monkeypatch.setattr(cpu, "_cpu_flags", lambda: frozenset(flags.split()))
    device = cpu.CpuDevice()
    assert device.auto_dtype(torch.float16) == getattr(torch, float16_becomes)
    bf16 = "bf16" in flags
    assert device.auto_dtype(torch.bfloat16) == (torch.bfloat16 if bf16 else torch.float32)
    assert device.auto_dtype(torch.float32) == torch.float32


def _skip_unless_glibc() -> None:
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            pytest.skip("glibc only")
    except (ValueError, OSError):
        pytest.skip("glibc only")


def _run_probe(code: str, env: dict[str, str]) -> str:
    """What ``python -c code`` prints, in a process of its own (malloc's settings are the
    process's)."""
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout


_MALLOC_PROBE = """
import os, torch
from pagedllm.plugins.devices.cpu import CpuDevice, tune_malloc
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
CpuDevice().prepare_process()
before = rss()
t = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page touched
del t
if os.environ.get("PAGEDLLM_PROBE_RELEASE"):
    CpuDevice().release_startup_memory()
print(tune_malloc(), (rss() - before) >> 20)
"""


@pytest.mark.skipif(not hasattr(os, "confstr"), reason="glibc only")
def test_cpu_device_keeps_large_buffers_for_the_next_step():
    """The cpu device has glibc keep large freed buffers (the next step reuses their pages
    instead of faulting in fresh zeroed ones); PAGEDLLM_CPU_MALLOC_TUNING=0 or glibc's own
    settings leave glibc as it is (a 64 MiB buffer is then a mapping, given back on free)."""
    _skip_unless_glibc()
    ours = ("PAGEDLLM_CPU_MALLOC_TUNING", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    env = {k: v for k, v in os.environ.items() if k not in ours}

    def probe(**extra):
        tuned, kept = _run_probe(_MALLOC_PROBE, {**env, **extra}).split()
        return tuned == "True", int(kept)

    tuned, kept = probe()
    assert tuned and kept >= 60
    for extra in ({"PAGEDLLM_CPU_MALLOC_TUNING": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}):
        tuned, kept = probe(**extra)
        assert not tuned and kept < 16
    # Once start-up is over, the engine has what it freed given back.
    tuned, kept = probe(PAGEDLLM_PROBE_RELEASE="1")
    assert tuned and kept < 16


_ARENA_PROBE = """
import ctypes, os, tempfile, threading
from pagedllm.plugins.devices.cpu import CpuDevice
CpuDevice().prepare_process()
libc = ctypes.CDLL(None)
libc.malloc.restype = libc.fopen.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = libc.fclose.argtypes = None
barrier = threading.Barrier(4)
def allocate():
    barrier.wait()  # all four at once: each would take a heap of its own
    libc.malloc(1 << 16)
threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "info.xml")
    fp = ctypes.c_void_p(libc.fopen(path.encode(), b"w"))
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(open(path).read().count("<heap nr="))
"""


@pytest.mark.skipif(not hasattr(os, "confstr"), reason="glibc only")
def test_cpu_device_threads_share_one_heap():
    """With the cpu device's malloc settings every thread allocates from glibc's one heap
    (freed buffers of the engine's thread serve the server's, and the reverse); without
    them, four threads allocating at once take heaps of their own; a MALLOC_ARENA_MAX of
    the user's is left as it is."""
    _skip_unless_glibc()
    ours = ("PAGEDLLM_CPU_MALLOC_TUNING", "MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST")
    env = {k: v for k, v in os.environ.items() if k not in ours}

    def heaps(**extra) -> int:
        return int(_run_probe(_ARENA_PROBE, {**env, **extra}))

    assert heaps() == 1
    assert heaps(PAGEDLLM_CPU_MALLOC_TUNING="0") > 1
    assert heaps(MALLOC_ARENA_MAX="2") == 2
