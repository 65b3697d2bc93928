"""Device plugins: cheap to import, honest about availability, chosen by --device."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from pagedllm import hookimpl
from pagedllm.core.config import resolve_device
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import Device
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
